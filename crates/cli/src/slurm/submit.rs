//! `labrun --backend slurm`: the code and data are pushed as for labd, the
//! coordinator ranks Slurm's nodes (Slurm's free GPUs, the agents' caches),
//! and the job is submitted with `sbatch --prefer` naming the best nodes
//! that can start it now: a soft preference (Slurm starts it elsewhere when
//! they are taken), never a pin.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use labsync_agent::proto::{DataRef, Info, RankAsk, SubmitRequest, TreeRef};
use labsync_agent::Client;
use labsync_placer::{preferred, Ranking};
use serde::{Deserialize, Serialize};

use super::{feature_of, job_name, Slurm};
use crate::Settings;

/// What the batch script's own step needs (`labrun _slurm-job SPEC`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The coordinator (`LABRUN_LABD` as the submitter had it).
    pub labd: String,
    /// The command, run in the code's folder.
    pub argv: Vec<String>,
    /// The code.
    pub code: Option<TreeRef>,
    /// The datasets.
    pub data: Vec<DataRef>,
    /// Folder (relative to the code) saved as `runs/slurm-<id>`.
    pub outputs: Option<String>,
    /// Seconds between saves of the outputs while the job runs.
    pub outputs_every_s: u64,
}

/// How the job is submitted, beyond the request.
#[derive(Clone, Debug, Default)]
pub struct SlurmRun {
    /// `--time`, seconds.
    pub time_s: Option<u64>,
    /// Print the ranking and the sbatch line; submit nothing.
    pub explain: bool,
    /// Print the job id and return.
    pub detach: bool,
}

/// Seconds between saves of the outputs when not asked: labd's default.
const OUTPUTS_EVERY_S: u64 = 300;

/// Where the jobs' output files go: `~/.local/state/labsync/slurm` (the
/// home is shared between a Slurm cluster's nodes, so labrun reads there
/// what the node wrote).
pub fn output_dir() -> Result<PathBuf> {
    Ok(dirs::state_dir()
        .or_else(|| dirs::home_dir().map(|h| h.join(".local/state")))
        .context("no home folder for the Slurm jobs' output files (set HOME)")?
        .join("labsync")
        .join("slurm"))
}

/// `'…'` for sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The batch script: the job's first and only step is labrun's own, which
/// stages, runs the command and saves the outputs.
pub fn batch_script(labrun: &Path, spec: &JobSpec) -> String {
    let json = serde_json::to_string(spec).expect("spec serialises");
    format!(
        "#!/bin/sh\n\
         # Written by labrun --backend slurm: stage the code and data through this\n\
         # node's labd (peers first, then the store), run the command, save --outputs.\n\
         exec {} _slurm-job {}\n",
        quote(&labrun.display().to_string()),
        quote(&json)
    )
}

/// The job's comment in Slurm: what the coordinator's re-ranking prices
/// it by (`labsync:v1:<gpus>:<snapshot>,<snapshot>`, code first).
pub fn comment(req: &SubmitRequest) -> String {
    let snaps: Vec<String> = (req.code.iter())
        .chain(req.data.iter().map(|d| &d.tree))
        .map(|t| t.snapshot.to_string())
        .collect();
    format!("{COMMENT}{}:{}", req.gpus, snaps.join(","))
}

pub use labsync_agent::slurm::{parse_comment, COMMENT};

/// sbatch's arguments (the script comes on stdin).
pub fn sbatch_args(
    name: &str,
    comment: &str,
    gpus: u32,
    prefer: &[String],
    out_dir: &Path,
    s: &crate::SlurmSettings,
    time_s: Option<u64>,
) -> Vec<String> {
    let mut a = vec![
        "--parsable".to_string(),
        format!("--job-name={name}"),
        format!("--comment={comment}"),
        format!("--output={}/slurm-%j.out", out_dir.display()),
        format!("--chdir={}", out_dir.display()),
    ];
    if gpus > 0 {
        a.push(format!("--gres=gpu:{gpus}"));
    }
    if !prefer.is_empty() {
        let list: Vec<String> = prefer.iter().map(|n| feature_of(n)).collect();
        a.push(format!("--prefer={}", list.join("|")));
    }
    if let Some(p) = &s.partition {
        a.push(format!("--partition={p}"));
    }
    let grace = match time_s {
        Some(t) => {
            // Slurm's limits are whole minutes.
            let minutes = t.div_ceil(60).max(1);
            a.push(format!("--time={minutes}"));
            s.grace_s.min(minutes * 60 / 2)
        }
        None => s.grace_s,
    };
    // B: to the batch step alone (labrun's own, which passes it on and
    // then saves the outputs).
    a.push(format!("--signal=B:TERM@{}", grace.clamp(1, 65_535)));
    a
}

