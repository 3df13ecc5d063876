//! The versions a user has seen, and the snapshot each named then.
//!
//! Every member can write every key of the store, so a version record
//! (`refs/NAME/@/000000000N`) can be overwritten to name another snapshot
//! (a `torch.save` pickle of the writer's own runs code when loaded). A
//! version is immutable by design: once this user pulled `div2k@v3` as
//! snapshot X, `div2k@v3` naming Y later is refused as rewritten, saying
//! which key, instead of being followed. Kept per user in the node cache
//! (`seen-v1/<store>/<uid>`), one line per version: `NAME@vN HEX`.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::id::SnapshotId;
use crate::version::{version_key, VersionRecord};

/// The most of a memory file read (a million versions and more).
const MAX_SEEN_BYTES: u64 = 128 << 20;

/// What one user has seen of one store's versions.
#[derive(Debug)]
pub struct SeenVersions {
    path: PathBuf,
    known: Mutex<HashMap<String, SnapshotId>>,
}

impl SeenVersions {
    /// This user's memory of store `store_id` in the node cache at
    /// `cache_dir`: per uid, so users sharing a cache never share it.
    pub fn in_cache(cache_dir: &std::path::Path, store_id: &str) -> SeenVersions {
        let uid = rustix::process::geteuid().as_raw();
        SeenVersions::open(
            cache_dir
                .join("seen-v1")
                .join(store_id)
                .join(uid.to_string()),
        )
    }

    /// The memory kept in `path` (read now; a missing or unreadable file is
    /// an empty memory: it is a defence, not something a pull needs).
    pub fn open(path: PathBuf) -> SeenVersions {
        let mut known = HashMap::new();
        let small = std::fs::metadata(&path).is_ok_and(|m| m.len() <= MAX_SEEN_BYTES);
        if let Some(text) = small.then(|| std::fs::read_to_string(&path).ok()).flatten() {
            for line in text.lines() {
                let Some((label, id)) = line.split_once(' ') else {
                    continue;
                };
                if let Ok(id) = id.parse::<SnapshotId>() {
                    // The first seen is what the version was.
                    known.entry(label.to_string()).or_insert(id);
                }
            }
        }
        SeenVersions {
            path,
            known: Mutex::new(known),
        }
    }

    /// Refuses `rec` if its version was seen naming another snapshot.
    pub fn check(&self, rec: &VersionRecord) -> Result<()> {
        let label = rec.label();
        let before = self
            .known
            .lock()
            .expect("seen poisoned")
            .get(&label)
            .copied();
        match before {
            Some(id) if id != rec.snapshot => Err(Error::Rewritten {
                key: version_key(&rec.name, rec.version),
                label,
                expected: id.to_string(),
                found: rec.snapshot.to_string(),
                seen: format!("you last used it (remembered in {})", self.path.display()),
            }),
            _ => Ok(()),
        }
    }

    /// [`SeenVersions::check`], then remembers `rec` if it is new.
    pub fn check_and_note(&self, rec: &VersionRecord) -> Result<()> {
        self.check(rec)?;
        let label = rec.label();
        let mut known = self.known.lock().expect("seen poisoned");
        if known.contains_key(&label) {
            return Ok(());
        }
        known.insert(label.clone(), rec.snapshot);
        drop(known);
        if let Err(e) = self.append(&format!("{label} {}\n", rec.snapshot)) {
            tracing::debug!("cannot remember {label} in {}: {e}", self.path.display());
        }
        Ok(())
    }

    fn append(&self, line: &str) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // One write of one short line with O_APPEND: concurrent pulls of
        // this user never interleave within a line.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&self.path)?
            .write_all(line.as_bytes())
    }
}
