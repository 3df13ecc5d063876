//! The engine of one node: a first-come-first-served queue over the GPUs,
//! leases, and the job runner. Synchronous (it forks, scans `/proc` and
//! waits on children); labd's async API calls it off the runtime.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use labsync_store::RunAs;

use crate::cgroup::{Cgroups, JobLimits};
use crate::error::LeaseError;
use crate::gpu::GpuInventory;
use crate::ids::JobId;
use crate::leases::{unix_now, JobMeta, JobRecord, JobState, Leases, QueuedSpec};
use crate::runner::{self, JobSpec};
use crate::status::{classify, free_gpus, process_session, process_user, GpuState, GpuStatus};
use crate::watchdog::{Reading, Watchdog};

/// Why a job of `gpus` GPUs with `min_free` bytes each can never run on a
/// node whose GPUs are `status`; `None` while it could, or while any GPU is
/// unknown.
///
/// A card never has all its memory free: the driver keeps some even with
/// no process on it (a few hundred MiB), so the most a card can free is its
/// total less what the emptiest idle card of the node (no process on it)
/// reports used. A job asking a card's full memory never starts on real
/// GPUs, and is failed here rather than left waiting forever.
fn never_fits(status: &[GpuStatus], gpus: u32, min_free: u64) -> Option<String> {
    if status
        .iter()
        .any(|g| matches!(g.state, GpuState::Unknown { .. }))
    {
        return None;
    }
    let kept = status
        .iter()
        .filter_map(|g| g.info.as_ref())
        .filter(|i| i.processes.is_empty())
        .map(|i| i.memory_used)
        .min()
        .unwrap_or(0);
    let big = status
        .iter()
        .filter(|g| {
            g.info
                .as_ref()
                .is_some_and(|i| i.memory_total.saturating_sub(kept) >= min_free)
        })
        .count();
    (big < gpus as usize).then(|| {
        let kept = match kept {
            0 => String::new(),
            k => format!(", with {} MiB the driver keeps on an idle card", k >> 20),
        };
        format!(
            "never fits this node: {gpus} GPU(s) with {} MiB free asked for, \
             it has {big} GPU(s) that can free that much (of {}{kept})",
            min_free >> 20,
            status.len()
        )
    })
}

/// The free GPUs of `status` large enough for a job with `min_free` bytes
/// free on each, once what holds memory there leaves. A job later in the
/// queue that passes a waiting one never takes these (see
/// [`Node::schedule`]).
fn could_serve(status: &[GpuStatus], min_free: u64) -> HashSet<u32> {
    status
        .iter()
        .filter(|g| g.state == GpuState::Free)
        .filter(|g| g.info.as_ref().is_some_and(|i| i.memory_total >= min_free))
        .map(|g| g.index)
        .collect()
}

pub use crate::leases::{job_number, JOB_NUMBERS};

/// The highest job number outputs in the store may make new ids start
/// above. A lab member can push `runs/j<N>` for any `N`: one near
/// [`JOB_NUMBERS`] would leave no ids to give, so store refs past this
/// (a thousand times more jobs than any lab runs) are not taken for jobs.
pub const STORE_NUMBERS: u64 = 1_000_000_000;

/// The cgroups of this labd's jobs, named after its state folder, what
/// they hold in words, and the limits they cannot hold; or why there are
/// none, with what to do about it. labd says it in its log; `labd doctor`
/// prints it.
pub fn probe_cgroups(
    state_dir: &std::path::Path,
    limits: JobLimits,
) -> Result<(Cgroups, String, Vec<String>), String> {
    let dir = state_dir
        .canonicalize()
        .unwrap_or_else(|_| state_dir.to_path_buf());
    let name = blake3::hash(dir.as_os_str().as_encoded_bytes()).to_hex();
    match Cgroups::open(&name[..16], limits) {
        Ok(c) => {
            let held = c.held();
            let tasks = |n: Option<u64>| n.map_or("any number of".into(), |n| n.to_string());
            let memory =
                |n: Option<u64>| n.map_or("any amount".into(), crate::daemon::shares::human_bytes);
            let said = format!(
                "each job runs in a cgroup of its own ({:?}), at most {} tasks and {} of memory; \
                 all of one user's jobs together at most {} tasks and {} of memory",
                c.flavor(),
                tasks(held.tasks),
                memory(held.memory),
                tasks(held.user_tasks),
                memory(held.user_memory),
            );
            let unheld = c.unheld().to_vec();
            Ok((c, said, unheld))
        }
        Err(why) => Err(format!("{why}; {}", cgroup_fix(&why.to_string()))),
    }
}

/// What to do where labd finds no cgroup it can use, for the reason it
/// gives: root is not always the answer (a root labd in a container whose
/// namespace hides or seals the hierarchy is still root).
fn cgroup_fix(why: &str) -> String {
    let root = crate::users::euid() == 0;
    if why.contains("no cgroup v2 or v1 freezer hierarchy is mounted") {
        "mount the cgroup hierarchy (mount -t cgroup2 none /sys/fs/cgroup); in a container, \
         start it with the host's cgroups (docker run --cgroupns=host -v \
         /sys/fs/cgroup:/sys/fs/cgroup:rw)"
            .into()
    } else if !root {
        "labd is not root, and only root may make cgroups for other users' jobs: run it as \
         root (dist/systemd/labd.service)"
            .into()
    } else if why.contains("Read-only") || why.contains("read-only") {
        "labd is root but /sys/fs/cgroup is read-only here (a container or namespace sealed \
         it): run labd on the host (dist/systemd/labd.service), or give its container the \
         host's cgroups, writable (docker: --cgroupns=host -v /sys/fs/cgroup:/sys/fs/cgroup:rw)"
            .into()
    } else {
        "labd is root but cannot make its cgroup folder: a namespace or a security module \
         (SELinux, AppArmor) may stop it; labd run on the host by dist/systemd/labd.service \
         makes it"
            .into()
    }
}

/// The cgroups of this labd's jobs (see [`probe_cgroups`]), said once in
/// the log.
fn open_cgroups(state_dir: &std::path::Path, limits: JobLimits) -> Option<Cgroups> {
    match probe_cgroups(state_dir, limits) {
        Ok((c, said, unheld)) => {
            tracing::info!("{said}");
            for why in unheld {
                tracing::warn!("jobs run without this limit: {why}");
            }
            Some(c)
        }
        Err(why) => {
            tracing::warn!(
                "jobs run without cgroups, so without job_pids_max, job_memory_max, user_pids_max \
                 or user_memory_max, and a killed job's processes that left its session \
                 (setsid, tmux, daemons) survive it: {why}"
            );
            None
        }
    }
}

/// Keeps jobs from the GPUs they did not lease where the node can
/// ([`crate::devices`]), said in the log; the answer is what `labrun
/// status` says of it.
fn confine_jobs(
    cgroups: Option<&mut Cgroups>,
    inventory: Arc<dyn GpuInventory>,
    deadline: Duration,
) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    // A wedged driver must not hang labd's start: read beside it.
    std::thread::spawn(move || {
        let _ = tx.send(inventory.devices());
    });
    let devices = rx
        .recv_timeout(deadline.max(Duration::from_secs(5)))
        .unwrap_or_else(|_| {
            Err(crate::SetupError::Devices(
                "the GPU inventory did not answer at start".into(),
            ))
        });
    let confined = match (devices, cgroups) {
        (Ok(None), _) => return "no GPUs on this node".into(),
        (Err(why), _) => Err(why),
        (Ok(_), None) => Err(crate::SetupError::Cgroups(
            "jobs run without cgroups".into(),
        )),
        (Ok(Some(gpus)), Some(cg)) => cg.confine(gpus),
    };
    match confined {
        Ok(how) => {
            tracing::info!("each job can open only the GPUs it leased ({how})");
            format!("each job can open only the GPUs it leased ({how})")
        }
        Err(why) => {
            let said = format!(
                "jobs are NOT kept from GPUs they did not lease ({why}): a job that unsets \
                 CUDA_VISIBLE_DEVICES can open every GPU of the node"
            );
            tracing::warn!("{said}");
            said
        }
    }
}

