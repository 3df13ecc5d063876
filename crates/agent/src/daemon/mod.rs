//! labd, split by role so a coordinator can sit beside it: the node engine
//! ([`Node`]: queue, leases, runner), the shared trees ([`Trees`]:
//! materialise, evict, with [`housekeeping`]), the [`outputs`] saver and the
//! job [`logs`], each a type with a narrow interface. [`Daemon`] owns one of
//! each, runs the ticker that drives them, and offers the API's operations
//! ([`ops`]); the HTTP layer ([`crate::serve`]) only authenticates and
//! translates.

mod here;
mod holds;
mod housekeeping;
mod limits;
mod logs;
mod ops;
mod outputs;
mod ping;
mod reporter;
pub(crate) mod shares;
mod stages;
mod warm;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use labsync_store::{NodeCache, Remote, Repo};

use crate::blocking::off_runtime;
use crate::clock::Clock;
use crate::cluster::{ClusterConfig, ClusterPeers, Coordinator};
use crate::error::JobError;
use crate::gpu::GpuInventory;
use crate::leases::JobState;
use crate::node::{Node, NodeConfig, NodeError};
use crate::secret::{RedactedOptions, Secret};
use crate::tokens::Tokens;
use crate::trees::Trees;
use crate::users;
use housekeeping::Housekeeping;
use logs::JobLogs;
use outputs::{OutputsConfig, OutputsSaver};
pub(crate) use reporter::{cache_summary, Reporter};
pub use warm::Warms;

/// What one peer, and everyone together, may hold open. A local user
/// without a token can still connect to a shared labd's socket, so these
/// hold before any authentication.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections open at once, all peers together.
    pub max: usize,
    /// Connections open at once from one Unix user (socket) or address (TCP).
    pub per_peer: usize,
    /// A connection that has not sent a whole request head this long after
    /// it opened or after its last answer is closed.
    pub header_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max: 1024,
            per_peer: 128,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// Everything labd is told (the binary resolves files, flags and defaults).
/// Its `Debug` shows no token and no store credential.
#[derive(Clone)]
pub struct DaemonConfig {
    /// This node's name.
    pub node_name: labsync_placer::NodeName,
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
    /// Bytes of trees one user's active jobs and stages may hold here
    /// (`trees_per_user`; `None`: no share).
    pub trees_per_user: Option<u64>,
    /// A GPU with more foreign memory than this is not free.
    pub foreign_limit: u64,
    /// Deadline of one inventory read.
    pub inventory_deadline: Duration,
    /// SIGTERM → SIGKILL grace of `labrun kill`.
    pub kill_grace: Duration,
    /// A hold (`labrun --hold`) whose GPUs show no utilisation for this
    /// long is given back.
    pub idle_hold: Duration,
    /// Default time between pushes of a job's outputs.
    pub outputs_every: Duration,
    /// The shortest time between pushes a job may ask for: every periodic
    /// push lists and reads the store, and a user's thousand jobs asking
    /// for one a second must not make the node push a thousand a second.
    pub outputs_every_min: Duration,
    /// First wait before a failed final outputs push is tried again; it
    /// doubles after each failure, up to 10 minutes.
    pub outputs_retry: Duration,
    /// How long a job's working folder (and its log) stays after it ended.
    pub work_keep: Duration,
    /// How long an ended job's record stays (`labrun ps --all`), at least
    /// `work_keep`: then it is forgotten, its id never given again.
    pub history_keep: Duration,
    /// Cap on one job's log on disk: its first and last halves are kept.
    pub log_max: u64,
    /// Run each job as the Unix user who submitted it (only when labd is root).
    pub run_as_submitter: bool,
    /// (user, token) pairs.
    pub tokens: Vec<(String, Secret)>,
    /// A file of more (`user = "token"` lines), read again when it changes.
    pub tokens_file: Option<PathBuf>,
    /// Users who may kill and read every job.
    pub admins: Vec<String>,
    /// How often ended jobs are reaped and queued ones started.
    pub tick: Duration,
    /// What connections may hold open (before any token is checked).
    pub conn_limits: ConnLimits,
    /// Jobs one user may have queued (waiting or being prepared) at once.
    pub max_queued_per_user: usize,
    /// Jobs without GPUs one user may have running at once.
    pub max_cpu_jobs_per_user: usize,
    /// What each job may use at most (tasks, memory).
    pub job_limits: crate::JobLimits,
    /// Where the login limits jobs get are kept (`limits_conf`).
    pub login_limits: crate::LoginLimits,
    /// labd's binary, run as each job's log keeper ([`crate::keeper`]);
    /// `None` only in this crate's tests, which have no labd binary.
    pub log_keeper: Option<PathBuf>,
    /// The cluster this node belongs to; `None`: a node of its own.
    pub cluster: Option<ClusterConfig>,
    /// How a stage's Slurm job is checked with Slurm before anything is
    /// staged for it (`[slurm]`); `None`: not checked.
    pub slurm_check: Option<SlurmCheck>,
    /// The coordinator re-ranks pending Slurm jobs (`[slurm] rerank_s`):
    /// run beside the ticker ([`crate::cluster::rerank`]).
    pub slurm_rerank: Option<crate::slurm::Rerank>,
    /// The web page and `/metrics` (`[web]`).
    pub web: crate::web::WebConfig,
    /// Telling users of their jobs' ends (`[notify]`).
    pub notify: crate::notify::NotifyConfig,
}

