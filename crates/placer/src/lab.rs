//! The lab's rules of precedence: the tier ladder, paper-deadline grants
//! that lapse, fair share by decaying GPU time, and the order of the queue
//! that follows from them.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::cluster::Millis;

/// A priority tier, an index into the [`Ladder`]: 0 is the highest.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Tier(pub u8);

/// The lab's tiers, highest first, and which of them is the paper-deadline
/// tier (granted by an admin, until a date).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ladder {
    names: Vec<String>,
    deadline: Option<Tier>,
}

/// A ladder that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("tier ladder: {0}")]
pub struct BadLadder(pub String);

impl Default for Ladder {
    /// Project lead > paper deadline > PhD > master > undergraduate.
    fn default() -> Self {
        Ladder::new(
            ["lead", "deadline", "phd", "master", "undergrad"]
                .into_iter()
                .map(String::from)
                .collect(),
            Some("deadline"),
        )
        .expect("the default ladder is valid")
    }
}

impl Ladder {
    /// Tiers named highest first; `deadline` names the one only grants
    /// give (`None`: no such tier).
    pub fn new(names: Vec<String>, deadline: Option<&str>) -> Result<Ladder, BadLadder> {
        if names.is_empty() || names.len() > 32 {
            return Err(BadLadder(format!(
                "has {} tiers; give 1 to 32, highest first",
                names.len()
            )));
        }
        for (i, n) in names.iter().enumerate() {
            if n.is_empty()
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(BadLadder(format!(
                    "tier name {n:?}: use letters, digits, '-' and '_'"
                )));
            }
            if names[..i].contains(n) {
                return Err(BadLadder(format!("tier {n:?} is named twice")));
            }
        }
        let mut ladder = Ladder {
            names,
            deadline: None,
        };
        if let Some(d) = deadline {
            ladder.deadline = Some(ladder.tier(d).ok_or_else(|| {
                BadLadder(format!(
                    "the deadline tier {d:?} is not one of {}",
                    ladder.names.join(", ")
                ))
            })?);
        }
        Ok(ladder)
    }

    /// The tier of that name.
    pub fn tier(&self, name: &str) -> Option<Tier> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| Tier(i as u8))
    }

    /// The name of a tier (`?` for one off the ladder).
    pub fn name(&self, tier: Tier) -> &str {
        self.names.get(tier.0 as usize).map_or("?", |s| s.as_str())
    }

    /// The lowest tier: where users the config does not name stand.
    pub fn lowest(&self) -> Tier {
        Tier(self.names.len() as u8 - 1)
    }

    /// The tier only grants give, if the ladder has one.
    pub fn deadline(&self) -> Option<Tier> {
        self.deadline
    }

    /// Every tier name, highest first.
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Where one user stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Their own tier.
    pub tier: Tier,
    /// A paper-deadline grant: jobs may ask for the deadline tier until
    /// then; it lapses by itself.
    pub deadline_until: Option<Millis>,
}

/// Why a job cannot have the tier it asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TierRefused(pub String);

/// The lab's members and their tiers.
#[derive(Clone, Debug, Default)]
pub struct Members {
    /// The ladder.
    pub ladder: Ladder,
    /// By user name; anyone else stands at the ladder's lowest tier.
    pub members: HashMap<String, Member>,
}

impl Members {
    /// `user`'s entry, made at the lowest tier with no grant if they had
    /// none (the config's `[lab.grants]` and `labrun admin` both name
    /// users the ladder did not).
    pub fn entry(&mut self, user: &str) -> &mut Member {
        let lowest = self.ladder.lowest();
        self.members.entry(user.to_string()).or_insert(Member {
            tier: lowest,
            deadline_until: None,
        })
    }

