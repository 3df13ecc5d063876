//! A pack from peer to peer without copies, where the link is plain TCP.
//!
//! Served as a body, a pack was read from the page cache into a buffer and
//! copied from there into the socket: on the serving peer of a 1 GB fetch
//! (follow-bench, perf) those two copies were 55% of its CPU, and hyper's
//! frames added a copy on the fetching side. So a fetching node asks to
//! switch the connection to this protocol (`Upgrade: labsync-pack`), after
//! the request was checked like any other from a cluster member. The peer
//! answers `101 Switching Protocols` with the pack's length in
//! [`LENGTH`], and sends the file with `sendfile(2)`: the kernel hands the
//! page-cache pages to the socket. The fetching node reads exactly that
//! many bytes straight into the buffer the pack is verified and written
//! from, then closes the connection. The serving peer's CPU for 1 GB went
//! from 0.73 s and 0.68 s to 0.23 s and 0.23 s (medians of two 5-run
//! follow-bench runs each, interleaved).
//!
//! TLS needs the bytes in user space, so over TLS (and on a Unix socket)
//! nothing is asked or offered and the pack comes as a body, as before.
//! Either way the fetching node checks every chunk against its id.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The `Upgrade` token of this protocol.
pub const PROTOCOL: &str = "labsync-pack";

/// The header of the `101` answer giving the pack's length in bytes.
pub const LENGTH: &str = "x-labsync-pack-length";

/// A peer that stops reading for this long loses its transfer.
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// A transfer still going after this long is ended, however it trickles.
const SEND_MAX: Duration = Duration::from_secs(600);

/// Transfers at once, each a thread of its own. An upgraded connection no
/// longer counts against labd's connection caps, so these are bounded
/// here; past them a pack goes as a body, as over TLS.
const AT_ONCE: usize = 32;

static SENDING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(AT_ONCE);

/// Room for one more transfer by `sendfile`, if there is any.
pub fn slot() -> Option<tokio::sync::SemaphorePermit<'static>> {
    SENDING.try_acquire().ok()
}

/// Marks requests that came over plain TCP (no TLS): only those may
/// switch, since only there is the socket the file can be sent into.
#[derive(Clone, Copy, Debug)]
pub struct PlainTcp;

/// Sends `len` bytes of `file` on the connection `upgrade` hands over
/// once the `101` answer is out, then calls `sent`; logs what went wrong
/// (the fetching node sees a short pack and fetches it elsewhere).
pub async fn send(
    upgrade: hyper::upgrade::OnUpgrade,
    file: std::fs::File,
    len: u64,
    what: String,
    slot: tokio::sync::SemaphorePermit<'static>,
    sent: impl FnOnce() + Send,
) {
    let _slot = slot;
    let done = async {
        let upgraded = upgrade.await.map_err(io::Error::other)?;
        let parts = upgraded
            .downcast::<TokioIo<TcpStream>>()
            .map_err(|_| io::Error::other("the connection is not plain TCP"))?;
        // Nothing more is read from the peer: what hyper read ahead is
        // dropped with `parts`.
        let socket = parts.io.into_inner().into_std()?;
        crate::blocking::off_runtime(move || send_file(&socket, &file, len)).await
    };
    match done.await {
        Ok(()) => sent(),
        Err(e) => tracing::debug!("sending {what}: {e}"),
    }
}

/// `sendfile(2)` until `len` bytes are out, on the socket made blocking
/// (this runs on a thread of its own: the file side may wait for the disk).
fn send_file(socket: &std::net::TcpStream, file: &std::fs::File, len: u64) -> io::Result<()> {
    socket.set_nonblocking(false)?;
    socket.set_write_timeout(Some(SEND_TIMEOUT))?;
    let (mut offset, started) = (0u64, std::time::Instant::now());
    while offset < len {
        if started.elapsed() > SEND_MAX {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{offset} of {len} bytes sent in {SEND_MAX:?}"),
            ));
        }
        let left = usize::try_from(len - offset)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        match rustix::fs::sendfile(socket, file, Some(&mut offset), left) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads the `len` bytes of a pack after a `101` answer into a buffer
/// from [`crate::buffers::answer_buffer`]: what hyper read past the answer's
/// head first, then straight from the socket. More than `len` bytes, or
/// fewer before the peer closes, is an error.
pub(crate) async fn receive(
    upgraded: hyper::upgrade::Upgraded,
    len: usize,
) -> Result<Bytes, String> {
    use tokio::io::AsyncReadExt;
    let parts = upgraded
        .downcast::<TokioIo<TcpStream>>()
        .map_err(|_| "switched protocols on a connection that is not plain TCP".to_string())?;
    if parts.read_buf.len() > len {
        return Err(format!(
            "the peer sent more than the {len} bytes it announced"
        ));
    }
    let (mut buf, start) = crate::buffers::answer_buffer(len);
    buf.extend_from_slice(&parts.read_buf);
    let mut socket = parts.io.into_inner();
    while buf.len() - start < len {
        let left = (len - (buf.len() - start)) as u64;
        let n = (&mut socket)
            .take(left)
            .read_buf(&mut buf)
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!(
                "the peer closed after {} of the {len} bytes it announced",
                buf.len() - start
            ));
        }
    }
    Ok(labsync_store::reuse::recycled(buf, start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Client, Endpoint};
    use http_body_util::Full;

    /// A server that answers every request by switching to this protocol
    /// and sending `path` with [`send`], announcing `announced` bytes.
    async fn serve_file(path: std::path::PathBuf, announced: u64) -> Endpoint {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
                let path = path.clone();
                async move {
                    let asked = req.headers().get(hyper::header::UPGRADE).cloned();
                    assert_eq!(asked.unwrap(), PROTOCOL);
                    let up = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
                    let file = std::fs::File::open(&path).unwrap();
                    let slot = slot().unwrap();
                    tokio::spawn(send(
                        up.unwrap(),
                        file,
                        announced,
                        "test".into(),
                        slot,
                        || {},
                    ));
                    let resp = hyper::Response::builder()
                        .status(hyper::StatusCode::SWITCHING_PROTOCOLS)
                        .header(hyper::header::CONNECTION, "upgrade")
                        .header(hyper::header::UPGRADE, PROTOCOL)
                        .header(LENGTH, announced)
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .with_upgrades();
            let _ = conn.await;
        });
        Endpoint::Tcp(addr.to_string())
    }

    #[tokio::test]
    async fn a_pack_is_sent_from_the_file_and_arrives_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pack");
        let data: Vec<u8> = (0..(5u32 << 20) + 3).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let id = labsync_store::PackId::from_bytes([1; 32]);

        let ep = serve_file(path.clone(), data.len() as u64).await;
        let got = Client::new(ep, None).pack(&id).await.unwrap();
        assert!(got == data, "the bytes sent are the file's");
        // Ready for an O_DIRECT write from where it is.
        assert_eq!(got.as_ptr() as usize % 4096, 0);

        // A peer that announces more than it sends: an error, not a short pack.
        let ep = serve_file(path, data.len() as u64 + 10).await;
        let err = Client::new(ep, None).pack(&id).await.unwrap_err();
        assert!(err.to_string().contains("closed after"), "{err}");
    }
}
