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
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rustix::fs::{Advice, OFlags};

use super::beneath::Beneath;
use super::queue::Jobs;

/// Reads (or `statx` calls) in flight on a cold tree: prefetcher threads
/// here, and as many scan listers. Of 1, 4, 16 and 64 parallel `cat`s, 16
/// read the benchmark's sets fastest.
pub(super) const IO_DEPTH: usize = 16;

/// Files the prefetchers may be ahead of the readers.
const AHEAD_FILES: u64 = 1024;

/// Bytes the prefetchers may be ahead of the readers: what the page cache
/// must hold until a reader gets there.
const AHEAD_BYTES: u64 = 256 << 20;

/// Files found in memory in a row after which prefetching stops.
const WARM_STREAK: usize = 64;

/// Whether the source turned out to be in memory, shared by the prefetchers.
#[derive(Default)]
pub(super) struct Warm {
    /// Files in a row found in memory.
    streak: AtomicUsize,
    /// Set once prefetching is pointless.
    stop: AtomicBool,
}

/// One prefetcher: takes the next file in `jobs` once it is within reach
/// of the readers, and starts reading it into the page cache.
pub(super) fn run(jobs: &Jobs, warm: &Warm, beneath: &Beneath) {
    while !warm.stop.load(Ordering::Relaxed) {
        let files = jobs.ahead(AHEAD_FILES, AHEAD_BYTES);
        if files.is_empty() {
            return;
        }
        for (path, room) in files {
            match start_reading(beneath, &path, room) {
                Some(true) => {
                    if warm.streak.fetch_add(1, Ordering::Relaxed) + 1 >= WARM_STREAK {
                        warm.stop.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                _ => warm.streak.store(0, Ordering::Relaxed),
            }
        }
    }
}

/// Opens `path` and asks the kernel to read its first `room` bytes ahead;
/// `Some(true)` when its first byte was already in memory (then nothing is
/// asked), `None` when it cannot be opened or is no longer a regular file
/// (the reader will say why). `O_NONBLOCK`: a FIFO swapped in since the scan
/// must not hang the push.
fn start_reading(beneath: &Beneath, path: &Path, room: u64) -> Option<bool> {
    let fd = beneath
        .open_at(path, OFlags::RDONLY | OFlags::NONBLOCK)
        .ok()?;
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
