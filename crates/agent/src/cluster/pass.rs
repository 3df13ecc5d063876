//! One scheduling pass of the coordinator, as a pure function: from the
//! cluster as the heartbeats show it, the live jobs (their snapshots
//! priced), the users' usage and the time, the [`Action`]s to take.
//! [`super::Coordinator::schedule`] gathers what it reads (the queue, the
//! clock, the store's prices) and carries the actions out; nothing here
//! reads a clock, a database or the network.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use labsync_placer::{
    plan, prefetch, Choice, Decision, Ends, Job, Members, Pass, Policy, Queued, Running, Slot,
    SnapshotKey, Tier, Usage, Warm,
};
use labsync_store::SnapshotId;

use super::queue::{ClusterJob, Placement};
use crate::proto::{Expected, JobId, NodeName, SubmitRequest};

/// How often an unanswered dispatch is sent again.
pub(super) const RESEND: Duration = Duration::from_secs(2);

/// A preempted job still running this long after its node was told to stop
/// it is told again (the node may not have heard).
pub(super) const PREEMPT_AGAIN: Duration = Duration::from_secs(60);

/// What a pass decided, in the order it is to be carried out.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Action {
    /// End job `id`, which never ran, for `why`.
    End {
        /// The job.
        id: JobId,
        /// Why, for `labrun ps`.
        why: String,
    },
    /// Send dispatched job `id` to its node again: it has not answered.
    Resend {
        /// The job.
        id: JobId,
    },
    /// Tell `node` again to stop `id` for `for_job`.
    StopAgain {
        /// The job being preempted.
        id: JobId,
        /// Its node.
        node: NodeName,
        /// The job it makes way for.
        for_job: JobId,
    },
    /// Ask `id`'s node whether it has ended, and keep its record if so.
    Collect {
        /// The job.
        id: JobId,
    },
    /// Warm these nodes with the data of jobs likely to start there.
    Prefetch(Vec<Warm>),
    /// Send queued job `id` to `choice` (its GPUs are promised to it).
    Dispatch {
        /// The job.
        id: JobId,
        /// Where, on which GPUs.
        choice: Choice,
    },
    /// Stop `victims` for job `id`, which waits for their GPUs (`why`).
    Preempt {
        /// The job.
        id: JobId,
        /// The jobs to stop.
        victims: Vec<JobId>,
        /// Why `id` waits, for `labrun ps`.
        why: String,
    },
    /// Record why queued job `id` waits.
    SetWhy {
        /// The job.
        id: JobId,
        /// Why.
        why: String,
    },
}

/// What a pass reads besides the placer's model.
pub(super) struct Inputs<'a> {
    /// The jobs not ended, in the queue's order.
    pub jobs: &'a [ClusterJob],
    /// The snapshots each queued job reads, or why they cannot be priced.
    pub needs: &'a HashMap<JobId, Result<Vec<SnapshotId>, String>>,
    /// Jobs their nodes report ended, still saving their outputs: no
    /// longer holding GPUs (not counted for the cap, never preempted).
    pub ended_on_nodes: &'a HashSet<JobId>,
    /// Who stands in which tier.
    pub members: &'a Members,
    /// Fair-share usage.
    pub usage: &'a Usage,
    /// The placement rule's settings.
    pub policy: &'a Policy,
    /// How long each live job is expected to run, where known (its limit,
    /// its tier's, or an estimate).
    pub expected: &'a HashMap<JobId, Expected>,
    /// When dispatched jobs started on their nodes (Unix seconds), as their
    /// heartbeats say.
    pub started: &'a HashMap<JobId, u64>,
    /// Unix milliseconds.
    pub now_ms: u64,
    /// Whether dispatched jobs are asked after this pass (once a second).
    pub collect: bool,
}

/// The placer's view of `req`, which reads `needs` and is expected to run
/// `expected`.
pub(super) fn placer_job(
    req: &SubmitRequest,
    needs: &[SnapshotId],
    expected: Option<Expected>,
) -> Job {
    Job {
        gpus: req.gpus,
        gpu_mem: req.gpu_mem,
        needs: needs.iter().map(|s| SnapshotKey(*s.as_bytes())).collect(),
        expected_secs: expected.map(|e| e.secs),
        limited: expected.is_some_and(|e| e.limit),
    }
}

