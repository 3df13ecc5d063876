//! labd's HTTP API (axum) on a Unix socket or TCP, and the ticker beside it.
//! The routes are listed in [`crate::proto`].

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use crate::daemon::{Caller, Daemon};
use crate::error::ApiError;
use crate::proto::{ErrorBody, SubmitRequest, DONE, NEXT_OFFSET};

/// A bound listener: the local default is a Unix socket, a cluster node listens on TCP.
pub enum Listener {
    /// A Unix socket.
    Unix(tokio::net::UnixListener),
    /// TCP.
    Tcp(tokio::net::TcpListener),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
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

async fn health() -> &'static str {
    "ok"
}

async fn info(State(d): D, h: HeaderMap) -> Result<impl IntoResponse, ApiError> {
    Ok(Json(d.info(&caller(&d, &h)?)))
}

async fn gpus(State(d): D, h: HeaderMap) -> Result<impl IntoResponse, ApiError> {
    caller(&d, &h)?;
    Ok(Json(d.gpus().await?))
}

async fn jobs(State(d): D, h: HeaderMap) -> Result<impl IntoResponse, ApiError> {
    caller(&d, &h)?;
    Ok(Json(d.jobs().await?))
}

async fn submit(
    State(d): D,
    h: HeaderMap,
    Json(req): Json<SubmitRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let c = caller(&d, &h)?;
    Ok((StatusCode::CREATED, Json(d.submit(&c, req).await?)))
}

async fn job(
    State(d): D,
    h: HeaderMap,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    caller(&d, &h)?;
    Ok(Json(d.job(&id).await?))
}

async fn kill(
    State(d): D,
    h: HeaderMap,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let c = caller(&d, &h)?;
    Ok(Json(d.kill(&c, &id).await?))
}

#[derive(Deserialize)]
struct LogQuery {
    #[serde(default)]
    offset: u64,
    #[serde(default)]
    wait_ms: u64,
}

async fn log(
    State(d): D,
    h: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Response, ApiError> {
    let c = caller(&d, &h)?;
    let r = d
        .log(&c, &id, q.offset, Duration::from_millis(q.wait_ms))
        .await?;
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(NEXT_OFFSET, r.next.to_string())
        .header(DONE, r.done.to_string())
        .body(Body::from(r.bytes))
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// The API's routes over `daemon`.
pub fn router(daemon: Arc<Daemon>) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/info", get(info))
        .route("/v1/gpus", get(gpus))
        .route("/v1/jobs", get(jobs).post(submit))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/log", get(log))
        .route("/v1/jobs/{id}/kill", post(kill))
        .with_state(daemon)
}

/// Serves the API on `listener` and runs the ticker until `shutdown` resolves.
pub async fn serve(
    daemon: Arc<Daemon>,
    listener: Listener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let ticker = tokio::spawn(daemon.clone().run_ticker(stop_rx.clone()));
    let app = router(daemon);
    let mut rx = stop_rx;
    let stopped = async move {
        let _ = rx.changed().await;
    };
    let signal = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    tokio::spawn(signal);
    let served = match listener {
        Listener::Unix(l) => axum::serve(l, app).with_graceful_shutdown(stopped).await,
        Listener::Tcp(l) => axum::serve(l, app).with_graceful_shutdown(stopped).await,
    };
    let _ = ticker.await;
    served
}
