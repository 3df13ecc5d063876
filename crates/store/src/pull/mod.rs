//! `pull`: materialise a snapshot into a folder, from verified chunks only.
//!
//! Packs are brought into the node cache (hard links for a local store on
//! the same file system) and files written by a few threads: each to a
//! temporary name, every chunk checked against its BLAKE3 id before its
//! bytes are written, mode and mtime set, then renamed into place once its
//! data is on the disk (a batch of files at a time, one `syncfs` each). A
//! file already present with the snapshot's size and mtime is complete
//! (only a finished rename can produce it, and only once the data it names
//! is durable: a power cut cannot leave a file of zeros under its name), so
//! a re-run after an interruption skips it.
//!
//! Every name in the destination is reached from the folder holding it
//! ([`crate::at`]): no symlink in the destination is followed, and paths
//! longer than `PATH_MAX` under a long destination are written like any.

use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};

use serde::Serialize;

use crate::arrive::Arrivals;
use crate::at::{self, Tree};
use crate::behind::{AbandonOnFailure, CacheWrites, StartOnDrop};
use crate::cache::{NodeCache, PackReader};
use crate::error::{Error, Result};
use crate::fsutil::{blocking, tmp_leaf};
use crate::id::{ChunkId, PackId, SnapshotId};
use crate::index::{Index, IndexPack};
use crate::listing::{Item, Listing, Loader};
use crate::progress::{NoProgress, Progress};
use crate::rebuild;
use crate::repo::{RefSpec, Repo, VersionRecord};
use crate::snapshot::Kind;

/// What a pull did.
#[derive(Clone, Debug, Serialize)]
pub struct PullOutcome {
    /// The version pulled.
    pub record: VersionRecord,
    /// Files written.
    pub files_written: u64,
    /// Files already complete in the destination.
    pub files_skipped: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Packs fetched into the node cache.
    pub packs_fetched: u64,
    /// Bytes fetched into the node cache.
    pub bytes_fetched: u64,
    /// Entries (files, links, folders) the destination held that the version
    /// does not: left in place, or removed with [`PullOptions::delete`].
    pub extra: u64,
    /// Of those, how many were removed.
    pub deleted: u64,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// How to pull.
#[derive(Clone, Copy, Debug)]
pub struct PullOptions {
    /// Writer threads.
    pub threads: usize,
    /// Make the destination equal the version: remove what it holds that
    /// the version does not (as `rsync --delete` and `restic restore
    /// --delete` do).
    pub delete: bool,
    /// Make a tree shared by jobs of any user (labd's materialised trees):
    /// nothing in it writable, everything readable (and folders searchable)
    /// by all, whatever modes the version records.
    pub shared: bool,
    /// The snapshot the caller knows the name to hold (a node told by the
    /// coordinator): its tree is loaded while the name is resolved, not
    /// after (one store round trip less before the first pack), and a name
    /// that has moved on fails before anything is fetched.
    pub expect: Option<SnapshotId>,
}

fn time_of(ns: i64) -> std::time::SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

/// True when the destination already holds this file (a finished earlier pull).
fn complete(tree: &Tree, e: Item<'_>) -> bool {
    tree.stat(e.path()).ok().flatten().is_some_and(|st| {
        at::kind(&st) == rustix::fs::FileType::RegularFile
            && st.st_size as u64 == e.size()
            && st.st_mode & 0o7777 == e.mode()
            && at::mtime_ns(&st) == e.mtime_ns()
    })
}

/// A pull of `spec` into `dest`: plan, fetch packs, write verified files,
/// sweep what the version does not hold (with [`PullOptions::delete`]),
/// rename them in once durable. The one way to pull:
///
/// ```no_run
/// # async fn f(repo: &labsync_store::Repo, cache: &labsync_store::NodeCache) -> labsync_store::Result<()> {
/// let spec = "div2k@v3".parse()?;
/// let got = labsync_store::Pull::new(repo, cache, &spec, "/data/div2k".as_ref())
///     .threads(8)
///     .run()
///     .await?;
/// # Ok(()) }
/// ```
pub struct Pull<'a> {
    repo: &'a Repo,
    cache: &'a NodeCache,
    spec: &'a RefSpec,
    dest: &'a Path,
    opts: PullOptions,
    progress: Arc<dyn Progress>,
    behind: Option<&'a CacheWrites>,
}

impl<'a> Pull<'a> {
    /// `spec` into `dest`, with 4 writers, keeping what the destination
    /// holds beyond the version (and counting it), silently.
    pub fn new(repo: &'a Repo, cache: &'a NodeCache, spec: &'a RefSpec, dest: &'a Path) -> Self {
        Pull {
            repo,
            cache,
            spec,
            dest,
            opts: PullOptions {
                threads: 4,
                delete: false,
                shared: false,
                expect: None,
            },
            progress: Arc::new(NoProgress),
            behind: None,
        }
    }

    /// With `n` writers.
    pub fn threads(mut self, n: usize) -> Self {
        self.opts.threads = n;
        self
    }

