//! The retry policy under the S3 backend, in place of `object_store`'s own,
//! which retries every 5xx (`501 Not Implemented` included, ten times, for
//! nothing) and does not read `Retry-After`.
//!
//! - `500`, `502`, `503` (S3's `SlowDown`), `504`, `408` and `429` are tried
//!   again: after the server's `Retry-After` when it sends one (capped at a
//!   minute), else after an exponential backoff with full jitter (0 to
//!   100 ms, doubling to 10 s), at most [`MAX_RETRIES`] times and
//!   [`MAX_ELAPSED`] in all.
//! - Every other status, `501` and the other 4xx among them, is answered at
//!   once: asking again cannot change it.
//! - A request that failed in transport (refused, reset, timed out) is sent
//!   again: every request labsync makes may be repeated. Objects are written
//!   whole under their final key, and a conditional create that did land
//!   the first time answers "exists" the second, which the caller handles.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::client::{
    ClientOptions, HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpService, ReqwestConnector,
};

/// Retries of one request at most.
pub(crate) const MAX_RETRIES: u32 = 8;
/// Time one request may take with its retries.
pub(crate) const MAX_ELAPSED: Duration = Duration::from_secs(120);

/// `HttpService` for a type with `async fn send(&self, HttpRequest)`.
/// The trait is declared with `async_trait`; this is its expansion, so no
/// macro crate is needed for one method.
macro_rules! http_service {
    ($t:ty) => {
        impl HttpService for $t {
            fn call<'life0, 'async_trait>(
                &'life0 self,
                req: HttpRequest,
            ) -> std::pin::Pin<
                Box<
                    dyn std::future::Future<Output = Result<HttpResponse, HttpError>>
                        + Send
                        + 'async_trait,
                >,
            >
            where
                'life0: 'async_trait,
                Self: 'async_trait,
            {
                Box::pin(self.send(req))
            }
        }
    };
}

mod plain;

/// Builds the HTTP client for the S3 backend, wrapped in [`Retrying`]:
/// [`plain::Plain`] for a server spoken to in plain HTTP with no proxy and
/// no client options set (`plain`), else `object_store`'s own (reqwest).
#[derive(Debug, Default)]
pub(crate) struct Connector {
    pub(crate) plain: bool,
    /// Where the keys listings pass by are kept ([`Retrying::send`]).
    pub(crate) unnamable: Unnamable,
}

impl HttpConnector for Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = if self.plain {
            HttpClient::new(plain::Plain::new())
        } else {
            ReqwestConnector::default().connect(options)?
        };
        Ok(HttpClient::new(Retrying {
            inner,
            unnamable: self.unnamable.clone(),
        }))
    }
}

/// An HTTP client that retries what retrying can fix (see the module).
#[derive(Debug)]
struct Retrying {
    inner: HttpClient,
    unnamable: Unnamable,
}

/// Keys a listing met that `object_store` cannot name (an empty segment as
/// in `index//x`, a `.` or `..` segment, a control character): any member
/// can write one, and one of them failed every listing of its folder, so
/// every push, pull, gc and verify on every node. Listings pass them by;
/// a [`crate::Remote`] remembers the first [`MAX_UNNAMABLE_KEPT`] it met (and
/// counts the rest) for `verify` to report.
#[derive(Clone, Debug, Default)]
pub(crate) struct Unnamable(Arc<Mutex<(BTreeSet<String>, u64)>>);

/// Unnamable keys remembered by name, at most.
const MAX_UNNAMABLE_KEPT: usize = 100;

impl Unnamable {
    /// The keys remembered, and how many more were met.
    pub(crate) fn keys(&self) -> (Vec<String>, u64) {
        let u = self.0.lock().expect("unnamable poisoned");
        (u.0.iter().cloned().collect(), u.1)
    }

    /// Records a key a listing passed by, warning once.
    pub(crate) fn note(&self, key: &str) {
        let mut u = self.0.lock().expect("unnamable poisoned");
        if u.0.contains(key) {
            return;
        }
        tracing::warn!(
            "a listing passed by key {key:?}: no labsync command can name it (an empty, `.` \
             or `..` segment, or a control character); remove it with the server's own tools"
        );
        if u.0.len() < MAX_UNNAMABLE_KEPT {
            u.0.insert(key.to_string());
        } else {
            u.1 += 1;
        }
    }
}

