//! What labd counts for `/metrics` (Prometheus' text format, version
//! 0.0.4): jobs started and ended by outcome, how long jobs waited, and
//! how long labd took to answer each route. The gauges (GPUs, caches, the
//! queue) are read from the same board the web page shows ([`crate::web`]).
//!
//! The counters are process-wide statics, not fields of the daemon: one
//! labd runs per process, every count only grows, and the places that
//! count (the job database's commit, the coordinator's dispatch, the HTTP
//! layer) would otherwise all need a handle threaded to them for a number
//! only `/metrics` reads.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::leases::JobState;

/// The upper bounds (seconds) of the queue-wait histogram: ten seconds to
/// a week, where a lab's waits fall.
pub const WAIT_BOUNDS: [f64; 10] = [
    10.0, 60.0, 300.0, 900.0, 3600.0, 14_400.0, 43_200.0, 86_400.0, 259_200.0, 604_800.0,
];

/// The upper bounds (seconds) of the request-latency histogram.
pub const LATENCY_BOUNDS: [f64; 9] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0];

/// A Prometheus histogram over fixed bounds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hist {
    /// Observations at or below each bound (not cumulative).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Hist {
    /// Counts `v` against `bounds`.
    pub fn observe(&mut self, bounds: &[f64], v: f64) {
        if self.counts.len() != bounds.len() {
            self.counts = vec![0; bounds.len()];
        }
        if let Some(i) = bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Writes the histogram's samples (`_bucket`, `_sum`, `_count`) for
    /// `name` with `labels`.
    fn write(&self, out: &mut String, name: &str, labels: &[(&str, &str)], bounds: &[f64]) {
        let mut cum = 0;
        for (i, b) in bounds.iter().enumerate() {
            cum += self.counts.get(i).copied().unwrap_or(0);
            let le = format!("{b}");
            let mut l = labels.to_vec();
            l.push(("le", &le));
            sample(out, &format!("{name}_bucket"), &l, cum as f64);
        }
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        sample(out, &format!("{name}_bucket"), &l, self.count as f64);
        sample(out, &format!("{name}_sum"), labels, self.sum);
        sample(out, &format!("{name}_count"), labels, self.count as f64);
    }
}

/// How a job ended, as `/metrics` labels it.
pub const OUTCOMES: [&str; 5] = ["succeeded", "failed", "killed", "preempted", "lost"];

/// The outcome of an ended job: exit 0, another exit code, a signal
/// (`labrun kill`, out of memory), stopped for a higher tier, or ended
/// without an exit status (its node lost it).
pub fn outcome(state: &JobState, preempted: bool) -> Option<&'static str> {
    Some(match state {
        _ if preempted && matches!(state, JobState::Exited { .. }) => "preempted",
        JobState::Exited { code: Some(0), .. } => "succeeded",
        JobState::Exited { code: Some(_), .. } => "failed",
        JobState::Exited { .. } => "killed",
        JobState::Failed { .. } => "lost",
        JobState::Queued | JobState::Running { .. } => return None,
    })
}

/// Jobs started and ended, and their waits: one set for the jobs a node
/// runs, one for the cluster's queue.
pub struct Jobs {
    started: AtomicU64,
    ended: Mutex<[u64; OUTCOMES.len()]>,
    wait: Mutex<Option<Hist>>,
}

impl Jobs {
    const fn new() -> Jobs {
        Jobs {
            started: AtomicU64::new(0),
            ended: Mutex::new([0; OUTCOMES.len()]),
            wait: Mutex::new(None),
        }
    }

    /// A job started (or, for the cluster, was placed) after waiting
    /// `waited_s` seconds since it was submitted.
    pub fn started(&self, waited_s: u64) {
        self.started.fetch_add(1, Ordering::Relaxed);
        let mut w = self.wait.lock().expect("metrics poisoned");
        w.get_or_insert_with(Hist::default)
            .observe(&WAIT_BOUNDS, waited_s as f64);
    }

    /// A job ended as `outcome` (one of [`OUTCOMES`]).
    pub fn ended(&self, outcome: &str) {
        if let Some(i) = OUTCOMES.iter().position(|o| *o == outcome) {
            self.ended.lock().expect("metrics poisoned")[i] += 1;
        }
    }

    /// A job's state went from `before` to `after` (submitted and started
    /// at those Unix seconds; `preempted`: stopped for a higher tier):
    /// counted where it started or ended.
    pub fn changed(
        &self,
        before: Option<&JobState>,
        after: &JobState,
        submitted_at: u64,
        started_at: Option<u64>,
        preempted: bool,
    ) {
        let running = |s: &JobState| matches!(s, JobState::Running { .. });
        let ended = |s: &JobState| matches!(s, JobState::Exited { .. } | JobState::Failed { .. });
        if running(after) && !before.is_some_and(running) {
            let at = started_at.unwrap_or(submitted_at);
            self.started(at.saturating_sub(submitted_at));
        }
        // Only from a known live state: an ended record written again
        // (its outputs saved) is no second end.
        if ended(after) && before.is_some_and(|b| !ended(b)) {
            if let Some(o) = outcome(after, preempted) {
                self.ended(o);
            }
        }
    }

