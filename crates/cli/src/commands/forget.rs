//! `labsync forget SPEC...`: versions no longer listed; gc may free their data.

use std::process::ExitCode;

use anyhow::Result;
use labsync_store::RefSpec;
use serde_json::json;

use super::StoreContext;

/// Forgets each of `specs` (`div2k@v1`), in order.
pub async fn forget(ctx: &StoreContext, specs: &[String]) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let specs: Vec<RefSpec> = specs.iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
    let mut done = Vec::new();
    for spec in &specs {
        done.push(repo.forget(spec).await?.label());
    }
    ctx.printer.out(
        || {
            format!(
                "forgot {} (run `labsync gc` to free their data)",
                done.join(", ")
            )
        },
        json!({"command": "forget", "forgotten": done}),
    );
    Ok(ExitCode::SUCCESS)
}
