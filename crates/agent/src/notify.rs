//! Telling a job's user that it ended, failed, was preempted or that an
//! idle hold was given back: a webhook (Slack, Mattermost and Discord all
//! take a JSON body with `text` or `content`; both are sent) or mail
//! through the system's sendmail. Sent by the coordinator (a labd alone:
//! by itself), from a loop of its own that watches the jobs, so a slow or
//! dead receiver never holds the queue; each message is tried three times
//! (at once, after 2 s, after 10 s), and how it went is shown on the job's
//! web page.
//!
//! A webhook's address is the user's to choose, and labd sends from
//! inside the lab's network: it goes only to the hosts `[notify] hosts`
//! names (Slack's and Discord's by default), never to labd's own API or a
//! service on the LAN an admin did not name. Its path is a secret (anyone
//! with it may post to the channel): neither shown nor logged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;

use crate::error::JobError;
use crate::leases::JobState;
use crate::proto::JobView;

/// `[notify]` of labd's config.
#[derive(Clone, Debug)]
pub struct NotifyConfig {
    /// Where to tell users who name nowhere (webhooks or `mailto:`): the
    /// lab's channel, say. Empty: they are not told.
    pub default: Vec<String>,
    /// Hosts a webhook may go to.
    pub hosts: Vec<String>,
    /// The sendmail program `mailto:` targets go through.
    pub sendmail: PathBuf,
}

impl Default for NotifyConfig {
    fn default() -> Self {
        NotifyConfig {
            default: Vec::new(),
            hosts: DEFAULT_HOSTS.iter().map(|h| h.to_string()).collect(),
            sendmail: PathBuf::from("/usr/sbin/sendmail"),
        }
    }
}

/// Where webhooks may go unless the config says otherwise.
pub const DEFAULT_HOSTS: [&str; 3] = ["hooks.slack.com", "discord.com", "discordapp.com"];

/// At most this many targets per job.
pub const MAX_TARGETS: usize = 4;

/// The longest target taken, bytes (Slack's webhook URLs are ~80).
pub const MAX_TARGET_BYTES: usize = 2048;

/// Where to tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// POST the message as JSON.
    Webhook {
        /// TLS.
        https: bool,
        /// The host, as named.
        host: String,
        /// Its port.
        port: u16,
        /// Path and query (the secret part).
        path: String,
    },
    /// Mail through sendmail.
    Mail(String),
}

impl Target {
    /// Parses `s` (`https://host/path` or `mailto:user@host`) and checks a
    /// webhook's host against `hosts`.
    pub fn parse(s: &str, hosts: &[String]) -> Result<Target, String> {
        if s.len() > MAX_TARGET_BYTES {
            return Err(format!(
                "notify: a target of {} bytes; at most {MAX_TARGET_BYTES}",
                s.len()
            ));
        }
        if let Some(addr) = s.strip_prefix("mailto:") {
            // sendmail takes it as an argument: no option, no header
            // breaker, nothing but an address.
            let ok = addr.split_once('@').is_some_and(|(u, h)| {
                !u.is_empty()
                    && !h.is_empty()
                    && !addr.starts_with('-')
                    && addr
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._%+-@".contains(&b))
            }) && addr.len() <= 254;
            return if ok {
                Ok(Target::Mail(addr.to_string()))
            } else {
                Err(format!("notify {s:?}: not a mail address labsync sends to"))
            };
        }
        let (https, rest) = match (s.strip_prefix("https://"), s.strip_prefix("http://")) {
            (Some(r), _) => (true, r),
            (None, Some(r)) => (false, r),
            _ => {
                return Err(format!(
                    "notify {s:?}: say https://… (a Slack, Mattermost or Discord webhook) or mailto:you@lab"
                ))
            }
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.contains('@') || s.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            return Err(format!(
                "notify {s:?}: no user part, spaces or control characters"
            ));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("notify {s:?}: port {p:?}"))?,
            ),
            None => (authority, if https { 443 } else { 80 }),
        };
        let host = host.to_ascii_lowercase();
        if host.is_empty() {
            return Err(format!("notify {s:?}: no host"));
        }
        if !hosts.iter().any(|h| h.eq_ignore_ascii_case(&host)) {
            return Err(format!(
                "notify: webhooks go only to the hosts labd's [notify] hosts names ({}); ask an \
                 admin to add {host}",
                hosts.join(", ")
            ));
        }
        Ok(Target::Webhook {
            https,
            host,
            port,
            path: path.to_string(),
        })
    }

    /// What may be shown of it: a webhook's scheme and host (its path is
    /// the secret), a mail address.
    pub fn shown(&self) -> String {
        match self {
            Target::Webhook { https, host, .. } => {
                format!("{}://{host}/…", if *https { "https" } else { "http" })
            }
            Target::Mail(a) => format!("mailto:{a}"),
        }
    }
}

