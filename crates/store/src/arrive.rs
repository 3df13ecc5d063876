//! Packs arriving while a pull writes files: the two overlap.
//!
//! A pull used to fetch every missing pack, then write every file. Now
//! writers start at once and each file waits only for its own packs. The
//! packs are fetched in the order the writers first need them, and a pack
//! fetched whole into memory is kept there for its files (up to
//! [`FRESH_MAX`] bytes), so they are read from memory rather than from
//! the cache's copy just written. Chunks read from memory are verified like
//! those read from the cache: nothing unverified reaches a file.
//!
//! The memory bound holds for the whole process: several pulls at once (a
//! job's code and data, several jobs) share [`FRESH_MAX`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};
use crate::pack::PackEntry;
use std::borrow::Cow;

/// Bytes of fetched packs kept in memory for the files still to write, by
/// every pull of the process together. Past it a pack goes to the cache
/// only, and its files read it there.
pub(crate) const FRESH_MAX: u64 = 256 << 20;

/// Bytes held in memory now, every pull together.
static HELD: AtomicU64 = AtomicU64::new(0);

/// Takes `n` bytes of the process's allowance; false when they do not fit.
fn take(n: u64) -> bool {
    HELD.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
        (h + n <= FRESH_MAX).then_some(h + n)
    })
    .is_ok()
}

fn give_back(n: u64) {
    HELD.fetch_sub(n, Ordering::AcqRel);
}

/// The packs a pull waits for, and those in memory.
pub(crate) struct Arrivals {
    state: Mutex<State>,
    arrived: Condvar,
}

#[derive(Default)]
struct State {
    /// Neither in memory nor in the cache yet: writers wait for these.
    waiting: HashSet<PackId>,
    /// Not yet in the cache (possibly in memory).
    unwritten: HashSet<PackId>,
    /// In memory, for the files that still need it.
    fresh: HashMap<PackId, Arc<Fresh>>,
    fresh_bytes: u64,
    /// In memory until its cache copy is written behind the pull
    /// ([`crate::CacheWrites`], which bounds their memory), for any file.
    pending: HashMap<PackId, Arc<Fresh>>,
    /// Copies to be rebuilt behind the pull from the files written
    /// ([`Arrivals::offer_rebuilt`]): not in the cache until then.
    rebuilt: HashSet<PackId>,
    /// Files still to write, per pack.
    users: HashMap<PackId, usize>,
    /// The fetch gave up: waiting is over.
    failed: bool,
}

/// The fetch gave up; the writer stops (the fetch's error is the one
/// reported).
#[derive(Debug)]
pub(crate) struct FetchFailed;

