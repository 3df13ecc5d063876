//! Snapshots materialised once per node, read-only, and shared by every job
//! that uses them; and each job's working folder built over its code tree.
//!
//! A tree lives at `<cache>/trees-v2/<snapshot-id>`: pulled into a temporary
//! folder, made read-only (files `a-w`, folders `a-w`), then renamed into
//! place, so a half-made tree is never seen and a crash leaves only a
//! temporary folder that the next attempt removes. A job's working folder
//! holds links to the top level of its code tree (folders as symlinks, files
//! as hard links), so starting a job costs one link per top-level entry, not
//! one copy per file, however many files the code has; the `--outputs`
//! folder is made real (and the job's own) along its path.
//!
//! Trees are bounded like the rest of the node cache: each has a small
//! record (`<snapshot-id>.json`: bytes, last use), and [`Trees::evict`]
//! removes the least recently used trees that no active job uses until the
//! rest fit the budget.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use labsync_store::{
    CacheWrites, NoProgress, NodeCache, Pull, PullOptions, RefSpec, Repo, RunAs, SnapshotId,
};
use serde::{Deserialize, Serialize};

use crate::blocking::off_runtime;
use crate::error::PrepareError;
use crate::leases::unix_now;
use crate::proto::TreeRef;

/// What the node knows of one materialised tree.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct TreeRecord {
    /// Bytes of its files.
    bytes: u64,
    /// Last time a job was given it (Unix seconds).
    used_at: u64,
    /// Every byte of the tree was on the disk before it got its name: a
    /// power cut cannot have left it with files of zeros. Trees made
    /// before labd synced them have none, and are trusted only in the boot
    /// that made them (see [`Trees::get`]).
    #[serde(default)]
    durable: bool,
}

/// The snapshots whose trees are materialised in the node cache at
/// `cache_root`, with their bytes (as their records say): what `labsync
/// cache status` adds to the packs, and heartbeats tell the coordinator.
pub fn materialised_trees(cache_root: &Path) -> Vec<(SnapshotId, u64)> {
    materialised_in(&cache_root.join(TREES_DIR))
}

/// The folder of the trees in a node cache.
pub const TREES_DIR: &str = "trees-v2";

fn materialised_in(root: &Path) -> Vec<(SnapshotId, u64)> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut v: Vec<(SnapshotId, u64)> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str()?.parse::<SnapshotId>().ok())
        .map(|id| {
            let rec: TreeRecord = std::fs::read(root.join(format!("{id}.json")))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            (id, rec.bytes)
        })
        .collect();
    v.sort();
    v
}

/// The node's shared read-only trees.
pub struct Trees {
    root: PathBuf,
    /// When this machine booted (Unix seconds): a tree not known durable
    /// that changed before it may have lost data in a power cut.
    booted: i64,
    /// One materialisation per snapshot at a time; the others wait for it.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Sizes of trees not materialised, as their snapshot objects say
    /// ([`Trees::size`]).
    claimed: Mutex<HashMap<String, u64>>,
}

impl Trees {
    /// Trees under `cache`'s folder.
    pub fn new(cache: &NodeCache) -> Result<Trees, PrepareError> {
        // v1 trees were made before modes were masked and may hold setuid
        // bits from the store. None is handed to a new job again, but jobs
        // that outlived the upgrade may still run on them (and their
        // working folders hard-link their files): the bits are stripped in
        // place, and the folder stays for the admin to remove.
        let old = cache.root().join("trees-v1");
        if old.is_dir() {
            let passed = strip_setid_bits(&old, None)
                .map_err(PrepareError::io("strip setuid bits in", &old))?;
            if passed > 0 {
                tracing::warn!(
                    "{passed} entries of {} could not be looked at for setuid bits; remove \
                     that folder once no job runs on it",
                    old.display()
                );
            }
        }
        let root = cache.root().join(TREES_DIR);
        std::fs::create_dir_all(&root).map_err(PrepareError::io("create", &root))?;
        // Jobs run as their submitters must be able to reach the trees.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
            .map_err(PrepareError::io("chmod", &root))?;
        for e in std::fs::read_dir(&root).map_err(PrepareError::io("read", &root))? {
            let e = e.map_err(PrepareError::io("read", &root))?;
            if e.file_name().to_string_lossy().starts_with(".trash-") {
                remove_tree(&e.path()).map_err(PrepareError::io("remove", &e.path()))?;
            }
        }
        Ok(Trees {
            root,
            booted: boot_time(),
            locks: Mutex::new(HashMap::new()),
            claimed: Mutex::new(HashMap::new()),
        })
    }

    /// Where the tree of `snapshot` lives (materialised or not).
    pub fn path(&self, snapshot: &str) -> PathBuf {
        self.root.join(snapshot)
    }

    /// Bytes of the tree of `snapshot`: its record's where it is
    /// materialised, else what its snapshot object says (read once, then
    /// remembered).
    pub async fn size(&self, repo: &Repo, snapshot: &SnapshotId) -> Result<u64, PrepareError> {
        let name = snapshot.to_string();
        if let Some(b) = self.materialised_size(&name) {
            return Ok(b);
        }
        if let Some(b) = self.claimed.lock().expect("trees poisoned").get(&name) {
            return Ok(*b);
        }
        let bytes = repo.load_snapshot(snapshot).await?.bytes;
        self.claimed
            .lock()
            .expect("trees poisoned")
            .insert(name, bytes);
        Ok(bytes)
    }

