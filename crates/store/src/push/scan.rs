//! Stage 1, scan: every path under the source with what `statx` says of it,
//! streamed in path order.
//!
//! The walk never holds the whole tree: a consumer takes entries in the
//! order a sorted list of every path would have (bytes, `/` included), while
//! [`LISTERS`] threads list the folders it will reach next, at most
//! [`HELD_ENTRIES`] entries ahead. On a cold tree each listing is one
//! `statx` per entry waiting on the disk, so many are in flight at once.
//!
//! Path order from a depth-first walk: among the names of one folder, a
//! subfolder `a` is itself listed at `a` and its contents at `a/`, which is
//! where every path below it sorts (`a` < `a.txt` < `a/b` < `a0`).

use std::collections::{BTreeMap, HashMap};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};

use rustix::fs::{AtFlags, FileType, OFlags, Stat};
use rustix::io::Errno;

use super::beneath::Beneath;
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::snapshot::Kind;

/// One path found by the scan.
pub(super) struct Scanned {
    pub path: Vec<u8>,
    pub kind: Kind,
    pub mode: u32,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    /// Device and link count: names of one inode become hard links.
    pub dev: u64,
    pub nlink: u64,
    pub size: u64,
    pub target: Vec<u8>,
}

/// Entries listed but not yet taken by the walk, at most: what the listers
/// may hold ahead of it (about 150 bytes each).
const HELD_ENTRIES: usize = 64 * 1024;

/// What one folder's listing is, for the walk.
enum Item {
    /// An entry, in path order among its siblings' items.
    Entry(Scanned),
    /// Where the walk goes into a subfolder (its relative path).
    Descend(Vec<u8>),
}

/// A listed folder: its items in walk order, or why it could not be listed.
type Listing = Result<Vec<Item>>;

struct WalkState {
    /// Folders to list, by where the walk reaches their contents.
    to_list: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Folders listed and not yet reached, with their entry counts.
    listed: HashMap<Vec<u8>, (Listing, usize)>,
    /// Entries in `listed`.
    held: usize,
    /// Set when the walk is over (done or abandoned): listers stop.
    stop: bool,
}

/// The folders the walk will reach, listed ahead of it by a few threads.
pub(super) struct Listers<'a> {
    root: &'a Path,
    /// The root, open: every folder is listed through it.
    beneath: &'a Beneath,
    state: Mutex<WalkState>,
    changed: Condvar,
    skipped: Skipped,
    /// Folders gone, or replaced by something else, when listed.
    moved: Skipped,
}

/// Sets `stop` when dropped: the listers end however the walk does.
pub(super) struct StopListers<'a, 'b>(pub &'b Listers<'a>);

impl Drop for StopListers<'_, '_> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.changed.notify_all();
    }
}

impl<'a> Listers<'a> {
    /// Listers of the folder `root`, open as `beneath`.
    pub fn new(root: &'a Path, beneath: &'a Beneath) -> Listers<'a> {
        Listers {
            root,
            beneath,
            state: Mutex::new(WalkState {
                to_list: BTreeMap::new(),
                listed: HashMap::new(),
                held: 0,
                stop: false,
            }),
            changed: Condvar::new(),
            skipped: Skipped::default(),
            moved: Skipped::default(),
        }
    }

    /// The state; a panicking holder cannot have left it half changed.
    fn lock(&self) -> std::sync::MutexGuard<'_, WalkState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'g>(
        &self,
        st: std::sync::MutexGuard<'g, WalkState>,
    ) -> std::sync::MutexGuard<'g, WalkState> {
        (self.changed.wait(st)).unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One lister thread: lists the next folder the walk will reach while
    /// fewer than [`HELD_ENTRIES`] entries wait for it.
    pub fn run(&self) {
        loop {
            let rel = {
                let mut st = self.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    if st.held < HELD_ENTRIES {
                        if let Some((_, rel)) = st.to_list.pop_first() {
                            break rel;
                        }
                    }
                    st = self.wait(st);
                }
            };
            // A panic listing it must not leave the walk waiting for it.
            let guard = ListingLost(self, &rel);
            let listing = self.list(&rel);
            std::mem::forget(guard);
            let n = listing.as_ref().map_or(0, |l| l.len());
            let mut st = self.lock();
            st.held += n;
            st.listed.insert(rel, (listing, n));
            self.changed.notify_all();
        }
    }

    /// Lists `rel` and queues its subfolders for listing.
    fn list(&self, rel: &[u8]) -> Listing {
        let items = list_dir(self.root, self.beneath, rel, &self.skipped, &self.moved)?;
        let mut st = self.lock();
        for item in &items {
            if let Item::Descend(sub) = item {
                let mut key = sub.clone();
                key.push(b'/');
                st.to_list.insert(key, sub.clone());
            }
        }
        drop(st);
        self.changed.notify_all();
        Ok(items)
    }

    /// The listing of `rel`, listed by this thread if no lister has started it.
    fn take(&self, rel: &[u8]) -> Listing {
        let mut key = rel.to_vec();
        key.push(b'/');
        let mut st = self.lock();
        loop {
            if let Some((listing, n)) = st.listed.remove(rel) {
                st.held -= n;
                drop(st);
                self.changed.notify_all();
                return listing;
            }
            if st.to_list.remove(&key).is_some() {
                drop(st);
                return self.list(rel);
            }
            // A lister has it: wait for it.
            st = self.wait(st);
        }
    }
}

