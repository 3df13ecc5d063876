//! labd: the node engine, the store, the shared trees and the outputs
//! pushes, behind the API's operations. The HTTP layer ([`crate::serve`])
//! only authenticates and translates.

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use labsync_store::{push, NoProgress, NodeCache, PushOptions, Remote, Repo};

use crate::api::ConnLimits;
use crate::error::{ApiError, PrepareError};
use crate::gpu::GpuInventory;
use crate::leases::{JobMeta, JobRecord, JobState};
use crate::node::{Node, NodeConfig, NodeError, Submit};
use crate::proto::{Info, JobView, SubmitRequest};
use crate::secret::{RedactedOptions, Secret};
use crate::status::GpuStatus;
use crate::trees::{check_outputs, make_workdir, Trees};
use crate::users;

/// How long a file in a running job's outputs must have been left alone
/// before a periodic push takes it as it is: `torch.save` writes in place,
/// and a copy taken mid-write would be the checkpoint a crash leaves.
const OUTPUTS_SETTLE: Duration = Duration::from_secs(5);

/// Tries of a final outputs push that fails reading the outputs themselves.
const UNREADABLE_TRIES: u32 = 3;

/// How long an ended job stays in the default listing (`labrun ps`).
const RECENT: Duration = Duration::from_secs(86_400);

/// The longest wait between two tries of a final outputs push: a store
/// outage of hours is normal, and the checkpoints wait for it.
const OUTPUTS_RETRY_MAX: Duration = Duration::from_secs(600);

/// Everything labd is told (the binary resolves files, flags and defaults).
/// Its `Debug` shows no token and no store credential.
#[derive(Clone)]
pub struct DaemonConfig {
    /// This node's name.
    pub node_name: String,
    /// State database, logs and job folders.
    pub state_dir: PathBuf,
    /// Store URL.
    pub store: String,
    /// Backend options of the store.
    pub store_options: Vec<(String, String)>,
    /// Node cache folder (packs and shared trees).
    pub cache_dir: PathBuf,
    /// Node cache cap, bytes.
    pub cache_max: u64,
    /// How outputs pushes compress compressible chunks.
    pub compression: labsync_store::Codec,
    /// Cap on the shared read-only trees, bytes; trees no active job uses
    /// are removed, least recently used first, above it.
    pub trees_max: u64,
    /// A GPU with more foreign memory than this is not free.
    pub foreign_limit: u64,
    /// Deadline of one inventory read.
    pub inventory_deadline: Duration,
    /// SIGTERM → SIGKILL grace of `labrun kill`.
    pub kill_grace: Duration,
    /// Default time between pushes of a job's outputs.
    pub outputs_every: Duration,
    /// First wait before a failed final outputs push is tried again; it
    /// doubles after each failure, up to 10 minutes.
    pub outputs_retry: Duration,
    /// How long a job's working folder (and its log) stays after it ended.
    pub work_keep: Duration,
    /// Cap on one job's log on disk: its first and last halves are kept.
    pub log_max: u64,
    /// Run each job as the Unix user who submitted it (only when labd is root).
    pub run_as_submitter: bool,
    /// (user, token) pairs.
    pub tokens: Vec<(String, Secret)>,
    /// Users who may kill and read every job.
    pub admins: Vec<String>,
    /// How often ended jobs are reaped and queued ones started.
    pub tick: Duration,
    /// What connections may hold open (before any token is checked).
    pub conn_limits: ConnLimits,
    /// Jobs one user may have queued (waiting or being prepared) at once.
    pub max_queued_per_user: usize,
}

impl std::fmt::Debug for DaemonConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonConfig")
            .field("node_name", &self.node_name)
            .field("state_dir", &self.state_dir)
            .field("store", &self.store)
            .field("store_options", &RedactedOptions(&self.store_options))
            .field("cache_dir", &self.cache_dir)
            .field("cache_max", &self.cache_max)
            .field("trees_max", &self.trees_max)
            .field("run_as_submitter", &self.run_as_submitter)
            .field("tokens", &self.tokens)
            .field("admins", &self.admins)
            .finish_non_exhaustive()
    }
}

