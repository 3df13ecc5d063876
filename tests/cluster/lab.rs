//! The cluster the end-to-end tests start: three real labd processes on
//! 127.0.0.1, each with its own state, cache and fake GPUs, one real
//! S3-compatible server as their store. Shared by `tests/cluster` and
//! `tests/slurm`.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use labsync_agent::cluster::ClusterKey;
use labsync_agent::proto::{ClusterStatus, JobView, NodeHealth, NodeStatus};
use labsync_agent::{Client, Endpoint, JobState};

use crate::common::{bin, wait_until};
use crate::support::{free_port, write_tree, S3Server};

pub const SECRET: &str = "cluster-secret-0123456789abcdef0123456789";
pub const ADMIN: &str = "tok-cluster-admin-0123456789";
pub const ALICE: &str = "tok-cluster-alice-0123456789";
pub const BOB: &str = "tok-cluster-bob-0123456789";

/// One labd of the cluster.
pub struct Member {
    pub name: String,
    pub port: u16,
    pub config: PathBuf,
    pub labd: Option<Child>,
    /// The labd binary it runs (this build's, or an older one's).
    pub bin: PathBuf,
}

/// Three labd processes, a store, a folder for everything.
pub struct Lab {
    pub dir: tempfile::TempDir,
    s3: S3Server,
    pub store: String,
    pub nodes: Vec<Member>,
    /// With TLS: the lab's CA (PEM); every address is then `https://`.
    pub ca: Option<PathBuf>,
}

/// A lab CA and, for each node, a certificate for 127.0.0.1 it signed
/// and its key, written to `dir`: `ca.pem`, `gpuN.pem`, `gpuN.key` (600).
pub fn certificates(dir: &std::path::Path, n: usize) -> PathBuf {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    for i in 0..n {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("gpu{i}.pem")), cert.pem()).unwrap();
        let k = dir.join(format!("gpu{i}.key"));
        std::fs::write(&k, key.serialize_pem()).unwrap();
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, ca_cert.pem()).unwrap();
    ca
}

impl Lab {
    /// `None` when no S3 server is installed (outside CI only).
    pub fn start(n: usize) -> Option<Lab> {
        Lab::start_with(n, false)
    }

    /// With `tls`, every node has a certificate from the lab's CA and
    /// speaks only TLS.
    pub fn start_with(n: usize, tls: bool) -> Option<Lab> {
        Lab::start_full(n, tls, "", "")
    }

    /// With `top` at the start of every node's config (top-level keys) and
    /// `extra` at its end (a `[lab]` section).
    pub fn start_full(n: usize, tls: bool, top: &str, extra: &str) -> Option<Lab> {
        Lab::start_on(n, tls, top, extra, &bin("labd"))
    }

