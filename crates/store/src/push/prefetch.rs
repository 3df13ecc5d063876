//! Read-ahead for a cold source: I/O concurrency apart from the readers.
//!
//! The readers (stage 3) are as many as the CPUs, because chunking and
//! hashing is CPU work. A tree nobody has read since boot is not in the page
//! cache, and then each reader waits on one read at a time: a cold push of
//! the `sr` set ran at the speed of one `cat` (2.5 s), where 16 parallel
//! `cat`s read it in 1.1 s. So a few threads walk the files the readers will
//! take next and ask the kernel to start reading them
//! (`posix_fadvise(WILLNEED)`, asynchronous). They stay at most
//! [`AHEAD_FILES`] files and [`AHEAD_BYTES`] bytes ahead, so what they bring
//! in is still in the cache when a reader gets there.
//!
//! A warm tree needs none of it: each prefetcher first asks, without
//! waiting, for a file's first byte (`preadv2(RWF_NOWAIT)`); after
//! [`WARM_STREAK`] files in a row that were already in memory, prefetching
//! stops for the push.

use std::num::NonZeroU64;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use rustix::fs::{Advice, Mode, OFlags};

/// Reads (or `statx` calls) in flight on a cold tree: prefetcher threads
/// here, and at least as many scan workers. Of 1, 4, 16 and 64 parallel
/// `cat`s, 16 read the benchmark's sets fastest.
pub(super) const IO_DEPTH: usize = 16;

/// Files the prefetchers may be ahead of the readers.
const AHEAD_FILES: usize = 1024;

/// Bytes the prefetchers may be ahead of the readers: what the page cache
/// must hold until a reader gets there.
const AHEAD_BYTES: u64 = 256 << 20;

/// Files found in memory in a row after which prefetching stops.
const WARM_STREAK: usize = 64;

/// Where the readers are, shared with the prefetchers.
pub(super) struct Progress<'a> {
    /// Byte offset of each file in the reading order, and the total at the end.
    starts: Vec<u64>,
    /// The next file a reader takes (the readers' own counter).
    pub next: &'a AtomicUsize,
    /// The next file a prefetcher takes.
    ahead: AtomicUsize,
    /// Files in a row found in memory.
    streak: AtomicUsize,
    /// Set when the readers are done or prefetching is pointless.
    pub stop: AtomicBool,
}

impl<'a> Progress<'a> {
    /// For files of `sizes`, read in that order, by readers counting with `next`.
    pub fn new(sizes: impl Iterator<Item = u64>, next: &'a AtomicUsize) -> Self {
        let mut starts = vec![0u64];
        for s in sizes {
            let last = *starts.last().expect("non-empty");
            starts.push(last.saturating_add(s));
        }
        Progress {
            starts,
            next,
            ahead: AtomicUsize::new(0),
            streak: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Files in the reading order.
    fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// Waits until file `k` is within reach of the readers: `Some(n)` to
    /// read up to `n` bytes of it ahead (what is left of [`AHEAD_BYTES`]:
    /// one huge checkpoint must not push out what was read ahead of it),
    /// `Some(0)` when a reader has it already, `None` when prefetching is
    /// over.
    fn wait_for_room(&self, k: usize) -> Option<u64> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            let next = self.next.load(Ordering::Relaxed).min(self.len());
            if k < next {
                return Some(0);
            }
            let bytes = self.starts[k] - self.starts[next];
            if k - next <= AHEAD_FILES && bytes < AHEAD_BYTES {
                return Some(AHEAD_BYTES - bytes);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Sets `stop` when dropped: the prefetchers end however the readers do
/// (a panic while they are started included).
pub(super) struct StopOnDrop<'a>(pub &'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// One prefetcher: takes the next file, waits until it is within reach,
/// and starts reading it into the page cache. `path_of(k)` is the k-th file.
pub(super) fn run(progress: &Progress<'_>, path_of: &(dyn Fn(usize) -> PathBuf + Sync)) {
    loop {
        let k = progress.ahead.fetch_add(1, Ordering::Relaxed);
        if k >= progress.len() {
            return;
        }
        let room = match progress.wait_for_room(k) {
            None => return,
            Some(0) => continue,
            Some(room) => room,
        };
        match start_reading(&path_of(k), room) {
            Some(true) => {
                if progress.streak.fetch_add(1, Ordering::Relaxed) + 1 >= WARM_STREAK {
                    progress.stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
            _ => progress.streak.store(0, Ordering::Relaxed),
        }
    }
}

/// Opens `path` and asks the kernel to read its first `room` bytes ahead;
/// `Some(true)` when its first byte was already in memory (then nothing is
/// asked), `None` when it cannot be opened or is no longer a regular file
/// (the reader will say why). `O_NONBLOCK`: a FIFO swapped in since the scan
/// must not hang the push.
fn start_reading(path: &Path, room: u64) -> Option<bool> {
    let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK;
    let fd = rustix::fs::open(path, flags, Mode::empty()).ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return None;
    }
    let mut byte = [0u8; 1];
    let probe = rustix::io::preadv2(
        fd.as_fd(),
        &mut [std::io::IoSliceMut::new(&mut byte)],
        0,
        rustix::io::ReadWriteFlags::NOWAIT,
    );
    match probe {
        Ok(_) => Some(true),
        // Not in memory (EAGAIN), or the file system cannot say: read ahead.
        Err(_) => {
            let _ = rustix::fs::fadvise(&fd, 0, NonZeroU64::new(room), Advice::WillNeed);
            Some(false)
        }
    }
}
