//! `/metrics`: the board in Prometheus' text format (0.0.4). Names are
//! `labsync_*`, bytes in bytes and times in seconds, as Prometheus'
//! naming guide asks; `dist/grafana-labsync.json` and
//! `dist/labsync-alerts.yml` are built on these names.

use std::collections::BTreeMap;

use super::Board;
use crate::leases::JobState;
use crate::metrics::{family, sample, write_counters};
use crate::proto::NodeHealth;
use crate::status::GpuState;

/// Every state a GPU cell can be in, as `labsync_gpu_state`'s `state`.
pub const GPU_STATES: [&str; 5] = ["free", "leased", "foreign", "unknown", "down"];

/// The state of a GPU on a node that is up or down.
pub(crate) fn gpu_state(up: bool, state: &GpuState) -> &'static str {
    match state {
        _ if !up => "down",
        GpuState::Free => "free",
        GpuState::Leased { .. } => "leased",
        GpuState::Foreign { .. } => "foreign",
        GpuState::Unknown { .. } => "unknown",
    }
}

/// The metrics of `b`, then labd's counters.
pub(crate) fn render(b: &Board) -> String {
    let mut out = String::with_capacity(4096 + b.nodes.len() * 4096);
    family(
        &mut out,
        "labsync_info",
        "gauge",
        "The labd serving these metrics.",
    );
    sample(
        &mut out,
        "labsync_info",
        &[("node", &b.served_by), ("version", &b.version)],
        1.0,
    );
    gpus(&mut out, b);
    nodes(&mut out, b);
    queue(&mut out, b);
    write_counters(&mut out, b.cluster);
    out
}

fn gpus(out: &mut String, b: &Board) {
    type Value = fn(&crate::gpu::GpuInfo) -> Option<f64>;
    let readings: [(&str, &str, Value); 3] = [
        (
            "labsync_gpu_memory_used_bytes",
            "GPU memory in use, as NVML last read it.",
            |i| Some(i.memory_used as f64),
        ),
        (
            "labsync_gpu_memory_total_bytes",
            "GPU memory installed.",
            |i| Some(i.memory_total as f64),
        ),
        (
            "labsync_gpu_utilization_ratio",
            "GPU utilisation, 0 to 1, where NVML reports it.",
            |i| i.utilization.map(|u| f64::from(u) / 100.0),
        ),
    ];
    for (name, help, value) in readings {
        family(out, name, "gauge", help);
        for n in &b.nodes {
            for g in &n.gpus {
                let idx = g.index.to_string();
                if let Some(v) = g.info.as_ref().and_then(value) {
                    sample(out, name, &[("node", n.name.as_str()), ("gpu", &idx)], v);
                }
            }
        }
    }
    let name = "labsync_gpu_state";
    family(
        out,
        name,
        "gauge",
        "1 for the state a GPU is in (free, leased, foreign, unknown, down), 0 for the others.",
    );
    for n in &b.nodes {
        let up = n.health == NodeHealth::Up;
        for g in &n.gpus {
            let idx = g.index.to_string();
            let now = gpu_state(up, &g.state);
            for s in GPU_STATES {
                let v = if s == now { 1.0 } else { 0.0 };
                sample(
                    out,
                    name,
                    &[("node", n.name.as_str()), ("gpu", &idx), ("state", s)],
                    v,
                );
            }
        }
    }
    let name = "labsync_gpu_foreign_memory_bytes";
    family(
        out,
        name,
        "gauge",
        "GPU memory held by processes that are not the GPU's lease holder's.",
    );
    for n in &b.nodes {
        for g in &n.gpus {
            let procs = match &g.state {
                GpuState::Foreign { processes } => processes.as_slice(),
                GpuState::Leased { others, .. } => others.as_slice(),
                _ => &[],
            };
            let held: u64 = procs.iter().filter_map(|p| p.used_bytes).sum();
            let idx = g.index.to_string();
            sample(
                out,
                name,
                &[("node", n.name.as_str()), ("gpu", &idx)],
                held as f64,
            );
        }
    }
}

