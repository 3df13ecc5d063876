//! One scheduling pass over the queue, in the lab's order: tier first,
//! then fair share (least decayed GPU time first), then submit time. A job
//! that cannot start yet does not hold back the ones behind it that can
//! (the same rule for every policy the simulator compares).

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::cluster::{Cluster, Millis, NodeName, Slot};
use crate::lab::{span, Ladder, Tier, Usage};
use crate::place::{rank, Choice, GpuWait, Job, Policy, Ranking, Verdict};

/// A job waiting in the queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queued {
    /// Its id.
    pub id: String,
    /// What it needs.
    pub job: Job,
    /// Whose it is.
    pub user: String,
    /// The tier it runs at (settled at submit: see
    /// [`crate::Members::tier_for`]).
    pub tier: Tier,
    /// When it was submitted (or requeued).
    pub submitted: Millis,
    /// Whether a higher tier's job may stop it (it is requeued).
    pub preemptible: bool,
}

/// A job holding GPUs now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Running {
    /// Its id.
    pub id: String,
    /// Whose it is.
    pub user: String,
    /// Its tier.
    pub tier: Tier,
    /// Where.
    pub node: NodeName,
    /// Its GPUs there.
    pub gpus: Vec<u32>,
    /// Whether a higher tier's job may stop it.
    pub preemptible: bool,
    /// Told to stop for another job: its GPUs free once it has.
    pub stopping: bool,
    /// When it is expected to end, where known.
    pub ends: Option<Ends>,
}

/// When a running job is expected to end, and on whose word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Ends {
    /// When (the pass's clock).
    pub at: Millis,
    /// Its time limit (it is stopped then); else an estimate from its
    /// user's earlier runs, which it may overrun.
    pub limit: bool,
}

impl Ends {
    /// `limit` or `estimate`, for reasons.
    fn word(self) -> &'static str {
        if self.limit {
            "limit"
        } else {
            "estimate"
        }
    }
}

/// What one pass looks at besides the cluster view.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'a> {
    /// Every queued job, any order.
    pub queue: &'a [Queued],
    /// Every job holding GPUs.
    pub running: &'a [Running],
    /// Each user's decayed GPU time.
    pub usage: &'a Usage,
    /// The tiers' names, for the reasons given.
    pub ladder: &'a Ladder,
    /// Now.
    pub now: Millis,
}

/// What a pass decided for one queued job.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Send it to this node now: its GPUs there are free (its data is
    /// fetched as it prepares).
    Start {
        /// The job.
        id: String,
        /// Where, on which GPUs.
        choice: Choice,
    },
    /// Stop these preemptible jobs of lower tiers: once they have, their
    /// GPUs on `node` are this job's (it stays queued until then).
    Preempt {
        /// The job.
        id: String,
        /// Where the GPUs are freed.
        node: NodeName,
        /// The jobs to stop (and requeue).
        victims: Vec<String>,
        /// In one line, for `labrun ps`.
        why: String,
    },
    /// It stays queued.
    Wait {
        /// The job.
        id: String,
        /// Why, for `labrun ps` and `labrun explain`.
        why: String,
        /// The node it waits for, when one is expected to free up first
        /// (where its data could be prefetched).
        likely: Option<NodeName>,
    },
    /// No node of the cluster can ever run it as asked.
    Never {
        /// The job.
        id: String,
        /// Which nodes have what.
        why: String,
    },
}

impl Decision {
    /// The job decided on.
    pub fn id(&self) -> &str {
        match self {
            Decision::Start { id, .. }
            | Decision::Preempt { id, .. }
            | Decision::Wait { id, .. }
            | Decision::Never { id, .. } => id,
        }
    }
}

/// The tier `q` is ordered at `now`: its own, raised one tier for every
/// [`Policy::aging_secs`] it has waited, but never to the ladder's
/// deadline tier or above it (nor, on a ladder without one, to the top
/// tier). The rule that bounds how long a lower tier waits while higher
/// ones keep the cluster full: after `(its tier - the cap) × aging_secs`
/// an undergraduate's job is ordered beside the PhD students' that came
/// later, by fair share and then by submit time, so the older goes first;
/// deadline-tier jobs still go before it. It orders the queue only: an
/// aged job stops no one (preemption goes by the job's own tier).
pub fn effective_tier(q: &Queued, now: Millis, ladder: &Ladder, policy: &Policy) -> Tier {
    let Some(step) = policy.aging_secs.filter(|&s| s > 0) else {
        return q.tier;
    };
    let cap = ladder.deadline().map_or(1, |d| d.0.saturating_add(1));
    if q.tier.0 <= cap {
        return q.tier;
    }
    let steps = now.saturating_sub(q.submitted) / step.saturating_mul(1000);
    let rise = steps.min(u64::from(q.tier.0 - cap)) as u8;
    Tier(q.tier.0 - rise)
}

/// Where `q`'s user stands for its order at `now` ([`Usage::standing`],
/// `user`'s): once it has waited [`Policy::aging_secs`], fair share no
/// longer holds it back (it stands as one with no usage, so it goes by
/// submit time): a heavy user's old job is not passed for ever by a
/// light user's new ones of its tier.
pub fn standing_of(q: &Queued, user: f64, now: Millis, policy: &Policy) -> f64 {
    let old = policy
        .aging_secs
        .filter(|&s| s > 0)
        .is_some_and(|s| now.saturating_sub(q.submitted) >= s.saturating_mul(1000));
    if old {
        f64::NEG_INFINITY
    } else {
        user
    }
}

/// The queue in the order a pass takes it: tier ([`effective_tier`]: aged
/// by waiting), then the user's decayed GPU time (least first; not for a
/// job that has waited long, [`standing_of`]), then submit time, then id
/// (shorter first, so `j9` comes before `j10`).
pub fn order<'q>(pass: &Pass<'q>, policy: &Policy) -> Vec<&'q Queued> {
    let mut standing: HashMap<&str, f64> = HashMap::new();
    for q in pass.queue {
        standing
            .entry(q.user.as_str())
            .or_insert_with(|| pass.usage.standing(&q.user));
    }
    let mut order: Vec<(Tier, f64, &Queued)> = (pass.queue.iter())
        .map(|q| {
            let s = standing_of(q, standing[q.user.as_str()], pass.now, policy);
            (effective_tier(q, pass.now, pass.ladder, policy), s, q)
        })
        .collect();
    order.sort_by(|(ta, sa, a), (tb, sb, b)| before((*ta, *sa, a), (*tb, *sb, b)));
    order.into_iter().map(|(_, _, q)| q).collect()
}

