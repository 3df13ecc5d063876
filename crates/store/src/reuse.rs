//! Buffers of packs fetched whole into memory, used again by the next
//! fetch while fetches go on.
//!
//! A pack from a peer is received into one buffer of its size (about
//! 32 MiB). Each page of a fresh buffer costs a page fault when it is
//! first written, and on a virtual machine a fault costs the most of all:
//! 0.65 s per GiB of 4 KiB pages on follow-bench's guest (nested, with a
//! balloon that hands freed memory back to its host), against 0.05 s to
//! write the same GiB again once faulted. A gigabyte from a peer faulted
//! a gigabyte of buffers, while `rsync` receives into one small buffer
//! and faults none. So a buffer whose pack has left memory (its files are
//! written) comes back here, and the next fetch takes it.
//!
//! Buffers are kept only while some fetch of the store runs, at most 16
//! of them: when the last fetch ends they are freed, so an idle labd
//! holds none.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

/// Buffers kept at most: as many as packs may be in flight in a process
/// (the cache's `FETCHING`), so every fetch of a busy node can find one.
const KEPT: usize = 16;

/// Buffers below this size are not kept: they cost few faults, and the
/// allocator reuses small ones itself.
const SMALLEST: usize = 4 << 20;

/// Fetches running now, every pull and warm of the process together.
static FETCHES: AtomicUsize = AtomicUsize::new(0);

/// Buffers given back while fetches run: each with where its contents
/// started (the owner aligned them), which a new use keeps.
static KEPT_BUFFERS: Mutex<Vec<(Vec<u8>, usize)>> = Mutex::new(Vec::new());

/// Some fetch runs while this lives: buffers given back are kept for the
/// next one.
pub(crate) struct Fetching(());

impl Fetching {
    pub(crate) fn start() -> Fetching {
        FETCHES.fetch_add(1, Ordering::AcqRel);
        Fetching(())
    }
}

impl Drop for Fetching {
    /// The last fetch to end frees what is kept.
    fn drop(&mut self) {
        if FETCHES.fetch_sub(1, Ordering::AcqRel) == 1 {
            let freed = std::mem::take(&mut *kept());
            drop(freed);
        }
    }
}

fn kept() -> std::sync::MutexGuard<'static, Vec<(Vec<u8>, usize)>> {
    KEPT_BUFFERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A kept buffer with room for `n` bytes after its start, emptied down
/// to its start (the bytes before it are the owner's padding, left as
/// they were); `None` when no kept buffer is large enough. The smallest
/// that fits is taken.
pub fn reused(n: usize) -> Option<(Vec<u8>, usize)> {
    let mut k = kept();
    let (i, _) = k
        .iter()
        .enumerate()
        .filter(|(_, (b, start))| b.capacity() - start >= n)
        .min_by_key(|(_, (b, _))| b.capacity())?;
    let (mut buf, start) = k.swap_remove(i);
    drop(k);
    buf.truncate(start);
    Some((buf, start))
}

/// `buf[start..]` as [`Bytes`]; when the last of its clones is dropped,
/// the buffer is kept for [`reused`] if a fetch still runs and it is
/// large enough to be worth it (and its contents start at a 4 KiB
/// boundary), else freed.
pub fn recycled(buf: Vec<u8>, start: usize) -> Bytes {
    // Only contents that start at a 4 KiB boundary (a pack's, which the
    // cache writes with O_DIRECT from where they are) are worth keeping
    // for a pack.
    let aligned = (buf.as_ptr() as usize + start).is_multiple_of(crate::fsutil::DIRECT_ALIGN);
    if buf.capacity() < SMALLEST || !aligned {
        return Bytes::from(buf).slice(start..);
    }
    Bytes::from_owner(Recycled {
        buf: Some(buf),
        start,
    })
}

struct Recycled {
    buf: Option<Vec<u8>>,
    start: usize,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().map_or(&[], |b| &b[self.start..])
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        if FETCHES.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut k = kept();
        // Checked again under the lock: the last fetch may have ended and
        // emptied the list since.
        if k.len() < KEPT && FETCHES.load(Ordering::Acquire) > 0 {
            k.push((buf, self.start));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests of this module share the process's list: one at a time.
    static ONE: Mutex<()> = Mutex::new(());

    /// A buffer as a pack's: its contents start at a 4 KiB boundary.
    fn big(tag: u8) -> (Vec<u8>, usize) {
        let mut b: Vec<u8> = Vec::with_capacity(SMALLEST + 4096);
        let start = b.as_ptr().align_offset(4096);
        b.resize(start, 0);
        b.extend_from_slice(&[tag; 1000]);
        (b, start)
    }

    #[test]
    fn a_buffer_comes_back_only_while_a_fetch_runs() {
        let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
        let (b, start) = big(7);
        let ptr = b.as_ptr();
        let bytes = recycled(b, start);
        assert_eq!(&bytes[..], &[7u8; 1000][..], "the contents after the start");
        let f = Fetching::start();
        let clone = bytes.clone();
        drop(bytes);
        assert!(reused(10).is_none(), "a clone still holds it");
        drop(clone);
        let (again, again_start) = reused(SMALLEST).expect("kept while the fetch runs");
        assert_eq!(
            (again.as_ptr(), again_start, again.len()),
            (ptr, start, start)
        );
        let start = again_start;
        assert!(reused(1).is_none(), "taken once");
        // Given back again, then the fetch ends: nothing is kept.
        drop(recycled(again, start));
        drop(f);
        assert!(reused(1).is_none(), "freed with the last fetch");
        // With no fetch running, nothing is kept at all.
        let (b, start) = big(1);
        drop(recycled(b, start));
        let _f = Fetching::start();
        assert!(reused(1).is_none());
    }

    #[test]
    fn only_large_buffers_are_kept_and_only_so_many() {
        let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
        let _f = Fetching::start();
        drop(recycled(vec![1u8; 100], 0));
        assert!(reused(1).is_none(), "a small buffer is freed");
        // Contents not at a 4 KiB boundary: no pack could be written from
        // it without a copy.
        let (b, start) = big(9);
        drop(recycled(b, start + 1));
        assert!(reused(1).is_none(), "a misaligned buffer is freed");
        for i in 0..KEPT + 3 {
            let (b, start) = big(i as u8);
            drop(recycled(b, start));
        }
        assert_eq!(kept().len(), KEPT);
        let room = kept().iter().map(|(b, s)| b.capacity() - s).max().unwrap();
        assert!(reused(room + 1).is_none(), "none has the room");
        assert!(reused(room).is_some());
        kept().clear();
    }
}
