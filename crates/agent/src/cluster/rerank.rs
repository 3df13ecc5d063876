//! The coordinator's re-ranking of labsync's pending Slurm jobs
//! (`[slurm] rerank_s` in its labd.toml): every few seconds, each pending
//! job labrun submitted (its comment says what it reads) is ranked again
//! with Slurm's GPUs and the caches as they are now, and where the nodes
//! to prefer changed, `scontrol update JobId=… Prefer=…` says so. A job
//! that waits while an admin warms its data somewhere then starts there.
//! It runs inside labd, started beside the ticker, until labd stops.
//!
//! As at submission, only nodes that can start the job now are preferred:
//! a job no node can take keeps the preference it has.

use std::collections::HashMap;
use std::sync::Arc;

use labsync_placer::preferred;

use super::{Coordinator, Reach};
use crate::proto::{DataRef, RankAsk, SnapshotId, SubmitRequest, TreeRef};
use crate::slurm::{feature_of, has_own_feature, job_id, parse_comment, Rerank, Slurm, SlurmError};

/// Whether `out`, squeue's `%k` for one job asked alone, is a single line
/// that reads as the comment labrun writes for (`gpus`, `snaps`).
fn own_comment(out: &str, gpus: u32, snaps: &[SnapshotId]) -> bool {
    let mut lines = out.lines().filter(|l| !l.trim().is_empty());
    match (lines.next(), lines.next()) {
        (Some(l), None) => parse_comment(l.trim()).is_some_and(|(g, s)| g == gpus && s == snaps),
        _ => false,
    }
}

/// The pending jobs labrun submitted, in what `squeue -h -t PENDING -o
/// %i|%k` printed: each one's id, GPUs and snapshots. Lines of other jobs
/// (another comment, or none) are skipped.
pub fn pending(out: &str) -> Vec<(String, u32, Vec<SnapshotId>)> {
    out.lines()
        .filter_map(|l| {
            let (id, comment) = l.split_once('|')?;
            let (gpus, snaps) = parse_comment(comment.trim())?;
            let id = job_id(id.trim())?.to_string();
            Some((id, gpus, snaps))
        })
        .collect()
}

/// The request a pending job's comment stands for: its GPUs, its code and
/// data snapshots (labels are not needed to rank).
fn request(gpus: u32, snaps: &[SnapshotId]) -> SubmitRequest {
    let tree = |s: &SnapshotId| TreeRef {
        label: s.to_string(),
        snapshot: *s,
    };
    SubmitRequest {
        gpus,
        code: snaps.first().map(tree),
        data: (snaps.iter().skip(1))
            .map(|s| DataRef {
                env: "LABRUN_DATA_X".into(),
                tree: tree(s),
            })
            .collect(),
        ..Default::default()
    }
}

/// Runs the re-ranking until `shutdown`.
pub async fn run(
    co: Arc<Coordinator>,
    reach: Reach,
    cfg: Rerank,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let slurm = Slurm::for_labd(cfg.timeout, cfg.conf.clone());
    tracing::info!(
        "re-ranking labsync's pending Slurm jobs every {} s",
        cfg.every.as_secs()
    );
    // What each job was last told to prefer, so unchanged ones are left alone.
    let mut told: HashMap<String, String> = HashMap::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(cfg.every) => {}
            _ = shutdown.changed() => return,
        }
        if let Err(e) = pass(&co, &reach, &slurm, &cfg, &mut told).await {
            tracing::warn!(
                "re-ranking pending Slurm jobs: {}",
                crate::blocking::chain(&e)
            );
        }
    }
}

