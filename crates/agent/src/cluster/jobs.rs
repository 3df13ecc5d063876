//! What the coordinator does with jobs: takes submissions into its queue,
//! places them with the placer each pass, dispatches them to agents (which
//! lease the GPUs themselves and refuse a placement made on a stale view),
//! and answers `labrun ps | logs | kill` for the whole cluster, forwarding
//! to the node that runs a job.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use labsync_placer::{rank, Choice, NodeName, PackKey, Ranking, Slot, SnapshotKey, Warm};
use labsync_store::SnapshotId;

use crate::cluster::queue::{ClusterJob, Placement};
use crate::cluster::{Coordinator, WarmOrder};
use crate::error::{JobError, LeaseError};
use crate::leases::JobState;
use crate::proto::{Dispatch, DispatchReply, Expected, JobId, JobView, SubmitRequest};
use crate::request::{check_user_request, Caller, LogRead};

use super::link::{Link, Reach, FORWARD};
use super::pass::{pass, placer_job, Action, Inputs};

/// The same snapshot is prefetched on the same node again after this long
/// at the soonest (a fetch under way, or data evicted since).
const PREFETCH_AGAIN: Duration = Duration::from_secs(600);

fn db(e: impl std::fmt::Display) -> JobError {
    JobError::Internal(e.to_string())
}

/// A snapshot and its packs with their sizes, read from the store's index.
pub(super) type Priced = (SnapshotId, Arc<Vec<(labsync_store::PackId, u64)>>);

/// Snapshots priced and not kept in the view whose pack lists are kept
/// aside all the same (see [`Coordinator::priced`]).
pub(super) const PRICED_LATELY: usize = 64;

/// The snapshots a request reads (code first).
pub(super) fn snapshots_of(req: &SubmitRequest) -> Vec<SnapshotId> {
    req.code
        .iter()
        .chain(req.data.iter().map(|d| &d.tree))
        .map(|t| t.snapshot)
        .collect()
}

impl Coordinator {
    /// Loads the pack lists of the snapshots the view does not know yet,
    /// from the store's index (once per snapshot: they are immutable).
    pub(super) async fn price(
        &self,
        r: &Reach,
        req: &SubmitRequest,
    ) -> Result<Vec<SnapshotId>, JobError> {
        let (ids, fresh) = self.priced(r, req).await?;
        for (id, packs) in &fresh {
            self.learn(id, packs);
        }
        Ok(ids)
    }

    /// `req`'s snapshots, and the pack lists of those the view does not
    /// know, read from the store's index but not kept: an `--explain` or a
    /// Slurm ranking (any user's, of any snapshot anyone pushed) must not
    /// grow the view every scheduling pass copies.
    pub(super) async fn priced(
        &self,
        r: &Reach,
        req: &SubmitRequest,
    ) -> Result<(Vec<SnapshotId>, Vec<Priced>), JobError> {
        // Bounded for a ranking or an --explain as for a submission.
        crate::request::check_size(req)?;
        let ids = snapshots_of(req);
        let mut fresh: Vec<Priced> = Vec::new();
        for id in &ids {
            if self.knows(id) || fresh.iter().any(|(f, _)| f == id) {
                continue;
            }
            // Asked about again (a Slurm job array's tasks, a user's
            // explains): read once, for the last few snapshots.
            let seen = (self.priced_lately.lock().expect("coordinator poisoned"))
                .iter()
                .find(|(s, _)| s == id)
                .map(|(_, p)| p.clone());
            let packs = match seen {
                Some(p) => p,
                None => {
                    let packs = labsync_store::snapshot_packs(r.repo()?, r.cache(), id)
                        .await
                        .map_err(|e| JobError::Conflict(format!("snapshot {}: {e}", id.short())))?;
                    let packs = Arc::new(packs);
                    let mut lately = self.priced_lately.lock().expect("coordinator poisoned");
                    if lately.len() >= PRICED_LATELY {
                        lately.pop_front();
                    }
                    lately.push_back((*id, packs.clone()));
                    packs
                }
            };
            fresh.push((*id, packs));
        }
        Ok((ids, fresh))
    }

    /// A copy of the view to plan on, knowing `fresh` as well.
    pub(super) fn planning_with(&self, fresh: &[Priced]) -> labsync_placer::Cluster {
        let mut planning = self.view.lock().expect("coordinator poisoned").planning();
        for (id, packs) in fresh {
            planning.add_snapshot(
                SnapshotKey(*id.as_bytes()),
                packs.iter().map(|(p, n)| (PackKey(*p.as_bytes()), *n)),
            );
        }
        planning
    }

    /// Where `req` would go now, and why not elsewhere (`labrun --explain`).
    pub async fn explain(&self, r: &Reach, req: &SubmitRequest) -> Result<Ranking, JobError> {
        self.ranked(r, req, false).await
    }

    /// [`Coordinator::explain`]; with `keep` (a submission, whose passes
    /// place it by them) the snapshots' pack lists stay in the view.
    async fn ranked(
        &self,
        r: &Reach,
        req: &SubmitRequest,
        keep: bool,
    ) -> Result<Ranking, JobError> {
        let (needs, fresh) = if keep {
            (self.price(r, req).await?, Vec::new())
        } else {
            self.priced(r, req).await?
        };
        let now = self.now_ms();
        self.tick(now);
        let live = self.jobs.live();
        let (expected, started) = self.times(&live, now);
        let mut planning = self.planning_with(&fresh);
        super::pass::overlay_ends(&mut planning, &live, &expected, &started);
        // Its own limit only: the asker's tier and history are the queue's.
        let own = (req.time_limit_s).map(|secs| Expected { secs, limit: true });
        Ok(rank(
            &planning,
            &placer_job(req, &needs, own),
            now,
            &self.policy(),
        ))
    }

