//! A node's persistent state: GPU leases and job records, in one redb file,
//! so a labd restarted after `kill -9` knows what it had leased to whom.
//!
//! Every change is one redb write transaction, and redb serialises write
//! transactions: racing submissions can never be handed the same GPU, and a
//! job's end and the release of its GPUs are one atomic step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use labsync_store::RunAs;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::LeaseError;
use crate::ids::JobId;

/// GPU index → id of the job holding it.
const LEASES: TableDefinition<u32, &str> = TableDefinition::new("leases-v1");
/// Job id → JSON [`JobRecord`].
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs-v1");
/// Ids of the jobs that still need labd's attention (queued, running, or
/// ended with outputs still to save), so the periodic work of a daemon that
/// has run for months reads a handful of records, not its whole history.
const ACTIVE: TableDefinition<&str, ()> = TableDefinition::new("active-v1");
/// Counters that outlive the records they count ([`PRUNED_MAX`]).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta-v1");
/// The highest job number of the records pruned: ids stay above it.
const PRUNED_MAX: &str = "pruned-max";

/// Where a job is in its life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for GPUs.
    Queued,
    /// Started; `sid` is its session (= leader pid).
    Running {
        /// Session id.
        sid: u32,
        /// When the leader started, in clock ticks after boot
        /// (`/proc/PID/stat` field 22): after a restart, a process that
        /// reuses the pid (even another session leader) is not the job.
        /// Absent in records written before it was kept.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start: Option<u64>,
    },
    /// Ended with an exit code (or killed by `signal`).
    Exited {
        /// Exit code, if it exited.
        code: Option<i32>,
        /// Signal that ended it, if any.
        signal: Option<i32>,
    },
    /// Ended without an exit status (e.g. gone when labd restarted).
    Failed {
        /// Why.
        reason: String,
    },
}

/// What labd remembers about a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Job id.
    pub id: JobId,
    /// Who submitted it.
    pub user: String,
    /// The command.
    pub argv: Vec<String>,
    /// GPUs it asked for.
    pub gpus_wanted: u32,
    /// GPUs it holds (while running).
    pub gpus: Vec<u32>,
    /// Where it is.
    pub state: JobState,
    /// When it was submitted, ended (Unix seconds; 0 / `None` in records of older labd).
    #[serde(default)]
    pub submitted_at: u64,
    /// When it started running.
    #[serde(default)]
    pub started_at: Option<u64>,
    /// When it ended.
    #[serde(default)]
    pub ended_at: Option<u64>,
    /// What labd made of it: trees, work folder, outputs.
    #[serde(default)]
    pub meta: JobMeta,
    /// How to start it, kept while it is queued so a restarted labd queues
    /// it again.
    #[serde(default)]
    pub queued: Option<QueuedSpec>,
}

impl JobRecord {
    /// True while labd still has work with it.
    pub fn active(&self) -> bool {
        !matches!(
            self.state,
            JobState::Exited { .. } | JobState::Failed { .. }
        ) || self.meta.outputs_pending
    }
}

/// What a queued job needs to start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedSpec {
    /// The command.
    pub argv: Vec<String>,
    /// Working folder.
    pub cwd: PathBuf,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// Free memory each GPU must have.
    pub min_free_bytes: u64,
    /// Run as uid/gid.
    pub run_as: Option<RunAs>,
}

