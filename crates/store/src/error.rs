//! The crate's one public error type.
//!
//! Variants are what a caller can act on; module detail maps into them. Messages
//! name the object, path or ref and do not repeat their source, so a CLI that
//! prints the chain (`{:#}`) reads as one sentence.

use std::path::PathBuf;

/// Result alias for the store.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the chunk store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A name, version, snapshot, chunk or object does not exist.
    #[error("{what} not found{hint}")]
    NotFound {
        /// What was looked up, e.g. `ref div2k@v3`.
        what: String,
        /// What the user can do about it (may be empty; starts with "; ").
        hint: String,
    },
    /// The file system of `path` has less room than the work needs; checked
    /// before anything is written, so nothing is half done.
    #[error(
        "not enough space on the file system of {}: {} needed, {} free; free some space \
         (`labsync cache evict` frees the node cache) and run it again",
        path.display(), mib(*needed), mib(*available)
    )]
    NoSpace {
        /// Where it would have been written.
        path: PathBuf,
        /// Bytes the work needs there.
        needed: u64,
        /// Bytes free there.
        available: u64,
    },
    /// Stored data does not match its id or format. Never materialised.
    #[error("corrupt {what}: {detail}")]
    Corrupt {
        /// The object, e.g. `pack 3fa1…`.
        what: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A concurrent writer won; the operation can be retried.
    #[error("conflict on {what}: {detail}")]
    Conflict {
        /// The contended object.
        what: String,
        /// What to do.
        detail: String,
    },
    /// Bad input from the caller: a name, a parameter, a URL.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// The input that was wrong.
        what: String,
        /// Why.
        detail: String,
    },
    /// The name's version holds another snapshot than the one the caller
    /// was told of (see [`crate::PullOptions::expect`]).
    #[error("{label} is snapshot {found}, not {expected} as asked")]
    Moved {
        /// `NAME@vN`.
        label: String,
        /// The snapshot asked for.
        expected: String,
        /// The snapshot the version holds.
        found: String,
    },
    /// A version record that now names another snapshot than it did when
    /// this user (or the job, through `LABRUN_RESUME_FROM`) saw it: anyone
    /// who can write the store overwrote it.
    #[error(
        "{label} was rewritten: {key} now names snapshot {found}, where it named {expected} \
         when {seen}; refusing it (ask an admin to look at who wrote {key})"
    )]
    Rewritten {
        /// `NAME@vN`.
        label: String,
        /// The record's key, `refs/NAME/@/000000000N`.
        key: String,
        /// The snapshot it named before.
        expected: String,
        /// The snapshot it names now.
        found: String,
        /// Where the first was seen: "you pulled it", "it was saved".
        seen: String,
    },
    /// A snapshot entry that would write outside the destination.
    #[error("refusing unsafe path {path:?} in snapshot {snapshot}: {why}")]
    UnsafePath {
        /// The offending path as stored.
        path: String,
        /// The snapshot that contains it.
        snapshot: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// The object store could not be reached or refused the request. One
    /// line: the server's status and message once (the backend's own error
    /// nests three copies of it, so it is kept here but not chained).
    #[error("object store: {op} {key}: {}", crate::http::summary(error))]
    Unavailable {
        /// What was being done (`get`, `put`, `list`, …).
        op: &'static str,
        /// The key or prefix.
        key: String,
        /// The backend's error.
        error: object_store::Error,
    },
    /// The server refused a request that asking again cannot change, and
    /// there is something to do about it (`hint`).
    #[error("object store: {op} {key}: {detail}; {hint}")]
    Refused {
        /// What was being done.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's answer, once.
        detail: String,
        /// What to do.
        hint: &'static str,
    },
    /// A local file operation failed.
    #[error("{op} {}", path.display())]
    Io {
        /// What was being done (`read`, `create`, …).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    pub(crate) fn not_found(what: impl Into<String>) -> Error {
        Error::NotFound {
            what: what.into(),
            hint: String::new(),
        }
    }

    pub(crate) fn corrupt(what: impl Into<String>, detail: impl Into<String>) -> Error {
        Error::Corrupt {
            what: what.into(),
            detail: detail.into(),
        }
    }

    pub(crate) fn invalid(what: impl Into<String>, detail: impl Into<String>) -> Error {
        Error::Invalid {
            what: what.into(),
            detail: detail.into(),
        }
    }

    /// True when the error says the thing does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}
