//! The coordinator's part in jobs Slurm runs: it ranks nodes with the GPUs
//! as Slurm reports them (`labrun --backend slurm`), and forwards a batch
//! script's stage request to the node the job was given, signed, with the
//! user its token names.

use labsync_placer::{rank, with_scheduler_gpus, Ranking};

use crate::cluster::Coordinator;
use crate::error::JobError;
use crate::request::Caller;

use super::link::{Link, Reach};
use crate::proto::{RankAsk, StageAsk, StageDone, StageOrder, Staged};

impl Coordinator {
    /// Every node Slurm offers, ranked for `ask.req` with Slurm's GPUs and
    /// the caches as the agents report them.
    pub async fn rank_for_scheduler(&self, r: &Reach, ask: &RankAsk) -> Result<Ranking, JobError> {
        check_nodes(&ask.nodes)?;
        let (needs, fresh) = self.priced(r, &ask.req).await?;
        let now = self.now_ms();
        self.tick(now);
        let view = with_scheduler_gpus(&self.planning_with(&fresh), &ask.nodes);
        Ok(rank(
            &view,
            &super::pass::placer_job(&ask.req, &needs, None),
            now,
            &self.policy(),
        ))
    }

    /// The tie the preference is made of, seconds.
    pub fn tie_secs(&self) -> f64 {
        self.policy().tie_secs
    }

    /// Stages `ask` on its node for `caller` (there, or here when the node
    /// is this one).
    pub async fn stage(
        &self,
        r: &Reach,
        caller: &Caller,
        ask: StageAsk,
    ) -> Result<Staged, JobError> {
        let node = ask.node.clone();
        let order = StageOrder {
            user: caller.user.clone(),
            ask,
        };
        self.member(r, &node)?.stage(order).await
    }

    /// Releases a stage of `caller`'s on its node.
    pub async fn stage_done(
        &self,
        r: &Reach,
        caller: &Caller,
        done: StageDone,
    ) -> Result<(), JobError> {
        let done = StageDone {
            user: caller.user.clone(),
            ..done
        };
        let node = done.node.clone();
        self.member(r, &node)?.stage_done(done).await
    }

    /// `node`, which must be up (or be this one).
    fn member(&self, r: &Reach, node: &str) -> Result<Link, JobError> {
        let here = node == r.name();
        if !here && !self.members_up(self.now_ms()).iter().any(|m| m == node) {
            return Err(JobError::NotFound(format!(
                "no labd agent of node {node} is up in the cluster: a Slurm node stages \
                 through its own labd (node_name = \"{node}\" in its labd.toml)"
            )));
        }
        self.link(r, node)
            .ok_or_else(|| JobError::Conflict(format!("{node} is unknown; try again")))
    }
}

/// Nodes at most, GPUs on one node at most, and GPUs in all at most, in
/// a ranking asked for (the view the placer builds holds every GPU: ten
/// thousand nodes of 1,024 would be hundreds of MB per request).
const MAX_NODES: usize = 10_000;
const MAX_GPUS: u32 = 1024;
const MAX_ALL_GPUS: u64 = 65_536;

/// A ranking's nodes as a user sent them: bounded, each once, free ≤ GPUs.
fn check_nodes(nodes: &[labsync_placer::SchedulerNode]) -> Result<(), JobError> {
    if nodes.len() > MAX_NODES {
        return Err(JobError::Invalid(format!(
            "{} nodes to rank: at most {MAX_NODES}",
            nodes.len()
        )));
    }
    let all: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();
    if all > MAX_ALL_GPUS {
        return Err(JobError::Invalid(format!(
            "{all} GPUs in the nodes to rank: at most {MAX_ALL_GPUS} in all"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for n in nodes {
        if n.gpus > MAX_GPUS || n.free > n.gpus {
            return Err(JobError::Invalid(format!(
                "node {}: {} GPUs, {} free: at most {MAX_GPUS}, and no more free than it has",
                n.node, n.gpus, n.free
            )));
        }
        if !seen.insert(&n.node) {
            return Err(JobError::Invalid(format!("node {} listed twice", n.node)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use labsync_placer::SchedulerNode;

    fn node(name: &str, gpus: u32, free: u32) -> SchedulerNode {
        SchedulerNode {
            node: name.parse().unwrap(),
            gpus,
            free,
            usable: true,
        }
    }

    #[test]
    fn a_ranking_ask_is_bounded() {
        assert!(check_nodes(&[node("a", 8, 8), node("b", 4, 0)]).is_ok());
        // A GPU entry per GPU is built: u32::MAX of them would be gigabytes.
        assert!(check_nodes(&[node("a", u32::MAX, 0)]).is_err());
        assert!(check_nodes(&[node("a", MAX_GPUS + 1, 0)]).is_err());
        assert!(check_nodes(&[node("a", 2, 3)]).is_err());
        assert!(check_nodes(&[node("a", 2, 2), node("a", 2, 2)]).is_err());
        let many: Vec<_> = (0..65)
            .map(|i| node(&format!("n{i}"), MAX_GPUS, 0))
            .collect();
        let e = check_nodes(&many).unwrap_err().to_string();
        assert!(
            e.contains("66560 GPUs") && e.contains("at most 65536"),
            "{e}"
        );
        assert!(check_nodes(&many[..64]).is_ok());
        let many: Vec<_> = (0..=MAX_NODES)
            .map(|i| node(&format!("n{i}"), 1, 1))
            .collect();
        assert!(check_nodes(&many).is_err());
    }
}
