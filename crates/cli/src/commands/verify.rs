//! `labsync verify [NAME] [--remote]`: every reachable chunk against its id.

use std::process::ExitCode;

use anyhow::Result;
use labsync_store::{self as store, RefSpec, VerifyReport};
use serde_json::json;

use super::StoreContext;

/// Verifies `name`'s versions (all when `None`), re-hashing the node cache's
/// copies, or the store's with `remote`. Exits 1 when anything is wrong.
pub async fn verify(ctx: &StoreContext, name: Option<&str>, remote: bool) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let cache = ctx.cache()?;
    let spec = name.map(|n| n.parse::<RefSpec>()).transpose()?;
    let progress = ctx.printer.progress();
    let r = store::verify(&repo, &cache, spec.as_ref(), remote, progress).await?;
    let ok = r.problems.is_empty();
    ctx.printer.out(
        || text(&r, remote),
        json!({"command": "verify", "ok": ok, "report": r}),
    );
    Ok(super::exit(ok))
}

fn text(r: &VerifyReport, remote: bool) -> String {
    let mut s = String::new();
    for p in &r.problems {
        s += &format!("PROBLEM {p}\n");
    }
    for w in &r.warnings {
        s += &format!("WARNING {w}\n");
    }
    if let Some(repair) = &r.repair {
        s += &format!("REPAIR {repair}\n");
    }
    // Warnings do not fail the command (everything recorded restores),
    // but a store with them is not called clean.
    let verdict = match (r.problems.is_empty(), r.warnings.is_empty()) {
        (false, _) => "FAILED",
        (true, false) => "WARNINGS",
        (true, true) => "ok",
    };
    let rehashed = if remote {
        "from the store"
    } else {
        "node cache"
    };
    s + &format!(
        "{verdict}: {} versions, {} chunks referenced; {} pack footers checked against the \
         index; {} packs and {} chunks re-hashed ({rehashed}); {} problems, {} warnings",
        r.versions,
        r.chunks,
        r.footers_checked,
        r.packs_checked,
        r.chunks_checked,
        r.problems.len(),
        r.warnings.len()
    )
}
