//! `labsync warm`, the coordinator's side: an admin names nodes (or all
//! that are up) to fetch a dataset's packs into their caches now and pin
//! them there, ahead of a deadline week; each node's side is
//! `daemon/warm.rs`.

use labsync_store::RefSpec;

use super::link::{Link, Reach};
use crate::cluster::Coordinator;
use crate::error::JobError;
use crate::proto::NodeName;
pub use crate::proto::{WarmAnswer, WarmAsk, WarmOrder, Warming};
use crate::request::Caller;

impl Coordinator {
    /// Sends an admin's warm (or unpin) to the nodes named, or to every
    /// node that is up.
    pub async fn warm(
        &self,
        r: &Reach,
        caller: &Caller,
        ask: WarmAsk,
    ) -> Result<WarmAnswer, JobError> {
        if !caller.admin {
            return Err(JobError::Forbidden(format!(
                "warming node caches pins data there: admins only ({} is not one)",
                caller.user
            )));
        }
        let spec: RefSpec = ask
            .name
            .parse()
            .map_err(|e| JobError::Invalid(format!("{}: {e}", ask.name)))?;
        let rec = r
            .repo()?
            .resolve(&spec)
            .await
            .map_err(|e| JobError::NotFound(e.to_string()))?;
        let members = self.members_up(self.now_ms());
        let nodes: Vec<NodeName> = if ask.nodes.is_empty() {
            members
        } else {
            ask.nodes
                .iter()
                .map(|n| {
                    members.iter().find(|m| *m == n).cloned().ok_or_else(|| {
                        JobError::NotFound(format!("no node {n} is up in the cluster"))
                    })
                })
                .collect::<Result<_, _>>()?
        };
        let order = WarmOrder {
            label: rec.label(),
            snapshot: rec.snapshot,
            unpin: ask.unpin,
            pin: true,
        };
        let mut sent = Vec::new();
        for name in nodes {
            let link = self
                .link(r, &name)
                .ok_or_else(|| JobError::Conflict(format!("{name} is unknown; try again")))?;
            match link {
                Link::Here(_) => link.warm(&order).await?,
                // Said as the node said it, whatever it was.
                Link::There { client, .. } => client
                    .warm(&order)
                    .await
                    .map_err(|e| JobError::Conflict(format!("{name}: {e}")))?,
            }
            sent.push(name);
        }
        tracing::info!(
            "{} {} on {} for {}",
            if ask.unpin { "unpinning" } else { "warming" },
            order.label,
            sent.join(", "),
            caller.user
        );
        Ok(WarmAnswer {
            label: order.label,
            snapshot: order.snapshot,
            nodes: sent,
        })
    }
}
