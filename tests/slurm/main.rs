//! The Slurm backend against a real Slurm (Debian's 22.05.8 packages): one
//! munged, one slurmctld and a slurmd per node on this host
//! (`NodeName=gpuN NodeHostname=localhost Port=…`, `slurmd -N gpuN`), fake
//! GPUs as GRES (`File=` links to /dev/null), beside the cluster's three
//! labd processes named as the Slurm nodes are.
//!
//! Where Slurm is not installed these tests say so and pass outside CI
//! (`scripts/test.sh` installs it, and says at its end when it could not);
//! in CI a missing Slurm fails them.
//!
//! A test binary of its own: its Slurm daemons never compete for the CPU
//! with the cluster's timing-sensitive tests.

#[path = "../../crates/store/tests/support/mod.rs"]
mod support;

#[path = "../common/mod.rs"]
mod common;

#[path = "../cluster/lab.rs"]
mod lab;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::wait_until;
use lab::{present, Lab};
use support::free_port;

const PROGRAMS: [&str; 8] = [
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "squeue",
    "scontrol",
    "scancel",
];

fn installed(prog: &str) -> bool {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|d| d.join(prog).is_file())
}

/// A Slurm of its own: munged, slurmctld and one slurmd per node, each a
/// child process, ended when dropped.
pub struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    munged: Child,
    ctld: Option<Child>,
    slurmds: Vec<Child>,
}

