//! `labrun ps | logs | kill` under Slurm: `squeue`, the job's output file
//! (`scontrol show job`'s `StdOut`), `scancel`; and following a job until
//! it ends, with its exit code.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

use super::{job_name, slurm_id, Slurm};

/// States in which a job has not ended.
const ACTIVE: [&str; 13] = [
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESV_DEL_HOLD",
    "RESIZING",
    "STAGE_OUT",
];

/// One row of `labrun ps`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Row {
    /// `slurm-1234`.
    pub id: String,
    /// Who submitted it.
    pub user: String,
    /// Its state (`RUNNING`, `PENDING`).
    pub state: String,
    /// Run time so far.
    pub time: String,
    /// The node, or why it waits.
    pub node_or_reason: String,
    /// GRES asked for (`gres:gpu:1`).
    pub gres: String,
    /// Its name.
    pub name: String,
}

/// `squeue` fields, `|`-separated.
const FORMAT: &str = "%i|%u|%T|%M|%R|%b|%j";

fn parse_rows(out: &str) -> Vec<Row> {
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(7, '|').collect();
            (f.len() == 7).then(|| Row {
                id: job_name(f[0].trim()),
                user: f[1].into(),
                state: f[2].into(),
                time: f[3].into(),
                node_or_reason: f[4].into(),
                gres: f[5].into(),
                name: f[6].into(),
            })
        })
        .collect()
}

