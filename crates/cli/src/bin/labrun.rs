//! `labrun`: run a job on a lab GPU server, with its code and data.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use labsync_cli::commands::run::{Labd, RunRequest};
use labsync_cli::commands::{self};
use labsync_cli::local::connect;
use labsync_cli::{slurm, Backend, Overrides, Settings};

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
GPUs are free it waits; `labrun ps` says why. One labd serves first come,
first served; a cluster's coordinator goes by the lab's tiers (--priority),
then by who used the least GPU time lately, then first come.

A script that is a file runs with its interpreter (train.py: python3, x.sh:
bash, an executable: itself); after `--`, any command runs as given.

labrun streams the job's output and exits with its exit code. Ctrl-C once
shows the job's state and leaves it running; Ctrl-C again within a second
kills it (as with srun). If labrun itself goes away, the job keeps running:
`labrun logs -f JOB` reattaches. --outputs DIR is pushed to the store as
runs/<job-id> every few minutes and when the job ends, however it ends:
`labsync pull runs/<job-id>` gets the checkpoints back.

In a cluster, point labrun at the coordinator: it places each job on the
node where it can start soonest (free GPUs, and its code and data cached
there or quickly fetched); `labrun --explain ...` shows that choice per node
without submitting, and ps, logs, kill and status cover every node.

Where the lab runs Slurm, `--backend slurm` (or backend = \"slurm\" in the
config file) submits the job with sbatch instead: the coordinator ranks
Slurm's nodes by free GPUs and cached data, sbatch --prefer names the best
that can start it now (Slurm still decides), and on the node the job's
first step stages the code and data through that node's labd, runs the
command with the GPUs Slurm granted and saves --outputs as runs/slurm-ID,
also on scancel and before --time runs out. ps, logs and kill then map to
squeue, the job's output file and scancel.

