//! Stages 7 to 9, commit: the index of the new packs once they are durable,
//! then the snapshot, then the version. That order is the whole of crash
//! safety: a ref never points at data that is not there.

use std::collections::HashSet;

use super::upload::Uploaded;
use super::PushOptions;
use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId, SnapshotId};
use crate::index::Index;
use crate::repo::{now_secs, snapshot_key, Repo, VersionRecord};
use crate::snapshot::{self, Entry, SnapshotObject};

/// Objects and bytes a push wrote to the store.
#[derive(Default)]
pub(super) struct Written {
    pub objects: u64,
    pub bytes: u64,
}

/// Makes the uploaded packs durable, then writes and syncs the index of
/// those no index object written during the push names (the uploader wrote
/// one every 32 packs or 64 Ki chunks).
pub(super) async fn write_index(repo: &Repo, uploaded: &Uploaded) -> Result<Written> {
    let mut written = Written {
        objects: uploaded.packs + uploaded.index_objects,
        bytes: uploaded.bytes + uploaded.index_bytes,
    };
    repo.remote().sync().await?;
    let index = repo.write_index(&uploaded.unindexed).await?;
    if !index.is_empty() {
        written.bytes += index.iter().map(|(_, n)| n).sum::<u64>();
        written.objects += index.len() as u64;
        repo.remote().sync().await?;
    }
    tracing::debug!(packs = uploaded.packs, "push: packs and index durable");
    Ok(written)
}

/// The snapshot as written, and the version it would follow.
pub(super) struct WrittenSnapshot {
    pub object: SnapshotObject,
    pub id: SnapshotId,
    /// The name's latest version before this push (read again after the
    /// scan unless the push is unchanged).
    pub latest: Option<VersionRecord>,
    /// True when the tree equals the newest version's, checked after the
    /// scan (nothing was written).
    pub unchanged: bool,
}

/// Writes the snapshot `object` unless the name's newest version has the
/// same one. `early` is the name's latest version read when the push
/// started: when it has the same snapshot, one read confirms that it is
/// still the newest and nothing is written. Otherwise (a changed tree, or a
/// name that moved on during the push) the object is written while the
/// latest version is read again, so what follows (the check that
/// deduplicated packs were not condemned, the change counts) goes by the
/// version the push will follow, as when it was read only now.
pub(super) async fn write_snapshot(
    repo: &Repo,
    name: &str,
    early: Option<VersionRecord>,
    object: SnapshotObject,
    written: &mut Written,
) -> Result<WrittenSnapshot> {
    let (id, bytes) = object.encode();
    if early.as_ref().is_some_and(|l| l.snapshot == id) {
        // Whether the object is there is asked alongside: a push that died
        // after its commit, before it could write back an object gc took
        // meanwhile (see commit_version), is repaired by pushing again.
        let key = snapshot_key(&id);
        let (newest, present) = tokio::join!(repo.newest_record(name), repo.remote().head(&key));
        if let Some(l) = newest?.filter(|l| l.snapshot == id && !l.forgotten) {
            if present?.is_none() {
                tracing::warn!(
                    "push: the snapshot object of {} was missing: written again",
                    l.label()
                );
                put_snapshot(repo, &id, bytes, written).await?;
            }
            return Ok(WrittenSnapshot {
                object,
                id,
                latest: Some(l),
                unchanged: true,
            });
        }
    }
    let (put, latest) = tokio::join!(put_snapshot(repo, &id, bytes, written), repo.latest(name));
    put?;
    tracing::debug!("push: snapshot durable");
    Ok(WrittenSnapshot {
        object,
        id,
        latest: latest?,
        unchanged: false,
    })
}

/// What the version record says of its tree beyond its counts.
pub(super) struct TreeStats {
    /// Stored bytes of the distinct chunks the tree references.
    pub stored_bytes: u64,
    /// Entries added, removed and modified since the latest version.
    pub added: u64,
    pub removed: u64,
    pub modified: u64,
}

