//! labd's settings: its config file (TOML) and flags, resolved into what the
//! daemon runs with, where it listens and which GPUs it sees.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use labsync_agent::cluster::{ClusterConfig, ClusterKey, LabConfig};
use labsync_agent::tls::{ClientConfig, ServerConfig};
use labsync_agent::tokens::check_tokens;
use labsync_agent::{
    current_user, detect, euid, ConnLimits, DaemonConfig, Endpoint, FakeGpus, GpuInventory,
    JobLimits, LoginLimits, Secret, SlurmCheck,
};
use labsync_placer::{Ladder, Member, Members};
use serde::Deserialize;

use crate::local::{hostname, load_or_create_token, LocalLabd};
use crate::{parse_size, Overrides, Settings};

/// labd's command line; each flag wins over the config file.
#[derive(Clone, Debug, Default)]
pub struct LabdFlags {
    /// Config file.
    pub config: Option<PathBuf>,
    /// Where to listen.
    pub listen: Option<String>,
    /// State folder.
    pub state_dir: Option<PathBuf>,
    /// Store URL.
    pub store: Option<String>,
    /// Node cache folder.
    pub cache_dir: Option<PathBuf>,
    /// Node cache cap (`500G`).
    pub cache_max: Option<String>,
    /// Fake GPUs (`4x11GiB`), for tests and demos.
    pub fake_gpus: Option<String>,
    /// Their control file.
    pub fake_gpus_control: Option<PathBuf>,
}

/// What labd runs with.
pub struct LabdSettings {
    /// The daemon's configuration.
    pub config: DaemonConfig,
    /// Where it listens.
    pub listen: Endpoint,
    /// Its GPUs.
    pub inventory: Arc<dyn GpuInventory>,
    /// TLS on its TCP listener (`[tls]`).
    pub tls: Option<Arc<ServerConfig>>,
}

/// labd's config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LabdFile {
    listen: Option<String>,
    state_dir: Option<PathBuf>,
    node_name: Option<String>,
    store: Option<String>,
    cache_dir: Option<PathBuf>,
    cache_max: Option<String>,
    /// Cap on materialised trees of code and data (default: cache_max).
    trees_max: Option<String>,
    /// Trees one user's jobs and stages may hold here (default: half of
    /// trees_max; "0": no share).
    trees_per_user: Option<String>,
    s3_endpoint: Option<String>,
    s3_region: Option<String>,
    /// How outputs pushes compress compressible chunks: `lz4` or `zstd`.
    compression: Option<String>,
    fake_gpus: Option<String>,
    fake_gpus_control: Option<PathBuf>,
    /// A folder with a character device `nvidia<i>` per fake GPU, which
    /// jobs are confined to as to real cards (tests).
    fake_gpus_dev: Option<PathBuf>,
    /// A GPU with more than this held by foreign processes is not free (default 256M).
    foreign_limit: Option<String>,
    inventory_deadline_ms: Option<u64>,
    kill_grace_s: Option<u64>,
    /// A hold's GPUs idle this long are given back (default 1800).
    idle_hold_s: Option<u64>,
    outputs_every_s: Option<u64>,
    /// The shortest `--outputs-every` a job gets (default 60).
    outputs_every_min_s: Option<u64>,
    /// First wait before a failed final outputs push is tried again (doubles, up to 10 min).
    outputs_retry_s: Option<u64>,
    /// Seconds a job's working folder stays after it ended (default: one day).
    work_keep_s: Option<u64>,
    /// Days an ended job stays in `labrun ps --all` (default 90).
    history_keep_days: Option<u64>,
    /// Cap on one job's log on disk, e.g. `100M` (default); head and tail are kept.
    log_max: Option<String>,
    /// `submitter` (default; only when root) or `labd`.
    run_as: Option<String>,
    #[serde(default)]
    admins: Vec<String>,
    #[serde(default)]
    tokens: BTreeMap<String, Secret>,
    /// A file of more tokens (`user = "token"` lines, mode 600), read again
    /// when it changes: what `labd init` and `labd adduser` write.
    tokens_file: Option<PathBuf>,
    tick_ms: Option<u64>,
    /// Connections open at once, everyone together (default 1024).
    max_connections: Option<usize>,
    /// Connections open at once from one Unix user or address (default 128).
    max_connections_per_user: Option<usize>,
    /// A connection that sends no whole request head for this long is closed (default 10000).
    header_timeout_ms: Option<u64>,
    /// Jobs one user may have queued at once (default 1000).
    max_queued_per_user: Option<usize>,
    /// Jobs without GPUs one user may have running at once (default: four
    /// per CPU, at least 8).
    max_cpu_jobs_per_user: Option<usize>,
    /// Processes and threads one job may have at once (0: no limit).
    job_pids_max: Option<u64>,
    /// Memory one job may use, e.g. `64G` (default: no limit).
    job_memory_max: Option<String>,
    /// Processes and threads of one user's jobs together (default: half
    /// the machine's pids; 0: no limit).
    user_pids_max: Option<u64>,
    /// Memory of one user's jobs together (default: three quarters of the
    /// machine's; "0": no limit).
    user_memory_max: Option<String>,
    /// The login limits jobs get, as pam_limits gives them at a login
    /// (default `/etc/security/limits.conf`, and the `limits.d` folder
    /// beside it).
    limits_conf: Option<PathBuf>,
    /// Membership of a cluster.
    cluster: Option<ClusterFile>,
    /// The lab's rules for the cluster's queue (the coordinator's).
    lab: Option<LabFile>,
    /// TLS on the TCP listener and towards the other nodes.
    tls: Option<TlsFile>,
    /// Where the lab runs Slurm (the coordinator's).
    slurm: Option<SlurmFile>,
    /// The web page and `/metrics`.
    web: Option<WebFile>,
    /// Telling users of their jobs' ends.
    notify: Option<NotifyFile>,
}

/// `[notify]` of labd's config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NotifyFile {
    /// Where to tell users who name nowhere.
    #[serde(default)]
    default: Vec<String>,
    /// Hosts webhooks may go to (default: Slack's and Discord's).
    hosts: Option<Vec<String>>,
    /// The sendmail program (default /usr/sbin/sendmail).
    sendmail: Option<PathBuf>,
}

