//! A lab adopts labsync as an admin would: the packages `scripts/package.sh`
//! builds, installed into a throw-away root with dpkg; `labd init` from
//! that install making a three-node cluster's files; those three labd
//! started from the files it wrote, TLS on, each in a network namespace of
//! its own (a host of its own on a bridge); `labd doctor --cluster` passing,
//! then failing with a fix once a link is cut for real; and a job run
//! through the cluster with the token `labd adduser` issued.
//!
//! A test binary of its own: it needs root (network namespaces, dpkg
//! --root) and builds packages, and cargo runs test binaries one after the
//! other.

#[path = "../common/mod.rs"]
mod common;

mod net;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use common::bin;
use net::Hosts;

/// Runs `cmd`, failing the test with its output when it fails.
fn ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Whether this run may use root's tools; outside CI, a run that may not
/// says it skipped.
fn as_root() -> bool {
    let root = labsync_agent::euid() == 0;
    let tools = Command::new("ip").arg("-V").output().is_ok()
        && Command::new("dpkg").arg("--version").output().is_ok();
    if root && tools {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the install tests need root, ip (iproute2) and dpkg; CI runs them as root"
    );
    eprintln!("SKIPPED: the install tests need root, ip (iproute2) and dpkg");
    false
}

/// The packages, built by the repo's script from the binaries under test.
struct Packages {
    _dir: tempfile::TempDir,
    deb: PathBuf,
    tarball: PathBuf,
    rpm: Option<PathBuf>,
    glibc_min: String,
}

