//! `labrun logs [-f] JOB`, and the streaming that `labrun` itself does.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use labsync_agent::{Client, ClientError, JobState};

use super::explain_client;
use super::job_words::state_words;

/// Streams a job's log until it ends; returns its exit code.
pub(super) async fn follow(
    client: &Client,
    id: &str,
    quiet: bool,
    interactive: bool,
) -> Result<ExitCode> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut offset = 0;
    let mut last_why: Option<String> = None;
    let mut checked = Instant::now();
    let mut first_ctrl_c: Option<Instant> = None;
    let mut out = std::io::stdout();
    loop {
        tokio::select! {
            piece = client.log(id, offset, Duration::from_secs(1)) => {
                let piece = piece.map_err(explain_client)?;
                out.write_all(&piece.bytes)?;
                out.flush()?;
                offset = piece.next;
                if piece.done {
                    break;
                }
                if piece.bytes.is_empty() && checked.elapsed() > Duration::from_millis(900) {
                    checked = Instant::now();
                    let j = client.job(id).await.map_err(explain_client)?;
                    if j.why != last_why && !quiet {
                        if let Some(w) = &j.why {
                            eprintln!("labrun: {id} {w}");
                        }
                    }
                    last_why = j.why;
                }
            }
            _ = sigint.recv() => {
                if !interactive {
                    return Ok(ExitCode::from(130));
                }
                match first_ctrl_c {
                    Some(t) if t.elapsed() < Duration::from_secs(1) => {
                        eprintln!("labrun: killing {id}");
                        match client.kill(id).await {
                            Ok(_) | Err(ClientError::Status { status: 409, .. }) => {}
                            Err(e) => return Err(explain_client(e)),
                        }
                    }
                    _ => {
                        first_ctrl_c = Some(Instant::now());
                        let j = client.job(id).await.map_err(explain_client)?;
                        eprintln!(
                            "labrun: {id} is {}; Ctrl-C again within 1 s kills it. \
                             Otherwise it keeps running (`labrun logs -f {id}` reattaches).",
                            state_words(&j)
                        );
                    }
                }
            }
        }
    }
    let j = client.job(id).await.map_err(explain_client)?;
    if !quiet {
        if let Some(saved) = &j.meta.outputs_saved {
            eprintln!("labrun: outputs saved as {saved} (labsync pull {saved} DEST)");
        }
        if let Some(e) = &j.meta.outputs_error {
            if j.meta.outputs_pending {
                eprintln!(
                    "labrun: outputs not saved yet: {e}; labd keeps retrying and keeps \
                     {id}'s folder until they are (`labrun ps` shows it)"
                );
            } else {
                eprintln!("labrun: outputs: {e}");
            }
        }
        if let JobState::Failed { reason } = &j.state {
            eprintln!("labrun: {id} failed: {reason}");
        }
    }
    let code = j.exit_code().unwrap_or(1);
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// Prints job `id`'s log so far, or with `follow_on` until the job ends.
pub async fn logs(client: &Client, id: &str, follow_on: bool) -> Result<ExitCode> {
    if follow_on {
        follow(client, id, true, false).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut offset = 0;
    let mut out = std::io::stdout();
    loop {
        let p = client
            .log(id, offset, Duration::ZERO)
            .await
            .map_err(explain_client)?;
        out.write_all(&p.bytes)?;
        offset = p.next;
        if p.bytes.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
    }
}
