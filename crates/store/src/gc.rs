//! `gc`: mark and sweep with a grace period, safe next to running pushes.
//!
//! Mark: every version of every name is a root; its tree and file chunks mark
//! their packs. Sweep, in two phases so no lock is needed:
//! 1. an unreferenced pack older than the grace period is *condemned* (listed
//!    in a `gc/condemned-*` object); pushes stop deduplicating against it;
//! 2. a later gc, once the condemnation is older than the grace period,
//!    deletes it if it is still unreferenced.
//!
//! A pack a running push just wrote is younger than the grace period, so it is
//! kept; a push that deduplicated against a pack before it was condemned has a
//! whole grace period to commit (and re-checks if it ran longer than half of
//! it). If any root cannot be read, nothing is deleted.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId, SnapshotId};
use crate::index::Index;
use crate::progress::Progress;
use crate::repo::{now_secs, pack_key, snapshot_key, Repo, MAX_SNAPSHOT_OBJECT};

/// A condemnation as listed: its key and the time the store gives it.
struct Record {
    key: String,
    listed: i64,
    rec: Condemned,
}

#[derive(Serialize, Deserialize)]
struct Condemned {
    time: i64,
    packs: Vec<PackId>,
}

/// Packs that gc has condemned and not yet deleted.
pub async fn condemned_packs(repo: &Repo) -> Result<HashSet<PackId>> {
    let mut out = HashSet::new();
    for o in repo.remote().list("gc/").await? {
        if let Some(c) = read_condemned(repo, &o.key).await? {
            out.extend(c.packs);
        }
    }
    Ok(out)
}

/// A condemnation record, or `None` when it is gone or cannot be used. One
/// that is too large or does not parse (any member can write `gc/`) is
/// said once in the log and condemns nothing: its packs are neither kept
/// from dedup nor deleted by it, and no push or gc stops for it.
async fn read_condemned(repo: &Repo, key: &str) -> Result<Option<Condemned>> {
    let bytes = match repo.remote().get_at_most(key, MAX_GC_RECORD).await {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e @ Error::Corrupt { .. }) => {
            tracing::warn!("gc record {key} is not used: {e}");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    match serde_json::from_slice(&bytes) {
        Ok(c) => Ok(Some(c)),
        Err(e) => {
            tracing::warn!("gc record {key} is not used: it does not parse ({e})");
            Ok(None)
        }
    }
}

/// Where long pushes pin the packs they uploaded and no version names yet.
pub(crate) const PINS: &str = "pins/";

/// The most a pin may hold: two million packs (64 TB of 32 MiB packs).
const MAX_PIN: u64 = 64 << 20;

/// A pin: the packs a running push uploaded (and who pushes).
#[derive(Serialize, Deserialize)]
struct Pin {
    packs: Vec<PackId>,
    by: String,
}

/// A new pin's key.
pub(crate) fn pin_key() -> String {
    format!("{PINS}{}", crate::claims::nonce())
}

/// Writes (again) the pin `key` naming `packs`: gc keeps them, as young,
/// as long as the pin is younger than the grace period.
pub(crate) async fn write_pin(repo: &Repo, key: &str, packs: &[PackId]) -> Result<()> {
    let pin = Pin {
        packs: packs.to_vec(),
        by: crate::claims::claimant(),
    };
    let json = serde_json::to_vec(&pin).expect("pin serialises");
    repo.remote().put(key, json.into()).await
}

/// The packs pins younger than `grace` (by `now`, the store's clock)
/// name: uploaded by pushes still running. A pin that is too large or
/// does not parse pins nothing (any member can write `pins/`).
async fn pinned(repo: &Repo, now: i64, grace: i64) -> Result<HashSet<PackId>> {
    let mut out = HashSet::new();
    for o in repo.remote().list(PINS).await? {
        if now.saturating_sub(o.modified) >= grace {
            continue;
        }
        let bytes = match repo.remote().get_at_most(&o.key, MAX_PIN).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue,
            Err(e @ Error::Corrupt { .. }) => {
                tracing::warn!("pin {} is not used: {e}", o.key);
                continue;
            }
            Err(e) => return Err(e),
        };
        match serde_json::from_slice::<Pin>(&bytes) {
            Ok(p) => out.extend(p.packs),
            Err(e) => tracing::warn!("pin {} is not used: it does not parse ({e})", o.key),
        }
    }
    Ok(out)
}

/// The most a `gc/` record may hold: about 900,000 packs (30 TB of 32 MiB
/// packs). A run condemns at most [`MAX_CONDEMNED_PER_RUN`], which fits.
const MAX_GC_RECORD: u64 = 64 << 20;
/// Packs one run condemns at most; the rest wait for the next run.
const MAX_CONDEMNED_PER_RUN: usize = 500_000;

