//! Cache copies written behind a pull: labd's pulls start a job once its
//! files are written, and write the node cache's copies of the packs they
//! fetched after that.
//!
//! A pull from a peer wrote each pack to the cache as it arrived, and
//! returned once every copy was on the disk. The job waited for those
//! writes, which it never reads (its files are written from the packs in
//! memory), and while they ran the disk they went to was not reading: on
//! one machine (follow-bench, both nodes on one disk), a gigabyte from a
//! peer took 1.38 s against rsync's 1.23 s, and 0.78 s with no cache copy
//! written at all. Now the copies of a pull that is given [`CacheWrites`]
//! are written when the pull is done, at the disk's idle priority, one at
//! a time.
//!
//! A pack that is mostly its files' plain chunks leaves memory once its
//! files are written, and its copy is rebuilt from them after the pull
//! ([`crate::rebuild`]), so its buffer serves the next fetch
//! ([`crate::reuse`]). Any other pack (mostly compressed chunks, or
//! chunks of no file of the pull) is held in memory for its files and
//! for the copy, which is written when the pull is done, or sooner, at
//! the disk's usual priority, when the memory held copies take
//! ([`BEHIND_MAX_MIB`], the whole process together) is wanted. When every
//! pack was held, every pack of a gigabyte pulled from a peer faulted a
//! fresh buffer, and on a virtual machine the faults cost more than the
//! rest of the fetch.
//!
//! The node's record of the snapshot names its packs from the pull's start
//! (so they are never evicted as unowned mid-pull), and its heartbeats say
//! so: a peer sent here for a pack whose copy is not written yet gets no
//! copy and fetches it from another holder or the store.
//!
//! Memory: a held pack takes its share of the budget once fetched, so a
//! labd holds at most the budget, plus the packs being received (16 of at
//! most 64 MiB, every pull together), plus those kept for files
//! ([`crate::arrive`]'s 256 MiB), plus the bytes recipes keep (64 MiB at
//! most, a few KiB per pack), plus, while fetches run, the buffers kept
//! for reuse (16, each touched up to the largest pack it held).
//!
//! A copy that cannot be written (a full disk) is said in the log and
//! left out; the next pull that needs the pack fetches it again. The copy
//! is only a cache: nothing is lost with it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::arrive::Arrivals;
use crate::error::{Error, Result};
use crate::fsutil::{blocking, write_atomic_direct};
use crate::id::PackId;
use crate::pack::PackEntry;
use crate::rebuild::{Recipe, Written};

/// Mebibytes of fetched packs held for their cache copy, every pull of
/// the process together. Past it a fetch waits for held copies to be
/// written (and has every pull's held copies written now).
pub const BEHIND_MAX_MIB: usize = 1024;

/// The memory waiting copies may hold, and what wakes them when it is
/// wanted.
pub(crate) struct Budget {
    mib: tokio::sync::Semaphore,
    pressed: tokio::sync::Notify,
}

impl Budget {
    pub(crate) const fn new(mib: usize) -> Budget {
        Budget {
            mib: tokio::sync::Semaphore::const_new(mib),
            pressed: tokio::sync::Notify::const_new(),
        }
    }
}

/// Every pull of the process together.
static BEHIND: Budget = Budget::new(BEHIND_MAX_MIB);