/// One pass over the pending jobs.
async fn pass(
    co: &Coordinator,
    reach: &Reach,
    slurm: &Slurm,
    cfg: &Rerank,
    told: &mut HashMap<String, String>,
) -> Result<(), SlurmError> {
    let args = ["-h", "-t", "PENDING", "-o", "%i|%k"].map(str::to_string);
    let pending = pending(&slurm.run("squeue", &args, None).await?);
    told.retain(|id, _| pending.iter().any(|(p, _, _)| p == id));
    if pending.is_empty() {
        return Ok(());
    }
    // The preference is the coordinator's own tie (`[lab] tie_s`).
    let tie = co.tie_secs();
    let nodes = slurm.nodes(cfg.partition.as_deref()).await?;
    let offered: Vec<_> = nodes.iter().filter_map(|n| n.scheduler_node()).collect();
    for (id, gpus, snaps) in pending {
        let ask = RankAsk {
            req: request(gpus, &snaps),
            nodes: offered.clone(),
        };
        let ranking = match co.rank_for_scheduler(reach, &ask).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("cannot rank pending Slurm job {id}: {e}");
                continue;
            }
        };
        let prefer: Vec<String> = preferred(&ranking, tie)
            .into_iter()
            .map(|n| n.to_string())
            .filter(|n| has_own_feature(&nodes, n))
            .map(|n| feature_of(&n))
            .collect();
        if prefer.is_empty() {
            continue;
        }
        let list = prefer.join("|");
        if told.get(&id) == Some(&list) {
            continue;
        }
        // The listing's lines are partly users' words: a comment holding a
        // newline can add a line naming another user's pending job. So the
        // job is asked about alone before root changes it.
        let asked = [
            "--noheader".to_string(),
            format!("--jobs={id}"),
            "--format=%k".to_string(),
        ];
        match slurm.run("squeue", &asked, None).await {
            Ok(out) if own_comment(&out, gpus, &snaps) => {}
            Ok(_) => {
                tracing::warn!(
                    "pending Slurm job {id}: its comment is not one labrun wrote (a line of \
                     another job's comment named it?); not re-ranked"
                );
                told.insert(id, list);
                continue;
            }
            Err(e) => {
                tracing::warn!(
                    "cannot check pending Slurm job {id}: {}",
                    crate::blocking::chain(&e)
                );
                continue;
            }
        }
        let update = [
            "update".to_string(),
            format!("JobId={id}"),
            format!("Prefer={list}"),
        ];
        match slurm.run("scontrol", &update, None).await {
            Ok(_) => {
                tracing::info!("pending Slurm job {id} now prefers {list}");
                told.insert(id, list);
            }
            Err(e) => {
                let e = crate::blocking::chain(&e);
                tracing::warn!("cannot re-rank Slurm job {id}: {e}")
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two snapshot ids, and the hex of each as a comment spells it.
    fn two() -> (Vec<SnapshotId>, String, String) {
        let snaps = vec![
            SnapshotId::from_bytes([0xa1; 32]),
            SnapshotId::from_bytes([0xb2; 32]),
        ];
        let (a, b) = (snaps[0].to_string(), snaps[1].to_string());
        (snaps, a, b)
    }

    #[test]
    fn only_a_jobs_own_comment_confirms_a_line_of_the_listing() {
        let (snaps, a, b) = two();
        assert!(own_comment(&format!("labsync:v1:2:{a},{b}\n"), 2, &snaps));
        // Another job's comment, or another request.
        assert!(!own_comment("nightly build\n", 2, &snaps));
        assert!(!own_comment(&format!("labsync:v1:1:{a},{b}\n"), 2, &snaps));
        assert!(!own_comment(&format!("labsync:v1:2:{a}\n"), 2, &snaps));
        // A comment of several lines (it may have planted the line asked
        // about), or none.
        assert!(!own_comment(
            &format!("labsync:v1:2:{a},{b}\n77|labsync:v1:2:{a},{b}\n"),
            2,
            &snaps
        ));
        assert!(!own_comment("", 2, &snaps));
    }

    /// `squeue -h -t PENDING -o %i|%k` as Slurm 22.05 prints it: labrun's
    /// jobs, another user's job without a comment, and one whose comment
    /// only looks like labrun's.
    #[test]
    fn pending_jobs_are_read_from_squeue() {
        let (snaps, a, b) = two();
        let out = format!(
            "41|labsync:v1:1:{a},{b}\n42|(null)\n43|nightly build\n\
             44|labsync:v1:x:{a}\nx;rm|labsync:v1:1:{a}\n45|labsync:v1:0:\n\
             46|labsync:v1:1:aa11\n"
        );
        assert_eq!(
            pending(&out),
            vec![("41".to_string(), 1, snaps), ("45".to_string(), 0, vec![])],
            "46's comment names no snapshot: not labrun's"
        );
        assert!(pending("").is_empty());
    }
}
