//! The labd client `labrun` uses: one HTTP/1.1 exchange per call, over a
//! Unix socket or TCP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::auth::{signing_ms, ClusterKey, Route as Signing};
use crate::error::ClientError;
use crate::proto::{path_of, routes, AnswerOf, RequestOf, Route, Verb};
use crate::proto::{
    ClusterStatus, Dispatch, DispatchReply, ErrorBody, Heartbeat, HeartbeatReply, Info, JobView,
    SubmitRequest, DONE, NEXT_OFFSET,
};
use crate::secret::Secret;
use crate::status::GpuStatus;
use crate::tls::ClientConfig;
use crate::wire;

/// The largest answer a client takes in, bytes.
const MAX_ANSWER: usize = 96 << 20;

/// Where a labd listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket (`unix:///run/labsync/labd.sock`, or a bare path).
    Unix(PathBuf),
    /// TCP (`http://gpu3:7420` or `gpu3:7420`).
    Tcp(String),
    /// TCP with TLS (`https://gpu3:7420`).
    Tls(String),
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix://") {
            return Ok(Endpoint::Unix(p.into()));
        }
        if s.starts_with('/') || s.starts_with('.') {
            return Ok(Endpoint::Unix(s.into()));
        }
        let (tls, rest) = match s.strip_prefix("https://") {
            Some(r) => (true, r),
            None => (false, s),
        };
        let hostport = rest
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("tcp://"))
            .unwrap_or(rest)
            .trim_end_matches('/');
        match hostport.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() && tls => {
                Ok(Endpoint::Tls(hostport.into()))
            }
            Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
                Ok(Endpoint::Tcp(hostport.into()))
            }
            _ => Err(format!(
                "labd address {s:?}: write unix:///path/labd.sock, /path/labd.sock, \
                 http://host:port or https://host:port"
            )),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "http://{a}"),
            Endpoint::Tls(a) => write!(f, "https://{a}"),
        }
    }
}

/// A labd, as seen by one user, or by another node of its cluster.
#[derive(Clone, Debug)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<Secret>,
    /// Requests between nodes are signed with the cluster key, from the
    /// first node named, for the second.
    signer: Option<(ClusterKey, String, String)>,
    /// For an `https://` endpoint: whom to trust (the system's roots without it).
    tls: Option<Arc<ClientConfig>>,
}

/// A piece of a job's log.
#[derive(Debug)]
pub struct LogPiece {
    /// The bytes.
    pub bytes: Bytes,
    /// Offset to ask for next.
    pub next: u64,
    /// Nothing more will come: the job ended and its outputs are saved.
    pub done: bool,
}

impl Client {
    /// A client of the labd at `endpoint`, authenticating with `token`.
    pub fn new(endpoint: Endpoint, token: Option<Secret>) -> Client {
        Client {
            endpoint,
            token,
            signer: None,
            tls: None,
        }
    }

    /// Checks an `https://` labd's certificate with `tls` (its CA) rather
    /// than the system's roots; `None` keeps the roots.
    pub fn with_tls(mut self, tls: Option<Arc<ClientConfig>>) -> Client {
        self.tls = tls;
        self
    }

    /// A client of another node of the cluster: every request is signed
    /// with `key` as from `node`, for `to` (that node's name, or
    /// [`crate::cluster::TO_COORDINATOR`]), and carries no user's token.
    pub fn for_cluster(endpoint: Endpoint, key: ClusterKey, node: &str, to: &str) -> Client {
        Client {
            endpoint,
            token: None,
            signer: Some((key, node.to_string(), to.to_string())),
            tls: None,
        }
    }

