//! `labrun [--data D]... SCRIPT | -- CMD`: push the code (and local data),
//! submit the job to labd, then stream its output until it ends.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use labsync_agent::proto::{DataRef, Info, JobView, SubmitRequest, TreeRef};
use labsync_agent::Client;
use labsync_store::{push, NodeCache, PushOptions, RefSpec, Remote, Repo};

use super::explain_client;
use super::logs::follow;
use crate::local::{hostname, parse_duration, LocalLabd};
use crate::progress::Bar;
use crate::{human_bytes, parse_size, Settings};

/// What `labrun` was asked to run.
#[derive(Clone, Debug, Default)]
pub struct RunRequest {
    /// Stored names or local folders.
    pub data: Vec<String>,
    /// GPUs to lease (default: 1 on a node with GPUs, else 0).
    pub gpus: Option<u32>,
    /// Free memory each GPU must have (`10G`).
    pub gpu_mem: Option<String>,
    /// Folder, relative to the code, saved as `runs/JOB-ID`.
    pub outputs: Option<String>,
    /// How often outputs are saved while the job runs (`10m`).
    pub outputs_every: Option<String>,
    /// Code folder (default: the current one).
    pub code: Option<PathBuf>,
    /// Name the code is stored under (default: `code/USER/FOLDER`).
    pub name: Option<String>,
    /// Submit and print the job id, without streaming.
    pub detach: bool,
    /// Print where the coordinator would place it; submit nothing.
    pub explain: bool,
    /// The script and its arguments, or the command.
    pub command: Vec<String>,
    /// The command came after `--`: run as given, with no interpreter picked.
    pub as_given: bool,
    /// The tier to run at (a cluster's; default the user's own).
    pub priority: Option<String>,
    /// Hold GPUs this long (`2h`) with no command.
    pub hold: Option<String>,
    /// A higher tier's job may stop and requeue it.
    pub preemptible: bool,
    /// Time limit (`2h`; the Slurm backend's).
    pub time: Option<String>,
    /// Where to be told of its end (instead of the config's `notify`).
    pub notify: Vec<String>,
}

impl RunRequest {
    /// `--gpu-mem` in bytes (0: any).
    fn gpu_mem_bytes(&self) -> Result<u64> {
        Ok(self
            .gpu_mem
            .as_deref()
            .map(parse_size)
            .transpose()?
            .unwrap_or(0))
    }
}

/// The labd a command talks to: its client, and the personal labd when
/// labrun found (or started) that one.
#[derive(Clone, Copy)]
pub struct Labd<'a> {
    /// Connected client.
    pub client: &'a Client,
    /// Set when it is the user's personal labd.
    pub personal: Option<&'a LocalLabd>,
}