    /// Bytes of the tree of `snapshot` as far as known without the store:
    /// materialised or sized before ([`Trees::size`]), else 0.
    pub fn known_size(&self, snapshot: &SnapshotId) -> u64 {
        let name = snapshot.to_hex();
        self.materialised_size(&name).unwrap_or_else(|| {
            let claimed = self.claimed.lock().expect("trees poisoned");
            claimed.get(&name).copied().unwrap_or(0)
        })
    }

    fn materialised_size(&self, snapshot: &str) -> Option<u64> {
        self.path(snapshot)
            .is_dir()
            .then(|| self.record(snapshot).bytes)
    }

    /// The tree of `tree`, materialised now unless it already is.
    pub async fn get(
        &self,
        repo: &Repo,
        cache: &NodeCache,
        tree: &TreeRef,
    ) -> Result<PathBuf, PrepareError> {
        // Only an id, spelt as ids are (64 lower-case hex digits, by its
        // type), becomes a folder name.
        let snapshot = tree.snapshot;
        let name = snapshot.to_hex();
        let dest = self.path(&name);
        let lock = self
            .locks
            .lock()
            .expect("trees poisoned")
            .entry(name.clone())
            .or_default()
            .clone();
        let _held = lock.lock().await;
        if dest.is_dir() {
            let mut rec = self.record(&name);
            if let Some(ok) = self.trusted(&dest, &mut rec).await {
                rec.used_at = unix_now();
                self.write_record(&name, &rec);
                return ok.map(|()| dest);
            }
            // Made in an earlier boot and never synced: a power cut may
            // have left it files of zeros at their size. No job of an
            // earlier boot still runs on it; it is made again.
            tracing::warn!(
                "tree {} of {} was made before this machine last booted and never synced to \
                 the disk: materialised again",
                tree.snapshot,
                tree.label
            );
            let trash = self.root.join(format!(".trash-{}", tree.snapshot));
            let d = dest.clone();
            off_runtime(move || std::fs::rename(&d, &trash).and_then(|_| remove_tree(&trash)))
                .await
                .map_err(PrepareError::io("remove", &dest))?;
        }
        let tmp = self.root.join(format!(".tmp-{}", tree.snapshot));
        let got = self.pull_beside(repo, cache, tree, snapshot, &tmp).await?;
        self.name_durably(&name, &tmp, &dest, got.bytes_written)
            .await?;
        Ok(dest)
    }

    /// Pulls `tree` into `tmp` (emptied first); the cache's copies of the
    /// packs are written after, beside the job.
    async fn pull_beside(
        &self,
        repo: &Repo,
        cache: &NodeCache,
        tree: &TreeRef,
        snapshot: SnapshotId,
        tmp: &Path,
    ) -> Result<labsync_store::PullOutcome, PrepareError> {
        let spec: RefSpec = tree.label.parse()?;
        if tmp.exists() {
            let t = tmp.to_path_buf();
            off_runtime(move || remove_tree(&t))
                .await
                .map_err(PrepareError::io("remove", tmp))?;
        }
        // Read-only to all as it is written: no second walk, and no path
        // that PATH_MAX would stop.
        let opts = PullOptions {
            threads: 4,
            delete: false,
            shared: true,
            expect: Some(snapshot),
        };
        // The job waits for its files, not for the cache's copies of the
        // packs they came from: those are written after.
        let writes = CacheWrites::new();
        let pulled = Pull::new(repo, cache, &spec, tmp)
            .options(opts)
            .progress(Arc::new(NoProgress))
            .writing_behind(&writes)
            .run()
            .await;
        let (c, label, started) = (cache.clone(), tree.label.clone(), std::time::Instant::now());
        tokio::spawn(async move {
            let done = writes.finish().await;
            if done.packs > 0 {
                tracing::info!(
                    "cached the packs of {label} {:.2} s after its files: {} packs ({} rebuilt \
                     from the files), {} bytes{}",
                    started.elapsed().as_secs_f64(),
                    done.packs,
                    done.rebuilt,
                    done.bytes,
                    match done.failed {
                        0 => String::new(),
                        n => format!(" ({n} could not be written)"),
                    }
                );
            }
            let evicted = off_runtime(move || c.enforce_cap(Some(snapshot))).await;
            for gone in evicted.unwrap_or_default() {
                tracing::info!("evicted {gone} from the node cache (over its size cap)");
            }
        });
        let got = pulled?;
        tracing::info!(
            "materialised {} in {:.2} s: {} files, {} bytes; {} packs ({} bytes) fetched",
            tree.label,
            got.seconds,
            got.files_written,
            got.bytes_written,
            got.packs_fetched,
            got.bytes_fetched
        );
        Ok(got)
    }

    /// Names the pulled tree `tmp` as `dest`, read-only, and records it.
    /// Every file's data was synced before its rename (by the pull);
    /// its folders and names are too before the tree gets its name, and
    /// that name before the record says so: after a power cut the tree is
    /// whole, or absent and made again.
    async fn name_durably(
        &self,
        snapshot: &str,
        tmp: &Path,
        dest: &Path,
        bytes: u64,
    ) -> Result<(), PrepareError> {
        let (t, d, root) = (tmp.to_path_buf(), dest.to_path_buf(), self.root.clone());
        off_runtime(move || {
            set_mode(&t, |m| m & 0o1777 & !0o222 | 0o555)?;
            sync_file_system(&t)?;
            std::fs::rename(&t, &d)?;
            std::fs::File::open(&root)?.sync_all()
        })
        .await
        .map_err(PrepareError::io("make read-only and sync", dest))?;
        let rec = TreeRecord {
            bytes,
            used_at: unix_now(),
            durable: true,
        };
        self.write_record(snapshot, &rec);
        Ok(())
    }

