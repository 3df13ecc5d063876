//! `labrun admin`: the lab's rules on the coordinator, changed with no
//! restart (grants, tiers, the GPU cap) and shown with who changed what.

use std::process::ExitCode;

use anyhow::{bail, Result};
use labsync_agent::proto::{AdminChange, AdminRecord, AdminView};
use labsync_agent::Client;

use super::explain_client;

/// What an admin asks (`labrun admin ...`).
#[derive(Debug, clap::Subcommand)]
pub enum Ask {
    /// A paper-deadline grant: USER may run at TIER (the deadline tier)
    /// until the end of --until (UTC)
    Grant {
        /// The user
        user: String,
        /// The deadline tier (`deadline` on the default ladder)
        tier: String,
        /// The grant's last day, YYYY-MM-DD (UTC)
        #[arg(long, value_name = "YYYY-MM-DD")]
        until: String,
    },
    /// Withdraws USER's deadline grant (their queued deadline jobs fall
    /// back to their own tier)
    Ungrant {
        /// The user
        user: String,
    },
    /// Sets USER's own tier
    Tier {
        /// The user
        user: String,
        /// A tier of the ladder, not the deadline tier
        tier: String,
    },
    /// GPUs one user may have running at once (`none`: no cap)
    Cap {
        /// A number, or `none`
        gpus: String,
    },
    /// The rules in force: tiers, users, grants, cap, time limits, aging,
    /// fair share, and the changes admins made
    Show,
}

/// Runs `ask` against the coordinator.
pub async fn admin(client: &Client, json: bool, ask: Ask) -> Result<ExitCode> {
    let change = match ask {
        Ask::Show => None,
        Ask::Grant { user, tier, until } => {
            let view = client.admin_show().await.map_err(explain_client)?;
            match view.deadline_tier.as_deref() {
                Some(d) if d == tier => {}
                Some(d) => bail!(
                    "{tier:?} is not the lab's deadline tier: grants give {d:?} until a date; \
                     for a user's own tier, labrun admin tier {user} {tier}"
                ),
                None => bail!("the lab's ladder has no deadline tier to grant"),
            }
            let Some(until_ms) = crate::labd_config::end_of_day_ms(&until) else {
                bail!("--until {until:?}: write the grant's last day as YYYY-MM-DD (UTC)");
            };
            if until_ms <= labsync_agent::unix_now() * 1000 {
                bail!("--until {until}: that day is over; give today or a later day");
            }
            Some(AdminChange::Grant {
                user,
                until_ms: Some(until_ms),
            })
        }
        Ask::Ungrant { user } => Some(AdminChange::Grant {
            user,
            until_ms: None,
        }),
        Ask::Tier { user, tier } => Some(AdminChange::Tier { user, tier }),
        Ask::Cap { gpus } => Some(AdminChange::Cap {
            gpus: match gpus.as_str() {
                "none" => None,
                n => match n.parse::<u32>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => bail!("cap {n:?}: give a number of GPUs above 0, or `none`"),
                },
            },
        }),
    };
    let view = match change {
        Some(c) => client.admin_change(&c).await,
        None => client.admin_show().await,
    }
    .map_err(explain_client)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print!("{}", shown(&view));
    }
    Ok(ExitCode::SUCCESS)
}

/// `2026-12-20` from the end of that day, Unix ms.
fn day_of(end_ms: u64) -> String {
    let t = labsync_agent::utc_time((end_ms / 1000) as i64 - 1);
    t.split(' ').next().unwrap_or_default().to_string()
}

/// One change in words.
fn change_words(r: &AdminRecord, deadline: &str) -> String {
    let what = match &r.change {
        AdminChange::Grant {
            user,
            until_ms: Some(u),
        } => format!("grant {user} {deadline} until {}", day_of(*u)),
        AdminChange::Grant {
            user,
            until_ms: None,
        } => format!("ungrant {user}"),
        AdminChange::Tier { user, tier } => format!("tier {user} {tier}"),
        AdminChange::Cap { gpus: Some(n) } => format!("cap {n}"),
        AdminChange::Cap { gpus: None } => "cap none".into(),
    };
    format!(
        "{} UTC  {:<10} {}",
        labsync_agent::utc_time(r.at as i64),
        crate::shown(&r.by),
        crate::shown(&what)
    )
}

