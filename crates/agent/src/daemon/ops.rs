//! The API's operations: what a caller may ask of labd, checked (who owns
//! a job, what a request may contain) and run on the engine, the trees and
//! the logs. The HTTP layer maps each route to one of these.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use labsync_store::RunAs;

use super::logs::read_log;
use super::ConnLimits;
use super::Daemon;
use crate::blocking::{chain, off_runtime};
use crate::error::{JobError, PrepareError};
use crate::ids::JobId;
use crate::leases::{JobMeta, JobRecord, JobState};
use crate::node::{NodeError, Submit};
use crate::proto::{Dispatch, DispatchReply, Info, JobView, SubmitRequest, TreeRef};
use crate::request::{check_request, check_user_request, Caller, LogRead};
use crate::status::GpuStatus;
use crate::trees::make_workdir;
use crate::users;

/// Data sets of one job materialised at once (the code beside them).
const TREES_AT_ONCE: usize = 4;

/// How long an ended job stays in the default listing (`labrun ps`).
const RECENT: Duration = Duration::from_secs(86_400);

/// How often the log of a fresh job that is followed is looked at, besides
/// the ticker's look.
const FRESH_POLL: Duration = Duration::from_millis(20);

/// A job submitted or started in the last seconds: its first lines are what
/// its user is waiting for. The ticker wakes log followers once a tick (100
/// ms), which alone doubled `labrun`'s time to a job's first line (0.16 s
/// to 0.29-0.34 s with 5,000 code files), so one task looks at a fresh
/// job's log every [`FRESH_POLL`] and wakes its followers
/// ([`Daemon::watch_fresh`]); a job running for a while is followed on the
/// ticker's wakes only, which keeps a thousand followers cheap.
fn fresh(rec: &JobRecord) -> bool {
    let now = crate::leases::unix_now();
    now.saturating_sub(rec.submitted_at) < 5
        || rec.started_at.is_some_and(|s| now.saturating_sub(s) < 5)
}

fn internal(e: impl std::fmt::Display) -> JobError {
    JobError::Internal(e.to_string())
}

impl From<NodeError> for JobError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Refused(m) => JobError::Conflict(m),
            NodeError::NoJob(id) => JobError::NotFound(format!("no job {id}")),
            NodeError::TooMany(m) => JobError::Busy(m),
            NodeError::Stale(m) => JobError::Conflict(m),
            other => JobError::Internal(other.to_string()),
        }
    }
}

impl Daemon {
    /// Slurm's nodes ranked for a job (the coordinator's re-ranking of
    /// pending Slurm jobs; [`crate::cluster::Coordinator::rank_for_scheduler`]).
    pub async fn rank_for_scheduler(
        self: &Arc<Self>,
        ask: &crate::proto::RankAsk,
    ) -> Result<labsync_placer::Ranking, JobError> {
        let co = self.coordinator.as_ref().ok_or_else(|| {
            JobError::Conflict(format!(
                "{} does not coordinate a cluster",
                self.cfg.node_name
            ))
        })?;
        let reach = crate::cluster::Reach::new(self.clone());
        co.rank_for_scheduler(&reach, ask).await
    }

    /// The caller a bearer token belongs to.
    pub fn authenticate(&self, token: &str) -> Option<Caller> {
        self.tokens.user_of(token).map(|user| Caller {
            admin: self.cfg.admins.contains(&user),
            user,
        })
    }

    /// What connections may hold open.
    pub fn conn_limits(&self) -> ConnLimits {
        self.cfg.conn_limits
    }

    /// `labrun`'s first question.
    pub fn info(&self, caller: &Caller) -> Info {
        Info {
            version: env!("CARGO_PKG_VERSION").into(),
            node: self.cfg.node_name.clone(),
            store: self.cfg.store.clone(),
            user: caller.user.clone(),
            admin: caller.admin,
            inventory: self.inventory.clone(),
            coordinator: self.coordinator.is_some(),
            gpu_confinement: self.gpu_confinement().to_string(),
            trees_held: Some(self.tree_charge(&caller.user)),
        }
    }

    /// Whether jobs are kept from the GPUs they did not lease, in words.
    pub fn gpu_confinement(&self) -> &str {
        self.node.gpu_confinement()
    }

