//! `labd doctor`: what a node needs, checked before the first job fails.
//!
//! Each check prints `ok`, `warn` or `FAIL`, and a failure its fix. On a
//! node: its config, GPUs, cgroups, store, disks and secrets, and in a
//! cluster the coordinator and every peer, both ways, with the cluster
//! secret (each side pings the other with a signed request), the clocks
//! within the signature window, and every node on one labsync version.
//! `--cluster` checks every pair of nodes from here.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use labsync_agent::cluster::{ClusterConfig, SKEW, TO_COORDINATOR};
use labsync_agent::proto::{MemberSeen, NodeName, PingAsk, Pong, PROTOCOL, VERSION};
use labsync_agent::{Client, ClientError, DaemonConfig, Endpoint, GpuInventory};

use super::gib;
use crate::labd_config::{self, LabdFlags};

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// Fine.
    Ok,
    /// Works, with something to know.
    Warn,
    /// Will fail a job or the cluster: fix it.
    Fail,
}

/// One check's outcome.
#[derive(Clone, Debug)]
pub struct Check {
    /// What was checked.
    pub what: String,
    /// How it came out.
    pub mark: Mark,
    /// What was found.
    pub said: String,
    /// What to do (failures and warnings).
    pub fix: Option<String>,
}

impl Check {
    fn ok(what: impl Into<String>, said: impl Into<String>) -> Check {
        Check {
            what: what.into(),
            mark: Mark::Ok,
            said: said.into(),
            fix: None,
        }
    }

    fn fail(what: impl Into<String>, said: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            what: what.into(),
            mark: Mark::Fail,
            said: said.into(),
            fix: Some(fix.into()),
        }
    }

    fn warn(what: impl Into<String>, said: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            mark: Mark::Warn,
            ..Check::fail(what, said, fix)
        }
    }

    /// The check as printed: `ok    what: said`, and the fix under it.
    pub fn render(&self) -> String {
        let mark = match self.mark {
            Mark::Ok => "ok  ",
            Mark::Warn => "warn",
            Mark::Fail => "FAIL",
        };
        let mut s = format!("{mark}  {}: {}", self.what, self.said);
        if let Some(f) = &self.fix {
            s += &format!("\n      fix: {f}");
        }
        s
    }
}

/// The least free space a state or cache folder's disk may have.
const MIN_FREE: u64 = 1 << 30;
/// Clocks further apart than this are said (the window is [`SKEW`]).
const CLOCK_WARN_MS: i64 = 5_000;
/// How long one ping may take.
const PING_WAIT: Duration = Duration::from_secs(10);

/// The config a server's labd runs with (the unit's `--config`): what
/// `labd doctor` checks when given none.
const SERVER_CONFIG: &str = "/etc/labsync/labd.toml";

/// `KEY=VALUE` lines of an environment file as systemd reads one
/// (`EnvironmentFile=`): blank lines and `#` comments skipped, quotes
/// around a value taken off.
fn environment_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.strip_prefix("export ").unwrap_or(l).split_once('='))
        .map(|(k, v)| {
            let v = v.trim();
            let unquoted = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(v);
            (k.trim().to_string(), unquoted.to_string())
        })
        .collect()
}

/// `labd doctor`: prints each check; fails when one fails.
pub async fn doctor(flags: &LabdFlags, cluster: bool) -> Result<ExitCode> {
    let mut flags = flags.clone();
    // A server's labd runs with /etc/labsync/labd.toml: checked when no
    // other is named (not the defaults of a personal labd).
    if flags.config.is_none() && Path::new(SERVER_CONFIG).is_file() {
        flags.config = Some(SERVER_CONFIG.into());
    }
    let config = flags
        .config
        .as_ref()
        .map_or("no config file (the defaults)".to_string(), |p| {
            p.display().to_string()
        });
    println!("labd doctor: labsync {VERSION} (protocol {PROTOCOL}), {config}");
    // The store's keys, as labd.service gives them to labd: store.env beside
    // the config.
    let store_env = flags
        .config
        .as_ref()
        .and_then(|c| c.parent())
        .map(|d| d.join("store.env"))
        .filter(|f| f.is_file());
    let more_env = match &store_env {
        Some(f) => {
            println!(
                "  (the store's keys from {}, as labd.service reads them)",
                f.display()
            );
            environment_file(&std::fs::read_to_string(f).unwrap_or_default())
        }
        None => Vec::new(),
    };
    let flags = &flags;
    let mut checks = Vec::new();
    let settings = match labd_config::resolve_with(flags, &more_env) {
        Ok(s) => {
            checks.push(Check::ok(
                "config",
                format!("read; this node is {}", s.config.node_name),
            ));
            s
        }
        Err(e) => {
            checks.push(Check::fail(
                "config",
                format!("{e:#}"),
                "change what the message names; every key: docs/config.md",
            ));
            return Ok(finish(&checks));
        }
    };
    let cfg = &settings.config;
    checks.push(gpus(settings.inventory.clone(), cfg.inventory_deadline).await);
    checks.extend(cgroups(cfg));
    checks.push(store(cfg).await);
    checks.extend(disks(cfg));
    checks.push(secrets(flags.config.as_deref()));
    if let Some(c) = &cfg.cluster {
        checks.extend(cluster_checks(cfg, c, cluster).await);
    } else if cluster {
        checks.push(Check::fail(
            "cluster",
            "this labd is in no cluster: its config has no [cluster]",
            "labd init makes a cluster's configs (docs/install.md)",
        ));
    }
    Ok(finish(&checks))
}

