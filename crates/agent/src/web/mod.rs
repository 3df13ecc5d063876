//! labd's web page, the lab's spreadsheet replaced where the lab looks:
//! the grid of every GPU, the queue and why each job waits, what each node
//! has cached, a page per job and per user; and `/metrics` for Prometheus.
//!
//! Read-only: no route here changes anything but the viewer's own login
//! cookie. Pages are rendered by labd (no framework, no build step, no
//! asset from elsewhere: `app.js` and `style.css` are in the binary), and
//! work without JavaScript (they refresh themselves every 5 s); with it,
//! `app.js` fetches the page's live part every second and swaps it in, so
//! a change shows within two seconds. Every value a user chose (a command,
//! a dataset's label, a user or node name) is escaped ([`html`]), and the
//! pages forbid inline scripts (Content-Security-Policy), so a job named
//! `<script>` is text.
//!
//! Access ([`Access`]): behind the users' tokens by default, a login that
//! sets an HttpOnly, SameSite=Strict cookie holding the token (read again
//! on every request, so a token taken away from the tokens file logs its
//! browser out); `lan` opens the read-only pages (and `/metrics`) to
//! anyone who reaches labd; `off` serves none. A job's log is shown to
//! its user and admins only, unless `logs = "lab"`.

mod html;
pub(crate) use html::span;
mod prom;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;

use crate::cluster::{Standing, Standings};
use crate::daemon::Daemon;
use crate::error::JobError;
use crate::jobs::Jobs;
use crate::proto::{JobView, NodeHealth, NodeStatus, Presence, Refused};
use crate::request::Caller;

/// Who may see the web page and `/metrics` (`[web] access`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// Users with a token (a login), the default.
    #[default]
    Token,
    /// Anyone who reaches labd, read-only: the spreadsheet's way.
    Lan,
    /// Not served.
    Off,
}

/// Whose job logs a viewer may read on a job's page (`[web] logs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogsTo {
    /// The job's user and admins, the default.
    #[default]
    Owner,
    /// Everyone who may see the page.
    Lab,
}

/// The `[web]` section.
#[derive(Clone, Debug, Default)]
pub struct WebConfig {
    /// Who may look.
    pub access: Access,
    /// Whose logs they may read.
    pub logs: LogsTo,
    /// labd listens with TLS: the login cookie is `Secure`.
    pub secure_cookie: bool,
}

/// The cookie a login sets.
const COOKIE: &str = "labsync_web";
/// How old a board may be when a page asks for it: twenty open pages
/// polling every second cost one build per this, not twenty.
const BOARD_FRESH: Duration = Duration::from_millis(500);
/// Bytes of a job's log its page shows.
const LOG_TAIL_BYTES: u64 = 16 * 1024;

/// What every page is drawn from: the cluster (or this node) as the
/// coordinator sees it now.
pub(crate) struct Board {
    /// A cluster's coordinator (else one labd alone).
    pub cluster: bool,
    /// The node serving the page.
    pub served_by: String,
    /// labsync's version there.
    pub version: String,
    /// Every node.
    pub nodes: Vec<NodeStatus>,
    /// Jobs live or ended in the last day, oldest first.
    pub jobs: Vec<JobView>,
    /// Tiers, job tiers, users' standing (a cluster's).
    pub standings: Standings,
    /// Nodes the coordinator refuses.
    pub refused: Vec<Refused>,
    /// When it was read, Unix seconds.
    pub now: u64,
}

impl Board {
    /// The job `id`, if live or recent.
    pub fn job(&self, id: &str) -> Option<&JobView> {
        self.jobs.iter().find(|j| j.id.as_str() == id)
    }

    /// `user`'s standing, if the lab knows them.
    pub fn standing(&self, user: &str) -> Option<&Standing> {
        self.standings.users.iter().find(|s| s.user == user)
    }
}

/// The web routes' state.
struct Web {
    daemon: Arc<Daemon>,
    jobs: Arc<Jobs>,
    cfg: WebConfig,
    /// The last board, and when it was built.
    board: tokio::sync::Mutex<Option<(Instant, Arc<Board>)>>,
    /// Live parts the same for every viewer, by page: the board each was
    /// rendered from, the HTML, its ETag.
    rendered: std::sync::Mutex<std::collections::HashMap<String, Rendered>>,
}

type Rendered = (Arc<Board>, Arc<String>, String);

type W = State<Arc<Web>>;

