//! Stage 1, scan: every path under the source with what `statx` says of it.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::fsutil::blocking;
use crate::progress::Progress;
use crate::snapshot::Kind;

/// What the scan found, sorted by path.
pub(super) struct Scan {
    /// One per path.
    pub entries: Vec<Scanned>,
    /// Wall clock (ns since the epoch) taken before any file was looked at:
    /// the files cache's racy rule compares with it.
    pub started_ns: i64,
}

/// Scans `root` off the async runtime with `threads` listers, as `read_as`.
pub(super) async fn scan_source(
    root: &Path,
    threads: usize,
    read_as: Option<(u32, u32)>,
    progress: &Arc<dyn Progress>,
) -> Result<Scan> {
    let started_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    progress.phase("scan", None, None);
    let (root, progress) = (root.to_path_buf(), progress.clone());
    let mut entries =
        blocking(move || scan(&root, threads.max(1), read_as, progress.as_ref())).await?;
    link_groups(&mut entries);

    tracing::debug!(entries = entries.len(), "push: scanned");
    Ok(Scan {
        entries,
        started_ns,
    })
}

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

/// Lists `root` recursively, sorted by path. Folders are listed by `threads`
/// workers sharing a stack of folders still to list: the scan is one
/// `statx` per entry, and on one thread it was a tenth of a cold push of
/// 50,000 small files and most of a re-push, with the other cores idle.
fn scan(
    root: &Path,
    threads: usize,
    read_as: Option<(u32, u32)>,
    progress: &dyn Progress,
) -> Result<Vec<Scanned>> {
    let meta = std::fs::symlink_metadata(root).map_err(Error::io("read", root))?;
    let mut out = Vec::new();
    if !meta.is_dir() {
        let name = root.file_name().ok_or_else(|| {
            Error::invalid(format!("source {}", root.display()), "has no file name")
        })?;
        let parent = root.parent().unwrap_or(Path::new("."));
        let skipped = Skipped::default();
        if let Some(s) = scanned(parent, name.as_bytes().to_vec(), &meta, &skipped)? {
            out.push(s);
        }
        skipped.warn(progress);
        return Ok(out);
    }
    struct Shared {
        to_list: Vec<Vec<u8>>,
        listing: usize,
        failed: Option<Error>,
    }
    let skipped = Skipped::default();
    let shared = Mutex::new(Shared {
        to_list: vec![Vec::new()],
        listing: 0,
        failed: None,
    });
    let changed = std::sync::Condvar::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let _as = crate::fsutil::ReadAs::enter(read_as);
                    let mut found = Vec::new();
                    loop {
                        let rel = {
                            let mut st = shared.lock().expect("scan poisoned");
                            loop {
                                if st.failed.is_some() {
                                    return found;
                                }
                                if let Some(d) = st.to_list.pop() {
                                    st.listing += 1;
                                    break d;
                                }
                                if st.listing == 0 {
                                    return found;
                                }
                                st = changed.wait(st).expect("scan poisoned");
                            }
                        };
                        let listed = list_dir(root, &rel, &skipped, &mut found);
                        let mut st = shared.lock().expect("scan poisoned");
                        st.listing -= 1;
                        match listed {
                            Ok(dirs) => st.to_list.extend(dirs),
                            Err(e) => {
                                st.failed.get_or_insert(e);
                            }
                        }
                        changed.notify_all();
                    }
                })
            })
            .collect();
        for w in workers {
            out.extend(w.join().expect("scan worker panicked"));
        }
    });
    if let Some(e) = shared.into_inner().expect("scan poisoned").failed {
        return Err(e);
    }
    skipped.warn(progress);
    out.sort_unstable_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Makes every name of a file with several names, after the first in path
/// order, a hard link to that first one: its data is read, stored and
/// written once (DF2K is DIV2K and Flickr2K hard-linked).
fn link_groups(entries: &mut [Scanned]) {
    let mut first: std::collections::HashMap<(u64, u64), usize> = Default::default();
    for i in 0..entries.len() {
        let s = &entries[i];
        if s.kind != Kind::File || s.nlink < 2 {
            continue;
        }
        match first.get(&(s.dev, s.ino)) {
            Some(&f) => {
                let target = entries[f].path.clone();
                let s = &mut entries[i];
                s.kind = Kind::HardLink;
                s.target = target;
                s.size = 0;
            }
            None => {
                first.insert((s.dev, s.ino), i);
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

    fn warn(&self, progress: &dyn Progress) {
        let (n, first) = std::mem::take(&mut *self.0.lock().expect("scan poisoned"));
        if n == 0 {
            return;
        }
        let names: Vec<_> = first.iter().map(|p| String::from_utf8_lossy(p)).collect();
        progress.warn(&format!(
            "skipped {n} entries that are not files, folders or symlinks (FIFOs, sockets, \
             devices: a store keeps none of them): {}{}",
            names.join(", "),
            if n as usize > names.len() {
                ", ..."
            } else {
                ""
            }
        ));
    }
}

/// Lists one folder (`rel` under `root`) into `found`; returns its subfolders.
fn list_dir(
    root: &Path,
    rel: &[u8],
    skipped: &Skipped,
    found: &mut Vec<Scanned>,
) -> Result<Vec<Vec<u8>>> {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(std::ffi::OsStr::from_bytes(rel))
    };
    let mut dirs = Vec::new();
    let rd = std::fs::read_dir(&dir).map_err(Error::io("list", &dir))?;
    for ent in rd {
        let ent = ent.map_err(Error::io("list", &dir))?;
        let name = ent.file_name();
        let mut path = rel.to_vec();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(name.as_bytes());
        if path.iter().filter(|&&b| b == b'/').count() >= crate::snapshot::MAX_DEPTH {
            return Err(Error::invalid(
                format!("source path {}", ent.path().display()),
                "more than 256 folders deep (labsync keeps trees up to 256 deep)",
            ));
        }
        let m = match ent.metadata() {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io("stat", ent.path())(e)),
        };
        if let Some(s) = scanned(&dir, path, &m, skipped)? {
            if s.kind == Kind::Dir {
                dirs.push(s.path.clone());
            }
            found.push(s);
        }
    }
    Ok(dirs)
}

fn scanned(
    dir: &Path,
    path: Vec<u8>,
    m: &std::fs::Metadata,
    skipped: &Skipped,
) -> Result<Option<Scanned>> {
    let ft = m.file_type();
    let (kind, target) = if ft.is_file() {
        (Kind::File, Vec::new())
    } else if ft.is_dir() {
        (Kind::Dir, Vec::new())
    } else if ft.is_symlink() {
        let name = std::ffi::OsStr::from_bytes(path.rsplit(|&b| b == b'/').next().unwrap_or(&path));
        let full = dir.join(name);
        let t = std::fs::read_link(&full).map_err(Error::io("read link", &full))?;
        (Kind::Symlink, t.as_os_str().as_bytes().to_vec())
    } else {
        skipped.add(path);
        return Ok(None);
    };
    Ok(Some(Scanned {
        kind,
        mode: crate::snapshot::allowed_mode(kind, m.mode()),
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
        ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
        ino: m.ino(),
        dev: m.dev(),
        nlink: m.nlink(),
        size: if kind == Kind::File { m.size() } else { 0 },
        path,
        target,
    }))
}
