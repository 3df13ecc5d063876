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
        provenance: None,
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

/// The user a version is recorded as pushed by: the account of this
/// process's user, as git takes it (cron, systemd and `sudo -u` leave
/// `$USER` unset or stale: such versions read `unknown@host`); `$USER` or
/// `$LOGNAME` only where the uid has no account, else `uid N`.
fn user_name() -> String {
    let uid = labsync_agent::euid();
    pusher(
        labsync_agent::user_by_uid(uid).map(|u| u.name),
        std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .ok(),
        uid,
    )
}

/// [`user_name`]'s rule, given the account's name and the environment's.
fn pusher(account: Option<String>, env: Option<String>, uid: u32) -> String {
    account
        .or(env.filter(|n| !n.is_empty()))
        .unwrap_or_else(|| format!("uid {uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43: a push from cron or systemd (no `$USER`) was recorded as
    /// `unknown@host`; the account of the uid names it, as in git.
    #[test]
    fn a_version_is_recorded_as_the_accounts_user_not_the_environments() {
        // Whatever `$USER` says here (the environment is left alone: other
        // tests read it), this process's account names the pusher.
        assert_eq!(user_name(), labsync_agent::current_user());
        assert_eq!(
            pusher(Some("alice".into()), Some("mallory".into()), 1000),
            "alice"
        );
        assert_eq!(pusher(None, Some("bob".into()), 1001), "bob");
        assert_eq!(pusher(None, Some(String::new()), 1002), "uid 1002");
        assert_eq!(pusher(None, None, 1003), "uid 1003");
    }
}
