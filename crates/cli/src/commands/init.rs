//! `labd init` and `labd adduser`: a cluster's files made on one server.
//!
//! `init` writes, under one folder, a lab CA and for each node the whole of
//! its `/etc/labsync`: `labd.toml`, the cluster secret, the users' tokens,
//! its certificate and key, and the CA's certificate. Paths in a node's
//! `labd.toml` are relative to its folder, so the folder works wherever it
//! is copied. `adduser` issues a user a token, adds it to every node's
//! tokens file (labd reads it again when it changes) and prints the user's
//! config lines.
//!
//! Nothing here overwrites: a second `init` into a folder that holds a
//! cluster is refused (a new CA would lock every node out of the others).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{IpAddr, ToSocketAddrs};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use labsync_placer::NodeName;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde::{Deserialize, Serialize};

use crate::local::random_token;

/// What `labd init` is asked to make.
#[derive(Clone, Debug)]
pub struct InitArgs {
    /// The nodes, the coordinator among them.
    pub nodes: Vec<String>,
    /// The coordinating node (default: the first).
    pub coordinator: Option<String>,
    /// The lab's store URL.
    pub store: String,
    /// Its S3 endpoint, where not AWS.
    pub s3_endpoint: Option<String>,
    /// The port every labd listens on.
    pub port: u16,
    /// `node=address`: how the others reach a node whose name does not
    /// resolve.
    pub advertise: Vec<String>,
    /// Admins: users who may read and kill every job; each gets a token.
    pub admins: Vec<String>,
    /// Where the files are written.
    pub out: PathBuf,
    /// Where they will live on each node.
    pub etc: PathBuf,
    /// The nodes' state folder.
    pub state_dir: PathBuf,
    /// The nodes' cache folder.
    pub cache_dir: PathBuf,
    /// The nodes' cache cap.
    pub cache_max: String,
}

/// What `init` remembers for `adduser`: `<out>/cluster.toml`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Made {
    nodes: Vec<String>,
    coordinator: String,
    /// The coordinator's address, as users' labrun reach it.
    coordinator_url: String,
    store: String,
    s3_endpoint: Option<String>,
    etc: PathBuf,
    /// Node → the host others dial it at (its name, or its --advertise).
    #[serde(default)]
    hosts: BTreeMap<String, String>,
}

impl Made {
    /// The host `node` is dialled at.
    fn host<'a>(&'a self, node: &'a str) -> &'a str {
        self.hosts.get(node).map_or(node, String::as_str)
    }
}

const MADE: &str = "cluster.toml";
const TOKENS: &str = "tokens.toml";

/// A user or admin name a token may name: a Unix account's (jobs run as it).
fn check_user(name: &str) -> Result<()> {
    let ok = (1..=32).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'));
    if !ok {
        bail!(
            "{name:?} is not a user name: jobs run as the Unix account a token names, so use \
             its login name (lower-case letters, digits, '_' or '-', starting with a letter)"
        );
    }
    Ok(())
}

/// A store every node can reach: an object store's URL, or a folder they
/// all mount.
fn check_store(url: &str) -> Result<()> {
    let scheme = url.split_once("://").map(|(s, _)| s);
    let ok = match scheme {
        Some(s) => [
            "s3", "gs", "az", "abfs", "abfss", "azure", "file", "http", "https",
        ]
        .contains(&s),
        None => url.starts_with('/'),
    };
    if !ok {
        bail!(
            "--store {url:?}: give the lab's store, every node's: s3://bucket/prefix (gs://, \
             az://), or file:///path of a folder every node mounts"
        );
    }
    Ok(())
}

/// `node=address` pairs, every node named being one of `nodes`.
fn advertised(pairs: &[String], nodes: &[NodeName]) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for p in pairs {
        let Some((n, a)) = p.split_once('=') else {
            bail!("--advertise {p:?}: write NODE=ADDRESS, e.g. gpu2=10.0.0.12");
        };
        if !nodes.iter().any(|m| m.as_str() == n) {
            bail!("--advertise {p:?}: {n} is not one of --nodes");
        }
        if a.is_empty() || a.contains(['/', ':', ' ']) && a.parse::<IpAddr>().is_err() {
            bail!("--advertise {p:?}: give a host name or an IP address, without port or scheme");
        }
        out.insert(n.to_string(), a.to_string());
    }
    Ok(out)
}

