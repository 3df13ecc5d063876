//! Stages: code and data materialised here for a job another scheduler
//! (Slurm) runs on this node. The job's batch script asks, as its user,
//! through the coordinator; labd pulls the trees (peers first, then the
//! store) as for its own jobs and builds a working folder that is the
//! user's, then the script runs the command itself, under Slurm.
//!
//! Each stage is a folder `<state>/slurm/<job>.<n>` (root's, 0755): its
//! record `stage.json` and the working folder `work`. `n` is the first
//! number free, so a user who stages under someone else's job id only ever
//! makes a folder of their own. The trees of a stage not yet released count
//! as in use, so eviction never takes them from a running job; a released
//! stage's folder goes after `work_keep`. A stage whose step could not
//! release it (killed with SIGKILL, the node rebooted) is released by labd
//! once Slurm says its job no longer runs here (checked every
//! [`STAGE_CHECK_EVERY`]); without that check, after [`STAGE_TTL`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::blocking::off_runtime;
use crate::daemon::Daemon;
use crate::error::JobError;
use crate::leases::unix_now;
use crate::proto::{SnapshotId, StageAsk, StageDone, StageOrder, Staged, TreeRef};
use crate::request::Caller;
use crate::trees::{check_outputs, make_workdir};

/// A stage never released (its job's script was killed before it could
/// say so) stops holding its trees after this long.
pub const STAGE_TTL: Duration = Duration::from_secs(30 * 86_400);

/// The record of one stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StageRecord {
    /// Whose.
    pub user: String,
    /// The scheduler's job id.
    pub job: String,
    /// Snapshots of its trees.
    pub trees: Vec<SnapshotId>,
    /// Made (Unix seconds).
    pub at: u64,
    /// Released (Unix seconds).
    pub released: Option<u64>,
    /// When Slurm last said its job still runs here (Unix seconds): a
    /// stage is held [`STAGE_TTL`] after this, not after it was made, so a
    /// job running longer keeps its folder and trees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen: Option<u64>,
    /// Its trees or folder could not be made: released at once, and its
    /// folder goes at the next sweep (nothing of it is in use).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

/// A scheduler's job id: 1 to 20 digits (`SLURM_JOB_ID`).
fn check_job_id(job: &str) -> Result<(), JobError> {
    if job.is_empty() || job.len() > 20 || !job.bytes().all(|b| b.is_ascii_digit()) {
        return Err(JobError::Invalid(format!(
            "job id {job:?}: a scheduler's job id is digits (SLURM_JOB_ID)"
        )));
    }
    Ok(())
}

/// A stage's name as [`Staged::stage`] gives it: `<job>.<n>`, digits.
fn check_stage_name(stage: &str) -> Result<(), JobError> {
    match stage.split_once('.') {
        Some((job, n)) if check_job_id(job).is_ok() && check_job_id(n).is_ok() => Ok(()),
        _ => Err(JobError::Invalid(format!("no stage {stage:?}"))),
    }
}

/// How often the stages not released are checked with Slurm: a step
/// killed with SIGKILL (or a node rebooted under it) never says it ended.
const STAGE_CHECK_EVERY: Duration = Duration::from_secs(30);

/// A stage younger than this is not checked: its job was running when it
/// was made.
const STAGE_CHECK_AFTER: u64 = 30;

/// The fields labd asks Slurm for (`squeue -o`): the job's id (unique per
/// array task), its state, batch host and user. None is a field a user
/// names: `scontrol show job` prints the job's name and comment unquoted
/// among its fields, where a name such as `x JobState=RUNNING` planted one.
const JOB_FORMAT: &str = "%A|%T|%B|%u";

/// A job as one line of `squeue -h -o JOB_FORMAT` shows it.
#[derive(Debug, PartialEq, Eq)]
struct SlurmJob<'a> {
    state: &'a str,
    batch_host: &'a str,
    user: &'a str,
}

/// Job `job`'s line in `squeue`'s output (an array's id lists every task:
/// only the line with that very id counts).
fn job_line<'a>(out: &'a str, job: &str) -> Option<SlurmJob<'a>> {
    out.lines().find_map(|l| {
        let mut f = l.trim().split('|');
        let (id, state, batch_host, user) = (f.next()?, f.next()?, f.next()?, f.next()?);
        (id == job && f.next().is_none()).then_some(SlurmJob {
            state,
            batch_host,
            user,
        })
    })
}

/// States in which a job's step on its batch host is over for good (a
/// PENDING job was requeued: its next run makes a stage of its own).
/// Anything else, `RESIZING` or `SIGNALING` of a running job, `REQUEUED`
/// or `COMPLETING` while its processes stop, keeps the stage.
const ENDED: [&str; 12] = [
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "PENDING",
    "SPECIAL_EXIT",
    "REVOKED",
];