/// Copies are written one at a time: thirty 32 MiB writes at once queued
/// a gigabyte before the disk, and the job just started (its interpreter
/// and libraries read from the disk) waited behind them, 0.5 s on
/// follow-bench's machine.
static WRITING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// The cache copies of one pull, written once [`CacheWrites::start`] is
/// called (the pull calls it when it is done, failed or dropped).
pub struct CacheWrites {
    /// Which copies may be written: none yet, [`HELD`] ones, or [`ALL`].
    go: tokio::sync::watch::Sender<u8>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<Option<Copied>>>>,
    /// [`BEHIND`], or a smaller one in tests.
    budget: &'static Budget,
    /// Memory was wanted: the copies are holding up a fetch, and are
    /// written at the disk's usual priority.
    pressed: Arc<std::sync::atomic::AtomicBool>,
    /// The pull's files, once it knows them: packs are rebuilt from them
    /// rather than held ([`crate::rebuild`]).
    written: std::sync::OnceLock<Arc<Written>>,
    /// The pull failed: its files are not all there to rebuild from.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// [`CacheWrites::start_held`] was called: held copies may be written.
const HELD: u8 = 1;
/// [`CacheWrites::start`] was called: every copy may be written.
const ALL: u8 = 2;

/// A copy written: its bytes, and whether it was rebuilt from the pull's
/// files.
type Copied = (u64, bool);

/// What [`CacheWrites::finish`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheWritten {
    /// Packs written to the cache.
    pub packs: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of those packs, how many were rebuilt from the pull's files rather
    /// than held in memory until written.
    pub rebuilt: u64,
    /// Packs that could not be written (said in the log).
    pub failed: u64,
}

impl CacheWrites {
    /// Copies to write later.
    pub fn new() -> Arc<CacheWrites> {
        CacheWrites::with_budget(&BEHIND)
    }

    fn with_budget(budget: &'static Budget) -> Arc<CacheWrites> {
        Arc::new(CacheWrites {
            go: tokio::sync::watch::channel(0).0,
            tasks: Mutex::new(Vec::new()),
            budget,
            pressed: Arc::default(),
            written: std::sync::OnceLock::new(),
            abandoned: Arc::default(),
        })
    }

    /// The pull writes these files: copies of packs whose chunks they hold
    /// are rebuilt from them. One pull per `CacheWrites`: a second pull's
    /// files are not taken.
    pub(crate) fn rebuild_from(&self, written: Written) {
        let first = self.written.set(Arc::new(written)).is_ok();
        debug_assert!(first, "one pull per CacheWrites");
    }