/// Prints the checks and a summary; the exit code.
fn finish(checks: &[Check]) -> ExitCode {
    for c in checks {
        println!("{}", c.render());
    }
    let failed = checks.iter().filter(|c| c.mark == Mark::Fail).count();
    let warned = checks.iter().filter(|c| c.mark == Mark::Warn).count();
    match failed {
        0 => {
            println!("all {} checks passed ({warned} warning(s))", checks.len());
            ExitCode::SUCCESS
        }
        n => {
            println!("{n} of {} checks FAILED", checks.len());
            ExitCode::from(1)
        }
    }
}

async fn gpus(inventory: std::sync::Arc<dyn GpuInventory>, deadline: Duration) -> Check {
    let what = inventory.describe();
    let inv = inventory.clone();
    let read = tokio::time::timeout(
        deadline.max(Duration::from_secs(5)),
        tokio::task::spawn_blocking(move || inv.read()),
    )
    .await;
    let devices = Path::new("/dev/nvidia0").exists();
    match read {
        Err(_) => Check::fail(
            "GPUs",
            format!(
                "{what}: no answer in {} s",
                deadline.max(Duration::from_secs(5)).as_secs()
            ),
            "nvidia-smi will hang too: a wedged driver; reboot the node or reload the driver",
        ),
        Ok(Err(e)) => Check::fail(
            "GPUs",
            format!("{what}: {e}"),
            "see labd's log and nvidia-smi",
        ),
        Ok(Ok(Err(e))) => Check::fail(
            "GPUs",
            format!("{what}: {e}"),
            "nvidia-smi tells whether the driver answers; labd reads what it reads",
        ),
        Ok(Ok(Ok(list))) if list.is_empty() && devices => Check::fail(
            "GPUs",
            format!("{what}: none, but /dev/nvidia0 exists"),
            "NVML (libnvidia-ml.so.1) did not load: install the driver's NVML library \
             (Debian: libnvidia-ml1; it comes with the NVIDIA driver)",
        ),
        Ok(Ok(Ok(list))) if list.is_empty() => {
            Check::ok("GPUs", format!("{what}: jobs here run with --gpus 0"))
        }
        Ok(Ok(Ok(list))) => {
            let names: Vec<String> = list
                .iter()
                .map(|g| format!("{} {} ({})", g.index, g.name, gib(g.memory_total)))
                .collect();
            Check::ok(
                "GPUs",
                format!("{what}: {} GPU(s): {}", list.len(), names.join(", ")),
            )
        }
    }
}

fn cgroups(cfg: &DaemonConfig) -> Vec<Check> {
    match labsync_agent::probe_cgroups(&cfg.state_dir, cfg.job_limits) {
        Ok((_, said, unheld)) => {
            let mut v = vec![Check::ok("cgroups", said)];
            v.extend(unheld.into_iter().map(|why| {
                Check::warn(
                    "cgroups",
                    format!("jobs run without a limit: {why}"),
                    "enable the controller (cgroup v2: the parent's cgroup.subtree_control)",
                )
            }));
            v
        }
        Err(why) => vec![Check::fail(
            "cgroups",
            "jobs would run without cgroups (no memory or process limits, and processes that \
             leave a killed job's session survive it)",
            why,
        )],
    }
}

