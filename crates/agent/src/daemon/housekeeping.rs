//! Housekeeping of the node's disk: shared trees over their cap and the
//! working folders of jobs that ended long ago. Runs at most every few
//! seconds, in a task of its own: removing a big tree must not hold up
//! reaping and scheduling.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::blocking::off_runtime;
use crate::clock::Clock;
use crate::node::Node;
use crate::trees::Trees;

use super::stages;

/// How often housekeeping runs at most.
const EVERY: Duration = Duration::from_secs(5);

/// The shortest an ended job's record stays: a coordinator that lost a
/// dispatch's answer sends it again, and a node must still know the job.
const HISTORY_KEEP_MIN: Duration = Duration::from_secs(7 * 86_400);

/// How long an ended job's record stays: `history_keep`, but never less
/// than its folder (`work_keep`) or [`HISTORY_KEEP_MIN`].
pub(crate) fn kept_for(history_keep: Duration, work_keep: Duration) -> Duration {
    history_keep.max(work_keep).max(HISTORY_KEEP_MIN)
}

/// How often the records of long-ended jobs are looked for.
pub(crate) const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// The longest a folder that could not be removed waits for its next try.
const RETRY_MAX: Duration = Duration::from_secs(3600);

/// Whether a folder whose removal failed `failures` times, the last one
/// `since` ago, is tried again: after 5 s, then twice as long each time up
/// to an hour. A folder its user keeps from going (someone else's files
/// moved into it) must not fill the log with a warning every 5 s.
fn retry_due(failures: u32, since: Duration) -> bool {
    let wait = EVERY
        .checked_mul(1 << failures.saturating_sub(1).min(16))
        .map_or(RETRY_MAX, |w| w.min(RETRY_MAX));
    since >= wait
}

/// An ended job's folder and log stay at least this long, whatever
/// `work_keep`: a follower's last read of the log comes after the end (it
/// was swept under a follower with `work_keep_s = 0`).
const SWEEP_AFTER_AT_LEAST: Duration = Duration::from_secs(5);

pub(crate) struct Housekeeping {
    /// Checked before each pass: a labd whose state folder was replaced
    /// must not sweep the new one.
    lock: Arc<super::StateLock>,
    node: Arc<Node>,
    trees: Arc<Trees>,
    /// Cap on the shared trees, bytes.
    trees_max: u64,
    /// The jobs' folders (`<state>/jobs/<id>`).
    jobs_dir: PathBuf,
    /// The stages of jobs Slurm runs (`<state>/slurm`).
    stages_dir: PathBuf,
    /// How long an ended job's folder stays.
    work_keep: Duration,
    /// How long an ended job's record stays.
    history_keep: Duration,
    /// When old records were last pruned ([`PRUNE_EVERY`]).
    pruned_at: Mutex<Option<Instant>>,
    /// When it last ran.
    ran_at: Mutex<Instant>,
    /// A pass is running.
    running: AtomicBool,
    /// Folders whose removal failed: how often, and when last.
    failed: Mutex<HashMap<PathBuf, (u32, Instant)>>,
    /// What its passes are timed by.
    clock: Clock,
}

/// What housekeeping keeps within bounds, and for how long.
pub(crate) struct Kept {
    /// Cap on the shared trees, bytes.
    pub trees_max: u64,
    /// The jobs' folders (`<state>/jobs/<id>`).
    pub jobs_dir: PathBuf,
    /// The stages of jobs Slurm runs (`<state>/slurm`).
    pub stages_dir: PathBuf,
    /// How long an ended job's folder stays.
    pub work_keep: Duration,
    /// How long an ended job's record stays (at least [`kept_for`]).
    pub history_keep: Duration,
}

impl Housekeeping {
    /// Housekeeping of `trees` and the folders of `kept`, for the jobs of
    /// `node`, while labd holds `lock`, its passes timed by `clock`.
    pub fn new(
        lock: Arc<super::StateLock>,
        node: Arc<Node>,
        trees: Arc<Trees>,
        kept: Kept,
        clock: Clock,
    ) -> Housekeeping {
        Housekeeping {
            lock,
            node,
            trees,
            trees_max: kept.trees_max,
            jobs_dir: kept.jobs_dir,
            stages_dir: kept.stages_dir,
            work_keep: kept.work_keep,
            history_keep: kept_for(kept.history_keep, kept.work_keep),
            pruned_at: Mutex::new(None),
            ran_at: Mutex::new(clock.instant()),
            running: AtomicBool::new(false),
            failed: Mutex::new(HashMap::new()),
            clock,
        }
    }

