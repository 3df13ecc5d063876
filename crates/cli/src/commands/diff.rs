//! `labsync diff A B`: paths added, removed and modified between two versions.

use std::process::ExitCode;

use anyhow::Result;
use labsync_store::{self as store, Changes};
use serde_json::json;

use super::StoreContext;

/// Compares the trees of versions `a` and `b`.
pub async fn diff(ctx: &StoreContext, a: &str, b: &str) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let (ra, rb) = (
        repo.resolve(&a.parse()?).await?,
        repo.resolve(&b.parse()?).await?,
    );
    let (index, _) = repo.load_index().await?;
    let (_, ea) = repo.load_tree(&index, &ra.snapshot).await?;
    let (_, eb) = repo.load_tree(&index, &rb.snapshot).await?;
    let d = store::diff(&ea, &eb);
    let (la, lb) = (ra.label(), rb.label());
    ctx.printer.out(
        || text(&d, &la, &lb),
        json!({"command": "diff", "a": la, "b": lb, "changes": d}),
    );
    Ok(ExitCode::SUCCESS)
}

fn text(d: &Changes, a: &str, b: &str) -> String {
    let mut s = String::new();
    for p in &d.added {
        s += &format!("A {p}\n");
    }
    for p in &d.removed {
        s += &format!("D {p}\n");
    }
    for p in &d.modified {
        s += &format!("M {p}\n");
    }
    s + &format!(
        "{a} -> {b}: {} added, {} removed, {} modified",
        d.added.len(),
        d.removed.len(),
        d.modified.len()
    )
}