    /// The pull failed: no copy is rebuilt from its files (each counts as
    /// not written, without a word in the log: the pull's own error says
    /// what happened).
    pub(crate) fn abandon_rebuilt(&self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// How to rebuild `bytes` (pack with the checked `entries`) from the
    /// pull's files; `None` when it is held whole for its copy.
    pub(crate) fn recipe(&self, bytes: &[u8], entries: &[PackEntry]) -> Option<Recipe> {
        self.written.get()?.recipe(bytes, entries)
    }

    /// The copies are written from now on: the pull is over (its files
    /// are written, so copies rebuilt from them can be).
    pub fn start(&self) {
        self.allow(ALL);
    }

    /// The copies held in memory are written from now on, ahead of the
    /// pull's end: a fetch waits for their memory, or the pull for one of
    /// them. Copies rebuilt from files still wait for the end.
    pub(crate) fn start_held(&self) {
        self.allow(HELD);
    }

    fn allow(&self, which: u8) {
        self.go.send_if_modified(|g| {
            let more = *g < which;
            *g = (*g).max(which);
            more
        });
    }

    /// Starts the copies and waits until every one is written or failed.
    pub async fn finish(&self) -> CacheWritten {
        self.start();
        let tasks = std::mem::take(&mut *self.tasks.lock().expect("cache writes poisoned"));
        let mut done = CacheWritten::default();
        for t in tasks {
            match t.await {
                Ok(Some((bytes, rebuilt))) => {
                    done.packs += 1;
                    done.bytes += bytes;
                    done.rebuilt += u64::from(rebuilt);
                }
                _ => done.failed += 1,
            }
        }
        done
    }

    /// Writes `bytes` to the cache as `dest` once started; until then the
    /// pull's files read `pack` from `arrivals`, which hears when it is
    /// written. Waits while the memory of every pull's waiting copies is
    /// at [`BEHIND_MAX_MIB`], and has them written meanwhile.
    pub(crate) async fn defer(
        &self,
        pack: PackId,
        dest: PathBuf,
        bytes: Bytes,
        arrivals: Arc<Arrivals>,
    ) {
        use std::sync::atomic::Ordering;
        let budget = self.budget;
        let mib = (bytes.len().div_ceil(1 << 20)).clamp(1, BEHIND_MAX_MIB) as u32;
        let permit = match budget.mib.try_acquire_many(mib) {
            Ok(p) => p,
            Err(_) => {
                self.pressed.store(true, Ordering::Relaxed);
                self.start_held();
                budget.pressed.notify_waiters();
                budget.mib.acquire_many(mib).await.expect("never closed")
            }
        };
        // Made here, not in the task: it hears a press from now on, even
        // before the task first runs.
        let pressed = budget.pressed.notified();
        let size = bytes.len() as u64;
        let write = move || write_atomic_direct(&dest, &bytes).map(|()| true);
        self.spawn(
            pack,
            size,
            arrivals,
            Some(Box::pin(pressed)),
            write,
            Some(permit),
        );
    }

    /// Writes `pack`'s copy to the cache as `dest` once the pull is over
    /// ([`CacheWrites::start`]), rebuilt from the pull's files as `recipe`
    /// says; the pull's files read it from `arrivals` meanwhile (it was
    /// offered there with [`Arrivals::offer_rebuilt`]). It holds no memory
    /// but the recipe's kept bytes (bounded, see the module's doc). Not
    /// written when the pull failed ([`CacheWrites::abandon_rebuilt`]), or
    /// when the pack is in the cache by then.
    pub(crate) fn defer_rebuilt(
        &self,
        pack: PackId,
        dest: PathBuf,
        recipe: Recipe,
        arrivals: Arc<Arrivals>,
    ) {
        let Some(from) = self.written.get().cloned() else {
            arrivals.not_written(pack);
            return;
        };
        let size = recipe.size();
        let abandoned = self.abandoned.clone();
        let write = move || {
            use std::sync::atomic::Ordering;
            if abandoned.load(Ordering::Acquire) {
                return Err(Error::not_found(
                    "the pull's files (the pull failed before they were all written)",
                ));
            }
            // Fetched again meanwhile (a chunk of it failed a writer, and
            // the pull fetched it whole from the store).
            if dest.exists() {
                return Ok(false);
            }
            from.rebuild(&pack, &recipe, &dest).map(|()| true)
        };
        self.spawn(pack, size, arrivals, None, write, None);
    }

    /// The task that runs `write` (a copy of `size` bytes; true when it
    /// wrote it, false when the cache had it already) once the copies are
    /// started, or as soon as `pressed` says memory is wanted, one copy of
    /// the process at a time; `permit` (memory) held until then.
    fn spawn(
        &self,
        pack: PackId,
        size: u64,
        arrivals: Arc<Arrivals>,
        pressed: Option<std::pin::Pin<Box<tokio::sync::futures::Notified<'static>>>>,
        write: impl FnOnce() -> Result<bool> + Send + 'static,
        permit: Option<tokio::sync::SemaphorePermit<'static>>,
    ) {
        use std::sync::atomic::Ordering;
        let mut go = self.go.subscribe();
        let mine = self.pressed.clone();
        // Only a rebuilt copy holds no memory (no permit), and it is
        // written once the pull's files are.
        let rebuilt = permit.is_none();
        let wanted = if rebuilt { ALL } else { HELD };
        let abandoned = self.abandoned.clone();
        let task = tokio::spawn(async move {
            let pressed = async {
                match pressed {
                    Some(p) => p.await,
                    None => std::future::pending().await,
                }
            };
            let urgent = tokio::select! {
                // Started, or its pull and caller are gone: written now.
                _ = go.wait_for(|g| *g >= wanted) => mine.load(Ordering::Relaxed),
                _ = pressed => true,
            };
            let one = WRITING.acquire().await.expect("never closed");
            let written = blocking(move || {
                let _idle = (!urgent).then(IdleIo::enter);
                write()
            })
            .await;
            drop(one);
            drop(permit);
            match written {
                Ok(wrote) => {
                    arrivals.written(pack);
                    Some((size, rebuilt && wrote))
                }
                Err(e) => {
                    arrivals.not_written(pack);
                    if !(rebuilt && abandoned.load(Ordering::Acquire)) {
                        tracing::warn!("pack {pack}: no copy in the node cache: {e}");
                    }
                    None
                }
            }
        });
        self.tasks.lock().expect("cache writes poisoned").push(task);
    }
}

/// The calling thread's I/O at the idle priority while this lives: a
/// copy's writes yield to every other read and write of the disk (the
/// job's own start reading its interpreter and libraries, for one),
/// where the disk's scheduler knows priorities (mq-deadline, bfq; not
/// `none`, usual on NVMe, where it changes nothing).
struct IdleIo {
    before: Option<libc::c_long>,
}

/// `ioprio_set`/`ioprio_get` of the calling thread (`IOPRIO_WHO_PROCESS`, 0).
const IOPRIO_WHO_PROCESS: libc::c_long = 1;
const IOPRIO_CLASS_IDLE: libc::c_long = 3;
const IOPRIO_CLASS_SHIFT: u32 = 13;

impl IdleIo {
    #[allow(unsafe_code)]
    fn enter() -> IdleIo {
        // SAFETY: ioprio_get and ioprio_set take integers only and act on
        // the calling thread (who 0); an error leaves its priority as it was.
        let before = unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0) };
        if before < 0 {
            // Not to be put back: left as it is.
            return IdleIo { before: None };
        }
        let idle = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT;
        let set = unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, idle) };
        IdleIo {
            before: (set == 0).then_some(before),
        }
    }
}