    /// With all of these options.
    pub fn options(mut self, opts: PullOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Saying how it goes to `progress`.
    pub fn progress(mut self, progress: Arc<dyn Progress>) -> Self {
        self.progress = progress;
        self
    }

    /// Returning once the files are written: the node cache's copies of
    /// packs fetched from peers are written after, by `writes`
    /// ([`CacheWrites::finish`] waits for them), so a job does not wait for
    /// copies it does not read.
    pub fn writing_behind(mut self, writes: &'a CacheWrites) -> Self {
        self.behind = Some(writes);
        self
    }

    /// Runs it.
    pub async fn run(self) -> Result<PullOutcome> {
        pull_inner(
            self.repo,
            self.cache,
            self.spec,
            self.dest,
            self.opts,
            self.progress,
            self.behind,
        )
        .await
    }
}

async fn pull_inner(
    repo: &Repo,
    cache: &NodeCache,
    spec: &RefSpec,
    dest: &Path,
    opts: PullOptions,
    progress: Arc<dyn Progress>,
    behind: Option<&CacheWrites>,
) -> Result<PullOutcome> {
    // However the pull ends, the copies it leaves are written.
    let _start = StartOnDrop(behind);
    // Dropped first: a pull that fails has no copy rebuilt from its files.
    let mut abandon = AbandonOnFailure(behind);
    let (threads, started) = (opts.threads, Instant::now());
    let repo = repo
        .clone()
        .with_index_cache(Some(cache.index_dir(&repo.config().id)));
    // With `shared`, written with shared modes, and a finished file is
    // recognised by them.
    let (record, index, entries) =
        resolve_and_load(&repo, spec, opts.expect, opts.shared, progress.as_ref()).await?;
    let loaded = started.elapsed();
    let (dest, empty) = prepare_destination(dest)?;
    let tree = Arc::new(Tree::open(&dest).map_err(Error::io("open destination", &dest))?);
    let replaced = if opts.delete && !empty {
        clear_type_changes(&tree, &entries)?
    } else {
        0
    };
    make_directories(&tree, &entries, &record)?;

    let plan = plan(&entries, &index, &tree, empty)?;
    check_room(&repo, cache, &dest, &plan)?;
    // Recorded before fetching, so packs of an interrupted pull stay owned;
    // held until the end, so another pull's eviction passes it by.
    let (id, label, store) = (record.snapshot, record.label(), &repo.config().id);
    let _held = cache.hold(id)?;
    cache.touch(id, &label, store, plan.packs.clone())?;

    // Files are written while the packs they need arrive (see `arrive`);
    // the progress shown is the files written.
    let order = spread_over_folders(&entries, &plan.files);
    let (fetch_order, arrivals) = arrivals_for(cache, &entries, &index, &order, &plan.packs);
    let arrivals = Arc::new(arrivals);
    // A pull dropped half way (its caller gave up) must not leave writers
    // waiting in their threads for packs that will never come.
    let _release = FailOnDrop(arrivals.clone());
    progress.phase("write", Some(plan.bytes), Some(plan.files.len() as u64));
    let entries = Arc::new(entries);
    // Only packs from peers are rebuilt (those from the store are written
    // to the cache as they come).
    if let Some(w) = behind.filter(|_| cache.has_peers()) {
        w.rebuild_from(rebuild::Written::new(
            tree.clone(),
            entries.clone(),
            &index,
            &plan.files,
        ));
    }
    let writing = Writing {
        entries: entries.clone(),
        order,
        tree: tree.clone(),
        threads,
        progress: progress.clone(),
        arrivals,
    };
    let (written, packs_fetched, bytes_fetched) =
        fetch_and_write(&repo, cache, &writing, index, &fetch_order, behind).await?;
    tracing::debug!(
        "pull {}: tree loaded at {:.3} s, files written at {:.3} s",
        record.label(),
        loaded.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let (extra, deleted) = complete_tree(&tree, &entries, empty, opts.delete, replaced)?;

    cache.touch(id, &label, store, plan.packs)?;
    for label in cache.enforce_cap(Some(record.snapshot))? {
        progress.warn(&format!(
            "evicted {label} from the node cache (over its size cap)"
        ));
    }
    abandon.disarm();
    Ok(PullOutcome {
        record,
        files_written: plan.files.len() as u64,
        files_skipped: plan.skipped,
        bytes_written: written,
        packs_fetched,
        bytes_fetched,
        extra,
        deleted,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Stage 1: the version `spec` names (which must still be the snapshot
/// `expect`, when given), the store's index and the version's tree. The
/// index loads while the name is resolved and the snapshot object read
/// (neither needs it): a round trip less before the first pack.
async fn resolve_and_load(
    repo: &Repo,
    spec: &RefSpec,
    expect: Option<SnapshotId>,
    shared: bool,
    progress: &dyn Progress,
) -> Result<(VersionRecord, Index, Listing)> {
    match expect {
        Some(expected) => {
            // The tree is read only once the name is known to still name
            // the snapshot the caller expects.
            let snapshot = async {
                let (record, object) =
                    tokio::join!(repo.resolve(spec), repo.load_snapshot(&expected));
                let record = record?;
                if record.snapshot != expected {
                    return Err(Error::Moved {
                        label: record.label(),
                        expected: expected.to_string(),
                        found: record.snapshot.to_string(),
                    });
                }
                Ok((record, object?))
            };
            load_tree(repo, snapshot, shared, progress).await
        }
        None => {
            let snapshot = async {
                let record = repo.resolve(spec).await?;
                let object = repo.load_snapshot(&record.snapshot).await?;
                Ok((record, object))
            };
            load_tree(repo, snapshot, shared, progress).await
        }
    }
}

/// The store's index and the version's validated tree. Special mode bits
/// are masked (and said so), unsafe paths refused.
/// Loads the index while `snapshot` resolves the version and reads its
/// snapshot object, then the tree. The first error of the two ends both.
async fn load_tree(
    repo: &Repo,
    snapshot: impl std::future::Future<Output = Result<(VersionRecord, crate::SnapshotObject)>>,
    shared: bool,
    progress: &dyn Progress,
) -> Result<(VersionRecord, Index, Listing)> {
    let ((mut index, _), (record, object)) = tokio::try_join!(repo.load_index(), snapshot)?;
    warn_refused(&index, progress);
    // A chunk two index objects place apart is read where its pack's
    // footer confirms it (a planted object cannot make a version fail).
    repo.settle_places(&mut index, object.segments.iter().map(|s| s.id))
        .await?;
    let mut loader = Loader::new(&index, shared);
    repo.decode_tree_into(&index, &record.snapshot, &object, &mut loader)
        .await?;
    let (entries, masked, first) = loader.finish(&record.snapshot.to_string())?;
    if index.has_other_places() {
        let ids: Vec<ChunkId> = (0..entries.len())
            .flat_map(|i| entries.get(i).chunks().to_vec())
            .filter_map(|c| entries.chunk(&index, c).ok().map(|(_, e)| e.id))
            .collect();
        repo.settle_places(&mut index, ids.into_iter()).await?;
    }
    if let Some(first) = first {
        progress.warn(&format!(
            "{masked} entries of {} carry setuid, setgid or other special mode bits \
             (first: {first}); they are restored without them",
            record.label()
        ));
    }
    Ok((record, index, entries))
}

/// Says which index objects were left out (the first few, and how many):
/// a planted or damaged object, named so an admin can remove it.
pub(crate) fn warn_refused(index: &Index, progress: &dyn Progress) {
    for (key, why) in index.refused().iter().take(3) {
        progress.warn(&format!("index object {key} is not used: {why}"));
    }
    let more = (index.refused().len() as u64).saturating_sub(3) + index.refused_more();
    if more > 0 {
        progress.warn(&format!(
            "{more} more objects under index/ are not used either"
        ));
    }
}

/// Creates `dest` if needed; returns it resolved, and whether it was empty.
fn prepare_destination(dest: &Path) -> Result<(PathBuf, bool)> {
    match std::fs::symlink_metadata(dest) {
        Ok(m) if !m.is_dir() => {
            return Err(Error::invalid(
                format!("destination {}", dest.display()),
                "exists and is not a directory",
            ))
        }
        Ok(_) => {}
        Err(_) => std::fs::create_dir_all(dest).map_err(Error::io("create destination", dest))?,
    }
    // Into an empty folder nothing can be complete already: skip one lookup per file.
    let empty = std::fs::read_dir(dest)
        .map_err(Error::io("list destination", dest))?
        .next()
        .is_none();
    let dest = dest
        .canonicalize()
        .map_err(Error::io("resolve destination", dest))?;
    Ok((dest, empty))
}

/// Directories first (writable until the end), refusing symlinks planted in the destination.
fn make_directories(tree: &Tree, entries: &Listing, record: &VersionRecord) -> Result<()> {
    for e in entries.iter().filter(|e| e.kind() == Kind::Dir) {
        let found = tree.stat(e.path());
        match found.map_err(Error::io("look at", tree.shown(e.path())))? {
            Some(st) if at::kind(&st) == rustix::fs::FileType::Directory => {}
            Some(_) => {
                return Err(Error::UnsafePath {
                    path: e.path_lossy(),
                    snapshot: record.snapshot.to_string(),
                    why: "the destination has a non-directory (maybe a symlink) where the snapshot has a directory",
                })
            }
            None => tree
                .mkdir(e.path())
                .map_err(Error::io("create directory", tree.shown(e.path())))?,
        }
    }
    Ok(())
}

/// What a pull has to do.
struct Plan {
    /// Entries (indexes) of the files to write.
    files: Vec<usize>,
    /// Files already complete in the destination.
    skipped: u64,
    /// The packs those files need, with their sizes.
    packs: Vec<(PackId, u64)>,
    /// Bytes of the files to write.
    bytes: u64,
}

/// The files not yet complete in `dest` and the packs they need.
fn plan(entries: &Listing, index: &Index, tree: &Tree, empty: bool) -> Result<Plan> {
    let files: Vec<usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind() == Kind::File && (empty || !complete(tree, *e)))
        .map(|(i, _)| i)
        .collect();
    let skipped =
        entries.iter().filter(|e| e.kind() == Kind::File).count() as u64 - files.len() as u64;
    let hint = match index.refused().first() {
        Some((key, why)) => {
            format!("; index object {key} is not used ({why}): run `labsync rebuild-index`")
        }
        None => "; run `labsync verify --remote`, or `labsync rebuild-index` if the index was lost"
            .into(),
    };
    let planned = files.iter().map(|&i| entries.get(i));
    let packs = needed_packs(entries, index, planned, |c, e| Error::NotFound {
        what: format!("chunk {c} of {}", e.path_lossy()),
        hint: hint.clone(),
    })?;
    // Saturating: sizes come from the snapshot, which anyone may have written.
    let bytes = files
        .iter()
        .map(|&i| entries.get(i).size())
        .fold(0, u64::saturating_add);
    Ok(Plan {
        files,
        skipped,
        packs,
        bytes,
    })
}

/// The packs holding the chunks of `entries`, in id order, with their sizes.
fn needed_packs<'a>(
    list: &Listing,
    index: &Index,
    entries: impl Iterator<Item = Item<'a>>,
    missing: impl Fn(&ChunkId, Item<'a>) -> Error,
) -> Result<Vec<(PackId, u64)>> {
    let mut needed = BTreeSet::new();
    for e in entries {
        for &c in e.chunks() {
            let (p, _) = list.chunk(index, c).map_err(|c| missing(&c, e))?;
            needed.insert(p);
        }
    }
    Ok(needed
        .iter()
        .map(|p| (*p, index.pack_size(p).unwrap_or(0)))
        .collect())
}

/// Room for the files, checked before anything is fetched or written, so
/// a full disk fails at once with the numbers instead of half way. The
/// packs to fetch count here too when the cache shares the file system.
fn check_room(repo: &Repo, cache: &NodeCache, dest: &Path, plan: &Plan) -> Result<()> {
    let Some(available) = crate::fsutil::free_space(dest) else {
        return Ok(());
    };
    let missing: u64 = plan
        .packs
        .iter()
        .filter(|(p, _)| !cache.pack_path(p).exists())
        .map(|(_, n)| *n)
        .fold(0, u64::saturating_add);
    let shared = crate::fsutil::device_of(dest) == crate::fsutil::device_of(cache.root());
    let for_packs = if shared {
        cache.space_for_packs(repo, missing)
    } else {
        0
    };
    let needed = plan.bytes.saturating_add(for_packs);
    if available < needed {
        return Err(Error::NoSpace {
            path: dest.to_path_buf(),
            needed,
            available,
        });
    }
    Ok(())
}

/// Writes the planned files off the runtime, every chunk verified before a
/// byte of it reaches a file (verifying and writing are one pass: a second
/// pass would read every pack twice). When a chunk of a pack fails, the
/// pack's own footer is read first: if the index disagrees with it, the
/// index is what is wrong, and the footer's entries are used (said once,
/// with the repair). Otherwise the pack is fetched once more. Either way
/// the files not yet complete are written again; a pack failing after both
/// is corrupt in the store.
async fn write_verified(
    repo: &Repo,
    cache: &NodeCache,
    w: &Writing,
    index: Index,
    behind: Option<&CacheWrites>,
) -> Result<u64> {
    let (progress, arrivals) = (&w.progress, &w.arrivals);
    let mut index = Arc::new(index);
    let mut corrected = HashSet::new();
    let mut refetched = HashSet::new();
    let mut attempt = 0;
    loop {
        let (w2, i2, c2) = (w.clone(), index.clone(), cache.clone());
        let retry = attempt > 0;
        attempt += 1;
        let res = blocking(move || {
            // After a repair, what the first attempt wrote is done already.
            let order: Vec<usize> = if retry {
                (w2.order.iter().copied())
                    .filter(|&i| !complete(&w2.tree, w2.entries.get(i)))
                    .collect()
            } else {
                w2.order.clone()
            };
            write_files(&w2, &order, &i2, &c2)
        })
        .await;
        let (what, detail) = match res {
            Ok(n) => return Ok(n),
            Err(Error::Corrupt { what, detail }) => (what, detail),
            Err(e) => return Err(e),
        };
        let Some(p) = what
            .rsplit(' ')
            .next()
            .and_then(|h| h.parse::<PackId>().ok())
        else {
            return Err(Error::Corrupt { what, detail });
        };
        // The pack may have been read from memory while the fetch still
        // writes it to the cache: its footer is read, and the pack
        // replaced, only once that is done. A copy held for writing behind
        // waits for the pull's end, which waits for this: it is written
        // now. (One rebuilt from the files cannot be before they are all
        // written: nothing waits for it, and the pack is fetched again.)
        if let Some(w) = behind {
            w.start_held();
        }
        let a = arrivals.clone();
        blocking(move || {
            a.wait_in_cache(&p);
            Ok(())
        })
        .await?;
        if !corrected.contains(&p) {
            if let Some(own) = cache.footer_record(&p) {
                if index_disagrees(&index, &own) {
                    progress.warn(&format!(
                        "the index disagrees with pack {p}'s own footer; using the footer \
                         (run `labsync rebuild-index` to repair the index)"
                    ));
                    Arc::make_mut(&mut index).correct_from_footer(&own);
                    corrected.insert(p);
                    continue;
                }
            }
        }
        if !refetched.insert(p) {
            return Err(Error::Corrupt { what, detail });
        }
        progress.warn(&format!(
            "pack {p} failed verification ({detail}); fetching it again"
        ));
        arrivals.forget(&p);
        cache.forget_pack(&p);
        cache.fetch_pack(repo, &p).await?;
    }
}

/// Stage 5, once every file is in place: hard links, what the version does
/// not hold (counted, or removed with `delete`; `replaced` were already),
/// then the modes and times of folders and the symlinks. Returns the
/// entries found extra and those deleted.
fn complete_tree(
    tree: &Tree,
    entries: &Listing,
    empty: bool,
    delete: bool,
    replaced: u64,
) -> Result<(u64, u64)> {
    make_links(tree, entries)?;
    // Into an empty folder nothing extra can be there: no walk.
    let (extra, deleted) = if empty {
        (0, 0)
    } else {
        let (extra, deleted) = sweep_extras(tree, entries, delete)?;
        (extra + replaced, deleted + replaced)
    };
    finish(tree, entries)?;
    Ok((extra, deleted))
}

/// Stages 3 and 4, side by side: the packs fetched in `fetch_order` (into
/// the node cache, from peers or the store) while the files are written
/// from them as they arrive. Returns the bytes written and the packs and
/// bytes fetched.
async fn fetch_and_write(
    repo: &Repo,
    cache: &NodeCache,
    w: &Writing,
    index: Index,
    fetch_order: &[(PackId, u64)],
    behind: Option<&CacheWrites>,
) -> Result<(u64, u64, u64)> {
    let (progress, arrivals) = (&w.progress, &w.arrivals);
    let started = Instant::now();
    let fetch = async {
        let quiet: Arc<dyn Progress> = Arc::new(WarningsOnly(progress.clone()));
        let fetched = cache
            .fetch_packs_then(repo, fetch_order, &quiet, Some(arrivals), behind)
            .await;
        // Done or failed, no writer waits any longer: a pack that turned
        // up in the cache meanwhile is read there.
        match &fetched {
            Ok(_) => arrivals.finished(),
            Err(_) => arrivals.fail(),
        }
        tracing::debug!(
            "pull: packs fetched in {:.3} s",
            started.elapsed().as_secs_f64()
        );
        fetched
    };
    let write = write_verified(repo, cache, w, index, behind);
    let (fetched, written) = tokio::join!(fetch, write);
    // A writer's own error says more than the fetch's, unless the writer
    // only stopped because the fetch failed.
    let written = match written {
        Err(Error::NotFound { what, .. }) if what == FETCH_FAILED => None,
        w => Some(w?),
    };
    let (packs_fetched, bytes_fetched) = fetched?;
    let written = written.ok_or_else(|| Error::not_found(FETCH_FAILED))?;
    Ok((written, packs_fetched, bytes_fetched))
}

/// What a writer reports when the fetch it waited on failed (the fetch's
/// error is the one returned).
const FETCH_FAILED: &str = "packs (the fetch failed)";

/// Ends every wait of a pull's writers when the pull is dropped.
struct FailOnDrop(Arc<Arrivals>);

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        self.0.fail();
    }
}

/// Passes on warnings only: while files are written, their progress is
/// the one shown.
struct WarningsOnly(Arc<dyn Progress>);

impl Progress for WarningsOnly {
    fn phase(&self, _: &str, _: Option<u64>, _: Option<u64>) {}
    fn advance(&self, _: u64, _: u64) {}
    fn warn(&self, message: &str) {
        self.0.warn(message);
    }
}

/// The packs of `e`'s chunks, each once, in order of first use; chunks
/// the index does not know are left out (the writer reports them).
fn packs_of(list: &Listing, e: Item<'_>, index: &Index) -> Vec<PackId> {
    let mut packs: Vec<PackId> = Vec::new();
    for &c in e.chunks() {
        if let Ok((p, _)) = list.chunk(index, c) {
            if !packs.contains(&p) {
                packs.push(p);
            }
        }
    }
    packs
}

/// The packs to fetch, in the order the writers first need them (files in
/// `order`), and what the writers wait for: those not in the cache.
fn arrivals_for(
    cache: &NodeCache,
    entries: &Listing,
    index: &Index,
    order: &[usize],
    packs: &[(PackId, u64)],
) -> (Vec<(PackId, u64)>, Arrivals) {
    let sizes: std::collections::HashMap<PackId, u64> = packs.iter().copied().collect();
    let mut seen = HashSet::new();
    let mut fetch = Vec::with_capacity(packs.len());
    for &i in order {
        for p in packs_of(entries, entries.get(i), index) {
            if seen.insert(p) {
                fetch.push((p, sizes.get(&p).copied().unwrap_or(0)));
            }
        }
    }
    let missing = fetch
        .iter()
        .filter(|(p, _)| !cache.pack_path(p).exists())
        .map(|(p, _)| *p);
    let uses = order
        .iter()
        .map(|&i| packs_of(entries, entries.get(i), index));
    let arrivals = Arrivals::new(missing, uses);
    (fetch, arrivals)
}

/// True when `index` places a chunk of `own` (a pack's footer) elsewhere in
/// that pack, or gives the pack another size.
fn index_disagrees(index: &Index, own: &IndexPack) -> bool {
    index.pack_size(&own.pack).is_some_and(|s| s != own.size)
        || own
            .chunks
            .iter()
            .any(|&(id, offset, stored_len, raw_len, flags)| {
                index.get(&id).is_some_and(|(p, e)| {
                    p == own.pack
                        && (e.offset, e.stored_len, e.raw_len, e.flags)
                            != (offset, stored_len, raw_len, flags)
                })
            })
}

/// Gives each hard link's file its other names: `link(2)` to a temporary
/// name, renamed into place. The snapshot was validated: every target is a
/// file of this version, written above. A name that already is that file
/// is left alone.
fn make_links(tree: &Tree, entries: &Listing) -> Result<()> {
    use rustix::fs::FileType;
    for e in entries.iter().filter(|e| e.kind() == Kind::HardLink) {
        let src = tree.stat(e.target());
        let src = src.map_err(Error::io("read", tree.shown(e.target())))?;
        let Some(src) = src.filter(|st| at::kind(st) == FileType::RegularFile) else {
            return Err(Error::invalid(
                format!("destination {}", tree.shown(e.target()).display()),
                "is not the file a hard link of the snapshot names",
            ));
        };
        let dst = tree.stat(e.path());
        match dst.map_err(Error::io("read", tree.shown(e.path())))? {
            Some(m) if (m.st_dev, m.st_ino) == (src.st_dev, src.st_ino) => continue,
            Some(m) if at::kind(&m) == FileType::Directory => {
                return Err(Error::invalid(
                    format!("destination {}", tree.shown(e.path()).display()),
                    "is a directory where the snapshot has a hard link",
                ))
            }
            _ => {}
        }
        let shown = || tree.shown(e.path());
        let (from_dir, from) = tree
            .parent(e.target())
            .map_err(Error::io("link", shown()))?;
        let (dir, name) = tree.parent(e.path()).map_err(Error::io("link", shown()))?;
        let tmp = tmp_leaf();
        at::link(&from_dir, from, &dir, tmp.as_ref()).map_err(Error::io("link", shown()))?;
        if let Err(err) = at::rename(&dir, tmp.as_ref(), name) {
            at::discard(&dir, tmp.as_ref());
            return Err(Error::io("rename into place", shown())(err));
        }
    }
    Ok(())
}

/// With `delete`: what the destination holds at a path of the version
/// under another type (a folder where the version has a file or link, a
/// file or link where it has a folder) is removed first, so the version can
/// take its place; returns how many entries went. Without `delete` such a
/// path is refused, never cleared: a pull does not destroy what it was not
/// asked to. Paths are visited in order, parents first, so a parent is a
/// real folder (or absent) before anything below it is looked at, and no
/// symlink is ever followed.
fn clear_type_changes(tree: &Tree, entries: &Listing) -> Result<u64> {
    let mut removed = 0;
    for e in entries.iter() {
        let shown = || tree.shown(e.path());
        let Some(st) = tree.stat(e.path()).map_err(Error::io("look at", shown()))? else {
            continue;
        };
        let is_dir = at::kind(&st) == rustix::fs::FileType::Directory;
        if is_dir == (e.kind() == Kind::Dir) {
            continue;
        }
        removed += if is_dir {
            tree.remove_dir_all(e.path())
                .map_err(Error::io("remove", shown()))?
        } else {
            tree.remove_file(e.path())
                .map_err(Error::io("remove", shown()))?;
            1
        };
    }
    Ok(removed)
}

/// Walks the destination for entries the version does not hold (symlinks
/// are never followed); returns how many there are and how many were
/// removed. With `delete` each goes: a file or link unlinked, a folder with
/// all it holds. Runs before directory modes are set, so a read-only folder
/// of the version cannot block it.
fn sweep_extras(tree: &Tree, entries: &Listing, delete: bool) -> Result<(u64, u64)> {
    let (mut extra, mut deleted) = (0u64, 0u64);
    let mut to_list: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(rel) = to_list.pop() {
        let names = tree
            .list(&rel)
            .map_err(Error::io("list", tree.shown(&rel)))?;
        for (name, is_dir) in names {
            let mut path = rel.clone();
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(&name);
            if entries.find(&path).is_some() {
                if is_dir {
                    to_list.push(path);
                }
                continue;
            }
            let shown = || tree.shown(&path);
            if !delete {
                extra += if is_dir {
                    tree.count_under(&path) + 1
                } else {
                    1
                };
                continue;
            }
            let n = if is_dir {
                tree.remove_dir_all(&path)
                    .map_err(Error::io("remove", shown()))?
            } else {
                tree.remove_file(&path)
                    .map_err(Error::io("remove", shown()))?;
                1
            };
            extra += n;
            deleted += n;
        }
    }
    Ok((extra, deleted))
}

/// Symlinks, then directory modes and times deepest first (a read-only
/// directory set earlier would block writing into it).
fn finish(tree: &Tree, entries: &Listing) -> Result<()> {
    for e in entries.iter().filter(|e| e.kind() == Kind::Symlink) {
        let shown = || tree.shown(e.path());
        if let Some(st) = tree.stat(e.path()).map_err(Error::io("look at", shown()))? {
            if at::kind(&st) == rustix::fs::FileType::Directory {
                return Err(Error::invalid(
                    format!("destination {}", shown().display()),
                    "is a directory where the snapshot has a symlink",
                ));
            }
            tree.remove_file(e.path())
                .map_err(Error::io("replace", shown()))?;
        }
        tree.symlink(e.target(), e.path(), e.mtime_ns())
            .map_err(Error::io("create symlink", shown()))?;
    }
    for e in entries.iter().rev().filter(|e| e.kind() == Kind::Dir) {
        tree.set_dir_meta(e.path(), e.mode(), e.mtime_ns())
            .map_err(Error::io("set mode and time of", tree.shown(e.path())))?;
    }
    Ok(())
}

/// What a pull's writers share: the listing, which of its files to write
/// in which order, the tree they go into, how many threads write, what
/// shows their progress, and where the packs arrive. Handles only: cloned
/// for each attempt of [`write_verified`].
#[derive(Clone)]
struct Writing {
    entries: Arc<Listing>,
    order: Vec<usize>,
    tree: Arc<Tree>,
    threads: usize,
    progress: Arc<dyn Progress>,
    arrivals: Arc<Arrivals>,
}

/// Writes the files `order` names (of `w`'s listing) with `w.threads`
/// writers, each file once its packs have arrived, its chunks read from
/// `cache` by `index` and verified; returns the bytes written.
fn write_files(w: &Writing, order: &[usize], index: &Index, cache: &NodeCache) -> Result<u64> {
    let (entries, tree, threads) = (w.entries.as_ref(), w.tree.as_ref(), w.threads);
    let (progress, arrivals) = (w.progress.as_ref(), w.arrivals.as_ref());
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let err: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut reader = PackReader::new(cache).with_fresh(arrivals);
                let mut buf = Vec::new();
                let mut dirs = at::Dirs::for_writer(threads);
                let mut unsynced = Unsynced::default();
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = order.get(k) else { break };
                    if err.lock().expect("poisoned").is_some() {
                        break;
                    }
                    let e = entries.get(i);
                    let packs = packs_of(entries, e, index);
                    if arrivals.wait_for(&packs).is_err() {
                        // The fetch failed; its error is the one reported.
                        let failed = Error::not_found(FETCH_FAILED);
                        err.lock().expect("poisoned").get_or_insert(failed);
                        break;
                    }
                    let written =
                        write_one(entries, e, tree, &mut dirs, index, &mut reader, &mut buf)
                            .and_then(|w| unsynced.add(tree, w, e.size()));
                    match written {
                        Ok(()) => {
                            arrivals.done_with(&packs);
                            bytes.fetch_add(e.size(), Ordering::Relaxed);
                            progress.advance(e.size(), 1);
                        }
                        Err(x) => {
                            err.lock().expect("poisoned").get_or_insert(x);
                            break;
                        }
                    }
                }
                // What this writer wrote is whole, whatever stopped the
                // others: named now, a re-run finds it complete.
                if let Err(x) = unsynced.name_all(tree) {
                    err.lock().expect("poisoned").get_or_insert(x);
                }
            });
        }
    });
    match err.into_inner().expect("poisoned") {
        Some(e) => Err(e),
        None => Ok(bytes.into_inner()),
    }
}