impl Arrivals {
    /// Waiting for `missing`; `uses` lists, per file to write, the packs it
    /// needs (each once).
    pub(crate) fn new(
        missing: impl IntoIterator<Item = PackId>,
        uses: impl IntoIterator<Item = Vec<PackId>>,
    ) -> Arrivals {
        let mut users: HashMap<PackId, usize> = HashMap::new();
        for packs in uses {
            for p in packs {
                *users.entry(p).or_default() += 1;
            }
        }
        let waiting: HashSet<PackId> = missing.into_iter().collect();
        Arrivals {
            state: Mutex::new(State {
                unwritten: waiting.clone(),
                waiting,
                users,
                ..State::default()
            }),
            arrived: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("arrivals poisoned")
    }

    /// All of `pack`, fetched and not yet in the cache: kept in memory
    /// while files need it and there is room, and then no longer awaited.
    pub(crate) fn offer(&self, pack: PackId, fresh: Fresh) {
        let mut s = self.lock();
        let size = fresh.bytes.len() as u64;
        let needed = s.users.get(&pack).is_some_and(|&n| n > 0);
        if !needed || s.fresh.contains_key(&pack) || !take(size) {
            return;
        }
        s.fresh_bytes += size;
        s.fresh.insert(pack, Arc::new(fresh));
        s.waiting.remove(&pack);
        drop(s);
        self.arrived.notify_all();
    }

    /// `pack` is fetched: in the cache, or in memory until its copy is
    /// written behind ([`Arrivals::offer_pending`]), or in memory while
    /// its files need it and its copy rebuilt behind
    /// ([`Arrivals::offer_rebuilt`]): not in the cache until
    /// [`Arrivals::written`] says so.
    pub(crate) fn arrived(&self, pack: PackId) {
        let mut s = self.lock();
        s.waiting.remove(&pack);
        if !s.pending.contains_key(&pack) && !s.rebuilt.contains(&pack) {
            s.unwritten.remove(&pack);
        }
        drop(s);
        self.arrived.notify_all();
    }

    /// All of `pack`, fetched, its cache copy to be written later: files
    /// read it from memory until [`Arrivals::written`].
    pub(crate) fn offer_pending(&self, pack: PackId, fresh: Fresh) {
        let mut s = self.lock();
        s.pending.insert(pack, Arc::new(fresh));
        s.waiting.remove(&pack);
        drop(s);
        self.arrived.notify_all();
    }

    /// All of `pack`, fetched, its cache copy to be rebuilt behind the
    /// pull from the files it is written to: kept in memory like
    /// [`Arrivals::offer`] (until its files are written, within
    /// [`FRESH_MAX`]), and not in the cache until [`Arrivals::written`]
    /// (though no writer waits for it there: it comes only after the
    /// pull, [`Arrivals::wait_in_cache`]). False, and nothing kept, when there is no
    /// room: the caller holds the pack for its copy instead
    /// ([`Arrivals::offer_pending`]).
    pub(crate) fn offer_rebuilt(&self, pack: PackId, fresh: Fresh) -> bool {
        let mut s = self.lock();
        let size = fresh.bytes.len() as u64;
        if s.fresh.contains_key(&pack) || !take(size) {
            return false;
        }
        s.fresh_bytes += size;
        s.fresh.insert(pack, Arc::new(fresh));
        s.waiting.remove(&pack);
        s.rebuilt.insert(pack);
        drop(s);
        self.arrived.notify_all();
        true
    }

    /// `pack`'s copy is in the cache: files read it there.
    pub(crate) fn written(&self, pack: PackId) {
        let mut s = self.lock();
        s.pending.remove(&pack);
        s.rebuilt.remove(&pack);
        s.unwritten.remove(&pack);
        drop(s);
        self.arrived.notify_all();
    }

    /// `pack`'s copy could not be written: a held pack stays in memory for
    /// this pull's files, and no one waits for the copy.
    pub(crate) fn not_written(&self, pack: PackId) {
        let mut s = self.lock();
        s.rebuilt.remove(&pack);
        s.unwritten.remove(&pack);
        drop(s);
        self.arrived.notify_all();
    }

    /// Blocks until `pack` is in the cache, or the fetch is over; at once
    /// when its copy is to be rebuilt from the files, which comes only
    /// after the pull.
    pub(crate) fn wait_in_cache(&self, pack: &PackId) {
        let mut s = self.lock();
        while s.unwritten.contains(pack) && !s.failed && !s.rebuilt.contains(pack) {
            s = self.arrived.wait(s).expect("arrivals poisoned");
        }
    }

    /// The fetch is over: whatever is still awaited is read from the cache
    /// (it was there already, or its absence is reported).
    pub(crate) fn finished(&self) {
        let mut s = self.lock();
        s.waiting.clear();
        let State {
            unwritten,
            pending,
            rebuilt,
            ..
        } = &mut *s;
        unwritten.retain(|p| pending.contains_key(p) || rebuilt.contains(p));
        drop(s);
        self.arrived.notify_all();
    }

    /// The fetch failed: nothing more will arrive.
    pub(crate) fn fail(&self) {
        self.lock().failed = true;
        self.arrived.notify_all();
    }

    /// Blocks until every pack in `packs` is in the cache.
    pub(crate) fn wait_for(&self, packs: &[PackId]) -> Result<(), FetchFailed> {
        let mut s = self.lock();
        loop {
            if !packs.iter().any(|p| s.waiting.contains(p)) {
                return Ok(());
            }
            if s.failed {
                return Err(FetchFailed);
            }
            s = self.arrived.wait(s).expect("arrivals poisoned");
        }
    }

    /// The pack, when it is in memory.
    pub(crate) fn fresh(&self, pack: &PackId) -> Option<Arc<Fresh>> {
        let s = self.lock();
        s.fresh.get(pack).or_else(|| s.pending.get(pack)).cloned()
    }

    /// A file that needed `packs` is written: a pack no file needs any
    /// more leaves memory.
    pub(crate) fn done_with(&self, packs: &[PackId]) {
        let mut s = self.lock();
        for p in packs {
            let left = match s.users.get_mut(p) {
                Some(n) => {
                    *n = n.saturating_sub(1);
                    *n
                }
                None => 0,
            };
            if left == 0 {
                if let Some(f) = s.fresh.remove(p) {
                    s.fresh_bytes -= f.bytes.len() as u64;
                    give_back(f.bytes.len() as u64);
                }
            }
        }
    }

    /// A pack found corrupt is fetched again: its copy in memory goes.
    pub(crate) fn forget(&self, pack: &PackId) {
        let mut s = self.lock();
        s.pending.remove(pack);
        if let Some(f) = s.fresh.remove(pack) {
            s.fresh_bytes -= f.bytes.len() as u64;
            give_back(f.bytes.len() as u64);
        }
    }
}

impl Drop for Arrivals {
    /// What this pull still holds goes back to the process's allowance.
    fn drop(&mut self) {
        let held = self.state.get_mut().map_or(0, |s| s.fresh_bytes);
        give_back(held);
    }
}

/// A pack just fetched whole into memory.
pub(crate) struct Fresh {
    /// All of it.
    pub(crate) bytes: Bytes,
    /// Its entries by chunk, when every chunk was checked against its id
    /// as it arrived (from a peer); `None` when nothing was checked yet.
    pub(crate) verified: Option<HashMap<ChunkId, PackEntry>>,
}

impl Fresh {
    /// The plain bytes of the chunk `entry` (the index's) locates, checked
    /// against its id unless the pack's own verified entry for that chunk
    /// is the very same: then it was checked on arrival.
    pub(crate) fn plain(&self, pack: &PackId, entry: &PackEntry) -> Result<Cow<'_, [u8]>> {
        let stored = usize::try_from(entry.offset)
            .ok()
            .and_then(|o| self.bytes.get(o..o.checked_add(entry.stored_len as usize)?))
            .ok_or_else(|| Error::corrupt(format!("pack {pack}"), "entry past the end"))?;
        let checked = (self.verified.as_ref()).is_some_and(|v| v.get(&entry.id) == Some(entry));
        if checked {
            entry.decompress(stored, pack)
        } else {
            entry.decode(stored, pack)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn bytes(b: Bytes) -> Fresh {
        Fresh {
            bytes: b,
            verified: None,
        }
    }

    fn id(n: u8) -> PackId {
        PackId::of(&[n])
    }

    /// The allowance is the process's: tests that take of it run one at
    /// a time, so none finds it used up by another.
    static ALLOWANCE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn alone() -> std::sync::MutexGuard<'static, ()> {
        ALLOWANCE.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn a_writer_waits_for_its_own_packs_only() {
        let _alone = alone();
        let (a, b) = (id(1), id(2));
        let uses = [vec![a], vec![b]];
        let arr = std::sync::Arc::new(Arrivals::new([a, b], uses));
        let waiter = {
            let arr = arr.clone();
            std::thread::spawn(move || arr.wait_for(&[b]))
        };
        arr.offer(a, bytes(Bytes::from_static(b"pack a")));
        assert!(arr.wait_for(&[a]).is_ok(), "a is there");
        assert_eq!(arr.fresh(&a).unwrap().bytes, &b"pack a"[..]);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished(), "b has not arrived");
        arr.arrived(b);
        assert!(waiter.join().unwrap().is_ok());
        assert!(arr.fresh(&b).is_none(), "b came without its bytes");
        arr.done_with(&[a]);
        assert!(arr.fresh(&a).is_none(), "no file needs a any more");
    }

