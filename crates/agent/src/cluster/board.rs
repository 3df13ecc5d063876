//! What the web page and `/metrics` read of the coordinator beyond its
//! status ([`Coordinator::status`]): the tier each live job runs at, and
//! where each user stands (tier, grant, fair-share usage).

use std::collections::{BTreeMap, HashMap};

use super::pass::tier_of;
use super::Coordinator;

/// One user's standing.
#[derive(Clone, Debug, PartialEq)]
pub struct Standing {
    /// The user.
    pub user: String,
    /// Their own tier.
    pub tier: String,
    /// Their deadline grant runs until then (Unix milliseconds), lapsed
    /// or not.
    pub deadline_until: Option<u64>,
    /// Their decayed GPU time now, GPU-seconds (what fair share orders
    /// by; lowest first).
    pub usage_gpu_secs: f64,
}

/// The lab's tiers, each live job's, and every user's standing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Standings {
    /// Tier names, highest first.
    pub tiers: Vec<String>,
    /// The deadline tier's name, if the ladder has one.
    pub deadline: Option<String>,
    /// Job id → the tier it runs (or waits) at now.
    pub job_tiers: HashMap<String, String>,
    /// Every user the config names, who has usage, or a live job; by name.
    pub users: Vec<Standing>,
}

impl Coordinator {
    /// The standings at `now` (Unix milliseconds).
    pub fn standings(&self, now: u64) -> Standings {
        let members = self.members();
        let ladder = &members.ladder;
        let live = self.jobs.live();
        let job_tiers = live
            .iter()
            .map(|j| {
                let t = tier_of(&members, j, now);
                (j.id.to_string(), ladder.name(t).to_string())
            })
            .collect();
        let usage = self.usage.lock().expect("coordinator poisoned");
        let mut users: BTreeMap<String, Standing> = BTreeMap::new();
        let names = (members.members.keys().cloned())
            .chain(usage.entries().map(|(u, _, _)| u.to_string()))
            .chain(live.iter().map(|j| j.user.clone()));
        for user in names {
            let member = members.members.get(&user);
            let tier = member.map_or(ladder.lowest(), |m| m.tier);
            users.insert(
                user.clone(),
                Standing {
                    tier: ladder.name(tier).to_string(),
                    deadline_until: member.and_then(|m| m.deadline_until),
                    usage_gpu_secs: usage.of(&user, now),
                    user,
                },
            );
        }
        Standings {
            tiers: ladder.names().to_vec(),
            deadline: ladder.deadline().map(|t| ladder.name(t).to_string()),
            job_tiers,
            users: users.into_values().collect(),
        }
    }

    /// Where `job`'s user asked to be told of its end.
    pub fn notify_targets(&self, job: &str) -> Vec<String> {
        match self.jobs.get(job) {
            Ok(Some(j)) => j.req.notify,
            _ => Vec::new(),
        }
    }
}