/// The job's name in Slurm: the script (`train.py` of `python3 train.py`)
/// or the program, letters, digits and `._-` only.
fn job_label(argv: &[String]) -> String {
    let interpreted = argv.first().is_some_and(|p| {
        matches!(p.as_str(), "python" | "python3" | "bash" | "sh")
            && argv.get(1).is_some_and(|a| !a.starts_with('-'))
    });
    let word = argv
        .get(usize::from(interpreted))
        .map_or("labrun", String::as_str);
    let base = Path::new(word)
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let clean: String = base
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
        .take(40)
        .collect();
    if clean.is_empty() {
        "labrun".into()
    } else {
        clean
    }
}

/// The nodes to prefer, among those that carry their feature; the ones
/// that lack it are said once (Slurm refuses a preference no node has).
fn with_features(prefer: Vec<String>, nodes: &[super::NodeInfo], quiet: bool) -> Vec<String> {
    prefer
        .into_iter()
        .filter(|n| {
            let has = super::has_own_feature(nodes, n);
            if !has && !quiet {
                eprintln!(
                    "labrun: node {n} has no feature {} in Slurm, so jobs cannot prefer it \
                     (`labd slurm-config` prints the slurm.conf lines)",
                    feature_of(n)
                );
            }
            has
        })
        .collect()
}

/// What `labrun --backend slurm` needs before it asks Slurm anything: a
/// coordinator at a network address (the job's step asks it to stage),
/// and none of labd's own flags.
fn check_submit(client: &Client, info: &Info, req: &SubmitRequest) -> Result<()> {
    if !info.coordinator {
        bail!(
            "the Slurm backend ranks Slurm's nodes by what their labd agents have cached and \
             stages through them: point labrun at the cluster's coordinator (LABRUN_LABD or \
             `labd` in the config file), not at {}'s own labd",
            info.node
        );
    }
    if let labsync_agent::Endpoint::Unix(p) = client.endpoint() {
        bail!(
            "the job's step on the Slurm node asks the coordinator to stage its data, and \
             {} is a socket of this machine: give the coordinator's network address \
             (LABRUN_LABD=http://HOST:PORT, or https://)",
            p.display()
        );
    }
    if req.gpu_mem > 0 || req.priority.is_some() || req.preemptible {
        bail!(
            "--gpu-mem, --priority and --preemptible are labd's; under Slurm, ask Slurm \
             (a GPU type in its GRES, its QOS and preemption)"
        );
    }
    Ok(())
}