labd is found at --labd, LABRUN_LABD, `labd` in the config file, the system
socket /run/labsync/labd.sock, or else a personal labd that labrun starts in
the background (state in ~/.local/state/labsync/labd). A shared labd needs
your token: LABRUN_TOKEN or `token` in ~/.config/labsync/config.toml. An
https:// labd's certificate is checked against LABRUN_CA (the lab's CA file,
or `labd_ca` in the config file), else the system's roots.

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
    /// labd to use: unix:///path/labd.sock, http://host:port or https://host:port
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
    /// Who runs the job: labd (default) or slurm (sbatch --prefer the nodes
    /// whose labd caches hold its data; ps, logs and kill then map to
    /// squeue, the job's output file and scancel) [config: backend]
    #[arg(long, global = true, env = "LABRUN_BACKEND", value_name = "labd|slurm")]
    backend: Option<String>,
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
    /// Hold GPUs for your own shell this long (2h, 30m), with no command:
    /// prints the node and CUDA_VISIBLE_DEVICES; GPUs that show no
    /// utilisation for labd's idle time (30 min) are given back early
    #[arg(long, value_name = "DURATION")]
    hold: Option<String>,
    /// A higher tier's job may stop this one (SIGTERM, then SIGKILL after
    /// labd's grace; --outputs pushed as always) and requeue it: the new
    /// run sees LABRUN_RESTARTS (1, 2, …) and LABRUN_RESUME_FROM (the
    /// outputs saved, runs/JOB@vN#SNAPSHOT: `labsync pull` it, and a
    /// version rewritten since is refused) to resume from its checkpoint
    #[arg(long)]
    preemptible: bool,
    /// Where labd tells you that it ended, failed or was preempted: a
    /// webhook URL (Slack, Mattermost, Discord: on hosts labd's notify hosts
    /// allow) or mailto:you@lab; repeatable [config: notify] [env:
    /// LABRUN_NOTIFY]
    #[arg(long, value_name = "URL|mailto:ADDR")]
    notify: Vec<String>,
    /// Run at this tier of the lab's ladder (lead, deadline, phd, master,
    /// undergrad by default): your own or a lower one, or `deadline` while
    /// an admin's grant runs [default: your own tier]. A cluster's
    /// coordinator orders its queue by tier, then by GPU time used lately
    #[arg(long, value_name = "TIER")]
    priority: Option<String>,
    /// Time limit (90m, 12h, 2d): at the limit labd sends SIGTERM, saves
    /// --outputs, and SIGKILLs what is left after its grace; `labrun ps`
    /// says it ran out of time. A cluster gives a job without one its
    /// tier's default (the lab's time_limits), and plans with it: a job whose
    /// limit ends before a reserved big job starts may use the reserved
    /// GPUs meanwhile. Under Slurm: sbatch --time (whole minutes; SIGTERM
    /// [slurm] grace before it, at most half of it)
    #[arg(long, value_name = "DURATION")]
    time: Option<String>,
    /// Submit nothing: print where the cluster's coordinator would place
    /// the job and, per node, when it could start there and why not there
    /// (GPU wait, bytes to fetch from peers and the store)
    #[arg(long)]
    explain: bool,
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
    Status {
        /// Keep the grid on screen, refreshed every 2 s (Ctrl-C ends it)
        #[arg(short, long)]
        watch: bool,
    },
    /// Why a job waits, in one line, and in a cluster every node's row for
    /// it: when it could start there, bytes to fetch, why not there
    Explain {
        /// Job id
        job: String,
    },
    /// Run a job again: the same command on the same code and data
    /// snapshots (by id, not by a name looked up again), with the same GPUs,
    /// GPU memory and outputs; your environment of now. Its outputs go to
    /// runs/NEW-ID
    #[command(
        after_help = "Examples:\n  labrun rerun j7\n  labrun rerun j7 --data div2k@v4   \
                            # the same run on another version of div2k"
    )]
    Rerun {
        /// The job to run again (labrun ps --all lists them)
        job: String,
        /// NAME@vN: that version of the job's dataset NAME instead (repeat for more)
        #[arg(long, value_name = "NAME@vN")]
        data: Vec<String>,
        /// Tier to run at (default: your own)
        #[arg(long)]
        priority: Option<String>,
        /// Print the new job's id and return
        #[arg(short, long)]
        detach: bool,
    },
    /// The lab's rules on the coordinator, changed at once with no restart
    /// and kept with who changed what (admins): deadline grants, users'
    /// tiers, the per-user GPU cap. The config file's lab values are the
    /// defaults these change
    #[command(
        after_help = "Examples:\n  labrun admin grant alice deadline --until 2026-12-20\n  \
                      labrun admin tier bob phd\n  labrun admin cap 8\n  labrun admin show"
    )]
    Admin {
        #[command(subcommand)]
        what: commands::admin::Ask,
    },
    /// The batch script's step of a Slurm job (labrun --backend slurm writes it)
    #[command(name = "_slurm-job", hide = true)]
    SlurmJob {
        /// The job, as labrun submitted it (JSON)
        spec: String,
    },
}

fn settings(g: &Global) -> Result<Settings> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    let mut s = Settings::resolve(
        &Overrides {
            store: g.store.clone(),
            cache_dir: g.cache_dir.clone(),
            config: g.config.clone(),
            ..Default::default()
        },
        &env,
    )?;
    if let Some(b) = &g.backend {
        s.backend = b.parse()?;
    }
    Ok(s)
}

impl RunArgs {
    /// The request, with whether the command came after `--` (then it runs
    /// as given; clap drops the `--` itself, so the raw arguments tell).
    fn request(self, raw: &[String]) -> RunRequest {
        let as_given = raw
            .iter()
            .position(|x| x == "--")
            .is_some_and(|i| raw.get(i + 1) == self.command.first());
        RunRequest {
            data: self.data,
            gpus: self.gpus,
            gpu_mem: self.gpu_mem,
            outputs: self.outputs,
            outputs_every: self.outputs_every,
            code: self.code,
            name: self.name,
            detach: self.detach,
            explain: self.explain,
            command: self.command,
            as_given,
            priority: self.priority,
            hold: self.hold,
            preemptible: self.preemptible,
            time: self.time,
            notify: self.notify,
        }
    }
}

