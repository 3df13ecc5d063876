//! Time limits (`labrun --time`, `[lab] time_limits`): a running job past
//! its limit is stopped as `labrun kill` stops one (SIGTERM to all its
//! processes, its outputs saved, SIGKILL after the grace), and its record
//! says it ran out of time.

use super::Daemon;
use crate::blocking::off_runtime;
use crate::leases::{JobRecord, JobState};
use crate::node::NodeError;

/// `2 h 30 min`, `45 s`: a limit in words.
pub(crate) fn limit_words(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let parts: Vec<String> = [(d, "d"), (h, "h"), (m, "min"), (s, "s")]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, u)| format!("{n} {u}"))
        .collect();
    if parts.is_empty() {
        "0 s".into()
    } else {
        parts.join(" ")
    }
}

/// What a job stopped at its limit is told (its `why` once ended).
pub(crate) fn ran_out(limit: u64) -> String {
    format!("ran out of time (its limit of {})", limit_words(limit))
}

/// The jobs among `active` running past their limit at `now` (Unix
/// seconds), not yet told to stop for it. Holds end by themselves.
pub(crate) fn overdue(active: &[JobRecord], now: u64) -> Vec<(crate::ids::JobId, u64)> {
    active
        .iter()
        .filter(|j| matches!(j.state, JobState::Running { .. }) && j.meta.released.is_none())
        .filter(|j| j.meta.hold_s.is_none())
        .filter_map(|j| {
            let limit = j.meta.request.as_ref()?.time_limit_s?;
            let started = j.started_at?;
            (now >= started.saturating_add(limit)).then(|| (j.id.clone(), limit))
        })
        .collect()
}

impl Daemon {
    /// Stops every job among `active` that ran past its time limit, in the
    /// background (the grace of each would hold up the tick).
    pub(super) fn end_overdue(self: &std::sync::Arc<Self>, active: &[JobRecord]) {
        for (id, limit) in overdue(active, self.clock.unix_secs()) {
            let (node, grace, log) = (
                self.node.clone(),
                self.cfg.kill_grace,
                self.node.log_path(&id),
            );
            let why = ran_out(limit);
            // Marked before the kill: the next tick does not stop it again,
            // and its end reads as the limit's, not a user's kill.
            let (n, j, w) = (node.clone(), id.clone(), why.clone());
            let me = self.clone();
            tokio::spawn(async move {
                let marked = off_runtime(move || n.update_meta(&j, |m| m.released = Some(w))).await;
                if let Err(e) = marked {
                    tracing::error!("time limit of {id}: {e}");
                    return;
                }
                let (j, w) = (id.clone(), why.clone());
                let done = off_runtime(move || {
                    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log) {
                        use std::io::Write;
                        let _ = writeln!(
                            f,
                            "labd: {w}: SIGTERM now, SIGKILL in {} s",
                            grace.as_secs()
                        );
                    }
                    node.kill(&j, grace)
                })
                .await;
                match done {
                    Ok(()) | Err(NodeError::Refused(_)) => tracing::info!("job {id} {why}"),
                    Err(e) => tracing::error!("stopping {id} at its time limit: {e}"),
                }
                me.tick().await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_in_words() {
        assert_eq!(limit_words(45), "45 s");
        assert_eq!(limit_words(2 * 3600 + 30 * 60), "2 h 30 min");
        assert_eq!(limit_words(2 * 86_400), "2 d");
        assert_eq!(ran_out(90), "ran out of time (its limit of 1 min 30 s)");
    }
}
