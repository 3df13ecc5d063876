//! The batch script's step (`labrun _slurm-job SPEC`), on the node Slurm
//! chose, as the job's user, with the GPUs Slurm granted: stage the code
//! and data through this node's labd, run the command there, and save the
//! outputs every few minutes and at the end, also when Slurm stops the job
//! (`scancel`, or SIGTERM `grace` before its time limit).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use labsync_agent::proto::{NodeName, StageAsk, StageDone, Staged};
use labsync_agent::Client;
use labsync_store::{push, NoProgress, NodeCache, PushOptions, Remote, Repo};
use tokio::signal::unix::{signal, SignalKind};

use super::job_name;
use super::submit::JobSpec;
use crate::commands::explain_client;
use crate::Settings;

/// Files changed this recently may be half written while the job runs.
const SETTLE: Duration = Duration::from_secs(5);

/// A variable Slurm sets in every batch job.
fn slurm_var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!(
            "{name} is not set: `labrun _slurm-job` is the step of the batch script that \
             `labrun --backend slurm` submits, and runs only inside that Slurm job"
        )
    })
}

/// Runs the job; its exit code (128+N for a signal).
pub async fn run(s: &Settings, spec: &str) -> Result<ExitCode> {
    let spec: JobSpec = serde_json::from_str(spec).context("the job's spec")?;
    let id = slurm_var("SLURM_JOB_ID")?;
    let id = super::slurm_id(&id)?;
    let node: NodeName = slurm_var("SLURMD_NODENAME")?
        .parse()
        .context("SLURMD_NODENAME: labsync names this node as Slurm does")?;
    let name = job_name(&id);
    if spec.argv.is_empty() {
        bail!("the job's spec has no command");
    }
    // Ignored until the child runs: a TERM while staging ends labrun (and
    // the job) as Slurm means it to.
    let (client, _) = crate::local::connect(Some(spec.labd.clone()), s, true).await?;
    let started = Instant::now();
    eprintln!("labrun: {name}: staging its code and data on {node}…");
    let ask = StageAsk {
        node: node.clone(),
        job: id.clone(),
        code: spec.code.clone(),
        data: spec.data.clone(),
        outputs: spec.outputs.clone(),
    };
    let staged = client.stage_ask(&ask).await.map_err(explain_client)?;
    eprintln!(
        "labrun: {name}: staged in {:.1} s, running in {}",
        started.elapsed().as_secs_f64(),
        staged.work.display()
    );
    let done = StageDone {
        node: node.clone(),
        stage: staged.stage.clone(),
        user: String::new(),
    };
    let ran = run_staged(s, &client, &spec, &staged, &name, &node).await;
    // Released however the command went (its trees may then be evicted;
    // the working folder stays for labd's work_keep).
    if let Err(e) = client.stage_done_ask(&done).await {
        eprintln!("labrun: {name}: could not release its stage ({e}); labd keeps it a while");
    }
    let code = ran?;
    eprintln!("labrun: {name} ended: exit {code}");
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// Runs the command in the staged folder, saving the outputs as it runs
/// and once it has ended; its exit code (128+N for signal N).
async fn run_staged(
    s: &Settings,
    client: &Client,
    spec: &JobSpec,
    staged: &Staged,
    name: &str,
    node: &str,
) -> Result<i32> {
    let mut term = signal(SignalKind::terminate()).context("cannot catch SIGTERM")?;
    let mut cmd = tokio::process::Command::new(&spec.argv[0]);
    cmd.args(&spec.argv[1..])
        .current_dir(&staged.work)
        // Its own process group, so SIGTERM reaches what it started too.
        .process_group(0)
        .env_remove("LABRUN_TOKEN")
        .env("LABRUN_JOB_ID", name)
        .env("LABRUN_NODE", node);
    for (i, (var, path)) in staged.data.iter().enumerate() {
        if i == 0 {
            cmd.env("LABRUN_DATA", path);
        }
        cmd.env(var, path);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {:?}", spec.argv))?;
    let saver = Saver::open(s, client, spec, staged, name)
        .await
        .map(Arc::new);
    let every = Duration::from_secs(spec.outputs_every_s.max(1));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // One periodic save at a time, in a task of its own: a long push must
    // not keep SIGTERM from being passed on, or the end from being seen.
    let mut saving: Option<tokio::task::JoinHandle<()>> = None;
    let status = loop {
        tokio::select! {
            st = child.wait() => break st.context("waiting for the command")?,
            _ = term.recv() => {
                eprintln!("labrun: {name}: Slurm stops the job (SIGTERM): passing it on, then saving the outputs");
                if let Some(pid) = child.id() {
                    // SAFETY: kill(2) of our child's process group (it leads
                    // it); no memory is touched.
                    #[allow(unsafe_code)]
                    unsafe { libc::kill(-(pid as i32), libc::SIGTERM) };
                }
            }
            _ = tick.tick() => {
                if let Some(sv) = &saver {
                    if saving.as_ref().is_none_or(|h| h.is_finished()) {
                        let sv = sv.clone();
                        saving = Some(tokio::spawn(async move { sv.save(false).await }));
                    }
                }
            }
        }
    };
    if let Some(h) = saving {
        let _ = h.await;
    }
    if let Some(sv) = &saver {
        sv.save(true).await;
    }
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    })
}

/// Pushes the job's `--outputs` as `runs/slurm-<id>`, as the job's user.
struct Saver {
    repo: Repo,
    dir: std::path::PathBuf,
    opts: PushOptions,
}

impl Saver {
    /// `None` when the job has no `--outputs` (or the store cannot be
    /// opened: said, and the job runs on).
    async fn open(
        s: &Settings,
        client: &Client,
        spec: &JobSpec,
        staged: &Staged,
        name: &str,
    ) -> Option<Saver> {
        let out = spec.outputs.as_ref()?;
        let opened = async {
            let info = client.info().await.map_err(explain_client)?;
            let remote = Remote::open(&info.store, &s.store_options)
                .with_context(|| format!("cannot open the store {}", info.store))?;
            let repo = Repo::open(remote, None).await?;
            let cache = NodeCache::open(&s.cache_dir, s.cache_max)?;
            Ok::<_, anyhow::Error>((repo, cache, info.user))
        };
        match opened.await {
            Ok((repo, cache, user)) => Some(Saver {
                dir: staged.work.join(out),
                opts: PushOptions {
                    name: format!("runs/{name}"),
                    files_cache: Some(cache.files_cache_dir()),
                    threads: 2,
                    user,
                    host: staged.node.to_string(),
                    read_as: None,
                    settle: Some(SETTLE),
                    compression: s.compression,
                    provenance: None,
                },
                repo,
            }),
            Err(e) => {
                eprintln!("labrun: {name}: its outputs cannot be saved: {e:#}");
                None
            }
        }
    }

    /// One push; `last`: the job has stopped, take every file as it is.
    async fn save(&self, last: bool) {
        if !self.dir.is_dir() {
            return;
        }
        let opts = PushOptions {
            settle: (!last).then_some(SETTLE),
            ..self.opts.clone()
        };
        match push(&self.repo, &self.dir, &opts, Arc::new(NoProgress)).await {
            Ok(o) if o.created || last => {
                let (label, id) = (o.record.label(), o.record.snapshot);
                eprintln!("labrun: outputs saved as {label}#{id}")
            }
            Ok(_) => {}
            Err(e) => eprintln!("labrun: saving the outputs failed: {e:#}"),
        }
    }
}
