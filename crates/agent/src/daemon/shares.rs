//! Disk held for a user is charged to that user.
//!
//! Twenty versions of a 50 GB dataset that differ by one file cost
//! nothing in the store, and 1 TB of materialised trees on a node: a tree
//! in use cannot be evicted, so one user's queued jobs could hold the
//! node's disk past `trees_max`. So each user's active jobs and unreleased
//! Slurm stages may hold at most `trees_per_user` bytes of trees here, each
//! distinct tree counted once and in full (a tree another user also holds
//! costs both: either may be the one left holding it). A job or stage
//! whose new trees would take its user past the share is refused before
//! anything is pulled, saying what is held and what to do; `labrun ps`
//! says what the user holds.
//!
//! A tree's size is its record's once materialised, else what its
//! snapshot object says (written by whoever pushed it: a lie there lets one
//! job past the share once, and its real size counts from then on).

use std::collections::HashSet;

use labsync_store::{Repo, SnapshotId};

use super::{stages, Daemon};
use crate::error::PrepareError;
use crate::leases::unix_now;
use crate::proto::TreeRef;

/// One check at a time: two jobs of one user prepared at once each see
/// the other's trees.
static CHARGING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What is being charged, so that its own record is not counted as held.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Asking<'a> {
    /// A job of this labd's (its record names its trees already).
    Job(&'a str),
    /// A Slurm stage (its record names its trees already).
    Stage(&'a str),
}

impl Daemon {
    /// The snapshots whose trees `user`'s active jobs and unreleased
    /// stages hold here, but `asking`'s own.
    fn trees_held_by(&self, user: &str, asking: Option<Asking>) -> HashSet<SnapshotId> {
        let job = match asking {
            Some(Asking::Job(id)) => Some(id),
            _ => None,
        };
        let mut held: HashSet<SnapshotId> = self
            .node
            .active_where(|j| j.user == user && Some(j.id.as_str()) != job)
            .into_iter()
            .flat_map(|j| j.meta.trees)
            .collect();
        let now = unix_now();
        for (name, rec) in stages::records(&self.stages_dir()).unwrap_or_default() {
            let Some(rec) = rec else { continue };
            let own = matches!(asking, Some(Asking::Stage(s)) if s == name);
            if rec.user == user && !own && stages::holds_trees(&rec, now) {
                held.extend(rec.trees);
            }
        }
        held
    }

    /// Bytes of the trees `user` holds here, and their share
    /// (`trees_per_user`; `None`: no share).
    pub(crate) fn tree_charge(&self, user: &str) -> (u64, Option<u64>) {
        let held = self.trees_held_by(user, None);
        let bytes = held.iter().map(|s| self.trees.known_size(s)).sum();
        (bytes, self.cfg.trees_per_user)
    }

    /// Refuses `trees` for `user` where those not held yet would take the
    /// user past their share; `asking` is the job or stage they are for.
    pub(crate) async fn check_tree_share(
        &self,
        user: &str,
        asking: Asking<'_>,
        trees: &[&TreeRef],
        repo: &Repo,
    ) -> Result<(), PrepareError> {
        let Some(share) = self.cfg.trees_per_user else {
            return Ok(());
        };
        let _one = CHARGING.lock().await;
        let held = self.trees_held_by(user, Some(asking));
        let mut new: Vec<(&TreeRef, u64)> = Vec::new();
        for t in trees {
            if held.contains(&t.snapshot) || new.iter().any(|(n, _)| n.snapshot == t.snapshot) {
                continue;
            }
            new.push((t, self.trees.size(repo, &t.snapshot).await?));
        }
        let held_bytes: u64 = held.iter().map(|s| self.trees.known_size(s)).sum();
        over_share(user, &self.cfg.node_name, held_bytes, share, &new)
            .map_or(Ok(()), |why| Err(PrepareError::OverShare(why)))
    }
}

/// Why `new` trees (with their sizes) would take `user`, who holds
/// `held` bytes, past `share`; `None` when they fit (or add nothing).
fn over_share(
    user: &str,
    node: &str,
    held: u64,
    share: u64,
    new: &[(&TreeRef, u64)],
) -> Option<String> {
    let more: u64 = new.iter().map(|(_, b)| b).sum();
    if more == 0 || held.saturating_add(more) <= share {
        return None;
    }
    let names: Vec<String> = new
        .iter()
        .map(|(t, b)| format!("{} ({})", t.label, human_bytes(*b)))
        .collect();
    Some(format!(
        "{user}'s jobs and stages on {node} hold {} of materialised code and data, and {} \
         would take {} more, past {user}'s share of {} (trees_per_user): end a job that holds \
         other versions, or use versions already held",
        human_bytes(held),
        names.join(", "),
        human_bytes(more),
        human_bytes(share)
    ))
}

/// `1.02 GiB`: binary units, as `labrun status` and the docs give sizes
/// (issue 43: `cache status` said GB where `labrun status` said GiB).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(label: &str) -> TreeRef {
        TreeRef {
            label: label.into(),
            snapshot: "0".repeat(64).parse().unwrap(),
        }
    }

    /// Within the share, or nothing new: fits. Past it: refused, naming
    /// what is held, what would be added and the share.
    #[test]
    fn the_share_counts_what_is_held_and_what_is_new() {
        let (a, b) = (tree("div2k@v19"), tree("div2k@v20"));
        assert_eq!(over_share("alice", "gpu1", 400, 1000, &[(&a, 600)]), None);
        assert_eq!(over_share("alice", "gpu1", 5000, 1000, &[]), None);
        assert_eq!(over_share("alice", "gpu1", 5000, 1000, &[(&a, 0)]), None);
        let why = over_share(
            "alice",
            "gpu1",
            700_000,
            1_000_000,
            &[(&a, 200_000), (&b, 200_000)],
        )
        .unwrap();
        assert!(
            why.contains("hold 683.59 KiB")
                && why.contains("div2k@v19 (195.31 KiB), div2k@v20 (195.31 KiB)")
                && why.contains("390.62 KiB more")
                && why.contains("share of 976.56 KiB (trees_per_user)"),
            "{why}"
        );
    }
}
