//! One scheduling pass over the queue: first come, first served, and a job
//! that cannot start yet does not hold back the ones behind it that can.

use serde::Serialize;

use crate::cluster::{Cluster, Millis, NodeName, Slot};
use crate::place::{rank, Choice, GpuWait, Job, Policy, Verdict};

/// A job waiting in the queue, oldest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queued {
    /// Its id.
    pub id: String,
    /// What it needs.
    pub job: Job,
}

/// What a pass decided for one queued job.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Send it to this node now: its GPUs there are free (its data is
    /// fetched as it prepares).
    Start {
        /// The job.
        id: String,
        /// Where, on which GPUs.
        choice: Choice,
    },
    /// It stays queued.
    Wait {
        /// The job.
        id: String,
        /// Why, for `labrun ps`.
        why: String,
        /// The node it waits for, when one is expected to free up first
        /// (where its data could be prefetched).
        likely: Option<NodeName>,
    },
    /// No node of the cluster can ever run it as asked.
    Never {
        /// The job.
        id: String,
        /// Which nodes have what.
        why: String,
    },
}

/// Decides every queued job in order, and records each start in `cluster`
/// (its GPUs busy, its packs present at the node) so later jobs of the
/// same pass, and passes before the agents report back, see them: the
/// same GPU is never offered twice. An agent that finds a GPU taken after
/// all refuses the start, and the next heartbeat corrects the view.
pub fn plan(
    cluster: &mut Cluster,
    queue: &[Queued],
    now: Millis,
    policy: &Policy,
) -> Vec<Decision> {
    queue
        .iter()
        .map(|q| {
            let ranking = rank(cluster, &q.job, now, policy);
            match ranking.choice {
                Some(choice) if choice.gpus_free_now => {
                    reserve(cluster, &q.job, &choice, now);
                    Decision::Start {
                        id: q.id.clone(),
                        choice,
                    }
                }
                Some(choice) => Decision::Wait {
                    id: q.id.clone(),
                    why: format!(
                        "waits for {}, expected to start there in {:.0} s",
                        choice.node, choice.start_secs
                    ),
                    likely: Some(choice.node),
                },
                None => {
                    // Down nodes count with the GPUs they last reported.
                    let never = !ranking.rows.is_empty()
                        && ranking
                            .rows
                            .iter()
                            .all(|r| matches!(r.gpu_wait, GpuWait::Never { .. }));
                    let why = ranking
                        .rows
                        .iter()
                        .map(|r| match (&r.verdict, &r.gpu_wait) {
                            (Verdict::Down { .. }, _) => format!("{}: down", r.node),
                            (_, GpuWait::Never { why } | GpuWait::Unknown { why }) => {
                                format!("{}: {why}", r.node)
                            }
                            _ => format!("{}: no start estimate", r.node),
                        })
                        .collect::<Vec<_>>()
                        .join("; ");
                    let why = if ranking.rows.is_empty() {
                        "no node has joined the cluster".to_string()
                    } else {
                        why
                    };
                    if never {
                        Decision::Never {
                            id: q.id.clone(),
                            why,
                        }
                    } else {
                        Decision::Wait {
                            id: q.id.clone(),
                            why,
                            likely: None,
                        }
                    }
                }
            }
        })
        .collect()
}