/// The parts of a job labd (not the engine) keeps: what it runs on and where
/// its outputs went.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobMeta {
    /// The code snapshot, `code/alice/proj@v3`.
    pub code: Option<String>,
    /// The data snapshots, `div2k@v1`.
    pub data: Vec<String>,
    /// The job's working folder.
    pub work: Option<PathBuf>,
    /// Outputs folder, relative to `work`.
    pub outputs: Option<String>,
    /// Seconds between periodic pushes of the outputs.
    pub outputs_every_s: u64,
    /// The last version the outputs were pushed as, with the snapshot it
    /// names: `runs/j3@v2#ID` (what `labsync pull` takes, refusing the
    /// version if its record was rewritten since).
    pub outputs_saved: Option<String>,
    /// Why the last push of the outputs failed.
    pub outputs_error: Option<String>,
    /// True until the final push after the job's end has succeeded (or
    /// found no outputs folder to save).
    pub outputs_pending: bool,
    /// Failed tries of the final push so far; labd keeps trying.
    #[serde(default)]
    pub outputs_failures: u32,
    /// The byte range of the job's log cut out to keep it under `log_max`
    /// (a hole in the file; readers are told, not given zeros).
    #[serde(default)]
    pub log_cut: Option<(u64, u64)>,
    /// Still materialising code and data: what, in words.
    pub preparing: Option<String>,
    /// Snapshot ids of the shared trees it uses (kept while it is active).
    #[serde(default)]
    pub trees: Vec<labsync_store::SnapshotId>,
    /// The uid/gid it runs as, when not labd's own: its outputs are read as them.
    #[serde(default)]
    pub run_as: Option<RunAs>,
    /// A hold (`labrun --hold`) of this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_s: Option<u64>,
    /// Why labd gave a hold's GPUs back early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<String>,
    /// Stopped by the coordinator for a higher tier's job (which): it is
    /// to be requeued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_for: Option<String>,
    /// The pid and start (clock ticks) of the job's log keeper
    /// ([`crate::keeper`]), ended when the job is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_keeper: Option<(u32, Option<u64>)>,
    /// What was submitted, without its command (the record's `argv`) and
    /// environment (the submitter's secrets, as often as not): the code
    /// and data snapshots by id, the resources, the tier it runs at. Its
    /// outputs' versions carry it; `labrun rerun` submits it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<crate::proto::SubmitRequest>,
    /// When the cluster's coordinator sent it to its node (Unix seconds):
    /// set in what the coordinator shows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placed_at: Option<u64>,
    /// A running hold: since when its GPUs have shown no use (Unix ms), at
    /// labd's last look; set in what labd shows, never stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
    /// How long it is expected to run: its limit, kept by its node, or
    /// the coordinator's estimate from its user's earlier runs (set in what
    /// the coordinator shows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<crate::proto::Expected>,
    /// The GPUs it held, kept once it ended (its `gpus` are then given back).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus_held: Vec<u32>,
}

/// `req` as a job's record keeps it ([`JobMeta::request`]).
pub fn recorded(req: &crate::proto::SubmitRequest) -> crate::proto::SubmitRequest {
    crate::proto::SubmitRequest {
        argv: Vec::new(),
        env: Vec::new(),
        notify: Vec::new(),
        ..req.clone()
    }
}

/// Now, in Unix seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The state database of one node.
pub struct Leases {
    db: Database,
    path: PathBuf,
    /// The active records as last committed, so the reads made every tick
    /// and every submission decode no JSON (with a thousand queued jobs,
    /// each carrying its submitter's environment, that was most of labd's
    /// CPU under load). Locked across each write transaction that changes
    /// records, so it changes in commit order.
    active: std::sync::Mutex<BTreeMap<JobId, JobRecord>>,
    /// Unit tests make record writes fail here, as a full or broken disk would.
    #[cfg(test)]
    pub(crate) fail_writes: std::sync::atomic::AtomicBool,
}

/// Opens (creating) the redb database at `path`, readable by its owner
/// only from the first byte: it holds queued jobs' environments (users'
/// API keys). Created by redb it was 0644 until labd narrowed it, and a
/// user who opened it in that window kept reading it.
pub(crate) fn create_private(path: &Path) -> Result<Database, String> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| e.to_string())?;
    let mode = f
        .metadata()
        .map_err(|e| e.to_string())?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| e.to_string())?;
    }
    drop(f);
    Database::create(path).map_err(|e| e.to_string())
}