/// A probe object put, read back and deleted.
async fn store(cfg: &DaemonConfig) -> Check {
    let what = format!("store {}", cfg.store);
    let fix = "check store and s3_endpoint in the config, and the store's keys \
               (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY in /etc/labsync/store.env, which \
               labd.service reads; this shell's environment when run by hand)";
    let probe = async {
        let remote = labsync_store::Remote::open(&cfg.store, &cfg.store_options)
            .map_err(|e| format!("cannot open it: {e}"))?;
        let key = format!(
            "labsync-doctor/{}-{}-{}",
            cfg.node_name,
            std::process::id(),
            labsync_agent::cluster::now_ms()
        );
        let body = format!("labd doctor probe from {}", cfg.node_name).into_bytes();
        remote
            .put(&key, body.clone().into())
            .await
            .map_err(|e| format!("cannot write {key}: {e}"))?;
        let got = remote.get_at_most(&key, 1 << 16).await;
        let deleted = remote.delete(&key).await;
        let got = got.map_err(|e| format!("wrote {key} but cannot read it back: {e}"))?;
        if got[..] != body[..] {
            return Err(format!("{key} read back other bytes than were written"));
        }
        deleted.map_err(|e| format!("cannot delete {key}: {e}"))?;
        Ok::<_, String>(())
    };
    match tokio::time::timeout(Duration::from_secs(30), probe).await {
        Err(_) => Check::fail(&what, "no answer in 30 s", fix),
        Ok(Err(e)) => Check::fail(&what, e, fix),
        Ok(Ok(())) => Check::ok(&what, "a probe object written, read back and deleted"),
    }
}

fn disks(cfg: &DaemonConfig) -> Vec<Check> {
    [
        ("state folder", &cfg.state_dir, None),
        ("cache folder", &cfg.cache_dir, Some(cfg.cache_max)),
    ]
    .into_iter()
    .map(|(what, dir, cap)| {
        let name = format!("{what} {}", dir.display());
        match labsync_store::disk_space(dir) {
            None => Check::fail(
                &name,
                "its disk cannot be read",
                "create the folder, or give one on a mounted disk",
            ),
            Some((at, free, total)) => {
                let on = if at == *dir {
                    String::new()
                } else {
                    format!(" (not made yet; its disk is {}'s)", at.display())
                };
                judge_disk(name, &on, free, total, cap)
            }
        }
    })
    .collect()
}

/// A folder's disk with `free` of `total` bytes, holding up to `cap`.
fn judge_disk(name: String, on: &str, free: u64, total: u64, cap: Option<u64>) -> Check {
    if free < MIN_FREE {
        Check::fail(
            name,
            format!("{} free of {}{on}", gib(free), gib(total)),
            "free space on that disk, or move the folder to a larger one",
        )
    } else if let Some(cap) = cap.filter(|&c| c > total) {
        Check::fail(
            name,
            format!(
                "cache_max {} is more than the whole disk ({}){on}",
                gib(cap),
                gib(total)
            ),
            "lower cache_max below the disk's size, leaving room for the job folders",
        )
    } else {
        let capped = cap.map_or(String::new(), |c| format!(", cap {}", gib(c)));
        Check::ok(
            name,
            format!("{} free of {}{capped}{on}", gib(free), gib(total)),
        )
    }
}

/// The files that hold secrets, checked as labd checks them: private to
/// labd's user (labd refuses to start otherwise, which `resolve` said
/// already; this names what was checked).
fn secrets(config: Option<&Path>) -> Check {
    let Some(config) = config else {
        return Check::ok("secrets", "no config file: the personal labd's token only");
    };
    let Ok(file) = labd_config::read_file(config) else {
        return Check::fail(
            "secrets",
            "the config file cannot be read",
            "see config above",
        );
    };
    let mut named = vec![(config.to_path_buf(), file.holds_secrets())];
    named.extend(file.secret_files());
    let mut wrong = Vec::new();
    for (path, secret) in &named {
        if let Err(e) = labsync_agent::tokens::check_private(path, *secret) {
            wrong.push(e);
        }
    }
    if wrong.is_empty() {
        let list: Vec<String> = named.iter().map(|(p, _)| p.display().to_string()).collect();
        Check::ok(
            "secrets",
            format!("private to labd's user: {}", list.join(", ")),
        )
    } else {
        Check::fail(
            "secrets",
            wrong.join("; "),
            "chmod and chown as each message says",
        )
    }
}

