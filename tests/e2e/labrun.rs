//! `labd` and `labrun` end to end: real labd processes on real Unix sockets,
//! real jobs, fake GPUs driven by a control file.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use labsync_agent::proto::JobView;
use labsync_agent::{session_members, JobState};

pub(crate) const ALICE: &str = "tok-alice-0123456789";
const BOB: &str = "tok-bob-0123456789";
const ADMIN: &str = "tok-admin-0123456789";

/// A temporary lab: a store, a labd with fake GPUs, and users' tokens.
pub(crate) struct Node {
    dir: tempfile::TempDir,
    labd: Option<Child>,
    config: PathBuf,
    /// Where labd listens: `unix://…` or `http://127.0.0.1:PORT`.
    addr: String,
    /// The store's URL.
    store: String,
    /// The environment labd and `labsync` get (an S3 server's credentials).
    env: Vec<(String, String)>,
}

pub(crate) use crate::common::wait_until;

impl Node {
    /// `gpus` like "2x11GiB"; `extra` appended to labd's config.
    fn start(gpus: Option<&str>, extra: &str) -> Node {
        Node::start_on(None, gpus, extra)
    }

    /// As [`Node::start`], listening on `tcp` (`127.0.0.1:PORT`) instead of a Unix socket.
    fn start_on(tcp: Option<&str>, gpus: Option<&str>, extra: &str) -> Node {
        Node::start_at(tcp, gpus, extra, None, None)
    }

    /// A labd with no GPUs whose store is `store` (a URL), reached with
    /// `env` (an S3 server's endpoint and credentials).
    pub(crate) fn start_with_store(store: &str, env: Vec<(String, String)>) -> Node {
        Node::start_full(
            None,
            None,
            "run_as = \"labd\"",
            None,
            Some(store.into()),
            env,
        )
    }

    /// As [`Node::start_on`], with the node cache and the store where given.
    fn start_at(
        tcp: Option<&str>,
        gpus: Option<&str>,
        extra: &str,
        cache: Option<&Path>,
        store: Option<&Path>,
    ) -> Node {
        let store = store.map(|p| format!("file://{}", p.display()));
        Node::start_full(tcp, gpus, extra, cache, store, Vec::new())
    }

    fn start_full(
        tcp: Option<&str>,
        gpus: Option<&str>,
        extra: &str,
        cache: Option<&Path>,
        store: Option<String>,
        env: Vec<(String, String)>,
    ) -> Node {
        let dir = tempfile::tempdir().unwrap();
        // Jobs run as other users (when the tests run as root) must reach their folders.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("home")).unwrap();
        std::fs::write(d.join("control.toml"), "").unwrap();
        let fake = match gpus {
            Some(g) => format!(
                "fake_gpus = \"{g}\"\nfake_gpus_control = \"{}\"\n",
                d.join("control.toml").display()
            ),
            None => String::new(),
        };
        let config = d.join("labd.toml");
        let addr = match tcp {
            Some(a) => format!("http://{a}"),
            None => format!("unix://{}", d.join("labd.sock").display()),
        };
        std::fs::write(
            &config,
            format!(
                "listen = \"{addr}\"\nstate_dir = \"{state}\"\nstore = \"{store}\"\n\
                 cache_dir = \"{cache}\"\ntick_ms = 50\nkill_grace_s = 1\ninventory_deadline_ms = 300\n\
                 {fake}{extra}\nadmins = [\"admin\"]\n[tokens]\nalice = \"{ALICE}\"\nbob = \"{BOB}\"\n\
                 admin = \"{ADMIN}\"\nnobody = \"tok-nobody-0123456789\"\n",
                state = d.join("state").display(),
                store = store
                    .clone()
                    .unwrap_or_else(|| format!("file://{}", d.join("store").display())),
                cache = cache.map_or(d.join("cache"), Path::to_path_buf).display(),
            ),
        )
        .unwrap();
        // It holds tokens: labd refuses it readable by others.
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
        let store = store.unwrap_or_else(|| format!("file://{}", d.join("store").display()));
        let mut n = Node {
            dir,
            labd: None,
            config,
            addr,
            store,
            env,
        };
        n.restart();
        n
    }

    pub(crate) fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Starts labd (again) and waits until it answers.
    fn restart(&mut self) {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.path("labd.log"))
            .unwrap();
        let child = Command::new(crate::bin("labd"))
            .arg("--config")
            .arg(&self.config)
            .env("HOME", self.path("home"))
            .env("LABD_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.labd = Some(child);
        let addr = self.addr.clone();
        wait_until("labd to answer", 30, || {
            match addr.strip_prefix("http://") {
                Some(tcp) => std::net::TcpStream::connect(tcp).is_ok(),
                None => std::os::unix::net::UnixStream::connect(&addr["unix://".len()..]).is_ok(),
            }
        });
    }

    /// A job of alice's without GPUs that writes `ckpt/model.pt` holding
    /// `epoch` as its `--outputs`, prints `started`, and runs until the
    /// file `go` (the second of what is returned) appears; once it runs.
    fn checkpointing_job(&self, epoch: &str) -> (String, PathBuf) {
        let go = self.path("go");
        let script = format!(
            "mkdir -p ckpt; echo {epoch} > ckpt/model.pt; echo started; \
             while [ ! -e {} ]; do sleep 0.05; done",
            go.display()
        );
        let id = self.detach(
            ALICE,
            &[
                "--gpus",
                "0",
                "--outputs",
                "ckpt",
                "--",
                "bash",
                "-c",
                &script,
            ],
        );
        wait_until("the job to run", 20, || {
            matches!(self.job(&id).state, JobState::Running { .. })
        });
        (id, go)
    }

    /// A store outage: the store's folder becomes a file, which no write
    /// gets through, root or not. [`Node::store_up`] ends it.
    fn store_down(&self) {
        std::fs::rename(self.path("store"), self.path("store.away")).unwrap();
        std::fs::write(self.path("store"), "outage").unwrap();
    }

    /// The end of [`Node::store_down`]'s outage.
    fn store_up(&self) {
        std::fs::remove_file(self.path("store")).unwrap();
        std::fs::rename(self.path("store.away"), self.path("store")).unwrap();
    }