/// The web page's routes and `/metrics`, over `daemon`'s `jobs`.
pub(crate) fn router(daemon: Arc<Daemon>, jobs: Arc<Jobs>) -> Router {
    let cfg = daemon.web_config().clone();
    let web = Arc::new(Web {
        daemon,
        jobs,
        cfg,
        board: tokio::sync::Mutex::new(None),
        rendered: std::sync::Mutex::new(std::collections::HashMap::new()),
    });
    Router::new()
        .route("/", get(home))
        .route("/queue", get(queue))
        .route("/job/{id}", get(job))
        .route("/user/{name}", get(user))
        .route("/login", get(login_form).post(login))
        .route("/logout", post(logout))
        .route("/ui/app.js", get(app_js))
        .route("/ui/style.css", get(style_css))
        .route("/metrics", get(metrics))
        .with_state(web)
}

/// `?live`: only the part of the page that changes (what `app.js` asks
/// for every second).
#[derive(Deserialize)]
struct LiveQuery {
    live: Option<String>,
}

impl Web {
    /// The viewer: a token in `Authorization: Bearer` (Prometheus, curl)
    /// or the login cookie; checked as every API request is.
    fn viewer(&self, h: &HeaderMap) -> Option<Caller> {
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let token = match bearer {
            Some(t) => t.to_string(),
            None => unhex(&cookie(h, COOKIE)?)?,
        };
        self.daemon.authenticate(token.trim())
    }

    /// The viewer, or why they may not look: the page is off, or (with
    /// tokens) they have not logged in.
    fn gate(&self, h: &HeaderMap, page: bool) -> Result<Option<Caller>, Refusal> {
        match self.cfg.access {
            Access::Off => Err(Refusal::Off),
            Access::Lan => Ok(self.viewer(h)),
            Access::Token => match self.viewer(h) {
                Some(c) => Ok(Some(c)),
                None if page => Err(Refusal::Login),
                None => Err(Refusal::Unauthorized),
            },
        }
    }

    /// The board, built again when older than [`BOARD_FRESH`]; pages
    /// asking meanwhile wait for the one build.
    async fn board(&self) -> Result<Arc<Board>, JobError> {
        let mut slot = self.board.lock().await;
        if let Some((at, b)) = slot.as_ref() {
            if at.elapsed() < BOARD_FRESH {
                return Ok(b.clone());
            }
        }
        let b = Arc::new(build(&self.daemon).await?);
        *slot = Some((Instant::now(), b.clone()));
        Ok(b)
    }

    /// A whole page, or its live part alone (`live`).
    fn page(&self, title: &str, viewer: Option<&Caller>, live: bool, body: String) -> Response {
        let text = if live {
            body
        } else {
            html::page(
                title,
                viewer.map(|c| c.user.as_str()),
                self.cfg.access,
                &body,
            )
        };
        html_response(StatusCode::OK, text)
    }
}

/// Why a viewer may not look.
enum Refusal {
    /// The page is off: 404.
    Off,
    /// A page, with tokens and no login: to the login page.
    Login,
    /// `app.js`'s fetch or `/metrics`, with tokens and none given: 401.
    Unauthorized,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Off => (
                StatusCode::NOT_FOUND,
                "this labd serves no web page ([web] access = \"off\")\n",
            )
                .into_response(),
            Refusal::Login => (
                StatusCode::SEE_OTHER,
                [(header::LOCATION, "/login")],
                "log in at /login\n",
            )
                .into_response(),
            Refusal::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "log in first: a user's token (Authorization: Bearer, or the login cookie)\n",
            )
                .into_response(),
        }
    }
}

