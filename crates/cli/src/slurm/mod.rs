//! The Slurm backend: Slurm allocates and isolates the GPUs, accounts and
//! orders by its QOS and fair share; labsync adds where the data is.
//!
//! - [`submit`]: `labrun --backend slurm`: push the code and data, rank the
//!   nodes (Slurm's free GPUs, the agents' caches) on the coordinator, and
//!   `sbatch --prefer` the best that can start the job now.
//! - [`job`]: the batch script's own step (`labrun _slurm-job`), on the
//!   node Slurm chose, as the user: stage the code and data through that
//!   node's labd, run the command, save the outputs periodically, at the
//!   end, on `scancel` and before the time limit.
//! - [`manage`]: `labrun ps | logs | kill` mapped to `squeue`, the job's
//!   output file and `scancel`.
//! - [`config`]: `labd slurm-config`, the slurm.conf lines labsync needs.
//! - [`rerank`]: the coordinator's re-ranking of pending jobs as caches
//!   change (`scontrol update JobId=… Prefer=…`).
//!
//! Every Slurm command runs under a timeout ([`Slurm::run`]): `sinfo` and
//! friends block for seconds when slurmctld is down, and labrun must say
//! what failed instead of hanging.

pub mod config;
pub mod job;
pub mod manage;
pub mod rerank;
pub mod submit;

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use labsync_placer::{NodeName, SchedulerNode};
use tokio::io::AsyncWriteExt;

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

/// Slurm's id from what a user typed: `1234` or `slurm-1234`.
pub fn slurm_id(job: &str) -> Result<String> {
    let id = job.strip_prefix("slurm-").unwrap_or(job);
    if id.is_empty() || id.len() > 20 || !id.bytes().all(|b| b.is_ascii_digit()) {
        bail!("{job:?} is not a Slurm job id (1234 or slurm-1234; see labrun ps)");
    }
    Ok(id.to_string())
}

/// Runs Slurm's commands, each under a deadline.
#[derive(Clone, Debug)]
pub struct Slurm {
    /// Longest wait for one command.
    pub timeout: Duration,
    /// slurm.conf (`SLURM_CONF`) where not Slurm's default or the
    /// environment's.
    pub conf: Option<std::path::PathBuf>,
}

/// Whether Slurm's node `name` carries its own feature (`lsn_<name>`): a
/// job can prefer only such a node (Slurm refuses a preference no node has).
pub fn has_own_feature(nodes: &[NodeInfo], name: &str) -> bool {
    nodes
        .iter()
        .any(|x| x.name == name && x.features.contains(&feature_of(name)))
}

impl Slurm {
    /// Slurm's commands as configured in the environment (`SLURM_CONF`).
    pub fn new(timeout: Duration) -> Slurm {
        Slurm {
            timeout,
            conf: None,
        }
    }

    /// `prog args…` (with `stdin`): its standard output, or an error that
    /// says which command failed, how, and what to check.
    pub async fn run(&self, prog: &str, args: &[String], stdin: Option<&[u8]>) -> Result<String> {
        let shown = format!("{prog} {}", args.join(" "));
        let mut cmd = tokio::process::Command::new(prog);
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
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "{prog} not found: the Slurm backend runs Slurm's own commands; install \
                 Slurm's client (Debian: slurm-client) or put them on PATH"
            ),
            Err(e) => return Err(e).with_context(|| format!("cannot run {prog}")),
        };
        if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(data)
                .await
                .with_context(|| format!("cannot write to {prog}"))?;
        }
        let out = match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(r) => r.with_context(|| format!("{prog} failed"))?,
            Err(_) => bail!(
                "`{shown}` did not answer within {} s: is slurmctld running and reachable? \
                 `scontrol ping` says; on the controller, `systemctl status slurmctld` and its \
                 log. (labrun waits [slurm] timeout for each Slurm command)",
                self.timeout.as_secs()
            ),
        };
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = err.trim();
            bail!(
                "`{shown}` failed ({}): {}",
                out.status,
                if err.is_empty() { "no message" } else { err }
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Every node of `partition` (all with `None`) as `scontrol show node`
    /// reports it.
    pub async fn nodes(&self, partition: Option<&str>) -> Result<Vec<NodeInfo>> {
        let out = self
            .run(
                "scontrol",
                &["-o".into(), "-d".into(), "show".into(), "node".into()],
                None,
            )
            .await?;
        Ok(out
            .lines()
            .filter_map(|l| NodeInfo::parse(l).ok())
            .filter(|n| partition.is_none_or(|p| n.partitions.iter().any(|x| x == p)))
            .collect())
    }

    /// `scontrol show job ID`, as keys and values; `None` once Slurm has
    /// forgotten it.
    pub async fn job(&self, id: &str) -> Result<Option<HashMap<String, String>>> {
        let args = ["-o".into(), "show".into(), "job".into(), id.to_string()];
        match self.run("scontrol", &args, None).await {
            Ok(out) => Ok(out.lines().next().map(fields)),
            Err(e) if format!("{e:#}").contains("Invalid job id") => Ok(None),
            Err(e) => Err(e),
        }
    }
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
    /// Parses one line.
    pub fn parse(line: &str) -> Result<NodeInfo> {
        let f = fields(line);
        let name = f.get("NodeName").context("no NodeName")?.clone();
        let list = |k: &str| -> Vec<String> {
            f.get(k)
                .filter(|v| !v.is_empty() && v.as_str() != "(null)")
                .map(|v| v.split(',').map(str::to_string).collect())
                .unwrap_or_default()
        };
        Ok(NodeInfo {
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
        let s = n.scheduler_node().unwrap();
        assert_eq!((s.gpus, s.free, s.usable), (2, 1, true));
        let f = fields(N1);
        assert_eq!(f["OS"], "Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0");
        let none = N1.replace("AvailableFeatures=lsn_n1", "AvailableFeatures=(null)");
        assert!(NodeInfo::parse(&none).unwrap().features.is_empty());
        assert!(NodeInfo::parse("Arch=x86_64").is_err());
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
        assert_eq!(slurm_id("1234").unwrap(), "1234");
        assert_eq!(slurm_id("slurm-1234").unwrap(), "1234");
        for bad in ["", "j12", "slurm-", "12;rm", "1 2"] {
            assert!(slurm_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(job_name("7"), "slurm-7");
        assert_eq!(feature_of("gpu3"), "lsn_gpu3");
    }
}