/// Checking a stage's job with Slurm (`squeue`): it must be
/// running (or starting) with this node as its batch host, and be the
/// asker's where jobs run as their submitters.
#[derive(Clone, Debug, Default)]
pub struct SlurmCheck {
    /// slurm.conf (`SLURM_CONF`), where not the default.
    pub conf: Option<PathBuf>,
    /// Longest wait for `squeue`.
    pub timeout: Duration,
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
            .field("trees_per_user", &self.trees_per_user)
            .field("run_as_submitter", &self.run_as_submitter)
            .field("tokens", &self.tokens)
            .field("tokens_file", &self.tokens_file)
            .field("admins", &self.admins)
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
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

/// A running labd.
pub struct Daemon {
    cfg: DaemonConfig,
    node: Arc<Node>,
    store: Arc<StoreLink>,
    cache: Arc<NodeCache>,
    trees: Arc<Trees>,
    logs: Arc<JobLogs>,
    outputs: Arc<OutputsSaver>,
    housekeeping: Arc<Housekeeping>,
    tokens: Tokens,
    inventory: String,
    /// The cluster view, on the coordinating node.
    coordinator: Option<Arc<Coordinator>>,
    /// Where packs come from in a cluster.
    peers: Option<Arc<ClusterPeers>>,
    /// `labsync warm` orders under way here.
    warms: Warms,
    /// Asks for a heartbeat now (a job ended: its GPUs are free).
    beat_now: tokio::sync::Notify,
    /// Running holds: since when each has shown no utilisation (Unix ms;
    /// `None`: busy at the last reading).
    hold_idle: std::sync::Mutex<std::collections::HashMap<crate::ids::JobId, Option<u64>>>,
    /// When the holds' GPUs were last read.
    hold_checked: std::sync::Mutex<Option<std::time::Instant>>,
    /// When unreleased stages were last checked with Slurm, and whether a
    /// check is running.
    stages_checked: std::sync::Mutex<Option<std::time::Instant>>,
    stages_checking: std::sync::atomic::AtomicBool,
    lock: Arc<StateLock>,
    /// What its loops read the time from.
    clock: Clock,
    /// Tells users of their jobs' ends.
    notifier: Arc<crate::notify::Notifier>,
}

impl Daemon {
    /// Opens the state (adopting jobs that outlived a previous labd), the store and the cache.
    pub async fn open(
        cfg: DaemonConfig,
        inventory: Arc<dyn GpuInventory>,
    ) -> Result<Arc<Daemon>, DaemonError> {
        Daemon::open_with_clock(cfg, inventory, Clock::system()).await
    }

