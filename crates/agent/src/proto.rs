//! What `labrun` and `labd` say to each other over HTTP (JSON bodies).
//!
//! Every path is under `/v1/`; all but `/v1/health` need
//! `Authorization: Bearer <token>`.
//!
//! Every route is written once, in [`routes`]: its method, path, what is
//! sent and what comes back. labd's router and the [`crate::Client`] both
//! read it. Routes under `/v1/cluster/` (but `status`, `explain` and `rank`)
//! are between the nodes of a cluster, signed with the cluster secret
//! ([`crate::cluster`]), never with a user's token.
//!
//! Users ask the coordinator (`/v1/jobs…` as on one node); it checks who
//! may do what and forwards to the node that runs the job.

use labsync_store::PackId;
use serde::{Deserialize, Serialize};

pub use crate::ids::{JobId, NodeName, SnapshotId};

use crate::leases::{JobMeta, JobState};
use crate::status::GpuStatus;

/// Response header: the log offset to ask for next.
pub const NEXT_OFFSET: &str = "x-labd-next-offset";
/// Response header: `true` once the job has ended, its outputs are saved
/// and the answer holds the last of its log.
pub const DONE: &str = "x-labd-done";

/// The version of what nodes say to each other. It counts up when a
/// request or answer between nodes changes meaning (a field added with a
/// default does not count: both sides ignore what they do not know). A node
/// takes requests from nodes one version apart, so a cluster upgrades node
/// by node; two apart are refused with both versions named.
pub const PROTOCOL: u32 = 2;
/// Request header: the sender's [`PROTOCOL`] (absent: 1, every labd
/// before versions were sent).
pub const PROTOCOL_HEADER: &str = "x-labsync-protocol";
/// Request header: the sender's labsync version.
pub const VERSION_HEADER: &str = "x-labsync-version";
/// This build's labsync version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A request between nodes from a sender speaking `theirs` (and labsync
/// `their_version`), refused when it is two or more protocol versions from
/// this node's, saying both.
pub fn check_protocol(
    from: &str,
    theirs: u32,
    their_version: &str,
    me: &str,
) -> Result<(), String> {
    if theirs.abs_diff(PROTOCOL) <= 1 {
        return Ok(());
    }
    let older = if theirs < PROTOCOL { from } else { me };
    Err(format!(
        "{from} speaks labsync protocol {theirs} (labsync {their_version}) and {me} speaks \
         {PROTOCOL} (labsync {VERSION}), which takes {}–{} only: upgrade {older}",
        PROTOCOL.saturating_sub(1),
        PROTOCOL + 1
    ))
}

/// A snapshot the job runs on, pinned to one version by `labrun`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeRef {
    /// `NAME@vN`.
    pub label: String,
    /// Its snapshot id, so labd can tell the version moved under it.
    pub snapshot: SnapshotId,
}

/// A dataset and the variable that carries its path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataRef {
    /// `LABRUN_DATA_DIV2K`.
    pub env: String,
    /// The snapshot.
    pub tree: TreeRef,
}

/// A job as `labrun` submits it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitRequest {
    /// The command, run in the code's folder.
    pub argv: Vec<String>,
    /// The submitter's environment (srun-style: the job sees the caller's
    /// `PATH`, virtualenv, …).
    pub env: Vec<(String, String)>,
    /// The code, materialised as the working folder; `None` runs in an empty one.
    pub code: Option<TreeRef>,
    /// Datasets, materialised read-only and shared.
    pub data: Vec<DataRef>,
    /// GPUs wanted.
    pub gpus: u32,
    /// Free memory wanted on each GPU, bytes.
    pub gpu_mem: u64,
    /// Folder (relative to the working folder) pushed as `runs/<job-id>`.
    pub outputs: Option<String>,
    /// Seconds between pushes of the outputs; `None`: labd's default.
    pub outputs_every_s: Option<u64>,
    /// The tier asked for (`labrun --priority deadline`); `None`: the
    /// user's own. Only a cluster's coordinator orders its queue by tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
    /// A hold (`labrun --hold`): GPUs leased for this many seconds with no
    /// command of the user's (`argv` is `sleep` for that long), given back
    /// early once they show no utilisation for labd's `idle_hold_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_s: Option<u64>,
    /// A higher tier's job may stop it (SIGTERM, its outputs pushed) and
    /// requeue it (`labrun --preemptible`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    /// Its time limit, seconds of running (`labrun --time 2d`; else the
    /// coordinator gives its tier's default from `[lab] time_limits`): at
    /// the limit its node stops it (SIGTERM, outputs saved, SIGKILL after
    /// the grace) and says it ran out of time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_s: Option<u64>,
    /// Times it was preempted and requeued (`LABRUN_RESTARTS`); set by the
    /// coordinator only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// The outputs its last run saved, pinned to their snapshot
    /// (`runs/j12@v3#ID`, `LABRUN_RESUME_FROM`);
    /// set by the coordinator only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<String>,
    /// Where to tell its user that it ended (webhook URLs, `mailto:`):
    /// secrets (a webhook's URL lets anyone post), so never recorded with
    /// the job nor sent to its node (labd's notify module).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notify: Vec<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// How long a job is expected to run, and on whose word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    /// Seconds of running.
    pub secs: u64,
    /// Its time limit (its own or its tier's): it is stopped then. Else an
    /// estimate from its user's earlier runs, which it may overrun.
    pub limit: bool,
}