/// Measures the tree: its stored bytes, `new_stored` for the chunks the
/// push added and those of the chunks it `used` the store had (bits over
/// `index`), and its changes from the latest version (`index` must hold the
/// new tree segments).
pub(super) async fn tree_stats(
    repo: &Repo,
    index: &Index,
    used: &[u64],
    new_stored: u64,
    snapshot: &WrittenSnapshot,
) -> Result<TreeStats> {
    let stored_bytes = new_stored
        + used_positions(used)
            .map(|i| u64::from(index.at(i).1.stored_len))
            .sum::<u64>();
    let (added, removed, modified) = match &snapshot.latest {
        Some(l) if !snapshot.unchanged => {
            let old = repo.load_snapshot(&l.snapshot).await?;
            match diff_counts(repo, index, &old, &snapshot.object).await {
                // The latest version was pushed concurrently, after our index was loaded.
                Err(e) if e.is_not_found() => {
                    let index = repo.load_index().await?.0;
                    diff_counts(repo, &index, &old, &snapshot.object).await?
                }
                counts => counts?,
            }
        }
        Some(_) => (0, 0, 0),
        None => (
            snapshot
                .object
                .segments
                .iter()
                .map(|s| s.entries as u64)
                .sum(),
            0,
            0,
        ),
    };
    Ok(TreeStats {
        stored_bytes,
        added,
        removed,
        modified,
    })
}

/// The positions whose bits are set.
fn used_positions(bits: &[u64]) -> impl Iterator<Item = usize> + '_ {
    bits.iter().enumerate().flat_map(|(w, &word)| {
        (0..64)
            .filter(move |b| word >> b & 1 == 1)
            .map(move |b| w * 64 + b)
    })
}

/// Entries added, removed and modified from the tree `old` to `new`. A
/// segment in both holds the same entries, which count for neither side, so
/// only the segments of one side are read, a batch at a time: a re-push
/// that changed a few files reads a few segments, never a whole tree.
async fn diff_counts(
    repo: &Repo,
    index: &Index,
    old: &SnapshotObject,
    new: &SnapshotObject,
) -> Result<(u64, u64, u64)> {
    use std::cmp::Ordering::*;
    // The latest version is anyone's: checked as `load_tree` checks a tree
    // before any of it is read (no segment twice, a bounded total).
    let ids = |o: &SnapshotObject, what: &str| {
        let mut set = HashSet::with_capacity(o.segments.len());
        match o.segments.iter().find(|s| !set.insert(s.id)) {
            Some(s) => Err(Error::corrupt(
                format!("{what} tree"),
                format!("tree segment {} listed twice", s.id.short()),
            )),
            None => Ok(set),
        }
    };
    let (in_old, in_new) = (ids(old, "the latest version's")?, ids(new, "the new")?);
    let only = |o: &SnapshotObject, other: &HashSet<ChunkId>| Segments {
        ids: (o.segments.iter().map(|s| s.id))
            .filter(|id| !other.contains(id))
            .collect(),
        next: 0,
        entries: Default::default(),
    };
    let (mut a, mut b) = (only(old, &in_new), only(new, &in_old));
    let claimed = (a.ids.iter().chain(&b.ids))
        .filter_map(|id| index.get(id))
        .map(|(_, e)| u64::from(e.raw_len))
        .fold(0u64, u64::saturating_add);
    if claimed > crate::repo::MAX_TREE_BYTES {
        return Err(Error::corrupt(
            "the latest version's tree",
            format!(
                "its segments claim {claimed} bytes, more than {}",
                crate::repo::MAX_TREE_BYTES
            ),
        ));
    }
    let (mut added, mut removed, mut modified) = (0, 0, 0);
    loop {
        a.fill(repo, index).await?;
        b.fill(repo, index).await?;
        let ord = match (a.entries.front(), b.entries.front()) {
            (None, None) => break,
            (Some(_), None) => Less,
            (None, Some(_)) => Greater,
            (Some(x), Some(y)) => x.path.cmp(&y.path),
        };
        match ord {
            Less => {
                removed += 1;
                a.entries.pop_front();
            }
            Greater => {
                added += 1;
                b.entries.pop_front();
            }
            Equal => {
                let (x, y) = (a.entries.pop_front(), b.entries.pop_front());
                if let (Some(x), Some(y)) = (x, y) {
                    modified += u64::from(snapshot::modified(&x, &y));
                }
            }
        }
    }
    Ok((added, removed, modified))
}

