//! `labd`: the node daemon that owns a GPU server's GPUs and runs its jobs.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use labsync_agent::{
    current_user, detect, euid, serve, ConnLimits, Daemon, DaemonConfig, Endpoint, FakeGpus,
    GpuInventory, Listener, Secret,
};
use labsync_cli::local::{hostname, load_or_create_token, LocalLabd};
use labsync_cli::{parse_size, Overrides, Settings};
use serde::Deserialize;

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

Jobs then run as the Unix user their token names.";

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
}

/// labd's config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LabdFile {
    listen: Option<String>,
    state_dir: Option<PathBuf>,
    node_name: Option<String>,
    store: Option<String>,
    cache_dir: Option<PathBuf>,
    cache_max: Option<String>,
    /// Cap on materialised trees of code and data (default: cache_max).
    trees_max: Option<String>,
    s3_endpoint: Option<String>,
    s3_region: Option<String>,
    /// How outputs pushes compress compressible chunks: `lz4` or `zstd`.
    compression: Option<String>,
    fake_gpus: Option<String>,
    fake_gpus_control: Option<PathBuf>,
    /// A GPU with more than this held by foreign processes is not free (default 256M).
    foreign_limit: Option<String>,
    inventory_deadline_ms: Option<u64>,
    kill_grace_s: Option<u64>,
    outputs_every_s: Option<u64>,
    /// First wait before a failed final outputs push is tried again (doubles, up to 10 min).
    outputs_retry_s: Option<u64>,
    /// Seconds a job's working folder stays after it ended (default: one day).
    work_keep_s: Option<u64>,
    /// Cap on one job's log on disk, e.g. `100M` (default); head and tail are kept.
    log_max: Option<String>,
    /// `submitter` (default; only when root) or `labd`.
    run_as: Option<String>,
    #[serde(default)]
    admins: Vec<String>,
    #[serde(default)]
    tokens: BTreeMap<String, Secret>,
    tick_ms: Option<u64>,
    /// Connections open at once, everyone together (default 1024).
    max_connections: Option<usize>,
    /// Connections open at once from one Unix user or address (default 128).
    max_connections_per_user: Option<usize>,
    /// A connection that sends no whole request head for this long is closed (default 10000).
    header_timeout_ms: Option<u64>,
    /// Jobs one user may have queued at once (default 1000).
    max_queued_per_user: Option<usize>,
}

fn load(cli: &Cli) -> Result<(DaemonConfig, Endpoint, Arc<dyn GpuInventory>)> {
    let file: LabdFile = match &cli.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read config file {}", p.display()))?;
            let file: LabdFile = toml::from_str(&text)
                .with_context(|| format!("invalid config file {}", p.display()))?;
            check_private(p, !file.tokens.is_empty())?;
            file
        }
        None => LabdFile::default(),
    };
    let env: Vec<(String, String)> = std::env::vars().collect();
    let settings = Settings::resolve(
        &Overrides {
            store: cli.store.clone().or(file.store.clone()),
            cache_dir: cli.cache_dir.clone().or(file.cache_dir.clone()),
            cache_max: cli.cache_max.clone().or(file.cache_max.clone()),
            s3_endpoint: file.s3_endpoint.clone(),
            s3_region: file.s3_region.clone(),
            compression: file.compression.clone(),
            ..Default::default()
        },
        &env,
    )?;
    let local = match cli.state_dir.clone().or(file.state_dir.clone()) {
        Some(d) => LocalLabd::at(&d),
        None => LocalLabd::for_user()?,
    };
    let listen = match cli.listen.clone().or(file.listen.clone()) {
        Some(l) => l.parse::<Endpoint>().map_err(anyhow::Error::msg)?,
        None => Endpoint::Unix(local.socket()),
    };
    let me = current_user();
    if let Some((user, _)) = file
        .tokens
        .iter()
        .find(|(_, t)| t.expose().trim().len() < 16)
    {
        bail!("the token of {user} in the config file is shorter than 16 characters; use a long random one (e.g. openssl rand -hex 32)");
    }
    let mut tokens: Vec<(String, Secret)> = file.tokens.into_iter().collect();
    let own = local.token_file();
    let own_token = load_or_create_token(&own)?;
    check_private(&own, true)?;
    tokens.push((me.clone(), own_token.into()));
    for (i, (a, ta)) in tokens.iter().enumerate() {
        if let Some((b, _)) = tokens[i + 1..].iter().find(|(_, tb)| tb == ta) {
            bail!(
                "{a} and {b} have the same token: each user needs a token of their own \
                 (jobs run as the user the token names)"
            );
        }
    }
    if file.tick_ms == Some(0) {
        bail!("tick_ms = 0: labd would reap and schedule in a busy loop; use e.g. 100");
    }
    let mut admins = file.admins;
    admins.push(me);
    let run_as_submitter = match file.run_as.as_deref() {
        None | Some("submitter") => true,
        Some("labd") => false,
        Some(o) => bail!("run_as = {o:?}: write \"submitter\" or \"labd\""),
    };
    if !run_as_submitter && euid() == 0 && tokens.len() > 1 {
        tracing::warn!("run_as = \"labd\" as root: every token holder's jobs run as root");
    }
    let inventory: Arc<dyn GpuInventory> = match cli.fake_gpus.clone().or(file.fake_gpus) {
        Some(spec) => {
            let control = cli.fake_gpus_control.clone().or(file.fake_gpus_control);
            Arc::new(FakeGpus::new(&spec, control)?)
        }
        None => Arc::from(detect()),
    };
    let cfg = DaemonConfig {
        node_name: file.node_name.unwrap_or_else(hostname),
        state_dir: local.state_dir.clone(),
        store: settings.store,
        store_options: settings.store_options,
        cache_dir: settings.cache_dir,
        cache_max: settings.cache_max,
        compression: settings.compression,
        trees_max: match file.trees_max {
            Some(s) => parse_size(&s)?,
            None => settings.cache_max,
        },
        foreign_limit: match file.foreign_limit {
            Some(s) => parse_size(&s)?,
            None => 256 << 20,
        },
        inventory_deadline: Duration::from_millis(file.inventory_deadline_ms.unwrap_or(2000)),
        kill_grace: Duration::from_secs(file.kill_grace_s.unwrap_or(10)),
        outputs_every: Duration::from_secs(file.outputs_every_s.unwrap_or(300)),
        outputs_retry: Duration::from_secs(file.outputs_retry_s.unwrap_or(10).clamp(1, 600)),
        work_keep: Duration::from_secs(file.work_keep_s.unwrap_or(86_400)),
        log_max: match file.log_max {
            Some(s) => parse_size(&s)?.max(64 << 10),
            None => 100 << 20,
        },
        run_as_submitter,
        tokens,
        admins,
        tick: Duration::from_millis(file.tick_ms.unwrap_or(100)),
        conn_limits: {
            let d = ConnLimits::default();
            ConnLimits {
                max: file.max_connections.unwrap_or(d.max).max(1),
                per_peer: file.max_connections_per_user.unwrap_or(d.per_peer).max(1),
                header_timeout: file
                    .header_timeout_ms
                    .map_or(d.header_timeout, |ms| Duration::from_millis(ms.max(100))),
            }
        },
        max_queued_per_user: file.max_queued_per_user.unwrap_or(1000),
    };
    Ok((cfg, listen, inventory))
}

