//! `labsync push SRC`: store a folder (or file) as a new version of a name.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use labsync_store::{self as store, PushOptions, PushOutcome};
use serde_json::json;

use super::StoreContext;
use crate::human_bytes;
use crate::local::hostname;

/// Pushes `src` as `name` (default: the folder's name) with `threads` readers.
pub async fn push(
    ctx: &StoreContext,
    src: &Path,
    name: Option<String>,
    threads: Option<usize>,
) -> Result<ExitCode> {
    let name = match name {
        Some(n) => n,
        None => src
            .canonicalize()
            .with_context(|| format!("cannot open {}", src.display()))?
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
            .context("cannot derive a name from the path; pass --name")?,
    };
    let cache = ctx.cache()?;
    // Index objects never change once written: those read before are read
    // from the cache (checked against their names), not the store.
    let repo = ctx.repo().await?;
    let dir = cache.index_dir(&repo.config().id);
    let repo = repo.with_index_cache(Some(dir));
    let opts = PushOptions {
        name,
        files_cache: Some(cache.files_cache_dir()),
        threads: super::threads(threads),
        user: user_name(),
        host: hostname(),
        read_as: None,
        settle: None,
        compression: ctx.settings.compression,
    };
    let r = store::push(&repo, src, &opts, ctx.printer.progress()).await?;
    ctx.printer
        .out(|| text(&r), json!({"command": "push", "result": r}));
    Ok(ExitCode::SUCCESS)
}

/// `div2k@v2  1a2b3c4d  1.02 GB, 3.10 MB new, 0.8 s`.
fn text(r: &PushOutcome) -> String {
    format!(
        "{}  {}  {}, {} new, {:.1} s{}",
        r.record.label(),
        r.record.snapshot.short(),
        human_bytes(r.record.bytes),
        human_bytes(if r.created { r.record.new_bytes } else { 0 }),
        r.seconds,
        if r.created {
            ""
        } else {
            "  (unchanged: no new version)"
        }
    )
}

/// The user a version is recorded as pushed by.
fn user_name() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into())
}
