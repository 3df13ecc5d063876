//! `labsync rebuild-index`: the index again, from the pack footers.

use std::process::ExitCode;

use anyhow::Result;
use serde_json::json;

use super::StoreContext;

/// Rebuilds the store's index after a lost or corrupt one.
pub async fn rebuild_index(ctx: &StoreContext) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let (packs, chunks) = repo.rebuild_index().await?;
    ctx.printer.out(
        || format!("index rebuilt from {packs} pack footers: {chunks} chunks"),
        json!({"command": "rebuild-index", "packs": packs, "chunks": chunks}),
    );
    Ok(ExitCode::SUCCESS)
}
