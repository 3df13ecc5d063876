//! `labsync cache status|pin|unpin|evict`: this node's cache.

use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::proto::FetchCounts;
use labsync_store::{self as store, CacheStatus};
use serde_json::json;

use super::StoreContext;
use crate::{human_bytes, human_time, parse_size};

/// Size, cap and the cached versions, and (where labd fills this cache in
/// a cluster) where the fetched packs came from.
pub async fn status(ctx: &StoreContext) -> Result<ExitCode> {
    let mut s = ctx.cache()?.status()?;
    // labd's cache: its cap is labd's cache_max, not this command's.
    let labd_cap = std::fs::read(s.root.join(labsync_agent::CACHE_CAP_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["cache_max"].as_u64());
    if let Some(cap) = labd_cap {
        s.max_bytes = cap;
    }
    let trees = labsync_agent::trees::materialised_trees(&s.root);
    let fetched: Option<FetchCounts> =
        std::fs::read(s.root.join(labsync_agent::cluster::COUNTS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
    ctx.printer.out(
        || {
            let mut t = status_text(&s, labd_cap.is_some());
            t += &trees_line(&trees);
            if let Some(f) = &fetched {
                t += &format!(
                    "\nfetched by labd: {} from peers, {} from the store; {} corrupt copies \
                     from peers refused, {} tries at peers failed\n\
                     served to peers: {} ({} by sendfile); {} copies served reported corrupt \
                     by peers ({} corrupt here too, dropped)",
                    human_bytes(f.from_peers),
                    human_bytes(f.from_store),
                    f.corrupt_from_peers,
                    f.failed_from_peers,
                    human_bytes(f.served_to_peers),
                    human_bytes(f.served_by_sendfile),
                    f.reported_corrupt,
                    f.dropped_corrupt
                );
            }
            t
        },
        json!({
            "command": "cache status",
            "status": s,
            "fetched": fetched,
            "trees": trees.iter().map(|(id, b)| json!({"snapshot": id, "bytes": b})).collect::<Vec<_>>(),
        }),
    );
    Ok(ExitCode::SUCCESS)
}

fn status_text(s: &CacheStatus, labds: bool) -> String {
    let mut t = format!(
        "{}: {} of {} used{}\n",
        s.root.display(),
        human_bytes(s.used_bytes),
        human_bytes(s.max_bytes),
        if labds { " (labd's cache_max)" } else { "" }
    );
    for (id, c, bytes) in &s.snapshots {
        t += &format!(
            "  {:<24} {}  {:>10}  last used {}{}\n",
            c.label,
            id.short(),
            human_bytes(*bytes),
            human_time(c.last_used),
            if c.pinned { "  pinned" } else { "" }
        );
    }
    t.trim_end().to_string()
}

/// The trees labd materialised from this cache, said beside its packs: a
/// cache with no pack left may still hold a dataset's whole tree (issue 43:
/// `evict --to 0` said `0 B used` while trees held 573 MB).
fn trees_line(trees: &[(labsync_store::SnapshotId, u64)]) -> String {
    if trees.is_empty() {
        return String::new();
    }
    let bytes: u64 = trees.iter().map(|t| t.1).sum();
    format!(
        "\nmaterialised trees (labd's, for jobs): {} of {} version(s); labd removes unused \
         ones past trees_max, and a job on one starts without a fetch",
        human_bytes(bytes),
        trees.len()
    )
}

/// Fetches `name` into the cache and never evicts it.
pub async fn pin(ctx: &StoreContext, name: &str) -> Result<ExitCode> {
    let cache = ctx.cache()?;
    let repo = ctx.repo().await?;
    let (rec, n, bytes) =
        store::warm(&repo, &cache, &name.parse()?, ctx.printer.progress()).await?;
    cache.set_pinned(rec.snapshot, true)?;
    ctx.printer.out(
        || format!("pinned {} ({} packs fetched, {})", rec.label(), n, human_bytes(bytes)),
        json!({"command": "cache pin", "version": rec.label(), "packs_fetched": n, "bytes_fetched": bytes}),
    );
    Ok(ExitCode::SUCCESS)
}

/// Lets a pinned version be evicted again.
pub async fn unpin(ctx: &StoreContext, name: &str) -> Result<ExitCode> {
    let cache = ctx.cache()?;
    let repo = ctx.repo().await?;
    let rec = repo.resolve(&name.parse()?).await?;
    cache.set_pinned(rec.snapshot, false)?;
    ctx.printer.out(
        || format!("unpinned {}", rec.label()),
        json!({"command": "cache unpin", "version": rec.label()}),
    );
    Ok(ExitCode::SUCCESS)
}

/// Evicts least recently used unpinned versions until at most `to` (`10G`,
/// default 0) is used.
pub async fn evict(ctx: &StoreContext, to: Option<&str>) -> Result<ExitCode> {
    let cache = ctx.cache()?;
    let target = to.map(parse_size).transpose()?.unwrap_or(0);
    let evicted = cache.evict_to(target, None)?;
    let s = cache.status()?;
    let trees = labsync_agent::trees::materialised_trees(&s.root);
    let tree_bytes: u64 = trees.iter().map(|t| t.1).sum();
    ctx.printer.out(
        || {
            let mut t = format!(
                "evicted {} versions; {} of packs used",
                evicted.len(),
                human_bytes(s.used_bytes)
            );
            if !trees.is_empty() {
                t += &format!(
                    "; materialised trees hold {} more (labd's: it removes unused ones past \
                     trees_max, not this command)",
                    human_bytes(tree_bytes)
                );
            }
            t
        },
        json!({"command": "cache evict", "evicted": evicted, "used_bytes": s.used_bytes, "tree_bytes": tree_bytes}),
    );
    Ok(ExitCode::SUCCESS)
}
