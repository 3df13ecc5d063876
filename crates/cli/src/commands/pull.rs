//! `labsync pull SPEC [DEST]`: write a stored version into a folder.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use labsync_store::{self as store, PullOptions, PullOutcome, RefSpec};
use serde_json::json;

use super::StoreContext;
use crate::human_bytes;

/// Pulls `spec` into `dest` (default: `./NAME`) with `threads` writers
/// (default: one per CPU, at least 4: large chunks are read straight from
/// disk, and more reads in flight keep it busy).
pub async fn pull(
    ctx: &StoreContext,
    spec: &str,
    dest: Option<PathBuf>,
    threads: Option<usize>,
    delete: bool,
) -> Result<ExitCode> {
    let spec: RefSpec = spec.parse()?;
    let dest =
        dest.unwrap_or_else(|| PathBuf::from(spec.name.rsplit('/').next().unwrap_or(&spec.name)));
    let repo = ctx.repo().await?;
    let cache = ctx.cache()?;
    let opts = PullOptions {
        threads: super::threads(threads).max(if threads.is_some() { 1 } else { 4 }),
        delete,
        shared: false,
        expect: None,
    };
    let progress = ctx.printer.progress();
    let r = store::Pull::new(&repo, &cache, &spec, &dest)
        .options(opts)
        .progress(progress)
        .run()
        .await?;
    ctx.printer.out(
        || text(&r, &dest),
        json!({"command": "pull", "dest": dest, "result": r}),
    );
    Ok(ExitCode::SUCCESS)
}

fn text(r: &PullOutcome, dest: &Path) -> String {
    let entries = |n: u64| format!("{n} {}", if n == 1 { "entry" } else { "entries" });
    let extra = match (r.extra, r.deleted) {
        (0, _) => String::new(),
        (n, 0) => format!(
            "; {} in {} not in the version (--delete removes them)",
            entries(n),
            dest.display()
        ),
        (_, d) => format!("; {} not in the version removed", entries(d)),
    };
    format!(
        "{} -> {}: {} files written ({}), {} already there, {} fetched, {:.1} s{extra}",
        r.record.label(),
        dest.display(),
        r.files_written,
        human_bytes(r.bytes_written),
        r.files_skipped,
        human_bytes(r.bytes_fetched),
        r.seconds
    )
}
