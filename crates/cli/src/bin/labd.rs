//! `labd`: the node daemon that owns a GPU server's GPUs and runs its jobs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use labsync_cli::commands;
use labsync_cli::labd_config::{self, LabdFlags};

const LONG_ABOUT: &str = "\
The labsync node daemon: owns this machine's GPUs and runs labrun's jobs.

It leases GPUs so no two jobs share one by accident, keeps out GPUs that a
process it did not start is using (and shows that process), runs each job in
its own session with its code and read-only data materialised from the store,
pushes each job's --outputs back to the store as runs/<job-id>, and keeps its
state in a database so a restart adopts running jobs and frees dead ones.

With no configuration at all it listens on a Unix socket in
~/.local/state/labsync/labd/, uses the same store and cache as `labsync`,
reads the GPUs through NVML (none if the NVIDIA library is absent), and
accepts the token it writes next to the socket. labrun starts it this way
by itself when none is running.

A shared GPU server runs it as root with a config file, for example:

  listen = \"unix:///run/labsync/labd.sock\"   # or \"http://0.0.0.0:7420\"
  state_dir = \"/var/lib/labsync\"
  cache_dir = \"/var/cache/labsync\"
  store = \"s3://lab-store/labsync\"
  trees_max = \"500G\"                       # materialised code and data [cache cap]
  admins = [\"alice\"]
  [tokens]                                  # user = token (give each user theirs)
  alice = \"…\"
  bob = \"…\"

Jobs then run as the Unix user their token names.

Several GPU servers form a cluster by config alone: each labd listens on TCP
and names the coordinator and a shared secret; one of them coordinates:

  node_name = \"gpu2\"
  listen = \"0.0.0.0:7420\"
  [cluster]
  coordinator = \"http://gpu1:7420\"
  coordinate = false                        # true on gpu1
  secret_file = \"/etc/labsync/cluster.secret\" # the same 32+ characters on every node, mode 600
  heartbeat_ms = 1000
  down_after_ms = 10000                     # no heartbeat this long: node down

The coordinator orders its queue by the lab's rules (all optional):

  [lab]
  max_gpus_per_user = 8                     # GPUs one user may run at once
  fair_share_half_life_days = 7             # GPU time used counts half after this
  [lab.users]                               # tiers: lead, deadline, phd, master, undergrad
  carol = \"lead\"                            # (anyone not named: the lowest)
  alice = \"phd\"
  [lab.grants]                              # labrun --priority deadline until the end
  alice = \"2026-12-20\"                      # of that day (UTC); then it lapses

Where the lab runs Slurm (labrun --backend slurm), each Slurm node's labd
is named as Slurm names it, `labd slurm-config` prints the slurm.conf lines,
and the coordinator may re-rank labsync's pending Slurm jobs as caches
change (it runs Slurm's client commands):

  [slurm]
  rerank_s = 30                             # seconds between passes; 0: never
  timeout_s = 10                            # each Slurm command

labrun status against the coordinator then shows every node. With TLS, the
TCP port speaks only TLS and every address is https:// (coordinator too):

  [tls]
  cert = \"/etc/labsync/tls/gpu2.pem\"        # this node's certificate
  key = \"/etc/labsync/tls/gpu2.key\"         # its key, mode 600
  ca = \"/etc/labsync/tls/lab-ca.pem\"        # checks the other nodes

Without [tls], tokens, jobs, heartbeats and pack bytes cross the network in
clear (the cluster secret never does).";

#[derive(Parser, Debug)]
#[command(name = "labd", version, about = "The labsync node daemon", long_about = LONG_ABOUT)]
struct Cli {
    /// Config file (TOML; see above)
    #[arg(long, env = "LABD_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where to listen: unix:///path/labd.sock or http://ADDR:PORT
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// State folder: job database, logs, job folders [default: ~/.local/state/labsync/labd]
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Store URL (as for labsync)
    #[arg(long, env = "LABSYNC_STORE", value_name = "URL")]
    store: Option<String>,
    /// Node cache folder [default: ~/.cache/labsync]
    #[arg(long, env = "LABSYNC_CACHE", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Node cache size cap, e.g. 500G
    #[arg(long, env = "LABSYNC_CACHE_MAX", value_name = "SIZE")]
    cache_max: Option<String>,
    /// Pretend to have these GPUs, e.g. 4x11GiB (tests and demos; never a fallback)
    #[arg(long, value_name = "SPEC")]
    fake_gpus: Option<String>,
    /// TOML file that injects foreign processes or a hang into the fake GPUs
    #[arg(long, value_name = "FILE", requires = "fake_gpus")]
    fake_gpus_control: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Print the slurm.conf lines labsync needs (a feature per node, lsn_NODE,
    /// for labrun --backend slurm to prefer), for every node Slurm lists
    SlurmConfig {
        /// These nodes instead of asking Slurm (gpu1,gpu2)
        #[arg(long, value_delimiter = ',', value_name = "NODES")]
        nodes: Vec<String>,
        /// Longest wait for Slurm's answer, e.g. 10s
        #[arg(long, default_value = "10s", value_name = "DURATION")]
        timeout: String,
    },
}

fn main() -> ExitCode {
    // `labd keep-log <job>`: a job's output keeper, started by labd.
    labsync_agent::keep_log_if_asked();
    let cli = Cli::parse();
    if let Some(Cmd::SlurmConfig { nodes, timeout }) = &cli.cmd {
        let Some(rt) = labsync_cli::start("labd", "LABD_LOG", "error") else {
            return ExitCode::from(1);
        };
        let done = rt.block_on(async {
            let t = labsync_cli::local::parse_duration(timeout)?;
            labsync_cli::slurm::config::slurm_config(
                nodes,
                std::time::Duration::from_secs(t.max(1)),
            )
            .await
        });
        return match done {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("labd: error: {e:#}");
                ExitCode::from(1)
            }
        };
    }
    let flags = LabdFlags {
        config: cli.config,
        listen: cli.listen,
        state_dir: cli.state_dir,
        store: cli.store,
        cache_dir: cli.cache_dir,
        cache_max: cli.cache_max,
        fake_gpus: cli.fake_gpus,
        fake_gpus_control: cli.fake_gpus_control,
    };
    let Some(rt) = labsync_cli::start("labd", "LABD_LOG", "info") else {
        return ExitCode::from(1);
    };
    let served = rt.block_on(async { commands::labd::labd(labd_config::resolve(&flags)?).await });
    match served {
        Ok(code) => code,
        Err(e) => {
            eprintln!("labd: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
