//! labd in a cluster, the coordinator's side: its view ([`Coordinator`],
//! fed by heartbeats), its queue and scheduling passes, and what it reaches
//! of its own labd and the other nodes ([`Reach`], [`Here`]); with the
//! signatures that authenticate nodes to each other ([`ClusterKey`]). A
//! node's side (its heartbeats, its part of a warm) is the daemon's.
//!
//! A cluster is set up by config alone: every node names the coordinator's
//! address and holds the cluster secret; one node says it coordinates.

mod admin;
mod board;
mod coordinator;
mod jobs;
mod link;
mod pass;
mod peers;
mod queue;
pub mod rerank;
mod stage;
mod times;
mod warm;

use std::time::Duration;

pub use crate::auth::{
    now_ms, signing_ms, AuthError, ClusterKey, Route, Signed, BODY, MIN_SECRET, NODE, SIGNATURE,
    SKEW, TIME, TO, TO_COORDINATOR,
};
pub use board::{Standing, Standings};
pub use coordinator::Coordinator;
pub use link::{Answer, Here, Reach};
pub use peers::{ClusterPeers, COUNTS_FILE};
pub use queue::{ClusterJob, ClusterJobs, Placement, RECENT_SECS};
pub use warm::{WarmAnswer, WarmAsk, WarmOrder, Warming};

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
    /// The lab's rules for the queue (`[lab]`; the coordinator's setting).
    pub lab: LabConfig,
}

/// The lab's rules for the coordinator's queue: who stands in which tier,
/// paper-deadline grants, the per-user GPU cap, the fair-share half-life.
#[derive(Clone, Debug)]
pub struct LabConfig {
    /// The tier ladder and each user's tier and grant.
    pub members: labsync_placer::Members,
    /// GPUs one user may have running at once (`None`: no cap).
    pub user_gpu_cap: Option<u32>,
    /// GPU time used counts half after this long (fair share).
    pub half_life: Duration,
    /// Each tier's default time limit, seconds (`[lab] time_limits`): a
    /// job without `--time` gets its tier's.
    pub time_limits: std::collections::HashMap<labsync_placer::Tier, u64>,
    /// A waiting job is ordered one tier higher per this long waited, up
    /// to the tier below the deadline tier (`[lab] aging_hours`); `None`:
    /// tiers never age.
    pub aging: Option<Duration>,
    /// The first job that cannot start holds the GPUs it waits for once it
    /// has waited this long (`[lab] reserve_after_minutes`).
    pub reserve_after: Duration,
}

impl Default for LabConfig {
    /// The default ladder, everyone at its lowest tier, no cap, 7 days.
    fn default() -> Self {
        LabConfig {
            members: labsync_placer::Members::default(),
            user_gpu_cap: None,
            half_life: Duration::from_secs(7 * 86_400),
            time_limits: Default::default(),
            aging: Some(Duration::from_secs(86_400)),
            reserve_after: Duration::from_secs(
                labsync_placer::Policy::default().reserve_after_secs,
            ),
        }
    }
}
