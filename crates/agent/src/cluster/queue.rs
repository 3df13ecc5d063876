//! The coordinator's jobs, kept in a redb database (`cluster-v1.redb` in
//! its state folder) so `kill -9` of the coordinator loses none: each job
//! is queued, dispatched to a node (confirmed once its agent leased the
//! GPUs), or ended. A job is written as dispatched *before* it is sent, so
//! after a crash it is sent again to the same node (agents take a dispatch
//! they already have as a no-op), never placed a second time elsewhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::LeaseError;
use crate::ids::JobId;
use crate::proto::{JobView, NodeName, SubmitRequest};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("cluster-jobs-v1");
const META: TableDefinition<&str, u64> = TableDefinition::new("cluster-meta-v1");
/// Each user's fair-share usage: decayed GPU-seconds as of a Unix
/// millisecond.
const USAGE: TableDefinition<&str, (f64, u64)> = TableDefinition::new("cluster-usage-v1");
/// The lab's rules as admins changed them (`labrun admin`), in order:
/// number → [`crate::proto::AdminRecord`] as JSON.
const ADMIN: TableDefinition<u64, &[u8]> = TableDefinition::new("cluster-admin-v1");

/// Where a job of the cluster is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "placement", rename_all = "snake_case")]
pub enum Placement {
    /// Waiting for a node; `why` from the last scheduling pass.
    Queued {
        /// Why it waits.
        why: Option<String>,
    },
    /// Sent to `node` with `gpus`; `confirmed` once the agent answered.
    Dispatched {
        /// The node.
        node: NodeName,
        /// Its GPUs there.
        gpus: Vec<u32>,
        /// When it was sent, Unix seconds.
        at: u64,
        /// The agent took it.
        confirmed: bool,
        /// The placer's estimate of its staging there (fetching what the
        /// node lacks), milliseconds; `/metrics` sets the actual beside it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        est_ms: Option<u64>,
    },
    /// Over: its last record (from its node, or made here for a job killed
    /// while queued or that no node can run).
    Ended {
        /// The record.
        view: Box<JobView>,
    },
}

/// One job of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterJob {
    /// `j<N>`, unique in the cluster (outputs go to `runs/<id>`).
    pub id: JobId,
    /// Who submitted it.
    pub user: String,
    /// What was submitted (its environment included: the database is the
    /// coordinator's alone, mode 600).
    pub req: SubmitRequest,
    /// Unix seconds.
    pub submitted_at: u64,
    /// Where it is.
    pub placement: Placement,
    /// Told to stop for a higher tier's job (why): requeued once it ended
    /// if its node stopped it for that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted: Option<String>,
    /// When the stop was last sent (Unix seconds).
    #[serde(default)]
    pub preempted_at: u64,
    /// Its GPU time is charged to its user's fair share up to then (Unix
    /// seconds), while it runs and at its end.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub charged_to: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ClusterJob {
    /// The number of its id, for ordering.
    pub fn number(&self) -> u64 {
        crate::node::job_number(&self.id).unwrap_or(u64::MAX)
    }
}

/// Why `user`, with `queued` jobs queued, may queue no more.
pub fn too_many(user: &str, queued: usize) -> String {
    format!(
        "{user} has {queued} jobs queued or running without GPUs, the most one user may \
         (max_queued_per_user); wait for some to start or end, or kill some"
    )
}

/// Whether `j` counts against its user's `max_queued_per_user`: queued,
/// or running without GPUs. Those start at once and so leave the queue,
/// and no GPU cap bounds them: without this a user could run any number.
fn counted(j: &ClusterJob, user: &str) -> bool {
    j.user == user
        && match &j.placement {
            Placement::Queued { .. } => true,
            Placement::Dispatched { .. } => j.req.gpus == 0,
            Placement::Ended { .. } => false,
        }
}