/// Whether `a` (ordered at tier `ta`, its user standing at `sa`,
/// [`Usage::standing`]) goes before `b`: the comparison [`order`] sorts
/// by, for callers that keep the queue sorted themselves (the simulator).
pub fn before(
    (ta, sa, a): (Tier, f64, &Queued),
    (tb, sb, b): (Tier, f64, &Queued),
) -> std::cmp::Ordering {
    ta.cmp(&tb)
        .then(sa.total_cmp(&sb))
        .then(a.submitted.cmp(&b.submitted))
        // `j9` before `j10`.
        .then(a.id.len().cmp(&b.id.len()))
        .then(a.id.cmp(&b.id))
}

/// Decides every queued job, in [`order`], and records each start in
/// `cluster` (its GPUs busy, its packs present at the node) so later jobs
/// of the same pass, and passes before the agents report back, see them:
/// the same GPU is never offered twice. An agent that finds a GPU taken
/// after all refuses the start, and the next heartbeat corrects the view.
///
/// - **Backfill with a reservation** (EASY, [`Policy::backfill`]): the
///   first job in order that cannot start, and has a node whose GPUs are
///   expected free at a known time, is given those GPUs from then. A later
///   job may take one of them only if its expected run
///   ([`Job::expected_secs`]: its limit or estimate) ends before the
///   reservation begins; other GPUs, there and elsewhere, are anyone's.
///   A stream of small jobs thus never starves a big one at the head.
///
/// - A user with [`Policy::user_gpu_cap`] GPUs running waits.
/// - A job whose best node is busy waits for it ([`rank`]: the GPUs there
///   are expected free sooner than its data could be fetched elsewhere),
///   but never longer than that fetch: once it has waited as long, it
///   starts on the best node free now.
/// - A job no free node can take may stop preemptible jobs of lower tiers
///   ([`Policy::preemption`]): on the node where the fewest jobs, then the
///   fewest GPUs, are stopped. GPUs of jobs already stopping count as
///   coming free, so one job never stops more than it needs.
///
/// Decisions come in the pass's order.
pub fn plan(cluster: &mut Cluster, pass: &Pass, policy: &Policy) -> Vec<Decision> {
    plan_reserving(cluster, pass, policy, &mut None)
}

/// [`plan`] over one part of a queue, the reservation carried from the
/// parts before it and left for the parts after (a caller that hands the
/// queue over a chunk at a time, in order, as the simulator does).
pub fn plan_reserving(
    cluster: &mut Cluster,
    pass: &Pass,
    policy: &Policy,
    reservation: &mut Option<Reservation>,
) -> Vec<Decision> {
    let mut in_use: HashMap<&str, u32> = HashMap::new();
    for r in pass.running {
        *in_use.entry(r.user.as_str()).or_default() += r.gpus.len() as u32;
    }
    // Victims already given to a job of this pass.
    let mut claimed: HashSet<&str> = HashSet::new();
    // Jobs ahead that did not start, by tier.
    let mut ahead: Vec<u32> = Vec::new();
    let mut out = Vec::with_capacity(pass.queue.len());
    for q in order(pass, policy) {
        let tier = effective_tier(q, pass.now, pass.ladder, policy);
        let mut at = At {
            in_use: &mut in_use,
            claimed: &mut claimed,
            ahead: &ahead,
            tier,
            reservation,
        };
        let d = decide(cluster, pass, policy, q, &mut at);
        if !matches!(d, Decision::Start { .. }) {
            let t = tier.0 as usize;
            if ahead.len() <= t {
                ahead.resize(t + 1, 0);
            }
            ahead[t] += 1;
        }
        out.push(d);
    }
    out
}

/// GPUs promised to the first job of a pass that could not start (EASY
/// backfill): on one node, from when they are expected free.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    /// The job they are held for.
    pub id: String,
    /// The node's index in the view.
    node: usize,
    /// The node.
    pub name: NodeName,
    /// From then (the pass's clock).
    pub at: Millis,
    /// Its GPUs there.
    pub gpus: Vec<u32>,
}

impl Reservation {
    /// Whether `job`, starting `start_secs` from `now`, is sure to be done
    /// before the reservation begins: its time limit ends before.
    fn ends_before(&self, job: &Job, start_secs: f64, now: Millis) -> bool {
        (job.expected_secs.filter(|_| job.limited))
            .is_some_and(|e| now as f64 + (start_secs + e as f64) * 1000.0 <= self.at as f64)
    }

    /// Whether `c` takes one of the reserved GPUs.
    fn taken_by(&self, c: &Choice) -> bool {
        c.node == self.name && c.gpus.iter().any(|g| self.gpus.contains(g))
    }

    /// In words, for the reasons of the jobs it keeps off its GPUs.
    fn words(&self, now: Millis) -> String {
        format!(
            "{} holds {}'s GPU(s) {} from ~{} (a job whose --time ends before then may use them)",
            self.id,
            self.name,
            list(&self.gpus),
            span(self.at.saturating_sub(now).div_ceil(1000))
        )
    }
}