/// Variables labd sets for every job, whatever the submitter's environment
/// says: its GPUs, its id, and who it runs as (an admin submitting with a
/// user's token handed the job their own `HOME`, and it read
/// `/root/.config/…`).
const JOB_VARS: [&str; 6] = [
    "CUDA_DEVICE_ORDER",
    "CUDA_VISIBLE_DEVICES",
    "LABRUN_JOB_ID",
    "HOME",
    "USER",
    "LOGNAME",
];

/// The record of a job just reserved (queued, not yet in the queue).
fn new_record(id: &str, s: &Submit, gpus: Vec<u32>) -> JobRecord {
    JobRecord {
        id: id.into(),
        user: s.user.clone(),
        argv: s.argv.clone(),
        gpus_wanted: s.gpus,
        gpus,
        state: JobState::Queued,
        submitted_at: unix_now(),
        started_at: None,
        ended_at: None,
        meta: s.meta.clone(),
        queued: None,
    }
}

/// Settings of a node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Where the state database and job logs live.
    pub state_dir: PathBuf,
    /// A GPU with more than this much memory held by foreign processes is not free.
    pub foreign_limit: u64,
    /// Deadline of one inventory read.
    pub inventory_deadline: Duration,
    /// Jobs one user may have queued at once (checked as each is reserved).
    pub max_queued_per_user: usize,
    /// Jobs without GPUs one user may have running at once; the rest wait
    /// in the queue (no GPU bounds them: a thousand at once took the node).
    pub max_cpu_jobs_per_user: usize,
    /// What each job may use at most (held by its cgroups).
    pub limits: JobLimits,
    /// Where the login limits jobs get are kept.
    pub login_limits: crate::rlimits::LoginLimits,
    /// labd's binary, which a job's output goes through as its keeper
    /// ([`crate::keeper`]); `None` (tests of this crate only, which have no
    /// labd binary): the job writes its log itself.
    pub log_keeper: Option<PathBuf>,
}

/// A job as submitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submit {
    /// Who submits it.
    pub user: String,
    /// The command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: PathBuf,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// GPUs wanted.
    pub gpus: u32,
    /// Free memory each GPU must have, bytes.
    pub min_free_bytes: u64,
    /// Run as this uid/gid.
    pub run_as: Option<RunAs>,
    /// What labd records beside the engine's state.
    pub meta: JobMeta,
}

/// Why a submission was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The job can never run here.
    #[error("{0}")]
    Refused(String),
    /// The state database failed.
    #[error(transparent)]
    State(#[from] LeaseError),
    /// The job could not be started.
    #[error("cannot start {argv:?}: {source}")]
    Spawn {
        /// The command.
        argv: Vec<String>,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// No such job.
    #[error("no job {0}")]
    NoJob(String),
    /// The submitter is over a cap (jobs queued at once).
    #[error("{0}")]
    TooMany(String),
    /// A placement made on a view of the GPUs that is out of date.
    #[error("{0}")]
    Stale(String),
}

/// Job `id`'s environment on `gpus`: the submitter's, less what labd
/// sets, and then labd's. Set after (and instead of) the submitter's own:
/// NVML numbers GPUs in PCI bus order, CUDA by default fastest first, so
/// without PCI_BUS_ID a job on a mixed node would use GPUs it did not
/// lease.
fn job_env(
    env: &[(String, String)],
    id: &str,
    gpus: &[u32],
    who: Option<&crate::users::UnixUser>,
) -> Vec<(String, String)> {
    let visible: Vec<String> = gpus.iter().map(u32::to_string).collect();
    let mut env: Vec<(String, String)> = env
        .iter()
        .filter(|(k, _)| !JOB_VARS.contains(&k.as_str()))
        .cloned()
        .collect();
    env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
    env.push(("CUDA_VISIBLE_DEVICES".into(), visible.join(",")));
    env.push(("LABRUN_JOB_ID".into(), id.to_string()));
    // The account the job runs as; a uid without one gets none of these
    // rather than the submitter's.
    if let Some(u) = who {
        env.push(("HOME".into(), u.home.to_string_lossy().into_owned()));
        env.push(("USER".into(), u.name.clone()));
        env.push(("LOGNAME".into(), u.name.clone()));
    }
    env
}

/// The number of the next job: above every job the database knows and
/// every folder and log on disk. Ids are never reused, even when the
/// database is lost: a second `j1` would find the first one's folder and
/// log, and push its outputs over `runs/j1`. So the folders count too.
fn next_job_number(state: &Leases, state_dir: &std::path::Path) -> Result<u64, NodeError> {
    let in_db = state.jobs()?.into_iter().map(|j| String::from(j.id));
    let on_disk = ["jobs", "logs"].into_iter().flat_map(|d| {
        std::fs::read_dir(state_dir.join(d))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_suffix(".log").unwrap_or(&name).to_string()
            })
    });
    Ok(in_db
        .chain(on_disk)
        .filter_map(|id| job_number(&id))
        .chain([state.pruned_max()?])
        .max()
        .unwrap_or(0)
        + 1)
}

/// What one pass of [`Node::schedule`] has learnt so far.
#[derive(Default)]
struct Pass {
    /// Free GPUs a job that waits could use: kept for it, so a job behind
    /// passes it only on GPUs it could not use, or none (a stream of small
    /// jobs never starves a large one).
    kept: HashSet<u32>,
    /// The GPUs and their leases, read once per pass and again only after
    /// a job took some: read per queued job, a pass over a queue of a
    /// thousand behind busy GPUs made a thousand inventory reads, and labd
    /// answered submissions in seconds (`bench/labd-load.sh`).
    seen: Option<(Vec<GpuStatus>, BTreeMap<u32, String>)>,
}

/// What a queued job gets in a pass.
enum Take {
    /// These GPUs (none for a job without), leased to it: it starts.
    Gpus(Vec<u32>),
    /// Nothing now: it stays queued.
    Wait,
    /// Nothing ever, for this reason: it is failed.
    Never(String),
}

struct Inner {
    queue: VecDeque<(JobId, Submit)>,
    children: HashMap<JobId, Child>,
    /// The log keepers of this labd's jobs ([`crate::keeper`]), waited
    /// for when their jobs end.
    keepers: HashMap<JobId, Child>,
    /// Jobs whose exit the reaper has collected and is about to record: a
    /// kill racing it must not record its own guess over the real status.
    ending: HashSet<JobId>,
    /// Endings collected whose record failed to be written; retried first.
    unrecorded: Vec<(JobId, JobState)>,
    next: u64,
}

/// One node's jobs and GPUs.
pub struct Node {
    cfg: NodeConfig,
    /// Where jobs get cgroups of their own; `None` where none can be made.
    cgroups: Option<Cgroups>,
    dog: Watchdog,
    state: Leases,
    inner: Mutex<Inner>,
    /// GPU indices of the last good reading, so a hang shows them as unknown.
    last_known: Mutex<Vec<u32>>,
    /// Whether jobs are kept from the GPUs they did not lease, in words.
    gpu_confinement: String,
}

