//! Housekeeping of the node's disk: shared trees over their cap and the
//! working folders of jobs that ended long ago. Runs at most every few
//! seconds, in a task of its own: removing a big tree must not hold up
//! reaping and scheduling.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::blocking::off_runtime;
use crate::node::Node;
use crate::trees::Trees;

use super::stages;

/// How often housekeeping runs at most.
const EVERY: Duration = Duration::from_secs(5);

pub(crate) struct Housekeeping {
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
    /// When it last ran.
    ran_at: Mutex<Instant>,
    /// A pass is running.
    running: AtomicBool,
}

impl Housekeeping {
    pub fn new(
        node: Arc<Node>,
        trees: Arc<Trees>,
        trees_max: u64,
        jobs_dir: PathBuf,
        stages_dir: PathBuf,
        work_keep: Duration,
    ) -> Housekeeping {
        Housekeeping {
            node,
            trees,
            trees_max,
            jobs_dir,
            stages_dir,
            work_keep,
            ran_at: Mutex::new(Instant::now()),
            running: AtomicBool::new(false),
        }
    }

    /// Starts a pass in the background when one is due and none is running.
    pub fn start_if_due(self: &Arc<Self>) {
        let due = {
            let mut at = self.ran_at.lock().expect("labd poisoned");
            let due = at.elapsed() >= EVERY;
            if due {
                *at = Instant::now();
            }
            due
        };
        if !due || self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(off_runtime(move || {
            let node = me.node.clone();
            let stages = me.stages_dir.clone();
            // Asked under the tree's lock, so read afresh each time: a
            // stage recorded a moment ago holds its trees.
            let in_use = move |snap: &str| {
                // An error reading the state keeps every tree.
                !node
                    .active_where(|j| j.meta.trees.iter().any(|t| t == snap))
                    .is_empty()
                    || stages::tree_in_stage(&stages, snap, crate::leases::unix_now())
            };
            for snap in me.trees.evict(me.trees_max, &in_use) {
                tracing::info!("removed the unused tree of snapshot {snap} (over trees_max)");
            }
            me.sweep_work_folders();
            me.sweep_stages();
            me.running.store(false, Ordering::Release);
        }));
    }

    /// Removes the working folders of jobs that ended (outputs saved) more
    /// than `work_keep` ago: checkpoints are in the store by then, and a
    /// node's disk must not fill with old runs.
    fn sweep_work_folders(&self) {
        let Ok(rd) = std::fs::read_dir(&self.jobs_dir) else {
            return;
        };
        let now = crate::leases::unix_now();
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let old = match self.node.job(&id) {
                Ok(Some(j)) => {
                    !j.active()
                        && j.ended_at
                            .is_some_and(|t| now >= t + self.work_keep.as_secs())
                }
                Ok(None) => true,
                Err(_) => false,
            };
            if old {
                match crate::trees::remove_job_folder(&e.path()) {
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

    /// Removes the folders of stages released more than `work_keep` ago,
    /// or never released within [`stages::STAGE_TTL`], and those left
    /// without a record for an hour (a crash between making and recording).
    fn sweep_stages(&self) {
        let now = crate::leases::unix_now();
        let Ok(recs) = stages::records(&self.stages_dir) else {
            return;
        };
        for (name, rec) in recs {
            let path = self.stages_dir.join(&name);
            let gone = match &rec {
                Some(r) => stages::expired(r, now, self.work_keep),
                None => std::fs::symlink_metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|e| e.as_secs() > 3600)),
            };
            if !gone {
                continue;
            }
            match crate::trees::remove_job_folder(&path) {
                Ok(()) => tracing::info!("removed the folder of stage {name}"),
                Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
            }
        }
    }
}
