//! Where a job should run: the cluster model and the placement rule.
//!
//! Pure and synchronous (no I/O, no runtime, no clock: time is an
//! argument), so `labd`'s coordinator and the trace-driven simulator run
//! the same code.
//!
//! - [`Cluster`]: nodes ([`NodeView`]: health, [`Gpu`]s, measured
//!   [`Rates`]), which packs each has cached (deltas from heartbeats), and
//!   which packs each snapshot needs.
//! - [`rank`]: for one [`Job`], every node's start estimate
//!   `max(GPU wait, fetch time)` and the choice, with the reasons `labrun
//!   --explain` prints ([`Ranking`]).
//! - [`plan`]: one pass over the queue in the lab's [`order`] (tier, fair
//!   share by decaying GPU time, submit time), where a job that cannot
//!   start does not block those behind it, a user's GPUs may be capped, and
//!   a higher tier's job may stop preemptible ones ([`Decision`]).
//! - [`Members`]: the tier [`Ladder`], who stands where, paper-deadline
//!   grants that lapse; [`Usage`]: the decaying GPU time.
//! - [`prefetch`]: what to warm where while jobs wait; [`idle_holds`]:
//!   held GPUs to give back.
//! - [`with_scheduler_gpus`], [`preferred`]: where Slurm owns the GPUs,
//!   its view of them joined with the caches, and the nodes to prefer.
//!
//! ```
//! use labsync_placer::{plan, Cluster, Decision, Gpu, Job, Ladder, NodeName, PackKey, Pass, Policy, Queued, SnapshotKey, Tier, Usage};
//!
//! let mut c = Cluster::new();
//! let (gpu1, gpu2): (NodeName, NodeName) = ("gpu1".parse().unwrap(), "gpu2".parse().unwrap());
//! for n in [&gpu1, &gpu2] {
//!     c.node_entry(n).gpus = (0..4).map(|i| Gpu::free(i, 11 << 30)).collect();
//! }
//! let div2k = SnapshotKey([7; 32]);
//! c.add_snapshot(div2k, [(PackKey([1; 32]), 3 << 30)]);
//! c.set_cached(&gpu2, PackKey([1; 32]), 3 << 30, true);
//!
//! let job = Job { gpus: 1, gpu_mem: 0, needs: vec![div2k], expected_secs: None, limited: false };
//! let queue = [Queued { id: "j1".into(), job, user: "alice".into(), tier: Tier(2), submitted: 0, preemptible: false }];
//! let pass = Pass { queue: &queue, running: &[], usage: &Usage::default(), ladder: &Ladder::default(), now: 0 };
//! let d = plan(&mut c, &pass, &Policy::default());
//! let Decision::Start { choice, .. } = &d[0] else { panic!() };
//! assert_eq!(choice.node, gpu2); // GPUs free on both; the data is on gpu2
//! ```
#![deny(missing_docs)]

mod bitset;
mod cluster;
mod lab;
mod place;
mod prefetch;
mod queue;
mod scheduler;

pub use cluster::{
    BadNodeName, Cluster, Gpu, Health, Millis, NodeName, NodeView, PackKey, Rates, Slot,
    SnapshotKey,
};
pub use lab::{BadLadder, Ladder, Member, Members, Tier, TierRefused, Usage};
pub use place::{rank, Choice, GpuWait, Job, Policy, Ranking, Row, Verdict};
pub use prefetch::{idle_holds, prefetch, Hold, Warm};
pub use queue::{
    before, effective_tier, order, plan, plan_reserving, reserve, standing_of, Decision, Ends,
    Pass, Queued, Reservation, Running,
};
pub use scheduler::{preferred, with_scheduler_gpus, SchedulerNode};