/// What gc found and did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcOutcome {
    /// Versions used as roots.
    pub versions: u64,
    /// Packs in the store.
    pub packs: u64,
    /// Packs some version references.
    pub referenced_packs: u64,
    /// Unreferenced packs kept because they are younger than the grace period.
    pub young_packs: u64,
    /// Packs kept because a running push pinned them.
    pub pinned_packs: u64,
    /// Packs condemned by this run (deleted by a run after the grace period).
    pub condemned: Vec<PackId>,
    /// Packs deleted (or that would be, with `--dry-run`).
    pub deleted: Vec<PackId>,
    /// Bytes of deleted packs.
    pub deleted_bytes: u64,
    /// Unreferenced snapshot objects deleted.
    pub deleted_snapshots: u64,
    /// Staging files of local writes that never finished (older than the
    /// grace period), removed.
    pub deleted_staging: u64,
    /// Their bytes.
    pub deleted_staging_bytes: u64,
    /// Whether anything was changed.
    pub dry_run: bool,
}

/// Runs gc. `grace_secs` overrides the store's grace period (0 is only safe
/// when no push is running: the admin's to say, on the command line);
/// the store's own is never taken below [`crate::GC_GRACE_FLOOR_SECS`].
pub async fn gc(
    repo: &Repo,
    dry_run: bool,
    grace_secs: Option<u64>,
    progress: &dyn Progress,
) -> Result<GcOutcome> {
    gc_on_clock(repo, dry_run, grace_secs, progress, now_secs()).await
}

/// The most this host's clock may differ from the store's for gc to run.
pub const CLOCK_MARGIN_SECS: i64 = 300;

/// The store's clock now: the modification time the server gives an
/// object this run writes (and removes at once).
async fn store_now(repo: &Repo) -> Result<i64> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let key = format!("clock/gc-{}-{nanos}", std::process::id());
    repo.remote()
        .put(
            &key,
            bytes::Bytes::from_static(b"gc reads the store's clock here"),
        )
        .await?;
    let info = repo.remote().head(&key).await;
    let _ = repo.remote().delete(&key).await;
    match info? {
        Some(o) => Ok(o.modified),
        None => Err(Error::not_found(format!("{key}, just written"))),
    }
}

/// Refuses a run whose host clock (`local`) is more than
/// [`CLOCK_MARGIN_SECS`] off the store's (`store`).
fn check_clock(local: i64, store: i64) -> Result<()> {
    let skew = local - store;
    if skew.abs() <= CLOCK_MARGIN_SECS {
        return Ok(());
    }
    Err(Error::invalid(
        "this host's clock",
        format!(
            "it is {} s {} the store's (the time the server gave an object gc wrote); gc \
             measures ages on the store's clock and deletes nothing while this host's is more \
             than {CLOCK_MARGIN_SECS} s off it: set the clock right (NTP; a hardware clock kept \
             in local time is hours off) and run gc again",
            skew.abs(),
            if skew > 0 { "ahead of" } else { "behind" }
        ),
    ))
}

/// [`gc`] on a host whose clock says `local` now (tests skew it).
async fn gc_on_clock(
    repo: &Repo,
    dry_run: bool,
    grace_secs: Option<u64>,
    progress: &dyn Progress,
    local: i64,
) -> Result<GcOutcome> {
    // Ages are the server's (LastModified): measured against the host's
    // clock, one hours ahead deleted the packs of running pushes.
    let now = store_now(repo).await?;
    check_clock(local, now)?;
    let config = repo.config();
    if grace_secs.is_none() && config.gc_grace_secs < config.gc_grace() {
        tracing::warn!(
            "the store's config asks a gc grace of {} s: gc takes {} s, the floor (any member \
             can write config; a shorter grace would delete running pushes' packs)",
            config.gc_grace_secs,
            config.gc_grace()
        );
    }
    let run = Run {
        repo,
        now,
        grace: grace_secs.unwrap_or_else(|| config.gc_grace()) as i64,
        dry_run,
    };
    progress.phase("gc: list", None, None);
    let packs = list_packs(repo).await?;
    // Versions before the index: a push writes the index object naming its
    // packs before it commits its version, so every version listed here
    // has its chunks in the index read next. Read the other way round, a
    // push committing in between left gc with a version whose chunks its
    // index did not have ("chunk ... not found"), and gc failed.
    let versions = repo.all_versions().await?;
    let (index, index_keys) = repo.load_index().await?;
    if let Some((key, why)) = index.refused().first() {
        // Its chunks look unreferenced; the consolidated index would drop them.
        return Err(Error::corrupt(
            format!("index {key}"),
            format!("{why}; gc deletes nothing while an index object is refused: run `labsync rebuild-index` first"),
        ));
    }

    let mut marked = mark(repo, &index, &versions, progress).await?;
    let mut out = GcOutcome {
        versions: versions.len() as u64,
        packs: packs.len() as u64,
        referenced_packs: packs.keys().filter(|p| marked.packs.contains(p)).count() as u64,
        dry_run,
        ..Default::default()
    };
    // Packs a running push pinned are kept as if a version named them:
    // neither condemned nor deleted while the pin is younger than the grace.
    let pins = pinned(repo, run.now, run.grace).await?;
    out.pinned_packs = packs.keys().filter(|p| pins.contains(p)).count() as u64;
    marked.packs.extend(pins);
    let records = run.condemn(&packs, &marked, &mut out).await?;

    progress.phase("gc: sweep", None, None);
    let (deleted, swept) = run
        .sweep_packs(&records, &packs, &index, &marked, &mut out)
        .await?;
    run.sweep_snapshots(&marked, &mut out).await?;
    run.sweep_staging(&mut out).await?;
    run.rewrite_index(&index, &index_keys, &deleted).await?;
    // Only now, with no index object naming the deleted packs: while a
    // record exists, a push leaves its packs out of the index it
    // deduplicates against. Removed before the index was rewritten, a push
    // in between took the old index whole and could name deleted chunks.
    // Interrupted before this, the next gc finds the packs gone and
    // removes the records then.
    if !run.dry_run {
        for key in swept {
            repo.remote().delete(&key).await?;
        }
    }
    Ok(out)
}

