//! The placement rule: for each node, when could the job start there?
//!
//! `start = max(time until enough GPUs are free, time to bring the packs
//! the node lacks)`, the earliest wins, and near-ties go to the node the
//! job fragments least. See [`rank`] for the rule in full.

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, Millis, NodeName, Slot, SnapshotKey};

/// A job as the placer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// GPUs it needs, all on one node (0: a CPU job).
    pub gpus: u32,
    /// Memory each of its GPUs must have free, bytes (0: any).
    pub gpu_mem: u64,
    /// The snapshots it reads: its code and its data.
    pub needs: Vec<SnapshotKey>,
    /// How long it is expected to run, where known: its time limit, or an
    /// estimate from its user's earlier runs. Lets [`crate::plan`] say when
    /// the GPUs it takes will be free again, and whether it may start in
    /// the gap before a reservation (backfill).
    pub expected_secs: Option<u64>,
    /// Whether `expected_secs` is a time limit its node enforces. Only
    /// such a job may backfill into a reservation's gap: an estimate from
    /// history is a user's to game (short runs of a command, then a long
    /// one), and the job the gap was kept for would pay.
    pub limited: bool,
}

/// The knobs of the rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Nodes whose start estimates are this close to the earliest are tied,
    /// and the tie is broken against fragmentation. Estimates come from
    /// measured rates and expected ends, so a smaller difference means
    /// nothing.
    pub tie_secs: f64,
    /// GPUs one user may have running at once (`None`: no cap).
    pub user_gpu_cap: Option<u32>,
    /// Whether a job no free node can take may stop preemptible jobs of
    /// lower tiers.
    pub preemption: bool,
    /// A GPU held without a command (`labrun --hold`) that shows no
    /// utilisation for this long is released.
    pub idle_hold_secs: u64,
    /// A dataset wanted by this many queued jobs is warmed on that many
    /// nodes (up to [`Policy::replicas_max`]); one job's data is warmed on
    /// the node it most likely gets.
    pub replicas_max: usize,
    /// Copies one user's waiting jobs may have warmed per pass, their
    /// earliest jobs' first: a thousand queued jobs on a thousand datasets
    /// must not fill every node's cache and evict everyone else's data.
    pub prefetch_per_user: usize,
    /// A waiting job is ordered one tier higher for every this many
    /// seconds it has waited, up to the tier below the deadline tier
    /// ([`crate::effective_tier`]); `None`: tiers never age.
    pub aging_secs: Option<u64>,
    /// Whether the first job that cannot start holds the GPUs it waits for
    /// (EASY backfill, see [`crate::plan`]); off, any later job may take
    /// them, and a big job may wait for ever behind a stream of small ones.
    pub backfill: bool,
    /// A job is given the reservation only once it has waited this long
    /// (Slurm's `bf_min_age_reserve`): until then the GPUs it would hold
    /// keep working for whoever fits, and a big job that would start soon
    /// anyway costs no one an idle GPU.
    pub reserve_after_secs: u64,
}

impl Default for Policy {
    /// Ties within 2 s, no cap, preemption on, idle holds released after
    /// 30 minutes, hot data warmed on up to 3 nodes, 2 warms per user,
    /// tiers aged one step a day, backfill with a reservation for a job
    /// that has waited 2 hours (the default the simulator's matrix chose:
    /// `bench/results/placement.md`).
    fn default() -> Self {
        Policy {
            tie_secs: 2.0,
            user_gpu_cap: None,
            preemption: true,
            idle_hold_secs: 30 * 60,
            replicas_max: 3,
            prefetch_per_user: 2,
            aging_secs: Some(86_400),
            backfill: true,
            reserve_after_secs: 2 * 3600,
        }
    }
}

/// When a node will have enough GPUs for the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "wait", rename_all = "snake_case")]
pub enum GpuWait {
    /// Free now.
    Now,
    /// Expected free in this many seconds (jobs with known ends).
    In {
        /// Seconds from now.
        secs: f64,
    },
    /// Not free now, and no one knows when.
    Unknown {
        /// What holds them.
        why: String,
    },
    /// The node does not have enough GPUs of the size asked for.
    Never {
        /// Which it has.
        why: String,
    },
}

