//! `verify`: every version restorable, as far as reading can tell.
//!
//! Always: every ref, snapshot and tree segment readable and matching its
//! name; every index object matching its name; every chunk the versions use
//! indexed; and every index entry equal to its pack's own footer (two ranged
//! reads of a few KB per pack), the pack present at the size the index says.
//! Then every chunk is re-hashed: the node cache's copies by default, the
//! store's own packs with `remote` (which downloads them all).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use serde::Serialize;

use crate::cache::{verify_pack_bytes, NodeCache};
use crate::error::Result;
use crate::id::{ChunkId, PackId};
use crate::index::Index;
use crate::pack::PackEntry;
use crate::progress::Progress;
use crate::repo::{pack_key, RefSpec, Repo, VersionRecord};

/// What verify checked and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyReport {
    /// Versions whose trees were read.
    pub versions: u64,
    /// Distinct chunks referenced.
    pub chunks: u64,
    /// Packs read and re-hashed.
    pub packs_checked: u64,
    /// Chunks re-hashed.
    pub chunks_checked: u64,
    /// Everything wrong, one line each, naming the object.
    pub problems: Vec<String>,
    /// Corrupt packs removed from the node cache (fetched again on next use).
    pub repaired_cache_packs: u64,
    /// Pack footers read and compared with the index.
    pub footers_checked: u64,
    /// What was found that restores fine but is not as it should be (a
    /// snapshot no version names); reported, not counted as problems.
    pub warnings: Vec<String>,
    /// What repairs what was found, when one command does.
    pub repair: Option<String>,
}

/// Verifies the versions of `name` (all names when `None`): trees readable,
/// every chunk indexed, and every chunk re-hashed in the node cache, or in
/// the store itself with `remote`.
pub async fn verify(
    repo: &Repo,
    cache: &NodeCache,
    name: Option<&RefSpec>,
    remote: bool,
    progress: Arc<dyn Progress>,
) -> Result<VerifyReport> {
    let mut report = VerifyReport::default();
    // Listed before the versions are read: a push that wrote its snapshot
    // before this list and records its version meanwhile is not taken for lost.
    let snapshots = match name {
        None => Some(repo.remote().list("snapshots/").await?),
        Some(_) => None,
    };
    let versions = versions_of(repo, name).await?;
    // A version that names another snapshot than when this user used it:
    // overwritten by someone who can write the store.
    if let Some(seen) = repo.seen() {
        for rec in &versions {
            if let Err(e) = seen.check(rec) {
                report.problems.push(e.to_string());
            }
        }
    }
    if let Some(snapshots) = snapshots {
        check_unnamed_snapshots(repo, snapshots, &mut report).await?;
    }
    let (index, _) = repo.load_index().await?;
    for (key, why) in index.refused() {
        report
            .problems
            .push(format!("index {key}: {why}; it is not used"));
    }
    if index.refused_more() > 0 {
        report.problems.push(format!(
            "{} more objects under index/ are not used either",
            index.refused_more()
        ));
    }
    let chunks = check_trees(repo, &index, &versions, &mut report, progress.as_ref()).await;
    report.chunks = chunks.len() as u64;
    let index_sound = check_index_against_packs(repo, &index, &chunks, &mut report).await?;
    let packs: HashSet<PackId> = chunks
        .iter()
        .filter_map(|c| index.get(c).map(|(p, _)| p))
        .collect();
    if remote {
        check_store_packs(repo, &index, &packs, &mut report, progress.as_ref()).await;
    } else {
        check_cache_packs(cache, packs, &mut report, progress).await?;
    }
    // Keys the listings passed by: they stop nothing, but are junk someone
    // wrote, which only the server's own tools can remove.
    let (unnamable, more) = repo.remote().unnamable_keys();
    for key in unnamable {
        report.warnings.push(format!(
            "key {key:?} cannot be named by any command (an empty, `.` or `..` segment, or \
             a control character): listings pass it by; remove it with the server's own \
             tools (e.g. `aws s3api delete-object`)"
        ));
    }
    if more > 0 {
        report
            .warnings
            .push(format!("{more} more keys cannot be named either"));
    }
    if !index_sound || !index.refused().is_empty() {
        report.repair = Some(
            "the packs hold what the index lacks or misstates: run `labsync rebuild-index`, \
             then `labsync verify` again"
                .into(),
        );
    }
    Ok(report)
}