/// Whether `squeue`'s answer about `job` (its output, or its error when it
/// failed) says that a stage made on `node` for the job is no longer used
/// by it: the job ended or was requeued, runs on another node, or Slurm
/// has forgotten it. `None` when the answer says neither (slurmctld did
/// not answer, no line for the job): the stage stays held.
fn job_over(answer: Result<&str, &str>, job: &str, node: &str) -> Option<bool> {
    let out = match answer {
        Ok(out) => out,
        Err(e) if e.contains("Invalid job id") => return Some(true),
        Err(_) => return None,
    };
    let j = job_line(out, job)?;
    let elsewhere = j.state == "RUNNING" && j.batch_host != node;
    Some(ENDED.contains(&j.state) || elsewhere)
}

/// Whether `squeue`'s answer shows `job` running on `node`.
fn runs_here(answer: Result<&str, &str>, job: &str, node: &str) -> bool {
    answer
        .ok()
        .and_then(|out| job_line(out, job))
        .is_some_and(|j| j.state == "RUNNING" && j.batch_host == node)
}

/// The trees a stage asks for (code first), once the ask is found sound:
/// a job id Slurm could have given, outputs inside the work folder, data
/// variables that are ones, at most [`crate::request::MAX_DATASETS`] datasets,
/// tree refs spelt as labsync writes them.
fn check_stage_ask(ask: &StageAsk) -> Result<Vec<&TreeRef>, JobError> {
    check_job_id(&ask.job)?;
    if let Some(out) = &ask.outputs {
        check_outputs(out)?;
    }
    crate::request::check_data_vars(&ask.data)?;
    if ask.data.len() > crate::request::MAX_DATASETS {
        return Err(JobError::Invalid(format!(
            "{} datasets: at most {} per job",
            ask.data.len(),
            crate::request::MAX_DATASETS
        )));
    }
    let trees: Vec<&TreeRef> = (ask.code.iter())
        .chain(ask.data.iter().map(|d| &d.tree))
        .collect();
    for t in &trees {
        crate::request::check_tree_ref(t)?;
    }
    Ok(trees)
}

/// Stages a user may hold unreleased on one node at once.
pub const STAGES_PER_USER: usize = 64;

/// The stages folder's records, by stage name; `Err` when the folder or a
/// record cannot be read (then every tree must count as in use). A folder
/// with no record yet (made a moment ago, or left by a crash) is `None`,
/// and so is one whose record does not parse (cut short by a crash): like
/// a folder without one, it holds every tree until the sweep removes it,
/// and the other stages go on.
pub(crate) fn records(dir: &Path) -> std::io::Result<Vec<(String, Option<StageRecord>)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e?;
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let rec = match std::fs::read(e.path().join("stage.json")) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(r) => Some(r),
                Err(err) => {
                    tracing::warn!(
                        "stage {name}: its record does not read ({err}); \
                         held as one without a record"
                    );
                    None
                }
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(err) => return Err(err),
        };
        out.push((name, rec));
    }
    Ok(out)
}

/// Whether a stage holds `snapshot`'s tree at `now`; true when the records
/// cannot be read, or a stage's record is not written yet.
pub(crate) fn tree_in_stage(dir: &Path, snapshot: &SnapshotId, now: u64) -> bool {
    match records(dir) {
        Ok(recs) => recs.iter().any(|(_, r)| match r {
            Some(r) => holds_trees(r, now) && r.trees.contains(snapshot),
            None => true,
        }),
        Err(e) => {
            tracing::warn!(
                "cannot read the stages in {}: {e}; keeping every tree",
                dir.display()
            );
            true
        }
    }
}

fn write_record(stage_dir: &Path, rec: &StageRecord) -> std::io::Result<()> {
    // labd's alone (it names the user's job and snapshots), whole on the
    // disk before it is in place, under a name of its own (the sweep, the
    // step's release and an abandoned request's may write it at once).
    let json = serde_json::to_vec(rec).expect("record serialises");
    labsync_store::write_atomic_mode(&stage_dir.join("stage.json"), &json, 0o600)
        .map_err(std::io::Error::other)
}

/// When a stage not released stops holding its trees: [`STAGE_TTL`] after
/// it was made or Slurm last said its job runs here.
fn held_until(rec: &StageRecord) -> u64 {
    rec.at
        .max(rec.seen.unwrap_or(0))
        .saturating_add(STAGE_TTL.as_secs())
}

/// Whether a stage's trees are still in use at `now`.
pub(crate) fn holds_trees(rec: &StageRecord, now: u64) -> bool {
    rec.released.is_none() && now < held_until(rec)
}

/// Whether a stage's folder may go at `now`.
pub(crate) fn expired(rec: &StageRecord, now: u64, work_keep: Duration) -> bool {
    match rec.released {
        Some(_) if rec.failed => true,
        Some(t) => now >= t.saturating_add(work_keep.as_secs()),
        None => now >= held_until(rec),
    }
}

/// How often a stage's record is written again to say its job still runs
/// (see [`StageRecord::seen`]).
const SEEN_EVERY: u64 = 86_400;

/// Stage folders a user has here at most for one Slurm job (a requeued job
/// stages again; a released stage's folder stays for `work_keep`).
pub const STAGES_PER_JOB: usize = 64;

/// Stage folders a user has here at most, released or not: what a user
/// staging and releasing in a loop can leave for the sweep.
pub const STAGE_FOLDERS_PER_USER: usize = 1024;

