//! The HTTP client for an S3 server spoken to in plain HTTP (a lab's own
//! server on its network), in place of `object_store`'s reqwest client:
//! the same hyper underneath, with one difference on the socket.
//!
//! A server that leaves Nagle's algorithm on and writes a response's head and
//! body separately (s3s-fs does, as does any hyper server by default) holds
//! the body until the client acknowledges the head. Linux delays that
//! acknowledgement by up to 40 ms on a connection in request/response rhythm
//! (a kept-alive one). Every small object then took about 45 ms instead of a
//! fraction of one: a ref, an index object, a tree segment, each on the
//! critical path of `labrun`, two or three times in a row. This client asks
//! the kernel to acknowledge at once (`TCP_QUICKACK`, which the kernel clears
//! again by itself) after every write and every read, so no server's Nagle
//! waits on us. Nothing else changes on the wire.
//!
//! Used only where reqwest's features are not: plain HTTP, no proxy, no
//! client options set (see [`super::Connector`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming};
use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use object_store::client::{
    HttpError, HttpErrorKind, HttpRequest, HttpRequestBody, HttpResponse, HttpResponseBody,
    HttpService,
};
use tokio::net::TcpStream;

/// How long a connection may take to open (`object_store`'s default), in
/// all over the addresses a name resolves to.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an answer may go without a byte: its head (after the request's
/// upload, allowed a second per MiB), then each piece of its body (so a
/// large pack on a slow link is not cut off half way, and a server that
/// stops answering is).
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The client: hyper's pooled one over [`Quick`] connections.
#[derive(Debug)]
pub(crate) struct Plain {
    client: Client<Quick, HttpRequestBody>,
    /// [`IDLE_TIMEOUT`], shorter in tests.
    idle: Duration,
}

impl Plain {
    pub(crate) fn new() -> Plain {
        Plain::with_idle(IDLE_TIMEOUT)
    }

    fn with_idle(idle: Duration) -> Plain {
        // reqwest's connector and settings: Happy Eyeballs over the
        // addresses a name resolves to, keepalive probes on idle sockets.
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
        tcp.set_keepalive(Some(Duration::from_secs(15)));
        tcp.set_keepalive_interval(Some(Duration::from_secs(15)));
        tcp.set_keepalive_retries(Some(3));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_timer(TokioTimer::new())
            .build(Quick(tcp));
        Plain { client, idle }
    }

    async fn send(&self, mut req: HttpRequest) -> Result<HttpResponse, HttpError> {
        if !req.headers().contains_key(hyper::header::USER_AGENT) {
            req.headers_mut().insert(
                hyper::header::USER_AGENT,
                hyper::header::HeaderValue::from_static(concat!(
                    "labsync/",
                    env!("CARGO_PKG_VERSION")
                )),
            );
        }
        let wait = head_timeout(self.idle, req.body().content_length());
        let resp = tokio::time::timeout(wait, self.client.request(req))
            .await
            .map_err(|_| HttpError::new(HttpErrorKind::Timeout, timed_out("an answer", wait)))?
            .map_err(|e| {
                let kind = if e.is_connect() {
                    HttpErrorKind::Connect
                } else {
                    error_kind(&e)
                };
                HttpError::new(kind, e)
            })?;
        Ok(resp.map(|body| {
            // The whole body has a deadline too (as reqwest's 30 s for the
            // whole request had): a server trickling a byte a minute, or
            // streaming without end, is cut off.
            let total = match body.size_hint().exact() {
                Some(n) => head_timeout(self.idle, n.try_into().unwrap_or(usize::MAX)),
                None => self.idle * UNSIZED_BODY_IDLES,
            };
            HttpResponseBody::new(Idle::new(body, self.idle, total))
        }))
    }
}

/// How long an answer's head may take: it comes once the request is sent,
/// so an upload (a pack) is allowed a second per MiB on top of `idle`. The
/// same rule bounds a body of known length.
fn head_timeout(idle: Duration, bytes: usize) -> Duration {
    idle + Duration::from_secs((bytes >> 20) as u64)
}

/// A body of no announced length (a listing) may take this many idle
/// timeouts in all.
const UNSIZED_BODY_IDLES: u32 = 4;

fn timed_out(what: &str, idle: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no byte of {what} within {idle:?}"),
    )
}

http_service!(Plain);