/// Refuses a file others could change (they could give themselves a token,
/// or make jobs run as root) or, when it holds tokens, read.
fn check_private(path: &std::path::Path, holds_tokens: bool) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.uid() != euid() && meta.uid() != 0 {
        bail!(
            "{} belongs to uid {}, not to labd's user or root: its owner could give themselves \
             a token or make jobs run as labd; chown it",
            path.display(),
            meta.uid()
        );
    }
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 {
        bail!(
            "{} is writable by other users (mode {:o}): anyone could give themselves a token; \
             chmod go-w it",
            path.display(),
            mode & 0o777
        );
    }
    if holds_tokens && mode & 0o044 != 0 {
        bail!(
            "{} holds tokens and is readable by other users (mode {:o}): chmod 600 it",
            path.display(),
            mode & 0o777
        );
    }
    Ok(())
}

async fn bind(endpoint: &Endpoint, shared: bool) -> Result<Listener> {
    match endpoint {
        Endpoint::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
            if path.exists() {
                if tokio::net::UnixStream::connect(path).await.is_ok() {
                    bail!("another labd answers on {}", path.display());
                }
                // Left by a labd that died; nobody listens on it.
                std::fs::remove_file(path)
                    .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
            }
            let l = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("cannot listen on {}", path.display()))?;
            // A root labd serves every user (each with a token); a personal one only its owner.
            let mode = if shared { 0o666 } else { 0o600 };
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
            Ok(Listener::Unix(l))
        }
        Endpoint::Tcp(addr) => {
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            if !matches!(host, "127.0.0.1" | "localhost" | "[::1]") {
                tracing::warn!(
                    "listening on {addr} without TLS: tokens and job environments cross the \
                     network in clear; keep it on a trusted lab network or tunnel it (ssh -L)"
                );
            }
            Ok(Listener::Tcp(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
            ))
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let (cfg, listen, inventory) = load(&cli)?;
    tracing::info!(
        "labd {} on {}: store {}, cache {}, GPUs: {}",
        env!("CARGO_PKG_VERSION"),
        cfg.node_name,
        cfg.store,
        cfg.cache_dir.display(),
        inventory.describe()
    );
    let daemon = Daemon::open(cfg, inventory).await?;
    let listener = bind(&listen, euid() == 0).await?;
    tracing::info!("listening on {listen}");
    let shutdown = async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("stopping; running jobs keep running and are adopted at the next start");
    };
    serve(daemon, listener, shutdown).await?;
    if let Endpoint::Unix(p) = &listen {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(rt) = labsync_cli::start("labd", "LABD_LOG", "info") else {
        return ExitCode::from(1);
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("labd: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