/// Whether `target` is one labd sends to with these `hosts` (the config's
/// check of its default targets).
pub fn target_ok(target: &str, hosts: &[String]) -> Result<(), String> {
    Target::parse(target, hosts).map(drop)
}

/// Checks a submission's targets against the config (the submit's refusal).
pub fn check(targets: &[String], cfg: &NotifyConfig) -> Result<(), JobError> {
    if targets.len() > MAX_TARGETS {
        return Err(JobError::Invalid(format!(
            "notify: at most {MAX_TARGETS} places to tell per job"
        )));
    }
    for t in targets {
        Target::parse(t, &cfg.hosts).map_err(JobError::Invalid)?;
    }
    Ok(())
}

/// What happened to a job that its user is told of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Exited 0.
    Ended,
    /// Exited otherwise, killed, or lost.
    Failed,
    /// Stopped for a higher tier's job (and requeued).
    Preempted,
    /// A hold given back early: its GPUs showed no use.
    HoldGivenBack,
}

impl Event {
    /// The event an ended `job` is, `None` while it runs.
    pub fn of(job: &JobView) -> Option<Event> {
        if !job.ended() {
            return None;
        }
        Some(if job.meta.stopped_for.is_some() {
            Event::Preempted
        } else if job.meta.released.is_some() {
            Event::HoldGivenBack
        } else if matches!(job.state, JobState::Exited { code: Some(0), .. }) {
            Event::Ended
        } else {
            Event::Failed
        })
    }

    fn word(self) -> &'static str {
        match self {
            Event::Ended => "ended",
            Event::Failed => "failed",
            Event::Preempted => "was preempted",
            Event::HoldGivenBack => "hold given back",
        }
    }
}