/// Every pack in the store, with its size and age (seconds since the epoch).
async fn list_packs(repo: &Repo) -> Result<HashMap<PackId, (u64, i64)>> {
    Ok(repo
        .remote()
        .list("packs/")
        .await?
        .iter()
        .filter_map(|o| {
            o.key
                .rsplit('/')
                .next()?
                .parse()
                .ok()
                .map(|id| (id, (o.size, o.modified)))
        })
        .collect())
}

/// What the versions reference.
struct Marked {
    packs: HashSet<PackId>,
    snapshots: HashSet<SnapshotId>,
    /// The index positions of every chunk a version needs, as bits.
    live: Vec<u64>,
}

impl Marked {
    /// Whether the chunk at index position `pos` is one a version needs.
    fn is_live(&self, pos: usize) -> bool {
        self.live
            .get(pos / 64)
            .is_some_and(|w| w & (1 << (pos % 64)) != 0)
    }
}

/// Mark: every version is a root; its tree and file chunks mark their packs.
/// A chunk the index lacks stops gc (nothing is deleted while a version is
/// incomplete).
async fn mark(
    repo: &Repo,
    index: &crate::index::Index,
    versions: &[crate::repo::VersionRecord],
    progress: &dyn Progress,
) -> Result<Marked> {
    progress.phase("gc: mark", None, Some(versions.len() as u64));
    let mut referenced: HashSet<PackId> = HashSet::new();
    let mut live_snapshots: HashSet<SnapshotId> = HashSet::new();
    let mut live = vec![0u64; index.len().div_ceil(64)];
    for v in versions {
        if !live_snapshots.insert(v.snapshot) {
            continue;
        }
        let snap = repo.load_snapshot(&v.snapshot).await?;
        let (_, entries) = repo.load_tree(index, &v.snapshot).await?;
        let ids = snap
            .segments
            .iter()
            .map(|s| s.id)
            .chain(entries.iter().flat_map(|e| e.chunks.iter().copied()));
        for c in ids {
            let pos = index.position(&c).ok_or_else(|| Error::NotFound {
                what: format!("chunk {c} of {}", v.label()),
                hint: "; gc deletes nothing while a version is incomplete: run `labsync rebuild-index`, then `labsync verify`".into(),
            })?;
            live[pos / 64] |= 1 << (pos % 64);
            referenced.insert(index.at(pos).0);
        }
        progress.advance(0, 1);
    }
    Ok(Marked {
        packs: referenced,
        snapshots: live_snapshots,
        live,
    })
}

/// One gc run: the store, its clock and its grace period.
struct Run<'a> {
    repo: &'a Repo,
    now: i64,
    grace: i64,
    dry_run: bool,
}