/// Who is calling, from the token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The user.
    pub user: String,
    /// May kill and read every job.
    pub admin: bool,
}

/// A log read.
#[derive(Debug)]
pub struct LogRead {
    /// The bytes from the offset asked for.
    pub bytes: Vec<u8>,
    /// Offset to ask for next.
    pub next: u64,
    /// The job ended, its outputs are saved, and this is the end of its log.
    pub done: bool,
}

/// A running labd.
pub struct Daemon {
    cfg: DaemonConfig,
    node: Arc<Node>,
    repo: Repo,
    cache: Arc<NodeCache>,
    trees: Arc<Trees>,
    /// When trees were last checked against their cap.
    evicted_at: Mutex<Instant>,
    /// An eviction pass is running.
    evicting: std::sync::atomic::AtomicBool,
    /// BLAKE3 of each token: comparing hashes is constant-time and keeps no token in memory.
    tokens: Vec<(blake3::Hash, String)>,
    /// Jobs whose outputs are being pushed right now.
    pushing: Mutex<HashSet<String>>,
    /// When each running job's outputs were last pushed, and failed final pushes.
    pushed_at: Mutex<std::collections::HashMap<String, (Instant, u32)>>,
    /// Per job followed: bumped by the ticker when its log grows or the job
    /// changes state, so log followers sleep until then.
    log_watch: Mutex<std::collections::HashMap<String, tokio::sync::watch::Sender<u64>>>,
    /// Held while a log is bounded.
    log_bounding: Mutex<()>,
    /// Jobs whose log could not be cut (said once each).
    log_warned: Mutex<HashSet<String>>,
    inventory: String,
    _lock: File,
}

/// Runs blocking work (the engine forks, waits and scans `/proc`) off the runtime.
pub async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(e.to_string())
}

impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Refused(m) => ApiError::Conflict(m),
            NodeError::NoJob(id) => ApiError::NotFound(format!("no job {id}")),
            NodeError::TooMany(m) => ApiError::TooMany(m),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// Why labd could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    /// Another labd holds the state folder.
    #[error(
        "another labd is running on {0} (see its labd.pid); stop it or use another --state-dir"
    )]
    Running(PathBuf),
    /// The state folder, cache or store could not be opened.
    #[error("{0}")]
    Open(String),
}