impl GpuWait {
    fn secs(&self) -> Option<f64> {
        match self {
            GpuWait::Now => Some(0.0),
            GpuWait::In { secs } => Some(*secs),
            _ => None,
        }
    }
}

/// Why a node was or was not chosen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// This node.
    Chosen,
    /// It could start the job, later than the chosen node.
    Later {
        /// Seconds after the chosen node's start.
        by_secs: f64,
    },
    /// It ties with the chosen node on start time and lost the tie.
    TieLost {
        /// The rule that decided.
        why: String,
    },
    /// Its GPUs are busy with no known end, or held by foreign processes.
    Busy,
    /// It never can: too few GPUs of the size asked for.
    Never,
    /// No heartbeat since then; never chosen.
    Down {
        /// The last heartbeat.
        since: Millis,
    },
}

/// One node's row of the `--explain` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The node.
    pub node: NodeName,
    /// GPUs large enough for the job and free now.
    pub gpus_free: u32,
    /// GPUs large enough for the job, whatever they are doing (foreign and
    /// unknown ones left out).
    pub gpus_fit: u32,
    /// When enough are free.
    pub gpu_wait: GpuWait,
    /// Bytes of the job's packs the node lacks.
    pub missing_bytes: u64,
    /// Of those, bytes some peer that is up holds.
    pub from_peers: u64,
    /// Of those, bytes only the object store holds.
    pub from_store: u64,
    /// Seconds to bring them at the node's measured rates.
    pub fetch_secs: f64,
    /// When the job could start there, seconds from now: the later of the
    /// GPU wait and the fetch. `None` when no one can say.
    pub start_secs: Option<f64>,
    /// The outcome.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// GPUs of the job's size that would stay idle at the start (the
    /// fragmentation tie-break): free then, minus the job's.
    #[serde(skip)]
    idle_left: u32,
    /// The GPUs the job would get.
    #[serde(skip)]
    gpus: Vec<u32>,
}

/// Where a job goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The node.
    pub node: NodeName,
    /// The GPUs it would lease there (NVML indices).
    pub gpus: Vec<u32>,
    /// Seconds from now until it could start there.
    pub start_secs: f64,
    /// Whether its GPUs are free now (it can be dispatched; the data is
    /// fetched as it prepares) or it waits for a busy node.
    pub gpus_free_now: bool,
    /// Bytes the node must fetch.
    pub fetch_bytes: u64,
}

/// The placer's answer for one job: the choice and every node's row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ranking {
    /// The chosen node, when some node can say when it could start the job.
    pub choice: Option<Choice>,
    /// Every node: the chosen one first, then by start, then the busy, the
    /// never and the down ones.
    pub rows: Vec<Row>,
    /// Snapshots the view does not know the packs of, priced as present
    /// everywhere (the caller adds them with [`Cluster::add_snapshot`]).
    #[serde(skip)]
    pub unpriced: Vec<SnapshotKey>,
}

impl Ranking {
    /// The best node whose GPUs are free now (the earliest start there, that
    /// is the quickest fetch; ties to the one left least fragmented), where
    /// the choice may be a busy node.
    pub fn best_free_now(&self) -> Option<Choice> {
        self.rows
            .iter()
            .filter(|r| r.gpu_wait == GpuWait::Now && r.start_secs.is_some())
            .min_by(|a, b| {
                a.start_secs
                    .unwrap_or(f64::INFINITY)
                    .total_cmp(&b.start_secs.unwrap_or(f64::INFINITY))
                    .then(a.idle_left.cmp(&b.idle_left))
                    .then(a.node.cmp(&b.node))
            })
            .map(|r| Choice {
                node: r.node.clone(),
                gpus: r.gpus.clone(),
                start_secs: r.start_secs.unwrap_or(0.0),
                gpus_free_now: true,
                fetch_bytes: r.missing_bytes,
            })
    }
}

/// GiB for messages.
fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Bytes for messages, in the binary unit that shows them (`8.8 MiB`), as
/// everything else labsync prints.
fn bytes(b: u64) -> String {
    let mut v = b as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if v < 1024.0 {
            return if unit == "B" {
                format!("{b} B")
            } else {
                format!("{v:.1} {unit}")
            };
        }
        v /= 1024.0;
    }
    format!("{v:.1} TiB")
}

