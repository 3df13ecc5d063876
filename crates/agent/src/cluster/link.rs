//! What the coordinator needs of the labd it runs in, and no more: its
//! name, the store to price snapshots with, the cluster's key to sign with,
//! and each node as a [`Link`], this one in process, the others over HTTP.
//! The coordinator's code never holds the whole daemon.

use std::sync::Arc;
use std::time::Duration;

use labsync_store::{NodeCache, Repo};

use crate::client::{Client, Endpoint};
use crate::daemon::{Caller, Daemon, LogRead};
use crate::error::{ClientError, JobError};
use crate::proto::{Dispatch, DispatchReply, JobView, StageDone, StageOrder, Staged};

use super::WarmOrder;

/// How long a request forwarded to a node may take beyond its own wait.
pub(super) const FORWARD: Duration = Duration::from_secs(10);

/// The coordinator's narrow handle on its labd (see the module's doc).
#[derive(Clone)]
pub struct Reach {
    here: Arc<Daemon>,
}

impl Reach {
    /// The coordinator's reach from `daemon`, the labd it runs in.
    pub(crate) fn new(daemon: Arc<Daemon>) -> Reach {
        Reach { here: daemon }
    }

    /// This node's name.
    pub(super) fn name(&self) -> &str {
        self.here.node_name()
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

    /// Queued jobs one user may have.
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
    Here(Arc<Daemon>),
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
            Link::Here(daemon) => Ok(daemon.submit_placed(d).await),
            Link::There { node, client } => timed(node, "", FORWARD, client.dispatch(&d)).await,
        }
    }

    /// A job's record there (within [`FORWARD`]).
    pub(super) async fn job(&self, id: &str) -> Result<JobView, JobError> {
        match self {
            Link::Here(daemon) => daemon.job(id).await,
            Link::There { node, client } => timed(node, "", FORWARD, client.cluster_job(id)).await,
        }
    }

    /// Kills a job there on behalf of `by` (whom the coordinator checked).
    pub(super) async fn kill(&self, id: &str, by: &str) -> Result<JobView, JobError> {
        match self {
            Link::Here(daemon) => daemon.kill(&for_user(by), id).await,
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
            Link::Here(daemon) => daemon.log(&for_user(by), id, offset, wait).await,
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
            Link::Here(daemon) => daemon.stop_for(victim, for_job).await,
            Link::There { node, client } => {
                let stop = client.cluster_preempt(victim, for_job);
                timed(node, "", FORWARD, stop).await
            }
        }
    }

    /// Fetches (and with `order.pin`, pins) a snapshot there.
    pub(super) async fn warm(&self, order: &WarmOrder) -> Result<(), JobError> {
        match self {
            Link::Here(daemon) => daemon.warm(order.clone()).await,
            Link::There { node, client } => {
                client.warm(order).await.map_err(|e| forwarded(node, e))
            }
        }
    }

    /// Stages a Slurm job's code and data there (untimed: a big dataset
    /// takes minutes).
    pub(super) async fn stage(&self, order: StageOrder) -> Result<Staged, JobError> {
        match self {
            Link::Here(daemon) => daemon.stage(order).await,
            Link::There { node, client } => {
                client.stage(&order).await.map_err(|e| passed_on(node, e))
            }
        }
    }

    /// Releases a Slurm job's stage there.
    pub(super) async fn stage_done(&self, done: StageDone) -> Result<(), JobError> {
        match self {
            Link::Here(daemon) => daemon.stage_done(done).await,
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