/// A change an admin makes to the lab's rules on the coordinator, with no
/// restart (`labrun admin`). Kept in the coordinator's database; the
/// config file's `[lab]` values are the defaults it changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum AdminChange {
    /// A paper-deadline grant until then (Unix ms: the end of its last
    /// day), or withdrawn (`None`).
    Grant {
        /// Whose.
        user: String,
        /// Until.
        until_ms: Option<u64>,
    },
    /// A user's own tier.
    Tier {
        /// Whose.
        user: String,
        /// A tier of the ladder, not the deadline tier.
        tier: String,
    },
    /// GPUs one user may have running at once (`None`: no cap).
    Cap {
        /// The cap.
        gpus: Option<u32>,
    },
}

/// A change to the lab's rules as kept: who made it, when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminRecord {
    /// Unix seconds.
    pub at: u64,
    /// The admin.
    pub by: String,
    /// What changed.
    pub change: AdminChange,
}

/// One user's standing in the lab's rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRule {
    /// The user.
    pub user: String,
    /// Their own tier.
    pub tier: String,
    /// Their deadline grant runs until then (Unix ms), if they have one.
    pub deadline_until: Option<u64>,
}

/// The lab's rules in force on the coordinator (`labrun admin show`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdminView {
    /// The ladder, highest first.
    pub tiers: Vec<String>,
    /// The tier grants give.
    pub deadline_tier: Option<String>,
    /// Users named by the config or an admin; anyone else stands at the
    /// lowest tier.
    pub users: Vec<UserRule>,
    /// GPUs one user may have running at once.
    pub cap: Option<u32>,
    /// Each tier's default time limit, seconds.
    pub time_limits: Vec<(String, u64)>,
    /// A waiting job rises a tier per this many seconds waited.
    pub aging_s: Option<u64>,
    /// The changes admins made, oldest first (the last 100).
    pub changes: Vec<AdminRecord>,
    /// Each user's fair-share usage now: decayed GPU-hours, running jobs
    /// charged as they run.
    #[serde(default)]
    pub usage: Vec<(String, f64)>,
}

/// The coordinator's order to stop a preemptible job (`POST
/// /v1/cluster/jobs/{id}/preempt`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptOrder {
    /// The job it makes way for.
    pub for_job: JobId,
}

/// `labrun explain JOB`: the job, and for one queued in a cluster the
/// placer's table of every node for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobExplain {
    /// The job as `labrun ps` shows it (`why` says why it waits).
    pub job: JobView,
    /// Per node: when it could start there and why not there.
    pub ranking: Option<labsync_placer::Ranking>,
}

/// A log offset at or above this asks for the log's last `offset -
/// LOG_TAIL` bytes (a job's web page shows its tail): no log reaches 2^62
/// bytes. A node that predates it reads past the end and sends nothing.
pub const LOG_TAIL: u64 = 1 << 62;