    /// The tier a job of `user` runs at when it asks for `asked` (a tier
    /// name) at `now`. Without asking: the user's own tier. A user may ask
    /// for their own tier or any lower one; the deadline tier only while an
    /// admin's grant runs, whatever their own tier.
    pub fn tier_for(
        &self,
        user: &str,
        asked: Option<&str>,
        now: Millis,
    ) -> Result<Tier, TierRefused> {
        let member = self.members.get(user);
        let own = member.map_or(self.ladder.lowest(), |m| m.tier);
        let Some(asked) = asked else {
            return Ok(own);
        };
        let tier = self.ladder.tier(asked).ok_or_else(|| {
            TierRefused(format!(
                "no tier is named {asked:?}; the lab's tiers are {}",
                self.ladder.names.join(", ")
            ))
        })?;
        // The deadline tier needs a grant only to rise to it.
        if Some(tier) == self.ladder.deadline && tier < own {
            return match member.and_then(|m| m.deadline_until) {
                Some(until) if until > now => Ok(tier),
                Some(until) => Err(TierRefused(format!(
                    "{user}'s {asked} grant lapsed {} ago; an admin grants it again in [lab.grants] of the coordinator's labd.toml",
                    span((now - until) / 1000)
                ))),
                None => Err(TierRefused(format!(
                    "{user} has no {asked} grant; an admin gives one in [lab.grants] of the coordinator's labd.toml"
                ))),
            };
        }
        if tier < own {
            return Err(TierRefused(format!(
                "{user}'s tier is {}; a job may ask for that tier or a lower one, not {asked}",
                self.ladder.name(own)
            )));
        }
        Ok(tier)
    }
}

/// A duration for messages: `40 s`, `12 min`, `3 h`, `2 d`.
pub(crate) fn span(secs: u64) -> String {
    match secs {
        0..120 => format!("{secs} s"),
        120..7200 => format!("{} min", secs / 60),
        7200..172_800 => format!("{} h", secs / 3600),
        _ => format!("{} d", secs / 86_400),
    }
}

/// GPU time each user has used, decaying by half every `half_life`: the
/// fair-share measure inside a tier (who used least lately goes first).
#[derive(Clone, Debug)]
pub struct Usage {
    half_life: Millis,
    /// GPU-seconds as of a time.
    per_user: HashMap<String, (f64, Millis)>,
}

impl Default for Usage {
    /// A half-life of seven days.
    fn default() -> Self {
        Usage::new(7 * 86_400 * 1000)
    }
}

impl Usage {
    /// No usage yet; halves every `half_life` milliseconds.
    pub fn new(half_life: Millis) -> Usage {
        Usage {
            half_life: half_life.max(1),
            per_user: HashMap::new(),
        }
    }

    fn decayed(&self, value: f64, from: Millis, to: Millis) -> f64 {
        if to <= from {
            return value;
        }
        value * 0.5f64.powf((to - from) as f64 / self.half_life as f64)
    }

    /// Adds `gpu_secs` of `user`'s at `now`.
    pub fn add(&mut self, user: &str, gpu_secs: f64, now: Millis) {
        let (v, at) = self.per_user.get(user).copied().unwrap_or((0.0, now));
        let v = self.decayed(v, at, now) + gpu_secs;
        self.per_user.insert(user.to_string(), (v, now.max(at)));
    }

    /// `user`'s decayed GPU-seconds at `now`.
    pub fn of(&self, user: &str, now: Millis) -> f64 {
        self.per_user
            .get(user)
            .map_or(0.0, |&(v, at)| self.decayed(v, at, now))
    }

    /// Where `user` stands against the others, the same at any time: the
    /// log of their decayed usage, referred to time 0. Every user's usage
    /// decays by the same factor, so comparing standings is comparing
    /// [`Usage::of`] at any one time (`-inf`: no usage).
    pub fn standing(&self, user: &str) -> f64 {
        self.per_user
            .get(user)
            .map_or(f64::NEG_INFINITY, |&(v, at)| {
                v.ln() + at as f64 * std::f64::consts::LN_2 / self.half_life as f64
            })
    }

    /// Every user's entry as of its last update (for saving).
    pub fn entries(&self) -> impl Iterator<Item = (&str, f64, Millis)> {
        self.per_user
            .iter()
            .map(|(u, &(v, at))| (u.as_str(), v, at))
    }

