//! `labrun rerun JOB [--data NAME@vN]...`: the same command on the same
//! code and data snapshots (by id, not by a label read again), with the
//! same GPUs, GPU memory and outputs, as the job's own record at labd
//! says it ran.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use labsync_agent::proto::{SubmitRequest, TreeRef};
use labsync_agent::Client;
use labsync_store::RefSpec;

use super::explain_client;
use super::logs::follow;
use super::run::{check_size, open_repo, say_where};
use crate::Settings;

/// What `labrun rerun` was asked.
#[derive(Clone, Debug, Default)]
pub struct Rerun {
    /// The job to run again.
    pub job: String,
    /// `NAME@vN`: this version of the job's dataset NAME instead.
    pub data: Vec<String>,
    /// The tier to run at (default: the user's own).
    pub priority: Option<String>,
    /// Submit and print the new job's id, without streaming.
    pub detach: bool,
}

/// Submits job `a.job` again; follows it unless detached.
pub async fn rerun(s: &Settings, client: &Client, quiet: bool, a: Rerun) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain_client)?;
    let old = client.job(&a.job).await.map_err(explain_client)?;
    let Some(recorded) = old.meta.request.clone() else {
        bail!(
            "{} kept no record of what it ran on (an older labd ran it): run it \
             again with labrun --data ... as it was",
            a.job
        );
    };
    if recorded.hold_s.is_some() {
        bail!(
            "{} was a hold (labrun --hold), which has no command to run again",
            a.job
        );
    }
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k != "LABRUN_TOKEN")
        .collect();
    let mut req = SubmitRequest {
        argv: old.argv.clone(),
        env,
        priority: a.priority.clone(),
        // A new run: it resumes from nothing, and counts no restarts.
        restarts: 0,
        resume_from: None,
        // Never recorded (a webhook's address is a secret): yours of now.
        notify: s.notify.clone(),
        ..recorded
    };
    if req.argv.is_empty() {
        bail!("{}'s record holds no command to run again", a.job);
    }
    if !a.data.is_empty() {
        let repo = open_repo(&info, s).await?;
        for d in &a.data {
            let spec: RefSpec = d
                .parse()
                .with_context(|| format!("--data {d}: say NAME@vN, a stored version"))?;
            let Some(slot) = req
                .data
                .iter_mut()
                .find(|r| r.tree.label.split('@').next() == Some(spec.name.as_str()))
            else {
                let read: Vec<&str> = req.data.iter().map(|r| r.tree.label.as_str()).collect();
                bail!(
                    "--data {d}: {} read no dataset {}; it read {}",
                    a.job,
                    spec.name,
                    if read.is_empty() {
                        "none".to_string()
                    } else {
                        read.join(", ")
                    }
                );
            };
            let rec = repo.resolve(&spec).await.with_context(|| {
                format!(
                    "--data {d}: not in {} (see labsync log {})",
                    info.store, spec.name
                )
            })?;
            slot.tree = TreeRef {
                label: rec.label(),
                snapshot: rec.snapshot,
            };
        }
    }
    check_size(&req.argv, &req.env, req.data.len())?;
    let job = client.submit(&req).await.map_err(explain_client)?;
    if a.detach {
        println!("{}", job.id);
        return Ok(ExitCode::SUCCESS);
    }
    if !quiet {
        let code = req.code.as_ref().map_or("no code", |c| c.label.as_str());
        eprintln!("labrun: {} again as {}", a.job, job.id);
        say_where(&job, &info, code, req.gpus);
    }
    follow(client, &job.id, quiet, true).await
}
