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
        s += &line(r);
        s.push('\n');
    }
    s.trim_end().to_string()
}

/// One version: its files and size, the paths (files and folders) added,
/// changed and removed since the one before, and the bytes the push wrote
/// to the store (packs and tree objects, compressed: more than the size
/// for a small tree, less for one mostly stored before).
fn line(r: &VersionRecord) -> String {
    format!(
        "v{:<4} {}  {}  {}@{}  {} {}, {}  paths +{} ~{} -{}  {} written to the store",
        r.version,
        r.snapshot.short(),
        human_time(r.time),
        r.user,
        r.host,
        r.files,
        if r.files == 1 { "file" } else { "files" },
        human_bytes(r.bytes),
        r.added,
        r.modified,
        r.removed,
        human_bytes(r.new_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43: `labsync log` said "1 files", counted folders as added
    /// files ("10 files … +12") and showed "new" bytes past the size
    /// without saying what they were.
    #[test]
    fn a_version_line_says_files_paths_and_what_was_written() {
        let r = VersionRecord {
            name: "ds".into(),
            version: 1,
            snapshot: labsync_store::SnapshotId::from_bytes([0xab; 32]),
            time: 0,
            user: "alice".into(),
            host: "gpu1".into(),
            files: 1,
            bytes: 3,
            stored_bytes: 900,
            new_bytes: 900,
            added: 2,
            removed: 0,
            modified: 0,
            forgotten: false,
        };
        assert_eq!(
            line(&r),
            format!(
                "v1    abababababab  {}  alice@gpu1  1 file, 3 B  paths +2 ~0 -0  \
                 900 B written to the store",
                human_time(0)
            )
        );
        let r = VersionRecord { files: 10, ..r };
        assert!(line(&r).contains("  10 files, 3 B  "), "{}", line(&r));
    }
}
