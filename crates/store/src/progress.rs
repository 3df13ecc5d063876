//! Progress reporting, as a trait so the library never prints: the CLI
//! implements it with indicatif, tests and scripts with [`NoProgress`].

/// Receives progress of long work. Calls are cheap and may come from any thread.
pub trait Progress: Send + Sync {
    /// A new phase begins (`scan`, `upload`, `download`, `write`, …) with the
    /// totals when known.
    fn phase(&self, name: &str, total_bytes: Option<u64>, total_items: Option<u64>);
    /// Work done in the current phase since the last call.
    fn advance(&self, bytes: u64, items: u64);
    /// A warning the user should see (a file skipped, a retry).
    fn warn(&self, message: &str);
}

/// Discards progress.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn phase(&self, _: &str, _: Option<u64>, _: Option<u64>) {}
    fn advance(&self, _: u64, _: u64) {}
    fn warn(&self, _: &str) {}
}