/// Ranks every node for `job` at `now`.
///
/// - **GPUs.** Only GPUs with at least `gpu_mem` installed count. Free ones
///   with `gpu_mem` free count now; busy ones at their job's expected end;
///   busy ones with no known end (or past it), foreign-held and unknown
///   ones never. The
///   job's wait is the time until the `gpus`-th of them is free. A node with
///   too few GPUs of that size is *never*; a down node is never chosen.
/// - **Data.** Every pack of the job's snapshots that the node lacks is
///   fetched: from peers (at the node's peer rate) when an up node has it,
///   else from the store (store rate). Shared packs count once, so a new
///   version of a cached dataset, or DF2K on a node that has DIV2K, costs
///   only what differs.
/// - **Choice.** The earliest `max(GPU wait, fetch)` wins. Every node
///   within [`Policy::tie_secs`] of it ties, and the tie goes to the node
///   that leaves the fewest GPUs of the job's size idle at the start (best
///   fit: whole free nodes stay whole for multi-GPU jobs), then to the one
///   that moves the fewest bytes, then the earlier start, then the name.
/// - **GPUs on the node.** The smallest GPUs that fit (big ones stay for
///   big jobs), then the lowest index; for a wait, the ones free soonest.
pub fn rank(cluster: &Cluster, job: &Job, now: Millis, policy: &Policy) -> Ranking {
    let (packs, unpriced) = cluster.packs_of(&job.needs);
    let nodes = cluster.nodes();
    // How many up nodes hold each pack: the peers a node could fetch from.
    let holders: Vec<u32> = packs
        .iter()
        .map(|&p| {
            (0..nodes.len())
                .filter(|&i| nodes[i].is_up() && cluster.has(i, p))
                .count() as u32
        })
        .collect();
    let mut rows: Vec<Row> = (nodes.iter().enumerate())
        .map(|(i, node)| row(cluster, i, node, job, &packs, &holders, now))
        .collect();
    let earliest = rows
        .iter()
        .filter_map(|r| r.start_secs)
        .fold(f64::INFINITY, f64::min);
    let chosen = choose(&rows, earliest, policy);
    let choice = chosen.map(|c| {
        let r = &rows[c];
        Choice {
            node: r.node.clone(),
            gpus: r.gpus.clone(),
            start_secs: r.start_secs.expect("chosen rows have a start"),
            gpus_free_now: r.gpu_wait == GpuWait::Now,
            fetch_bytes: r.missing_bytes,
        }
    });
    if let Some(c) = chosen {
        give_verdicts(&mut rows, c, earliest, policy);
    }
    let order = |r: &Row| match r.verdict {
        Verdict::Chosen => 0,
        Verdict::Later { .. } | Verdict::TieLost { .. } => 1,
        Verdict::Busy => 2,
        Verdict::Never => 3,
        Verdict::Down { .. } => 4,
    };
    rows.sort_by(|a, b| {
        order(a)
            .cmp(&order(b))
            .then(
                a.start_secs
                    .unwrap_or(f64::INFINITY)
                    .total_cmp(&b.start_secs.unwrap_or(f64::INFINITY)),
            )
            .then(a.node.cmp(&b.node))
    });
    Ranking {
        choice,
        rows,
        unpriced,
    }
}

/// Node `i`'s row for `job`: when its GPUs free, what it would fetch from
/// peers (`holders`: how many up nodes hold each of `packs`) and from the
/// store, and so when the job would start there.
fn row(
    cluster: &Cluster,
    i: usize,
    node: &crate::NodeView,
    job: &Job,
    packs: &[u32],
    holders: &[u32],
    now: Millis,
) -> Row {
    let (gpu_wait, gpus_free, gpus_fit, at_start, gpus) = gpu_wait(node.gpus.as_slice(), job, now);
    let (mut from_peers, mut from_store) = (0, 0);
    // A snapshot materialised there needs none of its packs.
    let trees = cluster.tree_packs(i, &job.needs);
    for (k, &p) in packs.iter().enumerate() {
        if !cluster.has(i, p) && !trees.contains(p) {
            if holders[k] > 0 {
                from_peers += cluster.pack_size(p);
            } else {
                from_store += cluster.pack_size(p);
            }
        }
    }
    let fetch_secs = from_peers as f64 / node.rates.peer.max(1.0)
        + from_store as f64 / node.rates.store.max(1.0);
    let start_secs = match node.health {
        crate::Health::Up => gpu_wait.secs().map(|w| w.max(fetch_secs)),
        crate::Health::Down { .. } => None,
    };
    let verdict = match (&node.health, &gpu_wait) {
        (crate::Health::Down { since }, _) => Verdict::Down { since: *since },
        (_, GpuWait::Never { .. }) => Verdict::Never,
        (_, GpuWait::Unknown { .. }) => Verdict::Busy,
        _ => Verdict::Later { by_secs: 0.0 },
    };
    Row {
        node: node.name().clone(),
        gpus_free,
        gpus_fit,
        gpu_wait,
        missing_bytes: from_peers + from_store,
        from_peers,
        from_store,
        fetch_secs,
        start_secs,
        verdict,
        idle_left: at_start.saturating_sub(job.gpus),
        gpus,
    }
}