    /// How long `j` is expected to run ([`super::times`]).
    pub(super) fn expected_of(&self, j: &ClusterJob, now_ms: u64) -> Option<Expected> {
        let tier = super::pass::tier_of(&self.members(), j, now_ms);
        let mut runs = self.runs.lock().expect("coordinator poisoned");
        let runs = runs.get_or_insert_with(|| {
            let mut runs = super::times::Runs::default();
            match self.jobs.ended() {
                Ok(mut ended) => {
                    ended.sort_by_key(|x| x.number());
                    for x in &ended {
                        if let Placement::Ended { view } = &x.placement {
                            runs.learn(&x.user, &x.req, view);
                        }
                    }
                }
                Err(e) => tracing::error!("cluster jobs (for estimates): {e}"),
            }
            runs
        });
        super::times::expected(&j.user, &j.req, tier, &self.time_limits, runs)
    }

    /// How long each of `live` is expected to run, and when those
    /// dispatched started on their nodes (Unix seconds), as heartbeats say.
    fn times(
        &self,
        live: &[ClusterJob],
        now_ms: u64,
    ) -> (HashMap<JobId, Expected>, HashMap<JobId, u64>) {
        let expected = (live.iter())
            .filter_map(|j| Some((j.id.clone(), self.expected_of(j, now_ms)?)))
            .collect();
        let v = self.view.lock().expect("coordinator poisoned");
        let started = (v.members.values())
            .flat_map(|m| m.jobs.iter())
            .filter_map(|x| Some((x.id.clone(), x.started_at?)))
            .collect();
        (expected, started)
    }

    /// Takes a submission into the queue. Refused at once when no node of
    /// the cluster could ever run it as asked.
    pub async fn submit(
        self: &Arc<Self>,
        r: &Reach,
        caller: &Caller,
        req: SubmitRequest,
    ) -> Result<JobView, JobError> {
        check_user_request(&req)?;
        // A tier the user may not have is refused now, not at placing.
        self.members()
            .tier_for(&caller.user, req.priority.as_deref(), self.now_ms())
            .map_err(|e| JobError::Forbidden(format!("--priority: {e}")))?;
        if let Some(cap) = self.policy().user_gpu_cap.filter(|&c| req.gpus > c) {
            return Err(JobError::Conflict(format!(
                "asks for {} GPUs and the lab's cap is {cap} per user ([lab] \
                 max_gpus_per_user): it could never start",
                req.gpus
            )));
        }
        // Said before the store is read; counted again as the job is made.
        let queued = self.jobs.queued_of(&caller.user);
        if queued >= r.max_queued_per_user() {
            return Err(JobError::Busy(super::queue::too_many(&caller.user, queued)));
        }
        self.check_labels(r, &req).await?;
        let ranking = self.ranked(r, &req, true).await?;
        if !ranking.rows.is_empty()
            && ranking
                .rows
                .iter()
                .all(|r| matches!(r.gpu_wait, labsync_placer::GpuWait::Never { .. }))
        {
            let why: Vec<String> = ranking
                .rows
                .iter()
                .filter_map(|r| match &r.gpu_wait {
                    labsync_placer::GpuWait::Never { why } => Some(format!("{}: {why}", r.node)),
                    _ => None,
                })
                .collect();
            return Err(JobError::Conflict(format!(
                "no node of the cluster can run it: {}",
                why.join("; ")
            )));
        }
        let floor = self.floor.load(std::sync::atomic::Ordering::Relaxed);
        let job = (self.jobs)
            .create_queued(
                &caller.user,
                req,
                self.clock.unix_secs(),
                floor,
                r.max_queued_per_user(),
            )
            .map_err(|e| match e {
                LeaseError::TooMany(m) => JobError::Busy(m),
                e => db(e),
            })?;
        tracing::info!("job {} of {} queued in the cluster", job.id, job.user);
        self.wake.notify_one();
        Ok(self.view_of(&job))
    }

    /// Each tree's label is a version (`NAME@vN`) whose snapshot is the
    /// one the request names. Nodes fetch a queued job's data ahead by its
    /// label, and the label a job says for a snapshot is the one used:
    /// unchecked, a user could make nodes fetch any dataset, or hold up
    /// another user's prefetch with a label that fails.
    async fn check_labels(&self, r: &Reach, req: &SubmitRequest) -> Result<(), JobError> {
        /// Checked labels kept at most (then forgotten and read again).
        const KEPT: usize = 100_000;
        for t in req.code.iter().chain(req.data.iter().map(|x| &x.tree)) {
            let known = self
                .checked_labels
                .lock()
                .expect("coordinator poisoned")
                .get(&t.label)
                == Some(&t.snapshot);
            if known {
                continue;
            }
            let spec: labsync_store::RefSpec = t
                .label
                .parse()
                .ok()
                .filter(|s: &labsync_store::RefSpec| s.version.is_some())
                .ok_or_else(|| {
                    JobError::Invalid(format!("{:?} is not a version (NAME@vN)", t.label))
                })?;
            let rec = r.repo()?.resolve(&spec).await.map_err(|e| {
                JobError::Invalid(format!("{}: {}", t.label, crate::blocking::chain(&e)))
            })?;
            if rec.snapshot != t.snapshot {
                return Err(JobError::Invalid(format!(
                    "{} is snapshot {}, not {}",
                    t.label,
                    rec.snapshot.short(),
                    t.snapshot
                )));
            }
            let mut checked = self.checked_labels.lock().expect("coordinator poisoned");
            if checked.len() >= KEPT {
                checked.clear();
            }
            checked.insert(t.label.clone(), t.snapshot);
        }
        Ok(())
    }