/// Snapshots that no version record names (forgotten ones included): a
/// version overwritten by another push on a server that ignored conditional
/// creates (stores made before labsync probed for that), or a push killed
/// between writing its tree and its version. What is recorded still
/// restores, so these are warnings; `gc` removes them after its grace period.
async fn check_unnamed_snapshots(
    repo: &Repo,
    snapshots: Vec<crate::remote::ObjectInfo>,
    report: &mut VerifyReport,
) -> Result<()> {
    let mut named = HashSet::new();
    for n in repo.names().await? {
        named.extend(repo.records(&n).await?.into_iter().map(|r| r.snapshot));
    }
    for o in snapshots {
        let Some(id) = o.key.rsplit('/').next().and_then(|h| h.parse().ok()) else {
            continue;
        };
        if named.contains(&id) {
            continue;
        }
        let age = crate::repo::now_secs().saturating_sub(o.modified).max(0);
        report.warnings.push(format!(
            "snapshot {id} (written {age} s ago) is named by no version: a version lost to a \
             server that ignored conditional writes (stores made before labsync probed for \
             them), a push killed before it recorded its version, or one in progress now"
        ));
    }
    Ok(())
}

/// The versions `name` selects: one, a name's, or every name's.
async fn versions_of(repo: &Repo, name: Option<&RefSpec>) -> Result<Vec<VersionRecord>> {
    Ok(match name {
        Some(spec) if spec.version.is_some() => vec![repo.resolve(spec).await?],
        Some(spec) => {
            let v = repo.versions(&spec.name).await?;
            if v.is_empty() {
                repo.resolve(spec).await?; // the NotFound error with its hint
            }
            v
        }
        None => repo.all_versions().await?,
    })
}

/// Reads every distinct tree; returns the chunks they reference (segments
/// included) and reports unreadable trees and unindexed chunks.
async fn check_trees(
    repo: &Repo,
    index: &Index,
    versions: &[VersionRecord],
    report: &mut VerifyReport,
    progress: &dyn Progress,
) -> HashSet<ChunkId> {
    progress.phase("verify trees", None, Some(versions.len() as u64));
    let mut chunks: HashSet<ChunkId> = HashSet::new();
    let mut seen = HashSet::new();
    for v in versions {
        progress.advance(0, 1);
        if !seen.insert(v.snapshot) {
            continue;
        }
        report.versions += 1;
        match repo.load_tree(index, &v.snapshot).await {
            Ok((snap, entries)) => {
                chunks.extend(snap.segments.iter().map(|s| s.id));
                for e in &entries {
                    for c in &e.chunks {
                        if chunks.insert(*c) && !index.contains(c) {
                            report.problems.push(format!(
                                "{}: chunk {c} of {} is not in the index",
                                v.label(),
                                e.path_lossy()
                            ));
                        }
                    }
                }
            }
            Err(e) => report
                .problems
                .push(format!("{}: tree unreadable: {e}", v.label())),
        }
    }
    chunks
}

/// Every pack holding a chunk in `chunks` against the index: present in the
/// store at the size the index says, with a sound footer (two ranged reads),
/// and every index entry of those chunks equal to the footer's. Returns
/// false when the index disagrees with packs whose footers are sound (the
/// index is what is wrong: `rebuild-index` repairs it).
async fn check_index_against_packs(
    repo: &Repo,
    index: &Index,
    chunks: &HashSet<ChunkId>,
    report: &mut VerifyReport,
) -> Result<bool> {
    let mut by_pack: BTreeMap<PackId, Vec<PackEntry>> = BTreeMap::new();
    for c in chunks {
        if let Some((p, e)) = index.get(c) {
            by_pack.entry(p).or_default().push(e);
        }
    }
    let listed: HashMap<PackId, u64> = repo
        .remote()
        .list("packs/")
        .await?
        .into_iter()
        .filter_map(|o| Some((o.key.rsplit('/').next()?.parse().ok()?, o.size)))
        .collect();
    let checks: Vec<_> = by_pack
        .into_iter()
        .map(|(pack, entries)| {
            let real = listed.get(&pack).copied();
            async move {
                (
                    pack,
                    check_pack_footer(repo, index, pack, real, &entries).await,
                )
            }
        })
        .collect();
    let results: Vec<(PackId, FooterCheck)> = futures::stream::iter(checks)
        .buffer_unordered(8)
        .collect()
        .await;
    let mut sound = true;
    for (pack, r) in results {
        match r {
            FooterCheck::Agrees => report.footers_checked += 1,
            FooterCheck::Missing => report.problems.push(format!(
                "pack {pack}: named by the index, missing from the store"
            )),
            FooterCheck::Damaged(why) => report.problems.push(format!("pack {pack}: {why}")),
            FooterCheck::IndexWrong(why) => {
                report.footers_checked += 1;
                sound = false;
                report
                    .problems
                    .push(format!("index: pack {pack}: {why} (the pack is sound)"));
            }
        }
    }
    Ok(sound)
}