/// `[notify]`, checked: the lab's default targets must be ones a user could name.
fn notify_config(file: Option<NotifyFile>) -> Result<labsync_agent::NotifyConfig> {
    let file = file.unwrap_or_default();
    let mut cfg = labsync_agent::NotifyConfig::default();
    if let Some(h) = file.hosts {
        if let Some(bad) = h
            .iter()
            .find(|h| h.is_empty() || h.contains(['/', ':', '@', ' ']))
        {
            bail!("[notify] hosts: {bad:?} is not a host name (say hooks.slack.com, chat.lab.example)");
        }
        cfg.hosts = h;
    }
    if let Some(s) = file.sendmail {
        cfg.sendmail = s;
    }
    for t in &file.default {
        labsync_agent::notify_target_ok(t, &cfg.hosts)
            .map_err(|e| anyhow::anyhow!("[notify] default: {e}"))?;
    }
    cfg.default = file.default;
    Ok(cfg)
}

/// `[web]` of labd's config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WebFile {
    /// `token` (default), `lan` or `off`.
    access: Option<String>,
    /// `owner` (default) or `lab`: whose job logs a page shows.
    logs: Option<String>,
}

/// `[web]`, checked; `secure`: labd listens with TLS.
fn web_config(file: Option<WebFile>, secure: bool) -> Result<labsync_agent::WebConfig> {
    use labsync_agent::{Access, LogsTo};
    let file = file.unwrap_or(WebFile {
        access: None,
        logs: None,
    });
    let access = match file.access.as_deref() {
        None | Some("token") => Access::Token,
        Some("lan") => Access::Lan,
        Some("off") => Access::Off,
        Some(other) => bail!(
            "[web] access = {other:?}: say \"token\" (users log in with their token), \"lan\" \
             (read-only pages open to whoever reaches labd) or \"off\""
        ),
    };
    let logs = match file.logs.as_deref() {
        None | Some("owner") => LogsTo::Owner,
        Some("lab") => LogsTo::Lab,
        Some(other) => bail!(
            "[web] logs = {other:?}: say \"owner\" (a job's log only to its user and admins) or \
             \"lab\" (to everyone who sees the page)"
        ),
    };
    Ok(labsync_agent::WebConfig {
        access,
        logs,
        secure_cookie: secure,
    })
}

/// `[slurm]` of the coordinator's config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SlurmFile {
    /// Seconds between re-rankings of labsync's pending Slurm jobs (0: never).
    rerank_s: Option<u64>,
    /// Longest wait for one Slurm command, seconds (default 10).
    timeout_s: Option<u64>,
    /// Only this partition's nodes.
    partition: Option<String>,
    /// slurm.conf, where not the default (SLURM_CONF for Slurm's commands).
    conf: Option<PathBuf>,
    /// Check with Slurm (`scontrol show job`) that a stage is for the
    /// asker's job running on this node (default true).
    check_jobs: Option<bool>,
}

/// `[tls]` of labd's config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsFile {
    /// This node's certificate chain (PEM, its own certificate first).
    cert: PathBuf,
    /// Its private key (PEM, mode 600).
    key: PathBuf,
    /// The CA the other nodes' certificates are checked against (PEM;
    /// required in a cluster; without one, the system's roots).
    ca: Option<PathBuf>,
}

/// `[tls]`, read and checked.
struct Tls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

fn tls_config(t: TlsFile, in_cluster: bool) -> Result<Tls> {
    check_private(&t.key, true).context("[tls] key")?;
    // Whoever can change the certificate or the CA could stand in for a
    // node: neither may be writable by other users.
    check_private(&t.cert, false).context("[tls] cert")?;
    match &t.ca {
        Some(ca) => check_private(ca, false).context("[tls] ca")?,
        None if in_cluster => bail!(
            "[tls] ca is not set: in a cluster each node checks the others' certificates \
             against the lab's CA; give its file (the system's roots would accept any \
             certificate a public CA issued for a node's name)"
        ),
        None => {}
    }
    Ok(Tls {
        server: labsync_agent::tls::server(&t.cert, &t.key).map_err(anyhow::Error::msg)?,
        client: labsync_agent::tls::client(t.ca.as_deref()).map_err(anyhow::Error::msg)?,
    })
}

/// `[cluster]` of labd's config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterFile {
    /// The coordinator's address, `http://host:port` (on the coordinator too).
    coordinator: String,
    /// This labd coordinates.
    #[serde(default)]
    coordinate: bool,
    /// How the other nodes reach this one (default: `http://<node_name>:<port>`).
    advertise: Option<String>,
    /// The cluster secret, the same on every node (or `secret_file`).
    secret: Option<Secret>,
    /// A file holding it (mode 600).
    secret_file: Option<PathBuf>,
    /// Time between heartbeats (default 1000).
    heartbeat_ms: Option<u64>,
    /// A node without a heartbeat this long is down (default 10000).
    down_after_ms: Option<u64>,
    /// Without `[tls]`, nodes talk in clear: requests are signed, but their
    /// answers (a heartbeat's reply telling a node to kill jobs, a
    /// dispatch's refusal) are not, and anyone on the LAN can forge them.
    /// Only with this set to true does such a cluster start.
    #[serde(default)]
    insecure_cleartext: bool,
}

/// Reads the config file (if any) and resolves everything with the flags.
pub fn resolve(flags: &LabdFlags) -> Result<LabdSettings> {
    resolve_with(flags, &[])
}

