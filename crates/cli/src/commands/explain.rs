//! `labrun explain JOB`: why a job waits, in one line, and in a cluster
//! every node's row for it.

use std::process::ExitCode;

use anyhow::Result;
use labsync_agent::Client;

use super::explain_client as client_error;
use super::job_words::state_words;
use super::run::ranking_table;

/// Prints job `id`'s state (why it waits) and, while it is queued in a
/// cluster, where it could start and why not elsewhere.
pub async fn explain(client: &Client, json: bool, id: &str) -> Result<ExitCode> {
    let e = client.explain_job(id).await.map_err(client_error)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&e)?);
        return Ok(ExitCode::SUCCESS);
    }
    let j = &e.job;
    println!("{} ({}): {}", j.id, j.user, crate::shown(&state_words(j)));
    if let Some(r) = &e.ranking {
        print!("{}", ranking_table(r, j.gpus_wanted));
    }
    Ok(ExitCode::SUCCESS)
}