impl Daemon {
    /// Opens the state (adopting jobs that outlived a previous labd), the store and the cache.
    pub async fn open(
        cfg: DaemonConfig,
        inventory: Arc<dyn GpuInventory>,
    ) -> Result<Arc<Daemon>, DaemonError> {
        let open = |what: &str, e: &dyn std::fmt::Display| {
            DaemonError::Open(format!("cannot open {what}: {e}"))
        };
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| open(&cfg.state_dir.display().to_string(), &e))?;
        let lock_path = cfg.state_dir.join("labd.lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| open(&lock_path.display().to_string(), &e))?;
        if !try_lock(&lock) {
            return Err(DaemonError::Running(cfg.state_dir.clone()));
        }
        let _ = std::fs::write(
            cfg.state_dir.join("labd.pid"),
            std::process::id().to_string(),
        );
        let inventory_name = inventory.describe();
        let node_cfg = NodeConfig {
            state_dir: cfg.state_dir.clone(),
            foreign_limit: cfg.foreign_limit,
            inventory_deadline: cfg.inventory_deadline,
            max_queued_per_user: cfg.max_queued_per_user,
        };
        let node = off_runtime(move || Node::open(node_cfg, inventory))
            .await
            .map_err(|e| open("the job state", &e))?;
        let remote = Remote::open(&cfg.store, &cfg.store_options)
            .map_err(|e| open(&format!("store {}", cfg.store), &e))?;
        let repo = Repo::open(remote, None)
            .await
            .map_err(|e| open(&format!("store {}", cfg.store), &e))?;
        // Outputs already in the store name jobs this node must not repeat.
        let runs = repo
            .remote()
            .list("refs/runs/")
            .await
            .map_err(|e| open(&format!("store {}", cfg.store), &e))?;
        let highest = runs
            .iter()
            .filter_map(|o| {
                let rest = o.key.strip_prefix("refs/runs/")?;
                crate::node::job_number(rest.split_once('/')?.0)
            })
            .max();
        if let Some(n) = highest {
            node.ids_above(n);
        }
        let cache = NodeCache::open(&cfg.cache_dir, cfg.cache_max)
            .map_err(|e| open(&format!("cache {}", cfg.cache_dir.display()), &e))?;
        let trees = Trees::new(&cache).map_err(|e| open("the shared trees", &e))?;
        let jobs_dir = cfg.state_dir.join("jobs");
        std::fs::create_dir_all(&jobs_dir).map_err(|e| open("the job folders", &e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path, m: u32| {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(m))
                    .map_err(|e| open(&p.display().to_string(), &e))
            };
            // The database holds queued jobs' environments and the logs their
            // output: labd's alone. Jobs run as their submitters must still
            // reach their working folders through the state folder.
            mode(&cfg.state_dir.join("state-v1.redb"), 0o600)?;
            mode(&cfg.state_dir.join("logs"), 0o700)?;
            if users::euid() == 0 {
                mode(&cfg.state_dir, 0o755)?;
                mode(&jobs_dir, 0o755)?;
            }
        }
        let tokens = cfg
            .tokens
            .iter()
            .map(|(u, t)| (blake3::hash(t.expose().as_bytes()), u.clone()))
            .collect();
        Ok(Arc::new(Daemon {
            node: Arc::new(node),
            repo,
            cache: Arc::new(cache),
            trees: Arc::new(trees),
            evicted_at: Mutex::new(Instant::now()),
            evicting: std::sync::atomic::AtomicBool::new(false),
            tokens,
            pushing: Mutex::new(HashSet::new()),
            pushed_at: Mutex::new(Default::default()),
            log_watch: Mutex::new(Default::default()),
            log_bounding: Mutex::new(()),
            log_warned: Mutex::new(HashSet::new()),
            inventory: inventory_name,
            _lock: lock,
            cfg,
        }))
    }