/// Statuses worth asking again.
fn retryable(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

/// A copy of `req` to send again (requests are not `Clone`; bodies are
/// cheap to clone).
fn copy_request(req: &HttpRequest) -> HttpRequest {
    let mut r = HttpRequest::new(req.body().clone());
    *r.method_mut() = req.method().clone();
    *r.uri_mut() = req.uri().clone();
    *r.version_mut() = req.version();
    *r.headers_mut() = req.headers().clone();
    r
}

/// The server's `Retry-After` in seconds, capped at a minute (S3 servers
/// send seconds, not the HTTP-date form).
fn retry_after(resp: &HttpResponse) -> Option<Duration> {
    let v = resp.headers().get("retry-after")?.to_str().ok()?;
    let secs: u64 = v.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(60)))
}

/// A uniform random fraction in `[0, 1)`, for jitter (std's per-call
/// random hash keys; no generator needed for this).
pub(crate) fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let h = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Full jitter: uniform in `[0, min(10 s, 100 ms × 2^retry))`.
fn backoff(retry: u32) -> Duration {
    let cap = Duration::from_millis(100)
        .saturating_mul(1 << retry.min(7))
        .min(Duration::from_secs(10));
    cap.mul_f64(random_fraction())
}

impl Retrying {
    async fn send(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let listing = req.method() == hyper::Method::GET
            && req.uri().query().is_some_and(|q| q.contains("list-type=2"));
        let resp = self.send_retrying(req).await?;
        if !listing || resp.status() != hyper::StatusCode::OK {
            return Ok(resp);
        }
        // A listing's page is parsed whole by `object_store`: one key it
        // cannot name fails the page, so every listing of that folder.
        let (parts, body) = resp.into_parts();
        let body = body.bytes().await?;
        let kept = match without_unnamable(&body) {
            Some((kept, passed)) => {
                passed.iter().for_each(|k| self.unnamable.note(k));
                bytes::Bytes::from(kept)
            }
            None => body,
        };
        Ok(HttpResponse::from_parts(parts, kept.into()))
    }

    async fn send_retrying(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let started = Instant::now();
        let mut retry = 0;
        loop {
            let out = self.inner.execute(copy_request(&req)).await;
            let wait = match &out {
                Ok(resp) if retryable(resp.status().as_u16()) => {
                    retry_after(resp).unwrap_or_else(|| backoff(retry))
                }
                Ok(_) => return out,
                Err(e) => match e.kind() {
                    HttpErrorKind::Connect
                    | HttpErrorKind::Request
                    | HttpErrorKind::Timeout
                    | HttpErrorKind::Interrupted => backoff(retry),
                    _ => return out,
                },
            };
            if retry >= MAX_RETRIES || started.elapsed() + wait > MAX_ELAPSED {
                return out;
            }
            retry += 1;
            tracing::debug!(
                "{} {}: {}; retry {retry} of {MAX_RETRIES} in {wait:?}",
                req.method(),
                req.uri().path(),
                match &out {
                    Ok(r) => r.status().to_string(),
                    Err(e) => e.to_string(),
                }
            );
            tokio::time::sleep(wait).await;
        }
    }
}

http_service!(Retrying);

/// An S3 `ListObjectsV2` answer without the objects whose keys
/// `object_store` cannot name, and those keys; `None` when every key can
/// be named (the answer is passed on as it came). The answer is scanned,
/// not parsed: each `<Contents>` element holds one `<Key>`, and `<` never
/// appears escaped-free inside a key.
fn without_unnamable(body: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
    let text = std::str::from_utf8(body).ok()?;
    let (open, close) = ("<Contents>", "</Contents>");
    let mut kept = String::with_capacity(text.len());
    let mut passed = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let Some(len) = rest[start..].find(close) else {
            break;
        };
        let end = start + len + close.len();
        let element = &rest[start..end];
        kept.push_str(&rest[..start]);
        match element_key(element) {
            Some(key) if object_store::path::Path::parse(&key).is_err() => passed.push(key),
            _ => kept.push_str(element),
        }
        rest = &rest[end..];
    }
    kept.push_str(rest);
    (!passed.is_empty()).then(|| (kept.into_bytes(), passed))
}

/// The text of the `<Key>` of one `<Contents>` element, unescaped.
fn element_key(element: &str) -> Option<String> {
    let start = element.find("<Key>")? + "<Key>".len();
    let len = element[start..].find("</Key>")?;
    unescape_xml(&element[start..start + len])
}