/// A response body that fails once no piece of it came for `idle`, or once
/// it has taken `total` in all.
struct Idle {
    body: Incoming,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl Idle {
    fn new(body: Incoming, idle: Duration, total: Duration) -> Idle {
        Idle {
            body,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            deadline: Box::pin(tokio::time::sleep(total)),
        }
    }
}

impl Body for Idle {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let this = &mut *self;
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(HttpError::new(
                HttpErrorKind::Timeout,
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "an answer took longer in all than its size allows",
                ),
            ))));
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(next);
                Poll::Ready(frame.map(|f| f.map_err(|e| HttpError::new(body_error_kind(&e), e))))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(HttpError::new(
                    HttpErrorKind::Timeout,
                    timed_out("the rest of an answer", this.idle),
                )))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// What object_store makes of the same failure from reqwest
/// (`HttpError::reqwest`): a connection closed or cut mid-answer is asked
/// again (`Request`, `Interrupted`), a stall is a `Timeout`, anything else
/// (a malformed answer) is not retried.
fn error_kind(e: &hyper_util::client::legacy::Error) -> HttpErrorKind {
    chain_kind(e).unwrap_or(HttpErrorKind::Unknown)
}

/// [`error_kind`] for a body's error; hyper's own body errors that say
/// nothing more are a cut connection.
fn body_error_kind(e: &hyper::Error) -> HttpErrorKind {
    chain_kind(e).unwrap_or(HttpErrorKind::Request)
}

fn chain_kind(e: &(dyn std::error::Error + 'static)) -> Option<HttpErrorKind> {
    let mut source = Some(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_closed() || h.is_incomplete_message() || h.is_body_write_aborted() {
                return Some(HttpErrorKind::Request);
            }
            if h.is_timeout() {
                return Some(HttpErrorKind::Timeout);
            }
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            match io.kind() {
                K::TimedOut => return Some(HttpErrorKind::Timeout),
                K::ConnectionAborted | K::ConnectionReset | K::BrokenPipe | K::UnexpectedEof => {
                    return Some(HttpErrorKind::Interrupted)
                }
                _ => {}
            }
        }
        source = s.source();
    }
    None
}

/// Opens [`QuickAck`] connections: hyper-util's connector (reqwest's),
/// then quick acknowledgements on the socket.
#[derive(Clone, Debug)]
pub(crate) struct Quick(HttpConnector);

impl tower_service::Service<Uri> for Quick {
    type Response = QuickAck;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn Future<Output = Result<QuickAck, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::poll_ready(&mut self.0, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = tower_service::Service::call(&mut self.0, uri);
        Box::pin(async move {
            let io = connecting.await?;
            quick_ack(io.inner());
            Ok(QuickAck(io))
        })
    }
}

/// Acknowledges what has arrived at once, and leaves the kernel's
/// delayed-acknowledgement mode until it enters it again by itself.
#[cfg(target_os = "linux")]
fn quick_ack(s: &TcpStream) {
    // Failing (not TCP after all) changes nothing.
    let _ = rustix::net::sockopt::set_tcp_quickack(s, true);
}

#[cfg(not(target_os = "linux"))]
fn quick_ack(_: &TcpStream) {}

/// A TCP connection that acknowledges at once after each read and write.
pub(crate) struct QuickAck(TokioIo<TcpStream>);

impl Connection for QuickAck {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for QuickAck {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let out = Pin::new(&mut self.0).poll_read(cx, buf);
        if out.is_ready() {
            quick_ack(self.0.inner());
        }
        out
    }
}