    /// The caller a bearer token belongs to.
    pub fn authenticate(&self, token: &str) -> Option<Caller> {
        let h = blake3::hash(token.as_bytes());
        // Every entry is compared (blake3::Hash's `==` is constant-time).
        let mut found = None;
        for (t, user) in &self.tokens {
            if *t == h {
                found = Some(user.clone());
            }
        }
        found.map(|user| Caller {
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
        }
    }

    /// Every GPU and what it is.
    pub async fn gpus(self: &Arc<Self>) -> Result<Vec<GpuStatus>, ApiError> {
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
        Ok(recs
            .into_iter()
            .map(|rec| {
                let why = match (&rec.state, &rec.meta.preparing, &gpus) {
                    (JobState::Queued, Some(p), _) => Some(p.clone()),
                    (JobState::Queued, None, Some(g)) => self.node.why_waiting(&rec.id, g),
                    _ => None,
                };
                JobView {
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

    /// Active jobs and those that ended in the last day, oldest first: what
    /// `labrun ps` shows. Older ones come from [`Daemon::history`].
    pub async fn jobs(self: &Arc<Self>) -> Result<Vec<JobView>, ApiError> {
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
    ) -> Result<Vec<JobView>, ApiError> {
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

    fn record(&self, id: &str) -> Result<JobRecord, ApiError> {
        self.node
            .job(id)?
            .ok_or_else(|| ApiError::NotFound(format!("no job {id} on {}", self.cfg.node_name)))
    }

    /// One job.
    pub async fn job(self: &Arc<Self>, id: &str) -> Result<JobView, ApiError> {
        let (me, id) = (self.clone(), id.to_string());
        off_runtime(move || {
            let rec = me.record(&id)?;
            Ok(me.views(vec![rec])?.remove(0))
        })
        .await
    }

    fn own(&self, caller: &Caller, rec: &JobRecord, what: &str) -> Result<(), ApiError> {
        if caller.admin || caller.user == rec.user {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "job {} is {}'s; only they or an admin may {what} it",
                rec.id, rec.user
            )))
        }
    }

    /// Takes a job: records it, materialises its code and data in the
    /// background, then queues it.
    pub async fn submit(
        self: &Arc<Self>,
        caller: &Caller,
        req: SubmitRequest,
    ) -> Result<JobView, ApiError> {
        if req.argv.is_empty() {
            return Err(ApiError::BadRequest("no command to run".into()));
        }
        if let Some(o) = &req.outputs {
            check_outputs(o).map_err(ApiError::BadRequest)?;
        }
        for d in &req.data {
            let ok = d.env.starts_with("LABRUN_DATA_")
                && d.env
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                return Err(ApiError::BadRequest(format!(
                    "data variable {:?} must be LABRUN_DATA_ and capitals, digits or _",
                    d.env
                )));
            }
        }
        let run_as = if self.cfg.run_as_submitter && users::euid() == 0 {
            // NSS may ask a directory server: off the runtime.
            let name = caller.user.clone();
            let u = off_runtime(move || users::user_by_name(&name)).await;
            let u = u.ok_or_else(|| {
                ApiError::Conflict(format!(
                    "no Unix user {:?} on {}: labd runs jobs as the user who submits them",
                    caller.user, self.cfg.node_name
                ))
            })?;
            Some((u.uid, u.gid))
        } else {
            None
        };
        let meta = JobMeta {
            code: req.code.as_ref().map(|t| t.label.clone()),
            data: req.data.iter().map(|d| d.tree.label.clone()).collect(),
            work: None,
            outputs: req.outputs.clone(),
            outputs_every_s: req
                .outputs_every_s
                .unwrap_or(self.cfg.outputs_every.as_secs())
                .max(1),
            outputs_saved: None,
            outputs_error: None,
            outputs_pending: req.outputs.is_some(),
            outputs_failures: 0,
            log_cut: None,
            preparing: Some("materialising code and data".into()),
            run_as,
            trees: req
                .code
                .iter()
                .chain(req.data.iter().map(|d| &d.tree))
                .map(|t| t.snapshot.clone())
                .collect(),
        };
        let mut submit = Submit {
            user: caller.user.clone(),
            argv: req.argv.clone(),
            cwd: PathBuf::new(),
            env: Vec::new(),
            gpus: req.gpus,
            min_free_bytes: req.gpu_mem,
            run_as,
            meta,
        };
        let node = self.node.clone();
        let s = submit.clone();
        let id = off_runtime(move || node.reserve(&s)).await?;
        let work = self.cfg.state_dir.join("jobs").join(&id).join("work");
        submit.cwd = work.clone();
        submit.meta.work = Some(work);
        let me = self.clone();
        let job = id.clone();
        tokio::spawn(async move {
            let outcome = me.prepare(&job, &req, &mut submit).await;
            let (node, job) = (me.node.clone(), job.clone());
            let this = job.clone();
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
            me.wake_followers(&this, None);
        });
        self.job(&id).await
    }

    async fn prepare(
        &self,
        id: &str,
        req: &SubmitRequest,
        submit: &mut Submit,
    ) -> Result<(), PrepareError> {
        let code = match &req.code {
            Some(t) => Some(self.trees.get(&self.repo, &self.cache, t).await?),
            None => None,
        };
        let mut env: Vec<(String, String)> = req
            .env
            .iter()
            .filter(|(k, _)| k != "LABRUN_TOKEN" && !k.starts_with("LABRUN_DATA"))
            .cloned()
            .collect();
        for (i, d) in req.data.iter().enumerate() {
            let path = self.trees.get(&self.repo, &self.cache, &d.tree).await?;
            let path = path.display().to_string();
            if i == 0 {
                env.push(("LABRUN_DATA".into(), path.clone()));
            }
            env.push((d.env.clone(), path));
        }
        env.push(("LABRUN_NODE".into(), self.cfg.node_name.clone()));
        submit.env = env;
        let (work, outputs, owner) = (submit.cwd.clone(), req.outputs.clone(), submit.run_as);
        off_runtime(move || make_workdir(code.as_deref(), &work, outputs.as_deref(), owner))
            .await?;
        tracing::info!("job {id} ready in {}", submit.cwd.display());
        Ok(())
    }

    /// Kills a job (or drops it from the queue); its GPUs are freed and its
    /// outputs pushed.
    pub async fn kill(self: &Arc<Self>, caller: &Caller, id: &str) -> Result<JobView, ApiError> {
        let (me, job) = (self.clone(), id.to_string());
        let rec = off_runtime(move || me.record(&job)).await?;
        self.own(caller, &rec, "kill")?;
        if matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. }) {
            return Err(ApiError::Conflict(format!("job {id} has already ended")));
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

    /// The job's log from `offset`, waiting up to `wait` for new bytes.
    pub async fn log(
        self: &Arc<Self>,
        caller: &Caller,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogRead, ApiError> {
        let rec = self.record(id)?;
        self.own(caller, &rec, "read the log of")?;
        let path = self.node.log_path(id);
        let deadline = Instant::now() + wait.min(Duration::from_secs(30));
        // Subscribed before the first read: a change after it wakes us.
        let mut changed = self
            .log_watch
            .lock()
            .expect("labd poisoned")
            .entry(id.to_string())
            .or_insert_with(|| tokio::sync::watch::channel(0).0)
            .subscribe();
        loop {
            // Whether it had ended is read before the file, so no last line is missed.
            let rec = self.record(id)?;
            // A final push that failed is retried by labd for as long as it
            // takes; the log's reader is told at its first failure.
            let finished = matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. })
                && (!rec.meta.outputs_pending || rec.meta.outputs_failures > 0);
            let p = path.clone();
            let cut = rec.meta.log_cut;
            let (bytes, next) = off_runtime(move || read_log(&p, offset, 1 << 20, cut))
                .await
                .map_err(internal)?;
            // Cut meanwhile: what was read may hold the new hole; read again.
            if self.record(id)?.meta.log_cut != cut {
                continue;
            }
            let done = finished && next == offset + bytes.len() as u64 && bytes.len() < 1 << 20;
            if !bytes.is_empty() || done || Instant::now() >= deadline {
                return Ok(LogRead { bytes, next, done });
            }
            changed.mark_unchanged();
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, changed.changed()).await;
        }
    }

    /// Reaps ended jobs, starts what fits, and pushes outputs that are due.
    pub async fn tick(self: &Arc<Self>) {
        let me = self.clone();
        let jobs = off_runtime(move || {
            let ended = me.node.reap()?;
            me.node.schedule()?;
            // Queued jobs have neither a log nor outputs yet.
            let active = me.node.active_where(|j| j.state != JobState::Queued);
            // Every job that may still write, and those that just stopped.
            let writing = active
                .iter()
                .filter(|j| matches!(j.state, JobState::Running { .. }))
                .map(|j| j.id.as_str())
                .chain(ended.iter().map(|(id, _)| id.as_str()));
            for id in writing {
                me.bound_log(id);
            }
            for (id, _) in &ended {
                me.wake_followers(id, None);
            }
            me.log_watch
                .lock()
                .expect("labd poisoned")
                .retain(|_, tx| tx.receiver_count() > 0);
            Ok::<_, NodeError>(active)
        })
        .await;
        let jobs = match jobs {
            Ok(j) => j,
            Err(e) => {
                tracing::error!("job state: {e}");
                return;
            }
        };
        let due = {
            let mut at = self.evicted_at.lock().expect("labd poisoned");
            let due = at.elapsed() >= Duration::from_secs(5);
            if due {
                *at = Instant::now();
            }
            due
        };
        // Its own task: removing a big tree must not hold up reaping and scheduling.
        if due
            && !self
                .evicting
                .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            let me = self.clone();
            tokio::spawn(off_runtime(move || {
                let node = me.node.clone();
                let in_use = move |snap: &str| {
                    // An error reading the state keeps every tree.
                    !node
                        .active_where(|j| j.meta.trees.iter().any(|t| t == snap))
                        .is_empty()
                };
                for snap in me.trees.evict(me.cfg.trees_max, &in_use) {
                    tracing::info!("removed the unused tree of snapshot {snap} (over trees_max)");
                }
                me.sweep_work_folders();
                me.evicting
                    .store(false, std::sync::atomic::Ordering::Release);
            }));
        }
        for j in jobs {
            if j.meta.outputs.is_none() {
                continue;
            }
            let ended = matches!(j.state, JobState::Exited { .. } | JobState::Failed { .. });
            let due = match j.state {
                // A failed final push is tried again, with backoff, until it succeeds.
                _ if ended => {
                    j.meta.outputs_pending
                        && match self.pushed_at.lock().expect("labd poisoned").get(&j.id) {
                            Some(&(t, failed)) if failed > 0 => {
                                t.elapsed() >= self.retry_delay(failed)
                            }
                            _ => true,
                        }
                }
                JobState::Running { .. } => {
                    let every = Duration::from_secs(j.meta.outputs_every_s);
                    let at = self
                        .pushed_at
                        .lock()
                        .expect("labd poisoned")
                        .get(&j.id)
                        .copied();
                    match at {
                        Some((t, _)) => t.elapsed() >= every,
                        None => j.started_at.is_some_and(|s| {
                            crate::leases::unix_now().saturating_sub(s) >= every.as_secs()
                        }),
                    }
                }
                _ => false,
            };
            if due
                && self
                    .pushing
                    .lock()
                    .expect("labd poisoned")
                    .insert(j.id.clone())
            {
                let me = self.clone();
                tokio::spawn(async move {
                    let id = j.id.clone();
                    me.push_outputs(j, ended).await;
                    me.pushing.lock().expect("labd poisoned").remove(&id);
                });
            }
        }
    }

