//! Holds (`labrun --hold`): GPUs leased with no command of the user's, and
//! given back when they show no utilisation for `idle_hold` — what ends
//! "debugging GPUs idle while a deadline waits". The rule is the placer's
//! [`labsync_placer::idle_holds`], the one the simulator measures.

use std::collections::HashMap;
use std::io::Write;

use labsync_placer::{idle_holds, Hold, Policy};

use super::Daemon;
use crate::blocking::off_runtime;
use crate::ids::JobId;
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

/// What a hold's holder runs on its GPUs outside the hold itself: their
/// processes that NVML lists on one of `gpus`, or whose environment names
/// one (`CUDA_VISIBLE_DEVICES` with its index under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`, as the hold told them to export, or
/// its UUID). Never another user's, never root's, and never a process
/// some labd started for a job (`LABRUN_JOB_ID` in its environment: its
/// own job ends it). Each with its pid, start time and command name.
fn holders_processes(uid: u32, gpus: &[u32], reading: &[GpuStatus]) -> Vec<(u32, u64, String)> {
    if uid == 0 {
        return Vec::new();
    }
    let held: Vec<&GpuStatus> = reading.iter().filter(|g| gpus.contains(&g.index)).collect();
    let uuids: Vec<&str> = held
        .iter()
        .filter_map(|g| g.info.as_ref().map(|i| i.uuid.as_str()))
        .filter(|u| !u.is_empty())
        .collect();
    let on_gpu: Vec<u32> = held
        .iter()
        .filter_map(|g| g.info.as_ref())
        .flat_map(|i| i.processes.iter().map(|p| p.pid))
        .collect();
    let names_a_held_gpu = |environ: &[u8]| {
        let vars: HashMap<&[u8], &[u8]> = environ
            .split(|&b| b == 0)
            .filter_map(|v| {
                let at = v.iter().position(|&b| b == b'=')?;
                Some((&v[..at], &v[at + 1..]))
            })
            .collect();
        if vars.contains_key(&b"LABRUN_JOB_ID"[..]) {
            return false;
        }
        let Some(visible) = vars.get(&b"CUDA_VISIBLE_DEVICES"[..]) else {
            return false;
        };
        let by_bus = vars.get(&b"CUDA_DEVICE_ORDER"[..]) == Some(&&b"PCI_BUS_ID"[..]);
        String::from_utf8_lossy(visible).split(',').any(|d| {
            let d = d.trim();
            (by_bus && d.parse::<u32>().is_ok_and(|i| gpus.contains(&i)))
                || (d.starts_with("GPU-") && uuids.iter().any(|u| u.starts_with(d)))
        })
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let owner = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                let l = s.lines().find_map(|l| l.strip_prefix("Uid:"))?.to_string();
                l.split_whitespace().next()?.parse::<u32>().ok()
            });
        if owner != Some(uid) {
            continue;
        }
        let listed = on_gpu.contains(&pid);
        let named = !listed
            && std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| names_a_held_gpu(&e));
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if listed || named {
            if let Some(start) = crate::runner::start_ticks(pid) {
                found.push((pid, start, comm.trim().to_string()));
            }
        }
    }
    found
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
            if last.is_some_and(|t| self.clock.since(t) < check_every(self.cfg.idle_hold)) {
                return;
            }
            *last = Some(self.clock.instant());
        }
        let now = self.clock.unix_ms();
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
        let due = self.idle_now(&holds, &reading, now);
        for (id, why) in due {
            if let Some(j) = holds.iter().find(|j| j.id == id) {
                self.release_hold(j, why, &reading).await;
            }
        }
    }

    /// The holds among `holds` idle long enough to give back (with why),
    /// their idle times kept from the last reading to this one.
    fn idle_now(
        &self,
        holds: &[&JobRecord],
        reading: &[GpuStatus],
        now: u64,
    ) -> Vec<(String, String)> {
        let mut idle = self.hold_idle.lock().expect("holds poisoned");
        let mut seen: HashMap<JobId, Option<u64>> = HashMap::new();
        for j in holds {
            let since = if busy(&j.gpus, reading) {
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
                id: j.id.to_string(),
                user: j.user.clone(),
                node: self.cfg.node_name.clone(),
                gpus: j.gpus.clone(),
                idle_since: idle.get(&j.id).copied().flatten(),
            })
            .collect();
        let policy = Policy {
            idle_hold_secs: self.cfg.idle_hold.as_secs(),
            ..Policy::default()
        };
        idle_holds(&as_placer, now, &policy)
    }

    /// Gives back hold `j`, idle for `why`: says so in its record and log,
    /// ends it, and ends what its holder runs on its GPUs.
    async fn release_hold(&self, j: &JobRecord, why: String, reading: &[GpuStatus]) {
        let id = j.id.clone();
        let (node, grace, log) = (
            self.node.clone(),
            self.cfg.kill_grace,
            self.node.log_path(&id),
        );
        let holder = j.meta.run_as.map_or_else(crate::euid, |r| r.uid);
        let (gpus, user, reading) = (j.gpus.clone(), j.user.clone(), reading.to_vec());
        let reason = why.clone();
        let done = off_runtime(move || {
            node.update_meta(&id, |m| m.released = Some(reason.clone()))?;
            // What the holder runs on those GPUs under the hold ends
            // with it (else it keeps them from the next job); told
            // first, in the log its holder may be following.
            let theirs = holders_processes(holder, &gpus, &reading);
            if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log) {
                let _ = writeln!(f, "labd: {reason}");
                if !theirs.is_empty() {
                    let named: Vec<String> = theirs
                        .iter()
                        .map(|(p, _, c)| format!("{p} ({c})"))
                        .collect();
                    let _ = writeln!(
                        f,
                        "labd: ending {} process(es) of {user} on the GPU(s) given back: {}",
                        theirs.len(),
                        named.join(", ")
                    );
                }
            }
            node.kill(&id, grace)?;
            let procs: Vec<(u32, u64)> = theirs.iter().map(|(p, s, _)| (*p, *s)).collect();
            crate::runner::kill_processes(&procs, grace);
            Ok::<_, NodeError>((id, theirs.len()))
        })
        .await;
        match done {
            Ok((id, 0)) => tracing::info!("hold {id} {why}"),
            Ok((id, n)) => {
                tracing::info!("hold {id} {why}; {n} process(es) of its holder ended")
            }
            Err(e) => tracing::error!("releasing an idle hold: {e}"),
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