/// How long after its limit a job's GPUs are expected free: its node
/// sends SIGTERM at the limit and SIGKILL `kill_grace_s` later (10 s
/// unless set), then says so in a heartbeat; start times are whole
/// seconds. Planned any sooner, the GPUs would read as overdue (no known
/// end) while the job is being stopped, and a job waiting for them would
/// go elsewhere.
pub(super) const STOP_SLACK_MS: u64 = 12_000;

/// When dispatched job `j` is expected to end, Unix ms: from its start on
/// its node (or, before its node said, its dispatch), and for a limit, its
/// stop ([`STOP_SLACK_MS`]).
fn ends_of(
    j: &ClusterJob,
    expected: &HashMap<JobId, Expected>,
    started: &HashMap<JobId, u64>,
) -> Option<Ends> {
    let Placement::Dispatched { at, .. } = &j.placement else {
        return None;
    };
    let e = expected.get(&j.id)?;
    let start = started.get(&j.id).copied().unwrap_or(*at);
    let slack = if e.limit { STOP_SLACK_MS } else { 0 };
    Some(Ends {
        at: (start.saturating_add(e.secs).saturating_mul(1000)).saturating_add(slack),
        limit: e.limit,
    })
}

/// Marks the GPUs of `jobs` dispatched with a known end as expected free
/// then, in `planning`.
pub(super) fn overlay_ends(
    planning: &mut labsync_placer::Cluster,
    jobs: &[ClusterJob],
    expected: &HashMap<JobId, Expected>,
    started: &HashMap<JobId, u64>,
) {
    for j in jobs {
        let (Placement::Dispatched { node, gpus, .. }, Some(ends)) =
            (&j.placement, ends_of(j, expected, started))
        else {
            continue;
        };
        let Some(n) = planning.node_mut(node) else {
            continue;
        };
        for g in n.gpus.iter_mut().filter(|g| gpus.contains(&g.index)) {
            if let Slot::Busy { until: None } = g.slot {
                g.slot = Slot::Busy {
                    until: Some(ends.at),
                };
            }
        }
    }
}

/// The tier `j` runs at `now`: the one it asked for while the user may
/// have it (a deadline grant lapses by itself), else the user's own.
pub(super) fn tier_of(members: &Members, j: &ClusterJob, now: u64) -> Tier {
    members
        .tier_for(&j.user, j.req.priority.as_deref(), now)
        .or_else(|_| members.tier_for(&j.user, None, now))
        .unwrap_or(members.ladder.lowest())
}