/// Marks a start in the view: the GPUs busy until the job's expected end,
/// its packs present at the node.
pub fn reserve(cluster: &mut Cluster, job: &Job, choice: &Choice, now: Millis) {
    let Some(i) = cluster.index_of(&choice.node) else {
        return;
    };
    let until = job
        .expected_secs
        .map(|s| now + ((choice.start_secs + s as f64) * 1000.0) as Millis);
    for g in cluster.nodes_mut()[i].gpus.iter_mut() {
        if choice.gpus.contains(&g.index) {
            g.slot = Slot::Busy { until };
            g.memory_free = 0;
        }
    }
    let (packs, _) = cluster.packs_of(&job.needs);
    for p in packs {
        cluster.mark(i, p);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::place::tests::{job, n, node, snapshot, GIB};
    use crate::{Gpu, Health, PackKey, Rates, SnapshotKey};

    fn q(id: &str, job: Job) -> Queued {
        Queued { id: id.into(), job }
    }

    #[test]
    fn a_job_that_cannot_start_does_not_block_the_next() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 2);
        node(&mut c, "b", 2, 2);
        let d = plan(
            &mut c,
            &[q("j1", job(4, &[])), q("j2", job(1, &[]))],
            0,
            &Policy::default(),
        );
        assert!(
            matches!(&d[0], Decision::Wait { id, why, likely: None }
                if id == "j1" && why.contains("a: 2 of 4 GPU(s) busy with no known end")),
            "{:?}",
            d[0]
        );
        assert!(matches!(&d[1], Decision::Start { id, .. } if id == "j2"));
    }

    #[test]
    fn a_job_no_node_can_ever_run_is_never() {
        let mut c = Cluster::new();
        node(&mut c, "a", 4, 0);
        node(&mut c, "b", 4, 0);
        c.node_mut(&n("b")).unwrap().health = Health::Down { since: 1 };
        let d = plan(&mut c, &[q("j1", job(8, &[]))], 0, &Policy::default());
        let Decision::Never { why, .. } = &d[0] else {
            panic!("{:?}", d[0])
        };
        assert!(
            why.contains("a: has 4 GPU(s) (of 4); the job asks for 8"),
            "{why}"
        );
        let d = plan(
            &mut Cluster::new(),
            &[q("j1", job(1, &[]))],
            0,
            &Policy::default(),
        );
        assert!(
            matches!(&d[0], Decision::Wait { why, .. } if why == "no node has joined the cluster")
        );
    }

    #[test]
    fn a_pass_never_offers_a_gpu_twice() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 0);
        node(&mut c, "b", 2, 0);
        let queue: Vec<Queued> = (0..5).map(|i| q(&format!("j{i}"), job(1, &[]))).collect();
        let d = plan(&mut c, &queue, 0, &Policy::default());
        let mut taken = HashSet::new();
        for x in &d[..4] {
            let Decision::Start { choice, .. } = x else {
                panic!("{x:?}")
            };
            assert!(taken.insert((choice.node.clone(), choice.gpus[0])), "{x:?}");
        }
        assert!(matches!(&d[4], Decision::Wait { .. }));
        // The view remembers: a second pass before any heartbeat starts nothing.
        let d = plan(&mut c, &[q("j9", job(1, &[]))], 0, &Policy::default());
        assert!(matches!(&d[0], Decision::Wait { .. }));
    }

    #[test]
    fn the_second_job_of_a_dataset_follows_the_first() {
        let mut c = Cluster::new();
        node(&mut c, "a", 2, 0);
        node(&mut c, "b", 2, 0);
        node(&mut c, "c", 2, 0);
        let data = snapshot(&mut c, 1, 1, 4);
        let d = plan(
            &mut c,
            &[q("j1", job(1, &[data])), q("j2", job(1, &[data]))],
            0,
            &Policy::default(),
        );
        let node_of = |x: &Decision| match x {
            Decision::Start { choice, .. } => (choice.node.clone(), choice.fetch_bytes),
            other => panic!("{other:?}"),
        };
        let (first, fetched) = node_of(&d[0]);
        assert_eq!(fetched, 4 * GIB);
        assert_eq!(node_of(&d[1]), (first, 0));
    }

    #[test]
    fn expected_ends_let_later_passes_plan_ahead() {
        let mut c = Cluster::new();
        node(&mut c, "a", 1, 0);
        let mut j = job(1, &[]);
        j.expected_secs = Some(60);
        plan(&mut c, &[q("j1", j.clone())], 1_000, &Policy::default());
        let d = plan(&mut c, &[q("j2", j)], 1_000, &Policy::default());
        assert!(
            matches!(&d[0], Decision::Wait { why, likely: Some(x), .. }
                if x.as_str() == "a" && why.contains("in 60 s")),
            "{:?}",
            d[0]
        );
    }

    /// A random cluster: up to 6 nodes of up to 4 GPUs in random states, up
    /// to 6 snapshots over 12 packs, random caches.
    fn cluster() -> impl Strategy<Value = (Cluster, Vec<SnapshotKey>)> {
        let gpu = (0u8..4, 1u64..4, 0u64..2000);
        let node = (prop::collection::vec(gpu, 0..5), any::<bool>(), 0u16..4096);
        let snap = prop::collection::vec(0u8..12, 0..6);
        (
            prop::collection::vec(node, 0..7),
            prop::collection::vec(snap, 1..7),
        )
            .prop_map(|(nodes, snaps)| {
                let mut c = Cluster::new();
                let keys: Vec<SnapshotKey> = snaps
                    .iter()
                    .enumerate()
                    .map(|(i, packs)| {
                        let key = SnapshotKey([i as u8; 32]);
                        c.add_snapshot(
                            key,
                            packs
                                .iter()
                                .map(|&p| (PackKey([p; 32]), (p as u64 + 1) * GIB)),
                        );
                        key
                    })
                    .collect();
                for (i, (gpus, down, cached)) in nodes.into_iter().enumerate() {
                    let name = n(&format!("n{i}"));
                    let v = c.node_entry(&name);
                    v.health = if down {
                        Health::Down { since: 0 }
                    } else {
                        Health::Up
                    };
                    v.rates = Rates {
                        peer: 1e8,
                        store: 5e7,
                    };
                    v.gpus = gpus
                        .into_iter()
                        .enumerate()
                        .map(|(g, (state, mem, end))| {
                            let slot = match state {
                                0 => Slot::Free,
                                1 => Slot::Busy { until: None },
                                2 => Slot::Busy {
                                    until: Some(end * 1000),
                                },
                                _ => Slot::Unavailable,
                            };
                            Gpu {
                                index: g as u32,
                                memory_total: mem * 8 * GIB,
                                memory_free: if slot == Slot::Free { mem * 8 * GIB } else { 0 },
                                slot,
                            }
                        })
                        .collect();
                    for p in 0..12u8 {
                        if cached & (1 << p) != 0 {
                            c.set_cached(&name, PackKey([p; 32]), (p as u64 + 1) * GIB, true);
                        }
                    }
                }
                (c, keys)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Whatever the cluster: a start goes to an up node, on GPUs that
        /// were free with the memory asked for, never one GPU twice; and
        /// no node could have started the job clearly sooner.
        #[test]
        fn starts_are_on_free_gpus_once_and_earliest(
            (cluster, keys) in cluster(),
            jobs in prop::collection::vec((0u32..4, 0u64..3, prop::collection::vec(0usize..6, 0..3)), 1..12),
        ) {
            let policy = Policy::default();
            let queue: Vec<Queued> = jobs
                .iter()
                .enumerate()
                .map(|(i, (gpus, mem, needs))| q(&format!("j{i}"), Job {
                    gpus: *gpus,
                    gpu_mem: mem * 8 * GIB,
                    needs: needs.iter().map(|&k| keys[k % keys.len()]).collect(),
                    expected_secs: None,
                }))
                .collect();
            let mut view = cluster.clone();
            let mut taken = HashSet::new();
            for (x, qd) in queue.iter().enumerate() {
                let before = view.clone();
                let r = rank(&before, &qd.job, 0, &policy);
                let d = plan(&mut view, std::slice::from_ref(qd), 0, &policy);
                match &d[0] {
                    Decision::Start { choice, .. } => {
                        let v = before.node(&choice.node).unwrap();
                        prop_assert!(v.is_up());
                        prop_assert_eq!(choice.gpus.len(), qd.job.gpus as usize);
                        for g in &choice.gpus {
                            let gpu = v.gpus.iter().find(|x| x.index == *g).unwrap();
                            prop_assert_eq!(&gpu.slot, &Slot::Free);
                            prop_assert!(gpu.memory_free >= qd.job.gpu_mem);
                            prop_assert!(taken.insert((choice.node.clone(), *g)), "GPU given twice at job {}", x);
                        }
                        for row in &r.rows {
                            if let Some(s) = row.start_secs {
                                prop_assert!(choice.start_secs <= s + policy.tie_secs);
                            }
                        }
                    }
                    Decision::Never { .. } => {
                        let all_never = r.rows.iter().all(|row| matches!(row.gpu_wait, GpuWait::Never { .. }));
                        prop_assert!(all_never);
                    }
                    Decision::Wait { .. } => {
                        prop_assert!(r.choice.as_ref().is_none_or(|c| !c.gpus_free_now));
                    }
                }
            }
        }
    }
}