impl Slurm {
    /// Starts it for `nodes` (2 GPUs each, feature `lsn_<node>`); `None`
    /// (said) where Slurm is not installed, outside CI.
    pub fn start(nodes: &[&str]) -> Option<Slurm> {
        if let Some(missing) = PROGRAMS.iter().find(|p| !installed(p)) {
            let why = format!(
                "{missing} is not installed; scripts/test.sh installs Slurm (apt-get install \
                 slurmctld slurmd slurm-client munge)"
            );
            assert!(std::env::var_os("CI").is_none(), "Slurm tests: {why}");
            eprintln!("SKIPPED: the Slurm tests need a real Slurm: {why}");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        for sub in ["state", "spool", "dev"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let ok = Command::new("mungekey")
            .args(["-c", "-k"])
            .arg(d.join("munge.key"))
            .status()
            .unwrap()
            .success();
        assert!(ok, "mungekey");
        let sock = d.join("munge.sock");
        let munged = Command::new("munged")
            .args(["-F", "-f", "-S"])
            .arg(&sock)
            .arg(format!("--key-file={}", d.join("munge.key").display()))
            .arg(format!("--pid-file={}", d.join("munged.pid").display()))
            .arg(format!("--log-file={}", d.join("munged.log").display()))
            .arg(format!("--seed-file={}", d.join("munged.seed").display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_until("munged's socket", 10, || sock.exists());
        let mut conf = format!(
            "ClusterName=labsync\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={ctld}\n\
             AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={sock}\n\
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n\
             SlurmUser=root\nSlurmdUser=root\nProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
             GresTypes=gpu\nSchedulerType=sched/backfill\nSlurmdParameters=config_overrides\n\
             ReturnToService=2\nMpiDefault=none\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n\
             KillWait=10\nMinJobAge=600\n",
            ctld = free_port(),
            sock = sock.display(),
            d = d.display(),
        );
        let mut gres = String::from("AutoDetect=off\n");
        for n in nodes {
            for g in 0..2 {
                std::os::unix::fs::symlink("/dev/null", d.join(format!("dev/{n}-gpu{g}"))).unwrap();
            }
            conf += &format!(
                "NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=4 \
                 RealMemory=1000 Gres=gpu:2 Feature=lsn_{n} State=UNKNOWN\n",
                port = free_port()
            );
            gres += &format!(
                "NodeName={n} Name=gpu File={}/dev/{n}-gpu[0-1]\n",
                d.display()
            );
        }
        conf += &format!(
            "PartitionName=gpu Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
            nodes.join(",")
        );
        let path = d.join("slurm.conf");
        std::fs::write(&path, conf).unwrap();
        std::fs::write(d.join("gres.conf"), gres).unwrap();
        let mut s = Slurm {
            conf: path,
            munged,
            ctld: None,
            slurmds: Vec::new(),
            dir,
        };
        s.start_ctld();
        for n in nodes {
            let child = s.daemon("slurmd").args(["-D", "-N", n]).spawn().unwrap();
            s.slurmds.push(child);
        }
        wait_until("every Slurm node idle", 60, || {
            std::thread::sleep(Duration::from_millis(200));
            let o = s
                .cmd("sinfo")
                .args(["-h", "-N", "-o", "%T"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.lines().count() == nodes.len() && text.lines().all(|l| l.trim() == "idle")
        });
        Some(s)
    }

    fn daemon(&self, prog: &str) -> Command {
        let mut c = self.cmd(prog);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{prog}.out")))
            .unwrap();
        c.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        c
    }

    fn start_ctld(&mut self) {
        self.ctld = Some(self.daemon("slurmctld").args(["-D", "-i"]).spawn().unwrap());
    }

    /// Stops slurmctld (the nodes' slurmd keep running).
    pub fn stop_ctld(&mut self) {
        if let Some(mut c) = self.ctld.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A Slurm command with this Slurm's config.
    pub fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `sbatch --parsable ARGS` of a job of the test's own (not labrun's):
    /// its id.
    pub fn sbatch(&self, args: &[&str]) -> String {
        let o = self
            .cmd("sbatch")
            .arg("--parsable")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap().trim().to_string()
    }

    /// Takes both GPUs of `node` with a job of someone else's (running
    /// when this returns): its id.
    pub fn block(&self, node: &str) -> String {
        let id = self.sbatch(&[
            "-w",
            node,
            "--gres=gpu:2",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 300",
        ]);
        assert_eq!(self.running_on(&id, 60), node);
        id
    }

    /// `SLURM_CONF` for labrun.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// `scontrol show job ID` as `Key=Value` pairs ("" for keys it lacks).
    pub fn job_field(&self, id: &str, key: &str) -> String {
        let o = self
            .cmd("scontrol")
            .args(["-o", "show", "job", id])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
            .unwrap_or_default()
    }

    /// Waits until job `id` runs; its node (`squeue -o %N`).
    pub fn running_on(&self, id: &str, secs: u64) -> String {
        let mut node = String::new();
        wait_until(&format!("Slurm job {id} to run"), secs, || {
            std::thread::sleep(Duration::from_millis(100));
            let o = self
                .cmd("squeue")
                .args(["-h", "-j", id, "-o", "%T %N"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&o.stdout).trim().to_string();
            match text.split_once(' ') {
                Some(("RUNNING", n)) => {
                    node = n.to_string();
                    true
                }
                _ => false,
            }
        });
        node
    }

    /// Waits until job `id` has ended; its final state.
    pub fn ended(&self, id: &str, secs: u64) -> String {
        let mut state = String::new();
        wait_until(&format!("Slurm job {id} to end"), secs, || {
            std::thread::sleep(Duration::from_millis(200));
            state = self.job_field(id, "JobState");
            // "": scontrol did not answer this time.
            !matches!(
                state.as_str(),
                "" | "PENDING" | "RUNNING" | "COMPLETING" | "CONFIGURING"
            )
        });
        state
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Jobs still running (blockers, `sleep 600`s, the command of a step
        // whose labrun was killed, which proctrack/linuxproc loses) would
        // outlive the test by minutes, as would their slurmstepd. Every
        // process of this Slurm, daemons included, has its SLURM_CONF in
        // its environment: all are killed, twice over in case one forked.
        let mine = format!("SLURM_CONF={}", self.conf.display());
        for _ in 0..2 {
            let pids = pids_with_env(mine.as_bytes());
            if !pids.is_empty() {
                let _ = Command::new("kill")
                    .arg("-KILL")
                    .args(pids.iter().map(u32::to_string))
                    .stderr(Stdio::null())
                    .status();
            }
        }
        for c in self.slurmds.iter_mut().chain(self.ctld.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.munged.kill();
        let _ = self.munged.wait();
    }
}

/// Processes (not this one) whose environment holds `var` (`NAME=value`).
fn pids_with_env(var: &[u8]) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == var))
        })
        .collect()
}

/// The `[slurm]` section every labd gets: Slurm's commands (the nodes
/// check each stage's job with `scontrol`) use this Slurm.
fn slurm_section(slurm: &Slurm, more: &str) -> String {
    format!(
        "[slurm]\nconf = \"{}\"\ntimeout_s = 5\n{more}",
        slurm.conf().display()
    )
}

/// `labrun --backend slurm ARGS` as alice, against the coordinator.
fn labrun(lab: &Lab, slurm: &Slurm, args: &[&str]) -> Output {
    let mut full = vec!["--backend", "slurm"];
    full.extend_from_slice(args);
    lab.labrun_cmd(&full)
        .env("SLURM_CONF", slurm.conf())
        .env("LABRUN_SLURM_TIMEOUT", "5s")
        .output()
        .unwrap()
}

fn ok(lab: &Lab, slurm: &Slurm, args: &[&str]) -> String {
    let o = labrun(lab, slurm, args);
    assert!(
        o.status.success(),
        "labrun --backend slurm {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// The file `name` of the outputs job `job` saved (`runs/<job>`), pulled.
fn saved(lab: &Lab, job: &str, name: &str) -> String {
    let out = lab.dir.path().join(format!("{job}-out"));
    lab.labsync(0, &["pull", &format!("runs/{job}"), out.to_str().unwrap()]);
    std::fs::read_to_string(out.join(name)).unwrap()
}

/// `slurm-N` → `N`.
fn id_of(job: &str) -> String {
    job.trim()
        .strip_prefix("slurm-")
        .expect("slurm-N")
        .to_string()
}

/// What the test jobs print: where they ran, the GPUs they were given,
/// whether the data is the pushed tree byte for byte and read-only.
fn probe(original: &Path) -> String {
    format!(
        "echo node=$LABRUN_NODE job=$LABRUN_JOB_ID cvd=$CUDA_VISIBLE_DEVICES \
         granted=$SLURM_JOB_GPUS; diff -r --no-dereference \"$LABRUN_DATA_DIV2K\" {orig} >/dev/null && \
         echo data=identical; test -z \"$(find \"$LABRUN_DATA\" ! -type l -perm /222)\" && \
         echo data=read-only; sleep 2",
        orig = original.display()
    )
}

fn check_probe(log: &str, node: &str, job: &str) {
    assert!(log.contains(&format!("node={node} job={job} ")), "{log}");
    let cvd = log
        .split_whitespace()
        .find_map(|w| w.strip_prefix("cvd="))
        .expect("cvd=");
    let granted = log
        .split_whitespace()
        .find_map(|w| w.strip_prefix("granted="))
        .expect("granted=");
    assert!(
        !cvd.is_empty() && cvd == granted,
        "CUDA_VISIBLE_DEVICES {cvd:?}, Slurm granted {granted:?}: {log}"
    );
    assert!(log.contains("data=identical"), "{log}");
    assert!(log.contains("data=read-only"), "{log}");
}

/// The tests 1, 2, 3 and 5:
///
/// 1. with GPUs free everywhere the job lands on the node whose cache
///    holds its data;
/// 2. with that node's GPUs taken it starts elsewhere at once (that node is
///    not preferred), and the data follows;
/// 3. the staged data is the pushed tree byte for byte, read-only, and
///    CUDA_VISIBLE_DEVICES is what Slurm granted;
/// 5. with slurmctld stopped labrun fails within its timeout and says what
///    to check.
#[test]
fn slurm_jobs_go_where_their_data_is_and_fail_fast_without_slurmctld() {
    let Some(mut slurm) = Slurm::start(&["gpu0", "gpu1", "gpu2"]) else {
        return;
    };
    let Some(lab) = Lab::start_full(3, false, "", &slurm_section(&slurm, "")) else {
        return;
    };
    let div2k = lab.dataset("div2k", 7);
    lab.cache_on(1, "div2k");
    let script = probe(&div2k);

    // 1: everything free; gpu1 holds div2k.
    let explain = ok(
        &lab,
        &slurm,
        &["--explain", "--data", "div2k", "--", "sh", "-c", &script],
    );
    assert!(explain.contains(" --prefer=lsn_gpu1 "), "{explain}");
    let job = ok(
        &lab,
        &slurm,
        &["-d", "--data", "div2k", "--", "sh", "-c", &script],
    );
    let id = id_of(&job);
    assert_eq!(slurm.running_on(&id, 60), "gpu1");
    assert_eq!(slurm.ended(&id, 120), "COMPLETED");
    let log = ok(&lab, &slurm, &["logs", job.trim()]);
    // 3: on the node it ran on, as Slurm granted.
    check_probe(&log, "gpu1", job.trim());

    // 2: gpu1's GPUs taken by a job of someone else's.
    let blocker = slurm.block("gpu1");
    let t = Instant::now();
    let job = ok(
        &lab,
        &slurm,
        &["-d", "--data", "div2k", "--", "sh", "-c", &script],
    );
    let id = id_of(&job);
    let node = slurm.running_on(&id, 60);
    eprintln!(
        "with the data's node busy, the job started on {node} {:.1} s after labrun was run",
        t.elapsed().as_secs_f64()
    );
    assert!(node == "gpu0" || node == "gpu2", "{node}");
    // Not preferred: it started at once, not after a backfill pass.
    let features = slurm.job_field(&id, "Features");
    assert!(!features.contains("lsn_gpu1"), "{features}");
    assert_eq!(slurm.ended(&id, 120), "COMPLETED");
    check_probe(&ok(&lab, &slurm, &["logs", job.trim()]), &node, job.trim());
    // The data followed: that node's cache holds it now.
    lab.wait_for(&format!("div2k cached on {node}"), 20, |s| {
        present(s, &node, "div2k@v1").is_some_and(|(h, t)| h == t)
    });
    // Slurm's fallback, which labrun avoids by never preferring a busy
    // node: a job that prefers gpu1 anyway waits for a backfill pass, then
    // starts elsewhere (a soft preference, never a pin).
    let t = Instant::now();
    let direct = slurm.sbatch(&[
        "--prefer=lsn_gpu1",
        "--gres=gpu:1",
        "-o",
        "/dev/null",
        "--wrap",
        "true",
    ]);
    slurm.ended(&direct, 120);
    let ran_on = slurm.job_field(&direct, "NodeList");
    eprintln!(
        "a job preferring the busy gpu1 ran on {ran_on} after {:.1} s (Slurm's fallback)",
        t.elapsed().as_secs_f64()
    );
    assert!(ran_on == "gpu0" || ran_on == "gpu2", "{ran_on}");
    // A node stages only for a Slurm job running there (checked with
    // squeue): not for a job of another node, not for one Slurm lacks, not
    // for one whose name plants the fields `scontrol show job` prints.
    let planted = slurm.sbatch(&[
        "-w",
        "gpu1",
        "--job-name",
        "x JobState=RUNNING BatchHost=gpu2",
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 300",
    ]);
    assert_eq!(slurm.running_on(&planted, 60), "gpu1");
    let spec = format!(
        "{{\"labd\":\"{}\",\"argv\":[\"true\"],\"code\":null,\"data\":[],\
         \"outputs\":null,\"outputs_every_s\":300}}",
        lab.url(0)
    );
    for (job, node, says) in [
        (blocker.as_str(), "gpu2", "runs on \"gpu1\", not on gpu2"),
        ("999999", "gpu1", "Slurm knows no job 999999"),
        (planted.as_str(), "gpu2", "runs on \"gpu1\", not on gpu2"),
    ] {
        let o = lab
            .labrun_cmd(&["_slurm-job", &spec])
            .env("SLURM_CONF", slurm.conf())
            .env("SLURM_JOB_ID", job)
            .env("SLURMD_NODENAME", node)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(says),
            "{job} on {node}: {err}"
        );
    }
    // ps shows the blocker (everyone's) and not ours (ended).
    let ps = ok(&lab, &slurm, &["ps", "--all"]);
    assert!(ps.contains(&format!("slurm-{blocker} ")), "{ps}");

    // 5: slurmctld stopped.
    slurm.stop_ctld();
    for args in [vec!["ps"], vec!["--data", "div2k", "--", "true"]] {
        let t = Instant::now();
        let o = labrun(&lab, &slurm, &args);
        let took = t.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: {err}");
        assert!(
            err.contains("slurmctld") && err.contains("scontrol ping")
                || err.contains("Unable to contact slurm controller"),
            "{args:?}: {err}"
        );
        // 5 s per Slurm command, and a margin for the push: never a hang.
        assert!(took < Duration::from_secs(30), "{args:?} took {took:?}");
    }
}

/// The test 4: `labrun kill` cancels the Slurm job and its outputs
/// are saved; a job that runs into its time limit saves its outputs too.
#[test]
fn slurm_jobs_save_their_outputs_when_cancelled_or_out_of_time() {
    let Some(slurm) = Slurm::start(&["gpu0", "gpu1", "gpu2"]) else {
        return;
    };
    let Some(lab) = Lab::start_full(3, false, "", &slurm_section(&slurm, "")) else {
        return;
    };
    let writer = |name: &str| {
        format!("mkdir -p ckpt && echo {name} > ckpt/{name}.txt && echo wrote && sleep 600")
    };
    let killed = ok(
        &lab,
        &slurm,
        &[
            "-d",
            "--outputs",
            "ckpt",
            "--outputs-every",
            "1s",
            "--",
            "sh",
            "-c",
            &writer("killed"),
        ],
    );
    let id = id_of(&killed);
    slurm.running_on(&id, 60);
    // Saved while it runs, every --outputs-every.
    wait_until("a save of the outputs while the job runs", 60, || {
        std::thread::sleep(Duration::from_millis(200));
        let log = labrun(&lab, &slurm, &["logs", killed.trim()]).stdout;
        let log = String::from_utf8_lossy(&log);
        log.contains("wrote")
            && log.contains(&format!("outputs saved as runs/{}@v1", killed.trim()))
    });
    let said = ok(&lab, &slurm, &["kill", killed.trim()]);
    assert!(said.contains("cancelled"), "{said}");
    assert_eq!(slurm.ended(&id, 60), "CANCELLED");
    let log = String::from_utf8_lossy(&labrun(&lab, &slurm, &["logs", killed.trim()]).stdout)
        .into_owned();
    assert!(
        log.contains(&format!("outputs saved as runs/{}@v", killed.trim())),
        "{log}"
    );
    assert_eq!(saved(&lab, killed.trim(), "killed.txt"), "killed\n");

    // A 1-minute limit: SIGTERM at most 30 s before it, or at it.
    let timed = ok(
        &lab,
        &slurm,
        &[
            "-d",
            "--time",
            "1m",
            "--outputs",
            "ckpt",
            "--",
            "sh",
            "-c",
            &writer("timed"),
        ],
    );
    let id = id_of(&timed);
    slurm.running_on(&id, 60);
    // Told to stop before its limit (SIGTERM passed on, exit 143): FAILED;
    // or ended by Slurm at the limit: TIMEOUT. Its outputs are saved either way.
    let state = slurm.ended(&id, 180);
    assert!(state == "FAILED" || state == "TIMEOUT", "{state}");
    let log =
        String::from_utf8_lossy(&labrun(&lab, &slurm, &["logs", timed.trim()]).stdout).into_owned();
    assert!(log.contains("Slurm stops the job (SIGTERM)"), "{log}");
    assert_eq!(saved(&lab, timed.trim(), "timed.txt"), "timed\n");

    // Attached (no -d): labrun streams the job's output and exits with its code.
    let o = labrun(
        &lab,
        &slurm,
        &["--", "sh", "-c", "echo hello from $LABRUN_NODE; exit 3"],
    );
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(3), "{out}{err}");
    assert!(out.contains("hello from gpu"), "{out}{err}");
    assert!(err.contains("running on gpu"), "{err}");
}

/// A stage whose step was killed with SIGKILL (its `labrun` never says the
/// step ended) is released once Slurm says the job no longer runs: its
/// trees are not held against eviction for the stage's 30 days, while a
/// job still running beside it on the node keeps its stage.
#[test]
fn a_stage_whose_step_was_killed_is_released() {
    let Some(slurm) = Slurm::start(&["gpu0", "gpu1", "gpu2"]) else {
        return;
    };
    let Some(lab) = Lab::start_full(3, false, "", &slurm_section(&slurm, "")) else {
        return;
    };
    lab.dataset("div2k", 11);
    // Both jobs on gpu0 (two GPUs), so its labd holds both stages.
    let _blockers: Vec<String> = ["gpu1", "gpu2"].iter().map(|n| slurm.block(n)).collect();
    let submit = || {
        let args = [
            "-d",
            "--data",
            "div2k",
            "--",
            "sh",
            "-c",
            "echo staged && sleep 600",
        ];
        let job = ok(&lab, &slurm, &args);
        let id = id_of(&job);
        assert_eq!(slurm.running_on(&id, 60), "gpu0");
        wait_until("the job's step to run", 60, || {
            std::thread::sleep(Duration::from_millis(200));
            let log = labrun(&lab, &slurm, &["logs", job.trim()]).stdout;
            String::from_utf8_lossy(&log).contains("staged")
        });
        id
    };
    let (killed_id, live_id) = (submit(), submit());
    let released = |id: &str| -> Option<bool> {
        let record = lab
            .dir
            .path()
            .join("gpu0/state/slurm")
            .join(format!("{id}.1"))
            .join("stage.json");
        let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).ok()?).ok()?;
        Some(!rec["released"].is_null())
    };
    assert_eq!(released(&killed_id), Some(false));
    assert_eq!(released(&live_id), Some(false));
    // SIGKILL to the step's labrun (`scancel --signal=KILL` would send
    // SIGTERM first, and labrun would release the stage itself).
    let pid = step_pid(&killed_id).expect("the job's `labrun _slurm-job` process");
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let state = slurm.ended(&killed_id, 60);
    eprintln!("Slurm job {killed_id} ended {state} after its step's labrun was killed");
    assert_eq!(
        released(&killed_id),
        Some(false),
        "released by someone else"
    );
    // labd asks Slurm about stages older than 30 s, every 30 s.
    wait_until("labd to release the stage of the killed job", 120, || {
        std::thread::sleep(Duration::from_millis(500));
        released(&killed_id) == Some(true)
    });
    assert_eq!(
        released(&live_id),
        Some(false),
        "the stage of job {live_id}, still running on gpu0, was released"
    );
    // What labd's check relies on, from this Slurm: a job id it does not
    // know, asked alone, is an error that says so (a stage of such a job
    // is released); a running job is listed with its batch host.
    let squeue = |id: &str| {
        slurm
            .cmd("squeue")
            .args([
                "-h",
                "--local",
                "--states=all",
                "-j",
                id,
                "-o",
                "%A|%T|%B|%u",
            ])
            .output()
            .unwrap()
    };
    let o = squeue(&live_id);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{o:?}");
    assert!(
        text.starts_with(&format!("{live_id}|RUNNING|gpu0|")),
        "{text}"
    );
    let o = squeue("4000000");
    assert!(!o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("Invalid job id"),
        "{o:?}"
    );
}

/// The pid of Slurm job `id`'s `labrun _slurm-job` (its environment says
/// `SLURM_JOB_ID=id`).
fn step_pid(id: &str) -> Option<u32> {
    let want = format!("SLURM_JOB_ID={id}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        if !cmdline.split(|b| *b == 0).any(|a| a == b"_slurm-job") {
            return None;
        }
        let env = std::fs::read(e.path().join("environ")).ok()?;
        env.split(|b| *b == 0)
            .any(|v| v == want.as_bytes())
            .then_some(pid)
    })
}