    /// One scheduling pass: dispatches sent again where unanswered, queued
    /// jobs placed in order, the records of jobs that ended on their nodes
    /// collected. What to do is decided by `cluster/pass.rs` (pure), from what
    /// is read here; this carries it out.
    pub async fn schedule(self: &Arc<Self>, r: &Reach) {
        let now = self.now_ms();
        self.tick(now);
        let live = self.jobs.live();
        self.forget_promises(&live);
        let collect = self.collect_due();
        let (expected, started) = self.times(&live, now);
        self.charge_running(&live, &started);
        let mut needs = HashMap::new();
        for j in &live {
            if matches!(j.placement, Placement::Queued { .. }) {
                let priced = self.price(r, &j.req).await.map_err(|e| e.to_string());
                needs.insert(j.id.clone(), priced);
            }
        }
        let actions = {
            let mut v = self.view.lock().expect("coordinator poisoned");
            let ended_on_nodes: HashSet<JobId> = (v.members.values())
                .flat_map(|m| m.jobs.iter().filter(|x| x.ended()).map(|x| x.id.clone()))
                .collect();
            let mut scratch = v.planning();
            let usage = self.usage.lock().expect("coordinator poisoned");
            let (members, policy) = (self.members(), self.policy());
            let inputs = Inputs {
                jobs: &live,
                needs: &needs,
                ended_on_nodes: &ended_on_nodes,
                members: &members,
                usage: &usage,
                policy: &policy,
                expected: &expected,
                started: &started,
                now_ms: now,
                collect,
            };
            let actions = pass(&mut scratch, &inputs);
            // The GPUs of each dispatch are promised before it is sent.
            for a in &actions {
                if let Action::Dispatch { id, choice } = a {
                    let promised = v.promised.entry(choice.node.clone()).or_default();
                    for g in &choice.gpus {
                        promised.insert(*g, id.clone());
                    }
                }
            }
            actions
        };
        let by_id: HashMap<&str, &ClusterJob> = live.iter().map(|j| (j.id.as_str(), j)).collect();
        for a in actions {
            self.carry_out(r, a, &by_id, &live).await;
        }
    }

    /// Whether ended jobs are looked for in this pass: once a second, not
    /// every pass.
    fn collect_due(&self) -> bool {
        let mut last = self.collected.lock().expect("coordinator poisoned");
        let due = last.is_none_or(|t| self.clock.since(t) >= Duration::from_secs(1));
        if due {
            *last = Some(self.clock.instant());
        }
        due
    }

    /// Carries out one action of a pass over `live` (`by_id`).
    async fn carry_out(
        self: &Arc<Self>,
        r: &Reach,
        a: Action,
        by_id: &HashMap<&str, &ClusterJob>,
        live: &[ClusterJob],
    ) {
        match a {
            Action::End { id, why } => match self.jobs.get(&id) {
                Ok(Some(j)) => self.end(&j, why),
                Ok(None) => {}
                Err(e) => tracing::error!("cluster jobs: {e}"),
            },
            Action::Resend { id } => {
                if let Some(j) = by_id.get(id.as_str()) {
                    self.send(r, (*j).clone());
                }
            }
            Action::StopAgain { id, node, for_job } => {
                let _ = self.jobs.update(&id, |x| {
                    x.preempted_at = self.clock.unix_secs();
                    true
                });
                self.send_stop(r, &node, &id, &for_job);
            }
            Action::Collect { id } => {
                if let Some(j) = by_id.get(id.as_str()) {
                    self.collect_if_ended(r, j).await;
                }
            }
            Action::Prefetch(warms) => self.send_prefetches(r, live, warms),
            Action::Dispatch { id, choice } => self.dispatch(r, &id, &choice),
            Action::Preempt { id, victims, why } => {
                self.preempt(r, &id, &victims);
                self.set_why(&id, why);
            }
            Action::SetWhy { id, why } => self.set_why(&id, why),
        }
    }

    /// Records queued job `id` as dispatched to `choice` and sends it; a
    /// job killed (or placed) since the plan was made is left alone.
    fn dispatch(self: &Arc<Self>, r: &Reach, id: &str, choice: &Choice) {
        let mut placing = false;
        let placed = self.jobs.update(id, |j| {
            if !matches!(j.placement, Placement::Queued { .. }) {
                return false;
            }
            placing = true;
            j.placement = Placement::Dispatched {
                node: choice.node.clone(),
                gpus: choice.gpus.clone(),
                at: self.clock.unix_secs(),
                confirmed: false,
                est_ms: Some((choice.start_secs.max(0.0) * 1000.0) as u64),
            };
            true
        });
        match placed {
            Ok(Some(j)) if placing => {
                tracing::info!(
                    "job {id} placed on {} GPU(s) {:?}, {} to fetch",
                    choice.node,
                    choice.gpus,
                    choice.fetch_bytes
                );
                self.send(r, j)
            }
            Ok(_) => {}
            Err(e) => tracing::error!("cluster jobs: {e}"),
        }
    }

    /// Sends each node the data to warm for the jobs waiting (not pinned:
    /// it is cache like any other), at most once in [`PREFETCH_AGAIN`] per
    /// node and snapshot.
    fn send_prefetches(self: &Arc<Self>, r: &Reach, live: &[ClusterJob], warms: Vec<Warm>) {
        if warms.is_empty() {
            return;
        }
        // The labels of the snapshots queued jobs read.
        let mut labels: HashMap<SnapshotKey, (String, SnapshotId)> = HashMap::new();
        for j in live {
            for t in j.req.code.iter().chain(j.req.data.iter().map(|x| &x.tree)) {
                let id = t.snapshot;
                labels.insert(SnapshotKey(*id.as_bytes()), (t.label.clone(), id));
            }
        }
        let now = self.clock.instant();
        for w in warms {
            let Some((label, snapshot)) = labels.get(&w.snapshot).cloned() else {
                continue;
            };
            let node = w.node.to_string();
            {
                let mut sent = self.prefetched.lock().expect("coordinator poisoned");
                sent.retain(|_, at| now.saturating_duration_since(*at) < PREFETCH_AGAIN);
                if sent.contains_key(&(node.clone(), snapshot)) {
                    continue;
                }
                sent.insert((node.clone(), snapshot), now);
            }
            tracing::info!(
                "prefetching {label} ({} bytes missing) on {node} for {}",
                w.missing,
                w.for_jobs.join(", ")
            );
            let order = WarmOrder {
                label,
                snapshot,
                unpin: false,
                pin: false,
            };
            let link = self.link(r, &node);
            tokio::spawn(async move {
                let r = match link {
                    Some(l) => l.warm(&order).await,
                    None => Err(unknown(&node)),
                };
                if let Err(e) = r {
                    tracing::warn!("prefetch on {node}: {e}");
                }
            });
        }
    }