impl Node {
    /// Opens the node's state, adopting jobs that survived a restart.
    pub fn open(cfg: NodeConfig, inventory: Arc<dyn GpuInventory>) -> Result<Node, NodeError> {
        // Jobs' output: never readable by others, not even before labd
        // narrows the folder's mode at the end of its start.
        let mut logs = std::fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(logs.recursive(true), 0o700);
        logs.create(cfg.state_dir.join("logs")).map_err(|e| {
            NodeError::Refused(format!("cannot create {}: {e}", cfg.state_dir.display()))
        })?;
        let state = Leases::open(&cfg.state_dir.join("state-v1.redb"))?;
        let mut cgroups = open_cgroups(&cfg.state_dir, cfg.limits);
        let gpu_confinement =
            confine_jobs(cgroups.as_mut(), inventory.clone(), cfg.inventory_deadline);
        let failed = state.reconcile(runner::alive)?;
        for id in &failed {
            tracing::warn!("job {id} was gone after the restart; marked failed, its GPUs freed");
            // What it left running outside its session goes with it.
            if let Some(cg) = &cgroups {
                cg.kill(id, Duration::from_secs(5));
                cg.remove(id);
            }
        }
        let next = next_job_number(&state, &cfg.state_dir)?;
        let dog = Watchdog::new(inventory, cfg.inventory_deadline);
        // Learn the GPU set now, so a later hang can still list them as unknown.
        let known = match dog.poll() {
            Reading::Known(g) => g.iter().map(|g| g.index).collect(),
            Reading::Unknown { reason } => {
                tracing::warn!(
                    "GPU inventory ({}) did not answer at start: {reason}",
                    dog.describe()
                );
                Vec::new()
            }
        };
        // Jobs still queued when labd stopped queue again, in their order;
        // one stopped while its code and data were being prepared cannot be.
        let mut queued: Vec<JobRecord> = state
            .active_jobs()?
            .into_iter()
            .filter(|j| j.state == JobState::Queued)
            .collect();
        queued.sort_by_key(|j| (j.submitted_at, j.id.len(), j.id.clone()));
        let mut queue = VecDeque::new();
        for j in queued {
            match j.queued.clone() {
                Some(q) => queue.push_back((
                    j.id.clone(),
                    Submit {
                        user: j.user,
                        argv: q.argv,
                        cwd: q.cwd,
                        env: q.env,
                        gpus: j.gpus_wanted,
                        min_free_bytes: q.min_free_bytes,
                        run_as: q.run_as,
                        meta: j.meta,
                    },
                )),
                None => {
                    let reason = "labd stopped while preparing it; submit it again".into();
                    state.update(&j.id, |r| r.meta.outputs_pending = false)?;
                    state.finish(&j.id, JobState::Failed { reason })?;
                }
            }
        }
        let node = Node {
            cfg,
            cgroups,
            dog,
            state,
            inner: Mutex::new(Inner {
                queue,
                children: HashMap::new(),
                keepers: HashMap::new(),
                ending: HashSet::new(),
                unrecorded: Vec::new(),
                next,
            }),
            last_known: Mutex::new(known),
            gpu_confinement,
        };
        // Their output's keepers too.
        node.end_keepers(&failed, Duration::from_secs(2));
        Ok(node)
    }

    /// Session id → job id of every running job.
    fn running_sessions(&self) -> Result<HashMap<u32, JobId>, NodeError> {
        Ok(self
            .state
            .running()
            .into_iter()
            .map(|(id, sid, _)| (sid, id))
            .collect())
    }

    /// Every GPU: free, leased (to which job), foreign (pid, user, bytes, or
    /// the job using it outside its lease), unknown.
    pub fn gpus(&self) -> Result<Vec<GpuStatus>, NodeError> {
        let sessions = self.running_sessions()?;
        let leases = self.state.all()?;
        let reading = self.dog.poll();
        let mut known = self.last_known.lock().expect("node poisoned");
        if let Reading::Known(g) = &reading {
            *known = g.iter().map(|g| g.index).collect();
        }
        Ok(classify(
            &reading,
            &known,
            &leases,
            &|pid| {
                self.cgroups
                    .as_ref()
                    .and_then(|c| c.job_of(pid))
                    .or_else(|| {
                        process_session(pid).and_then(|s| sessions.get(&s).map(JobId::to_string))
                    })
            },
            &process_user,
            self.cfg.foreign_limit,
        ))
    }

    /// Refuses a job that can never run on this node: more GPUs than it
    /// has, or more free memory per GPU than any of them holds.
    pub fn admissible(&self, gpus: u32, min_free_bytes: u64) -> Result<(), NodeError> {
        if gpus == 0 {
            return Ok(());
        }
        let n = match self.dog.poll() {
            Reading::Known(g) => {
                let big = g
                    .iter()
                    .filter(|g| g.memory_total >= min_free_bytes)
                    .count();
                if !g.is_empty() && big < gpus as usize {
                    return Err(NodeError::Refused(format!(
                        "{gpus} GPU(s) with {} MiB free asked for; this node has {big} GPU(s) that large",
                        min_free_bytes >> 20
                    )));
                }
                Some(g.len())
            }
            Reading::Unknown { .. } => None,
        };
        if n == Some(0) {
            return Err(NodeError::Refused(format!(
                "this node has no GPUs (inventory: {}); ask for --gpus 0 or run it on a GPU node",
                self.dog.describe()
            )));
        }
        if let Some(n) = n.filter(|&n| (gpus as usize) > n) {
            return Err(NodeError::Refused(format!(
                "{gpus} GPUs asked for, this node has {n}"
            )));
        }
        Ok(())
    }

    /// Makes every later job id greater than `j{n}` (labd passes the
    /// highest `runs/j{n}` in the store, so a node whose state folder was
    /// lost never pushes a second `runs/j1`).
    pub fn ids_above(&self, n: u64) {
        let mut inner = self.inner.lock().expect("node poisoned");
        inner.next = inner.next.max(n.saturating_add(1));
    }

    /// Records a new job as queued and returns its id; it runs once
    /// [`Node::enqueue`]d (labd materialises its code and data in between).
    pub fn reserve(&self, s: &Submit) -> Result<JobId, NodeError> {
        self.admissible(s.gpus, s.min_free_bytes)?;
        let mut inner = self.inner.lock().expect("node poisoned");
        // Under the queue's lock: concurrent submissions cannot all slip in.
        let queued = self.state.queued_of(&s.user);
        if queued >= self.cfg.max_queued_per_user {
            return Err(NodeError::TooMany(format!(
                "{} has {queued} jobs queued or running without GPUs, the most one user may \
                 (max_queued_per_user); wait for some to start or end, or kill some",
                s.user
            )));
        }
        // Never a record that exists (a lost database, a hand-made ref):
        // its job would vanish from labd's view while holding its GPUs.
        let id = loop {
            let n = inner.next;
            if n >= JOB_NUMBERS {
                return Err(NodeError::Refused("job ids exhausted".into()));
            }
            inner.next = n + 1;
            let id = JobId::numbered(n);
            if self.state.job(&id)?.is_none() {
                break id;
            }
        };
        self.state.put_job(&new_record(&id, s, Vec::new()))?;
        Ok(id)
    }

    /// Records a job the cluster's coordinator placed here, as `id`, with
    /// exactly `gpus` leased to it now (it keeps them while its code and
    /// data are materialised). Refused when one of them is not free any
    /// more: the coordinator's view was stale, and it places the job again.
    /// A second call for the same job (a dispatch sent again) changes
    /// nothing.
    pub fn reserve_placed(&self, id: &str, s: &Submit, gpus: &[u32]) -> Result<(), NodeError> {
        if job_number(id).is_none() {
            return Err(NodeError::Refused(format!("{id:?} is not a job id")));
        }
        if gpus.len() != s.gpus as usize {
            return Err(NodeError::Refused(format!(
                "job {id} asks for {} GPU(s) and was placed on {}",
                s.gpus,
                gpus.len()
            )));
        }
        self.admissible(s.gpus, s.min_free_bytes)?;
        let _inner = self.inner.lock().expect("node poisoned");
        if let Some(r) = self.state.job(id)? {
            return if r.user == s.user && r.argv == s.argv {
                Ok(())
            } else {
                Err(NodeError::Refused(format!("job {id} already exists here")))
            };
        }
        if !gpus.is_empty() {
            let free = free_gpus(&self.gpus()?, s.min_free_bytes);
            let taken: Vec<u32> = gpus.iter().filter(|g| !free.contains(g)).copied().collect();
            if !taken.is_empty() {
                return Err(NodeError::Stale(format!(
                    "GPU(s) {taken:?} are not free here any more"
                )));
            }
            match self.state.acquire(id, gpus.len(), gpus)? {
                Some(got) if got.len() == gpus.len() => {}
                _ => {
                    return Err(NodeError::Stale(format!(
                        "GPU(s) {gpus:?} were leased meanwhile"
                    )))
                }
            }
        }
        if let Err(e) = self.state.put_job(&new_record(id, s, gpus.to_vec())) {
            let _ = self.state.release(id);
            return Err(e.into());
        }
        Ok(())
    }