/// Records a failed listing of the folder when dropped by a panic
/// (forgotten otherwise).
struct ListingLost<'a, 'b>(&'b Listers<'a>, &'b [u8]);

impl Drop for ListingLost<'_, '_> {
    fn drop(&mut self) {
        let failed = Error::Io {
            op: "list (a lister panicked)",
            path: self.0.root.join(std::ffi::OsStr::from_bytes(self.1)),
            source: std::io::Error::other("lister panicked"),
        };
        self.0
            .lock()
            .listed
            .insert(self.1.to_vec(), (Err(failed), 0));
        self.0.changed.notify_all();
    }
}

/// The walk: entries in path order, from the listers' listings.
pub(super) struct Walk<'a, 'b> {
    listers: &'b Listers<'a>,
    /// The items still to take of each folder being walked, innermost last.
    stack: Vec<std::vec::IntoIter<Item>>,
    /// The source is one file, this entry.
    single: Option<Scanned>,
    progress: &'b dyn Progress,
    warned: bool,
}

impl<'a, 'b> Walk<'a, 'b> {
    /// Starts the walk of `listers`' root (a folder or one file).
    pub fn start(listers: &'b Listers<'a>, progress: &'b dyn Progress) -> Result<Self> {
        let root = listers.root;
        let meta = rustix::fs::lstat(root).map_err(|e| Error::io("read", root)(e.into()))?;
        let mut walk = Walk {
            listers,
            stack: Vec::new(),
            single: None,
            progress,
            warned: false,
        };
        if FileType::from_raw_mode(meta.st_mode) == FileType::Directory {
            walk.stack.push(listers.list(b"")?.into_iter());
        } else {
            let name = root.file_name().ok_or_else(|| {
                Error::invalid(format!("source {}", root.display()), "has no file name")
            })?;
            let parent = root.parent().unwrap_or(Path::new("."));
            walk.single = scanned(
                None,
                parent,
                name.as_bytes().to_vec(),
                &meta,
                &listers.skipped,
            )?;
        }
        Ok(walk)
    }

    /// The next entry in path order; `None` at the end.
    pub fn next_entry(&mut self) -> Result<Option<Scanned>> {
        if let Some(s) = self.single.take() {
            return Ok(Some(s));
        }
        loop {
            let Some(top) = self.stack.last_mut() else {
                if !self.warned {
                    self.warned = true;
                    self.listers.skipped.warn(
                        self.progress,
                        "entries that are not files, folders or symlinks (FIFOs, sockets, \
                         devices: a store keeps none of them)",
                    );
                    self.listers.moved.warn(
                        self.progress,
                        "folders removed, or replaced by a symlink or a file, during the push \
                         (kept empty: a push never follows a symlink)",
                    );
                }
                return Ok(None);
            };
            match top.next() {
                None => {
                    self.stack.pop();
                }
                Some(Item::Entry(s)) => return Ok(Some(s)),
                Some(Item::Descend(rel)) => {
                    let items = self.listers.take(&rel)?;
                    self.stack.push(items.into_iter());
                }
            }
        }
    }
}

/// FIFOs, sockets and devices found by the scan: a store keeps none of
/// them, which is said once per push (a count and the first few paths), not
/// once per entry.
#[derive(Default)]
struct Skipped(Mutex<(u64, Vec<Vec<u8>>)>);

impl Skipped {
    const SHOWN: usize = 3;

    fn add(&self, path: Vec<u8>) {
        let mut s = self.0.lock().expect("scan poisoned");
        s.0 += 1;
        // The first in path order, whichever lister found them.
        s.1.push(path);
        s.1.sort();
        s.1.truncate(Self::SHOWN);
    }

    fn warn(&self, progress: &dyn Progress, what: &str) {
        let (n, first) = std::mem::take(&mut *self.0.lock().expect("scan poisoned"));
        if n == 0 {
            return;
        }
        let names: Vec<_> = first.iter().map(|p| String::from_utf8_lossy(p)).collect();
        let more = if n as usize > names.len() {
            ", ..."
        } else {
            ""
        };
        progress.warn(&format!("skipped {n} {what}: {}{more}", names.join(", ")));
    }
}

/// Lists one folder (`rel` under `root`, opened through `beneath`): its
/// entries and where the walk descends into each subfolder, in walk order.
/// A folder gone or replaced since its parent was listed (by a symlink:
/// never followed) is said in `moved` and listed empty.
fn list_dir(
    root: &Path,
    beneath: &Beneath,
    rel: &[u8],
    skipped: &Skipped,
    moved: &Skipped,
) -> Result<Vec<Item>> {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(std::ffi::OsStr::from_bytes(rel))
    };
    let listing = |e: std::io::Error| Error::io("list", &dir)(e);
    let fd = match beneath.open_at(&dir, OFlags::RDONLY | OFlags::DIRECTORY) {
        Ok(fd) => fd,
        Err(e)
            if !rel.is_empty()
                && matches!(
                    e.raw_os_error(),
                    Some(libc::ELOOP | libc::ENOENT | libc::ENOTDIR)
                ) =>
        {
            moved.add(rel.to_vec());
            return Ok(Vec::new());
        }
        Err(e) => return Err(listing(e)),
    };
    // Read through a second descriptor (`fd` stays free for `statat`):
    // two calls per folder, nothing beside a `statx` per entry.
    let mut rd = rustix::fs::Dir::read_from(&fd).map_err(|e| listing(e.into()))?;
    // (sort key, item): a subfolder's contents sort after its name and a '/'.
    let mut items: Vec<(Vec<u8>, Item)> = Vec::new();
    while let Some(ent) = rd.read() {
        let ent = ent.map_err(|e| listing(e.into()))?;
        let name = ent.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let mut path = rel.to_vec();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(name);
        let full = || dir.join(std::ffi::OsStr::from_bytes(name));
        if path.iter().filter(|&&b| b == b'/').count() >= crate::snapshot::MAX_DEPTH {
            return Err(Error::invalid(
                format!("source path {}", full().display()),
                "more than 256 folders deep (labsync keeps trees up to 256 deep)",
            ));
        }
        let m = match rustix::fs::statat(&fd, ent.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(m) => m,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(Error::io("stat", full())(e.into())),
        };
        if let Some(s) = scanned(Some(&fd), &dir, path, &m, skipped)? {
            if s.kind == Kind::Dir {
                let mut key = name.to_vec();
                key.push(b'/');
                items.push((key, Item::Descend(s.path.clone())));
            }
            items.push((name.to_vec(), Item::Entry(s)));
        }
    }
    items.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    Ok(items.into_iter().map(|(_, item)| item).collect())
}