    /// Every GPU and what it is.
    pub async fn gpus(self: &Arc<Self>) -> Result<Vec<GpuStatus>, JobError> {
        let node = self.node.clone();
        Ok(off_runtime(move || node.gpus()).await?)
    }

    /// The view of each record; the GPUs are read once for all of them
    /// (and only if one waits for GPUs), not once per queued job.
    fn views(&self, recs: Vec<JobRecord>) -> Result<Vec<JobView>, NodeError> {
        let waiting = recs
            .iter()
            .any(|r| r.state == JobState::Queued && r.meta.preparing.is_none());
        let gpus = if waiting {
            Some(self.node.gpus()?)
        } else {
            None
        };
        let idle = self.hold_idle.lock().expect("holds poisoned").clone();
        Ok(recs
            .into_iter()
            .map(|mut rec| {
                rec.meta.idle_since_ms = idle.get(&rec.id).copied().flatten();
                let why = match (&rec.state, &rec.meta.preparing, &gpus) {
                    (JobState::Queued, Some(p), _) => Some(p.clone()),
                    (JobState::Queued, None, Some(g)) => self.node.why_waiting(&rec.id, g),
                    _ => rec.meta.released.clone(),
                };
                JobView {
                    node: Some(self.cfg.node_name.clone()),
                    id: rec.id,
                    user: rec.user,
                    argv: rec.argv,
                    gpus_wanted: rec.gpus_wanted,
                    gpus: rec.gpus,
                    state: rec.state,
                    why,
                    submitted_at: rec.submitted_at,
                    started_at: rec.started_at,
                    ended_at: rec.ended_at,
                    meta: rec.meta,
                }
            })
            .collect())
    }

    /// The jobs labd still has work with (see [`JobRecord::active`]), from
    /// memory: what a heartbeat carries, every second, with no read of the
    /// database's every record.
    pub async fn active_jobs(self: &Arc<Self>) -> Result<Vec<JobView>, JobError> {
        let me = self.clone();
        off_runtime(move || Ok(me.views(me.node.active_jobs()?)?)).await
    }

    /// Active jobs and those that ended in the last day, oldest first: what
    /// `labrun ps` shows. Older ones come from [`Daemon::history`].
    pub async fn jobs(self: &Arc<Self>) -> Result<Vec<JobView>, JobError> {
        let me = self.clone();
        off_runtime(move || {
            let day_ago = crate::leases::unix_now().saturating_sub(RECENT.as_secs());
            let mut jobs: Vec<JobRecord> = me
                .node
                .jobs()?
                .into_iter()
                .filter(|j| j.active() || j.ended_at.is_none_or(|t| t >= day_ago))
                .collect();
            jobs.sort_by_key(|j| (j.submitted_at, crate::node::job_number(&j.id), j.id.clone()));
            Ok(me.views(jobs)?)
        })
        .await
    }

