//! `labrun ps [--all]`: jobs, their GPUs and state, why they wait.

use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::proto::JobView;
use labsync_agent::Client;

use super::explain_client;
use super::job_words::{runtime, state_words};

/// The jobs' table: in a cluster a NODE column, filled for every job that
/// was placed (ended ones too: issue 43 found them shown with no node).
fn table(jobs: &[JobView]) -> Vec<String> {
    let cluster = jobs.iter().any(|j| j.node.is_some());
    let node = |n: &str| {
        if cluster {
            format!("{n:<8} ")
        } else {
            String::new()
        }
    };
    let mut lines = vec![format!(
        "{:<6} {:<10} {}{:<8} {:<18} {:<30} COMMAND",
        "ID",
        "USER",
        node("NODE"),
        "GPUS",
        "RUNTIME",
        "STATE"
    )];
    for j in jobs {
        let gpus = if j.gpus.is_empty() {
            j.gpus_wanted.to_string()
        } else {
            j.gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        lines.push(format!(
            "{:<6} {:<10} {}{:<8} {:<18} {:<30} {}",
            j.id,
            j.user,
            node(j.node.as_deref().unwrap_or("-")),
            gpus,
            runtime(j),
            crate::shown(&state_words(j)),
            // Other users' commands: text, never bytes a terminal acts on.
            crate::shown(&j.argv.join(" "))
        ));
    }
    lines
}

/// Lists your jobs (`all`: everyone's): live ones, and those that ended in the last day.
pub async fn ps(client: &Client, json: bool, all: bool) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain_client)?;
    let me = info.user.clone();
    let jobs: Vec<JobView> = client
        .jobs()
        .await
        .map_err(explain_client)?
        .into_iter()
        .filter(|j| all || j.user == me)
        // Live jobs, and those that ended in the last day.
        .filter(|j| {
            !j.ended()
                || j.ended_at
                    .is_some_and(|t| labsync_agent::unix_now() < t + 86_400)
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(ExitCode::SUCCESS);
    }
    for line in table(&jobs) {
        println!("{line}");
    }
    // What the disk holds for this user here (their share of it).
    if let Some((held, share)) = info.trees_held {
        if held > 0 || share.is_some() {
            let share = share.map_or_else(
                || "no share set".into(),
                |s| format!("your share is {} (trees_per_user)", crate::human_bytes(s)),
            );
            println!(
                "code and data your jobs hold on {}: {}; {share}",
                info.node,
                crate::human_bytes(held)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