    async fn push_outputs(&self, job: JobRecord, last: bool) {
        let (Some(work), Some(out)) = (&job.meta.work, &job.meta.outputs) else {
            return;
        };
        let dir = work.join(out);
        // An error reading the outputs themselves (a file the job's user made
        // unreadable, a symlink out of the folder) will not heal by waiting,
        // unlike a store that is down or full.
        let mut unreadable = false;
        let result = if dir.is_dir() {
            let opts = PushOptions {
                name: format!("runs/{}", job.id),
                files_cache: Some(self.cache.files_cache_dir()),
                threads: 2,
                user: job.user.clone(),
                host: self.cfg.node_name.clone(),
                read_as: job.meta.run_as,
                // While the job runs, a checkpoint may be half saved: keep
                // its previous copy until it has been still for a while.
                // The push after the job ended takes everything as it is.
                settle: (!last).then_some(OUTPUTS_SETTLE),
                compression: self.cfg.compression,
            };
            push(&self.repo, &dir, &opts, Arc::new(NoProgress))
                .await
                .map(|o| o.record.label())
                .map_err(|e| {
                    let canon = dir.canonicalize().ok();
                    unreadable = matches!(&e, labsync_store::Error::Io { path, .. }
                        if path.starts_with(&dir)
                            || canon.as_ref().is_some_and(|c| path.starts_with(c)));
                    chain(&e)
                })
        } else {
            Err(format!("the job left no {out} folder to save"))
        };
        // Failed final pushes are counted (periodic ones are not: a store
        // that was down during the run must not cost the last checkpoint).
        let attempts = {
            let mut at = self.pushed_at.lock().expect("labd poisoned");
            let e = at.entry(job.id.clone()).or_insert((Instant::now(), 0));
            *e = (Instant::now(), e.1 + u32::from(last && result.is_err()));
            e.1
        };
        match &result {
            Ok(label) => tracing::info!("job {}: outputs saved as {label}", job.id),
            Err(e) if last => tracing::warn!(
                "job {}: outputs not saved yet ({attempts} tries): {e}; next try in {} s",
                job.id,
                self.retry_delay(attempts).as_secs()
            ),
            Err(e) => tracing::warn!("job {}: outputs not saved: {e}", job.id),
        }
        // Until the final push succeeds the job stays active, so its working
        // folder (the only copy of its checkpoints) is never swept. A job
        // that left no outputs folder has nothing to wait for; one whose
        // outputs cannot be read as its user gets UNREADABLE_TRIES tries, not
        // an eternity of them holding its folder and trees.
        let gave_up = unreadable && attempts >= UNREADABLE_TRIES;
        let settled = last && (result.is_ok() || !dir.is_dir() || gave_up);
        let result = match result {
            Err(e) if gave_up => Err(format!(
                "{e} (gave up after {attempts} tries: the job's user cannot read its outputs)"
            )),
            r => r,
        };
        let node = self.node.clone();
        let id = job.id.clone();
        let r = off_runtime(move || {
            node.update_meta(&id, |m| {
                match result {
                    Ok(label) => {
                        m.outputs_saved = Some(label);
                        m.outputs_error = None;
                    }
                    Err(e) => m.outputs_error = Some(e),
                }
                m.outputs_failures = if last && !settled { attempts } else { 0 };
                if settled {
                    m.outputs_pending = false;
                }
            })
        })
        .await;
        if let Err(e) = r {
            tracing::error!("job state: {e}");
        }
        self.wake_followers(&job.id, None);
        if settled {
            self.pushed_at
                .lock()
                .expect("labd poisoned")
                .remove(&job.id);
        }
    }

