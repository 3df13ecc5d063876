//! What the coordinator needs of the labd it runs in, and no more: its
//! name, the store to price snapshots with, the cluster's key to sign with,
//! and each node as a [`Link`], this one in process ([`Here`]), the others
//! over HTTP. The coordinator's code never names the daemon: labd hands it
//! itself as a [`Here`] (`daemon/here.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use labsync_store::{NodeCache, Repo};

use crate::client::{Client, Endpoint};
use crate::error::{ClientError, JobError};
use crate::proto::{Dispatch, DispatchReply, JobView, NodeName, StageDone, StageOrder, Staged};
use crate::request::{Caller, LogRead};

use super::{ClusterConfig, WarmOrder};

/// An operation of [`Here`] under way.
pub type Answer<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The labd the coordinator runs in, as the coordinator sees it: what it
/// reads of it, and the operations another node answers over HTTP, here
/// called in process. Each takes its own handle (`Arc`) so the answer
/// outlives the call.
pub trait Here: Send + Sync {
    /// This node's name.
    fn name(&self) -> &NodeName;
    /// The store (refused while labd has not reached it).
    fn repo(&self) -> Result<&Repo, JobError>;
    /// This node's cache.
    fn cache(&self) -> &Arc<NodeCache>;
    /// Queued jobs one user may have.
    fn max_queued_per_user(&self) -> usize;
    /// Who tells users of their jobs' ends.
    fn notifier(&self) -> &Arc<crate::notify::Notifier>;
    /// The cluster's settings (the key, TLS), in a cluster.
    fn cluster(&self) -> Option<&ClusterConfig>;
    /// Takes a job the coordinator placed here.
    fn dispatch(self: Arc<Self>, d: Dispatch) -> Answer<DispatchReply>;
    /// A job's record here.
    fn job(self: Arc<Self>, id: String) -> Answer<Result<JobView, JobError>>;
    /// Kills a job here for `by`.
    fn kill(self: Arc<Self>, by: Caller, id: String) -> Answer<Result<JobView, JobError>>;
    /// A job's log here from `offset`, waiting up to `wait` for new bytes.
    fn log(
        self: Arc<Self>,
        by: Caller,
        id: String,
        offset: u64,
        wait: Duration,
    ) -> Answer<Result<LogRead, JobError>>;
    /// Stops a preemptible job here for `for_job`.
    fn stop_for(self: Arc<Self>, victim: String, for_job: String) -> Answer<Result<(), JobError>>;
    /// Fetches (and pins, or unpins) a snapshot here.
    fn warm(self: Arc<Self>, order: WarmOrder) -> Answer<Result<(), JobError>>;
    /// Stages a Slurm job's code and data here.
    fn stage(self: Arc<Self>, order: StageOrder) -> Answer<Result<Staged, JobError>>;
    /// Releases a Slurm job's stage here.
    fn stage_done(self: Arc<Self>, done: StageDone) -> Answer<Result<(), JobError>>;
}

/// How long a request forwarded to a node may take beyond its own wait.
pub(super) const FORWARD: Duration = Duration::from_secs(10);

/// The coordinator's narrow handle on its labd (see the module's doc).
#[derive(Clone)]
pub struct Reach {
    here: Arc<dyn Here>,
}

impl Reach {
    /// The coordinator's reach from `here`, the labd it runs in.
    pub(crate) fn new(here: Arc<dyn Here>) -> Reach {
        Reach { here }
    }

    /// This node's name.
    pub(super) fn name(&self) -> &str {
        self.here.name()
    }

    /// The store, to price snapshots and resolve labels (refused while
    /// labd has not reached it).
    pub(super) fn repo(&self) -> Result<&Repo, JobError> {
        self.here.repo()
    }

    /// This node's cache, whose index copy prices snapshots without a read
    /// of the store's.
    pub(super) fn cache(&self) -> &Arc<NodeCache> {
        self.here.cache()
    }

    /// Who tells users of their jobs' ends.
    pub(crate) fn notifier(&self) -> &Arc<crate::notify::Notifier> {
        self.here.notifier()
    }

    /// The most jobs one user may have queued.
    pub(super) fn max_queued_per_user(&self) -> usize {
        self.here.max_queued_per_user()
    }

    /// `node`, reached at `addr` (its last heartbeat's) when it is another
    /// node than this one; `None` when it cannot be reached at all.
    pub(super) fn link(&self, node: &str, addr: Option<&str>) -> Option<Link> {
        if node == self.name() {
            return Some(Link::Here(self.here.clone()));
        }
        let ep: Endpoint = addr?.parse().ok()?;
        let cfg = self.here.cluster()?;
        let client =
            Client::for_cluster(ep, cfg.key.clone(), self.name(), node).with_tls(cfg.tls.clone());
        Some(Link::There {
            node: node.to_string(),
            client,
        })
    }
}

/// One node as the coordinator reaches it. Each operation answers a
/// [`JobError`] either way: a node's refusal over HTTP is read back into
/// the error it was ([`forwarded`]).
pub(super) enum Link {
    /// The coordinator's own node: called in process.
    Here(Arc<dyn Here>),
    /// Another node, by signed requests.
    There {
        /// Its name.
        node: String,
        /// A client signed with the cluster's key.
        client: Client,
    },
}

