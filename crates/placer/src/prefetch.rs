//! While jobs wait: which data to warm where, and which held GPUs to give
//! back.

use std::collections::HashMap;

use crate::cluster::{Cluster, Millis, NodeName, SnapshotKey};
use crate::lab::span;
use crate::place::{rank, Policy, Verdict};
use crate::queue::{Decision, Queued};

/// A snapshot to warm on a node.
#[derive(Clone, Debug, PartialEq)]
pub struct Warm {
    /// Where.
    pub node: NodeName,
    /// What.
    pub snapshot: SnapshotKey,
    /// Bytes of it the node lacks.
    pub missing: u64,
    /// The waiting jobs it is for.
    pub for_jobs: Vec<String>,
}

/// What to warm while jobs wait, given a pass's decisions (and the view
/// after it: starts already count as present where they go).
///
/// Each waiting job's data goes to the node it most likely gets: the one
/// it waits for, the one it preempts on, or else the node of its ranking
/// that lacks the fewest bytes and can ever run it. A snapshot several
/// waiting jobs want goes to as many of their likely nodes, up to
/// [`Policy::replicas_max`]: each copy is one more node that can start
/// them at once. Packs shared between snapshots (DIV2K inside DF2K, a new
/// version of a dataset) count as present, so only what differs moves.
///
/// Each copy is charged to the first user, in queue order, of the jobs
/// that want it who has not had [`Policy::prefetch_per_user`] copies
/// already; a copy no such user wants is not made. Copies already whole
/// where a waiting job would go count too, charged the same way: a pass
/// warms only what the last ones left of a user's share, not that many
/// more each time. So one user's many waiting jobs keep at most that many
/// copies warm, however many datasets they name and however long they
/// wait, and never crowd out another user's.
pub fn prefetch(
    cluster: &Cluster,
    queue: &[Queued],
    decisions: &[Decision],
    now: Millis,
    policy: &Policy,
) -> Vec<Warm> {
    let by_id: HashMap<&str, &Queued> = queue.iter().map(|q| (q.id.as_str(), q)).collect();
    // Per snapshot: the jobs that want it and, per job, its nodes best first.
    type Wanted<'q> = (SnapshotKey, Vec<&'q Queued>, Vec<Vec<NodeName>>);
    let mut wanted: Vec<Wanted<'_>> = Vec::new();
    for d in decisions {
        let Some(q) = by_id.get(d.id()) else {
            continue;
        };
        let first = match d {
            Decision::Wait { likely, .. } => likely.clone(),
            Decision::Preempt { node, .. } => Some(node.clone()),
            Decision::Start { .. } | Decision::Never { .. } => continue,
        };
        let ranking = rank(cluster, &q.job, now, policy);
        let mut nodes: Vec<(u64, NodeName)> = ranking
            .rows
            .iter()
            .filter(|r| !matches!(r.verdict, Verdict::Never | Verdict::Down { .. }))
            .map(|r| (r.missing_bytes, r.node.clone()))
            .collect();
        nodes.sort();
        let nodes: Vec<NodeName> = first
            .into_iter()
            .chain(nodes.into_iter().map(|(_, n)| n))
            .collect();
        for s in &q.job.needs {
            let i = match wanted.iter().position(|(k, ..)| k == s) {
                Some(i) => i,
                None => {
                    wanted.push((*s, Vec::new(), Vec::new()));
                    wanted.len() - 1
                }
            };
            let (_, jobs, per_job) = &mut wanted[i];
            jobs.push(q);
            per_job.push(nodes.clone());
        }
    }
    let mut out = Vec::new();
    let mut warms_of: HashMap<&str, usize> = HashMap::new();
    for (snapshot, jobs, per_job) in wanted {
        // Every job's best node first, in queue order, then their others.
        let mut targets: Vec<NodeName> = Vec::new();
        let firsts = per_job.iter().filter_map(|n| n.first());
        let rest = per_job.iter().flat_map(|n| n.iter().skip(1));
        for n in firsts.chain(rest) {
            if !targets.contains(n) {
                targets.push(n.clone());
            }
        }
        let copies = jobs.len().min(policy.replicas_max.max(1));
        for node in targets.into_iter().take(copies) {
            let Some((have, total)) = cluster.presence(&node, &snapshot) else {
                continue;
            };
            let user = jobs
                .iter()
                .map(|q| q.user.as_str())
                .find(|u| warms_of.get(u).copied().unwrap_or(0) < policy.prefetch_per_user);
            if let Some(user) = user {
                *warms_of.entry(user).or_default() += 1;
            }
            if have < total {
                if user.is_none() {
                    break;
                }
                out.push(Warm {
                    node,
                    snapshot,
                    missing: total - have,
                    for_jobs: jobs.iter().map(|q| q.id.clone()).collect(),
                });
            }
        }
    }
    out
}