/// The host other nodes dial for `node`, in a URL (IPv6 in brackets).
fn url_host(host: &str) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => format!("[{v6}]"),
        _ => host.to_string(),
    }
}

/// Every node without an address of its own must resolve here: the others
/// will dial it by name. All that do not are named at once.
fn check_resolve(nodes: &[NodeName], addr: &BTreeMap<String, String>, port: u16) -> Result<()> {
    let unresolved: Vec<String> = nodes
        .iter()
        .filter(|n| !addr.contains_key(n.as_str()))
        .filter_map(|n| match (n.as_str(), port).to_socket_addrs() {
            Ok(a) if a.len() > 0 => None,
            Ok(_) => Some(format!("{n} (no address)")),
            Err(e) => Some(format!("{n} ({e})")),
        })
        .collect();
    if !unresolved.is_empty() {
        bail!(
            "node names that do not resolve here: {}. The other nodes would dial them by name \
             and never reach them: add them to DNS or /etc/hosts on every node, or give each \
             its address, e.g. --advertise {}=10.0.0.12",
            unresolved.join(", "),
            nodes
                .iter()
                .find(|n| !addr.contains_key(n.as_str()))
                .map_or("gpu2", |n| n.as_str())
        );
    }
    Ok(())
}

/// Writes `text` to a new file `path` with `mode`, refusing to overwrite.
fn write_new(path: &Path, text: &str, mode: u32) -> Result<()> {
    let mut f = std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    // The umask may have taken bits the mode asked for; set it exactly.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Replaces `path` with `text` (mode `mode`), all at once.
fn replace(path: &Path, text: &str, mode: u32) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    write_new(&tmp, text, mode)?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

fn mkdir(path: &Path, mode: u32) -> Result<()> {
    std::fs::create_dir_all(path).with_context(|| format!("cannot create {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The lab's CA: its certificate (PEM) and what signs with it.
fn make_ca() -> Result<(String, String, Issuer<'static, KeyPair>)> {
    let key = KeyPair::generate().context("cannot make the CA's key")?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "labsync lab CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key)?;
    let key_pem = key.serialize_pem();
    Ok((cert.pem(), key_pem, Issuer::new(params, key)))
}

/// A node's certificate (for its name and the address others dial) and key.
fn make_node_cert(
    name: &str,
    dialled: &str,
    ca: &Issuer<'static, KeyPair>,
) -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut sans = vec![name.to_string()];
    if dialled != name {
        sans.push(dialled.to_string());
    }
    let mut params = CertificateParams::new(sans)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    let cert = params.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// One node's `labd.toml`.
fn node_config(a: &InitArgs, node: &str, coordinator_url: &str, dialled: &str) -> String {
    let admins: Vec<String> = a.admins.iter().map(|u| toml_str(u)).collect();
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# labd on {node}, written by `labd init`. Every key: docs/config.md.\n\
         # Relative paths are relative to this file's folder ({etc}).\n",
        etc = a.etc.display()
    );
    let _ = writeln!(t, "node_name = {}", toml_str(node));
    let _ = writeln!(
        t,
        "listen = {}                  # TLS only (see [tls])",
        toml_str(&format!("0.0.0.0:{}", a.port))
    );
    let _ = writeln!(t, "store = {}", toml_str(&a.store));
    if let Some(e) = &a.s3_endpoint {
        let _ = writeln!(t, "s3_endpoint = {}", toml_str(e));
    }
    let _ = writeln!(
        t,
        "state_dir = {}\ncache_dir = {}\ncache_max = {}",
        toml_str(&a.state_dir.to_string_lossy()),
        toml_str(&a.cache_dir.to_string_lossy()),
        toml_str(&a.cache_max)
    );
    let _ = writeln!(t, "admins = [{}]", admins.join(", "));
    let _ = writeln!(
        t,
        "tokens_file = \"{TOKENS}\"              # user = token; `labd adduser` adds to it\n"
    );
    let _ = writeln!(t, "[cluster]\ncoordinator = {}", toml_str(coordinator_url));
    if node == coordinator_url_node(a) {
        let _ = writeln!(t, "coordinate = true");
    }
    let _ = writeln!(
        t,
        "advertise = {}\nsecret_file = \"cluster.secret\"\n",
        toml_str(&format!("https://{}:{}", url_host(dialled), a.port))
    );
    let _ = writeln!(
        t,
        "[tls]\ncert = \"tls/{node}.pem\"\nkey = \"tls/{node}.key\"\nca = \"tls/lab-ca.pem\""
    );
    t
}

fn coordinator_url_node(a: &InitArgs) -> &str {
    a.coordinator.as_deref().unwrap_or(&a.nodes[0])
}

/// The lines of a user's `~/.config/labsync/config.toml`.
fn user_config(made: &Made, user: &str, token: &str) -> String {
    let mut t = format!(
        "# ~/.config/labsync/config.toml of {user} (chmod 600: it holds {user}'s token)\n\
         labd = {}\ntoken = {}\nlabd_ca = {}\nstore = {}\n",
        toml_str(&made.coordinator_url),
        toml_str(token),
        toml_str(&made.etc.join("tls/lab-ca.pem").to_string_lossy()),
        toml_str(&made.store),
    );
    if let Some(e) = &made.s3_endpoint {
        let _ = writeln!(t, "s3_endpoint = {}", toml_str(e));
    }
    t
}

/// The folder of one node's files: what goes to its `/etc/labsync`.
fn node_dir(out: &Path, node: &str) -> PathBuf {
    out.join(node).join("etc/labsync")
}

/// `labd init`: makes the cluster's files; returns what to tell the admin.
pub fn init(a: &InitArgs) -> Result<String> {
    if a.nodes.is_empty() {
        bail!("--nodes names no node: give every node of the cluster, e.g. --nodes gpu1,gpu2");
    }
    let nodes: Vec<NodeName> = a
        .nodes
        .iter()
        .map(|n| n.parse::<NodeName>().map_err(anyhow::Error::from))
        .collect::<Result<_>>()?;
    for (i, n) in nodes.iter().enumerate() {
        if nodes[..i].contains(n) {
            bail!("--nodes names {n} twice");
        }
    }
    let coordinator = coordinator_url_node(a);
    if !a.nodes.iter().any(|n| n == coordinator) {
        bail!("--coordinator {coordinator} is not one of --nodes");
    }
    for u in &a.admins {
        check_user(u)?;
    }
    crate::parse_size(&a.cache_max)
        .with_context(|| format!("--node-cache-max {:?}", a.cache_max))?;
    if a.port == 0 {
        bail!("--port 0: give the port every labd listens on, e.g. 7420");
    }
    if !a.etc.is_absolute() {
        bail!(
            "--etc {}: give the absolute folder the files will have on each node",
            a.etc.display()
        );
    }
    check_store(&a.store)?;
    let addr = advertised(&a.advertise, &nodes)?;
    check_resolve(&nodes, &addr, a.port)?;
    let dialled = |n: &str| addr.get(n).cloned().unwrap_or_else(|| n.to_string());

    if a.out.join(MADE).exists() || a.out.join("ca").exists() {
        bail!(
            "{} already holds a cluster's files: a second CA would lock every node out of the \
             others. Add users with `labd adduser NAME --dir {}`, or init into a new folder",
            a.out.display(),
            a.out.display()
        );
    }
    // A folder of its own, mode 700: not one that holds anything else,
    // whose mode would change under its owner (`--out .`, `--out ~`).
    if std::fs::read_dir(&a.out).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "--out {} is a folder with other files in it: init writes the CA's key there and \
             makes it mode 700; give a new folder (the default is ./labsync-cluster)",
            a.out.display()
        );
    }
    mkdir(&a.out, 0o700)?;
    mkdir(&a.out.join("ca"), 0o700)?;
    let (ca_pem, ca_key, issuer) = make_ca()?;
    write_new(&a.out.join("ca/lab-ca.pem"), &ca_pem, 0o644)?;
    write_new(&a.out.join("ca/lab-ca.key"), &ca_key, 0o600)?;

    let secret = random_token();
    let mut tokens = BTreeMap::new();
    for u in &a.admins {
        tokens.insert(u.clone(), random_token());
    }
    let tokens_text = toml::to_string(&tokens)?;
    let coordinator_url = format!("https://{}:{}", url_host(&dialled(coordinator)), a.port);
    for n in &a.nodes {
        let d = node_dir(&a.out, n);
        mkdir(&a.out.join(n), 0o700)?;
        mkdir(&a.out.join(n).join("etc"), 0o755)?;
        mkdir(&d, 0o755)?;
        mkdir(&d.join("tls"), 0o755)?;
        let (cert, key) = make_node_cert(n, &dialled(n), &issuer)?;
        write_new(&d.join(format!("tls/{n}.pem")), &cert, 0o644)?;
        write_new(&d.join(format!("tls/{n}.key")), &key, 0o600)?;
        write_new(&d.join("tls/lab-ca.pem"), &ca_pem, 0o644)?;
        write_new(&d.join("cluster.secret"), &format!("{secret}\n"), 0o600)?;
        write_new(&d.join(TOKENS), &tokens_text, 0o600)?;
        write_new(
            &d.join("labd.toml"),
            &node_config(a, n, &coordinator_url, &dialled(n)),
            0o644,
        )?;
    }
    let made = Made {
        nodes: a.nodes.clone(),
        coordinator: coordinator.to_string(),
        coordinator_url,
        store: a.store.clone(),
        s3_endpoint: a.s3_endpoint.clone(),
        etc: a.etc.clone(),
        hosts: a.nodes.iter().map(|n| (n.clone(), dialled(n))).collect(),
    };
    write_new(&a.out.join(MADE), &toml::to_string(&made)?, 0o600)?;

    let out = a.out.display();
    let etc = a.etc.display();
    let mut say = format!(
        "Made a cluster of {} node(s) in {out}, coordinated by {coordinator} ({}).\n\n\
         The lab's CA key is {out}/ca/lab-ca.key: it signs node certificates. Keep it (and \
         this folder) on this server only, mode 700, or offline.\n",
        a.nodes.len(),
        made.coordinator_url
    );
    if labsync_agent::euid() != 0 {
        let _ = write!(
            say,
            "\nThese files belong to you, not root: labd (root) refuses secrets another user \
             owns. Run init with sudo, or chown -R root: {out} before copying.\n"
        );
    }
    if a.store.starts_with("s3://") {
        let _ = write!(
            say,
            "\nFirst, on each node, the store's keys in {etc}/store.env (mode 600; labd.service \
             reads it): AWS_ACCESS_KEY_ID=… and AWS_SECRET_ACCESS_KEY=… lines.\n"
        );
    }
    let _ = writeln!(
        say,
        "\nCopy each node's files to it (as root), then start labd there:"
    );
    for n in &a.nodes {
        let _ = writeln!(
            say,
            "  rsync -a {out}/{n}/etc/labsync/ root@{host}:{etc}/ && ssh root@{host} systemctl enable --now labd",
            host = made.host(n)
        );
    }
    let _ = write!(
        say,
        "\nThen check the cluster from {coordinator}:  labd doctor --cluster --config {etc}/labd.toml\n"
    );
    for u in &a.admins {
        let _ = write!(
            say,
            "\nAdmin {u}'s lines for ~/.config/labsync/config.toml:\n\n{}",
            user_config(&made, u, &tokens[u])
        );
    }
    let _ = write!(
        say,
        "\nAdd users with `labd adduser NAME --dir {out}`; each must be a Unix account on every \
         node (jobs run as it).\n"
    );
    Ok(say)
}

/// `labd adduser`: issues `user` a token in every node's tokens file.
pub fn adduser(dir: &Path, user: &str, replace_token: bool) -> Result<String> {
    check_user(user)?;
    let made_path = dir.join(MADE);
    let made: Made = toml::from_str(&std::fs::read_to_string(&made_path).with_context(|| {
        format!(
            "cannot read {}: is {} a folder `labd init` made?",
            made_path.display(),
            dir.display()
        )
    })?)
    .with_context(|| format!("invalid {}", made_path.display()))?;
    let token = random_token();
    let mut said_nodes = Vec::new();
    for n in &made.nodes {
        let f = node_dir(dir, n).join(TOKENS);
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display()))?;
        let mut tokens: BTreeMap<String, String> =
            toml::from_str(&text).with_context(|| format!("invalid {}", f.display()))?;
        if tokens.contains_key(user) && !replace_token {
            bail!(
                "{user} already has a token: --replace gives them a new one (the old one stops \
                 working once the nodes have the new {TOKENS})"
            );
        }
        tokens.insert(user.to_string(), token.clone());
        replace(&f, &toml::to_string(&tokens)?, 0o600)?;
        said_nodes.push(n.clone());
    }
    let out = dir.display();
    let etc = made.etc.display();
    let mut say = format!(
        "{user} has a token in the tokens file of {}. Copy it to the nodes (labd reads it \
         again; no restart):\n\n",
        said_nodes.join(", ")
    );
    for n in &made.nodes {
        let _ = writeln!(
            say,
            "  rsync -a {out}/{n}/etc/labsync/{TOKENS} root@{}:{etc}/{TOKENS}",
            made.host(n)
        );
    }
    if labsync_agent::user_by_name(user).is_none() {
        let _ = writeln!(
            say,
            "\n{user} is no Unix account on this machine: jobs run as the account a token \
             names, so make {user} one on every node."
        );
    }
    let _ = write!(
        say,
        "\nGive {user} these lines for ~/.config/labsync/config.toml, and make {user} a Unix \
         account on every node (jobs run as it):\n\n{}",
        user_config(&made, user, &token)
    );
    Ok(say)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: &Path) -> InitArgs {
        InitArgs {
            nodes: vec!["gpu1".into(), "gpu2".into(), "gpu3".into()],
            coordinator: None,
            store: "s3://lab-store/labsync".into(),
            s3_endpoint: Some("http://10.0.0.5:9000".into()),
            port: 7420,
            advertise: vec![
                "gpu1=10.0.0.11".into(),
                "gpu2=10.0.0.12".into(),
                "gpu3=10.0.0.13".into(),
            ],
            admins: vec!["ana".into()],
            out: out.to_path_buf(),
            etc: "/etc/labsync".into(),
            state_dir: "/var/lib/labsync".into(),
            cache_dir: "/var/cache/labsync".into(),
            cache_max: "500G".into(),
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn init_writes_each_nodes_files_with_modes_that_labd_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("lab");
        let said = init(&args(&out)).unwrap();
        assert!(said.contains("rsync -a"), "{said}");
        assert!(said.contains("token = "), "the admin's lines: {said}");
        assert_eq!(mode(&out), 0o700);
        assert_eq!(mode(&out.join("ca/lab-ca.key")), 0o600);
        let secrets: Vec<String> = ["gpu1", "gpu2", "gpu3"]
            .iter()
            .map(|n| {
                let d = node_dir(&out, n);
                assert_eq!(mode(&d.join("cluster.secret")), 0o600);
                assert_eq!(mode(&d.join(TOKENS)), 0o600);
                assert_eq!(mode(&d.join(format!("tls/{n}.key"))), 0o600);
                assert_eq!(mode(&d.join("labd.toml")), 0o644);
                let cfg = std::fs::read_to_string(d.join("labd.toml")).unwrap();
                assert!(cfg.contains(&format!("node_name = \"{n}\"")), "{cfg}");
                assert!(
                    cfg.contains("coordinator = \"https://10.0.0.11:7420\""),
                    "{cfg}"
                );
                assert_eq!(cfg.contains("coordinate = true"), *n == "gpu1", "{cfg}");
                // Each node's file reads as labd reads it, and passes the
                // mode checks labd makes.
                let file = crate::labd_config::read_file(&d.join("labd.toml")).unwrap();
                assert!(format!("{file:?}").contains("10.0.0.1"));
                labsync_agent::tokens::read_tokens_file(&d.join(TOKENS)).unwrap();
                std::fs::read_to_string(d.join("cluster.secret")).unwrap()
            })
            .collect();
        assert!(secrets
            .iter()
            .all(|s| *s == secrets[0] && s.trim().len() == 64));
        // A second init into the folder is refused, and changes nothing.
        let before = std::fs::read(out.join("ca/lab-ca.key")).unwrap();
        let e = init(&args(&out)).unwrap_err().to_string();
        assert!(e.contains("already holds"), "{e}");
        assert_eq!(std::fs::read(out.join("ca/lab-ca.key")).unwrap(), before);
    }

    #[test]
    fn the_node_certificates_are_the_cas_and_name_the_address_others_dial() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("lab");
        init(&args(&out)).unwrap();
        let d = node_dir(&out, "gpu2");
        // labd's own TLS loaders take them: a server from the node's pair,
        // a client trusting the CA.
        labsync_agent::tls::server(&d.join("tls/gpu2.pem"), &d.join("tls/gpu2.key")).unwrap();
        labsync_agent::tls::client(Some(&d.join("tls/lab-ca.pem"))).unwrap();
        let pem = std::fs::read_to_string(d.join("tls/gpu2.pem")).unwrap();
        let ca = std::fs::read_to_string(out.join("ca/lab-ca.pem")).unwrap();
        assert_ne!(pem, ca);
        assert_eq!(
            std::fs::read_to_string(d.join("tls/lab-ca.pem")).unwrap(),
            ca
        );
    }

    #[test]
    fn names_that_do_not_resolve_are_refused_at_init_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = args(&dir.path().join("lab"));
        a.nodes = vec![
            "gpu1".into(),
            "no-such-node-7f3a.invalid".into(),
            "localhost".into(),
        ];
        a.advertise = vec!["gpu1=10.0.0.11".into()];
        let e = init(&a).unwrap_err().to_string();
        assert!(e.contains("no-such-node-7f3a.invalid"), "{e}");
        assert!(!e.contains("localhost (") && !e.contains("gpu1 ("), "{e}");
        assert!(e.contains("--advertise"), "{e}");
        assert!(!dir.path().join("lab").exists(), "nothing written");
    }

    #[test]
    fn bad_input_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("lab");
        type Change = Box<dyn Fn(&mut InitArgs)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|a| a.nodes.clear()), "names no node"),
            (Box::new(|a| a.nodes[1] = "gpu1".into()), "twice"),
            (
                Box::new(|a| a.nodes[1] = "../etc".into()),
                "not a node name",
            ),
            (
                Box::new(|a| a.coordinator = Some("gpu9".into())),
                "not one of --nodes",
            ),
            (
                Box::new(|a| a.admins = vec!["Root Admin".into()]),
                "not a user name",
            ),
            (
                Box::new(|a| a.advertise = vec!["gpu9=1.2.3.4".into()]),
                "not one of --nodes",
            ),
            (
                Box::new(|a| a.advertise = vec!["gpu1".into()]),
                "NODE=ADDRESS",
            ),
            (
                Box::new(|a| a.advertise = vec!["gpu1=http://x:1".into()]),
                "without port",
            ),
            (Box::new(|a| a.etc = "etc".into()), "absolute"),
            (Box::new(|a| a.store = "ftp://x".into()), "--store"),
            (
                Box::new(|a| a.cache_max = "lots".into()),
                "--node-cache-max",
            ),
        ];
        for (change, want) in cases {
            let mut a = args(&out);
            change(&mut a);
            let e = format!("{:#}", init(&a).unwrap_err());
            assert!(e.contains(want), "{want}: {e}");
        }
        assert!(!out.exists());
        // A folder that holds other files is not taken (nor its mode changed).
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = init(&args(&out)).unwrap_err().to_string();
        assert!(e.contains("other files"), "{e}");
        assert_eq!(mode(&out), 0o755);
    }

    #[test]
    fn adduser_adds_a_token_to_every_node_and_prints_the_users_lines() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("lab");
        init(&args(&out)).unwrap();
        let said = adduser(&out, "bob", false).unwrap();
        assert!(said.contains("labd = \"https://10.0.0.11:7420\""), "{said}");
        // Copied to the addresses the nodes are dialled at.
        assert!(
            said.contains("root@10.0.0.13:/etc/labsync/tokens.toml"),
            "{said}"
        );
        assert!(
            said.contains("labd_ca = \"/etc/labsync/tls/lab-ca.pem\""),
            "{said}"
        );
        assert!(
            said.contains("s3_endpoint = \"http://10.0.0.5:9000\""),
            "{said}"
        );
        let token = said
            .lines()
            .find_map(|l| l.strip_prefix("token = \""))
            .and_then(|t| t.strip_suffix('"'))
            .unwrap()
            .to_string();
        for n in ["gpu1", "gpu2", "gpu3"] {
            let f = node_dir(&out, n).join(TOKENS);
            assert_eq!(mode(&f), 0o600);
            let t = labsync_agent::tokens::read_tokens_file(&f).unwrap();
            assert_eq!(t["bob"].expose(), token);
            assert!(t.contains_key("ana"));
        }
        let e = adduser(&out, "bob", false).unwrap_err().to_string();
        assert!(e.contains("--replace"), "{e}");
        let again = adduser(&out, "bob", true).unwrap();
        assert!(!again.contains(&token));
        let e = adduser(dir.path(), "carol", false).unwrap_err().to_string();
        assert!(e.contains("labd init"), "{e}");
    }
}
