//! When jobs end, as far as the coordinator knows: a job's own limit
//! (`labrun --time`), else its tier's default (`[lab] time_limits`), else
//! an estimate from its user's earlier runs. The placer plans with them:
//! reasons name them, the bounded locality wait weighs them, and backfill
//! lets a job use GPUs reserved for a bigger one if it ends first.
//!
//! **The estimate**: the longest of the user's last [`RUNS_KEPT`] runs
//! that exited 0 with the same command line on code of the same name
//! (`code/alice/proj`, whatever its version). The longest, not the mean:
//! an estimate lets a job into a reservation's gap, and one too short
//! delays the job the gap was kept for. No such run: no estimate, and the
//! job is planned as running for ever (it never backfills).

use std::collections::{HashMap, VecDeque};

use labsync_placer::Tier;

use crate::proto::{Expected, JobView, SubmitRequest};
use crate::JobState;

/// Runs of one kind an estimate looks at.
pub(crate) const RUNS_KEPT: usize = 5;

/// The lengths of users' latest successful runs, by kind.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    by_kind: HashMap<String, VecDeque<u64>>,
}

/// A run's kind: its user, command line and code name.
fn kind(user: &str, req: &SubmitRequest) -> String {
    let code = req.code.as_ref().map_or("", |t| {
        t.label
            .rsplit_once("@v")
            .map_or(t.label.as_str(), |(n, _)| n)
    });
    let mut k = format!("{user}\0{code}");
    for a in &req.argv {
        k.push('\0');
        k.push_str(a);
    }
    k
}

impl Runs {
    /// Learns from `ended`, `user`'s job that ran `req`: its length if it
    /// exited 0.
    pub(crate) fn learn(&mut self, user: &str, req: &SubmitRequest, ended: &JobView) {
        if req.hold_s.is_some() {
            return;
        }
        let ok = matches!(ended.state, JobState::Exited { code: Some(0), .. });
        let (Some(start), Some(end), true) = (ended.started_at, ended.ended_at, ok) else {
            return;
        };
        let runs = self.by_kind.entry(kind(user, req)).or_default();
        runs.push_back(end.saturating_sub(start).max(1));
        while runs.len() > RUNS_KEPT {
            runs.pop_front();
        }
    }

    /// The estimate for `user`'s `req`, seconds.
    pub(crate) fn estimate(&self, user: &str, req: &SubmitRequest) -> Option<u64> {
        self.by_kind.get(&kind(user, req))?.iter().copied().max()
    }
}

/// How long `user`'s `req`, at `tier`, is expected to run.
pub(crate) fn expected(
    user: &str,
    req: &SubmitRequest,
    tier: Tier,
    limits: &HashMap<Tier, u64>,
    runs: &Runs,
) -> Option<Expected> {
    if let Some(h) = req.hold_s {
        return Some(Expected {
            secs: h,
            limit: true,
        });
    }
    let limit = req.time_limit_s.or_else(|| limits.get(&tier).copied());
    match limit {
        Some(secs) => Some(Expected { secs, limit: true }),
        None => runs
            .estimate(user, req)
            .map(|secs| Expected { secs, limit: false }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::TreeRef;

    fn req(argv: &[&str], code: &str) -> SubmitRequest {
        SubmitRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            code: Some(TreeRef {
                label: code.into(),
                snapshot: "ab".repeat(32).parse().unwrap(),
            }),
            ..Default::default()
        }
    }

    fn ran(secs: u64, code: Option<i32>) -> JobView {
        JobView {
            id: "j1".into(),
            node: None,
            user: "alice".into(),
            argv: Vec::new(),
            gpus_wanted: 1,
            gpus: Vec::new(),
            state: JobState::Exited { code, signal: None },
            why: None,
            submitted_at: 0,
            started_at: Some(100),
            ended_at: Some(100 + secs),
            meta: Default::default(),
        }
    }

    #[test]
    fn an_estimate_is_the_longest_of_the_last_five_good_runs_of_the_same_command_and_code() {
        let mut runs = Runs::default();
        let train = req(&["python3", "train.py"], "code/alice/sr@v3");
        assert_eq!(runs.estimate("alice", &train), None);
        for secs in [9000, 100, 200, 300, 400, 500] {
            runs.learn("alice", &train, &ran(secs, Some(0)));
        }
        // The 9000 s run is the sixth back: forgotten.
        assert_eq!(runs.estimate("alice", &train), Some(500));
        // Failures and kills teach nothing.
        runs.learn("alice", &train, &ran(7000, Some(1)));
        runs.learn("alice", &train, &ran(7000, None));
        assert_eq!(runs.estimate("alice", &train), Some(500));
        // Another version of the same code: the same kind.
        assert_eq!(
            runs.estimate("alice", &req(&["python3", "train.py"], "code/alice/sr@v9")),
            Some(500)
        );
        // Another command, code or user: none.
        assert_eq!(
            runs.estimate("alice", &req(&["python3", "eval.py"], "code/alice/sr@v3")),
            None
        );
        assert_eq!(
            runs.estimate("alice", &req(&["python3", "train.py"], "code/alice/x@v3")),
            None
        );
        assert_eq!(runs.estimate("bob", &train), None);
    }

    #[test]
    fn a_limit_comes_from_the_job_then_its_tier_then_history() {
        let mut runs = Runs::default();
        let mut r = req(&["x"], "code/a/b@v1");
        runs.learn("alice", &r, &ran(600, Some(0)));
        let limits = HashMap::from([(Tier(4), 86_400)]);
        let est = Expected {
            secs: 600,
            limit: false,
        };
        assert_eq!(expected("alice", &r, Tier(2), &limits, &runs), Some(est));
        let tiers = Expected {
            secs: 86_400,
            limit: true,
        };
        assert_eq!(expected("alice", &r, Tier(4), &limits, &runs), Some(tiers));
        r.time_limit_s = Some(60);
        let own = Expected {
            secs: 60,
            limit: true,
        };
        assert_eq!(expected("alice", &r, Tier(4), &limits, &runs), Some(own));
    }
}
