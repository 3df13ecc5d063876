//! `labrun status`: the spreadsheet, replaced. Every GPU — free, leased
//! (job, user), held by a foreign process, unknown — of this node, or of
//! every node of the cluster when labrun talks to the coordinator, with
//! what each node has cached.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::proto::{JobView, NodeHealth, NodeStatus, Refused};
use labsync_agent::{Client, ForeignProcess, GpuState, GpuStatus, JobState};

use super::{explain_client, gib};

/// `labrun status [--watch]`: once, or the grid kept on screen, read
/// again every 2 s from the same answer the web page and `/metrics` are
/// drawn from, until Ctrl-C.
pub async fn watch(client: &Client, json: bool, watch: bool) -> Result<ExitCode> {
    if !watch {
        return status(client, json).await;
    }
    if json {
        anyhow::bail!("--watch draws the grid for a terminal; for JSON, ask labrun status --json as often as needed");
    }
    use std::io::IsTerminal;
    let tty = std::io::stdout().is_terminal();
    loop {
        if tty {
            // Home and clear: the grid redrawn in place.
            print!("\x1b[H\x1b[2J");
        }
        status(client, false).await?;
        println!(
            "\n(every 2 s; Ctrl-C to stop; {})",
            labsync_agent::utc_time(labsync_agent::unix_now() as i64)
        );
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// Prints the node's (or the cluster's) GPUs and jobs.
pub async fn status(client: &Client, json: bool) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain_client)?;
    if info.coordinator {
        let cluster = client.cluster_status().await.map_err(explain_client)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&cluster)?);
            return Ok(ExitCode::SUCCESS);
        }
        let now = labsync_agent::cluster::now_ms() as u64;
        let up = cluster
            .nodes
            .iter()
            .filter(|n| n.health == NodeHealth::Up)
            .count();
        // The queue is the coordinator's: jobs wait there, not on a node.
        let queued = (client.jobs().await.map_err(explain_client)?)
            .iter()
            .filter(|j| j.state == JobState::Queued)
            .count();
        println!(
            "cluster of {} node(s), {up} up, coordinated by {} (labsync {}); {queued} job(s) \
             queued{}",
            cluster.nodes.len(),
            cluster.coordinator,
            cluster.version,
            if queued > 0 {
                " (labrun ps says why)"
            } else {
                ""
            }
        );
        for line in refusals(&cluster.refused) {
            println!("{line}");
        }
        for n in &cluster.nodes {
            print_node(n, now, &cluster.version);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let gpus = client.gpus().await.map_err(explain_client)?;
    let jobs = client.jobs().await.map_err(explain_client)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "node": info.node,
                "inventory": info.inventory,
                "gpu_confinement": info.gpu_confinement,
                "gpus": gpus,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}", headline(&info.node, &info.inventory));
    if gpus.is_empty() {
        println!("  no GPUs on this node: jobs run with --gpus 0");
    } else if !info.gpu_confinement.is_empty() {
        println!("  {}", info.gpu_confinement);
    }
    print_gpus(&gpus, &jobs);
    print_counts(&jobs);
    Ok(ExitCode::SUCCESS)
}

/// The first line of a node's status: its name and where its GPUs are read
/// from ("GPUs from none" read as if they came from somewhere; issue 43).
fn headline(node: &str, inventory: &str) -> String {
    format!("{node} — GPUs: {inventory}")
}

/// Nodes the coordinator refuses for their protocol version, each with
/// both versions and what to do.
fn refusals(refused: &[Refused]) -> Vec<String> {
    refused
        .iter()
        .map(|r| format!("{} REFUSED: {}", r.node, r.why))
        .collect()
}

/// A node on another labsync version than the coordinator's, said: it
/// works (one protocol version apart), but the upgrade is not finished.
fn version_note(node: &str, coordinator: &str) -> Option<String> {
    if node == coordinator || coordinator.is_empty() {
        return None;
    }
    let node = if node.is_empty() { "0.1.0" } else { node };
    Some(format!(
        "labsync {node}, the coordinator {coordinator}: finish the upgrade (docs/install.md)"
    ))
}