    /// Wakes the followers of `id`'s log: when `size` is new, or always
    /// (`None`: the job's state changed).
    fn wake_followers(&self, id: &str, size: Option<u64>) {
        let watch = self.log_watch.lock().expect("labd poisoned");
        if let Some(tx) = watch.get(id) {
            tx.send_if_modified(|v| match size {
                Some(s) if *v == s => false,
                Some(s) => {
                    *v = s;
                    true
                }
                None => true,
            });
        }
    }

    /// Keeps the job's log under `log_max` on disk: once it grows past the
    /// cap (plus an eighth, so the database is written once per few MB, not
    /// per line), everything between its first half and its last half is
    /// punched out. The job keeps appending to the same file; readers
    /// skipping the hole are told how much was cut.
    fn bound_log(&self, id: &str) {
        // One at a time: a kill's tick may run beside the ticker's, and a
        // cut must only ever grow.
        let _one = self.log_bounding.lock().expect("labd poisoned");
        let cap = self.cfg.log_max;
        let path = self.node.log_path(id);
        let Ok(size) = std::fs::metadata(&path).map(|m| m.len()) else {
            return;
        };
        self.wake_followers(id, Some(size));
        let Ok(Some(rec)) = self.node.job(id) else {
            return;
        };
        const BLOCK: u64 = 4096;
        // Bytes [start, done) are cut already; start is fixed at the first cut.
        let start = rec
            .meta
            .log_cut
            .map_or((cap / 2).div_ceil(BLOCK) * BLOCK, |(s, _)| s);
        let done = rec.meta.log_cut.map_or(start, |(_, e)| e);
        let on_disk = start + size.saturating_sub(done);
        let end = size.saturating_sub(cap / 2) / BLOCK * BLOCK;
        if on_disk <= cap + cap / 8 || end <= done {
            return;
        }
        // Recorded before the bytes go, so a reader never reads the hole
        // as zeros: it either sees the cut or reads bytes still there.
        if let Err(e) = self
            .node
            .update_meta(id, |m| m.log_cut = Some((start, end)))
        {
            tracing::error!("job state: {e}");
            return;
        }
        if let Err(e) = punch_hole(&path, done, end - done) {
            // Once per job: a file system without hole punching (NFS) would
            // say it ten times a second.
            if self
                .log_warned
                .lock()
                .expect("labd poisoned")
                .insert(id.to_string())
            {
                tracing::warn!(
                    "job {id}: cannot free the cut part of its log {} ({e}); it stays on disk",
                    path.display()
                );
            }
        }
    }