/// Pushes the code and local data, submits the job and (unless detached)
/// follows it; returns the job's exit code. `store_given`: the user named a
/// store, which labd must then be using.
pub async fn run(
    s: &Settings,
    labd: Labd<'_>,
    store_given: bool,
    quiet: bool,
    json: bool,
    a: RunRequest,
) -> Result<ExitCode> {
    let client = labd.client;
    let info = client.info().await.map_err(explain_client)?;
    let slurm = s.backend == crate::Backend::Slurm;
    if slurm && a.hold.is_some() {
        bail!("--hold leases labd's GPUs; under Slurm, hold GPUs with salloc --gres=gpu:N");
    }
    if slurm && !a.notify.is_empty() {
        bail!("--notify is labd's; under Slurm, Slurm tells of a job's end (sbatch --mail-type END,FAIL --mail-user ...)");
    }
    if a.hold.is_some() && a.time.is_some() {
        bail!("--hold 2h is its own time limit: give --hold or --time, not both");
    }
    if let Some(h) = &a.hold {
        let notify = if a.notify.is_empty() {
            s.notify.clone()
        } else {
            a.notify.clone()
        };
        return hold(client, &info, h, &a, notify, quiet, json).await;
    }
    check_store(s, labd, store_given, &info)?;
    let code = a.code.clone().unwrap_or_else(|| PathBuf::from("."));
    let code = code
        .canonicalize()
        .with_context(|| format!("cannot open code folder {}", code.display()))?;
    let argv = if a.as_given {
        a.command.clone()
    } else {
        interpret(&a.command, &code)?
    };
    let gpus = match a.gpus {
        Some(n) => n,
        // A cluster's nodes have GPUs; the coordinator's own may not.
        None if info.coordinator => 1,
        None => u32::from(!client.gpus().await.map_err(explain_client)?.is_empty()),
    };
    if a.explain && !info.coordinator && !slurm {
        bail!(
            "--explain asks a cluster's coordinator where a job would go; labd at {} is a node \
             of its own (its jobs run there)",
            client.endpoint()
        );
    }
    // Variables that are not UTF-8 cannot travel as JSON strings; they stay behind.
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k != "LABRUN_TOKEN")
        .collect();
    // Said before anything is pushed (labd refuses the same).
    check_size(&argv, &env, a.data.len())?;
    let repo = open_repo(&info, s).await?;
    let code_name = a.name.clone().unwrap_or_else(|| {
        format!(
            "code/{}/{}",
            name_part(Path::new(&info.user)),
            name_part(&code)
        )
    });
    let (code_ref, data) = push_inputs(&repo, s, &info, &code, code_name, &a.data, quiet).await?;
    let req = SubmitRequest {
        argv,
        env,
        code: Some(code_ref.clone()),
        data,
        gpus,
        gpu_mem: a.gpu_mem_bytes()?,
        outputs: a.outputs.clone(),
        outputs_every_s: a.outputs_every.as_deref().map(parse_duration).transpose()?,
        priority: a.priority.clone(),
        hold_s: None,
        preemptible: a.preemptible,
        time_limit_s: a.time.as_deref().map(parse_duration).transpose()?,
        restarts: 0,
        resume_from: None,
        // Under Slurm, Slurm tells (its --mail-type); the config's are labd's.
        notify: match (slurm, a.notify.is_empty()) {
            (true, _) => Vec::new(),
            (false, true) => s.notify.clone(),
            (false, false) => a.notify.clone(),
        },
    };
    if slurm {
        let run = crate::slurm::submit::SlurmRun {
            time_s: a.time.as_deref().map(parse_duration).transpose()?,
            explain: a.explain,
            detach: a.detach,
        };
        return crate::slurm::submit::submit(s, client, &info, req, run, quiet, json).await;
    }
    if a.explain {
        let ranking = client.explain(&req).await.map_err(explain_client)?;
        print_ranking(&ranking, gpus, json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let job = client.submit(&req).await.map_err(explain_client)?;
    if a.detach {
        println!("{}", job.id);
        return Ok(ExitCode::SUCCESS);
    }
    if !quiet {
        say_where(&job, &info, &code_ref.label, gpus);
    }
    follow(client, &job.id, quiet, true).await
}

/// Pushes the code and names the data. The code push and the stored
/// datasets' lookups (a round trip or more each to the store) go at once;
/// a local folder's push comes after the code's, so two progress bars
/// never share the terminal.
async fn push_inputs(
    repo: &Repo,
    s: &Settings,
    info: &Info,
    code: &Path,
    code_name: String,
    data: &[String],
    quiet: bool,
) -> Result<(TreeRef, Vec<DataRef>)> {
    let code_push = push_tree(repo, s, code, code_name, &info.user, quiet);
    if data.iter().any(|d| Path::new(d).is_dir()) {
        let code_ref = code_push.await?;
        Ok((code_ref, data_refs(repo, s, info, data, quiet).await?))
    } else {
        let (c, d) = tokio::join!(code_push, data_refs(repo, s, info, data, quiet));
        Ok((c?, d?))
    }
}

/// `labrun --explain`'s answer: the placer's table, or its JSON.
fn print_ranking(ranking: &labsync_placer::Ranking, gpus: u32, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(ranking)?);
    } else {
        print!("{}", ranking_table(ranking, gpus));
    }
    Ok(())
}

/// Where the job went, on stderr: its node, or the cluster's queue.
pub(crate) fn say_where(job: &JobView, info: &Info, code: &str, gpus: u32) {
    let place = match (&job.node, info.coordinator) {
        (Some(n), _) => n.to_string(),
        (None, true) => format!("the cluster of {}", info.node),
        (None, false) => info.node.to_string(),
    };
    eprintln!(
        "labrun: job {} on {} ({code}, {} GPU{})",
        job.id,
        place,
        gpus,
        if gpus == 1 { "" } else { "s" }
    );
}