/// A cluster client from this node to `to` at `addr`.
fn member_client(cfg: &DaemonConfig, c: &ClusterConfig, addr: &str, to: &str) -> Option<Client> {
    let ep: Endpoint = addr.parse().ok()?;
    Some(Client::for_cluster(ep, c.key.clone(), &cfg.node_name, to).with_tls(c.tls.clone()))
}

/// What to do about a failed ping, by what failed.
fn ping_fix(e: &ClientError, whom: &str) -> String {
    let text = e.to_string();
    match e {
        ClientError::Connect { .. } => format!(
            "is labd running on {whom} (systemctl status labd), and its port open to this \
             node (firewall)? Its address is [cluster] coordinator / advertise"
        ),
        ClientError::Tls { .. } => "give every node a certificate from the lab's CA for the \
                                    name or address the others dial (labd init makes them), \
                                    and [tls] ca the lab's CA"
            .into(),
        _ if text.contains("bad cluster signature") => {
            "the cluster secrets differ: copy the same cluster.secret to every node".into()
        }
        _ if text.contains("off this node's clock") => {
            "the clocks are too far apart: run NTP (chrony or systemd-timesyncd) on every node"
                .into()
        }
        _ if text.contains("speaks labsync protocol") => {
            "upgrade the older node (docs/install.md, upgrading a cluster)".into()
        }
        _ if text.contains("no answer in") => format!(
            "{whom} did not answer: it is down, or a firewall drops its port; check it is up \
             and reachable from here (ping it; nc -vz HOST PORT)"
        ),
        _ if text.contains("not this node") => {
            format!("the address dialled for {whom} reaches another node: fix [cluster] advertise")
        }
        _ => format!("see labd's log on {whom}"),
    }
}

/// One ping from here, with how far the other's clock is from this one's.
async fn ping(client: &Client, ask: &PingAsk) -> Result<(Pong, i64), ClientError> {
    let sent = labsync_agent::cluster::now_ms();
    let pong = match tokio::time::timeout(PING_WAIT, client.ping(ask)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ClientError::Protocol {
                endpoint: client.endpoint().to_string(),
                detail: format!("no answer in {} s", PING_WAIT.as_secs()),
            })
        }
    };
    let back = labsync_agent::cluster::now_ms();
    let off = pong.now_ms - (sent + back) / 2;
    Ok((pong, off))
}

fn clock_check(whom: &str, off_ms: i64) -> Check {
    let said = format!("{:.1} s from {whom}'s", off_ms as f64 / 1000.0);
    let fix = "run NTP (chrony or systemd-timesyncd) on every node";
    if off_ms.unsigned_abs() as u128 * 2 >= SKEW.as_millis() {
        Check::fail(
            "clock",
            format!(
                "{said}: requests between nodes are refused past {} s",
                SKEW.as_secs()
            ),
            fix,
        )
    } else if off_ms.abs() > CLOCK_WARN_MS {
        Check::warn("clock", said, fix)
    } else {
        Check::ok("clock", said)
    }
}

async fn cluster_checks(cfg: &DaemonConfig, c: &ClusterConfig, mesh: bool) -> Vec<Check> {
    let mut v = Vec::new();
    let me = cfg.node_name.clone();
    let coord_addr = c.coordinator.to_string();
    let what = format!("coordinator {coord_addr}");
    let Some(client) = member_client(cfg, c, &coord_addr, TO_COORDINATOR) else {
        v.push(Check::fail(
            &what,
            "no address",
            "fix [cluster] coordinator",
        ));
        return v;
    };
    let ask = PingAsk {
        reach: vec![(me.clone(), c.advertise.clone())],
        members: true,
    };
    let (pong, off) = match ping(&client, &ask).await {
        Ok(p) => p,
        Err(e) => {
            let fix = ping_fix(&e, &coord_addr);
            v.push(Check::fail(&what, e.to_string(), fix));
            return v;
        }
    };
    let coord = pong.node.clone();
    v.push(Check::ok(
        &what,
        format!(
            "{coord} answers this node's signature (labsync {})",
            pong.version
        ),
    ));
    v.push(clock_check(&coord, off));
    v.extend(reached_back(&coord, &pong));
    let members = pong.members.clone();
    if mesh {
        v.extend(mesh_checks(cfg, c, &members).await);
    } else {
        for m in members.iter().filter(|m| m.node != me && m.node != coord) {
            v.push(peer_check(cfg, c, m).await);
        }
    }
    v.push(versions(&me, &coord, &pong.version, &members));
    for r in &pong.refused {
        v.push(Check::fail(
            format!("node {}", r.node),
            format!("refused by the coordinator: {}", r.why),
            "upgrade the older node (docs/install.md, upgrading a cluster)",
        ));
    }
    v
}

