//! Users' tokens: the config's own, and a tokens file (`tokens_file`, what
//! `labd init` and `labd adduser` write) that is read again whenever it
//! changes, so adding a user needs no restart.
//!
//! A tokens file that turns bad while labd runs (too short a token, two
//! users with one token, a mode others can read) is refused as at start, and
//! the last good set stays in force: a typo never locks every user out, and
//! never lets anyone in.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::secret::Secret;
use crate::users::euid;

/// Refuses a file others could change (they could give themselves a token,
/// or make jobs run as root) or, when it holds secrets, read.
pub fn check_private(path: &Path, holds_secrets: bool) -> Result<(), String> {
    let meta =
        std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if meta.uid() != euid() && meta.uid() != 0 {
        return Err(format!(
            "{} belongs to uid {}, not to labd's user or root: its owner could give themselves \
             a token or make jobs run as labd; chown it",
            path.display(),
            meta.uid()
        ));
    }
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(format!(
            "{} is writable by other users (mode {:o}): anyone could give themselves a token; \
             chmod go-w it",
            path.display(),
            mode & 0o777
        ));
    }
    if holds_secrets && mode & 0o044 != 0 {
        return Err(format!(
            "{} holds tokens or a key and is readable by other users (mode {:o}): chmod 600 it",
            path.display(),
            mode & 0o777
        ));
    }
    Ok(())
}

/// Reads a tokens file: `user = "token"` lines (TOML), private to labd's
/// user.
pub fn read_tokens_file(path: &Path) -> Result<BTreeMap<String, Secret>, String> {
    check_private(path, true)?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read tokens file {}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| {
        format!(
            "tokens file {}: {e}(each line is user = \"token\")",
            path.display()
        )
    })
}

/// Refuses a short token, or one token given to two users: jobs run as the
/// user a token names.
pub fn check_tokens(tokens: &[(String, Secret)]) -> Result<(), String> {
    if let Some((user, _)) = tokens.iter().find(|(_, t)| t.expose().trim().len() < 16) {
        return Err(format!(
            "the token of {user} is shorter than 16 characters; use a long random one \
             (labd adduser {user} makes one)"
        ));
    }
    for (i, (a, ta)) in tokens.iter().enumerate() {
        if let Some((b, _)) = tokens[i + 1..].iter().find(|(_, tb)| tb == ta) {
            return Err(format!(
                "{a} and {b} have the same token: each user needs a token of their own \
                 (jobs run as the user the token names)"
            ));
        }
    }
    Ok(())
}

/// What a file looked like when it was last read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Stamp {
    mtime: (i64, i64),
    ctime: (i64, i64),
    len: u64,
    ino: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
        len: m.len(),
        ino: m.ino(),
    })
}

struct Loaded {
    stamp: Option<Stamp>,
    /// BLAKE3 of each token: comparing hashes is constant-time and keeps no
    /// token in memory.
    hashed: Vec<(blake3::Hash, String)>,
}

/// Every token labd accepts.
pub struct Tokens {
    fixed: Vec<(String, Secret)>,
    file: Option<PathBuf>,
    loaded: Mutex<Loaded>,
}

impl Tokens {
    /// The config's tokens and those of `file`, checked together.
    pub fn new(fixed: Vec<(String, Secret)>, file: Option<PathBuf>) -> Result<Tokens, String> {
        let t = Tokens {
            fixed,
            file,
            loaded: Mutex::new(Loaded {
                stamp: None,
                hashed: Vec::new(),
            }),
        };
        let loaded = t.read()?;
        *t.loaded.lock().unwrap_or_else(|p| p.into_inner()) = loaded;
        Ok(t)
    }

    fn read(&self) -> Result<Loaded, String> {
        let mut all = self.fixed.clone();
        let mut seen = None;
        if let Some(f) = &self.file {
            seen = stamp(f);
            // A user may hold tokens in both (labd's own user always has
            // the one labd made); one token for two users is refused below.
            all.extend(read_tokens_file(f)?);
        }
        check_tokens(&all)?;
        let hashed = all
            .iter()
            .map(|(u, t)| (blake3::hash(t.expose().as_bytes()), u.clone()))
            .collect();
        Ok(Loaded {
            stamp: seen,
            hashed,
        })
    }