/// The message for `job`'s `event`, one line.
pub fn message(job: &JobView, event: Event) -> String {
    let mut m = format!("labsync: {} ({}) {}", job.id, job.user, event.word());
    let how = match &job.state {
        JobState::Exited { code: Some(c), .. } => format!("exit {c}"),
        JobState::Exited {
            signal: Some(s), ..
        } => format!("killed by signal {s}"),
        JobState::Failed { reason } => reason.clone(),
        _ => String::new(),
    };
    if !how.is_empty() {
        m += &format!(": {how}");
    }
    if let (Some(a), Some(b)) = (job.started_at, job.ended_at) {
        m += &format!(" after {}", crate::web::span(b.saturating_sub(a)));
    }
    if let Some(n) = &job.node {
        m += &format!(" on {n}");
    }
    for extra in [&job.meta.stopped_for, &job.meta.released, &job.why]
        .into_iter()
        .flatten()
    {
        m += &format!("; {extra}");
    }
    if let Some(o) = &job.meta.outputs_saved {
        m += &format!("; outputs {o}");
    }
    let cmd = job.argv.join(" ");
    let cmd: String = cmd.chars().take(200).collect();
    if !cmd.is_empty() {
        m += &format!(" — {cmd}");
    }
    // One line, no control character: it becomes a mail's subject too.
    m.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Deliveries, and what became of them.
pub struct Notifier {
    cfg: NotifyConfig,
    /// Targets of jobs a labd alone took (a cluster's are in its queue's
    /// records): kept in memory, so a restart forgets them.
    targets: Mutex<HashMap<String, Vec<String>>>,
    /// Per job, what became of each message (newest [`REPORTS`] jobs).
    reports: Mutex<BTreeMap<u64, (String, Vec<String>)>>,
}

/// How many jobs' delivery reports are kept.
const REPORTS: usize = 1000;
/// Waits before the second and third tries.
const RETRY: [Duration; 2] = [Duration::from_secs(2), Duration::from_secs(10)];

impl Notifier {
    /// A notifier with `cfg`.
    pub fn new(cfg: NotifyConfig) -> Notifier {
        Notifier {
            cfg,
            targets: Mutex::new(HashMap::new()),
            reports: Mutex::new(BTreeMap::new()),
        }
    }

    /// The config.
    pub fn config(&self) -> &NotifyConfig {
        &self.cfg
    }

    /// Remembers where to tell of `job` (a labd alone).
    pub fn remember(&self, job: &str, targets: Vec<String>) {
        let mut t = self.targets.lock().expect("notifier poisoned");
        if t.len() > 100_000 {
            t.clear();
        }
        t.insert(job.to_string(), targets);
    }

    fn remembered(&self, job: &str) -> Vec<String> {
        (self.targets.lock().expect("notifier poisoned"))
            .remove(job)
            .unwrap_or_default()
    }

    /// What became of `job`'s messages, one line per target.
    pub fn report(&self, job: &str) -> Vec<String> {
        let n = crate::node::job_number(job).unwrap_or(u64::MAX);
        (self.reports.lock().expect("notifier poisoned"))
            .get(&n)
            .filter(|(id, _)| id == job)
            .map(|(_, r)| r.clone())
            .unwrap_or_default()
    }

    fn said(&self, job: &str, line: String) {
        let n = crate::node::job_number(job).unwrap_or(u64::MAX);
        let mut r = self.reports.lock().expect("notifier poisoned");
        r.entry(n)
            .or_insert_with(|| (job.to_string(), Vec::new()))
            .1
            .push(line);
        while r.len() > REPORTS {
            r.pop_first();
        }
    }

    /// Tells `targets` of `job`'s `event`, each in a task of its own.
    pub fn send(self: &Arc<Self>, job: &JobView, event: Event, targets: Vec<String>) {
        let text = message(job, event);
        let subject = format!("labsync: {} {}", job.id, event.word());
        for t in targets {
            let target = match Target::parse(&t, &self.cfg.hosts) {
                Ok(t) => t,
                Err(e) => {
                    self.said(job.id.as_str(), e);
                    continue;
                }
            };
            let (me, id, text, subject) = (
                self.clone(),
                job.id.to_string(),
                text.clone(),
                subject.clone(),
            );
            tokio::spawn(async move {
                let mut tries = 0;
                let outcome = loop {
                    tries += 1;
                    let r = deliver(&me.cfg, &target, &subject, &text).await;
                    match r {
                        Ok(()) => break Ok(()),
                        Err(e) if tries > RETRY.len() => break Err(e),
                        Err(_) => tokio::time::sleep(RETRY[tries - 1]).await,
                    }
                };
                let tried = if tries == 1 {
                    String::new()
                } else {
                    format!(" ({tries} tries)")
                };
                let line = match outcome {
                    Ok(()) => format!("told {}{tried}", target.shown()),
                    Err(e) => {
                        tracing::warn!("could not tell {} of {id}: {e}", target.shown());
                        format!("could not tell {}: {e}{tried}", target.shown())
                    }
                };
                me.said(&id, line);
            });
        }
    }
}

/// One try at telling `target`.
async fn deliver(
    cfg: &NotifyConfig,
    target: &Target,
    subject: &str,
    text: &str,
) -> Result<(), String> {
    match target {
        Target::Mail(addr) => mail(&cfg.sendmail, addr, subject, text).await,
        Target::Webhook {
            https,
            host,
            port,
            path,
        } => {
            let body = serde_json::json!({ "text": text, "content": text }).to_string();
            let req = hyper::Request::post(path.as_str())
                .header(hyper::header::HOST, host.as_str())
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .header(
                    hyper::header::USER_AGENT,
                    concat!("labsync/", env!("CARGO_PKG_VERSION")),
                )
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let addr = format!("{host}:{port}");
            let go = async {
                let tcp = tokio::net::TcpStream::connect(&addr)
                    .await
                    .map_err(|e| format!("cannot connect: {e}"))?;
                let status = if *https {
                    let config = crate::tls::system_client().map_err(|e| e.to_string())?;
                    let name = crate::tls::server_name(&addr).map_err(|e| e.to_string())?;
                    let tls = tokio_rustls::TlsConnector::from(config)
                        .connect(name, tcp)
                        .await
                        .map_err(|e| format!("TLS: {e}"))?;
                    post(tls, req).await?
                } else {
                    post(tcp, req).await?
                };
                if status.is_success() {
                    Ok(())
                } else {
                    Err(format!("answered {status}"))
                }
            };
            tokio::time::timeout(Duration::from_secs(20), go)
                .await
                .map_err(|_| "no answer within 20 s".to_string())?
        }
    }
}

async fn post<S>(stream: S, req: hyper::Request<Full<Bytes>>) -> Result<hyper::StatusCode, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.status())
}

/// Mails `text` to `addr` through `sendmail -i -- addr`.
async fn mail(
    sendmail: &std::path::Path,
    addr: &str,
    subject: &str,
    text: &str,
) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(sendmail)
        .args(["-i", "--", addr])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", sendmail.display()))?;
    let letter = format!(
        "To: {addr}\nSubject: {subject}\nContent-Type: text/plain; charset=utf-8\n\n{text}\n"
    );
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(letter.as_bytes())
            .await
            .map_err(|e| format!("{}: {e}", sendmail.display()))?;
    }
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .map_err(|_| format!("{} took over 30 s", sendmail.display()))?
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        let why = String::from_utf8_lossy(&out.stderr);
        Err(format!(
            "{} failed ({}): {}",
            sendmail.display(),
            out.status,
            why.trim()
        ))
    }
}

