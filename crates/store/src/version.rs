//! A name's version record and where it lives (`refs/<name>/@/<n>`):
//! what the repository writes and what a user's seen versions check.

use serde::{Deserialize, Serialize};

use crate::id::SnapshotId;

/// A name's version: what `refs/<name>/@/<n>` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRecord {
    /// The name, e.g. `div2k` or `runs/42`.
    pub name: String,
    /// 1, 2, 3, …
    pub version: u64,
    /// The tree.
    pub snapshot: SnapshotId,
    /// When it was pushed, seconds since the Unix epoch.
    pub time: i64,
    /// Who pushed it.
    pub user: String,
    /// From which machine.
    pub host: String,
    /// Files in the tree.
    pub files: u64,
    /// Logical size: sum of file sizes.
    pub bytes: u64,
    /// Stored size of the tree's distinct chunks (compressed).
    pub stored_bytes: u64,
    /// Bytes this push added to the store.
    pub new_bytes: u64,
    /// Paths added since the previous version.
    pub added: u64,
    /// Paths removed since the previous version.
    pub removed: u64,
    /// Paths modified since the previous version.
    pub modified: u64,
    /// Set by `labsync forget`: the version is no longer a gc root and is not
    /// listed, but its number stays taken so versions never repeat.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forgotten: bool,
    /// For a job's outputs (`runs/<job>`): what made them, as the labd
    /// that ran the job recorded it. Whoever can write the store can write
    /// a record, so this is the pusher's word: `labrun rerun` reads the
    /// job's own record from labd, not this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
}

/// What made a version of a job's outputs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// The job, `j7`.
    pub job: String,
    /// Its command.
    pub command: Vec<String>,
    /// The code it ran: `code/alice/proj@v3` and its snapshot.
    pub code: Option<(String, SnapshotId)>,
    /// Each dataset: `div2k@v1` and its snapshot.
    pub data: Vec<(String, SnapshotId)>,
    /// The node it ran on.
    pub node: String,
    /// The GPUs it held there.
    pub gpus: Vec<u32>,
    /// The tier it ran at (a cluster's).
    pub tier: Option<String>,
    /// Started and ended, Unix seconds.
    pub started: Option<u64>,
    /// Ended (`None` for a save while it ran).
    pub ended: Option<u64>,
    /// How it ended: `exit 0`, `signal 9`, or why it failed.
    pub exit: Option<String>,
}

impl VersionRecord {
    /// `name@vN`.
    pub fn label(&self) -> String {
        format!("{}@v{}", self.name, self.version)
    }
}

/// Where version `v` of `name` lives.
pub(crate) fn version_key(name: &str, v: u64) -> String {
    format!("refs/{name}/@/{v:010}")
}