/// Submits `req` to Slurm; follows it unless detached. `info` is the
/// coordinator's.
pub async fn submit(
    s: &Settings,
    client: &Client,
    info: &Info,
    req: SubmitRequest,
    run: SlurmRun,
    quiet: bool,
    json: bool,
) -> Result<ExitCode> {
    check_submit(client, info, &req)?;
    let slurm = Slurm::new(s.slurm.timeout);
    let nodes = slurm.nodes(s.slurm.partition.as_deref()).await?;
    if nodes.is_empty() {
        bail!(
            "Slurm lists no nodes{}",
            s.slurm
                .partition
                .as_ref()
                .map_or(String::new(), |p| format!(" in partition {p}"))
        );
    }
    let ask = RankAsk {
        // What it reads and how many GPUs, not the submitter's environment
        // (the job's environment goes with sbatch, never to labd).
        req: SubmitRequest {
            env: Vec::new(),
            ..req.clone()
        },
        nodes: nodes.iter().filter_map(|n| n.scheduler_node()).collect(),
    };
    let ranking = client
        .rank(&ask)
        .await
        .map_err(crate::commands::explain_client)?;
    let prefer = preferred(&ranking, 2.0)
        .into_iter()
        .map(|n| n.to_string())
        .collect();
    let prefer = with_features(prefer, &nodes, quiet);
    let out_dir = output_dir()?;
    let name = job_label(&req.argv);
    let args = sbatch_args(
        &name,
        &comment(&req),
        req.gpus,
        &prefer,
        &out_dir,
        &s.slurm,
        run.time_s,
    );
    if run.explain {
        if json {
            println!("{}", serde_json::to_string_pretty(&(ranking, &args))?);
        } else {
            print!(
                "{}",
                crate::commands::run::ranking_table(&ranking, req.gpus)
            );
            println!("sbatch {}", args.join(" "));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let spec = JobSpec {
        labd: client.endpoint().to_string(),
        argv: req.argv.clone(),
        code: req.code.clone(),
        data: req.data.clone(),
        outputs: req.outputs.clone(),
        outputs_every_s: req.outputs_every_s.unwrap_or(OUTPUTS_EVERY_S).max(1),
    };
    let labrun = std::env::current_exe().context("cannot find labrun's own path")?;
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let script = batch_script(&labrun, &spec);
    let out = slurm.run("sbatch", &args, Some(script.as_bytes())).await?;
    let id = out.trim().split(';').next().unwrap_or_default().to_string();
    let id = super::slurm_id(&id).with_context(|| format!("sbatch answered {out:?}"))?;
    if run.detach {
        println!("{}", job_name(&id));
        return Ok(ExitCode::SUCCESS);
    }
    if !quiet {
        eprintln!(
            "labrun: Slurm job {id} ({}), {}",
            job_name(&id),
            describe(&ranking, &prefer)
        );
    }
    super::manage::follow(&slurm, &id, quiet).await
}

/// Why the preference is what it is, in words.
fn describe(r: &Ranking, prefer: &[String]) -> String {
    if prefer.is_empty() {
        return "no node has its GPUs free now: Slurm starts it where it can".into();
    }
    let missing = |n: &str| {
        r.rows
            .iter()
            .find(|row| row.node.as_str() == n)
            .map_or(0, |row| row.missing_bytes)
    };
    let parts: Vec<String> = prefer
        .iter()
        .map(|n| format!("{n} ({} to fetch)", crate::human_bytes(missing(n))))
        .collect();
    format!("preferring {}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> crate::SlurmSettings {
        crate::SlurmSettings {
            timeout: std::time::Duration::from_secs(10),
            partition: Some("gpu".into()),
            grace_s: 120,
        }
    }

    #[test]
    fn the_sbatch_line() {
        let a = sbatch_args(
            "train.py",
            "labsync:v1:2:ab,cd",
            2,
            &["n1".into(), "n3".into()],
            Path::new("/home/a/.local/state/labsync/slurm"),
            &settings(),
            Some(90),
        );
        assert_eq!(
            a,
            [
                "--parsable",
                "--job-name=train.py",
                "--comment=labsync:v1:2:ab,cd",
                "--output=/home/a/.local/state/labsync/slurm/slurm-%j.out",
                "--chdir=/home/a/.local/state/labsync/slurm",
                "--gres=gpu:2",
                "--prefer=lsn_n1|lsn_n3",
                "--partition=gpu",
                "--time=2",
                // Half the 2-minute limit: the grace never eats the whole run.
                "--signal=B:TERM@60",
            ]
        );
        let a = sbatch_args("x", "c", 0, &[], Path::new("/o"), &settings(), None);
        assert!(!a
            .iter()
            .any(|x| x.starts_with("--gres") || x.starts_with("--prefer")));
        assert_eq!(a.last().unwrap(), "--signal=B:TERM@120");
    }

    #[test]
    fn comments_round_trip() {
        let (code, data) = (
            labsync_store::SnapshotId::from_bytes([0xc0; 32]),
            labsync_store::SnapshotId::from_bytes([0xda; 32]),
        );
        let tree = |s: labsync_store::SnapshotId| TreeRef {
            label: format!("{}@v1", s.short()),
            snapshot: s,
        };
        let req = SubmitRequest {
            gpus: 2,
            code: Some(tree(code)),
            data: vec![DataRef {
                env: "LABRUN_DATA_X".into(),
                tree: tree(data),
            }],
            ..Default::default()
        };
        assert_eq!(comment(&req), format!("labsync:v1:2:{code},{data}"));
        assert_eq!(parse_comment(&comment(&req)), Some((2, vec![code, data])));
        for other in ["", "my own comment", "labsync:v1:x:ab", "labsync:v2:1:ab"] {
            assert_eq!(parse_comment(other), None, "{other:?}");
        }
    }

    #[test]
    fn job_names() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            job_label(&v(&["python3", "train.py", "--lr", "1"])),
            "train.py"
        );
        assert_eq!(job_label(&v(&["sh", "-c", "echo $(x) && y"])), "sh");
        assert_eq!(job_label(&v(&["./bin/run me"])), "runme");
        assert_eq!(job_label(&[]), "labrun");
    }

    #[test]
    fn the_script_quotes_what_it_carries() {
        let spec = JobSpec {
            labd: "http://127.0.0.1:1".into(),
            argv: vec!["python3".into(), "it's.py".into()],
            code: None,
            data: vec![],
            outputs: None,
            outputs_every_s: 300,
        };
        let script = batch_script(Path::new("/usr/bin/labrun"), &spec);
        let line = script.lines().last().unwrap();
        // The shell hands labrun exactly the JSON it was given.
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(line.replace("exec '/usr/bin/labrun' _slurm-job", "printf %s"))
            .output()
            .unwrap();
        let back: JobSpec = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(back, spec);
    }
}