/// One side of a diff: its segments, read a batch at a time.
struct Segments {
    ids: Vec<ChunkId>,
    next: usize,
    entries: std::collections::VecDeque<Entry>,
}

impl Segments {
    /// Decoded bytes read per batch at most (at least one segment): ~25,000
    /// entries, ~5 MB once decoded.
    const BATCH_BYTES: u64 = 2 << 20;

    /// Reads batches of segments until there are entries to take or none
    /// is left (a segment may hold no entries).
    async fn fill(&mut self, repo: &Repo, index: &Index) -> Result<()> {
        while self.entries.is_empty() && self.next < self.ids.len() {
            let mut end = self.next;
            let mut bytes = 0u64;
            while end < self.ids.len() && (end == self.next || bytes < Self::BATCH_BYTES) {
                bytes += index
                    .get(&self.ids[end])
                    .map_or(0, |(_, e)| u64::from(e.raw_len));
                end += 1;
            }
            let batch = &self.ids[self.next..end];
            let segs = repo.read_chunks(index, batch).await?;
            for id in batch {
                let bytes = segs.get(id).expect("read_chunks returns every id or fails");
                self.entries.extend(snapshot::decode_segment(bytes, id)?);
            }
            self.next = end;
        }
        Ok(())
    }
}

/// Writes the snapshot object. Always, even when the store has it: it
/// refreshes the object's age, which gc's grace period reads.
async fn put_snapshot(
    repo: &Repo,
    id: &SnapshotId,
    bytes: Vec<u8>,
    written: &mut Written,
) -> Result<()> {
    written.bytes += bytes.len() as u64;
    repo.remote().put(&snapshot_key(id), bytes.into()).await?;
    written.objects += 1;
    repo.remote().sync().await
}

/// Creates the version (or finds the latest one equal to it, when nothing
/// changed); returns it and whether it is new.
pub(super) async fn commit_version(
    repo: &Repo,
    opts: &PushOptions,
    snapshot: &WrittenSnapshot,
    stats: &TreeStats,
    written: &mut Written,
) -> Result<(VersionRecord, bool)> {
    if let Some(l) = snapshot.latest.as_ref().filter(|_| snapshot.unchanged) {
        // Found the newest version, with this snapshot, after the scan.
        tracing::debug!(created = false, "push: version committed");
        return Ok((l.clone(), false));
    }
    let (record, created) = repo
        .commit_version(VersionRecord {
            name: opts.name.clone(),
            version: 0,
            snapshot: snapshot.id,
            time: now_secs(),
            user: opts.user.clone(),
            host: opts.host.clone(),
            files: snapshot.object.files,
            bytes: snapshot.object.bytes,
            stored_bytes: stats.stored_bytes,
            new_bytes: written.bytes,
            added: stats.added,
            removed: stats.removed,
            modified: stats.modified,
            forgotten: false,
            provenance: opts.provenance.clone(),
        })
        .await?;
    tracing::debug!(created, "push: version committed");
    if created {
        written.objects += 1;
        // A gc that read the versions before this one was committed may
        // have deleted the snapshot object as unreferenced since it was
        // written (it was an older, forgotten version's): write it again.
        // gc puts back what it deleted that a version named by the time it
        // finished, so between the two the version keeps its snapshot.
        if repo
            .remote()
            .head(&snapshot_key(&snapshot.id))
            .await?
            .is_none()
        {
            tracing::info!(
                "push: snapshot {} deleted by a gc meanwhile: written again",
                snapshot.id
            );
            let (_, bytes) = snapshot.object.encode();
            put_snapshot(repo, &snapshot.id, bytes, written).await?;
        }
    }
    Ok((record, created))
}