fn build_packages() -> Packages {
    let dir = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bins = bin("labd").parent().unwrap().to_path_buf();
    let rpm_tool = Command::new("cargo")
        .args(["generate-rpm", "--help"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !rpm_tool {
        assert!(
            std::env::var_os("CI").is_none(),
            "cargo-generate-rpm is missing: scripts/test.sh installs it"
        );
        eprintln!(
            "SKIPPED: the .rpm (cargo-generate-rpm is not installed; scripts/test.sh installs it)"
        );
    }
    let mut cmd = Command::new(repo.join("scripts/package.sh"));
    if !rpm_tool {
        cmd.arg("--deb-only");
    }
    ok(cmd
        .env("LABSYNC_BIN", &bins)
        .env("LABSYNC_PACKAGE_OUT", dir.path())
        .current_dir(repo));
    let version = env!("CARGO_PKG_VERSION");
    let find = |suffix: &str| -> Option<PathBuf> {
        std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(suffix))
    };
    Packages {
        deb: find(".deb").expect("a .deb"),
        tarball: find(&format!("labsync-{version}-x86_64-linux-gnu.tar.gz"))
            .or_else(|| find("-linux-gnu.tar.gz"))
            .expect("a tarball"),
        rpm: rpm_tool.then(|| find(".rpm").expect("an .rpm")),
        glibc_min: std::fs::read_to_string(dir.path().join("GLIBC_MIN"))
            .unwrap()
            .trim()
            .to_string(),
        _dir: dir,
    }
}

/// The .deb installed into `root` with dpkg, as a throw-away system.
fn dpkg_install(root: &Path, deb: &Path) -> String {
    for d in [
        "var/lib/dpkg/info",
        "var/lib/dpkg/updates",
        "var/lib/dpkg/triggers",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    let root_arg = format!("--root={}", root.display());
    ok(Command::new("dpkg")
        .args([
            &root_arg,
            "--force-script-chrootless",
            "--force-depends",
            "--log=/dev/null",
            "-i",
        ])
        .arg(deb))
}

fn check_packages(p: &Packages, root: &Path) {
    // What the .deb says of itself.
    let field = |f: &str| ok(Command::new("dpkg-deb").args(["-f"]).arg(&p.deb).arg(f));
    assert_eq!(field("Package").trim(), "labsync");
    assert_eq!(
        field("Version").trim(),
        format!("{}-1", env!("CARGO_PKG_VERSION"))
    );
    assert!(
        field("Depends").contains(&format!("libc6 (>= {})", p.glibc_min)),
        "the oldest glibc the binaries need: {}",
        field("Depends")
    );
    let conffiles = ok(Command::new("dpkg-deb")
        .args(["-I"])
        .arg(&p.deb)
        .arg("conffiles"));
    assert_eq!(conffiles.trim(), "/etc/labsync/labd.toml");
    let listing = ok(Command::new("dpkg-deb").arg("-c").arg(&p.deb));
    for f in [
        "./usr/bin/labsync",
        "./usr/bin/labrun",
        "./usr/bin/labd",
        "./lib/systemd/system/labd.service",
        "./etc/labsync/labd.toml",
    ] {
        assert!(listing.contains(f), "{f} in the .deb:\n{listing}");
    }
    // Its maintainer scripts are shell that parses.
    let control = tempfile::tempdir().unwrap();
    ok(Command::new("dpkg-deb")
        .arg("-e")
        .arg(&p.deb)
        .arg(control.path()));
    for s in ["postinst", "prerm", "postrm"] {
        let script = control.path().join(s);
        let mode = std::fs::metadata(&script).unwrap().permissions().mode();
        assert_eq!(mode & 0o755, 0o755, "{s} is executable");
        ok(Command::new("sh").arg("-n").arg(&script));
    }

    // Installed into a throw-away root: the tools run, postinst made the
    // state folder, the unit runs the installed labd.
    let said = dpkg_install(root, &p.deb);
    assert!(
        said.contains("labd doctor --config /etc/labsync/labd.toml"),
        "{said}"
    );
    let v = ok(Command::new(root.join("usr/bin/labd")).arg("--version"));
    assert_eq!(v.trim(), format!("labd {}", env!("CARGO_PKG_VERSION")));
    let help = ok(Command::new(root.join("usr/bin/labrun")).arg("--help"));
    assert!(help.contains("--data"), "{help}");
    ok(Command::new(root.join("usr/bin/labsync")).arg("--help"));
    assert!(
        root.join("var/lib/labsync").is_dir(),
        "postinst made the state folder"
    );
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/labd.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/labd --config /etc/labsync/labd.toml"),
        "{unit}"
    );
    assert!(unit.contains("KillMode=process"), "{unit}");
    let conf = std::fs::read_to_string(root.join("etc/labsync/labd.toml")).unwrap();
    assert!(
        conf.contains("labd init"),
        "the config says where to start:\n{conf}"
    );

    // The tarball: the same tree, its config an example that `tar -C /`
    // cannot overwrite one with.
    let t = ok(Command::new("tar").arg("-tzf").arg(&p.tarball));
    for f in [
        "usr/bin/labd",
        "usr/bin/labrun",
        "usr/bin/labsync",
        "lib/systemd/system/labd.service",
        "etc/labsync/labd.toml.example",
    ] {
        assert!(
            t.lines().any(|l| l.trim_start_matches("./") == f),
            "{f} in the tarball:\n{t}"
        );
    }
    assert!(
        !t.lines().any(|l| l.ends_with("etc/labsync/labd.toml")),
        "{t}"
    );

    // The .rpm names the same files in its header (basenames and their
    // folders are stored apart, in clear).
    if let Some(rpm) = &p.rpm {
        let bytes = std::fs::read(rpm).unwrap();
        assert_eq!(&bytes[..4], b"\xed\xab\xee\xdb", "an RPM lead");
        let has = |s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
        for s in [
            "labd.service",
            "/usr/lib/systemd/system/",
            "/usr/bin/",
            "labrun",
            "/etc/labsync/",
            "labd.toml",
        ] {
            assert!(has(s), "{s} in the .rpm's header");
        }
        assert!(has("glibc") && has(&p.glibc_min), "its glibc requirement");
    }
}

/// One labd of the cluster, in its namespace.
struct Labd {
    child: Child,
    log: PathBuf,
}

impl Drop for Labd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The folder `labd init` wrote for `node`: its /etc/labsync.
fn etc_of(cluster: &Path, node: &str) -> PathBuf {
    cluster.join(node).join("etc/labsync")
}

fn start_labd(hosts: &Hosts, i: usize, root: &Path, cluster: &Path, work: &Path) -> Labd {
    let node = format!("gpu{}", i + 1);
    let dir = work.join(&node);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("labd.log");
    let child = hosts
        .exec(i)
        .arg(root.join("usr/bin/labd"))
        .arg("--config")
        .arg(etc_of(cluster, &node).join("labd.toml"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .args(["--fake-gpus", "2x11GiB"])
        .env("LABD_LOG", "info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::from(
            std::fs::File::options().append(true).open(&log).unwrap(),
        ))
        .spawn()
        .unwrap();
    Labd { child, log }
}

fn doctor(hosts: &Hosts, root: &Path, cluster: &Path, work: &Path, node: usize) -> Output {
    doctor_in(hosts.exec(node), root, cluster, work, node)
}

fn doctor_in(mut cmd: Command, root: &Path, cluster: &Path, work: &Path, node: usize) -> Output {
    let name = format!("gpu{}", node + 1);
    let dir = work.join(&name);
    cmd.arg(root.join("usr/bin/labd"))
        .args(["doctor", "--cluster", "--config"])
        .arg(etc_of(cluster, &name).join("labd.toml"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .args(["--fake-gpus", "2x11GiB"])
        .output()
        .unwrap()
}

#[test]
fn a_cluster_installed_from_the_package_and_labd_init_runs_a_job_and_its_doctor_finds_a_cut_link() {
    if !as_root() {
        return;
    }
    let packages = build_packages();
    let work = tempfile::tempdir().unwrap();
    std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = work.path().join("root");
    check_packages(&packages, &root);

    // Three hosts on one bridge, the test's own address on it.
    let hosts = Hosts::new(3);
    let store = work.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cluster = work.path().join("labsync-cluster");
    let advertise: Vec<String> = (0..3)
        .map(|i| format!("gpu{}={}", i + 1, hosts.addr(i)))
        .collect();
    let said = ok(Command::new(root.join("usr/bin/labd"))
        .args([
            "init",
            "--nodes",
            "gpu1,gpu2,gpu3",
            "--admin",
            "root",
            "--node-cache-max",
            "2G",
        ])
        .arg("--advertise")
        .arg(advertise.join(","))
        .arg("--store")
        .arg(format!("file://{}", store.display()))
        .arg("--out")
        .arg(&cluster)
        .arg("--etc")
        .arg(etc_of(&cluster, "gpu1")));
    assert!(
        said.contains(&format!("rsync -a {}/gpu2/etc/labsync/", cluster.display())),
        "{said}"
    );
    // A user of the lab: the token, and their config lines.
    let user = ok(Command::new(root.join("usr/bin/labd"))
        .args(["adduser", "nobody", "--dir"])
        .arg(&cluster));
    let lines: String = user
        .lines()
        .filter(|l| l.contains(" = ") && !l.starts_with(' '))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        lines.contains("token = ") && lines.contains("labd_ca = "),
        "{user}"
    );
    let home = work.path().join("home");
    std::fs::create_dir_all(home.join(".config/labsync")).unwrap();
    let user_config = home.join(".config/labsync/config.toml");
    std::fs::write(&user_config, &lines).unwrap();
    std::fs::set_permissions(&user_config, std::fs::Permissions::from_mode(0o600)).unwrap();

    let nodes: Vec<Labd> = (0..3)
        .map(|i| start_labd(&hosts, i, &root, &cluster, work.path()))
        .collect();
    let labrun = |args: &[&str]| -> Output {
        let code = work.path().join("code");
        std::fs::create_dir_all(&code).unwrap();
        Command::new(root.join("usr/bin/labrun"))
            .args(args)
            .current_dir(&code)
            .env("HOME", &home)
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_STATE_HOME")
            .env_remove("LABRUN_LABD")
            .env_remove("LABRUN_TOKEN")
            .env_remove("LABRUN_CA")
            .env_remove("LABSYNC_STORE")
            .env("LABSYNC_CACHE", work.path().join("client-cache"))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let logs = || {
        nodes
            .iter()
            .map(|n| std::fs::read_to_string(&n.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let mut last = String::new();
    let t0 = std::time::Instant::now();
    while !last.contains("cluster of 3 node(s), 3 up") {
        assert!(
            t0.elapsed().as_secs() < 60,
            "three nodes up over TLS, not:\n{last}\n{}",
            logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
        last = text(&labrun(&["status"]));
    }

    // The doctor, from the coordinator: every check passes.
    let o = doctor(&hosts, &root, &cluster, work.path(), 0);
    let d = text(&o);
    assert!(o.status.success(), "{d}\n{}", logs());
    for want in [
        "ok    config: read; this node is gpu1",
        "ok    secrets: private to labd's user",
        "ok    clock:",
        "ok    gpu2 → the others: all 2 reached",
        "ok    gpu3 → the others: all 2 reached",
        &format!(
            "ok    versions: every node on labsync {}",
            env!("CARGO_PKG_VERSION")
        ),
    ] {
        assert!(d.contains(want), "{want}:\n{d}");
    }
    assert!(!d.contains("FAIL"), "{d}");
    // Where a namespace hides the cgroup hierarchy (ip netns exec mounts a
    // sysfs of its own), the doctor says so, and root is not its answer.
    let o = doctor_in(
        hosts.exec_hiding_cgroups(1),
        &root,
        &cluster,
        work.path(),
        1,
    );
    let d = text(&o);
    assert_eq!(o.status.code(), Some(1), "{d}");
    let cg = d
        .lines()
        .skip_while(|l| !l.starts_with("FAIL  cgroups"))
        .take(2)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        cg.contains("fix: ") && cg.contains("mount the cgroup hierarchy"),
        "{d}"
    );
    assert!(!cg.contains("run it as root"), "{d}");

    // A job through the cluster, as the user adduser made.
    let data = work.path().join("sample");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("0801.png"), vec![7u8; 300_000]).unwrap();
    let o = labrun(&[
        "--data",
        data.to_str().unwrap(),
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "wc -c < $LABRUN_DATA/0801.png; echo node=$LABRUN_NODE user=$(id -un)",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}\n{}", logs());
    assert!(out.contains("300000"), "{out}");
    assert!(out.contains("user=nobody"), "{out}");
    assert!(
        ["gpu1", "gpu2", "gpu3"]
            .iter()
            .any(|n| out.contains(&format!("node={n}"))),
        "{out}"
    );

    // gpu3's link cut for real: the doctor fails, naming it, with a fix.
    hosts.cut(2);
    let o = doctor(&hosts, &root, &cluster, work.path(), 0);
    let d = text(&o);
    assert_eq!(o.status.code(), Some(1), "{d}");
    let cut = d
        .lines()
        .skip_while(|l| !l.starts_with("FAIL  node gpu3"))
        .take(2)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(cut.contains("fix: ") && cut.contains("firewall"), "{d}");
    assert!(d.contains("FAIL  gpu2 → gpu3"), "{d}");
    hosts.mend(2);
    drop(nodes);
}
