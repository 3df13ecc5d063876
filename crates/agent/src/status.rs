//! What each GPU is, for leasing and for `labrun status`: the rule that
//! replaces the spreadsheet.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::gpu::GpuInfo;
use crate::watchdog::Reading;

/// A process on a GPU that labd did not start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignProcess {
    /// Its pid.
    pub pid: u32,
    /// Its owner, when known.
    pub user: Option<String>,
    /// GPU memory it holds, bytes.
    pub used_bytes: Option<u64>,
}

/// One GPU's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum GpuState {
    /// Not leased, nobody else holding memory above the limit.
    Free,
    /// Leased to a job.
    Leased {
        /// The job.
        job: String,
    },
    /// Held by processes labd did not start (a zombie, or someone outside labd).
    Foreign {
        /// Who.
        processes: Vec<ForeignProcess>,
    },
    /// The inventory did not answer; never leased.
    Unknown {
        /// Why.
        reason: String,
    },
}

/// A GPU and its state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    /// NVML index.
    pub index: u32,
    /// The hardware reading, when known.
    pub info: Option<GpuInfo>,
    /// What it is.
    pub state: GpuState,
}

/// Classifies every GPU. A GPU is free only when the reading is known, it is
/// not leased, and processes not belonging to labd's jobs (`is_ours`) hold at
/// most `foreign_limit` bytes on it. Leased GPUs stay leased whatever runs on
/// them; with an unknown reading, every GPU is unknown, leased or not.
pub fn classify(
    reading: &Reading,
    known_gpus: &[u32],
    leases: &BTreeMap<u32, String>,
    is_ours: &dyn Fn(u32) -> bool,
    user_of: &dyn Fn(u32) -> Option<String>,
    foreign_limit: u64,
) -> Vec<GpuStatus> {
    let gpus = match reading {
        Reading::Unknown { reason } => {
            let mut idx: HashSet<u32> = known_gpus.iter().copied().collect();
            idx.extend(leases.keys());
            let mut idx: Vec<u32> = idx.into_iter().collect();
            idx.sort();
            return idx
                .into_iter()
                .map(|index| GpuStatus {
                    index,
                    info: None,
                    state: GpuState::Unknown {
                        reason: reason.clone(),
                    },
                })
                .collect();
        }
        Reading::Known(g) => g,
    };
    gpus.iter()
        .map(|g| {
            let state = if let Some(job) = leases.get(&g.index) {
                GpuState::Leased { job: job.clone() }
            } else {
                let foreign: Vec<ForeignProcess> = g
                    .processes
                    .iter()
                    .filter(|p| !is_ours(p.pid))
                    .map(|p| ForeignProcess {
                        pid: p.pid,
                        user: user_of(p.pid),
                        used_bytes: p.used_bytes,
                    })
                    .collect();
                // Unknown per-process memory counts as over the limit: safer to wait.
                let held: u64 = foreign
                    .iter()
                    .map(|p| p.used_bytes.unwrap_or(u64::MAX / 64))
                    .sum();
                if !foreign.is_empty() && held > foreign_limit {
                    GpuState::Foreign { processes: foreign }
                } else {
                    GpuState::Free
                }
            };
            GpuStatus {
                index: g.index,
                info: Some(g.clone()),
                state,
            }
        })
        .collect()
}

/// Indices of the free GPUs with at least `min_free_bytes` of memory free.
pub fn free_gpus(status: &[GpuStatus], min_free_bytes: u64) -> Vec<u32> {
    status
        .iter()
        .filter(|s| s.state == GpuState::Free)
        .filter(|s| {
            s.info
                .as_ref()
                .is_some_and(|i| i.memory_total.saturating_sub(i.memory_used) >= min_free_bytes)
        })
        .map(|s| s.index)
        .collect()
}

/// The owner of a process, from `/proc/<pid>/status` and `/etc/passwd`.
pub fn process_user(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    Some(
        passwd
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() > 2 && f[2] == uid.to_string()).then(|| f[0].to_string())
            })
            .unwrap_or_else(|| format!("uid {uid}")),
    )
}

/// The session id of a process (`/proc/<pid>/stat` field 6): every process a
/// job forks stays in the job's session, so this tells labd's own GPU users
/// from foreign ones.
pub fn process_session(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuProcess;

    fn gpu(index: u32, procs: &[(u32, u64)]) -> GpuInfo {
        GpuInfo {
            index,
            uuid: String::new(),
            name: String::new(),
            memory_total: 11 << 30,
            memory_used: procs.iter().map(|p| p.1).sum(),
            utilization: None,
            temperature: None,
            processes: procs
                .iter()
                .map(|&(pid, b)| GpuProcess {
                    pid,
                    used_bytes: Some(b),
                })
                .collect(),
        }
    }

    #[test]
    fn foreign_memory_keeps_a_gpu_out_ours_does_not() {
        let reading = Reading::Known(vec![
            gpu(0, &[(100, 3 << 30)]),
            gpu(1, &[(200, 3 << 30)]),
            gpu(2, &[(300, 1 << 20)]),
            gpu(3, &[]),
        ]);
        let leases = BTreeMap::from([(3, "job-7".to_string())]);
        let st = classify(
            &reading,
            &[],
            &leases,
            &|pid| pid == 200,
            &|_| Some("bob".into()),
            256 << 20,
        );
        assert!(
            matches!(&st[0].state, GpuState::Foreign { processes } if processes[0].pid == 100 && processes[0].user.as_deref() == Some("bob"))
        );
        assert_eq!(
            st[1].state,
            GpuState::Free,
            "our own job's process is not foreign"
        );
        assert_eq!(st[2].state, GpuState::Free, "1 MiB is under the limit");
        assert_eq!(
            st[3].state,
            GpuState::Leased {
                job: "job-7".into()
            }
        );
        assert_eq!(free_gpus(&st, 0), vec![1, 2]);
        assert_eq!(
            free_gpus(&st, 9 << 30),
            vec![2],
            "GPU 1 has only 8 GiB free"
        );
    }

    #[test]
    fn unknown_reading_makes_every_gpu_unknown() {
        let st = classify(
            &Reading::Unknown {
                reason: "hung".into(),
            },
            &[0, 1],
            &BTreeMap::new(),
            &|_| false,
            &|_| None,
            0,
        );
        assert_eq!(st.len(), 2);
        assert!(st
            .iter()
            .all(|s| matches!(s.state, GpuState::Unknown { .. })));
        assert!(free_gpus(&st, 0).is_empty());
    }

    #[test]
    fn proc_helpers_read_this_process() {
        let me = std::process::id();
        assert!(process_session(me).is_some());
        assert!(process_user(me).is_some());
    }
}
