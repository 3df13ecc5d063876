//! A destination folder reached one name at a time, through `openat(2)` and
//! its siblings, never through a whole path.
//!
//! Two things follow. No path handed to the kernel is longer than one name,
//! so `PATH_MAX` does not limit how deep a pull writes: a tree pushed from
//! `/d` with 4,000-byte paths pulls into `/home/someone/long/destination`
//! too. And every folder on the way is opened with `O_NOFOLLOW |
//! O_DIRECTORY`, so a symlink in the destination is never followed, not
//! even one swapped in for a folder while the pull runs.
//!
//! Folders are opened `O_PATH` (search permission is all a lookup needs, as
//! with a path) and kept open in a [`Dirs`] cache, bounded so a tree of a
//! million folders does not hold a million descriptors. Each writer thread
//! has its own: one shared cache behind a lock put 14,000 futex waits into a
//! 50,000-file pull.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, Stat, Timespec, Timestamps};

/// Folders the cache of the one-thread steps keeps open: they go through
/// the tree in path order, so few are in use at a time.
const SHARED_DIRS: usize = 64;

/// Folders all the caches of one pull may keep open together.
///
/// Descriptors are a per-process limit (often 1,024 soft): the soft limit is
/// raised to the hard one once, as Go's runtime does, and a quarter of what
/// it then allows (at most 4,096) goes to open folders.
fn dir_budget() -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource};
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mut lim = getrlimit(Resource::Nofile);
        if lim.current < lim.maximum {
            let raised = rustix::process::Rlimit {
                current: lim.maximum.map(|m| m.min(1 << 20)),
                maximum: lim.maximum,
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                lim = getrlimit(Resource::Nofile);
            }
        }
        let soft = lim.current.unwrap_or(1 << 20);
        (soft / 4).clamp(128, 4096) as usize
    })
}

/// Open folders of a [`Tree`], by relative path. When full, it is emptied:
/// writers take folders a window at a time (`pull::spread_over_folders`),
/// and evicting one at random kept evicting folders of the window in use. A
/// miss costs one `openat` per level below the nearest folder still open.
pub(crate) struct Dirs {
    open: HashMap<Vec<u8>, Arc<OwnedFd>>,
    cap: usize,
}

impl Dirs {
    /// The cache of one of `writers` writer threads: an equal share of what
    /// the shared cache leaves of [`dir_budget`].
    pub(crate) fn for_writer(writers: usize) -> Dirs {
        let share = dir_budget().saturating_sub(SHARED_DIRS) / writers.max(1);
        Dirs::with_cap(share.max(16))
    }

    fn with_cap(cap: usize) -> Dirs {
        Dirs {
            open: HashMap::new(),
            cap,
        }
    }
}