fn nodes(out: &mut String, b: &Board) {
    type Value = fn(&crate::proto::NodeStatus) -> f64;
    let per_node: [(&str, &str, &str, Value); 7] = [
        (
            "labsync_node_up",
            "gauge",
            "1 while the node heartbeats, 0 once it is down.",
            |n| f64::from(u8::from(n.health == NodeHealth::Up)),
        ),
        (
            "labsync_node_cache_bytes",
            "gauge",
            "Bytes in the node's cache.",
            |n| n.cache_used as f64,
        ),
        (
            "labsync_node_cache_max_bytes",
            "gauge",
            "The node's cache cap.",
            |n| n.cache_max as f64,
        ),
        (
            "labsync_node_served_bytes_total",
            "counter",
            "Bytes of packs the node sent to peers.",
            |n| n.fetched.served_to_peers as f64,
        ),
        (
            "labsync_node_corrupt_refused_total",
            "counter",
            "Copies the node refused from peers: their bytes did not match their ids.",
            |n| n.fetched.corrupt_from_peers as f64,
        ),
        (
            "labsync_node_peer_failures_total",
            "counter",
            "Fetches from peers that failed (gone, timed out).",
            |n| n.fetched.failed_from_peers as f64,
        ),
        (
            "labsync_node_jobs_running",
            "gauge",
            "Jobs running on the node.",
            |n| {
                n.jobs
                    .iter()
                    .filter(|j| matches!(j.state, JobState::Running { .. }))
                    .count() as f64
            },
        ),
    ];
    for (name, kind, help, value) in per_node {
        family(out, name, kind, help);
        for n in &b.nodes {
            sample(out, name, &[("node", n.name.as_str())], value(n));
        }
    }
    let name = "labsync_node_fetched_bytes_total";
    family(
        out,
        name,
        "counter",
        "Bytes of packs the node fetched into its cache, by source (peers or store).",
    );
    for n in &b.nodes {
        let node = n.name.as_str();
        sample(
            out,
            name,
            &[("node", node), ("from", "peers")],
            n.fetched.from_peers as f64,
        );
        sample(
            out,
            name,
            &[("node", node), ("from", "store")],
            n.fetched.from_store as f64,
        );
    }
    let name = "labsync_node_dataset_present_ratio";
    family(
        out,
        name,
        "gauge",
        "Share of a dataset's bytes in the node's cache, 0 to 1.",
    );
    for n in &b.nodes {
        for d in &n.data {
            let r = if d.total_bytes == 0 {
                1.0
            } else {
                d.present_bytes as f64 / d.total_bytes as f64
            };
            let snapshot = d.snapshot.to_string();
            sample(
                out,
                name,
                &[
                    ("node", n.name.as_str()),
                    ("dataset", &d.label),
                    ("snapshot", &snapshot),
                ],
                r,
            );
        }
    }
}

fn queue(out: &mut String, b: &Board) {
    let queued: Vec<_> = b
        .jobs
        .iter()
        .filter(|j| j.state == JobState::Queued)
        .collect();
    let tier_of = |id: &str| {
        b.standings
            .job_tiers
            .get(id)
            .map_or("default", String::as_str)
    };
    let mut by_tier: BTreeMap<&str, usize> =
        b.standings.tiers.iter().map(|t| (t.as_str(), 0)).collect();
    if b.standings.tiers.is_empty() {
        by_tier.insert("default", 0);
    }
    for j in &queued {
        *by_tier.entry(tier_of(j.id.as_str())).or_default() += 1;
    }
    let name = "labsync_queue_jobs";
    family(out, name, "gauge", "Jobs waiting in the queue, by tier.");
    for (tier, n) in &by_tier {
        sample(out, name, &[("tier", tier)], *n as f64);
    }
    let name = "labsync_queue_oldest_wait_seconds";
    family(
        out,
        name,
        "gauge",
        "How long the job waiting longest has waited (0 with none waiting).",
    );
    let oldest = queued.iter().map(|j| j.submitted_at).min();
    let waited = oldest.map_or(0, |t| b.now.saturating_sub(t));
    sample(out, name, &[], waited as f64);
}
