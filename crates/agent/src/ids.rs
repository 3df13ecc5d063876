//! The ids at the agent's edges, typed: a job's id is not a user's name,
//! a node's name or a path, and the compiler says so. Each one is stored
//! and sent as the string it replaced (`serde(transparent)`, or the
//! placer's checked [`NodeName`]): the wire and the databases do not change.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

pub use labsync_placer::NodeName;
pub use labsync_store::SnapshotId;

/// A job's id: `j<N>`, unique on its node, or in its cluster where a
/// coordinator numbers them (outputs go to `runs/<id>`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(String);

impl JobId {
    /// The id of job number `n`.
    pub fn numbered(n: u64) -> JobId {
        JobId(format!("j{n}"))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its number, for an id of the form `j<N>`.
    pub fn number(&self) -> Option<u64> {
        self.0.strip_prefix('j')?.parse().ok()
    }
}

impl Deref for JobId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for JobId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for JobId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for JobId {
    fn from(s: String) -> JobId {
        JobId(s)
    }
}

impl From<&str> for JobId {
    fn from(s: &str) -> JobId {
        JobId(s.to_string())
    }
}

impl From<JobId> for String {
    fn from(id: JobId) -> String {
        id.0
    }
}

impl PartialEq<str> for JobId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for JobId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for JobId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<JobId> for str {
    fn eq(&self, other: &JobId) -> bool {
        self == other.0
    }
}

impl PartialEq<JobId> for &str {
    fn eq(&self, other: &JobId) -> bool {
        *self == other.0
    }
}

impl PartialEq<JobId> for String {
    fn eq(&self, other: &JobId) -> bool {
        *self == other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_id_is_sent_and_stored_as_the_string_it_replaced() {
        let id = JobId::numbered(12);
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"j12\"");
        let back: JobId = serde_json::from_str("\"j12\"").unwrap();
        assert_eq!(back, id);
        assert_eq!(back.number(), Some(12));
        assert_eq!(JobId::from("job1").number(), None);
        assert_eq!(id, "j12");
        assert_eq!("j12", id);
    }
}
