//! When another scheduler owns the GPUs (Slurm): its view of the GPUs,
//! labsync's of the data, and the nodes to prefer.
//!
//! Slurm allocates the GPUs, so how many are free on each node is what
//! Slurm says, not what the agents' leases say; which packs each node has
//! cached is still labsync's. [`with_scheduler_gpus`] joins the two, and
//! [`preferred`] turns the placer's [`Ranking`] into the soft preference
//! Slurm is given (`sbatch --prefer`).

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, Gpu, NodeName, Slot};
use crate::place::{GpuWait, Ranking};

/// One node as the other scheduler reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerNode {
    /// Its name (the scheduler's and labd's `node_name` are the same).
    pub node: NodeName,
    /// GPUs it has.
    pub gpus: u32,
    /// Of those, free now.
    pub free: u32,
    /// It takes jobs (not down, drained or failing).
    pub usable: bool,
}

/// The planning view with GPUs as `nodes` report them: every node the
/// scheduler lists, with its GPUs (the first `free` free, the rest busy with
/// no known end; none at all when it is not usable), and no node it does
/// not list. What each node has cached stays as `cluster` knows it; a node
/// no agent reported has nothing cached.
///
/// GPU memory is the agents' reading where they report that GPU, else 0:
/// the other scheduler picks the GPUs, so jobs ask it, not the placer, for
/// their size.
pub fn with_scheduler_gpus(cluster: &Cluster, nodes: &[SchedulerNode]) -> Cluster {
    let mut out = cluster.clone();
    let gone: Vec<NodeName> = (out.nodes().iter())
        .map(|n| n.name().clone())
        .filter(|n| !nodes.iter().any(|s| &s.node == n))
        .collect();
    for n in &gone {
        out.remove_node(n);
    }
    for s in nodes {
        let view = out.node_entry(&s.node);
        let memory = |i: u32| {
            (view.gpus.iter())
                .find(|g| g.index == i)
                .map_or(0, |g| g.memory_total)
        };
        let gpus: Vec<Gpu> = (0..if s.usable { s.gpus } else { 0 })
            .map(|i| Gpu {
                index: i,
                memory_total: memory(i),
                memory_free: memory(i),
                slot: if i < s.free.min(s.gpus) {
                    Slot::Free
                } else {
                    Slot::Busy { until: None }
                },
            })
            .collect();
        view.gpus = gpus;
    }
    out
}