/// Resolves the settings, finds labd, then runs the one command.
async fn run(cli: Cli) -> Result<ExitCode> {
    let g = &cli.global;
    let s = settings(g)?;
    if let Some(Cmd::SlurmJob { spec }) = &cli.cmd {
        return slurm::job::run(&s, spec).await;
    }
    if s.backend == Backend::Slurm {
        let sl = slurm::Slurm::new(s.slurm.timeout);
        match &cli.cmd {
            Some(Cmd::Ps { all }) => return slurm::manage::ps(&sl, g.json, *all).await,
            Some(Cmd::Logs { job, follow }) => return slurm::manage::logs(&sl, job, *follow).await,
            Some(Cmd::Kill { job }) => return slurm::manage::kill(&sl, job, g.quiet).await,
            _ => {}
        }
    }
    let (client, personal) = connect(g.labd.clone(), &s, g.quiet).await?;
    match cli.cmd {
        None => {
            let labd = Labd {
                client: &client,
                personal: personal.as_ref(),
            };
            let raw: Vec<String> = std::env::args().collect();
            let req = cli.run.request(&raw);
            commands::run::run(&s, labd, g.store.is_some(), g.quiet, g.json, req).await
        }
        Some(Cmd::Ps { all }) => commands::ps::ps(&client, g.json, all).await,
        Some(Cmd::Logs { job, follow }) => commands::logs::logs(&client, &job, follow).await,
        Some(Cmd::Kill { job }) => commands::kill::kill(&client, g.json, g.quiet, &job).await,
        Some(Cmd::Status { watch }) => commands::status::watch(&client, g.json, watch).await,
        Some(Cmd::Explain { job }) => commands::explain::explain(&client, g.json, &job).await,
        Some(Cmd::Rerun {
            job,
            data,
            priority,
            detach,
        }) => {
            let a = commands::rerun::Rerun {
                job,
                data,
                priority,
                detach,
            };
            commands::rerun::rerun(&s, &client, g.quiet, a).await
        }
        Some(Cmd::Admin { what }) => commands::admin::admin(&client, g.json, what).await,
        Some(Cmd::SlurmJob { .. }) => unreachable!("run before labd is looked for"),
    }
}

/// The arguments with global options given before a subcommand moved
/// after it: clap stops looking for subcommands at the first option it
/// sees (the run's options and subcommands conflict), so `labrun --backend
/// slurm ps` would otherwise run `ps` as a job.
fn subcommand_first(args: Vec<String>) -> Vec<String> {
    const VALUED: [&str; 5] = ["--labd", "--config", "--store", "--cache-dir", "--backend"];
    const FLAGS: [&str; 3] = ["-q", "--quiet", "--json"];
    const SUBCOMMANDS: [&str; 9] = [
        "ps",
        "admin",
        "rerun",
        "logs",
        "kill",
        "status",
        "explain",
        "help",
        "_slurm-job",
    ];
    let mut i = 1;
    while i < args.len() {
        let a = args[i].as_str();
        if VALUED.contains(&a) {
            i += 2;
        } else if FLAGS.contains(&a) || VALUED.iter().any(|v| a.starts_with(&format!("{v}="))) {
            i += 1;
        } else {
            break;
        }
    }
    if i == 1 || i >= args.len() || !SUBCOMMANDS.contains(&args[i].as_str()) {
        return args;
    }
    let mut out = vec![args[0].clone(), args[i].clone()];
    out.extend_from_slice(&args[1..i]);
    out.extend_from_slice(&args[i + 1..]);
    out
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(subcommand_first(std::env::args().collect()));
    let Some(rt) = labsync_cli::start("labrun", "LABSYNC_LOG", "error") else {
        return ExitCode::from(1);
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("labrun: error: {}", labsync_cli::said_error(&e));
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::subcommand_first;

    fn v(a: &str) -> Vec<String> {
        a.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn global_options_before_a_subcommand_stay_with_it() {
        assert_eq!(
            subcommand_first(v("labrun --backend slurm ps --all")),
            v("labrun ps --backend slurm --all")
        );
        assert_eq!(
            subcommand_first(v("labrun --json -q kill j1")),
            v("labrun kill --json -q j1")
        );
        assert_eq!(
            subcommand_first(v("labrun --labd=http://x:1 logs j1")),
            v("labrun logs --labd=http://x:1 j1")
        );
        // A run stays a run, whatever its command is called.
        for same in [
            "labrun --data div2k ps",
            "labrun train.py",
            "labrun --backend slurm -- ps",
            "labrun ps",
        ] {
            assert_eq!(subcommand_first(v(same)), v(same));
        }
    }
}
