//! labd's HTTP API (axum) on a Unix socket or TCP, and the ticker beside it.
//! The routes are listed in [`crate::proto`].

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use crate::auth::now_ms;
use crate::blocking::off_runtime;
use crate::cluster::Reach;
use crate::daemon::Daemon;
use crate::error::{ApiError, JobError};
use crate::jobs::Jobs;
use crate::lane::{Lane, Place, LANE_HEAD_TIMEOUT, LANE_PLACES};
use crate::proto::routes::*;
use crate::proto::{AnswerOf, RequestOf};
use crate::proto::{ErrorBody, NodeName, DONE, NEXT_OFFSET};
use crate::request::Caller;
use crate::wire;

/// A bound listener: the local default is a Unix socket, a cluster node listens on TCP.
pub enum Listener {
    /// A Unix socket.
    Unix(tokio::net::UnixListener),
    /// TCP.
    Tcp(tokio::net::TcpListener),
    /// TCP, every connection TLS with this configuration (nothing in clear).
    Tls(tokio::net::TcpListener, Arc<crate::tls::ServerConfig>),
}

/// The HTTP status of a refusal: the one place errors meet HTTP.
pub(crate) fn status_of(e: &ApiError) -> StatusCode {
    match e {
        ApiError::Unauthorized | ApiError::NotMember(_) => StatusCode::UNAUTHORIZED,
        ApiError::Job(e) => job_status(e),
    }
}

/// See [`status_of`].
pub(crate) fn job_status(e: &JobError) -> StatusCode {
    match e {
        JobError::NotFound(_) => StatusCode::NOT_FOUND,
        JobError::Forbidden(_) => StatusCode::FORBIDDEN,
        JobError::Invalid(_) => StatusCode::BAD_REQUEST,
        JobError::Conflict(_) => StatusCode::CONFLICT,
        JobError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
        JobError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        JobError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = status_of(&self);
        (
            status,
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response()
    }
}

/// The caller of a request, from `Authorization: Bearer …`. The token is
/// never logged.
fn caller(d: &Daemon, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized)?;
    d.authenticate(token.trim()).ok_or(ApiError::Unauthorized)
}

type D = State<Arc<Daemon>>;

/// The router's state: the daemon, and its jobs (a node's or the
/// cluster's, chosen once in [`router`]).
#[derive(Clone)]
struct App {
    daemon: Arc<Daemon>,
    jobs: Arc<Jobs>,
}

impl axum::extract::FromRef<App> for Arc<Daemon> {
    fn from_ref(app: &App) -> Arc<Daemon> {
        app.daemon.clone()
    }
}

impl axum::extract::FromRef<App> for Arc<Jobs> {
    fn from_ref(app: &App) -> Arc<Jobs> {
        app.jobs.clone()
    }
}

type J = State<Arc<Jobs>>;

/// The caller, as an extractor: checked from the headers, before a
/// handler's body extractor reads a byte of the body (a request without a
/// token cannot make labd hold one).
struct Authed(Caller);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Authed
where
    Arc<Daemon>: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        s: &S,
    ) -> Result<Self, ApiError> {
        let d: Arc<Daemon> = axum::extract::FromRef::from_ref(s);
        caller(&d, &parts.headers).map(Authed)
    }
}

async fn health() -> &'static str {
    "ok"
}

async fn info(State(d): D, h: HeaderMap) -> Result<Json<AnswerOf<GetInfo>>, ApiError> {
    Ok(Json(d.info(&caller(&d, &h)?)))
}

async fn gpus(State(d): D, h: HeaderMap) -> Result<Json<AnswerOf<GetGpus>>, ApiError> {
    caller(&d, &h)?;
    Ok(Json(d.gpus().await?))
}

#[derive(Deserialize)]
struct JobsQuery {
    /// Ended jobs numbered below this (`j<N>`), newest first: one page of history.
    before: Option<u64>,
    /// With `history`: at most this many (default 100, at most 1000).
    limit: Option<usize>,
    /// Ask for history rather than the active and recent jobs.
    #[serde(default)]
    history: bool,
}

async fn jobs(
    State(jobs): J,
    _: Authed,
    Query(q): Query<JobsQuery>,
) -> Result<Json<AnswerOf<ListJobs>>, ApiError> {
    Ok(Json(if q.history || q.before.is_some() {
        jobs.history(q.before, q.limit.unwrap_or(100)).await?
    } else {
        jobs.list().await?
    }))
}

async fn submit(
    State(jobs): J,
    Authed(c): Authed,
    Json(req): Json<RequestOf<SubmitJob>>,
) -> Result<(StatusCode, Json<AnswerOf<SubmitJob>>), ApiError> {
    Ok((StatusCode::CREATED, Json(jobs.submit(&c, req).await?)))
}