/// One node of the cluster: health, GPUs, jobs and cached data.
fn print_node(n: &NodeStatus, now: u64, coordinator_version: &str) {
    let health = match n.health {
        NodeHealth::Up => "up".to_string(),
        NodeHealth::Down { since } => format!(
            "NODE DOWN since {} s ago (never chosen; its jobs as last reported)",
            now.saturating_sub(since) / 1000
        ),
    };
    println!();
    println!(
        "{} ({}) — {health}; cache {} of {}",
        n.name,
        n.addr,
        gib(n.cache_used),
        gib(n.cache_max)
    );
    if let Some(v) = version_note(&n.version, coordinator_version) {
        println!("  {v}");
    }
    for s in &n.suspect {
        println!("  SUSPECT: {s}; its packs are not offered meanwhile");
    }
    if n.gpus.is_empty() {
        println!("  no GPUs");
    } else if !n.gpu_confinement.is_empty() {
        println!("  {}", n.gpu_confinement);
    }
    print_gpus(&n.gpus, &n.jobs);
    let running = (n.jobs.iter())
        .filter(|j| matches!(j.state, JobState::Running { .. }))
        .count();
    println!("  jobs: {running} running");
    let f = &n.fetched;
    if f.from_peers + f.from_store > 0 || f.corrupt_from_peers + f.failed_from_peers > 0 {
        let mut line = format!(
            "  fetched into its cache: {} from peers, {} from the store",
            gib(f.from_peers),
            gib(f.from_store)
        );
        if f.corrupt_from_peers > 0 {
            line += &format!(
                "; {} corrupt copies from peers refused",
                f.corrupt_from_peers
            );
        }
        if f.failed_from_peers > 0 {
            line += &format!("; {} tries at peers failed", f.failed_from_peers);
        }
        println!("{line}");
    }
    if f.served_to_peers > 0 {
        println!(
            "  served to peers: {} ({} by sendfile)",
            gib(f.served_to_peers),
            gib(f.served_by_sendfile)
        );
    }
    if f.reported_corrupt > 0 {
        println!(
            "  copies it served reported corrupt by peers: {} ({} corrupt here too, dropped)",
            f.reported_corrupt, f.dropped_corrupt
        );
    }
    if !n.data.is_empty() {
        let data: Vec<String> = n
            .data
            .iter()
            .map(|d| {
                let pct = 100.0 * d.present_bytes as f64 / d.total_bytes.max(1) as f64;
                let mut marks = Vec::new();
                if d.pinned {
                    marks.push("pinned");
                }
                if d.materialised {
                    marks.push("materialised: jobs start without a fetch");
                }
                let marks = match marks.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", marks.join("; ")),
                };
                format!("{} {:.0}%{marks}", d.label, pct.floor())
            })
            .collect();
        println!("  data: {}", data.join(", "));
    }
}

fn print_gpus(gpus: &[GpuStatus], jobs: &[JobView]) {
    let owner: HashMap<&str, &str> = jobs
        .iter()
        .map(|j| (j.id.as_str(), j.user.as_str()))
        .collect();
    for g in gpus {
        let hw = match &g.info {
            Some(i) => format!(
                "{:<22} {:>9} / {:<9} used",
                i.name,
                gib(i.memory_used),
                gib(i.memory_total)
            ),
            None => format!("{:<22} {:>21}", "?", "?"),
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
}

fn procs(ps: &[ForeignProcess]) -> String {
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
}

fn print_counts(jobs: &[JobView]) {
    let queued = jobs.iter().filter(|j| j.state == JobState::Queued).count();
    let running = jobs
        .iter()
        .filter(|j| matches!(j.state, JobState::Running { .. }))
        .count();
    println!("  jobs: {running} running, {queued} queued");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_on_another_version_and_a_refused_one_are_said() {
        assert_eq!(version_note("0.2.0", "0.2.0"), None);
        let v = version_note("", "0.2.0").unwrap();
        assert!(v.contains("0.1.0") && v.contains("0.2.0"), "{v}");
        let r = Refused {
            node: "gpu3".parse().unwrap(),
            why: "gpu3 speaks labsync protocol 4 (labsync 0.4.0) and gpu0 speaks 2".into(),
            at_ms: 1,
        };
        assert_eq!(
            refusals(&[r]),
            vec!["gpu3 REFUSED: gpu3 speaks labsync protocol 4 (labsync 0.4.0) and gpu0 speaks 2"]
        );
    }

    #[test]
    fn the_headline_says_what_reads_the_gpus() {
        assert_eq!(
            headline("gpu1", "none (no NVML library on this node)"),
            "gpu1 — GPUs: none (no NVML library on this node)"
        );
        assert_eq!(
            headline("gpu2", "nvml (driver 550.54)"),
            "gpu2 — GPUs: nvml (driver 550.54)"
        );
    }
}