    /// Whether the materialised tree at `dest` can be handed out: one known
    /// durable, or one made since this machine booted (what it wrote is
    /// still in memory or on the disk), which is synced now and recorded
    /// durable. `None` for a tree to make again.
    async fn trusted(&self, dest: &Path, rec: &mut TreeRecord) -> Option<Result<(), PrepareError>> {
        if rec.durable {
            return Some(Ok(()));
        }
        use std::os::unix::fs::MetadataExt;
        let changed = std::fs::symlink_metadata(dest).ok()?.ctime();
        if changed < self.booted {
            return None;
        }
        let d = dest.to_path_buf();
        let synced = off_runtime(move || sync_file_system(&d)).await;
        rec.durable = synced.is_ok();
        Some(synced.map_err(PrepareError::io("sync", dest)))
    }

    /// The snapshots materialised here, with their trees' bytes.
    pub fn materialised(&self) -> Vec<(SnapshotId, u64)> {
        materialised_in(&self.root)
    }

    fn record(&self, snapshot: &str) -> TreeRecord {
        std::fs::read(self.root.join(format!("{snapshot}.json")))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    fn write_record(&self, snapshot: &str, rec: &TreeRecord) {
        let path = self.root.join(format!("{snapshot}.json"));
        let json = serde_json::to_vec(rec).expect("record serialises");
        // Eviction order and trust depend on it: a lost record makes a tree
        // look old, and one made before the last boot is made again.
        if labsync_store::write_atomic(&path, &json).is_err() {
            tracing::warn!("cannot write {}", path.display());
        }
    }

    /// Removes least recently used trees that are not in use until the rest
    /// take at most `budget` bytes. Returns the snapshots removed.
    ///
    /// `in_use` is asked under the tree's own lock, after the job that wants
    /// a tree has been recorded and before [`Trees::get`] hands it out: a
    /// tree cannot go between a job being given it and the job being seen.
    pub fn evict(&self, budget: u64, in_use: &dyn Fn(&str) -> bool) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut trees: Vec<(String, TreeRecord)> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .map(|n| {
                let r = self.record(&n);
                (n, r)
            })
            .collect();
        let mut total: u64 = trees.iter().map(|(_, r)| r.bytes).sum();
        trees.sort_by_key(|(_, r)| r.used_at);
        let mut removed = Vec::new();
        for (snap, rec) in trees {
            if total <= budget {
                break;
            }
            // Held while removing, so no job is handed a tree half gone.
            let lock = self
                .locks
                .lock()
                .expect("trees poisoned")
                .entry(snap.clone())
                .or_default()
                .clone();
            let Ok(_held) = lock.try_lock() else { continue };
            if in_use(&snap) {
                continue;
            }
            // Renamed away first: a crash mid-removal leaves a `.trash-`
            // folder (removed at the next start), never a partial tree under
            // the snapshot's name.
            let trash = self.root.join(format!(".trash-{snap}"));
            let removed_ok =
                std::fs::rename(self.root.join(&snap), &trash).and_then(|_| remove_tree(&trash));
            match removed_ok {
                Ok(()) => {
                    let _ = std::fs::remove_file(self.root.join(format!("{snap}.json")));
                    total = total.saturating_sub(rec.bytes);
                    removed.push(snap);
                }
                Err(e) => tracing::warn!("cannot remove tree {snap}: {e}"),
            }
        }
        removed
    }
}

/// Writes everything of the file system holding `path` to the disk
/// (`syncfs`): the folders and names of a tree of thousands, in one call.
fn sync_file_system(path: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    rustix::fs::syncfs(&f).map_err(std::io::Error::from)
}

/// When this machine booted, in Unix seconds (`btime` of `/proc/stat`);
/// 0 where that cannot be read (every tree then counts as this boot's).
fn boot_time() -> i64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn set_mode(path: &Path, f: impl Fn(u32) -> u32) -> std::io::Result<()> {
    let m = std::fs::symlink_metadata(path)?.permissions().mode();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(f(m)))
}