    /// One page of the jobs that ended, newest first: those numbered below
    /// `before` (all, without it), at most `limit` (1 to 1000).
    pub async fn history(
        self: &Arc<Self>,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<JobView>, JobError> {
        let me = self.clone();
        off_runtime(move || {
            let mut jobs: Vec<(u64, JobRecord)> = me
                .node
                .jobs()?
                .into_iter()
                .filter(|j| !j.active())
                .filter_map(|j| Some((crate::node::job_number(&j.id)?, j)))
                .filter(|(n, _)| before.is_none_or(|b| *n < b))
                .collect();
            jobs.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
            jobs.truncate(limit.clamp(1, 1000));
            Ok(me.views(jobs.into_iter().map(|(_, j)| j).collect())?)
        })
        .await
    }

    fn record(&self, id: &str) -> Result<JobRecord, JobError> {
        self.node
            .job(id)?
            .ok_or_else(|| JobError::NotFound(format!("no job {id} on {}", self.cfg.node_name)))
    }

    /// One job.
    pub async fn job(self: &Arc<Self>, id: &str) -> Result<JobView, JobError> {
        let (me, id) = (self.clone(), id.to_string());
        off_runtime(move || {
            let rec = me.record(&id)?;
            Ok(me.views(vec![rec])?.remove(0))
        })
        .await
    }

    fn own(&self, caller: &Caller, rec: &JobRecord, what: &str) -> Result<(), JobError> {
        crate::request::own(caller, &rec.id, &rec.user, what)
    }

    /// Takes a job: records it, materialises its code and data in the
    /// background, then queues it.
    pub async fn submit(
        self: &Arc<Self>,
        caller: &Caller,
        req: SubmitRequest,
    ) -> Result<JobView, JobError> {
        if let Some(c) = self.cfg.cluster.as_ref().filter(|c| !c.coordinate) {
            return Err(JobError::Conflict(format!(
                "{} is a node of the cluster coordinated at {}: submit there \
                 (LABRUN_LABD={}), which places jobs over every node",
                self.cfg.node_name, c.coordinator, c.coordinator
            )));
        }
        check_user_request(&req)?;
        // A job's code and data come from the store and its outputs go
        // there: none is taken before labd has reached it (and numbered its
        // jobs above the store's). A hold needs none of it.
        if needs_store(&req) {
            self.repo()?;
        }
        if let Some(p) = &req.priority {
            return Err(JobError::Invalid(format!(
                "--priority {p}: tiers order a cluster's queue, and this labd is not a cluster's \
                 coordinator (its jobs start first come, first served); leave --priority out"
            )));
        }
        let run_as = self.run_as(caller).await?;
        let mut submit = Submit {
            user: caller.user.clone(),
            argv: req.argv.clone(),
            cwd: PathBuf::new(),
            env: Vec::new(),
            gpus: req.gpus,
            min_free_bytes: req.gpu_mem,
            run_as,
            meta: self.job_meta(&req, run_as),
        };
        // Reserved and handed to its preparation in a task of its own: a
        // client that goes away drops this future, and a job reserved that
        // nothing prepares would hold its place (and GPUs) for good.
        let me = self.clone();
        let id = tokio::spawn(async move {
            let (node, s) = (me.node.clone(), submit.clone());
            let id = off_runtime(move || node.reserve(&s)).await?;
            let work = me.cfg.state_dir.join("jobs").join(id.as_str()).join("work");
            submit.cwd = work.clone();
            submit.meta.work = Some(work);
            me.prepare_in_background(id.clone(), req, submit);
            Ok::<_, JobError>(id)
        })
        .await
        .map_err(|e| JobError::Internal(format!("submitting: {e}")))??;
        self.job(&id).await
    }

    /// Takes a job the coordinator placed here: leases exactly its GPUs
    /// now, then materialises and queues it as [`Daemon::submit`] does.
    pub async fn submit_placed(self: &Arc<Self>, d: Dispatch) -> DispatchReply {
        let refused = |e: JobError| DispatchReply::Refused { why: e.to_string() };
        let reached = || match needs_store(&d.req) {
            true => self.repo().map(drop),
            false => Ok(()),
        };
        if let Err(e) = check_request(&d.req).and_then(|()| reached()) {
            return refused(e);
        }
        let caller = Caller {
            user: d.user.clone(),
            admin: false,
        };
        let run_as = match self.run_as(&caller).await {
            Ok(r) => r,
            Err(e) => return refused(e),
        };
        let work = self
            .cfg
            .state_dir
            .join("jobs")
            .join(d.id.as_str())
            .join("work");
        let mut submit = Submit {
            user: d.user.clone(),
            argv: d.req.argv.clone(),
            cwd: work.clone(),
            env: Vec::new(),
            gpus: d.req.gpus,
            min_free_bytes: d.req.gpu_mem,
            run_as,
            meta: self.job_meta(&d.req, run_as),
        };
        submit.meta.work = Some(work);
        let (node, s, id, gpus) = (
            self.node.clone(),
            submit.clone(),
            d.id.clone(),
            d.gpus.clone(),
        );
        // Leased and handed to its preparation in a task of its own: the
        // coordinator giving up on this answer drops this future, and a
        // job leased that nothing prepares would hold its GPUs for good
        // (a dispatch sent again finds it known and leaves it).
        let (me, req, job) = (self.clone(), d.req.clone(), d.id.clone());
        let placed = tokio::spawn(async move {
            let fresh = off_runtime(move || {
                let known = node.job(&id)?.is_some();
                node.reserve_placed(&id, &s, &gpus).map(|()| !known)
            })
            .await;
            if let Ok(true) = fresh {
                me.prepare_in_background(job, req, submit);
            }
            fresh
        })
        .await;
        match placed {
            Ok(Ok(true)) => {
                tracing::info!(
                    "job {} of {} placed here on GPU(s) {:?}",
                    d.id,
                    d.user,
                    d.gpus
                );
            }
            Ok(Ok(false)) => {}
            Ok(Err(NodeError::Stale(why))) => return DispatchReply::Stale { why },
            Ok(Err(e)) => return refused(e.into()),
            Err(e) => return refused(JobError::Internal(format!("placing: {e}"))),
        }
        match self.job(&d.id).await {
            Ok(job) => DispatchReply::Accepted { job: Box::new(job) },
            Err(e) => refused(e),
        }
    }

    /// The Unix user (uid, gid) a caller's jobs run as: themselves when labd
    /// is root and runs jobs as their submitters, else labd's own (`None`).
    pub(crate) async fn run_as(&self, caller: &Caller) -> Result<Option<RunAs>, JobError> {
        if !(self.cfg.run_as_submitter && users::euid() == 0) {
            return Ok(None);
        }
        // NSS may ask a directory server: off the runtime.
        let name = caller.user.clone();
        let u = off_runtime(move || users::user_by_name(&name)).await;
        let u = u.ok_or_else(|| {
            JobError::Conflict(format!(
                "no Unix user {:?} on {}: labd runs jobs as the user who submits them",
                caller.user, self.cfg.node_name
            ))
        })?;
        Ok(Some(RunAs {
            uid: u.uid,
            gid: u.gid,
        }))
    }

    /// What the job's record keeps beside the engine's fields.
    pub(crate) fn job_meta(&self, req: &SubmitRequest, run_as: Option<RunAs>) -> JobMeta {
        JobMeta {
            code: req.code.as_ref().map(|t| t.label.clone()),
            data: req.data.iter().map(|d| d.tree.label.clone()).collect(),
            work: None,
            outputs: req.outputs.clone(),
            outputs_every_s: req
                .outputs_every_s
                .unwrap_or(self.cfg.outputs_every.as_secs())
                .max(self.cfg.outputs_every_min.as_secs())
                .max(1),
            outputs_saved: None,
            outputs_error: None,
            outputs_pending: req.outputs.is_some(),
            outputs_failures: 0,
            log_cut: None,
            preparing: Some("materialising code and data".into()),
            run_as,
            hold_s: req.hold_s,
            released: None,
            stopped_for: None,
            log_keeper: None,
            trees: req
                .code
                .iter()
                .chain(req.data.iter().map(|d| &d.tree))
                .map(|t| t.snapshot)
                .collect(),
            request: Some(crate::leases::recorded(req)),
            expected: req
                .time_limit_s
                .map(|secs| crate::proto::Expected { secs, limit: true }),
            gpus_held: Vec::new(),
            placed_at: None,
            idle_since_ms: None,
        }
    }

    /// Materialises the reserved job `id`'s trees and working folder in a
    /// task of its own, then queues it (or ends it, saying why).
    fn prepare_in_background(self: &Arc<Self>, id: JobId, req: SubmitRequest, mut submit: Submit) {
        let me = self.clone();
        tokio::spawn(async move {
            let outcome = me.prepare(&id, &req, &mut submit).await;
            let (node, job) = (me.node.clone(), id.clone());
            // Either may find the job killed meanwhile; it then stays ended.
            let result = off_runtime(move || match outcome {
                Ok(()) => node.enqueue(&job, submit).map(drop),
                Err(e) => node
                    .cancel_reserved(&job, format!("cannot prepare the job: {}", chain(&e)))
                    .map(drop),
            })
            .await;
            if let Err(e) = result {
                tracing::error!("job state: {e}");
            }
            me.logs.wake(&id, None);
        });
    }

    /// Materialises the job's code and data trees, its environment and its
    /// working folder (owned by its user).
    async fn prepare(
        &self,
        id: &str,
        req: &SubmitRequest,
        submit: &mut Submit,
    ) -> Result<(), PrepareError> {
        // Code and every data set at once: each waits on its own packs.
        // Each runs to its end even when another fails (a pull dropped half
        // way would waste what it fetched); the first error is reported.
        let repo = match needs_store(req) {
            true => Some(self.store.get().map_err(PrepareError::NoStore)?),
            false => None,
        };
        if let Some(repo) = repo {
            let trees: Vec<&TreeRef> = (req.code.iter())
                .chain(req.data.iter().map(|d| &d.tree))
                .collect();
            let user = &submit.user;
            self.check_tree_share(user, super::shares::Asking::Job(id), &trees, repo)
                .await?;
        }
        let code = async {
            match (&req.code, repo) {
                (Some(t), Some(repo)) => self.trees.get(repo, &self.cache, t).await.map(Some),
                _ => Ok(None),
            }
        };
        use futures::StreamExt;
        // Futures made before they are streamed: a closure inside the
        // stream made the spawned future non-`Send` (rust-lang/rust#102211).
        let trees: Vec<_> = (req.data.iter())
            .filter_map(|d| repo.map(|repo| self.trees.get(repo, &self.cache, &d.tree)))
            .collect();
        let data = futures::stream::iter(trees)
            .buffered(TREES_AT_ONCE)
            .collect::<Vec<_>>();
        let (code, data) = futures::future::join(code, data).await;
        let code = code?;
        let data = data.into_iter().collect::<Result<Vec<_>, _>>()?;
        let mut env: Vec<(String, String)> = req
            .env
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "LABRUN_TOKEN" | "LABRUN_RESTARTS" | "LABRUN_RESUME_FROM"
                ) && !k.starts_with("LABRUN_DATA")
            })
            .cloned()
            .collect();
        for (i, (d, path)) in req.data.iter().zip(data).enumerate() {
            let path = path.display().to_string();
            if i == 0 {
                env.push(("LABRUN_DATA".into(), path.clone()));
            }
            env.push((d.env.clone(), path));
        }
        env.push(("LABRUN_NODE".into(), self.cfg.node_name.to_string()));
        env.push(("LABRUN_RESTARTS".into(), req.restarts.to_string()));
        if let Some(r) = &req.resume_from {
            env.push(("LABRUN_RESUME_FROM".into(), r.clone()));
        }
        submit.env = env;
        let (work, outputs, owner) = (submit.cwd.clone(), req.outputs.clone(), submit.run_as);
        off_runtime(move || make_workdir(code.as_deref(), &work, outputs.as_deref(), owner))
            .await?;
        tracing::info!("job {id} ready in {}", submit.cwd.display());
        Ok(())
    }

    /// Kills a job (or drops it from the queue); its GPUs are freed and its
    /// outputs pushed.
    pub async fn kill(self: &Arc<Self>, caller: &Caller, id: &str) -> Result<JobView, JobError> {
        let (me, job) = (self.clone(), id.to_string());
        let rec = off_runtime(move || me.record(&job)).await?;
        self.own(caller, &rec, "kill")?;
        if matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. }) {
            return Err(JobError::Conflict(format!("job {id} has already ended")));
        }
        let (node, job, grace) = (self.node.clone(), id.to_string(), self.cfg.kill_grace);
        off_runtime(move || {
            // A job still being prepared is ended before it is queued; one
            // queued meanwhile is killed like any other.
            if !node.cancel_reserved(&job, "killed while being prepared".into())? {
                node.kill(&job, grace)?;
            }
            Ok::<_, NodeError>(())
        })
        .await?;
        tracing::info!("job {id} killed by {}", caller.user);
        self.tick().await;
        self.job(id).await
    }

    /// The coordinator stops a preemptible job for `for_job`: the mark is
    /// kept on the job (so it is requeued once it has ended), then it is
    /// killed in the background (SIGTERM, SIGKILL after the grace) and the
    /// answer comes at once. A job that ends by itself before the kill
    /// reaches it loses the mark: it is not run again.
    pub async fn stop_for(self: &Arc<Self>, id: &str, for_job: &str) -> Result<(), JobError> {
        let (me, job) = (self.clone(), id.to_string());
        let rec = off_runtime(move || me.record(&job)).await?;
        if matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. }) {
            return Err(JobError::Conflict(format!("job {id} has already ended")));
        }
        let (node, job, reason) = (self.node.clone(), id.to_string(), for_job.to_string());
        off_runtime(move || node.update_meta(&job, |m| m.stopped_for = Some(reason))).await?;
        let (me, job) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            let labd = Caller {
                user: "labd (preemption)".into(),
                admin: true,
            };
            if let Err(e) = me.kill(&labd, &job).await {
                tracing::info!("preempting {job}: {e}; not to be requeued");
                let node = me.node.clone();
                let j = job.clone();
                let _ = off_runtime(move || node.update_meta(&j, |m| m.stopped_for = None)).await;
            }
        });
        Ok(())
    }

    /// The job's log from `offset`, waiting up to `wait` for new bytes.
    pub async fn log(
        self: &Arc<Self>,
        caller: &Caller,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogRead, JobError> {
        let rec = self.record(id)?;
        self.own(caller, &rec, "read the log of")?;
        let path = self.node.log_path(id);
        let offset = if offset >= crate::proto::LOG_TAIL {
            let p = path.clone();
            // The log's own size: a link swapped in for it is not followed.
            let size = off_runtime(move || std::fs::symlink_metadata(&p).map(|m| m.len()))
                .await
                .unwrap_or(0);
            size.saturating_sub(offset - crate::proto::LOG_TAIL)
        } else {
            offset
        };
        let deadline = Instant::now() + wait.min(Duration::from_secs(30));
        // Subscribed before the first read: a change after it wakes us.
        let mut changed = self.logs.subscribe(id);
        loop {
            // Whether it had ended is read before the file, so no last line is missed.
            let rec = self.record(id)?;
            // A final push that failed is retried by labd for as long as it
            // takes; the log's reader is told at its first failure.
            let finished = matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. })
                && (!rec.meta.outputs_pending || rec.meta.outputs_failures > 0);
            let p = path.clone();
            let cut = rec.meta.log_cut;
            let (bytes, next) = match off_runtime(move || read_log(&p, offset, 1 << 20, cut)).await
            {
                Ok(read) => read,
                // A job that never started wrote nothing.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && rec.started_at.is_none() => {
                    (Vec::new(), offset)
                }
                // Never an empty read: the follower would take it for the
                // whole output, and say nothing was lost.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(JobError::NotFound(format!(
                        "the output of job {id} is gone: its log was removed from {} \
                         (a job's folder and log are kept work_keep_s after it ended and its outputs were saved)",
                        self.node_name()
                    )))
                }
                Err(e) => return Err(internal(e)),
            };
            // Cut meanwhile: what was read may hold the new hole; read again.
            if self.record(id)?.meta.log_cut != cut {
                continue;
            }
            let done = finished && next == offset + bytes.len() as u64 && bytes.len() < 1 << 20;
            if !bytes.is_empty() || done || Instant::now() >= deadline {
                return Ok(LogRead { bytes, next, done });
            }
            changed.mark_unchanged();
            if fresh(&rec) {
                self.watch_fresh(id);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, changed.changed()).await;
        }
    }

    /// Looks at fresh job `id`'s log every [`FRESH_POLL`] while it is
    /// fresh and followed, and wakes its followers when it grows: one task
    /// per job, however many follow it. Each follower reading the log
    /// every 20 ms itself made 50 followers of a silent job cost labd
    /// three times its idle CPU (`bench/labd-load.sh`).
    fn watch_fresh(self: &Arc<Self>, id: &str) {
        if !self.logs.start_watching(id) {
            return;
        }
        let (me, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(FRESH_POLL).await;
                let (node, job) = (me.node.clone(), id.clone());
                let looked = off_runtime(move || {
                    let rec = node.job(&job).ok().flatten()?;
                    let size = std::fs::symlink_metadata(node.log_path(&job)).map(|m| m.len());
                    Some((fresh(&rec), size.ok()))
                })
                .await;
                match looked {
                    Some((true, size)) if me.logs.followed(&id) => {
                        if let Some(size) = size {
                            me.logs.wake(&id, Some(size));
                        }
                    }
                    _ => break,
                }
            }
            me.logs.stop_watching(&id);
        });
    }
}

/// Whether a job needs the store: its code or data come from it, or its
/// outputs go there (a hold needs none of it).
fn needs_store(req: &SubmitRequest) -> bool {
    req.code.is_some() || !req.data.is_empty() || req.outputs.is_some()
}