/// `0,1,3`.
fn list(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What [`decide`] carries from one job of a pass to the next.
struct At<'a, 'p> {
    /// GPUs each user holds or was given in this pass.
    in_use: &'a mut HashMap<&'p str, u32>,
    /// Victims already given to a job of this pass.
    claimed: &'a mut HashSet<&'p str>,
    /// Jobs ahead that did not start, by tier.
    ahead: &'a [u32],
    /// The tier the job is ordered at.
    tier: Tier,
    /// The backfill reservation, once a job has it.
    reservation: &'a mut Option<Reservation>,
}

/// `job`'s ranking with the reservation's GPUs free now kept from it,
/// unless it would be done before the reservation begins; and whether
/// they were kept from it.
fn ranked(
    cluster: &mut Cluster,
    job: &Job,
    now: Millis,
    policy: &Policy,
    res: Option<&Reservation>,
) -> (Ranking, bool) {
    let Some(res) = res.filter(|_| policy.backfill) else {
        return (rank(cluster, job, now, policy), false);
    };
    if res.ends_before(job, 0.0, now) {
        let r = rank(cluster, job, now, policy);
        // The fetch before its start may make it end too late after all.
        let overruns = |c: &Choice| res.taken_by(c) && !res.ends_before(job, c.start_secs, now);
        if !r.choice.as_ref().is_some_and(overruns)
            && !r.best_free_now().is_some_and(|c| overruns(&c))
        {
            return (r, false);
        }
    }
    let mut kept = Vec::new();
    for g in cluster.nodes_mut()[res.node].gpus.iter_mut() {
        if res.gpus.contains(&g.index) && g.slot == Slot::Free {
            kept.push((g.index, g.memory_free));
            g.slot = Slot::Busy { until: None };
        }
    }
    let r = rank(cluster, job, now, policy);
    for g in cluster.nodes_mut()[res.node].gpus.iter_mut() {
        if let Some(&(_, free)) = kept.iter().find(|(i, _)| *i == g.index) {
            g.slot = Slot::Free;
            g.memory_free = free;
        }
    }
    let kept_off = !kept.is_empty();
    (r, kept_off)
}

fn decide<'p>(
    cluster: &mut Cluster,
    pass: &Pass<'p>,
    policy: &Policy,
    q: &'p Queued,
    at: &mut At<'_, 'p>,
) -> Decision {
    let now = pass.now;
    let id = q.id.clone();
    let ahead = at.ahead;
    let used = at.in_use.get(q.user.as_str()).copied().unwrap_or(0);
    if let Some(cap) = policy.user_gpu_cap {
        if q.job.gpus > 0 && used + q.job.gpus > cap {
            return Decision::Wait {
                id,
                why: format!(
                    "{}; {} has {used} GPU(s) running and the lab's cap is {cap} per user{}",
                    needs(&q.job),
                    q.user,
                    ahead_of(ahead, at.tier, pass.ladder)
                ),
                likely: None,
            };
        }
    }
    let (ranking, kept_off) = ranked(cluster, &q.job, now, policy, at.reservation.as_ref());
    let waited = now.saturating_sub(q.submitted) as f64 / 1000.0;
    let start = match &ranking.choice {
        Some(c) if c.gpus_free_now => Some(c.clone()),
        // Waiting for the data's node is bounded by the fetch elsewhere.
        Some(_) => ranking
            .best_free_now()
            .filter(|free| waited >= free.start_secs),
        None => None,
    };
    if let Some(choice) = start {
        reserve(cluster, &q.job, &choice, now);
        *at.in_use.entry(q.user.as_str()).or_default() += q.job.gpus;
        return Decision::Start { id, choice };
    }
    if policy.preemption {
        if let Some(d) = preempt(cluster, pass, q, at.claimed, ahead, at.tier) {
            // The GPUs it stops jobs for are the user's from now on (their
            // cap holds for their other jobs in this pass).
            *at.in_use.entry(q.user.as_str()).or_default() += q.job.gpus;
            return d;
        }
    }
    let kept = match (kept_off, at.reservation.as_ref()) {
        (true, Some(r)) => format!("; {}", r.words(now)),
        _ => String::new(),
    };
    let d = match &ranking.choice {
        Some(choice) => {
            // The first job that cannot start has the GPUs it waits for
            // from when they are expected free.
            let gpu_secs = (ranking.rows.iter())
                .find(|r| r.node == choice.node)
                .and_then(|r| match r.gpu_wait {
                    GpuWait::In { secs } => Some(secs),
                    _ => None,
                });
            let mut held = String::new();
            let due = waited >= policy.reserve_after_secs as f64;
            if let (None, Some(secs), true) =
                (at.reservation.as_ref(), gpu_secs, policy.backfill && due)
            {
                let res = Reservation {
                    id: q.id.clone(),
                    node: cluster.index_of(&choice.node).expect("a ranked node"),
                    name: choice.node.clone(),
                    at: now + (secs * 1000.0).ceil() as Millis,
                    gpus: choice.gpus.clone(),
                };
                held = format!(
                    "; {}'s GPU(s) {} are held for it from then",
                    res.name,
                    list(&res.gpus)
                );
                *at.reservation = Some(res);
            }
            waits_for(pass, q, id, choice, gpu_secs, at.tier, ahead, &held)
        }
        None => no_start(pass, q, id, &ranking, ahead, at.tier),
    };
    match d {
        Decision::Wait { id, why, likely } if !kept.is_empty() => Decision::Wait {
            id,
            why: why + &kept,
            likely,
        },
        d => d,
    }
}

/// `q` waits for `choice`'s node, whose GPUs are expected free in
/// `gpu_secs`: the job whose end frees the last of them is named, with
/// whether that end is its limit or an estimate; else the holders there.
#[allow(clippy::too_many_arguments)]
fn waits_for(
    pass: &Pass,
    q: &Queued,
    id: String,
    choice: &Choice,
    gpu_secs: Option<f64>,
    tier: Tier,
    ahead: &[u32],
    held: &str,
) -> Decision {
    let on_node = || pass.running.iter().filter(|r| r.node == choice.node);
    let by = gpu_secs
        .and_then(|s| {
            let by = pass.now + (s * 1000.0).ceil() as Millis;
            on_node()
                .filter_map(|r| Some((r, r.ends?)))
                .filter(|(_, e)| e.at <= by + 1000)
                .max_by_key(|(r, e)| (e.at, r.id.as_str()))
        })
        .map(|(r, e)| format!(" ({}'s {})", r.id, e.word()));
    let by = by.unwrap_or_else(|| {
        let holders: Vec<String> = on_node().map(|r| format!("{}, {}", r.id, r.user)).collect();
        if holders.is_empty() {
            String::new()
        } else {
            format!(" ({})", holders.join("; "))
        }
    });
    // The later of the GPUs' wait and the fetch there.
    let when = gpu_secs.map_or(choice.start_secs, |g| g.max(choice.start_secs));
    Decision::Wait {
        id,
        why: format!(
            "{}; {}: {} GPU(s) free in ~{}{by}{held}{}",
            needs(&q.job),
            choice.node,
            q.job.gpus,
            span(when.ceil() as u64),
            ahead_of(ahead, tier, pass.ladder)
        ),
        likely: Some(choice.node.clone()),
    }
}

/// `q` has no start estimate anywhere: never, if no node could ever run
/// it (down nodes count with the GPUs they last reported); else it waits,
/// each node saying why.
fn no_start(
    pass: &Pass,
    q: &Queued,
    id: String,
    ranking: &Ranking,
    ahead: &[u32],
    tier: Tier,
) -> Decision {
    let never = !ranking.rows.is_empty()
        && ranking
            .rows
            .iter()
            .all(|r| matches!(r.gpu_wait, GpuWait::Never { .. }));
    let why = ranking
        .rows
        .iter()
        .map(|r| match (&r.verdict, &r.gpu_wait) {
            (Verdict::Down { .. }, _) => format!("{}: down", r.node),
            (_, GpuWait::Never { why } | GpuWait::Unknown { why }) => {
                format!("{}: {why}", r.node)
            }
            _ => format!("{}: no start estimate", r.node),
        })
        .collect::<Vec<_>>()
        .join("; ");
    let why = if ranking.rows.is_empty() {
        "no node has joined the cluster".to_string()
    } else {
        why
    };
    if never {
        Decision::Never { id, why }
    } else {
        Decision::Wait {
            id,
            why: format!(
                "{}; {why}{}",
                needs(&q.job),
                ahead_of(ahead, tier, pass.ladder)
            ),
            likely: None,
        }
    }
}