    #[test]
    fn a_failed_fetch_ends_every_wait() {
        let a = id(1);
        let uses = [vec![a]];
        let arr = std::sync::Arc::new(Arrivals::new([a], uses));
        let waiter = {
            let arr = arr.clone();
            std::thread::spawn(move || arr.wait_for(&[a]))
        };
        arr.fail();
        assert!(waiter.join().unwrap().is_err());
    }

    /// A pack whose copy is rebuilt from its files leaves memory with
    /// them, yet is not in the cache until the copy is written.
    #[test]
    fn a_pack_to_rebuild_leaves_memory_with_its_files_and_is_awaited_in_the_cache() {
        let _alone = alone();
        let (a, b) = (id(1), id(2));
        let arr = std::sync::Arc::new(Arrivals::new([a, b], [vec![a], vec![a]]));
        assert!(arr.offer_rebuilt(a, bytes(Bytes::from_static(b"pack a"))));
        arr.arrived(a);
        assert!(arr.wait_for(&[a]).is_ok());
        assert!(arr.fresh(&a).is_some());
        arr.done_with(&[a]);
        assert!(arr.fresh(&a).is_some(), "one file still needs it");
        arr.done_with(&[a]);
        assert!(arr.fresh(&a).is_none(), "out of memory with its files");
        assert_eq!(arr.lock().fresh_bytes, 0);
        arr.finished();
        assert!(arr.lock().unwritten.contains(&a), "not in the cache yet");
        // Its copy comes after the pull: a writer of this pull does not
        // wait for it.
        arr.wait_in_cache(&a);
        arr.written(a);
        assert!(!arr.lock().unwritten.contains(&a));
        // Over the allowance, nothing is taken: the caller holds it.
        let big = Bytes::from(vec![0u8; FRESH_MAX as usize + 1]);
        assert!(!arr.offer_rebuilt(b, bytes(big)));
        assert!(arr.fresh(&b).is_none());
    }

    #[test]
    fn memory_is_bounded_and_a_corrupt_copy_forgotten() {
        let _alone = alone();
        let (a, b) = (id(1), id(2));
        let uses = [vec![a], vec![b]];
        let arr = Arrivals::new([a, b], uses);
        let big = Bytes::from(vec![0u8; FRESH_MAX as usize - 10]);
        arr.offer(a, bytes(big));
        arr.offer(b, bytes(Bytes::from(vec![1u8; 100])));
        assert!(arr.fresh(&a).is_some());
        assert!(
            arr.fresh(&b).is_none(),
            "over the cap: b is read from the cache"
        );
        assert!(
            arr.lock().waiting.contains(&b),
            "and awaited until it is there"
        );
        arr.forget(&a);
        assert!(arr.fresh(&a).is_none());
        assert_eq!(arr.lock().fresh_bytes, 0);
    }
}