/// [`resolve`], with `more_env` as if in the environment (before it: the
/// process's own wins), as `labd doctor` reads the store's keys from the
/// `store.env` that labd.service gives labd.
pub fn resolve_with(flags: &LabdFlags, more_env: &[(String, String)]) -> Result<LabdSettings> {
    let mut file = match &flags.config {
        Some(p) => read_file(p)?,
        None => LabdFile::default(),
    };
    let mut env: Vec<(String, String)> = more_env.to_vec();
    env.extend(std::env::vars());
    let settings = Settings::resolve(
        &Overrides {
            store: flags.store.clone().or(file.store.clone()),
            cache_dir: flags.cache_dir.clone().or(file.cache_dir.clone()),
            cache_max: flags.cache_max.clone().or(file.cache_max.clone()),
            s3_endpoint: file.s3_endpoint.clone(),
            s3_region: file.s3_region.clone(),
            compression: file.compression.clone(),
            ..Default::default()
        },
        &env,
    )?;
    let local = match flags.state_dir.clone().or(file.state_dir.clone()) {
        Some(d) => LocalLabd::at(&d),
        None => LocalLabd::for_user()?,
    };
    let in_cluster = file.cluster.is_some();
    let tls = (file.tls.take())
        .map(|t| tls_config(t, in_cluster))
        .transpose()?;
    let listen = match flags.listen.clone().or(file.listen.clone()) {
        Some(l) => l.parse::<Endpoint>().map_err(anyhow::Error::msg)?,
        None => Endpoint::Unix(local.socket()),
    };
    // With [tls] the TCP listener speaks only TLS; without it, none.
    let listen = match (listen, &tls) {
        (Endpoint::Tcp(a) | Endpoint::Tls(a), Some(_)) => Endpoint::Tls(a),
        (Endpoint::Tls(a), None) => bail!(
            "listen = \"https://{a}\" needs a certificate: set [tls] cert and key (or listen on \
             http://{a})"
        ),
        (Endpoint::Unix(p), Some(_)) => bail!(
            "[tls] is set but labd listens on the Unix socket {}: TLS is for a TCP listener \
             (listen = \"0.0.0.0:7420\")",
            p.display()
        ),
        (l, None) => l,
    };
    let fake_gpus = flags.fake_gpus.clone().or(file.fake_gpus.clone());
    let control = (flags.fake_gpus_control.clone()).or(file.fake_gpus_control.clone());
    let fake_dev = file.fake_gpus_dev.clone();
    let cluster_file = file.cluster.take();
    let lab_file = file.lab.take();
    let slurm_file = file.slurm.take();
    let web_file = file.web.take();
    let notify_file = file.notify.take();
    let coordinates = cluster_file.as_ref().is_some_and(|c| c.coordinate);
    let mut config = daemon_config(file, settings, &local)?;
    if let Some(c) = cluster_file {
        let client = tls.as_ref().map(|t| t.client.clone());
        config.cluster = Some(cluster_config(c, &config.node_name, &listen, client)?);
    }
    if let Some(l) = lab_file {
        let Some(c) = config.cluster.as_mut() else {
            bail!(
                "[lab] orders a cluster's queue (tiers, grants, caps), and this labd has no \
                 [cluster]; one labd runs its jobs first come, first served"
            );
        };
        c.lab = lab_config(l)?;
    }
    let inventory: Arc<dyn GpuInventory> = match fake_gpus {
        Some(spec) => {
            let fake = FakeGpus::new(&spec, control)?;
            Arc::new(match fake_dev {
                Some(dev) => fake.with_devices(dev),
                None => fake,
            })
        }
        None => Arc::from(detect()),
    };
    (config.slurm_check, config.slurm_rerank) = slurm_settings(slurm_file, coordinates);
    config.web = web_config(web_file, matches!(listen, Endpoint::Tls(_)))?;
    config.notify = notify_config(notify_file)?;
    Ok(LabdSettings {
        config,
        listen,
        inventory,
        tls: tls.map(|t| t.server),
    })
}

/// `[slurm]`: how stages are checked with Slurm, and how a coordinator
/// (`coordinates`) re-ranks pending Slurm jobs.
fn slurm_settings(
    slurm_file: Option<SlurmFile>,
    coordinates: bool,
) -> (Option<SlurmCheck>, Option<labsync_agent::slurm::Rerank>) {
    // Stages are for Slurm jobs only: each is checked with Slurm unless
    // the admin says otherwise.
    let check = match &slurm_file {
        Some(f) if f.check_jobs == Some(false) => None,
        f => Some(SlurmCheck {
            conf: f.as_ref().and_then(|f| f.conf.clone()),
            timeout: Duration::from_secs(f.as_ref().and_then(|f| f.timeout_s).unwrap_or(10).max(1)),
        }),
    };
    let rerank = match slurm_file {
        Some(f) if f.rerank_s.unwrap_or(0) > 0 => {
            if !coordinates {
                // One labd.toml may be deployed to every node.
                tracing::info!(
                    "[slurm] rerank_s: only the cluster's coordinator re-ranks pending Slurm \
                     jobs; ignored here"
                );
                None
            } else {
                Some(labsync_agent::slurm::Rerank {
                    every: Duration::from_secs(f.rerank_s.unwrap_or(30)),
                    timeout: Duration::from_secs(f.timeout_s.unwrap_or(10).max(1)),
                    partition: f.partition,
                    conf: f.conf,
                })
            }
        }
        _ => None,
    };
    (check, rerank)
}

/// Parses the config file, refusing one others could change (or read, when
/// it holds tokens).
pub(crate) fn read_file(p: &Path) -> Result<LabdFile> {
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("cannot read config file {}", p.display()))?;
    let mut file: LabdFile =
        toml::from_str(&text).with_context(|| format!("invalid config file {}", p.display()))?;
    check_private(p, file.holds_secrets())?;
    let dir = std::fs::canonicalize(p)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    file.rebase(&dir);
    Ok(file)
}

impl LabdFile {
    /// Whether the file itself holds tokens or the cluster secret.
    pub(crate) fn holds_secrets(&self) -> bool {
        !self.tokens.is_empty() || self.cluster.as_ref().is_some_and(|c| c.secret.is_some())
    }

    /// The files it names that hold secrets (`true`) or that others must
    /// not change (`false`), the config file itself first.
    pub(crate) fn secret_files(&self) -> Vec<(PathBuf, bool)> {
        let mut v = Vec::new();
        if let Some(t) = &self.tokens_file {
            v.push((t.clone(), true));
        }
        if let Some(f) = self.cluster.as_ref().and_then(|c| c.secret_file.clone()) {
            v.push((f, true));
        }
        if let Some(t) = &self.tls {
            v.push((t.key.clone(), true));
            v.push((t.cert.clone(), false));
            if let Some(ca) = &t.ca {
                v.push((ca.clone(), false));
            }
        }
        v
    }