    /// Starts a pass in the background when one is due and none is running.
    pub fn start_if_due(self: &Arc<Self>) {
        let due = {
            let mut at = self.ran_at.lock().expect("labd poisoned");
            let due = self.clock.since(*at) >= EVERY;
            if due {
                *at = self.clock.instant();
            }
            due
        };
        if !due || self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(off_runtime(move || {
            /// Lets the next pass run however this one ends (a panic in a
            /// removal too: else eviction and sweeping would stop for good).
            struct Idle<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Idle<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let _idle = Idle(&me.running);
            // labd stops on its own within seconds (`labd` checks too).
            if me.lock.lost().is_some() {
                return;
            }
            let node = me.node.clone();
            let stages = me.stages_dir.clone();
            let clock = me.clock.clone();
            // Asked under the tree's lock, so read afresh each time: a
            // stage recorded a moment ago holds its trees.
            let in_use = move |snap: &str| {
                // A folder not named by an id is no job's (nor is a
                // tree named by one in capitals: ids are spelt in lower
                // case).
                let Some(snap) = snap
                    .parse::<labsync_store::SnapshotId>()
                    .ok()
                    .filter(|id| id.to_hex() == snap)
                else {
                    return false;
                };
                // An error reading the state keeps every tree.
                !node
                    .active_where(|j| j.meta.trees.contains(&snap))
                    .is_empty()
                    || stages::tree_in_stage(&stages, &snap, clock.unix_secs())
            };
            for snap in me.trees.evict(me.trees_max, &in_use) {
                tracing::info!("removed the unused tree of snapshot {snap} (over trees_max)");
            }
            // Failures of folders gone since (by other hands) are forgotten.
            (me.failed.lock().expect("labd poisoned")).retain(|dir, _| dir.exists());
            me.sweep_work_folders();
            me.sweep_stages();
            me.prune_records();
        }));
    }

    /// Forgets the records of jobs that ended more than `history_keep`
    /// ago, once per [`PRUNE_EVERY`] (a pass reads every record).
    fn prune_records(&self) {
        {
            let mut at = self.pruned_at.lock().expect("labd poisoned");
            if at.is_some_and(|t| self.clock.since(t) < PRUNE_EVERY) {
                return;
            }
            *at = Some(self.clock.instant());
        }
        let before = self
            .clock
            .unix_secs()
            .saturating_sub(self.history_keep.as_secs());
        match self.node.prune_ended(before) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                "forgot {n} jobs that ended more than {} days ago (history_keep_days)",
                self.history_keep.as_secs() / 86_400
            ),
            Err(e) => tracing::warn!("cannot forget old jobs: {e}"),
        }
    }

    /// Whether a removal of `dir` is due (see [`retry_due`]).
    fn may_try(&self, dir: &Path) -> bool {
        let failed = self.failed.lock().expect("labd poisoned");
        failed
            .get(dir)
            .is_none_or(|(n, at)| retry_due(*n, self.clock.since(*at)))
    }

    /// Removes a job's or stage's folder, remembering a failure.
    fn remove(&self, dir: &Path) -> std::io::Result<()> {
        let done = crate::trees::remove_job_folder(dir);
        let mut failed = self.failed.lock().expect("labd poisoned");
        match &done {
            Ok(()) => {
                failed.remove(dir);
            }
            Err(_) => {
                let n = failed.get(dir).map_or(0, |(n, _)| *n);
                failed.insert(dir.to_path_buf(), (n + 1, self.clock.instant()));
            }
        }
        done
    }

    /// Removes the working folders of jobs that ended (outputs saved) more
    /// than `work_keep` ago: checkpoints are in the store by then, and a
    /// node's disk must not fill with old runs.
    fn sweep_work_folders(&self) {
        let Ok(rd) = std::fs::read_dir(&self.jobs_dir) else {
            return;
        };
        let now = self.clock.unix_secs();
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let old = match self.node.job(&id) {
                Ok(Some(j)) => {
                    let keep = self.work_keep.max(SWEEP_AFTER_AT_LEAST).as_secs();
                    !j.active() && j.ended_at.is_some_and(|t| now >= t.saturating_add(keep))
                }
                Ok(None) => true,
                Err(_) => false,
            };
            if old && self.may_try(&e.path()) {
                match self.remove(&e.path()) {
                    Ok(()) => tracing::info!("removed the working folder and log of job {id}"),
                    Err(err) => {
                        // The log stays with the folder it tells of.
                        tracing::warn!("cannot remove {}: {err}", e.path().display());
                        continue;
                    }
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

    /// Removes the folders of stages released more than `work_keep` ago,
    /// or never released within [`stages::STAGE_TTL`], and those left
    /// without a record for an hour (a crash between making and recording).
    fn sweep_stages(&self) {
        let now = self.clock.unix_secs();
        let Ok(recs) = stages::records(&self.stages_dir) else {
            return;
        };
        for (name, rec) in recs {
            let path = self.stages_dir.join(&name);
            let gone = match &rec {
                Some(r) => stages::expired(r, now, self.work_keep),
                None => std::fs::symlink_metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| {
                        let at = t
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs());
                        now.saturating_sub(at) > 3600
                    }),
            };
            if !gone || !self.may_try(&path) {
                continue;
            }
            match self.remove(&path) {
                Ok(()) => tracing::info!("removed the folder of stage {name}"),
                Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_that_cannot_go_is_tried_less_and_less_often() {
        let s = Duration::from_secs;
        assert!(!retry_due(1, s(4)) && retry_due(1, s(5)));
        assert!(!retry_due(2, s(9)) && retry_due(2, s(10)));
        assert!(!retry_due(5, s(79)) && retry_due(5, s(80)));
        // Never more than an hour apart, however many failures.
        assert!(!retry_due(40, s(3599)) && retry_due(40, s(3600)));
    }
}