/// `labrun --hold 2h`: leases GPUs with no command, waits until they are
/// the user's and says which, for the user's own shell.
async fn hold(
    client: &Client,
    info: &Info,
    length: &str,
    a: &RunRequest,
    notify: Vec<String>,
    quiet: bool,
    json: bool,
) -> Result<ExitCode> {
    if !a.command.is_empty() || !a.data.is_empty() || a.outputs.is_some() || a.explain {
        bail!(
            "--hold leases GPUs for your own shell: give no command, --data, --outputs or \
             --explain with it (labrun --hold 2h --gpus 1)"
        );
    }
    let secs = parse_duration(length)?;
    let gpus = a.gpus.unwrap_or(1);
    if gpus == 0 {
        bail!("--hold --gpus 0 would hold nothing; ask for 1 or more GPUs");
    }
    let req = SubmitRequest {
        argv: vec!["sleep".into(), secs.to_string()],
        gpus,
        gpu_mem: a.gpu_mem_bytes()?,
        priority: a.priority.clone(),
        hold_s: Some(secs),
        // Told when it is given back for idling.
        notify,
        ..Default::default()
    };
    let job = client.submit(&req).await.map_err(explain_client)?;
    if a.detach {
        println!("{}", job.id);
        return Ok(ExitCode::SUCCESS);
    }
    if !quiet {
        eprintln!("labrun: hold {} queued; waiting for {gpus} GPU(s)…", job.id);
    }
    let job = loop {
        let j = client.job(&job.id).await.map_err(explain_client)?;
        match j.state {
            labsync_agent::JobState::Running { .. } => break j,
            _ if j.ended() => bail!("hold {} ended before it started: {:?}", j.id, j.state),
            _ => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
        }
    };
    let node = job.node.clone().unwrap_or_else(|| info.node.clone());
    let list = job
        .gpus
        .iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",");
    if json {
        println!("{}", serde_json::to_string_pretty(&job)?);
    } else {
        println!("held on {node}: export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={list}");
    }
    if !quiet {
        eprintln!(
            "labrun: hold {} has GPU(s) {list} of {node} for {length}; GPUs that show no \
             utilisation for labd's idle time (30 min unless the lab set otherwise) are given \
             back; `labrun kill {}` gives them back now",
            job.id, job.id
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The placer's answer as a table: one row per node, the chosen first.
pub fn ranking_table(r: &labsync_placer::Ranking, gpus: u32) -> String {
    use labsync_placer::{GpuWait, Verdict};
    let secs = |s: f64| {
        if s < 0.05 {
            "now".to_string()
        } else {
            format!("{s:.1} s")
        }
    };
    let mut out = match &r.choice {
        Some(c) => format!(
            "would go to {} (GPU{} {:?}){}, start {}\n",
            c.node,
            if c.gpus.len() == 1 { "" } else { "s" },
            c.gpus,
            if c.gpus_free_now {
                ""
            } else {
                " once its GPUs free up"
            },
            if c.start_secs < 0.05 {
                "now".to_string()
            } else {
                format!("in {:.1} s", c.start_secs)
            }
        ),
        None => format!("no node can start it now ({gpus} GPU(s)): it would wait in the queue\n"),
    };
    out += &format!(
        "{:<12} {:>9}  {:<10} {:>10} {:>10} {:>10} {:>9}  {}\n",
        "node", "GPUs free", "GPU wait", "to fetch", "from peers", "from store", "start", "verdict"
    );
    for row in &r.rows {
        let wait = match &row.gpu_wait {
            GpuWait::Now => "now".to_string(),
            GpuWait::In { secs: s } => secs(*s),
            GpuWait::Unknown { .. } => "unknown".to_string(),
            GpuWait::Never { .. } => "never".to_string(),
        };
        let verdict = match (&row.verdict, &row.gpu_wait) {
            (Verdict::Chosen, _) => "CHOSEN".to_string(),
            (Verdict::Later { by_secs }, _) => format!("{by_secs:.1} s later"),
            (Verdict::TieLost { why }, _) => why.clone(),
            (Verdict::Down { .. }, _) => "node down".to_string(),
            (_, GpuWait::Unknown { why } | GpuWait::Never { why }) => why.clone(),
            (v, _) => format!("{v:?}"),
        };
        out += &format!(
            "{:<12} {:>9}  {:<10} {:>10} {:>10} {:>10} {:>9}  {}\n",
            row.node.as_str(),
            format!("{}/{}", row.gpus_free, row.gpus_fit),
            wait,
            human_bytes(row.missing_bytes),
            human_bytes(row.from_peers),
            human_bytes(row.from_store),
            row.start_secs.map_or("-".to_string(), secs),
            verdict
        );
    }
    out
}

/// The store labrun pushes code to is labd's; a mismatch with what the
/// user asked for (or, for the personal labd, configured since it
/// started) is said, not silently followed.
fn check_store(s: &Settings, labd: Labd<'_>, store_given: bool, info: &Info) -> Result<()> {
    if !(store_given || labd.personal.is_some()) || s.store == info.store {
        return Ok(());
    }
    let hint = match labd.personal {
        Some(local) => format!(
            "stop it (kill $(cat {})) and labrun starts one with your settings",
            local.state_dir.join("labd.pid").display()
        ),
        None => "run with its store or use another labd".into(),
    };
    bail!(
        "labd at {} uses store {}, not {}: {hint}",
        labd.client.endpoint(),
        info.store,
        s.store
    );
}

/// Each `--data`: a local folder is pushed (as `data/USER/FOLDER`), a
/// stored name resolved; the job sees each at `$LABRUN_DATA_<NAME>`.
async fn data_refs(
    repo: &Repo,
    s: &Settings,
    info: &Info,
    data: &[String],
    quiet: bool,
) -> Result<Vec<DataRef>> {
    let mut out = Vec::new();
    for d in data {
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
            push_tree(repo, s, &p, name, &info.user, quiet).await?
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
                snapshot: rec.snapshot,
            }
        };
        let name = tree.label.split('@').next().unwrap_or_default().to_string();
        out.push(DataRef {
            env: data_var(&name),
            tree,
        });
    }
    Ok(out)
}