/// A job as `labrun ps` shows it. Its own type, not the stored
/// `JobRecord`: the record keeps a queued job's environment, which must
/// never reach another user through the API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    /// Job id.
    pub id: JobId,
    /// The node it runs (or ran) on; `None` while the cluster's
    /// coordinator has not placed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeName>,
    /// Who submitted it.
    pub user: String,
    /// The command.
    pub argv: Vec<String>,
    /// GPUs asked for.
    pub gpus_wanted: u32,
    /// GPUs held.
    pub gpus: Vec<u32>,
    /// Where it is.
    pub state: JobState,
    /// Why it is not running yet, in words.
    pub why: Option<String>,
    /// Submitted, started, ended (Unix seconds).
    pub submitted_at: u64,
    /// Started.
    pub started_at: Option<u64>,
    /// Ended.
    pub ended_at: Option<u64>,
    /// Code, data, work folder, outputs.
    pub meta: JobMeta,
}

impl JobView {
    /// True once the job has ended (exited, failed or killed).
    pub fn ended(&self) -> bool {
        matches!(
            self.state,
            JobState::Exited { .. } | JobState::Failed { .. }
        )
    }

    /// The exit code `labrun` returns: the job's own, 128 + signal, or 1.
    pub fn exit_code(&self) -> Option<i32> {
        match &self.state {
            JobState::Exited { code: Some(c), .. } => Some(*c),
            JobState::Exited {
                signal: Some(s), ..
            } => Some(128 + s),
            JobState::Exited { .. } | JobState::Failed { .. } => Some(1),
            _ => None,
        }
    }
}

/// Who and where: what `labrun` learns first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    /// labd's version.
    pub version: String,
    /// This node's name.
    pub node: NodeName,
    /// The store labd materialises from and pushes outputs to; `labrun`
    /// pushes code there.
    pub store: String,
    /// The user the token belongs to.
    pub user: String,
    /// Whether that user may kill and read every job.
    pub admin: bool,
    /// The GPU inventory, in words.
    pub inventory: String,
    /// Whether this labd coordinates a cluster (then `labrun status`
    /// asks it for [`ClusterStatus`]).
    #[serde(default)]
    pub coordinator: bool,
    /// Whether its jobs are kept from the GPUs they did not lease, in words.
    #[serde(default)]
    pub gpu_confinement: String,
    /// Bytes of materialised code and data the asking user's jobs and
    /// stages hold on this node, and their share (`trees_per_user`).
    #[serde(default)]
    pub trees_held: Option<(u64, Option<u64>)>,
}

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong and what to do.
    pub error: String,
}

/// A snapshot a node has cached, as heartbeats carry it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedTree {
    /// Its id.
    pub snapshot: SnapshotId,
    /// `NAME@vN` when it was last used.
    pub label: String,
    /// Bytes of its packs.
    pub bytes: u64,
    /// Pinned by an admin (`labsync warm`, `cache pin`).
    pub pinned: bool,
}

/// A node's cache in a heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSummary {
    /// Bytes of cached packs.
    pub used_bytes: u64,
    /// The cap.
    pub max_bytes: u64,
    /// What is cached.
    pub trees: Vec<CachedTree>,
    /// Where the packs fetched into this cache came from (kept across
    /// restarts of labd).
    #[serde(default)]
    pub fetched: FetchCounts,
    /// Warms under way (or failed), with their progress.
    #[serde(default)]
    pub warming: Vec<Warming>,
    /// Snapshots whose trees are materialised on the node: a job on one
    /// starts with no fetch, whatever packs were evicted.
    #[serde(default)]
    pub materialised: Vec<SnapshotId>,
}

/// Bytes of packs a node fetched into its cache, by source (labd keeps
/// them in the cache folder across its restarts).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchCounts {
    /// From peers, verified.
    pub from_peers: u64,
    /// From the object store.
    pub from_store: u64,
    /// Copies refused from peers: their bytes did not match their ids.
    pub corrupt_from_peers: u64,
    /// Tries at a peer that failed (gone, timed out).
    pub failed_from_peers: u64,
    /// Measured rate of fetches from peers, bytes per second (an average
    /// weighted to the latest), once a fetch of 4 MiB or more came from
    /// them.
    #[serde(default)]
    pub peer_rate: Option<u64>,
    /// The same for fetches from the store.
    #[serde(default)]
    pub store_rate: Option<u64>,
    /// Bytes of packs this node sent to peers (kept when the counts are
    /// next written, at a fetch).
    #[serde(default)]
    pub served_to_peers: u64,
    /// Of those, bytes sent with `sendfile` (peers on plain TCP).
    #[serde(default)]
    pub served_by_sendfile: u64,
    /// Copies this node served that a peer found corrupt and said so
    /// (`POST /v1/cluster/packs/{id}/corrupt`).
    #[serde(default)]
    pub reported_corrupt: u64,
    /// Of those, copies found corrupt here too when checked again, and
    /// dropped (the others went bad on the way).
    #[serde(default)]
    pub dropped_corrupt: u64,
}

