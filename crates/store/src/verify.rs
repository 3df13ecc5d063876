//! `verify`: every chunk it can reach, checked against its BLAKE3 id.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use serde::Serialize;

use crate::cache::{verify_pack_bytes, NodeCache};
use crate::error::Result;
use crate::id::{ChunkId, PackId};
use crate::index::Index;
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
    let versions = versions_of(repo, name).await?;
    let (index, _) = repo.load_index().await?;
    let chunks = check_trees(repo, &index, &versions, &mut report, progress.as_ref()).await;
    report.chunks = chunks.len() as u64;
    let packs: HashSet<PackId> = chunks
        .iter()
        .filter_map(|c| index.get(c).map(|(p, _)| p))
        .collect();
    if remote {
        check_store_packs(repo, &index, &packs, &mut report, progress.as_ref()).await;
    } else {
        check_cache_packs(cache, packs, &mut report, progress).await?;
    }
    Ok(report)
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
        Some(packs.iter().map(|p| index.pack_size(p).unwrap_or(0)).sum()),
        Some(packs.len() as u64),
    );
    let results: Vec<(PackId, Result<u64>)> = futures::stream::iter(packs.iter().copied())
        .map(|p| {
            let repo = repo.clone();
            async move {
                let r = match repo.remote().get(&pack_key(&p)).await {
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