/// The key ties are broken on: GPUs left idle, then bytes to move.
fn tie_key(r: &Row) -> (u32, u64) {
    (r.idle_left, r.missing_bytes)
}

/// The row chosen among those starting within the tie of the `earliest`:
/// the fewest GPUs left idle, then the fewest bytes, then the earlier
/// start, then the name.
fn choose(rows: &[Row], earliest: f64, policy: &Policy) -> Option<usize> {
    rows.iter()
        .enumerate()
        .filter(|(_, r)| {
            r.start_secs
                .is_some_and(|s| s <= earliest + policy.tie_secs)
        })
        .min_by(|(_, a), (_, b)| {
            tie_key(a)
                .cmp(&tie_key(b))
                .then(a.start_secs.partial_cmp(&b.start_secs).expect("finite"))
                .then(a.node.cmp(&b.node))
        })
        .map(|(i, _)| i)
}

/// Says of each row that could start why it was not row `c`, the chosen.
fn give_verdicts(rows: &mut [Row], c: usize, earliest: f64, policy: &Policy) {
    let (won_start, won_key) = (rows[c].start_secs.unwrap_or(0.0), tie_key(&rows[c]));
    for (i, r) in rows.iter_mut().enumerate() {
        let Some(s) = r.start_secs else { continue };
        r.verdict = if i == c {
            Verdict::Chosen
        } else if s > earliest + policy.tie_secs {
            Verdict::Later {
                by_secs: s - won_start,
            }
        } else {
            let why = if r.idle_left != won_key.0 {
                format!(
                    "ties on start; would leave {} GPU(s) idle there against {}",
                    r.idle_left, won_key.0
                )
            } else if r.missing_bytes != won_key.1 {
                format!(
                    "ties on start and fit; would move {} against {}",
                    bytes(r.missing_bytes),
                    bytes(won_key.1)
                )
            } else {
                "ties on start, fit and bytes; the earlier start or name wins".to_string()
            };
            Verdict::TieLost { why }
        };
    }
}

