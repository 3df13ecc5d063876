//! How `labrun` says what a job is doing (ps, kill, the Ctrl-C message).

use labsync_agent::proto::JobView;
use labsync_agent::JobState;

/// A job's state in words, with outputs still to be saved.
pub(super) fn state_words(j: &JobView) -> String {
    let mut words = job_state_words(j);
    if j.ended() && j.meta.outputs_pending {
        if let Some(e) = &j.meta.outputs_error {
            words += &format!("; outputs not saved yet: {e}, retrying");
        }
    }
    words
}

/// `queued (why)`, `running on GPUs 0,1`, `exited (3)`, ... and, for an
/// ended job labd stopped (a preempted job, a hold given back), why.
fn job_state_words(j: &JobView) -> String {
    let words = base_words(j);
    match (&j.why, j.ended()) {
        (Some(w), true) => format!("{words}: {w}"),
        _ => words,
    }
}

fn base_words(j: &JobView) -> String {
    match &j.state {
        JobState::Queued => match &j.why {
            Some(w) => format!("queued ({w})"),
            None => "queued".into(),
        },
        JobState::Running { .. } => format!(
            "running on GPU{} {}",
            if j.gpus.len() == 1 { "" } else { "s" },
            j.gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
        ended => ended_words(ended),
    }
}

/// How an ended job ended.
fn ended_words(state: &JobState) -> String {
    match state {
        JobState::Exited { code: Some(c), .. } => format!("exited ({c})"),
        JobState::Exited {
            signal: Some(s), ..
        } => format!("killed (signal {s})"),
        JobState::Exited { .. } => "exited".into(),
        // Killed after a restart of labd, which adopted it: not its child,
        // so no exit status; a kill all the same (issue 43: it read
        // `failed: killed` beside others' `killed (signal 15)`).
        JobState::Failed { reason } if reason == "killed" => {
            "killed (no exit status: labd adopted it after a restart)".into()
        }
        JobState::Failed { reason } => format!("failed: {reason}"),
        JobState::Queued | JobState::Running { .. } => "not ended".into(),
    }
}

/// `h:mm:ss` since the job started (until it ended), `-` before.
pub(super) fn runtime(j: &JobView) -> String {
    let Some(start) = j.started_at else {
        return "-".into();
    };
    let end = j.ended_at.unwrap_or_else(labsync_agent::unix_now);
    let s = end.saturating_sub(start);
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_job_reads_killed_whether_labd_started_or_adopted_it() {
        let child = JobState::Exited {
            code: None,
            signal: Some(15),
        };
        assert_eq!(ended_words(&child), "killed (signal 15)");
        let adopted = JobState::Failed {
            reason: "killed".into(),
        };
        assert!(ended_words(&adopted).starts_with("killed ("));
        let failed = JobState::Failed {
            reason: "cannot pull div2k".into(),
        };
        assert_eq!(ended_words(&failed), "failed: cannot pull div2k");
    }
}