/// The entry `path` (its last name in `dir`, open as `fd` when listed)
/// with what `m` says of it; `None` for what a store keeps not.
// `stat` field types differ between architectures: the casts are no-ops
// on some only.
#[allow(clippy::unnecessary_cast)]
fn scanned(
    fd: Option<&std::os::fd::OwnedFd>,
    dir: &Path,
    path: Vec<u8>,
    m: &Stat,
    skipped: &Skipped,
) -> Result<Option<Scanned>> {
    let ft = FileType::from_raw_mode(m.st_mode);
    let (kind, target) = match ft {
        FileType::RegularFile => (Kind::File, Vec::new()),
        FileType::Directory => (Kind::Dir, Vec::new()),
        FileType::Symlink => {
            let name = path.rsplit(|&b| b == b'/').next().unwrap_or(&path);
            let name = std::ffi::OsStr::from_bytes(name);
            let full: PathBuf = dir.join(name);
            let t = match fd {
                Some(fd) => rustix::fs::readlinkat(fd, name, Vec::new()),
                None => rustix::fs::readlinkat(rustix::fs::CWD, &full, Vec::new()),
            };
            let t = t.map_err(|e| Error::io("read link", &full)(e.into()))?;
            (Kind::Symlink, t.into_bytes())
        }
        _ => {
            skipped.add(path);
            return Ok(None);
        }
    };
    let ns = |s: i64, n: i64| s * 1_000_000_000 + n;
    Ok(Some(Scanned {
        kind,
        mode: crate::snapshot::allowed_mode(kind, m.st_mode),
        mtime_ns: ns(m.st_mtime as i64, m.st_mtime_nsec as i64),
        ctime_ns: ns(m.st_ctime as i64, m.st_ctime_nsec as i64),
        ino: m.st_ino as u64,
        dev: m.st_dev as u64,
        nlink: m.st_nlink as u64,
        size: if kind == Kind::File {
            m.st_size as u64
        } else {
            0
        },
        path,
        target,
    }))
}