/// A peer's word that a pack this node served was corrupt
/// (`POST /v1/cluster/packs/{id}/corrupt`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorruptCopy {
    /// What the fetching node found.
    pub why: String,
}

/// The serving node's answer to a [`CorruptCopy`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorruptChecked {
    /// Its copy failed the check again and was dropped (`false`: sound
    /// here, so it went bad on the way, or was dropped already).
    pub dropped: bool,
}

impl FetchCounts {
    /// Takes in a fetch of `bytes` that took `secs`, mostly from peers or
    /// mostly from the store (a mixed one says nothing of either).
    pub fn measure(&mut self, from_peers: u64, from_store: u64, secs: f64) {
        let total = from_peers + from_store;
        // Smaller fetches measure latency, not rate.
        if total < 4 << 20 || secs <= 0.0 {
            return;
        }
        let rate = total as f64 / secs;
        let slot = if from_peers * 10 >= total * 9 {
            &mut self.peer_rate
        } else if from_store * 10 >= total * 9 {
            &mut self.store_rate
        } else {
            return;
        };
        *slot = Some(match *slot {
            Some(old) => ((old as f64 + rate) / 2.0) as u64,
            None => rate as u64,
        });
    }
}

/// Which nodes hold which packs: `(pack, [(node, address)])`.
pub type Located = Vec<(PackId, Vec<(String, String)>)>;

/// What changed in a node's cache since the heartbeat the coordinator
/// acknowledged last (`base`), or everything (`full`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InventoryDelta {
    /// Everything, not a change: the coordinator forgets what it had.
    pub full: bool,
    /// The `seq` of the heartbeat this delta follows.
    pub base: u64,
    /// Packs now cached, with their sizes.
    pub added: Vec<(PackId, u64)>,
    /// Packs no longer cached.
    pub removed: Vec<PackId>,
    /// The packs of snapshots newly cached (so the coordinator can price
    /// them on every node), with sizes.
    pub snapshots: Vec<(SnapshotId, Vec<(PackId, u64)>)>,
}

/// An agent's heartbeat to the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The node's name.
    pub node: NodeName,
    /// Where the others reach it (`http://host:port`).
    pub addr: String,
    /// Random per labd start: a restarted agent starts its deltas afresh.
    pub instance: String,
    /// Counts up with each heartbeat of this instance.
    pub seq: u64,
    /// Its GPUs.
    pub gpus: Vec<GpuStatus>,
    /// Its active jobs, and those ended that still save their outputs.
    pub jobs: Vec<JobView>,
    /// Its cache.
    pub cache: CacheSummary,
    /// What changed in it.
    pub inventory: InventoryDelta,
    /// Whether its jobs are kept from the GPUs they did not lease, in words.
    #[serde(default)]
    pub gpu_confinement: String,
    /// Its labsync version (empty from a labd before versions were sent).
    #[serde(default)]
    pub version: String,
    /// Its [`PROTOCOL`] (0: one before versions were sent, which is 1).
    #[serde(default)]
    pub protocol: u32,
}

/// The coordinator's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// The delta did not follow what the coordinator holds (it restarted,
    /// or a reply was lost): send the whole inventory next.
    pub want_full: bool,
    /// Jobs it lists as active that have ended at the coordinator: killed
    /// by their owner (or an admin) while this node was down. The node
    /// kills them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kill: Vec<JobId>,
}

/// Whether the coordinator hears from a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "health", rename_all = "snake_case")]
pub enum NodeHealth {
    /// Heartbeats arrive.
    Up,
    /// None since `since` (Unix ms); never chosen. Its jobs are shown as
    /// they were, not failed.
    Down {
        /// The last heartbeat.
        since: u64,
    },
}