/// One pass over `planning` (the cluster with promised GPUs busy, changed
/// as the placer plans on it) and `inputs`.
pub(super) fn pass(planning: &mut labsync_placer::Cluster, inputs: &Inputs) -> Vec<Action> {
    let (now, now_s) = (inputs.now_ms, inputs.now_ms / 1000);
    let up: HashSet<NodeName> = (planning.nodes().iter())
        .filter(|n| n.is_up())
        .map(|n| n.name().clone())
        .collect();
    let mut actions = Vec::new();
    let mut queue = Vec::new();
    let mut running = Vec::new();
    for j in inputs.jobs {
        match &j.placement {
            Placement::Queued { .. } => match inputs.needs.get(&j.id) {
                Some(Ok(needs)) => queue.push(Queued {
                    id: j.id.to_string(),
                    job: placer_job(&j.req, needs, inputs.expected.get(&j.id).copied()),
                    user: j.user.clone(),
                    tier: tier_of(inputs.members, j, now),
                    submitted: j.submitted_at.saturating_mul(1000),
                    preemptible: j.req.preemptible,
                }),
                Some(Err(e)) => actions.push(Action::End {
                    id: j.id.clone(),
                    why: format!("cannot read what it runs on: {e}"),
                }),
                // Queued since the prices were read: the next pass.
                None => {}
            },
            Placement::Dispatched { node, gpus, .. } if !inputs.ended_on_nodes.contains(&j.id) => {
                running.push(Running {
                    id: j.id.to_string(),
                    user: j.user.clone(),
                    tier: tier_of(inputs.members, j, now),
                    node: node.clone(),
                    gpus: gpus.clone(),
                    preemptible: j.req.preemptible,
                    stopping: j.preempted.is_some(),
                    ends: ends_of(j, inputs.expected, inputs.started),
                })
            }
            Placement::Dispatched { .. } | Placement::Ended { .. } => {}
        }
        actions.extend(follow_up(j, inputs, &up, now_s));
    }
    if queue.is_empty() {
        return actions;
    }
    // The GPUs of jobs with known ends are expected free then.
    overlay_ends(planning, inputs.jobs, inputs.expected, inputs.started);
    let input = Pass {
        queue: &queue,
        running: &running,
        usage: inputs.usage,
        ladder: &inputs.members.ladder,
        now,
    };
    let decisions = plan(planning, &input, inputs.policy);
    // While jobs wait, their data goes where they likely start.
    let warms = prefetch(planning, &queue, &decisions, now, inputs.policy);
    if !warms.is_empty() {
        actions.push(Action::Prefetch(warms));
    }
    actions.extend(decisions.into_iter().map(|d| match d {
        Decision::Start { id, choice } => Action::Dispatch {
            id: id.into(),
            choice,
        },
        Decision::Preempt {
            id, why, victims, ..
        } => Action::Preempt {
            id: id.into(),
            victims: victims.into_iter().map(JobId::from).collect(),
            why,
        },
        Decision::Wait { id, why, .. } => Action::SetWhy { id: id.into(), why },
        Decision::Never { id, why } => Action::End {
            id: id.into(),
            why: format!("no node of the cluster can run it: {why}"),
        },
    }));
    actions
}

/// What a dispatched job needs this pass: its dispatch sent again, its
/// stop told again, a look at whether it ended.
fn follow_up(j: &ClusterJob, inputs: &Inputs, up: &HashSet<NodeName>, now_s: u64) -> Vec<Action> {
    let Placement::Dispatched {
        node,
        confirmed,
        at,
        ..
    } = &j.placement
    else {
        return Vec::new();
    };
    let collect = || match inputs.collect {
        true => vec![Action::Collect { id: j.id.clone() }],
        false => Vec::new(),
    };
    if !confirmed {
        let due = now_s.saturating_sub(*at) >= RESEND.as_secs();
        return match due && up.contains(node) {
            true => vec![Action::Resend { id: j.id.clone() }],
            false => Vec::new(),
        };
    }
    match &j.preempted {
        Some(why) if now_s.saturating_sub(j.preempted_at) >= PREEMPT_AGAIN.as_secs() => {
            let for_job = why.trim_start_matches("preempted for ").into();
            let mut out = vec![Action::StopAgain {
                id: j.id.clone(),
                node: node.clone(),
                for_job,
            }];
            out.extend(collect());
            out
        }
        _ => collect(),
    }
}

#[cfg(test)]
mod tests {
    use labsync_placer::{Cluster, Gpu, Health, Ladder, Member, NodeName, PackKey, SnapshotKey};

    use super::*;

    const GIB: u64 = 1 << 30;
    const NOW_S: u64 = 1_000_000;

    fn n(name: &str) -> NodeName {
        name.parse().unwrap()
    }

    /// Node `name` with `free` free GPUs and `busy` busy ones (of 16 GiB).
    fn node(c: &mut Cluster, name: &str, free: u32, busy: u32) {
        let v = c.node_entry(&n(name));
        v.gpus = (0..free + busy).map(|i| Gpu::free(i, 16 * GIB)).collect();
        for g in v.gpus.iter_mut().skip(free as usize) {
            g.slot = labsync_placer::Slot::Busy {
                until: Some(NOW_S * 1000 + 3_600_000),
            };
            g.memory_free = 0;
        }
    }