/// The chunks the push took from the store (the positions in `used`, and
/// the tree segments of `snapshot` the store had) that are not where the
/// index places them: the pack missing, or its own footer not placing the
/// chunk there, as a planted index object naming common chunks in a pack
/// that does not hold them would have it. A version naming them would not
/// restore. See [`Repo::confirm_entries`].
pub(super) async fn unconfirmed_hits(
    repo: &Repo,
    index: &Index,
    used: &[u64],
    snapshot: &SnapshotObject,
) -> Result<HashSet<ChunkId>> {
    let mut by_pack: std::collections::HashMap<PackId, Vec<crate::pack::PackEntry>> =
        Default::default();
    let segments = snapshot
        .segments
        .iter()
        .filter_map(|s| index.position(&s.id));
    for i in used_positions(used).chain(segments) {
        let (p, e) = index.at(i);
        by_pack.entry(p).or_default().push(e);
    }
    let bad = repo.confirm_entries(by_pack).await?;
    if let Some((p, e)) = bad.first() {
        tracing::warn!(
            "push: the index places chunk {} in pack {p}, whose own footer does not ({} such \
             entries): not used (run `labsync rebuild-index` to repair the index)",
            e.id,
            bad.len()
        );
    }
    Ok(bad.into_iter().map(|(_, e)| e.id).collect())
}

