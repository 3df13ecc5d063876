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
}