/// What one pack's footer says of the index.
enum FooterCheck {
    Agrees,
    Missing,
    Damaged(String),
    IndexWrong(String),
}

async fn check_pack_footer(
    repo: &Repo,
    index: &Index,
    pack: PackId,
    real: Option<u64>,
    entries: &[PackEntry],
) -> FooterCheck {
    let Some(real) = real else {
        return FooterCheck::Missing;
    };
    let footer = match repo.read_pack_footer(&pack, real).await {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return FooterCheck::Missing,
        Err(e) => return FooterCheck::Damaged(e.to_string()),
    };
    let claimed = index.pack_size(&pack).unwrap_or(0);
    if claimed != real {
        return FooterCheck::IndexWrong(format!(
            "the index says {claimed} bytes, the store holds {real}"
        ));
    }
    let own: HashMap<ChunkId, PackEntry> = footer.into_iter().map(|e| (e.id, e)).collect();
    let wrong: Vec<&PackEntry> = entries
        .iter()
        .filter(|e| own.get(&e.id) != Some(*e))
        .collect();
    match wrong.first() {
        None => FooterCheck::Agrees,
        Some(e) => FooterCheck::IndexWrong(format!(
            "{} index entries differ from the pack's footer (first: chunk {}: the index \
             says offset {} stored {} raw {} flags {:#04x}, {})",
            wrong.len(),
            e.id.short(),
            e.offset,
            e.stored_len,
            e.raw_len,
            e.flags,
            match own.get(&e.id) {
                Some(f) => format!(
                    "the footer offset {} stored {} raw {} flags {:#04x}",
                    f.offset, f.stored_len, f.raw_len, f.flags
                ),
                None => "the footer does not list it".into(),
            }
        )),
    }
}

/// Re-hashes `packs` as the store holds them, two at a time.
async fn check_store_packs(
    repo: &Repo,
    index: &Index,
    packs: &HashSet<PackId>,
    report: &mut VerifyReport,
    progress: &dyn Progress,
) {
    progress.phase(
        "verify store",
        Some(
            packs
                .iter()
                .map(|p| index.pack_size(p).unwrap_or(0))
                .fold(0, u64::saturating_add),
        ),
        Some(packs.len() as u64),
    );
    let results: Vec<(PackId, Result<u64>)> = futures::stream::iter(packs.iter().copied())
        .map(|p| {
            let repo = repo.clone();
            async move {
                let r = match (repo.remote())
                    .get_at_most(&pack_key(&p), crate::pack::MAX_PACK_BYTES)
                    .await
                {
                    Ok(bytes) => {
                        let n = bytes.len() as u64;
                        // The footer against the pack id, then every chunk against its own.
                        let r =
                            crate::fsutil::blocking(move || verify_pack_bytes(&bytes, &p)).await;
                        (r, n)
                    }
                    Err(e) => (Err(e), 0),
                };
                (p, r)
            }
        })
        .buffer_unordered(2)
        .map(|(p, (r, n))| {
            progress.advance(n, 1);
            (p, r)
        })
        .collect()
        .await;
    for (p, r) in results {
        report.packs_checked += 1;
        match r {
            Ok(n) => report.chunks_checked += n,
            Err(e) => report.problems.push(format!("pack {p}: {e}")),
        }
    }
}

/// Re-hashes `packs` in the node cache, removing corrupt ones.
async fn check_cache_packs(
    cache: &NodeCache,
    packs: HashSet<PackId>,
    report: &mut VerifyReport,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    let cache = cache.clone();
    let (n, c, bad) =
        crate::fsutil::blocking(move || cache.verify(Some(&packs), progress.as_ref())).await?;
    report.packs_checked = n;
    report.chunks_checked = c;
    report.repaired_cache_packs = bad.len() as u64;
    for (p, why) in bad {
        report.problems.push(format!(
            "node cache: pack {p} was corrupt ({why}); removed, it is fetched again on next use"
        ));
    }
    Ok(())
}