impl Drop for IdleIo {
    /// The thread is the runtime's, and goes back to its other work.
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if let Some(before) = self.before {
            // SAFETY: as in `enter`.
            unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, before) };
        }
    }
}

/// Abandons a pull's rebuilt copies ([`CacheWrites::abandon_rebuilt`])
/// when dropped armed: the pull returned early, failed.
pub(crate) struct AbandonOnFailure<'a>(pub(crate) Option<&'a CacheWrites>);

impl AbandonOnFailure<'_> {
    /// The pull wrote all its files.
    pub(crate) fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for AbandonOnFailure<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0 {
            w.abandon_rebuilt();
        }
    }
}

/// Starts a pull's copies when the pull ends, however it ends.
pub(crate) struct StartOnDrop<'a>(pub(crate) Option<&'a CacheWrites>);

impl Drop for StartOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0 {
            w.start();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Fresh;
    use std::time::Duration;

    fn pack(n: u8) -> (PackId, Bytes) {
        let bytes = Bytes::from(vec![n; 1 << 20]);
        (PackId::of(&bytes), bytes)
    }

    fn fresh(bytes: &Bytes) -> Fresh {
        Fresh {
            bytes: bytes.clone(),
            verified: None,
        }
    }

    /// A copy waits for its pull's end; meanwhile the pull's files read
    /// the pack from memory, and after it from the cache.
    #[tokio::test]
    async fn copies_wait_for_the_start_and_files_read_memory_until_then() {
        let dir = tempfile::tempdir().unwrap();
        let (id, bytes) = pack(1);
        let arrivals = Arc::new(Arrivals::new([id], [vec![id]]));
        let w = CacheWrites::new();
        let dest = dir.path().join("p1");
        arrivals.offer_pending(id, fresh(&bytes));
        w.defer(id, dest.clone(), bytes.clone(), arrivals.clone())
            .await;
        arrivals.arrived(id);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!dest.exists(), "written before the pull ended");
        assert!(
            arrivals.wait_for(&[id]).is_ok(),
            "no file waits for the copy"
        );
        assert_eq!(arrivals.fresh(&id).unwrap().bytes, bytes);
        let done = w.finish().await;
        assert_eq!(
            done,
            CacheWritten {
                packs: 1,
                bytes: 1 << 20,
                rebuilt: 0,
                failed: 0
            }
        );
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
        assert!(arrivals.fresh(&id).is_none(), "read from the cache now");
    }

    /// With the memory for waiting copies used up, the next fetch has the
    /// copies written rather than waiting for a start that comes only
    /// after it.
    #[tokio::test]
    async fn a_full_budget_starts_the_copies_instead_of_waiting_for_the_end() {
        static SMALL: Budget = Budget::new(2);
        let dir = tempfile::tempdir().unwrap();
        let w = CacheWrites::with_budget(&SMALL);
        let packs: Vec<(PackId, Bytes)> = (1..=3).map(pack).collect();
        let ids: Vec<PackId> = packs.iter().map(|(id, _)| *id).collect();
        let arrivals = Arc::new(Arrivals::new(ids.clone(), vec![ids.clone()]));
        for (i, (id, bytes)) in packs.iter().enumerate() {
            arrivals.offer_pending(*id, fresh(bytes));
            let deferred = w.defer(
                *id,
                dir.path().join(format!("p{i}")),
                bytes.clone(),
                arrivals.clone(),
            );
            tokio::time::timeout(Duration::from_secs(10), deferred)
                .await
                .expect("the third copy's fetch is not held up for good");
        }
        let done = w.finish().await;
        assert_eq!((done.packs, done.failed), (3, 0));
    }

    /// A pull whose fetch finds the memory used up by another pull's
    /// copies has those written (that pull may be stuck behind this one),
    /// at the usual priority.
    #[tokio::test]
    async fn a_full_budget_has_another_pulls_copies_written() {
        static SMALL: Budget = Budget::new(2);
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (
            CacheWrites::with_budget(&SMALL),
            CacheWrites::with_budget(&SMALL),
        );
        let packs: Vec<(PackId, Bytes)> = (5..=7).map(pack).collect();
        let ids: Vec<PackId> = packs.iter().map(|(id, _)| *id).collect();
        let arrivals = Arc::new(Arrivals::new(ids.clone(), vec![ids.clone()]));
        let dest = |i: usize| dir.path().join(format!("q{i}"));
        for (i, (id, bytes)) in packs.iter().enumerate() {
            arrivals.offer_pending(*id, fresh(bytes));
            let w = if i < 2 { &first } else { &second };
            let deferred = w.defer(*id, dest(i), bytes.clone(), arrivals.clone());
            tokio::time::timeout(Duration::from_secs(10), deferred)
                .await
                .expect("the second pull is not held up by the first's copies");
        }
        // The first pull never ended, yet its copies are in.
        let t = std::time::Instant::now();
        while !(dest(0).exists() && dest(1).exists()) {
            assert!(t.elapsed() < Duration::from_secs(10), "not written");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(second.finish().await.packs, 1);
        assert_eq!(first.finish().await.packs, 2);
    }

    /// A copy that cannot be written is left out and said; the pull's
    /// files still read the pack from memory.
    #[tokio::test]
    async fn a_copy_that_cannot_be_written_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("not-a-folder"), b"x").unwrap();
        let (id, bytes) = pack(4);
        let arrivals = Arc::new(Arrivals::new([id], [vec![id]]));
        let w = CacheWrites::new();
        arrivals.offer_pending(id, fresh(&bytes));
        let dest = dir.path().join("not-a-folder/p4");
        w.defer(id, dest, bytes.clone(), arrivals.clone()).await;
        let done = w.finish().await;
        assert_eq!((done.packs, done.failed), (0, 1));
        assert_eq!(arrivals.fresh(&id).unwrap().bytes, bytes);
        // Nothing waits for a copy that will not come.
        arrivals.wait_in_cache(&id);
    }
}