    /// How long to wait after the `failed`-th failure of a final outputs push.
    fn retry_delay(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(20);
        self.cfg
            .outputs_retry
            .checked_mul(1u32 << doublings)
            .map_or(OUTPUTS_RETRY_MAX, |d| d.min(OUTPUTS_RETRY_MAX))
    }

    /// Removes the working folders of jobs that ended (outputs saved) more
    /// than `work_keep` ago: checkpoints are in the store by then, and a
    /// node's disk must not fill with old runs.
    fn sweep_work_folders(&self) {
        let jobs_dir = self.cfg.state_dir.join("jobs");
        let Ok(rd) = std::fs::read_dir(&jobs_dir) else {
            return;
        };
        let now = crate::leases::unix_now();
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let old = match self.node.job(&id) {
                Ok(Some(j)) => {
                    !j.active()
                        && j.ended_at
                            .is_some_and(|t| now >= t + self.cfg.work_keep.as_secs())
                }
                Ok(None) => true,
                Err(_) => false,
            };
            if old {
                match std::fs::remove_dir_all(e.path()) {
                    Ok(()) => tracing::info!("removed the working folder and log of job {id}"),
                    Err(err) => tracing::warn!("cannot remove {}: {err}", e.path().display()),
                }
                let log = self.node.log_path(&id);
                if let Err(err) = std::fs::remove_file(&log) {
                    if err.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!("cannot remove {}: {err}", log.display());
                    }
                }
            }
        }
    }

    /// The ticker: every `tick`, until `shutdown`.
    pub async fn run_ticker(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut shutdown = shutdown;
        let mut every = tokio::time::interval(self.cfg.tick);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => self.tick().await,
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Where shared trees live (tests look at them).
    pub fn trees_dir(&self) -> PathBuf {
        self.trees.path("")
    }
}