    /// Records why a queued job waits (written only when it changed).
    fn set_why(&self, id: &str, why: String) {
        let r = self.jobs.update(id, |j| {
            let changed = j.placement
                != Placement::Queued {
                    why: Some(why.clone()),
                };
            j.placement = Placement::Queued { why: Some(why) };
            changed
        });
        if let Err(e) = r {
            tracing::error!("cluster jobs: {e}");
        }
    }

    /// Charges a job that ran to its user's fair-share usage: its GPUs
    /// times how long it ran, less what was charged while it ran.
    fn charge(&self, j: &ClusterJob, view: &JobView) {
        let (Some(start), Some(end)) = (view.started_at, view.ended_at) else {
            return;
        };
        let gpus = match &j.placement {
            Placement::Dispatched { gpus, .. } => gpus.len(),
            _ => view.gpus.len().max(view.meta.gpus_held.len()),
        };
        let from = start.max(j.charged_to);
        self.add_usage(&j.user, gpus as f64 * end.saturating_sub(from) as f64);
    }

    /// Charges the jobs of `live` running on their nodes (`started`: since
    /// when, Unix seconds) up to now, at most every [`CHARGE_EVERY`]: a
    /// week-long job weighs on its user's fair share while it runs, not
    /// only once it ends. Each job's record keeps how far it was charged,
    /// under the lock its end is charged under, so no second is charged
    /// twice.
    fn charge_running(&self, live: &[ClusterJob], started: &HashMap<JobId, u64>) {
        let now_s = self.clock.unix_secs();
        let _one = self.ending.lock().expect("coordinator poisoned");
        for j in live {
            let (Placement::Dispatched { gpus, .. }, Some(&start)) =
                (&j.placement, started.get(&j.id))
            else {
                continue;
            };
            if now_s < start.max(j.charged_to) + CHARGE_EVERY.as_secs() {
                continue;
            }
            let mut secs = 0;
            let r = self.jobs.update(&j.id, |x| {
                if !matches!(x.placement, Placement::Dispatched { .. }) {
                    return false;
                }
                secs = now_s.saturating_sub(start.max(x.charged_to));
                x.charged_to = now_s;
                secs > 0
            });
            match r {
                Ok(Some(_)) => self.add_usage(&j.user, gpus.len() as f64 * secs as f64),
                Ok(None) => {}
                Err(e) => tracing::error!("cluster jobs: {e}"),
            }
        }
    }

    /// Adds `gpu_secs` to `user`'s decaying usage, and saves it.
    fn add_usage(&self, user: &str, gpu_secs: f64) {
        if gpu_secs <= 0.0 {
            return;
        }
        let now = self.now_ms();
        let (v, at) = {
            let mut u = self.usage.lock().expect("coordinator poisoned");
            u.add(user, gpu_secs, now);
            (u.of(user, now), now)
        };
        if let Err(e) = self.jobs.put_usage(user, v, at) {
            tracing::error!("cluster usage: {e}");
        }
    }

    /// Ends a job that never ran.
    fn end(&self, j: &ClusterJob, reason: String) {
        if let Err(e) = self.jobs.put(&self.ended(j, reason)) {
            tracing::error!("cluster jobs: {e}");
        }
        self.drop_promises(&j.id);
    }

    /// `j` ended here (never started on a node) for `reason`.
    fn ended(&self, j: &ClusterJob, reason: String) -> ClusterJob {
        let mut view = self.synthesized(j, None);
        view.state = JobState::Failed { reason };
        view.ended_at = Some(self.clock.unix_secs());
        view.meta.outputs_pending = false;
        let mut ended = j.clone();
        ended.placement = Placement::Ended {
            view: Box::new(view),
        };
        ended
    }

    /// Whether `node` is up; `None` when it has not been heard from since
    /// the coordinator started.
    fn health(&self, node: &str) -> Option<bool> {
        let v = self.view.lock().expect("coordinator poisoned");
        let n = node.parse::<NodeName>().ok()?;
        v.cluster.node(&n).map(|x| x.is_up())
    }

    /// Whether `node` is another node than `d`'s, which the coordinator
    /// has marked down (not merely not heard from since it started).
    fn is_down(&self, r: &Reach, node: &str) -> bool {
        node != r.name() && self.health(node) == Some(false)
    }

    /// `node`: this one in process, another at the address of its last
    /// heartbeat.
    pub(super) fn link(&self, r: &Reach, node: &str) -> Option<Link> {
        let addr = {
            let v = self.view.lock().expect("coordinator poisoned");
            v.members.get(node).map(|m| m.addr.clone())
        };
        r.link(node, addr.as_deref())
    }

    /// Sends a dispatched job to its node (in the background; one at a
    /// time per job) and records the answer.
    fn send(self: &Arc<Self>, r: &Reach, job: ClusterJob) {
        let Placement::Dispatched { node, gpus, .. } = job.placement.clone() else {
            return;
        };
        if !self
            .inflight
            .lock()
            .expect("coordinator poisoned")
            .insert(job.id.clone())
        {
            return;
        }
        let (me, link) = (self.clone(), self.link(r, &node));
        // The node records the tier the job runs at (its provenance), not
        // the one asked: only this copy says it, the queue keeps the ask.
        let members = self.members();
        let tier = super::pass::tier_of(&members, &job, self.now_ms());
        let mut req = job.req.clone();
        req.priority = Some(members.ladder.name(tier).to_string());
        drop(members);
        // Its tier's default limit, where it gave none: its node keeps it.
        if req.time_limit_s.is_none() && req.hold_s.is_none() {
            req.time_limit_s = self.time_limits.get(&tier).copied();
        }
        // The coordinator tells of the end; the node never sees where.
        req.notify = Vec::new();
        tokio::spawn(async move {
            let dispatch = Dispatch {
                id: job.id.clone(),
                user: job.user.clone(),
                req,
                gpus,
            };
            let reply = match link {
                Some(l) => l.dispatch(dispatch).await,
                None => Err(unknown(&node)),
            };
            me.answered(&job, &node, reply);
            me.inflight
                .lock()
                .expect("coordinator poisoned")
                .remove(&job.id);
        });
    }

