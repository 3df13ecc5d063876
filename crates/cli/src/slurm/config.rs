//! `labd slurm-config`: the slurm.conf lines labsync needs: a feature per
//! node named after it (`lsn_<node>`), which `labrun --backend slurm`
//! prefers (`sbatch --prefer=lsn_gpu3|lsn_gpu5`), and GPUs as GRES.

use anyhow::{bail, Result};

use super::{feature_of, NodeInfo, Slurm};

/// The text for `nodes` (names, and the features each has now).
pub fn render(nodes: &[(String, Vec<String>)]) -> String {
    let mut out = String::from(
        "# labsync: each node carries a feature named after it, so that\n\
         # `labrun --backend slurm` can prefer the nodes that hold a job's data\n\
         # (sbatch --prefer=\"lsn_gpu3|lsn_gpu5\": soft, Slurm >= 22.05). Put these\n\
         # Features on each node's NodeName line in slurm.conf (keeping its other\n\
         # settings), then `scontrol reconfigure`:\n",
    );
    for (name, features) in nodes {
        let mut all: Vec<String> = features
            .iter()
            .filter(|f| !f.starts_with("lsn_"))
            .cloned()
            .collect();
        all.push(feature_of(name));
        out += &format!("NodeName={name} Features={}\n", all.join(","));
    }
    out += "# GPUs are GRES (labrun asks for --gres=gpu:N), with gres.conf on each node:\n\
            GresTypes=gpu\n\
            # Each node runs a labd agent of the cluster whose node_name is the node's\n\
            # Slurm NodeName (node_name = \"gpu3\" in its labd.toml): jobs stage their code\n\
            # and data through it, and its cache is what the ranking counts.\n";
    out
}

/// Prints the lines for `nodes`, or for every node Slurm lists.
pub async fn slurm_config(nodes: &[String], timeout: std::time::Duration) -> Result<()> {
    let list: Vec<(String, Vec<String>)> = if nodes.is_empty() {
        let slurm = Slurm::new(timeout);
        let found: Vec<NodeInfo> = slurm.nodes(None).await.map_err(|e| {
            anyhow::Error::new(e).context(
                "cannot ask Slurm for its nodes; name them instead: labd slurm-config --nodes gpu1,gpu2",
            )
        })?;
        if found.is_empty() {
            bail!("Slurm lists no nodes; name them: labd slurm-config --nodes gpu1,gpu2");
        }
        found.into_iter().map(|n| (n.name, n.features)).collect()
    } else {
        for n in nodes {
            if n.parse::<labsync_placer::NodeName>().is_err() {
                bail!("{n:?} is not a node name");
            }
        }
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect()
    };
    print!("{}", render(&list));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_added_to_what_nodes_have() {
        let text = render(&[
            ("gpu1".into(), vec!["a100".into(), "lsn_old".into()]),
            ("gpu2".into(), vec![]),
        ]);
        assert!(
            text.contains("\nNodeName=gpu1 Features=a100,lsn_gpu1\n"),
            "{text}"
        );
        assert!(
            text.contains("\nNodeName=gpu2 Features=lsn_gpu2\n"),
            "{text}"
        );
        assert!(text.contains("\nGresTypes=gpu\n"));
    }
}