/// GPUs held without a command (`labrun --hold`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    /// The hold's id.
    pub id: String,
    /// Whose.
    pub user: String,
    /// Where.
    pub node: NodeName,
    /// Its GPUs.
    pub gpus: Vec<u32>,
    /// Since when none of its GPUs has shown utilisation (`None`: one is
    /// busy now).
    pub idle_since: Option<Millis>,
}

/// The holds to release at `now`, each with the reason its holder is told:
/// every GPU idle for [`Policy::idle_hold_secs`] or more.
pub fn idle_holds(holds: &[Hold], now: Millis, policy: &Policy) -> Vec<(String, String)> {
    holds
        .iter()
        .filter_map(|h| {
            let since = h.idle_since?;
            let idle = now.saturating_sub(since) / 1000;
            (idle >= policy.idle_hold_secs).then(|| {
                (
                    h.id.clone(),
                    format!(
                        "released: {} GPU(s) on {} held by {} showed no utilisation for {} (the lab releases idle holds after {})",
                        h.gpus.len(),
                        h.node,
                        h.user,
                        span(idle),
                        span(policy.idle_hold_secs)
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Slot;
    use crate::place::tests::{cache, job, n, node, snapshot, GIB};
    use crate::queue::tests::{of, pass};
    use crate::{plan, Usage};

    /// Three nodes of one GPU, busy until 10, 20 and 30 s.
    fn busy_trio() -> Cluster {
        let mut c = Cluster::new();
        for (name, end) in [("a", 10_000), ("b", 20_000), ("c", 30_000)] {
            node(&mut c, name, 0, 1);
            c.node_mut(&n(name)).unwrap().gpus[0].slot = Slot::Busy { until: Some(end) };
        }
        c
    }

    fn warmed(w: &[Warm]) -> Vec<(String, u8, u64)> {
        let mut v: Vec<_> = w
            .iter()
            .map(|w| (w.node.to_string(), w.snapshot.0[0], w.missing / GIB))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn one_waiting_job_is_warmed_where_it_will_likely_start() {
        let mut c = busy_trio();
        let data = snapshot(&mut c, 1, 1, 1);
        let queue = [of("j1", "alice", 2, 0, job(1, &[data]))];
        let usage = Usage::default();
        let d = plan(&mut c, &pass(&queue, &[], &usage, 0), &Policy::default());
        let w = prefetch(&c, &queue, &d, 0, &Policy::default());
        assert_eq!(warmed(&w), [("a".to_string(), 1, 1)], "{d:?}");
        assert_eq!(w[0].for_jobs, ["j1"]);
    }

    #[test]
    fn data_several_jobs_wait_for_is_warmed_on_several_nodes_counting_shared_packs() {
        let mut c = busy_trio();
        // DIV2K: packs 1-2; DF2K: DIV2K's packs and Flickr2K's (3-6).
        let div2k = snapshot(&mut c, 1, 1, 2);
        let df2k = SnapshotKey([2; 32]);
        c.add_snapshot(df2k, (1..=6).map(|p| (crate::PackKey([p; 32]), GIB)));
        cache(&mut c, "b", 1, 2);
        let queue = [
            of("j1", "alice", 2, 0, job(1, &[df2k])),
            of("j2", "bob", 2, 1, job(1, &[df2k])),
            of("j3", "carol", 2, 2, job(1, &[div2k])),
        ];
        let usage = Usage::default();
        let d = plan(&mut c, &pass(&queue, &[], &usage, 0), &Policy::default());
        assert!(
            d.iter().all(|d| matches!(d, Decision::Wait { .. })),
            "{d:?}"
        );
        let w = prefetch(&c, &queue, &d, 0, &Policy::default());
        // DF2K on two nodes (two jobs want it); on b only Flickr2K's 4 GiB
        // move. DIV2K is on b already, where its one job likely goes.
        let got = warmed(&w);
        assert_eq!(got.len(), 2, "{got:?} {d:?}");
        assert!(got.iter().all(|(_, s, _)| *s == 2), "{got:?}");
        assert!(got.contains(&("b".to_string(), 2, 4)), "{got:?}");
        let once = Policy {
            replicas_max: 1,
            ..Policy::default()
        };
        assert_eq!(prefetch(&c, &queue, &d, 0, &once).len(), 1);
    }

    /// Issue 40, point 8: alice's ten waiting jobs, each on a dataset of
    /// its own, warm two copies (her earliest jobs'), and bob's one job
    /// still gets his: her queue cannot fill the nodes' caches.
    #[test]
    fn one_users_many_waiting_jobs_warm_only_their_share() {
        let mut c = busy_trio();
        let mut queue: Vec<Queued> = (1..=10u8)
            .map(|i| {
                let data = snapshot(&mut c, i, i, 1);
                of(&format!("a{i}"), "alice", 2, u64::from(i), job(1, &[data]))
            })
            .collect();
        let bobs = snapshot(&mut c, 20, 20, 1);
        queue.push(of("b1", "bob", 2, 100, job(1, &[bobs])));
        let usage = Usage::default();
        let d = plan(&mut c, &pass(&queue, &[], &usage, 0), &Policy::default());
        let w = prefetch(&c, &queue, &d, 0, &Policy::default());
        let for_whom: Vec<&str> = w.iter().map(|w| w.for_jobs[0].as_str()).collect();
        assert_eq!(for_whom, ["a1", "a2", "b1"], "{w:?}");
        let generous = Policy {
            prefetch_per_user: 100,
            ..Policy::default()
        };
        assert_eq!(prefetch(&c, &queue, &d, 0, &generous).len(), 11);
        // Warmed, they count at the next passes: her share is full, and
        // her eight other datasets stay where they are however long her
        // jobs wait.
        for w in &w {
            let first = w.snapshot.0[0];
            cache(&mut c, w.node.as_str(), first, 1);
        }
        for now in [1_000, 2_000, 3_000] {
            let d = plan(&mut c, &pass(&queue, &[], &usage, now), &Policy::default());
            let more = prefetch(&c, &queue, &d, now, &Policy::default());
            assert!(more.is_empty(), "{more:?}");
        }
    }

    #[test]
    fn a_hold_idle_for_the_lab_s_time_is_released_and_says_why() {
        let hold = |id: &str, idle_since: Option<Millis>| Hold {
            id: id.into(),
            user: "alice".into(),
            node: n("gpu2"),
            gpus: vec![1],
            idle_since,
        };
        let holds = [
            hold("h1", Some(0)),
            hold("h2", Some(20 * 60_000)),
            hold("h3", None),
        ];
        let out = idle_holds(&holds, 31 * 60_000, &Policy::default());
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].0, "h1");
        assert!(
            out[0]
                .1
                .contains("1 GPU(s) on gpu2 held by alice showed no utilisation for 31 min"),
            "{}",
            out[0].1
        );
    }
}