    fn job(id: &str, user: &str, gpus: u32, placement: Placement) -> ClusterJob {
        ClusterJob {
            id: id.into(),
            user: user.into(),
            req: SubmitRequest {
                argv: vec!["train.py".into()],
                gpus,
                ..Default::default()
            },
            submitted_at: NOW_S - 10,
            placement,
            preempted: None,
            preempted_at: 0,
            charged_to: 0,
        }
    }

    fn queued(id: &str, gpus: u32) -> ClusterJob {
        job(id, "alice", gpus, Placement::Queued { why: None })
    }

    fn dispatched(id: &str, node: &str, at: u64, confirmed: bool) -> ClusterJob {
        let placement = Placement::Dispatched {
            node: node.parse().unwrap(),
            gpus: vec![0],
            at,
            confirmed,
            est_ms: None,
        };
        job(id, "bob", 1, placement)
    }

    /// The state of a pass: the jobs, their prices (none read), nobody's
    /// usage; the nodes up are the cluster's.
    struct State {
        jobs: Vec<ClusterJob>,
        needs: HashMap<JobId, Result<Vec<SnapshotId>, String>>,
        members: Members,
        collect: bool,
        expected: HashMap<JobId, Expected>,
        started: HashMap<JobId, u64>,
    }

    impl State {
        fn of(jobs: Vec<ClusterJob>) -> State {
            let needs = (jobs.iter())
                .filter(|j| matches!(j.placement, Placement::Queued { .. }))
                .map(|j| (j.id.clone(), Ok(Vec::new())))
                .collect();
            State {
                jobs,
                needs,
                members: Members::default(),
                collect: false,
                expected: HashMap::new(),
                started: HashMap::new(),
            }
        }

        fn pass(&self, c: &mut Cluster) -> Vec<Action> {
            let usage = Usage::default();
            let inputs = Inputs {
                jobs: &self.jobs,
                needs: &self.needs,
                ended_on_nodes: &HashSet::new(),
                members: &self.members,
                usage: &usage,
                policy: &Policy::default(),
                expected: &self.expected,
                started: &self.started,
                now_ms: NOW_S * 1000,
                collect: self.collect,
            };
            pass(c, &inputs)
        }
    }

