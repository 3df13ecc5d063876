//! Requests between nodes carry a signature made with the cluster secret,
//! never the secret itself and never a user's token: a node that sees a
//! request learns nothing it could reuse beyond the replay window, and a
//! user's token opens none of these routes.
//!
//! Signed: the method, the path and query, the sending node, the receiving
//! node, the time and the BLAKE3 of the body, under a key derived from the
//! secret. Checked: the signature (constant-time), that this node is the
//! one it was meant for, and the time, within [`SKEW`] of the receiver's
//! clock. The receiver is a node's name, or [`TO_COORDINATOR`] for the
//! coordinator's routes (whose name a node need not know): a request seen
//! on the wire and sent to another node is refused there, so a dispatch
//! captured on its way to gpu2 cannot run the job again on gpu3. The body's hash travels as a header too, so the
//! receiver checks the signature before it reads a byte of the body (then
//! the body against that hash): a sender without the secret cannot make a
//! node hold a large body in memory.
//!
//! A signature is taken once: a receiver remembers those it took for as
//! long as their time is within [`SKEW`], and refuses one again (a
//! request captured on a network without TLS and sent again). Senders
//! sign with a time that never repeats in their process
//! ([`signing_ms`]), so no two of their requests are
//! alike.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::secret::Secret;

/// The wall clock in Unix milliseconds: signatures and heartbeats carry it.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Header: the sending node's name.
pub const NODE: &str = "x-labsync-node";
/// Header: the sender's clock, Unix milliseconds.
pub const TIME: &str = "x-labsync-time";
/// Header: the signature, hex.
pub const SIGNATURE: &str = "x-labsync-signature";
/// Header: the BLAKE3 of the body, hex.
pub const BODY: &str = "x-labsync-body";
/// Header: the node the request is meant for.
pub const TO: &str = "x-labsync-to";
/// The receiver of requests meant for the cluster's coordinator, whichever
/// node it is (no node name can be this: names start with a letter or digit).
pub const TO_COORDINATOR: &str = "@coordinator";

/// How far apart the sender's and receiver's clocks may be, and so how
/// long a captured request could be replayed. Nodes of a lab run NTP.
pub const SKEW: Duration = Duration::from_secs(60);

/// The shortest cluster secret accepted, in characters.
pub const MIN_SECRET: usize = 32;

/// The key requests are signed with, and the signatures it took (shared
/// by its clones: one node's routes).
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
    seen: Arc<Mutex<Seen>>,
}

/// Signatures taken, with their request times, until those are past
/// [`SKEW`] (a request that old is refused anyway).
#[derive(Default)]
struct Seen {
    taken: HashMap<[u8; 32], i64>,
    /// `taken`'s size after the last pruning: pruned again at twice that.
    pruned_at: usize,
}

impl Seen {
    fn has(&self, sig: &blake3::Hash) -> bool {
        self.taken.contains_key(sig.as_bytes())
    }

    /// Takes `sig` (of a request at `time`); false if it was taken before.
    fn take(&mut self, sig: &blake3::Hash, time: i64, now_ms: i64) -> bool {
        if self.taken.len() >= (2 * self.pruned_at).max(1024) {
            let oldest = now_ms - SKEW.as_millis() as i64;
            self.taken.retain(|_, t| *t >= oldest);
            self.pruned_at = self.taken.len();
        }
        self.taken.insert(*sig.as_bytes(), time).is_none()
    }
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<redacted>)")
    }
}

/// Why a request's signature was refused. The caller answers 401 whatever
/// it is, and logs it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// A header is missing or malformed.
    #[error("no cluster signature ({0})")]
    Missing(&'static str),
    /// The clocks are further apart than [`SKEW`], or it is a replay.
    #[error("request time {0} ms off this node's clock (more than {SKEW:?}): check NTP")]
    Skew(i64),
    /// A request this node took already, sent again.
    #[error("a request from {0} this node took already, sent again (a replay)")]
    Replay(String),
    /// Signed for another node: captured on the wire and sent here, or an
    /// address that reaches another node than the sender thinks.
    #[error("a request from {from} meant for {to}, not this node: a replay, or an address that reaches the wrong node")]
    Misdirected {
        /// The signing node.
        from: String,
        /// Whom it was signed for.
        to: String,
    },
    /// Signed with another secret, or altered on the way.
    #[error(
        "bad cluster signature from {0}: a different cluster secret, or the request was altered"
    )]
    Bad(String),
    /// The body is not the one signed.
    #[error("the body from {0} is not the one it signed: altered on the way")]
    BodyAltered(String),
}