/// Clears setuid and setgid on every file and folder under `root`, through
/// descriptors only: each entry is opened without following a symlink
/// (`O_NOFOLLOW`; files also `O_NONBLOCK`, so a FIFO cannot block), checked
/// on that handle, and changed with `fchmod` on it. Folders of old trees
/// are not all root's alone (a pull that ended early left users' modes on
/// them), and a user who can rename in one could swap an entry for a
/// symlink between a look by path and a `chmod` by path, which follows
/// it: root would then change the mode of whatever it points to.
///
/// With `owner`, only files and folders that uid owns change, and only
/// files with one link (a copy, not a link a user made to someone else's
/// program). The walk stays on `root`'s file system, holds one descriptor
/// per level, and goes past an entry it cannot look at (a user's FUSE
/// mount, an entry swapped meanwhile): it returns how many it went past.
fn strip_setid_bits(root: &Path, owner: Option<u32>) -> std::io::Result<u64> {
    use rustix::fs::{fchmod, fstat, openat, AtFlags, Dir, FileType, Mode, OFlags, Stat};
    use std::os::fd::OwnedFd;
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let file_flags =
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let ours = |st: &Stat| {
        owner.is_none_or(|o| {
            o == st.st_uid
                && (FileType::from_raw_mode(st.st_mode) == FileType::Directory || st.st_nlink == 1)
        })
    };
    let strip = |fd: &OwnedFd, st: &Stat| -> std::io::Result<()> {
        if st.st_mode & 0o6000 != 0 && ours(st) {
            fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o7777 & !0o6000))?;
        }
        Ok(())
    };
    let names = |dir: &OwnedFd| -> std::io::Result<Vec<std::ffi::CString>> {
        let mut names = Vec::new();
        for ent in Dir::read_from(dir)? {
            let name = ent?.file_name().to_owned();
            if !matches!(name.to_bytes(), b"." | b"..") {
                names.push(name);
            }
        }
        Ok(names)
    };
    let top = rustix::fs::open(root, dir_flags, Mode::empty())?;
    let top_st = fstat(&top)?;
    strip(&top, &top_st)?;
    let mut passed = 0u64;
    // One frame per level: the folder, and its entries still to look at.
    let mut stack = vec![(names(&top)?, top)];
    while let Some((left, dir)) = stack.last_mut() {
        let Some(name) = left.pop() else {
            stack.pop();
            continue;
        };
        let st = match rustix::fs::statat(&*dir, &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(_) => {
                passed += 1;
                continue;
            }
        };
        let kind = FileType::from_raw_mode(st.st_mode);
        let flags = match kind {
            FileType::Directory if st.st_dev == top_st.st_dev => dir_flags,
            FileType::RegularFile if st.st_mode & 0o6000 != 0 && ours(&st) => file_flags,
            // A symlink is never followed; nothing else holds setid bits
            // that matter; another file system (a mount) is not walked.
            _ => continue,
        };
        let fd = match openat(&*dir, &name, flags, Mode::empty()) {
            Ok(fd) => fd,
            // Gone meanwhile.
            Err(rustix::io::Errno::NOENT) => continue,
            // Swapped for a symlink, or anything else: gone past.
            Err(_) => {
                passed += 1;
                continue;
            }
        };
        // The handle's own type: a swap for a FIFO or device is left alone.
        let st = fstat(&fd)?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory if st.st_dev == top_st.st_dev => {
                strip(&fd, &st)?;
                match names(&fd) {
                    Ok(n) => stack.push((n, fd)),
                    Err(_) => passed += 1,
                }
            }
            FileType::RegularFile => strip(&fd, &st)?,
            _ => {}
        }
    }
    Ok(passed)
}

/// Strips the setuid and setgid bits a labd from before modes were masked
/// left on root's copies in jobs' and stages' working folders
/// (`<state>/jobs/*/work`, `<state>/slurm/*/work`). It copied files of
/// its trees there where it could not hard-link them, modes and all, and
/// as root: a setuid file of the store became a setuid-root program in the
/// user's folder. Only root's files with one link and root's folders
/// change; the users' own keep their modes. Done once per state folder
/// (marked done there); returns how many entries it could not look at.
pub fn strip_old_setid_copies(state_dir: &Path) -> std::io::Result<u64> {
    let done = state_dir.join("old-copies-setid-stripped");
    if done.exists() {
        return Ok(0);
    }
    let mut passed = 0;
    for top in ["jobs", "slurm"] {
        let top = state_dir.join(top);
        let entries = match std::fs::read_dir(&top) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for e in entries {
            let e = e?;
            // Only labd makes entries here; a symlink is not followed all
            // the same.
            if !e.file_type()?.is_dir() {
                continue;
            }
            let work = e.path().join("work");
            // The walk opens nothing through a symlink, `work` included.
            match strip_setid_bits(&work, Some(crate::euid())) {
                Ok(n) => passed += n,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                    ) => {}
                Err(_) => passed += 1,
            }
        }
    }
    std::fs::write(&done, "")?;
    Ok(passed)
}

/// Removes a tree that was made read-only for sharing (at any depth, no
/// symlink below `root` followed).
pub fn remove_tree(root: &Path) -> std::io::Result<()> {
    labsync_store::remove_tree(root)
}

/// Removes a job's (or a stage's) folder: root's, holding root's files and
/// `work`, its user's. What is in `work` is removed with that user's
/// rights, not root's: a user who moved someone else's folder into theirs
/// (from a group-writable project folder, say) makes the removal fail, to
/// be tried again, instead of having root delete what they could not.
/// `work` itself, emptied, and the rest go as root; `work` refilled
/// meanwhile is left for the next try.
pub fn remove_job_folder(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let work = dir.join("work");
    if let Ok(md) = std::fs::symlink_metadata(&work) {
        if md.is_dir() && md.uid() != crate::euid() {
            labsync_store::empty_tree_as(
                &work,
                Some(RunAs {
                    uid: md.uid(),
                    gid: md.gid(),
                }),
            )?;
            std::fs::remove_dir(&work)?;
        }
    }
    remove_tree(dir)
}

/// The longest `--outputs` path (`PATH_MAX`): the path is kept with the
/// job, heartbeated and logged.
pub const MAX_OUTPUTS_BYTES: usize = 4096;

/// Checks an `--outputs` path: relative, inside the working folder.
pub fn check_outputs(path: &str) -> Result<(), crate::JobError> {
    outputs_inside(path).map_err(crate::JobError::Invalid)
}

fn outputs_inside(path: &str) -> Result<(), String> {
    if path.len() > MAX_OUTPUTS_BYTES {
        return Err(format!(
            "--outputs of {} bytes: at most {MAX_OUTPUTS_BYTES} (a path's limit)",
            path.len()
        ));
    }
    let p = Path::new(path);
    if path.is_empty() || p.is_absolute() {
        return Err(format!(
            "--outputs {path:?} must be a folder relative to the code folder, e.g. ckpt/"
        ));
    }
    if p.components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(format!("--outputs {path:?} must not contain '..'"));
    }
    Ok(())
}