    /// `kill -9` labd, as a crash would.
    fn crash(&mut self) {
        let mut c = self.labd.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn control(&self, toml: &str) {
        std::fs::write(self.path("control.toml"), toml).unwrap();
    }

    fn labrun_cmd(&self, token: Option<&str>, args: &[&str]) -> Command {
        let mut c = Command::new(crate::bin("labrun"));
        c.args(args)
            .current_dir(self.path("code"))
            .env("HOME", self.path("home"))
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_STATE_HOME")
            .env_remove("LABRUN_TOKEN")
            .env("LABRUN_LABD", &self.addr)
            .env("LABSYNC_CACHE", self.path("client-cache"))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        if let Some(t) = token {
            c.env("LABRUN_TOKEN", t);
        }
        c
    }

    fn labrun(&self, token: Option<&str>, args: &[&str]) -> Output {
        std::fs::create_dir_all(self.path("code")).unwrap();
        self.labrun_cmd(token, args).output().unwrap()
    }

    fn ok(&self, token: &str, args: &[&str]) -> String {
        let o = self.labrun(Some(token), args);
        assert!(
            o.status.success(),
            "labrun {args:?} failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    /// Submits `bash -c script` on `gpus` GPUs without waiting; returns the job id.
    fn bash(&self, token: &str, gpus: u32, script: &str) -> String {
        self.detach(
            token,
            &["--gpus", &gpus.to_string(), "--", "bash", "-c", script],
        )
    }

    /// Submits without waiting; returns the job id.
    pub(crate) fn detach(&self, token: &str, args: &[&str]) -> String {
        let mut a = vec!["-d"];
        a.extend_from_slice(args);
        self.ok(token, &a).trim().to_string()
    }

    fn jobs(&self) -> Vec<JobView> {
        serde_json::from_str(&self.ok(ADMIN, &["ps", "--all", "--json"])).unwrap()
    }

    pub(crate) fn job(&self, id: &str) -> JobView {
        self.jobs().into_iter().find(|j| j.id == id).unwrap()
    }

    /// Waits until `id` says it waits for something containing `why`, then
    /// checks it is still queued half a second later.
    fn stays_queued(&self, id: &str, why: &str, because: &str) {
        wait_until("the job to say why it waits", 10, || {
            self.job(id).why.is_some_and(|w| w.contains(why))
        });
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(self.job(id).state, JobState::Queued, "{because}");
    }

    pub(crate) fn ended(&self, id: &str) -> bool {
        let j = self.job(id);
        j.ended() && !j.meta.outputs_pending
    }

    /// The job's outputs, saved as `runs/<id>@v1`, pulled back: `file`'s content.
    pub(crate) fn saved_outputs(&self, j: &JobView, file: &str) -> String {
        let id = &j.id;
        let saved = j.meta.outputs_saved.clone().unwrap_or_default();
        assert!(
            saved.starts_with(&format!("runs/{id}@v1#")),
            "saved as the version and its snapshot's id: {saved}"
        );
        let dest = self.path(&format!("recovered-{id}"));
        assert!(self
            .labsync(&["pull", &saved, dest.to_str().unwrap()])
            .status
            .success());
        std::fs::read_to_string(dest.join(file)).unwrap()
    }

    fn status(&self) -> String {
        self.ok(ALICE, &["status"])
    }

    pub(crate) fn labsync(&self, args: &[&str]) -> Output {
        Command::new(crate::bin("labsync"))
            .args(args)
            .env("HOME", self.path("home"))
            .env("LABSYNC_STORE", &self.store)
            .env("LABSYNC_CACHE", self.path("client-cache"))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.labd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Jobs outlive labd by design; the tests' own must not outlive the test.
        let state = self.path("state/state-v1.redb");
        if state.exists() {
            if let Ok(l) = labsync_agent::Leases::open(&state) {
                for j in l.jobs().unwrap_or_default() {
                    if let JobState::Running { sid, .. } = j.state {
                        labsync_agent::kill_session(sid, Duration::from_millis(100));
                    }
                }
            }
        }
    }
}

fn sid(j: &JobView) -> u32 {
    match j.state {
        JobState::Running { sid, .. } => sid,
        ref s => panic!("job {} is not running: {s:?}", j.id),
    }
}

/// Test 1: many submissions race for one free GPU; exactly one runs on it at
/// a time, the others wait (and say why), then run.
#[test]
fn racing_submissions_share_one_gpu_one_at_a_time() {
    let n = Node::start(Some("1x11GiB"), "run_as = \"labd\"");
    let trace = n.path("trace");
    std::fs::create_dir_all(n.path("code")).unwrap();
    let script = format!(
        "echo start $LABRUN_JOB_ID $CUDA_VISIBLE_DEVICES $(date +%s%N) >> {t}; sleep 0.4; \
         echo end $LABRUN_JOB_ID $(date +%s%N) >> {t}",
        t = trace.display()
    );
    let children: Vec<Child> = (0..5)
        .map(|_| {
            n.labrun_cmd(
                Some(ALICE),
                &["-d", "--gpus", "1", "--", "bash", "-c", &script],
            )
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    let ids: Vec<String> = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success());
            String::from_utf8(o.stdout).unwrap().trim().to_string()
        })
        .collect();
    wait_until("a job to wait", 20, || {
        n.jobs().iter().any(|j| {
            j.why
                .as_deref()
                .is_some_and(|w| w.contains("waits for 1 GPU(s): 0 free"))
        })
    });
    wait_until("all five jobs to end", 60, || {
        ids.iter().all(|id| n.ended(id))
    });
    let text = std::fs::read_to_string(&trace).unwrap();
    let mut spans: Vec<(u128, u128)> = Vec::new();
    for id in &ids {
        let start = text
            .lines()
            .find(|l| l.starts_with(&format!("start {id} ")))
            .unwrap_or_else(|| panic!("{id} never ran: {text}"));
        let f: Vec<&str> = start.split_whitespace().collect();
        assert_eq!(f[2], "0", "{id} sees only its GPU: {start}");
        let end = text
            .lines()
            .find(|l| l.starts_with(&format!("end {id} ")))
            .unwrap();
        spans.push((
            f[3].parse().unwrap(),
            end.split_whitespace().nth(2).unwrap().parse().unwrap(),
        ));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "two jobs held the GPU at once: {spans:?}");
    }
    assert!(n.status().contains("free"), "the GPU is free again");
}

/// Test 2: a foreign process on a GPU keeps it out of leasing and `labrun
/// status` shows it with pid, user and memory.
#[test]
fn foreign_process_keeps_its_gpu_out() {
    let n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    let mut zombie = Command::new("sleep").arg("300").spawn().unwrap();
    n.control(&format!(
        "foreign = [{{ gpu = 0, pid = {}, mib = 2048 }}]",
        zombie.id()
    ));
    let status = n.status();
    assert!(
        status.contains(&format!("FOREIGN: pid {} (", zombie.id())) && status.contains("2048 MiB"),
        "{status}"
    );
    let one = n.ok(
        ALICE,
        &[
            "--gpus",
            "1",
            "--",
            "bash",
            "-c",
            "echo gpu=$CUDA_VISIBLE_DEVICES",
        ],
    );
    assert_eq!(
        one.trim(),
        "gpu=1",
        "the job got the GPU without the foreign process"
    );
    // A job no GPU here could ever hold is refused, not queued forever.
    let o = n.labrun(
        Some(ALICE),
        &["--gpus", "1", "--gpu-mem", "20G", "--", "true"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("0 GPU(s) that large"));
    // After `--`, a command runs as given, even an absolute path.
    assert_eq!(
        n.ok(ALICE, &["--gpus", "0", "--", "/bin/echo", "as given"])
            .trim(),
        "as given"
    );
    let two = n.bash(ALICE, 2, "echo gpus=$CUDA_VISIBLE_DEVICES");
    n.stays_queued(&two, "1 free", "never leased over a foreign process");
    zombie.kill().unwrap();
    zombie.wait().unwrap();
    n.control("");
    wait_until("the 2-GPU job to end", 20, || n.ended(&two));
    assert_eq!(n.ok(ALICE, &["logs", &two]).trim(), "gpus=0,1");
}

/// Test 3: an NVML hang makes every GPU unknown; nothing is leased; when the
/// inventory answers again the waiting job runs.
#[test]
fn inventory_hang_makes_gpus_unknown_until_it_answers() {
    let n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    n.control("hang = true");
    let status = n.status();
    assert!(status.matches("UNKNOWN").count() == 2, "{status}");
    let id = n.bash(ALICE, 1, "echo ran on $CUDA_VISIBLE_DEVICES");
    n.stays_queued(&id, "unknown", "nothing leased while unknown");
    n.control("");
    wait_until("the job to end after recovery", 20, || n.ended(&id));
    assert_eq!(n.ok(ALICE, &["logs", &id]).trim(), "ran on 0");
    assert!(!n.status().contains("UNKNOWN"));
}

/// Issue 9, point 4: the GPUs a job sees are the ones it leased. NVML
/// numbers GPUs in PCI order and CUDA by default fastest first, so labd sets
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID` after the submitter's environment, and a
/// submitter's own `CUDA_VISIBLE_DEVICES` never replaces the lease's.
#[test]
fn jobs_see_their_leased_gpus_in_pci_order() {
    let n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    std::fs::create_dir_all(n.path("code")).unwrap();
    let o = n
        .labrun_cmd(
            Some(ALICE),
            &[
                "--gpus",
                "1",
                "--",
                "bash",
                "-c",
                "echo $CUDA_DEVICE_ORDER $CUDA_VISIBLE_DEVICES",
            ],
        )
        .env("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        .env("CUDA_VISIBLE_DEVICES", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "PCI_BUS_ID 0");
}

/// Issue 9, point 3: a job that uses a GPU it did not lease (here a
/// `--gpus 0` job, as one that resets `CUDA_VISIBLE_DEVICES` would) makes
/// that GPU busy: shown with the job's id, never leased to the next job.
#[test]
fn a_gpu_used_outside_its_lease_is_not_free() {
    let n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    let rogue = n.bash(ALICE, 0, "sleep 300");
    wait_until("the rogue job to run", 20, || {
        matches!(n.job(&rogue).state, JobState::Running { .. })
    });
    let pid = sid(&n.job(&rogue));
    n.control(&format!("[[processes]]\ngpu = 0\npid = {pid}\nmib = 100\n"));
    let status = n.status();
    assert!(
        status.contains(&format!("pid {pid} ({rogue} outside its lease, 100 MiB)")),
        "{status}"
    );
    let one = n.ok(
        ALICE,
        &[
            "--gpus",
            "1",
            "--",
            "bash",
            "-c",
            "echo gpu=$CUDA_VISIBLE_DEVICES",
        ],
    );
    assert_eq!(one.trim(), "gpu=1", "GPU 0 is in use outside a lease");
    let two = n.bash(ALICE, 2, "echo gpus=$CUDA_VISIBLE_DEVICES");
    n.stays_queued(&two, "1 free", "never leased under another job");
    n.ok(ALICE, &["kill", &rogue]);
    n.control("");
    wait_until("the 2-GPU job to end", 20, || n.ended(&two));
    assert_eq!(n.ok(ALICE, &["logs", &two]).trim(), "gpus=0,1");
}

/// Test 4 and 6 (killed): `labrun kill` leaves no process of the job alive —
/// grandchildren that ignore SIGTERM in another process group included — frees
/// the lease, and the job's outputs are still saved: the last whole
/// checkpoint, not the one it was rewriting when it was killed.
#[test]
fn kill_leaves_no_process_and_saves_outputs() {
    let n = Node::start(
        Some("1x11GiB"),
        "run_as = \"labd\"\noutputs_every_min_s = 1",
    );
    // The checkpoint is dated a minute back: periodic saves leave out files
    // written in the last seconds (they may be half saved).
    // Told to (a file `go`), it rewrites the checkpoint and is killed
    // before it could have finished (issue 40, point 13).
    let script =
        "mkdir -p ckpt; echo epoch-1 > ckpt/model.pt; touch -d '-1 minute' ckpt/model.pt; \
                  trap '' TERM; (sleep 300 & sleep 300 & wait) & set -m; (sleep 300) & echo ready; \
                  while [ ! -e go ]; do sleep 0.1; done; echo epoch-2-half > ckpt/model.pt; wait";
    let id = n.detach(
        ALICE,
        &[
            "--gpus",
            "1",
            "--outputs",
            "ckpt",
            "--outputs-every",
            "1s",
            "--",
            "bash",
            "-c",
            script,
        ],
    );
    wait_until("the job to start its children", 20, || {
        let j = n.job(&id);
        matches!(j.state, JobState::Running { .. }) && session_members(sid(&j)).len() >= 5
    });
    wait_until("a periodic save while it runs", 20, || {
        let j = n.job(&id);
        matches!(j.state, JobState::Running { .. }) && j.meta.outputs_saved.is_some()
    });
    let s = sid(&n.job(&id));
    let work = n.job(&id).meta.work.clone().expect("a working folder");
    std::fs::write(work.join("go"), "").unwrap();
    wait_until("the checkpoint to be half rewritten", 20, || {
        std::fs::read_to_string(work.join("ckpt/model.pt")).is_ok_and(|t| t == "epoch-2-half\n")
    });
    let o = n.labrun(Some(BOB), &["kill", &id]);
    assert!(!o.status.success(), "bob may not kill alice's job");
    assert!(String::from_utf8_lossy(&o.stderr).contains("alice's"));
    n.ok(ALICE, &["kill", &id]);
    assert!(
        session_members(s).is_empty(),
        "left: {:?}",
        session_members(s)
    );
    wait_until("the outputs to be saved", 20, || n.ended(&id));
    let j = n.job(&id);
    assert!(
        j.gpus.is_empty() && n.status().contains("free"),
        "lease freed"
    );
    assert_eq!(n.saved_outputs(&j, "model.pt"), "epoch-1\n");
}

/// Issue 9, point 6: checkpoints are never deleted unsaved. The store is
/// down when the job ends: the final push is retried (with backoff) past the
/// three tries labd used to give up after, `labrun ps` says so, the working
/// folder outlives `work_keep_s`, and once the store is back the outputs
/// land and only then is the folder swept.
#[test]
fn final_outputs_push_retries_through_a_store_outage() {
    let n = Node::start(
        None,
        "run_as = \"labd\"\nwork_keep_s = 0\noutputs_retry_s = 1",
    );
    let (id, go) = n.checkpointing_job("epoch-9");
    n.store_down();
    std::fs::write(&go, "").unwrap();
    // Tries at +0, +1, +3, +7 s: the sweeper (every 5 s, work_keep_s = 0) has run meanwhile.
    wait_until("four failed final pushes", 60, || {
        n.job(&id).meta.outputs_failures >= 4
    });
    let j = n.job(&id);
    assert!(
        j.meta.outputs_pending && j.meta.outputs_saved.is_none(),
        "{j:?}"
    );
    let work = j.meta.work.clone().unwrap();
    assert!(
        work.join("ckpt/model.pt").exists(),
        "the only copy of the checkpoint was swept"
    );
    let ps = n.ok(ALICE, &["ps"]);
    assert!(
        ps.contains("outputs not saved yet") && ps.contains("retrying"),
        "{ps}"
    );
    n.store_up();
    wait_until("the outputs to be saved after the outage", 60, || {
        n.ended(&id)
    });
    let j = n.job(&id);
    assert_eq!(n.saved_outputs(&j, "model.pt"), "epoch-9\n");
    wait_until("the folder to go once its outputs are saved", 30, || {
        !work.exists()
    });
}

/// Issue 9, point 5: a killed job leaves nothing behind, including a
/// process that left its session (`setsid`, as `Popen(start_new_session=True)`,
/// tmux and daemonisers do). While the job runs, that process is shown as the
/// job's own on the job's GPU, not as someone else's.
#[test]
fn a_killed_job_leaves_no_process_that_left_its_session() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: labd makes no cgroups and says so in its log");
        return;
    }
    let n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    let pid_file = n.path("escaped.pid");
    let script = format!(
        "setsid bash -c 'echo $$ > {}.tmp; mv {0}.tmp {0}; exec sleep 300' & wait",
        pid_file.display()
    );
    let id = n.bash(ALICE, 1, &script);
    wait_until("the escaped process", 20, || pid_file.exists());
    let escaped: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let j = n.job(&id);
    assert_ne!(
        labsync_agent::process_session(escaped),
        Some(sid(&j)),
        "it left the job's session"
    );
    n.control(&format!(
        "[[processes]]\ngpu = {}\npid = {escaped}\nmib = 500\n",
        j.gpus[0]
    ));
    let status = n.status();
    let line = status
        .lines()
        .find(|l| l.contains(&format!("GPU {}", j.gpus[0])))
        .unwrap();
    assert!(
        line.contains(&format!("leased to {id}")) && !line.contains("ALSO USED BY"),
        "{status}"
    );
    n.ok(ALICE, &["kill", &id]);
    n.control("");
    let gone = || {
        std::fs::read_to_string(format!("/proc/{escaped}/stat")).map_or(true, |s| {
            s.rfind(')').is_some_and(|i| s[i + 2..].starts_with('Z'))
        })
    };
    assert!(gone(), "pid {escaped} outlived the kill of {id}");
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(log.contains("cgroup of its own"), "{log}");
}

/// A job's `HOME`, `USER` and `LOGNAME` are those of the account it runs
/// as, not the submitter's labrun's (issue 43: an admin submitting with a
/// user's token made the job read `/root/.config/…` and fail).
#[test]
fn a_job_runs_with_its_own_accounts_home_not_the_submitters() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: jobs run as labd's own user, the submitter's account");
        return;
    }
    let n = Node::start(None, "");
    let id = n.bash(
        "tok-nobody-0123456789",
        0,
        "echo home=$HOME user=$USER logname=$LOGNAME",
    );
    wait_until("the job to end", 20, || n.ended(&id));
    let said = n.ok("tok-nobody-0123456789", &["logs", &id]);
    let home = labsync_agent::user_by_name("nobody").unwrap().home;
    assert_eq!(
        said.trim(),
        format!("home={} user=nobody logname=nobody", home.display()),
        "labrun's HOME was {}",
        n.path("home").display()
    );
}

/// labd's log, written to a file, holds no colour codes (issue 43: they
/// made `labd.log` hard to read and grep).
#[test]
fn labds_log_in_a_file_holds_no_colour_codes() {
    let n = Node::start(None, "run_as = \"labd\"");
    let id = n.bash(ALICE, 0, "true");
    wait_until("the job to end", 20, || n.ended(&id));
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(log.contains(" INFO "), "{log}");
    assert!(!log.contains('\x1b'), "{log:?}");
    // And `labrun status` says what reads the GPUs (it said "GPUs from
    // none").
    let status = n.status();
    let first = status.lines().next().unwrap_or_default();
    assert!(
        first.contains(" — GPUs: ") && !first.contains("GPUs from"),
        "{status}"
    );
}

/// A job's limits from labd's config (`job_pids_max`, `job_memory_max`):
/// a fork bomb stops at its task limit while labd and the other users'
/// jobs go on, and a job that outgrows its memory is killed (SIGKILL), not
/// a process of someone else's the kernel's OOM killer would pick.
#[test]
fn a_fork_bomb_and_a_memory_hog_are_held_to_their_jobs() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: labd makes no cgroups and says so in its log");
        return;
    }
    let n = Node::start(
        Some("2x11GiB"),
        "run_as = \"labd\"\njob_pids_max = 64\njob_memory_max = \"128M\"",
    );
    // Bash retries a refused fork, so the bomb keeps asking.
    let bomb = n.bash(ALICE, 1, "for i in $(seq 500); do sleep 300 & done; wait");
    wait_until("the bomb to start", 20, || {
        matches!(n.job(&bomb).state, JobState::Running { .. })
    });
    let leader = sid(&n.job(&bomb));
    let count = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&p| labsync_agent::process_session(p) == Some(leader))
            .count()
    };
    wait_until("the bomb to reach its limit", 30, || count() >= 60);
    std::thread::sleep(Duration::from_millis(500));
    let at_most = count();
    assert!(at_most <= 64, "{at_most} processes in a job limited to 64");
    // labd answers, and another job starts and ends meanwhile.
    let other = n.bash(BOB, 1, "echo bob-was-here");
    wait_until("bob's job to end", 20, || n.ended(&other));
    assert_eq!(
        n.job(&other).state,
        JobState::Exited {
            code: Some(0),
            signal: None
        }
    );
    n.ok(ALICE, &["kill", &bomb]);
    wait_until("the bomb to be gone", 20, || count() == 0);
    let told = n.ok(ALICE, &["logs", &bomb]);
    assert!(
        told.contains("labd: ") && told.contains("refused: the job was at its limit of 64"),
        "{told}"
    );

    let hog = n.bash(
        ALICE,
        0,
        "exec dd if=/dev/zero of=/dev/null bs=512M count=1",
    );
    wait_until("the hog to end", 30, || n.ended(&hog));
    assert_eq!(
        n.job(&hog).state,
        JobState::Exited {
            code: None,
            signal: Some(9)
        }
    );
    let told = n.ok(ALICE, &["logs", &hog]);
    assert!(
        told.contains("killed for memory: the job was at its limit of 128 MiB"),
        "{told}"
    );
    let fits = n.bash(ALICE, 0, "exec dd if=/dev/zero of=/dev/null bs=32M count=4");
    wait_until("the job within its memory to end", 30, || n.ended(&fits));
    assert_eq!(
        n.job(&fits).state,
        JobState::Exited {
            code: Some(0),
            signal: None
        }
    );
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(
        log.contains("at most 64 tasks and 128.00 MiB of memory")
            && !log.contains("without this limit"),
        "{log}"
    );
}

/// Issue 40, point 4: limits are the user's, not the job's nor root's.
/// A job gets its user's login limits (pam_limits' files, here a
/// `limits_conf` of the test's) and runs in its user's cgroup; two fork
/// bombs of one user, each allowed 32 tasks, together stop at the user's
/// 40.
#[test]
fn a_users_jobs_share_the_users_limits_and_get_their_login_limits() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: jobs run as labd's user, with its limits");
        return;
    }
    let conf = tempfile::tempdir().unwrap();
    let limits = conf.path().join("limits.conf");
    std::fs::write(
        &limits,
        "nobody soft nofile 321\nnobody hard nofile 654\n* hard core 0\n",
    )
    .unwrap();
    let n = Node::start(
        None,
        &format!(
            "job_pids_max = 32\nuser_pids_max = 40\nlimits_conf = \"{}\"",
            limits.display()
        ),
    );
    let nobody = "tok-nobody-0123456789";
    let probe = n.bash(
        nobody,
        0,
        "echo soft=$(ulimit -Sn) hard=$(ulimit -Hn) core=$(ulimit -Hc); cat /proc/self/cgroup",
    );
    wait_until("the probe to end", 20, || n.ended(&probe));
    let told = n.ok(nobody, &["logs", &probe]);
    assert!(told.contains("soft=321 hard=654 core=0"), "{told}");
    let uid = String::from_utf8(
        Command::new("id")
            .args(["-u", "nobody"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let under = format!("/u{}/{probe}", uid.trim());
    assert!(told.contains(&under), "not under {under}: {told}");
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(
        log.contains("all of one user's jobs together at most 40 tasks"),
        "{log}"
    );

    let bombs = [0, 1].map(|_| n.bash(nobody, 0, "for i in $(seq 100); do sleep 300 & done; wait"));
    wait_until("both bombs to start", 20, || {
        bombs
            .iter()
            .all(|b| matches!(n.job(b).state, JobState::Running { .. }))
    });
    let leaders: Vec<u32> = bombs.iter().map(|b| sid(&n.job(b))).collect();
    let count = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&p| labsync_agent::process_session(p).is_some_and(|s| leaders.contains(&s)))
            .count()
    };
    // Past one job's 32: the two have the user's 40 between them.
    wait_until("the bombs to reach the user's limit", 30, || count() >= 40);
    std::thread::sleep(Duration::from_millis(500));
    let at_most = count();
    assert!(at_most <= 40, "{at_most} processes of a user limited to 40");
    for b in &bombs {
        n.ok(nobody, &["kill", b]);
    }
    wait_until("the bombs to be gone", 20, || count() == 0);
}

/// Issue 40, point 9: a job opens only the GPUs it leased. The fake GPUs'
/// device nodes are made for the test (NVIDIA's major, no driver behind
/// it): the leased card's open reaches the kernel's "no such device"
/// (ENXIO, what a driver would answer), the other card's is refused
/// (EPERM), whatever `CUDA_VISIBLE_DEVICES` says; `labrun status` says
/// the node confines its jobs.
#[test]
fn a_job_cannot_open_a_gpu_it_did_not_lease() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: no cgroups, no device nodes to make");
        return;
    }
    let dev = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dev.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for i in 0..2 {
        let node = dev.path().join(format!("nvidia{i}"));
        let made = Command::new("mknod")
            .args([
                "-m",
                "666",
                node.to_str().unwrap(),
                "c",
                "195",
                &i.to_string(),
            ])
            .status()
            .unwrap();
        assert!(made.success());
    }
    let n = Node::start(
        Some("2x11GiB"),
        &format!("fake_gpus_dev = \"{}\"", dev.path().display()),
    );
    let status = n.status();
    if status.contains("NOT kept from GPUs") {
        eprintln!("SKIPPED: this kernel cannot confine jobs, and says so: {status}");
        return;
    }
    assert!(
        status.contains("each job can open only the GPUs it leased"),
        "{status}"
    );
    let script = format!(
        "echo leased=$CUDA_VISIBLE_DEVICES; unset CUDA_VISIBLE_DEVICES; \
         for i in 0 1; do cat {0}/nvidia$i 2>&1 | sed \"s/^/card$i: /\"; done",
        dev.path().display()
    );
    let nobody = "tok-nobody-0123456789";
    let job = n.bash(nobody, 1, &script);
    wait_until("the job to end", 20, || n.ended(&job));
    let log = n.ok(nobody, &["logs", &job]);
    let leased: u32 = log
        .lines()
        .find_map(|l| l.strip_prefix("leased="))
        .and_then(|g| g.trim().parse().ok())
        .unwrap_or_else(|| panic!("{log}"));
    let other = 1 - leased;
    assert!(
        log.contains(&format!(
            "card{leased}: cat: {}/nvidia{leased}: No such device or address",
            dev.path().display()
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "card{other}: cat: {}/nvidia{other}: Operation not permitted",
            dev.path().display()
        )),
        "{log}"
    );
}

/// Issue 9, point 13: labd refuses, with a message naming the problem, a
/// config that holds tokens and is readable by others, one writable by
/// others, two users with one token, `tick_ms = 0`, and job limits no
/// job could start under.
#[test]
fn labd_refuses_unsafe_configs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = format!(
        "listen = \"unix://{0}/labd.sock\"\nstate_dir = \"{0}/state\"\nstore = \"file://{0}/store\"\n\
         cache_dir = \"{0}/cache\"\nfake_gpus = \"1x11GiB\"\nrun_as = \"labd\"\n",
        d.display()
    );
    let tokens = "[tokens]\nalice = \"tok-alice-0123456789\"\n";
    let cases = [
        (0o644, format!("{base}{tokens}"), "readable by other users"),
        (0o666, base.clone(), "writable by other users"),
        (
            0o600,
            format!("{base}{tokens}bob = \"tok-alice-0123456789\"\n"),
            "alice and bob have the same token",
        ),
        (0o600, format!("tick_ms = 0\n{base}"), "tick_ms = 0"),
        (
            0o600,
            format!("job_pids_max = 5\n{base}"),
            "job_pids_max = 5",
        ),
        (
            0o600,
            format!("job_pids_max = 5000000\n{base}"),
            "job_pids_max = 5000000",
        ),
        (
            0o600,
            format!("job_memory_max = \"1M\"\n{base}"),
            "job_memory_max = \"1M\"",
        ),
    ];
    for (mode, text, why) in cases {
        let config = d.join("labd.toml");
        std::fs::write(&config, text).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(mode)).unwrap();
        let o = Command::new(crate::bin("labd"))
            .arg("--config")
            .arg(&config)
            .env("HOME", d)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{why}: {err}");
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// A submission whose command and environment are past 256 KiB is
/// refused with what to do (labd keeps, lists and heartbeats every job's
/// command); and `labrun ps --all` shows another user's command as text,
/// its control characters escaped, never as bytes a terminal acts on.
#[test]
fn huge_commands_are_refused_and_listings_show_commands_as_text() {
    let n = Node::start(None, "run_as = \"labd\"");
    std::fs::create_dir_all(n.path("code")).unwrap();
    let big = "x".repeat(100_000);
    let o = n
        .labrun_cmd(Some(ALICE), &["-d", "--gpus", "0", "--", "true"])
        .envs((1..=3).map(|i| (format!("BIG{i}"), big.clone())))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "taken: {err}");
    // Said by labrun before it pushes anything, with what to unset.
    assert!(
        err.contains("at most 256 KiB") && err.contains("BIG1 (100006 bytes)"),
        "{err}"
    );
    assert!(
        !n.path("store/refs").join("code").exists(),
        "the code was pushed first"
    );
    let id = n.bash(ALICE, 0, "sleep 30 # \x1b]0;pwned\x07\rrow");
    let listed = n.ok(BOB, &["ps", "--all"]);
    let row = listed
        .lines()
        .find(|l| l.starts_with(id.as_str()))
        .unwrap_or_else(|| panic!("{id} not listed: {listed}"));
    assert!(
        row.contains(r"sleep 30 # \u{1b}]0;pwned\u{7}\rrow"),
        "{row:?}"
    );
    assert!(
        !listed.contains('\x1b') && !listed.contains('\r'),
        "{listed:?}"
    );
    n.ok(ALICE, &["kill", &id]);
}

/// Issue 9, point 13: job ids stay unique when labd's database, or its
/// whole state folder, is lost: a new job never pushes a second `runs/j1`.
#[test]
fn job_ids_stay_unique_when_the_state_is_lost() {
    let mut n = Node::start(None, "run_as = \"labd\"");
    let run = |n: &Node| {
        let id = n.detach(
            ALICE,
            &[
                "--gpus",
                "0",
                "--outputs",
                "ckpt",
                "--",
                "bash",
                "-c",
                "mkdir -p ckpt; echo $LABRUN_JOB_ID > ckpt/who",
            ],
        );
        wait_until("the outputs to be saved", 30, || n.ended(&id));
        let saved = n.job(&id).meta.outputs_saved;
        assert!(
            saved.is_some_and(|s| s.starts_with(&format!("runs/{id}@v1#"))),
            "a name of its own"
        );
        id
    };
    let first = run(&n);
    n.crash();
    std::fs::remove_file(n.path("state/state-v1.redb")).unwrap();
    n.restart();
    let second = run(&n);
    assert_ne!(second, first, "the database was lost, the folders were not");
    n.crash();
    std::fs::remove_dir_all(n.path("state")).unwrap();
    n.restart();
    let third = run(&n);
    assert!(
        third != first && third != second,
        "the state folder was lost, the store was not: {first} {second} {third}"
    );
    // Refs anyone can write name a job near u64::MAX, and one just below
    // the last id labd gives: ignored, not wrapped, and no ids used up.
    std::fs::create_dir_all(n.path("evil")).unwrap();
    for name in ["runs/j18446744073709551614", "runs/j999999999999"] {
        let o = n.labsync(&["push", n.path("evil").to_str().unwrap(), "--name", name]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    n.crash();
    n.restart();
    let fourth = run(&n);
    let num = |id: &str| id[1..].parse::<u64>().unwrap();
    assert!(
        num(&fourth) > num(&third) && num(&fourth) < 1000,
        "{third} then {fourth}"
    );
}

/// Issue 9, point 7: a job's log is bounded on disk (here `log_max = 1M`):
/// its head and tail are kept, readers are told what was cut, and the log
/// goes with the working folder after `work_keep_s`.
#[test]
fn job_logs_keep_head_and_tail_under_their_cap() {
    use std::os::unix::fs::MetadataExt;
    let n = Node::start(None, "run_as = \"labd\"\nlog_max = \"1M\"\nwork_keep_s = 3");
    // 8 MB of output in ~130-byte lines, then a last line.
    let script = "echo FIRST; for i in $(seq 1 64); do yes \"$i: a chatty training loop prints this line again and again and again and again and again\" | head -c 131072; done; echo LAST";
    let id = n.bash(ALICE, 0, script);
    wait_until("the job to end", 60, || n.ended(&id));
    let log = n.path(&format!("state/logs/{id}.log"));
    let m = std::fs::metadata(&log).unwrap();
    assert!(
        m.len() > 8_000_000,
        "the file keeps its offsets: {}",
        m.len()
    );
    // The last cut comes in the tick that records the end, just after it:
    // a reader can see the job ended a moment before.
    let on_disk = || std::fs::metadata(&log).unwrap().blocks() * 512;
    let bound = (1 << 20) + (1 << 20) / 8 + 65536;
    let t = std::time::Instant::now();
    while on_disk() > bound && t.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(on_disk() <= bound, "{} bytes on disk", on_disk());
    let out = n.ok(ALICE, &["logs", &id]);
    assert!(out.starts_with("FIRST\n1: a chatty"), "{}", &out[..100]);
    assert!(out.trim_end().ends_with("LAST"), "the tail is kept");
    assert!(out.contains("bytes of output cut here"), "readers are told");
    assert!(!out.contains('\0'), "the hole is never read as zeros");
    assert!(out.len() < 2 << 20, "{}", out.len());

    // The job does not hold its log: its stdout is a pipe to its keeper
    // (issue 40, point 6), so it can neither write back into the part
    // labd cut nor allocate disk through it, charged to root.
    let probe = r#"
import errno, os, stat
print("pipe" if stat.S_ISFIFO(os.fstat(1).st_mode) else "FILE", flush=True)
tries = [
    ("pwrite", lambda: os.pwrite(1, b"y" * 4096, 1 << 20)),
    ("fallocate", lambda: os.posix_fallocate(1, 0, 64 << 20)),
    ("truncate", lambda: os.ftruncate(1, 0)),
]
for what, f in tries:
    try:
        f()
        print(what, "WORKED", flush=True)
    except OSError as e:
        print(what, errno.errorcode[e.errno], flush=True)
"#;
    let second = n.detach(
        ALICE,
        &["--gpus", "0", "--", "/usr/bin/python3", "-c", probe],
    );
    wait_until("the probing job to end", 60, || n.ended(&second));
    let out = n.ok(ALICE, &["logs", &second]);
    assert!(
        out.starts_with("pipe\n") && out.contains("pwrite ") && !out.contains("WORKED"),
        "{out}"
    );
    wait_until("the log to go with the folder", 30, || !log.exists());
}

/// Issue 9, point 12: a local user without a token can connect to a shared
/// labd's socket. Holding connections open without sending anything must not
/// lock others out: beyond `max_connections_per_user` they are closed at
/// once, and the rest after `header_timeout_ms`; meanwhile other users are
/// served.
#[test]
fn idle_connections_of_a_user_without_a_token_cannot_lock_labd() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: cannot play another local user");
        return;
    }
    let n = Node::start(
        Some("1x11GiB"),
        "run_as = \"labd\"\nmax_connections_per_user = 16\nheader_timeout_ms = 3000",
    );
    let sock = n.addr.strip_prefix("unix://").unwrap().to_string();
    let script = r#"
import socket, sys, time
socks = []
for i in range(200):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except OSError:
        break
    socks.append(s)
def closed(s):
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
# labd closes what is over the cap as it accepts it: wait for that (busy CI
# machines accept slowly), then report.
deadline = time.time() + 10
while sum(closed(s) for s in socks) < len(socks) - 16 and time.time() < deadline:
    time.sleep(0.05)
print("opened", len(socks), "closed", sum(closed(s) for s in socks), flush=True)
sys.stdin.readline()
time.sleep(4)
print("closed", sum(closed(s) for s in socks), flush=True)
"#;
    let mut attacker = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["/usr/bin/python3", "-c", script, &sock])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(attacker.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let f: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(f.len(), 2, "{line}");
    let (opened, closed_at_once) = (f[0], f[1]);
    assert!(opened >= 100, "{line}");
    assert_eq!(
        closed_at_once,
        opened - 16,
        "all but 16 closed at once: {line}"
    );
    // While nobody holds its 16 connections, alice is served.
    assert!(n.status().contains("free"));
    use std::io::Write;
    writeln!(attacker.stdin.as_mut().unwrap()).unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(
        line.trim(),
        format!("closed {opened}"),
        "idle connections closed after the header timeout"
    );
    attacker.wait().unwrap();
}

/// A request without a valid token is refused from its headers: labd reads
/// none of its body (a body up to the 2 MB limit, held for the 60 s a
/// request may take on each of a user's connections, was memory anyone
/// who can reach the socket could make labd hold).
#[test]
fn a_request_without_a_token_is_refused_before_its_body_is_read() {
    use std::io::{Read, Write};
    let n = Node::start(None, "run_as = \"labd\"");
    let sock = n.addr.strip_prefix("unix://").unwrap().to_string();
    // Every route that takes a body: users' (a token) and nodes' (a
    // cluster signature, which this labd in no cluster never accepts).
    let routes = [
        "/v1/jobs",
        "/v1/cluster/explain",
        "/v1/cluster/rank",
        "/v1/stage",
        "/v1/stage/done",
        "/v1/warm",
        "/v1/cluster/heartbeat",
        "/v1/cluster/stage",
        "/v1/cluster/stage/done",
        "/v1/cluster/warm",
        "/v1/cluster/locate",
        "/v1/cluster/jobs",
    ];
    for route in routes {
        for auth in ["", "Authorization: Bearer not-a-token-of-anyone\r\n"] {
            let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let head = format!(
                "POST {route} HTTP/1.1\r\nHost: labd\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n{auth}\r\n",
                (2 << 20) - 1
            );
            s.write_all(head.as_bytes()).unwrap();
            let mut answer = [0u8; 12];
            s.read_exact(&mut answer)
                .unwrap_or_else(|e| panic!("{route}: no answer before the body is sent: {e}"));
            assert_eq!(&answer, b"HTTP/1.1 401", "{route} {auth:?}");
        }
    }
}

/// Issue 9, point 10: labd on a full disk. Materialising a job's data into
/// a node cache on a full file system fails the job with a clear error and
/// leaves no tree behind; the same job runs once space is freed. A final
/// outputs save into a store on a full disk fails, is retried, and lands
/// once space is freed, leaving the store verifiable throughout.
#[test]
fn labd_on_a_full_disk_says_so_and_recovers_once_space_is_freed() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: cannot mount a small file system");
        return;
    }
    let cache_fs = crate::support::Mounted::tmpfs(16 << 10);
    let store_fs = crate::support::Mounted::tmpfs(16 << 10);
    let n = Node::start_at(
        None,
        None,
        "run_as = \"labd\"\noutputs_retry_s = 1",
        Some(&cache_fs.path.join("cache")),
        Some(&store_fs.path.join("store")),
    );
    let data = n.path("ds");
    std::fs::create_dir_all(&data).unwrap();
    for i in 0..4u64 {
        std::fs::write(
            data.join(format!("{i}.png")),
            crate::support::random_bytes(1_000_000, i),
        )
        .unwrap();
    }
    let o = n.labsync(&["push", data.to_str().unwrap(), "--name", "ds"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::create_dir_all(n.path("code")).unwrap();

    // The node cache's disk is full: the data cannot be materialised.
    let filler = cache_fs.path.join("filler");
    std::fs::write(&filler, vec![1u8; 12 << 20]).unwrap();
    let count = "ls $LABRUN_DATA | wc -l";
    let id = n.detach(
        ALICE,
        &["--gpus", "0", "--data", "ds", "--", "bash", "-c", count],
    );
    wait_until("the job to fail", 30, || n.ended(&id));
    match n.job(&id).state {
        JobState::Failed { reason } => assert!(
            reason.contains("not enough space") && reason.contains("needed"),
            "{reason}"
        ),
        s => panic!("{s:?}"),
    }
    // The code's tree is there; no tree (or leftover) holds any of the data.
    let half: Vec<_> = std::fs::read_dir(cache_fs.path.join("cache/trees-v2"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|t| t.join("0.png").exists() || t.join("3.png").exists())
        .collect();
    assert!(half.is_empty(), "no half tree is kept: {half:?}");
    std::fs::remove_file(&filler).unwrap();
    let id = n.detach(
        ALICE,
        &["--gpus", "0", "--data", "ds", "--", "bash", "-c", count],
    );
    wait_until("the job to run", 30, || n.ended(&id));
    assert_eq!(n.ok(ALICE, &["logs", &id]).trim(), "4");

    // The store's disk is full when the job's outputs are saved.
    // About 1 MiB is left: the code push fits, a 3 MB checkpoint does not.
    let filler = store_fs.path.join("filler");
    std::fs::write(&filler, vec![1u8; 11 << 20]).unwrap();
    let script = "mkdir -p ckpt; head -c 3000000 /dev/urandom > ckpt/model.pt";
    let id = n.detach(
        ALICE,
        &[
            "--gpus",
            "0",
            "--outputs",
            "ckpt",
            "--",
            "bash",
            "-c",
            script,
        ],
    );
    wait_until("a failed save", 30, || n.job(&id).meta.outputs_failures > 0);
    let j = n.job(&id);
    assert!(
        j.meta
            .outputs_error
            .as_deref()
            .is_some_and(|e| e.contains("No space left")),
        "{j:?}"
    );
    let v = n.labsync(&["verify"]);
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
    std::fs::remove_file(&filler).unwrap();
    wait_until("the outputs to be saved", 60, || n.ended(&id));
    let saved = n.job(&id).meta.outputs_saved.unwrap_or_default();
    assert!(saved.starts_with(&format!("runs/{id}@v1#")), "{saved}");
}

/// A job's folder its user made 30,000 folders deep (`mkdir a && cd a` in
/// a loop) is swept like any other: removing it recursively overflowed the
/// stack of labd's sweeping thread (or ran out of descriptors), and a crash
/// there came back at every restart.
#[test]
fn a_working_folder_made_deeper_than_a_stack_is_swept_and_labd_lives_on() {
    let n = Node::start(None, "run_as = \"labd\"\nwork_keep_s = 0");
    let go = n.path("go");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", go.display());
    let id = n.bash(ALICE, 0, &script);
    wait_until("the job to run", 20, || {
        matches!(n.job(&id).state, JobState::Running { .. })
    });
    let work = n.job(&id).meta.work.clone().unwrap();
    let job_dir = n.path(&format!("state/jobs/{id}"));
    // Should the test fail, the temporary folder's recursive removal must
    // not meet the chain.
    let _cut = RemoveOnDrop(job_dir.clone());
    deep_chain(&work, 30_000);
    std::fs::write(&go, "").unwrap();
    wait_until("the deep working folder to be swept", 60, || {
        n.ended(&id) && !job_dir.exists()
    });
    // Said once the folder is gone: the line may come a moment after the
    // folder's last `rmdir` (seen under a loaded machine).
    let said = format!("removed the working folder and log of job {id}");
    let log = || std::fs::read_to_string(n.path("labd.log")).unwrap();
    wait_until("labd to say it removed the folder", 10, || {
        log().contains(&said)
    });
    assert!(n.status().contains("node"), "labd still answers");
}

/// A log removed under labd (here swept right away, `work_keep_s = 0`)
/// is said to be gone: it read as empty, so `labrun` and `labrun logs`
/// printed nothing and succeeded, as if the job had said nothing (seen
/// once in the follow benchmark, where a stray labd swept the job's log).
#[test]
fn a_log_removed_before_it_is_read_is_said_to_be_gone_not_empty() {
    let n = Node::start(None, "run_as = \"labd\"\nwork_keep_s = 0");
    let id = n.bash(ALICE, 0, "echo first");
    let (job_dir, log) = (
        n.path(&format!("state/jobs/{id}")),
        n.path(&format!("state/logs/{id}.log")),
    );
    wait_until("the job to end and be swept", 60, || {
        n.ended(&id) && !job_dir.exists() && !log.exists()
    });
    for args in [vec!["logs", id.as_str()], vec!["logs", "-f", id.as_str()]] {
        let o = n.labrun(Some(ALICE), &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "labrun {args:?} succeeded: {err}");
        assert!(
            o.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(
            err.contains(&format!("the output of job {id} is gone")),
            "labrun {args:?}: {err}"
        );
    }
}

/// A labd whose state folder is replaced under it stops, saying why,
/// instead of acting on the new folder: one left running so (by a
/// benchmark harness that died) swept the job folders and logs of the labd
/// started on the new folder, which its own database did not know.
#[test]
fn a_labd_whose_state_folder_is_replaced_stops_and_a_new_one_runs_there() {
    let mut n = Node::start(None, "run_as = \"labd\"");
    let state = n.path("state");
    std::fs::rename(&state, n.path("state.old")).unwrap();
    std::fs::create_dir(&state).unwrap();
    let mut labd = n.labd.take().unwrap();
    wait_until("labd to stop", 30, || labd.try_wait().unwrap().is_some());
    assert_eq!(labd.wait().unwrap().code(), Some(1));
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(
        log.contains(&format!(
            "the state folder {} was removed or replaced while labd ran",
            state.display()
        )) && log.contains("no job was running"),
        "{log}"
    );
    n.restart();
    let id = n.bash(ALICE, 0, "echo first");
    wait_until("the job to end", 30, || n.ended(&id));
    assert_eq!(n.ok(ALICE, &["logs", &id]), "first\n");
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if self.0.exists() {
            let _ = labsync_store::remove_tree(&self.0);
        }
    }
}

/// Makes `a/a/…`, `depth` folders deep, in `dir`: chains of 1,000 made with
/// short paths, each moved under the deepest folder of the next.
fn deep_chain(dir: &Path, depth: usize) {
    let chain = dir.join("chain");
    for k in 0..depth / 1000 {
        let next = dir.join(format!("next{k}"));
        // Not `create_dir_all`: it recurses once per folder it makes.
        let mut deepest = next.clone();
        std::fs::create_dir(&deepest).unwrap();
        for _ in 0..1000 {
            deepest.push("a");
            std::fs::create_dir(&deepest).unwrap();
        }
        if chain.exists() {
            std::fs::rename(&chain, deepest.join("a")).unwrap();
        }
        std::fs::rename(&next, &chain).unwrap();
    }
}

/// Test 6 (crashed) and the exit code: a job that fails leaves its outputs in
/// the store, and labrun exits with the job's code after streaming its output.
#[test]
fn crashed_job_leaves_its_outputs_and_labrun_returns_its_exit_code() {
    let n = Node::start(None, "run_as = \"labd\"\nwork_keep_s = 0");
    std::fs::create_dir_all(n.path("code")).unwrap();
    std::fs::write(
        n.path("code/train.sh"),
        "mkdir -p ckpt; echo step-100 > ckpt/last.pt; echo training; echo oops >&2; exit 7\n",
    )
    .unwrap();
    let o = n.labrun(Some(ALICE), &["--outputs", "ckpt", "train.sh"]);
    assert_eq!(
        o.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("training") && out.contains("oops"), "{out}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("outputs saved as runs/j1@v1"), "{err}");
    let dest = n.path("recovered");
    assert!(n
        .labsync(&["pull", "runs/j1", dest.to_str().unwrap()])
        .status
        .success());
    assert_eq!(
        std::fs::read_to_string(dest.join("last.pt")).unwrap(),
        "step-100\n"
    );
    // Saved in the store, the job's folder on the node goes (work_keep_s = 0).
    wait_until("the working folder to be swept", 20, || {
        !n.path("state/jobs/j1").exists()
    });
    // Asking for a GPU on a node without any is refused, with what to do
    // (this node reads the real inventory: on a GPU machine it has GPUs).
    if n.status().contains("no GPUs on this node") {
        let o = n.labrun(Some(ALICE), &["--gpus", "1", "train.sh"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&o.stderr).contains("--gpus 0"));
    }
}

/// Ctrl-C as srun users expect: once shows the state and leaves the job
/// running; twice within a second kills it, and labrun returns its status.
#[test]
fn ctrl_c_once_reports_twice_kills() {
    let n = Node::start(None, "run_as = \"labd\"");
    std::fs::create_dir_all(n.path("code")).unwrap();
    let mut child = n
        .labrun_cmd(
            Some(ALICE),
            &["--gpus", "0", "--", "bash", "-c", "echo started; sleep 300"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "started\n");
    let sigint = |pid: u32| {
        assert!(Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status()
            .unwrap()
            .success())
    };
    sigint(child.id());
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "one Ctrl-C leaves labrun following"
    );
    assert!(
        matches!(n.job("j1").state, JobState::Running { .. }),
        "and the job running"
    );
    sigint(child.id());
    std::thread::sleep(Duration::from_millis(200));
    sigint(child.id());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("Ctrl-C again within 1 s kills it"), "{err}");
    assert_eq!(o.status.code(), Some(128 + 15), "killed by SIGTERM: {err}");
    assert!(n.job("j1").ended());
}

/// Test 5: `kill -9` of labd mid-job and a restart: the live job is adopted
/// (its GPU stays leased to it), the one that died meanwhile is marked failed
/// and its GPU freed; when the adopted job ends, its GPU is freed too.
#[test]
fn labd_crash_and_restart_adopts_live_jobs_and_frees_dead_ones() {
    let mut n = Node::start(Some("2x11GiB"), "run_as = \"labd\"");
    let long = n.bash(ALICE, 1, "echo before; sleep 3; echo after");
    let short = n.bash(ALICE, 1, "sleep 0.5");
    wait_until("both to run", 20, || {
        [&long, &short]
            .iter()
            .all(|id| matches!(n.job(id).state, JobState::Running { .. }))
    });
    let waiting = n.bash(ALICE, 2, "echo both=$CUDA_VISIBLE_DEVICES");
    wait_until("the third to queue", 20, || n.job(&waiting).why.is_some());
    n.crash();
    std::thread::sleep(Duration::from_millis(1000));
    n.restart();
    let (l, s) = (n.job(&long), n.job(&short));
    assert!(
        matches!(l.state, JobState::Running { start: Some(_), .. }),
        "adopted, with its leader's start time on record: {l:?}"
    );
    assert_eq!(l.gpus.len(), 1);
    assert!(
        matches!(s.state, JobState::Failed { .. }),
        "dead one failed: {s:?}"
    );
    assert!(n.status().contains(&format!("leased to {long} (alice)")));
    assert_eq!(
        n.job(&waiting).state,
        JobState::Queued,
        "still queued after the restart"
    );
    wait_until("the adopted job to end", 20, || n.job(&long).ended());
    // Its output's keeper outlived labd: what it printed after the crash
    // is in its log.
    assert_eq!(n.ok(ALICE, &["logs", &long]), "before\nafter\n");
    wait_until("the queued job to run and end", 20, || n.ended(&waiting));
    assert_eq!(n.ok(ALICE, &["logs", &waiting]).trim(), "both=0,1");
    let status = n.status();
    assert_eq!(status.matches("free").count(), 2, "{status}");
}

/// Issue 40, point 6: a job's output cannot outlive its job. A
/// descriptor of the job's stdout taken out of it (here by root through
/// `/proc`, as a job passes one out with `SCM_RIGHTS`) reaches the log
/// while the job runs; once the job has ended, its writes fail (`EPIPE`)
/// and the log stays as it was, however much is written.
#[test]
fn a_jobs_output_cannot_outlive_its_job() {
    use std::io::Write;
    let n = Node::start(None, "run_as = \"labd\"");
    let job = n.bash(ALICE, 0, "echo started; sleep 300");
    wait_until("the job to print", 20, || {
        n.ok(ALICE, &["logs", &job]).contains("started")
    });
    let leader = sid(&n.job(&job));
    let mut held = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{leader}/fd/1"))
        .unwrap();
    held.write_all(b"from outside while it runs\n").unwrap();
    wait_until("the outside line in the log", 20, || {
        n.ok(ALICE, &["logs", &job])
            .contains("from outside while it runs")
    });
    n.ok(ALICE, &["kill", &job]);
    wait_until("the job to end", 20, || n.job(&job).ended());
    let mut written = 0u64;
    let err = loop {
        match held.write_all(&[b'x'; 1 << 16]) {
            Err(e) => break e,
            Ok(()) => {
                written += 1 << 16;
                assert!(
                    written < 64 << 20,
                    "64 MiB written to an ended job's output"
                );
            }
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
    assert_eq!(written, 0, "written after the job's end");
    let log = n.ok(ALICE, &["logs", &job]);
    assert!(!log.contains("xxxx"), "{log}");
    let said = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(said.contains("still holds its output open"), "{said}");
}

/// Issue 40, point 5: disk held for a user is charged to that user. Two
/// versions of one dataset, 0.7 MB each, and a share of 1 MB: alice's job
/// on v1 holds 0.7 MB, her job on v2 is refused before anything is pulled
/// (saying what she holds and her share), another on v1 costs nothing
/// more, bob's on v2 counts against his own share; `labrun ps` says what
/// she holds; once her v1 job ends, v2 fits.
#[test]
fn trees_held_for_a_user_are_charged_to_that_user() {
    let n = Node::start(None, "run_as = \"labd\"\ntrees_per_user = \"1000000\"");
    for byte in [1u8, 2] {
        let d = n.path(&format!("div2k-{byte}"));
        std::fs::create_dir_all(d.join("train")).unwrap();
        std::fs::write(d.join("train/0001.png"), vec![byte; 700_000]).unwrap();
        let o = n.labsync(&["push", d.to_str().unwrap(), "--name", "div2k"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let on = |token: &str, version: &str, script: &str| {
        n.detach(token, &["--data", version, "--", "bash", "-c", script])
    };
    let v1 = on(ALICE, "div2k@v1", "sleep 60");
    wait_until("alice's v1 job to run", 30, || {
        matches!(n.job(&v1).state, JobState::Running { .. })
    });
    let v2 = on(ALICE, "div2k@v2", "echo ran");
    wait_until("alice's v2 job to end", 30, || n.ended(&v2));
    match n.job(&v2).state {
        JobState::Failed { reason } => assert!(
            reason.contains("alice's jobs and stages on")
                && reason.contains("hold 683.59 KiB")
                && reason.contains("div2k@v2 (683.59 KiB)")
                && reason.contains("share of 976.56 KiB (trees_per_user)"),
            "{reason}"
        ),
        other => panic!("alice's v2 job: {other:?}"),
    }
    let again = on(ALICE, "div2k@v1", "echo again");
    let bobs = on(BOB, "div2k@v2", "echo bob");
    wait_until("both to end", 30, || n.ended(&again) && n.ended(&bobs));
    for id in [&again, &bobs] {
        assert_eq!(n.job(id).exit_code(), Some(0), "{:?}", n.job(id));
    }
    let ps = n.ok(ALICE, &["ps"]);
    assert!(
        ps.contains("code and data your jobs hold on")
            && ps.contains(": 683.59 KiB; your share is 976.56 KiB (trees_per_user)"),
        "{ps}"
    );
    n.ok(ALICE, &["kill", &v1]);
    wait_until("alice's v1 job to end", 30, || n.job(&v1).ended());
    let fits = on(ALICE, "div2k@v2", "echo fits");
    wait_until("alice's v2 job to end", 30, || n.ended(&fits));
    assert_eq!(n.job(&fits).exit_code(), Some(0), "{:?}", n.job(&fits));
}

/// Issue 40, point 7: a job that can never start does not stop the node.
/// On an 11 GiB card whose driver keeps 300 MiB, as real idle cards do, a
/// job asking the whole card is failed with the reason, and the jobs
/// behind it run.
#[test]
fn a_job_that_can_never_start_does_not_stop_the_node() {
    let n = Node::start(Some("1x11GiB"), "run_as = \"labd\"");
    n.control("reserved = [{ gpu = 0, mib = 300 }]\n");
    let whole = n.detach(ALICE, &["--gpus", "1", "--gpu-mem", "11G", "--", "true"]);
    let behind = n.detach(BOB, &["--gpus", "1", "--", "echo", "behind"]);
    wait_until("both to end", 30, || n.ended(&whole) && n.ended(&behind));
    match n.job(&whole).state {
        JobState::Failed { reason } => assert!(
            reason.contains("never fits") && reason.contains("300 MiB the driver keeps"),
            "{reason}"
        ),
        other => panic!("a job no card can serve: {other:?}"),
    }
    assert_eq!(n.job(&behind).exit_code(), Some(0), "{:?}", n.job(&behind));
    assert_eq!(n.ok(BOB, &["logs", &behind]), "behind\n");
}

/// Test 7: without a valid token nothing but the health check answers; a user
/// cannot kill or read another user's job; an admin can.
#[test]
fn tokens_are_required_and_users_own_their_jobs() {
    let n = Node::start(None, "run_as = \"labd\"");
    for token in [None, Some("wrong-token")] {
        let o = n.labrun(token, &["ps"]);
        assert_eq!(o.status.code(), Some(1));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("no valid token"), "{err}");
        assert!(!err.contains(ALICE));
    }
    let id = n.detach(ALICE, &["--", "bash", "-c", "echo secret; sleep 30"]);
    wait_until("the job to print", 20, || {
        n.ok(ALICE, &["logs", &id]).contains("secret")
    });
    let o = n.labrun(Some(BOB), &["logs", &id]);
    assert!(!o.status.success() && o.stdout.is_empty());
    assert!(String::from_utf8_lossy(&o.stderr).contains("only they or an admin"));
    assert!(!n.labrun(Some(BOB), &["kill", &id]).status.success());
    assert!(matches!(n.job(&id).state, JobState::Running { .. }));
    assert!(
        n.ok(BOB, &["ps", "--all"]).contains(&id),
        "everyone sees every job"
    );
    assert!(!n.ok(BOB, &["ps"]).contains(&id), "ps alone is one's own");
    n.ok(ADMIN, &["kill", &id]);
    wait_until("the job to end", 20, || n.job(&id).ended());
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(
        !log.contains(ALICE) && !log.contains("wrong-token"),
        "tokens are never logged"
    );
}

/// Test 8: data is read-only to the job, and two concurrent jobs on one
/// dataset share one materialised copy. When the tests run as root, the job
/// runs as `nobody`, as it would for a user on a shared node.
#[test]
fn data_is_read_only_and_shared_between_jobs() {
    let n = Node::start(None, "");
    let user_token = "tok-nobody-0123456789";
    let data = n.path("div2k");
    std::fs::create_dir_all(data.join("train")).unwrap();
    std::fs::write(data.join("train/0001.png"), vec![7u8; 300_000]).unwrap();
    assert!(n
        .labsync(&["push", data.to_str().unwrap(), "--name", "div2k"])
        .status
        .success());
    let script = "echo data=$LABRUN_DATA_DIV2K same=$([ \"$LABRUN_DATA\" = \"$LABRUN_DATA_DIV2K\" ] && echo y); \
                  echo inode=$(stat -c %i $LABRUN_DATA/train/0001.png); \
                  touch $LABRUN_DATA/new 2>/dev/null && echo WROTE-NEW; \
                  echo x >> $LABRUN_DATA/train/0001.png 2>/dev/null && echo WROTE-OLD; \
                  rm -f $LABRUN_DATA/train/0001.png 2>/dev/null; [ -e $LABRUN_DATA/train/0001.png ] || echo REMOVED; \
                  echo whoami=$(id -un); sleep 1";
    let a = n.detach(user_token, &["--data", "div2k", "--", "bash", "-c", script]);
    let b = n.detach(user_token, &["--data", "div2k", "--", "bash", "-c", script]);
    wait_until("both jobs to end", 30, || n.ended(&a) && n.ended(&b));
    let (la, lb) = (
        n.ok(user_token, &["logs", &a]),
        n.ok(user_token, &["logs", &b]),
    );
    for log in [&la, &lb] {
        assert!(log.contains("same=y"), "{log}");
        assert!(
            !log.contains("WROTE") && !log.contains("REMOVED"),
            "data writable: {log}"
        );
        if labsync_agent::euid() == 0 {
            assert!(
                log.contains("whoami=nobody"),
                "runs as its submitter: {log}"
            );
        }
    }
    let line = |log: &str, key: &str| {
        log.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("{key} missing in {log}"))
            .to_string()
    };
    assert_eq!(
        line(&la, "data="),
        line(&lb, "data="),
        "one materialised copy"
    );
    assert_eq!(line(&la, "inode="), line(&lb, "inode="));
    let trees: Vec<_> = std::fs::read_dir(n.path("cache/trees-v2"))
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.') && e.path().is_dir())
        .collect();
    assert_eq!(
        trees.len(),
        2,
        "one tree for the data, one for the (empty) code"
    );
    assert_eq!(
        std::fs::read(data.join("train/0001.png")).unwrap(),
        vec![7u8; 300_000],
        "the source is untouched"
    );
}

/// Materialised trees are bounded: above `trees_max`, a tree no active job
/// uses is removed; one in use stays. (That an eviction pass runs while
/// the job does and keeps its tree is shown on a paused clock, with no
/// wait, by `a_tree_in_use_outlives_an_eviction_pass_on_a_paused_clock`
/// in `crates/agent/tests/daemon.rs`; this one slept 6 s for it.)
#[test]
fn unused_trees_are_evicted_above_the_cap_but_never_in_use() {
    // No share per user: one tree is past any share of a 1K budget.
    let n = Node::start(
        None,
        "run_as = \"labd\"\ntrees_max = \"1K\"\ntrees_per_user = \"0\"",
    );
    let data = n.path("div2k");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("0001.png"), vec![7u8; 300_000]).unwrap();
    assert!(n
        .labsync(&["push", data.to_str().unwrap(), "--name", "div2k"])
        .status
        .success());
    let data_trees = || -> usize {
        std::fs::read_dir(n.path("cache/trees-v2"))
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().join("0001.png").exists())
                    .count()
            })
            .unwrap_or(0)
    };
    let release = n.path("release");
    let script = format!(
        "while [ ! -e {} ]; do sleep 0.05; done; wc -c < $LABRUN_DATA/0001.png",
        release.display()
    );
    let id = n.detach(ALICE, &["--data", "div2k", "--", "bash", "-c", &script]);
    wait_until("the job to run", 20, || {
        matches!(n.job(&id).state, JobState::Running { .. })
    });
    assert_eq!(data_trees(), 1, "in use: kept over the cap");
    std::fs::write(&release, "").unwrap();
    wait_until("the job to end", 20, || n.ended(&id));
    assert_eq!(n.ok(ALICE, &["logs", &id]).trim(), "300000");
    wait_until("the unused data tree to go", 20, || data_trees() == 0);
}

/// A root labd reads a job's outputs as the job's user: a job that swaps its
/// outputs folder for a symlink to a root-only folder saves nothing of it.
/// (Only root can run jobs as another user, so only then is there anything to show.)
#[test]
fn outputs_are_read_as_the_jobs_user() {
    if labsync_agent::euid() != 0 {
        eprintln!("not root: jobs run as labd's own user; nothing to escalate");
        return;
    }
    let n = Node::start(None, "outputs_retry_s = 1");
    // Whether the folder is there is looked at as the job's user too: a
    // link into a folder only root may enter cannot be looked at (issue 40,
    // point 14: not "no folder"), is given up as unreadable after three
    // tries, and the answer says nothing of what root would have seen there.
    // A job of nobody's whose outputs folder `ckpt` is a symlink to `to`.
    let linking_to = |to: &std::path::Path| {
        let script = format!("rm -rf ckpt; ln -s {} ckpt", to.display());
        n.detach(
            "tok-nobody-0123456789",
            &["--outputs", "ckpt", "--", "bash", "-c", &script],
        )
    };
    let closed = n.path("closed");
    std::fs::create_dir_all(closed.join("inside")).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let id = linking_to(&closed.join("inside"));
    wait_until("the final push to be settled", 30, || {
        let j = n.job(&id);
        j.ended() && !j.meta.outputs_pending
    });
    let err = n.job(&id).meta.outputs_error.unwrap();
    assert!(
        err.contains("may not look at its outputs folder")
            && err.contains("ermission denied")
            && err.contains("gave up after 3 tries"),
        "{err}"
    );
    // A folder the user may enter but not read: the push itself is refused.
    let secret = n.path("root-only");
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(secret.join("key"), "root's").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o711)).unwrap();
    let id = linking_to(&secret);
    // The failed final push is retried later (10 s, 60 s); its first failure is enough here.
    wait_until("the final push to fail", 30, || {
        let j = n.job(&id);
        j.ended() && j.meta.outputs_error.is_some()
    });
    let j = n.job(&id);
    assert_eq!(j.meta.outputs_saved, None, "{j:?}");
    let err = j.meta.outputs_error.unwrap();
    assert!(
        err.contains("root-only"),
        "refused reading the escaped folder: {err}"
    );
    let ls = n.labsync(&["ls"]);
    assert!(!String::from_utf8_lossy(&ls.stdout).contains(&format!("runs/{id}")));
    // Unreadable outputs do not heal by waiting: labd gives up after three
    // tries instead of keeping the job (and its folder) active for ever.
    wait_until("labd to give up", 30, || !n.job(&id).meta.outputs_pending);
    let err = n.job(&id).meta.outputs_error.unwrap();
    assert!(err.contains("gave up after 3 tries"), "{err}");
}

/// Outputs no snapshot can hold (a folder deeper than 256 levels) do not
/// heal by waiting either: the final push is given up after three tries,
/// and the job settles (its folder and trees are not held for ever).
#[test]
fn outputs_too_deep_to_save_are_given_up() {
    let n = Node::start(None, "outputs_retry_s = 1");
    let script = "mkdir -p ckpt && cd ckpt && for i in $(seq 300); do mkdir d && cd d; done";
    // nobody's where labd is root (jobs run as their users), else labd's.
    let id = n.detach(
        "tok-nobody-0123456789",
        &["--outputs", "ckpt", "--", "bash", "-c", script],
    );
    wait_until("labd to give up on the final push", 60, || {
        let j = n.job(&id);
        j.ended() && !j.meta.outputs_pending
    });
    let j = n.job(&id);
    assert_eq!(j.meta.outputs_saved, None, "{j:?}");
    let err = j.meta.outputs_error.unwrap();
    assert!(
        err.contains("more than 256 folders deep") && err.contains("gave up after 3 tries"),
        "{err}"
    );
}

/// A cluster node listens on TCP: the same API, the same tokens.
#[test]
fn tcp_listener_serves_the_same_api() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let n = Node::start_on(
        Some(&format!("127.0.0.1:{port}")),
        Some("1x11GiB"),
        "run_as = \"labd\"",
    );
    let out = n.ok(
        ALICE,
        &[
            "--gpus",
            "1",
            "--",
            "bash",
            "-c",
            "echo over tcp on $CUDA_VISIBLE_DEVICES",
        ],
    );
    assert_eq!(out.trim(), "over tcp on 0");
    assert!(n.labrun(Some("wrong-token"), &["status"]).status.code() == Some(1));
}

/// Test 9: the README's main command (scripts/quickstart.sh), on a fresh HOME
/// with no configuration: it starts its own labd, runs the sample training
/// script on the sample dataset, and saves the checkpoint.
#[test]
fn readme_main_job_runs_on_a_fresh_home() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let bin = crate::bin("labrun").parent().unwrap().to_path_buf();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/quickstart.sh");
    let o = Command::new("bash")
        .arg(script)
        .env("HOME", &home)
        .env_remove("XDG_CONFIG_HOME")
        .env_remove("XDG_STATE_HOME")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_CACHE_HOME")
        .env_remove("LABSYNC_STORE")
        .env_remove("LABSYNC_CACHE")
        .env_remove("LABRUN_LABD")
        .env_remove("LABRUN_TOKEN")
        .env("LABSYNC_BIN", bin)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // The personal labd keeps the store it started with; a changed setting is said.
    let moved = Command::new(crate::bin("labrun"))
        .args(["--", "true"])
        .current_dir(&home)
        .env("HOME", &home)
        .env("LABSYNC_STORE", dir.path().join("elsewhere"))
        .env_remove("LABRUN_LABD")
        .env_remove("LABRUN_TOKEN")
        .env_remove("XDG_STATE_HOME")
        .output()
        .unwrap();
    let pid = std::fs::read_to_string(home.join(".local/state/labsync/labd/labd.pid"));
    if let Ok(pid) = &pid {
        let _ = Command::new("kill").arg(pid.trim()).status();
    }
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "quickstart failed:\n{out}\n{err}");
    assert!(pid.is_ok(), "labrun started a labd of its own");
    assert!(
        out.contains("10 images at") && out.contains("epoch 3/3"),
        "{out}"
    );
    assert!(
        out.contains("runs/j1"),
        "the checkpoint is listed in the store: {out}"
    );
    assert!(err.contains("outputs saved as runs/j1@v1"), "{err}");
    let moved_err = String::from_utf8_lossy(&moved.stderr);
    assert!(
        !moved.status.success()
            && moved_err.contains("uses store")
            && moved_err.contains("kill $(cat"),
        "{moved_err}"
    );
    assert!(
        home.join(".local/share/labsync/store/config").exists(),
        "embedded default store"
    );
}

/// Issue 40, point 16: an idle hold given back ends what its holder runs
/// on the held GPU from their own shell (their processes whose
/// environment names it, as the hold told them to export, or that NVML
/// lists on it), after saying so in the hold's log; their processes on
/// another GPU, and another user's on the same one, are never touched.
#[test]
fn an_idle_hold_given_back_ends_what_its_holder_runs_on_it() {
    if labsync_agent::euid() != 0 {
        return; // Running processes as other users needs root.
    }
    let n = Node::start(Some("2x11GiB"), "idle_hold_s = 2");
    let nobody = "tok-nobody-0123456789";
    let out = n.ok(nobody, &["--hold", "1h", "--gpus", "1"]);
    let gpu: u32 = out
        .split("CUDA_VISIBLE_DEVICES=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("which GPU: {out}"));
    let hold = n
        .jobs()
        .into_iter()
        .find(|j| j.meta.hold_s.is_some())
        .expect("the hold in labrun ps");
    let spawn = |uid: u32, visible: Option<u32>| {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
        ])
        .args(["sleep", "600"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null());
        if let Some(g) = visible {
            c.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
                .env("CUDA_VISIBLE_DEVICES", g.to_string());
        }
        c.spawn().unwrap()
    };
    let mut in_shell = spawn(65534, Some(gpu));
    let mut listed = spawn(65534, None);
    let mut elsewhere = spawn(65534, Some(1 - gpu));
    let mut not_theirs = spawn(4242, Some(gpu));
    std::fs::write(
        n.path("control.toml"),
        format!(
            "processes = [{{ gpu = {gpu}, pid = {}, mib = 100 }}]\n",
            listed.id()
        ),
    )
    .unwrap();
    wait_until("the idle hold to be given back", 30, || {
        n.job(&hold.id).ended()
    });
    wait_until("the holder's processes on its GPU to end", 15, || {
        in_shell.try_wait().unwrap().is_some() && listed.try_wait().unwrap().is_some()
    });
    let left: Vec<_> = [&mut elsewhere, &mut not_theirs]
        .into_iter()
        .map(|c| c.try_wait().unwrap())
        .collect();
    for c in [&mut elsewhere, &mut not_theirs] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert_eq!(
        left,
        [None, None],
        "another GPU's, another user's: untouched"
    );
    let log = n.ok(nobody, &["logs", &hold.id]);
    assert!(
        log.contains("labd: ending 2 process(es) of nobody on the GPU(s) given back")
            && log.contains(&format!("{} (sleep)", in_shell.id())),
        "{log}"
    );
}

/// Issue 40, point 3: a job cannot make its node push its outputs more
/// often than the node's floor (`outputs_every_min_s`, 60 s by default):
/// `--outputs-every 1s` is taken as 60 s, and `labrun ps` shows it.
#[test]
fn outputs_are_pushed_no_more_often_than_the_nodes_floor() {
    let n = Node::start(None, "run_as = \"labd\"");
    let id = n.detach(
        ALICE,
        &[
            "--outputs",
            "ckpt",
            "--outputs-every",
            "1s",
            "--",
            "sleep",
            "30",
        ],
    );
    let j = n.job(&id);
    assert_eq!(j.meta.outputs_every_s, 60, "{j:?}");
    n.ok(ALICE, &["kill", &id]);
}

/// Issue 40, point 3: outputs pushes run through one node-wide limit.
/// Eight jobs that end together, each with 4 MB of outputs, make eight
/// final pushes due at once: every one is saved, never more than two at
/// a time (labd says in its log each time more run at once than ever).
#[test]
fn outputs_pushes_run_at_most_two_at_once() {
    let n = Node::start(None, "run_as = \"labd\"");
    let go = n.path("go");
    let script = format!(
        "mkdir -p ckpt; head -c 4000000 /dev/urandom > ckpt/w.pt; echo written; \
         while [ ! -e {} ]; do sleep 0.05; done",
        go.display()
    );
    let ids: Vec<String> = (0..8)
        .map(|_| n.detach(ALICE, &["--outputs", "ckpt", "--", "bash", "-c", &script]))
        .collect();
    for id in &ids {
        wait_until("each job to write its outputs", 30, || {
            n.ok(ALICE, &["logs", id]).contains("written")
        });
    }
    std::fs::write(&go, "").unwrap();
    for id in &ids {
        wait_until("each job's outputs to be saved", 60, || {
            let j = n.job(id);
            j.ended() && j.meta.outputs_saved.is_some() && !j.meta.outputs_pending
        });
    }
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    let most = log
        .lines()
        .filter_map(|l| {
            let at = l.split("outputs pushes at once: ").nth(1)?;
            at.split(',').next()?.parse::<usize>().ok()
        })
        .max()
        .unwrap_or_else(|| panic!("no push counted:\n{log}"));
    assert!(most <= 2, "{most} outputs pushes at once");
}

/// Issue 40, point 15: labd starts while its store is unreachable (here
/// its folder replaced by a file). It manages the job it already has (its
/// state, its log), refuses new jobs saying why, keeps the outputs of the
/// job that ended meanwhile, and saves them once the store answers again.
/// Before, labd refused to start, and the running job had no labd.
#[test]
fn labd_starts_while_its_store_is_unreachable() {
    let mut n = Node::start(Some("1x11GiB"), "run_as = \"labd\"\noutputs_retry_s = 1");
    let (id, go) = n.checkpointing_job("epoch-3");
    n.crash();
    n.store_down();
    n.restart();
    assert!(matches!(n.job(&id).state, JobState::Running { .. }));
    wait_until("the job's log", 10, || {
        n.ok(ALICE, &["logs", &id]).contains("started")
    });
    let log = std::fs::read_to_string(n.path("labd.log")).unwrap();
    assert!(log.contains("labd starts without it"), "{log}");
    // A hold needs nothing of the store: taken meanwhile.
    let held = n.ok(ALICE, &["--hold", "1h", "--gpus", "1"]);
    assert!(held.starts_with("held on"), "{held}");
    let hold = (n.jobs().into_iter())
        .find(|j| j.meta.hold_s.is_some())
        .expect("the hold");
    n.ok(ALICE, &["kill", &hold.id]);
    std::fs::write(&go, "").unwrap();
    wait_until("the job to end, its outputs kept", 30, || {
        let j = n.job(&id);
        j.ended()
            && j.meta.outputs_pending
            && j.meta
                .outputs_error
                .as_deref()
                .is_some_and(|e| e.contains("not reached its store"))
    });
    n.store_up();
    wait_until(
        "the outputs to be saved once the store is back",
        120,
        || n.ended(&id),
    );
    let j = n.job(&id);
    assert_eq!(n.saved_outputs(&j, "model.pt"), "epoch-3\n");
}