/// Counts a live job's placement (once its node took it) and its end for
/// `/metrics`, once each:
/// `before` is the job as the live map held it (an ended job is no longer
/// there, so writing it again counts nothing).
fn count(before: Option<&ClusterJob>, after: &ClusterJob) {
    let Some(before) = before else { return };
    let stats = &crate::metrics::CLUSTER_JOBS;
    match (&before.placement, &after.placement) {
        // Counted once its node took it: a dispatch refused or gone stale
        // is queued again and sent again, and that is one placement.
        (
            Placement::Dispatched {
                confirmed: false, ..
            },
            Placement::Dispatched {
                confirmed: true,
                at,
                ..
            },
        ) => stats.started(at.saturating_sub(after.submitted_at)),
        (Placement::Ended { .. }, _)
        | (_, Placement::Queued { .. } | Placement::Dispatched { .. }) => {}
        (before, Placement::Ended { view }) => {
            if let Some(o) = crate::metrics::outcome(&view.state, after.preempted.is_some()) {
                stats.ended(o)
            }
            // Its staging, estimated at placement and as it went: from its
            // dispatch to its start on the node.
            if let (
                Placement::Dispatched {
                    at,
                    est_ms: Some(est),
                    ..
                },
                Some(started),
            ) = (before, view.started_at)
            {
                let actual = started.saturating_sub(*at) as f64;
                crate::metrics::STAGING.staged(*est as f64 / 1000.0, actual);
            }
        }
    }
}

/// How long an ended job stays in `labrun ps`'s default listing.
pub const RECENT_SECS: u64 = 86_400;

/// The coordinator's job database, with every job not ended, and those
/// ended in the last [`RECENT_SECS`], in memory: `labrun ps` reads no
/// record from the disk, however long the history.
pub struct ClusterJobs {
    db: Database,
    path: PathBuf,
    /// Jobs not ended, by number: the queue in order.
    live: Mutex<BTreeMap<u64, ClusterJob>>,
    /// Jobs ended lately, by number (pruned as they age).
    recent: Mutex<BTreeMap<u64, ClusterJob>>,
}

/// Whether an ended job ended at or after `since` (one with no end time
/// counts as recent).
fn ended_after(job: &ClusterJob, since: u64) -> bool {
    match &job.placement {
        Placement::Ended { view } => view.ended_at.is_none_or(|t| t >= since),
        _ => false,
    }
}

impl ClusterJobs {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<ClusterJobs, LeaseError> {
        let err = |e: &dyn std::fmt::Display| LeaseError::Db {
            path: path.display().to_string(),
            detail: e.to_string(),
        };
        let db = crate::leases::create_private(path).map_err(|e| err(&e))?;
        let txn = db.begin_write().map_err(|e| err(&e))?;
        let mut live = BTreeMap::new();
        let mut recent = BTreeMap::new();
        let day_ago = crate::leases::unix_now().saturating_sub(RECENT_SECS);
        {
            let jobs = txn.open_table(JOBS).map_err(|e| err(&e))?;
            txn.open_table(META).map_err(|e| err(&e))?;
            txn.open_table(USAGE).map_err(|e| err(&e))?;
            txn.open_table(ADMIN).map_err(|e| err(&e))?;
            for r in jobs.iter().map_err(|e| err(&e))? {
                let (_, v) = r.map_err(|e| err(&e))?;
                let job: ClusterJob = serde_json::from_slice(v.value()).map_err(|e| err(&e))?;
                if !matches!(job.placement, Placement::Ended { .. }) {
                    live.insert(job.number(), job);
                } else if ended_after(&job, day_ago) {
                    recent.insert(job.number(), job);
                }
            }
        }
        txn.commit().map_err(|e| err(&e))?;
        Ok(ClusterJobs {
            db,
            path: path.to_path_buf(),
            live: Mutex::new(live),
            recent: Mutex::new(recent),
        })
    }

