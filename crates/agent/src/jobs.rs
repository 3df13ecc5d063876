//! The jobs interface: what a user may ask of labd about jobs (submit,
//! one job, its explanation, the list, history, kill, log), answered by
//! this node alone or, on a cluster's coordinator, by the cluster. Which
//! one is chosen once, when labd starts serving ([`Jobs::of`]); the HTTP
//! handlers call it and never ask which it is.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::{Coordinator, Reach};
use crate::daemon::Daemon;
use crate::error::JobError;
use crate::proto::{JobExplain, JobView, SubmitRequest};
use crate::request::{Caller, LogRead};

/// Where a labd's jobs are kept and run.
#[derive(Clone)]
pub enum Jobs {
    /// A labd on its own (or a node of a cluster, asked directly): its
    /// own engine, first come, first served.
    Node(Arc<Daemon>),
    /// A cluster's coordinator: its queue over every node.
    Cluster {
        /// The coordinator's queue and view.
        co: Arc<Coordinator>,
        /// What it needs of the labd it runs in.
        reach: Reach,
    },
}

impl Jobs {
    /// The jobs of `daemon`: the cluster's when it coordinates one.
    pub fn of(daemon: &Arc<Daemon>) -> Jobs {
        match daemon.coordinator() {
            Some(co) => Jobs::Cluster {
                co: co.clone(),
                reach: Reach::new(daemon.clone()),
            },
            None => Jobs::Node(daemon.clone()),
        }
    }

    /// Takes `caller`'s job. Where its user is to be told of its end is
    /// checked here (a webhook only to a host the lab names), and kept:
    /// in the cluster's queue record, or in a labd alone's memory.
    pub async fn submit(&self, caller: &Caller, req: SubmitRequest) -> Result<JobView, JobError> {
        match self {
            Jobs::Node(d) => {
                crate::notify::check(&req.notify, d.notifier().config())?;
                let targets = req.notify.clone();
                let job = d.submit(caller, req).await?;
                if !targets.is_empty() {
                    d.notifier().remember(job.id.as_str(), targets);
                }
                Ok(job)
            }
            Jobs::Cluster { co, reach } => {
                crate::notify::check(&req.notify, reach.notifier().config())?;
                co.submit(reach, caller, req).await
            }
        }
    }

    /// One job.
    pub async fn job(&self, id: &str) -> Result<JobView, JobError> {
        match self {
            Jobs::Node(d) => d.job(id).await,
            Jobs::Cluster { co, reach } => co.job(reach, id).await,
        }
    }

    /// One job and, while a cluster's queue holds it, every node's row for
    /// it (`labrun explain JOB`).
    pub async fn explain(&self, id: &str) -> Result<JobExplain, JobError> {
        match self {
            Jobs::Node(d) => Ok(JobExplain {
                job: d.job(id).await?,
                ranking: None,
            }),
            Jobs::Cluster { co, reach } => co.explain_job(reach, id).await,
        }
    }

    /// Active jobs and those that ended in the last day (`labrun ps`).
    pub async fn list(&self) -> Result<Vec<JobView>, JobError> {
        match self {
            Jobs::Node(d) => d.jobs().await,
            Jobs::Cluster { co, .. } => co.jobs_view(),
        }
    }

    /// Ended jobs numbered below `before`, newest first, at most `limit`.
    pub async fn history(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<JobView>, JobError> {
        match self {
            Jobs::Node(d) => d.history(before, limit).await,
            Jobs::Cluster { co, .. } => co.history(before, limit),
        }
    }

    /// Kills `caller`'s job (any job, for an admin).
    pub async fn kill(&self, caller: &Caller, id: &str) -> Result<JobView, JobError> {
        match self {
            Jobs::Node(d) => d.kill(caller, id).await,
            Jobs::Cluster { co, reach } => co.kill(reach, caller, id).await,
        }
    }

    /// The log of `caller`'s job from `offset`, waiting up to `wait` for
    /// new bytes.
    pub async fn log(
        &self,
        caller: &Caller,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogRead, JobError> {
        match self {
            Jobs::Node(d) => d.log(caller, id, offset, wait).await,
            Jobs::Cluster { co, reach } => co.log(reach, caller, id, offset, wait).await,
        }
    }
}
