//! `labrun`: run a job on a lab GPU server, with its code and data.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use labsync_agent::proto::{DataRef, Info, JobView, SubmitRequest, TreeRef};
use labsync_agent::{Client, ClientError, Endpoint, GpuState, JobState, Secret};
use labsync_cli::local::{hostname, parse_duration, LocalLabd, SYSTEM_SOCKET};
use labsync_cli::progress::Bar;
use labsync_cli::{human_bytes, parse_size, Overrides, Settings};
use labsync_store::{push, NodeCache, PushOptions, RefSpec, Remote, Repo};

const LONG_ABOUT: &str = "\
Run a job on this lab's GPUs, with its code and data, instead of claiming a
GPU in a spreadsheet.

  labrun --data div2k train.py
  labrun --data div2k --gpus 2 --gpu-mem 10G --outputs ckpt/ -- python train.py --scale 4

The current folder (or --code) is pushed to the store as your code (only what
changed is uploaded) and materialised as the job's working folder. Each
--data is a stored name (div2k, div2k@v3) or a local folder (pushed first,
as data/USER/FOLDER); the job sees it read-only at $LABRUN_DATA (the first)
and $LABRUN_DATA_<NAME> (each), shared with every other job on the same
version. The job sees only
its leased GPUs in CUDA_VISIBLE_DEVICES, and LABRUN_JOB_ID. If not enough
GPUs are free it waits, first come first served; `labrun ps` says why.

A script that is a file runs with its interpreter (train.py: python3, x.sh:
bash, an executable: itself); after `--`, any command runs as given.

labrun streams the job's output and exits with its exit code. Ctrl-C once
shows the job's state and leaves it running; Ctrl-C again within a second
kills it (as with srun). If labrun itself goes away, the job keeps running:
`labrun logs -f JOB` reattaches. --outputs DIR is pushed to the store as
runs/<job-id> every few minutes and when the job ends, however it ends:
`labsync pull runs/<job-id>` gets the checkpoints back.

labd is found at --labd, LABRUN_LABD, `labd` in the config file, the system
socket /run/labsync/labd.sock, or else a personal labd that labrun starts in
the background (state in ~/.local/state/labsync/labd). A shared labd needs
your token: LABRUN_TOKEN or `token` in ~/.config/labsync/config.toml.

Exit codes: the job's own; 128+N if a signal N ended it; 1 if it could not
run or labrun failed; 2 for a usage error.";

#[derive(Parser, Debug)]
#[command(
    name = "labrun",
    version,
    about = "Run a job on the lab's GPUs with its code and data",
    long_about = LONG_ABOUT,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(flatten)]
    run: RunArgs,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Args, Debug, Clone)]