impl ClusterKey {
    /// The key of a secret; refuses a short one.
    pub fn new(secret: &Secret) -> Result<ClusterKey, crate::SetupError> {
        let s = secret.expose().trim();
        if s.len() < MIN_SECRET {
            return Err(crate::SetupError::Secret(format!(
                "the cluster secret has {} characters; use at least {MIN_SECRET} random ones \
                 (e.g. openssl rand -hex 32), the same on every node",
                s.len()
            )));
        }
        Ok(ClusterKey {
            key: blake3::derive_key("labsync 2026-12 cluster request signing v2", s.as_bytes()),
            seen: Arc::default(),
        })
    }

    fn mac(&self, r: &Route<'_>, time: i64, body: &blake3::Hash) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        // Lengths first: no two different requests hash the same bytes.
        for part in [r.method, r.path, r.from, r.to].map(str::as_bytes) {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.update(&time.to_le_bytes());
        h.update(body.as_bytes());
        h.finalize()
    }

    /// The headers of the request `r` at `now_ms`.
    pub fn sign(&self, r: &Route<'_>, now_ms: i64, body: &[u8]) -> [(&'static str, String); 5] {
        let hash = blake3::hash(body);
        let mac = self.mac(r, now_ms, &hash);
        [
            (NODE, r.from.to_string()),
            (TO, r.to.to_string()),
            (TIME, now_ms.to_string()),
            (SIGNATURE, mac.to_hex().to_string()),
            (BODY, hash.to_hex().to_string()),
        ]
    }

    /// Checks a request's headers (`get` reads one) before its body is
    /// read: the sending node's name, and the body's hash it signed (which
    /// the caller checks the body against with [`Signed::body`]). `me` are
    /// the receivers this node answers to: its name, and [`TO_COORDINATOR`]
    /// where it coordinates.
    pub fn verify_head(
        &self,
        method: &str,
        path: &str,
        me: &[&str],
        get: impl Fn(&str) -> Option<String>,
        now_ms: i64,
    ) -> Result<Signed, AuthError> {
        let node = get(NODE).ok_or(AuthError::Missing(NODE))?;
        let to = get(TO).ok_or(AuthError::Missing(TO))?;
        let time: i64 = get(TIME)
            .and_then(|t| t.parse().ok())
            .ok_or(AuthError::Missing(TIME))?;
        let sig = get(SIGNATURE)
            .and_then(|s| blake3::Hash::from_hex(s.trim()).ok())
            .ok_or(AuthError::Missing(SIGNATURE))?;
        let body = get(BODY)
            .and_then(|s| blake3::Hash::from_hex(s.trim()).ok())
            .ok_or(AuthError::Missing(BODY))?;
        // Signature first: an unsigned request learns nothing of the clock.
        // blake3::Hash's equality is constant-time.
        let route = Route {
            method,
            path,
            from: &node,
            to: &to,
        };
        if self.mac(&route, time, &body) != sig {
            return Err(AuthError::Bad(node));
        }
        // After the signature: only a member learns whom this node answers to.
        if !me.contains(&to.as_str()) {
            return Err(AuthError::Misdirected { from: node, to });
        }
        let off = time.saturating_sub(now_ms);
        if off.unsigned_abs() > SKEW.as_millis() as u64 {
            return Err(AuthError::Skew(off));
        }
        // Said before the body is read; taken once the body checks out.
        if self.seen.lock().expect("seen poisoned").has(&sig) {
            return Err(AuthError::Replay(node));
        }
        Ok(Signed {
            node,
            body,
            sig,
            time,
            now_ms,
            seen: self.seen.clone(),
        })
    }

    /// [`ClusterKey::verify_head`] and the body: the sending node's name.
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        me: &[&str],
        get: impl Fn(&str) -> Option<String>,
        now_ms: i64,
        body: &[u8],
    ) -> Result<String, AuthError> {
        self.verify_head(method, path, me, get, now_ms)?.body(body)
    }
}