/// Makes every name of a file with several names, after the first in path
/// order, a hard link to that first one: its data is read, stored and
/// written once (DF2K is DIV2K and Flickr2K hard-linked). Holds one path
/// per inode with several names.
#[derive(Default)]
pub(super) struct LinkGroups {
    first: HashMap<(u64, u64), Vec<u8>>,
}

impl LinkGroups {
    /// Turns `s` into a hard link when an earlier name of its inode was seen.
    pub fn apply(&mut self, s: &mut Scanned) {
        if s.kind != Kind::File || s.nlink < 2 {
            return;
        }
        match self.first.get(&(s.dev, s.ino)) {
            Some(target) => {
                s.kind = Kind::HardLink;
                s.target = target.clone();
                s.size = 0;
            }
            None => {
                self.first.insert((s.dev, s.ino), s.path.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk yields exactly what sorting every path by its bytes would,
    /// with names that sort around '/' ('.' below it, '0' above it) at
    /// every depth, and more folders than the listers list at once.
    #[test]
    fn the_walk_is_in_path_order() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = dir.path().canonicalize().unwrap();
        let root = canonical.as_path();
        let names = ["a", "a.txt", "a0", "a-b", "b", "a.d", "a0.d", "z"];
        let mut expected = Vec::new();
        for d in [
            "a",
            "a.d",
            "a0.d",
            "a/a",
            "a/a.d",
            "a/a/a",
            "a/a0.d",
            "deep/a/b/c",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for d in [
            "",
            "a",
            "a.d",
            "a0.d",
            "a/a",
            "a/a.d",
            "a/a/a",
            "a/a0.d",
            "deep/a/b/c",
        ] {
            for n in names {
                let p = root.join(d).join(n);
                if !p.exists() {
                    std::fs::write(&p, n).unwrap();
                }
            }
        }
        for i in 0..300 {
            std::fs::create_dir_all(root.join(format!("many/{i}"))).unwrap();
            std::fs::write(root.join(format!("many/{i}/f")), b"x").unwrap();
        }
        let mut walk_all = |stack: &mut Vec<std::path::PathBuf>| {
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).unwrap() {
                    let p = e.unwrap().path();
                    let rel = p
                        .strip_prefix(root)
                        .unwrap()
                        .as_os_str()
                        .as_bytes()
                        .to_vec();
                    expected.push(rel);
                    if p.is_dir() {
                        stack.push(p);
                    }
                }
            }
        };
        walk_all(&mut vec![root.to_path_buf()]);
        expected.sort();

        let beneath = Beneath::open(root).unwrap();
        let listers = Listers::new(root, &beneath);
        let got = std::thread::scope(|s| {
            let _stop = StopListers(&listers);
            for _ in 0..4 {
                s.spawn(|| listers.run());
            }
            let np = crate::progress::NoProgress;
            let mut walk = Walk::start(&listers, &np).unwrap();
            let mut got = Vec::new();
            while let Some(e) = walk.next_entry().unwrap() {
                got.push(e.path);
            }
            got
        });
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the walk's order differs from path order");
    }

    /// A folder swapped for a symlink after its parent was listed (here:
    /// one to a folder this process holds open, through /proc/self/fd, as
    /// root's labd holds other users' job folders) is listed empty and
    /// said, never followed; a path lookup listed what it pointed to.
    #[test]
    fn a_folder_swapped_for_a_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let (root, other) = (base.join("src"), base.join("other"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("secret"), b"theirs").unwrap();
        let held = std::fs::File::open(&other).unwrap();
        let magic = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held));
        std::os::unix::fs::symlink(&magic, root.join("sub")).unwrap();
        assert!(
            std::fs::read_dir(root.join("sub"))
                .unwrap()
                .next()
                .is_some(),
            "the premise"
        );
        let beneath = Beneath::open(&root).unwrap();
        let (skipped, moved) = (Skipped::default(), Skipped::default());
        // As if "sub" had been a folder when its parent was listed.
        let items = list_dir(&root, &beneath, b"sub", &skipped, &moved).unwrap();
        assert!(items.is_empty());
        assert_eq!(moved.0.lock().unwrap().0, 1);
        // Gone altogether: the same.
        let items = list_dir(&root, &beneath, b"gone", &skipped, &moved).unwrap();
        assert!(items.is_empty());
        assert_eq!(moved.0.lock().unwrap().0, 2);
    }
}
