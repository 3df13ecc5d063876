//! The Slurm backend: Slurm allocates and isolates the GPUs, accounts and
//! orders by its QOS and fair share; labsync adds where the data is.
//!
//! - [`submit`]: `labrun --backend slurm`: push the code and data, rank the
//!   nodes (Slurm's free GPUs, the agents' caches) on the coordinator, and
//!   `sbatch --prefer` the best that can start the job now.
//! - [`job`]: the batch script's own step (`labrun _slurm-job`), on the
//!   node Slurm chose, as the user: stage the code and data through that
//!   node's labd, run the command, save the outputs periodically, at the
//!   end, on `scancel` and before the time limit.
//! - [`manage`]: `labrun ps | logs | kill` mapped to `squeue`, the job's
//!   output file and `scancel`.
//! - [`config`]: `labd slurm-config`, the slurm.conf lines labsync needs.
//!
//! Slurm's commands run through the agent's one runner, each under a
//! timeout ([`Slurm::run`]), and what they print is read by the agent's
//! pure parsers ([`labsync_agent::slurm`]); the coordinator's re-ranking of
//! pending jobs runs inside labd ([`labsync_agent::cluster::rerank`]).

pub mod config;
pub mod job;
pub mod manage;
pub mod submit;

use anyhow::{bail, Result};

pub use labsync_agent::slurm::{
    feature_of, fields, gres_gpus, has_own_feature, job_name, NodeInfo, Slurm,
};

/// Slurm's id from what a user typed: `1234` or `slurm-1234`.
pub fn slurm_id(job: &str) -> Result<String> {
    match labsync_agent::slurm::job_id(job) {
        Some(id) => Ok(id.to_string()),
        None => bail!("{job:?} is not a Slurm job id (1234 or slurm-1234; see labrun ps)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids() {
        assert_eq!(slurm_id("1234").unwrap(), "1234");
        assert_eq!(slurm_id("slurm-1234").unwrap(), "1234");
        for bad in ["", "j12", "slurm-", "12;rm", "1 2"] {
            assert!(slurm_id(bad).is_err(), "{bad:?}");
        }
    }
}