    /// Restores an entry [`Usage::entries`] gave.
    pub fn restore(&mut self, user: &str, gpu_secs: f64, at: Millis) {
        self.per_user.insert(user.to_string(), (gpu_secs, at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Millis = 86_400 * 1000;

    fn lab() -> Members {
        let mut m = Members::default();
        m.members.insert(
            "lead".into(),
            Member {
                tier: Tier(0),
                deadline_until: None,
            },
        );
        m.members.insert(
            "alice".into(),
            Member {
                tier: Tier(2),
                deadline_until: Some(10 * DAY),
            },
        );
        m.members.insert(
            "bob".into(),
            Member {
                tier: Tier(3),
                deadline_until: None,
            },
        );
        m
    }

    #[test]
    fn the_default_ladder_is_the_labs() {
        let l = Ladder::default();
        assert_eq!(
            l.names(),
            ["lead", "deadline", "phd", "master", "undergrad"]
        );
        assert_eq!(l.deadline(), Some(Tier(1)));
        assert_eq!(l.lowest(), Tier(4));
        assert!(Ladder::new(vec!["a".into(), "a".into()], None).is_err());
        assert!(Ladder::new(vec!["a".into()], Some("b")).is_err());
        assert!(Ladder::new(vec![], None).is_err());
    }

    #[test]
    fn a_deadline_grant_holds_until_its_date_and_then_lapses() {
        let m = lab();
        assert_eq!(m.tier_for("alice", None, 0), Ok(Tier(2)));
        assert_eq!(m.tier_for("alice", Some("deadline"), 9 * DAY), Ok(Tier(1)));
        let lapsed = m.tier_for("alice", Some("deadline"), 12 * DAY).unwrap_err();
        assert!(
            lapsed.0.contains("alice's deadline grant lapsed 2 d ago"),
            "{lapsed}"
        );
        let none = m.tier_for("bob", Some("deadline"), 0).unwrap_err();
        assert!(none.0.contains("bob has no deadline grant"), "{none}");
    }

    #[test]
    fn a_job_asks_for_its_users_tier_or_lower_only() {
        let m = lab();
        assert_eq!(m.tier_for("bob", Some("undergrad"), 0), Ok(Tier(4)));
        let up = m.tier_for("bob", Some("phd"), 0).unwrap_err();
        assert!(up.0.contains("bob's tier is master"), "{up}");
        assert_eq!(m.tier_for("lead", Some("lead"), 0), Ok(Tier(0)));
        // Stepping down to the deadline tier needs no grant.
        assert_eq!(m.tier_for("lead", Some("deadline"), 0), Ok(Tier(1)));
        // Strangers stand at the bottom.
        assert_eq!(m.tier_for("eve", None, 0), Ok(Tier(4)));
        let bad = m.tier_for("bob", Some("vip"), 0).unwrap_err();
        assert!(bad.0.contains("no tier is named \"vip\""), "{bad}");
    }

    #[test]
    fn usage_halves_every_half_life() {
        let mut u = Usage::new(DAY);
        u.add("alice", 100.0, 0);
        assert_eq!(u.of("alice", 0), 100.0);
        assert!((u.of("alice", DAY) - 50.0).abs() < 1e-9);
        u.add("alice", 50.0, DAY);
        assert!((u.of("alice", 2 * DAY) - 50.0).abs() < 1e-9);
        assert_eq!(u.of("bob", DAY), 0.0);
        // Standings order users as their usage does, whenever compared.
        u.add("bob", 30.0, 3 * DAY);
        u.add("carol", 300.0, 0);
        for at in [3 * DAY, 5 * DAY, 40 * DAY] {
            let mut by_usage = ["alice", "bob", "carol", "dave"];
            by_usage.sort_by(|a, b| u.of(a, at).total_cmp(&u.of(b, at)));
            let mut by_standing = ["alice", "bob", "carol", "dave"];
            by_standing.sort_by(|a, b| u.standing(a).total_cmp(&u.standing(b)));
            assert_eq!(by_usage, by_standing, "at {at}");
        }
    }
}