impl Link {
    /// Sends a placed job (within [`FORWARD`]).
    pub(super) async fn dispatch(&self, d: Dispatch) -> Result<DispatchReply, JobError> {
        match self {
            Link::Here(here) => Ok(here.clone().dispatch(d).await),
            Link::There { node, client } => timed(node, "", FORWARD, client.dispatch(&d)).await,
        }
    }

    /// A job's record there (within [`FORWARD`]).
    pub(super) async fn job(&self, id: &str) -> Result<JobView, JobError> {
        match self {
            Link::Here(here) => here.clone().job(id.to_string()).await,
            Link::There { node, client } => timed(node, "", FORWARD, client.cluster_job(id)).await,
        }
    }

    /// Kills a job there on behalf of `by` (whom the coordinator checked).
    pub(super) async fn kill(&self, id: &str, by: &str) -> Result<JobView, JobError> {
        match self {
            Link::Here(here) => here.clone().kill(for_user(by), id.to_string()).await,
            Link::There { node, client } => {
                timed(node, "; try again", FORWARD, client.cluster_kill(id)).await
            }
        }
    }

    /// A job's log there, from `offset`, waiting up to `wait` for new bytes.
    pub(super) async fn log(
        &self,
        id: &str,
        by: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogRead, JobError> {
        match self {
            Link::Here(here) => {
                (here.clone())
                    .log(for_user(by), id.to_string(), offset, wait)
                    .await
            }
            Link::There { node, client } => {
                let piece = timed(
                    node,
                    "",
                    wait + FORWARD,
                    client.cluster_log(id, offset, wait),
                )
                .await?;
                Ok(LogRead {
                    bytes: piece.bytes.to_vec(),
                    next: piece.next,
                    done: piece.done,
                })
            }
        }
    }

    /// Stops a preemptible job there for `for_job` (answered at once).
    pub(super) async fn stop_for(&self, victim: &str, for_job: &str) -> Result<(), JobError> {
        match self {
            Link::Here(here) => {
                (here.clone())
                    .stop_for(victim.to_string(), for_job.to_string())
                    .await
            }
            Link::There { node, client } => {
                let stop = client.cluster_preempt(victim, for_job);
                timed(node, "", FORWARD, stop).await
            }
        }
    }

    /// Fetches (and with `order.pin`, pins) a snapshot there.
    pub(super) async fn warm(&self, order: &WarmOrder) -> Result<(), JobError> {
        match self {
            Link::Here(here) => here.clone().warm(order.clone()).await,
            Link::There { node, client } => {
                client.warm(order).await.map_err(|e| forwarded(node, e))
            }
        }
    }

    /// Stages a Slurm job's code and data there (untimed: a big dataset
    /// takes minutes).
    pub(super) async fn stage(&self, order: StageOrder) -> Result<Staged, JobError> {
        match self {
            Link::Here(here) => here.clone().stage(order).await,
            Link::There { node, client } => {
                client.stage(&order).await.map_err(|e| passed_on(node, e))
            }
        }
    }

    /// Releases a Slurm job's stage there.
    pub(super) async fn stage_done(&self, done: StageDone) -> Result<(), JobError> {
        match self {
            Link::Here(here) => here.clone().stage_done(done).await,
            Link::There { node, client } => client
                .stage_done(&done)
                .await
                .map_err(|e| passed_on(node, e)),
        }
    }
}

/// `call` to `node` within `limit`; past it, a conflict saying the node
/// did not answer (and `then`, what the user may do about it).
async fn timed<T>(
    node: &str,
    then: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, ClientError>>,
) -> Result<T, JobError> {
    tokio::time::timeout(limit, call)
        .await
        .map_err(|_| JobError::Conflict(format!("{node} did not answer{then}")))?
        .map_err(|e| forwarded(node, e))
}

/// The coordinator acts on a node for a user it has checked: as an admin
/// there, under that user's name.
fn for_user(by: &str) -> Caller {
    Caller {
        user: by.to_string(),
        admin: true,
    }
}

/// A node's error answer, as the coordinator's: what the node refused
/// stays that refusal; anything else is a conflict naming the node.
pub(super) fn forwarded(node: &str, e: ClientError) -> JobError {
    match e {
        ClientError::Status {
            status: 404,
            message,
        } => JobError::NotFound(message),
        ClientError::Status {
            status: 403,
            message,
        } => JobError::Forbidden(message),
        ClientError::Status {
            status: 409,
            message,
        } => JobError::Conflict(message),
        other => JobError::Conflict(format!("{node}: {other}")),
    }
}

/// A node's refusal of a Slurm stage, passed on to the batch script as the
/// node said it, naming the node.
fn passed_on(node: &str, e: ClientError) -> JobError {
    match e {
        ClientError::Status { status, message } => match status {
            400 => JobError::Invalid(format!("{node}: {message}")),
            403 => JobError::Forbidden(format!("{node}: {message}")),
            404 => JobError::NotFound(format!("{node}: {message}")),
            429 => JobError::Busy(format!("{node}: {message}")),
            _ => JobError::Conflict(format!("{node}: {message}")),
        },
        e => JobError::Conflict(format!("{node}: {e}")),
    }
}