    /// Puts a reserved job in the queue and starts what fits. Returns false
    /// (and queues nothing) when the job was ended meanwhile, e.g. killed
    /// while labd prepared it.
    pub fn enqueue(&self, id: &str, s: Submit) -> Result<bool, NodeError> {
        {
            // Under the queue's lock, so a cancel of the reserved job cannot interleave.
            let mut inner = self.inner.lock().expect("node poisoned");
            let queued = self.state.update(id, |r| {
                if r.state != JobState::Queued || r.queued.is_some() {
                    return false;
                }
                r.meta = s.meta.clone();
                r.meta.preparing = None;
                r.queued = Some(QueuedSpec {
                    argv: s.argv.clone(),
                    cwd: s.cwd.clone(),
                    env: s.env.clone(),
                    min_free_bytes: s.min_free_bytes,
                    run_as: s.run_as,
                });
                true
            })?;
            if queued != Some(true) {
                return Ok(false);
            }
            inner.queue.push_back((id.into(), s));
        }
        self.schedule()?;
        Ok(true)
    }

    /// Ends a reserved job that is not queued yet (its preparation failed,
    /// or it was killed meanwhile). Returns false when it was queued first;
    /// [`Node::kill`] handles it then.
    pub fn cancel_reserved(&self, id: &str, reason: String) -> Result<bool, NodeError> {
        let inner = self.inner.lock().expect("node poisoned");
        let reserved = self
            .state
            .job(id)?
            .is_some_and(|r| r.state == JobState::Queued && r.queued.is_none())
            && !inner.queue.iter().any(|(q, _)| q == id);
        if reserved {
            self.state.update(id, |r| r.meta.outputs_pending = false)?;
            self.state.finish(id, JobState::Failed { reason })?;
        }
        Ok(reserved)
    }

    /// Queues a job; refuses one that can never run on this node.
    pub fn submit(&self, s: Submit) -> Result<JobId, NodeError> {
        let id = self.reserve(&s)?;
        self.enqueue(&id, s)?;
        Ok(id)
    }

