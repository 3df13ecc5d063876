//! What the readers, prefetchers and the uploader of a push share: the
//! files to read, in walk order ([`Jobs`]), and the pack buffers that
//! circulate between readers and uploader ([`BufferPool`]).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};

/// One file to read: its place in the walk, path and scanned size.
pub(super) struct Job {
    pub seq: u64,
    pub path: PathBuf,
    pub size: u64,
    /// Bytes of the files queued before it (where the prefetchers are).
    start: u64,
}

/// The files to read, in walk order, shared by readers and prefetchers.
///
/// Readers and prefetchers wait on condition variables of their own, and
/// each new or taken job wakes one of them: waking all eighteen threads for
/// every one of 100,000 small files made a cold push twice as slow.
pub(super) struct Jobs {
    state: Mutex<JobsState>,
    /// A job was queued, or the queue closed.
    for_readers: Condvar,
    /// A job was queued or taken (the readers moved), or the queue closed.
    for_prefetchers: Condvar,
}

struct JobsState {
    /// Jobs no reader has taken yet, oldest first.
    queue: VecDeque<Job>,
    /// Jobs readers have taken: the first in `queue` is job number `taken`.
    taken: u64,
    /// The next job a prefetcher takes (a job number).
    ahead: u64,
    /// Bytes of all jobs queued so far.
    queued_bytes: u64,
    /// No more jobs will come (or the push stopped).
    closed: bool,
}

impl Jobs {
    pub fn new() -> Jobs {
        Jobs {
            state: Mutex::new(JobsState {
                queue: VecDeque::new(),
                taken: 0,
                ahead: 0,
                queued_bytes: 0,
                closed: false,
            }),
            for_readers: Condvar::new(),
            for_prefetchers: Condvar::new(),
        }
    }

    fn wake_all(&self) {
        self.for_readers.notify_all();
        self.for_prefetchers.notify_all();
    }

    /// The state; a panicking holder cannot have left it half changed.
    fn lock(&self) -> std::sync::MutexGuard<'_, JobsState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues a file to read.
    pub fn push(&self, seq: u64, path: PathBuf, size: u64) {
        let mut st = self.lock();
        let start = st.queued_bytes;
        st.queued_bytes = start.saturating_add(size);
        st.queue.push_back(Job {
            seq,
            path,
            size,
            start,
        });
        // Prefetchers take files a batch at a time: a wake-up per batch.
        let batch_ready =
            (st.taken + st.queue.len() as u64).is_multiple_of(Self::AHEAD_BATCH as u64);
        drop(st);
        self.for_readers.notify_one();
        if batch_ready {
            self.for_prefetchers.notify_one();
        }
    }

    /// No more files: readers end once the queue is empty.
    pub fn close(&self) {
        self.lock().closed = true;
        self.wake_all();
    }

    /// Stops readers and prefetchers at once (the push failed).
    pub fn abandon(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.queue.clear();
        drop(st);
        self.wake_all();
    }

    /// The next file for a reader; `None` when there are no more.
    pub(super) fn take(&self) -> Option<Job> {
        let mut st = self.lock();
        loop {
            if let Some(job) = st.queue.pop_front() {
                st.taken += 1;
                // The readers moved a batch on: a prefetcher waiting for
                // room may go on.
                let moved = st.taken.is_multiple_of(Self::AHEAD_BATCH as u64);
                drop(st);
                if moved {
                    self.for_prefetchers.notify_one();
                }
                return Some(job);
            }
            if st.closed {
                return None;
            }
            st = (self.for_readers.wait(st)).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// The next files for a prefetcher (up to [`Jobs::AHEAD_BATCH`] in a
    /// row) once they are within reach of the readers (`limit` files and
    /// `room` bytes ahead of them): their paths and how many of their bytes
    /// to read ahead. Empty when there are no more.
    pub fn ahead(&self, limit: u64, room: u64) -> Vec<(PathBuf, u64)> {
        let mut got = Vec::new();
        let mut st = self.lock();
        loop {
            if st.closed && st.queue.is_empty() {
                return got;
            }
            while got.len() < Self::AHEAD_BATCH {
                let k = st.ahead.max(st.taken);
                let i = (k - st.taken) as usize;
                let (Some(job), Some(first)) = (st.queue.get(i), st.queue.front()) else {
                    break;
                };
                let bytes = job.start - first.start;
                if (i as u64) > limit || bytes >= room {
                    break;
                }
                got.push((job.path.clone(), room - bytes));
                st.ahead = k + 1;
            }
            if !got.is_empty() {
                drop(st);
                if got.len() == Self::AHEAD_BATCH {
                    // More may be in reach: another prefetcher takes them.
                    self.for_prefetchers.notify_one();
                }
                return got;
            }
            st = (self.for_prefetchers.wait(st)).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Files a prefetcher takes at a time: one wake-up per file was most of
    /// a cold push's system time on 100,000 small files.
    const AHEAD_BATCH: usize = 16;
}

/// A fixed number of pack buffers circulating between the readers and the
/// uploader. A reader that needs a new pack waits for the uploader to hand one
/// back, which bounds memory to `n` packs whatever the dataset size, and the
/// reused allocations are already faulted in (a fresh 32 MiB buffer per pack
/// cost 15% of a 1 GB push in page faults).
pub(super) struct BufferPool {
    state: Mutex<PoolState>,
    returned: std::sync::Condvar,
}

struct PoolState {
    free: Vec<Vec<u8>>,
    /// Buffers taken and not given back.
    out: usize,
    closed: bool,
}

impl BufferPool {
    pub fn new(n: usize) -> Arc<BufferPool> {
        Arc::new(BufferPool {
            state: Mutex::new(PoolState {
                free: (0..n).map(|_| Vec::new()).collect(),
                out: 0,
                closed: false,
            }),
            returned: Default::default(),
        })
    }

    /// Blocks until a buffer is free; fails once the uploader has stopped.
    pub(super) fn take(&self) -> Result<Vec<u8>> {
        let mut st = self.state.lock().expect("pool poisoned");
        loop {
            if st.closed {
                return Err(upload_stopped());
            }
            if let Some(b) = st.free.pop() {
                st.out += 1;
                return Ok(b);
            }
            st = self.returned.wait(st).expect("pool poisoned");
        }
    }

    /// Gives a buffer back after its pack was uploaded. Every uploaded pack
    /// comes here, tree packs too, which were not taken from the pool: the
    /// pool keeps as many buffers as were taken, never more (tree packs
    /// interleaved with data packs grew it by one each).
    pub fn give(&self, buf: Vec<u8>) {
        let mut st = self.state.lock().expect("pool poisoned");
        if st.out == 0 {
            return;
        }
        st.out -= 1;
        st.free.push(buf);
        drop(st);
        self.returned.notify_one();
    }

    pub fn close(&self) {
        self.state.lock().expect("pool poisoned").closed = true;
        self.returned.notify_all();
    }
}

/// The error of a reader (or the tree) whose uploader stopped.
pub(super) fn upload_stopped() -> Error {
    Error::Io {
        op: "hand a pack to the uploader (it stopped)",
        path: PathBuf::new(),
        source: std::io::Error::other("upload failed"),
    }
}