impl Leases {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<Leases, LeaseError> {
        let db = create_private(path).map_err(|e| LeaseError::Db {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        let leases = Leases {
            db,
            path: path.to_path_buf(),
            active: Default::default(),
            #[cfg(test)]
            fail_writes: Default::default(),
        };
        let mut active = BTreeMap::new();
        // Create the table up front so readers never see "no such table".
        let txn = leases.db.begin_write().map_err(|e| leases.err(e))?;
        txn.open_table(LEASES).map_err(|e| leases.err(e))?;
        txn.open_table(JOBS).map_err(|e| leases.err(e))?;
        txn.open_table(META).map_err(|e| leases.err(e))?;
        {
            // Rebuilt at every start: cheap once, and right after any change of format.
            let jobs = txn.open_table(JOBS).map_err(|e| leases.err(e))?;
            let mut active_ids = txn.open_table(ACTIVE).map_err(|e| leases.err(e))?;
            for r in jobs.iter().map_err(|e| leases.err(e))? {
                let (id, v) = r.map_err(|e| leases.err(e))?;
                let rec: JobRecord =
                    serde_json::from_slice(v.value()).map_err(|e| leases.err(e))?;
                if rec.active() {
                    active_ids
                        .insert(id.value(), ())
                        .map_err(|e| leases.err(e))?;
                    active.insert(rec.id.clone(), rec);
                } else {
                    active_ids.remove(id.value()).map_err(|e| leases.err(e))?;
                }
            }
        }
        txn.commit().map_err(|e| leases.err(e))?;
        *leases.active.lock().expect("leases poisoned") = active;
        Ok(leases)
    }

    fn err(&self, e: impl std::fmt::Display) -> LeaseError {
        LeaseError::Db {
            path: self.path.display().to_string(),
            detail: e.to_string(),
        }
    }

    /// Atomically leases `want` GPUs to `job`, choosing among `free` in order
    /// and skipping any already leased. Returns the GPUs, or `None` (and
    /// leases nothing) when fewer than `want` are available.
    pub fn acquire(
        &self,
        job: &str,
        want: usize,
        free: &[u32],
    ) -> Result<Option<Vec<u32>>, LeaseError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let chosen = {
            let mut t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
            let mut chosen = Vec::with_capacity(want);
            for &g in free {
                if chosen.len() == want {
                    break;
                }
                // Free, or already this job's (a start that was undone
                // and whose lease could not be freed).
                let holder = t.get(g).map_err(|e| self.err(e))?;
                if holder.is_none_or(|h| h.value() == job) {
                    chosen.push(g);
                }
            }
            if chosen.len() < want {
                None
            } else {
                for &g in &chosen {
                    t.insert(g, job).map_err(|e| self.err(e))?;
                }
                Some(chosen)
            }
        };
        match chosen {
            Some(c) => {
                txn.commit().map_err(|e| self.err(e))?;
                Ok(Some(c))
            }
            None => {
                txn.abort().map_err(|e| self.err(e))?;
                Ok(None)
            }
        }
    }

    /// Frees every GPU `job` holds; returns them.
    pub fn release(&self, job: &str) -> Result<Vec<u32>, LeaseError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let freed = self.release_in(&txn, job)?;
        txn.commit().map_err(|e| self.err(e))?;
        Ok(freed)
    }

    fn release_in(&self, txn: &redb::WriteTransaction, job: &str) -> Result<Vec<u32>, LeaseError> {
        let mut t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
        let mine: Vec<u32> = t
            .iter()
            .map_err(|e| self.err(e))?
            .filter_map(|r| r.ok())
            .filter(|(_, j)| j.value() == job)
            .map(|(g, _)| g.value())
            .collect();
        for g in &mine {
            t.remove(*g).map_err(|e| self.err(e))?;
        }
        Ok(mine)
    }