/// Whether the pinged node reached every node it was asked to.
fn reached_back(from: &NodeName, pong: &Pong) -> Vec<Check> {
    pong.reached
        .iter()
        .map(|r| {
            let what = format!("{from} → {} at {}", r.node, r.addr);
            match &r.answer {
                Ok(_) => Check::ok(what, "reached, with the cluster secret"),
                Err(e) => Check::fail(
                    what,
                    e.clone(),
                    format!(
                        "{} must be reachable from {from} at that address: is its labd \
                         running, its port open to {from}, and [cluster] advertise right?",
                        r.node
                    ),
                ),
            }
        })
        .collect()
}

/// A peer both ways: this node pings it, and it pings this node back.
async fn peer_check(cfg: &DaemonConfig, c: &ClusterConfig, m: &MemberSeen) -> Check {
    let what = format!("peer {} at {}", m.node, m.addr);
    let Some(client) = member_client(cfg, c, &m.addr, &m.node) else {
        return Check::fail(&what, "no address", "fix its [cluster] advertise");
    };
    let ask = PingAsk {
        reach: vec![(cfg.node_name.clone(), c.advertise.clone())],
        members: false,
    };
    match ping(&client, &ask).await {
        Err(e) => {
            let fix = ping_fix(&e, &m.node);
            Check::fail(&what, format!("not reached from here: {e}"), fix)
        }
        Ok((pong, _)) => match pong.reached.first().map(|r| &r.answer) {
            Some(Ok(_)) => Check::ok(&what, "both ways, with the cluster secret"),
            Some(Err(e)) => Check::fail(
                &what,
                format!("reached from here, but it does not reach this node: {e}"),
                "open this node's port to it, and check this node's [cluster] advertise",
            ),
            None => Check::fail(&what, "it did not try this node", "see its labd's log"),
        },
    }
}

/// Every pair of nodes, from here: each node pings all the others.
async fn mesh_checks(cfg: &DaemonConfig, c: &ClusterConfig, members: &[MemberSeen]) -> Vec<Check> {
    let mut v = Vec::new();
    for m in members {
        if !m.up {
            v.push(Check::fail(
                format!("node {}", m.node),
                "down: no heartbeat lately",
                format!(
                    "start labd on {} (systemctl start labd) and see its log",
                    m.node
                ),
            ));
            continue;
        }
        let others: Vec<(NodeName, String)> = members
            .iter()
            .filter(|o| o.node != m.node)
            .map(|o| (o.node.clone(), o.addr.clone()))
            .collect();
        let what = format!("node {} at {}", m.node, m.addr);
        let Some(client) = member_client(cfg, c, &m.addr, &m.node) else {
            v.push(Check::fail(
                &what,
                "no address",
                "fix its [cluster] advertise",
            ));
            continue;
        };
        match ping(
            &client,
            &PingAsk {
                reach: others,
                members: false,
            },
        )
        .await
        {
            Err(e) => {
                let fix = ping_fix(&e, &m.node);
                v.push(Check::fail(&what, e.to_string(), fix));
            }
            Ok((pong, off)) => {
                let mut clock = clock_check(&m.node, off);
                clock.what = format!("clock of {}", m.node);
                v.push(Check::ok(
                    &what,
                    format!("answers (labsync {})", pong.version),
                ));
                if clock.mark != Mark::Ok {
                    v.push(clock);
                }
                v.extend(
                    reached_back(&m.node, &pong)
                        .into_iter()
                        .filter(|c| c.mark != Mark::Ok),
                );
                let reached = pong.reached.iter().filter(|r| r.answer.is_ok()).count();
                if reached == pong.reached.len() {
                    v.push(Check::ok(
                        format!("{} → the others", m.node),
                        format!("all {reached} reached"),
                    ));
                }
            }
        }
    }
    v
}