/// `s` in lowercase hex.
fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// What [`hex`] wrote; `None` for anything else.
fn unhex(h: &str) -> Option<String> {
    if !h.len().is_multiple_of(2) || h.len() > 4096 {
        return None;
    }
    let bytes = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie(h: &HeaderMap, name: &str) -> Option<String> {
    h.get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// A page with the headers every page gets: no script but labd's own
/// file, no framing, no caching, no referrer.
fn html_response(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn failed(e: JobError) -> Response {
    let status = crate::api::job_status(&e);
    html_response(status, html::error_page(&e.to_string()))
}

async fn home(State(w): W, h: HeaderMap, Query(q): Query<LiveQuery>) -> Response {
    w.shared_page(&h, q.live.is_some(), "the lab", "/", |b| {
        html::board(b, false)
    })
    .await
}

/// Every waiting job (the home page lists the first [`html::QUEUE_SHOWN`]).
async fn queue(State(w): W, h: HeaderMap, Query(q): Query<LiveQuery>) -> Response {
    w.shared_page(&h, q.live.is_some(), "the queue", "/queue", |b| {
        html::board(b, true)
    })
    .await
}

impl Web {
    /// A page whose live part is the same for every viewer (the home
    /// page, the queue, a user's page): rendered once per board, however
    /// many pages poll it, and answered 304 to a poller that has it
    /// (`If-None-Match`), so twenty open pages cost one render and a few
    /// bytes each per second.
    async fn shared_page(
        &self,
        h: &HeaderMap,
        live: bool,
        title: &str,
        key: &str,
        render: impl FnOnce(&Board) -> String,
    ) -> Response {
        let viewer = match self.gate(h, !live) {
            Ok(v) => v,
            Err(r) => return r.into_response(),
        };
        let b = match self.board().await {
            Ok(b) => b,
            Err(e) => return failed(e),
        };
        let (body, tag) = {
            let mut cache = self.rendered.lock().expect("web poisoned");
            match cache.get(key) {
                Some((of, body, tag)) if Arc::ptr_eq(of, &b) => (body.clone(), tag.clone()),
                _ => {
                    let body = Arc::new(render(&b));
                    let tag = etag(&body);
                    if cache.len() > 256 {
                        cache.clear();
                    }
                    cache.insert(key.to_string(), (b.clone(), body.clone(), tag.clone()));
                    (body, tag)
                }
            }
        };
        if !live {
            return self.page(title, viewer.as_ref(), false, (*body).clone());
        }
        let fresh = h
            .get(header::IF_NONE_MATCH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == tag);
        let mut r = if fresh {
            html_response(StatusCode::NOT_MODIFIED, String::new())
        } else {
            html_response(StatusCode::OK, (*body).clone())
        };
        if let Ok(v) = HeaderValue::from_str(&tag) {
            r.headers_mut().insert(header::ETAG, v);
        }
        r
    }
}

/// A strong validator of a page's live part.
fn etag(body: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    body.hash(&mut h);
    format!("\"{:016x}-{}\"", h.finish(), body.len())
}

async fn job(
    State(w): W,
    h: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<LiveQuery>,
) -> Response {
    let viewer = match w.gate(&h, q.live.is_none()) {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let b = match w.board().await {
        Ok(b) => b,
        Err(e) => return failed(e),
    };
    // Live or recent from the board; older from the history.
    let view = match b.job(&id) {
        Some(j) => j.clone(),
        None => match w.jobs.job(&id).await {
            Ok(j) => j,
            Err(e) => return failed(e),
        },
    };
    let log = w.log_tail(viewer.as_ref(), &view).await;
    let tier = b.standings.job_tiers.get(view.id.as_str()).cloned();
    let told = w.daemon.notifier().report(view.id.as_str());
    let body = html::job(&b, &view, tier.as_deref(), &log, &told);
    w.page(view.id.as_str(), viewer.as_ref(), q.live.is_some(), body)
}

/// What a job's page shows of its log.
pub(crate) enum LogTail {
    /// Its last bytes (lossy UTF-8).
    Text(String),
    /// Not for this viewer: why.
    Hidden(&'static str),
    /// Could not be read: why.
    Failed(String),
}

impl Web {
    /// The last [`LOG_TAIL_BYTES`] of `job`'s log, when `viewer` may read
    /// it: its user, an admin, or anyone with `logs = "lab"`.
    async fn log_tail(&self, viewer: Option<&Caller>, job: &JobView) -> LogTail {
        let reader = match viewer {
            Some(c) if c.admin || c.user == job.user => c.clone(),
            _ if self.cfg.logs == LogsTo::Lab => Caller {
                user: job.user.clone(),
                admin: false,
            },
            Some(_) => return LogTail::Hidden("only its user and admins read a job's log here"),
            None => return LogTail::Hidden("log in to read your jobs' logs"),
        };
        if job.started_at.is_none() {
            return LogTail::Text(String::new());
        }
        let offset = crate::proto::LOG_TAIL + LOG_TAIL_BYTES;
        match self
            .jobs
            .log(&reader, job.id.as_str(), offset, Duration::ZERO)
            .await
        {
            Ok(r) => LogTail::Text(String::from_utf8_lossy(&r.bytes).into_owned()),
            Err(e) => LogTail::Failed(e.to_string()),
        }
    }
}

async fn user(
    State(w): W,
    h: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<LiveQuery>,
) -> Response {
    let key = format!("/user/{name}");
    w.shared_page(&h, q.live.is_some(), &name, &key, |b| html::user(b, &name))
        .await
}

async fn login_form(State(w): W) -> Response {
    if w.cfg.access == Access::Off {
        return (StatusCode::NOT_FOUND, "no web page here\n").into_response();
    }
    html_response(StatusCode::OK, html::login(None))
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

/// Checks the token and sets it as the cookie; a wrong one is told so.
async fn login(
    State(w): W,
    form: Result<axum::Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    if w.cfg.access == Access::Off {
        return (StatusCode::NOT_FOUND, "no web page here\n").into_response();
    }
    let token = form
        .map(|f| f.0.token.trim().to_string())
        .unwrap_or_default();
    if token.is_empty() || w.daemon.authenticate(&token).is_none() {
        return html_response(
            StatusCode::UNAUTHORIZED,
            html::login(Some("that is not a token this labd knows")),
        );
    }
    let secure = if w.cfg.secure_cookie { "; Secure" } else { "" };
    // In hex: a cookie's value may hold no `;`, `,`, space or control
    // character, and an admin's token may.
    let set = format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=2592000{secure}",
        hex(&token)
    );
    let mut r = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
    if let Ok(v) = HeaderValue::from_str(&set) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn logout() -> Response {
    let mut r = (StatusCode::SEE_OTHER, [(header::LOCATION, "/login")]).into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("labsync_web=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    r
}

async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", include_str!("app.js"))
}

async fn style_css() -> Response {
    asset("text/css; charset=utf-8", include_str!("style.css"))
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=300"),
    );
    r
}

async fn metrics(State(w): W, h: HeaderMap) -> Response {
    if let Err(r) = w.gate(&h, false) {
        return r.into_response();
    }
    match w.board().await {
        Ok(b) => {
            let mut r = prom::render(&b).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        Err(e) => (crate::api::job_status(&e), e.to_string()).into_response(),
    }
}

/// The board as this labd sees it now: the cluster's on a coordinator,
/// else this node's.
async fn build(d: &Arc<Daemon>) -> Result<Board, JobError> {
    if let Some(co) = d.coordinator() {
        let now = co.now_ms();
        let status = co.status(now);
        return Ok(Board {
            cluster: true,
            served_by: d.node_name().to_string(),
            version: status.version,
            nodes: status.nodes,
            jobs: co.jobs_view()?,
            standings: co.standings(now),
            refused: status.refused,
            now: now / 1000,
        });
    }
    let gpus = d.gpus().await?;
    let jobs = d.jobs().await?;
    let cache = d.cache().clone();
    let summary = crate::blocking::off_runtime(move || crate::daemon::cache_summary(&cache))
        .await
        .map_err(JobError::Internal)?;
    let now = crate::leases::unix_now();
    let node = NodeStatus {
        name: d.node_name().clone(),
        addr: String::new(),
        health: NodeHealth::Up,
        last_heartbeat: now * 1000,
        gpus,
        jobs: jobs.iter().filter(|j| !j.ended()).cloned().collect(),
        cache_used: summary.used_bytes,
        cache_max: summary.max_bytes,
        fetched: d.fetched(),
        warming: d.warms().snapshot(),
        data: (summary.trees.iter())
            .map(|t| Presence {
                label: t.label.clone(),
                snapshot: t.snapshot,
                present_bytes: t.bytes,
                total_bytes: t.bytes,
                pinned: t.pinned,
                materialised: false,
            })
            .collect(),
        gpu_confinement: d.gpu_confinement().to_string(),
        version: crate::proto::VERSION.into(),
        suspect: Vec::new(),
    };
    Ok(Board {
        cluster: false,
        served_by: d.node_name().to_string(),
        version: crate::proto::VERSION.into(),
        nodes: vec![node],
        jobs,
        standings: Standings::default(),
        refused: Vec::new(),
        now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_of_any_characters_travels_in_the_cookie_and_junk_is_no_token() {
        for t in ["tok-alice-0123456789", "a;b, c=\"d\"\\e ü"] {
            assert_eq!(unhex(&hex(t)).as_deref(), Some(t));
            assert!(hex(t).bytes().all(|b| b.is_ascii_hexdigit()));
        }
        for junk in ["abc", "zz", "ff", "é1"] {
            assert_eq!(unhex(junk), None, "{junk}");
        }
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; labsync_web=6869"),
        );
        assert_eq!(
            cookie(&h, COOKIE).and_then(|c| unhex(&c)).as_deref(),
            Some("hi")
        );
    }
}