    /// Changes a job's record (labd's outputs bookkeeping).
    pub fn update_meta<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut JobMeta) -> T,
    ) -> Result<Option<T>, NodeError> {
        Ok(self.state.update(id, |r| f(&mut r.meta))?)
    }

    /// One job's record.
    pub fn job(&self, id: &str) -> Result<Option<JobRecord>, NodeError> {
        Ok(self.state.job(id)?)
    }

    /// Starts queued jobs in order while GPUs allow. A job that cannot
    /// start now keeps the free GPUs it could use; those behind it start on
    /// GPUs it could not use (too small for it) or without GPUs, never on
    /// its own. One that can never start here (more than the cards can
    /// free) is failed with the reason. Returns the ids started.
    pub fn schedule(&self) -> Result<Vec<JobId>, NodeError> {
        let mut inner = self.inner.lock().expect("node poisoned");
        let mut started = Vec::new();
        let mut pass = Pass::default();
        let mut at = 0;
        while let Some((id, q)) = inner.queue.get(at) {
            let gpus = match self.gpus_for(id, q, &mut pass)? {
                Take::Gpus(gpus) => gpus,
                Take::Wait => {
                    at += 1;
                    continue;
                }
                Take::Never(reason) => {
                    let (id, _) = inner.queue.remove(at).expect("read above");
                    self.state.finish(&id, JobState::Failed { reason })?;
                    continue;
                }
            };
            let (id, s) = inner.queue.remove(at).expect("read above");
            if let Some(id) = self.start(&mut inner, at, id, s, gpus)? {
                started.push(id);
            }
        }
        Ok(started)
    }

    /// The GPUs queued job `id` (`q`) takes now, leased to it; or why not.
    fn gpus_for(&self, id: &str, q: &Submit, pass: &mut Pass) -> Result<Take, NodeError> {
        let (wanted, min_free) = (q.gpus, q.min_free_bytes);
        if wanted == 0 {
            return Ok(
                match self.cpu_jobs_of(&q.user) >= self.cfg.max_cpu_jobs_per_user {
                    true => Take::Wait,
                    false => Take::Gpus(Vec::new()),
                },
            );
        }
        if pass.seen.is_none() {
            pass.seen = Some((self.gpus()?, self.state.all()?));
        }
        let (status, leases) = pass.seen.as_ref().expect("read above");
        // Accepted while the inventory did not answer, or asking more than
        // a card can free: failed with the reason, so it does not block
        // the queue.
        if let Some(why) = never_fits(status, wanted, min_free) {
            return Ok(Take::Never(why));
        }
        // GPUs already leased to it (a job placed here by the coordinator
        // holds them from its dispatch) come first.
        let mut free: Vec<u32> = leases
            .iter()
            .filter(|(_, holder)| holder.as_str() == id)
            .map(|(g, _)| *g)
            .collect();
        free.extend(
            free_gpus(status, min_free)
                .into_iter()
                .filter(|g| !pass.kept.contains(g)),
        );
        // Fewer than it wants: no lease could be taken (one is taken among
        // these only), so none is tried.
        let taken = match free.len() >= wanted as usize {
            true => self.state.acquire(id, wanted as usize, &free)?,
            false => None,
        };
        Ok(match taken {
            Some(gpus) => {
                pass.seen = None;
                Take::Gpus(gpus)
            }
            None => {
                pass.kept.extend(could_serve(status, min_free));
                Take::Wait
            }
        })
    }

    /// The cgroup files job `id` (run as `uid`, on `gpus`) is started
    /// into: none where the node has no cgroups, or this one could not be
    /// made and the node does not promise confinement. `None` when it must
    /// not run (recorded as failed).
    fn cgroup_for(
        &self,
        id: &str,
        uid: u32,
        gpus: &[u32],
    ) -> Result<Option<Vec<std::fs::File>>, NodeError> {
        let Some(c) = self.cgroups.as_ref() else {
            return Ok(Some(Vec::new()));
        };
        match c.create(id, uid, gpus) {
            Ok(procs) => Ok(Some(procs)),
            // The node says its jobs are confined to their GPUs: this one
            // would not be, so it does not run.
            Err(e) if c.confines() => {
                c.remove(id);
                let reason = format!("{e}; the job was not started");
                tracing::warn!("job {id}: {reason}");
                self.state.finish(id, JobState::Failed { reason })?;
                Ok(None)
            }
            Err(e) => {
                c.remove(id);
                tracing::warn!("job {id} runs without a cgroup: {e}");
                Ok(Some(Vec::new()))
            }
        }
    }

    /// Starts job `id` (`s`, out of the queue at `at`) on `gpus`, leased
    /// to it: its cgroup, its process, its record. `None` when it failed
    /// to start (recorded so); a record that cannot be written puts it
    /// back in the queue, stopped.
    fn start(
        &self,
        inner: &mut Inner,
        at: usize,
        id: JobId,
        s: Submit,
        gpus: Vec<u32>,
    ) -> Result<Option<JobId>, NodeError> {
        let uid = s.run_as.map_or_else(crate::euid, |r| r.uid);
        let Some(cgroups) = self.cgroup_for(&id, uid, &gpus)? else {
            return Ok(None);
        };
        // The account the job runs as, looked up once (NSS may ask LDAP,
        // under the queue's lock): its environment and its login limits.
        let account = crate::users::user_by_uid(uid);
        let spec = JobSpec {
            argv: s.argv.clone(),
            cwd: s.cwd.clone(),
            env: job_env(&s.env, &id, &gpus, account.as_ref()),
            log: self.log_path(&id),
            user: s.run_as,
            cgroups,
            rlimits: self.login_limits(s.run_as, account.as_ref()),
            keeper: self.cfg.log_keeper.as_ref().map(|exe| runner::KeeperSpec {
                exe: exe.clone(),
                cgroup: self.cgroups.as_ref().map(Cgroups::keepers),
            }),
        };
        match runner::spawn(&spec) {
            Ok(mut st) => {
                let sid = st.sid();
                // Our child, unwaited: its pid cannot change hands yet.
                let start = runner::start_ticks(sid);
                let keeper = st
                    .keeper
                    .as_ref()
                    .map(|k| (k.id(), runner::start_ticks(k.id())));
                let recorded = self.state.update(&id, |r| {
                    r.meta.gpus_held = gpus.clone();
                    r.gpus = gpus;
                    r.state = JobState::Running { sid, start };
                    r.started_at = Some(unix_now());
                    r.meta.preparing = None;
                    r.meta.log_keeper = keeper;
                    r.queued = None;
                });
                if let Err(e) = recorded {
                    // A job the database does not know runs would hold
                    // its GPUs unseen: it is stopped, its lease freed,
                    // and it stays queued to start again.
                    self.kill_job(&id, (sid, start), Duration::ZERO);
                    // Never a blocking wait under the queue's lock (a
                    // leader stuck in the kernel would hang labd).
                    let _ = st.child.try_wait();
                    if let Some(mut k) = st.keeper {
                        let _ = k.kill();
                        let _ = k.try_wait();
                    }
                    // If this fails too, the lease is the job's own and
                    // acquire gives it back to it when it starts again.
                    let _ = self.state.release(&id);
                    inner.queue.insert(at, (id, s));
                    return Err(e.into());
                }
                inner.children.insert(id.clone(), st.child);
                if let Some(k) = st.keeper {
                    inner.keepers.insert(id.clone(), k);
                }
                Ok(Some(id))
            }
            Err(source) => {
                if let Some(cg) = &self.cgroups {
                    cg.remove(&id);
                }
                let reason = format!(
                    "cannot start {} in {}: {source}",
                    s.argv.first().map_or("", String::as_str),
                    s.cwd.display()
                );
                self.state.finish(&id, JobState::Failed { reason })?;
                Ok(None)
            }
        }
    }

    /// The limits of a login of `run_as` ([`crate::rlimits`]); none (labd's
    /// own) for a job run as labd's user.
    fn login_limits(
        &self,
        run_as: Option<RunAs>,
        account: Option<&crate::users::UnixUser>,
    ) -> Vec<crate::rlimits::Rlimit> {
        let Some(RunAs { uid, gid }) = run_as else {
            return Vec::new();
        };
        let name = account.map_or_else(String::new, |u| u.name.clone());
        let gids = crate::users::groups_of(&name, gid);
        self.cfg.login_limits.for_user(&crate::rlimits::Who {
            name: &name,
            uid,
            gids: &gids,
        })
    }

    /// Whether jobs are kept from the GPUs they did not lease, in words
    /// (`labrun status`).
    pub fn gpu_confinement(&self) -> &str {
        &self.gpu_confinement
    }

    /// The job's log file.
    pub fn log_path(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("logs").join(format!("{id}.log"))
    }

    /// Records jobs that ended, frees their GPUs, and starts what now fits.
    pub fn reap(&self) -> Result<Vec<(JobId, JobState)>, NodeError> {
        let (ended, sessions) = {
            let mut inner = self.inner.lock().expect("node poisoned");
            let mut ended = std::mem::take(&mut inner.unrecorded);
            for (id, child) in inner.children.iter_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    use std::os::unix::process::ExitStatusExt;
                    ended.push((
                        id.clone(),
                        JobState::Exited {
                            code: status.code(),
                            signal: status.signal(),
                        },
                    ));
                }
            }
            for (id, _) in &ended {
                inner.children.remove(id);
                inner.ending.insert(id.clone());
            }
            // Jobs adopted after a restart are not our children: their exit
            // status is lost, but their end is not.
            for (id, sid, start) in self.state.running() {
                if !inner.children.contains_key(&id)
                    && !inner.ending.contains(&id)
                    && !runner::alive(sid, start)
                {
                    inner.ending.insert(id.clone());
                    ended.push((
                        id,
                        JobState::Failed {
                            reason: "ended while labd was restarting; exit status unknown".into(),
                        },
                    ));
                }
            }
            // From memory: nothing between collecting and recording can fail.
            let running: HashMap<JobId, (u32, Option<u64>)> = self
                .state
                .running()
                .into_iter()
                .map(|(id, sid, start)| (id, (sid, start)))
                .collect();
            let sessions: Vec<(JobId, (u32, Option<u64>))> = ended
                .iter()
                .filter_map(|(id, _)| Some((id.clone(), *running.get(id)?)))
                .collect();
            (ended, sessions)
        };
        // Whatever the leaders left behind in their sessions and cgroups
        // goes too, before their GPUs are freed: all jobs at once, so one
        // grace period, not one per job, holds up the tick (a user whose
        // jobs leave processes that ignore SIGTERM could otherwise stall
        // the node's scheduling and log bounding for minutes).
        self.kill_jobs(&sessions, Duration::from_secs(2));
        let ids: Vec<JobId> = ended.iter().map(|(id, _)| id.clone()).collect();
        self.end_keepers(&ids, Duration::from_secs(2));
        {
            let mut inner = self.inner.lock().expect("node poisoned");
            let mut result = Ok(());
            for (id, st) in &ended {
                if result.is_ok() {
                    result = self.state.finish(id, st.clone()).map(drop);
                }
                if result.is_ok() {
                    inner.ending.remove(id);
                } else {
                    // Kept (and still marked ending) for the next reap: the
                    // exit status is known and must not be lost to a write
                    // that failed once.
                    inner.unrecorded.push((id.clone(), st.clone()));
                }
            }
            result?;
        }
        if !ended.is_empty() {
            self.schedule()?;
        }
        Ok(ended)
    }

    /// SIGTERM to every process of the job (its session and its cgroup),
    /// SIGKILL to what is left after `grace`, until none is left. The
    /// session is its leader's pid and start ([`runner::kill_sessions`]):
    /// once the pid is another process's, only the cgroup is the job's.
    fn kill_job(&self, id: &str, session: (u32, Option<u64>), grace: Duration) {
        self.kill_jobs(&[(id.into(), session)], grace);
    }

    /// Ends the log keepers of the jobs `ids`, which have ended and whose
    /// processes are gone: a keeper has drained the pipe and exits by
    /// itself once the last writer is gone; one still held open `grace`
    /// later (a descriptor passed out of the job) is killed, and its
    /// holder's writes fail from then on. Keepers of jobs adopted after a
    /// restart are found by their record.
    fn end_keepers(&self, ids: &[JobId], grace: Duration) {
        /// A job, its keeper if ours, and its keeper's pid and start on record.
        type Kept = (JobId, Option<Child>, Option<(u32, Option<u64>)>);
        let mut keepers: Vec<Kept> = {
            let mut inner = self.inner.lock().expect("node poisoned");
            ids.iter()
                .map(|id| (id.clone(), inner.keepers.remove(id)))
                .collect::<Vec<_>>()
        }
        .into_iter()
        .map(|(id, child)| {
            let rec = match &child {
                Some(_) => None,
                None => self
                    .state
                    .job(&id)
                    .ok()
                    .flatten()
                    .and_then(|r| r.meta.log_keeper),
            };
            (id, child, rec)
        })
        .filter(|(_, child, rec)| child.is_some() || rec.is_some())
        .collect();
        let deadline = std::time::Instant::now() + grace;
        loop {
            keepers.retain_mut(|(_, child, rec)| match child {
                Some(c) => matches!(c.try_wait(), Ok(None)),
                None => rec.is_some_and(|(pid, start)| runner::alive(pid, start)),
            });
            if keepers.is_empty() || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for (id, child, rec) in keepers {
            tracing::warn!(
                "job {id} has ended and a process outside it still holds its output open: \
                 its log is closed, and that process's writes fail from now on"
            );
            match (child, rec) {
                (Some(mut c), _) => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                (None, Some((pid, start))) if runner::alive(pid, start) => {
                    runner::signal(pid, libc::SIGKILL);
                }
                _ => {}
            }
        }
    }

    /// [`Node::kill_job`] for several jobs at once, under one grace period.
    fn kill_jobs(&self, jobs: &[(JobId, (u32, Option<u64>))], grace: Duration) {
        let sessions: Vec<(u32, Option<u64>)> = jobs.iter().map(|(_, s)| *s).collect();
        let Some(cg) = &self.cgroups else {
            runner::kill_sessions(&sessions, grace);
            return;
        };
        let deadline = std::time::Instant::now() + grace;
        for (id, _) in jobs {
            cg.terminate(id);
        }
        runner::kill_sessions(&sessions, grace);
        while jobs.iter().any(|(id, _)| !cg.members(id).is_empty())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        for (id, _) in jobs {
            if !cg.kill(id, Duration::from_secs(5)) {
                tracing::warn!("job {id}: processes of its cgroup would not die");
            }
            self.say_limits_hit(cg, id);
            cg.remove(id);
        }
    }

    /// Tells the job's log (its user reads it) and labd's what the job ran
    /// into: a job that died of "Resource temporarily unavailable" or of
    /// SIGKILL learns why.
    fn say_limits_hit(&self, cg: &Cgroups, id: &str) {
        use std::io::Write;
        let hit = cg.limits_hit(id);
        if hit.is_empty() {
            return;
        }
        tracing::info!("job {id}: {}", hit.join("; "));
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.log_path(id));
        if let Ok(mut f) = log {
            let lines: String = hit.iter().map(|h| format!("labd: {h}\n")).collect();
            let _ = f.write_all(lines.as_bytes());
        }
    }

    /// The session of a running job: its id and its leader's start.
    fn session_of(&self, id: &str) -> Result<Option<(u32, Option<u64>)>, NodeError> {
        Ok(self.state.job(id)?.and_then(|j| match j.state {
            JobState::Running { sid, start } => Some((sid, start)),
            _ => None,
        }))
    }

    /// Jobs labd still has work with (queued, running, outputs to save).
    pub fn active_jobs(&self) -> Result<Vec<JobRecord>, NodeError> {
        Ok(self.state.active_jobs()?)
    }

    /// The active jobs for which `keep` holds (copied from memory, so the
    /// ticker does not copy a thousand queued jobs to find four running).
    pub fn active_where(&self, keep: impl Fn(&JobRecord) -> bool) -> Vec<JobRecord> {
        self.state.active_where(keep)
    }

    /// How many jobs without GPUs `user` has running.
    fn cpu_jobs_of(&self, user: &str) -> usize {
        self.active_where(|r| {
            r.user == user && r.gpus_wanted == 0 && matches!(r.state, JobState::Running { .. })
        })
        .len()
    }

    /// How many jobs `user` has queued, or running without GPUs.
    pub fn queued_of(&self, user: &str) -> usize {
        self.state.queued_of(user)
    }

    /// Kills a job's whole session (SIGTERM, SIGKILL after `grace`) or drops
    /// it from the queue; its GPUs are freed either way.
    pub fn kill(&self, id: &str, grace: Duration) -> Result<(), NodeError> {
        {
            let mut inner = self.inner.lock().expect("node poisoned");
            if let Some(pos) = inner.queue.iter().position(|(q, _)| q == id) {
                inner.queue.remove(pos);
                drop(inner);
                self.state.finish(
                    id,
                    JobState::Failed {
                        reason: "killed while queued".into(),
                    },
                )?;
                return Ok(());
            }
        }
        let Some(session) = self.session_of(id)? else {
            return Err(match self.state.job(id)? {
                Some(_) => NodeError::Refused(format!("job {id} has already ended")),
                None => NodeError::NoJob(id.into()),
            });
        };
        self.kill_job(id, session, grace);
        self.end_keepers(&[id.into()], Duration::from_secs(2));
        // The ending is recorded under the queue's lock, as the reaper
        // records its own: whichever sees the exit first records the real
        // status, and the other leaves it alone.
        let mut inner = self.inner.lock().expect("node poisoned");
        if inner.ending.contains(id) {
            drop(inner);
            return Ok(());
        }
        let state = match inner.children.get_mut(id).map(|c| c.try_wait()) {
            Some(Ok(Some(status))) => {
                use std::os::unix::process::ExitStatusExt;
                inner.children.remove(id);
                JobState::Exited {
                    code: status.code(),
                    signal: status.signal(),
                }
            }
            // Unkillable (stuck in the kernel): the reaper records it when it goes.
            Some(Ok(None)) => return Ok(()),
            Some(Err(_)) => {
                inner.children.remove(id);
                JobState::Failed {
                    reason: "killed".into(),
                }
            }
            // Adopted after a restart, not our child: only its end is known.
            // Or the reaper recorded it already.
            None => match self.state.job(id)?.map(|r| r.state) {
                Some(JobState::Running { .. }) => JobState::Failed {
                    reason: "killed".into(),
                },
                _ => {
                    drop(inner);
                    self.schedule()?;
                    return Ok(());
                }
            },
        };
        self.state.finish(id, state)?;
        drop(inner);
        self.schedule()?;
        Ok(())
    }

    /// All job records.
    pub fn jobs(&self) -> Result<Vec<JobRecord>, NodeError> {
        Ok(self.state.jobs()?)
    }

    /// Forgets the jobs that ended before `before` (unix seconds) and have
    /// nothing left to do; their ids are never given again.
    pub fn prune_ended(&self, before: u64) -> Result<usize, NodeError> {
        Ok(self.state.prune_ended(before)?)
    }

    /// Why a queued job waits, in words (`labrun ps`), given a reading of
    /// the GPUs (one reading serves a whole listing).
    pub fn why_waiting(&self, id: &str, gpus: &[GpuStatus]) -> Option<String> {
        let inner = self.inner.lock().expect("node poisoned");
        let pos = inner.queue.iter().position(|(q, _)| q == id)?;
        let (want, min_free) = (inner.queue[pos].1.gpus, inner.queue[pos].1.min_free_bytes);
        let user = inner.queue[pos].1.user.clone();
        drop(inner);
        if want == 0 {
            return Some(format!(
                "waits: {user} runs {} job(s) without GPUs here already, as many as one user \
                 may (max_cpu_jobs_per_user)",
                self.cpu_jobs_of(&user)
            ));
        }
        let free = free_gpus(gpus, min_free).len();
        let unknown = gpus
            .iter()
            .filter(|g| matches!(g.state, GpuState::Unknown { .. }))
            .count();
        let mut why = format!("waits for {want} GPU(s): {free} free");
        if unknown > 0 {
            why += &format!(", {unknown} unknown (inventory not answering)");
        }
        if pos > 0 {
            why += &format!(", {pos} job(s) ahead in the queue");
        }
        Some(why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeGpus;
    use std::path::Path;
    use std::sync::atomic::Ordering;

    /// Issue 43: a job's GPUs, id and account are labd's to say: an admin
    /// submitting with a user's token handed the job their own `HOME` (and
    /// `USER`), and it read `/root/.config/…` as that user.
    #[test]
    fn a_jobs_home_and_name_are_its_accounts_not_the_submitters() {
        let sent: Vec<(String, String)> = [
            ("HOME", "/root"),
            ("USER", "root"),
            ("LOGNAME", "root"),
            ("LABRUN_JOB_ID", "j999"),
            ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
            ("WANDB_PROJECT", "sr"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .to_vec();
        let alice = crate::users::UnixUser {
            name: "alice".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/alice".into(),
        };
        let env = job_env(&sent, "j7", &[2], Some(&alice));
        let get = |k: &str| -> Vec<&str> {
            env.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect()
        };
        assert_eq!(get("HOME"), ["/home/alice"]);
        assert_eq!(get("USER"), ["alice"]);
        assert_eq!(get("LOGNAME"), ["alice"]);
        assert_eq!(get("LABRUN_JOB_ID"), ["j7"]);
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), ["2"]);
        assert_eq!(get("WANDB_PROJECT"), ["sr"], "the rest is the submitter's");
        // A uid without an account gets none of them, not the submitter's.
        let env = job_env(&sent, "j8", &[], None);
        assert!(!env
            .iter()
            .any(|(k, _)| k == "HOME" || k == "USER" || k == "LOGNAME"));
    }

    /// A node's settings with its state in `dir/state`.
    fn test_config(dir: &Path) -> NodeConfig {
        NodeConfig {
            state_dir: dir.join("state"),
            foreign_limit: 256 << 20,
            inventory_deadline: Duration::from_secs(2),
            max_queued_per_user: 1000,
            max_cpu_jobs_per_user: 100,
            limits: JobLimits::default(),
            login_limits: crate::rlimits::LoginLimits::default(),
            log_keeper: None,
        }
    }

    /// alice's job running `argv` in `cwd` on `gpus` GPUs.
    fn alices(cwd: &Path, argv: Vec<String>, gpus: u32) -> Submit {
        Submit {
            user: "alice".into(),
            argv,
            cwd: cwd.to_path_buf(),
            env: vec![],
            gpus,
            min_free_bytes: 0,
            run_as: None,
            meta: Default::default(),
        }
    }

    /// Processes whose command line holds `marker`.
    fn processes_with(marker: &str) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
                    && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .is_ok_and(|s| s.rfind(')').is_some_and(|i| s[i + 2..].starts_with('Z')))
            })
            .collect()
    }

    /// A job adopted after a restart whose leader's pid went to another
    /// process (here: its record says the leader started at another
    /// time) ends without a signal to that pid's session, which is not the
    /// job's any more.
    #[test]
    fn a_session_whose_pid_changed_hands_is_not_killed() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = || test_config(dir.path());
        let id = {
            let n = Node::open(cfg(), Arc::new(crate::NoGpus)).unwrap();
            n.submit(alices(dir.path(), vec!["sleep".into(), "300".into()], 0))
                .unwrap()
        }; // gone without cleaning up, as after kill -9
        let n = Node::open(cfg(), Arc::new(crate::NoGpus)).unwrap();
        let Some(JobState::Running {
            sid,
            start: Some(start),
        }) = n.job(&id).unwrap().map(|r| r.state)
        else {
            panic!("not adopted")
        };
        n.state
            .update(&id, |r| {
                r.state = JobState::Running {
                    sid,
                    start: Some(start + 1),
                }
            })
            .unwrap();
        // Another process with that pid would not be in the job's cgroup.
        if let Some(cg) = &n.cgroups {
            std::fs::write(cg.root_procs(), sid.to_string()).unwrap();
        }
        let ended = n.reap().unwrap();
        assert_eq!(ended.len(), 1, "{ended:?}");
        let alive = runner::alive(sid, Some(start));
        runner::kill_session(sid, Duration::ZERO);
        assert!(alive, "the process now holding the pid was killed");
    }

    /// Issue 9, point 8: when the record of a started job cannot be written,
    /// the job is killed and its lease freed (a job the database does not
    /// know would hold its GPU unseen), and it stays queued to start again.
    #[test]
    fn a_start_that_cannot_be_recorded_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = dir.path().join("ctl.toml");
        std::fs::write(&ctl, "foreign = [{ gpu = 0, pid = 4242, mib = 3000 }]\n").unwrap();
        let inv = Arc::new(FakeGpus::new("1x11GiB", Some(ctl.clone())).unwrap());
        let cfg = test_config(dir.path());
        let n = Node::open(cfg, inv).unwrap();
        let marker = format!("301.{}", std::process::id());
        let id = n
            .submit(alices(
                dir.path(),
                vec!["bash".into(), "-c".into(), format!("exec sleep {marker}")],
                1,
            ))
            .unwrap();
        assert_eq!(n.job(&id).unwrap().unwrap().state, JobState::Queued);
        // The GPU frees up, and the database stops taking writes.
        std::fs::write(&ctl, "").unwrap();
        n.state.fail_writes.store(true, Ordering::SeqCst);
        assert!(n.schedule().is_err());
        assert!(
            processes_with(&marker).is_empty(),
            "the started job was left running: {:?}",
            processes_with(&marker)
        );
        assert!(n.state.all().unwrap().is_empty(), "its lease is freed");
        n.state.fail_writes.store(false, Ordering::SeqCst);
        assert_eq!(
            n.schedule().unwrap(),
            vec![id.clone()],
            "still queued, it starts"
        );
        assert!(matches!(
            n.job(&id).unwrap().unwrap().state,
            JobState::Running { .. }
        ));
        n.kill(&id, Duration::from_millis(100)).unwrap();
        assert!(processes_with(&marker).is_empty());
    }

    /// Issue 40, point 7: a job asking the whole memory of a card (which a
    /// real card never frees: the driver keeps some) is failed with the
    /// reason instead of stopping the queue; jobs behind a head that cannot
    /// start now pass it on GPUs it could not use and without GPUs, and
    /// never take the free GPUs it waits for.
    #[test]
    fn a_job_that_cannot_start_does_not_stop_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = dir.path().join("ctl.toml");
        let driver =
            "reserved = [{ gpu = 0, mib = 300 }, { gpu = 1, mib = 300 }, { gpu = 2, mib = 300 }]\n";
        // GPU 0 (11 GiB) held by a process labd did not start.
        std::fs::write(
            &ctl,
            format!("{driver}foreign = [{{ gpu = 0, pid = 4242, mib = 3000 }}]\n"),
        )
        .unwrap();
        let inv = FakeGpus::new("2x11GiB,1x4GiB", Some(ctl.clone())).unwrap();
        let n = Node::open(test_config(dir.path()), Arc::new(inv)).unwrap();
        let sleep = |marker: &str| vec!["sleep".to_string(), marker.to_string()];
        let job = |gpus: u32, gib: u64, marker: &str| Submit {
            min_free_bytes: gib << 30,
            ..alices(dir.path(), sleep(marker), gpus)
        };
        let tag = std::process::id();
        // The whole of an 11 GiB card: never, on cards as they are.
        let whole = n.submit(job(1, 11, &format!("1001.{tag}"))).unwrap();
        // Two 8 GiB GPUs: only GPU 1 is free now, so it waits, keeping GPU 1.
        let head = n.submit(job(2, 8, &format!("1002.{tag}"))).unwrap();
        // Behind it: one 8 GiB GPU (only GPU 1 fits, kept for the head),
        // one 2 GiB GPU (GPU 2, which the head cannot use), none.
        let kept_out = n.submit(job(1, 8, &format!("1003.{tag}"))).unwrap();
        let small = n.submit(job(1, 2, &format!("1004.{tag}"))).unwrap();
        let cpu = n.submit(job(0, 0, &format!("1005.{tag}"))).unwrap();
        // Each submission runs a pass: those two passed the head.
        for id in [&small, &cpu] {
            let state = n.job(id).unwrap().unwrap().state;
            assert!(matches!(state, JobState::Running { .. }), "{id}: {state:?}");
        }
        assert_eq!(n.schedule().unwrap(), Vec::<String>::new());
        match n.job(&whole).unwrap().unwrap().state {
            JobState::Failed { reason } => assert!(
                reason.contains("never fits") && reason.contains("300 MiB the driver keeps"),
                "{reason}"
            ),
            other => panic!("a job no card can serve: {other:?}"),
        }
        assert_eq!(n.job(&small).unwrap().unwrap().gpus, vec![2]);
        for id in [&head, &kept_out] {
            assert_eq!(n.job(id).unwrap().unwrap().state, JobState::Queued, "{id}");
        }
        let why = n.why_waiting(&kept_out, &n.gpus().unwrap()).unwrap();
        assert!(why.contains("1 job(s) ahead"), "{why}");
        // The holder of GPU 0 leaves: the head starts on GPUs 0 and 1, and
        // the one behind it still waits.
        std::fs::write(&ctl, driver).unwrap();
        assert_eq!(n.schedule().unwrap(), vec![head.clone()]);
        let mut gpus = n.job(&head).unwrap().unwrap().gpus;
        gpus.sort();
        assert_eq!(gpus, vec![0, 1]);
        assert_eq!(n.job(&kept_out).unwrap().unwrap().state, JobState::Queued);
        for id in [&head, &small, &cpu, &kept_out] {
            n.kill(id, Duration::from_millis(100)).unwrap();
        }
    }

    /// A pass over a long queue behind busy GPUs reads the inventory once,
    /// not once per queued job: it read it a thousand times behind a
    /// thousand queued jobs, and labd answered `labrun -d` in seconds.
    #[test]
    fn a_pass_over_a_long_queue_reads_the_gpus_once() {
        struct Counting(FakeGpus, std::sync::atomic::AtomicUsize);
        impl GpuInventory for Counting {
            fn read(&self) -> Result<Vec<crate::GpuInfo>, crate::InventoryError> {
                self.1.fetch_add(1, Ordering::SeqCst);
                self.0.read()
            }
            fn describe(&self) -> String {
                self.0.describe()
            }
            fn devices(&self) -> Result<Option<crate::GpuDevices>, crate::SetupError> {
                self.0.devices()
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeGpus::new("1x11GiB", None).unwrap();
        let inv = Arc::new(Counting(fake, Default::default()));
        let n = Node::open(test_config(dir.path()), inv.clone()).unwrap();
        let marker = format!("1107.{}", std::process::id());
        let sleep = vec!["sleep".to_string(), marker.clone()];
        let holder = n.submit(alices(dir.path(), sleep.clone(), 1)).unwrap();
        assert!(matches!(
            n.job(&holder).unwrap().unwrap().state,
            JobState::Running { .. }
        ));
        let waiting: Vec<JobId> = (0..200)
            .map(|_| n.submit(alices(dir.path(), sleep.clone(), 1)).unwrap())
            .collect();
        inv.1.store(0, Ordering::SeqCst);
        assert_eq!(n.schedule().unwrap(), Vec::<String>::new());
        assert_eq!(
            inv.1.load(Ordering::SeqCst),
            1,
            "inventory reads in one pass"
        );
        // The holder is killed: the pass after it starts the next one.
        n.kill(&holder, Duration::from_millis(100)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !matches!(
            n.job(&waiting[0]).unwrap().unwrap().state,
            JobState::Running { .. }
        ) {
            assert!(
                std::time::Instant::now() < deadline,
                "the next did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
            n.reap().unwrap();
            n.schedule().unwrap();
        }
        assert_eq!(n.job(&waiting[1]).unwrap().unwrap().state, JobState::Queued);
        // The queued first, or each kill would start the next.
        for id in waiting.iter().rev() {
            n.kill(id, Duration::from_millis(100)).unwrap();
        }
        assert!(processes_with(&marker).is_empty());
    }

    /// Jobs without GPUs start at once, so leave the queue at once: they
    /// count against `max_queued_per_user` while they run, or one user
    /// could start any number of them.
    #[test]
    fn jobs_running_without_gpus_count_against_the_queue_cap() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = test_config(dir.path());
        cfg.max_queued_per_user = 3;
        let n = Node::open(cfg, Arc::new(FakeGpus::new("1x11GiB", None).unwrap())).unwrap();
        let sleeper = |user: &str| Submit {
            user: user.into(),
            ..alices(dir.path(), vec!["sleep".into(), "300".into()], 0)
        };
        let mut ids = Vec::new();
        for _ in 0..3 {
            let id = n.reserve(&sleeper("alice")).unwrap();
            assert!(n.enqueue(&id, sleeper("alice")).unwrap());
            ids.push(id);
        }
        let running = n.jobs().unwrap();
        assert!(
            running
                .iter()
                .all(|j| matches!(j.state, JobState::Running { .. })),
            "{running:?}"
        );
        let over = n.reserve(&sleeper("alice")).unwrap_err();
        assert!(
            matches!(&over, NodeError::TooMany(m) if m.contains("3 jobs queued or running without GPUs")),
            "{over}"
        );
        let bobs = n.reserve(&sleeper("bob")).unwrap();
        assert!(n.enqueue(&bobs, sleeper("bob")).unwrap());
        ids.push(bobs);
        n.kill(&ids[0], Duration::ZERO).unwrap();
        let again = n.reserve(&sleeper("alice")).unwrap();
        assert!(n.enqueue(&again, sleeper("alice")).unwrap());
        ids.push(again);
        for id in &ids[1..] {
            n.kill(id, Duration::ZERO).unwrap();
        }
    }

    /// Issue 40, point 4 (in part): one user's jobs without GPUs run at
    /// most `max_cpu_jobs_per_user` at once (no GPU bounds them); the rest
    /// wait, saying why, and another user's start meanwhile.
    #[test]
    fn jobs_without_gpus_are_capped_per_user() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = test_config(dir.path());
        cfg.max_cpu_jobs_per_user = 2;
        let n = Node::open(cfg, Arc::new(FakeGpus::new("1x11GiB", None).unwrap())).unwrap();
        let sleeper = |user: &str| Submit {
            user: user.into(),
            ..alices(dir.path(), vec!["sleep".into(), "300".into()], 0)
        };
        let running =
            |id: &str| matches!(n.job(id).unwrap().unwrap().state, JobState::Running { .. });
        let alice: Vec<JobId> = (0..3)
            .map(|_| n.submit(sleeper("alice")).unwrap())
            .collect();
        assert!(running(&alice[0]) && running(&alice[1]));
        assert_eq!(n.job(&alice[2]).unwrap().unwrap().state, JobState::Queued);
        let why = n.why_waiting(&alice[2], &n.gpus().unwrap()).unwrap();
        assert!(why.contains("alice runs 2 job(s) without GPUs"), "{why}");
        let bob = n.submit(sleeper("bob")).unwrap();
        assert!(running(&bob), "another user's job is not held by alice's");
        n.kill(&alice[0], Duration::ZERO).unwrap();
        n.schedule().unwrap();
        assert!(running(&alice[2]), "started once one of hers ended");
        for id in alice[1..].iter().chain([&bob]) {
            n.kill(id, Duration::ZERO).unwrap();
        }
    }

    /// Ids stay above the jobs forgotten: with every record pruned (and
    /// the folders and logs gone), the next job is not `j1` again.
    #[test]
    fn forgotten_jobs_keep_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = test_config(dir.path());
        let inv = || Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
        let submit = || alices(dir.path(), vec!["true".into()], 0);
        let n = Node::open(cfg.clone(), inv()).unwrap();
        let first = n.reserve(&submit()).unwrap();
        n.state
            .finish(
                &first,
                JobState::Failed {
                    reason: "test".into(),
                },
            )
            .unwrap();
        assert_eq!(n.prune_ended(crate::leases::unix_now() + 1).unwrap(), 1);
        assert!(n.jobs().unwrap().is_empty());
        drop(n);
        let _ = std::fs::remove_dir_all(cfg.state_dir.join("jobs"));
        let _ = std::fs::remove_dir_all(cfg.state_dir.join("logs"));
        let n = Node::open(cfg, inv()).unwrap();
        let next = n.reserve(&submit()).unwrap();
        assert!(
            job_number(&next) > job_number(&first),
            "{first} then {next}"
        );
    }
}
