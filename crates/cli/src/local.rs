//! The per-user labd that `labrun` starts when no other is configured (as
//! sccache starts its server), the files it shares with `labrun`, and how
//! `labrun` finds the labd to talk to.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use labsync_agent::{Client, Endpoint, Secret};

use crate::Settings;

/// The system labd's socket; used when it exists and nothing else is configured.
pub const SYSTEM_SOCKET: &str = "/run/labsync/labd.sock";

/// Where the per-user labd keeps its state, socket and token.
#[derive(Clone, Debug)]
pub struct LocalLabd {
    /// State folder (`~/.local/state/labsync/labd`).
    pub state_dir: PathBuf,
}

impl LocalLabd {
    /// The current user's.
    pub fn for_user() -> Result<LocalLabd> {
        let base = dirs::state_dir()
            .or_else(|| dirs::home_dir().map(|h| h.join(".local").join("state")))
            .context("no state directory (set HOME)")?;
        Ok(LocalLabd {
            state_dir: base.join("labsync").join("labd"),
        })
    }

    /// In a given state folder.
    pub fn at(state_dir: &Path) -> LocalLabd {
        LocalLabd {
            state_dir: state_dir.to_path_buf(),
        }
    }

    /// Its socket.
    pub fn socket(&self) -> PathBuf {
        self.state_dir.join("labd.sock")
    }

    /// The token of the user who runs it.
    pub fn token_file(&self) -> PathBuf {
        self.state_dir.join("token")
    }

    /// Its log, when `labrun` started it.
    pub fn log_file(&self) -> PathBuf {
        self.state_dir.join("labd.log")
    }
}

/// A new random token (or secret): 32 random bytes in hex.
pub fn random_token() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads the token in `path`, creating a random one (mode 0600) if there is none.
pub fn load_or_create_token(path: &Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => return Ok(t.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let token = random_token();
    // Written under a name of its own, then linked into place: of two
    // labds starting at once, one token wins and both read it back.
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    {
        use std::io::Write;
        let mut f = std::fs::File::options()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.write_all(token.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(token),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let t = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(t.trim().to_string())
        }
        Err(e) => Err(e).with_context(|| format!("cannot write {}", path.display())),
    }
}

/// `5m`, `30s`, `2h`, `2d`, `90` (seconds) → seconds.
pub fn parse_duration(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 's')) => (&t[..i], 1),
        Some((i, 'm')) => (&t[..i], 60),
        Some((i, 'h')) => (&t[..i], 3600),
        Some((i, 'd')) => (&t[..i], 86_400),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .with_context(|| format!("invalid duration {s:?}: write e.g. 30s, 5m, 1h or 2d"))?;
    n.checked_mul(mult)
        .with_context(|| format!("invalid duration {s:?}: too long"))
}

/// This machine's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Finds labd, starting the personal one if nothing else is configured
/// (then also returned, so its store can be checked against the settings).
///
/// labd is `labd` (a flag or LABRUN_LABD), else the config's, else the
/// system socket, else the personal one; the token is LABRUN_TOKEN, else
/// the config's, else the personal labd's own.
pub async fn connect(
    labd: Option<String>,
    s: &Settings,
    quiet: bool,
) -> Result<(Client, Option<LocalLabd>)> {
    let token = std::env::var("LABRUN_TOKEN")
        .ok()
        .map(Secret::from)
        .or(s.token.clone());
    if let Some(addr) = labd.or(s.labd.clone()) {
        return Ok((client_of(&addr, token, s)?, None));
    }
    if Path::new(SYSTEM_SOCKET).exists() {
        return Ok((
            Client::new(Endpoint::Unix(SYSTEM_SOCKET.into()), token),
            None,
        ));
    }
    let local = LocalLabd::for_user()?;
    let probe = Client::new(Endpoint::Unix(local.socket()), None);
    if !probe.healthy().await {
        start_local(&local, s, quiet).await?;
    }
    let token = match token {
        Some(t) => t,
        None => std::fs::read_to_string(local.token_file())
            .with_context(|| format!("cannot read labd's token {}", local.token_file().display()))?
            .trim()
            .to_string()
            .into(),
    };
    let client = Client::new(Endpoint::Unix(local.socket()), Some(token));
    Ok((client, Some(local)))
}

/// A client of the labd at `addr` (`http://`, `https://` or a socket); an
/// `https://` one's certificate is checked against the settings' CA, or the
/// system's roots.
pub fn client_of(addr: &str, token: Option<Secret>, s: &Settings) -> Result<Client> {
    let ep: Endpoint = addr.parse().map_err(anyhow::Error::msg)?;
    let tls = match (&ep, &s.labd_ca) {
        (Endpoint::Tls(_), Some(ca)) => {
            Some(labsync_agent::tls::client(Some(ca)).map_err(anyhow::Error::msg)?)
        }
        _ => None,
    };
    Ok(Client::new(ep, token).with_tls(tls))
}

/// Starts the personal labd in the background and waits until it answers.
async fn start_local(local: &LocalLabd, s: &Settings, quiet: bool) -> Result<()> {
    let exe = std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("labd"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("labd"));
    std::fs::create_dir_all(&local.state_dir)
        .with_context(|| format!("cannot create {}", local.state_dir.display()))?;
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(local.log_file())
        .with_context(|| format!("cannot open {}", local.log_file().display()))?;
    if !quiet {
        eprintln!(
            "labrun: starting labd in the background (log: {})",
            local.log_file().display()
        );
    }
    let mut child = std::process::Command::new(&exe)
        .arg("--state-dir")
        .arg(&local.state_dir)
        .arg("--store")
        .arg(&s.store)
        .arg("--cache-dir")
        .arg(&s.cache_dir)
        .arg("--cache-max")
        .arg(s.cache_max.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a Ctrl-C at labrun's terminal must not reach it.
        .process_group(0)
        .spawn()
        .with_context(|| {
            format!(
                "cannot start {} (is labd installed next to labrun?)",
                exe.display()
            )
        })?;
    let probe = Client::new(Endpoint::Unix(local.socket()), None);
    let t = Instant::now();
    loop {
        if probe.healthy().await {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            // Another labrun may have started one at the same moment.
            if probe.healthy().await {
                return Ok(());
            }
            let tail = std::fs::read_to_string(local.log_file()).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            bail!(
                "labd exited ({status}) at start:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!(
                "labd did not answer within 30 s; see {}",
                local.log_file().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_created_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s/token");
        let t = load_or_create_token(&p).unwrap();
        assert_eq!(t.len(), 64);
        assert_eq!(load_or_create_token(&p).unwrap(), t);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5m").unwrap(), 300);
        assert_eq!(parse_duration("30s").unwrap(), 30);
        assert_eq!(parse_duration("2h").unwrap(), 7200);
        assert_eq!(parse_duration("90").unwrap(), 90);
        assert_eq!(parse_duration("2d").unwrap(), 172_800);
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("999999999999999999d").is_err());
    }
}
