//! `labrun kill JOB`: SIGTERM to all its processes, SIGKILL after a grace period.

use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::Client;

use super::explain_client;
use super::job_words::state_words;

/// Kills job `id` and says its state (as JSON with `json`, nothing with `quiet`).
pub async fn kill(client: &Client, json: bool, quiet: bool, id: &str) -> Result<ExitCode> {
    let j = client.kill(id).await.map_err(explain_client)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else if !quiet {
        println!("{}: {}", j.id, crate::shown(&state_words(&j)));
    }
    Ok(ExitCode::SUCCESS)
}