    /// Reads the tokens file again if it changed since it was last read; a
    /// bad one is logged and the last good set kept.
    fn refresh(&self) {
        let Some(f) = &self.file else { return };
        let now = stamp(f);
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if now == loaded.stamp {
            return;
        }
        match self.read() {
            Ok(fresh) => {
                tracing::info!(
                    "read {} again: {} token(s) in force",
                    f.display(),
                    fresh.hashed.len()
                );
                *loaded = fresh;
            }
            Err(e) => {
                // Remember the bad file so it is not read (and logged) again
                // for every request until it changes once more.
                tracing::warn!("{e}; the tokens read before stay in force");
                loaded.stamp = now;
            }
        }
    }

    /// The user `token` belongs to.
    pub fn user_of(&self, token: &str) -> Option<String> {
        self.refresh();
        let h = blake3::hash(token.as_bytes());
        let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        // Every entry is compared (blake3::Hash's `==` is constant-time).
        let mut found = None;
        for (t, user) in &loaded.hashed {
            if *t == h {
                found = Some(user.clone());
            }
        }
        found
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("fixed", &self.fixed)
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        // A new file each time, as an editor or `labd adduser` writes one:
        // the stamp changes even within one clock tick.
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    #[test]
    fn a_user_added_to_the_tokens_file_is_let_in_without_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tokens.toml");
        write(&f, "ana = \"tok-ana-0123456789abcdef\"\n");
        let fixed = vec![("root".to_string(), Secret::new("tok-root-0123456789"))];
        let t = Tokens::new(fixed, Some(f.clone())).unwrap();
        assert_eq!(
            t.user_of("tok-ana-0123456789abcdef").as_deref(),
            Some("ana")
        );
        assert_eq!(t.user_of("tok-root-0123456789").as_deref(), Some("root"));
        assert_eq!(t.user_of("tok-bob-0123456789abcdef"), None);

        write(
            &f,
            "ana = \"tok-ana-0123456789abcdef\"\nbob = \"tok-bob-0123456789abcdef\"\n",
        );
        assert_eq!(
            t.user_of("tok-bob-0123456789abcdef").as_deref(),
            Some("bob")
        );

        // A token taken away stops working.
        write(&f, "bob = \"tok-bob-0123456789abcdef\"\n");
        assert_eq!(t.user_of("tok-ana-0123456789abcdef"), None);
        assert_eq!(
            t.user_of("tok-bob-0123456789abcdef").as_deref(),
            Some("bob")
        );
    }

    #[test]
    fn a_tokens_file_that_turns_bad_keeps_the_last_good_set() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tokens.toml");
        write(&f, "ana = \"tok-ana-0123456789abcdef\"\n");
        let t = Tokens::new(Vec::new(), Some(f.clone())).unwrap();
        // Two users with one token, then a short one, then one others may read.
        write(
            &f,
            "ana = \"tok-ana-0123456789abcdef\"\nbob = \"tok-ana-0123456789abcdef\"\n",
        );
        assert_eq!(
            t.user_of("tok-ana-0123456789abcdef").as_deref(),
            Some("ana")
        );
        write(&f, "eve = \"short\"\n");
        assert_eq!(t.user_of("short"), None);
        assert_eq!(
            t.user_of("tok-ana-0123456789abcdef").as_deref(),
            Some("ana")
        );
        write(&f, "eve = \"tok-eve-0123456789abcdef\"\n");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(t.user_of("tok-eve-0123456789abcdef"), None);
        assert_eq!(
            t.user_of("tok-ana-0123456789abcdef").as_deref(),
            Some("ana")
        );
    }

    #[test]
    fn a_bad_tokens_file_at_start_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tokens.toml");
        write(&f, "ana = \"tok-ana-0123456789abcdef\"\n");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Tokens::new(Vec::new(), Some(f.clone())).unwrap_err();
        assert!(e.contains("tokens.toml") && e.contains("chmod 600"), "{e}");
        write(&f, "ana = 12\n");
        let e = Tokens::new(Vec::new(), Some(f.clone())).unwrap_err();
        assert!(e.contains("user = \"token\""), "{e}");
        write(&f, "ana = \"tok-ana-0123456789abcdef\"\n");
        let fixed = vec![("bob".to_string(), Secret::new("tok-ana-0123456789abcdef"))];
        let e = Tokens::new(fixed, Some(f)).unwrap_err();
        assert!(e.contains("bob and ana have the same token"), "{e}");
    }
}