/// The nodes to prefer for a job ranked `r`: among those that can start it
/// now (enough GPUs free) and whose start is within `tie_secs` of the
/// earliest such start, the ones with the fewest bytes to fetch, by name.
/// A tie on start alone is not enough: Slurm picks freely among the nodes
/// it is given, and a node without the data would fetch it. Empty when no
/// node can start it now: a preference for a busy node would only delay
/// the job (Slurm tries the preferred nodes for an immediate start, and
/// falls back to the others only at its next backfill pass).
pub fn preferred(r: &Ranking, tie_secs: f64) -> Vec<NodeName> {
    let now: Vec<(f64, u64, &NodeName)> = (r.rows.iter())
        .filter(|row| row.gpu_wait == GpuWait::Now)
        .filter_map(|row| Some((row.start_secs?, row.missing_bytes, &row.node)))
        .collect();
    let Some(best) = now.iter().map(|x| x.0).min_by(f64::total_cmp) else {
        return Vec::new();
    };
    let tied: Vec<_> = now.into_iter().filter(|x| x.0 <= best + tie_secs).collect();
    let fewest = tied.iter().map(|x| x.1).min().unwrap_or(0);
    let mut out: Vec<NodeName> = (tied.into_iter())
        .filter(|x| x.1 == fewest)
        .map(|x| x.2.clone())
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{rank, Job, PackKey, Policy, SnapshotKey};

    fn name(s: &str) -> NodeName {
        s.parse().unwrap()
    }

    fn node(n: &str, gpus: u32, free: u32) -> SchedulerNode {
        SchedulerNode {
            node: name(n),
            gpus,
            free,
            usable: true,
        }
    }

    /// n1 has the dataset cached; the agents' own view says every GPU is
    /// free, which Slurm's replaces.
    fn lab() -> (Cluster, Job) {
        let mut c = Cluster::new();
        for n in ["n1", "n2", "n3", "other"] {
            c.node_entry(&name(n)).gpus = (0..2).map(|i| Gpu::free(i, 11 << 30)).collect();
        }
        let data = SnapshotKey([7; 32]);
        c.add_snapshot(data, [(PackKey([1; 32]), 4 << 30)]);
        c.set_cached(&name("n1"), PackKey([1; 32]), 4 << 30, true);
        let job = Job {
            gpus: 1,
            gpu_mem: 0,
            needs: vec![data],
            expected_secs: None,
            limited: false,
        };
        (c, job)
    }

    #[test]
    fn the_node_with_the_data_is_preferred_while_its_gpus_are_free() {
        let (c, job) = lab();
        let v = with_scheduler_gpus(&c, &[node("n1", 2, 2), node("n2", 2, 2), node("n3", 2, 1)]);
        // Only Slurm's nodes, with Slurm's GPUs; memory kept from the agents.
        let names: Vec<&str> = v.nodes().iter().map(|n| n.name().as_str()).collect();
        assert_eq!(names, ["n1", "n2", "n3"]);
        let n3 = v.node(&name("n3")).unwrap();
        assert_eq!(n3.gpus[0].slot, Slot::Free);
        assert_eq!(n3.gpus[1].slot, Slot::Busy { until: None });
        assert_eq!(n3.gpus[1].memory_total, 11 << 30);
        let r = rank(&v, &job, 0, &Policy::default());
        assert_eq!(preferred(&r, 2.0), [name("n1")]);
    }

    #[test]
    fn a_tie_on_start_goes_to_the_nodes_with_the_data() {
        let mut c = Cluster::new();
        for n in ["n1", "n2"] {
            c.node_entry(&name(n)).gpus = (0..2).map(|i| Gpu::free(i, 11 << 30)).collect();
        }
        // A small dataset: every node could fetch it within the tie.
        let data = SnapshotKey([9; 32]);
        c.add_snapshot(data, [(PackKey([2; 32]), 1 << 20)]);
        c.set_cached(&name("n2"), PackKey([2; 32]), 1 << 20, true);
        let job = Job {
            gpus: 1,
            gpu_mem: 0,
            needs: vec![data],
            expected_secs: None,
            limited: false,
        };
        let v = with_scheduler_gpus(&c, &[node("n1", 2, 2), node("n2", 2, 2)]);
        let r = rank(&v, &job, 0, &Policy::default());
        assert_eq!(preferred(&r, 2.0), [name("n2")]);
    }

    #[test]
    fn busy_nodes_are_never_preferred() {
        let (c, job) = lab();
        // n1 holds the data but Slurm has both its GPUs allocated.
        let v = with_scheduler_gpus(&c, &[node("n1", 2, 0), node("n2", 2, 2), node("n3", 2, 2)]);
        let r = rank(&v, &job, 0, &Policy::default());
        // n2 and n3 tie (neither has the data): both preferred, n1 not.
        assert_eq!(preferred(&r, 2.0), [name("n2"), name("n3")]);
        // Nothing free anywhere: no preference at all.
        let v = with_scheduler_gpus(&c, &[node("n1", 2, 0), node("n2", 2, 0)]);
        let r = rank(&v, &job, 0, &Policy::default());
        assert!(preferred(&r, 2.0).is_empty());
    }

    #[test]
    fn unusable_nodes_and_nodes_no_agent_knows() {
        let (c, job) = lab();
        let mut down = node("n1", 2, 2);
        down.usable = false;
        // `fresh` runs no labd agent: nothing cached, still a candidate.
        let v = with_scheduler_gpus(&c, &[down, node("fresh", 4, 4)]);
        assert!(v.node(&name("n1")).unwrap().gpus.is_empty());
        assert_eq!(v.node(&name("fresh")).unwrap().gpus.len(), 4);
        let r = rank(&v, &job, 0, &Policy::default());
        assert_eq!(preferred(&r, 2.0), [name("fresh")]);
    }
}
