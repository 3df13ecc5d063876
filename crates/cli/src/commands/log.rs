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
        for l in r.provenance.iter().flat_map(made_by) {
            s += "      ";
            s += &l;
            s.push('\n');
        }
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

/// A job's outputs' version: the job, its command, where it ran, its code
/// and data by snapshot, its times and how it ended. Every value is the
/// pusher's (anyone who can write the store could write one): shown
/// through `shown`, so no control character reaches the terminal.
fn made_by(p: &labsync_store::Provenance) -> Vec<String> {
    let tree = |(label, id): &(String, labsync_store::SnapshotId)| {
        format!("{} ({})", crate::shown(label), id.short())
    };
    let mut out = vec![format!(
        "made by job {} on {}, GPU(s) {}{}: {}",
        crate::shown(&p.job),
        crate::shown(&p.node),
        if p.gpus.is_empty() {
            "none".to_string()
        } else {
            p.gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        },
        p.tier
            .as_deref()
            .map_or(String::new(), |t| format!(", tier {}", crate::shown(t))),
        crate::shown(&p.command.join(" ")),
    )];
    let mut inputs = Vec::new();
    if let Some(c) = &p.code {
        inputs.push(format!("code {}", tree(c)));
    }
    for d in &p.data {
        inputs.push(format!("data {}", tree(d)));
    }
    if !inputs.is_empty() {
        out.push(inputs.join(", "));
    }
    let mut times = Vec::new();
    if let Some(t) = p.started {
        times.push(format!("started {}", human_time(t as i64)));
    }
    match (p.ended, &p.exit) {
        (Some(t), Some(e)) => times.push(format!(
            "ended {} ({})",
            human_time(t as i64),
            crate::shown(e)
        )),
        (Some(t), None) => times.push(format!("ended {}", human_time(t as i64))),
        (None, _) => times.push("saved while it ran".into()),
    }
    out.push(times.join(", "));
    out
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
            provenance: None,
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

    /// Issue 44: a job's outputs say what made them; what a pusher wrote
    /// there reaches the terminal as text.
    #[test]
    fn an_outputs_version_says_what_made_it() {
        let id = labsync_store::SnapshotId::from_bytes([0xcd; 32]);
        let p = labsync_store::Provenance {
            job: "j7".into(),
            command: vec!["python".into(), "train.py\x1b[2J".into()],
            code: Some(("code/alice/sr@v3".into(), id)),
            data: vec![("div2k@v1".into(), id)],
            node: "gpu2".into(),
            gpus: vec![0, 1],
            tier: Some("phd".into()),
            started: Some(0),
            ended: Some(60),
            exit: Some("exit 0".into()),
        };
        let l = made_by(&p);
        assert_eq!(
            l[0],
            "made by job j7 on gpu2, GPU(s) 0,1, tier phd: python train.py\\u{1b}[2J"
        );
        assert_eq!(
            l[1],
            "code code/alice/sr@v3 (cdcdcdcdcdcd), data div2k@v1 (cdcdcdcdcdcd)"
        );
        assert!(
            l[2].ends_with("(exit 0)") && l[2].starts_with("started "),
            "{}",
            l[2]
        );
    }
}