/// Builds a job's working folder at `work`: the top level of `code` linked
/// in, the `outputs` folder real along its path, all handed to `owner`.
///
/// labd runs this as root, and the job's user must never turn it into a
/// chown of something else. So `work` must be new, and stays writable by
/// labd alone (0700, root's) until the hand-over: nothing the user plants
/// can be inside while it is built. The hand-over then changes owners
/// through handles opened without following symlinks, deepest first and
/// `work` last, so even a user who could write into a folder the moment it
/// is theirs can only swap names, never redirect a chown.
pub fn make_workdir(
    code: Option<&Path>,
    work: &Path,
    outputs: Option<&str>,
    owner: Option<RunAs>,
) -> Result<(), PrepareError> {
    build_workdir(code, work, outputs, owner, &|| {})
}

/// [`make_workdir`], with `before_hand_over` run between building and
/// handing over (where tests play the attacker).
fn build_workdir(
    code: Option<&Path>,
    work: &Path,
    outputs: Option<&str>,
    owner: Option<RunAs>,
    before_hand_over: &dyn Fn(),
) -> Result<(), PrepareError> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(parent) = work.parent() {
        std::fs::create_dir_all(parent).map_err(PrepareError::io("create", parent))?;
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(work)
        .map_err(PrepareError::io(
            "create (a job's folder is always new)",
            work,
        ))?;
    let mut own = vec![open_dir_nofollow(work)?];
    // The symlinks this build made to folders of the code tree: the only
    // ones ever followed to make outputs real.
    let mut made = HashMap::new();
    if let Some(code) = code {
        link_children(code, work, &mut made)?;
    }
    if let Some(out) = outputs {
        check_outputs(out).map_err(|e| PrepareError::Outputs(out.into(), e.to_string()))?;
        let mut dir = work.to_path_buf();
        for c in Path::new(out).components() {
            let Component::Normal(name) = c else { continue };
            dir.push(name);
            match std::fs::symlink_metadata(&dir) {
                Ok(m) if m.file_type().is_symlink() => {
                    // A folder of the code tree: make it real, its entries
                    // linked. Only a link this build made to a real folder
                    // of the tree is followed. A symlink that came with the
                    // code could point anywhere, and labd may be root: a
                    // check of its text let `<code>/../../home/bob` through
                    // (`..` is a component like any other to starts_with),
                    // and `<code>/m` where the code's own `m` leads out.
                    let Some(target) = made.get(&dir).cloned() else {
                        return Err(PrepareError::Outputs(
                            out.into(),
                            format!("{} is a symlink in the code", dir.display()),
                        ));
                    };
                    std::fs::remove_file(&dir).map_err(PrepareError::io("unlink", &dir))?;
                    std::fs::create_dir(&dir).map_err(PrepareError::io("create", &dir))?;
                    link_children(&target, &dir, &mut made)?;
                }
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(PrepareError::Outputs(
                        out.into(),
                        format!("{} is a file in the code", dir.display()),
                    ))
                }
                Err(_) => std::fs::create_dir(&dir).map_err(PrepareError::io("create", &dir))?,
            }
            own.push(open_dir_nofollow(&dir)?);
        }
    }
    before_hand_over();
    if let Some(RunAs { uid, gid }) = owner {
        for (d, f) in own.iter().rev() {
            std::os::unix::fs::fchown(f, Some(uid), Some(gid))
                .map_err(PrepareError::io("hand over", d))?;
        }
    }
    Ok(())
}

/// A handle on the folder `path` itself, refusing a symlink in its place.
fn open_dir_nofollow(path: &Path) -> Result<(PathBuf, std::fs::File), PrepareError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(PrepareError::io("open (no symlinks)", path))?;
    Ok((path.to_path_buf(), f))
}

