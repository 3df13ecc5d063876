//! End-to-end tests: the real `labsync`, `labrun` and `labd` binaries as
//! processes, real files, real S3-compatible servers and real sockets on
//! 127.0.0.1.
//!
//! The binaries are the ones `cargo test --workspace` builds for
//! labsync-cli beside this test (`target/<profile>/`); see [`bin`]. The
//! cluster's tests are a binary of their own (`tests/cluster/`): cargo runs
//! test binaries one after the other, so their nine labd processes and
//! hundreds of jobs never compete with the timing- and memory-sensitive
//! tests here.

pub(crate) use common::bin;

#[path = "../../crates/store/tests/support/mod.rs"]
mod support;

#[path = "../common/mod.rs"]
mod common;

mod hostile;
mod labrun;
mod lying;
mod matrix;

#[path = "../../crates/store/tests/support/proxy.rs"]
mod proxy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::{assert_same_tree, write_tree, S3Server};

struct Lab {
    dir: tempfile::TempDir,
    store: String,
    extra_env: Vec<(String, String)>,
}

impl Lab {
    fn new() -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("file://{}", dir.path().join("store").display());
        Lab {
            dir,
            store,
            extra_env: Vec::new(),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin("labsync"));
        c.args(args)
            .env("HOME", self.path("home"))
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_DATA_HOME")
            .env_remove("XDG_CACHE_HOME")
            .env("LABSYNC_STORE", &self.store)
            .env("LABSYNC_CACHE", self.path("cache"))
            .stdin(Stdio::null());
        for (k, v) in &self.extra_env {
            c.env(k, v);
        }
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "labsync {args:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        serde_json::from_str(&self.ok(&a)).unwrap()
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `cmd`, run under `prlimit` with its heap (RLIMIT_DATA) capped at
/// `bytes`: an allocation past it fails, whatever other tests in this
/// process hold (which a peak RSS read after a vfork would count).
fn heap_capped(cmd: &Command, bytes: u64) -> Command {
    let mut c = Command::new("prlimit");
    c.arg(format!("--data={bytes}:{bytes}"))
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// Issue 43: a version pushed by a process without `$USER` or `$LOGNAME`
/// (cron, systemd, `sudo -u`) was recorded as `unknown@host`; it names the
/// account of the uid that pushed, as git does, whatever the environment.
#[test]
fn a_version_names_its_pushers_account_without_user_in_the_environment() {
    let lab = Lab::new();
    let src = lab.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a").unwrap();
    let o = lab
        .cmd(&["push", s(&src), "--name", "ds"])
        .env_remove("USER")
        .env_remove("LOGNAME")
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    std::fs::write(src.join("a.txt"), "b").unwrap();
    let o = lab
        .cmd(&["push", s(&src), "--name", "ds"])
        .env("USER", "mallory")
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let me = labsync_agent::current_user();
    let log = lab.json(&["log", "ds"]);
    let users: Vec<&str> = (log["versions"].as_array().unwrap().iter())
        .map(|v| v["user"].as_str().unwrap())
        .collect();
    assert_eq!(users, [me.as_str(), me.as_str()], "{log}");
}

/// Times in `labsync log` and `ls` are the reader's, with the offset: a
/// lab in Seoul (`TZ=KST-9`) reads its own clock, nine hours past UTC's.
#[test]
fn times_are_shown_in_the_readers_time_zone_with_its_offset() {
    let lab = Lab::new();
    let src = lab.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "a").unwrap();
    lab.ok(&["push", s(&src), "--name", "ds"]);
    let time = lab.json(&["log", "ds"])["versions"][0]["time"]
        .as_i64()
        .unwrap();
    let read = |tz: &str, args: &[&str]| {
        let o = lab.cmd(args).env("TZ", tz).output().unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    for args in [&["log", "ds"][..], &["ls"][..]] {
        let utc = read("UTC0", args);
        let seoul = read("KST-9", args);
        let shown = labsync_cli::human_time_at(time, 9 * 3600);
        assert!(shown.ends_with("+09:00"), "{shown}");
        assert!(seoul.contains(&shown), "{args:?}: {shown} in\n{seoul}");
        assert!(utc.contains(&labsync_cli::human_time_at(time, 0)), "{utc}");
    }
}

#[test]
fn push_pull_ls_log_diff() {
    let lab = Lab::new();
    let src = lab.path("div2k");
    write_tree(&src, 1);
    support::wait_until_at_rest(&src);
    let out = lab.ok(&["push", s(&src)]);
    assert!(out.starts_with("div2k@v1  "), "{out}");
    let again = lab.json(&["push", s(&src), "--name", "div2k"]);
    assert_eq!(again["result"]["created"], false);
    assert_eq!(again["result"]["record"]["version"], 1);
    assert_eq!(again["result"]["files_read"], 0);

    support::overwrite_middle(&src.join("big.bin"), 100);
    assert!(lab
        .ok(&["push", s(&src), "--name", "div2k"])
        .starts_with("div2k@v2"));

    let dest = lab.path("scratch/div2k");
    lab.ok(&["pull", "div2k", s(&dest)]);
    assert_same_tree(&src, &dest);
    let old = lab.path("old");
    lab.ok(&["pull", "div2k@v1", s(&old)]);
    assert_ne!(
        std::fs::read(old.join("big.bin")).unwrap(),
        std::fs::read(src.join("big.bin")).unwrap()
    );

    let ls = lab.ok(&["ls"]);
    assert!(ls.contains("div2k") && ls.contains("v2"), "{ls}");
    let log = lab.ok(&["log", "div2k"]);
    assert!(log.lines().next().unwrap().starts_with("v2"), "{log}");
    assert!(log.contains("~1"), "{log}");
    let diff = lab.ok(&["diff", "div2k@v1", "div2k@v2"]);
    assert!(diff.contains("M big.bin"), "{diff}");
    assert!(lab.ok(&["verify"]).starts_with("ok"));
    assert!(lab.ok(&["verify", "--remote", "div2k"]).starts_with("ok"));
    // A snapshot no version names (a version lost to a server that ignored
    // conditional writes, say): listed, not called clean, exit 0.
    let orphan = lab.path("store/snapshots").join("ab".repeat(32));
    std::fs::write(&orphan, b"lost").unwrap();
    let v = lab.ok(&["verify"]);
    assert!(
        v.contains(&format!("WARNING snapshot {}", "ab".repeat(32))),
        "{v}"
    );
    assert!(v.lines().last().unwrap().starts_with("WARNINGS: "), "{v}");
    std::fs::remove_file(&orphan).unwrap();
    let st = lab.json(&["cache", "status"]);
    assert_eq!(st["status"]["snapshots"].as_array().unwrap().len(), 2);

    assert!(lab.ok(&["forget", "div2k@v1"]).contains("div2k@v1"));
    let log = lab.ok(&["log", "div2k"]);
    assert_eq!(log.lines().count(), 1, "{log}");
    assert_eq!(
        lab.run(&["forget", "div2k"]).status.code(),
        Some(1),
        "a version must be named"
    );
    assert_eq!(lab.run(&["forget"]).status.code(), Some(2));
}

#[test]
fn exit_codes_and_messages() {
    let lab = Lab::new();
    let o = lab.run(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2), "usage error");
    let o = lab.run(&["pull", "nosuch"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("\"nosuch\"") && err.contains("not found") && err.contains("labsync ls"),
        "{err}"
    );
    let o = lab.run(&["push", "/definitely/not/here", "--name", "x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/definitely/not/here"));
    let o = lab.run(&["push", ".", "--name", "../etc"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid name"));
    let o = lab.run(&["--json", "pull", "nosuch"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(doc["error"].as_str().unwrap().contains("not found"));
    let help = lab.ok(&["push", "--help"]);
    assert!(
        help.contains("files cache") || help.contains("unchanged"),
        "{help}"
    );
    assert!(
        help.contains("--compression") && help.contains("zstd"),
        "{help}"
    );
    let o = lab.run(&["push", ".", "--name", "x", "--compression", "gzip"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("\"gzip\"") && err.contains("lz4 or zstd"),
        "{err}"
    );
}

/// An admin's `labsync push` as root into a local store a lab member can
/// write is refused before anything is written: the member could have
/// planted a symlink (here `packs/<xx>` to another folder) and root's
/// push would write its packs through it. The same store made root's
/// alone takes the push.
#[test]
fn root_refuses_a_local_store_others_can_write() {
    use std::os::unix::fs::PermissionsExt;
    if labsync_agent::euid() != 0 {
        eprintln!("not root: the check is root's");
        return;
    }
    let lab = Lab::new();
    std::fs::set_permissions(lab.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let src = lab.path("div2k");
    write_tree(&src, 20);
    lab.ok(&["push", s(&src)]);
    let packs = lab.path("store/packs");
    std::fs::set_permissions(&packs, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // What a member could do there: every pack folder a symlink elsewhere.
    let elsewhere = lab.path("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    for i in 0..=255u8 {
        let d = packs.join(format!("{i:02x}"));
        if !d.exists() {
            std::os::unix::fs::symlink(&elsewhere, &d).unwrap();
        }
    }
    write_tree(&lab.path("div2k/more"), 20);
    let o = lab.run(&["push", s(&src)]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("runs as root") && err.contains("packs is writable by others (mode 1777)"),
        "{err}"
    );
    assert!(
        err.contains("s3://") && err.contains("chmod -R go-w"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "root wrote through a planted symlink"
    );
    // The planted links gone and the folder root's alone again, it pushes.
    for i in 0..=255u8 {
        let d = packs.join(format!("{i:02x}"));
        if d.is_symlink() {
            std::fs::remove_file(&d).unwrap();
        }
    }
    std::fs::set_permissions(&packs, std::fs::Permissions::from_mode(0o755)).unwrap();
    lab.ok(&["push", s(&src)]);
}

/// What `n` `labsync push` processes racing to one name did.
struct Race {
    /// The versions the pushes that said "ok" reported, with their snapshots.
    told: BTreeMap<u64, String>,
    /// Pushes that failed (each loudly: exit 1, "conflict").
    failed: usize,
    /// The versions `labsync log` shows afterwards.
    recorded: BTreeMap<u64, String>,
}

/// Starts `n` pushes of different trees to `name` at once and checks that
/// what they said is what `labsync log` shows: every push that said "ok"
/// has its own version, naming its snapshot, and no version is unaccounted.
fn race(lab: &Lab, name: &str, n: u64, seed: u64) -> Race {
    let pushes: Vec<_> = (0..n)
        .map(|i| {
            let src = lab.path(&format!("{name}-src-{seed}-{i}"));
            std::fs::create_dir_all(&src).unwrap();
            std::fs::write(
                src.join("ckpt.pt"),
                support::random_bytes(100_000, seed + i),
            )
            .unwrap();
            lab.cmd(&["--json", "push", s(&src), "--name", name])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut race = Race {
        told: BTreeMap::new(),
        failed: 0,
        recorded: BTreeMap::new(),
    };
    for p in pushes {
        let o = p.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        if !o.status.success() {
            assert_eq!(o.status.code(), Some(1), "{err}");
            assert!(err.contains("conflict"), "a lost race says so: {err}");
            race.failed += 1;
            continue;
        }
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let rec = &doc["result"]["record"];
        let v = rec["version"].as_u64().unwrap();
        let before = race.told.insert(v, rec["snapshot"].to_string());
        assert!(before.is_none(), "v{v} reported by two pushes");
    }
    let log = lab.json(&["log", name]);
    race.recorded = log["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["version"].as_u64().unwrap(), v["snapshot"].to_string()))
        .collect();
    for (v, snap) in &race.told {
        let got = race.recorded.get(v);
        assert_eq!(got, Some(snap), "v{v} names what its push reported");
    }
    race
}

#[test]
fn two_processes_racing_one_name_never_lose_a_version() {
    let lab = Lab::new();
    for round in 0..3u64 {
        let r = race(&lab, "race", 2, 100 + round * 2);
        assert_eq!(r.failed, 0, "both pushes land");
    }
    let log = lab.json(&["log", "race"]);
    let versions: Vec<u64> = log["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_u64().unwrap())
        .collect();
    assert_eq!(
        versions,
        (1..=6).collect::<Vec<_>>(),
        "six pushes, six versions"
    );
}

/// `n` files of `size` random bytes under `lab/dir`.
fn random_files(lab: &Lab, dir: &str, n: u64, size: usize, seed: u64) -> PathBuf {
    let src = lab.path(dir);
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..n {
        std::fs::write(
            src.join(format!("{i:03}.png")),
            support::random_bytes(size, seed + i),
        )
        .unwrap();
    }
    src
}

/// Pushes of `src` killed (`kill -9`) after each of `delays_ms` leave a
/// store that `verify --remote` passes; after a whole push and a `gc`, the
/// tree pulls back.
fn killed_pushes_leave_the_store_verifiable(lab: &Lab, src: &Path, delays_ms: &[u64]) {
    for (round, delay_ms) in delays_ms.iter().enumerate() {
        support::overwrite_middle(&src.join(format!("{round:03}.png")), 10);
        let mut p = lab
            .cmd(&["push", s(src), "--name", "crashy", "--quiet"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(*delay_ms));
        let _ = p.kill(); // SIGKILL
        let _ = p.wait();
        let v = lab.run(&["verify", "--remote"]);
        assert!(
            v.status.success(),
            "store inconsistent after kill at {delay_ms} ms: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
    lab.ok(&["push", s(src), "--name", "crashy"]);
    lab.ok(&["gc", "--grace", "0"]);
    assert!(lab.ok(&["verify", "--remote"]).starts_with("ok"));
    let dest = lab.path("crashy-out");
    lab.ok(&["pull", "crashy", s(&dest)]);
    assert_same_tree(src, &dest);
}

#[test]
fn killed_push_never_leaves_a_ref_to_missing_data() {
    let lab = Lab::new();
    let src = random_files(&lab, "data", 48, 2_000_000, 0);
    killed_pushes_leave_the_store_verifiable(&lab, &src, &[30, 120, 250, 400, 700]);
}

/// `labsync gc` run again and again while `src` is pushed as `name`: the
/// push lands whole, the store verifies, the tree pulls back.
fn gc_next_to_push(lab: &Lab, src: &Path, name: &str) {
    let mut push = lab
        .cmd(&["push", s(src), "--name", name, "--quiet"])
        .spawn()
        .unwrap();
    let mut gcs = 0;
    loop {
        lab.ok(&["gc"]);
        gcs += 1;
        if push.try_wait().unwrap().is_some() {
            break;
        }
    }
    assert!(push.wait().unwrap().success());
    assert!(gcs >= 1);
    assert!(lab.ok(&["verify", "--remote"]).starts_with("ok"));
    let dest = lab.path(&format!("{name}-out"));
    lab.ok(&["pull", name, s(&dest)]);
    assert_same_tree(src, &dest);
}

#[test]
fn gc_process_next_to_push_process() {
    let lab = Lab::new();
    let src = random_files(&lab, "d", 24, 2_000_000, 1000);
    gc_next_to_push(&lab, &src, "d");
}

#[test]
fn config_file_and_precedence() {
    let mut lab = Lab::new();
    let cfg = lab.path("labsync.toml");
    let file_store = lab.path("file-store");
    std::fs::write(
        &cfg,
        format!(
            "store = \"file://{}\"\ncache_max = \"1G\"\n",
            file_store.display()
        ),
    )
    .unwrap();
    let src = lab.path("x");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a"), b"a").unwrap();
    // LABSYNC_STORE (environment) beats the file.
    lab.ok(&["--config", s(&cfg), "push", s(&src)]);
    assert!(!file_store.exists());
    // Without it, the file's store is used.
    lab.store = String::new();
    let o = lab
        .cmd(&["--config", s(&cfg), "push", s(&src)])
        .env_remove("LABSYNC_STORE")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(file_store.join("config").exists());
    // A flag beats both.
    let flag_store = lab.path("flag-store");
    lab.extra_env.push((
        "LABSYNC_STORE".into(),
        format!("file://{}", lab.path("env-store").display()),
    ));
    lab.ok(&[
        "--config",
        s(&cfg),
        "--store",
        s(&flag_store),
        "push",
        s(&src),
    ]);
    assert!(flag_store.join("config").exists());
}

#[test]
fn default_store_works_with_no_configuration() {
    let lab = Lab::new();
    let src = lab.path("sample");
    write_tree(&src, 5);
    let home = lab.path("home");
    let run = |args: &[&str]| {
        let o = Command::new(bin("labsync"))
            .args(args)
            .env_clear()
            .env("HOME", &home)
            .env("PATH", std::env::var_os("PATH").unwrap())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(&["push", s(&src)]);
    run(&["pull", "sample", s(&lab.path("back"))]);
    assert_same_tree(&src, &lab.path("back"));
    assert!(home.join(".local/share/labsync/store/config").exists());
}

#[test]
fn s3_end_to_end() {
    let Some(server) = S3Server::start() else {
        return;
    };
    let mut lab = Lab::new();
    lab.store = "s3://labsync/cli-test".into();
    lab.extra_env = vec![
        ("AWS_ACCESS_KEY_ID".into(), support::ACCESS_KEY.into()),
        ("AWS_SECRET_ACCESS_KEY".into(), support::SECRET_KEY.into()),
        ("AWS_REGION".into(), "us-east-1".into()),
        ("AWS_ENDPOINT".into(), server.endpoint()),
    ];
    let src = lab.path("ds");
    write_tree(&src, 9);
    lab.ok(&["push", s(&src)]);
    let again = lab.json(&["push", s(&src)]);
    assert_eq!(again["result"]["created"], false);
    let dest = lab.path("out");
    lab.ok(&["pull", "ds", s(&dest)]);
    assert_same_tree(&src, &dest);
    assert!(lab.ok(&["verify", "--remote"]).starts_with("ok"));
    // Issue 17, point 2: what the server does with conditional writes,
    // probed when the store was made.
    let info = lab.ok(&["info"]);
    assert!(
        info.contains("store:              s3://labsync/cli-test"),
        "{info}"
    );
    assert!(
        info.contains("conditional writes: honoured (probed"),
        "{info}"
    );
    // Issue 41, point 9: a claim someone keeps renewing on the next
    // version is shown with whose it is, and an admin removes it by the
    // key it claims.
    let key = "refs/ds/@/0000000002";
    let hash = blake3::hash(key.as_bytes()).to_hex();
    let claims = server.data_dir().join("labsync/cli-test/claims");
    std::fs::create_dir_all(&claims).unwrap();
    let claim = format!("{}.{}", &hash[..32], "f".repeat(32));
    std::fs::write(claims.join(&claim), format!("{key}\nmallory@gpu9 (pid 7)")).unwrap();
    let shown = lab.ok(&["claims"]);
    assert!(
        shown.contains(&format!(
            "claims/{claim}  on {key}  by mallory@gpu9 (pid 7)"
        )),
        "{shown}"
    );
    let removed = lab.json(&["claims", "--remove", key]);
    assert_eq!(removed["removed"][0], format!("claims/{claim}"));
    assert!(lab.ok(&["claims"]).starts_with("no claims are held"));
    let info = lab.json(&["info"]);
    assert_eq!(info["conditional_writes"], "honoured");
    assert_eq!(info["conditional_writes_probed"], true);
    assert_eq!(info["config"]["chunker"], "fastcdc-v2020");
    assert!(info["scheme"].as_str().unwrap().starts_with("a claim"));
    // Wrong credentials: a clear error, exit 1.
    let o = lab
        .cmd(&["ls"])
        .env("AWS_SECRET_ACCESS_KEY", "wrong")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot open store s3://labsync/cli-test"));
}

/// Issue 19, point 4: the summary says what the destination holds beyond the
/// version, and `--delete` removes it.
#[test]
fn pull_says_what_is_extra_and_delete_removes_it() {
    let lab = Lab::new();
    let src = lab.path("ds");
    write_tree(&src, 8);
    lab.ok(&["push", s(&src), "--name", "ds"]);
    let dest = lab.path("work");
    std::fs::create_dir_all(dest.join("old")).unwrap();
    std::fs::write(dest.join("old/ckpt.pt"), b"x").unwrap();
    std::fs::write(dest.join("notes.txt"), b"y").unwrap();
    let out = lab.ok(&["pull", "ds", s(&dest)]);
    assert!(
        out.contains("3 entries in") && out.contains("not in the version (--delete removes them)"),
        "{out}"
    );
    assert!(dest.join("notes.txt").exists());
    let out = lab.ok(&["pull", "ds", s(&dest), "--delete"]);
    assert!(
        out.contains("3 entries not in the version removed"),
        "{out}"
    );
    assert_same_tree(&src, &dest);
}