impl Run<'_> {
    /// Condemn: unreferenced packs older than the grace period, not yet
    /// condemned, go into a new `gc/condemned-*` record. Returns every
    /// record, the new one included.
    async fn condemn(
        &self,
        packs: &HashMap<PackId, (u64, i64)>,
        marked: &Marked,
        out: &mut GcOutcome,
    ) -> Result<Vec<Record>> {
        let (repo, now) = (self.repo, self.now);
        let mut records = Vec::new();
        for o in repo.remote().list("gc/").await? {
            if let Some(c) = read_condemned(repo, &o.key).await? {
                records.push(Record {
                    key: o.key,
                    listed: o.modified,
                    rec: c,
                });
            }
        }
        let already: HashSet<PackId> = records
            .iter()
            .flat_map(|r| r.rec.packs.iter().copied())
            .collect();
        let mut fresh = Vec::new();
        for (p, (_, modified)) in packs {
            if marked.packs.contains(p) || already.contains(p) {
                continue;
            }
            if now.saturating_sub(*modified) >= self.grace {
                fresh.push(*p);
            } else {
                out.young_packs += 1;
            }
        }
        fresh.sort();
        fresh.truncate(MAX_CONDEMNED_PER_RUN);
        if !fresh.is_empty() {
            let rec = Condemned {
                time: now,
                packs: fresh.clone(),
            };
            let key = format!(
                "gc/condemned-{now:012}-{}",
                PackId::of(&serde_json::to_vec(&rec.packs).unwrap_or_default()).short()
            );
            if !self.dry_run {
                repo.remote()
                    .put(&key, serde_json::to_vec(&rec).expect("serialises").into())
                    .await?;
                repo.remote().sync().await?;
            }
            records.push(Record {
                key,
                listed: now,
                rec,
            });
        }
        out.condemned = fresh;
        Ok(records)
    }

    /// Sweep: packs of condemnations older than the grace period that are
    /// still unreferenced are deleted. Returns them, and the records swept
    /// (for the caller to remove once the index no longer names the packs).
    ///
    /// Anyone can write to the store, so neither a record nor the index is
    /// taken at its word: a record is as old as the store's listing says
    /// (its own `time` is not read), a pack younger than the grace period is never
    /// deleted, and neither is one holding a chunk a version needs that is
    /// not, checked, where the index places it (an index object naming a
    /// live pack's chunks in another pack would otherwise condemn it).
    async fn sweep_packs(
        &self,
        records: &[Record],
        packs: &HashMap<PackId, (u64, i64)>,
        index: &Index,
        marked: &Marked,
        out: &mut GcOutcome,
    ) -> Result<(HashSet<PackId>, Vec<String>)> {
        let mut deleted: HashSet<PackId> = HashSet::new();
        let mut swept = Vec::new();
        for r in records {
            // Its own `time` says nothing: anyone may write one, dated
            // 1970 (deleted at once) or 2262 (never swept).
            if self.now.saturating_sub(r.listed) < self.grace {
                continue;
            }
            for p in &r.rec.packs {
                if marked.packs.contains(p) || deleted.contains(p) {
                    continue; // a version took it back meanwhile
                }
                if let Some(&(size, modified)) = packs.get(p) {
                    if self.now.saturating_sub(modified) < self.grace {
                        tracing::warn!(
                            "gc: {} names pack {p}, younger than the grace period: kept",
                            r.key
                        );
                        continue;
                    }
                    if !self.only_copies(p, size, packs, index, marked).await? {
                        continue;
                    }
                    out.deleted_bytes += size;
                }
                if !self.dry_run {
                    self.repo.remote().delete(&pack_key(p)).await?;
                }
                deleted.insert(*p);
            }
            swept.push(r.key.clone());
        }
        out.deleted = deleted.iter().copied().collect();
        out.deleted.sort();
        Ok((deleted, swept))
    }

    /// Whether pack `p` (`size` bytes) holds no chunk a version needs but
    /// copies of chunks that are, checked against their ids, where the
    /// index places them (each other pack read once, a few at once). A footer that cannot be read holds nothing a pull
    /// could use.
    async fn only_copies(
        &self,
        p: &PackId,
        size: u64,
        packs: &HashMap<PackId, (u64, i64)>,
        index: &Index,
        marked: &Marked,
    ) -> Result<bool> {
        use futures::{StreamExt, TryStreamExt};
        let entries = match self.repo.read_pack_footer(p, size).await {
            Ok(entries) => entries,
            Err(Error::Corrupt { .. }) => return Ok(true),
            Err(e) => return Err(e),
        };
        let kept = |chunk: &ChunkId, q: &PackId| {
            tracing::warn!(
                "gc: pack {p} holds chunk {chunk} of a version, which the index places in \
                 pack {q} where it is not: pack {p} kept; run `labsync rebuild-index`"
            );
            Ok(false)
        };
        let mut elsewhere: HashMap<PackId, Vec<crate::pack::PackEntry>> = HashMap::new();
        for e in entries {
            let Some(pos) = index.position(&e.id).filter(|&pos| marked.is_live(pos)) else {
                continue;
            };
            let (q, at) = index.at(pos);
            let end = at.offset.saturating_add(u64::from(at.stored_len));
            if q == *p || packs.get(&q).is_none_or(|&(q_size, _)| end > q_size) {
                return kept(&e.id, &q);
            }
            elsewhere.entry(q).or_default().push(at);
        }
        let remote = self.repo.remote();
        // One read per pack, of the span its chunks take (a pack overwritten
        // shorter meanwhile gives short bytes: those chunks are not there).
        let checks = elsewhere.into_iter().map(|(q, ats)| async move {
            let start = ats.iter().map(|a| a.offset).min().unwrap_or(0);
            let end = (ats.iter())
                .map(|a| a.offset + u64::from(a.stored_len))
                .max()
                .unwrap_or(0);
            let span = remote.get_range(&pack_key(&q), start..end).await?;
            let bad = ats.iter().find(|a| {
                let at = (a.offset - start) as usize;
                let stored = span.get(at..at + a.stored_len as usize);
                stored.is_none_or(|b| a.decode(b, &q).is_err())
            });
            Ok::<_, Error>(bad.map(|a| (a.id, q)))
        });
        let bad: Vec<_> = futures::stream::iter(checks)
            .buffer_unordered(8)
            .try_collect()
            .await?;
        match bad.into_iter().flatten().next() {
            Some((chunk, q)) => kept(&chunk, &q),
            None => Ok(true),
        }
    }

    /// Snapshot objects no version names, older than the grace period.
    ///
    /// A push may write one of them again and commit a version naming it
    /// after the versions were read (the same tree pushed again after its
    /// version was forgotten): each is read before it is deleted, and the
    /// versions are read again after the deletions; one that a version now
    /// names is put back. A push committing after that second read finds its
    /// snapshot gone itself and writes it again (see the push's commit).
    /// Should anything fail after the first deletion, every object deleted
    /// is put back before the error is returned: the next gc deletes them.
    async fn sweep_snapshots(&self, marked: &Marked, out: &mut GcOutcome) -> Result<()> {
        let remote = self.repo.remote();
        let mut deleted: Vec<(SnapshotId, bytes::Bytes)> = Vec::new();
        let swept = self.delete_snapshots(marked, &mut deleted, out).await;
        if deleted.is_empty() {
            return swept;
        }
        let named: Result<HashSet<SnapshotId>> = match swept {
            Ok(()) => self
                .repo
                .all_versions()
                .await
                .map(|vs| vs.iter().map(|v| v.snapshot).collect()),
            Err(e) => Err(e),
        };
        let mut first_error = None;
        for (id, bytes) in deleted {
            let back = match &named {
                Ok(named) => named.contains(&id),
                Err(_) => true,
            };
            if !back {
                continue;
            }
            if named.is_ok() {
                tracing::info!(
                    "gc: snapshot {id} was named by a version committed meanwhile: put back"
                );
            }
            match remote.put(&snapshot_key(&id), bytes).await {
                Ok(()) => out.deleted_snapshots -= 1,
                Err(e) => {
                    tracing::error!("gc: could not put snapshot {id} back: {e}");
                    first_error.get_or_insert(e);
                }
            }
        }
        // What was put back is made durable before any error is returned.
        let synced = remote.sync().await;
        named?;
        if let Some(e) = first_error {
            return Err(e);
        }
        synced
    }

    /// Deletes the snapshot objects no version in `marked` names and older
    /// than the grace period, keeping what each held in `deleted`.
    async fn delete_snapshots(
        &self,
        marked: &Marked,
        deleted: &mut Vec<(SnapshotId, bytes::Bytes)>,
        out: &mut GcOutcome,
    ) -> Result<()> {
        let remote = self.repo.remote();
        for o in remote.list("snapshots/").await? {
            let Some(id) = o
                .key
                .rsplit('/')
                .next()
                .and_then(|h| h.parse::<SnapshotId>().ok())
            else {
                continue;
            };
            if marked.snapshots.contains(&id) || self.now - o.modified < self.grace {
                continue;
            }
            if !self.dry_run {
                let key = snapshot_key(&id);
                let bytes = match remote.get_at_most(&key, MAX_SNAPSHOT_OBJECT).await {
                    Ok(b) => b,
                    // Gone since the listing (another gc): nothing to delete.
                    Err(e) if e.is_not_found() => continue,
                    // Larger than any snapshot can be: no version can use
                    // it, so it goes without a copy kept to put back.
                    Err(Error::Corrupt { .. }) => {
                        out.deleted_snapshots += 1;
                        remote.delete(&key).await?;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                // Kept (and counted) before the delete: one that failed may
                // still have taken effect (a timeout), and is put back with
                // the rest.
                deleted.push((id, bytes));
                out.deleted_snapshots += 1;
                remote.delete(&key).await?;
            } else {
                out.deleted_snapshots += 1;
            }
        }
        Ok(())
    }

    /// Half-written objects of pushes that were killed, and claims and
    /// probes of writers that crashed ([`crate::claims`]), and the clock
    /// objects of gc runs that did: never referenced
    /// by anything, and older than any write still in progress.
    async fn sweep_staging(&self, out: &mut GcOutcome) -> Result<()> {
        let remote = self.repo.remote();
        for o in remote.stale_staging(self.grace).await? {
            if !self.dry_run {
                remote.remove_staging(&o.key).await?;
            }
            out.deleted_staging += 1;
            out.deleted_staging_bytes += o.size;
        }
        for prefix in ["claims/", "probe/", "clock/", PINS] {
            for o in remote.list(prefix).await? {
                if self.now - o.modified < self.grace || o.key == crate::claims::KEEP {
                    continue;
                }
                if !self.dry_run {
                    remote.delete(&o.key).await?;
                }
                out.deleted_staging += 1;
                out.deleted_staging_bytes += o.size;
            }
        }
        Ok(())
    }

    /// One index for what is left. Index objects written after our listing
    /// (a concurrent push) are not touched.
    async fn rewrite_index(
        &self,
        index: &crate::index::Index,
        index_keys: &[String],
        deleted: &HashSet<PackId>,
    ) -> Result<()> {
        if self.dry_run || (deleted.is_empty() && index_keys.len() <= 1) {
            return Ok(());
        }
        // Packs listed again, now: the listing above was made before the
        // index was read, and a push may have written packs and the index
        // object naming them in between. Filtered by that first listing,
        // those packs were dropped from the consolidated index, the object
        // naming them deleted, and the version the push committed named
        // chunks no index had. A push writes its packs before the index
        // object naming them, so every pack of a loaded index object is in
        // this listing unless it is gone.
        let now_listed = list_packs(self.repo).await?;
        let recs = index.to_records(|p| now_listed.contains_key(p) && !deleted.contains(p));
        let new_keys: HashSet<String> = (self.repo.write_index(&recs).await?)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        self.repo.remote().sync().await?;
        for k in index_keys {
            if !new_keys.contains(k) {
                self.repo.remote().delete(k).await?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;
    use crate::remote::Remote;
    use crate::{PushOptions, RefSpec};

    /// A real (not dry) run with no grace period.
    fn sweep_now(repo: &Repo) -> Run<'_> {
        Run {
            repo,
            now: now_secs(),
            grace: 0,
            dry_run: false,
        }
    }

    /// gc read the versions when a tree's only version was forgotten; then
    /// a push stored the same tree again, rewriting its snapshot object and
    /// committing a version naming it. gc's sweep, going by the versions it
    /// read, deletes the object, reads the versions again and puts it back.
    #[tokio::test]
    async fn a_snapshot_named_by_a_version_committed_during_gc_is_put_back() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let opts = PushOptions::for_test("ds");
        let np = std::sync::Arc::new(NoProgress);
        let v1 = crate::push(&repo, dir.path(), &opts, np.clone())
            .await
            .unwrap()
            .record;
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let (index, _) = repo.load_index().await.unwrap();
        let versions = repo.all_versions().await.unwrap();
        let marked = mark(&repo, &index, &versions, &NoProgress).await.unwrap();
        assert!(!marked.snapshots.contains(&v1.snapshot));

        let again = crate::push(&repo, dir.path(), &opts, np)
            .await
            .unwrap()
            .record;
        assert_eq!(again.snapshot, v1.snapshot);
        let run = sweep_now(&repo);
        let mut out = GcOutcome::default();
        run.sweep_snapshots(&marked, &mut out).await.unwrap();
        assert_eq!(out.deleted_snapshots, 0);
        repo.load_snapshot(&again.snapshot).await.unwrap();

        // With nothing naming it any more, the next sweep deletes it.
        repo.forget(&"ds@v2".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let versions = repo.all_versions().await.unwrap();
        let marked = mark(&repo, &index, &versions, &NoProgress).await.unwrap();
        let mut out = GcOutcome::default();
        run.sweep_snapshots(&marked, &mut out).await.unwrap();
        assert_eq!(out.deleted_snapshots, 1);
        assert!(repo.load_snapshot(&again.snapshot).await.is_err());
    }

    /// Issue 41, point 4: any member can write the store's `config`. One
    /// asking a grace of 0 does not make an honest gc condemn the packs a
    /// push has just written and not yet committed: the floor holds.
    #[tokio::test]
    async fn a_config_without_grace_keeps_the_floor() {
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let fresh = push_one(&repo, "ds", b"a push not committed yet").await;
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let mut cfg = repo.config().clone();
        cfg.gc_grace_secs = 0;
        repo.remote()
            .put("config", serde_json::to_vec(&cfg).unwrap().into())
            .await
            .unwrap();
        let repo = Repo::open(repo.remote().clone(), None).await.unwrap();
        assert_eq!(repo.config().gc_grace_secs, 0);
        let out = gc(&repo, false, None, &NoProgress).await.unwrap();
        assert!(out.condemned.is_empty(), "{out:?}");
        assert_eq!(out.young_packs, fresh.len() as u64);
        // The admin's own override still goes below it.
        let out = gc(&repo, false, Some(0), &NoProgress).await.unwrap();
        assert_eq!(out.condemned.len(), fresh.len());
    }

    /// Issue 41, point 8: any member can write `gc/`. Records that do not
    /// parse, or parse as something else, block neither a push nor a gc:
    /// they condemn nothing.
    #[tokio::test]
    async fn a_junk_gc_record_blocks_nothing() {
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let live = push_one(&repo, "ds", &[1u8; 1000]).await;
        for (key, body) in [
            ("gc/condemned-junk", "not json at all"),
            (
                "gc/condemned-000000000001-x",
                r#"{"time": "soon", "packs": 7}"#,
            ),
        ] {
            let body = bytes::Bytes::from(body.as_bytes().to_vec());
            repo.remote().put(key, body).await.unwrap();
        }
        assert!(condemned_packs(&repo).await.unwrap().is_empty());
        push_one(&repo, "other", b"pushed past the junk").await;
        let out = gc(&repo, false, Some(0), &NoProgress).await.unwrap();
        assert!(out.deleted.is_empty(), "{out:?}");
        assert!(live.iter().all(|p| !out.condemned.contains(p)));
    }

    /// Issue 41, point 2: a host whose clock is 8 h ahead of the store's
    /// (a hardware clock kept in local time at UTC+8) runs no gc: it would
    /// take the packs a push wrote a moment ago for 8 h old. It is told
    /// why; a clock within the margin runs, measuring on the store's.
    #[tokio::test]
    async fn a_host_clock_off_the_stores_runs_no_gc() {
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let fresh = push_one(&repo, "ds", b"a push not committed yet").await;
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let ahead = now_secs() + 8 * 3600;
        let err = gc_on_clock(&repo, false, None, &NoProgress, ahead)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("28800 s ahead of the store's") && err.contains("NTP"),
            "{err}"
        );
        assert!(condemned_packs(&repo).await.unwrap().is_empty());
        let behind = now_secs() - 2 * 3600;
        let err = gc_on_clock(&repo, false, None, &NoProgress, behind)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("s behind the store's"), "{err}");
        let near = now_secs() + 60;
        let out = gc_on_clock(&repo, false, None, &NoProgress, near)
            .await
            .unwrap();
        assert!(out.condemned.is_empty(), "{out:?}");
        assert_eq!(out.young_packs, fresh.len() as u64);
        assert!(repo.remote().list("clock/").await.unwrap().is_empty());
    }

    /// Issue 41, point 3: a push running longer than the grace period pins
    /// the packs it uploaded. gc keeps pinned packs, however old, while
    /// the pin is younger than the grace; once it is not (the push died),
    /// they go the usual way, and so does the pin.
    #[tokio::test]
    async fn packs_a_running_push_pinned_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::local(dir.path()).unwrap(), None)
            .await
            .unwrap();
        let mut uploaded = push_one(&repo, "ds", &[3u8; 50_000]).await;
        uploaded.sort();
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let day_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(86_400);
        let age = |key: &str| {
            let path = repo.remote().local_path(key).unwrap();
            let f = std::fs::File::options().write(true).open(path).unwrap();
            f.set_modified(day_ago).unwrap();
        };
        // As old as the first packs of a day-long push.
        for p in &uploaded {
            age(&pack_key(p));
        }
        write_pin(&repo, "pins/running", &uploaded).await.unwrap();
        let out = gc(&repo, false, Some(3600), &NoProgress).await.unwrap();
        assert!(out.condemned.is_empty(), "{out:?}");
        assert_eq!(out.pinned_packs, uploaded.len() as u64);
        age("pins/running");
        let out = gc(&repo, false, Some(3600), &NoProgress).await.unwrap();
        assert_eq!(out.condemned, uploaded);
        assert!(repo.remote().list(PINS).await.unwrap().is_empty());
    }

    /// Issue 41, point 3, the push's side: a push pins the packs it
    /// uploads (here at once, where a real one waits a quarter of the
    /// grace), and removes its pin once its version is committed. One that
    /// dies before (its snapshot cannot be written) leaves the pin, naming
    /// every pack it uploaded.
    #[tokio::test]
    async fn a_push_pins_its_packs_until_its_version_is_committed() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let repo = Repo::open(Remote::local(&store).unwrap(), None)
            .await
            .unwrap()
            .with_pin_every(std::time::Duration::ZERO);
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), [5u8; 60_000]).unwrap();
        // Its snapshot cannot be written: `snapshots` is a file.
        std::fs::write(store.join("snapshots"), "in the way").unwrap();
        let np = std::sync::Arc::new(NoProgress);
        let opts = PushOptions::for_test("ds");
        assert!(crate::push(&repo, &src, &opts, np.clone()).await.is_err());
        let pins = repo.remote().list(PINS).await.unwrap();
        assert_eq!(pins.len(), 1, "{pins:?}");
        let bytes = repo
            .remote()
            .get_at_most(&pins[0].key, MAX_PIN)
            .await
            .unwrap();
        let pin: Pin = serde_json::from_slice(&bytes).unwrap();
        let mut named = pin.packs.clone();
        named.sort();
        let mut all: Vec<PackId> = list_packs(&repo).await.unwrap().into_keys().collect();
        all.sort();
        assert_eq!(named, all, "the pin names every pack uploaded");
        std::fs::remove_file(store.join("snapshots")).unwrap();
        // New data, so that this push uploads (and pins) packs of its own.
        std::fs::write(src.join("g"), [6u8; 60_000]).unwrap();
        crate::push(&repo, &src, &opts, np).await.unwrap();
        let left = repo.remote().list(PINS).await.unwrap();
        assert_eq!(left.len(), 1, "only the dead push's pin is left: {left:?}");
        assert_eq!(left[0].key, pins[0].key);
    }

    /// The packs (data and tree) a push of `content` as `name` wrote.
    async fn push_one(repo: &Repo, name: &str, content: &[u8]) -> Vec<PackId> {
        let before: HashSet<PackId> = list_packs(repo).await.unwrap().into_keys().collect();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), content).unwrap();
        let np = std::sync::Arc::new(NoProgress);
        crate::push(repo, dir.path(), &PushOptions::for_test(name), np)
            .await
            .unwrap();
        let mut new: Vec<PackId> = (list_packs(repo).await.unwrap().into_keys())
            .filter(|p| !before.contains(p))
            .collect();
        new.sort();
        assert!(!new.is_empty());
        new
    }

    /// Anyone may write an index object. One naming every chunk of a live
    /// pack P as held in the writer's own pack Q, read first, left P
    /// unreferenced: condemned, then deleted, and the data gone for good.
    #[tokio::test]
    async fn an_index_naming_live_chunks_elsewhere_deletes_nothing() {
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let all = push_one(&repo, "ds", &[7u8; 100_000]).await;
        let q = push_one(&repo, "mine", b"the attacker's own").await[0];
        let packs = list_packs(&repo).await.unwrap();
        // The pack of the file's data (the other holds the tree).
        let version = repo.all_versions().await.unwrap()[0].clone();
        let segments: HashSet<_> = (repo.load_snapshot(&version.snapshot).await.unwrap())
            .segments
            .iter()
            .map(|s| s.id)
            .collect();
        let mut ps = Vec::new();
        let mut named = Vec::new();
        for p in &all {
            let footer = repo.read_pack_footer(p, packs[p].0).await.unwrap();
            if footer.iter().all(|e| !segments.contains(&e.id)) {
                ps.push(*p);
                named.extend(
                    footer
                        .iter()
                        .map(|e| (e.id, 0, e.stored_len, e.raw_len, e.flags)),
                );
            }
        }
        assert_eq!(ps.len(), 1);
        let (real, _) = repo.load_index().await.unwrap();
        let mut poisoned = Index::default();
        poisoned.add(&crate::index::IndexPack {
            pack: q,
            size: packs[&q].0,
            chunks: named,
        });
        for r in real.to_records(|_| true) {
            poisoned.add(&r);
        }
        let versions = repo.all_versions().await.unwrap();
        let marked = mark(&repo, &poisoned, &versions, &NoProgress)
            .await
            .unwrap();
        assert!(
            ps.iter().all(|p| !marked.packs.contains(p)),
            "the premise: ds's packs look unused"
        );
        let run = sweep_now(&repo);
        let mut out = GcOutcome::default();
        let records = run.condemn(&packs, &marked, &mut out).await.unwrap();
        assert_eq!(out.condemned, ps);
        let (deleted, _) = run
            .sweep_packs(&records, &packs, &poisoned, &marked, &mut out)
            .await
            .unwrap();
        assert!(deleted.is_empty(), "{deleted:?}");
        for p in &ps {
            repo.read_pack_footer(p, packs[p].0).await.unwrap();
        }

        // Once no version needs their chunks, they go.
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let versions = repo.all_versions().await.unwrap();
        let marked = mark(&repo, &poisoned, &versions, &NoProgress)
            .await
            .unwrap();
        let mut out = GcOutcome::default();
        let (deleted, _) = run
            .sweep_packs(&records, &packs, &poisoned, &marked, &mut out)
            .await
            .unwrap();
        assert_eq!(deleted, ps.iter().copied().collect());
    }

    /// Anyone may write a condemnation too: one dated 1970 (or i64::MIN)
    /// had its packs deleted at once, one dated 2262 kept them for good.
    /// A record is as old as the store says, and a young pack stays
    /// whatever names it.
    #[tokio::test]
    async fn a_condemnation_is_as_old_as_the_store_says() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::local(dir.path()).unwrap(), None)
            .await
            .unwrap();
        let hour = 3600;
        let back = |key: &str, secs: i64| {
            let t = filetime::FileTime::from_unix_time(now_secs() - secs, 0);
            let path = repo.remote().local_path(key).unwrap();
            filetime::set_file_mtime(path, t).unwrap();
        };
        let old = push_one(&repo, "ds", b"old").await;
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        for p in &old {
            back(&pack_key(p), 2 * hour);
        }
        let young = push_one(&repo, "ds2", b"young").await;
        repo.forget(&"ds2@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let forge = |name: &str, time: i64, packs: &[PackId]| {
            let rec = serde_json::json!({ "time": time, "packs": packs });
            let key = format!("gc/condemned-{name}");
            let repo = &repo;
            async move {
                (repo.remote())
                    .put(&key, serde_json::to_vec(&rec).unwrap().into())
                    .await
                    .unwrap();
                key
            }
        };
        let (index, _) = repo.load_index().await.unwrap();
        let marked = mark(&repo, &index, &[], &NoProgress).await.unwrap();
        let run = Run {
            repo: &repo,
            now: now_secs(),
            grace: hour,
            dry_run: true,
        };
        let swept = |records| {
            let (run, index, marked) = (&run, &index, &marked);
            async move {
                let packs = list_packs(run.repo).await.unwrap();
                let mut out = GcOutcome::default();
                let records: Vec<Record> = records;
                run.sweep_packs(&records, &packs, index, marked, &mut out)
                    .await
                    .unwrap()
                    .0
            }
        };
        let listed = || async {
            let packs = list_packs(&repo).await.unwrap();
            run.condemn(&packs, &marked, &mut GcOutcome::default())
                .await
                .unwrap()
        };
        // Old packs, a record written now dated 1970 or i64::MIN: kept.
        forge("a", 0, &old).await;
        forge("b", i64::MIN, &old).await;
        assert!(swept(listed().await).await.is_empty());
        // A record written two hours ago, dated 2262: swept.
        let key = forge("c", i64::MAX, &old).await;
        back(&key, 2 * hour);
        let deleted = swept(listed().await).await;
        assert_eq!(deleted, old.iter().copied().collect());
        // A young pack, named by a record two hours old: kept.
        let key = forge("d", 0, &young).await;
        back(&key, 2 * hour);
        let deleted = swept(listed().await).await;
        assert!(young.iter().all(|p| !deleted.contains(p)), "{deleted:?}");
    }

    /// A sweep that cannot read the versions again after deleting puts back
    /// everything it deleted before it fails: it cannot tell which a push
    /// committed meanwhile.
    #[tokio::test]
    async fn a_sweep_failing_after_deleting_puts_everything_back() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let np = std::sync::Arc::new(NoProgress);
        let v1 = crate::push(&repo, dir.path(), &PushOptions::for_test("ds"), np)
            .await
            .unwrap()
            .record;
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let marked = Marked {
            packs: HashSet::new(),
            snapshots: HashSet::new(),
            live: Vec::new(),
        };
        // A record that does not decode: reading the versions fails.
        let junk = crate::repo::version_key("other", 1);
        repo.remote().put(&junk, "junk".into()).await.unwrap();
        let run = sweep_now(&repo);
        let mut out = GcOutcome::default();
        let err = run.sweep_snapshots(&marked, &mut out).await.unwrap_err();
        assert!(err.to_string().contains("other"), "{err}");
        assert_eq!(out.deleted_snapshots, 0);
        repo.load_snapshot(&v1.snapshot).await.unwrap();
    }
}