/// The rules as text.
fn shown(v: &AdminView) -> String {
    let deadline = v.deadline_tier.clone().unwrap_or_default();
    let mut out = format!("tiers: {}", v.tiers.join(" > "));
    if !deadline.is_empty() {
        out += &format!(" ({deadline}: by grant, until a date)");
    }
    out += "\n";
    out += &match v.cap {
        Some(n) => format!("cap: {n} GPU(s) running per user\n"),
        None => "cap: none\n".into(),
    };
    if !v.time_limits.is_empty() {
        let limits: Vec<String> = (v.time_limits.iter())
            .map(|(t, s)| format!("{t} {}", super::job_words::span(*s)))
            .collect();
        out += &format!("time limits (jobs without --time): {}\n", limits.join(", "));
    }
    if let Some(a) = v.aging_s {
        out += &format!(
            "aging: a waiting job rises one tier per {} waited, never to {} or above\n",
            super::job_words::span(a),
            if deadline.is_empty() {
                "the top tier"
            } else {
                &deadline
            }
        );
    }
    out += &format!("{:<16} {:<12} DEADLINE GRANT\n", "USER", "TIER");
    let now_ms = labsync_agent::unix_now() * 1000;
    for u in &v.users {
        let grant = match u.deadline_until {
            Some(t) if t > now_ms => format!("until {} (UTC)", day_of(t)),
            Some(t) => format!("lapsed {}", day_of(t)),
            None => "-".into(),
        };
        out += &format!(
            "{:<16} {:<12} {grant}\n",
            crate::shown(&u.user),
            crate::shown(&u.tier)
        );
    }
    out += "(anyone else: ";
    out += v.tiers.last().map_or("", |s| s.as_str());
    out += ")\n";
    if !v.usage.is_empty() {
        let used: Vec<String> = (v.usage.iter())
            .map(|(u, h)| format!("{} {h:.2}", crate::shown(u)))
            .collect();
        out += &format!("fair share (GPU-hours, decayed): {}\n", used.join(", "));
    }
    if !v.changes.is_empty() {
        out += "changes:\n";
        for r in &v.changes {
            out += &format!("  {}\n", change_words(r, &deadline));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use labsync_agent::proto::UserRule;

    #[test]
    fn the_rules_read_with_who_changed_what() {
        let v = AdminView {
            tiers: vec!["lead".into(), "deadline".into(), "phd".into()],
            deadline_tier: Some("deadline".into()),
            users: vec![UserRule {
                user: "alice".into(),
                tier: "phd".into(),
                deadline_until: Some(4_102_444_800_000),
            }],
            cap: Some(8),
            time_limits: vec![("phd".into(), 2 * 86_400)],
            aging_s: Some(86_400),
            changes: vec![AdminRecord {
                at: 1_796_688_000,
                by: "admin".into(),
                change: AdminChange::Grant {
                    user: "alice".into(),
                    until_ms: Some(4_102_444_800_000),
                },
            }],
            usage: vec![("bob".into(), 1.5)],
        };
        let s = shown(&v);
        assert!(
            s.contains("tiers: lead > deadline > phd (deadline: by grant"),
            "{s}"
        );
        assert!(s.contains("cap: 8 GPU(s) running per user"), "{s}");
        assert!(
            s.contains("time limits (jobs without --time): phd 2 d"),
            "{s}"
        );
        assert!(
            s.contains("alice            phd          until 2099-12-31 (UTC)"),
            "{s}"
        );
        assert!(
            s.contains("admin      grant alice deadline until 2099-12-31"),
            "{s}"
        );
        assert!(
            s.contains("fair share (GPU-hours, decayed): bob 1.50"),
            "{s}"
        );
    }
}
