//! Slurm's commands as labd and `labrun` run them: one runner, each
//! command under a timeout ([`Slurm::run`]), and the pure reading of what
//! `scontrol` and `squeue` print, tested on their captured output. The
//! coordinator's re-ranking of pending jobs is `cluster/rerank.rs`.
//!
//! Every Slurm command runs under a timeout: `sinfo` and friends block for
//! seconds when slurmctld is down, and labrun must say what failed
//! instead of hanging, and labd must not stall a check on it.

use std::collections::HashMap;
use std::time::Duration;

use labsync_placer::{NodeName, SchedulerNode};
use labsync_store::SnapshotId;
use tokio::io::AsyncWriteExt;

/// Why a Slurm command gave no answer to read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SlurmError {
    /// The command is not installed.
    #[error(
        "{0} not found: the Slurm backend runs Slurm's own commands; install Slurm's client \
         (Debian: slurm-client) or put them on PATH"
    )]
    NotFound(String),
    /// It could not be started, fed or waited for.
    #[error("{what}")]
    Io {
        /// What failed (`cannot run scontrol`, `sbatch failed`, …).
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// It did not answer within the timeout.
    #[error(
        "`{shown}` did not answer within {secs} s: is slurmctld running and reachable? \
         `scontrol ping` says; on the controller, `systemctl status slurmctld` and its log. \
         (labrun waits [slurm] timeout for each Slurm command)"
    )]
    Timeout {
        /// The command line.
        shown: String,
        /// The timeout.
        secs: u64,
    },
    /// It exited with an error.
    #[error("`{shown}` failed ({status}): {message}")]
    Failed {
        /// The command line.
        shown: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// Its standard error (or "no message").
        message: String,
    },
}

/// How the coordinator re-ranks pending Slurm jobs (`[slurm]`).
#[derive(Clone, Debug)]
pub struct Rerank {
    /// Time between passes.
    pub every: Duration,
    /// Longest wait for one Slurm command.
    pub timeout: Duration,
    /// Only this partition's nodes.
    pub partition: Option<String>,
    /// slurm.conf for Slurm's commands.
    pub conf: Option<std::path::PathBuf>,
}

/// The feature each node carries so that jobs can prefer it:
/// `lsn_<node>`.
pub fn feature_of(node: &str) -> String {
    format!("lsn_{node}")
}

/// labsync's name of Slurm job `id`: `slurm-<id>` (`LABRUN_JOB_ID`, the
/// outputs' `runs/slurm-<id>`).
pub fn job_name(id: &str) -> String {
    format!("slurm-{id}")
}

/// Slurm's id in what a user typed (`1234` or `slurm-1234`), if it is one.
pub fn job_id(job: &str) -> Option<&str> {
    let id = job.strip_prefix("slurm-").unwrap_or(job);
    (!id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit())).then_some(id)
}

/// How labsync's comments start.
pub const COMMENT: &str = "labsync:v1:";

/// The GPUs and snapshots of a job whose comment labrun wrote
/// (`labsync:v1:GPUS:SNAP,SNAP…`).
pub fn parse_comment(c: &str) -> Option<(u32, Vec<SnapshotId>)> {
    let (gpus, snaps) = c.strip_prefix(COMMENT)?.split_once(':')?;
    let snaps: Vec<SnapshotId> = snaps
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().ok())
        .collect::<Option<_>>()?;
    Some((gpus.parse().ok()?, snaps))
}

/// Runs Slurm's commands, each under a deadline.
#[derive(Clone, Debug)]
pub struct Slurm {
    /// Longest wait for one command.
    pub timeout: Duration,
    /// slurm.conf (`SLURM_CONF`) where not Slurm's default or the
    /// environment's.
    pub conf: Option<std::path::PathBuf>,
    /// Run without the variables that change what a command reports
    /// ([`hides_jobs`]): labd's own checks, whatever its environment.
    pub clean: bool,
}

/// Whether Slurm's node `name` carries its own feature (`lsn_<name>`): a
/// job can prefer only such a node (Slurm refuses a preference no node has).
pub fn has_own_feature(nodes: &[NodeInfo], name: &str) -> bool {
    nodes
        .iter()
        .any(|x| x.name == name && x.features.contains(&feature_of(name)))
}