/// Distinct trees (code and data snapshots) a user's unreleased stages
/// hold here at most: eviction cannot take them, so without a bound one
/// running job could pin 64 stages of 65 trees each past `trees_max`.
pub const STAGE_TREES_PER_USER: usize = 128;

/// Names `<job>.<n>` tried for one job id (users' stages under one id
/// together; others may have taken some).
const NAMES_PER_JOB: u32 = 10_000;

/// One change to the stages' records at a time: the cap's count and the
/// new folder, and each record's read-change-write.
static RECORDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn records_lock() -> std::sync::MutexGuard<'static, ()> {
    RECORDS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes `<dir>/<job>.<n>` for the first `n` free; its path and name.
/// `None` when [`NAMES_PER_JOB`] are taken.
fn new_stage_dir(dir: &Path, job: &str) -> std::io::Result<Option<(PathBuf, String)>> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::create_dir_all(dir)?;
    // Users reach their working folders through it (its path is all they
    // are told); they can list none of it, and only labd writes it.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    for n in 1..=NAMES_PER_JOB {
        let name = format!("{job}.{n}");
        let path = dir.join(&name);
        match std::fs::DirBuilder::new().mode(0o711).create(&path) {
            Ok(()) => return Ok(Some((path, name))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// Releases a stage whose request was dropped half way.
struct ReleaseOnDrop {
    daemon: Option<Arc<Daemon>>,
    user: String,
    stage: String,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(d) = self.daemon.take() else { return };
        let (user, stage) = (
            std::mem::take(&mut self.user),
            std::mem::take(&mut self.stage),
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                tracing::info!("stage {stage} of {user} abandoned by its asker; released");
                let _ = d.release_stage(&user, &stage).await;
            });
        }
    }
}

/// Why `squeue`'s output (see [`JOB_FORMAT`]) does not show a job `user`
/// may stage for on `node`; `None` when it does. `user` is `None` where
/// jobs do not run as their submitters (the token's name is no Unix user's).
fn job_refusal(job: &str, out: &str, node: &str, user: Option<&str>) -> Option<String> {
    let Some(j) = job_line(out, job) else {
        return Some(format!("Slurm shows no job {job}"));
    };
    if !matches!(j.state, "RUNNING" | "CONFIGURING") {
        return Some(format!("Slurm job {job} is not running ({:?})", j.state));
    }
    if j.batch_host != node {
        return Some(format!(
            "Slurm job {job} runs on {:?}, not on {node}",
            j.batch_host
        ));
    }
    if let Some(u) = user {
        if j.user != u {
            return Some(format!("Slurm job {job} is {:?}'s, not {u}'s", j.user));
        }
    }
    None
}