    /// Where it talks to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    async fn exchange(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<hyper::Response<Bytes>, ClientError> {
        self.exchange_as(method, path, body, None).await
    }

    /// [`Client::exchange`], asking to switch to `upgrade` (over plain TCP
    /// only): the answer's body is then what came after the switch.
    async fn exchange_as(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Vec<u8>>,
        upgrade: Option<&str>,
    ) -> Result<hyper::Response<Bytes>, ClientError> {
        let connect = |source| ClientError::Connect {
            endpoint: self.endpoint.to_string(),
            source,
        };
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "labd")
            .header(crate::proto::PROTOCOL_HEADER, crate::proto::PROTOCOL)
            .header(crate::proto::VERSION_HEADER, crate::proto::VERSION);
        if let Some(t) = &self.token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {}", t.expose()));
        }
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let upgrade = upgrade.filter(|_| matches!(self.endpoint, Endpoint::Tcp(_)));
        if let Some(protocol) = upgrade {
            req = req
                .header(header::CONNECTION, "upgrade")
                .header(header::UPGRADE, protocol);
        }
        let body = body.unwrap_or_default();
        if let Some((key, from, to)) = &self.signer {
            let method = req.method_ref().map_or("GET", |m| m.as_str()).to_string();
            let route = Signing {
                method: &method,
                path,
                from,
                to,
            };
            for (name, value) in key.sign(&route, signing_ms(), &body) {
                req = req.header(name, value);
            }
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| self.protocol(e))?;
        match &self.endpoint {
            Endpoint::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p).await.map_err(connect)?;
                self.send(s, req).await
            }
            Endpoint::Tcp(_) if self.tls.is_some() => Err(self.protocol(
                "this side speaks TLS with its labd peers and refuses an http:// address",
            )),
            Endpoint::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a).await.map_err(connect)?;
                let _ = s.set_nodelay(true);
                self.send(s, req).await
            }
            Endpoint::Tls(a) => {
                let config = match &self.tls {
                    Some(c) => c.clone(),
                    None => crate::tls::system_client().map_err(|e| self.protocol(e))?,
                };
                let name = crate::tls::server_name(a).map_err(|e| self.protocol(e))?;
                let s = tokio::net::TcpStream::connect(a).await.map_err(connect)?;
                let _ = s.set_nodelay(true);
                let s = tokio_rustls::TlsConnector::from(config)
                    .connect(name, s)
                    .await
                    .map_err(|e| ClientError::Tls {
                        endpoint: self.endpoint.to_string(),
                        detail: e.to_string(),
                    })?;
                self.send(s, req).await
            }
        }
    }

    fn protocol(&self, e: impl std::fmt::Display) -> ClientError {
        ClientError::Protocol {
            endpoint: self.endpoint.to_string(),
            detail: e.to_string(),
        }
    }

    async fn send<S>(
        &self,
        stream: S,
        req: hyper::Request<Full<Bytes>>,
    ) -> Result<hyper::Response<Bytes>, ClientError>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let asked = req.headers().contains_key(header::UPGRADE);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.protocol(e))?;
        tokio::spawn(conn.with_upgrades());
        let mut resp = sender
            .send_request(req)
            .await
            .map_err(|e| self.protocol(e))?;
        if asked && resp.status() == hyper::StatusCode::SWITCHING_PROTOCOLS {
            let len = (resp.headers().get(wire::LENGTH))
                .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
                .ok_or_else(|| {
                    self.protocol(format!("switched without a {} header", wire::LENGTH))
                })?;
            if len > MAX_ANSWER {
                return Err(self.protocol(format!("an answer of more than {MAX_ANSWER} bytes")));
            }
            let upgraded = hyper::upgrade::on(&mut resp)
                .await
                .map_err(|e| self.protocol(e))?;
            let bytes = wire::receive(upgraded, len)
                .await
                .map_err(|e| self.protocol(e))?;
            let (parts, _) = resp.into_parts();
            return Ok(hyper::Response::from_parts(parts, bytes));
        }
        let (parts, body) = resp.into_parts();
        let length = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        let bytes = collect(body, length).await.map_err(|e| self.protocol(e))?;
        if !parts.status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&bytes)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
            return Err(ClientError::Status {
                status: parts.status.as_u16(),
                message,
            });
        }
        Ok(hyper::Response::from_parts(parts, bytes))
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let resp = self.exchange(method, path, body).await?;
        serde_json::from_slice(resp.body()).map_err(|e| self.protocol(e))
    }

    /// Asks route `R` (its `{id}` filled with `id`) with `body`, and reads
    /// its JSON answer: the method, path and types are the table's
    /// ([`crate::proto::routes`]).
    async fn call<R: Route>(
        &self,
        id: &str,
        body: Option<&RequestOf<R>>,
    ) -> Result<AnswerOf<R>, ClientError>
    where
        RequestOf<R>: serde::Serialize,
        AnswerOf<R>: DeserializeOwned,
    {
        let body = body.map(|b| serde_json::to_vec(b).expect("requests serialise"));
        self.json(method_of::<R>(), &path_of::<R>(id), body).await
    }

    /// Asks route `R`, which answers `{}`.
    async fn order<R: Route<Answer = ()>>(
        &self,
        id: &str,
        body: &RequestOf<R>,
    ) -> Result<(), ClientError>
    where
        RequestOf<R>: serde::Serialize,
    {
        let body = serde_json::to_vec(body).expect("requests serialise");
        let _: serde_json::Value =
            (self.json(method_of::<R>(), &path_of::<R>(id), Some(body))).await?;
        Ok(())
    }

    /// True when labd answers its health check (no token needed).
    pub async fn healthy(&self) -> bool {
        (self.exchange(method_of::<routes::Health>(), routes::Health::PATH, None))
            .await
            .is_ok()
    }

    /// Who we are to labd, and its store.
    pub async fn info(&self) -> Result<Info, ClientError> {
        self.call::<routes::GetInfo>("", None).await
    }

    /// Every GPU of the node.
    pub async fn gpus(&self) -> Result<Vec<GpuStatus>, ClientError> {
        self.call::<routes::GetGpus>("", None).await
    }

    /// Every active job, and those that ended in the last day.
    pub async fn jobs(&self) -> Result<Vec<JobView>, ClientError> {
        self.call::<routes::ListJobs>("", None).await
    }

    /// One page of older jobs: ended, numbered below `before` (all without
    /// it), newest first, at most `limit`.
    pub async fn history(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<JobView>, ClientError> {
        type R = routes::ListJobs;
        let mut path = format!("{}?history=true&limit={limit}", R::PATH);
        if let Some(b) = before {
            path += &format!("&before={b}");
        }
        self.json(method_of::<R>(), &path, None).await
    }

    /// One job.
    pub async fn job(&self, id: &str) -> Result<JobView, ClientError> {
        self.call::<routes::GetJob>(id, None).await
    }

    /// Submits a job.
    pub async fn submit(&self, req: &SubmitRequest) -> Result<JobView, ClientError> {
        self.call::<routes::SubmitJob>("", Some(req)).await
    }

    /// Kills a job.
    pub async fn kill(&self, id: &str) -> Result<JobView, ClientError> {
        self.call::<routes::KillJob>(id, None).await
    }

    /// Every node of the cluster (asked of the coordinator).
    pub async fn cluster_status(&self) -> Result<ClusterStatus, ClientError> {
        self.call::<routes::GetClusterStatus>("", None).await
    }

    /// Sends a heartbeat to the coordinator (a cluster client).
    pub async fn heartbeat(&self, hb: &Heartbeat) -> Result<HeartbeatReply, ClientError> {
        self.call::<routes::SendHeartbeat>("", Some(hb)).await
    }

    /// A pack from a peer's cache (a cluster client). Unverified: the
    /// caller checks it against its id.
    pub async fn pack(&self, id: &labsync_store::PackId) -> Result<Bytes, ClientError> {
        type R = routes::GetPack;
        let path = path_of::<R>(&id.to_string());
        let upgrade = Some(wire::PROTOCOL);
        let resp = (self.exchange_as(method_of::<R>(), &path, None, upgrade)).await?;
        Ok(resp.into_body())
    }

    /// Tells the node that served pack `id` that its copy was corrupt
    /// (`why`); it checks its copy again and drops it if so.
    pub async fn report_corrupt(
        &self,
        id: &labsync_store::PackId,
        why: &str,
    ) -> Result<crate::proto::CorruptChecked, ClientError> {
        let report = crate::proto::CorruptCopy { why: why.into() };
        (self.call::<routes::ReportCorrupt>(&id.to_string(), Some(&report))).await
    }

    /// Why job `id` waits, per node.
    pub async fn explain_job(&self, id: &str) -> Result<crate::proto::JobExplain, ClientError> {
        self.call::<routes::ExplainJob>(id, None).await
    }

    /// Where a job would go and why (`labrun --explain`; the coordinator).
    pub async fn explain(
        &self,
        req: &SubmitRequest,
    ) -> Result<labsync_placer::Ranking, ClientError> {
        self.call::<routes::ExplainRequest>("", Some(req)).await
    }

    /// The lab's rules in force (an admin; the coordinator).
    pub async fn admin_show(&self) -> Result<crate::proto::AdminView, ClientError> {
        self.call::<routes::GetAdmin>("", None).await
    }

    /// Changes the lab's rules (an admin; the coordinator).
    pub async fn admin_change(
        &self,
        change: &crate::proto::AdminChange,
    ) -> Result<crate::proto::AdminView, ClientError> {
        self.call::<routes::ChangeAdmin>("", Some(change)).await
    }

    /// The nodes ranked for a job with the GPUs as Slurm reports them
    /// (`labrun --backend slurm`; the coordinator).
    pub async fn rank(
        &self,
        ask: &crate::proto::RankAsk,
    ) -> Result<labsync_placer::Ranking, ClientError> {
        self.call::<routes::RankNodes>("", Some(ask)).await
    }

    /// Stages a Slurm job's code and data on its node (its batch script,
    /// as its user; the coordinator). Answers once they are there.
    pub async fn stage_ask(
        &self,
        ask: &crate::proto::StageAsk,
    ) -> Result<crate::proto::Staged, ClientError> {
        self.call::<routes::AskStage>("", Some(ask)).await
    }

    /// Releases a stage (the Slurm job ended; the coordinator).
    pub async fn stage_done_ask(&self, done: &crate::proto::StageDone) -> Result<(), ClientError> {
        self.order::<routes::AskStageDone>("", done).await
    }

    /// Orders a node to stage (a cluster client).
    pub async fn stage(
        &self,
        order: &crate::proto::StageOrder,
    ) -> Result<crate::proto::Staged, ClientError> {
        self.call::<routes::OrderStage>("", Some(order)).await
    }

    /// Releases a stage on its node (a cluster client).
    pub async fn stage_done(&self, done: &crate::proto::StageDone) -> Result<(), ClientError> {
        self.order::<routes::OrderStageDone>("", done).await
    }

    /// Has the coordinator warm (or unpin) a version on nodes (admins).
    pub async fn warm_ask(
        &self,
        ask: &crate::proto::WarmAsk,
    ) -> Result<crate::proto::WarmAnswer, ClientError> {
        self.call::<routes::AskWarm>("", Some(ask)).await
    }

    /// Orders a node to warm (or unpin) a version (a cluster client).
    pub async fn warm(&self, order: &crate::proto::WarmOrder) -> Result<(), ClientError> {
        self.order::<routes::OrderWarm>("", order).await
    }

    /// Who holds which packs (asked of the coordinator; a cluster client).
    pub async fn locate(
        &self,
        packs: &[labsync_store::PackId],
    ) -> Result<crate::proto::Located, ClientError> {
        self.call::<routes::LocatePacks>("", Some(&packs.to_vec()))
            .await
    }

    /// Tells the coordinator a peer failed this node (a cluster client).
    pub async fn report_suspect(
        &self,
        report: &crate::proto::SuspectPeer,
    ) -> Result<(), ClientError> {
        self.order::<routes::ReportSuspect>("", report).await
    }

    /// `labd doctor`'s ping (a cluster client).
    pub async fn ping(
        &self,
        ask: &crate::proto::PingAsk,
    ) -> Result<crate::proto::Pong, ClientError> {
        self.call::<routes::Ping>("", Some(ask)).await
    }

    /// Sends a placed job to its node's agent (a cluster client).
    pub async fn dispatch(&self, d: &Dispatch) -> Result<DispatchReply, ClientError> {
        self.call::<routes::DispatchJob>("", Some(d)).await
    }

    /// A job's record on the node that runs it (a cluster client).
    pub async fn cluster_job(&self, id: &str) -> Result<JobView, ClientError> {
        self.call::<routes::PlacedJob>(id, None).await
    }

    /// Stops a preemptible job on the node that runs it, for `for_job`
    /// (a cluster client; answered once SIGTERM is on its way).
    pub async fn cluster_preempt(&self, id: &str, for_job: &str) -> Result<(), ClientError> {
        let order = crate::proto::PreemptOrder {
            for_job: for_job.into(),
        };
        self.order::<routes::PlacedPreempt>(id, &order).await
    }

    /// Kills a job on the node that runs it (a cluster client).
    pub async fn cluster_kill(&self, id: &str) -> Result<JobView, ClientError> {
        self.call::<routes::PlacedKill>(id, None).await
    }

    /// A job's log on the node that runs it (a cluster client).
    pub async fn cluster_log(
        &self,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogPiece, ClientError> {
        self.log_at::<routes::PlacedLog>(id, offset, wait).await
    }

    /// The job's log from `offset`, waiting up to `wait` for something new.
    pub async fn log(
        &self,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogPiece, ClientError> {
        self.log_at::<routes::JobLog>(id, offset, wait).await
    }

    /// A log piece from route `R` ([`routes::JobLog`] or [`routes::PlacedLog`]).
    async fn log_at<R: Route>(
        &self,
        id: &str,
        offset: u64,
        wait: Duration,
    ) -> Result<LogPiece, ClientError> {
        let path = format!(
            "{}?offset={offset}&wait_ms={}",
            path_of::<R>(id),
            wait.as_millis()
        );
        let resp = self.exchange(method_of::<R>(), &path, None).await?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let next = header(NEXT_OFFSET)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| self.protocol("log answer without an offset"))?;
        let done = header(DONE).as_deref() == Some("true");
        Ok(LogPiece {
            next,
            done,
            bytes: resp.into_body(),
        })
    }
}

/// An answer's body in one buffer. Whoever answers (a peer holding the
/// cluster secret included) may send no more than [`MAX_ANSWER`]: a pack is
/// at most 64 MiB and a chunk.
///
/// The buffer is allocated once at the announced length, and a large one
/// is backed by huge pages where they pay (see `buffers::big_buffer`): collecting 30 MiB
/// packs frame by frame and then into a fresh buffer of 4 KiB pages spent
/// a third of a peer fetch's CPU in page faults (perf, 1 GB from a peer).
/// While the store's fetches run, a buffer whose pack has left memory is
/// taken again instead ([`labsync_store::reuse`]): its pages are faulted
/// already.
async fn collect(mut body: hyper::body::Incoming, length: Option<usize>) -> Result<Bytes, String> {
    let too_long = || format!("an answer of more than {MAX_ANSWER} bytes");
    if length.is_some_and(|n| n > MAX_ANSWER) {
        return Err(too_long());
    }
    let (mut buf, start) = crate::buffers::answer_buffer(length.unwrap_or(0));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Ok(data) = frame.into_data() {
            if buf.len() - start + data.len() > MAX_ANSWER {
                return Err(too_long());
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(labsync_store::reuse::recycled(buf, start))
}

/// The HTTP method of route `R`.
fn method_of<R: Route>() -> hyper::Method {
    match R::VERB {
        Verb::Get => hyper::Method::GET,
        Verb::Post => hyper::Method::POST,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let u: Endpoint = "unix:///run/labsync/labd.sock".parse().unwrap();
        assert_eq!(u, Endpoint::Unix("/run/labsync/labd.sock".into()));
        assert_eq!(u.to_string(), "unix:///run/labsync/labd.sock");
        assert_eq!(
            "/tmp/x.sock".parse(),
            Ok(Endpoint::Unix("/tmp/x.sock".into()))
        );
        assert_eq!(
            "http://gpu3:7420".parse(),
            Ok(Endpoint::Tcp("gpu3:7420".into()))
        );
        assert_eq!("gpu3:7420".parse(), Ok(Endpoint::Tcp("gpu3:7420".into())));
        let tls: Endpoint = "https://gpu3:7420/".parse().unwrap();
        assert_eq!(tls, Endpoint::Tls("gpu3:7420".into()));
        assert_eq!(tls.to_string(), "https://gpu3:7420");
        assert!("gpu3".parse::<Endpoint>().is_err());
        assert!("https://gpu3".parse::<Endpoint>().is_err());
    }

    /// The `VmFlags` of the mapping holding `addr` (`/proc/self/smaps`).
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            if let Some((a, b)) = range.filter(|_| !line.ends_with(':') && !line.contains(": ")) {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
            if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// A pack's buffer is left out of the children labd forks to start
    /// jobs: forking with a gigabyte of packs held copied their page
    /// tables (20 ms per GiB here), and each page written to the cache
    /// after faulted once more. Huge pages only where they pay.
    #[cfg(target_os = "linux")]
    #[test]
    fn pack_buffers_stay_out_of_forked_children() {
        let (buf, start) = crate::buffers::big_buffer(8 << 20);
        let addr = buf.as_ptr() as usize + start + 4096;
        let flags = vm_flags(addr);
        assert!(flags.iter().any(|f| f == "dc"), "{flags:?}");
        assert_eq!(
            flags.iter().any(|f| f == "hg"),
            crate::buffers::huge_pages_pay(),
            "{flags:?}"
        );
        // Small answers come from the heap, whose pages children keep.
        let (small, _) = crate::buffers::big_buffer(1 << 10);
        assert!(!vm_flags(small.as_ptr() as usize).iter().any(|f| f == "dc"));
    }

    /// Answers `head` then `body_len` bytes to one request on a fresh port.
    async fn answer_once(head: String, body_len: usize) -> Endpoint {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0u8; 4096];
            let _ = s.read(&mut req).await;
            let _ = s.write_all(head.as_bytes()).await;
            let piece = vec![7u8; 1 << 20];
            let mut left = body_len;
            while left > 0 {
                let n = left.min(piece.len());
                if s.write_all(&piece[..n]).await.is_err() {
                    return;
                }
                left -= n;
            }
        });
        Endpoint::Tcp(addr.to_string())
    }

    /// A large answer arrives whole (into a buffer starting at a 4 KiB
    /// boundary, for O_DIRECT); one longer than MAX_ANSWER is refused,
    /// whether it says so up front or only sends too much.
    #[tokio::test]
    async fn answers_are_whole_and_bounded() {
        let pack = labsync_store::PackId::from_bytes([3; 32]);
        let len = (5 << 20) + 3;
        let ok = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
        let got = Client::new(answer_once(ok, len).await, None)
            .pack(&pack)
            .await
            .unwrap();
        assert_eq!(got.len(), len);
        assert!(got.iter().all(|&b| b == 7));
        assert_eq!(got.as_ptr() as usize % 4096, 0);

        let announced = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            MAX_ANSWER + 1
        );
        let err = Client::new(answer_once(announced, 1).await, None)
            .pack(&pack)
            .await;
        assert!(err.unwrap_err().to_string().contains("more than"));

        // A 101 switching to the pack protocol, announcing `length` bytes
        // (or nothing).
        let switched = |length: Option<usize>| {
            let announced = length.map_or(String::new(), |n| format!("{}: {n}\r\n", wire::LENGTH));
            format!(
                "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {}\r\n{announced}\r\n",
                wire::PROTOCOL
            )
        };
        let err = Client::new(answer_once(switched(Some(MAX_ANSWER + 1)), 1).await, None)
            .pack(&pack)
            .await;
        assert!(err.unwrap_err().to_string().contains("more than"));

        // A peer that switches without saying how much: refused.
        let err = Client::new(answer_once(switched(None), len).await, None)
            .pack(&pack)
            .await;
        assert!(err.unwrap_err().to_string().contains("without"));

        // One that sends more than it announced: only what it announced
        // is read, into the aligned buffer.
        let got = Client::new(
            answer_once(switched(Some(len)), len + (1 << 20)).await,
            None,
        )
        .pack(&pack)
        .await
        .unwrap();
        assert_eq!(got.len(), len);
        assert!(got.iter().all(|&b| b == 7));
        assert_eq!(got.as_ptr() as usize % 4096, 0);

        // No length: the body ends when the connection closes.
        let endless = "HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n".to_string();
        let err = Client::new(answer_once(endless, MAX_ANSWER + (1 << 20)).await, None)
            .pack(&pack)
            .await;
        assert!(err.unwrap_err().to_string().contains("more than"));
    }
}
