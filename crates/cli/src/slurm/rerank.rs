//! The coordinator's re-ranking of labsync's pending Slurm jobs
//! (`[slurm] rerank_s` in its labd.toml): every few seconds, each pending
//! job labrun submitted (its comment says what it reads) is ranked again
//! with Slurm's GPUs and the caches as they are now, and where the nodes
//! to prefer changed, `scontrol update JobId=… Prefer=…` says so. A job
//! that waits while an admin warms its data somewhere then starts there.
//!
//! As at submission, only nodes that can start the job now are preferred:
//! a job no node can take keeps the preference it has.

use std::collections::HashMap;
use std::sync::Arc;

use labsync_agent::proto::{RankAsk, SubmitRequest, TreeRef};
use labsync_agent::Daemon;
use labsync_placer::preferred;

use super::submit::parse_comment;
use super::{feature_of, Slurm};
use crate::labd_config::SlurmRerank;

/// Runs the re-ranking until labd stops.
pub async fn run(daemon: Arc<Daemon>, cfg: SlurmRerank) {
    let slurm = Slurm {
        timeout: cfg.timeout,
        conf: cfg.conf.clone(),
    };
    tracing::info!(
        "re-ranking labsync's pending Slurm jobs every {} s",
        cfg.every.as_secs()
    );
    // What each job was last told to prefer, so unchanged ones are left alone.
    let mut told: HashMap<String, String> = HashMap::new();
    loop {
        tokio::time::sleep(cfg.every).await;
        if let Err(e) = pass(&daemon, &slurm, &cfg, &mut told).await {
            tracing::warn!("re-ranking pending Slurm jobs: {e:#}");
        }
    }
}

/// One pass over the pending jobs.
async fn pass(
    daemon: &Arc<Daemon>,
    slurm: &Slurm,
    cfg: &SlurmRerank,
    told: &mut HashMap<String, String>,
) -> anyhow::Result<()> {
    let args = ["-h", "-t", "PENDING", "-o", "%i|%k"].map(str::to_string);
    let out = slurm.run("squeue", &args, None).await?;
    let pending: Vec<(String, u32, Vec<String>)> = out
        .lines()
        .filter_map(|l| {
            let (id, comment) = l.split_once('|')?;
            let (gpus, snaps) = parse_comment(comment.trim())?;
            let id = super::slurm_id(id.trim()).ok()?;
            Some((id, gpus, snaps))
        })
        .collect();
    told.retain(|id, _| pending.iter().any(|(p, _, _)| p == id));
    if pending.is_empty() {
        return Ok(());
    }
    let nodes = slurm.nodes(cfg.partition.as_deref()).await?;
    let offered: Vec<_> = nodes.iter().filter_map(|n| n.scheduler_node()).collect();
    for (id, gpus, snaps) in pending {
        let tree = |s: &String| TreeRef {
            label: s.clone(),
            snapshot: s.clone(),
        };
        let req = SubmitRequest {
            gpus,
            code: snaps.first().map(tree),
            data: (snaps.iter().skip(1))
                .map(|s| labsync_agent::proto::DataRef {
                    env: "LABRUN_DATA_X".into(),
                    tree: tree(s),
                })
                .collect(),
            ..Default::default()
        };
        let ask = RankAsk {
            req,
            nodes: offered.clone(),
        };
        let ranking = match daemon.rank_for_scheduler(&ask).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("cannot rank pending Slurm job {id}: {e}");
                continue;
            }
        };
        let prefer: Vec<String> = preferred(&ranking, 2.0)
            .into_iter()
            .map(|n| n.to_string())
            .filter(|n| super::has_own_feature(&nodes, n))
            .map(|n| feature_of(&n))
            .collect();
        if prefer.is_empty() {
            continue;
        }
        let list = prefer.join("|");
        if told.get(&id) == Some(&list) {
            continue;
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
            Err(e) => tracing::warn!("cannot re-rank Slurm job {id}: {e:#}"),
        }
    }
    Ok(())
}