/// An error and its causes, as one line for a job's record: the store's
/// errors name the path and leave the OS's reason ("No space left on
/// device") to their source, which a user reading `labrun ps` needs too.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out += ": ";
            out += &s_text;
        }
        next = s.source();
    }
    out
}

fn read_from(path: &Path, offset: u64, max: usize) -> std::io::Result<Vec<u8>> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = Vec::new();
    f.take(max as u64).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Up to `max` bytes of a job's log from `offset`, and the offset to ask
/// for next. The range `cut` is a hole labd punched: a reader at its start
/// (or inside it) gets one line saying how much was cut, then the bytes after
/// it; a read never runs into it.
fn read_log(
    path: &Path,
    offset: u64,
    max: usize,
    cut: Option<(u64, u64)>,
) -> std::io::Result<(Vec<u8>, u64)> {
    match cut {
        Some((start, end)) if (start..end).contains(&offset) => {
            let mut out = format!(
                "\n[labd: {} bytes of output cut here to keep the log under its cap (log_max)]\n",
                end - offset
            )
            .into_bytes();
            let rest = read_from(path, end, max)?;
            let next = end + rest.len() as u64;
            out.extend(rest);
            Ok((out, next))
        }
        Some((start, _)) if offset < start => {
            let bytes = read_from(path, offset, max.min((start - offset) as usize))?;
            let next = offset + bytes.len() as u64;
            Ok((bytes, next))
        }
        _ => {
            let bytes = read_from(path, offset, max)?;
            let next = offset + bytes.len() as u64;
            Ok((bytes, next))
        }
    }
}

/// Frees `len` bytes of `path` from `offset` (the file keeps its size).
#[allow(unsafe_code)]
fn punch_hole(path: &Path, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = File::options().write(true).open(path)?;
    // SAFETY: fallocate(2) on a descriptor we own, with plain integers; it
    // touches no memory of ours.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[allow(unsafe_code)]
fn try_lock(f: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor we own; no memory is shared.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}