/// The command and environment within what labd takes
/// ([`labsync_agent::MAX_COMMAND_BYTES`], [`labsync_agent::MAX_DATASETS`]);
/// past it, the error names the largest variables.
pub(crate) fn check_size(argv: &[String], env: &[(String, String)], datasets: usize) -> Result<()> {
    use labsync_agent::{command_bytes, variable_bytes, MAX_COMMAND_BYTES, MAX_DATASETS};
    if datasets > MAX_DATASETS {
        bail!("{datasets} datasets: at most {MAX_DATASETS} per job");
    }
    let bytes = command_bytes(argv, env);
    if bytes > MAX_COMMAND_BYTES {
        let mut big: Vec<&(String, String)> = env.iter().collect();
        big.sort_by_key(|kv| std::cmp::Reverse(variable_bytes(kv)));
        let big: Vec<String> = big
            .iter()
            .take(5)
            .map(|kv| format!("{} ({} bytes)", kv.0, variable_bytes(kv)))
            .collect();
        bail!(
            "the command and your environment take {bytes} bytes, and a job's may take at most \
             {} KiB; the largest variables are {}: unset the ones the job does not need \
             (env -u NAME labrun …), or put a long script in a file of the code",
            MAX_COMMAND_BYTES >> 10,
            big.join(", ")
        );
    }
    Ok(())
}

pub(crate) async fn open_repo(info: &Info, s: &Settings) -> Result<Repo> {
    let remote = Remote::open(&info.store, &s.store_options)
        .with_context(|| format!("cannot open labd's store {}", info.store))?;
    super::refuse_shared_local_store_as_root(&remote).await?;
    let repo = Repo::open(remote, None)
        .await
        .with_context(|| format!("cannot open labd's store {}", info.store))?;
    Ok(super::with_seen(repo, &s.cache_dir))
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
    // Index objects read before come from the cache (see `labsync push`).
    let repo = &repo
        .clone()
        .with_index_cache(Some(cache.index_dir(&repo.config().id)));
    let opts = PushOptions {
        name,
        files_cache: Some(cache.files_cache_dir()),
        threads: 2,
        user: user.to_string(),
        host: hostname(),
        read_as: None,
        settle: None,
        compression: s.compression,
        provenance: None,
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
        snapshot: out.record.snapshot,
    })
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