    /// Makes the file's relative paths relative to its folder, not to
    /// wherever labd was started: a folder `labd init` wrote works wherever
    /// it is copied.
    fn rebase(&mut self, dir: &Path) {
        let at = |p: &mut Option<PathBuf>| {
            if let Some(p) = p.as_mut().filter(|p| p.is_relative()) {
                *p = dir.join(&*p);
            }
        };
        at(&mut self.state_dir);
        at(&mut self.cache_dir);
        at(&mut self.fake_gpus_control);
        at(&mut self.fake_gpus_dev);
        at(&mut self.limits_conf);
        at(&mut self.tokens_file);
        if let Some(c) = &mut self.cluster {
            at(&mut c.secret_file);
        }
        if let Some(s) = &mut self.slurm {
            at(&mut s.conf);
        }
        if let Some(t) = &mut self.tls {
            let one = |p: &mut PathBuf| {
                if p.is_relative() {
                    *p = dir.join(&*p);
                }
            };
            one(&mut t.cert);
            one(&mut t.key);
            if let Some(ca) = &mut t.ca {
                one(ca);
            }
        }
    }
}

/// The file's tokens and labd's own user's (created on first start). Each
/// must be long and belong to one user only: jobs run as the user a token
/// names.
fn tokens(
    file: BTreeMap<String, Secret>,
    me: &str,
    local: &LocalLabd,
) -> Result<Vec<(String, Secret)>> {
    let mut tokens: Vec<(String, Secret)> = file.into_iter().collect();
    let own = local.token_file();
    let own_token = load_or_create_token(&own)?;
    check_private(&own, true)?;
    tokens.push((me.to_string(), own_token.into()));
    check_tokens(&tokens).map_err(anyhow::Error::msg)?;
    Ok(tokens)
}

/// The daemon's configuration from the file, the resolved store settings and
/// the state folder; defaults for what the file leaves out.
fn daemon_config(file: LabdFile, settings: Settings, local: &LocalLabd) -> Result<DaemonConfig> {
    let me = current_user();
    let job_limits = job_limits(&file)?;
    let trees_max = match &file.trees_max {
        Some(s) => parse_size(s)?,
        None => settings.cache_max,
    };
    let tokens = tokens(file.tokens, &me, local)?;
    if file.tick_ms == Some(0) {
        bail!("tick_ms = 0: labd would reap and schedule in a busy loop; use e.g. 100");
    }
    let mut admins = file.admins;
    admins.push(me);
    let run_as_submitter = match file.run_as.as_deref() {
        None | Some("submitter") => true,
        Some("labd") => false,
        Some(o) => bail!("run_as = {o:?}: write \"submitter\" or \"labd\""),
    };
    if !run_as_submitter && euid() == 0 && tokens.len() > 1 {
        tracing::warn!("run_as = \"labd\" as root: every token holder's jobs run as root");
    }
    let d = ConnLimits::default();
    Ok(DaemonConfig {
        node_name: node_name(file.node_name)?,
        state_dir: local.state_dir.clone(),
        store: settings.store,
        store_options: settings.store_options,
        cache_dir: settings.cache_dir,
        cache_max: settings.cache_max,
        compression: settings.compression,
        trees_max,
        trees_per_user: match file.trees_per_user {
            Some(s) => Some(parse_size(&s)?).filter(|&n| n > 0),
            None => Some(trees_max / 2),
        },
        foreign_limit: match file.foreign_limit {
            Some(s) => parse_size(&s)?,
            None => 256 << 20,
        },
        inventory_deadline: Duration::from_millis(file.inventory_deadline_ms.unwrap_or(2000)),
        kill_grace: Duration::from_secs(file.kill_grace_s.unwrap_or(10)),
        idle_hold: Duration::from_secs(file.idle_hold_s.unwrap_or(1800).max(1)),
        outputs_every: Duration::from_secs(file.outputs_every_s.unwrap_or(300)),
        outputs_every_min: Duration::from_secs(file.outputs_every_min_s.unwrap_or(60).max(1)),
        outputs_retry: Duration::from_secs(file.outputs_retry_s.unwrap_or(10).clamp(1, 600)),
        work_keep: Duration::from_secs(file.work_keep_s.unwrap_or(86_400)),
        history_keep: Duration::from_secs(
            file.history_keep_days.unwrap_or(90).saturating_mul(86_400),
        ),
        log_max: match file.log_max {
            Some(s) => parse_size(&s)?.max(64 << 10),
            None => 100 << 20,
        },
        run_as_submitter,
        tokens,
        tokens_file: file.tokens_file,
        admins,
        tick: Duration::from_millis(file.tick_ms.unwrap_or(100)),
        conn_limits: ConnLimits {
            max: file.max_connections.unwrap_or(d.max).max(1),
            per_peer: file.max_connections_per_user.unwrap_or(d.per_peer).max(1),
            header_timeout: file
                .header_timeout_ms
                .map_or(d.header_timeout, |ms| Duration::from_millis(ms.max(100))),
        },
        max_queued_per_user: file.max_queued_per_user.unwrap_or(1000),
        max_cpu_jobs_per_user: file.max_cpu_jobs_per_user.map_or_else(
            || {
                let cpus = std::thread::available_parallelism().map_or(1, usize::from);
                (4 * cpus).max(8)
            },
            |n| n.max(1),
        ),
        job_limits,
        // The running binary, even once an upgrade replaced its file.
        log_keeper: Some(PathBuf::from("/proc/self/exe")),
        login_limits: file
            .limits_conf
            .map_or_else(LoginLimits::default, LoginLimits::new),
        cluster: None,
        slurm_check: None,
        slurm_rerank: None,
        web: labsync_agent::WebConfig::default(),
        notify: labsync_agent::NotifyConfig::default(),
    })
}

/// `job_pids_max`, `job_memory_max`, `user_pids_max` and
/// `user_memory_max`, checked: 0 is no limit; a limit no job could start
/// under is refused.
fn job_limits(file: &LabdFile) -> Result<JobLimits> {
    Ok(JobLimits {
        tasks: tasks_max(
            "job_pids_max",
            file.job_pids_max,
            JobLimits::default_tasks(),
        )?,
        memory: memory_max("job_memory_max", file.job_memory_max.as_deref(), None)?,
        user_tasks: tasks_max(
            "user_pids_max",
            file.user_pids_max,
            JobLimits::default_user_tasks(),
        )?,
        user_memory: memory_max(
            "user_memory_max",
            file.user_memory_max.as_deref(),
            JobLimits::default_user_memory(),
        )?,
    })
}