/// A push that ran longer than half of gc's grace period re-checks that the
/// packs it deduplicated against were not condemned meanwhile.
pub(super) async fn check_still_present(repo: &Repo, index: &Index, used: &[u64]) -> Result<()> {
    let condemned = crate::gc::condemned_packs(repo).await?;
    let present: HashSet<PackId> = repo
        .remote()
        .list("packs/")
        .await?
        .into_iter()
        .filter_map(|o| o.key.rsplit('/').next().and_then(|h| h.parse().ok()))
        .collect();
    for i in used_positions(used) {
        let (p, _) = index.at(i);
        if condemned.contains(&p) || !present.contains(&p) {
            return Err(Error::Conflict {
                what: format!("pack {p}"),
                detail: "gc removed data this long push relied on; run the push again (unchanged files are not re-read)".into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;
    use crate::remote::Remote;
    use crate::RefSpec;

    fn opts(name: &str) -> PushOptions {
        PushOptions::for_test(name)
    }

    /// Stats for a commit whose counts do not matter.
    fn no_stats() -> TreeStats {
        TreeStats {
            stored_bytes: 0,
            added: 0,
            removed: 0,
            modified: 0,
        }
    }

    /// A push finds its tree equal to the version that was the latest when
    /// it started; by the time it ends, the name has moved on, that version
    /// is forgotten, and gc took its snapshot object. The push is then a
    /// changed one: it writes the object again, follows the version that is
    /// the latest now, and only then creates its own, so no version refers
    /// to a missing snapshot.
    #[tokio::test]
    async fn a_push_whose_name_moved_meanwhile_is_a_changed_one() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for (d, text) in [(&a, "one"), (&b, "two")] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("f"), text).unwrap();
        }
        let np = std::sync::Arc::new(NoProgress);
        let v1 = crate::push(&repo, &a, &opts("ds"), np.clone())
            .await
            .unwrap()
            .record;
        let object = repo.load_snapshot(&v1.snapshot).await.unwrap();
        let v2 = crate::push(&repo, &b, &opts("ds"), np)
            .await
            .unwrap()
            .record;
        let v1_spec: RefSpec = "ds@v1".parse().unwrap();
        repo.forget(&v1_spec).await.unwrap();
        repo.remote()
            .delete(&snapshot_key(&v1.snapshot))
            .await
            .unwrap();

        let mut written = Written {
            objects: 0,
            bytes: 0,
        };
        let snapshot = write_snapshot(&repo, "ds", Some(v1.clone()), object, &mut written)
            .await
            .unwrap();
        assert!(!snapshot.unchanged);
        assert_eq!(written.objects, 1, "the snapshot object, written again");
        let follows = snapshot.latest.as_ref().map(|l| l.version);
        assert_eq!(follows, Some(v2.version), "it follows the latest now");
        repo.load_snapshot(&v1.snapshot).await.unwrap();
        let stats = no_stats();
        let (record, created) = commit_version(&repo, &opts("ds"), &snapshot, &stats, &mut written)
            .await
            .unwrap();
        assert!(created);
        assert_eq!((record.version, record.snapshot), (3, v1.snapshot));
    }

    /// A gc that read the versions before this push committed deletes the
    /// snapshot object the push has just written (an older, forgotten
    /// version had the same tree): the push, having committed, finds it
    /// gone and writes it again, so its version is never left without it.
    #[tokio::test]
    async fn a_snapshot_deleted_by_gc_before_the_commit_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let np = std::sync::Arc::new(NoProgress);
        let v1 = crate::push(&repo, dir.path(), &opts("ds"), np)
            .await
            .unwrap()
            .record;
        let object = repo.load_snapshot(&v1.snapshot).await.unwrap();
        repo.forget(&"ds@v1".parse::<RefSpec>().unwrap())
            .await
            .unwrap();
        let mut written = Written {
            objects: 0,
            bytes: 0,
        };
        let snapshot = write_snapshot(&repo, "ds", None, object, &mut written)
            .await
            .unwrap();
        // The gc's sweep, between the push's write and its commit.
        let key = snapshot_key(&snapshot.id);
        repo.remote().delete(&key).await.unwrap();
        let stats = no_stats();
        let (record, created) = commit_version(&repo, &opts("ds"), &snapshot, &stats, &mut written)
            .await
            .unwrap();
        assert!(created);
        assert_eq!(record.snapshot, v1.snapshot);
        assert!(repo.remote().head(&key).await.unwrap().is_some());
        repo.load_snapshot(&record.snapshot).await.unwrap();
        // The snapshot twice (written, then again) and the version.
        assert_eq!(written.objects, 3);
    }

    /// A version whose snapshot object went missing (a push killed between
    /// its commit and writing back an object gc took) is repaired by
    /// pushing the same tree again, which otherwise writes nothing.
    #[tokio::test]
    async fn an_unchanged_push_writes_a_missing_snapshot_object_again() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let np = std::sync::Arc::new(NoProgress);
        let v1 = crate::push(&repo, dir.path(), &opts("ds"), np.clone())
            .await
            .unwrap()
            .record;
        let key = snapshot_key(&v1.snapshot);
        repo.remote().delete(&key).await.unwrap();
        let again = crate::push(&repo, dir.path(), &opts("ds"), np)
            .await
            .unwrap();
        assert!(!again.created);
        assert_eq!(again.record.version, v1.version);
        repo.load_snapshot(&v1.snapshot).await.unwrap();
    }

    /// Still the newest: the unchanged push creates nothing.
    #[tokio::test]
    async fn an_unchanged_push_still_newest_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let np = std::sync::Arc::new(NoProgress);
        let first = crate::push(&repo, dir.path(), &opts("ds"), np.clone())
            .await
            .unwrap();
        let again = crate::push(&repo, dir.path(), &opts("ds"), np)
            .await
            .unwrap();
        assert!(first.created && !again.created);
        assert_eq!(again.record.version, 1);
        assert_eq!(again.objects_written, 0);
    }
}
