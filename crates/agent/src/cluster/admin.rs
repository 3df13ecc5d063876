//! The lab's rules changed with no restart (`labrun admin grant`, `tier`,
//! `cap`; `labrun admin show`): each change is checked, applied at once and
//! kept in the coordinator's database with who made it and when; at a
//! restart they are applied again over the config file's `[lab]`, whose
//! values are the defaults. Only admins may change or read them.

use labsync_placer::{Members, Policy};

use super::Coordinator;
use crate::error::JobError;
use crate::proto::{AdminChange, AdminRecord, AdminView, UserRule};
use crate::request::Caller;

/// Changes `labrun admin show` lists, the latest.
const SHOWN: usize = 100;

/// A user name an admin may name: what a token file takes.
fn check_user(user: &str) -> Result<(), String> {
    let ok = !user.is_empty()
        && user.len() <= 64
        && user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    match ok {
        true => Ok(()),
        false => Err(format!(
            "user {user:?}: give a name of letters, digits, '-', '_' and '.' (at most 64)"
        )),
    }
}

/// Applies `change` to the rules, or says why it cannot be.
pub(crate) fn apply(
    members: &mut Members,
    policy: &mut Policy,
    change: &AdminChange,
) -> Result<(), String> {
    match change {
        AdminChange::Grant { user, until_ms } => {
            check_user(user)?;
            if members.ladder.deadline().is_none() {
                return Err("the lab's ladder has no deadline tier to grant".into());
            }
            members.entry(user).deadline_until = *until_ms;
        }
        AdminChange::Tier { user, tier } => {
            check_user(user)?;
            let t = members.ladder.tier(tier).ok_or_else(|| {
                format!(
                    "no tier is named {tier:?}; the lab's tiers are {}",
                    members.ladder.names().join(", ")
                )
            })?;
            if Some(t) == members.ladder.deadline() {
                return Err(format!(
                    "{tier} comes from a grant with an end date: labrun admin grant {user} {tier} --until YYYY-MM-DD"
                ));
            }
            members.entry(user).tier = t;
        }
        AdminChange::Cap { gpus } => {
            if *gpus == Some(0) {
                return Err("a cap of 0 would stop every GPU job; `none` lifts the cap".into());
            }
            policy.user_gpu_cap = *gpus;
        }
    }
    Ok(())
}

impl Coordinator {
    fn admin_only(caller: &Caller, what: &str) -> Result<(), JobError> {
        match caller.admin {
            true => Ok(()),
            false => Err(JobError::Forbidden(format!(
                "{what} is for the lab's admins; {} is not one (labd's admins)",
                caller.user
            ))),
        }
    }

    /// The lab's rules in force, for an admin.
    pub fn admin_view(&self, caller: &Caller) -> Result<AdminView, JobError> {
        Self::admin_only(caller, "labrun admin show")?;
        let mut changes = self
            .jobs
            .admin_log()
            .map_err(|e| JobError::Internal(e.to_string()))?;
        let cut = changes.len().saturating_sub(SHOWN);
        changes.drain(..cut);
        let members = self.members();
        let ladder = &members.ladder;
        let mut users: Vec<UserRule> = (members.members.iter())
            .map(|(user, m)| UserRule {
                user: user.clone(),
                tier: ladder.name(m.tier).to_string(),
                deadline_until: m.deadline_until,
            })
            .collect();
        users.sort_by(|a, b| a.user.cmp(&b.user));
        let mut time_limits: Vec<(String, u64)> = (self.time_limits.iter())
            .map(|(t, s)| (ladder.name(*t).to_string(), *s))
            .collect();
        time_limits.sort_by_key(|(t, _)| ladder.tier(t));
        let policy = self.policy();
        let now = self.now_ms();
        let mut usage: Vec<(String, f64)> = {
            let u = self.usage.lock().expect("coordinator poisoned");
            (u.entries())
                .map(|(user, _, _)| (user.to_string(), u.of(user, now) / 3600.0))
                .collect()
        };
        usage.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(AdminView {
            tiers: ladder.names().to_vec(),
            deadline_tier: ladder.deadline().map(|t| ladder.name(t).to_string()),
            users,
            cap: policy.user_gpu_cap,
            time_limits,
            aging_s: policy.aging_secs,
            changes,
            usage,
        })
    }

    /// Makes an admin's change: checked, kept, then in force from the next
    /// pass. A change that cannot be kept is not made.
    pub fn admin_change(
        &self,
        caller: &Caller,
        change: AdminChange,
    ) -> Result<AdminView, JobError> {
        Self::admin_only(caller, "labrun admin")?;
        {
            let (mut members, mut policy) = self.rules_mut();
            let (mut m, mut p) = (members.clone(), policy.clone());
            apply(&mut m, &mut p, &change).map_err(JobError::Invalid)?;
            let rec = AdminRecord {
                at: self.clock.unix_secs(),
                by: caller.user.clone(),
                change: change.clone(),
            };
            self.jobs
                .put_admin(&rec)
                .map_err(|e| JobError::Internal(e.to_string()))?;
            (*members, *policy) = (m, p);
        }
        tracing::info!("{} changed the lab's rules: {change:?}", caller.user);
        self.wake.notify_one();
        self.admin_view(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use labsync_placer::Tier;

    #[test]
    fn changes_are_checked_before_they_apply() {
        let mut m = Members::default();
        let mut p = Policy::default();
        let grant = AdminChange::Grant {
            user: "alice".into(),
            until_ms: Some(1000),
        };
        apply(&mut m, &mut p, &grant).unwrap();
        assert_eq!(m.members["alice"].deadline_until, Some(1000));
        assert_eq!(m.members["alice"].tier, Tier(4));
        let tier = |t: &str| AdminChange::Tier {
            user: "alice".into(),
            tier: t.into(),
        };
        apply(&mut m, &mut p, &tier("phd")).unwrap();
        assert_eq!(m.members["alice"].tier, Tier(2));
        // The grant stays with a new tier.
        assert_eq!(m.members["alice"].deadline_until, Some(1000));
        let e = apply(&mut m, &mut p, &tier("deadline")).unwrap_err();
        assert!(e.contains("comes from a grant"), "{e}");
        let e = apply(&mut m, &mut p, &tier("postdoc")).unwrap_err();
        assert!(e.contains("no tier is named \"postdoc\""), "{e}");
        let e = apply(
            &mut m,
            &mut p,
            &AdminChange::Tier {
                user: "../etc".into(),
                tier: "phd".into(),
            },
        )
        .unwrap_err();
        assert!(e.contains("user \"../etc\""), "{e}");
        apply(&mut m, &mut p, &AdminChange::Cap { gpus: Some(8) }).unwrap();
        assert_eq!(p.user_gpu_cap, Some(8));
        assert!(apply(&mut m, &mut p, &AdminChange::Cap { gpus: Some(0) }).is_err());
        apply(&mut m, &mut p, &AdminChange::Cap { gpus: None }).unwrap();
        assert_eq!(p.user_gpu_cap, None);
    }
}