    fn answered(&self, job: &ClusterJob, node: &str, reply: Result<DispatchReply, JobError>) {
        let r = match reply {
            Ok(DispatchReply::Accepted { .. }) => {
                self.jobs.update(&job.id, |j| match &mut j.placement {
                    Placement::Dispatched {
                        confirmed, node: n, ..
                    } if n == node => {
                        *confirmed = true;
                        true
                    }
                    _ => false,
                })
            }
            Ok(DispatchReply::Stale { why }) => {
                tracing::info!(
                    "job {}: {node} refused a stale placement ({why}); placing it again",
                    job.id
                );
                self.drop_promises(&job.id);
                // Only from this dispatch: not a job ended meanwhile.
                self.jobs.update(&job.id, |j| {
                    if !matches!(&j.placement, Placement::Dispatched { node: n, .. } if n == node) {
                        return false;
                    }
                    j.placement = Placement::Queued {
                        why: Some(format!(
                            "{node}'s GPUs were taken meanwhile; placing it again"
                        )),
                    };
                    true
                })
            }
            Ok(DispatchReply::Refused { why }) => {
                tracing::warn!("job {}: {node} refused it: {why}", job.id);
                self.drop_promises(&job.id);
                let reason = format!("{node} refused it: {why}");
                self.jobs.update(&job.id, |j| {
                    if !matches!(&j.placement, Placement::Dispatched { node: n, .. } if n == node) {
                        return false;
                    }
                    let ended = self.ended(j, reason.clone());
                    *j = ended;
                    true
                })
            }
            Err(e) => {
                // Unknown whether it arrived: sent again to the same node
                // until that node answers (it takes a dispatch it has as a
                // no-op); never placed elsewhere meanwhile.
                tracing::warn!("job {}: dispatch to {node}: {e}; sending it again", job.id);
                Ok(None)
            }
        };
        if let Err(e) = r {
            tracing::error!("cluster jobs: {e}");
        }
    }

    fn drop_promises(&self, id: &str) {
        let mut v = self.view.lock().expect("coordinator poisoned");
        for p in v.promised.values_mut() {
            p.retain(|_, j| j != id);
        }
    }

    /// Promises of jobs that are no longer dispatched and unconfirmed.
    fn forget_promises(&self, live: &[ClusterJob]) {
        let waiting: HashSet<&str> = live
            .iter()
            .filter(|j| matches!(j.placement, Placement::Dispatched { .. }))
            .map(|j| j.id.as_str())
            .collect();
        let mut v = self.view.lock().expect("coordinator poisoned");
        for p in v.promised.values_mut() {
            p.retain(|_, j| waiting.contains(j.as_str()));
        }
    }

    /// A job dispatched and confirmed that its node's heartbeat no longer
    /// lists as active: its final record is fetched and kept here.
    async fn collect_if_ended(&self, r: &Reach, j: &ClusterJob) {
        let Placement::Dispatched { node, .. } = &j.placement else {
            return;
        };
        let listed = {
            let v = self.view.lock().expect("coordinator poisoned");
            match v.members.get(node) {
                Some(m) if v.cluster.node(node).is_some_and(|n| n.is_up()) => {
                    m.jobs.iter().any(|x| x.id == j.id)
                }
                _ => return,
            }
        };
        if listed {
            return;
        }
        // Up, answering, and without a record of it: its state folder was
        // lost. The job cannot be running there.
        if let Err(JobError::NotFound(_)) = self.fetch(r, j).await {
            self.end(
                j,
                format!("{node} has no record of it any more (its labd state was lost)"),
            );
        }
    }

    /// The job's record from its node; kept here once it has ended.
    async fn fetch(&self, r: &Reach, j: &ClusterJob) -> Result<JobView, JobError> {
        let Placement::Dispatched { node, .. } = &j.placement else {
            return Ok(self.view_of(j));
        };
        let view = match self.link(r, node) {
            Some(l) => l.job(&j.id).await?,
            None => return Err(unknown(node)),
        };
        if view.ended() && !view.meta.outputs_pending {
            // Once: two fetches of one ended job charge (and requeue) it once.
            let _one = self.ending.lock().expect("coordinator poisoned");
            // As it is now: it may have been preempted since `j` was read.
            let now = match self.jobs.get(&j.id) {
                Ok(Some(x)) if !matches!(x.placement, Placement::Ended { .. }) => Some(x),
                _ => None,
            };
            if let Some(j) = now.as_ref() {
                let mut ended = view.clone();
                if let Placement::Dispatched { at, .. } = &j.placement {
                    ended.meta.placed_at = Some(*at);
                }
                // Requeued only if its node stopped it for that: not a job
                // that ended by itself meanwhile, nor one its owner killed.
                let stopped = j
                    .preempted
                    .as_ref()
                    .filter(|_| view.meta.stopped_for.is_some());
                if let Some(reason) = stopped {
                    ended.why = Some(match self.requeue(j, &view) {
                        Some(n) => format!("{reason}; requeued as {n}"),
                        None => format!("{reason}; could not be requeued (see labd's log)"),
                    });
                }
                let r = self.jobs.update(&j.id, |x| {
                    x.placement = Placement::Ended {
                        view: Box::new(ended.clone()),
                    };
                    true
                });
                match r {
                    Ok(_) => {
                        self.charge(j, &view);
                        if let Some(runs) = self.runs.lock().expect("coordinator poisoned").as_mut()
                        {
                            runs.learn(&j.user, &j.req, &view);
                        }
                    }
                    Err(e) => tracing::error!("cluster jobs: {e}"),
                }
            }
        }
        Ok(view)
    }

