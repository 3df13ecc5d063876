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
//! stage's folder goes after `work_keep`, one never released after
//! [`STAGE_TTL`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::blocking::off_runtime;
use crate::daemon::{Caller, Daemon};
use crate::error::ApiError;
use crate::leases::unix_now;
use crate::proto::{StageDone, StageOrder, Staged};
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
    pub trees: Vec<String>,
    /// Made (Unix seconds).
    pub at: u64,
    /// Released (Unix seconds).
    pub released: Option<u64>,
}

/// A scheduler's job id: 1 to 20 digits (`SLURM_JOB_ID`).
fn check_job_id(job: &str) -> Result<(), ApiError> {
    if job.is_empty() || job.len() > 20 || !job.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::BadRequest(format!(
            "job id {job:?}: a scheduler's job id is digits (SLURM_JOB_ID)"
        )));
    }
    Ok(())
}

/// A stage's name as [`Staged::stage`] gives it: `<job>.<n>`, digits.
fn check_stage_name(stage: &str) -> Result<(), ApiError> {
    match stage.split_once('.') {
        Some((job, n)) if check_job_id(job).is_ok() && check_job_id(n).is_ok() => Ok(()),
        _ => Err(ApiError::BadRequest(format!("no stage {stage:?}"))),
    }
}

/// The stages folder's records, by stage name.
pub(crate) fn records(dir: &Path) -> Vec<(String, StageRecord)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let bytes = std::fs::read(e.path().join("stage.json")).ok()?;
            Some((name, serde_json::from_slice(&bytes).ok()?))
        })
        .collect()
}

fn write_record(stage_dir: &Path, rec: &StageRecord) -> std::io::Result<()> {
    let tmp = stage_dir.join(".stage.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(rec).expect("record serialises"))?;
    std::fs::rename(&tmp, stage_dir.join("stage.json"))
}

/// Whether a stage's trees are still in use at `now`.
pub(crate) fn holds_trees(rec: &StageRecord, now: u64) -> bool {
    rec.released.is_none() && now < rec.at + STAGE_TTL.as_secs()
}

/// Whether a stage's folder may go at `now`.
pub(crate) fn expired(rec: &StageRecord, now: u64, work_keep: Duration) -> bool {
    match rec.released {
        Some(t) => now >= t + work_keep.as_secs(),
        None => now >= rec.at + STAGE_TTL.as_secs(),
    }
}

/// Makes `<dir>/<job>.<n>` for the first `n` free; its path and name.
fn new_stage_dir(dir: &Path, job: &str) -> std::io::Result<(PathBuf, String)> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::create_dir_all(dir)?;
    // Users reach their working folders through it; only labd writes it.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for n in 1..10_000u32 {
        let name = format!("{job}.{n}");
        let path = dir.join(&name);
        match std::fs::DirBuilder::new().mode(0o755).create(&path) {
            Ok(()) => return Ok((path, name)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!(
        "job {job} has been staged 10,000 times here"
    )))
}

impl Daemon {
    /// Where stages live.
    pub(crate) fn stages_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("slurm")
    }

    /// Stages `o` here: records it (its trees now count as in use), pulls
    /// the trees and builds the working folder as the user's.
    pub async fn stage(self: &Arc<Self>, o: StageOrder) -> Result<Staged, ApiError> {
        let ask = &o.ask;
        check_job_id(&ask.job)?;
        if let Some(out) = &ask.outputs {
            check_outputs(out).map_err(ApiError::BadRequest)?;
        }
        super::ops::check_data_vars(&ask.data)?;
        let trees: Vec<_> = ask
            .code
            .iter()
            .chain(ask.data.iter().map(|d| &d.tree))
            .collect();
        for t in &trees {
            t.snapshot
                .parse::<labsync_store::SnapshotId>()
                .map_err(|e| ApiError::BadRequest(format!("{}: {e}", t.label)))?;
        }
        let caller = Caller {
            user: o.user.clone(),
            admin: false,
        };
        let owner = self.run_as(&caller).await?;
        let rec = StageRecord {
            user: o.user.clone(),
            job: ask.job.clone(),
            trees: trees.iter().map(|t| t.snapshot.clone()).collect(),
            at: unix_now(),
            released: None,
        };
        let (dir, job) = (self.stages_dir(), ask.job.clone());
        let (stage_dir, name) = off_runtime(move || {
            let (path, name) = new_stage_dir(&dir, &job)?;
            write_record(&path, &rec)?;
            Ok::<_, std::io::Error>((path, name))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("cannot record the stage: {e}")))?;
        let prepared = async {
            let code = match &ask.code {
                Some(t) => Some(self.trees.get(&self.repo, &self.cache, t).await?),
                None => None,
            };
            let mut data = Vec::new();
            for d in &ask.data {
                data.push((
                    d.env.clone(),
                    self.trees.get(&self.repo, &self.cache, &d.tree).await?,
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
                // Nothing of it is in use: released at once.
                let _ = self.release_stage(&o.user, &name).await;
                Err(ApiError::Conflict(format!(
                    "cannot stage job {} on {}: {}",
                    ask.job,
                    self.cfg.node_name,
                    crate::blocking::chain(&e)
                )))
            }
        }
    }

    /// Releases a stage of `user`'s (its job ended).
    pub async fn stage_done(self: &Arc<Self>, d: StageDone) -> Result<(), ApiError> {
        check_stage_name(&d.stage)?;
        self.release_stage(&d.user, &d.stage).await
    }

    async fn release_stage(&self, user: &str, stage: &str) -> Result<(), ApiError> {
        let dir = self.stages_dir().join(stage);
        let (user, stage) = (user.to_string(), stage.to_string());
        off_runtime(move || {
            let rec: StageRecord = std::fs::read(dir.join("stage.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .ok_or_else(|| ApiError::NotFound(format!("no stage {stage} here")))?;
            if rec.user != user {
                return Err(ApiError::Forbidden(format!(
                    "stage {stage} is {}'s, not {user}'s",
                    rec.user
                )));
            }
            if rec.released.is_none() {
                let rec = StageRecord {
                    released: Some(unix_now()),
                    ..rec
                };
                write_record(&dir, &rec)
                    .map_err(|e| ApiError::Internal(format!("cannot release {stage}: {e}")))?;
            }
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn a_taken_name_is_never_reused() {
        let dir = tempfile::tempdir().unwrap();
        // Someone made 5.1 first (under another user's job id, say).
        std::fs::create_dir_all(dir.path().join("5.1")).unwrap();
        let (p, name) = new_stage_dir(dir.path(), "5").unwrap();
        assert_eq!(name, "5.2");
        assert!(p.is_dir());
        let (_, name) = new_stage_dir(dir.path(), "5").unwrap();
        assert_eq!(name, "5.3");
    }
}