async fn job(
    State(jobs): J,
    _: Authed,
    Path(id): Path<String>,
) -> Result<Json<AnswerOf<GetJob>>, ApiError> {
    Ok(Json(jobs.job(&id).await?))
}

/// `labrun explain JOB`.
async fn job_explain(
    State(jobs): J,
    _: Authed,
    Path(id): Path<String>,
) -> Result<Json<AnswerOf<ExplainJob>>, ApiError> {
    Ok(Json(jobs.explain(&id).await?))
}

async fn kill(
    State(jobs): J,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> Result<Json<AnswerOf<KillJob>>, ApiError> {
    Ok(Json(jobs.kill(&c, &id).await?))
}

#[derive(Deserialize)]
struct LogQuery {
    #[serde(default)]
    offset: u64,
    #[serde(default)]
    wait_ms: u64,
}

async fn log(
    State(jobs): J,
    Authed(c): Authed,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Response, ApiError> {
    let wait = Duration::from_millis(q.wait_ms);
    log_response(jobs.log(&c, &id, q.offset, wait).await?)
}

fn log_response(r: crate::request::LogRead) -> Result<Response, ApiError> {
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(NEXT_OFFSET, r.next.to_string())
        .header(DONE, r.done.to_string())
        .body(Body::from(r.bytes))
        .map_err(|e| ApiError::from(JobError::Internal(e.to_string())))
}

/// The coordinator and its reach, or a refusal saying `what` needs it.
fn coordinator<'a>(
    d: &'a Arc<Daemon>,
    what: &str,
) -> Result<(&'a Arc<crate::cluster::Coordinator>, Reach), JobError> {
    let co = d.coordinator().ok_or_else(|| {
        JobError::Conflict(format!(
            "{} does not coordinate a cluster: {what} needs the coordinator",
            d.node_name()
        ))
    })?;
    Ok((co, Reach::new(d.clone())))
}

/// The coordinator's view of every node, for users.
async fn cluster_status(
    State(d): D,
    h: HeaderMap,
) -> Result<Json<AnswerOf<GetClusterStatus>>, ApiError> {
    caller(&d, &h)?;
    let (c, _) = coordinator(&d, "the cluster's status")?;
    Ok(Json(c.status(c.now_ms())))
}

/// The node that signed a request between nodes; a user's token, another
/// secret or an old request is refused (and logged: it is a probe or a
/// misconfigured node).
fn member(
    d: &Daemon,
    method: &Method,
    uri: &Uri,
    h: &HeaderMap,
    body: &[u8],
) -> Result<String, ApiError> {
    member_head(d, method, uri, h)?
        .body(body)
        .map_err(|e| refused(method, uri, e))
}

/// The signature of a request from another node of the cluster, checked
/// from its headers alone, before its body is read.
fn member_head(
    d: &Daemon,
    method: &Method,
    uri: &Uri,
    h: &HeaderMap,
) -> Result<crate::cluster::Signed, ApiError> {
    let cluster = d
        .cluster()
        .ok_or_else(|| ApiError::NotMember(format!("{} is in no cluster", d.node_name())))?;
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    let me = [d.node_name(), crate::cluster::TO_COORDINATOR];
    let me = if cluster.coordinate {
        &me[..]
    } else {
        &me[..1]
    };
    let signed = cluster
        .key
        .verify_head(method.as_str(), path, me, get, now_ms())
        .map_err(|e| refused(method, uri, e))?;
    // A member, by its signature: now whether it speaks this node's protocol.
    let from = get(crate::cluster::NODE).unwrap_or_default();
    let theirs = match h.get(crate::proto::PROTOCOL_HEADER) {
        // Every labd before versions were sent speaks 1.
        None => 1,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    };
    let their_version: String = get(crate::proto::VERSION_HEADER)
        .unwrap_or_else(|| "0.1.0".into())
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+'))
        .take(40)
        .collect();
    if let Err(why) = crate::proto::check_protocol(&from, theirs, &their_version, d.node_name()) {
        if let (Some(co), Ok(node)) = (d.coordinator(), from.parse::<NodeName>()) {
            co.refuse(&node, &why, now_ms().max(0) as u64);
        }
        static SAID: std::sync::Mutex<crate::error::Throttle> =
            std::sync::Mutex::new(crate::error::Throttle::new(REFUSED_EVERY));
        if crate::error::Throttle::say_in(&SAID).is_some() {
            tracing::warn!(
                "refused {method} {}: {why}",
                crate::error::logged(uri.path())
            );
        }
        return Err(ApiError::Job(JobError::Conflict(why)));
    }
    Ok(signed)
}

/// A request without a good cluster signature: said in the log escaped,
/// cut, and at most every [`REFUSED_EVERY`] (anyone who reaches the port
/// can send them by the thousand, with 400 KB paths).
fn refused(method: &Method, uri: &Uri, e: crate::cluster::AuthError) -> ApiError {
    static SAID: std::sync::Mutex<crate::error::Throttle> =
        std::sync::Mutex::new(crate::error::Throttle::new(REFUSED_EVERY));
    if let Some(held) = crate::error::Throttle::say_in(&SAID) {
        let since = match held {
            0 => String::new(),
            n => format!(" ({n} more refused since the last said)"),
        };
        tracing::warn!(
            "refused {method} {}: {}{since}",
            crate::error::logged(uri.path()),
            crate::error::logged(&e.to_string())
        );
    }
    ApiError::NotMember(e.to_string())
}

/// See [`refused`].
const REFUSED_EVERY: Duration = Duration::from_secs(10);

/// A request from another node of the cluster without a body, its
/// signature checked: the signing node.
struct FromMember(String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for FromMember
where
    Arc<Daemon>: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        s: &S,
    ) -> Result<Self, ApiError> {
        let d: Arc<Daemon> = axum::extract::FromRef::from_ref(s);
        member(&d, &parts.method, &parts.uri, &parts.headers, b"").map(FromMember)
    }
}