    fn write(&self, out: &mut String, prefix: &str, what: &str) {
        family(
            out,
            &format!("{prefix}_jobs_started_total"),
            "counter",
            &format!("Jobs {what} since labd started."),
        );
        sample(
            out,
            &format!("{prefix}_jobs_started_total"),
            &[],
            self.started.load(Ordering::Relaxed) as f64,
        );
        let name = format!("{prefix}_jobs_ended_total");
        family(
            out,
            &name,
            "counter",
            "Jobs ended since labd started, by outcome.",
        );
        let ended = *self.ended.lock().expect("metrics poisoned");
        for (o, n) in OUTCOMES.iter().zip(ended) {
            sample(out, &name, &[("outcome", o)], n as f64);
        }
        let name = format!("{prefix}_job_wait_seconds");
        family(
            out,
            &name,
            "histogram",
            &format!("Seconds from submission until a job was {what}."),
        );
        let w = self.wait.lock().expect("metrics poisoned").clone();
        w.unwrap_or_default().write(out, &name, &[], &WAIT_BOUNDS);
    }
}

/// The upper bounds (seconds) of the staging histograms: a cached dataset
/// to an hour's fetch.
pub const STAGING_BOUNDS: [f64; 10] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Placements: the placer's estimate of each job's staging on the node it
/// chose, and the staging as it went (dispatch to start), counted as the
/// job ends.
pub struct Staging {
    both: Mutex<Option<(Hist, Hist)>>,
}

impl Staging {
    /// A job placed with an estimate of `est` seconds staged in `actual`.
    pub fn staged(&self, est: f64, actual: f64) {
        let mut b = self.both.lock().expect("metrics poisoned");
        let (e, a) = b.get_or_insert_with(Default::default);
        e.observe(&STAGING_BOUNDS, est);
        a.observe(&STAGING_BOUNDS, actual);
    }

    fn write(&self, out: &mut String) {
        let (e, a) = self
            .both
            .lock()
            .expect("metrics poisoned")
            .clone()
            .unwrap_or_default();
        for (name, h, what) in [
            (
                "labsync_cluster_staging_estimated_seconds",
                e,
                "the placer's estimate",
            ),
            (
                "labsync_cluster_staging_actual_seconds",
                a,
                "dispatch to start, as it went",
            ),
        ] {
            family(
                out,
                name,
                "histogram",
                &format!("Staging of ended jobs on the node the placer chose: {what}."),
            );
            h.write(out, name, &[], &STAGING_BOUNDS);
        }
    }
}

/// The cluster's placements.
pub static STAGING: Staging = Staging {
    both: Mutex::new(None),
};

/// The jobs this labd's node ran.
pub static NODE_JOBS: Jobs = Jobs::new();
/// The jobs the cluster's queue placed (on the coordinator).
pub static CLUSTER_JOBS: Jobs = Jobs::new();

/// Request latency by route (the route's pattern, never the path asked
/// for: a caller must not grow this map).
static REQUESTS: Mutex<BTreeMap<String, Hist>> = Mutex::new(BTreeMap::new());

/// One request to `route` (a route's pattern, or `unmatched`) took `secs`.
pub fn request(route: &str, secs: f64) {
    let mut r = REQUESTS.lock().expect("metrics poisoned");
    match r.get_mut(route) {
        Some(h) => h.observe(&LATENCY_BOUNDS, secs),
        None => r
            .entry(route.to_string())
            .or_default()
            .observe(&LATENCY_BOUNDS, secs),
    }
}

/// Writes the job counters (the cluster's on a coordinator, else the
/// node's) and the request latencies.
pub fn write_counters(out: &mut String, cluster: bool) {
    if cluster {
        CLUSTER_JOBS.write(
            out,
            "labsync_cluster",
            "placed on a node (counted when the node took it)",
        );
        STAGING.write(out);
    }
    NODE_JOBS.write(out, "labsync_node", "started on this node");
    let name = "labsync_request_duration_seconds";
    family(
        out,
        name,
        "histogram",
        "Seconds labd took to answer, by route.",
    );
    let requests = REQUESTS.lock().expect("metrics poisoned").clone();
    for (route, h) in &requests {
        h.write(out, name, &[("route", route)], &LATENCY_BOUNDS);
    }
}

/// A family's `# HELP` and `# TYPE` lines.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One sample line; label values escaped as the format asks (`\\`, `\"`,
/// `\n`): a node's, user's or dataset's name is anyone's to choose.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        out.push('}');
    }
    let _ = if value.is_finite() {
        writeln!(out, " {value}")
    } else {
        writeln!(out, " NaN")
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_buckets_are_cumulative() {
        let mut out = String::new();
        sample(&mut out, "x", &[("node", "a\"b\\c\nd")], 1.5);
        assert_eq!(out, "x{node=\"a\\\"b\\\\c\\nd\"} 1.5\n");
        let mut h = Hist::default();
        for v in [0.5, 5.0, 5.0, 1e9] {
            h.observe(&[1.0, 10.0], v);
        }
        let mut out = String::new();
        h.write(&mut out, "w", &[], &[1.0, 10.0]);
        assert!(out.contains("w_bucket{le=\"1\"} 1\n"), "{out}");
        assert!(out.contains("w_bucket{le=\"10\"} 3\n"), "{out}");
        assert!(out.contains("w_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("w_count 4\n"), "{out}");
    }

    #[test]
    fn outcomes_name_how_a_job_ended() {
        let exited = |code, signal| JobState::Exited { code, signal };
        assert_eq!(outcome(&exited(Some(0), None), false), Some("succeeded"));
        assert_eq!(outcome(&exited(Some(3), None), false), Some("failed"));
        assert_eq!(outcome(&exited(None, Some(9)), false), Some("killed"));
        assert_eq!(outcome(&exited(None, Some(15)), true), Some("preempted"));
        let lost = JobState::Failed {
            reason: "gone".into(),
        };
        assert_eq!(outcome(&lost, false), Some("lost"));
        assert_eq!(outcome(&JobState::Queued, false), None);
    }
}