/// `needs 2 GPU(s) with 10.0 GiB`.
fn needs(job: &Job) -> String {
    if job.gpu_mem > 0 {
        format!(
            "needs {} GPU(s) with {:.1} GiB",
            job.gpus,
            job.gpu_mem as f64 / (1u64 << 30) as f64
        )
    } else {
        format!("needs {} GPU(s)", job.gpus)
    }
}

/// `; 3 deadline-tier job(s) ahead` for the jobs of the same or higher
/// tiers ahead of this one that did not start.
fn ahead_of(ahead: &[u32], tier: Tier, ladder: &Ladder) -> String {
    let parts: Vec<String> = ahead
        .iter()
        .enumerate()
        .take(tier.0 as usize + 1)
        .filter(|(_, &n)| n > 0)
        .map(|(t, n)| format!("{n} {}-tier job(s) ahead", ladder.name(Tier(t as u8))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("; {}", parts.join(", "))
    }
}

/// A node where stopping jobs frees enough GPUs: (jobs that must be told
/// to stop, GPUs they free, the node's index, the jobs, the GPUs the job
/// would get).
type Freed<'p> = (usize, u32, usize, Vec<&'p Running>, Vec<u32>);

/// Stops preemptible jobs of lower tiers for `q`, where that frees enough
/// GPUs; or waits for jobs already stopping. `None`: nothing to stop.
fn preempt<'p>(
    cluster: &mut Cluster,
    pass: &Pass<'p>,
    q: &Queued,
    claimed: &mut HashSet<&'p str>,
    ahead: &[u32],
    tier: Tier,
) -> Option<Decision> {
    let job = &q.job;
    if job.gpus == 0 {
        return None;
    }
    let mut best: Option<Freed<'p>> = None;
    for (i, node) in cluster.nodes().iter().enumerate() {
        let Some(freed) = freed_on(i, node, pass, q, claimed) else {
            continue;
        };
        if best
            .as_ref()
            .is_none_or(|(t, f, ..)| (freed.0, freed.1) < (*t, *f))
        {
            best = Some(freed);
        }
    }
    let (told, _, i, victims, gpus) = best?;
    if victims.is_empty() {
        return None;
    }
    let node = cluster.nodes()[i].name().clone();
    for r in &victims {
        claimed.insert(r.id.as_str());
    }
    // Its GPUs are spoken for: later jobs of the pass do not take the free
    // ones it counted on.
    for g in cluster.nodes_mut()[i].gpus.iter_mut() {
        if gpus.contains(&g.index) {
            g.slot = Slot::Busy { until: None };
            g.memory_free = 0;
        }
    }
    Some(stop_or_wait(pass, q, node, told, &victims, ahead, tier))
}

/// What stopping `victims` on node `i` would free for `q`: the GPUs free
/// there, then those of jobs stopping already, of the lowest tiers, of the
/// smallest. `None` when that is not enough (or the node is not up).
fn freed_on<'p>(
    i: usize,
    node: &crate::NodeView,
    pass: &Pass<'p>,
    q: &Queued,
    claimed: &HashSet<&'p str>,
) -> Option<Freed<'p>> {
    let job = &q.job;
    if !node.is_up() {
        return None;
    }
    {
        let fits = |index: u32| {
            node.gpus
                .iter()
                .any(|g| g.index == index && g.memory_total >= job.gpu_mem)
        };
        let mut gpus: Vec<u32> = node
            .gpus
            .iter()
            .filter(|g| g.slot == Slot::Free && g.memory_free >= job.gpu_mem)
            .map(|g| g.index)
            .collect();
        // Stopping ones first (free already), then the lowest tiers, then
        // the smallest.
        let mut candidates: Vec<&'p Running> = pass
            .running
            .iter()
            .filter(|r| {
                &r.node == node.name()
                    && !claimed.contains(r.id.as_str())
                    && (r.stopping || (r.preemptible && r.tier > q.tier))
            })
            .collect();
        candidates.sort_by(|a, b| {
            b.stopping
                .cmp(&a.stopping)
                .then(b.tier.cmp(&a.tier))
                .then(a.gpus.len().cmp(&b.gpus.len()))
                .then(a.id.cmp(&b.id))
        });
        let mut victims = Vec::new();
        for r in candidates {
            if gpus.len() >= job.gpus as usize {
                break;
            }
            // A GPU counts once: a stopping job's may read free already.
            let usable: Vec<u32> = (r.gpus.iter().copied())
                .filter(|&g| fits(g) && !gpus.contains(&g))
                .collect();
            if usable.is_empty() {
                continue;
            }
            gpus.extend(usable);
            victims.push(r);
        }
        if gpus.len() < job.gpus as usize {
            return None;
        }
        let told = victims.iter().filter(|r| !r.stopping).count();
        let freed: u32 = victims.iter().map(|r| r.gpus.len() as u32).sum();
        Some((told, freed, i, victims, gpus))
    }
}

/// The decision for `q` once `victims` on `node` are chosen: wait for
/// those stopping already (`told` is 0), or stop the others.
fn stop_or_wait(
    pass: &Pass,
    q: &Queued,
    node: crate::NodeName,
    told: usize,
    victims: &[&Running],
    ahead: &[u32],
    tier: Tier,
) -> Decision {
    let job = &q.job;
    let names: Vec<String> = victims
        .iter()
        .map(|r| format!("{} ({}, {})", r.id, r.user, pass.ladder.name(r.tier)))
        .collect();
    let stopping: Vec<String> = victims
        .iter()
        .filter(|r| r.stopping)
        .map(|r| r.id.clone())
        .collect();
    if told == 0 {
        return Decision::Wait {
            id: q.id.clone(),
            why: format!(
                "{}; waits for {} to stop on {node} (preempted: SIGTERM sent, SIGKILL after \
                 the node's kill_grace_s, 10 s unless set){}",
                needs(job),
                stopping.join(", "),
                ahead_of(ahead, tier, pass.ladder)
            ),
            likely: Some(node),
        };
    }
    Decision::Preempt {
        id: q.id.clone(),
        why: format!(
            "{}; stops preemptible {} on {node} (SIGTERM, SIGKILL after the node's \
             kill_grace_s, 10 s unless set)",
            needs(job),
            names.join(", ")
        ),
        node,
        victims: victims
            .iter()
            .filter(|r| !r.stopping)
            .map(|r| r.id.clone())
            .collect(),
    }
}