/// What a signature covers besides the time and the body: the request
/// line, who sends it and whom it is for.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    /// `GET`, `POST`, …
    pub method: &'a str,
    /// The path and query.
    pub path: &'a str,
    /// The sending node's name.
    pub from: &'a str,
    /// The receiving node's name, or [`TO_COORDINATOR`].
    pub to: &'a str,
}

/// A request whose headers passed [`ClusterKey::verify_head`].
pub struct Signed {
    node: String,
    body: blake3::Hash,
    sig: blake3::Hash,
    time: i64,
    now_ms: i64,
    seen: Arc<Mutex<Seen>>,
}

impl std::fmt::Debug for Signed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signed").field("node", &self.node).finish()
    }
}

impl Signed {
    /// The sending node's name, once `body` is checked to be the one
    /// signed and the signature taken (refused if it was, meanwhile).
    pub fn body(self, body: &[u8]) -> Result<String, AuthError> {
        if blake3::hash(body) != self.body {
            return Err(AuthError::BodyAltered(self.node));
        }
        let fresh =
            (self.seen.lock().expect("seen poisoned")).take(&self.sig, self.time, self.now_ms);
        if !fresh {
            return Err(AuthError::Replay(self.node));
        }
        Ok(self.node)
    }
}

/// The time a request is signed with: the clock, but never the same
/// millisecond twice in this process, so no two requests it signs are
/// alike and a receiver can refuse one it has seen ([`ClusterKey`]
/// remembers signatures).
pub fn signing_ms() -> i64 {
    use std::sync::atomic::{AtomicI64, Ordering};
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = now_ms();
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let t = now.max(last + 1);
        match LAST.compare_exchange_weak(last, t, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return t,
            Err(seen) => last = seen,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The node the tests' requests are meant for.
    const ME: &[&str] = &["gpu1"];

    fn route<'a>(method: &'a str, path: &'a str, from: &'a str) -> Route<'a> {
        Route {
            method,
            path,
            from,
            to: "gpu1",
        }
    }

    fn key(s: &str) -> ClusterKey {
        ClusterKey::new(&Secret::new(s)).unwrap()
    }

    fn headers(h: &[(&'static str, String); 5]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            h.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn signed_requests_pass_and_anything_else_is_refused() {
        let k = key(&"s".repeat(40));
        let h = k.sign(
            &route("POST", "/v1/cluster/heartbeat", "gpu2"),
            1_000_000,
            b"{}",
        );
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h),
                1_000_500,
                b"{}"
            ),
            Ok("gpu2".to_string())
        );
        // Another secret, another body, path, method or node name: refused.
        let other = key(&"t".repeat(40));
        assert!(matches!(
            other.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h),
                1_000_000,
                b"{}"
            ),
            Err(AuthError::Bad(_))
        ));
        for (m, p) in [
            ("POST", "/v1/cluster/packs/x"),
            ("GET", "/v1/cluster/heartbeat"),
        ] {
            assert!(matches!(
                k.verify(m, p, ME, headers(&h), 1_000_000, b"{}"),
                Err(AuthError::Bad(_))
            ));
        }
        // The same request again (captured and replayed): refused.
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h),
                1_000_900,
                b"{}"
            ),
            Err(AuthError::Replay("gpu2".into()))
        );
        // Another body under the signed hash; another hash in the header.
        let h2 = k.sign(
            &route("POST", "/v1/cluster/heartbeat", "gpu2"),
            1_000_001,
            b"{}",
        );
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h2),
                1_000_000,
                b"{ }"
            ),
            Err(AuthError::BodyAltered("gpu2".into()))
        );
        // A body refused takes nothing: the right one still goes through,
        // once; a clone of the key (another route) knows it too.
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h2),
                1_000_000,
                b"{}"
            ),
            Ok("gpu2".to_string())
        );
        assert_eq!(
            k.clone().verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h2),
                1_000_000,
                b"{}"
            ),
            Err(AuthError::Replay("gpu2".into()))
        );
        let mut rehashed = h.clone();
        rehashed[4].1 = blake3::hash(b"{ }").to_hex().to_string();
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&rehashed),
                1_000_000,
                b"{ }"
            ),
            Err(AuthError::Bad(_))
        ));
        let mut renamed = h.clone();
        renamed[0].1 = "gpu3".into();
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&renamed),
                1_000_000,
                b"{}"
            ),
            Err(AuthError::Bad(_))
        ));
        // Old or future requests.
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h),
                1_000_000 + 61_000,
                b"{}"
            ),
            Err(AuthError::Skew(_))
        ));
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                ME,
                headers(&h),
                1_000_000 - 61_000,
                b"{}"
            ),
            Err(AuthError::Skew(_))
        ));
        // No headers at all, or a user's bearer token only.
        assert_eq!(
            k.verify("GET", "/", ME, |_| None, 0, b""),
            Err(AuthError::Missing(NODE))
        );
    }

    /// Signatures are remembered while their time is within the skew, and
    /// forgotten after (their requests are refused as too old anyway).
    #[test]
    fn signatures_are_remembered_only_within_the_skew() {
        let k = key(&"s".repeat(40));
        let skew = SKEW.as_millis() as i64;
        for t in 0..1024 {
            let h = k.sign(&route("GET", "/v1/cluster/packs/x", "gpu1"), t, b"");
            assert!(k
                .verify("GET", "/v1/cluster/packs/x", ME, headers(&h), t, b"")
                .is_ok());
        }
        // Past the skew, the next one taken prunes them all.
        let late = 1024 + skew + 1;
        let h = k.sign(&route("GET", "/v1/cluster/packs/x", "gpu1"), late, b"");
        assert!(k
            .verify("GET", "/v1/cluster/packs/x", ME, headers(&h), late, b"")
            .is_ok());
        assert_eq!(k.seen.lock().unwrap().taken.len(), 1);
        // Times a process signs with never repeat.
        let mut times: Vec<i64> = (0..1000).map(|_| signing_ms()).collect();
        times.dedup();
        assert_eq!(times.len(), 1000);
    }

    /// Issue 40, point 10: a request captured on its way to one node and
    /// sent to another is refused there, and so is a receiver rewritten on
    /// the way; the coordinator's routes answer only to where it coordinates.
    #[test]
    fn a_request_is_taken_only_by_the_node_it_was_signed_for() {
        let k = key(&"s".repeat(40));
        let to_gpu2 = Route {
            method: "POST",
            path: "/v1/cluster/jobs",
            from: "gpu1",
            to: "gpu2",
        };
        let h = k.sign(&to_gpu2, 1_000, b"{}");
        let on = |me: &[&str]| k.verify("POST", "/v1/cluster/jobs", me, headers(&h), 1_000, b"{}");
        assert_eq!(
            on(&["gpu3"]),
            Err(AuthError::Misdirected {
                from: "gpu1".into(),
                to: "gpu2".into()
            })
        );
        assert_eq!(
            on(&["gpu3", TO_COORDINATOR]),
            Err(AuthError::Misdirected {
                from: "gpu1".into(),
                to: "gpu2".into()
            })
        );
        let mut readdressed = h.clone();
        readdressed[1].1 = "gpu3".into();
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/jobs",
                &["gpu3"],
                headers(&readdressed),
                1_000,
                b"{}"
            ),
            Err(AuthError::Bad(_))
        ));
        let mut unaddressed: HashMap<String, String> =
            h.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        unaddressed.remove(TO);
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/jobs",
                &["gpu2"],
                |n| unaddressed.get(n).cloned(),
                1_000,
                b"{}"
            ),
            Err(AuthError::Missing(TO))
        );
        assert_eq!(on(&["gpu2"]), Ok("gpu1".into()));
        // A heartbeat for the coordinator: taken where it coordinates only.
        let beat = Route {
            to: TO_COORDINATOR,
            path: "/v1/cluster/heartbeat",
            ..to_gpu2
        };
        let h = k.sign(&beat, 2_000, b"{}");
        assert!(matches!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                &["gpu3"],
                headers(&h),
                2_000,
                b"{}"
            ),
            Err(AuthError::Misdirected { .. })
        ));
        assert_eq!(
            k.verify(
                "POST",
                "/v1/cluster/heartbeat",
                &["gpu2", TO_COORDINATOR],
                headers(&h),
                2_000,
                b"{}"
            ),
            Ok("gpu1".into())
        );
    }

    #[test]
    fn short_secrets_are_refused_and_keys_never_print() {
        let e = ClusterKey::new(&Secret::new("short"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 32"), "{e}");
        let k = key(&"x".repeat(32));
        assert_eq!(format!("{k:?}"), "ClusterKey(<redacted>)");
    }
}
