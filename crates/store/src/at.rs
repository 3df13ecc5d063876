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

/// Folders a removal keeps open at once (see [`empty`]).
const WALK_OPEN: usize = 64;

/// A folder open during a walk, with the names in it still to visit.
struct Level {
    fd: OwnedFd,
    /// Its name in the folder above.
    name: Vec<u8>,
    entries: std::vec::IntoIter<(Vec<u8>, bool)>,
}

impl Level {
    fn open(parent: &OwnedFd, name: &[u8]) -> io::Result<Level> {
        let fd = rustix::fs::openat(parent, OsStr::from_bytes(name), read_flags(), Mode::empty())?;
        Level::of(fd, name)
    }

    fn of(fd: OwnedFd, name: &[u8]) -> io::Result<Level> {
        Ok(Level {
            entries: read_entries(fd.try_clone()?)?.into_iter(),
            fd,
            name: name.to_vec(),
        })
    }

    /// Reads its names again (some arrived after the first read).
    fn reread(&mut self) -> io::Result<()> {
        // The first read left the shared offset at the end.
        rustix::fs::seek(&self.fd, rustix::fs::SeekFrom::Start(0))?;
        self.entries = read_entries(self.fd.try_clone()?)?.into_iter();
        Ok(())
    }
}

/// Times a folder's names are read again when it is still not empty after
/// all it held went: something (its owner, still at work) keeps adding.
const REREADS: u32 = 8;

/// Entries one removal visits at most: past that, whoever keeps adding to
/// the tree (or moving what was moved up back down) has it stop with an
/// error, to be tried again later, rather than run forever.
const VISITS_MAX: u64 = 50_000_000;

/// Opens folder `name` of `parent` to empty it: made writable and
/// searchable by its owner first (a read-only shared tree; as another
/// user than its owner this fails, and the removal with it).
fn open_to_empty(parent: &OwnedFd, name: &[u8]) -> io::Result<Level> {
    let fd = rustix::fs::openat(parent, OsStr::from_bytes(name), read_flags(), Mode::empty())?;
    emptiable(fd, name)
}

/// The folder open at `fd`, made writable and searchable by its owner.
fn emptiable(fd: OwnedFd, name: &[u8]) -> io::Result<Level> {
    let mode = rustix::fs::fstat(&fd)?.st_mode;
    if mode & 0o700 != 0o700 {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode((mode | 0o700) & 0o7777))?;
    }
    Level::of(fd, name)
}