    /// Runs `f` in one write transaction that may change job records
    /// (`f` lists them in its second argument); once committed, the
    /// in-memory mirror of the active ones follows.
    fn write<T>(
        &self,
        f: impl FnOnce(&redb::WriteTransaction, &mut Vec<JobRecord>) -> Result<T, LeaseError>,
    ) -> Result<T, LeaseError> {
        let mut active = self.active.lock().expect("leases poisoned");
        #[cfg(test)]
        if self.fail_writes.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(self.err("injected write failure"));
        }
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let mut written = Vec::new();
        let out = f(&txn, &mut written)?;
        txn.commit().map_err(|e| self.err(e))?;
        for rec in written {
            // Counted once committed, from the state it had: a job's start
            // and its end each once (`/metrics`).
            crate::metrics::NODE_JOBS.changed(
                active.get(&rec.id).map(|r| &r.state),
                &rec.state,
                rec.submitted_at,
                rec.started_at,
                rec.meta.stopped_for.is_some(),
            );
            if rec.active() {
                active.insert(rec.id.clone(), rec);
            } else {
                active.remove(&rec.id);
            }
        }
        Ok(out)
    }

    /// Stores (creates or replaces) a job record.
    pub fn put_job(&self, job: &JobRecord) -> Result<(), LeaseError> {
        self.write(|txn, w| self.write_in(txn, job, w))
    }

    fn write_in(
        &self,
        txn: &redb::WriteTransaction,
        job: &JobRecord,
        written: &mut Vec<JobRecord>,
    ) -> Result<(), LeaseError> {
        let mut t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let json = serde_json::to_vec(job).expect("record serialises");
        t.insert(job.id.as_str(), json.as_slice())
            .map_err(|e| self.err(e))?;
        let mut a = txn.open_table(ACTIVE).map_err(|e| self.err(e))?;
        if job.active() {
            a.insert(job.id.as_str(), ()).map_err(|e| self.err(e))?;
        } else {
            a.remove(job.id.as_str()).map_err(|e| self.err(e))?;
        }
        written.push(job.clone());
        Ok(())
    }

    /// The records of the jobs that are not yet settled (see
    /// [`JobRecord::active`]), by id.
    pub fn active_jobs(&self) -> Result<Vec<JobRecord>, LeaseError> {
        Ok(self.active_where(|_| true))
    }

    /// The active records for which `keep` holds, by id (from memory).
    pub fn active_where(&self, keep: impl Fn(&JobRecord) -> bool) -> Vec<JobRecord> {
        let active = self.active.lock().expect("leases poisoned");
        active.values().filter(|j| keep(j)).cloned().collect()
    }

    /// (job, session, leader start) of every running job (from memory).
    pub fn running(&self) -> Vec<(JobId, u32, Option<u64>)> {
        let active = self.active.lock().expect("leases poisoned");
        active
            .values()
            .filter_map(|j| match j.state {
                JobState::Running { sid, start } => Some((j.id.clone(), sid, start)),
                _ => None,
            })
            .collect()
    }

    /// How many jobs `user` has queued, or running without GPUs (from
    /// memory): what `max_queued_per_user` bounds.
    pub fn queued_of(&self, user: &str) -> usize {
        let active = self.active.lock().expect("leases poisoned");
        active
            .values()
            .filter(|j| j.user == user)
            .filter(|j| match j.state {
                JobState::Queued => true,
                // Those start at once, so leave the queue at once: without
                // them in the count one user could start any number.
                JobState::Running { .. } => j.gpus_wanted == 0,
                _ => false,
            })
            .count()
    }

    /// Changes one job record in one transaction; `None` when there is no such job.
    pub fn update<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut JobRecord) -> T,
    ) -> Result<Option<T>, LeaseError> {
        self.write(|txn, w| {
            Ok(match self.read_in(txn, id)? {
                None => None,
                Some(mut rec) => {
                    let out = f(&mut rec);
                    self.write_in(txn, &rec, w)?;
                    Some(out)
                }
            })
        })
    }

    fn read_in(
        &self,
        txn: &redb::WriteTransaction,
        id: &str,
    ) -> Result<Option<JobRecord>, LeaseError> {
        let t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let v = t.get(id).map_err(|e| self.err(e))?;
        v.map(|v| serde_json::from_slice(v.value()).map_err(|e| self.err(e)))
            .transpose()
    }

    /// One job record.
    pub fn job(&self, id: &str) -> Result<Option<JobRecord>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let v = t.get(id).map_err(|e| self.err(e))?;
        v.map(|v| serde_json::from_slice(v.value()).map_err(|e| self.err(e)))
            .transpose()
    }

    /// Every job record, by id.
    pub fn jobs(&self) -> Result<Vec<JobRecord>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for r in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = r.map_err(|e| self.err(e))?;
            out.push(serde_json::from_slice(v.value()).map_err(|e| self.err(e))?);
        }
        Ok(out)
    }

    /// Removes the records of settled jobs (see [`JobRecord::active`])
    /// that ended before `before` (unix seconds): without it every job
    /// ever run stays, and is read by each `labrun ps` and each start.
    /// Their highest number is kept ([`Leases::pruned_max`]). Returns how
    /// many went.
    pub fn prune_ended(&self, before: u64) -> Result<usize, LeaseError> {
        let old =
            |rec: &JobRecord| !rec.active() && rec.ended_at.unwrap_or(rec.submitted_at) < before;
        // Found under a read transaction, which holds up no writer.
        let ids: Vec<String> = {
            let txn = self.db.begin_read().map_err(|e| self.err(e))?;
            let t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
            let mut ids = Vec::new();
            for r in t.iter().map_err(|e| self.err(e))? {
                let (id, v) = r.map_err(|e| self.err(e))?;
                let rec: JobRecord = serde_json::from_slice(v.value()).map_err(|e| self.err(e))?;
                if old(&rec) {
                    ids.push(id.value().to_string());
                }
            }
            ids
        };
        // A thousand per transaction: the first pass after an upgrade may
        // find years of them, and writes hold up the job tick meanwhile.
        let mut pruned = 0;
        for ids in ids.chunks(1000) {
            pruned += self.prune_these(ids, &old)?;
        }
        Ok(pruned)
    }

    /// Removes the records of `ids` that are still `old`.
    fn prune_these(
        &self,
        ids: &[String],
        old: &dyn Fn(&JobRecord) -> bool,
    ) -> Result<usize, LeaseError> {
        self.write(|txn, _| {
            let mut jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let mut highest =
                (meta.get(PRUNED_MAX).map_err(|e| self.err(e))?).map_or(0, |v| v.value());
            let mut pruned = 0;
            for id in ids {
                // Settled records do not change; read again all the same.
                let rec: Option<JobRecord> = (jobs.get(id.as_str()).map_err(|e| self.err(e))?)
                    .map(|v| serde_json::from_slice(v.value()).map_err(|e| self.err(e)))
                    .transpose()?;
                if !rec.is_some_and(|r| old(&r)) {
                    continue;
                }
                jobs.remove(id.as_str()).map_err(|e| self.err(e))?;
                highest = highest.max(job_number(id).unwrap_or(0));
                pruned += 1;
            }
            meta.insert(PRUNED_MAX, highest).map_err(|e| self.err(e))?;
            Ok(pruned)
        })
    }

    /// The highest job number of the records [`Leases::prune_ended`] removed.
    pub fn pruned_max(&self) -> Result<u64, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(META).map_err(|e| self.err(e))?;
        let v = t.get(PRUNED_MAX).map_err(|e| self.err(e))?;
        Ok(v.map_or(0, |v| v.value()))
    }

    /// Ends a job and frees its GPUs in one transaction, however it ended.
    pub fn finish(&self, id: &str, state: JobState) -> Result<Vec<u32>, LeaseError> {
        self.write(|txn, w| self.finish_in(txn, id, state, w))
    }

    fn finish_in(
        &self,
        txn: &redb::WriteTransaction,
        id: &str,
        state: JobState,
        written: &mut Vec<JobRecord>,
    ) -> Result<Vec<u32>, LeaseError> {
        if let Some(mut rec) = self.read_in(txn, id)? {
            // The first ending recorded is the job's: a second one (a kill
            // racing the reaper) never turns an exit code into a guess.
            if !matches!(rec.state, JobState::Exited { .. } | JobState::Failed { .. }) {
                rec.ended_at = Some(unix_now());
                rec.state = state;
            }
            rec.gpus.clear();
            rec.meta.preparing = None;
            rec.queued = None;
            self.write_in(txn, &rec, written)?;
        }
        self.release_in(txn, id)
    }

    /// After a restart: running jobs whose session is gone are marked failed,
    /// and every lease not held by a running job is freed (a crash between
    /// leasing and starting leaves such leases). Live jobs are adopted as they
    /// are. Returns the ids of the jobs marked failed.
    pub fn reconcile(
        &self,
        alive: impl Fn(u32, Option<u64>) -> bool,
    ) -> Result<Vec<JobId>, LeaseError> {
        let jobs = self.active_jobs()?;
        self.write(|txn, w| self.reconcile_in(txn, &jobs, &alive, w))
    }

    fn reconcile_in(
        &self,
        txn: &redb::WriteTransaction,
        jobs: &[JobRecord],
        alive: &dyn Fn(u32, Option<u64>) -> bool,
        written: &mut Vec<JobRecord>,
    ) -> Result<Vec<JobId>, LeaseError> {
        let mut failed = Vec::new();
        for j in jobs {
            if let JobState::Running { sid, start } = j.state {
                if !alive(sid, start) {
                    let reason = "the job was gone when labd restarted".to_string();
                    self.finish_in(txn, &j.id, JobState::Failed { reason }, written)?;
                    failed.push(j.id.clone());
                }
            }
        }
        let running: std::collections::HashSet<&str> = jobs
            .iter()
            .filter(|j| matches!(j.state, JobState::Running { .. }) && !failed.contains(&j.id))
            .map(|j| j.id.as_str())
            .collect();
        {
            let mut leases = txn.open_table(LEASES).map_err(|e| self.err(e))?;
            let stale: Vec<u32> = leases
                .iter()
                .map_err(|e| self.err(e))?
                .filter_map(|r| r.ok())
                .filter(|(_, j)| !running.contains(j.value()))
                .map(|(g, _)| g.value())
                .collect();
            for g in stale {
                leases.remove(g).map_err(|e| self.err(e))?;
            }
        }
        Ok(failed)
    }

    /// Every current lease.
    pub fn all(&self) -> Result<BTreeMap<u32, String>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
        let mut out = BTreeMap::new();
        for r in t.iter().map_err(|e| self.err(e))? {
            let (g, j) = r.map_err(|e| self.err(e))?;
            out.insert(g.value(), j.value().to_string());
        }
        Ok(out)
    }
}