    /// Every user's saved usage: (user, decayed GPU-seconds, as of).
    pub fn usage(&self) -> Result<Vec<(String, f64, u64)>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(USAGE).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for r in t.iter().map_err(|e| self.err(e))? {
            let (k, v) = r.map_err(|e| self.err(e))?;
            let (gpu_secs, at) = v.value();
            out.push((k.value().to_string(), gpu_secs, at));
        }
        Ok(out)
    }

    /// Saves one user's usage.
    pub fn put_usage(&self, user: &str, gpu_secs: f64, at: u64) -> Result<(), LeaseError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut t = txn.open_table(USAGE).map_err(|e| self.err(e))?;
            t.insert(user, (gpu_secs, at)).map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))
    }

    fn err(&self, e: impl std::fmt::Display) -> LeaseError {
        LeaseError::Db {
            path: self.path.display().to_string(),
            detail: e.to_string(),
        }
    }

    /// Records a new job under the next free number above `floor` and
    /// returns it.
    pub fn create(
        &self,
        user: &str,
        req: SubmitRequest,
        now: u64,
        floor: u64,
    ) -> Result<ClusterJob, LeaseError> {
        self.create_queued(user, req, now, floor, usize::MAX)
    }

    /// [`ClusterJobs::create`], refused ([`LeaseError::TooMany`]) when
    /// `user` has `max_queued` jobs queued: counted under the lock the
    /// record is made under, so submissions at once cannot all slip in.
    pub fn create_queued(
        &self,
        user: &str,
        req: SubmitRequest,
        now: u64,
        floor: u64,
        max_queued: usize,
    ) -> Result<ClusterJob, LeaseError> {
        let mut live = self.live.lock().expect("jobs poisoned");
        let queued = live.values().filter(|j| counted(j, user)).count();
        if queued >= max_queued {
            return Err(LeaseError::TooMany(too_many(user, queued)));
        }
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        let job = {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let mut jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
            let mut n = meta
                .get("next")
                .map_err(|e| self.err(e))?
                .map_or(1, |v| v.value())
                .max(floor);
            while jobs
                .get(format!("j{n}").as_str())
                .map_err(|e| self.err(e))?
                .is_some()
            {
                n += 1;
            }
            // Never an id that is not one: all such jobs would be one.
            if n >= crate::node::JOB_NUMBERS {
                return Err(self.err("job ids exhausted"));
            }
            meta.insert("next", n + 1).map_err(|e| self.err(e))?;
            let job = ClusterJob {
                id: JobId::numbered(n),
                user: user.to_string(),
                req,
                submitted_at: now,
                placement: Placement::Queued { why: None },
                preempted: None,
                preempted_at: 0,
                charged_to: 0,
            };
            let bytes = serde_json::to_vec(&job).expect("job serialises");
            jobs.insert(job.id.as_str(), bytes.as_slice())
                .map_err(|e| self.err(e))?;
            job
        };
        txn.commit().map_err(|e| self.err(e))?;
        live.insert(job.number(), job.clone());
        Ok(job)
    }

    /// Writes a job's new placement.
    pub fn put(&self, job: &ClusterJob) -> Result<(), LeaseError> {
        let mut live = self.live.lock().expect("jobs poisoned");
        self.put_locked(&mut live, job)
    }

    /// [`ClusterJobs::put`] under the caller's hold of the live map, so a
    /// read-modify-write is one step.
    fn put_locked(
        &self,
        live: &mut BTreeMap<u64, ClusterJob>,
        job: &ClusterJob,
    ) -> Result<(), LeaseError> {
        // An ended job's environment (its submitter's tokens and keys, as
        // often as not) is needed no more: neither kept nor listed.
        let ended;
        let job = if matches!(job.placement, Placement::Ended { .. }) && !job.req.env.is_empty() {
            ended = ClusterJob {
                req: SubmitRequest {
                    env: Vec::new(),
                    ..job.req.clone()
                },
                ..job.clone()
            };
            &ended
        } else {
            job
        };
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
            let bytes = serde_json::to_vec(job).expect("job serialises");
            jobs.insert(job.id.as_str(), bytes.as_slice())
                .map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))?;
        count(live.get(&job.number()), job);
        if matches!(job.placement, Placement::Ended { .. }) {
            live.remove(&job.number());
            (self.recent.lock().expect("jobs poisoned")).insert(job.number(), job.clone());
        } else {
            live.insert(job.number(), job.clone());
        }
        Ok(())
    }

    /// Changes a live job under the lock (`f` returns false to write
    /// nothing); the job after, or `None` when it is not live.
    pub fn update(
        &self,
        id: &str,
        f: impl FnOnce(&mut ClusterJob) -> bool,
    ) -> Result<Option<ClusterJob>, LeaseError> {
        let Some(n) = crate::node::job_number(id) else {
            return Ok(None);
        };
        let mut live = self.live.lock().expect("jobs poisoned");
        let mut job = match live.get(&n) {
            Some(j) => j.clone(),
            None => return Ok(None),
        };
        if f(&mut job) {
            self.put_locked(&mut live, &job)?;
        }
        Ok(Some(job))
    }

    /// Every live job, oldest first.
    pub fn live(&self) -> Vec<ClusterJob> {
        self.live
            .lock()
            .expect("jobs poisoned")
            .values()
            .cloned()
            .collect()
    }

    /// Live jobs of `user` that count against `max_queued_per_user`:
    /// queued, or running without GPUs.
    pub fn queued_of(&self, user: &str) -> usize {
        self.live
            .lock()
            .expect("jobs poisoned")
            .values()
            .filter(|j| counted(j, user))
            .count()
    }

    /// One job, live or ended.
    pub fn get(&self, id: &str) -> Result<Option<ClusterJob>, LeaseError> {
        if let Some(n) = crate::node::job_number(id) {
            if let Some(j) = self.live.lock().expect("jobs poisoned").get(&n) {
                return Ok(Some(j.clone()));
            }
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        match jobs.get(id).map_err(|e| self.err(e))? {
            Some(v) => Ok(Some(
                serde_json::from_slice(v.value()).map_err(|e| self.err(e))?,
            )),
            None => Ok(None),
        }
    }

    /// Ended jobs that ended at or after `since`, which is at most
    /// [`RECENT_SECS`] ago (older ones have left memory: [`Self::ended`]).
    pub fn ended_since(&self, since: u64) -> Vec<ClusterJob> {
        let mut recent = self.recent.lock().expect("jobs poisoned");
        let day_ago = crate::leases::unix_now().saturating_sub(RECENT_SECS);
        recent.retain(|_, j| ended_after(j, day_ago));
        recent
            .values()
            .filter(|j| ended_after(j, since))
            .cloned()
            .collect()
    }

    /// Removes the records of jobs that ended before `before` (unix
    /// seconds) with nothing left to save, a thousand per transaction;
    /// returns how many. Their ids are never given again (`next`).
    pub fn prune_ended(&self, before: u64) -> Result<usize, LeaseError> {
        let old = |job: &ClusterJob| match &job.placement {
            Placement::Ended { view } => {
                !view.meta.outputs_pending && view.ended_at.unwrap_or(job.submitted_at) < before
            }
            _ => false,
        };
        let ids: Vec<JobId> = (self.ended()?.into_iter())
            .filter(|j| old(j))
            .map(|j| j.id)
            .collect();
        let mut pruned = 0;
        for ids in ids.chunks(1000) {
            let txn = self.db.begin_write().map_err(|e| self.err(e))?;
            {
                let mut jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
                for id in ids {
                    let job: Option<ClusterJob> =
                        (jobs.get(id.as_str()).map_err(|e| self.err(e))?)
                            .map(|v| serde_json::from_slice(v.value()).map_err(|e| self.err(e)))
                            .transpose()?;
                    if job.is_some_and(|j| old(&j)) {
                        jobs.remove(id.as_str()).map_err(|e| self.err(e))?;
                        pruned += 1;
                    }
                }
            }
            txn.commit().map_err(|e| self.err(e))?;
        }
        Ok(pruned)
    }

    /// Every ended job, from the database (history pages).
    /// Every change admins made to the lab's rules, oldest first.
    pub fn admin_log(&self) -> Result<Vec<crate::proto::AdminRecord>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(ADMIN).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for r in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = r.map_err(|e| self.err(e))?;
            out.push(serde_json::from_slice(v.value()).map_err(|e| self.err(e))?);
        }
        Ok(out)
    }

    /// Keeps one more change to the lab's rules, after the others.
    pub fn put_admin(&self, rec: &crate::proto::AdminRecord) -> Result<(), LeaseError> {
        let bytes = serde_json::to_vec(rec).map_err(|e| self.err(e))?;
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut t = txn.open_table(ADMIN).map_err(|e| self.err(e))?;
            let next = match t.last().map_err(|e| self.err(e))? {
                Some((k, _)) => k.value() + 1,
                None => 0,
            };
            t.insert(next, bytes.as_slice()).map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))
    }

    /// Every ended job kept, any order.
    pub fn ended(&self) -> Result<Vec<ClusterJob>, LeaseError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let jobs = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for r in jobs.iter().map_err(|e| self.err(e))? {
            let (_, v) = r.map_err(|e| self.err(e))?;
            let job: ClusterJob = serde_json::from_slice(v.value()).map_err(|e| self.err(e))?;
            if matches!(job.placement, Placement::Ended { .. }) {
                out.push(job);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> SubmitRequest {
        SubmitRequest {
            argv: vec!["true".into()],
            env: vec![("WANDB_API_KEY".into(), "secret".into())],
            gpus: 1,
            ..Default::default()
        }
    }

    /// Issue 42, point 6: a record whose node name does not parse (only a
    /// hand or a disk could write one: names are checked when a node joins)
    /// is an error naming it when the coordinator opens its jobs, not a
    /// job dropped from the placer's view.
    #[test]
    fn a_record_naming_no_node_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        {
            let db = ClusterJobs::open(&path).unwrap();
            let j = db.create("alice", req(), 1, 0).unwrap();
            db.update(&j.id, |x| {
                x.placement = Placement::Dispatched {
                    node: "gpu2".parse().unwrap(),
                    gpus: vec![0],
                    at: 1,
                    confirmed: true,
                    est_ms: None,
                };
                true
            })
            .unwrap();
            let txn = db.db.begin_write().unwrap();
            {
                let mut t = txn.open_table(JOBS).unwrap();
                let v = t.get(j.id.as_str()).unwrap().unwrap().value().to_vec();
                let bad = String::from_utf8(v)
                    .unwrap()
                    .replace("\"gpu2\"", "\"no/such node\"");
                t.insert(j.id.as_str(), bad.as_bytes()).unwrap();
            }
            txn.commit().unwrap();
        }
        let Err(e) = ClusterJobs::open(&path) else {
            panic!("a record naming no node was read");
        };
        let e = e.to_string();
        assert!(
            e.contains("\"no/such node\" is not a node name") && e.contains("c.redb"),
            "{e}"
        );
    }

    fn ended(db: &ClusterJobs, ended_at: Option<u64>) -> ClusterJob {
        let mut j = db.create("alice", req(), 1, 0).unwrap();
        let view = crate::proto::JobView {
            id: j.id.clone(),
            node: None,
            user: j.user.clone(),
            argv: vec!["true".into()],
            gpus_wanted: 1,
            gpus: vec![],
            state: crate::leases::JobState::Failed {
                reason: "killed".into(),
            },
            why: None,
            submitted_at: 1,
            started_at: None,
            ended_at,
            meta: Default::default(),
        };
        j.placement = Placement::Ended {
            view: Box::new(view),
        };
        db.put(&j).unwrap();
        j
    }

    /// Jobs ended before the cut go, with nothing left to save; queued
    /// and recent ones stay, and ids are never given twice.
    #[test]
    fn old_ended_jobs_are_forgotten_and_ids_stay_unique() {
        let dir = tempfile::tempdir().unwrap();
        let db = ClusterJobs::open(&dir.path().join("c.redb")).unwrap();
        let gone = ended(&db, Some(100));
        let mut saving = ended(&db, Some(100));
        if let Placement::Ended { view } = &mut saving.placement {
            view.meta.outputs_pending = true;
        }
        db.put(&saving).unwrap();
        let recent = ended(&db, Some(5_000));
        let queued = db.create("alice", req(), 1, 0).unwrap();
        assert_eq!(db.prune_ended(1_000).unwrap(), 1);
        let mut left: Vec<JobId> = db.ended().unwrap().into_iter().map(|j| j.id).collect();
        left.sort();
        let mut want = vec![saving.id.clone(), recent.id.clone()];
        want.sort();
        assert_eq!(left, want);
        assert!(db.get(&gone.id).unwrap().is_none());
        assert!(db.get(&queued.id).unwrap().is_some());
        assert_eq!(db.prune_ended(1_000).unwrap(), 0);
        let next = db.create("alice", req(), 1, 0).unwrap();
        assert!(
            next.number() > queued.number(),
            "{} then {}",
            queued.id,
            next.id
        );
    }

    #[test]
    fn usage_is_kept_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        {
            let db = ClusterJobs::open(&path).unwrap();
            assert!(db.usage().unwrap().is_empty());
            db.put_usage("alice", 7200.0, 1_000).unwrap();
            db.put_usage("alice", 3600.5, 2_000).unwrap();
            db.put_usage("bob", 60.0, 3_000).unwrap();
        }
        let db = ClusterJobs::open(&path).unwrap();
        let mut u = db.usage().unwrap();
        u.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            u,
            [
                ("alice".to_string(), 3600.5, 2_000),
                ("bob".to_string(), 60.0, 3_000)
            ]
        );
    }

    #[test]
    fn recently_ended_jobs_are_listed_from_memory_and_old_ones_only_in_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster-v1.redb");
        let now = crate::leases::unix_now();
        let (fresh, old) = {
            let db = ClusterJobs::open(&path).unwrap();
            let fresh = ended(&db, Some(now));
            let old = ended(&db, Some(now - RECENT_SECS - 10));
            let ids: Vec<JobId> = db
                .ended_since(now - RECENT_SECS)
                .into_iter()
                .map(|j| j.id)
                .collect();
            assert_eq!(ids, vec![fresh.id.clone()]);
            assert!(db.live().is_empty());
            (fresh, old)
        };
        let db = ClusterJobs::open(&path).unwrap();
        let ids: Vec<JobId> = db
            .ended_since(now - RECENT_SECS)
            .into_iter()
            .map(|j| j.id)
            .collect();
        assert_eq!(ids, vec![fresh.id.clone()], "loaded again at open");
        let ended = db.ended().unwrap();
        assert!(
            ended.iter().all(|j| j.req.env.is_empty()),
            "an ended job's environment is kept"
        );
        assert!(db
            .ended_since(now - RECENT_SECS)
            .iter()
            .all(|j| j.req.env.is_empty()));
        let mut all: Vec<JobId> = ended.into_iter().map(|j| j.id).collect();
        all.sort();
        assert_eq!(all, vec![fresh.id, old.id]);
    }

    #[test]
    fn jobs_survive_a_reopen_and_numbers_never_repeat() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster-v1.redb");
        let (a, b) = {
            let db = ClusterJobs::open(&path).unwrap();
            let a = db.create("alice", req(), 10, 0).unwrap();
            let mut b = db.create("bob", req(), 11, 0).unwrap();
            b.placement = Placement::Dispatched {
                node: "gpu2".parse().unwrap(),
                gpus: vec![1],
                at: 12,
                confirmed: false,
                est_ms: None,
            };
            db.put(&b).unwrap();
            (a, b)
        };
        assert_eq!((a.id.as_str(), b.id.as_str()), ("j1", "j2"));
        let db = ClusterJobs::open(&path).unwrap();
        let live = db.live();
        assert_eq!(live.len(), 2);
        assert_eq!(live[1].placement, b.placement);
        assert_eq!(db.queued_of("alice"), 1);
        // A job running without GPUs counts (it left the queue at once, and
        // no GPU cap bounds it); one running on GPUs does not.
        assert_eq!(db.queued_of("bob"), 0);
        let mut cpu = db
            .create("bob", SubmitRequest { gpus: 0, ..req() }, 13, 0)
            .unwrap();
        cpu.placement = Placement::Dispatched {
            node: "gpu2".parse().unwrap(),
            gpus: vec![],
            at: 13,
            confirmed: true,
            est_ms: None,
        };
        db.put(&cpu).unwrap();
        assert_eq!(db.queued_of("bob"), 1);
        let e = db.create_queued("bob", req(), 13, 0, 1).unwrap_err();
        assert!(
            matches!(&e, LeaseError::TooMany(m) if m.contains("queued or running without GPUs")),
            "{e}"
        );
        // Above the floor (the highest runs/ in the store), never a number used.
        assert_eq!(db.create("alice", req(), 13, 0).unwrap().id, "j4");
        assert_eq!(db.create("alice", req(), 13, 40).unwrap().id, "j40");
        assert_eq!(db.create("alice", req(), 13, 0).unwrap().id, "j41");
        // The last id there is, then none: never one every job would share.
        let last = crate::node::JOB_NUMBERS - 1;
        assert_eq!(
            db.create("alice", req(), 13, last).unwrap().id,
            format!("j{last}")
        );
        let e = db.create("alice", req(), 13, 0).unwrap_err();
        assert!(e.to_string().contains("job ids exhausted"), "{e}");
        // alice has 5 queued (bob's is dispatched): a limit of 5 is full.
        let e = db.create_queued("alice", req(), 13, 0, 5).unwrap_err();
        assert!(
            matches!(&e, LeaseError::TooMany(m) if m.contains("alice has 5 jobs queued")),
            "{e}"
        );
        assert_eq!(db.live().len(), 7);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o077, 0, "holds environments: {mode:o}");
    }
}