    #[test]
    fn a_queued_job_that_fits_is_dispatched_and_one_that_waits_says_why() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 1);
        let s = State::of(vec![queued("j1", 1), queued("j2", 1)]);
        let got = s.pass(&mut c);
        assert!(
            matches!(&got[0], Action::Dispatch { id, choice }
                if id == "j1" && choice.node == n("a") && choice.gpus == [0]),
            "{got:?}"
        );
        assert!(
            matches!(&got[1], Action::SetWhy { id, why } if id == "j2" && why.contains("a: 1 GPU(s) free in")),
            "{got:?}"
        );
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn a_running_jobs_limit_or_estimate_says_when_its_gpus_free() {
        for (limit, word) in [(true, "limit"), (false, "estimate")] {
            // As heartbeats show a leased GPU: busy, no end known.
            let busy = |c: &mut Cluster| {
                node(c, "a", 0, 1);
                c.node_mut(&n("a")).unwrap().gpus[0].slot =
                    labsync_placer::Slot::Busy { until: None };
            };
            let mut c = Cluster::new();
            busy(&mut c);
            let mut s = State::of(vec![
                dispatched("j1", "a", NOW_S - 100, true),
                queued("j2", 1),
            ]);
            // Started 60 s ago on its node, to run 2 h.
            s.started.insert("j1".into(), NOW_S - 60);
            s.expected
                .insert("j1".into(), Expected { secs: 7200, limit });
            let got = s.pass(&mut c);
            let why = got.iter().find_map(|a| match a {
                Action::SetWhy { id, why } if id == "j2" => Some(why.clone()),
                _ => None,
            });
            let why = why.unwrap_or_else(|| panic!("{got:?}"));
            assert!(
                why.contains(&format!("a: 1 GPU(s) free in ~119 min (j1's {word})")),
                "{why}"
            );
            // No end known: no time said.
            s.expected.clear();
            let mut c2 = Cluster::new();
            busy(&mut c2);
            let got = s.pass(&mut c2);
            assert!(
                got.iter().any(|a| matches!(a, Action::SetWhy { why, .. } if why.contains("busy with no known end"))),
                "{got:?}"
            );
        }
    }

    #[test]
    fn a_job_no_node_can_run_or_that_cannot_be_priced_is_ended() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 0);
        let mut s = State::of(vec![queued("j1", 8), queued("j2", 1)]);
        s.needs
            .insert("j2".into(), Err("snapshot 1a2b: not in the index".into()));
        let got = s.pass(&mut c);
        assert_eq!(
            got[0],
            Action::End {
                id: "j2".into(),
                why: "cannot read what it runs on: snapshot 1a2b: not in the index".into()
            }
        );
        assert!(
            matches!(&got[1], Action::End { id, why }
                if id == "j1" && why.starts_with("no node of the cluster can run it: ")),
            "{got:?}"
        );
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn an_unanswered_dispatch_is_sent_again_while_its_node_is_up() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 1);
        node(&mut c, "b", 0, 1);
        c.node_mut(&n("b")).unwrap().health = Health::Down { since: 1 };
        let due = NOW_S - RESEND.as_secs();
        let jobs = vec![
            dispatched("j1", "a", due, false),
            // Sent a moment ago: not yet.
            dispatched("j2", "a", NOW_S, false),
            // Its node is down: sent when it is back.
            dispatched("j3", "b", due, false),
            // Answered.
            dispatched("j4", "a", due, true),
        ];
        let got = State::of(jobs).pass(&mut c);
        assert_eq!(got, [Action::Resend { id: "j1".into() }]);
    }

    #[test]
    fn running_jobs_are_collected_once_a_second_and_a_stop_is_said_again() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 2);
        let mut stopping = dispatched("j1", "a", NOW_S - 100, true);
        stopping.preempted = Some("preempted for j9".into());
        stopping.preempted_at = NOW_S - PREEMPT_AGAIN.as_secs();
        let mut told = dispatched("j2", "a", NOW_S - 100, true);
        told.preempted = Some("preempted for j9".into());
        told.preempted_at = NOW_S - 1;
        let mut s = State::of(vec![stopping, told]);
        let again = Action::StopAgain {
            id: "j1".into(),
            node: "a".parse().unwrap(),
            for_job: "j9".into(),
        };
        assert_eq!(s.pass(&mut c), std::slice::from_ref(&again));
        s.collect = true;
        assert_eq!(
            s.pass(&mut c),
            [
                again,
                Action::Collect { id: "j1".into() },
                Action::Collect { id: "j2".into() },
            ]
        );
    }

    #[test]
    fn a_higher_tier_preempts_a_preemptible_job_of_a_lower_one() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 1);
        let mut victim = dispatched("j1", "a", NOW_S - 100, true);
        victim.req.preemptible = true;
        let mut s = State::of(vec![victim, queued("j2", 1)]);
        let ladder = Ladder::default();
        let lead = Member {
            tier: ladder.tier("lead").unwrap(),
            deadline_until: None,
        };
        s.members = Members {
            members: HashMap::from([("alice".to_string(), lead)]),
            ladder,
        };
        let got = s.pass(&mut c);
        assert!(
            matches!(&got[..], [Action::Preempt { id, victims, .. }]
                if id == "j2" && victims == &["j1".to_string()]),
            "{got:?}"
        );
    }

    #[test]
    fn the_data_of_a_waiting_job_is_prefetched_where_it_will_likely_start() {
        let mut c = Cluster::new();
        node(&mut c, "a", 0, 1);
        let data = SnapshotId::from_bytes([7; 32]);
        c.add_snapshot(SnapshotKey(*data.as_bytes()), [(PackKey([7; 32]), GIB)]);
        let mut s = State::of(vec![queued("j1", 1)]);
        s.needs.insert("j1".into(), Ok(vec![data]));
        let got = s.pass(&mut c);
        let Action::Prefetch(w) = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!((w[0].node.as_str(), w[0].missing), ("a", GIB));
        assert_eq!(w[0].for_jobs, ["j1"]);
        assert!(matches!(&got[1], Action::SetWhy { id, .. } if id == "j1"));
    }
}
