//! `labsync log NAME`: a name's versions and what changed in each.

use std::process::ExitCode;

use anyhow::Result;
use labsync_store::{RefSpec, VersionRecord};
use serde_json::json;

use super::StoreContext;
use crate::{human_bytes, human_time};

/// Lists the versions of `name`, newest first.
pub async fn log(ctx: &StoreContext, name: &str) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let spec: RefSpec = name.parse()?;
    let versions = repo.versions(&spec.name).await?;
    if versions.is_empty() {
        repo.resolve(&spec).await?; // the NotFound error with its hint
    }
    ctx.printer.out(
        || text(&versions),
        json!({"command": "log", "versions": versions}),
    );
    Ok(ExitCode::SUCCESS)
}

fn text(versions: &[VersionRecord]) -> String {
    let mut s = String::new();
    for r in versions.iter().rev() {
        s += &format!(
            "v{:<4} {}  {}  {}@{}  {} files, {}, {} new  +{} ~{} -{}\n",
            r.version,
            r.snapshot.short(),
            human_time(r.time),
            r.user,
            r.host,
            r.files,
            human_bytes(r.bytes),
            human_bytes(r.new_bytes),
            r.added,
            r.modified,
            r.removed
        );
    }
    s.trim_end().to_string()
}
