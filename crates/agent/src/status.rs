//! What each GPU is, for leasing and for `labrun status`: the rule that
//! replaces the spreadsheet.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::gpu::GpuInfo;
use crate::watchdog::Reading;

/// A process on a GPU that is not the GPU's lease holder's: one labd did
/// not start, or one of another job using a GPU it did not lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignProcess {
    /// Its pid.
    pub pid: u32,
    /// The labd job it belongs to, when it is one (outside that job's lease).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
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
        /// Processes on it that are not that job's.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        others: Vec<ForeignProcess>,
    },
    /// Held by processes labd did not start (a zombie, or someone outside
    /// labd), or by a job outside its lease.
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

/// Classifies every GPU. Only the processes of the job that holds GPU g's
/// lease are exempt on g (`job_of` says which job, if any, a pid belongs
/// to): a job that resets `CUDA_VISIBLE_DEVICES`, or a `--gpus 0` job, using
/// a GPU it did not lease keeps that GPU out of placement, whatever memory
/// it holds, since the next job leased there would run out of memory.
/// Processes of no job are foreign and keep a GPU out above `foreign_limit`
/// bytes. A leased GPU stays leased and lists any other process on it; with
/// an unknown reading, every GPU is unknown, leased or not.
pub fn classify(
    reading: &Reading,
    known_gpus: &[u32],
    leases: &BTreeMap<u32, String>,
    job_of: &dyn Fn(u32) -> Option<String>,
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
            let holder = leases.get(&g.index);
            let others: Vec<ForeignProcess> = g
                .processes
                .iter()
                .filter_map(|p| {
                    let job = job_of(p.pid);
                    (job.is_none() || job.as_ref() != holder).then(|| ForeignProcess {
                        pid: p.pid,
                        user: user_of(p.pid),
                        used_bytes: p.used_bytes,
                        job,
                    })
                })
                .collect();
            let state = if let Some(job) = holder {
                GpuState::Leased {
                    job: job.clone(),
                    others,
                }
            } else {
                // Unknown per-process memory counts as over the limit: safer to wait.
                let held = others
                    .iter()
                    .filter(|p| p.job.is_none())
                    .map(|p| p.used_bytes.unwrap_or(u64::MAX / 64))
                    .fold(0u64, u64::saturating_add);
                let a_job_outside_its_lease = others.iter().any(|p| p.job.is_some());
                if a_job_outside_its_lease || (!others.is_empty() && held > foreign_limit) {
                    GpuState::Foreign { processes: others }
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

/// The owner of a process, from `/proc/<pid>/status`, named through NSS
/// (LDAP and other directory users of a lab show by name, not only those in
/// `/etc/passwd`). Blocking: called off the async runtime.
pub fn process_user(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(crate::users::user_by_uid(uid).map_or_else(|| format!("uid {uid}"), |u| u.name))
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
        let leases = BTreeMap::from([(1, "job-3".to_string()), (3, "job-7".to_string())]);
        let st = classify(
            &reading,
            &[],
            &leases,
            &|pid| (pid == 200).then(|| "job-3".to_string()),
            &|_| Some("bob".into()),
            256 << 20,
        );
        assert!(
            matches!(&st[0].state, GpuState::Foreign { processes } if processes[0].pid == 100 && processes[0].user.as_deref() == Some("bob"))
        );
        assert_eq!(
            st[1].state,
            GpuState::Leased {
                job: "job-3".into(),
                others: vec![]
            },
            "the lease holder's own process is not foreign"
        );
        assert_eq!(st[2].state, GpuState::Free, "1 MiB is under the limit");
        assert_eq!(
            st[3].state,
            GpuState::Leased {
                job: "job-7".into(),
                others: vec![]
            }
        );
        assert_eq!(free_gpus(&st, 0), vec![2]);
        assert!(free_gpus(&st, 11 << 30).is_empty(), "GPU 2 has 1 MiB used");
    }

    /// Issue 9, point 3: a job's process on a GPU it did not lease (it reset
    /// `CUDA_VISIBLE_DEVICES`, or asked for `--gpus 0`) is shown with its job
    /// and keeps the GPU out, even under the foreign limit; on another job's
    /// leased GPU it is listed beside the lease.
    #[test]
    fn a_job_outside_its_lease_keeps_the_gpu_out() {
        let reading = Reading::Known(vec![
            gpu(0, &[(10, 1 << 20)]),
            gpu(1, &[(11, 2 << 30), (10, 1 << 30)]),
        ]);
        let leases = BTreeMap::from([(1, "j2".to_string())]);
        let job_of = |pid: u32| match pid {
            10 => Some("j1".to_string()),
            11 => Some("j2".to_string()),
            _ => None,
        };
        let st = classify(&reading, &[], &leases, &job_of, &|_| None, 256 << 20);
        let j1 = |bytes: u64| ForeignProcess {
            pid: 10,
            job: Some("j1".into()),
            user: None,
            used_bytes: Some(bytes),
        };
        assert_eq!(
            st[0].state,
            GpuState::Foreign {
                processes: vec![j1(1 << 20)]
            }
        );
        assert_eq!(
            st[1].state,
            GpuState::Leased {
                job: "j2".into(),
                others: vec![j1(1 << 30)]
            }
        );
        assert!(free_gpus(&st, 0).is_empty());
    }

    #[test]
    fn unknown_reading_makes_every_gpu_unknown() {
        let st = classify(
            &Reading::Unknown {
                reason: "hung".into(),
            },
            &[0, 1],
            &BTreeMap::new(),
            &|_| None,
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