/// Every node on this binary's version, this node's running labd too.
fn versions(me: &NodeName, coord: &NodeName, coord_version: &str, members: &[MemberSeen]) -> Check {
    let mut others: Vec<String> = Vec::new();
    if coord_version != VERSION {
        others.push(format!("{coord} (coordinator) on {coord_version}"));
    }
    // This node's running labd too: a package upgraded under a labd that was
    // not restarted runs the old one.
    for m in members.iter().filter(|m| m.node != *coord) {
        if m.version != VERSION {
            let v = if m.version.is_empty() {
                "0.1.0"
            } else {
                &m.version
            };
            if m.node == *me {
                others.push(format!(
                    "this node's running labd is {v} (restart it: systemctl restart labd)"
                ));
            } else {
                others.push(format!("{} on {v}", m.node));
            }
        }
    }
    if others.is_empty() {
        Check::ok(
            "versions",
            format!(
                "every node on labsync {VERSION} ({} node(s))",
                members.len().max(1)
            ),
        )
    } else {
        Check::fail(
            "versions",
            format!("this node is on {VERSION}; {}", others.join(", ")),
            "finish the upgrade node by node (docs/install.md, upgrading a cluster)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(n: &str, v: &str) -> MemberSeen {
        MemberSeen {
            node: n.parse().unwrap(),
            addr: format!("https://{n}:7420"),
            version: v.into(),
            up: true,
        }
    }

    #[test]
    fn a_node_on_another_version_fails_naming_it() {
        let (me, co): (NodeName, NodeName) = ("gpu2".parse().unwrap(), "gpu1".parse().unwrap());
        let all = [
            member("gpu1", VERSION),
            member("gpu2", VERSION),
            member("gpu3", VERSION),
        ];
        assert_eq!(versions(&me, &co, VERSION, &all).mark, Mark::Ok);
        let old = [
            member("gpu1", VERSION),
            member("gpu2", VERSION),
            member("gpu3", ""),
        ];
        let c = versions(&me, &co, VERSION, &old);
        assert_eq!(c.mark, Mark::Fail);
        assert!(c.said.contains("gpu3 on 0.1.0"), "{}", c.said);
        assert!(c.render().contains("fix: finish the upgrade"));
    }

    #[test]
    fn a_node_whose_labd_was_not_restarted_after_an_upgrade_fails() {
        let (me, co): (NodeName, NodeName) = ("gpu2".parse().unwrap(), "gpu1".parse().unwrap());
        let all = [member("gpu1", VERSION), member("gpu2", "0.1.0")];
        let c = versions(&me, &co, VERSION, &all);
        assert_eq!(c.mark, Mark::Fail);
        assert!(c.said.contains("restart it"), "{}", c.said);
    }

    #[test]
    fn the_store_keys_are_read_as_systemd_reads_an_environment_file() {
        let env = environment_file(
            "# keys\nAWS_ACCESS_KEY_ID=labd\n\nAWS_SECRET_ACCESS_KEY=\"s e\"\nexport AWS_REGION='x'\n",
        );
        assert_eq!(
            env,
            [
                ("AWS_ACCESS_KEY_ID".to_string(), "labd".to_string()),
                ("AWS_SECRET_ACCESS_KEY".into(), "s e".into()),
                ("AWS_REGION".into(), "x".into())
            ]
        );
    }

    #[test]
    fn clocks_are_ok_then_said_then_failed_before_the_window() {
        assert_eq!(clock_check("gpu1", 200).mark, Mark::Ok);
        assert_eq!(clock_check("gpu1", -8_000).mark, Mark::Warn);
        let c = clock_check("gpu1", 31_000);
        assert_eq!(c.mark, Mark::Fail);
        assert!(c.render().contains("NTP"));
    }

    #[test]
    fn a_disk_without_room_or_smaller_than_the_cache_fails() {
        let dir = tempfile::tempdir().unwrap();
        let (at, free, total) =
            labsync_store::disk_space(&dir.path().join("not/made/yet")).unwrap();
        assert_eq!(at, dir.path());
        assert!(total >= free && total > 0);
        let g = 1u64 << 30;
        assert_eq!(
            judge_disk("c".into(), "", 100 * g, 200 * g, Some(150 * g)).mark,
            Mark::Ok
        );
        let full = judge_disk("c".into(), "", g / 2, 200 * g, None);
        assert_eq!(full.mark, Mark::Fail);
        assert!(full.said.contains("0.5 GiB free"), "{}", full.said);
        let big = judge_disk("c".into(), "", 100 * g, 200 * g, Some(500 * g));
        assert_eq!(big.mark, Mark::Fail);
        assert!(big.said.contains("cache_max 500.0 GiB"), "{}", big.said);
    }
}