/// The variables labd's Slurm commands run without: `SQUEUE_*` (a
/// format, states, partitions, QOS, names, clusters of a federation…),
/// `SLURM_CLUSTERS`, `SLURM_JWT` (squeue would ask as that token's user,
/// to whom a job may be hidden: "Invalid job id", read as gone) and
/// `POSIXLY_CORRECT`. labd's environment (a systemd unit's, an admin's
/// shell) must not hide a job from a check or a re-ranking.
pub fn hides_jobs(k: &std::ffi::OsStr) -> bool {
    let k = k.as_encoded_bytes();
    k.starts_with(b"SQUEUE_") || matches!(k, b"SLURM_CLUSTERS" | b"SLURM_JWT" | b"POSIXLY_CORRECT")
}

impl Slurm {
    /// Slurm's commands as configured in the environment (`SLURM_CONF`):
    /// a user's, for `labrun`.
    pub fn new(timeout: Duration) -> Slurm {
        Slurm {
            timeout,
            conf: None,
            clean: false,
        }
    }

    /// Slurm's commands as labd runs them: `conf` where set, and none of
    /// the variables of [`hides_jobs`].
    pub fn for_labd(timeout: Duration, conf: Option<std::path::PathBuf>) -> Slurm {
        Slurm {
            timeout,
            conf,
            clean: true,
        }
    }