/// Links the entries of folder `from` (of the code tree) into `to`: a
/// folder as a symlink to it (recorded in `made`, link → folder), a
/// symlink as a copy of it (never followed), a plain file as a hard link
/// (a copy on another file system). Anything else (a FIFO, a device) is
/// left out: opened as root to be copied, a FIFO blocks and a device
/// node acts.
fn link_children(
    from: &Path,
    to: &Path,
    made: &mut HashMap<PathBuf, PathBuf>,
) -> Result<(), PrepareError> {
    for entry in std::fs::read_dir(from).map_err(PrepareError::io("read", from))? {
        let entry = entry.map_err(PrepareError::io("read", from))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        // The entry's own type: a symlink is not followed.
        let ft = entry.file_type().map_err(PrepareError::io("stat", &src))?;
        let res = if ft.is_dir() {
            std::os::unix::fs::symlink(&src, &dst).map(|()| {
                made.insert(dst.clone(), src.clone());
            })
        } else if ft.is_symlink() {
            std::fs::read_link(&src).and_then(|t| std::os::unix::fs::symlink(t, &dst))
        } else if ft.is_file() {
            // A hard link shares the read-only inode; another file system gets a copy.
            std::fs::hard_link(&src, &dst).or_else(|_| std::fs::copy(&src, &dst).map(drop))
        } else {
            Ok(())
        };
        res.map_err(PrepareError::io("link", &dst))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job's folder is emptied with its user's rights: what another user
    /// owns in it (moved in by the job's user) stops the removal and is
    /// kept; the user's own read-only folders go.
    #[test]
    fn a_job_folder_is_emptied_as_its_user_and_keeps_what_is_not_theirs() {
        use std::os::unix::fs::{chown, PermissionsExt};
        if crate::euid() != 0 {
            eprintln!("not root: cannot give files to other users");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("j1");
        let work = job.join("work");
        std::fs::create_dir_all(work.join("mine/deep")).unwrap();
        std::fs::create_dir_all(work.join("theirs")).unwrap();
        std::fs::write(work.join("mine/deep/f"), b"x").unwrap();
        std::fs::write(work.join("theirs/keep"), b"k").unwrap();
        std::fs::write(job.join("stage.json"), b"{}").unwrap();
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for p in [
            &work,
            &work.join("mine"),
            &work.join("mine/deep"),
            &work.join("mine/deep/f"),
        ] {
            chown(p, Some(65534), Some(65534)).unwrap();
        }
        // The user's own folder, read-only: still theirs to remove.
        mode(&work.join("mine/deep"), 0o555);
        // Another user's folder and file, as in a group project folder.
        for p in [work.join("theirs"), work.join("theirs/keep")] {
            chown(&p, Some(4321), Some(4321)).unwrap();
        }
        mode(&work.join("theirs"), 0o775);
        mode(&work, 0o700);

        let e = remove_job_folder(&job).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert_eq!(std::fs::read(work.join("theirs/keep")).unwrap(), b"k");
        assert!(job.join("stage.json").exists(), "nothing removed as root");

        // Once it is gone (its owner took it back), the folder goes.
        std::fs::remove_dir_all(work.join("theirs")).unwrap();
        remove_job_folder(&job).unwrap();
        assert!(!job.exists());
    }

    #[test]
    fn workdir_links_the_top_level_and_makes_outputs_real() {
        let dir = tempfile::tempdir().unwrap();
        let code = dir.path().join("code");
        std::fs::create_dir_all(code.join("pkg/ckpt")).unwrap();
        std::fs::write(code.join("train.py"), "print(1)").unwrap();
        std::fs::write(code.join("pkg/m.py"), "x = 1").unwrap();
        std::fs::write(code.join("pkg/ckpt/keep"), "").unwrap();
        // Read-only, as a materialised tree is.
        for (p, mode) in [
            ("pkg/ckpt/keep", 0o444),
            ("pkg/m.py", 0o444),
            ("train.py", 0o444),
        ]
        .into_iter()
        .chain([("pkg/ckpt", 0o555), ("pkg", 0o555)])
        {
            std::fs::set_permissions(code.join(p), std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let work = dir.path().join("work");
        make_workdir(Some(&code), &work, Some("pkg/ckpt/new"), None).unwrap();
        assert_eq!(
            std::fs::read_to_string(work.join("train.py")).unwrap(),
            "print(1)"
        );
        assert_eq!(
            std::fs::read_to_string(work.join("pkg/m.py")).unwrap(),
            "x = 1"
        );
        for d in ["pkg", "pkg/ckpt", "pkg/ckpt/new"] {
            let m = std::fs::symlink_metadata(work.join(d)).unwrap();
            assert!(m.is_dir() && !m.file_type().is_symlink(), "{d} is real");
        }
        assert!(work.join("pkg/ckpt/keep").exists());
        std::fs::write(work.join("pkg/ckpt/new/model.pt"), "w").unwrap();
        assert!(!code.join("pkg/ckpt/new").exists(), "the tree is untouched");
        assert!(make_workdir(Some(&code), &dir.path().join("w2"), Some("train.py"), None).is_err());
        // A symlink that came with the code is never followed to make outputs.
        let code2 = dir.path().join("code2");
        std::fs::create_dir_all(&code2).unwrap();
        std::os::unix::fs::symlink("/etc", code2.join("ckpt")).unwrap();
        let e =
            make_workdir(Some(&code2), &dir.path().join("w3"), Some("ckpt/x"), None).unwrap_err();
        assert!(e.to_string().contains("is a symlink in the code"), "{e}");
        assert!(!Path::new("/etc/x").exists());
        // Nor one whose text starts with the code's path: through `..`, or
        // through a link of the code's own that leads out.
        let outside = dir.path().join("bob");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret"), "bob's").unwrap();
        let code3 = dir.path().join("code3");
        std::fs::create_dir_all(&code3).unwrap();
        std::os::unix::fs::symlink(code3.join("../bob"), code3.join("up")).unwrap();
        std::os::unix::fs::symlink(&outside, code3.join("m")).unwrap();
        std::os::unix::fs::symlink(code3.join("m"), code3.join("chain")).unwrap();
        for (k, link) in ["up", "chain"].into_iter().enumerate() {
            let w = dir.path().join(format!("w4-{k}"));
            let out = format!("{link}/o");
            let e = make_workdir(Some(&code3), &w, Some(&out), None).unwrap_err();
            assert!(
                e.to_string().contains("is a symlink in the code"),
                "{link}: {e}"
            );
            // Left as the code's symlink (whose target is the user's own
            // rights to reach), not made a real folder of bob's files.
            let kind = std::fs::symlink_metadata(w.join(link)).unwrap().file_type();
            assert!(
                kind.is_symlink(),
                "{link}: made real, bob's files linked in"
            );
            assert!(!outside.join("o").exists());
        }
        // Only plain files are linked or copied: a FIFO in a tree is left
        // out (opened as root to be copied, it would block).
        let code4 = dir.path().join("code4");
        std::fs::create_dir_all(code4.join("d")).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(code4.join("d/fifo"))
            .status()
            .unwrap();
        assert!(made.success());
        let w = dir.path().join("w5");
        make_workdir(Some(&code4), &w, Some("d/o"), None).unwrap();
        assert!(w.join("d/o").is_dir());
        assert!(
            std::fs::symlink_metadata(w.join("d/fifo")).is_err(),
            "a FIFO linked in"
        );
        assert!(check_outputs("../x").is_err() && check_outputs("/x").is_err());
        // `x////…` is `x` to Path, and megabytes of it were taken.
        let long = format!("x{}", "/".repeat(MAX_OUTPUTS_BYTES));
        assert!(check_outputs(&long)
            .unwrap_err()
            .to_string()
            .contains("at most 4096"));
        assert!(check_outputs(&long[..MAX_OUTPUTS_BYTES]).is_ok());
        remove_tree(&code).unwrap();
        assert!(!code.exists());
    }

    /// Trees made by a labd before modes were masked (trees-v1) lose their
    /// setuid and setgid bits at start, in place, hard links included, and
    /// stay for jobs that outlived the upgrade.
    #[test]
    fn old_trees_lose_setid_bits_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
        let old = cache.root().join("trees-v1/snap");
        std::fs::create_dir_all(old.join("d")).unwrap();
        std::fs::write(old.join("d/su"), "x").unwrap();
        std::fs::set_permissions(old.join("d/su"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::fs::set_permissions(old.join("d"), std::fs::Permissions::from_mode(0o2755)).unwrap();
        std::fs::hard_link(old.join("d/su"), dir.path().join("linked")).unwrap();
        // A symlink in an old tree (planted by a user who could write in a
        // folder of it) is not followed: what it points to keeps its mode.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, "x").unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o4755)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, old.join("d/planted")).unwrap();
        std::os::unix::fs::symlink(dir.path(), old.join("d/up")).unwrap();
        Trees::new(&cache).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&elsewhere), 0o4755, "a symlink was followed");
        assert_eq!(mode(&old.join("d/su")), 0o755);
        assert_eq!(mode(&old.join("d")), 0o755);
        assert_eq!(mode(&dir.path().join("linked")), 0o755, "the same inode");

        // Root's copies in working folders lose theirs once, the users'
        // own files keep theirs.
        let state = dir.path().join("state");
        let work = state.join("jobs/j1/work");
        let stage = state.join("slurm/s1/work/sub");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::create_dir_all(&stage).unwrap();
        std::fs::create_dir_all(state.join("jobs/j2")).unwrap();
        let setid = |p: &Path, m: u32| {
            std::fs::write(p, "x").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        };
        setid(&work.join("copy"), 0o4755);
        setid(&stage.join("copy"), 0o6755);
        let theirs = work.join("theirs");
        setid(&theirs, 0o4750);
        std::os::unix::fs::symlink(&elsewhere, work.join("planted")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, state.join("jobs/j3")).unwrap();
        let root = crate::euid() == 0;
        if root {
            // chown clears the bits: set again after.
            std::os::unix::fs::lchown(&theirs, Some(65534), Some(65534)).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o4750)).unwrap();
        }
        // A user's own hard link to root's setuid program (where
        // protected_hardlinks allows it) is not a copy: left alone.
        setid(&dir.path().join("program"), 0o4755);
        std::fs::hard_link(dir.path().join("program"), work.join("link")).unwrap();
        assert_eq!(strip_old_setid_copies(&state).unwrap(), 0);
        assert_eq!(
            mode(&work.join("link")),
            0o4755,
            "a linked program was changed"
        );
        assert_eq!(mode(&work.join("copy")), 0o755);
        assert_eq!(mode(&stage.join("copy")), 0o755);
        assert_eq!(mode(&elsewhere), 0o4755, "a symlink was followed");
        if root {
            assert_eq!(mode(&theirs), 0o4750, "a user's own file was changed");
        }
        // Once: a copy made later (by hand, here) is not looked for again.
        setid(&work.join("later"), 0o4755);
        strip_old_setid_copies(&state).unwrap();
        assert_eq!(mode(&work.join("later")), 0o4755);
    }

    /// Issue 19, point 1: a version whose paths go past `PATH_MAX` under the
    /// trees folder materialises for jobs, read-only to all as it is
    /// written, and is removed again when evicted.
    #[tokio::test]
    async fn a_tree_deeper_than_path_max_materialises_read_only_and_evicts() {
        use labsync_store::{push, PushOptions, Remote};
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        // 15 folders of 250 bytes; under trees-v2/<64 hex> the file's path
        // is past 4,096 bytes.
        let deep: PathBuf = (0..15)
            .map(|i| format!("{i:03}{}", "d".repeat(247)))
            .collect();
        std::fs::create_dir_all(src.join(&deep)).unwrap();
        std::fs::write(src.join(deep.join("weights.pt")), "w").unwrap();
        std::fs::write(src.join("train.py"), "print(1)").unwrap();
        std::fs::set_permissions(src.join("train.py"), std::fs::Permissions::from_mode(0o664))
            .unwrap();
        let cache = NodeCache::open(&dir.path().join("c".repeat(250)), 1 << 30).unwrap();
        let repo = Repo::open(Remote::local(&dir.path().join("store")).unwrap(), None)
            .await
            .unwrap();
        let opts = PushOptions::new("deep");
        let pushed = push(&repo, &src, &opts, Arc::new(NoProgress))
            .await
            .unwrap();
        let trees = Trees::new(&cache).unwrap();
        let tree = crate::proto::TreeRef {
            label: pushed.record.label(),
            snapshot: pushed.record.snapshot,
        };
        // The same id in capitals is the same id, so the same folder: a
        // folder is named by the id's spelling, not the request's.
        let shouted: crate::proto::TreeRef = serde_json::from_str(&format!(
            "{{\"label\":\"{}\",\"snapshot\":\"{}\"}}",
            tree.label,
            tree.snapshot.to_hex().to_uppercase()
        ))
        .unwrap();
        let path = trees.get(&repo, &cache, &shouted).await.unwrap();
        assert_eq!(path, trees.get(&repo, &cache, &tree).await.unwrap());
        assert_eq!(
            path.file_name().unwrap().to_str(),
            Some(&*tree.snapshot.to_hex())
        );
        let long = path.join(&deep).join("weights.pt");
        assert!(long.as_os_str().len() > 4096, "{}", long.as_os_str().len());
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&path.join("train.py")), 0o444);
        let top = path.join(deep.iter().next().unwrap());
        assert_eq!(mode(&top), 0o555);
        assert_eq!(mode(&path), 0o555);
        assert_eq!(trees.evict(0, &|_| false), vec![tree.snapshot.to_hex()]);
        assert!(!path.exists());
    }

    /// Issue 41, point 1: a tree is trusted only when it is known durable.
    /// One labd made before it synced trees, in an earlier boot, may hold
    /// files of zeros after a power cut: it is made again, not handed out.
    /// One made in this boot is synced and recorded durable; a new tree is
    /// recorded durable once synced.
    #[tokio::test]
    async fn a_tree_not_known_durable_from_before_the_boot_is_made_again() {
        use labsync_store::{push, PushOptions, Remote};
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("weights.pt"), "trained weights").unwrap();
        let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
        let repo = Repo::open(Remote::local(&dir.path().join("store")).unwrap(), None)
            .await
            .unwrap();
        let opts = PushOptions {
            threads: 1,
            ..PushOptions::new("w")
        };
        let pushed = push(&repo, &src, &opts, Arc::new(NoProgress))
            .await
            .unwrap();
        let mut trees = Trees::new(&cache).unwrap();
        let tree = crate::proto::TreeRef {
            label: pushed.record.label(),
            snapshot: pushed.record.snapshot,
        };
        let record = || trees_record(&cache, &tree.snapshot.to_hex());
        let path = trees.get(&repo, &cache, &tree).await.unwrap();
        assert!(record().durable, "a new tree is recorded durable");

        // What an older labd left: no word of durability, and what a power
        // cut left of the data.
        let file = path.join("weights.pt");
        std::fs::write(&file, vec![0u8; 15]).unwrap();
        let old = format!("{{\"bytes\":15,\"used_at\":{}}}", unix_now());
        let rec_path = cache
            .root()
            .join("trees-v2")
            .join(format!("{}.json", tree.snapshot));
        std::fs::write(&rec_path, &old).unwrap();
        // Made in this boot: trusted, synced, recorded durable.
        trees.booted = 0;
        trees.get(&repo, &cache, &tree).await.unwrap();
        assert!(record().durable);
        // Made before this boot: made again.
        std::fs::write(&rec_path, &old).unwrap();
        trees.booted = i64::MAX;
        let again = trees.get(&repo, &cache, &tree).await.unwrap();
        assert_eq!(
            std::fs::read(again.join("weights.pt")).unwrap(),
            b"trained weights"
        );
        assert!(record().durable);
        let mode = std::fs::metadata(&again).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o555);
    }

    fn trees_record(cache: &NodeCache, snapshot: &str) -> TreeRecord {
        let p = cache
            .root()
            .join("trees-v2")
            .join(format!("{snapshot}.json"));
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    }

    /// Issue 9, point 2: labd (root) hands the job's folders to its user.
    /// A path component swapped for a symlink to a root-owned folder during
    /// the hand-over must not make that folder the user's; and a folder that
    /// already exists (one the user may own) is never built on.
    #[test]
    fn the_hand_over_never_follows_a_symlink_planted_meanwhile() {
        use std::os::unix::fs::MetadataExt;
        if crate::users::euid() != 0 {
            eprintln!("not root: labd hands nothing over, nothing to test");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("root-only");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("secret"), "root's").unwrap();
        let work = dir.path().join("job/work");
        let nobody = Some(RunAs {
            uid: 65534,
            gid: 65534,
        });
        let swap = || {
            for p in ["out/deeper", "out"] {
                let p = work.join(p);
                std::fs::rename(&p, p.with_extension("moved")).unwrap();
                std::os::unix::fs::symlink(&victim, &p).unwrap();
            }
        };
        build_workdir(None, &work, Some("out/deeper"), nobody, &swap).unwrap();
        let owner = |p: &Path| std::fs::symlink_metadata(p).unwrap().uid();
        assert_eq!(owner(&victim), 0, "the planted symlink was followed");
        assert_eq!(owner(&victim.join("secret")), 0);
        assert_eq!(owner(&work), 65534);
        assert_eq!(owner(&work.join("out.moved")), 65534, "the real folder");
        assert_eq!(owner(&work.join("out.moved/deeper.moved")), 65534);

        // A folder left at the job's path is not reused.
        let e = make_workdir(None, &work, Some("out"), nobody).unwrap_err();
        assert!(e.to_string().contains("always new"), "{e}");
    }
}
