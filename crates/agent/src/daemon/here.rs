//! labd as the coordinator running in it sees it ([`Here`]): the same
//! operations another node answers over HTTP, called in process.

use std::sync::Arc;
use std::time::Duration;

use labsync_store::{NodeCache, Repo};

use super::Daemon;
use crate::cluster::{Answer, ClusterConfig, Here};
use crate::error::JobError;
use crate::proto::{
    Dispatch, DispatchReply, JobView, NodeName, StageDone, StageOrder, Staged, WarmOrder,
};
use crate::request::{Caller, LogRead};

impl Here for Daemon {
    fn name(&self) -> &NodeName {
        self.node_name()
    }

    fn repo(&self) -> Result<&Repo, JobError> {
        Daemon::repo(self)
    }

    fn cache(&self) -> &Arc<NodeCache> {
        Daemon::cache(self)
    }

    fn max_queued_per_user(&self) -> usize {
        Daemon::max_queued_per_user(self)
    }

    fn notifier(&self) -> &Arc<crate::notify::Notifier> {
        Daemon::notifier(self)
    }

    fn cluster(&self) -> Option<&ClusterConfig> {
        Daemon::cluster(self)
    }

    fn dispatch(self: Arc<Self>, d: Dispatch) -> Answer<DispatchReply> {
        Box::pin(async move { Daemon::submit_placed(&self, d).await })
    }

    fn job(self: Arc<Self>, id: String) -> Answer<Result<JobView, JobError>> {
        Box::pin(async move { Daemon::job(&self, &id).await })
    }

    fn kill(self: Arc<Self>, by: Caller, id: String) -> Answer<Result<JobView, JobError>> {
        Box::pin(async move { Daemon::kill(&self, &by, &id).await })
    }

    fn log(
        self: Arc<Self>,
        by: Caller,
        id: String,
        offset: u64,
        wait: Duration,
    ) -> Answer<Result<LogRead, JobError>> {
        Box::pin(async move { Daemon::log(&self, &by, &id, offset, wait).await })
    }

    fn stop_for(self: Arc<Self>, victim: String, for_job: String) -> Answer<Result<(), JobError>> {
        Box::pin(async move { Daemon::stop_for(&self, &victim, &for_job).await })
    }

    fn warm(self: Arc<Self>, order: WarmOrder) -> Answer<Result<(), JobError>> {
        Box::pin(async move { Daemon::warm(&self, order).await })
    }

    fn stage(self: Arc<Self>, order: StageOrder) -> Answer<Result<Staged, JobError>> {
        Box::pin(async move { Daemon::stage(&self, order).await })
    }

    fn stage_done(self: Arc<Self>, done: StageDone) -> Answer<Result<(), JobError>> {
        Box::pin(async move { Daemon::stage_done(&self, done).await })
    }
}
