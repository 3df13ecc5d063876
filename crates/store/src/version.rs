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