/// A task limit named `key`: `default` when not given, none for 0.
fn tasks_max(key: &str, given: Option<u64>, default: u64) -> Result<Option<u64>> {
    const MIN_TASKS: u64 = 32;
    /// The most `pids.max` takes (the kernel's `PID_MAX_LIMIT`).
    const MAX_TASKS: u64 = 4 << 20;
    match given {
        None => Ok(Some(default)),
        Some(0) => Ok(None),
        Some(n) if n < MIN_TASKS => {
            bail!("{key} = {n}: a job needs more; write at least {MIN_TASKS}, or 0 for no limit")
        }
        Some(n) if n > MAX_TASKS => {
            bail!("{key} = {n}: the kernel takes at most {MAX_TASKS}; write 0 for no limit")
        }
        Some(n) => Ok(Some(n)),
    }
}

/// A memory limit named `key`: `default` when not given, none for "0".
fn memory_max(key: &str, given: Option<&str>, default: Option<u64>) -> Result<Option<u64>> {
    const MIN_MEMORY: u64 = 64 << 20;
    let Some(s) = given else { return Ok(default) };
    match parse_size(s)? {
        0 => Ok(None),
        n if n < MIN_MEMORY => {
            bail!("{key} = {s:?}: a job needs more; write at least \"64M\", or \"0\" for no limit")
        }
        n => Ok(Some(n)),
    }
}

/// This node's name: `node_name`, else the host's name; one that is no
/// node name (it lands in tables, paths and logs, and names the node to
/// the cluster) is refused, saying where to set one.
fn node_name(configured: Option<String>) -> Result<labsync_placer::NodeName> {
    match configured {
        Some(n) => n.parse().map_err(|e| anyhow::anyhow!("node_name: {e}")),
        None => {
            let host = hostname();
            host.parse().map_err(|e| {
                anyhow::anyhow!("this host's name: {e}; set node_name in labd's config")
            })
        }
    }
}

/// The `[cluster]` section, checked: a TCP listener others can reach, a
/// long secret no other user can read;
/// with TLS (`tls`, whom to trust), every address `https://`, without it
/// none.
fn cluster_config(
    c: ClusterFile,
    node_name: &str,
    listen: &Endpoint,
    tls: Option<Arc<ClientConfig>>,
) -> Result<ClusterConfig> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let coordinator: Endpoint = c
        .coordinator
        .parse()
        .map_err(|e: String| anyhow::anyhow!("[cluster] coordinator: {e}"))?;
    match (&coordinator, &tls) {
        (Endpoint::Tcp(_), None) | (Endpoint::Tls(_), Some(_)) => {}
        (Endpoint::Unix(_), _) => bail!(
            "[cluster] coordinator = {:?}: nodes reach it over TCP; write {scheme}://host:port",
            c.coordinator
        ),
        (Endpoint::Tcp(_), Some(_)) => bail!(
            "[cluster] coordinator = {:?}: with [tls] every node speaks TLS; write https://host:port",
            c.coordinator
        ),
        (Endpoint::Tls(_), None) => bail!(
            "[cluster] coordinator = {:?} speaks TLS: set [tls] (cert, key and the lab's ca) on \
             this node too",
            c.coordinator
        ),
    }
    if tls.is_none() && !c.insecure_cleartext {
        bail!(
            "[cluster] without [tls]: nodes would take orders (kill a job, a dispatch refused) \
             from answers anyone on the LAN can forge. Set [tls] (cert, key and the lab's ca on \
             every node), or, on a network only the cluster's nodes reach, \
             insecure_cleartext = true in [cluster]"
        );
    }
    let (Endpoint::Tcp(addr) | Endpoint::Tls(addr)) = listen else {
        bail!(
            "labd listens on {listen}, which other nodes cannot reach: in a cluster set \
             listen = \"0.0.0.0:7420\" (or the address of this node)"
        );
    };
    let advertise = match c.advertise {
        Some(a) => match a.parse::<Endpoint>() {
            Ok(Endpoint::Tcp(hp)) if tls.is_none() => format!("http://{hp}"),
            Ok(Endpoint::Tls(hp)) if tls.is_some() => format!("https://{hp}"),
            _ => bail!(
                "[cluster] advertise = {a:?}: write {scheme}://host:port, how other nodes reach \
                 this one"
            ),
        },
        None => {
            let (host, port) = addr.rsplit_once(':').expect("a TCP endpoint has a port");
            let wildcard = ["0.0.0.0", "[::]", "::", ""].contains(&host);
            format!(
                "{scheme}://{}:{port}",
                if wildcard { node_name } else { host }
            )
        }
    };
    let secret = match (c.secret, c.secret_file) {
        (Some(s), None) => s,
        (None, Some(f)) => {
            check_private(&f, true)?;
            let text = std::fs::read_to_string(&f)
                .with_context(|| format!("cannot read the cluster secret {}", f.display()))?;
            Secret::new(text.trim())
        }
        _ => bail!("[cluster]: set one of secret_file (a file of mode 600) or secret, the same on every node"),
    };
    let key = ClusterKey::new(&secret).map_err(anyhow::Error::msg)?;
    let heartbeat = Duration::from_millis(c.heartbeat_ms.unwrap_or(1000).max(50));
    let down_after = Duration::from_millis(c.down_after_ms.unwrap_or(10_000));
    if down_after < heartbeat * 3 {
        bail!(
            "[cluster] down_after_ms = {} is under three heartbeats ({} ms each): nodes would flap \
             between up and down",
            down_after.as_millis(),
            heartbeat.as_millis()
        );
    }
    Ok(ClusterConfig {
        coordinator,
        coordinate: c.coordinate,
        advertise,
        key,
        heartbeat,
        down_after,
        tls,
        lab: LabConfig::default(),
    })
}