struct Global {
    /// labd to use: unix:///path/labd.sock or http://host:port
    #[arg(long, global = true, env = "LABRUN_LABD", value_name = "ADDR")]
    labd: Option<String>,
    /// Config file [default: ~/.config/labsync/config.toml]
    #[arg(long, global = true, env = "LABSYNC_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Store for the personal labd (as for labsync)
    #[arg(long, global = true, env = "LABSYNC_STORE", value_name = "URL")]
    store: Option<String>,
    /// Cache folder (files cache of code pushes; the personal labd's node cache)
    #[arg(long, global = true, env = "LABSYNC_CACHE", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Print only the job's own output
    #[arg(short, long, global = true)]
    quiet: bool,
    /// ps / status / kill: print JSON
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Args, Debug, Clone)]
struct RunArgs {
    /// Dataset: a stored name (div2k, div2k@v3) or a local folder (stored as data/USER/FOLDER); repeatable
    #[arg(long, value_name = "NAME|PATH")]
    data: Vec<String>,
    /// GPUs to lease [default: 1 on a node with GPUs, 0 on one without]
    #[arg(long, value_name = "N")]
    gpus: Option<u32>,
    /// Free memory each GPU must have, e.g. 10G
    #[arg(long, value_name = "SIZE")]
    gpu_mem: Option<String>,
    /// Folder (relative to the code) saved to the store as runs/JOB-ID
    #[arg(long, value_name = "DIR")]
    outputs: Option<String>,
    /// How often --outputs is saved while the job runs, e.g. 10m; files
    /// changed in the last 5 s keep their previous copy in such a save
    /// (they may be half written) [default: labd's, 5m]
    #[arg(long, value_name = "DURATION")]
    outputs_every: Option<String>,
    /// Code folder [default: the current folder]
    #[arg(long, value_name = "DIR")]
    code: Option<PathBuf>,
    /// Name the code is stored under [default: code/USER/FOLDER]
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// Submit, print the job id and return without streaming
    #[arg(short, long)]
    detach: bool,
    /// The script (train.py) or, after --, the command, and its arguments
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "SCRIPT|-- COMMAND"
    )]
    command: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Jobs: id, user, GPUs, state, runtime, why waiting (yours; --all: everyone's; ended ones for a day)
    Ps {
        /// Everyone's jobs
        #[arg(long)]
        all: bool,
    },
    /// A job's output (live with -f)
    Logs {
        /// Job id
        job: String,
        /// Follow until the job ends
        #[arg(short, long)]
        follow: bool,
    },
    /// Kill a job: SIGTERM to all its processes, SIGKILL after a grace period
    Kill {
        /// Job id
        job: String,
    },
    /// Every GPU: free, leased (job, user), foreign process (pid, user, memory), unknown
    Status,
}

fn settings(g: &Global) -> Result<Settings> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    Settings::resolve(
        &Overrides {
            store: g.store.clone(),
            cache_dir: g.cache_dir.clone(),
            config: g.config.clone(),
            ..Default::default()
        },
        &env,
    )
}

/// Finds labd, starting the personal one if nothing else is configured
/// (then also returned, so its store can be checked against the settings).
async fn connect(g: &Global, s: &Settings) -> Result<(Client, Option<LocalLabd>)> {
    let token = std::env::var("LABRUN_TOKEN")
        .ok()
        .map(Secret::from)
        .or(s.token.clone());
    if let Some(addr) = g.labd.clone().or(s.labd.clone()) {
        let ep: Endpoint = addr.parse().map_err(anyhow::Error::msg)?;
        return Ok((Client::new(ep, token), None));
    }
    if Path::new(SYSTEM_SOCKET).exists() {
        return Ok((
            Client::new(Endpoint::Unix(SYSTEM_SOCKET.into()), token),
            None,
        ));
    }
    let local = LocalLabd::for_user()?;
    let probe = Client::new(Endpoint::Unix(local.socket()), None);
    if !probe.healthy().await {
        start_local(&local, s, g.quiet).await?;
    }
    let token = match token {
        Some(t) => t,
        None => std::fs::read_to_string(local.token_file())
            .with_context(|| format!("cannot read labd's token {}", local.token_file().display()))?
            .trim()
            .to_string()
            .into(),
    };
    let client = Client::new(Endpoint::Unix(local.socket()), Some(token));
    Ok((client, Some(local)))
}

