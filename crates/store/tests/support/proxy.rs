//! A fault-injecting HTTP proxy in front of a real S3 server, on 127.0.0.1:
//! it makes one server behave as the servers labs run do with conditional
//! writes (ignoring them, refusing them) and under load (`503 SlowDown`).
//! Shared by the store's tests and the cli's matrix, which use different parts.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// What the proxy does to requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Passes everything through.
    None,
    /// Drops `If-None-Match` and `If-Match`: the server never sees the
    /// condition, so a "create" overwrites (as s3rver and old MinIO do).
    DropConditions,
    /// Answers `501 NotImplemented` to any request carrying a condition.
    RefuseConditions,
    /// Answers `503 SlowDown` (with `Retry-After: 1`) to one request in twenty.
    SlowDown,
    /// Holds the answer to the first listing of `packs/` for two seconds,
    /// after the server made it: what a gc lists then is already stale
    /// when it goes on ([`Proxy::holding`] says when it is held).
    HoldPackListing,
    /// [`Fault::DropConditions`], and a late write: once armed
    /// ([`Proxy::land_late_write`]), the first read of a version's key
    /// (`refs/.../@/...`) written through the proxy since finds another
    /// writer's bytes there, written just before the read reaches the
    /// server, as a writer frozen past its claim would land them.
    LateWrite,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    requests: AtomicU64,
    /// For each `503` answered: when, and the request it answered
    /// (method and path with query).
    slowed: Mutex<Vec<(Instant, String)>>,
    /// Every request that reached the server: when, and what.
    passed: Mutex<Vec<(Instant, String)>>,
    /// Conditional requests answered `501`.
    refused: AtomicU64,
    /// The first listing of `packs/` was made and is being held.
    holding: std::sync::atomic::AtomicBool,
    /// A listing of `packs/` was held already.
    held: std::sync::atomic::AtomicBool,
    /// The bytes of the late write still to land ([`Fault::LateWrite`]).
    late: Mutex<Option<Bytes>>,
    /// Paths written through the proxy.
    written: Mutex<std::collections::HashSet<String>>,
    /// Where the late write landed.
    landed: Mutex<Option<String>>,
}

impl Proxy {
    /// True while the first listing of `packs/` is held
    /// ([`Fault::HoldPackListing`]).
    pub fn holding(&self) -> bool {
        self.state.holding.load(Ordering::SeqCst)
    }

    /// Arms [`Fault::LateWrite`] with the late writer's bytes.
    pub fn land_late_write(&self, body: Bytes) {
        // Only keys written from now on.
        self.state.written.lock().unwrap().clear();
        *self.state.late.lock().unwrap() = Some(body);
    }

    /// The path the late write landed on, once it has.
    pub fn late_write_landed(&self) -> Option<String> {
        self.state.landed.lock().unwrap().clone()
    }

    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr, fault: Fault) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        async move { handle(req, upstream, fault, &st).await }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Proxy { addr, task, state }
    }

    /// The proxy's endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests that reached the proxy.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Every request that reached the server, in order: method and path
    /// with its query.
    pub fn passed(&self) -> Vec<String> {
        let passed = self.state.passed.lock().unwrap();
        passed.iter().map(|(_, what)| what.clone()).collect()
    }

    /// Conditional requests answered `501`.
    pub fn refused(&self) -> u64 {
        self.state.refused.load(Ordering::Relaxed)
    }

    /// For every request answered `503`, how long until the same request
    /// came again (`None` if it never did).
    pub fn retry_delays(&self) -> Vec<Option<std::time::Duration>> {
        let slowed = self.state.slowed.lock().unwrap().clone();
        let passed = self.state.passed.lock().unwrap().clone();
        slowed
            .iter()
            .map(|(t, what)| {
                passed
                    .iter()
                    .chain(slowed.iter())
                    .filter(|(t2, w2)| w2 == what && t2 > t)
                    .map(|(t2, _)| *t2 - *t)
                    .min()
            })
            .collect()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn s3_error(status: StatusCode, code: &str, message: &str) -> Response<Full<Bytes>> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>{message}</Message><RequestId>proxy</RequestId></Error>"
    );
    Response::builder()
        .status(status)
        .header("content-type", "application/xml")
        .header("retry-after", "1")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

async fn handle(
    req: Request<Incoming>,
    upstream: SocketAddr,
    fault: Fault,
    st: &State,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let n = st.requests.fetch_add(1, Ordering::Relaxed);
    let what = format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map_or("", |p| p.as_str())
    );
    let pack_listing = what.contains("list-type=2") && what.contains("packs%2F");
    let conditional =
        req.headers().contains_key("if-none-match") || req.headers().contains_key("if-match");
    match fault {
        Fault::RefuseConditions if conditional => {
            st.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(s3_error(
                StatusCode::NOT_IMPLEMENTED,
                "NotImplemented",
                "A header you provided implies functionality that is not implemented",
            ));
        }
        Fault::SlowDown if n % 20 == 7 => {
            st.slowed.lock().unwrap().push((Instant::now(), what));
            return Ok(s3_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "SlowDown",
                "Please reduce your request rate.",
            ));
        }
        _ => {}
    }
    st.passed.lock().unwrap().push((Instant::now(), what));
    let (mut parts, body) = req.into_parts();
    if matches!(fault, Fault::DropConditions | Fault::LateWrite) {
        parts.headers.remove("if-none-match");
        parts.headers.remove("if-match");
    }
    let body = body.collect().await?.to_bytes();
    if fault == Fault::LateWrite {
        let path = parts.uri.path().to_string();
        let decoded = path.replace("%2F", "/").replace("%40", "@");
        let version = decoded.contains("/refs/") && decoded.contains("/@/");
        if parts.method == hyper::Method::PUT {
            st.written.lock().unwrap().insert(path.clone());
        } else if parts.method == hyper::Method::GET
            && version
            && st.written.lock().unwrap().contains(&path)
        {
            let late = st.late.lock().unwrap().take();
            if let Some(late) = late {
                let put = Request::put(parts.uri.clone())
                    .header("host", parts.headers["host"].clone())
                    .header("content-length", late.len())
                    .body(Full::new(late))
                    .unwrap();
                let stream = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
                tokio::spawn(conn);
                let resp = sender.send_request(put).await?;
                assert!(resp.status().is_success(), "late write: {}", resp.status());
                *st.landed.lock().unwrap() = Some(decoded);
            }
        }
    }
    let stream = match tokio::net::TcpStream::connect(upstream).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("proxy cannot reach the server: {e}");
            return Ok(s3_error(StatusCode::BAD_GATEWAY, "BadGateway", &msg));
        }
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let resp = sender
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    if fault == Fault::HoldPackListing && pack_listing && !st.held.swap(true, Ordering::SeqCst) {
        st.holding.store(true, Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        st.holding.store(false, Ordering::SeqCst);
    }
    Ok(Response::from_parts(parts, Full::new(body)))
}
