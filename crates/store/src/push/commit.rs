//! Stages 7 to 9, commit: the index of the new packs once they are durable,
//! then the snapshot, then the version. That order is the whole of crash
//! safety: a ref never points at data that is not there.

use std::collections::HashSet;

use super::tree::snapshot_of;
use super::PushOptions;
use crate::error::{Error, Result};
use crate::id::{PackId, SnapshotId};
use crate::index::{Index, IndexPack};
use crate::repo::{now_secs, snapshot_key, Repo, VersionRecord};
use crate::snapshot::{self, Entry, SegmentRef, SnapshotObject};

/// Objects and bytes a push wrote to the store.
#[derive(Default)]
pub(super) struct Written {
    pub objects: u64,
    pub bytes: u64,
}

/// Makes the uploaded packs durable, then writes and syncs their index.
pub(super) async fn write_index(
    repo: &Repo,
    packs: &[IndexPack],
    pack_bytes: u64,
) -> Result<Written> {
    let mut written = Written {
        objects: packs.len() as u64,
        bytes: pack_bytes,
    };
    repo.remote().sync().await?;
    if !packs.is_empty() {
        written.bytes += crate::index::encode(packs).len() as u64;
        repo.write_index(packs).await?;
        written.objects += 1;
        repo.remote().sync().await?;
    }
    tracing::debug!(packs = packs.len(), "push: packs and index durable");
    Ok(written)
}

/// The snapshot as written, and the version it would follow.
pub(super) struct WrittenSnapshot {
    pub object: SnapshotObject,
    pub id: SnapshotId,
    /// The name's latest version before this push.
    pub latest: Option<VersionRecord>,
    /// True when the tree equals the latest version's (nothing was written).
    pub unchanged: bool,
}

/// Writes the snapshot of `entries` unless the name's latest version has
/// the same one.
pub(super) async fn write_snapshot(
    repo: &Repo,
    name: &str,
    entries: &[Entry],
    segments: Vec<SegmentRef>,
    written: &mut Written,
) -> Result<WrittenSnapshot> {
    let object = snapshot_of(entries, segments);
    let (id, bytes) = object.encode();
    let latest = repo.latest(name).await?;
    let unchanged = latest.as_ref().is_some_and(|l| l.snapshot == id);
    if !unchanged {
        // Always (re)write: it refreshes the object's age, which gc's grace period reads.
        repo.remote()
            .put(&snapshot_key(&id), bytes.clone().into())
            .await?;
        written.bytes += bytes.len() as u64;
        written.objects += 1;
        repo.remote().sync().await?;
    }
    tracing::debug!("push: snapshot durable");
    Ok(WrittenSnapshot {
        object,
        id,
        latest,
        unchanged,
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
    /// Chunks new to the store.
    pub new_chunks: u64,
}

/// Measures the tree against the store (`index`, before the push, and the
/// new `packs`) and against the latest version.
pub(super) async fn tree_stats(
    repo: &Repo,
    index: &Index,
    packs: &[IndexPack],
    entries: &[Entry],
    snapshot: &WrittenSnapshot,
) -> Result<TreeStats> {
    let mut new = Index::default();
    for r in packs {
        new.add(r);
    }
    let stored_bytes = {
        let mut seen = HashSet::new();
        entries
            .iter()
            .flat_map(|e| e.chunks.iter())
            .filter(|c| seen.insert(**c))
            .map(|c| {
                index
                    .get(c)
                    .or_else(|| new.get(c))
                    .map_or(0, |(_, e)| e.stored_len as u64)
            })
            .sum()
    };
    let (added, removed, modified) = match &snapshot.latest {
        Some(l) if !snapshot.unchanged => {
            let mut full = index.clone();
            for r in packs {
                full.add(r);
            }
            let old = match repo.load_tree(&full, &l.snapshot).await {
                Ok((_, old)) => old,
                // The latest version was pushed concurrently, after our index was loaded.
                Err(e) if e.is_not_found() => {
                    repo.load_tree(&repo.load_index().await?.0, &l.snapshot)
                        .await?
                        .1
                }
                Err(e) => return Err(e),
            };
            let c = snapshot::diff(&old, entries);
            (
                c.added.len() as u64,
                c.removed.len() as u64,
                c.modified.len() as u64,
            )
        }
        Some(_) => (0, 0, 0),
        None => (entries.len() as u64, 0, 0),
    };
    Ok(TreeStats {
        stored_bytes,
        added,
        removed,
        modified,
        new_chunks: new.len() as u64,
    })
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
        })
        .await?;
    tracing::debug!(created, "push: version committed");
    if created {
        written.objects += 1;
    }
    Ok((record, created))
}

/// A push that ran longer than half of gc's grace period re-checks that the
/// packs it deduplicated against were not condemned meanwhile.
pub(super) async fn check_still_present(
    repo: &Repo,
    index: &Index,
    entries: &[Entry],
) -> Result<()> {
    let condemned = crate::gc::condemned_packs(repo).await?;
    let present: HashSet<PackId> = repo
        .remote()
        .list("packs/")
        .await?
        .into_iter()
        .filter_map(|o| o.key.rsplit('/').next().and_then(|h| h.parse().ok()))
        .collect();
    for c in entries.iter().flat_map(|e| e.chunks.iter()) {
        if let Some((p, _)) = index.get(c) {
            if condemned.contains(&p) || !present.contains(&p) {
                return Err(Error::Conflict {
                    what: format!("pack {p}"),
                    detail: "gc removed data this long push relied on; run the push again (unchanged files are not re-read)".into(),
                });
            }
        }
    }
    Ok(())
}