    /// A record for a job no node has (yet).
    fn synthesized(&self, j: &ClusterJob, why: Option<String>) -> JobView {
        JobView {
            id: j.id.clone(),
            node: None,
            user: j.user.clone(),
            argv: j.req.argv.clone(),
            gpus_wanted: j.req.gpus,
            gpus: Vec::new(),
            state: JobState::Queued,
            why,
            submitted_at: j.submitted_at,
            started_at: None,
            ended_at: None,
            meta: crate::leases::JobMeta {
                code: j.req.code.as_ref().map(|t| t.label.clone()),
                data: j.req.data.iter().map(|t| t.tree.label.clone()).collect(),
                outputs: j.req.outputs.clone(),
                outputs_pending: j.req.outputs.is_some(),
                request: Some(crate::leases::recorded(&j.req)),
                expected: self.expected_of(j, self.now_ms()),
                ..Default::default()
            },
        }
    }

    /// The job as `labrun ps` shows it, from what the coordinator knows
    /// (its node's last heartbeat for a dispatched job).
    fn view_of(&self, j: &ClusterJob) -> JobView {
        match &j.placement {
            Placement::Queued { why } => self.synthesized(j, why.clone()),
            Placement::Ended { view } => (**view).clone(),
            Placement::Dispatched { node, gpus, at, .. } => {
                let v = self.view.lock().expect("coordinator poisoned");
                let member = v.members.get(node);
                let down = v.cluster.node(node).and_then(|n| match n.health {
                    labsync_placer::Health::Down { since } => Some(since),
                    labsync_placer::Health::Up => None,
                });
                let from_node = member.and_then(|m| m.jobs.iter().find(|x| x.id == j.id));
                let mut view = match from_node {
                    // Heartbeats carry no commands: the job's own here.
                    Some(x) => JobView {
                        argv: j.req.argv.clone(),
                        ..x.clone()
                    },
                    None => {
                        let mut s = self.synthesized(j, Some(format!("sent to {node}")));
                        s.node = Some(node.clone());
                        s.gpus = gpus.clone();
                        s
                    }
                };
                if let Some(since) = down {
                    let ago = self.now_ms().saturating_sub(since) / 1000;
                    view.why = Some(format!(
                        "node {node} down since {ago} s ago: shown as last reported"
                    ));
                }
                view.meta.placed_at = Some(*at);
                if view.meta.expected.is_none() {
                    view.meta.expected = self.expected_of(j, self.now_ms());
                }
                view
            }
        }
    }

    /// Every live job and those that ended in the last day.
    pub fn jobs_view(&self) -> Result<Vec<JobView>, JobError> {
        let mut out: Vec<(u64, JobView)> = self
            .jobs
            .live()
            .iter()
            .map(|j| (j.number(), self.view_of(j)))
            .collect();
        let day_ago = self
            .clock
            .unix_secs()
            .saturating_sub(super::queue::RECENT_SECS);
        for j in self.jobs.ended_since(day_ago) {
            out.push((j.number(), self.view_of(&j)));
        }
        out.sort_by_key(|(n, _)| *n);
        Ok(out.into_iter().map(|(_, v)| v).collect())
    }

    fn get(&self, id: &str) -> Result<ClusterJob, JobError> {
        self.jobs
            .get(id)
            .map_err(db)?
            .ok_or_else(|| JobError::NotFound(format!("no job {id} in the cluster")))
    }

    /// One job, asked of its node where it runs.
    pub async fn job(&self, r: &Reach, id: &str) -> Result<JobView, JobError> {
        let j = self.get(id)?;
        match &j.placement {
            Placement::Dispatched {
                confirmed: true, ..
            } => match self.fetch(r, &j).await {
                Ok(v) => Ok(v),
                Err(_) => Ok(self.view_of(&j)),
            },
            _ => Ok(self.view_of(&j)),
        }
    }

    /// `labrun explain JOB`: the job and, while it is queued, every node's
    /// row for it (as `labrun --explain` gives before submitting).
    pub async fn explain_job(
        &self,
        r: &Reach,
        id: &str,
    ) -> Result<crate::proto::JobExplain, JobError> {
        let j = self.get(id)?;
        let ranking = match &j.placement {
            Placement::Queued { .. } => Some(self.explain(r, &j.req).await?),
            _ => None,
        };
        Ok(crate::proto::JobExplain {
            job: self.job(r, id).await?,
            ranking,
        })
    }

    fn own(caller: &Caller, j: &ClusterJob, what: &str) -> Result<(), JobError> {
        crate::request::own(caller, &j.id, &j.user, what)
    }

    /// Kills a job: dropped from the queue, or killed on its node.
    pub async fn kill(&self, r: &Reach, caller: &Caller, id: &str) -> Result<JobView, JobError> {
        let mut j = self.get(id)?;
        Self::own(caller, &j, "kill")?;
        if matches!(j.placement, Placement::Queued { .. }) {
            // A pass placing it meanwhile has sent it to a node, where it
            // is killed below (ended here regardless, it would run there
            // unseen).
            match self.end_if_queued(caller, id)? {
                Some(x) if matches!(x.placement, Placement::Ended { .. }) => {
                    return Ok(self.view_of(&x));
                }
                Some(x) => j = x,
                None => j = self.get(id)?,
            }
        }
        match &j.placement {
            Placement::Ended { .. } => {
                Err(JobError::Conflict(format!("job {id} has already ended")))
            }
            Placement::Queued { .. } => Err(JobError::Conflict(format!(
                "job {id} was placed while it was killed; try again"
            ))),
            Placement::Dispatched { node, .. } => {
                // Killed by its owner (or an admin): not to be requeued,
                // even if it was being preempted.
                if j.preempted.is_some() {
                    self.jobs
                        .update(id, |x| {
                            x.preempted = None;
                            true
                        })
                        .map_err(|e| JobError::Internal(e.to_string()))?;
                }
                if let Placement::Dispatched {
                    confirmed: false, ..
                } = &j.placement
                {
                    return self.kill_unconfirmed(r, caller, id).await;
                }
                if self.is_down(r, node) {
                    return self.kill_while_down(caller, id, node);
                }
                let view = self.kill_on(r, node, id, &caller.user).await?;
                tracing::info!("job {id} killed by {} on {node}", caller.user);
                Ok(view)
            }
        }
    }