/// A snapshot's presence on a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presence {
    /// `NAME@vN`.
    pub label: String,
    /// The snapshot.
    pub snapshot: SnapshotId,
    /// Bytes of its packs the node has.
    pub present_bytes: u64,
    /// Bytes of all its packs.
    pub total_bytes: u64,
    /// Pinned there.
    pub pinned: bool,
    /// Its tree is materialised there: a job on it starts with no fetch,
    /// whatever share of its packs is cached.
    #[serde(default)]
    pub materialised: bool,
}

/// One node in `labrun status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Its name.
    pub name: NodeName,
    /// Where it is reached.
    pub addr: String,
    /// Up or down.
    #[serde(flatten)]
    pub health: NodeHealth,
    /// Its last heartbeat, Unix ms.
    pub last_heartbeat: u64,
    /// Its GPUs, as of that heartbeat.
    pub gpus: Vec<GpuStatus>,
    /// Its active jobs (and those ended that still save their outputs),
    /// as of that heartbeat.
    pub jobs: Vec<JobView>,
    /// Cache use and cap, bytes.
    pub cache_used: u64,
    /// The cap.
    pub cache_max: u64,
    /// Where the packs fetched into its cache came from.
    #[serde(default)]
    pub fetched: FetchCounts,
    /// Warms under way there (or failed).
    #[serde(default)]
    pub warming: Vec<Warming>,
    /// Every snapshot cached anywhere in the cluster, with how much of it
    /// this node has (a dataset that shares packs with a cached one is
    /// partly present), where anything is.
    pub data: Vec<Presence>,
    /// Whether its jobs are kept from the GPUs they did not lease, in words.
    #[serde(default)]
    pub gpu_confinement: String,
    /// Its labsync version, as its last heartbeat said (empty: a labd
    /// before versions were sent).
    #[serde(default)]
    pub version: String,
    /// Peers that could not get packs from it lately, and why (its packs
    /// are not offered meanwhile).
    #[serde(default)]
    pub suspect: Vec<String>,
}

/// `labd doctor`'s question to a node (signed): answer, and reach these
/// nodes back, each with a signed ping of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingAsk {
    /// `(node, address)` to ping from the node asked (at most
    /// [`PING_REACH_MAX`]).
    #[serde(default)]
    pub reach: Vec<(NodeName, String)>,
    /// Whether to list the cluster's nodes (the coordinator's answer).
    #[serde(default)]
    pub members: bool,
}

/// Nodes one ping may ask to be reached.
pub const PING_REACH_MAX: usize = 64;

/// A node's answer to a [`PingAsk`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// Who answered.
    pub node: NodeName,
    /// Its labsync version.
    pub version: String,
    /// Its [`PROTOCOL`].
    pub protocol: u32,
    /// Its clock, Unix ms, as it answered.
    pub now_ms: i64,
    /// Each node it was asked to reach, in order.
    pub reached: Vec<Reached>,
    /// The cluster's nodes, where asked of the coordinator.
    pub members: Vec<MemberSeen>,
    /// Nodes the coordinator refuses for their protocol version.
    #[serde(default)]
    pub refused: Vec<Refused>,
}

/// One node a ping was asked to reach.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reached {
    /// The node.
    pub node: NodeName,
    /// Where it was dialled.
    pub addr: String,
    /// Its version and clock offset from the asked node's (ms), or why it
    /// was not reached.
    pub answer: Result<(String, i64), String>,
}

/// A node as the coordinator knows it, for `labd doctor`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSeen {
    /// Its name.
    pub node: NodeName,
    /// Where it is reached.
    pub addr: String,
    /// Its labsync version, as its last heartbeat said.
    pub version: String,
    /// Whether it is up.
    pub up: bool,
}

/// A node's report to the coordinator that a peer failed it (signed): the
/// coordinator stops offering that peer's packs for a while, and `labrun
/// status` says so.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspectPeer {
    /// The peer.
    pub peer: NodeName,
    /// What failed.
    pub why: String,
}

/// A node whose requests this coordinator refuses for its protocol.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// The node, as its signature names it.
    pub node: NodeName,
    /// Why, naming both versions.
    pub why: String,
    /// When it last tried, Unix ms.
    pub at_ms: u64,
}