/// Folders whose files are interleaved at a time (see [`spread_over_folders`]).
const SPREAD_WINDOW: usize = 64;

/// The files in an order where consecutive ones sit in different folders:
/// round robin over a window of [`SPREAD_WINDOW`] folders, each folder's
/// files in order, then the next window. Creating and renaming files takes
/// the folder's lock: writers working through one folder side by side spent
/// a third of a 50,000-file pull spinning on it. The window keeps the
/// folders in use few, so the destination's open folders
/// ([`crate::at::Tree`]) stay open: a round robin over all 1,000 folders
/// of a tree made every file open its folder again, 12% of that pull.
fn spread_over_folders(entries: &Listing, files: &[usize]) -> Vec<usize> {
    let parent = |i: usize| {
        let p = entries.get(i).path();
        &p[..p.iter().rposition(|&b| b == b'/').unwrap_or(0)]
    };
    let mut folders: Vec<Vec<usize>> = Vec::new();
    for &i in files {
        match folders.last_mut() {
            Some(f) if parent(f[0]) == parent(i) => f.push(i),
            _ => folders.push(vec![i]),
        }
    }
    let mut order = Vec::with_capacity(files.len());
    for window in folders.chunks(SPREAD_WINDOW) {
        let longest = window.iter().map(Vec::len).max().unwrap_or(0);
        for k in 0..longest {
            order.extend(window.iter().filter_map(|f| f.get(k).copied()));
        }
    }
    order
}