/// A JSON body from another node of the cluster, bounded and parsed only
/// once its signature is checked; `from` is the signing node.
struct Signed<T> {
    from: String,
    body: T,
}

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Signed<T>
where
    Arc<Daemon>: axum::extract::FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, s: &S) -> Result<Self, ApiError> {
        let d: Arc<Daemon> = axum::extract::FromRef::from_ref(s);
        let d = &d;
        let (parts, body) = req.into_parts();
        // Not a byte of the body before the signature checks out.
        let signed = member_head(d, &parts.method, &parts.uri, &parts.headers)?;
        let bytes = axum::body::to_bytes(body, SIGNED_MAX)
            .await
            .map_err(|e| JobError::Invalid(format!("{}: {e}", parts.uri.path())))?;
        let from = signed
            .body(&bytes)
            .map_err(|e| refused(&parts.method, &parts.uri, e))?;
        let body = serde_json::from_slice(&bytes)
            .map_err(|e| JobError::Invalid(format!("{} from {from}: {e}", parts.uri.path())))?;
        Ok(Signed { from, body })
    }
}

/// A peer found the copy of a pack this node served corrupt: the copy here
/// is checked again, whole, and dropped if it fails (so it is not offered
/// again), and both are counted for `labrun status`.
async fn pack_corrupt(
    State(d): D,
    Path(id): Path<String>,
    Signed { from, body }: Signed<RequestOf<ReportCorrupt>>,
) -> Result<Json<AnswerOf<ReportCorrupt>>, ApiError> {
    let id: labsync_store::PackId = id
        .parse()
        .map_err(|_| JobError::Invalid(format!("{id:?} is not a pack id")))?;
    let cache = d.cache().clone();
    let checked = off_runtime(move || {
        let only = std::collections::HashSet::from([id]);
        cache.verify(Some(&only), &labsync_store::NoProgress)
    })
    .await
    .map_err(|e| JobError::Internal(format!("checking pack {}: {e}", id.short())))?;
    let dropped = checked.2.iter().any(|(p, _)| *p == id);
    d.reported_corrupt(dropped);
    tracing::warn!(
        "{from} found the copy of pack {} it got from here corrupt ({}); checked again here: {}",
        id.short(),
        crate::error::logged(&body.why),
        if dropped {
            "corrupt too, dropped"
        } else {
            "sound (or gone)"
        }
    );
    Ok(Json(crate::proto::CorruptChecked { dropped }))
}

/// An agent's heartbeat, on the coordinator.
async fn heartbeat(
    State(d): D,
    Signed { from, body }: Signed<RequestOf<SendHeartbeat>>,
) -> Result<Json<AnswerOf<SendHeartbeat>>, ApiError> {
    let c = d.coordinator().ok_or_else(|| {
        JobError::Conflict(format!(
            "{} is not the coordinator: check `coordinator` in {from}'s [cluster] config",
            d.node_name()
        ))
    })?;
    Ok(Json(c.heartbeat(&from, body, c.now_ms())?))
}