/// (wait, GPUs of the size free now, GPUs of the size, GPUs of the size free
/// at the start, the GPUs the job would get).
fn gpu_wait(gpus: &[crate::Gpu], job: &Job, now: Millis) -> (GpuWait, u32, u32, u32, Vec<u32>) {
    let fit: Vec<&crate::Gpu> = gpus
        .iter()
        .filter(|g| g.memory_total >= job.gpu_mem && g.slot != Slot::Unavailable)
        .collect();
    // When each fitting GPU is free, seconds from now; None: not knowable.
    let mut when: Vec<(Option<f64>, u64, u32)> = fit
        .iter()
        .map(|g| {
            let at = match g.slot {
                Slot::Free if g.memory_free >= job.gpu_mem => Some(0.0),
                // A job past its expected end still runs: when it ends is
                // anyone's guess, and its GPU is not free now.
                Slot::Busy { until: Some(t) } if t > now => Some((t - now) as f64 / 1000.0),
                _ => None,
            };
            (at, g.memory_total, g.index)
        })
        .collect();
    when.sort_by(|a, b| {
        a.0.unwrap_or(f64::INFINITY)
            .total_cmp(&b.0.unwrap_or(f64::INFINITY))
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
    });
    let free_now = when.iter().filter(|w| w.0 == Some(0.0)).count() as u32;
    let n_fit = fit.len() as u32;
    let k = job.gpus as usize;
    if k == 0 {
        return (GpuWait::Now, free_now, n_fit, free_now, Vec::new());
    }
    if fit.len() < k {
        let held = gpus
            .iter()
            .filter(|g| g.memory_total >= job.gpu_mem && g.slot == Slot::Unavailable)
            .count();
        let size = if job.gpu_mem > 0 {
            format!(" with {} or more", gib(job.gpu_mem))
        } else {
            String::new()
        };
        return if fit.len() + held >= k {
            let why = format!(
                "{held} GPU(s){size} held by foreign processes or not answering; {} usable",
                fit.len()
            );
            (GpuWait::Unknown { why }, free_now, n_fit, 0, Vec::new())
        } else {
            let why = format!(
                "has {} GPU(s){size} (of {}); the job asks for {k}",
                fit.len() + held,
                gpus.len()
            );
            (GpuWait::Never { why }, free_now, n_fit, 0, Vec::new())
        };
    }
    match when[k - 1].0 {
        None => {
            let busy = fit.len() - free_now as usize;
            let why = format!("{busy} of {} GPU(s) busy with no known end", fit.len());
            (
                GpuWait::Unknown { why },
                free_now,
                n_fit,
                free_now,
                Vec::new(),
            )
        }
        Some(t) => {
            let at_start = when.iter().filter(|w| w.0.is_some_and(|x| x <= t)).count() as u32;
            let mut chosen: Vec<(u64, u32)> = if t == 0.0 {
                when.iter()
                    .filter(|w| w.0 == Some(0.0))
                    .map(|w| (w.1, w.2))
                    .collect()
            } else {
                when[..k].iter().map(|w| (w.1, w.2)).collect()
            };
            // Smallest that fit first, then lowest index (`when` is sorted so).
            chosen.truncate(k);
            let mut ids: Vec<u32> = chosen.into_iter().map(|(_, i)| i).collect();
            ids.sort_unstable();
            let wait = if t == 0.0 {
                GpuWait::Now
            } else {
                GpuWait::In { secs: t }
            };
            (wait, free_now, n_fit, at_start, ids)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{Gpu, Health, PackKey, Rates};

    pub(crate) const GIB: u64 = 1 << 30;

    pub(crate) fn n(s: &str) -> NodeName {
        s.parse().unwrap()
    }

    /// A node with `free` free GPUs then `busy` busy ones (no known end), 11 GiB each.
    pub(crate) fn node(c: &mut Cluster, name: &str, free: u32, busy: u32) {
        let v = c.node_entry(&n(name));
        v.gpus = (0..free + busy)
            .map(|i| {
                let mut g = Gpu::free(i, 11 * GIB);
                if i >= free {
                    g.slot = Slot::Busy { until: None };
                    g.memory_free = 0;
                }
                g
            })
            .collect();
        v.rates = Rates {
            peer: 100e6,
            store: 50e6,
        };
    }

    /// A snapshot of `packs` packs of 1 GiB, numbered from `first`.
    pub(crate) fn snapshot(c: &mut Cluster, id: u8, first: u8, packs: u8) -> SnapshotKey {
        let key = SnapshotKey([id; 32]);
        c.add_snapshot(key, (first..first + packs).map(|p| (PackKey([p; 32]), GIB)));
        key
    }

    pub(crate) fn cache(c: &mut Cluster, node: &str, first: u8, packs: u8) {
        for p in first..first + packs {
            c.set_cached(&n(node), PackKey([p; 32]), GIB, true);
        }
    }

    pub(crate) fn job(gpus: u32, needs: &[SnapshotKey]) -> Job {
        Job {
            gpus,
            gpu_mem: 0,
            needs: needs.to_vec(),
            expected_secs: None,
            limited: false,
        }
    }

    fn row<'a>(r: &'a Ranking, node: &str) -> &'a Row {
        r.rows.iter().find(|x| x.node.as_str() == node).unwrap()
    }

    fn chosen(r: &Ranking) -> &str {
        r.choice.as_ref().expect("a choice").node.as_str()
    }

    #[test]
    fn free_everywhere_the_job_goes_where_its_data_is() {
        let mut c = Cluster::new();
        for name in ["a", "b", "c"] {
            node(&mut c, name, 4, 0);
        }
        let div2k = snapshot(&mut c, 1, 1, 4);
        cache(&mut c, "b", 1, 4);
        let r = rank(&c, &job(1, &[div2k]), 0, &Policy::default());
        assert_eq!(chosen(&r), "b");
        let ch = r.choice.as_ref().unwrap();
        assert!(ch.gpus_free_now);
        assert_eq!((ch.fetch_bytes, ch.start_secs), (0, 0.0));
        assert_eq!(r.rows[0].verdict, Verdict::Chosen);
        // The others fetch 4 GiB from the peer b at 100 MB/s.
        let a = row(&r, "a");
        assert_eq!((a.from_peers, a.from_store), (4 * GIB, 0));
        assert!((a.fetch_secs - 4.0 * GIB as f64 / 100e6).abs() < 1e-9);
        assert!(matches!(a.verdict, Verdict::Later { by_secs } if by_secs > 40.0));
    }

    #[test]
    fn a_busy_data_node_with_no_known_end_loses_to_a_free_one_and_the_data_follows() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 4);
        node(&mut c, "b", 4, 0);
        let div2k = snapshot(&mut c, 1, 1, 2);
        cache(&mut c, "a", 1, 2);
        let r = rank(&c, &job(1, &[div2k]), 0, &Policy::default());
        assert_eq!(chosen(&r), "b");
        assert_eq!(r.choice.as_ref().unwrap().fetch_bytes, 2 * GIB);
        let a = row(&r, "a");
        assert_eq!(a.verdict, Verdict::Busy);
        assert_eq!(a.start_secs, None);
        assert!(
            matches!(&a.gpu_wait, GpuWait::Unknown { why } if why.contains("4 of 4 GPU(s) busy"))
        );
    }

    #[test]
    fn locality_is_worth_a_short_wait_and_not_a_long_one() {
        for (ends_in, fetch_packs, want) in [(10_000, 30, "a"), (3_600_000, 1, "b")] {
            let mut c = Cluster::new();
            node(&mut c, "a", 0, 1);
            c.node_mut(&n("a")).unwrap().gpus[0].slot = Slot::Busy {
                until: Some(1_000 + ends_in),
            };
            node(&mut c, "b", 1, 0);
            let data = snapshot(&mut c, 1, 1, fetch_packs);
            cache(&mut c, "a", 1, fetch_packs);
            // b would fetch from a, at 100 MB/s: 30 GiB is 322 s against a
            // 10 s wait, 1 GiB is 11 s against an hour.
            let r = rank(&c, &job(1, &[data]), 1_000, &Policy::default());
            assert_eq!(chosen(&r), want, "ends in {ends_in} ms, {fetch_packs} GiB");
            let ch = r.choice.clone().unwrap();
            assert_eq!(ch.gpus_free_now, want == "b");
            if want == "a" {
                assert_eq!(ch.start_secs, 10.0);
                assert_eq!(row(&r, "a").gpu_wait, GpuWait::In { secs: 10.0 });
            }
        }
    }

    /// Found by the queue's property test: a GPU whose job overran its
    /// expected end was offered as free.
    #[test]
    fn a_job_past_its_expected_end_still_holds_its_gpu() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 1);
        c.node_mut(&n("a")).unwrap().gpus[0].slot = Slot::Busy { until: Some(5_000) };
        let r = rank(&c, &job(1, &[]), 5_000, &Policy::default());
        assert_eq!(r.choice, None);
        assert_eq!(r.rows[0].verdict, Verdict::Busy);
    }

    #[test]
    fn down_foreign_and_unknown_are_never_chosen() {
        let mut c = Cluster::new();
        node(&mut c, "a", 4, 0);
        c.node_mut(&n("a")).unwrap().health = Health::Down { since: 5 };
        node(&mut c, "b", 2, 0);
        for g in &mut c.node_mut(&n("b")).unwrap().gpus {
            g.slot = Slot::Unavailable;
        }
        let data = snapshot(&mut c, 1, 1, 1);
        cache(&mut c, "a", 1, 1);
        let r = rank(&c, &job(1, &[data]), 10, &Policy::default());
        assert_eq!(r.choice, None);
        assert_eq!(row(&r, "a").verdict, Verdict::Down { since: 5 });
        assert_eq!(row(&r, "b").verdict, Verdict::Busy);
        assert!(
            matches!(&row(&r, "b").gpu_wait, GpuWait::Unknown { why } if why.contains("held by foreign")),
            "{:?}",
            row(&r, "b").gpu_wait
        );
        // A down node's packs are not offered to peers: the store is priced.
        node(&mut c, "c", 1, 0);
        let r = rank(&c, &job(1, &[data]), 10, &Policy::default());
        assert_eq!(chosen(&r), "c");
        assert_eq!((row(&r, "c").from_peers, row(&r, "c").from_store), (0, GIB));
    }

    #[test]
    fn gpu_memory_picks_the_smallest_gpus_that_fit_or_says_never() {
        let mut c = Cluster::new();
        let v = c.node_entry(&n("mixed"));
        v.gpus = vec![
            Gpu::free(0, 24 * GIB),
            Gpu::free(1, 24 * GIB),
            Gpu::free(2, 11 * GIB),
            Gpu::free(3, 11 * GIB),
        ];
        let mut j = job(1, &[]);
        j.gpu_mem = 8 * GIB;
        let r = rank(&c, &j, 0, &Policy::default());
        assert_eq!(r.choice.unwrap().gpus, vec![2], "an 11 GiB GPU is enough");
        j.gpu_mem = 20 * GIB;
        j.gpus = 2;
        let r = rank(&c, &j, 0, &Policy::default());
        assert_eq!(r.choice.unwrap().gpus, vec![0, 1]);
        j.gpus = 3;
        let r = rank(&c, &j, 0, &Policy::default());
        assert_eq!(r.choice, None);
        assert_eq!(r.rows[0].verdict, Verdict::Never);
        let GpuWait::Never { why } = &r.rows[0].gpu_wait else {
            panic!("{:?}", r.rows[0].gpu_wait)
        };
        assert!(
            why.contains("has 2 GPU(s) with 20.0 GiB or more (of 4); the job asks for 3"),
            "{why}"
        );
        // Memory held by a small foreign process counts: 11 GiB installed,
        // 9 free, the job needs 10.
        let v = c.node_mut(&n("mixed")).unwrap();
        v.gpus = vec![Gpu {
            memory_free: 9 * GIB,
            ..Gpu::free(0, 11 * GIB)
        }];
        j.gpus = 1;
        j.gpu_mem = 10 * GIB;
        let r = rank(&c, &j, 0, &Policy::default());
        assert_eq!(r.choice, None);
        assert_eq!(r.rows[0].verdict, Verdict::Busy);
    }

    #[test]
    fn a_multi_gpu_job_stays_on_one_node() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 2);
        node(&mut c, "b", 2, 2);
        let r = rank(&c, &job(3, &[]), 0, &Policy::default());
        assert_eq!(
            r.choice, None,
            "2 + 2 free GPUs on two nodes are not 3 on one"
        );
        node(&mut c, "c", 3, 1);
        let r = rank(&c, &job(3, &[]), 0, &Policy::default());
        assert_eq!(chosen(&r), "c");
        assert_eq!(r.choice.unwrap().gpus, vec![0, 1, 2]);
    }

    #[test]
    fn ties_go_to_the_node_left_least_fragmented() {
        let mut c = Cluster::new();
        node(&mut c, "a", 4, 0);
        node(&mut c, "b", 1, 3);
        node(&mut c, "c", 2, 2);
        let r = rank(&c, &job(1, &[]), 0, &Policy::default());
        assert_eq!(chosen(&r), "b", "the last free GPU of b, not a whole node");
        let Verdict::TieLost { why } = &row(&r, "a").verdict else {
            panic!("{:?}", row(&r, "a").verdict)
        };
        assert!(why.contains("leave 3 GPU(s) idle there against 0"), "{why}");
        // Within the tie window only: a 1 GiB fetch (10.7 s) is not a tie.
        let data = snapshot(&mut c, 1, 1, 1);
        cache(&mut c, "a", 1, 1);
        let r = rank(&c, &job(1, &[data]), 0, &Policy::default());
        assert_eq!(chosen(&r), "a");
        assert!(matches!(row(&r, "b").verdict, Verdict::Later { .. }));
        // A CPU job goes where it leaves the fewest GPUs idle too.
        let r = rank(&c, &job(0, &[]), 0, &Policy::default());
        assert_eq!(chosen(&r), "b");
    }

    #[test]
    fn a_new_version_or_a_superset_counts_as_mostly_present() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        node(&mut c, "b", 1, 0);
        let div2k = snapshot(&mut c, 1, 1, 8);
        // DF2K = DIV2K's 8 packs and Flickr2K's 20.
        let df2k = SnapshotKey([2; 32]);
        c.add_snapshot(df2k, (1..29).map(|p| (PackKey([p; 32]), GIB)));
        cache(&mut c, "a", 1, 8);
        assert_eq!(c.presence(&n("a"), &df2k), Some((8 * GIB, 28 * GIB)));
        assert_eq!(c.presence(&n("a"), &div2k), Some((8 * GIB, 8 * GIB)));
        let r = rank(&c, &job(1, &[df2k]), 0, &Policy::default());
        assert_eq!(chosen(&r), "a");
        assert_eq!(row(&r, "a").from_store, 20 * GIB);
        assert_eq!(
            (row(&r, "b").from_peers, row(&r, "b").from_store),
            (8 * GIB, 20 * GIB)
        );
        // Code and data that share packs count them once.
        let r = rank(&c, &job(1, &[div2k, df2k]), 0, &Policy::default());
        assert_eq!(row(&r, "b").missing_bytes, 28 * GIB);
    }

    /// Issue 43: a node whose packs were evicted but whose tree of the
    /// dataset is materialised starts the job at once; the placer predicted
    /// a full fetch (10.9 s for a job that started in 0.11 s).
    #[test]
    fn a_materialised_tree_needs_no_fetch_whatever_packs_were_evicted() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        node(&mut c, "b", 1, 0);
        let div2k = snapshot(&mut c, 1, 1, 8);
        cache(&mut c, "b", 1, 8);
        // a holds no pack of it, but its tree.
        assert!(c.set_trees(&n("a"), vec![div2k]));
        // Said apart from its packs, of which it has none.
        assert_eq!(c.presence(&n("a"), &div2k), Some((0, 8 * GIB)));
        assert!(c.materialised(&n("a"), &div2k));
        let r = rank(&c, &job(1, &[div2k]), 0, &Policy::default());
        assert_eq!(row(&r, "a").missing_bytes, 0);
        // It serves no pack to a peer from a tree: b is the only holder.
        assert_eq!(c.holders(&PackKey([1; 32])), vec![&n("b")]);
        // A new version of the dataset is built from packs, not from the
        // old tree: every pack a lacks.
        let v2 = SnapshotKey([9; 32]);
        c.add_snapshot(v2, (1..10).map(|p| (PackKey([p; 32]), GIB)));
        let r = rank(&c, &job(1, &[v2]), 0, &Policy::default());
        assert_eq!(row(&r, "a").missing_bytes, 9 * GIB);
        let r = rank(&c, &job(1, &[div2k, v2]), 0, &Policy::default());
        assert_eq!(row(&r, "a").missing_bytes, 9 * GIB);
        // Once the tree is gone, the packs are missing again.
        c.set_trees(&n("a"), Vec::new());
        let r = rank(&c, &job(1, &[div2k]), 0, &Policy::default());
        assert_eq!(row(&r, "a").missing_bytes, 8 * GIB);
    }

    #[test]
    fn slow_links_count() {
        let mut c = Cluster::new();
        node(&mut c, "fast", 1, 0);
        node(&mut c, "slow", 1, 0);
        c.node_mut(&n("slow")).unwrap().rates = Rates {
            peer: 1e6,
            store: 1e6,
        };
        let data = snapshot(&mut c, 1, 1, 1);
        let r = rank(&c, &job(1, &[data]), 0, &Policy::default());
        assert_eq!(chosen(&r), "fast");
        assert!((row(&r, "slow").fetch_secs - GIB as f64 / 1e6).abs() < 1e-6);
    }

    #[test]
    fn unknown_snapshots_are_reported_not_guessed() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        let unknown = SnapshotKey([42; 32]);
        let r = rank(&c, &job(1, &[unknown]), 0, &Policy::default());
        assert_eq!(r.unpriced, vec![unknown]);
        assert_eq!(chosen(&r), "a");
    }

    #[test]
    fn an_empty_cluster_has_no_choice() {
        let r = rank(&Cluster::new(), &job(1, &[]), 0, &Policy::default());
        assert_eq!((r.choice, r.rows.len()), (None, 0));
    }
}
