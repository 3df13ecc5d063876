//! The per-user labd that `labrun` starts when no other is configured (as
//! sccache starts its server), and the files it shares with `labrun`.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

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
    let bytes: [u8; 32] = rand::random();
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
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

/// `5m`, `30s`, `2h`, `90` (seconds) → seconds.
pub fn parse_duration(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 's')) => (&t[..i], 1),
        Some((i, 'm')) => (&t[..i], 60),
        Some((i, 'h')) => (&t[..i], 3600),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .with_context(|| format!("invalid duration {s:?}: write e.g. 30s, 5m or 1h"))?;
    Ok(n * mult)
}

/// This machine's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
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
        assert!(parse_duration("soon").is_err());
    }
}
