//! `labrun status`: the node's GPUs and who holds them.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::{Client, GpuState, JobState};

use super::explain;

/// Every GPU of the node: free, leased (job, user), used by a foreign process, unknown.
pub async fn status(client: &Client, json: bool) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain)?;
    let gpus = client.gpus().await.map_err(explain)?;
    let jobs = client.jobs().await.map_err(explain)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"node": info.node, "inventory": info.inventory, "gpus": gpus})
            )?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let owner: HashMap<&str, &str> = jobs
        .iter()
        .map(|j| (j.id.as_str(), j.user.as_str()))
        .collect();
    println!("{} — GPUs from {}", info.node, info.inventory);
    if gpus.is_empty() {
        println!("  no GPUs on this node: jobs run with --gpus 0");
    }
    for g in &gpus {
        let hw = match &g.info {
            Some(i) => format!(
                "{:<22} {:>9} / {:<9} used",
                i.name,
                gib(i.memory_used),
                gib(i.memory_total)
            ),
            None => format!("{:<22} {:>21}", "?", "?"),
        };
        let procs = |ps: &[labsync_agent::ForeignProcess]| {
            ps.iter()
                .map(|p| {
                    let who = match &p.job {
                        Some(j) => format!("{j} outside its lease"),
                        None => p.user.as_deref().unwrap_or("?").to_string(),
                    };
                    format!(
                        "pid {} ({who}, {})",
                        p.pid,
                        p.used_bytes
                            .map_or("? MiB".into(), |b| format!("{} MiB", b >> 20))
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let state = match &g.state {
            GpuState::Free => "free".to_string(),
            GpuState::Leased { job, others } => {
                let mut s = format!(
                    "leased to {job} ({})",
                    owner.get(job.as_str()).copied().unwrap_or("?")
                );
                if !others.is_empty() {
                    s += &format!("; ALSO USED BY: {}", procs(others));
                }
                s
            }
            GpuState::Foreign { processes } => format!("FOREIGN: {}", procs(processes)),
            GpuState::Unknown { reason } => format!("UNKNOWN (never leased): {reason}"),
        };
        println!("  GPU {:<2} {hw}  {state}", g.index);
    }
    let queued = jobs.iter().filter(|j| j.state == JobState::Queued).count();
    let running = jobs
        .iter()
        .filter(|j| matches!(j.state, JobState::Running { .. }))
        .count();
    println!("  jobs: {running} running, {queued} queued");
    Ok(ExitCode::SUCCESS)
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}