/// `[lab]` of labd's config file: the coordinator's queue rules.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LabFile {
    /// Tier names, highest first (default lead, deadline, phd, master,
    /// undergrad).
    tiers: Option<Vec<String>>,
    /// The tier only grants give (default `deadline` where the ladder has
    /// it; `""`: none).
    deadline_tier: Option<String>,
    /// User → tier; users not named stand at the lowest tier.
    #[serde(default)]
    users: BTreeMap<String, String>,
    /// User → last day (`YYYY-MM-DD`, UTC) of a paper-deadline grant.
    #[serde(default)]
    grants: BTreeMap<String, String>,
    /// GPUs one user may have running at once.
    max_gpus_per_user: Option<u32>,
    /// GPU time used counts half after this many days (default 7).
    fair_share_half_life_days: Option<f64>,
    /// Tier → the time limit (`"2d"`, `"12h"`) of its jobs that give no
    /// `--time`.
    #[serde(default)]
    time_limits: BTreeMap<String, String>,
    /// A waiting job is ordered one tier higher per this many hours it has
    /// waited, up to the tier below the deadline tier (default 24; 0:
    /// tiers never age).
    aging_hours: Option<f64>,
    /// The first job that cannot start holds the GPUs it waits for
    /// (backfill's reservation) once it has waited this many minutes.
    reserve_after_minutes: Option<u64>,
}

/// `[lab]`, checked: every tier named exists, grants are dates.
fn lab_config(l: LabFile) -> Result<LabConfig> {
    let names = l
        .tiers
        .unwrap_or_else(|| Ladder::default().names().to_vec());
    let deadline = match l.deadline_tier.as_deref() {
        Some("") => None,
        Some(d) => Some(d.to_string()),
        None => names
            .iter()
            .any(|n| n == "deadline")
            .then(|| "deadline".to_string()),
    };
    let ladder =
        Ladder::new(names, deadline.as_deref()).map_err(|e| anyhow::anyhow!("[lab] {e}"))?;
    let mut members = Members {
        ladder,
        members: Default::default(),
    };
    for (user, tier) in &l.users {
        let t = members.ladder.tier(tier).ok_or_else(|| {
            anyhow::anyhow!(
                "[lab.users] {user} = {tier:?}: no such tier; the tiers are {}",
                members.ladder.names().join(", ")
            )
        })?;
        if Some(t) == members.ladder.deadline() {
            bail!(
                "[lab.users] {user} = {tier:?}: that tier comes from a grant with an end date; \
                 give {user} their own tier here and a grant in [lab.grants]"
            );
        }
        members.members.insert(
            user.clone(),
            Member {
                tier: t,
                deadline_until: None,
            },
        );
    }
    if !l.grants.is_empty() && members.ladder.deadline().is_none() {
        bail!("[lab.grants] needs a deadline tier (deadline_tier) to grant");
    }
    for (user, day) in &l.grants {
        let until = end_of_day_ms(day).ok_or_else(|| {
            anyhow::anyhow!(
                "[lab.grants] {user} = {day:?}: write the grant's last day as YYYY-MM-DD (UTC)"
            )
        })?;
        members.entry(user).deadline_until = Some(until);
    }
    let half_life = match l.fair_share_half_life_days {
        None => Duration::from_secs(7 * 86_400),
        Some(d) if d.is_finite() && d > 0.0 && d <= 3650.0 => Duration::from_secs_f64(d * 86_400.0),
        Some(d) => bail!("[lab] fair_share_half_life_days = {d}: give a number of days, above 0"),
    };
    if l.max_gpus_per_user == Some(0) {
        bail!("[lab] max_gpus_per_user = 0 would stop every GPU job; leave it out for no cap");
    }
    let mut time_limits = std::collections::HashMap::new();
    for (tier, limit) in &l.time_limits {
        let t = members.ladder.tier(tier).ok_or_else(|| {
            anyhow::anyhow!(
                "[lab.time_limits] {tier}: no such tier; the tiers are {}",
                members.ladder.names().join(", ")
            )
        })?;
        let secs = crate::local::parse_duration(limit)
            .ok()
            .filter(|&s| s > 0 && s <= labsync_agent::MAX_TIME_LIMIT_S)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "[lab.time_limits] {tier} = {limit:?}: give a duration such as \"12h\" or \"2d\", at most 365d"
                )
            })?;
        time_limits.insert(t, secs);
    }
    let aging = match l.aging_hours {
        None => Some(Duration::from_secs(86_400)),
        Some(0.0) => None,
        Some(h) if h.is_finite() && h > 0.0 && h <= 24.0 * 3650.0 => {
            Some(Duration::from_secs_f64(h * 3600.0))
        }
        Some(h) => bail!("[lab] aging_hours = {h}: give a number of hours above 0, or 0 for none"),
    };
    let reserve_after = match l.reserve_after_minutes {
        None => Duration::from_secs(labsync_placer::Policy::default().reserve_after_secs),
        Some(m) if m <= 525_600 => Duration::from_secs(m * 60),
        Some(m) => bail!("[lab] reserve_after_minutes = {m}: at most 525600 (a year)"),
    };
    Ok(LabConfig {
        members,
        user_gpu_cap: l.max_gpus_per_user,
        half_life,
        time_limits,
        aging,
        reserve_after,
    })
}

/// Unix milliseconds of the midnight (UTC) after the day `YYYY-MM-DD`.
pub(crate) fn end_of_day_ms(day: &str) -> Option<u64> {
    let mut it = day.split('-');
    let (y, m, d) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d): (i64, i64, i64) = (y.parse().ok()?, m.parse().ok()?, d.parse().ok()?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&m) || d < 1 || d > days_in[m as usize - 1]
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let (yy, mm) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days + 1) * 86_400_000) as u64)
}