/// The cluster as `labrun status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The coordinating node.
    pub coordinator: NodeName,
    /// Every node that has sent a heartbeat, by name.
    pub nodes: Vec<NodeStatus>,
    /// The coordinator's labsync version.
    #[serde(default)]
    pub version: String,
    /// Nodes whose requests are refused for their protocol version.
    #[serde(default)]
    pub refused: Vec<Refused>,
}

/// A job the coordinator placed on a node, sent to that node's agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatch {
    /// The id the coordinator gave it (cluster-wide).
    pub id: JobId,
    /// Who submitted it (checked by the coordinator).
    pub user: String,
    /// The job.
    pub req: SubmitRequest,
    /// The GPUs to lease it, as the coordinator saw them free.
    pub gpus: Vec<u32>,
}

/// An agent's answer to a [`Dispatch`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum DispatchReply {
    /// Leased and being prepared (or already there: a dispatch sent again).
    Accepted {
        /// Its record here.
        job: Box<JobView>,
    },
    /// The GPUs are not free any more: place it again.
    Stale {
        /// Which.
        why: String,
    },
    /// It cannot run here (no such Unix user, too few GPUs, a bad request).
    Refused {
        /// Why.
        why: String,
    },
}

/// `labrun --backend slurm`: rank the nodes for a job with the GPUs as
/// Slurm reports them (`POST /v1/cluster/rank`, the coordinator).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankAsk {
    /// The job (its code and data are what is priced).
    pub req: SubmitRequest,
    /// Every node Slurm offers, with its GPUs.
    pub nodes: Vec<labsync_placer::SchedulerNode>,
}

/// A job another scheduler runs (Slurm) asks for its code and data on the
/// node it was given (`POST /v1/stage`, the coordinator; its batch script
/// asks, as its user).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageAsk {
    /// The node the job runs on (`SLURMD_NODENAME`).
    pub node: NodeName,
    /// The scheduler's job id (`SLURM_JOB_ID`): digits.
    pub job: String,
    /// The code, materialised as the working folder.
    pub code: Option<TreeRef>,
    /// Datasets, materialised read-only and shared.
    pub data: Vec<DataRef>,
    /// The job's `--outputs` folder, made real and the user's.
    pub outputs: Option<String>,
}

/// The coordinator's order to stage on a node (`POST /v1/cluster/stage`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageOrder {
    /// Who asks (checked by the coordinator).
    pub user: String,
    /// What.
    pub ask: StageAsk,
}

/// Where a staged job's things are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staged {
    /// The node.
    pub node: NodeName,
    /// The stage's name on that node (`1234.1`), to release it.
    pub stage: String,
    /// The working folder (the code's files, the user's).
    pub work: std::path::PathBuf,
    /// `(LABRUN_DATA_DIV2K, path)` for each dataset, in the order asked.
    pub data: Vec<(String, std::path::PathBuf)>,
}

/// A staged job has ended: its trees may go, its folder after labd's
/// `work_keep` (`POST /v1/stage/done` to the coordinator, `POST
/// /v1/cluster/stage/done` from it, with the user).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageDone {
    /// The node.
    pub node: NodeName,
    /// [`Staged::stage`].
    pub stage: String,
    /// Who asks; set by the coordinator (a user's own is ignored).
    #[serde(default)]
    pub user: String,
}

/// What an admin asks of the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmAsk {
    /// `NAME` or `NAME@vN`.
    pub name: String,
    /// The nodes; empty: every node that is up.
    pub nodes: Vec<NodeName>,
    /// Release the pin instead.
    pub unpin: bool,
}

/// What the coordinator sends each node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmOrder {
    /// `NAME@vN`.
    pub label: String,
    /// Its snapshot (the node checks the label still names it).
    pub snapshot: labsync_store::SnapshotId,
    /// Release the pin instead.
    pub unpin: bool,
    /// Pin it once fetched (an admin's warm); a prefetch for queued jobs
    /// does not.
    #[serde(default = "yes")]
    pub pin: bool,
}

fn yes() -> bool {
    true
}

/// The coordinator's answer: which version, sent to which nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmAnswer {
    /// `NAME@vN`.
    pub label: String,
    /// Its snapshot.
    pub snapshot: labsync_store::SnapshotId,
    /// The nodes that took the order.
    pub nodes: Vec<NodeName>,
}