/// Your jobs in Slurm's queue (`all`: everyone's).
pub async fn ps(slurm: &Slurm, json: bool, all: bool) -> Result<ExitCode> {
    let mut args = vec!["-h".to_string(), "-o".into(), FORMAT.into()];
    if !all {
        args.push("--me".into());
    }
    let rows = parse_rows(&slurm.run("squeue", &args, None).await?);
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<14} {:<10} {:<12} {:<10} {:<12} {:<20} NAME",
        "ID", "USER", "GPUS", "TIME", "STATE", "NODE (REASON)"
    );
    for r in rows {
        println!(
            "{:<14} {:<10} {:<12} {:<10} {:<12} {:<20} {}",
            crate::shown(&r.id),
            crate::shown(&r.user),
            crate::shown(&r.gres),
            crate::shown(&r.time),
            crate::shown(&r.state),
            // Slurm's reason and the job's name are its submitter's text.
            crate::shown(&r.node_or_reason),
            crate::shown(&r.name)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `scancel`: Slurm sends SIGTERM to the job's processes (labrun's step
/// passes it on and saves the outputs), SIGKILL after its `KillWait`.
pub async fn kill(slurm: &Slurm, job: &str, quiet: bool) -> Result<ExitCode> {
    let id = slurm_id(job)?;
    if slurm.job(&id).await?.is_none() {
        bail!("Slurm knows no job {id} (it may have ended a while ago)");
    }
    slurm
        .run("scancel", std::slice::from_ref(&id), None)
        .await?;
    if !quiet {
        println!(
            "{}: cancelled (SIGTERM now, SIGKILL after Slurm's KillWait; its outputs are saved \
             as it stops)",
            job_name(&id)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Where job `id`'s output goes: Slurm's `StdOut`, or (once Slurm has
/// forgotten the job) the file labrun asked for.
fn output_path(id: &str, job: Option<&HashMap<String, String>>) -> Result<PathBuf> {
    match job.and_then(|j| j.get("StdOut")) {
        Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
        _ => Ok(super::submit::output_dir()?.join(format!("slurm-{id}.out"))),
    }
}

fn active(job: Option<&HashMap<String, String>>) -> bool {
    job.and_then(|j| j.get("JobState"))
        .is_some_and(|s| ACTIVE.contains(&s.as_str()))
}

/// Copies what the file holds past `offset` to stdout; the new offset.
fn copy_from(path: &std::path::Path, offset: u64) -> u64 {
    let Ok(mut f) = std::fs::File::open(path) else {
        return offset;
    };
    // A requeued job's file starts again from nothing.
    let offset = match f.metadata() {
        Ok(m) if m.len() < offset => 0,
        _ => offset,
    };
    if f.seek(SeekFrom::Start(offset)).is_err() {
        return offset;
    }
    let mut buf = Vec::new();
    if f.read_to_end(&mut buf).is_err() {
        return offset;
    }
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&buf);
    let _ = out.flush();
    offset + buf.len() as u64
}

/// `labrun logs JOB [-f]`.
pub async fn logs(slurm: &Slurm, job: &str, follow_it: bool) -> Result<ExitCode> {
    let id = slurm_id(job)?;
    let info = slurm.job(&id).await?;
    let path = output_path(&id, info.as_ref())?;
    if info.is_none() && !path.exists() {
        bail!(
            "Slurm knows no job {id}, and it left no output at {}",
            path.display()
        );
    }
    if !follow_it {
        copy_from(&path, 0);
        return Ok(ExitCode::SUCCESS);
    }
    tail(slurm, &id, &path, 0).await.map(|_| ExitCode::SUCCESS)
}

/// Prints the output as it grows until the job has ended; its record then.
async fn tail(
    slurm: &Slurm,
    id: &str,
    path: &std::path::Path,
    mut offset: u64,
) -> Result<Option<HashMap<String, String>>> {
    loop {
        offset = copy_from(path, offset);
        let info = slurm.job(id).await?;
        if !active(info.as_ref()) {
            // What it wrote as it ended.
            tokio::time::sleep(Duration::from_millis(200)).await;
            copy_from(path, offset);
            return Ok(info);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits for job `id` to start (saying why it waits), prints its output
/// until it ends; its exit code.
pub async fn follow(slurm: &Slurm, id: &str, quiet: bool) -> Result<ExitCode> {
    let mut said = String::new();
    let info = loop {
        let info = slurm.job(id).await?;
        let Some(j) = &info else {
            bail!("Slurm forgot job {id} before it was seen running");
        };
        let state = j.get("JobState").cloned().unwrap_or_default();
        if state != "PENDING" && state != "CONFIGURING" {
            break info;
        }
        let reason = j.get("Reason").cloned().unwrap_or_default();
        if !quiet && reason != said {
            eprintln!(
                "labrun: {}: waiting in Slurm's queue ({reason})",
                job_name(id)
            );
            said = reason;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if !quiet {
        if let Some(node) = info.as_ref().and_then(|j| j.get("NodeList")) {
            eprintln!("labrun: {}: running on {node}", job_name(id));
        }
    }
    let path = output_path(id, info.as_ref())?;
    let end = tail(slurm, id, &path, 0).await?;
    let Some(end) = end else {
        bail!("Slurm forgot job {id} as it ended: its exit code is unknown");
    };
    let state = end.get("JobState").cloned().unwrap_or_default();
    Ok(ExitCode::from(exit_code(&state, end.get("ExitCode"))))
}

/// labrun's exit code for a job that ended in `state` with Slurm's
/// `ExitCode=CODE:SIGNAL`.
fn exit_code(state: &str, code: Option<&String>) -> u8 {
    let (c, sig) = code
        .and_then(|c| c.split_once(':'))
        .map_or((None, None), |(a, b)| {
            (a.parse::<u8>().ok(), b.parse::<u8>().ok())
        });
    match (state, c, sig) {
        (_, _, Some(s)) if s > 0 => 128u8.saturating_add(s),
        ("COMPLETED", Some(c), _) => c,
        (_, Some(c), _) if c > 0 => c,
        // Cancelled, timed out, failed to start: not a success.
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_rows() {
        let rows = parse_rows("12|alice|RUNNING|0:05|n1|gres:gpu:1|train.py\n13|bob|PENDING|0:00|(Priority)|gres:gpu:2|a|b\n");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].id, "slurm-12");
        assert_eq!(rows[0].node_or_reason, "n1");
        assert_eq!(rows[1].name, "a|b");
    }

    #[test]
    fn exit_codes() {
        let c = |s: &str| Some(s.to_string());
        assert_eq!(exit_code("COMPLETED", c("0:0").as_ref()), 0);
        assert_eq!(exit_code("FAILED", c("3:0").as_ref()), 3);
        assert_eq!(exit_code("CANCELLED", c("0:15").as_ref()), 143);
        assert_eq!(exit_code("TIMEOUT", c("0:0").as_ref()), 1);
        assert_eq!(exit_code("FAILED", None), 1);
    }
}