impl hyper::rt::Write for QuickAck {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let out = Pin::new(&mut self.0).poll_write(cx, buf);
        if out.is_ready() {
            quick_ack(self.0.inner());
        }
        out
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let out = Pin::new(&mut self.0).poll_write_vectored(cx, bufs);
        if out.is_ready() {
            quick_ack(self.0.inner());
        }
        out
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Reads one request head (these requests have no body).
    async fn read_head(s: &mut TcpStream) -> bool {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(1) => head.push(b[0]),
                _ => return false,
            }
        }
        true
    }

    fn get(port: u16, path: &str) -> HttpRequest {
        let mut r = HttpRequest::new(HttpRequestBody::empty());
        *r.uri_mut() = format!("http://127.0.0.1:{port}{path}").parse().unwrap();
        r
    }

    async fn body(resp: HttpResponse) -> Result<Bytes, HttpError> {
        resp.into_body().bytes().await
    }

    /// A server as s3s-fs is: Nagle on, head and body written apart, the
    /// connection kept alive. Every answer comes whole, over one connection.
    #[tokio::test]
    async fn a_server_writing_head_and_body_apart_is_answered_whole_on_one_connection() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut n = 0u32;
                    while read_head(&mut s).await {
                        let body: Vec<u8> = (0..300 + n).map(|i| (i % 251) as u8).collect();
                        let head =
                            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                        s.write_all(head.as_bytes()).await.unwrap();
                        s.write_all(&body).await.unwrap();
                        n += 1;
                    }
                });
            }
        });
        let c = Plain::new();
        for n in 0..20u32 {
            let resp = c.send(get(port, "/bucket/ref")).await.unwrap();
            assert_eq!(resp.status(), 200);
            let want: Vec<u8> = (0..300 + n).map(|i| (i % 251) as u8).collect();
            assert_eq!(body(resp).await.unwrap(), want, "answer {n}");
        }
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "kept alive"
        );
    }

    #[test]
    fn an_upload_is_allowed_a_second_per_mib_before_its_answer() {
        let idle = Duration::from_secs(30);
        assert_eq!(head_timeout(idle, 0), idle);
        assert_eq!(head_timeout(idle, 1 << 19), idle);
        assert_eq!(head_timeout(idle, 64 << 20), Duration::from_secs(94));
    }

    /// What fails is told apart as the retry policy needs it: no server, a
    /// server that never answers, an answer that stops, one cut short.
    #[tokio::test]
    async fn failures_are_classed_for_the_retry_policy() {
        let idle = Duration::from_millis(300);
        let c = Plain::with_idle(idle);
        // No server: a connect error.
        let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = gone.local_addr().unwrap().port();
        drop(gone);
        let e = c.send(get(port, "/x")).await.unwrap_err();
        assert_eq!(e.kind(), HttpErrorKind::Connect, "{e}");

        // `mode` 0: never answers; 1: answers 10 of 100 MiB, then waits;
        // 2: answers 10 of 100 bytes, then closes; 3: answers 100 bytes a
        // byte every 100 ms (never idle, too slow in all); 4: answers
        // garbage.
        let serve = |mode: u8| async move {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = l.local_addr().unwrap().port();
            tokio::spawn(async move {
                let (mut s, _) = l.accept().await.unwrap();
                read_head(&mut s).await;
                let head = |len: u64| format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
                match mode {
                    1 => {
                        let h = head(100 << 20) + "0123456789";
                        s.write_all(h.as_bytes()).await.unwrap();
                    }
                    2 => {
                        let h = head(100) + "0123456789";
                        s.write_all(h.as_bytes()).await.unwrap();
                        return;
                    }
                    3 => {
                        s.write_all(head(100).as_bytes()).await.unwrap();
                        for _ in 0..100 {
                            if s.write_all(b"x").await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                    4 => {
                        let _ = s.write_all(b"not http at all\r\n\r\n").await;
                    }
                    _ => {}
                }
                tokio::time::sleep(Duration::from_secs(30)).await;
                drop(s);
            });
            port
        };
        let e = c.send(get(serve(0).await, "/x")).await.unwrap_err();
        assert_eq!(e.kind(), HttpErrorKind::Timeout, "{e}");
        // An answer whose head came and whose body then fails.
        let body_error = |port: u16| {
            let c = &c;
            async move {
                body(c.send(get(port, "/x")).await.unwrap())
                    .await
                    .unwrap_err()
            }
        };
        let e = body_error(serve(1).await).await;
        assert_eq!(e.kind(), HttpErrorKind::Timeout, "{e}");
        assert!(format!("{e:?}").contains("no byte"), "{e:?}");
        let e = body_error(serve(2).await).await;
        assert_eq!(e.kind(), HttpErrorKind::Interrupted, "{e:?}");
        // 100 bytes may take the idle timeout in all (0 MiB more): a
        // server trickling them 10 s long is cut off, though never idle.
        let e = body_error(serve(3).await).await;
        assert_eq!(e.kind(), HttpErrorKind::Timeout, "{e:?}");
        assert!(format!("{e:?}").contains("in all"), "{e:?}");
        // A malformed answer is not asked again.
        let e = c.send(get(serve(4).await, "/x")).await.unwrap_err();
        assert_eq!(e.kind(), HttpErrorKind::Unknown, "{e:?}");
    }
}
