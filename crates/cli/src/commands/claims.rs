//! `labsync claims`: the claims writers hold on keys that must not exist
//! yet (versions, the config) on a server that does not honour conditional
//! writes, and an admin's way past one renewed for ever.

use std::process::ExitCode;

use anyhow::Result;
use serde_json::json;

use super::StoreContext;

/// Lists the store's claims, or removes those `remove` names (claim keys,
/// or keys whose claims all go).
pub async fn claims(ctx: &StoreContext, remove: &[String]) -> Result<ExitCode> {
    let repo = ctx.repo().await?;
    let remote = repo.remote();
    if !remove.is_empty() {
        let mut removed = Vec::new();
        for target in remove {
            removed.extend(remote.remove_claims(target).await?);
        }
        ctx.printer.out(
            || match removed.len() {
                0 => "no claim was held on those keys".to_string(),
                n => format!("removed {n} claims: {}", removed.join(", ")),
            },
            json!({"command": "claims", "removed": removed}),
        );
        return Ok(ExitCode::SUCCESS);
    }
    let (all, more) = remote.claims().await?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    ctx.printer.out(
        || {
            if all.is_empty() {
                return "no claims are held".to_string();
            }
            let mut lines: Vec<String> = all
                .iter()
                .map(|c| {
                    let age = (now - c.modified).max(0);
                    format!("{}  on {}  by {}  ({age} s old)", c.claim, c.key, c.who)
                })
                .collect();
            if more > 0 {
                lines.push(format!("… and {more} more"));
            }
            lines.push(
                "A claim lives for the few seconds of one write; one much older than 120 s is \
                 left by a crashed writer (the next writer removes it), and one that stays \
                 young for minutes is renewed by someone: `labsync claims --remove KEY`"
                    .into(),
            );
            lines.join("\n")
        },
        json!({"command": "claims", "claims": all, "more": more}),
    );
    Ok(ExitCode::SUCCESS)
}
