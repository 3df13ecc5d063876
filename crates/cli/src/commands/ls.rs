//! `labsync ls`: the stored names, each with its latest version.

use std::process::ExitCode;

use anyhow::Result;
use labsync_store::VersionRecord;
use serde_json::json;

use super::StoreContext;
use crate::{human_bytes, human_time};

/// Lists every name's latest version.
pub async fn ls(ctx: &StoreContext) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let mut rows = Vec::new();
    for n in repo.names().await? {
        if let Some(l) = repo.latest(&n).await? {
            rows.push(l);
        }
    }
    let url = repo.remote().url();
    ctx.printer
        .out(|| text(&rows, url), json!({"command": "ls", "names": rows}));
    Ok(ExitCode::SUCCESS)
}

fn text(rows: &[VersionRecord], url: &str) -> String {
    if rows.is_empty() {
        return format!("nothing stored yet in {url} (try `labsync push DIR`)");
    }
    let mut s = format!(
        "{:<24} {:>7} {:>11} {:>11}  {}\n",
        "NAME", "LATEST", "SIZE", "STORED", "PUSHED"
    );
    for r in rows {
        s += &format!(
            "{:<24} {:>7} {:>11} {:>11}  {} by {}@{}\n",
            r.name,
            format!("v{}", r.version),
            human_bytes(r.bytes),
            human_bytes(r.stored_bytes),
            human_time(r.time),
            r.user,
            r.host
        );
    }
    s.trim_end().to_string()
}
