//! Holds (`labrun --hold`): GPUs leased with no command of the user's, and
//! given back when they show no utilisation for `idle_hold` — what ends
//! "debugging GPUs idle while a deadline waits". The rule is the placer's
//! [`labsync_placer::idle_holds`], the one the simulator measures.

use std::collections::HashMap;
use std::io::Write;

use labsync_placer::{idle_holds, Hold, Policy};

use super::Daemon;
use crate::blocking::off_runtime;
use crate::cluster::now_ms;
use crate::leases::{JobRecord, JobState};
use crate::node::NodeError;
use crate::status::GpuStatus;

/// How often the GPUs of running holds are read (a fresh NVML reading
/// each time, not on every tick): four times per idle time, at most every
/// 5 s.
fn check_every(idle_hold: std::time::Duration) -> std::time::Duration {
    (idle_hold / 4).clamp(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_secs(5),
    )
}

/// Whether any of `gpus` was computing at this reading. A GPU without a
/// utilisation reading counts as busy: a hold is never released on what
/// labd could not see.
fn busy(gpus: &[u32], reading: &[GpuStatus]) -> bool {
    gpus.iter().any(|g| {
        reading
            .iter()
            .find(|s| s.index == *g)
            .and_then(|s| s.info.as_ref())
            .and_then(|i| i.utilization)
            .is_none_or(|u| u > 0)
    })
}

impl Daemon {
    /// Looks at the running holds among `active`: notes since when each
    /// has been idle, and ends those idle for `idle_hold`, telling their
    /// holder why (in the job's log and `labrun ps`).
    pub(super) async fn release_idle_holds(&self, active: &[JobRecord]) {
        let holds: Vec<&JobRecord> = active
            .iter()
            .filter(|j| j.meta.hold_s.is_some() && matches!(j.state, JobState::Running { .. }))
            .collect();
        if holds.is_empty() {
            self.hold_idle.lock().expect("holds poisoned").clear();
            return;
        }
        {
            let mut last = self.hold_checked.lock().expect("holds poisoned");
            if last.is_some_and(|t| t.elapsed() < check_every(self.cfg.idle_hold)) {
                return;
            }
            *last = Some(std::time::Instant::now());
        }
        let now = now_ms() as u64;
        let reading = {
            let node = self.node.clone();
            match off_runtime(move || node.gpus()).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("holds: cannot read the GPUs: {e}");
                    return;
                }
            }
        };
        let due = {
            let mut idle = self.hold_idle.lock().expect("holds poisoned");
            let mut seen: HashMap<String, Option<u64>> = HashMap::new();
            for j in &holds {
                let since = if busy(&j.gpus, &reading) {
                    None
                } else {
                    Some(idle.get(&j.id).copied().flatten().unwrap_or(now))
                };
                seen.insert(j.id.clone(), since);
            }
            // Holds no longer running are forgotten.
            *idle = seen;
            let as_placer: Vec<Hold> = holds
                .iter()
                .map(|j| Hold {
                    id: j.id.clone(),
                    user: j.user.clone(),
                    node: self
                        .cfg
                        .node_name
                        .parse()
                        .unwrap_or_else(|_| "node".parse().expect("a valid name")),
                    gpus: j.gpus.clone(),
                    idle_since: idle.get(&j.id).copied().flatten(),
                })
                .collect();
            let policy = Policy {
                idle_hold_secs: self.cfg.idle_hold.as_secs(),
                ..Policy::default()
            };
            idle_holds(&as_placer, now, &policy)
        };
        for (id, why) in due {
            let (node, grace, log) = (
                self.node.clone(),
                self.cfg.kill_grace,
                self.node.log_path(&id),
            );
            let reason = why.clone();
            let done = off_runtime(move || {
                node.update_meta(&id, |m| m.released = Some(reason.clone()))?;
                // Its holder may be following the log.
                if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log) {
                    let _ = writeln!(f, "labd: {reason}");
                }
                node.kill(&id, grace)?;
                Ok::<_, NodeError>(id)
            })
            .await;
            match done {
                Ok(id) => tracing::info!("hold {id} {why}"),
                Err(e) => tracing::error!("releasing an idle hold: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuInfo;
    use crate::status::GpuState;

    fn gpu(index: u32, utilization: Option<u32>) -> GpuStatus {
        GpuStatus {
            index,
            info: Some(GpuInfo {
                index,
                uuid: String::new(),
                name: String::new(),
                memory_total: 1,
                memory_used: 0,
                utilization,
                temperature: None,
                processes: Vec::new(),
            }),
            state: GpuState::Free,
        }
    }

    #[test]
    fn a_hold_is_idle_only_when_every_gpu_reads_zero() {
        let r = [gpu(0, Some(0)), gpu(1, Some(35)), gpu(2, None)];
        assert!(!busy(&[0], &r));
        assert!(busy(&[0, 1], &r));
        // No reading: never released on it.
        assert!(busy(&[2], &r));
        assert!(busy(&[7], &r));
    }
}
