//! `labd doctor`'s ping, answered: this node's version and clock, whether
//! it reaches the nodes it is asked to (each with a signed ping of its own,
//! so "reachable" means "answers this node's signature"), and, on the
//! coordinator, the cluster's nodes.

use std::sync::Arc;
use std::time::Duration;

use super::Daemon;
use crate::client::{Client, Endpoint};
use crate::error::JobError;
use crate::proto::{
    MemberSeen, NodeHealth, PingAsk, Pong, Reached, PING_REACH_MAX, PROTOCOL, VERSION,
};

/// How long a node asked to reach another waits for its answer.
const REACH_WAIT: Duration = Duration::from_secs(5);

impl Daemon {
    /// Answers `ask` (see the module's doc).
    pub(crate) async fn pong(self: &Arc<Self>, ask: PingAsk) -> Result<Pong, JobError> {
        let cluster = self
            .cluster()
            .ok_or_else(|| JobError::Conflict(format!("{} is in no cluster", self.node_name())))?;
        if ask.reach.len() > PING_REACH_MAX {
            return Err(JobError::Invalid(format!(
                "a ping may ask for {PING_REACH_MAX} nodes at most, not {}",
                ask.reach.len()
            )));
        }
        let me = self.node_name().clone();
        let reached = ask.reach.into_iter().map(|(node, addr)| {
            let (key, tls, me) = (cluster.key.clone(), cluster.tls.clone(), me.clone());
            async move {
                let answer = match addr.parse::<Endpoint>() {
                    Err(e) => Err(format!("{addr:?} is no address: {e}")),
                    Ok(ep) => {
                        let client = Client::for_cluster(ep, key, &me, &node).with_tls(tls);
                        let sent = crate::auth::now_ms();
                        match tokio::time::timeout(REACH_WAIT, client.ping(&PingAsk::default()))
                            .await
                        {
                            Err(_) => Err(format!("no answer in {} s", REACH_WAIT.as_secs())),
                            Ok(Err(e)) => Err(e.to_string()),
                            Ok(Ok(p)) if p.node != node => Err(format!(
                                "{addr} is {}, not {node}: its advertised address is another \
                                 node's",
                                p.node
                            )),
                            Ok(Ok(p)) => {
                                let back = crate::auth::now_ms();
                                Ok((p.version, p.now_ms - (sent + back) / 2))
                            }
                        }
                    }
                };
                Reached { node, addr, answer }
            }
        });
        let reached = futures::future::join_all(reached).await;
        let (members, refused) = match (ask.members, self.coordinator()) {
            (true, Some(co)) => {
                let status = co.status(co.now_ms());
                let members = (status.nodes.into_iter())
                    .map(|n| MemberSeen {
                        node: n.name,
                        addr: n.addr,
                        version: n.version,
                        up: n.health == NodeHealth::Up,
                    })
                    .collect();
                (members, status.refused)
            }
            _ => (Vec::new(), Vec::new()),
        };
        Ok(Pong {
            node: me,
            version: VERSION.into(),
            protocol: PROTOCOL,
            now_ms: crate::auth::now_ms(),
            reached,
            members,
            refused,
        })
    }
}