    /// Every node running the labd binary `labd` (an older release's, say).
    pub fn start_on(
        n: usize,
        tls: bool,
        top: &str,
        extra: &str,
        labd: &std::path::Path,
    ) -> Option<Lab> {
        let s3 = S3Server::start()?;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let secret = dir.path().join("cluster.secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let store = "s3://labsync/cluster".to_string();
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let ca = tls.then(|| certificates(dir.path(), n));
        let scheme = if tls { "https" } else { "http" };
        let nodes = (0..n)
            .map(|i| {
                let name = format!("gpu{i}");
                let d = dir.path().join(&name);
                std::fs::create_dir_all(d.join("home")).unwrap();
                std::fs::write(d.join("control.toml"), "").unwrap();
                let config = d.join("labd.toml");
                std::fs::write(
                    &config,
                    format!(
                        "{top}node_name = \"{name}\"\nlisten = \"127.0.0.1:{port}\"\n\
                         state_dir = \"{state}\"\nstore = \"{store}\"\ncache_dir = \"{cache}\"\n\
                         tick_ms = 50\ninventory_deadline_ms = 300\nfake_gpus = \"2x11GiB\"\n\
                         fake_gpus_control = \"{control}\"\nrun_as = \"labd\"\nadmins = [\"admin\"]\n\
                         [tokens]\nalice = \"{ALICE}\"\nbob = \"{BOB}\"\nadmin = \"{ADMIN}\"\n\
                         [cluster]\ncoordinator = \"{scheme}://127.0.0.1:{coord}\"\ncoordinate = {coordinate}\n\
                         secret_file = \"{secret}\"\nheartbeat_ms = 200\ndown_after_ms = 1500\n{tls}{extra}",
                        port = ports[i],
                        state = d.join("state").display(),
                        cache = d.join("cache").display(),
                        control = d.join("control.toml").display(),
                        coord = ports[0],
                        coordinate = i == 0,
                        secret = secret.display(),
                        tls = match &ca {
                            Some(ca) => format!(
                                "[tls]\ncert = \"{dir}/{name}.pem\"\nkey = \"{dir}/{name}.key\"\n\
                                 ca = \"{ca}\"\n",
                                dir = dir.path().display(),
                                ca = ca.display(),
                            ),
                            // In clear only where the config says so (issue 40).
                            None => "insecure_cleartext = true\n".into(),
                        },
                    ),
                )
                .unwrap();
                std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
                Member {
                    name,
                    port: ports[i],
                    config,
                    labd: None,
                    bin: labd.to_path_buf(),
                }
            })
            .collect();
        let mut lab = Lab {
            dir,
            s3,
            store,
            nodes,
            ca,
        };
        for i in 0..n {
            lab.restart(i);
        }
        lab.wait_for("every node up", 30, |s| {
            s.nodes.len() == n && s.nodes.iter().all(|x| x.health == NodeHealth::Up)
        });
        Some(lab)
    }

    /// Node `i`'s address, `http://` or, with TLS, `https://`.
    pub fn url(&self, i: usize) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.nodes[i].port)
    }

    pub fn home(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[i].name).join("home")
    }

    pub fn cache(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[i].name).join("cache")
    }

    pub fn restart(&mut self, i: usize) {
        let d = self.dir.path().join(&self.nodes[i].name);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(d.join("labd.log"))
            .unwrap();
        let child = Command::new(&self.nodes[i].bin)
            .arg("--config")
            .arg(&self.nodes[i].config)
            .env("HOME", d.join("home"))
            .env("LABD_LOG", "info")
            .envs(self.s3.env())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.nodes[i].labd = Some(child);
        let port = self.nodes[i].port;
        let log = d.join("labd.log");
        let labd = self.nodes[i].labd.as_mut().unwrap();
        wait_until("labd to answer", 30, || {
            // One that exited (its port taken, say) is not waited for:
            // whatever answers on its port then is not it.
            if let Ok(Some(status)) = labd.try_wait() {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("labd {i} exited ({status}):\n{said}");
            }
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }

    /// Node `i`'s labd stopped and started again on the binary `labd`, as
    /// an upgrade does (its running jobs go on and are adopted).
    pub fn upgrade(&mut self, i: usize, labd: &std::path::Path) {
        self.crash(i);
        self.nodes[i].bin = labd.to_path_buf();
        self.restart(i);
    }

    /// `kill -SIG` of node `i`'s labd (`STOP`, `CONT`).
    pub fn signal(&self, i: usize, sig: &str) {
        let pid = self.nodes[i].labd.as_ref().unwrap().id();
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} {pid}");
    }

    pub fn crash(&mut self, i: usize) {
        let mut c = self.nodes[i].labd.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// `labrun ARGS` as alice, against the coordinator, from the folder
    /// `code` (created) as the job's code.
    pub fn labrun(&self, args: &[&str]) -> Output {
        self.labrun_cmd(args).output().unwrap()
    }

    pub fn labrun_cmd(&self, args: &[&str]) -> Command {
        let code = self.dir.path().join("code");
        std::fs::create_dir_all(&code).unwrap();
        let mut c = Command::new(bin("labrun"));
        c.args(args)
            .current_dir(&code)
            .env("HOME", self.home(0))
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_STATE_HOME")
            .env("LABRUN_LABD", self.url(0))
            .env("LABRUN_CA", self.ca.clone().unwrap_or_default())
            .env("LABRUN_TOKEN", ALICE)
            .env("LABSYNC_CACHE", self.dir.path().join("client-cache"))
            .envs(self.s3.env())
            .stdin(Stdio::null());
        c
    }

    /// `labrun ARGS` as bob.
    pub fn labrun_as_bob(&self, args: &[&str]) -> Output {
        self.labrun_cmd(args)
            .env("LABRUN_TOKEN", BOB)
            .output()
            .unwrap()
    }

    /// `labrun ARGS` that must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.labrun(args);
        assert!(
            o.status.success(),
            "labrun {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    /// Every job of the cluster, as `labrun ps --all --json` shows it.
    pub fn jobs(&self) -> Vec<JobView> {
        serde_json::from_str(&self.ok(&["ps", "--all", "--json"])).unwrap()
    }

    pub fn job(&self, id: &str) -> JobView {
        self.jobs()
            .into_iter()
            .find(|j| j.id == id)
            .unwrap_or_else(|| panic!("no job {id}"))
    }

    /// Waits until job `id` runs; the node it runs on.
    pub fn running(&self, id: &str) -> String {
        wait_until(&format!("{id} to run"), 60, || {
            matches!(self.job(id).state, JobState::Running { .. })
        });
        self.job(id)
            .node
            .expect("a running job has a node")
            .to_string()
    }

    /// Waits until job `id` runs or has ended; the node it ran on.
    pub fn running_or_ended(&self, id: &str) -> String {
        wait_until(&format!("{id} to run"), 60, || {
            !matches!(self.job(id).state, JobState::Queued)
        });
        self.job(id)
            .node
            .expect("a placed job has a node")
            .to_string()
    }

    pub fn status(&self) -> ClusterStatus {
        let o = self.labrun(&["status", "--json"]);
        assert!(o.status.success(), "labrun status: {o:?}");
        serde_json::from_slice(&o.stdout).unwrap()
    }

    pub fn node<'a>(s: &'a ClusterStatus, name: &str) -> Option<&'a NodeStatus> {
        s.nodes.iter().find(|n| n.name == name)
    }

    pub fn wait_for(&self, what: &str, secs: u64, f: impl Fn(&ClusterStatus) -> bool) {
        wait_until(what, secs, || f(&self.status()));
    }

    /// `labsync ARGS` against the store, with node `i`'s cache as its own
    /// (the way a pull on that node fills it).
    pub fn labsync(&self, i: usize, args: &[&str]) -> String {
        let o = self.labsync_cmd(i, args).output().unwrap();
        assert!(o.status.success(), "labsync {args:?}: {o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// The command `labsync ARGS` with node `i`'s cache, to run.
    pub fn labsync_cmd(&self, i: usize, args: &[&str]) -> Command {
        let mut c = Command::new(bin("labsync"));
        c.args(args)
            .env("HOME", self.home(i))
            .env("LABSYNC_STORE", &self.store)
            .env("LABSYNC_CACHE", self.cache(i))
            .envs(self.s3.env())
            .stdin(Stdio::null());
        c
    }

    /// Makes every GPU of node `i` held by a foreign process (never
    /// chosen), or frees them again (`held` false).
    pub fn hold_gpus(&self, i: usize, held: bool) {
        let control = self
            .dir
            .path()
            .join(&self.nodes[i].name)
            .join("control.toml");
        let text = if held {
            "foreign = [{ gpu = 0, pid = 4242, mib = 3000 }, { gpu = 1, pid = 4243, mib = 3000 }]\n"
        } else {
            ""
        };
        std::fs::write(control, text).unwrap();
    }

    /// A seeded tree written to `name` in the lab's folder and pushed as
    /// `name`; the folder.
    pub fn dataset(&self, name: &str, seed: u64) -> PathBuf {
        let tree = self.dir.path().join(name);
        write_tree(&tree, seed);
        self.labsync(0, &["push", tree.to_str().unwrap(), "--name", name]);
        tree
    }

    /// Pulls `name` on node `i` (filling its cache) and waits until the
    /// coordinator knows it is there.
    pub fn cache_on(&self, i: usize, name: &str) {
        let out = self.dir.path().join(format!("out-{name}-{i}"));
        self.labsync(i, &["pull", name, out.to_str().unwrap()]);
        let (node, label) = (format!("gpu{i}"), format!("{name}@v1"));
        self.wait_for(&format!("{label} on {node}"), 20, |s| {
            present(s, &node, &label).is_some()
        });
    }

    /// `labsync ARGS` against the coordinator with `token` (warm).
    pub fn labsync_as(&self, token: &str, args: &[&str]) -> Output {
        Command::new(bin("labsync"))
            .args(args)
            .env("HOME", self.home(0))
            .env("LABSYNC_STORE", &self.store)
            .env("LABSYNC_CACHE", self.dir.path().join("client-cache"))
            .env("LABRUN_LABD", self.url(0))
            .env("LABRUN_CA", self.ca.clone().unwrap_or_default())
            .env("LABRUN_TOKEN", token)
            .envs(self.s3.env())
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    pub fn client(&self, i: usize, key: ClusterKey, as_node: &str) -> Client {
        let ep: Endpoint = self.url(i).parse().unwrap();
        let tls = (self.ca.as_deref()).map(|ca| labsync_agent::tls::client(Some(ca)).unwrap());
        Client::for_cluster(ep, key, as_node, &format!("gpu{i}")).with_tls(tls)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.labd.take() {
                // SIGKILL ends a stopped process too.
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

pub fn present(s: &ClusterStatus, node: &str, label: &str) -> Option<(u64, u64)> {
    Lab::node(s, node)?
        .data
        .iter()
        .find(|d| d.label == label)
        .map(|d| (d.present_bytes, d.total_bytes))
}