/// Watches the jobs every second until `stop`, telling each ended job's
/// user once. Jobs that ended before labd started are not told again.
pub(crate) async fn run(
    daemon: Arc<crate::daemon::Daemon>,
    notifier: Arc<Notifier>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut told: HashSet<String> = HashSet::new();
    let mut first = true;
    loop {
        let jobs = match daemon.coordinator() {
            Some(co) => co.jobs_view(),
            None => daemon.jobs().await,
        };
        if let Ok(jobs) = jobs {
            let live: HashSet<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
            told.retain(|id| live.contains(id.as_str()));
            for j in &jobs {
                let Some(event) = Event::of(j) else { continue };
                if !told.insert(j.id.to_string()) || first {
                    continue;
                }
                let mut targets = match daemon.coordinator() {
                    Some(co) => co.notify_targets(j.id.as_str()),
                    None => notifier.remembered(j.id.as_str()),
                };
                if targets.is_empty() {
                    targets = notifier.cfg.default.clone();
                }
                if !targets.is_empty() {
                    notifier.send(j, event, targets);
                }
            }
            first = false;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> Vec<String> {
        vec!["hooks.slack.com".into(), "127.0.0.1".into()]
    }

    #[test]
    fn targets_go_only_where_the_lab_allows() {
        let t = Target::parse("https://hooks.slack.com/services/T0/B0/secret", &hosts()).unwrap();
        assert_eq!(t.shown(), "https://hooks.slack.com/…");
        assert!(!t.shown().contains("secret"));
        let t = Target::parse("http://127.0.0.1:8080/hook", &hosts()).unwrap();
        assert_eq!(
            t,
            Target::Webhook {
                https: false,
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/hook".into()
            }
        );
        for bad in [
            "https://169.254.169.254/latest/meta-data",
            "http://localhost:7420/v1/jobs",
            "https://hooks.slack.com@evil.example/x",
            "ftp://hooks.slack.com/x",
            "https://hooks.slack.com/a b",
            "mailto:-oQ/tmp/x@lab",
            "mailto:a@b\nBcc: all@lab",
            "mailto:nobody",
            "https://hooks.slack.com:99999/x",
        ] {
            assert!(Target::parse(bad, &hosts()).is_err(), "{bad}");
        }
        assert_eq!(
            Target::parse("mailto:alice@lab.example", &hosts()).unwrap(),
            Target::Mail("alice@lab.example".into())
        );
        let long = format!("https://hooks.slack.com/{}", "x".repeat(MAX_TARGET_BYTES));
        let e = Target::parse(&long, &hosts()).unwrap_err();
        assert!(e.contains("at most 2048"), "{e}");
        let many = vec!["mailto:a@lab".to_string(); MAX_TARGETS + 1];
        assert!(check(&many, &NotifyConfig::default()).is_err());
        let e = Target::parse("https://chat.lab/hooks/x", &hosts()).unwrap_err();
        assert!(e.contains("ask an admin to add chat.lab"), "{e}");
    }

    #[test]
    fn the_event_and_message_say_what_happened_on_one_line() {
        let mut j = JobView {
            id: crate::ids::JobId::numbered(7),
            node: Some("gpu2".parse().unwrap()),
            user: "alice".into(),
            argv: vec!["python".into(), "train.py\n--lr".into()],
            gpus_wanted: 1,
            gpus: vec![],
            state: JobState::Running {
                sid: 1,
                start: None,
            },
            why: None,
            submitted_at: 0,
            started_at: Some(100),
            ended_at: None,
            meta: Default::default(),
        };
        assert_eq!(Event::of(&j), None);
        j.state = JobState::Exited {
            code: Some(0),
            signal: None,
        };
        j.ended_at = Some(3700);
        assert_eq!(Event::of(&j), Some(Event::Ended));
        let m = message(&j, Event::Ended);
        assert_eq!(
            m,
            "labsync: j7 (alice) ended: exit 0 after 1 h 00 min on gpu2 — python train.py --lr"
        );
        j.state = JobState::Exited {
            code: None,
            signal: Some(9),
        };
        assert_eq!(Event::of(&j), Some(Event::Failed));
        j.meta.stopped_for = Some("stopped for j9 (deadline)".into());
        assert_eq!(Event::of(&j), Some(Event::Preempted));
        j.meta.stopped_for = None;
        j.meta.released = Some("idle 30 min".into());
        assert_eq!(Event::of(&j), Some(Event::HoldGivenBack));
        assert!(message(&j, Event::HoldGivenBack).contains("hold given back: killed by signal 9"));
    }
}