    /// `prog args…` (with `stdin`), however it exited: its output, or why
    /// there is none (not installed, no answer within the timeout).
    pub async fn output(
        &self,
        prog: &str,
        args: &[String],
        stdin: Option<&[u8]>,
    ) -> Result<std::process::Output, SlurmError> {
        let mut cmd = tokio::process::Command::new(prog);
        if self.clean {
            for (k, _) in std::env::vars_os() {
                if hides_jobs(&k) {
                    cmd.env_remove(k);
                }
            }
        }
        if let Some(c) = &self.conf {
            cmd.env("SLURM_CONF", c);
        }
        cmd.args(args)
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let io = |what: String| move |source| SlurmError::Io { what, source };
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SlurmError::NotFound(prog.to_string()))
            }
            Err(e) => return Err(io(format!("cannot run {prog}"))(e)),
        };
        if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let write = pipe.write_all(data).await;
            write.map_err(io(format!("cannot write to {prog}")))?;
        }
        match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(r) => r.map_err(io(format!("{prog} failed"))),
            Err(_) => Err(SlurmError::Timeout {
                shown: format!("{prog} {}", args.join(" ")),
                secs: self.timeout.as_secs(),
            }),
        }
    }

    /// `prog args…` (with `stdin`): its standard output, or an error that
    /// says which command failed, how, and what to check.
    pub async fn run(
        &self,
        prog: &str,
        args: &[String],
        stdin: Option<&[u8]>,
    ) -> Result<String, SlurmError> {
        let out = self.output(prog, args, stdin).await?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = err.trim();
            return Err(SlurmError::Failed {
                shown: format!("{prog} {}", args.join(" ")),
                status: out.status,
                message: if err.is_empty() { "no message" } else { err }.to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Every node of `partition` (all with `None`) as `scontrol show node`
    /// reports it.
    pub async fn nodes(&self, partition: Option<&str>) -> Result<Vec<NodeInfo>, SlurmError> {
        let out = self
            .run(
                "scontrol",
                &["-o".into(), "-d".into(), "show".into(), "node".into()],
                None,
            )
            .await?;
        Ok(nodes_of(&out, partition))
    }

    /// `scontrol show job ID`, as keys and values; `None` once Slurm has
    /// forgotten it.
    pub async fn job(&self, id: &str) -> Result<Option<HashMap<String, String>>, SlurmError> {
        let args = ["-o".into(), "show".into(), "job".into(), id.to_string()];
        match self.run("scontrol", &args, None).await {
            Ok(out) => Ok(out.lines().next().map(fields)),
            Err(SlurmError::Failed { message, .. }) if message.contains("Invalid job id") => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// The nodes of `partition` (all with `None`) in what `scontrol -o -d show
/// node` printed; lines that are no node's are skipped.
pub fn nodes_of(out: &str, partition: Option<&str>) -> Vec<NodeInfo> {
    out.lines()
        .filter_map(NodeInfo::parse)
        .filter(|n| partition.is_none_or(|p| n.partitions.iter().any(|x| x == p)))
        .collect()
}

/// `Key=Value Key=Value …` of one `scontrol -o` line. A word without `=`
/// belongs to the value before it (`OS=Linux 6.1 #1 SMP`).
pub fn fields(line: &str) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    let mut last: Option<String> = None;
    for word in line.split_whitespace() {
        match word.split_once('=') {
            Some((k, v))
                if !k.is_empty()
                    && k.bytes().all(|b| {
                        b.is_ascii_alphanumeric() || b == b'/' || b == b':' || b == b'_'
                    }) =>
            {
                out.insert(k.to_string(), v.to_string());
                last = Some(k.to_string());
            }
            _ => {
                if let Some(v) = last.as_ref().and_then(|k| out.get_mut(k)) {
                    v.push(' ');
                    v.push_str(word);
                }
            }
        }
    }
    out
}

/// GPUs in a GRES list: `gpu:2`, `gpu:a100:4(S:0-1)`, `gpu:a100:1,gpu:v100:2`,
/// `gpu:(null):0(IDX:N/A)`; other kinds (`mps:100`) are not GPUs.
pub fn gres_gpus(gres: &str) -> u32 {
    let mut total = 0u32;
    // Commas also appear inside `(IDX:0,2)`: split only outside parentheses.
    let mut depth = 0i32;
    let mut items = Vec::new();
    let mut cur = String::new();
    for c in gres.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        if depth == 0 && c != ')' {
            cur.push(c);
        }
    }
    items.push(cur);
    for item in items {
        let mut parts = item.split(':');
        if parts.next() != Some("gpu") {
            continue;
        }
        if let Some(n) = parts.next_back().and_then(|n| n.trim().parse::<u32>().ok()) {
            total += n;
        }
    }
    total
}

/// One node as `scontrol -o -d show node` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// `NodeName`.
    pub name: String,
    /// `State` (`IDLE`, `MIXED+DRAIN`, `DOWN*`, …).
    pub state: String,
    /// GPUs configured (`Gres`).
    pub gpus: u32,
    /// GPUs allocated (`GresUsed`).
    pub gpus_used: u32,
    /// `AvailableFeatures`.
    pub features: Vec<String>,
    /// `Partitions`.
    pub partitions: Vec<String>,
}

impl NodeInfo {
    /// One line; `None` without a `NodeName`.
    pub fn parse(line: &str) -> Option<NodeInfo> {
        let f = fields(line);
        let name = f.get("NodeName")?.clone();
        let list = |k: &str| -> Vec<String> {
            f.get(k)
                .filter(|v| !v.is_empty() && v.as_str() != "(null)")
                .map(|v| v.split(',').map(str::to_string).collect())
                .unwrap_or_default()
        };
        Some(NodeInfo {
            state: f.get("State").cloned().unwrap_or_default(),
            gpus: f.get("Gres").map_or(0, |g| gres_gpus(g)),
            gpus_used: f.get("GresUsed").map_or(0, |g| gres_gpus(g)),
            features: list("AvailableFeatures"),
            partitions: list("Partitions"),
            name,
        })
    }

    /// Whether it takes jobs: not down, drained, failing, in maintenance,
    /// powered down or not responding (`*`).
    pub fn usable(&self) -> bool {
        const OUT: [&str; 9] = [
            "DOWN", "DRAIN", "FAIL", "MAINT", "INVALID", "FUTURE", "POWER", "REBOOT", "UNKNOWN",
        ];
        !self.state.is_empty()
            && !self.state.ends_with('*')
            && !self
                .state
                .split('+')
                .any(|s| OUT.iter().any(|o| s.starts_with(o)))
    }

    /// The placer's view of it; `None` for a name the placer refuses.
    pub fn scheduler_node(&self) -> Option<SchedulerNode> {
        let node: NodeName = self.name.parse().ok()?;
        Some(SchedulerNode {
            node,
            gpus: self.gpus,
            free: self.gpus.saturating_sub(self.gpus_used),
            usable: self.usable(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as Slurm 22.05.8 prints them (`scontrol -o -d show node`).
    const N1: &str = "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=4 CPUTot=4 \
        CPULoad=1.48 AvailableFeatures=lsn_n1 ActiveFeatures=lsn_n1 Gres=gpu:2 GresDrain=N/A \
        GresUsed=gpu:1(IDX:0) NodeAddr=127.0.0.1 NodeHostName=localhost Port=16901 \
        Version=22.05.8 OS=Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 \
        AllocMem=0 FreeMem=17939 Sockets=4 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 \
        Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,debug  BootTime=2026-12-04T17:22:35";

    #[test]
    fn nodes_parse() {
        let n = NodeInfo::parse(N1).unwrap();
        assert_eq!(n.name, "n1");
        assert_eq!(n.state, "MIXED");
        assert_eq!((n.gpus, n.gpus_used), (2, 1));
        assert_eq!(n.features, ["lsn_n1"]);
        assert_eq!(n.partitions, ["gpu", "debug"]);
        assert!(n.usable());
        let two = format!(
            "{N1}\nslurm_load_node error\n{}",
            N1.replace("NodeName=n1", "NodeName=n2")
                .replace("Partitions=gpu,debug", "Partitions=cpu")
        );
        assert_eq!(nodes_of(&two, None).len(), 2);
        assert_eq!(nodes_of(&two, Some("gpu")), std::slice::from_ref(&n));
        let s = n.scheduler_node().unwrap();
        assert_eq!((s.gpus, s.free, s.usable), (2, 1, true));
        let f = fields(N1);
        assert_eq!(f["OS"], "Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0");
        let none = N1.replace("AvailableFeatures=lsn_n1", "AvailableFeatures=(null)");
        assert!(NodeInfo::parse(&none).unwrap().features.is_empty());
        assert!(NodeInfo::parse("Arch=x86_64").is_none());
    }

    #[test]
    fn states() {
        let with = |s: &str| NodeInfo {
            state: s.into(),
            ..NodeInfo::parse(N1).unwrap()
        };
        for ok in ["IDLE", "MIXED", "ALLOCATED", "COMPLETING", "IDLE+PLANNED"] {
            assert!(with(ok).usable(), "{ok}");
        }
        for bad in [
            "DOWN*",
            "IDLE*",
            "IDLE+DRAIN",
            "DRAINED",
            "MIXED+DRAIN",
            "DOWN+NOT_RESPONDING",
            "IDLE+MAINT",
            "IDLE+POWERED_DOWN",
            "FUTURE",
            "",
        ] {
            assert!(!with(bad).usable(), "{bad}");
        }
    }

    #[test]
    fn gres() {
        assert_eq!(gres_gpus("gpu:2"), 2);
        assert_eq!(gres_gpus("gpu:0"), 0);
        assert_eq!(gres_gpus("gpu:a100:4(S:0-1)"), 4);
        assert_eq!(gres_gpus("gpu:a100:1(IDX:0),gpu:v100:2(IDX:1,3)"), 3);
        assert_eq!(gres_gpus("gpu:(null):0(IDX:N/A)"), 0);
        assert_eq!(gres_gpus("mps:100,gpu:1"), 1);
        assert_eq!(gres_gpus("(null)"), 0);
        assert_eq!(gres_gpus(""), 0);
    }

    #[test]
    fn job_ids() {
        assert_eq!(job_id("1234"), Some("1234"));
        assert_eq!(job_id("slurm-1234"), Some("1234"));
        for bad in ["", "j12", "slurm-", "12;rm", "1 2"] {
            assert!(job_id(bad).is_none(), "{bad:?}");
        }
        assert_eq!(job_name("7"), "slurm-7");
        assert_eq!(feature_of("gpu3"), "lsn_gpu3");
    }
}