    /// Ends job `id`, killed by `caller`, if it is still queued, in one
    /// step under the queue's lock; the job after (`None`: not live).
    fn end_if_queued(&self, caller: &Caller, id: &str) -> Result<Option<ClusterJob>, JobError> {
        let reason = format!("killed by {} while queued", caller.user);
        let now = self
            .jobs
            .update(id, |x| {
                if !matches!(x.placement, Placement::Queued { .. }) {
                    return false;
                }
                *x = self.ended(x, reason);
                true
            })
            .map_err(|e| JobError::Internal(e.to_string()))?;
        if now
            .as_ref()
            .is_some_and(|x| matches!(x.placement, Placement::Ended { .. }))
        {
            self.drop_promises(id);
        }
        Ok(now)
    }

    /// Kills a job whose dispatch its node has not confirmed: it may be
    /// on its way, so its node may not know it yet (a kill there finds
    /// nothing, and the dispatch lands after). The job's dispatch slot is
    /// taken first (no dispatch of it is sent while it is held), waiting
    /// for one in flight to be answered; then the job is dropped from the
    /// queue if that answer put it back, or killed on its node. A node
    /// that does not have it may still be working on a dispatch that timed
    /// out here, so the job is not ended on that alone: the user is told
    /// to try again, and the next dispatch's answer settles where it is.
    async fn kill_unconfirmed(
        &self,
        r: &Reach,
        caller: &Caller,
        id: &str,
    ) -> Result<JobView, JobError> {
        struct Slot<'a>(&'a std::sync::Mutex<HashSet<JobId>>, &'a str);
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                self.0.lock().expect("coordinator poisoned").remove(self.1);
            }
        }
        let deadline = std::time::Instant::now() + FORWARD + Duration::from_secs(2);
        while !self
            .inflight
            .lock()
            .expect("coordinator poisoned")
            .insert(JobId::from(id))
        {
            if std::time::Instant::now() > deadline {
                return Err(JobError::Conflict(format!(
                    "job {id} is being sent to its node; try again in a moment"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _slot = Slot(&self.inflight, id);
        let j = self.get(id)?;
        match &j.placement {
            Placement::Ended { .. } => {
                Err(JobError::Conflict(format!("job {id} has already ended")))
            }
            // Its node answered that its GPUs were taken: queued again.
            Placement::Queued { .. } => match self.end_if_queued(caller, id)? {
                Some(x) if matches!(x.placement, Placement::Ended { .. }) => Ok(self.view_of(&x)),
                _ => Err(JobError::Conflict(format!(
                    "job {id} was placed while it was killed; try again"
                ))),
            },
            Placement::Dispatched { node, .. } if self.is_down(r, node) => {
                self.kill_while_down(caller, id, node)
            }
            Placement::Dispatched {
                node, confirmed, ..
            } => match self.kill_on(r, node, id, &caller.user).await {
                Err(JobError::NotFound(_)) if !confirmed => Err(JobError::Conflict(format!(
                    "job {id} is on its way to {node}, which does not have it yet; try again \
                     in a moment"
                ))),
                other => {
                    let view = other?;
                    tracing::info!("job {id} killed by {} on {node}", caller.user);
                    Ok(view)
                }
            },
        }
    }

    /// Ends job `id`, dispatched to `node`, which is down: a node that
    /// never comes back must not keep it (and its GPUs, against its
    /// user's cap) for good. It is ended here, as its node last reported
    /// it, and charged until now; if `node` comes back with it running,
    /// its heartbeat's answer tells it to kill it
    /// ([`super::Coordinator::heartbeat`]). Not ended if it moved on
    /// meanwhile.
    fn kill_while_down(
        &self,
        caller: &Caller,
        id: &str,
        node: &NodeName,
    ) -> Result<JobView, JobError> {
        let j = self.get(id)?;
        let mut view = self.view_of(&j);
        // Its node said it ended (its outputs being saved when it went
        // down): its own record comes back with the node.
        if view.ended() {
            return Err(JobError::Conflict(format!(
                "job {id} had already ended when {node} went down; its record comes back \
                 with {node}"
            )));
        }
        view.state = JobState::Failed {
            reason: format!(
                "killed by {} while its node {node} was down; stopped there if {node} comes back",
                caller.user
            ),
        };
        view.why = None;
        view.node = Some(node.clone());
        view.ended_at = Some(self.clock.unix_secs());
        view.meta.outputs_pending = false;
        let mut ended = false;
        self.jobs
            .update(id, |x| {
                if !matches!(&x.placement, Placement::Dispatched { node: n, .. } if n == node) {
                    return false;
                }
                x.placement = Placement::Ended {
                    view: Box::new(view.clone()),
                };
                x.preempted = None;
                ended = true;
                true
            })
            .map_err(|e| JobError::Internal(e.to_string()))?;
        if !ended {
            return Err(JobError::Conflict(format!(
                "job {id} changed while it was killed; try again"
            )));
        }
        self.drop_promises(id);
        self.charge(&j, &view);
        tracing::info!("job {id} killed by {} while {node} is down", caller.user);
        Ok(view)
    }

    /// Kills job `id` on `node` (SIGTERM, SIGKILL after the node's grace;
    /// its outputs pushed), on behalf of `by`.
    async fn kill_on(
        &self,
        r: &Reach,
        node: &str,
        id: &str,
        by: &str,
    ) -> Result<JobView, JobError> {
        match self.link(r, node) {
            Some(l) => l.kill(id, by).await,
            None => Err(unknown(node)),
        }
    }

    /// Stops `victims` for job `id`: each is marked (passes count its
    /// GPUs as coming free, so no more jobs are stopped than needed), then
    /// its node is told to stop it, in the background.
    fn preempt(self: &Arc<Self>, r: &Reach, id: &str, victims: &[JobId]) {
        for v in victims {
            let reason = format!("preempted for {id}");
            let mut marked = None;
            let updated = self.jobs.update(v, |j| match (&j.placement, &j.preempted) {
                (Placement::Dispatched { node, .. }, None) => {
                    marked = Some(node.clone());
                    j.preempted = Some(reason.clone());
                    j.preempted_at = self.clock.unix_secs();
                    true
                }
                _ => false,
            });
            if let Err(e) = updated {
                tracing::error!("cluster jobs: {e}");
                continue;
            }
            let Some(node) = marked else { continue };
            tracing::info!("job {v} on {node} {reason}");
            self.send_stop(r, &node, v, id);
        }
    }

    /// Tells `node` to stop `victim` for `for_job` (in the background). A
    /// node that does not answer is told again by a later pass
    /// ([`super::pass::PREEMPT_AGAIN`]); the mark stays, so the victim is never run
    /// twice at once and the job it makes way for keeps waiting for it.
    fn send_stop(self: &Arc<Self>, r: &Reach, node: &str, victim: &str, for_job: &str) {
        let link = self.link(r, node);
        let (node, victim, for_job) = (node.to_string(), victim.to_string(), for_job.to_string());
        tokio::spawn(async move {
            let r = match link {
                Some(l) => l.stop_for(&victim, &for_job).await,
                None => Err(unknown(&node)),
            };
            if let Err(e) = r {
                tracing::warn!("preempting {victim} on {node}: {e}");
            }
        });
    }

    /// Requeues a preempted job that has ended: a new job of the same
    /// request, user and submit time, with `LABRUN_RESTARTS` one more and
    /// `LABRUN_RESUME_FROM` its last saved outputs. Returns the new id.
    fn requeue(&self, j: &ClusterJob, view: &JobView) -> Option<JobId> {
        let mut req = j.req.clone();
        req.restarts += 1;
        req.resume_from = view.meta.outputs_saved.clone().or(req.resume_from);
        let floor = self.floor.load(std::sync::atomic::Ordering::Relaxed);
        match self.jobs.create(&j.user, req, j.submitted_at, floor) {
            Ok(n) => {
                self.wake.notify_one();
                Some(n.id)
            }
            Err(e) => {
                tracing::error!("requeueing {}: {e}", j.id);
                None
            }
        }
    }

    /// The job's log, from its node; a job not started has none yet.
    pub async fn log(
        &self,
        r: &Reach,
        caller: &Caller,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogRead, JobError> {
        let wait = wait.min(Duration::from_secs(30));
        // A job that ran has its log on its node, ended or not (kept there
        // `work_keep_s`).
        let ran_on = |j: &ClusterJob| match &j.placement {
            Placement::Dispatched {
                node,
                confirmed: true,
                ..
            } => Some(node.clone()),
            Placement::Ended { view } => view.node.clone(),
            _ => None,
        };
        let mut j = self.get(id)?;
        Self::own(caller, &j, "read the log of")?;
        // Not started anywhere yet: looked at again every 50 ms for up to a
        // second, so a follower neither spins nor misses the job's first
        // line by the rest of a second.
        let until = tokio::time::Instant::now() + wait.min(Duration::from_secs(1));
        if ran_on(&j).is_none() {
            self.wake.notify_one();
        }
        while ran_on(&j).is_none()
            && !matches!(j.placement, Placement::Ended { .. })
            && tokio::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            j = self.get(id)?;
        }
        match (&j.placement, ran_on(&j)) {
            (_, Some(node)) => match self.link(r, &node) {
                Some(l) => l.log(id, &caller.user, offset, wait).await,
                None => Err(unknown(&node)),
            },
            (Placement::Ended { .. }, None) => Ok(LogRead {
                bytes: Vec::new(),
                next: offset,
                done: true,
            }),
            _ => {
                // Still not started: nothing new.
                Ok(LogRead {
                    bytes: Vec::new(),
                    next: offset,
                    done: false,
                })
            }
        }
    }

    /// Ended jobs numbered below `before`, newest first.
    pub fn history(&self, before: Option<u64>, limit: usize) -> Result<Vec<JobView>, JobError> {
        let mut ended = self.jobs.ended().map_err(db)?;
        ended.retain(|j| before.is_none_or(|b| j.number() < b));
        ended.sort_by_key(|j| std::cmp::Reverse(j.number()));
        ended.truncate(limit.clamp(1, 1000));
        Ok(ended.iter().map(|j| self.view_of(j)).collect())
    }
}

/// How often running jobs are charged to their users' fair share.
const CHARGE_EVERY: Duration = Duration::from_secs(5);

/// `node` cannot be reached: not a member the coordinator has heard from.
fn unknown(node: &str) -> JobError {
    JobError::Conflict(format!("{node} is unknown; try again"))
}

/// The view the placer plans on: the agents' truth, with the GPUs promised
/// to dispatches not yet confirmed by a heartbeat counted busy.
pub(crate) fn with_promises(
    cluster: &labsync_placer::Cluster,
    promised: &BTreeMap<NodeName, BTreeMap<u32, JobId>>,
) -> labsync_placer::Cluster {
    let mut c = cluster.clone();
    for (name, gpus) in promised {
        if let Some(n) = c.node_mut(name) {
            for g in n.gpus.iter_mut() {
                if gpus.contains_key(&g.index) {
                    g.slot = Slot::Busy { until: None };
                    g.memory_free = 0;
                }
            }
        }
    }
    c
}