/// Pending jobs are ranked again as caches change: a job held while every
/// node is free and nothing is cached would start on gpu0 (Slurm's first
/// node); once its data is cached on gpu2, the coordinator's re-ranking
/// (`[slurm] rerank_s`) makes it prefer gpu2, and released it starts there.
#[test]
fn a_pending_job_is_re_ranked_when_its_data_is_cached() {
    let Some(slurm) = Slurm::start(&["gpu0", "gpu1", "gpu2"]) else {
        return;
    };
    let extra = slurm_section(&slurm, "rerank_s = 1\n");
    let Some(lab) = Lab::start_full(3, false, "", &extra) else {
        return;
    };
    lab.dataset("div2k", 11);
    // Every GPU taken: the job waits, preferring nothing.
    let blockers: Vec<String> = ["gpu0", "gpu1", "gpu2"]
        .iter()
        .map(|n| slurm.block(n))
        .collect();
    let job = ok(&lab, &slurm, &["-d", "--data", "div2k", "--", "true"]);
    let id = id_of(&job);
    assert_eq!(slurm.job_field(&id, "JobState"), "PENDING");
    // Held (an admin's hold stands in for a long queue), the nodes freed.
    let held = slurm.cmd("scontrol").args(["hold", &id]).status().unwrap();
    assert!(held.success());
    for b in &blockers {
        assert!(slurm.cmd("scancel").arg(b).status().unwrap().success());
        slurm.ended(b, 60);
    }
    // Someone else's pending job, and a job whose comment holds a newline
    // and, after it, a line naming that job with this job's comment: the
    // coordinator, which changes jobs as root, must not take it for one of
    // labrun's.
    let victim = slurm.sbatch(&[
        "--hold",
        "--gres=gpu:1",
        "-o",
        "/dev/null",
        "--wrap",
        "true",
    ]);
    let comment = slurm.job_field(&id, "Comment");
    assert!(comment.starts_with("labsync:"), "{comment}");
    let planted = format!("--comment=nightly\n{victim}|{comment}");
    let planter = slurm.sbatch(&["--hold", &planted, "-o", "/dev/null", "--wrap", "true"]);
    let listing = slurm
        .cmd("squeue")
        .args(["-h", "-t", "PENDING", "-o", "%i|%k"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    assert!(
        listing.contains(&format!("\n{victim}|{comment}")),
        "the planted line is not in squeue's listing, so this test shows nothing: {listing}"
    );
    lab.cache_on(2, "div2k");
    let log = lab.dir.path().join("gpu0").join("labd.log");
    wait_until("the coordinator to re-rank the job", 60, || {
        std::thread::sleep(Duration::from_millis(200));
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(&format!("pending Slurm job {id} now prefers lsn_gpu2"))
    });
    let refused = format!("pending Slurm job {victim}: its comment is not one");
    wait_until("the coordinator to look at the planted line", 30, || {
        std::thread::sleep(Duration::from_millis(200));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains(&refused) || slurm.job_field(&victim, "Prefer").contains("lsn_")
    });
    let prefer = slurm.job_field(&victim, "Prefer");
    assert!(
        !prefer.contains("lsn_"),
        "job {victim} was re-ranked: Prefer={prefer}"
    );
    for j in [&victim, &planter] {
        assert!(slurm.cmd("scancel").arg(j).status().unwrap().success());
    }
    let released = slurm
        .cmd("scontrol")
        .args(["release", &id])
        .status()
        .unwrap();
    assert!(released.success());
    assert_eq!(slurm.ended(&id, 60), "COMPLETED");
    assert_eq!(slurm.job_field(&id, "NodeList"), "gpu2");
}