/// Job numbers are below this: no node runs that many jobs, but a store
/// ref anyone can write may say so.
pub const JOB_NUMBERS: u64 = 1_000_000_000_000;

/// `n` of a job id `j{n}`; numbers from [`JOB_NUMBERS`] on are not ids.
pub fn job_number(id: &str) -> Option<u64> {
    id.strip_prefix('j')?
        .parse()
        .ok()
        .filter(|&n| n < JOB_NUMBERS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Settled jobs that ended before the cut are forgotten, active ones
    /// and recent ones stay, and the highest number forgotten is kept.
    #[test]
    fn old_settled_jobs_are_forgotten_and_their_numbers_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let l = Leases::open(&path).unwrap();
        let put = |id: &str, state: JobState, ended_at: Option<u64>, pending: bool| {
            let mut j = job(id, state, Vec::new());
            j.ended_at = ended_at;
            j.meta.outputs_pending = pending;
            l.put_job(&j).unwrap();
        };
        let exited = || JobState::Exited {
            code: Some(0),
            signal: None,
        };
        put("j7", exited(), Some(100), false);
        put(
            "j3",
            JobState::Failed { reason: "x".into() },
            Some(200),
            false,
        );
        put("j8", exited(), Some(100), true); // its outputs still to save
        put("j9", exited(), Some(5_000), false); // ended after the cut
        put("j10", JobState::Queued, None, false);
        assert_eq!(l.pruned_max().unwrap(), 0);
        assert_eq!(l.prune_ended(1_000).unwrap(), 2);
        let mut left: Vec<JobId> = l.jobs().unwrap().into_iter().map(|j| j.id).collect();
        left.sort();
        assert_eq!(left, ["j10", "j8", "j9"]);
        assert_eq!(l.pruned_max().unwrap(), 7);
        assert_eq!(l.prune_ended(1_000).unwrap(), 0);
        drop(l);
        assert_eq!(Leases::open(&path).unwrap().pruned_max().unwrap(), 7);
    }

    /// Created 0600 from its first byte (redb made it 0644 under the
    /// usual umask), and narrowed when found wider.
    #[test]
    fn the_database_is_never_readable_by_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        drop(Leases::open(&path).unwrap());
        assert_eq!(mode(&path), 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(Leases::open(&path).unwrap());
        assert_eq!(mode(&path), 0o600);
        // The coordinator's holds queued jobs' environments too.
        let q = dir.path().join("cluster.redb");
        drop(crate::cluster::ClusterJobs::open(&q).unwrap());
        assert_eq!(mode(&q), 0o600);
    }

    #[test]
    fn acquire_release_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let l = Leases::open(&path).unwrap();
            assert_eq!(l.acquire("j1", 2, &[0, 1, 2, 3]).unwrap(), Some(vec![0, 1]));
            assert_eq!(
                l.acquire("j2", 3, &[0, 1, 2, 3]).unwrap(),
                None,
                "only two left"
            );
            assert_eq!(l.acquire("j2", 2, &[0, 1, 2, 3]).unwrap(), Some(vec![2, 3]));
        }
        let l = Leases::open(&path).unwrap();
        assert_eq!(l.all().unwrap().len(), 4, "leases survive a restart");
        assert_eq!(l.release("j1").unwrap(), vec![0, 1]);
        assert_eq!(
            l.all().unwrap().values().collect::<Vec<_>>(),
            vec!["j2", "j2"]
        );
    }

    fn job(id: &str, state: JobState, gpus: Vec<u32>) -> JobRecord {
        JobRecord {
            id: id.into(),
            user: "alice".into(),
            argv: vec!["true".into()],
            gpus_wanted: gpus.len() as u32,
            gpus,
            state,
            submitted_at: 0,
            started_at: None,
            ended_at: None,
            meta: JobMeta::default(),
            queued: None,
        }
    }

    #[test]
    fn restart_adopts_live_jobs_and_frees_dead_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let l = Leases::open(&path).unwrap();
            for (id, sid, gpus) in [("live", 100, vec![0]), ("dead", 200, vec![1, 2])] {
                l.acquire(id, gpus.len(), &gpus).unwrap().unwrap();
                l.put_job(&job(id, JobState::Running { sid, start: None }, gpus))
                    .unwrap();
            }
            // Leased, then labd died before the job started.
            l.acquire("never-started", 1, &[3]).unwrap().unwrap();
            l.put_job(&job("never-started", JobState::Queued, vec![]))
                .unwrap();
        } // "kill -9": the handle is dropped, the file stays
        let l = Leases::open(&path).unwrap();
        let failed = l.reconcile(|sid, _| sid == 100).unwrap();
        assert_eq!(failed, vec!["dead".to_string()]);
        assert_eq!(
            l.all().unwrap(),
            BTreeMap::from([(0, "live".to_string())]),
            "only the live job keeps GPUs"
        );
        let jobs = l.jobs().unwrap();
        let dead = jobs.iter().find(|j| j.id == "dead").unwrap();
        assert!(matches!(&dead.state, JobState::Failed { reason } if reason.contains("gone")));
        assert!(dead.gpus.is_empty());
        assert_eq!(
            l.finish(
                "live",
                JobState::Exited {
                    code: Some(0),
                    signal: None
                }
            )
            .unwrap(),
            vec![0]
        );
        assert!(l.all().unwrap().is_empty());
    }

    #[test]
    fn active_jobs_are_the_unsettled_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let l = Leases::open(&path).unwrap();
        let mut pending = job(
            "a",
            JobState::Running {
                sid: 1,
                start: None,
            },
            vec![],
        );
        pending.meta.outputs_pending = true;
        l.put_job(&pending).unwrap();
        l.put_job(&job("b", JobState::Queued, vec![])).unwrap();
        l.finish("b", JobState::Failed { reason: "x".into() })
            .unwrap();
        let ids = |l: &Leases| {
            let mut v: Vec<JobId> = l.active_jobs().unwrap().into_iter().map(|j| j.id).collect();
            v.sort();
            v
        };
        assert_eq!(ids(&l), vec!["a"]);
        l.finish(
            "a",
            JobState::Exited {
                code: Some(0),
                signal: None,
            },
        )
        .unwrap();
        assert_eq!(ids(&l), vec!["a"], "ended, outputs still to save");
        l.update("a", |r| r.meta.outputs_pending = false).unwrap();
        assert!(ids(&l).is_empty());
        drop(l);
        let l = Leases::open(&path).unwrap();
        assert!(ids(&l).is_empty(), "rebuilt the same at open");
        assert_eq!(l.jobs().unwrap().len(), 2, "history is kept");
    }

    /// Issue 9, point 8: the first ending recorded is kept; a second (a
    /// kill racing the reaper) still frees the GPUs but changes nothing else.
    #[test]
    fn a_second_ending_never_replaces_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::open(&dir.path().join("s.redb")).unwrap();
        let running = JobState::Running {
            sid: 1,
            start: None,
        };
        l.put_job(&job("a", running, vec![0])).unwrap();
        assert_eq!(l.acquire("a", 1, &[0]).unwrap(), Some(vec![0]));
        let exited = JobState::Exited {
            code: Some(3),
            signal: None,
        };
        assert_eq!(l.finish("a", exited.clone()).unwrap(), vec![0]);
        let ended_at = l.job("a").unwrap().unwrap().ended_at;
        l.finish(
            "a",
            JobState::Failed {
                reason: "killed".into(),
            },
        )
        .unwrap();
        let rec = l.job("a").unwrap().unwrap();
        assert_eq!(rec.state, exited);
        assert_eq!(rec.ended_at, ended_at);
        assert!(l.all().unwrap().is_empty(), "no lease left");
    }

    #[test]
    fn racing_threads_never_share_a_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let l = Arc::new(Leases::open(&dir.path().join("s.redb")).unwrap());
        let winners: Vec<_> = (0..16)
            .map(|i| {
                let l = l.clone();
                std::thread::spawn(move || {
                    l.acquire(&format!("job{i}"), 1, &[0])
                        .unwrap()
                        .map(|g| (i, g))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "exactly one of 16 racers gets GPU 0: {winners:?}"
        );
        assert_eq!(l.all().unwrap().len(), 1);
    }
}
