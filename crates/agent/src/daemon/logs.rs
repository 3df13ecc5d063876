//! Job logs: followers woken when a log grows, logs kept under their cap by
//! punching out their middle, and reads that skip the hole.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::node::Node;

/// The logs of a node's jobs (the files are the engine's; this keeps them
/// bounded and tells followers when they change).
pub(crate) struct JobLogs {
    node: Arc<Node>,
    /// Cap on one log on disk.
    log_max: u64,
    /// Per job followed: bumped when its log grows or the job changes state,
    /// so log followers sleep until then.
    watch: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Held while a log is bounded.
    bounding: Mutex<()>,
    /// Jobs whose log could not be cut (said once each).
    warned: Mutex<HashSet<String>>,
    /// Jobs whose log held disk they allocated, freed (said once each).
    hoarders: Mutex<HashSet<String>>,
    /// Fresh jobs whose log one task looks at often for their followers
    /// (`Daemon::watch_fresh`).
    watched: Mutex<HashSet<String>>,
}

impl JobLogs {
    pub fn new(node: Arc<Node>, log_max: u64) -> JobLogs {
        JobLogs {
            node,
            log_max,
            watch: Mutex::new(HashMap::new()),
            bounding: Mutex::new(()),
            warned: Mutex::new(HashSet::new()),
            hoarders: Mutex::new(HashSet::new()),
            watched: Mutex::new(HashSet::new()),
        }
    }

    /// Marks `id`'s log as watched; false when it already was.
    pub fn start_watching(&self, id: &str) -> bool {
        (self.watched.lock().expect("labd poisoned")).insert(id.to_string())
    }

    /// See [`JobLogs::start_watching`].
    pub fn stop_watching(&self, id: &str) {
        self.watched.lock().expect("labd poisoned").remove(id);
    }

    /// Whether anyone follows `id`'s log now.
    pub fn followed(&self, id: &str) -> bool {
        (self.watch.lock().expect("labd poisoned"))
            .get(id)
            .is_some_and(|tx| tx.receiver_count() > 0)
    }