/// Refuses a file others could change (they could give themselves a token,
/// or make jobs run as root) or, when it holds tokens, read.
pub(crate) fn check_private(path: &Path, holds_tokens: bool) -> Result<()> {
    labsync_agent::tokens::check_private(path, holds_tokens).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn cluster(extra: &str) -> ClusterFile {
        toml::from_str(&format!(
            "coordinator = \"http://10.0.0.1:7420\"\ninsecure_cleartext = true\n\
             secret = \"{}\"\n{extra}",
            "s".repeat(40)
        ))
        .unwrap()
    }

    fn tcp(a: &str) -> Endpoint {
        a.parse().unwrap()
    }

    fn lab(text: &str) -> Result<LabConfig> {
        lab_config(toml::from_str(text).unwrap())
    }

    #[test]
    fn the_lab_section_gives_tiers_grants_and_caps() {
        let l = lab(r#"
            max_gpus_per_user = 8
            fair_share_half_life_days = 3
            aging_hours = 12
            [time_limits]
            undergrad = "1d"
            master = "36h"
            [users]
            carol = "lead"
            alice = "phd"
            [grants]
            alice = "2026-12-20"
            dave = "2024-02-29"
        "#)
        .unwrap();
        assert_eq!(l.user_gpu_cap, Some(8));
        assert_eq!(l.half_life, Duration::from_secs(3 * 86_400));
        assert_eq!(l.aging, Some(Duration::from_secs(12 * 3600)));
        let limits: std::collections::BTreeMap<u8, u64> =
            l.time_limits.iter().map(|(t, s)| (t.0, *s)).collect();
        assert_eq!(limits, [(3, 36 * 3600), (4, 86_400)].into());
        assert_eq!(lab("aging_hours = 0").unwrap().aging, None);
        assert_eq!(lab("").unwrap().aging, Some(Duration::from_secs(86_400)));
        let m = &l.members;
        // 2026-12-20 is day 20807 since 1970: the grant runs to its end.
        let end = 20_808 * 86_400_000;
        assert_eq!(m.tier_for("alice", Some("deadline"), end - 1).unwrap().0, 1);
        assert!(m.tier_for("alice", Some("deadline"), end).is_err());
        assert_eq!(m.tier_for("carol", None, 0).unwrap().0, 0);
        // Granted but not listed: the lowest tier of their own.
        assert_eq!(m.tier_for("dave", None, 0).unwrap().0, 4);
        assert_eq!(end_of_day_ms("1970-01-01"), Some(86_400_000));
        assert_eq!(end_of_day_ms("2024-02-29"), Some(19_783 * 86_400_000));
    }

    #[test]
    fn the_web_section_is_read_and_its_mistakes_named() {
        let web = |t: &str| web_config(Some(toml::from_str::<WebFile>(t).unwrap()), false);
        let w = web("access = \"lan\"\nlogs = \"lab\"").unwrap();
        assert_eq!(
            (w.access, w.logs),
            (labsync_agent::Access::Lan, labsync_agent::LogsTo::Lab)
        );
        let w = web_config(None, true).unwrap();
        assert_eq!(w.access, labsync_agent::Access::Token);
        assert!(w.secure_cookie);
        let e = web("access = \"public\"").unwrap_err().to_string();
        assert!(
            e.contains("[web] access = \"public\"") && e.contains("\"lan\""),
            "{e}"
        );
        let e = web("logs = \"all\"").unwrap_err().to_string();
        assert!(e.contains("[web] logs = \"all\""), "{e}");
        assert!(toml::from_str::<WebFile>("acess = \"lan\"").is_err());
    }

    #[test]
    fn lab_mistakes_are_named() {
        let e = |t: &str| format!("{:#}", lab(t).unwrap_err());
        assert!(
            e("[users]\nbob = \"postdoc\"").contains("[lab.users] bob = \"postdoc\": no such tier")
        );
        assert!(e("[users]\nbob = \"deadline\"").contains("comes from a grant with an end date"));
        assert!(e("[grants]\nbob = \"20/12/2026\"")
            .contains("write the grant's last day as YYYY-MM-DD"));
        assert!(e("[grants]\nbob = \"2026-02-30\"").contains("YYYY-MM-DD"));
        assert!(e("tiers = [\"a\", \"a\"]").contains("named twice"));
        assert!(e("max_gpus_per_user = 0").contains("would stop every GPU job"));
        assert!(e("[time_limits]\npostdoc = \"1d\"")
            .contains("[lab.time_limits] postdoc: no such tier"));
        assert!(e("[time_limits]\nphd = \"soon\"").contains("give a duration such as"));
        assert!(e("[time_limits]\nphd = \"0s\"").contains("give a duration such as"));
        assert!(e("aging_hours = -1").contains("[lab] aging_hours = -1"));
        assert!(e("deadline_tier = \"\"\n[grants]\nbob = \"2026-12-20\"")
            .contains("needs a deadline tier"));
    }

    #[test]
    fn a_cluster_node_is_reachable_named_and_keyed() {
        let c = cluster_config(cluster(""), "gpu2", &tcp("0.0.0.0:7420"), None).unwrap();
        assert_eq!(
            c.advertise, "http://gpu2:7420",
            "a wildcard listener advertises the name"
        );
        assert!(!c.coordinate);
        assert_eq!(c.coordinator, tcp("10.0.0.1:7420"));
        assert_eq!(
            (c.heartbeat.as_millis(), c.down_after.as_millis()),
            (1000, 10_000)
        );
        let c = cluster_config(
            cluster("coordinate = true"),
            "gpu2",
            &tcp("10.0.0.2:7420"),
            None,
        )
        .unwrap();
        assert_eq!(c.advertise, "http://10.0.0.2:7420");
        assert!(c.coordinate);
        let c = cluster_config(
            cluster("advertise = \"http://gpu2.lab:7420\""),
            "gpu2",
            &tcp("0.0.0.0:7420"),
            None,
        )
        .unwrap();
        assert_eq!(c.advertise, "http://gpu2.lab:7420");
    }

    #[test]
    fn a_node_name_that_is_none_is_refused_saying_where_to_set_one() {
        let e = node_name(Some("gpu 2".into())).unwrap_err().to_string();
        assert!(
            e.starts_with("node_name: \"gpu 2\" is not a node name"),
            "{e}"
        );
        assert_eq!(node_name(Some("gpu2".into())).unwrap(), "gpu2");
        // The host's name where none is set (this machine's is one).
        assert_eq!(node_name(None).unwrap(), hostname());
    }

    #[test]
    fn cluster_mistakes_are_named() {
        let err = |c: ClusterFile, name: &str, listen: Endpoint| {
            cluster_config(c, name, &listen, None)
                .unwrap_err()
                .to_string()
        };
        let unix = Endpoint::Unix("/run/labd.sock".into());
        assert!(err(cluster(""), "gpu2", unix).contains("other nodes cannot reach"));
        // Issue 40, point 10: in clear only when the config says so.
        let clear: ClusterFile = toml::from_str(&format!(
            "coordinator = \"http://h:1\"\nsecret = \"{}\"",
            "s".repeat(40)
        ))
        .unwrap();
        let e = err(clear, "gpu2", tcp("0.0.0.0:1"));
        assert!(
            e.contains("without [tls]") && e.contains("insecure_cleartext = true"),
            "{e}"
        );
        let short: ClusterFile = toml::from_str(
            "coordinator = \"http://h:1\"\ninsecure_cleartext = true\nsecret = \"short\"",
        )
        .unwrap();
        assert!(err(short, "gpu2", tcp("0.0.0.0:1")).contains("at least 32"));
        let none: ClusterFile =
            toml::from_str("coordinator = \"http://h:1\"\ninsecure_cleartext = true").unwrap();
        assert!(err(none, "gpu2", tcp("0.0.0.0:1")).contains("set one of secret_file"));
        let flapping = cluster("heartbeat_ms = 1000\ndown_after_ms = 2000");
        assert!(err(flapping, "gpu2", tcp("0.0.0.0:1")).contains("under three heartbeats"));
        let unix_coord: ClusterFile = toml::from_str(&format!(
            "coordinator = \"/run/labd.sock\"\ninsecure_cleartext = true\nsecret = \"{}\"",
            "s".repeat(40)
        ))
        .unwrap();
        assert!(err(unix_coord, "gpu2", tcp("0.0.0.0:1")).contains("over TCP"));
        assert!(
            toml::from_str::<ClusterFile>("coordinator = \"http://h:1\"\nsecert = \"x\"")
                .unwrap_err()
                .to_string()
                .contains("unknown field")
        );
    }

    #[test]
    fn with_tls_every_address_is_https_and_without_it_none() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let made = rcgen::generate_simple_self_signed(vec!["gpu1".to_string()]).unwrap();
        std::fs::write(&ca, made.cert.pem()).unwrap();
        let tls = || Some(labsync_agent::tls::client(Some(&ca)).unwrap());
        let https = |extra: &str| -> ClusterFile {
            toml::from_str(&format!(
                "coordinator = \"https://10.0.0.1:7420\"\nsecret = \"{}\"\n{extra}",
                "s".repeat(40)
            ))
            .unwrap()
        };
        let c = cluster_config(https(""), "gpu2", &tcp("https://0.0.0.0:7420"), tls()).unwrap();
        assert_eq!(c.advertise, "https://gpu2:7420");
        assert_eq!(c.coordinator, tcp("https://10.0.0.1:7420"));
        assert!(c.tls.is_some());
        let err = |c: ClusterFile, tls| {
            cluster_config(c, "gpu2", &tcp("https://0.0.0.0:7420"), tls)
                .unwrap_err()
                .to_string()
        };
        assert!(err(cluster(""), tls()).contains("with [tls] every node speaks TLS"));
        assert!(err(https(""), None).contains("set [tls]"));
        let plain_advertise = https("advertise = \"http://gpu2.lab:7420\"");
        assert!(err(plain_advertise, tls()).contains("write https://host:port"));
    }

    #[test]
    fn tls_mistakes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["gpu1".to_string()]).unwrap();
        let (cert, key) = (dir.path().join("gpu1.pem"), dir.path().join("gpu1.key"));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let file = |listen: &str| {
            let config = dir.path().join("labd.toml");
            std::fs::write(
                &config,
                format!(
                    "listen = \"{listen}\"\nstate_dir = \"{}\"\n[tls]\ncert = \"{}\"\nkey = \"{}\"\n",
                    dir.path().join("state").display(),
                    cert.display(),
                    key.display()
                ),
            )
            .unwrap();
            let flags = LabdFlags {
                config: Some(config),
                fake_gpus: Some("1x1GiB".into()),
                ..Default::default()
            };
            resolve(&flags).map(|s| (s.listen, s.tls.is_some()))
        };
        let e = file("127.0.0.1:7420").unwrap_err();
        assert!(
            format!("{e:#}").contains("readable by other users"),
            "{e:#}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let (listen, tls) = file("127.0.0.1:7420").unwrap();
        assert_eq!((listen, tls), (tcp("https://127.0.0.1:7420"), true));
        let e = file(&dir.path().join("labd.sock").display().to_string()).unwrap_err();
        assert!(e.to_string().contains("TLS is for a TCP listener"), "{e}");
        // A certificate others may change is refused.
        std::fs::set_permissions(&cert, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = file("127.0.0.1:7420").unwrap_err();
        assert!(format!("{e:#}").contains("[tls] cert"), "{e:#}");
        std::fs::set_permissions(&cert, std::fs::Permissions::from_mode(0o644)).unwrap();
        // In a cluster the lab's CA is required.
        let config = dir.path().join("cluster.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:7420\"\nnode_name = \"gpu1\"\nstate_dir = \"{}\"\n\
                 [tls]\ncert = \"{}\"\nkey = \"{}\"\n[cluster]\ncoordinator = \"https://gpu1:7420\"\n\
                 secret = \"{}\"\n",
                dir.path().join("state").display(),
                cert.display(),
                key.display(),
                "s".repeat(40)
            ),
        )
        .unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
        let flags = LabdFlags {
            config: Some(config),
            fake_gpus: Some("1x1GiB".into()),
            ..Default::default()
        };
        let e = resolve(&flags).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("[tls] ca is not set"), "{e}");
    }

    #[test]
    fn a_secret_file_others_can_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cluster.secret");
        std::fs::write(&f, "x".repeat(40)).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let c: ClusterFile = toml::from_str(&format!(
            "coordinator = \"http://h:1\"\ninsecure_cleartext = true\nsecret_file = \"{}\"",
            f.display()
        ))
        .unwrap();
        let e = cluster_config(c, "gpu2", &tcp("0.0.0.0:1"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("readable by other users"), "{e}");
    }
}