/// Removes non-folder `name` of `dir`; one already gone is no error.
fn unlink_file(dir: &OwnedFd, name: &[u8]) -> io::Result<()> {
    match rustix::fs::unlinkat(dir, OsStr::from_bytes(name), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes everything in the folder `top` (not the folder itself); returns
/// how many entries went, at any depth.
///
/// Without recursion: a folder 200,000 levels deep (its owner needs only a
/// loop of `mkdir a && cd a`) overflowed the stack, and labd removes its
/// users' job folders. At most [`WALK_OPEN`] levels are open at once: a
/// folder deeper than that is first moved up into `top` (never reopened
/// through `..`, which its owner could redirect), and emptied from there.
/// No symlink is followed; no name is longer than one folder's. What the
/// tree's owner changes meanwhile (a name gone, a file become a folder) is
/// taken as it comes; one that never stops adding makes it fail after
/// [`VISITS_MAX`] entries or [`REREADS`] readings of a folder that stays
/// full.
fn empty(top: Level) -> io::Result<u64> {
    let mut stack = vec![top];
    let (mut n, mut visits, mut rereads, mut moved) = (0u64, 0u64, 0u32, false);
    loop {
        let depth = stack.len();
        let cur = stack.last_mut().expect("never empty here");
        if let Some((child, is_dir)) = cur.entries.next() {
            visits += 1;
            if visits > VISITS_MAX {
                return Err(io::Error::other(format!(
                    "{VISITS_MAX} entries visited and still more: left for later"
                )));
            }
            if !is_dir {
                match rustix::fs::unlinkat(&cur.fd, OsStr::from_bytes(&child), AtFlags::empty()) {
                    Ok(()) => n += 1,
                    // Gone, or a folder now: the next reading of this
                    // folder has it.
                    Err(rustix::io::Errno::NOENT | rustix::io::Errno::ISDIR) => {}
                    Err(e) => return Err(e.into()),
                }
            } else if depth < WALK_OPEN {
                match open_to_empty(&cur.fd, &child) {
                    Ok(level) => stack.push(level),
                    Err(e) => match e.raw_os_error().map(rustix::io::Errno::from_raw_os_error) {
                        Some(rustix::io::Errno::NOENT) => {}
                        // A file or symlink now.
                        Some(rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) => {
                            unlink_file(&cur.fd, &child)?;
                            n += 1;
                        }
                        _ => return Err(e),
                    },
                }
            } else {
                // Too deep to open: moved to the top folder, whose names
                // are read again once it has been through its first ones.
                let (above, deepest) = stack.split_at(depth - 1);
                moved |= move_up(&deepest[0].fd, &child, &above[0].fd)?;
            }
            continue;
        }
        if depth == 1 {
            // The top: empty once a fresh reading finds nothing.
            cur.reread()?;
            if cur.entries.as_slice().is_empty() {
                return Ok(n);
            }
            if !moved {
                rereads += 1;
                if rereads > REREADS {
                    return Err(rustix::io::Errno::NOTEMPTY.into());
                }
            }
            moved = false;
            continue;
        }
        let mut done = stack.pop().expect("never empty here");
        let up = stack.last().expect("the top is below it");
        match rustix::fs::unlinkat(&up.fd, OsStr::from_bytes(&done.name), AtFlags::REMOVEDIR) {
            Ok(()) => n += 1,
            Err(rustix::io::Errno::NOENT) => {}
            // Added to since it was read (or a name in it became a folder).
            Err(rustix::io::Errno::NOTEMPTY) if rereads < REREADS => {
                rereads += 1;
                done.reread()?;
                stack.push(done);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Empties and removes folder `name` of `parent`; returns how many entries
/// it held, at any depth (see [`empty`]).
fn remove_below(parent: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let mut n = 0;
    for _ in 0..REREADS {
        n += empty(open_to_empty(parent, name.as_bytes())?)?;
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) => return Ok(n),
            // Added to between the last reading and the removal.
            Err(rustix::io::Errno::NOTEMPTY) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(rustix::io::Errno::NOTEMPTY.into())
}

/// Removes everything in folder `path` (not `path` itself, which the caller
/// named: it may be reached through symlinks; nothing below it is) with
/// the file-system rights of user `who` (uid, gid; no supplementary
/// groups) instead of the caller's; returns how many entries went.
///
/// labd, as root, empties its users' job folders this way: a user who
/// moved into theirs a folder of someone else's (from a group-writable
/// project folder, say) has the removal fail on it, rather than root
/// delete what that user could not.
pub fn empty_tree_as(path: &Path, who: Option<crate::RunAs>) -> io::Result<u64> {
    let fd = rustix::fs::open(path, read_flags(), Mode::empty())?;
    let _as = crate::fsutil::ReadAs::try_enter(who)?;
    empty(emptiable(fd, b"")?)
}

/// Moves folder `name` of `from` into `to` under a new name, so a walk
/// reaches what it holds from higher up; false if it was gone already.
fn move_up(from: &OwnedFd, name: &[u8], to: &OwnedFd) -> io::Result<bool> {
    use rustix::fs::RenameFlags;
    use rustix::io::Errno;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let (mut flags, mut opened) = (RenameFlags::NOREPLACE, false);
    loop {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let new = format!(".labsync-deep-{}-{k}", std::process::id());
        match rustix::fs::renameat_with(from, OsStr::from_bytes(name), to, new.as_str(), flags) {
            Ok(()) => return Ok(true),
            Err(Errno::NOENT) => return Ok(false),
            // Taken (with NOREPLACE; without it, a folder that is not
            // empty): another name.
            Err(Errno::EXIST | Errno::NOTEMPTY) => continue,
            // NFS and CIFS take no rename flags. Without them a rename can
            // replace only an empty folder, and only one inside the tree.
            Err(Errno::INVAL) if !flags.is_empty() => flags = RenameFlags::empty(),
            // Moving a folder rewrites its `..`: it must be writable.
            Err(Errno::ACCESS) if !opened => {
                opened = true;
                drop(open_to_empty(from, name)?);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Entries under folder `name` of `parent`, at any depth, without
/// recursion: a lower bound. One descriptor per level is open: a folder
/// that cannot be opened (out of descriptors, no permission) counts as
/// itself alone.
fn count_below(parent: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let mut stack = vec![Level::open(parent, name.as_bytes())?];
    let mut n = 0;
    while let Some(top) = stack.last_mut() {
        match top.entries.next() {
            Some((child, is_dir)) => {
                n += 1;
                if let Some(level) = is_dir.then(|| Level::open(&top.fd, &child).ok()).flatten() {
                    stack.push(level);
                }
            }
            None => {
                stack.pop();
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes a chain of `depth` folders `a/a/…` in `dir`, with a file and
    /// a symlink to `outside` every 1,000 levels; how many entries it holds.
    fn deep_chain(dir: &Path, depth: usize, outside: &Path) -> u64 {
        let mut fd = rustix::fs::open(dir, walk_flags(), Mode::empty()).unwrap();
        let mut n = 0;
        for level in 0..depth {
            if level % 1000 == 0 {
                drop(create(&fd, OsStr::new("f")).unwrap());
                rustix::fs::symlinkat(outside, &fd, "out").unwrap();
                n += 2;
            }
            rustix::fs::mkdirat(&fd, "a", Mode::from_raw_mode(0o755)).unwrap();
            fd = rustix::fs::openat(&fd, "a", walk_flags(), Mode::empty()).unwrap();
            n += 1;
        }
        n
    }

    #[test]
    fn a_folder_far_deeper_than_the_stack_allows_is_removed_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let top = dir.path().join("top");
        std::fs::create_dir(&top).unwrap();
        let held = deep_chain(&top, 20_000, &outside);
        // A recursive walk needs far more than this much stack (and one
        // descriptor per level) for 20,000 levels.
        let parent = rustix::fs::open(dir.path(), walk_flags(), Mode::empty()).unwrap();
        let removed = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || remove_below(&parent, OsStr::new("top")))
            .unwrap()
            .join()
            .unwrap();
        // Not unwrapped: the temporary folder's own (recursive) removal
        // would overflow the stack on what is left.
        let removed = match removed {
            Ok(n) => n,
            Err(e) => panic!("{e}; left in {}", dir.keep().display()),
        };
        assert_eq!(removed, held);
        assert!(!top.exists());
        assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"k");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "only `outside` is left"
        );
    }

    /// As a user (not root), a read-only chain deeper than the folders a
    /// removal keeps open: each folder moved up is made writable first
    /// (moving a folder rewrites its `..`).
    #[test]
    fn a_read_only_chain_deeper_than_the_open_folders_is_emptied_as_its_user() {
        use std::os::unix::fs::{chown, PermissionsExt};
        if rustix::process::geteuid().is_root() {
            let dir = tempfile::tempdir().unwrap();
            let top = dir.path().join("top");
            std::fs::create_dir(&top).unwrap();
            let held = deep_chain(&top, 200, Path::new("/etc"));
            let mut p = top.clone();
            let mut folders = vec![p.clone()];
            while p.join("a").exists() {
                p.push("a");
                folders.push(p.clone());
            }
            for f in &folders {
                for e in std::fs::read_dir(f).unwrap() {
                    let e = e.unwrap().path();
                    std::os::unix::fs::lchown(&e, Some(65534), Some(65534)).unwrap();
                }
            }
            chown(&top, Some(65534), Some(65534)).unwrap();
            for f in folders.iter().rev() {
                std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o555)).unwrap();
            }
            let removed = match empty_tree_as(
                &top,
                Some(crate::RunAs {
                    uid: 65534,
                    gid: 65534,
                }),
            ) {
                Ok(n) => n,
                Err(e) => {
                    // Root can (no recursion in remove_tree).
                    remove_tree(&top).unwrap();
                    panic!("{e}");
                }
            };
            assert_eq!(removed, held);
            assert_eq!(std::fs::read_dir(&top).unwrap().count(), 0);
        } else {
            eprintln!("not root: cannot act as another user");
        }
    }

    #[test]
    fn a_deep_folder_is_counted_without_recursion() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let top = dir.path().join("top");
        std::fs::create_dir(&top).unwrap();
        let held = deep_chain(&top, 600, &outside);
        let parent = rustix::fs::open(dir.path(), walk_flags(), Mode::empty()).unwrap();
        let counted = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || count_below(&parent, OsStr::new("top")))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(counted, held);
    }

    #[test]
    fn a_read_only_tree_is_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("top");
        std::fs::create_dir_all(top.join("b/c")).unwrap();
        std::fs::write(top.join("b/c/f"), b"x").unwrap();
        for p in [top.join("b/c"), top.join("b"), top.clone()] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
        remove_tree(&top).unwrap();
        assert!(!top.exists());
    }
}