    /// A receiver that changes when `id`'s log grows or the job changes state.
    pub fn subscribe(&self, id: &str) -> watch::Receiver<u64> {
        self.watch
            .lock()
            .expect("labd poisoned")
            .entry(id.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// Wakes the followers of `id`'s log: when `size` is new, or always
    /// (`None`: the job's state changed).
    pub fn wake(&self, id: &str, size: Option<u64>) {
        let watch = self.watch.lock().expect("labd poisoned");
        if let Some(tx) = watch.get(id) {
            tx.send_if_modified(|v| match size {
                Some(s) if *v == s => false,
                Some(s) => {
                    *v = s;
                    true
                }
                None => true,
            });
        }
    }

    /// Drops the channels of logs nobody follows any more.
    pub fn forget_unfollowed(&self) {
        self.watch
            .lock()
            .expect("labd poisoned")
            .retain(|_, tx| tx.receiver_count() > 0);
    }

    /// Keeps the job's log under `log_max` on disk: once it grows past the
    /// cap (plus an eighth, so the database is written once per few MB, not
    /// per line), everything between its first half and its last half is
    /// punched out. The job's keeper ([`crate::keeper`]) keeps appending to
    /// the same file; readers skipping the hole are told how much was cut.
    ///
    /// A job started by a labd before keepers (adopted) holds the file
    /// itself (its stdout), and may clear `O_APPEND`
    /// on it, then write back into the cut part, which does not move the
    /// file's size. So when the file holds more blocks than the cap (XFS
    /// counts its preallocation past the end there too) and there is data
    /// in the cut part (`SEEK_DATA`), that part is punched again whole.
    /// It may also `fallocate` it: blocks past the end (`KEEP_SIZE`), or
    /// unwritten ones in the cut part (holes to `SEEK_DATA`), charged to
    /// root, whom no quota stops. A file holding two caps more than its
    /// data has them freed: the cut part punched, the file truncated to its
    /// own size (which frees what lies past it on ext4 and XFS).
    pub fn bound(&self, id: &str) {
        use std::os::unix::fs::MetadataExt;
        // One at a time: a kill's tick may run beside the ticker's, and a
        // cut must only ever grow.
        let _one = self.bounding.lock().expect("labd poisoned");
        let cap = self.log_max;
        let limit = cap + cap / 8;
        let path = self.node.log_path(id);
        let Ok(md) = std::fs::symlink_metadata(&path) else {
            return;
        };
        let size = md.len();
        let held = md.blocks() * 512;
        self.wake(id, Some(size));
        let Ok(Some(rec)) = self.node.job(id) else {
            return;
        };
        // Bytes [start, done) are cut already; start is fixed at the first cut.
        let start = rec
            .meta
            .log_cut
            .map_or((cap / 2).div_ceil(LOG_BLOCK) * LOG_BLOCK, |(s, _)| s);
        let done = rec.meta.log_cut.map_or(start, |(_, e)| e);
        let on_disk = start + size.saturating_sub(done);
        let end = size.saturating_sub(cap / 2) / LOG_BLOCK * LOG_BLOCK;
        let grew = on_disk > limit && end > done;
        let hoarded = held > on_disk.saturating_add(2 * cap)
            && !self.warned.lock().expect("labd poisoned").contains(id);
        if hoarded {
            let keep = on_disk.saturating_add(2 * cap);
            match free_hoard(&path, start..done, held, keep) {
                Ok(truncated) => {
                    let first = (self.hoarders.lock().expect("labd poisoned")).insert(id.into());
                    if first || truncated {
                        tracing::warn!(
                            "job {id}: its log held {held} bytes of disk for {on_disk} bytes of \
                             output; freed{}",
                            if truncated {
                                " (allocated past its end by the job)"
                            } else {
                                ""
                            }
                        );
                    }
                }
                Err(e) => {
                    self.warned
                        .lock()
                        .expect("labd poisoned")
                        .insert(id.to_string());
                    tracing::warn!(
                        "job {id}: its log holds {held} bytes of disk for {on_disk} bytes of \
                         output, and they cannot be freed: {e}"
                    );
                }
            }
        }
        let refilled = held > limit
            && done > start
            // Where punching failed once (NFS), it is not tried each tick.
            && !self.warned.lock().expect("labd poisoned").contains(id)
            && data_between(&path, start, done);
        if !grew && !refilled {
            return;
        }
        if grew {
            // Recorded before the bytes go, so a reader never reads the
            // hole as zeros: it either sees the cut or reads bytes still
            // there.
            if let Err(e) = self
                .node
                .update_meta(id, |m| m.log_cut = Some((start, end)))
            {
                tracing::error!("job state: {e}");
                return;
            }
        }
        let cut = if grew { end } else { done };
        // Written back into, the cut part goes again whole; otherwise only
        // what is new in it.
        let from = if refilled { start } else { done };
        let freed = cut_log(&path, from..cut);
        if let Err(e) = freed {
            // Once per job: a file system without hole punching (NFS) would
            // say it ten times a second.
            if self
                .warned
                .lock()
                .expect("labd poisoned")
                .insert(id.to_string())
            {
                tracing::warn!(
                    "job {id}: cannot free the cut part of its log {} ({e}); it stays on disk",
                    path.display()
                );
            }
        }
    }
}

/// Logs are cut at multiples of this.
const LOG_BLOCK: u64 = 4096;

/// A missing log is an error (`NotFound`): whether that is an empty log
/// (a job that never started) or lost output is the caller's to say.
fn read_from(path: &Path, offset: u64, max: usize) -> std::io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = Vec::new();
    f.take(max as u64).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Up to `max` bytes of a job's log from `offset`, and the offset to ask
/// for next. The range `cut` is a hole labd punched: a reader at its start
/// (or inside it) gets one line saying how much was cut, then the bytes after
/// it; a read never runs into it.
pub(crate) fn read_log(
    path: &Path,
    offset: u64,
    max: usize,
    cut: Option<(u64, u64)>,
) -> std::io::Result<(Vec<u8>, u64)> {
    match cut {
        Some((start, end)) if (start..end).contains(&offset) => {
            let mut out = format!(
                "\n[labd: {} bytes of output cut here to keep the log under its cap (log_max)]\n",
                end - offset
            )
            .into_bytes();
            let rest = read_from(path, end, max)?;
            let next = end + rest.len() as u64;
            out.extend(rest);
            Ok((out, next))
        }
        Some((start, _)) if offset < start => {
            let bytes = read_from(path, offset, max.min((start - offset) as usize))?;
            let next = offset + bytes.len() as u64;
            Ok((bytes, next))
        }
        _ => {
            let bytes = read_from(path, offset, max)?;
            let next = offset + bytes.len() as u64;
            Ok((bytes, next))
        }
    }
}

/// Whether the log at `path` holds data (not a hole) anywhere in
/// `[start, end)`; false where it cannot be told.
fn data_between(path: &Path, start: u64, end: u64) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return false;
    };
    rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(start)).is_ok_and(|at| at < end)
}

/// Frees what the log at `path` holds beyond its output (`held` bytes of
/// disk where `keep` would do): the cut part `cut` punched again, then
/// what lies past the end punched too (XFS frees its preallocation and
/// what a job allocated there so; ext4 stops a punch at the file's size).
/// Still over `keep` (ext4), the file is truncated to its own size, which
/// frees the blocks past it, unless its size moved meanwhile; a byte the
/// job appends between that look and the truncation is lost, and only a
/// job that allocated disk past its log's end gets there. True when it
/// did.
fn free_hoard(
    path: &Path,
    cut: std::ops::Range<u64>,
    held: u64,
    keep: u64,
) -> std::io::Result<bool> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = File::options()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    punch(&f, cut)?;
    let size = f.metadata()?.len();
    let _ = punch(&f, size..size.saturating_add(held));
    let md = f.metadata()?;
    if md.blocks() * 512 > keep && md.len() == size {
        f.set_len(size)?;
        return Ok(true);
    }
    Ok(false)
}

/// Frees the bytes `range` of the log at `path` (the file keeps its size).
fn cut_log(path: &Path, range: std::ops::Range<u64>) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if range.is_empty() {
        return Ok(());
    }
    let f = File::options()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    punch(&f, range)
}

/// Punches the bytes `range` of `f` out (its size stays).
#[allow(unsafe_code)]
fn punch(f: &File, range: std::ops::Range<u64>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if range.is_empty() {
        return Ok(());
    }
    // SAFETY: fallocate(2) on a descriptor we own, with plain integers; it
    // touches no memory of ours.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            range.start as libc::off_t,
            (range.end - range.start) as libc::off_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
