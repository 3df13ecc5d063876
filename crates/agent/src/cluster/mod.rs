//! labd in a cluster: the coordinator's view ([`Coordinator`], fed by
//! heartbeats), each agent's heartbeats ([`Reporter`]), and the signatures
//! that authenticate nodes to each other ([`ClusterKey`]).
//!
//! A cluster is set up by config alone: every node names the coordinator's
//! address and holds the cluster secret; one node says it coordinates.

mod auth;
mod coordinator;
mod jobs;
mod peers;
mod queue;
mod reporter;
mod warm;

use std::time::Duration;

pub use auth::{AuthError, ClusterKey, MIN_SECRET, NODE, SIGNATURE, SKEW, TIME};
pub use coordinator::Coordinator;
pub use peers::{ClusterPeers, COUNTS_FILE};
pub use queue::{ClusterJob, ClusterJobs, Placement, RECENT_SECS};
pub use reporter::Reporter;
pub use warm::{WarmAnswer, WarmAsk, WarmOrder, Warming, Warms};

use crate::client::Endpoint;

/// A node's cluster settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Where the coordinator listens (TCP).
    pub coordinator: Endpoint,
    /// Whether this labd is the coordinator.
    pub coordinate: bool,
    /// How the other nodes reach this one (`http://host:port`).
    pub advertise: String,
    /// Signs and checks requests between nodes.
    pub key: ClusterKey,
    /// Time between heartbeats.
    pub heartbeat: Duration,
    /// A node without a heartbeat for this long is down (the coordinator's
    /// setting).
    pub down_after: Duration,
    /// With TLS (`[tls]`): whom to trust when reaching the other nodes, the
    /// lab's CA. Every address is then `https://`.
    pub tls: Option<std::sync::Arc<crate::tls::ClientConfig>>,
}

/// The wall clock in Unix milliseconds: signatures and heartbeats carry it.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
