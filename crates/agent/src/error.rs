//! The agent's error types.

/// Why the GPU inventory could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InventoryError {
    /// The NVML library is missing or would not initialise.
    #[error("NVML unavailable: {0}")]
    Unavailable(String),
    /// A call failed.
    #[error("NVML call failed: {0}")]
    Failed(String),
    /// A call did not return within the watchdog's deadline.
    #[error("NVML call did not answer within {0:?}")]
    Hung(std::time::Duration),
    /// A fake inventory's spec or control file is wrong.
    #[error("invalid fake GPU spec: {0}")]
    BadSpec(String),
}

/// Errors of the lease table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The database could not be opened, read or written.
    #[error("lease database {path}: {detail}")]
    Db {
        /// The database file.
        path: String,
        /// What redb said.
        detail: String,
    },
    /// A user has as many jobs queued as one may.
    #[error("{0}")]
    TooMany(String),
}

/// Why an operation of labd (on jobs, trees, stages, warming) was refused
/// or failed, as its caller can act on it. Only the HTTP layer
/// (`api.rs`) turns it into a status code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// No such job (or other thing asked for).
    #[error("{0}")]
    NotFound(String),
    /// The caller may not do this: not theirs, or not allowed them.
    #[error("{0}")]
    Forbidden(String),
    /// The request itself is wrong: asked again as it is, it is refused again.
    #[error("{0}")]
    Invalid(String),
    /// Not in this state: the job has ended, this labd is not the
    /// coordinator, no node could run it.
    #[error("{0}")]
    Conflict(String),
    /// The caller is over a cap (queued jobs per user, a share of the
    /// disk): it may be asked again once some of theirs end.
    #[error("{0}")]
    Busy(String),
    /// What it needs is not reachable now (the store): ask again later.
    #[error("{0}")]
    Unavailable(String),
    /// labd itself failed.
    #[error("{0}")]
    Internal(String),
}

/// Why labd refused a request at its HTTP edge: the caller unknown, or an
/// operation's [`JobError`]. Each maps to one HTTP status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// No token, or one labd does not know (401).
    #[error("no valid token: set LABRUN_TOKEN or `token` in the config file to the token your admin gave you")]
    Unauthorized,
    /// A request between nodes without a valid cluster signature (401).
    #[error("cluster request refused: {0}")]
    NotMember(String),
    /// The operation's own refusal or failure.
    #[error(transparent)]
    Job(#[from] JobError),
}

/// Why a part of labd cannot be set up as configured: said at its start
/// (or by `labsync`, for the store's folder) with what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A TLS certificate, key or CA file.
    #[error("{0}")]
    Tls(String),
    /// The cluster secret.
    #[error("{0}")]
    Secret(String),
    /// No cgroup hierarchy labd can use, or no way to keep jobs from GPUs
    /// in the one it has.
    #[error("{0}")]
    Cgroups(String),
    /// The GPUs' device nodes.
    #[error("{0}")]
    Devices(String),
    /// The store's folder is not safe for a labd that runs as root.
    #[error("{0}")]
    UnsafeStore(String),
}

/// Why a job's code or data could not be made ready.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The store failed (missing snapshot, corrupt chunk, …).
    #[error(transparent)]
    Store(#[from] labsync_store::Error),
    /// labd has not reached the store since it started.
    #[error("{0}")]
    NoStore(String),
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The outputs folder cannot be made in the code tree.
    #[error("--outputs {0}: {1}")]
    Outputs(String, String),
    /// The trees would take their user past their share of the node's
    /// disk (`trees_per_user`).
    #[error("{0}")]
    OverShare(String),
}

impl PrepareError {
    pub(crate) fn io(
        what: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.display().to_string();
        move |source| PrepareError::Io { what, path, source }
    }
}

/// Errors of the labd client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// labd could not be reached.
    #[error("cannot reach labd at {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake failed: an unknown or wrong certificate, or a
    /// labd that does not speak TLS on that port.
    #[error(
        "no TLS with labd at {endpoint}: {detail} (labd's certificate must name that host and be \
         signed by the CA this side trusts: [tls] ca for labd, LABRUN_CA for labrun; and labd \
         must have [tls] set)"
    )]
    Tls {
        /// Where.
        endpoint: String,
        /// Why, as rustls says it.
        detail: String,
    },
    /// labd answered with an error.
    #[error("labd: {message}")]
    Status {
        /// HTTP status.
        status: u16,
        /// labd's message.
        message: String,
    },
    /// The exchange broke off or made no sense.
    #[error("labd at {endpoint}: {detail}")]
    Protocol {
        /// Where.
        endpoint: String,
        /// What.
        detail: String,
    },
}

/// `s` as labd's log may show it: what users control (paths in their
/// outputs, a node name in a refused request) with every control and
/// invisible character escaped (a newline would forge a line of the log),
/// cut at [`LOGGED_CHARS`] characters (a request path may be 400 KB).
pub(crate) fn logged(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == LOGGED_CHARS {
            out.push_str("...");
            break;
        }
        out.extend(c.escape_debug());
    }
    out
}

/// See [`logged`].
pub(crate) const LOGGED_CHARS: usize = 512;

/// Says something at most once per period: what anyone can make labd
/// say by the thousand (a refused request) fills no disk.
#[derive(Debug)]
pub(crate) struct Throttle {
    every: std::time::Duration,
    last: Option<std::time::Instant>,
    held: u64,
}

impl Throttle {
    pub(crate) const fn new(every: std::time::Duration) -> Throttle {
        Throttle {
            every,
            last: None,
            held: 0,
        }
    }

    /// [`Throttle::say`] of the throttle in `slot` (a `static`), now.
    pub(crate) fn say_in(slot: &std::sync::Mutex<Throttle>) -> Option<u64> {
        slot.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .say(std::time::Instant::now())
    }

    /// Whether to say it `now`: `Some(n)` with the `n` times it was not
    /// said since it last was; `None` (counted) within the period.
    pub(crate) fn say(&mut self, now: std::time::Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < self.every)
        {
            self.held += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
mod logged_tests {
    use super::*;

    #[test]
    fn what_users_control_is_logged_escaped_and_cut() {
        let forged = "x\n2026-12-06T05:00:00Z  INFO labsync_agent: job j9 killed by root";
        let l = logged(forged);
        assert!(!l.contains('\n') && l.contains("x\\n2026"), "{l}");
        assert_eq!(logged("a\u{202e}b\rc"), "a\\u{202e}b\\rc");
        let long = logged(&"/".repeat(400_000));
        assert_eq!(long.len(), LOGGED_CHARS + 3);
        assert_eq!(logged("plain/path.pt"), "plain/path.pt");
    }

    #[test]
    fn a_throttle_says_once_per_period_and_counts_the_rest() {
        let every = std::time::Duration::from_secs(10);
        let mut t = Throttle::new(every);
        let t0 = std::time::Instant::now();
        let s = std::time::Duration::from_secs;
        assert_eq!(t.say(t0), Some(0));
        let within: Vec<_> = (1..=9).map(|k| t.say(t0 + s(k))).collect();
        assert!(within.iter().all(Option::is_none), "{within:?}");
        assert_eq!(t.say(t0 + s(10)), Some(9));
        assert_eq!(t.say(t0 + s(15)), None);
        assert_eq!(t.say(t0 + s(30)), Some(1));
    }
}
