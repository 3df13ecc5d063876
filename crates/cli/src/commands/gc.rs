//! `labsync gc`: remove data no version references.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use labsync_store::{self as store, GcOutcome};
use serde_json::json;

use super::StoreContext;
use crate::human_bytes;

/// Runs gc; `grace` (`6h`, `30m`, `0`) overrides the store's grace period.
pub async fn gc(ctx: &StoreContext, dry_run: bool, grace: Option<&str>) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let grace = grace.map(parse_grace).transpose()?;
    let r = store::gc(&repo, dry_run, grace, ctx.printer.progress().as_ref()).await?;
    ctx.printer
        .out(|| text(&r), json!({"command": "gc", "result": r}));
    Ok(ExitCode::SUCCESS)
}

fn text(r: &GcOutcome) -> String {
    format!(
        "{}{} versions, {} packs ({} referenced, {} young kept); {} condemned now; {} deleted ({}); {} snapshot objects and {} unfinished writes ({}) deleted",
        if r.dry_run { "dry run: " } else { "" },
        r.versions,
        r.packs,
        r.referenced_packs,
        r.young_packs,
        r.condemned.len(),
        r.deleted.len(),
        human_bytes(r.deleted_bytes),
        r.deleted_snapshots,
        r.deleted_staging,
        human_bytes(r.deleted_staging_bytes)
    )
}

/// `6h`, `30m`, `90s`, `2d` or `0` → seconds.
fn parse_grace(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .with_context(|| format!("invalid duration {s:?}: write e.g. 6h, 30m, 90s or 0"))?;
    Ok(n * match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => bail!("invalid duration {s:?}: unit must be s, m, h or d"),
    })
}