/// Block size of holes: a block of zeros aligned to it in the file is not
/// written, so a sparse file (a preallocated checkpoint, a disk image) stays
/// sparse. Smaller runs of zeros are written.
const HOLE_BLOCK: usize = 4096;

/// Writes `data` at `offset` of `f`, leaving out the aligned blocks that are
/// all zeros (the file was created empty, so they read back as zeros). A
/// block's first and last words are looked at before the rest: random or
/// text data fails there at once, so only blocks of zeros cost a scan.
fn write_data(f: &std::fs::File, data: &[u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let zero = |b: &[u8]| {
        let (head, tail) = (b.first().copied(), b.last().copied());
        head == Some(0)
            && tail == Some(0)
            && b.chunks_exact(8)
                .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
    };
    // Blocks aligned to the file, so a hole covers whole file-system blocks.
    let mut at = 0usize;
    let mut pending: Option<usize> = None; // start of bytes still to write
    while at < data.len() {
        let block_end = ((offset as usize + at) / HOLE_BLOCK + 1) * HOLE_BLOCK - offset as usize;
        let end = block_end.min(data.len());
        let whole = end - at == HOLE_BLOCK;
        if whole && zero(&data[at..end]) {
            if let Some(start) = pending.take() {
                f.write_all_at(&data[start..at], offset + start as u64)?;
            }
        } else if pending.is_none() {
            pending = Some(at);
        }
        at = end;
    }
    if let Some(start) = pending {
        f.write_all_at(&data[start..], offset + start as u64)?;
    }
    Ok(())
}

/// A file written under a temporary name, waiting for its data to be
/// durable before it gets its own ([`Unsynced`]).
struct Written {
    dir: Arc<rustix::fd::OwnedFd>,
    tmp: String,
    path: Vec<u8>,
}

/// Files written that wait for their renames: batched so that one `syncfs`
/// makes all their data durable, instead of an `fdatasync` each (which
/// made a pull of 50,000 small files twice as slow). A file is renamed
/// into place only after its data is on the disk: after a power cut a file
/// under its own name holds its bytes, never the zeros a journal that kept
/// the name and size but not the data would show (and a re-pull would take
/// for complete by size and time).
#[derive(Default)]
struct Unsynced {
    files: Vec<Written>,
    bytes: u64,
}

impl Unsynced {
    /// Files waiting at most, per writer.
    const FILES: usize = 4096;
    /// Bytes waiting at most, per writer: the kernel writes dirty data back
    /// by itself well before this much is held.
    const BYTES: u64 = 256 << 20;

    fn add(&mut self, tree: &Tree, w: Written, size: u64) -> Result<()> {
        self.files.push(w);
        self.bytes += size;
        if self.files.len() >= Self::FILES || self.bytes >= Self::BYTES {
            self.name_all(tree)?;
        }
        Ok(())
    }

    /// Makes the waiting files' data durable (one `syncfs` per file system
    /// they are on), then renames each into place. On failure the files
    /// not renamed are removed.
    fn name_all(&mut self, tree: &Tree) -> Result<()> {
        let files = std::mem::take(&mut self.files);
        self.bytes = 0;
        let result = Self::sync(&files).and_then(|()| {
            files.iter().try_for_each(|w| {
                let name = split_name(&w.path);
                at::rename(&w.dir, w.tmp.as_ref(), name)
                    .map_err(|err| rename_error(tree, &w.path, err))
            })
        });
        if result.is_err() {
            for w in &files {
                at::discard(&w.dir, w.tmp.as_ref());
            }
        }
        result
    }

    fn sync(files: &[Written]) -> Result<()> {
        let mut devices = Vec::new();
        let mut seen: Vec<*const rustix::fd::OwnedFd> = Vec::new();
        for w in files {
            if seen.contains(&Arc::as_ptr(&w.dir)) {
                continue;
            }
            seen.push(Arc::as_ptr(&w.dir));
            let st =
                rustix::fs::fstat(&*w.dir).map_err(|e| Error::io("sync", "a folder")(e.into()))?;
            if !devices.iter().any(|(d, _)| *d == st.st_dev) {
                devices.push((st.st_dev, w.dir.clone()));
            }
        }
        for (_, dir) in devices {
            // The tree's folders are open `O_PATH`, which `syncfs` refuses.
            let synced = rustix::fs::openat(
                &*dir,
                ".",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
                rustix::fs::Mode::empty(),
            )
            .and_then(rustix::fs::syncfs);
            synced.map_err(|e| Error::io("sync", "the destination")(e.into()))?;
        }
        Ok(())
    }
}

/// The last component of a relative path.
fn split_name(rel: &[u8]) -> &std::ffi::OsStr {
    use std::os::unix::ffi::OsStrExt;
    let at = rel.iter().rposition(|&b| b == b'/').map_or(0, |i| i + 1);
    std::ffi::OsStr::from_bytes(&rel[at..])
}

/// Why a file could not be renamed into place: a folder where the snapshot
/// has a file is said so (only a failed rename asks).
fn rename_error(tree: &Tree, rel: &[u8], err: std::io::Error) -> Error {
    let shown = tree.shown(rel);
    let is_dir = tree.stat(rel).ok().flatten();
    if is_dir.is_some_and(|st| at::kind(&st) == rustix::fs::FileType::Directory) {
        Error::invalid(
            format!("destination {}", shown.display()),
            "is a directory where the snapshot has a file",
        )
    } else {
        Error::io("rename into place", shown)(err)
    }
}

fn write_one(
    list: &Listing,
    e: Item<'_>,
    tree: &Tree,
    dirs: &mut at::Dirs,
    index: &Index,
    reader: &mut PackReader<'_>,
    buf: &mut Vec<u8>,
) -> Result<Written> {
    let shown = || tree.shown(e.path());
    let (dir, _) = tree
        .parent_in(dirs, e.path())
        .map_err(Error::io("create", shown()))?;
    let tmp_name = tmp_leaf();
    let tmp: &std::ffi::OsStr = tmp_name.as_ref();
    // Only a name this pull created is ever removed again.
    let w = at::create(&dir, tmp).map_err(Error::io("create", shown()))?;
    let result = (|| {
        // Chunks are whole files or up to 4 MiB: written directly, no buffer
        // copy, at their offset (blocks of zeros are left as holes).
        let mut n = 0u64;
        // Never more than the size the free space was checked for: a
        // hostile tree may list one chunk a million times for a file of
        // a few bytes (the listing refused what the index's lengths show;
        // this holds whatever the index says).
        let past_size = || {
            Error::corrupt(
                format!("file {}", e.path_lossy()),
                format!(
                    "its chunks hold more than the {} bytes the snapshot says",
                    e.size()
                ),
            )
        };
        for &c in e.chunks() {
            let (pack, entry) = list
                .chunk(index, c)
                .map_err(|c| Error::not_found(format!("chunk {c}")))?;
            if n + u64::from(entry.raw_len) > e.size() {
                return Err(past_size());
            }
            // Verified before a single byte reaches the file.
            n += reader.with_plain(&pack, &entry, buf, |plain| {
                if n + plain.len() as u64 > e.size() {
                    return Err(past_size());
                }
                write_data(&w, plain, n).map_err(Error::io("write", shown()))?;
                Ok(plain.len() as u64)
            })?;
        }
        if n != e.size() {
            return Err(Error::corrupt(
                format!("file {}", e.path_lossy()),
                format!("chunks give {n} bytes, the snapshot says {}", e.size()),
            ));
        }
        // A file ending in a hole: the size its last write did not reach.
        w.set_len(n).map_err(Error::io("write", shown()))?;
        w.set_permissions(std::fs::Permissions::from_mode(e.mode()))
            .map_err(Error::io("set mode of", shown()))?;
        w.set_modified(time_of(e.mtime_ns()))
            .map_err(Error::io("set time of", shown()))?;
        Ok(())
    })();
    match result {
        // Renamed once its data is durable ([`Unsynced`]).
        Ok(()) => Ok(Written {
            dir,
            tmp: tmp_name,
            path: e.path().to_vec(),
        }),
        Err(x) => {
            at::discard(&dir, tmp);
            Err(x)
        }
    }
}

/// The packs a snapshot's files need, with their sizes: what a
/// node must hold to materialise it (the placer prices nodes by them).
pub async fn snapshot_packs(
    repo: &Repo,
    cache: &NodeCache,
    snapshot: &SnapshotId,
) -> Result<Vec<(PackId, u64)>> {
    let repo = repo
        .clone()
        .with_index_cache(Some(cache.index_dir(&repo.config().id)));
    let ((index, _), object) = tokio::try_join!(repo.load_index(), repo.load_snapshot(snapshot))?;
    let mut loader = Loader::new(&index, false);
    repo.decode_tree_into(&index, snapshot, &object, &mut loader)
        .await?;
    let (entries, _, _) = loader.finish(&snapshot.to_string())?;
    needed_packs(&entries, &index, entries.iter(), |c, _| {
        Error::not_found(format!("chunk {c}"))
    })
}

/// Brings every pack of `spec` into the node cache without writing files
/// (`cache pin`, and admins warming a node before a deadline week).
pub async fn warm(
    repo: &Repo,
    cache: &NodeCache,
    spec: &RefSpec,
    progress: Arc<dyn Progress>,
) -> Result<(VersionRecord, u64, u64)> {
    let record = repo.resolve(spec).await?;
    let packs = snapshot_packs(repo, cache, &record.snapshot).await?;
    let repo = repo
        .clone()
        .with_index_cache(Some(cache.index_dir(&repo.config().id)));
    let _held = cache.hold(record.snapshot)?;
    cache.touch(
        record.snapshot,
        &record.label(),
        &repo.config().id,
        packs.clone(),
    )?;
    let fetched = cache.fetch_packs(&repo, &packs, &progress).await;
    // Bounded like a pull's: the cap applied after the fetch, ended or
    // failed (a failed one may have brought most of it). Warms alone (a
    // coordinator prefetching for a long queue) grew the cache past its
    // cap until the disk was full and other jobs' pulls were refused.
    for label in cache.enforce_cap(Some(record.snapshot))? {
        progress.warn(&format!(
            "evicted {label} from the node cache (over its size cap)"
        ));
    }
    let (n, bytes) = fetched?;
    Ok((record, n, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::TreeSink;

    #[test]
    fn writers_are_spread_over_folders() {
        let e = |p: &str, kind| crate::snapshot::Entry {
            path: p.as_bytes().to_vec(),
            kind,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            chunks: Vec::new(),
            target: Vec::new(),
        };
        let (file, dir) = (Kind::File, Kind::Dir);
        let index = Index::default();
        let mut loader = Loader::new(&index, false);
        let entries = vec![
            e("a", dir),
            e("a/1", file),
            e("a/2", file),
            e("a/3", file),
            e("b", dir),
            e("b/1", file),
            e("c", dir),
            e("c/d", dir),
            e("c/d/1", file),
            e("top", file),
        ];
        loader.add(entries).unwrap();
        let (list, _, _) = loader.finish("s").unwrap();
        let order = spread_over_folders(&list, &[1, 2, 3, 5, 8, 9]);
        assert_eq!(order, vec![1, 5, 8, 9, 2, 3]);
    }
}