/// A warm under way on a node, as its heartbeat shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warming {
    /// `NAME@vN`.
    pub label: String,
    /// Its snapshot.
    pub snapshot: Option<labsync_store::SnapshotId>,
    /// Bytes fetched so far.
    pub done_bytes: u64,
    /// Bytes to fetch (known once the missing packs are counted).
    pub total_bytes: Option<u64>,
    /// Why it failed, when it did (shown until the next warm of it).
    pub error: Option<String>,
}

/// How a route is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
}

/// One route of labd's API: the router serves it and the client asks it
/// from this one definition.
pub trait Route {
    /// How it is asked.
    const VERB: Verb;
    /// Its path; `{id}` stands for a job's or a pack's id.
    const PATH: &'static str;
    /// What is sent: JSON, or `()` for nothing.
    type Request;
    /// What comes back: JSON, `()` for `{}`, or bytes where said.
    type Answer;
}

/// The path of route `R` for `id` (the `{id}` in it filled in).
pub fn path_of<R: Route>(id: &str) -> String {
    R::PATH.replace("{id}", id)
}

/// What route `R` is sent.
pub type RequestOf<R> = <R as Route>::Request;

/// What route `R` answers.
pub type AnswerOf<R> = <R as Route>::Answer;

macro_rules! routes {
    ($($(#[$doc:meta])* $name:ident: $verb:ident $path:literal, $req:ty => $ans:ty;)*) => {
        $(
            $(#[$doc])*
            #[doc = concat!("\n\n`", stringify!($verb), " ", $path, "`: `", stringify!($req), "` → `", stringify!($ans), "`.")]
            #[derive(Clone, Copy, Debug)]
            pub struct $name;

            impl super::Route for $name {
                const VERB: super::Verb = super::Verb::$verb;
                const PATH: &'static str = $path;
                type Request = $req;
                type Answer = $ans;
            }
        )*

        /// Every route's method and path, in the order the router adds them.
        pub const ALL: &[(super::Verb, &str)] = &[$((super::Verb::$verb, $path)),*];
    };
}

/// labd's routes. All but [`routes::Health`] need `Authorization: Bearer
/// <token>` (a user's) or the cluster's signature (between nodes).
pub mod routes {
    use labsync_placer::Ranking;
    use labsync_store::PackId;

    use super::{
        AdminChange, AdminView, ClusterStatus, CorruptChecked, CorruptCopy, Dispatch,
        DispatchReply, Heartbeat, HeartbeatReply, Info, JobExplain, JobView, Located, PingAsk,
        Pong, PreemptOrder, RankAsk, StageAsk, StageDone, StageOrder, Staged, SubmitRequest,
        SuspectPeer, WarmAnswer, WarmAsk, WarmOrder,
    };
    use crate::status::GpuStatus;

    routes! {
        /// Whether labd answers (no token needed); the answer is `ok`.
        Health: Get "/v1/health", () => String;
        /// `labrun`'s first question.
        GetInfo: Get "/v1/info", () => Info;
        /// Every GPU and what it is.
        GetGpus: Get "/v1/gpus", () => Vec<GpuStatus>;
        /// Everyone's active jobs and those that ended in the last day; with
        /// `?history=true&before=N&limit=M`, ended jobs numbered below `jN`,
        /// newest first, `M` ≤ 1000 (default 100).
        ListJobs: Get "/v1/jobs", () => Vec<JobView>;
        /// A job submitted.
        SubmitJob: Post "/v1/jobs", SubmitRequest => JobView;
        /// One job.
        GetJob: Get "/v1/jobs/{id}", () => JobView;
        /// A job's log from `?offset=N`, waiting `&wait_ms=M` for new bytes;
        /// the bytes, with the headers [`super::NEXT_OFFSET`] and [`super::DONE`].
        JobLog: Get "/v1/jobs/{id}/log", () => Vec<u8>;
        /// A job killed (or dropped from the queue).
        KillJob: Post "/v1/jobs/{id}/kill", () => JobView;
        /// The job, and per node why not there (queued, in a cluster).
        ExplainJob: Get "/v1/jobs/{id}/explain", () => JobExplain;
        /// Every node, on the coordinator.
        GetClusterStatus: Get "/v1/cluster/status", () => ClusterStatus;
        /// An agent's heartbeat, to the coordinator (signed).
        SendHeartbeat: Post "/v1/cluster/heartbeat", Heartbeat => HeartbeatReply;
        /// A pack's bytes from a node's cache (signed); over plain TCP, with
        /// `Upgrade: labsync-pack`, `101` and then the bytes by `sendfile`.
        GetPack: Get "/v1/cluster/packs/{id}", () => Vec<u8>;
        /// A peer found the copy of a pack it got from here corrupt (signed).
        ReportCorrupt: Post "/v1/cluster/packs/{id}/corrupt", CorruptCopy => CorruptChecked;
        /// Where a job would go, and why not elsewhere (`labrun --explain`).
        ExplainRequest: Post "/v1/cluster/explain", SubmitRequest => Ranking;
        /// The lab's rules in force (`labrun admin show`; admins, the
        /// coordinator).
        GetAdmin: Get "/v1/cluster/admin", () => AdminView;
        /// An admin's change to the lab's rules (`labrun admin grant`,
        /// `tier`, `cap`; the coordinator).
        ChangeAdmin: Post "/v1/cluster/admin", AdminChange => AdminView;
        /// Nodes ranked with Slurm's GPUs, on the coordinator.
        RankNodes: Post "/v1/cluster/rank", RankAsk => Ranking;
        /// A Slurm job's code and data on its node, answered once there
        /// (to the coordinator; untimed).
        AskStage: Post "/v1/stage", StageAsk => Staged;
        /// A Slurm job ended: its stage released (to the coordinator).
        AskStageDone: Post "/v1/stage/done", StageDone => ();
        /// An admin's warm, to the coordinator.
        AskWarm: Post "/v1/warm", WarmAsk => WarmAnswer;
        /// The coordinator's warm order, to a node (signed).
        OrderWarm: Post "/v1/cluster/warm", WarmOrder => ();
        /// Who holds which packs, asked of the coordinator (signed).
        LocatePacks: Post "/v1/cluster/locate", Vec<PackId> => Located;
        /// A job the coordinator placed, to its node (signed).
        DispatchJob: Post "/v1/cluster/jobs", Dispatch => DispatchReply;
        /// A placed job's record, from its node (signed).
        PlacedJob: Get "/v1/cluster/jobs/{id}", () => JobView;
        /// A placed job's log, as [`JobLog`] (signed).
        PlacedLog: Get "/v1/cluster/jobs/{id}/log", () => Vec<u8>;
        /// A placed job killed for the user the coordinator checked (signed).
        PlacedKill: Post "/v1/cluster/jobs/{id}/kill", () => JobView;
        /// A preemptible job stopped to be requeued (signed).
        PlacedPreempt: Post "/v1/cluster/jobs/{id}/preempt", PreemptOrder => ();
        /// The coordinator's stage order, to a node (signed; untimed).
        OrderStage: Post "/v1/cluster/stage", StageOrder => Staged;
        /// The coordinator's release of a stage, to a node (signed).
        OrderStageDone: Post "/v1/cluster/stage/done", StageDone => ();
        /// A peer failed this node's fetch, to the coordinator (signed).
        ReportSuspect: Post "/v1/cluster/suspect", SuspectPeer => ();
        /// `labd doctor`'s ping (signed): the node's version and clock, and
        /// whether it reaches the nodes named back.
        Ping: Post "/v1/cluster/ping", PingAsk => Pong;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_one_protocol_version_apart_talk_and_two_apart_are_told_both() {
        for theirs in [PROTOCOL - 1, PROTOCOL, PROTOCOL + 1] {
            assert_eq!(check_protocol("gpu2", theirs, "x", "gpu1"), Ok(()));
        }
        let e = check_protocol("gpu2", PROTOCOL + 2, "9.0.0", "gpu1").unwrap_err();
        assert!(
            e.contains(&format!(
                "gpu2 speaks labsync protocol {} (labsync 9.0.0)",
                PROTOCOL + 2
            )) && e.contains(&format!("gpu1 speaks {PROTOCOL} (labsync {VERSION})"))
                && e.ends_with("upgrade gpu1"),
            "{e}"
        );
        let e = check_protocol("gpu2", 0, "0.0.1", "gpu1").unwrap_err();
        assert!(e.ends_with("upgrade gpu2"), "{e}");
    }
}