impl Daemon {
    /// Starts a check of the unreleased stages with Slurm in the background
    /// when one is due (every [`STAGE_CHECK_EVERY`], where labd checks
    /// stages with Slurm at all) and none is running.
    pub(crate) fn check_stages_if_due(self: &Arc<Self>) {
        if self.cfg.slurm_check.is_none() {
            return;
        }
        {
            let mut at = self.stages_checked.lock().expect("labd poisoned");
            if at.is_some_and(|t| self.clock.since(t) < STAGE_CHECK_EVERY) {
                return;
            }
            *at = Some(self.clock.instant());
        }
        if self
            .stages_checking
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            me.release_stages_of_ended_jobs().await;
            me.stages_checking
                .store(false, std::sync::atomic::Ordering::Release);
        });
    }

    /// Releases the stages whose Slurm job no longer runs here (see
    /// [`job_over`]): their trees may then be evicted, and their folders go
    /// after `work_keep`, instead of after [`STAGE_TTL`].
    async fn release_stages_of_ended_jobs(&self) {
        let Some(check) = &self.cfg.slurm_check else {
            return;
        };
        let dir = self.stages_dir();
        let Ok(recs) = off_runtime(move || records(&dir)).await else {
            return;
        };
        let now = unix_now();
        // Per job: over, and whether Slurm shows it running here.
        let mut asked: std::collections::HashMap<String, (Option<bool>, bool)> = Default::default();
        for (name, rec) in recs {
            let Some(rec) = rec else { continue };
            if !holds_trees(&rec, now) || now < rec.at.saturating_add(STAGE_CHECK_AFTER) {
                continue;
            }
            let (over, here) = match asked.get(&rec.job) {
                Some(o) => *o,
                None => {
                    let o = match self.squeue_job(check, &rec.job).await {
                        Ok(out) => {
                            let text = String::from_utf8_lossy(&out.stdout);
                            let err = String::from_utf8_lossy(&out.stderr);
                            let answer = if out.status.success() {
                                Ok(&*text)
                            } else {
                                Err(&*err)
                            };
                            let node = &self.cfg.node_name;
                            (
                                job_over(answer, &rec.job, node),
                                runs_here(answer, &rec.job, node),
                            )
                        }
                        Err(e) => {
                            tracing::debug!("checking stage {name}: {e}");
                            (None, false)
                        }
                    };
                    asked.insert(rec.job.clone(), o);
                    o
                }
            };
            match over {
                Some(true) => match self.release_stage(&rec.user, &name).await {
                    Ok(()) => tracing::info!(
                        "stage {name} of {}: Slurm job {} no longer runs here; released",
                        rec.user,
                        rec.job
                    ),
                    Err(e) => tracing::warn!("releasing stage {name}: {e}"),
                },
                // Running here: held for STAGE_TTL from now (not a job
                // held or suspended for ever).
                Some(false) if here && now >= rec.at.max(rec.seen.unwrap_or(0)) + SEEN_EVERY => {
                    let dir = self.stages_dir().join(&name);
                    let r = off_runtime(move || mark_seen(&dir, now)).await;
                    if let Err(e) = r {
                        tracing::warn!("stage {name}: {e}");
                    }
                }
                _ => {}
            }
        }
    }

    /// `squeue -h --states=all -j JOB -o JOB_FORMAT`, under the check's timeout.
    async fn squeue_job(
        &self,
        check: &super::SlurmCheck,
        job: &str,
    ) -> Result<std::process::Output, JobError> {
        // `--local`: in a federation, squeue asks every cluster and drops
        // one that does not answer, this one included, without an error:
        // a job of this node would then be "Invalid job id", and its stage
        // released. The job runs here, so this cluster's controller is the
        // one that knows it.
        // Each option one argument (`--jobs=ID`): with POSIXLY_CORRECT set,
        // getopt would stop at a separate one.
        let args = [
            "--noheader".to_string(),
            "--local".to_string(),
            "--states=all".to_string(),
            format!("--jobs={job}"),
            format!("--format={JOB_FORMAT}"),
        ];
        let slurm = crate::slurm::Slurm::for_labd(check.timeout, check.conf.clone());
        slurm
            .output("squeue", &args, None)
            .await
            .map_err(|e| match e {
                crate::slurm::SlurmError::Timeout { .. } => JobError::Conflict(format!(
                    "cannot check Slurm job {job}: squeue did not answer within {} s \
                 (is slurmctld up?)",
                    check.timeout.as_secs()
                )),
                e => JobError::Conflict(format!(
                    "cannot check Slurm job {job} with squeue on {}: {}",
                    self.cfg.node_name,
                    crate::blocking::chain(&e)
                )),
            })
    }

    /// Asks Slurm whether `job` is `user`'s running job on this node.
    async fn check_slurm_job(
        &self,
        check: &super::SlurmCheck,
        job: &str,
        user: &str,
    ) -> Result<(), JobError> {
        let out = self.squeue_job(check, job).await?;
        let text = String::from_utf8_lossy(&out.stdout);
        let user = self.cfg.run_as_submitter.then_some(user);
        let why = if out.status.success() {
            job_refusal(job, &text, &self.cfg.node_name, user)
        } else {
            Some(format!(
                "Slurm knows no job {job}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        };
        match why {
            Some(w) => Err(JobError::Forbidden(format!(
                "{w}: a node stages only for the asker's Slurm job running there"
            ))),
            None => Ok(()),
        }
    }

    /// Where stages live.
    pub(crate) fn stages_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("slurm")
    }

    /// Stages `o` here: records it (its trees now count as in use), pulls
    /// the trees and builds the working folder as the user's.
    pub async fn stage(self: &Arc<Self>, o: StageOrder) -> Result<Staged, JobError> {
        let ask = &o.ask;
        let trees = check_stage_ask(ask)?;
        let caller = Caller {
            user: o.user.clone(),
            admin: false,
        };
        let owner = self.run_as(&caller).await?;
        if let Some(check) = &self.cfg.slurm_check {
            self.check_slurm_job(check, &ask.job, &o.user).await?;
        }
        let rec = StageRecord {
            user: o.user.clone(),
            job: ask.job.clone(),
            trees: trees.iter().map(|t| t.snapshot).collect(),
            at: unix_now(),
            released: None,
            seen: None,
            failed: false,
        };
        let (dir, node) = (self.stages_dir(), self.cfg.node_name.clone());
        let (stage_dir, name) = off_runtime(move || new_stage(&dir, &rec, &node)).await?;
        // Released if this request goes away before it is answered (the
        // asker disconnected): its trees must not stay held.
        let mut guard = ReleaseOnDrop {
            daemon: Some(self.clone()),
            user: o.user.clone(),
            stage: name.clone(),
        };
        let repo = self.repo()?;
        let prepared = async {
            self.check_tree_share(&o.user, super::shares::Asking::Stage(&name), &trees, repo)
                .await?;
            let code = match &ask.code {
                Some(t) => Some(self.trees.get(repo, &self.cache, t).await?),
                None => None,
            };
            let mut data = Vec::new();
            for d in &ask.data {
                data.push((
                    d.env.clone(),
                    self.trees.get(repo, &self.cache, &d.tree).await?,
                ));
            }
            let work = stage_dir.join("work");
            let (w, outputs) = (work.clone(), ask.outputs.clone());
            off_runtime(move || make_workdir(code.as_deref(), &w, outputs.as_deref(), owner))
                .await?;
            Ok::<_, crate::error::PrepareError>((work, data))
        };
        match prepared.await {
            Ok((work, data)) => {
                guard.daemon = None;
                tracing::info!(
                    "staged Slurm job {} of {} in {}",
                    ask.job,
                    o.user,
                    work.display()
                );
                Ok(Staged {
                    node: self.cfg.node_name.clone(),
                    stage: name,
                    work,
                    data,
                })
            }
            Err(e) => {
                // Nothing of it is in use: released at once, its folder
                // removed at the next sweep.
                guard.daemon = None;
                let r = off_runtime(move || mark_failed(&stage_dir, unix_now())).await;
                if let Err(x) = r {
                    tracing::warn!("stage {name}: {x}");
                }
                Err(JobError::Conflict(format!(
                    "cannot stage job {} on {}: {}",
                    ask.job,
                    self.cfg.node_name,
                    crate::blocking::chain(&e)
                )))
            }
        }
    }

    /// Releases a stage of `user`'s (its job ended).
    pub async fn stage_done(self: &Arc<Self>, d: StageDone) -> Result<(), JobError> {
        check_stage_name(&d.stage)?;
        self.release_stage(&d.user, &d.stage).await
    }

    async fn release_stage(&self, user: &str, stage: &str) -> Result<(), JobError> {
        let dir = self.stages_dir().join(stage);
        let (user, stage) = (user.to_string(), stage.to_string());
        off_runtime(move || release_in(&dir, &user, &stage, unix_now())).await
    }
}

/// Makes a stage for `rec` in `dir` (on `node`) unless its user holds
/// [`STAGES_PER_USER`] already, or has [`STAGES_PER_JOB`] folders for its
/// job or [`STAGE_FOLDERS_PER_USER`] in all: its folder, with its record
/// written. One at a time, so that requests at once cannot each count
/// fewer than the cap. A folder whose record cannot be written is removed
/// again.
fn new_stage(dir: &Path, rec: &StageRecord, node: &str) -> Result<(PathBuf, String), JobError> {
    let _one = records_lock();
    let recs =
        records(dir).map_err(|e| JobError::Internal(format!("cannot read the stages: {e}")))?;
    let theirs = || {
        recs.iter()
            .filter_map(|(_, r)| r.as_ref())
            .filter(|r| r.user == rec.user)
    };
    let held = theirs().filter(|r| holds_trees(r, rec.at)).count();
    let user = &rec.user;
    if held >= STAGES_PER_USER {
        return Err(JobError::Busy(format!(
            "{user} holds {held} stages on {node} not yet released (at most {STAGES_PER_USER}): \
             a stage is released when its job's step ends"
        )));
    }
    let pinned: std::collections::HashSet<&SnapshotId> = theirs()
        .filter(|r| holds_trees(r, rec.at))
        .chain(std::iter::once(rec))
        .flat_map(|r| r.trees.iter())
        .collect();
    if pinned.len() > STAGE_TREES_PER_USER {
        return Err(JobError::Busy(format!(
            "{user}'s stages on {node} would hold {} different code and data trees (at most \
             {STAGE_TREES_PER_USER}): release stages whose jobs are done",
            pinned.len()
        )));
    }
    let of_job = theirs().filter(|r| r.job == rec.job).count();
    if of_job >= STAGES_PER_JOB {
        return Err(JobError::Busy(format!(
            "{user} has staged Slurm job {} {of_job} times on {node} (at most \
             {STAGES_PER_JOB}; a released stage's folder stays for work_keep)",
            rec.job
        )));
    }
    let folders = theirs().count();
    if folders >= STAGE_FOLDERS_PER_USER {
        return Err(JobError::Busy(format!(
            "{user} has {folders} stage folders on {node} (at most {STAGE_FOLDERS_PER_USER}; \
             a released stage's folder stays for work_keep)"
        )));
    }
    let (path, name) = new_stage_dir(dir, &rec.job)
        .map_err(|e| JobError::Internal(format!("cannot record the stage: {e}")))?
        .ok_or_else(|| {
            JobError::Busy(format!(
                "Slurm job {} has {NAMES_PER_JOB} stage folders on {node}",
                rec.job
            ))
        })?;
    if let Err(e) = write_record(&path, rec) {
        let _ = std::fs::remove_dir_all(&path);
        return Err(JobError::Internal(format!("cannot record the stage: {e}")));
    }
    Ok((path, name))
}

/// Rewrites the record in `stage_dir` with `change` applied.
fn rewrite(stage_dir: &Path, change: impl FnOnce(&mut StageRecord)) -> std::io::Result<()> {
    let _one = records_lock();
    let bytes = std::fs::read(stage_dir.join("stage.json"))?;
    let mut rec: StageRecord = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
    change(&mut rec);
    write_record(stage_dir, &rec)
}

/// Records that Slurm said at `now` that the stage's job runs here.
fn mark_seen(stage_dir: &Path, now: u64) -> std::io::Result<()> {
    rewrite(stage_dir, |r| r.seen = Some(now))
}

/// Records that the stage could not be made: released, its folder to go.
fn mark_failed(stage_dir: &Path, now: u64) -> std::io::Result<()> {
    rewrite(stage_dir, |r| {
        r.released.get_or_insert(now);
        r.failed = true;
    })
}

/// Stages `user` holds unreleased in `dir` at `now`.
#[cfg(test)]
fn held_by(dir: &Path, user: &str, now: u64) -> std::io::Result<usize> {
    Ok(records(dir)?
        .iter()
        .filter(|(_, r)| {
            r.as_ref()
                .is_some_and(|r| r.user == user && holds_trees(r, now))
        })
        .count())
}

/// Releases the stage in folder `dir` (named `stage`) for `user`, whose it
/// must be.
fn release_in(dir: &Path, user: &str, stage: &str, now: u64) -> Result<(), JobError> {
    let _one = records_lock();
    let rec: StageRecord = std::fs::read(dir.join("stage.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| JobError::NotFound(format!("no stage {stage} here")))?;
    if rec.user != user {
        return Err(JobError::Forbidden(format!(
            "stage {stage} is {}'s, not {user}'s",
            rec.user
        )));
    }
    if rec.released.is_none() {
        let rec = StageRecord {
            released: Some(now),
            ..rec
        };
        write_record(dir, &rec)
            .map_err(|e| JobError::Internal(format!("cannot release {stage}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot id named for a test.
    fn snap(name: &str) -> SnapshotId {
        SnapshotId::of(name.as_bytes())
    }

    #[test]
    fn names_and_lifetimes() {
        assert!(check_job_id("1234").is_ok());
        for bad in ["", "12a", "../1", "1.2", "123456789012345678901"] {
            assert!(check_job_id(bad).is_err(), "{bad:?}");
        }
        assert!(check_stage_name("1234.1").is_ok());
        for bad in ["1234", "1234.", ".1", "1234.1/..", "../x.1"] {
            assert!(check_stage_name(bad).is_err(), "{bad:?}");
        }
        let rec = StageRecord {
            user: "alice".into(),
            job: "7".into(),
            trees: vec![],
            at: 1000,
            released: None,
            seen: None,
            failed: false,
        };
        let keep = Duration::from_secs(60);
        assert!(holds_trees(&rec, 1000 + 86_400));
        assert!(!expired(&rec, 1000 + 86_400, keep));
        assert!(!holds_trees(&rec, 1000 + STAGE_TTL.as_secs()));
        assert!(expired(&rec, 1000 + STAGE_TTL.as_secs(), keep));
        let done = StageRecord {
            released: Some(2000),
            ..rec
        };
        assert!(!holds_trees(&done, 2000));
        assert!(!expired(&done, 2059, keep));
        assert!(expired(&done, 2060, keep));
        // Slurm said on day 29 that its job still runs here: held 30 days
        // from then, folder and trees.
        let seen = StageRecord {
            released: None,
            seen: Some(1000 + 29 * 86_400),
            ..done.clone()
        };
        assert!(holds_trees(&seen, 1000 + STAGE_TTL.as_secs()));
        assert!(!expired(&seen, 1000 + STAGE_TTL.as_secs(), keep));
        assert!(!holds_trees(&seen, 1000 + 59 * 86_400));
        // One that failed goes at the next sweep.
        let failed = StageRecord {
            failed: true,
            ..done
        };
        assert!(expired(&failed, 2000, keep));
    }

    fn record(user: &str, job: &str, at: u64) -> StageRecord {
        StageRecord {
            user: user.into(),
            job: job.into(),
            trees: vec![snap("s1")],
            at,
            released: None,
            seen: None,
            failed: false,
        }
    }

    #[test]
    fn stages_are_capped_per_user_and_per_job() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for k in 0..STAGES_PER_USER {
            new_stage(d, &record("alice", &k.to_string(), 100), "gpu1").unwrap();
        }
        let over = new_stage(d, &record("alice", "999", 100), "gpu1").unwrap_err();
        assert!(
            matches!(&over, JobError::Busy(m) if m.contains("not yet released")),
            "{over:?}"
        );
        // Another user is not held back by her.
        new_stage(d, &record("bob", "7", 100), "gpu1").unwrap();
        // Nor does one pin more than STAGE_TREES_PER_USER trees at once.
        let many = |n: usize, from: usize| {
            let mut r = record("erin", &format!("7{from}"), 100);
            r.trees = (from..from + n).map(|k| snap(&format!("t{k}"))).collect();
            r
        };
        new_stage(d, &many(65, 0), "gpu1").unwrap();
        new_stage(d, &many(63, 65), "gpu1").unwrap();
        // The same trees again cost nothing more; one new tree is over.
        new_stage(d, &many(64, 60), "gpu1").unwrap();
        let over = new_stage(d, &many(1, 128), "gpu1").unwrap_err();
        assert!(
            matches!(&over, JobError::Busy(m) if m.contains("129 different code and data trees")),
            "{over:?}"
        );
        // Staged, released and staged again: at most STAGES_PER_JOB
        // folders of one job, released or not.
        for _ in 1..STAGES_PER_JOB {
            let (p, name) = new_stage(d, &record("bob", "1008", 100), "gpu1").unwrap();
            release_in(&p, "bob", &name, 101).unwrap();
        }
        let (p, name) = new_stage(d, &record("bob", "1008", 100), "gpu1").unwrap();
        release_in(&p, "bob", &name, 101).unwrap();
        let over = new_stage(d, &record("bob", "1008", 100), "gpu1").unwrap_err();
        assert!(
            matches!(&over, JobError::Busy(m) if m.contains("staged Slurm job 1008 64 times")),
            "{over:?}"
        );
        // Bob's folders under that id do not stop Carol's stage of it.
        new_stage(d, &record("carol", "1008", 100), "gpu1").unwrap();
        // Nor does anyone get more than STAGE_FOLDERS_PER_USER folders
        // here, released or not, whatever job ids they name.
        for k in 0..STAGE_FOLDERS_PER_USER {
            let (p, _) = new_stage_dir(d, &format!("5{k}")).unwrap().unwrap();
            let mut r = record("dave", &format!("5{k}"), 100);
            r.released = Some(101);
            write_record(&p, &r).unwrap();
        }
        let over = new_stage(d, &record("dave", "42", 200), "gpu1").unwrap_err();
        assert!(
            matches!(&over, JobError::Busy(m) if m.contains("1024 stage folders")),
            "{over:?}"
        );
    }

    #[test]
    fn requests_at_once_do_not_pass_the_cap_together() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let made = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for k in 0..(2 * STAGES_PER_USER) {
                let (d, made) = (&d, &made);
                s.spawn(move || {
                    if new_stage(d, &record("alice", &k.to_string(), 100), "gpu1").is_ok() {
                        made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(made.into_inner(), STAGES_PER_USER);
    }

    #[test]
    fn a_failed_stage_is_released_and_its_folder_goes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let (p, _) = new_stage(d, &record("alice", "5", 100), "gpu1").unwrap();
        assert!(tree_in_stage(d, &snap("s1"), 100));
        mark_failed(&p, 120).unwrap();
        assert!(!tree_in_stage(d, &snap("s1"), 120));
        let recs = records(d).unwrap();
        let rec = recs[0].1.as_ref().unwrap();
        assert!(expired(rec, 120, Duration::from_secs(86_400)));
        // Seen running again later: held from then.
        let (q, _) = new_stage(d, &record("alice", "6", 100), "gpu1").unwrap();
        mark_seen(&q, 100 + STAGE_TTL.as_secs() - 1).unwrap();
        assert!(tree_in_stage(d, &snap("s1"), 100 + STAGE_TTL.as_secs()));
    }

    #[test]
    fn trees_are_held_unless_a_record_says_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert!(
            !tree_in_stage(d, &snap("s1"), 100),
            "no stages: nothing held"
        );
        let (p, _) = new_stage_dir(d, "9").unwrap().unwrap();
        // Made, not yet recorded: every tree is held.
        assert!(tree_in_stage(d, &snap("s1"), 100));
        let rec = record("alice", "9", 100);
        write_record(&p, &rec).unwrap();
        assert!(tree_in_stage(d, &snap("s1"), 100));
        assert!(!tree_in_stage(d, &snap("s2"), 100));
        write_record(
            &p,
            &StageRecord {
                released: Some(150),
                ..rec
            },
        )
        .unwrap();
        assert!(!tree_in_stage(d, &snap("s1"), 200));
        // A record that cannot be read keeps every tree.
        std::fs::write(p.join("stage.json"), "{ not json").unwrap();
        assert!(tree_in_stage(d, &snap("s2"), 200));
        // And the other stages are still read: a user's stage counts, and
        // a new one can be made.
        let (q, _) = new_stage(d, &record("bob", "10", 200), "gpu1").unwrap();
        assert_eq!(held_by(d, "bob", 200).unwrap(), 1);
        assert!(q.join("stage.json").exists());
    }

    #[test]
    fn only_the_askers_running_job_on_this_node() {
        let line = "12|RUNNING|gpu1|alice";
        assert_eq!(job_refusal("12", line, "gpu1", Some("alice")), None);
        assert_eq!(job_refusal("12", line, "gpu1", None), None);
        let why =
            |l: &str, node: &str, user: Option<&str>| job_refusal("12", l, node, user).unwrap();
        assert!(why(line, "gpu2", Some("alice")).contains("runs on \"gpu1\", not on gpu2"));
        assert!(why(line, "gpu1", Some("bob")).contains("is \"alice\"'s, not bob's"));
        assert!(why("12|PENDING|gpu1|alice", "gpu1", Some("alice")).contains("not running"));
        assert!(why("12|COMPLETED|gpu1|alice", "gpu1", None).contains("not running"));
        let starting = "12|CONFIGURING|gpu1|alice";
        assert_eq!(job_refusal("12", starting, "gpu1", Some("alice")), None);
        // An array's id lists its tasks: only the line of job 12 counts.
        let array = "13|RUNNING|gpu2|alice\n12|RUNNING|gpu1|alice\n";
        assert_eq!(job_refusal("12", array, "gpu1", Some("alice")), None);
        assert!(why("13|RUNNING|gpu1|alice", "gpu1", None).contains("shows no job 12"));
        // A line with more fields than asked for is no job's.
        assert!(why("12|RUNNING|gpu1|alice|x", "gpu1", None).contains("shows no job 12"));
    }

    #[test]
    fn only_a_job_running_here_renews_its_stage() {
        let here = |l: &str| runs_here(Ok(l), "12", "gpu1");
        assert!(here("12|RUNNING|gpu1|alice\n"));
        for l in [
            "12|RUNNING|gpu2|alice\n",
            "12|SUSPENDED|gpu1|alice\n",
            "12|REQUEUE_HOLD|gpu1|alice\n",
            "13|RUNNING|gpu1|alice\n",
            "",
        ] {
            assert!(!here(l), "{l:?}");
        }
        assert!(!runs_here(Err("slurm_load_jobs error"), "12", "gpu1"));
    }

    #[test]
    fn a_stage_is_over_when_its_job_no_longer_runs_here() {
        let line = |state: &str, host: &str| format!("12|{state}|{host}|alice\n");
        let live = [
            "RUNNING",
            "CONFIGURING",
            "SUSPENDED",
            "COMPLETING",
            "RESIZING",
            "SIGNALING",
            "REQUEUED",
            "STOPPED",
        ];
        for state in live {
            let over = job_over(Ok(&line(state, "gpu1")), "12", "gpu1");
            assert_eq!(over, Some(false), "{state}");
        }
        for state in ENDED {
            let over = job_over(Ok(&line(state, "gpu1")), "12", "gpu1");
            assert_eq!(over, Some(true), "{state}");
        }
        // Requeued and started on another node: this stage is not its own.
        assert_eq!(
            job_over(Ok(&line("RUNNING", "gpu2")), "12", "gpu1"),
            Some(true)
        );
        // Another task of an array, ended: not job 12's line.
        let array = "13|COMPLETED|gpu1|alice\n12|RUNNING|gpu1|alice\n";
        assert_eq!(job_over(Ok(array), "12", "gpu1"), Some(false));
        // Purged from slurmctld (MinJobAge): gone.
        let purged = "slurm_load_jobs error: Invalid job id specified";
        assert_eq!(job_over(Err(purged), "12", "gpu1"), Some(true));
        // slurmctld not answering, or no line for the job: held.
        let down = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)";
        assert_eq!(job_over(Err(down), "12", "gpu1"), None);
        assert_eq!(job_over(Ok(""), "12", "gpu1"), None);
    }

    #[test]
    fn no_squeue_default_from_labds_environment_filters_the_check() {
        use std::ffi::OsStr;
        for k in [
            "SQUEUE_USERS",
            "SQUEUE_PARTITION",
            "SQUEUE_ACCOUNT",
            "SQUEUE_QOS",
            "SQUEUE_NAMES",
            "SQUEUE_FEDERATION",
            "SLURM_CLUSTERS",
            "SLURM_JWT",
            "POSIXLY_CORRECT",
        ] {
            assert!(crate::slurm::hides_jobs(OsStr::new(k)), "{k}");
        }
        for k in ["SLURM_CONF", "PATH", "HOME", "SQUEUE", "MY_SQUEUE_USERS"] {
            assert!(!crate::slurm::hides_jobs(OsStr::new(k)), "{k}");
        }
    }

    #[test]
    fn only_its_user_releases_a_stage_and_the_cap_counts_theirs() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let rec = |user: &str| StageRecord {
            user: user.into(),
            job: "5".into(),
            trees: vec![snap("s1")],
            at: 100,
            released: None,
            seen: None,
            failed: false,
        };
        let (alice, name) = new_stage_dir(d, "5").unwrap().unwrap();
        write_record(&alice, &rec("alice")).unwrap();
        let (bob, _) = new_stage_dir(d, "5").unwrap().unwrap();
        write_record(&bob, &rec("bob")).unwrap();
        assert_eq!(held_by(d, "alice", 200).unwrap(), 1);
        // Bob cannot release Alice's stage (her trees stay held).
        assert!(matches!(
            release_in(&alice, "bob", &name, 200),
            Err(JobError::Forbidden(_))
        ));
        assert!(tree_in_stage(d, &snap("s1"), 200));
        assert!(matches!(
            release_in(&d.join("5.9"), "alice", "5.9", 200),
            Err(JobError::NotFound(_))
        ));
        release_in(&alice, "alice", &name, 200).unwrap();
        assert_eq!(held_by(d, "alice", 300).unwrap(), 0);
        assert_eq!(held_by(d, "bob", 300).unwrap(), 1);
        // A record cut short by a crash is a folder without one: it holds
        // every tree until the sweep removes it, and stops nothing else.
        std::fs::write(bob.join("stage.json"), "{").unwrap();
        assert_eq!(held_by(d, "bob", 300).unwrap(), 0);
        assert!(tree_in_stage(d, &snap("s2"), 300));
    }

    #[test]
    fn a_taken_name_is_never_reused() {
        let dir = tempfile::tempdir().unwrap();
        // Someone made 5.1 first (under another user's job id, say).
        std::fs::create_dir_all(dir.path().join("5.1")).unwrap();
        let (p, name) = new_stage_dir(dir.path(), "5").unwrap().unwrap();
        assert_eq!(name, "5.2");
        assert!(p.is_dir());
        let (_, name) = new_stage_dir(dir.path(), "5").unwrap().unwrap();
        assert_eq!(name, "5.3");
    }
}