/// XML text with its five named entities and numeric references replaced.
fn unescape_xml(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        let semi = rest[amp..].find(';')? + amp;
        let name = &rest[amp + 1..semi];
        let c = match name {
            "amp" => '&',
            "lt" => '<',
            "gt" => '>',
            "quot" => '"',
            "apos" => '\'',
            _ => {
                let n = match name.strip_prefix("#x").or_else(|| name.strip_prefix("#X")) {
                    Some(hex) => u32::from_str_radix(hex, 16).ok()?,
                    None => name.strip_prefix('#')?.parse().ok()?,
                };
                char::from_u32(n)?
            }
        };
        out.push(c);
        rest = &rest[semi + 1..];
    }
    out.push_str(rest);
    Some(out)
}

/// The HTTP status in an `object_store` error, if the server answered one.
/// `object_store` keeps it in a private type, so it is read from the
/// message ("... status code: 501 Not Implemented ..."); a test with a real
/// server answering `501` guards the format.
pub(crate) fn status_of(e: &object_store::Error) -> Option<u16> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        let text = s.to_string();
        if let Some(i) = text.find("status code: ") {
            let code = text[i + 13..].get(..3)?;
            return code.parse().ok();
        }
        source = s.source();
    }
    None
}

/// One line for an `object_store` error: the server's status and its own
/// message (`<Code>` and `<Message>` of an S3 error body) once, or the
/// innermost cause of a transport failure, instead of the three nested
/// copies of one text that its error chain prints.
pub(crate) fn summary(e: &object_store::Error) -> String {
    let mut innermost: &(dyn std::error::Error + 'static) = e;
    while let Some(s) = innermost.source() {
        innermost = s;
    }
    let text = e.to_string();
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{name}>"))? + start;
        Some(text[start..end].trim().to_string())
    };
    match status_of(e) {
        Some(_) => {
            let reason = text
                .find("status code: ")
                .map(|i| &text[i + 13..])
                .and_then(|t| t.split(':').next())
                .unwrap_or("")
                .trim()
                .to_string();
            match (tag("Code"), tag("Message")) {
                (Some(code), Some(msg)) => format!("the server answered {reason}: {code}: {msg}"),
                (Some(code), None) => format!("the server answered {reason}: {code}"),
                _ => format!("the server answered {reason}"),
            }
        }
        None => innermost.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_under_its_cap_and_varies() {
        let waits: Vec<Duration> = (0..50).map(|_| backoff(3)).collect();
        assert!(waits.iter().all(|w| *w < Duration::from_millis(800)));
        assert!(waits.iter().any(|w| *w != waits[0]), "jittered");
        assert!((0..50).all(|_| backoff(30) < Duration::from_secs(10)));
    }

    /// A listing's page loses the objects whose keys no command can name,
    /// escaped or not, and keeps the others and the rest of the answer.
    #[test]
    fn a_listing_page_passes_unnamable_keys_by() {
        let page = "<?xml version=\"1.0\"?><ListBucketResult><Name>b</Name>\
            <Contents><Key>index/a</Key><Size>1</Size></Contents>\
            <Contents><Key>index//x</Key><Size>2</Size></Contents>\
            <Contents><Key>index/c&amp;d</Key><Size>3</Size></Contents>\
            <Contents><Key>index/e&#x1;f</Key><Size>4</Size></Contents>\
            <Contents><Key>index/g\u{7}h</Key><Size>5</Size></Contents>\
            <Contents><Key>index/../y</Key><Size>6</Size></Contents>\
            <NextContinuationToken>t</NextContinuationToken></ListBucketResult>";
        let (kept, passed) = without_unnamable(page.as_bytes()).unwrap();
        let kept = String::from_utf8(kept).unwrap();
        assert_eq!(
            passed,
            ["index//x", "index/e\u{1}f", "index/g\u{7}h", "index/../y"]
        );
        assert!(kept.contains("<Key>index/a</Key>") && kept.contains("index/c&amp;d"));
        assert!(!kept.contains("index//x") && !kept.contains("&#x1;"));
        assert!(
            kept.ends_with("<NextContinuationToken>t</NextContinuationToken></ListBucketResult>")
        );
        let fine = "<ListBucketResult><Contents><Key>refs/a</Key></Contents></ListBucketResult>";
        assert!(without_unnamable(fine.as_bytes()).is_none());
    }

    #[test]
    fn only_what_retrying_can_fix_is_retried() {
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(retryable(s), "{s}");
        }
        for s in [400, 403, 404, 409, 412, 501] {
            assert!(!retryable(s), "{s}");
        }
    }
}