    /// [`Daemon::open`], its loops reading the time from `clock` (a test's
    /// [`Clock::manual`]: what must not happen for seconds is shown without
    /// waiting them).
    pub async fn open_with_clock(
        cfg: DaemonConfig,
        inventory: Arc<dyn GpuInventory>,
        clock: Clock,
    ) -> Result<Arc<Daemon>, DaemonError> {
        let lock = Arc::new(StateLock {
            path: cfg.state_dir.join("labd.lock"),
            file: lock_state_dir(&cfg.state_dir)?,
        });
        let inventory_name = inventory.describe();
        let node = open_node(&cfg, inventory).await?;
        let (store, highest) = connect_store(&cfg).await?;
        let reached = store.repo.get().is_some();
        if let Some(n) = highest {
            node.ids_above(n);
        }
        let (cache, peers) = open_cache(&cfg)?;
        let trees = Trees::new(&cache).map_err(|e| open_error("the shared trees", &e))?;
        strip_setid_beside(cfg.state_dir.clone());
        let jobs_dir = cfg.state_dir.join("jobs");
        std::fs::create_dir_all(&jobs_dir).map_err(|e| open_error("the job folders", &e))?;
        set_modes(&cfg.state_dir, &jobs_dir)?;
        let tokens =
            Tokens::new(cfg.tokens.clone(), cfg.tokens_file.clone()).map_err(DaemonError::Open)?;
        let coordinator = open_coordinator(&cfg, highest, &clock)?;
        let (node, cache, trees) = (Arc::new(node), Arc::new(cache), Arc::new(trees));
        let logs = Arc::new(JobLogs::new(node.clone(), cfg.log_max));
        if !reached {
            let again = (cfg.store.clone(), cfg.store_options.clone());
            tokio::spawn(reach_store(
                again,
                store.clone(),
                node.clone(),
                coordinator.clone(),
            ));
        }
        let outputs = OutputsSaver::new(
            node.clone(),
            store.clone(),
            cache.clone(),
            logs.clone(),
            OutputsConfig {
                node_name: cfg.node_name.to_string(),
                compression: cfg.compression,
                retry: cfg.outputs_retry,
            },
        );
        let housekeeping = Housekeeping::new(
            lock.clone(),
            node.clone(),
            trees.clone(),
            housekeeping::Kept {
                trees_max: cfg.trees_max,
                jobs_dir,
                stages_dir: cfg.state_dir.join("slurm"),
                work_keep: cfg.work_keep,
                history_keep: cfg.history_keep,
            },
            clock.clone(),
        );
        Ok(Arc::new(Daemon {
            node,
            store,
            cache,
            trees,
            logs,
            outputs: Arc::new(outputs),
            housekeeping: Arc::new(housekeeping),
            tokens,
            inventory: inventory_name,
            coordinator,
            peers,
            warms: Warms::default(),
            beat_now: tokio::sync::Notify::new(),
            hold_idle: Default::default(),
            hold_checked: Default::default(),
            stages_checked: Default::default(),
            stages_checking: Default::default(),
            lock,
            clock,
            notifier: Arc::new(crate::notify::Notifier::new(cfg.notify.clone())),
            cfg,
        }))
    }

    /// Reaps ended jobs, starts what fits, keeps logs bounded, and starts
    /// housekeeping and the outputs pushes that are due.
    pub async fn tick(self: &Arc<Self>) {
        let (node, logs) = (self.node.clone(), self.logs.clone());
        let jobs = off_runtime(move || {
            let ended = node.reap()?;
            node.schedule()?;
            // Queued jobs have neither a log nor outputs yet.
            let active = node.active_where(|j| j.state != JobState::Queued);
            // Every job that may still write, and those that just stopped.
            let writing = active
                .iter()
                .filter(|j| matches!(j.state, JobState::Running { .. }))
                .map(|j| j.id.as_str())
                .chain(ended.iter().map(|(id, _)| id.as_str()));
            for id in writing {
                logs.bound(id);
            }
            for (id, _) in &ended {
                logs.wake(id, None);
            }
            logs.forget_unfollowed();
            Ok::<_, NodeError>((active, !ended.is_empty()))
        })
        .await;
        let jobs = match jobs {
            Ok((j, any_ended)) => {
                // GPUs just freed: the coordinator hears at once, not at
                // the next heartbeat.
                if any_ended {
                    self.beat_now.notify_one();
                }
                j
            }
            Err(e) => {
                tracing::error!("job state: {e}");
                return;
            }
        };
        self.release_idle_holds(&jobs).await;
        self.end_overdue(&jobs);
        self.housekeeping.start_if_due();
        self.check_stages_if_due();
        self.outputs.start_due(jobs);
    }