/// What lookups open: the folder itself, never a symlink, for `*at` calls.
fn walk_flags() -> OFlags {
    OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// What listing and setting a folder's mode or times open.
fn read_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// A folder, and the folders below it reached by relative paths
/// (`/`-separated raw bytes, as snapshots hold them).
pub(crate) struct Tree {
    root: Arc<OwnedFd>,
    shown: PathBuf,
    /// The cache of the steps that run on one thread.
    dirs: Mutex<Dirs>,
}

/// A relative path's folder part and last name.
fn split(rel: &[u8]) -> (&[u8], &OsStr) {
    match rel.iter().rposition(|&b| b == b'/') {
        Some(i) => (&rel[..i], OsStr::from_bytes(&rel[i + 1..])),
        None => (&[], OsStr::from_bytes(rel)),
    }
}

/// The time `ns` (nanoseconds since the epoch, maybe negative) for `utimensat`.
fn timespec(ns: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000) as _,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

impl Tree {
    /// Opens `dest` (which the caller named, so it may be reached through
    /// symlinks; nothing below it is).
    pub(crate) fn open(dest: &Path) -> io::Result<Tree> {
        let root = rustix::fs::open(dest, walk_flags() - OFlags::NOFOLLOW, Mode::empty())?;
        Ok(Tree {
            root: Arc::new(root),
            shown: dest.to_path_buf(),
            dirs: Mutex::new(Dirs::with_cap(SHARED_DIRS)),
        })
    }

    /// `rel` below the destination, for messages only.
    pub(crate) fn shown(&self, rel: &[u8]) -> PathBuf {
        self.shown.join(OsStr::from_bytes(rel))
    }

    /// The open folder at `rel` (`""` is the destination itself).
    pub(crate) fn dir(&self, rel: &[u8]) -> io::Result<Arc<OwnedFd>> {
        self.dir_in(&mut self.dirs.lock().expect("poisoned"), rel)
    }

    /// The open folder at `rel`, opened through (and kept in) `dirs`.
    pub(crate) fn dir_in(&self, dirs: &mut Dirs, rel: &[u8]) -> io::Result<Arc<OwnedFd>> {
        if rel.is_empty() {
            return Ok(self.root.clone());
        }
        // The nearest folder above (or at) `rel` that is open already.
        let mut at = rel.len();
        let mut fd = loop {
            if let Some(fd) = dirs.open.get(&rel[..at]) {
                break fd.clone();
            }
            match rel[..at].iter().rposition(|&b| b == b'/') {
                Some(i) => at = i,
                None => {
                    at = 0;
                    break self.root.clone();
                }
            }
        };
        while at < rel.len() {
            let start = if at == 0 { 0 } else { at + 1 };
            let end = rel[start..]
                .iter()
                .position(|&b| b == b'/')
                .map_or(rel.len(), |i| start + i);
            let name = OsStr::from_bytes(&rel[start..end]);
            fd = Arc::new(rustix::fs::openat(&*fd, name, walk_flags(), Mode::empty())?);
            if dirs.open.len() >= dirs.cap {
                dirs.open.clear();
            }
            dirs.open.insert(rel[..end].to_vec(), fd.clone());
            at = end;
        }
        Ok(fd)
    }

    /// The open folder holding `rel`, and `rel`'s last name.
    pub(crate) fn parent<'a>(&self, rel: &'a [u8]) -> io::Result<(Arc<OwnedFd>, &'a OsStr)> {
        let (dir, name) = split(rel);
        Ok((self.dir(dir)?, name))
    }

    /// [`Tree::parent`] through a writer's own cache.
    pub(crate) fn parent_in<'a>(
        &self,
        dirs: &mut Dirs,
        rel: &'a [u8],
    ) -> io::Result<(Arc<OwnedFd>, &'a OsStr)> {
        let (dir, name) = split(rel);
        Ok((self.dir_in(dirs, dir)?, name))
    }

    /// What is at `rel`, symlinks not followed; `None` when nothing is
    /// (or a folder above it is missing or is not a folder).
    pub(crate) fn stat(&self, rel: &[u8]) -> io::Result<Option<Stat>> {
        let found = self
            .parent(rel)
            .and_then(|(d, n)| Ok(rustix::fs::statat(&*d, n, AtFlags::SYMLINK_NOFOLLOW)?));
        match found {
            Ok(st) => Ok(Some(st)),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates the folder `rel` (mode `0o777` less the umask; its own mode is
    /// set at the end).
    pub(crate) fn mkdir(&self, rel: &[u8]) -> io::Result<()> {
        let (d, n) = self.parent(rel)?;
        Ok(rustix::fs::mkdirat(&*d, n, Mode::from_raw_mode(0o777))?)
    }

    /// Sets the mode and times of the folder `rel` (never a symlink).
    pub(crate) fn set_dir_meta(&self, rel: &[u8], mode: u32, mtime_ns: i64) -> io::Result<()> {
        let (d, n) = self.parent(rel)?;
        match rustix::fs::openat(&*d, n, read_flags(), Mode::empty()) {
            Ok(fd) => {
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
                Ok(rustix::fs::futimens(&fd, &timespec(mtime_ns))?)
            }
            // A folder its owner may not read (mode 0o311, say) cannot be
            // opened for reading. It is opened O_PATH (never through a
            // symlink: O_NOFOLLOW), and set through /proc/self/fd, which
            // names that very folder, as glibc's lchmod does: setting it by
            // name could follow a symlink swapped in meanwhile.
            Err(rustix::io::Errno::ACCESS) => {
                let fd = rustix::fs::openat(&*d, n, walk_flags(), Mode::empty())?;
                let by_fd = format!("/proc/self/fd/{}", fd.as_raw_fd());
                let cwd = rustix::fs::CWD;
                rustix::fs::chmodat(cwd, &by_fd, Mode::from_raw_mode(mode), AtFlags::empty())?;
                let times = timespec(mtime_ns);
                Ok(rustix::fs::utimensat(
                    cwd,
                    &by_fd,
                    &times,
                    AtFlags::empty(),
                )?)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Makes `rel` a symlink to `target` with modification time `mtime_ns`.
    pub(crate) fn symlink(&self, target: &[u8], rel: &[u8], mtime_ns: i64) -> io::Result<()> {
        let (d, n) = self.parent(rel)?;
        rustix::fs::symlinkat(OsStr::from_bytes(target), &*d, n)?;
        let flags = AtFlags::SYMLINK_NOFOLLOW;
        Ok(rustix::fs::utimensat(&*d, n, &timespec(mtime_ns), flags)?)
    }

    /// Removes the file or symlink `rel`.
    pub(crate) fn remove_file(&self, rel: &[u8]) -> io::Result<()> {
        let (d, n) = self.parent(rel)?;
        Ok(rustix::fs::unlinkat(&*d, n, AtFlags::empty())?)
    }

    /// Removes the folder `rel` and all it holds; returns how many entries
    /// went, the folder included.
    pub(crate) fn remove_dir_all(&self, rel: &[u8]) -> io::Result<u64> {
        let (d, n) = self.parent(rel)?;
        // Folders opened below it are gone with it.
        self.dirs.lock().expect("poisoned").open.clear();
        Ok(remove_below(&d, n)? + 1)
    }

    /// The names in folder `rel` with whether each is a folder (never
    /// following a symlink).
    pub(crate) fn list(&self, rel: &[u8]) -> io::Result<Vec<(Vec<u8>, bool)>> {
        let fd = if rel.is_empty() {
            rustix::fs::openat(&*self.root, c".", read_flags(), Mode::empty())?
        } else {
            let (d, n) = self.parent(rel)?;
            rustix::fs::openat(&*d, n, read_flags(), Mode::empty())?
        };
        read_entries(fd)
    }

    /// Entries under folder `rel`, at any depth; 0 if it cannot be read.
    pub(crate) fn count_under(&self, rel: &[u8]) -> u64 {
        self.parent(rel)
            .and_then(|(d, n)| count_below(&d, n))
            .unwrap_or(0)
    }
}

/// The entries of the folder open at `fd` (not `.` and `..`), each with
/// whether it is a folder.
fn read_entries(fd: OwnedFd) -> io::Result<Vec<(Vec<u8>, bool)>> {
    let stat_fd = fd.try_clone()?;
    let mut out = Vec::new();
    for ent in Dir::new(fd)? {
        let ent = ent?;
        let name = ent.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let is_dir = match ent.file_type() {
            FileType::Unknown => {
                let st = rustix::fs::statat(&stat_fd, ent.file_name(), AtFlags::SYMLINK_NOFOLLOW)?;
                FileType::from_raw_mode(st.st_mode) == FileType::Directory
            }
            t => t == FileType::Directory,
        };
        out.push((name.to_vec(), is_dir));
    }
    Ok(out)
}

/// Removes the folder `path` and all it holds. Every name is reached from
/// its folder: no symlink below `path` is followed, and depth is not
/// limited by `PATH_MAX`. Folders without write permission (a shared,
/// read-only tree) are given it first.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let Some(name) = path.file_name() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no folder to remove", path.display()),
        ));
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = rustix::fs::open(parent, walk_flags() - OFlags::NOFOLLOW, Mode::empty())?;
    remove_below(&dir, name).map(drop)
}

/// Empties and removes folder `name` of `parent`; returns how many entries
/// it held, at any depth. One descriptor per level of depth is open at once.
fn remove_below(parent: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let fd = rustix::fs::openat(parent, name, read_flags(), Mode::empty())?;
    // Its entries can only go if it is writable (and searchable) by us.
    let mode = rustix::fs::fstat(&fd)?.st_mode;
    if mode & 0o700 != 0o700 {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode((mode | 0o700) & 0o7777))?;
    }
    let mut n = 0;
    for (child, is_dir) in read_entries(fd.try_clone()?)? {
        let child = OsStr::from_bytes(&child);
        if is_dir {
            n += remove_below(&fd, child)?;
        } else {
            rustix::fs::unlinkat(&fd, child, AtFlags::empty())?;
        }
        n += 1;
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)?;
    Ok(n)
}

/// Entries under folder `name` of `parent`, at any depth.
fn count_below(parent: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let fd = rustix::fs::openat(parent, name, read_flags(), Mode::empty())?;
    let mut n = 0;
    for (child, is_dir) in read_entries(fd.try_clone()?)? {
        n += 1;
        if is_dir {
            n += count_below(&fd, OsStr::from_bytes(&child)).unwrap_or(0);
        }
    }
    Ok(n)
}

/// Creates `name` in `dir` for writing: new (never an existing file, never
/// through a symlink), readable only by the owner until its mode is set.
pub(crate) fn create(dir: &OwnedFd, name: &OsStr) -> io::Result<std::fs::File> {
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(dir, name, flags, Mode::from_raw_mode(0o600))?;
    Ok(std::fs::File::from(fd))
}

/// `rename(2)` within one folder.
pub(crate) fn rename(dir: &OwnedFd, from: &OsStr, to: &OsStr) -> io::Result<()> {
    Ok(rustix::fs::renameat(dir, from, dir, to)?)
}

/// `link(2)` from `from` in `from_dir` to `to` in `to_dir` (a symlink at
/// `from` is linked itself, never followed).
pub(crate) fn link(
    from_dir: &OwnedFd,
    from: &OsStr,
    to_dir: &OwnedFd,
    to: &OsStr,
) -> io::Result<()> {
    Ok(rustix::fs::linkat(
        from_dir,
        from,
        to_dir,
        to,
        AtFlags::empty(),
    )?)
}

/// Removes `name` from `dir` (a file or symlink), ignoring failure: used to
/// clean up a temporary name.
pub(crate) fn discard(dir: &OwnedFd, name: &OsStr) {
    let _ = rustix::fs::unlinkat(dir, name, AtFlags::empty());
}

/// What `st` is.
pub(crate) fn kind(st: &Stat) -> FileType {
    FileType::from_raw_mode(st.st_mode)
}

/// `st`'s modification time in nanoseconds since the epoch.
#[allow(clippy::unnecessary_cast)] // the field types differ between architectures
pub(crate) fn mtime_ns(st: &Stat) -> i64 {
    st.st_mtime as i64 * 1_000_000_000 + st.st_mtime_nsec as i64
}