/// A pack from this node's cache, for a peer (which verifies it), sent as
/// it is read: the disk and the network work side by side. Over plain TCP
/// a peer that asks gets it with `sendfile(2)` instead (`wire`).
async fn pack(
    State(d): D,
    _: FromMember,
    Path(id): Path<String>,
    mut req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let id: labsync_store::PackId = id
        .parse()
        .map_err(|_| JobError::Invalid(format!("{id:?} is not a pack id")))?;
    let path = d.cache().pack_path(&id);
    let opened = off_runtime(move || {
        let f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        // The whole pack is read ahead while the first pieces go out.
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::WillNeed);
        Ok::<_, std::io::Error>((f, len))
    });
    let (file, len) = opened.await.map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => JobError::NotFound(format!(
            "pack {} is not cached on {}",
            id.short(),
            d.node_name()
        )),
        _ => JobError::Internal(format!("pack {}: {e}", id.short())),
    })?;
    let asks = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok());
    let plain = req.extensions().get::<wire::PlainTcp>().is_some();
    let slot = (plain && asks == Some(wire::PROTOCOL))
        .then(wire::slot)
        .flatten();
    if let Some(slot) = slot {
        if let Some(upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() {
            let what = format!("pack {}", id.short());
            let sent = move || d.served(len, true);
            tokio::spawn(wire::send(upgrade, file, len, what, slot, sent));
            return Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header(header::CONNECTION, "upgrade")
                .header(header::UPGRADE, wire::PROTOCOL)
                .header(wire::LENGTH, len)
                .body(Body::empty())
                .map_err(|e| ApiError::from(JobError::Internal(e.to_string())));
        }
    }
    // Counted as answered: a body cut short is the fetching node's to see.
    d.served(len, false);
    /// Bytes read and sent at a time.
    const PIECE: usize = 1 << 20;
    let pieces = futures::stream::unfold(Some(file), |file| async move {
        let mut f = file?;
        let read = off_runtime(move || {
            use std::io::Read;
            // Read into the buffer's spare room: zeroing a mebibyte first
            // (`vec![0; PIECE]`) took 4.5% of both CPUs of the follow
            // benchmark, the peer's largest cost after its copies.
            let mut buf = Vec::with_capacity(PIECE);
            (&mut f).take(PIECE as u64).read_to_end(&mut buf)?;
            Ok::<_, std::io::Error>((f, buf))
        })
        .await;
        match read {
            Ok((_, buf)) if buf.is_empty() => None,
            Ok((f, buf)) => Some((Ok(bytes::Bytes::from(buf)), Some(f))),
            Err(e) => Some((Err(e), None)),
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, len)
        .body(Body::from_stream(pieces))
        .map_err(|e| ApiError::from(JobError::Internal(e.to_string())))
}

/// Where a job would go, and why not elsewhere: the placer's table.
async fn explain(
    State(d): D,
    _: Authed,
    Json(req): Json<RequestOf<ExplainRequest>>,
) -> Result<Json<AnswerOf<ExplainRequest>>, ApiError> {
    let (co, r) = coordinator(&d, "--explain")?;
    Ok(Json(co.explain(&r, &req).await?))
}

/// The lab's rules in force, for an admin.
async fn admin_show(State(d): D, Authed(c): Authed) -> Result<Json<AnswerOf<GetAdmin>>, ApiError> {
    let (co, _) = coordinator(&d, "labrun admin")?;
    Ok(Json(co.admin_view(&c)?))
}

/// An admin changes the lab's rules.
async fn admin_change(
    State(d): D,
    Authed(c): Authed,
    Json(change): Json<RequestOf<ChangeAdmin>>,
) -> Result<Json<AnswerOf<ChangeAdmin>>, ApiError> {
    let (co, _) = coordinator(&d, "labrun admin")?;
    Ok(Json(co.admin_change(&c, change)?))
}

/// Nodes ranked with Slurm's GPUs (`labrun --backend slurm`).
async fn rank(
    State(d): D,
    _: Authed,
    Json(ask): Json<RequestOf<RankNodes>>,
) -> Result<Json<AnswerOf<RankNodes>>, ApiError> {
    let (co, r) = coordinator(&d, "ranking nodes for Slurm")?;
    Ok(Json(co.rank_for_scheduler(&r, &ask).await?))
}

/// A Slurm job's batch script asks for its code and data, on the
/// coordinator. Untimed (a big dataset takes minutes to arrive): only its
/// body must come within [`REQUEST_TIMEOUT`].
async fn stage_ask(
    State(d): D,
    req: axum::extract::Request,
) -> Result<Json<AnswerOf<AskStage>>, ApiError> {
    let (parts, body) = req.into_parts();
    let c = caller(&d, &parts.headers)?;
    let bytes = tokio::time::timeout(REQUEST_TIMEOUT, axum::body::to_bytes(body, 1 << 20))
        .await
        .map_err(|_| JobError::Invalid("request took too long; closed".into()))?
        .map_err(|e| JobError::Invalid(format!("/v1/stage: {e}")))?;
    let ask: crate::proto::StageAsk =
        serde_json::from_slice(&bytes).map_err(|e| JobError::Invalid(format!("/v1/stage: {e}")))?;
    let (co, r) = coordinator(&d, "staging a Slurm job")?;
    Ok(Json(co.stage(&r, &c, ask).await?))
}

/// A Slurm job ended: its stage is released, on the coordinator.
async fn stage_done_ask(
    State(d): D,
    Authed(c): Authed,
    Json(done): Json<RequestOf<AskStageDone>>,
) -> Result<impl IntoResponse, ApiError> {
    let (co, r) = coordinator(&d, "releasing a Slurm job's stage")?;
    co.stage_done(&r, &c, done).await?;
    Ok(Json(serde_json::json!({})))
}

/// The coordinator's stage order, on a node. Untimed as [`stage_ask`]:
/// only the signed body must come within [`REQUEST_TIMEOUT`].
async fn stage_order(
    State(d): D,
    req: axum::extract::Request,
) -> Result<Json<AnswerOf<OrderStage>>, ApiError> {
    use axum::extract::FromRequest;
    let signed = tokio::time::timeout(
        REQUEST_TIMEOUT,
        Signed::<RequestOf<OrderStage>>::from_request(req, &d),
    )
    .await
    .map_err(|_| JobError::Invalid("request took too long; closed".into()))??;
    Ok(Json(d.stage(signed.body).await?))
}

/// The coordinator's release of a stage, on a node.
async fn stage_done_order(
    State(d): D,
    Signed { body, .. }: Signed<RequestOf<OrderStageDone>>,
) -> Result<impl IntoResponse, ApiError> {
    d.stage_done(body).await?;
    Ok(Json(serde_json::json!({})))
}

/// An admin's `labsync warm`, on the coordinator.
async fn warm_ask(
    State(d): D,
    Authed(c): Authed,
    Json(ask): Json<RequestOf<AskWarm>>,
) -> Result<Json<AnswerOf<AskWarm>>, ApiError> {
    let (co, r) = coordinator(&d, "labsync warm")?;
    Ok(Json(co.warm(&r, &c, ask).await?))
}

/// A node could not get packs from a peer, on the coordinator.
async fn suspect(
    State(d): D,
    Signed { from, body }: Signed<RequestOf<ReportSuspect>>,
) -> Result<impl IntoResponse, ApiError> {
    let (co, _) = coordinator(&d, "a report of a failing peer")?;
    co.suspect(&from, &body.peer, &body.why, co.now_ms());
    Ok(Json(serde_json::json!({})))
}

/// `labd doctor`'s ping: this node's version and clock, and whether it
/// reaches the nodes named.
async fn ping(
    State(d): D,
    Signed { body, .. }: Signed<RequestOf<Ping>>,
) -> Result<Json<AnswerOf<Ping>>, ApiError> {
    Ok(Json(d.pong(body).await?))
}

/// The coordinator's warm order, on a node.
async fn warm_order(
    State(d): D,
    Signed { body, .. }: Signed<RequestOf<OrderWarm>>,
) -> Result<impl IntoResponse, ApiError> {
    d.warm(body).await?;
    Ok(Json(serde_json::json!({})))
}

/// Who holds which packs, on the coordinator.
async fn locate(
    State(d): D,
    Signed { from, body }: Signed<RequestOf<LocatePacks>>,
) -> Result<Json<AnswerOf<LocatePacks>>, ApiError> {
    let (co, _) = coordinator(&d, "locating packs")?;
    Ok(Json(co.locate(&from, &body)))
}

/// A job the coordinator placed here.
async fn dispatch(
    State(d): D,
    Signed { body, .. }: Signed<RequestOf<DispatchJob>>,
) -> Result<Json<AnswerOf<DispatchJob>>, ApiError> {
    Ok(Json(d.submit_placed(body).await))
}

/// The coordinator acts for a user it has checked: as an admin here.
fn for_coordinator(from: String) -> Caller {
    Caller {
        user: format!("coordinator {from}"),
        admin: true,
    }
}

async fn placed_job(
    State(d): D,
    _: FromMember,
    Path(id): Path<String>,
) -> Result<Json<AnswerOf<PlacedJob>>, ApiError> {
    Ok(Json(d.job(&id).await?))
}

async fn placed_kill(
    State(d): D,
    FromMember(from): FromMember,
    Path(id): Path<String>,
) -> Result<Json<AnswerOf<PlacedKill>>, ApiError> {
    Ok(Json(d.kill(&for_coordinator(from), &id).await?))
}

/// The coordinator stops a preemptible job here (answered at once).
async fn placed_preempt(
    State(d): D,
    Path(id): Path<String>,
    Signed { body, .. }: Signed<RequestOf<PlacedPreempt>>,
) -> Result<impl IntoResponse, ApiError> {
    d.stop_for(&id, &body.for_job).await?;
    Ok(Json(serde_json::json!({})))
}

async fn placed_log(
    State(d): D,
    FromMember(from): FromMember,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Response, ApiError> {
    let wait = Duration::from_millis(q.wait_ms);
    log_response(d.log(&for_coordinator(from), &id, q.offset, wait).await?)
}

/// The largest body of a request between nodes: a full inventory of a
/// large cache (a pack id and size is about 80 bytes of JSON) fits; read
/// before the signature is checked, so bounded.
const SIGNED_MAX: usize = 64 << 20;

/// The longest a request may take, body included: a log follower's wait is
/// at most 30 s; a client that trickles a body (read before its token is
/// checked) is cut off here.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

async fn time_limit(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<Response, ApiError> {
    tokio::time::timeout(REQUEST_TIMEOUT, next.run(req))
        .await
        .map_err(|_| JobError::Invalid("request took too long; closed".into()).into())
}

/// The API's routes over `daemon`, each where [`crate::proto::routes`]
/// says it is.
pub fn router(daemon: Arc<Daemon>) -> Router {
    let timed = Routes(Router::new())
        .at::<Health, _, _>(health)
        .at::<GetInfo, _, _>(info)
        .at::<GetGpus, _, _>(gpus)
        .at::<ListJobs, _, _>(jobs)
        .at::<SubmitJob, _, _>(submit)
        .at::<GetJob, _, _>(job)
        .at::<JobLog, _, _>(log)
        .at::<KillJob, _, _>(kill)
        .at::<ExplainJob, _, _>(job_explain)
        .at::<GetClusterStatus, _, _>(cluster_status)
        .at::<SendHeartbeat, _, _>(heartbeat)
        .at::<GetPack, _, _>(pack)
        .at::<ReportCorrupt, _, _>(pack_corrupt)
        .at::<ExplainRequest, _, _>(explain)
        .at::<GetAdmin, _, _>(admin_show)
        .at::<ChangeAdmin, _, _>(admin_change)
        .at::<RankNodes, _, _>(rank)
        .at::<AskStageDone, _, _>(stage_done_ask)
        .at::<OrderStageDone, _, _>(stage_done_order)
        .at::<AskWarm, _, _>(warm_ask)
        .at::<OrderWarm, _, _>(warm_order)
        .at::<LocatePacks, _, _>(locate)
        .at::<DispatchJob, _, _>(dispatch)
        .at::<PlacedJob, _, _>(placed_job)
        .at::<PlacedLog, _, _>(placed_log)
        .at::<PlacedKill, _, _>(placed_kill)
        .at::<PlacedPreempt, _, _>(placed_preempt)
        .at::<Ping, _, _>(ping)
        .at::<ReportSuspect, _, _>(suspect)
        .0;
    // Staging answers once the data is there: minutes for a big dataset.
    // Its handlers bound the body's arrival themselves.
    let untimed = Routes(Router::new())
        .at::<AskStage, _, _>(stage_ask)
        .at::<OrderStage, _, _>(stage_order)
        .0;
    let jobs = Arc::new(Jobs::of(&daemon));
    let web = crate::web::router(daemon.clone(), jobs.clone())
        .layer(axum::middleware::from_fn(time_limit));
    timed
        .layer(axum::middleware::from_fn(time_limit))
        .merge(untimed)
        .with_state(App { jobs, daemon })
        .merge(web)
        .layer(axum::middleware::from_fn(timed_by_route))
}

/// Counts how long each request took, by its route's pattern (never the
/// path asked for: a caller must not grow the table), for `/metrics`.
async fn timed_by_route(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let start = std::time::Instant::now();
    let r = next.run(req).await;
    crate::metrics::request(&route, start.elapsed().as_secs_f64());
    r
}

/// A router being built from the route table.
struct Routes(Router<App>);

impl Routes {
    /// Route `R` served by `handler`, with the method and path the table
    /// gives it.
    fn at<R, H, T>(self, handler: H) -> Routes
    where
        R: crate::proto::Route,
        H: axum::handler::Handler<T, App>,
        T: 'static,
    {
        use crate::proto::Verb;
        let method = match R::VERB {
            Verb::Get => get(handler),
            Verb::Post => post(handler),
        };
        Routes(self.0.route(R::PATH, method))
    }
}

/// Who is at the other end of a connection, for the per-peer cap.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Peer {
    Uid(u32),
    /// A network: any local user can pick a source address among
    /// 127.0.0.0/8 or an IPv6 /64, so those count as one peer.
    Net(std::net::IpAddr),
    Unknown,
}

impl Peer {
    fn of(addr: std::net::IpAddr) -> Peer {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        let net = match addr {
            IpAddr::V4(a) if a.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(a) => IpAddr::V4(a),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => return Peer::of(IpAddr::V4(v4)),
                None => {
                    let s = a.segments();
                    IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
                }
            },
        };
        Peer::Net(net)
    }
}

/// Counts one connection against the caps while it lives.
struct Slot {
    peer: Peer,
    open: Arc<std::sync::Mutex<std::collections::HashMap<Peer, usize>>>,
    _all: tokio::sync::OwnedSemaphorePermit,
}

impl Slot {
    /// A place for a connection from `peer`, within both caps; `None` past
    /// either. Counted only once granted: refused peers leave no entry
    /// behind.
    fn take(
        all: &Arc<tokio::sync::Semaphore>,
        open: &Arc<std::sync::Mutex<std::collections::HashMap<Peer, usize>>>,
        peer: &Peer,
        per_peer: usize,
    ) -> Option<Slot> {
        let mut o = open.lock().expect("labd poisoned");
        let held = o.get(peer).copied().unwrap_or(0);
        match all.clone().try_acquire_owned() {
            Ok(permit) if held < per_peer => {
                o.insert(peer.clone(), held + 1);
                Some(Slot {
                    peer: peer.clone(),
                    open: open.clone(),
                    _all: permit,
                })
            }
            _ => None,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.open.lock().expect("labd poisoned");
        if let Some(n) = open.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

/// Starts labd's loops until `stop`: the ticker (returned, to be waited
/// for), the coordinator's passes and its re-ranking of pending Slurm jobs,
/// a cluster node's heartbeats.
fn start_loops(
    daemon: &Arc<Daemon>,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let ticker = tokio::spawn(daemon.clone().run_ticker(stop.clone()));
    tokio::spawn(crate::notify::run(
        daemon.clone(),
        daemon.notifier().clone(),
        stop.clone(),
    ));
    tokio::spawn(daemon.clone().run_coordinator(stop.clone()));
    if let (Some(r), Some(co)) = (daemon.slurm_rerank(), daemon.coordinator()) {
        tokio::spawn(crate::cluster::rerank::run(
            co.clone(),
            crate::cluster::Reach::new(daemon.clone()),
            r.clone(),
            stop.clone(),
        ));
    }
    if let Some(cfg) = daemon.cluster() {
        let reporter = crate::daemon::Reporter::new(
            daemon.clone(),
            cfg.clone(),
            daemon.coordinator().cloned(),
        );
        tokio::spawn(reporter.run(stop.clone()));
    }
    ticker
}

/// Serves the API on `listener` and runs the ticker until `shutdown` resolves.
pub async fn serve(
    daemon: Arc<Daemon>,
    listener: Listener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = daemon.conn_limits();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let ticker = start_loops(&daemon, &stop_rx);
    // Past the caps, room for the cluster's own signed requests only.
    let lane = daemon
        .cluster()
        .map(|_| (Lane::new(LANE_PLACES), daemon.clone()));
    let app = router(daemon);
    // Requests over plain TCP are marked: a pack may be sent into their
    // socket with `sendfile` (`wire`).
    let plain_app = app.clone().layer(axum::Extension(wire::PlainTcp));
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let all = Arc::new(tokio::sync::Semaphore::new(limits.max));
    let open = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let mut conns = tokio::task::JoinSet::new();
    let mut stop = stop_rx.clone();
    let mut refused_at: Option<std::time::Instant> = None;
    let tls = match &listener {
        Listener::Tls(_, config) => Some(tokio_rustls::TlsAcceptor::from(config.clone())),
        _ => None,
    };
    loop {
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = stop.changed() => break,
        };
        let (io, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let Some(slot) = Slot::take(&all, &open, &peer, limits.per_peer) else {
            if let Some((place, evicted)) = lane.as_ref().and_then(|(l, _)| l.admit()) {
                let d = lane
                    .as_ref()
                    .map(|(_, d)| d.clone())
                    .expect("a lane has its daemon");
                let app = match (&io, &tls) {
                    (Io::Tcp(_), None) => plain_app.clone(),
                    _ => app.clone(),
                };
                let (stop, tls) = (stop_rx.clone(), tls.clone());
                conns.spawn(async move {
                    // Evicted: closed. The sender dropped once the head
                    // arrived is no eviction (that branch is then disabled).
                    tokio::select! {
                        _ = serve_members_only(d, app, io, tls, place, peer, stop) => {}
                        Ok(()) = evicted => {}
                    }
                });
                continue;
            }
            // Closed at once. Said at most once a minute: a flood must not fill the log.
            if refused_at.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                refused_at = Some(std::time::Instant::now());
                tracing::warn!("refusing connections from {peer:?}: over the connection caps");
            }
            continue;
        };
        let app = match (&io, &tls) {
            (Io::Tcp(_), None) => plain_app.clone(),
            _ => app.clone(),
        };
        let (mut stop, tls) = (stop_rx.clone(), tls.clone());
        conns.spawn(async move {
            let _slot = slot;
            serve_conn(io, tls, app, limits.header_timeout, &peer, &mut stop).await;
        });
    }
    // Running requests finish (a log follower's wait is at most 30 s).
    let drain = async { while conns.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(Duration::from_secs(35), drain).await;
    let _ = ticker.await;
    Ok(())
}

/// A connection over the caps, in the lane ([`crate::lane`]): served only
/// requests with a good cluster signature, each head within
/// [`LANE_HEAD_TIMEOUT`]; anything else gets 503 and the connection closes.
async fn serve_members_only(
    d: Arc<Daemon>,
    app: Router,
    io: Io,
    tls: Option<tokio_rustls::TlsAcceptor>,
    place: Place,
    peer: Peer,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let place = Arc::new(place);
    let app = app.layer(axum::middleware::from_fn(move |req, next| {
        members_only(d.clone(), place.clone(), req, next)
    }));
    serve_conn(io, tls, app, LANE_HEAD_TIMEOUT, &peer, &mut stop).await;
}

/// Serves one accepted connection: its TLS handshake (with `tls`) and then
/// its requests, each head within `head_timeout`. The handshake runs here,
/// not in the accept loop: a client that stalls in it holds only its own
/// place, for that long.
async fn serve_conn(
    io: Io,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    head_timeout: Duration,
    peer: &Peer,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    let io = match (io, tls) {
        (Io::Tcp(s), Some(acceptor)) => {
            match tokio::time::timeout(head_timeout, acceptor.accept(s)).await {
                Ok(Ok(s)) => Io::Tls(Box::new(s)),
                Ok(Err(e)) => {
                    tracing::debug!("TLS handshake with {peer:?}: {e}");
                    return;
                }
                Err(_) => {
                    tracing::debug!("TLS handshake with {peer:?}: timed out");
                    return;
                }
            }
        }
        (io, _) => io,
    };
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(head_timeout);
    let conn = match io {
        Io::Unix(s) => serve_one(&http, s, svc, stop).await,
        Io::Tcp(s) => serve_one(&http, s, svc, stop).await,
        Io::Tls(s) => serve_one(&http, s, svc, stop).await,
    };
    if let Err(e) = conn {
        tracing::debug!("connection from {peer:?}: {e}");
    }
}

/// The check of [`serve_members_only`]: the request's cluster signature,
/// from its head (the route checks it again, body and all, and takes it).
async fn members_only(
    d: Arc<Daemon>,
    place: Arc<Place>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    place.arrived();
    if member_head(&d, req.method(), req.uri(), req.headers()).is_ok() {
        return next.run(req).await;
    }
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONNECTION, "close")],
        "over the connection caps for this address: past them labd serves only \
         the cluster's signed requests; close idle connections and try again",
    )
        .into_response()
}

enum Io {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

async fn accept(listener: &Listener) -> std::io::Result<(Io, Peer)> {
    match listener {
        Listener::Unix(l) => {
            let (s, _) = l.accept().await?;
            let peer = s.peer_cred().map_or(Peer::Unknown, |c| Peer::Uid(c.uid()));
            Ok((Io::Unix(s), peer))
        }
        Listener::Tcp(l) | Listener::Tls(l, _) => {
            let (s, addr) = l.accept().await?;
            // A streamed answer (a log being followed, a pack) goes out as
            // its headers and then its pieces: with Nagle's algorithm on, a
            // small piece waited for the ACK of the headers, which the
            // client delays by 40 ms.
            let _ = s.set_nodelay(true);
            Ok((Io::Tcp(s), Peer::of(addr.ip())))
        }
    }
}

async fn serve_one<S>(
    http: &hyper::server::conn::http1::Builder,
    io: S,
    svc: hyper_util::service::TowerToHyperService<Router>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<(), hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    // Upgrades: a peer's pack may switch to `sendfile` (`wire`).
    let conn = http
        .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
        .with_upgrades();
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => r,
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    }
}
