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

/// `h:mm:ss`.
fn hms(s: u64) -> String {
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// `2 d`, `36 h`, `90 min`, `45 s`: the largest unit that says it whole.
pub(super) fn span(secs: u64) -> String {
    match secs {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{} d", s / 86_400),
        s if s >= 3600 && s % 3600 == 0 => format!("{} h", s / 3600),
        s if s >= 60 && s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// `h:mm:ss` since the job started (until it ended), `-` before; then, for
/// a live job, `/h:mm:ss` its time limit or `/~h:mm:ss` the coordinator's
/// estimate from its user's earlier runs.
pub(super) fn runtime(j: &JobView) -> String {
    let expected = j.meta.expected.or_else(|| {
        let secs = j.meta.request.as_ref()?.time_limit_s?;
        Some(labsync_agent::proto::Expected { secs, limit: true })
    });
    let of = match (expected, j.ended()) {
        (Some(e), false) if e.limit => format!("/{}", hms(e.secs)),
        (Some(e), false) => format!("/~{}", hms(e.secs)),
        _ => String::new(),
    };
    let Some(start) = j.started_at else {
        return format!("-{of}");
    };
    let end = j.ended_at.unwrap_or_else(labsync_agent::unix_now);
    format!("{}{of}", hms(end.saturating_sub(start)))
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