/// Marks a start in the view: the GPUs busy until the job's expected end,
/// its packs present at the node.
pub fn reserve(cluster: &mut Cluster, job: &Job, choice: &Choice, now: Millis) {
    let Some(i) = cluster.index_of(&choice.node) else {
        return;
    };
    let until = job
        .expected_secs
        .map(|s| now + ((choice.start_secs + s as f64) * 1000.0) as Millis);
    for g in cluster.nodes_mut()[i].gpus.iter_mut() {
        if choice.gpus.contains(&g.index) {
            g.slot = Slot::Busy { until };
            g.memory_free = 0;
        }
    }
    let (packs, _) = cluster.packs_of(&job.needs);
    for p in packs {
        cluster.mark(i, p);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::place::tests::{cache, job, n, node, snapshot, GIB};
    use crate::{Gpu, Health, PackKey, Rates, SnapshotKey};

    fn q(id: &str, job: Job) -> Queued {
        Queued {
            id: id.into(),
            job,
            user: "u".into(),
            tier: Tier(2),
            submitted: 0,
            preemptible: false,
        }
    }

    /// A pass of `queue` alone: one user, nothing running.
    fn fcfs(c: &mut Cluster, queue: &[Queued], now: Millis, policy: &Policy) -> Vec<Decision> {
        let pass = Pass {
            queue,
            running: &[],
            usage: &Usage::default(),
            ladder: &Ladder::default(),
            now,
        };
        plan(c, &pass, policy)
    }

    #[test]
    fn a_job_that_cannot_start_does_not_block_the_next() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 2);
        node(&mut c, "b", 2, 2);
        let d = fcfs(
            &mut c,
            &[q("j1", job(4, &[])), q("j2", job(1, &[]))],
            0,
            &Policy::default(),
        );
        assert!(
            matches!(&d[0], Decision::Wait { id, why, likely: None }
                if id == "j1" && why.contains("a: 2 of 4 GPU(s) busy with no known end")),
            "{:?}",
            d[0]
        );
        assert!(matches!(&d[1], Decision::Start { id, .. } if id == "j2"));
    }

    #[test]
    fn a_job_no_node_can_ever_run_is_never() {
        let mut c = Cluster::new();
        node(&mut c, "a", 4, 0);
        node(&mut c, "b", 4, 0);
        c.node_mut(&n("b")).unwrap().health = Health::Down { since: 1 };
        let d = fcfs(&mut c, &[q("j1", job(8, &[]))], 0, &Policy::default());
        let Decision::Never { why, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert!(
            why.contains("a: has 4 GPU(s) (of 4); the job asks for 8"),
            "{why}"
        );
        let d = fcfs(
            &mut Cluster::new(),
            &[q("j1", job(1, &[]))],
            0,
            &Policy::default(),
        );
        assert!(
            matches!(&d[0], Decision::Wait { why, .. } if why == "needs 1 GPU(s); no node has joined the cluster")
        );
    }

    #[test]
    fn a_pass_never_offers_a_gpu_twice() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 0);
        node(&mut c, "b", 2, 0);
        let queue: Vec<Queued> = (0..5).map(|i| q(&format!("j{i}"), job(1, &[]))).collect();
        let d = fcfs(&mut c, &queue, 0, &Policy::default());
        let mut taken = HashSet::new();
        for x in &d[..4] {
            let Decision::Start { choice, .. } = x else {
                panic!("{x:?}")
            };
            assert!(taken.insert((choice.node.clone(), choice.gpus[0])), "{x:?}");
        }
        assert!(matches!(&d[4], Decision::Wait { .. }));
        // The view remembers: a second pass before any heartbeat starts nothing.
        let d = fcfs(&mut c, &[q("j9", job(1, &[]))], 0, &Policy::default());
        assert!(matches!(&d[0], Decision::Wait { .. }));
    }

    #[test]
    fn the_second_job_of_a_dataset_follows_the_first() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 0);
        node(&mut c, "b", 2, 0);
        node(&mut c, "c", 2, 0);
        let data = snapshot(&mut c, 1, 1, 4);
        let d = fcfs(
            &mut c,
            &[q("j1", job(1, &[data])), q("j2", job(1, &[data]))],
            0,
            &Policy::default(),
        );
        let node_of = |x: &Decision| match x {
            Decision::Start { choice, .. } => (choice.node.clone(), choice.fetch_bytes),
            other => panic!("{other:?}"),
        };
        let (first, fetched) = node_of(&d[0]);
        assert_eq!(fetched, 4 * GIB);
        assert_eq!(node_of(&d[1]), (first, 0));
    }

    #[test]
    fn expected_ends_let_later_passes_plan_ahead() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        let mut j = job(1, &[]);
        j.expected_secs = Some(60);
        fcfs(&mut c, &[q("j1", j.clone())], 1_000, &Policy::default());
        let d = fcfs(&mut c, &[q("j2", j)], 1_000, &Policy::default());
        assert!(
            matches!(&d[0], Decision::Wait { why, likely: Some(x), .. }
                if x.as_str() == "a" && why.contains("a: 1 GPU(s) free in ~60 s")),
            "{:?}",
            d[0]
        );
    }

    pub(crate) fn running(
        id: &str,
        user: &str,
        tier: u8,
        node: &str,
        gpus: &[u32],
        preemptible: bool,
    ) -> Running {
        Running {
            id: id.into(),
            user: user.into(),
            tier: Tier(tier),
            node: n(node),
            gpus: gpus.to_vec(),
            preemptible,
            stopping: false,
            ends: None,
        }
    }

    pub(crate) fn of(id: &str, user: &str, tier: u8, submitted: Millis, job: Job) -> Queued {
        Queued {
            id: id.into(),
            job,
            user: user.into(),
            tier: Tier(tier),
            submitted,
            preemptible: false,
        }
    }

    pub(crate) fn pass<'a>(
        queue: &'a [Queued],
        running: &'a [Running],
        usage: &'a Usage,
        now: Millis,
    ) -> Pass<'a> {
        Pass {
            queue,
            running,
            usage,
            ladder: Box::leak(Box::new(Ladder::default())),
            now,
        }
    }

    #[test]
    fn tiers_go_first_then_the_least_used_then_the_oldest() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        let mut usage = Usage::default();
        usage.add("carol", 3600.0, 0);
        let queue = [
            of("bob1", "bob", 3, 0, job(1, &[])),
            of("carol1", "carol", 2, 1_000, job(1, &[])),
            of("alice1", "alice", 2, 5_000, job(1, &[])),
            of("alice2", "alice", 2, 6_000, job(1, &[])),
        ];
        let ids: Vec<&str> = order(&pass(&queue, &[], &usage, 10_000), &Policy::default())
            .iter()
            .map(|q| q.id.as_str())
            .collect();
        assert_eq!(ids, ["alice1", "alice2", "carol1", "bob1"]);
        let d = plan(
            &mut c,
            &pass(&queue, &[], &usage, 10_000),
            &Policy::default(),
        );
        let got: Vec<&str> = d.iter().map(|d| d.id()).collect();
        assert_eq!(got, ids);
        assert!(matches!(&d[0], Decision::Start { .. }), "{:?}", d[0]);
        let Decision::Wait { why, .. } = &d[3] else {
            panic!("{:?}", d[3])
        };
        assert!(
            why.starts_with("needs 1 GPU(s); a: 1 of 1 GPU(s) busy"),
            "{why}"
        );
        assert!(why.ends_with("; 2 phd-tier job(s) ahead"), "{why}");
    }

    #[test]
    fn a_user_at_the_cap_waits_and_others_do_not() {
        let mut c = Cluster::new();
        node(&mut c, "a", 3, 1);
        let run = [running("r1", "alice", 2, "a", &[3], false)];
        let queue = [
            of("big", "alice", 2, 0, job(2, &[])),
            of("small", "alice", 2, 1, job(1, &[])),
            of("other", "bob", 2, 2, job(2, &[])),
        ];
        let policy = Policy {
            user_gpu_cap: Some(2),
            ..Policy::default()
        };
        let d = plan(&mut c, &pass(&queue, &run, &Usage::default(), 0), &policy);
        let Decision::Wait { why, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert!(
            why.contains("alice has 1 GPU(s) running and the lab's cap is 2 per user"),
            "{why}"
        );
        assert!(
            matches!(&d[1], Decision::Start { id, .. } if id == "small"),
            "{:?}",
            d[1]
        );
        assert!(
            matches!(&d[2], Decision::Start { id, .. } if id == "other"),
            "{:?}",
            d[2]
        );
    }

    #[test]
    fn preemption_stops_only_preemptible_jobs_of_lower_tiers() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 2);
        node(&mut c, "b", 0, 1);
        let mut run = vec![
            running("r1", "bob", 3, "a", &[0], true),
            running("r2", "carol", 3, "a", &[1], false),
            running("r3", "dave", 1, "b", &[0], true),
        ];
        let usage = Usage::default();
        // A deadline-tier job: only r1 may go (r3 is of its own tier).
        let queue = [of("dl", "erin", 1, 0, job(1, &[]))];
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &run, &usage, 0),
            &Policy::default(),
        );
        let Decision::Preempt {
            node, victims, why, ..
        } = &d[0]
        else {
            panic!("{:?}", d[0])
        };
        assert_eq!(
            (node.as_str(), victims.as_slice()),
            ("a", &["r1".to_string()][..])
        );
        assert!(
            why.contains("stops preemptible r1 (bob, master) on a"),
            "{why}"
        );
        // Two GPUs would need r2, which is not preemptible: it waits.
        let queue2 = [of("dl2", "erin", 1, 0, job(2, &[]))];
        let d = plan(
            &mut c.clone(),
            &pass(&queue2, &run, &usage, 0),
            &Policy::default(),
        );
        assert!(matches!(&d[0], Decision::Wait { .. }), "{:?}", d[0]);
        // A job of bob's own tier stops nothing.
        let queue3 = [of("m", "frank", 3, 0, job(1, &[]))];
        let d = plan(
            &mut c.clone(),
            &pass(&queue3, &run, &usage, 0),
            &Policy::default(),
        );
        assert!(matches!(&d[0], Decision::Wait { .. }), "{:?}", d[0]);
        // Preemption off: nothing stops.
        let off = Policy {
            preemption: false,
            ..Policy::default()
        };
        let d = plan(&mut c.clone(), &pass(&queue, &run, &usage, 0), &off);
        assert!(matches!(&d[0], Decision::Wait { .. }), "{:?}", d[0]);
        // Once r1 is stopping, the next pass waits for it rather than
        // stopping another job.
        run[0].stopping = true;
        let d = plan(&mut c, &pass(&queue, &run, &usage, 0), &Policy::default());
        let Decision::Wait { why, likely, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert!(
            why.contains("waits for r1 to stop on a (preempted: SIGTERM sent, SIGKILL after"),
            "{why}"
        );
        assert_eq!(likely.as_ref().map(|n| n.as_str()), Some("a"));
    }

    #[test]
    fn a_gpu_a_stopping_job_already_freed_counts_once() {
        let mut c = Cluster::new();
        // GPU 0 is free (its stopping job let go of it), GPU 1 is busy.
        node(&mut c, "a", 1, 1);
        let mut stopping = running("r1", "bob", 4, "a", &[0], true);
        stopping.stopping = true;
        let run = [stopping, running("r2", "carol", 4, "a", &[1], true)];
        let queue = [of("big", "erin", 1, 0, job(2, &[]))];
        let d = plan(
            &mut c,
            &pass(&queue, &run, &Usage::default(), 0),
            &Policy::default(),
        );
        let Decision::Preempt { victims, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert_eq!(victims, &["r2".to_string()]);
    }

    #[test]
    fn stopping_jobs_for_a_user_counts_against_their_cap() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 2);
        let run = [
            running("r1", "bob", 4, "a", &[0], true),
            running("r2", "bob", 4, "a", &[1], true),
        ];
        let queue = [
            of("q1", "alice", 1, 0, job(1, &[])),
            of("q2", "alice", 1, 1, job(1, &[])),
        ];
        let capped = Policy {
            user_gpu_cap: Some(1),
            ..Policy::default()
        };
        let d = plan(&mut c, &pass(&queue, &run, &Usage::default(), 0), &capped);
        assert!(
            matches!(&d[0], Decision::Preempt { victims, .. } if victims.len() == 1),
            "{:?}",
            d[0]
        );
        let Decision::Wait { why, .. } = &d[1] else {
            panic!("{:?}", d[1])
        };
        assert!(
            why.contains("alice has 1 GPU(s) running and the lab's cap is 1"),
            "{why}"
        );
    }

    #[test]
    fn a_wait_for_the_datas_node_ends_when_the_fetch_elsewhere_would_have() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 1);
        node(&mut c, "b", 1, 0);
        c.node_mut(&n("a")).unwrap().gpus[0].slot = Slot::Busy {
            until: Some(300_000),
        };
        let data = snapshot(&mut c, 1, 1, 10);
        cache(&mut c, "a", 1, 10);
        // From a peer at 100 MB/s, 10 GiB take 107 s on b; a frees at 300 s.
        let usage = Usage::default();
        let queue = [of("j", "alice", 2, 200_000, job(1, &[data]))];
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &[], &usage, 200_000),
            &Policy::default(),
        );
        let Decision::Wait { likely, why, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert_eq!(likely.as_ref().map(|n| n.as_str()), Some("a"), "{why}");
        assert!(why.contains("a: 1 GPU(s) free in ~100 s"), "{why}");
        // Submitted 106 s before: still within the bound.
        let queue = [of("j", "alice", 2, 94_000, job(1, &[data]))];
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &[], &usage, 200_000),
            &Policy::default(),
        );
        assert!(matches!(&d[0], Decision::Wait { .. }), "{:?}", d[0]);
        // Waited 108 s, more than the 107 s the fetch to b takes: b.
        let queue = [of("j", "alice", 2, 92_000, job(1, &[data]))];
        let d = plan(
            &mut c,
            &pass(&queue, &[], &usage, 200_000),
            &Policy::default(),
        );
        let Decision::Start { choice, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert_eq!((choice.node.as_str(), choice.fetch_bytes), ("b", 10 * GIB));
    }

    /// One node of `gpus` GPUs, GPU `i` busy until `ends[i]` seconds (0:
    /// free), with the running jobs holding them (`r<i>`, limits).
    fn timed(c: &mut Cluster, name: &str, ends: &[u64]) -> Vec<Running> {
        node(c, name, ends.len() as u32, 0);
        let mut run = Vec::new();
        for (i, &e) in ends.iter().enumerate() {
            if e == 0 {
                continue;
            }
            let g = &mut c.node_mut(&n(name)).unwrap().gpus[i];
            g.slot = Slot::Busy {
                until: Some(e * 1000),
            };
            g.memory_free = 0;
            let mut r = running(&format!("{name}r{i}"), "x", 3, name, &[i as u32], false);
            r.ends = Some(Ends {
                at: e * 1000,
                limit: true,
            });
            run.push(r);
        }
        run
    }

    fn timed_job(gpus: u32, secs: Option<u64>) -> Job {
        Job {
            expected_secs: secs,
            limited: true,
            ..job(gpus, &[])
        }
    }

    #[test]
    fn a_big_job_at_the_head_holds_its_gpus_and_only_short_jobs_backfill() {
        let mut c = Cluster::new();
        // One node of 4 GPUs: two free, two busy until 100 s and 3600 s.
        let run = timed(&mut c, "a", &[0, 0, 100, 3600]);
        let queue = [
            of("big", "alice", 2, 0, timed_job(3, Some(600))),
            of("long", "bob", 2, 1, timed_job(1, Some(7200))),
            of("short", "carol", 2, 2, timed_job(1, Some(60))),
            of("unknown", "dave", 2, 3, timed_job(1, None)),
            of(
                "guessed",
                "erin",
                2,
                4,
                Job {
                    limited: false,
                    ..timed_job(1, Some(60))
                },
            ),
        ];
        let at_once = Policy {
            reserve_after_secs: 0,
            ..Policy::default()
        };
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &run, &Usage::default(), 0),
            &at_once,
        );
        let Decision::Wait { why, likely, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert_eq!(likely.as_ref().map(|x| x.as_str()), Some("a"));
        assert!(
            why.contains("a: 3 GPU(s) free in ~100 s (ar2's limit); a's GPU(s) 0,1,2 are held for it from then"),
            "{why}"
        );
        // The 2-hour job would delay it: it waits, told why.
        let Decision::Wait { why, .. } = &d[1] else {
            panic!("{:?}", d[1])
        };
        assert!(
            why.contains("big holds a's GPU(s) 0,1,2 from ~100 s (a job whose --time ends before then may use them)"),
            "{why}"
        );
        // One minute ends before: it starts in the gap.
        assert!(
            matches!(&d[2], Decision::Start { id, choice } if id == "short" && choice.gpus == [0]),
            "{:?}",
            d[2]
        );
        // No known end, or only an estimate (a user's to game): it may not.
        assert!(matches!(&d[3], Decision::Wait { .. }), "{:?}", d[3]);
        assert!(matches!(&d[4], Decision::Wait { .. }), "{:?}", d[4]);
        // Without backfill's reservation the long job takes a GPU and the
        // big one waits an hour more.
        let greedy = Policy {
            backfill: false,
            ..at_once.clone()
        };
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &run, &Usage::default(), 0),
            &greedy,
        );
        assert!(matches!(&d[1], Decision::Start { .. }), "{:?}", d[1]);
        // Nor before the big job has waited the reservation age: then it
        // holds nothing, and what fits goes.
        let young = Policy {
            reserve_after_secs: 600,
            ..at_once.clone()
        };
        let d = plan(
            &mut c.clone(),
            &pass(&queue, &run, &Usage::default(), 599_000),
            &young,
        );
        assert!(matches!(&d[1], Decision::Start { .. }), "{:?}", d[1]);
        let d = plan(
            &mut c,
            &pass(&queue, &run, &Usage::default(), 600_000),
            &young,
        );
        assert!(matches!(&d[1], Decision::Wait { .. }), "{:?}", d[1]);
    }

    #[test]
    fn gpus_beyond_the_reservations_are_anyones() {
        let mut c = Cluster::new();
        // 4 free now, 2 more at 100 s; the head needs 5: GPUs 0-4 are held.
        let run = timed(&mut c, "a", &[0, 0, 0, 0, 100, 100]);
        node(&mut c, "b", 1, 0);
        let queue = [
            of("big", "alice", 2, 0, timed_job(5, Some(600))),
            of("x", "bob", 2, 1, timed_job(1, None)),
            of("y", "bob", 2, 2, timed_job(1, None)),
        ];
        let at_once = Policy {
            reserve_after_secs: 0,
            ..Policy::default()
        };
        let d = plan(&mut c, &pass(&queue, &run, &Usage::default(), 0), &at_once);
        assert!(matches!(&d[0], Decision::Wait { .. }), "{:?}", d[0]);
        // Another node's GPU is anyone's; the held ones are not.
        assert!(
            matches!(&d[1], Decision::Start { choice, .. } if choice.node.as_str() == "b"),
            "{:?}",
            d[1]
        );
        assert!(matches!(&d[2], Decision::Wait { .. }), "{:?}", d[2]);
    }

    #[test]
    fn a_waiting_job_rises_a_tier_a_day_but_never_to_the_deadline_tier() {
        let ladder = Ladder::default();
        let policy = Policy::default();
        const DAY: Millis = 86_400_000;
        let undergrad = of("u", "bob", 4, 0, job(1, &[]));
        let tier = |now| effective_tier(&undergrad, now, &ladder, &policy);
        assert_eq!(tier(DAY - 1), Tier(4));
        assert_eq!(tier(DAY), Tier(3));
        assert_eq!(tier(2 * DAY), Tier(2));
        // PhD is as high as waiting takes anyone: deadline and lead stay ahead.
        assert_eq!(tier(30 * DAY), Tier(2));
        let lead = of("l", "lead", 0, 0, job(1, &[]));
        assert_eq!(effective_tier(&lead, 30 * DAY, &ladder, &policy), Tier(0));
        let off = Policy {
            aging_secs: None,
            ..Policy::default()
        };
        assert_eq!(effective_tier(&undergrad, 30 * DAY, &ladder, &off), Tier(4));
        // In the queue: an undergraduate's job of two days ago goes before
        // a PhD student's of today, and after a deadline job of today.
        let queue = [
            of("phd", "carol", 2, 2 * DAY, job(1, &[])),
            of("old", "bob", 4, 0, job(1, &[])),
            of("dl", "erin", 1, 2 * DAY, job(1, &[])),
        ];
        let usage = Usage::default();
        let ids: Vec<&str> = order(&pass(&queue, &[], &usage, 2 * DAY), &policy)
            .iter()
            .map(|q| q.id.as_str())
            .collect();
        assert_eq!(ids, ["dl", "old", "phd"]);
        // Within a tier, a heavy user's job that has waited a day is no
        // longer held back by fair share: it goes by submit time.
        let mut usage = Usage::default();
        usage.add("heavy", 1e6, 0);
        let queue = [
            of("light", "carol", 2, DAY, job(1, &[])),
            of("heavy", "heavy", 2, 0, job(1, &[])),
        ];
        let at = |now| -> Vec<String> {
            order(&pass(&queue, &[], &usage, now), &policy)
                .iter()
                .map(|q| q.id.clone())
                .collect()
        };
        assert_eq!(at(DAY - 1), ["light", "heavy"]);
        assert_eq!(at(DAY), ["heavy", "light"]);
    }

    /// A random cluster: up to 6 nodes of up to 4 GPUs in random states, up
    /// to 6 snapshots over 12 packs, random caches.
    fn cluster() -> impl Strategy<Value = (Cluster, Vec<SnapshotKey>)> {
        let gpu = (0u8..4, 1u64..4, 0u64..2000);
        let node = (prop::collection::vec(gpu, 0..5), any::<bool>(), 0u16..4096);
        let snap = prop::collection::vec(0u8..12, 0..6);
        (
            prop::collection::vec(node, 0..7),
            prop::collection::vec(snap, 1..7),
        )
            .prop_map(|(nodes, snaps)| {
                let mut c = Cluster::new();
                let keys: Vec<SnapshotKey> = snaps
                    .iter()
                    .enumerate()
                    .map(|(i, packs)| {
                        let key = SnapshotKey([i as u8; 32]);
                        c.add_snapshot(
                            key,
                            packs
                                .iter()
                                .map(|&p| (PackKey([p; 32]), (p as u64 + 1) * GIB)),
                        );
                        key
                    })
                    .collect();
                for (i, (gpus, down, cached)) in nodes.into_iter().enumerate() {
                    let name = n(&format!("n{i}"));
                    let v = c.node_entry(&name);
                    v.health = if down {
                        Health::Down { since: 0 }
                    } else {
                        Health::Up
                    };
                    v.rates = Rates {
                        peer: 1e8,
                        store: 5e7,
                    };
                    v.gpus = gpus
                        .into_iter()
                        .enumerate()
                        .map(|(g, (state, mem, end))| {
                            let slot = match state {
                                0 => Slot::Free,
                                1 => Slot::Busy { until: None },
                                2 => Slot::Busy {
                                    until: Some(end * 1000),
                                },
                                _ => Slot::Unavailable,
                            };
                            Gpu {
                                index: g as u32,
                                memory_total: mem * 8 * GIB,
                                memory_free: if slot == Slot::Free { mem * 8 * GIB } else { 0 },
                                slot,
                            }
                        })
                        .collect();
                    for p in 0..12u8 {
                        if cached & (1 << p) != 0 {
                            c.set_cached(&name, PackKey([p; 32]), (p as u64 + 1) * GIB, true);
                        }
                    }
                }
                (c, keys)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Whatever the cluster: a start goes to an up node, on GPUs that
        /// were free with the memory asked for, never one GPU twice; and
        /// no node could have started the job clearly sooner.
        #[test]
        fn starts_are_on_free_gpus_once_and_earliest(
            (cluster, keys) in cluster(),
            jobs in prop::collection::vec((0u32..4, 0u64..3, prop::collection::vec(0usize..6, 0..3)), 1..12),
        ) {
            let policy = Policy::default();
            let queue: Vec<Queued> = jobs
                .iter()
                .enumerate()
                .map(|(i, (gpus, mem, needs))| q(&format!("j{i}"), Job {
                    gpus: *gpus,
                    gpu_mem: mem * 8 * GIB,
                    needs: needs.iter().map(|&k| keys[k % keys.len()]).collect(),
                    expected_secs: None,
                    limited: false,
                }))
                .collect();
            let mut view = cluster.clone();
            let mut taken = HashSet::new();
            for (x, qd) in queue.iter().enumerate() {
                let before = view.clone();
                let r = rank(&before, &qd.job, 0, &policy);
                let d = fcfs(&mut view, std::slice::from_ref(qd), 0, &policy);
                match &d[0] {
                    Decision::Start { choice, .. } => {
                        let v = before.node(&choice.node).unwrap();
                        prop_assert!(v.is_up());
                        prop_assert_eq!(choice.gpus.len(), qd.job.gpus as usize);
                        for g in &choice.gpus {
                            let gpu = v.gpus.iter().find(|x| x.index == *g).unwrap();
                            prop_assert_eq!(&gpu.slot, &Slot::Free);
                            prop_assert!(gpu.memory_free >= qd.job.gpu_mem);
                            prop_assert!(taken.insert((choice.node.clone(), *g)), "GPU given twice at job {}", x);
                        }
                        for row in &r.rows {
                            if let Some(s) = row.start_secs {
                                prop_assert!(choice.start_secs <= s + policy.tie_secs);
                            }
                        }
                    }
                    Decision::Never { .. } => {
                        let all_never = r.rows.iter().all(|row| matches!(row.gpu_wait, GpuWait::Never { .. }));
                        prop_assert!(all_never);
                    }
                    Decision::Wait { .. } => {
                        prop_assert!(r.choice.as_ref().is_none_or(|c| !c.gpus_free_now));
                    }
                    // Nothing runs in this view.
                    Decision::Preempt { .. } => prop_assert!(false, "{:?}", d[0]),
                }
            }
        }
    }
}
