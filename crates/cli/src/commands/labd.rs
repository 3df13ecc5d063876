//! `labd`: serve this node's GPUs and jobs.

use std::os::unix::fs::PermissionsExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use labsync_agent::tls::ServerConfig;
use labsync_agent::{euid, serve, Daemon, Endpoint, Listener};

use crate::labd_config::LabdSettings;

/// Listens on `endpoint`: a Unix socket (stale ones replaced, mode 0666 for a
/// `shared` root labd, else 0600) or TCP: TLS with `tls`, else in clear
/// (with a warning off loopback).
async fn bind(
    endpoint: &Endpoint,
    shared: bool,
    tls: Option<&Arc<ServerConfig>>,
) -> Result<Listener> {
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
        Endpoint::Tcp(addr) | Endpoint::Tls(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            if let Some(config) = tls {
                return Ok(Listener::Tls(l, config.clone()));
            }
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
            if !matches!(host, "127.0.0.1" | "localhost" | "[::1]") {
                tracing::warn!(
                    "listening on {addr} without TLS: tokens, job environments and packs cross \
                     the network in clear; set [tls] (cert, key, ca), or keep it on a trusted lab \
                     network"
                );
            }
            Ok(Listener::Tcp(l))
        }
    }
}

/// Opens the daemon and serves its API on `s.listen` until SIGTERM or SIGINT;
/// running jobs keep running and the next start adopts them.
pub async fn labd(s: LabdSettings) -> Result<ExitCode> {
    let LabdSettings {
        config: cfg,
        listen,
        inventory,
        tls,
    } = s;
    tracing::info!(
        "labd {} on {}: store {}, cache {}, GPUs: {}",
        env!("CARGO_PKG_VERSION"),
        cfg.node_name,
        cfg.store,
        cfg.cache_dir.display(),
        inventory.describe()
    );
    let daemon = Daemon::open(cfg, inventory).await?;
    let listener = bind(&listen, euid() == 0, tls.as_ref()).await?;
    tracing::info!("listening on {listen}");
    let lost = Arc::new(AtomicBool::new(false));
    let shutdown = {
        let (daemon, lost) = (daemon.clone(), lost.clone());
        async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return std::future::pending().await;
            };
            let mut every = tokio::time::interval(STATE_CHECK);
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = int.recv() => break,
                    _ = every.tick() => {
                        let d = daemon.clone();
                        if let Some(why) = labsync_store::off_runtime(move || d.state_dir_lost()).await {
                            tracing::error!("{why}");
                            lost.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            }
            tracing::info!("stopping; running jobs keep running and are adopted at the next start");
        }
    };
    serve(daemon, listener, shutdown).await?;
    if lost.load(Ordering::Relaxed) {
        // The socket at that path may be a new labd's by now.
        return Ok(ExitCode::FAILURE);
    }
    if let Endpoint::Unix(p) = &listen {
        let _ = std::fs::remove_file(p);
    }
    Ok(ExitCode::SUCCESS)
}

/// How often labd checks that its state folder is still the one it locked.
const STATE_CHECK: std::time::Duration = std::time::Duration::from_secs(5);