async fn start_local(local: &LocalLabd, s: &Settings, quiet: bool) -> Result<()> {
    let exe = std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("labd"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("labd"));
    std::fs::create_dir_all(&local.state_dir)
        .with_context(|| format!("cannot create {}", local.state_dir.display()))?;
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(local.log_file())
        .with_context(|| format!("cannot open {}", local.log_file().display()))?;
    if !quiet {
        eprintln!(
            "labrun: starting labd in the background (log: {})",
            local.log_file().display()
        );
    }
    let mut child = std::process::Command::new(&exe)
        .arg("--state-dir")
        .arg(&local.state_dir)
        .arg("--store")
        .arg(&s.store)
        .arg("--cache-dir")
        .arg(&s.cache_dir)
        .arg("--cache-max")
        .arg(s.cache_max.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a Ctrl-C at labrun's terminal must not reach it.
        .process_group(0)
        .spawn()
        .with_context(|| {
            format!(
                "cannot start {} (is labd installed next to labrun?)",
                exe.display()
            )
        })?;
    let probe = Client::new(Endpoint::Unix(local.socket()), None);
    let t = Instant::now();
    loop {
        if probe.healthy().await {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            // Another labrun may have started one at the same moment.
            if probe.healthy().await {
                return Ok(());
            }
            let tail = std::fs::read_to_string(local.log_file()).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            bail!(
                "labd exited ({status}) at start:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!(
                "labd did not answer within 30 s; see {}",
                local.log_file().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn open_repo(info: &Info, s: &Settings) -> Result<Repo> {
    let remote = Remote::open(&info.store, &s.store_options)
        .with_context(|| format!("cannot open labd's store {}", info.store))?;
    Repo::open(remote, None)
        .await
        .with_context(|| format!("cannot open labd's store {}", info.store))
}

/// A name from a folder name: letters, digits, `._-` kept, the rest `_`.
fn name_part(p: &Path) -> String {
    let raw = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "root".into());
    let s: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    match s.trim_matches('.') {
        "" => "root".into(),
        t => t.to_string(),
    }
}

/// `LABRUN_DATA_DIV2K` for `div2k`, `LABRUN_DATA_SET14_X4` for `sr/set14-x4`.
fn data_var(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    let up: String = last
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("LABRUN_DATA_{up}")
}

/// `train.py` → `python3 train.py`; a command after `--` as given.
fn interpret(command: &[String], code: &Path) -> Result<Vec<String>> {
    let Some(first) = command.first() else {
        bail!("nothing to run: give a script (labrun train.py) or a command (labrun -- python train.py)")
    };
    let path = code.join(first);
    let Ok(meta) = std::fs::metadata(&path) else {
        return Ok(command.to_vec());
    };
    if !meta.is_file() {
        bail!("{first} is not a file");
    }
    if !path.starts_with(code) || first.starts_with('/') || first.split('/').any(|p| p == "..") {
        bail!(
            "{first} is outside the code folder {}; run it with -- CMD",
            code.display()
        );
    }
    let mut argv = match Path::new(first).extension().and_then(|e| e.to_str()) {
        Some("py") => vec!["python3".to_string(), first.clone()],
        Some("sh") => vec!["bash".to_string(), first.clone()],
        _ if meta.permissions().mode() & 0o111 != 0 => {
            vec![if first.contains('/') {
                first.clone()
            } else {
                format!("./{first}")
            }]
        }
        _ => bail!("don't know how to run {first}: make it executable, or run it with -- CMD ARGS"),
    };
    argv.extend(command[1..].iter().cloned());
    Ok(argv)
}

async fn push_tree(
    repo: &Repo,
    s: &Settings,
    src: &Path,
    name: String,
    user: &str,
    quiet: bool,
) -> Result<TreeRef> {
    let cache = NodeCache::open(&s.cache_dir, s.cache_max)
        .with_context(|| format!("cannot open cache {}", s.cache_dir.display()))?;
    let bar = Arc::new(Bar::new(quiet));
    let opts = PushOptions {
        name,
        files_cache: Some(cache.files_cache_dir()),
        threads: 2,
        user: user.to_string(),
        host: hostname(),
        read_as: None,
        settle: None,
        compression: s.compression,
    };
    let out = push(repo, src, &opts, bar.clone())
        .await
        .with_context(|| format!("cannot push {}", src.display()))?;
    bar.finish();
    if out.created && !quiet {
        eprintln!(
            "labrun: pushed {} as {} ({} new)",
            src.display(),
            out.record.label(),
            human_bytes(out.bytes_read)
        );
    }
    Ok(TreeRef {
        label: out.record.label(),
        snapshot: out.record.snapshot.to_string(),
    })
}

async fn submit(
    g: &Global,
    s: &Settings,
    (client, personal): (&Client, Option<&LocalLabd>),
    a: RunArgs,
) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain)?;
    // The store labrun pushes code to is labd's; a mismatch with what the
    // user asked for (or, for the personal labd, configured since it
    // started) is said, not silently followed.
    if (g.store.is_some() || personal.is_some()) && s.store != info.store {
        let hint = match personal {
            Some(local) => format!(
                "stop it (kill $(cat {})) and labrun starts one with your settings",
                local.state_dir.join("labd.pid").display()
            ),
            None => "run with its store or use another labd".into(),
        };
        bail!(
            "labd at {} uses store {}, not {}: {hint}",
            client.endpoint(),
            info.store,
            s.store
        );
    }
    let code = a.code.clone().unwrap_or_else(|| PathBuf::from("."));
    let code = code
        .canonicalize()
        .with_context(|| format!("cannot open code folder {}", code.display()))?;
    // After `--` the command runs as given; clap drops the `--` itself.
    let raw: Vec<String> = std::env::args().collect();
    let dashdash = raw
        .iter()
        .position(|x| x == "--")
        .is_some_and(|i| raw.get(i + 1) == a.command.first());
    let argv = if dashdash {
        a.command.clone()
    } else {
        interpret(&a.command, &code)?
    };
    let gpus = match a.gpus {
        Some(n) => n,
        None => u32::from(!client.gpus().await.map_err(explain)?.is_empty()),
    };
    let repo = open_repo(&info, s).await?;
    let code_name = a.name.clone().unwrap_or_else(|| {
        format!(
            "code/{}/{}",
            name_part(Path::new(&info.user)),
            name_part(&code)
        )
    });
    let code_ref = push_tree(&repo, s, &code, code_name, &info.user, g.quiet).await?;
    let mut data = Vec::new();
    for d in &a.data {
        let p = Path::new(d);
        let tree = if p.is_dir() {
            // Under the user's own prefix, so a folder called `data` never
            // becomes a new version of someone else's dataset `data`.
            let p = p.canonicalize()?;
            let name = format!(
                "data/{}/{}",
                name_part(Path::new(&info.user)),
                name_part(&p)
            );
            push_tree(&repo, s, &p, name, &info.user, g.quiet).await?
        } else {
            let spec: RefSpec = d.parse().with_context(|| {
                format!("--data {d}: neither a folder nor a stored name (see labsync ls)")
            })?;
            let rec = repo
                .resolve(&spec)
                .await
                .with_context(|| format!("--data {d}: not in {} (see labsync ls)", info.store))?;
            TreeRef {
                label: rec.label(),
                snapshot: rec.snapshot.to_string(),
            }
        };
        let name = tree.label.split('@').next().unwrap_or_default().to_string();
        data.push(DataRef {
            env: data_var(&name),
            tree,
        });
    }
    let req = SubmitRequest {
        argv,
        // Variables that are not UTF-8 cannot travel as JSON strings; they stay behind.
        env: std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| k != "LABRUN_TOKEN")
            .collect(),
        code: Some(code_ref.clone()),
        data,
        gpus,
        gpu_mem: a
            .gpu_mem
            .as_deref()
            .map(parse_size)
            .transpose()?
            .unwrap_or(0),
        outputs: a.outputs.clone(),
        outputs_every_s: a.outputs_every.as_deref().map(parse_duration).transpose()?,
    };
    let job = client.submit(&req).await.map_err(explain)?;
    if a.detach {
        println!("{}", job.id);
        return Ok(ExitCode::SUCCESS);
    }
    if !g.quiet {
        eprintln!(
            "labrun: job {} on {} ({}, {} GPU{})",
            job.id,
            info.node,
            code_ref.label,
            gpus,
            if gpus == 1 { "" } else { "s" }
        );
    }
    follow(client, &job.id, g.quiet, true).await
}

/// Turns labd's refusals into messages that say what to do.
fn explain(e: ClientError) -> anyhow::Error {
    anyhow::Error::new(e)
}

/// Streams a job's log until it ends; returns its exit code.
async fn follow(client: &Client, id: &str, quiet: bool, interactive: bool) -> Result<ExitCode> {
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
                let piece = piece.map_err(explain)?;
                out.write_all(&piece.bytes)?;
                out.flush()?;
                offset = piece.next;
                if piece.done {
                    break;
                }
                if piece.bytes.is_empty() && checked.elapsed() > Duration::from_millis(900) {
                    checked = Instant::now();
                    let j = client.job(id).await.map_err(explain)?;
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
                            Err(e) => return Err(explain(e)),
                        }
                    }
                    _ => {
                        first_ctrl_c = Some(Instant::now());
                        let j = client.job(id).await.map_err(explain)?;
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
    let j = client.job(id).await.map_err(explain)?;
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

fn state_words(j: &JobView) -> String {
    let mut words = job_state_words(j);
    if j.ended() && j.meta.outputs_pending {
        if let Some(e) = &j.meta.outputs_error {
            words += &format!("; outputs not saved yet: {e}, retrying");
        }
    }
    words
}

fn job_state_words(j: &JobView) -> String {
    match &j.state {
        JobState::Queued => match &j.why {
            Some(w) => format!("queued ({w})"),
            None => "queued".into(),
        },
        JobState::Running { .. } => format!(
            "running on GPU{} {}",
            if j.gpus.len() == 1 { "" } else { "s" },
            j.gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
        JobState::Exited { code: Some(c), .. } => format!("exited ({c})"),
        JobState::Exited {
            signal: Some(s), ..
        } => format!("killed (signal {s})"),
        JobState::Exited { .. } => "exited".into(),
        JobState::Failed { reason } => format!("failed: {reason}"),
    }
}

fn runtime(j: &JobView) -> String {
    let Some(start) = j.started_at else {
        return "-".into();
    };
    let end = j.ended_at.unwrap_or_else(labsync_agent::unix_now);
    let s = end.saturating_sub(start);
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

async fn ps(g: &Global, client: &Client, all: bool) -> Result<ExitCode> {
    let me = client.info().await.map_err(explain)?.user;
    let jobs: Vec<JobView> = client
        .jobs()
        .await
        .map_err(explain)?
        .into_iter()
        .filter(|j| all || j.user == me)
        // Live jobs, and those that ended in the last day.
        .filter(|j| {
            !j.ended()
                || j.ended_at
                    .is_some_and(|t| labsync_agent::unix_now() < t + 86_400)
        })
        .collect();
    if g.json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<6} {:<10} {:<6} {:<9} {:<30} COMMAND",
        "ID", "USER", "GPUS", "RUNTIME", "STATE"
    );
    for j in &jobs {
        let gpus = if j.gpus.is_empty() {
            j.gpus_wanted.to_string()
        } else {
            j.gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        println!(
            "{:<6} {:<10} {:<6} {:<9} {:<30} {}",
            j.id,
            j.user,
            gpus,
            runtime(j),
            state_words(j),
            j.argv.join(" ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn logs(client: &Client, id: &str, follow_on: bool) -> Result<ExitCode> {
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
            .map_err(explain)?;
        out.write_all(&p.bytes)?;
        offset = p.next;
        if p.bytes.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

async fn status(g: &Global, client: &Client) -> Result<ExitCode> {
    let info = client.info().await.map_err(explain)?;
    let gpus = client.gpus().await.map_err(explain)?;
    let jobs = client.jobs().await.map_err(explain)?;
    if g.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"node": info.node, "inventory": info.inventory, "gpus": gpus})
            )?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let owner: HashMap<&str, &str> = jobs
        .iter()
        .map(|j| (j.id.as_str(), j.user.as_str()))
        .collect();
    println!("{} — GPUs from {}", info.node, info.inventory);
    if gpus.is_empty() {
        println!("  no GPUs on this node: jobs run with --gpus 0");
    }
    for g in &gpus {
        let hw = match &g.info {
            Some(i) => format!(
                "{:<22} {:>9} / {:<9} used",
                i.name,
                gib(i.memory_used),
                gib(i.memory_total)
            ),
            None => format!("{:<22} {:>21}", "?", "?"),
        };
        let procs = |ps: &[labsync_agent::ForeignProcess]| {
            ps.iter()
                .map(|p| {
                    let who = match &p.job {
                        Some(j) => format!("{j} outside its lease"),
                        None => p.user.as_deref().unwrap_or("?").to_string(),
                    };
                    format!(
                        "pid {} ({who}, {})",
                        p.pid,
                        p.used_bytes
                            .map_or("? MiB".into(), |b| format!("{} MiB", b >> 20))
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let state = match &g.state {
            GpuState::Free => "free".to_string(),
            GpuState::Leased { job, others } => {
                let mut s = format!(
                    "leased to {job} ({})",
                    owner.get(job.as_str()).copied().unwrap_or("?")
                );
                if !others.is_empty() {
                    s += &format!("; ALSO USED BY: {}", procs(others));
                }
                s
            }
            GpuState::Foreign { processes } => format!("FOREIGN: {}", procs(processes)),
            GpuState::Unknown { reason } => format!("UNKNOWN (never leased): {reason}"),
        };
        println!("  GPU {:<2} {hw}  {state}", g.index);
    }
    let queued = jobs.iter().filter(|j| j.state == JobState::Queued).count();
    let running = jobs
        .iter()
        .filter(|j| matches!(j.state, JobState::Running { .. }))
        .count();
    println!("  jobs: {running} running, {queued} queued");
    Ok(ExitCode::SUCCESS)
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let s = settings(&cli.global)?;
    let (client, personal) = connect(&cli.global, &s).await?;
    match cli.cmd {
        None => submit(&cli.global, &s, (&client, personal.as_ref()), cli.run).await,
        Some(Cmd::Ps { all }) => ps(&cli.global, &client, all).await,
        Some(Cmd::Logs { job, follow }) => logs(&client, &job, follow).await,
        Some(Cmd::Kill { job }) => {
            let j = client.kill(&job).await.map_err(explain)?;
            if cli.global.json {
                println!("{}", serde_json::to_string_pretty(&j)?);
            } else if !cli.global.quiet {
                println!("{}: {}", j.id, state_words(&j));
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::Status) => status(&cli.global, &client).await,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(rt) = labsync_cli::start("labrun", "LABSYNC_LOG", "error") else {
        return ExitCode::from(1);
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("labrun: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_variables() {
        assert_eq!(name_part(Path::new("/home/a/My Project")), "My_Project");
        assert_eq!(data_var("div2k"), "LABRUN_DATA_DIV2K");
        assert_eq!(data_var("sr/set14-x4"), "LABRUN_DATA_SET14_X4");
    }

    #[test]
    fn scripts_get_their_interpreter() {
        let dir = tempfile::tempdir().unwrap();
        let code = dir.path().canonicalize().unwrap();
        std::fs::write(code.join("train.py"), "").unwrap();
        std::fs::write(code.join("notes.txt"), "").unwrap();
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            interpret(&v(&["train.py", "--lr", "1"]), &code).unwrap(),
            v(&["python3", "train.py", "--lr", "1"])
        );
        assert_eq!(
            interpret(&v(&["python", "-c", "1"]), &code).unwrap(),
            v(&["python", "-c", "1"])
        );
        assert!(interpret(&v(&["notes.txt"]), &code).is_err());
        assert!(interpret(&[], &code).is_err());
    }
}
