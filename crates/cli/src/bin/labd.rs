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
    #[arg(long, global = true, env = "LABD_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where to listen: unix:///path/labd.sock or http://ADDR:PORT
    #[arg(long, global = true, value_name = "ADDR")]
    listen: Option<String>,
    /// State folder: job database, logs, job folders [default: ~/.local/state/labsync/labd]
    #[arg(long, global = true, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Store URL (as for labsync)
    #[arg(long, global = true, env = "LABSYNC_STORE", value_name = "URL")]
    store: Option<String>,
    /// Node cache folder [default: ~/.cache/labsync]
    #[arg(long, global = true, env = "LABSYNC_CACHE", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Node cache size cap, e.g. 500G
    #[arg(long, global = true, env = "LABSYNC_CACHE_MAX", value_name = "SIZE")]
    cache_max: Option<String>,
    /// Pretend to have these GPUs, e.g. 4x11GiB (tests and demos; never a fallback)
    #[arg(long, global = true, value_name = "SPEC")]
    fake_gpus: Option<String>,
    /// TOML file that injects foreign processes or a hang into the fake GPUs
    #[arg(long, global = true, value_name = "FILE", requires = "fake_gpus")]
    fake_gpus_control: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

// Parsed once per run: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Make a cluster's files on the first server: the cluster secret, a
    /// lab CA and a certificate per node (TLS on), each node's labd.toml
    /// and the users' tokens file; prints what to copy to which node
    #[command(after_help = "\
Example, three nodes whose names resolve, the first coordinating:

  labd init --nodes gpu1,gpu2,gpu3 --store s3://lab-store/labsync \\
            --s3-endpoint http://10.0.0.5:9000 --admin ana

makes labsync-cluster/ (mode 700): ca/ (the lab's CA; its key signs node
certificates: keep it here or offline) and gpuN/etc/labsync/ for each node,
which goes to that node's /etc/labsync. Paths in each labd.toml are relative
to its folder. A node whose name does not resolve here needs --advertise
gpu2=10.0.0.12: init refuses names the other nodes could not dial.")]
    Init {
        /// Every node of the cluster, by name: gpu1,gpu2,gpu3
        #[arg(long, value_delimiter = ',', value_name = "NODES", required = true)]
        nodes: Vec<String>,
        /// The lab's store, every node's: s3://bucket/prefix, gs://, az://, file:///shared
        #[arg(long, value_name = "URL")]
        store: String,
        /// The store's S3 endpoint, where not AWS: http://10.0.0.5:9000
        #[arg(long, value_name = "URL")]
        s3_endpoint: Option<String>,
        /// The coordinating node [default: the first of --nodes]
        #[arg(long, value_name = "NODE")]
        coordinator: Option<String>,
        /// The port every labd listens on (TLS)
        #[arg(long, default_value_t = 7420)]
        port: u16,
        /// How the others reach a node, where not by its name: gpu2=10.0.0.12 (repeat or comma-separate)
        #[arg(long, value_delimiter = ',', value_name = "NODE=ADDR")]
        advertise: Vec<String>,
        /// An admin (may read and kill every job); gets a token (repeatable)
        #[arg(long = "admin", value_name = "USER")]
        admins: Vec<String>,
        /// Where the files are written
        #[arg(long, default_value = "labsync-cluster", value_name = "DIR")]
        out: PathBuf,
        /// Where the files will live on each node
        #[arg(long, default_value = "/etc/labsync", value_name = "DIR")]
        etc: PathBuf,
        /// Each node's state folder
        #[arg(long, default_value = "/var/lib/labsync", value_name = "DIR")]
        node_state_dir: PathBuf,
        /// Each node's cache folder
        #[arg(long, default_value = "/var/cache/labsync", value_name = "DIR")]
        node_cache_dir: PathBuf,
        /// Each node's cache cap
        #[arg(long, default_value = "500G", value_name = "SIZE")]
        node_cache_max: String,
    },
    /// Check this node before its first job: GPUs (NVML), cgroups, the
    /// store (a probe object put, read back, deleted), disks, secrets'
    /// modes; in a cluster the coordinator and peers both ways with the
    /// secret, the clocks, and every node's version. Each failure prints its
    /// fix; exits 1 if any check fails
    Doctor {
        /// Check every pair of nodes of the cluster (from the coordinator)
        #[arg(long)]
        cluster: bool,
    },
    /// Issue a user a token in every node's tokens file (labd reads it again:
    /// no restart) and print the lines of their ~/.config/labsync/config.toml
    Adduser {
        /// Their Unix login name (jobs run as it on every node)
        name: String,
        /// The folder `labd init` made
        #[arg(long, default_value = "labsync-cluster", value_name = "DIR")]
        dir: PathBuf,
        /// Give a user who has a token a new one (the old one stops working)
        #[arg(long)]
        replace: bool,
    },
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

/// Prints what a command says, or its error.
fn said(r: anyhow::Result<String>) -> ExitCode {
    match r {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("labd: error: {}", labsync_cli::said_error(&e));
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    // `labd keep-log <job>`: a job's output keeper, started by labd.
    labsync_agent::keep_log_if_asked();
    let cli = Cli::parse();
    match &cli.cmd {
        Some(Cmd::Init {
            nodes,
            store,
            s3_endpoint,
            coordinator,
            port,
            advertise,
            admins,
            out,
            etc,
            node_state_dir,
            node_cache_dir,
            node_cache_max,
        }) => {
            let args = commands::init::InitArgs {
                nodes: nodes.clone(),
                coordinator: coordinator.clone(),
                store: store.clone(),
                s3_endpoint: s3_endpoint.clone(),
                port: *port,
                advertise: advertise.clone(),
                admins: admins.clone(),
                out: out.clone(),
                etc: etc.clone(),
                state_dir: node_state_dir.clone(),
                cache_dir: node_cache_dir.clone(),
                cache_max: node_cache_max.clone(),
            };
            return said(commands::init::init(&args));
        }
        Some(Cmd::Adduser { name, dir, replace }) => {
            return said(commands::init::adduser(dir, name, *replace));
        }
        _ => {}
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
    if let Some(Cmd::Doctor { cluster }) = cli.cmd {
        let Some(rt) = labsync_cli::start("labd", "LABD_LOG", "error") else {
            return ExitCode::from(1);
        };
        return match rt.block_on(commands::doctor::doctor(&flags, cluster)) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("labd: error: {}", labsync_cli::said_error(&e));
                ExitCode::from(1)
            }
        };
    }
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
                eprintln!("labd: error: {}", labsync_cli::said_error(&e));
                ExitCode::from(1)
            }
        };
    }
    let Some(rt) = labsync_cli::start("labd", "LABD_LOG", "info") else {
        return ExitCode::from(1);
    };
    let served = rt.block_on(async { commands::labd::labd(labd_config::resolve(&flags)?).await });
    match served {
        Ok(code) => code,
        Err(e) => {
            eprintln!("labd: error: {}", labsync_cli::said_error(&e));
            ExitCode::from(1)
        }
    }
}