    /// The coordinator's scheduling passes: every `tick`, or at once after
    /// a submission, until `shutdown`.
    pub async fn run_coordinator(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) {
        let Some(c) = self.coordinator.clone() else {
            return;
        };
        let mut shutdown = shutdown;
        let reach = crate::cluster::Reach::new(self.clone());
        loop {
            tokio::select! {
                _ = c.wait_for_work(self.cfg.tick.max(std::time::Duration::from_millis(100))) => {}
                _ = shutdown.changed() => return,
            }
            c.schedule(&reach).await;
            let keep = housekeeping::kept_for(self.cfg.history_keep, self.cfg.work_keep);
            c.prune_if_due(keep, housekeeping::PRUNE_EVERY).await;
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

    /// Why this labd must stop, when its state folder was removed or
    /// replaced while it ran (its `labd.lock` is gone, or another file),
    /// with the jobs it leaves running unmanaged.
    pub fn state_dir_lost(&self) -> Option<String> {
        let why = self.lock.lost()?;
        let running: Vec<String> = (self.node)
            .active_where(|j| matches!(j.state, JobState::Running { .. }))
            .into_iter()
            .map(|j| j.id.into())
            .collect();
        Some(if running.is_empty() {
            format!("{why}; no job was running")
        } else {
            format!(
                "{why}; jobs {} keep running, managed by no labd until the old folder is put back",
                running.join(", ")
            )
        })
    }

    /// What its loops read the time from.
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// This node's name.
    pub fn node_name(&self) -> &labsync_placer::NodeName {
        &self.cfg.node_name
    }

    /// The store, or 503 while labd has not reached it since it started.
    pub(crate) fn repo(&self) -> Result<&Repo, JobError> {
        self.store.get().map_err(JobError::Unavailable)
    }

    /// Jobs one user may have queued at once.
    pub(crate) fn max_queued_per_user(&self) -> usize {
        self.cfg.max_queued_per_user
    }

    /// The node cache.
    pub(crate) fn cache(&self) -> &Arc<NodeCache> {
        &self.cache
    }

    /// Wakes the heartbeat early.
    pub(crate) fn beat_now(&self) -> &tokio::sync::Notify {
        &self.beat_now
    }

    /// The warms under way here.
    pub(crate) fn warms(&self) -> &Warms {
        &self.warms
    }

    /// `bytes` of a pack sent to a peer (in a cluster).
    pub(crate) fn served(&self, bytes: u64, by_sendfile: bool) {
        if let Some(p) = &self.peers {
            p.served(bytes, by_sendfile);
        }
    }

    /// A peer reported a copy this node served corrupt; `dropped`: the
    /// check here agreed and the pack is gone.
    pub(crate) fn reported_corrupt(&self, dropped: bool) {
        if let Some(p) = &self.peers {
            p.reported_corrupt(dropped);
        }
    }

    /// Bytes fetched by source, and served (in a cluster); the served
    /// counts are written for `labsync cache status` when they changed.
    pub(crate) fn fetched(&self) -> crate::proto::FetchCounts {
        self.peers.as_ref().map_or_else(Default::default, |p| {
            p.save();
            p.counts()
        })
    }

    /// Who tells users of their jobs' ends.
    pub(crate) fn notifier(&self) -> &Arc<crate::notify::Notifier> {
        &self.notifier
    }

    /// The web page's settings (`[web]`).
    pub(crate) fn web_config(&self) -> &crate::web::WebConfig {
        &self.cfg.web
    }

    /// The cluster settings, when in one.
    pub(crate) fn cluster(&self) -> Option<&ClusterConfig> {
        self.cfg.cluster.as_ref()
    }

    /// How pending Slurm jobs are re-ranked, on a coordinator that does.
    pub(crate) fn slurm_rerank(&self) -> Option<&crate::slurm::Rerank> {
        self.cfg.slurm_rerank.as_ref()
    }

    /// The coordinator, when this labd is one.
    pub(crate) fn coordinator(&self) -> Option<&Arc<Coordinator>> {
        self.coordinator.as_ref()
    }

    /// Where shared trees live (tests look at them).
    pub fn trees_dir(&self) -> PathBuf {
        self.trees.path("")
    }
}

/// The lock labd holds on its state folder (`labd.lock`), one labd per
/// folder.
pub(crate) struct StateLock {
    path: PathBuf,
    file: File,
}

impl StateLock {
    /// Why labd must stop, when its state folder was removed or replaced
    /// while it ran (`labd.lock` is gone, or another file): its database
    /// went with it, and a labd started on the new folder would see this one
    /// sweep job folders and logs it does not know. Other errors (a network
    /// file system that does not answer now) are logged and not taken for
    /// a loss.
    pub(crate) fn lost(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let held = self.file.metadata().ok()?;
        let lost = match std::fs::metadata(&self.path) {
            Ok(m) => (m.dev(), m.ino()) != (held.dev(), held.ino()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => {
                tracing::warn!("cannot check {}: {e}", self.path.display());
                false
            }
        };
        let folder = self.path.parent().unwrap_or(&self.path);
        lost.then(|| {
            format!(
                "the state folder {} was removed or replaced while labd ran ({} is not the lock \
                 this labd holds): stopping, so as not to act on files that are not its own",
                folder.display(),
                self.path.display()
            )
        })
    }
}

fn open_error(what: &str, e: &dyn std::fmt::Display) -> DaemonError {
    DaemonError::Open(format!("cannot open {what}: {e}"))
}

/// Creates the state folder and takes its lock (one labd per folder), and
/// writes `labd.pid` for admins.
fn lock_state_dir(state_dir: &Path) -> Result<File, DaemonError> {
    std::fs::create_dir_all(state_dir)
        .map_err(|e| open_error(&state_dir.display().to_string(), &e))?;
    let lock_path = state_dir.join("labd.lock");
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| open_error(&lock_path.display().to_string(), &e))?;
    if !try_lock(&lock) {
        return Err(DaemonError::Running(state_dir.to_path_buf()));
    }
    let _ = std::fs::write(state_dir.join("labd.pid"), std::process::id().to_string());
    Ok(lock)
}

/// Step 1 of [`Daemon::open`]: the job engine over its records and GPUs.
async fn open_node(
    cfg: &DaemonConfig,
    inventory: Arc<dyn GpuInventory>,
) -> Result<Node, DaemonError> {
    let node_cfg = NodeConfig {
        state_dir: cfg.state_dir.clone(),
        foreign_limit: cfg.foreign_limit,
        inventory_deadline: cfg.inventory_deadline,
        max_queued_per_user: cfg.max_queued_per_user,
        max_cpu_jobs_per_user: cfg.max_cpu_jobs_per_user,
        limits: cfg.job_limits,
        login_limits: cfg.login_limits.clone(),
        log_keeper: cfg.log_keeper.clone(),
    };
    off_runtime(move || Node::open(node_cfg, inventory))
        .await
        .map_err(|e| open_error("the job state", &e))
}

/// Step 2: the store, reached now or not (labd then starts without it
/// and keeps trying), and the highest job number it holds.
async fn connect_store(cfg: &DaemonConfig) -> Result<(Arc<StoreLink>, Option<u64>), DaemonError> {
    let store = Arc::new(StoreLink::new(&cfg.store));
    match open_store(&cfg.store, &cfg.store_options).await {
        Ok((repo, highest)) => {
            let _ = store.repo.set(repo);
            Ok((store, highest))
        }
        Err(StoreOpen::Fatal(e)) => Err(e),
        Err(StoreOpen::NotYet(why)) => {
            tracing::warn!(
                "store {} not reachable ({why}): labd starts without it and keeps trying; \
                 the jobs it has run, are killed and logged as usual, new jobs are refused \
                 and outputs are saved once it answers",
                cfg.store
            );
            *store.why.lock().expect("store poisoned") = why;
            Ok((store, None))
        }
    }
}

/// The file in a labd's cache folder that holds its `cache_max`.
pub const CACHE_CAP_FILE: &str = "labd-cap-v1.json";

/// Step 3: the node cache; in a cluster, packs come from peers that hold
/// them first.
fn open_cache(cfg: &DaemonConfig) -> Result<(NodeCache, Option<Arc<ClusterPeers>>), DaemonError> {
    let cache = NodeCache::open(&cfg.cache_dir, cfg.cache_max)
        .map_err(|e| open_error(&format!("cache {}", cfg.cache_dir.display()), &e))?;
    // labd's cap, for `labsync cache status` on this cache (which would
    // otherwise show its own default cap: issue 43).
    let cap = serde_json::json!({ "cache_max": cfg.cache_max, "node": cfg.node_name });
    if let Err(e) = labsync_store::write_atomic(
        &cfg.cache_dir.join(CACHE_CAP_FILE),
        cap.to_string().as_bytes(),
    ) {
        tracing::warn!(
            "cannot write {CACHE_CAP_FILE} in {}: {e}",
            cfg.cache_dir.display()
        );
    }
    let peers = cfg.cluster.as_ref().map(|c| {
        Arc::new(ClusterPeers::new(
            &cfg.node_name,
            c.key.clone(),
            c.tls.clone(),
            c.coordinator.clone(),
            &cfg.cache_dir,
        ))
    });
    Ok(match &peers {
        Some(p) => (cache.with_peers(p.clone()), peers),
        None => (cache, None),
    })
}

/// Strips the setuid bits of old copies in the working folders, once per
/// start, beside it: the walk goes through users' folders, where a look
/// can block (a FUSE mount of theirs).
fn strip_setid_beside(state_dir: PathBuf) {
    let _ = std::thread::Builder::new()
        .name("labd-setid".into())
        .spawn(
            move || match crate::trees::strip_old_setid_copies(&state_dir) {
                Ok(0) => {}
                Ok(n) => tracing::warn!(
                    "{n} entries of the working folders under {} could not be looked at for \
                     setuid copies",
                    state_dir.display()
                ),
                // Tried again at the next start.
                Err(e) => tracing::error!(
                    "cannot strip setuid bits from old copies in the working folders under {}: {e}",
                    state_dir.display()
                ),
            },
        );
}

/// The cluster's coordinator, when this labd is one, numbering its jobs
/// above `highest`.
fn open_coordinator(
    cfg: &DaemonConfig,
    highest: Option<u64>,
    clock: &Clock,
) -> Result<Option<Arc<Coordinator>>, DaemonError> {
    let Some(c) = cfg.cluster.as_ref().filter(|c| c.coordinate) else {
        return Ok(None);
    };
    let co = Coordinator::new(&cfg.node_name, c.down_after, &cfg.state_dir, &c.lab)
        .map(|co| co.with_clock(clock.clone()))
        .map_err(|e| open_error("the cluster's jobs", &e))?;
    if let Some(n) = highest {
        co.ids_above(n);
    }
    Ok(Some(Arc::new(co)))
}

/// Why the store could not be opened: `Fatal` for what no wait mends (a
/// URL that does not parse, a local store others can write refused to
/// root); `NotYet` for the rest (unreachable, down, refusing).
enum StoreOpen {
    Fatal(DaemonError),
    NotYet(String),
}

/// Opens the store, and the highest job number its outputs name (the
/// engine numbers new jobs above them: a node whose state folder was lost
/// never pushes a second `runs/j1`).
async fn open_store(
    store: &str,
    options: &[(String, String)],
) -> Result<(Repo, Option<u64>), StoreOpen> {
    let remote = Remote::open(store, options).map_err(|e| match e {
        labsync_store::Error::Invalid { .. } => {
            StoreOpen::Fatal(open_error(&format!("store {store}"), &e))
        }
        e => StoreOpen::NotYet(e.to_string()),
    })?;
    if let Some(root) = remote.local_path("").filter(|_| crate::euid() == 0) {
        off_runtime(move || crate::store_guard::check_root_store(&root))
            .await
            .map_err(|e| StoreOpen::Fatal(DaemonError::Open(e.to_string())))?;
    }
    // labd lives long and pushes jobs' outputs again and again: it keeps
    // the index between pushes and reads only what is new.
    let repo = Repo::open(remote, None)
        .await
        .map_err(|e| StoreOpen::NotYet(e.to_string()))?
        .with_index_memo();
    let highest = highest_run(&repo)
        .await
        .map_err(|e| StoreOpen::NotYet(e.to_string()))?;
    Ok((repo, highest))
}

/// The store as labd holds it: labd starts while the store is unreachable
/// (it manages the jobs it has: kill, leases, logs), opens it in the
/// background, and until then refuses new jobs and keeps outputs to save.
pub(crate) struct StoreLink {
    url: String,
    repo: std::sync::OnceLock<Repo>,
    why: Mutex<String>,
}

impl StoreLink {
    fn new(url: &str) -> StoreLink {
        StoreLink {
            url: url.to_string(),
            repo: std::sync::OnceLock::new(),
            why: Mutex::new(String::new()),
        }
    }

    /// The store, or why labd has not reached it yet.
    pub(crate) fn get(&self) -> Result<&Repo, String> {
        self.repo.get().ok_or_else(|| {
            format!(
                "labd has not reached its store {} since it started ({}); it keeps trying",
                self.url,
                self.why.lock().expect("store poisoned")
            )
        })
    }
}

/// Opens the store until it answers (2 s, then doubling to a minute apart),
/// then numbers the node's and the coordinator's jobs above its outputs.
async fn reach_store(
    cfg: (String, Vec<(String, String)>),
    link: Arc<StoreLink>,
    node: Arc<Node>,
    coordinator: Option<Arc<Coordinator>>,
) {
    let mut wait = Duration::from_secs(2);
    loop {
        tokio::time::sleep(wait).await;
        match open_store(&cfg.0, &cfg.1).await {
            Ok((repo, highest)) => {
                if let Some(n) = highest {
                    node.ids_above(n);
                    if let Some(c) = &coordinator {
                        c.ids_above(n);
                    }
                }
                let _ = link.repo.set(repo);
                tracing::info!("store {} reached: new jobs are taken again", cfg.0);
                return;
            }
            Err(StoreOpen::Fatal(e)) => {
                tracing::error!("store {}: {e}; new jobs stay refused", cfg.0);
                *link.why.lock().expect("store poisoned") = e.to_string();
                return;
            }
            Err(StoreOpen::NotYet(why)) => {
                tracing::debug!("store {} still not reached: {why}", cfg.0);
                *link.why.lock().expect("store poisoned") = why;
            }
        }
        wait = (wait * 2).min(Duration::from_secs(60));
    }
}

/// The highest `N` of the `runs/j<N>` outputs in the store, below
/// [`crate::node::STORE_NUMBERS`].
async fn highest_run(repo: &Repo) -> Result<Option<u64>, DaemonError> {
    let runs = repo
        .remote()
        .list("refs/runs/")
        .await
        .map_err(|e| open_error("the store's runs/", &e))?;
    Ok(runs
        .iter()
        .filter_map(|o| {
            let rest = o.key.strip_prefix("refs/runs/")?;
            crate::node::job_number(rest.split_once('/')?.0)
        })
        .filter(|&n| n < crate::node::STORE_NUMBERS)
        .max())
}

/// The database holds queued jobs' environments and the logs their output:
/// labd's alone. Jobs run as their submitters must still reach their working
/// folders through the state folder.
fn set_modes(state_dir: &Path, jobs_dir: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m))
            .map_err(|e| open_error(&p.display().to_string(), &e))
    };
    mode(&state_dir.join("state-v1.redb"), 0o600)?;
    mode(&state_dir.join("logs"), 0o700)?;
    if users::euid() == 0 {
        mode(state_dir, 0o755)?;
        mode(jobs_dir, 0o755)?;
    }
    Ok(())
}

#[allow(unsafe_code)]
fn try_lock(f: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor we own; no memory is shared.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}
