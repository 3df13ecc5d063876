//! The pages, as HTML strings. Every value that is not this file's own
//! text goes through [`esc`]: commands, labels, user, node and job names
//! are chosen by lab members, and a page is read by the others.

use std::fmt::Write as _;

use super::prom::gpu_state;
use super::{Access, Board, LogTail};
use crate::daemon::shares::human_bytes;
use crate::leases::JobState;
use crate::proto::{JobView, NodeHealth, NodeStatus};
use crate::status::{ForeignProcess, GpuState, GpuStatus};

/// `s` as HTML text or a quoted attribute's value.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A path segment: a job id or user name in a link, percent-encoded
/// beyond what ids and names are made of.
fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// `1 h 05 min`, `3 d 4 h`, `45 s`.
pub fn span(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s} s"),
        s if s < 3600 => format!("{} min", s / 60),
        s if s < 86_400 => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
        s => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A Unix time as UTC, with how long ago in the tooltip.
fn at(t: u64, now: u64) -> String {
    format!(
        "<span title=\"{} ago\">{} UTC</span>",
        span(now.saturating_sub(t)),
        crate::clock::utc_time(t as i64)
    )
}

fn job_link(id: &str) -> String {
    format!("<a href=\"/job/{}\">{}</a>", seg(id), esc(id))
}

fn user_link(user: &str) -> String {
    format!("<a href=\"/user/{}\">{}</a>", seg(user), esc(user))
}

/// The whole page around `body` (the live part, which `app.js` replaces
/// with `?live=1` of the same address every second).
pub fn page(title: &str, viewer: Option<&str>, access: Access, body: &str) -> String {
    let who = match (viewer, access) {
        (Some(u), _) => format!(
            "{} <form method=\"post\" action=\"/logout\"><button>log out</button></form>",
            user_link(u)
        ),
        (None, _) => "<a href=\"/login\">log in</a>".into(),
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>{title} · labsync</title><link rel=\"stylesheet\" href=\"/ui/style.css\">\
         <script src=\"/ui/app.js\" defer></script>\
         <noscript><meta http-equiv=\"refresh\" content=\"5\"></noscript></head>\
         <body><header><a class=\"home\" href=\"/\">labsync</a><span class=\"who\">{who}</span></header>\
         <main id=\"live\" data-live=\"1\">{body}</main></body></html>\n",
        title = esc(title),
    )
}

/// The error page.
pub fn error_page(why: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>labsync</title>\
         <link rel=\"stylesheet\" href=\"/ui/style.css\"></head><body><header><a class=\"home\" \
         href=\"/\">labsync</a></header><main><p class=\"error\">{}</p></main></body></html>\n",
        esc(why)
    )
}

/// The login form.
pub fn login(error: Option<&str>) -> String {
    let error = error.map_or(String::new(), |e| {
        format!("<p class=\"error\">{}</p>", esc(e))
    });
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>log in · labsync</title><link rel=\"stylesheet\" href=\"/ui/style.css\"></head>\
         <body><header><a class=\"home\" href=\"/\">labsync</a></header><main>\
         <h1>Log in</h1>{error}<form class=\"login\" method=\"post\" action=\"/login\">\
         <label>Your labsync token (the <code>token</code> line of \
         <code>~/.config/labsync/config.toml</code>) \
         <input type=\"password\" name=\"token\" autocomplete=\"current-password\" required></label>\
         <button type=\"submit\">Log in</button></form></main></body></html>\n"
    )
}

/// Waiting jobs the home page lists; `/queue` lists them all.
pub const QUEUE_SHOWN: usize = 100;
/// Characters of a job's why the queue shows (its page shows all of it):
/// in a cluster of 50 nodes it names each.
const WHY_SHOWN: usize = 300;

/// The home page's live part: the grid, the queue (`all` of it, or the
/// first [`QUEUE_SHOWN`]), the running jobs, the data.
pub fn board(b: &Board, all: bool) -> String {
    let mut out = String::new();
    let up = b
        .nodes
        .iter()
        .filter(|n| n.health == NodeHealth::Up)
        .count();
    let queued = b
        .jobs
        .iter()
        .filter(|j| j.state == JobState::Queued)
        .count();
    let _ = write!(
        out,
        "<p class=\"summary\">{what}: {n} node(s), {up} up, served by {by} (labsync {v}); \
         {queued} job(s) waiting</p>",
        what = if b.cluster { "Cluster" } else { "One node" },
        n = b.nodes.len(),
        by = esc(&b.served_by),
        v = esc(&b.version),
    );
    for r in &b.refused {
        let _ = write!(
            out,
            "<p class=\"error\">{} is refused: {}</p>",
            esc(r.node.as_str()),
            esc(&r.why)
        );
    }
    grid(&mut out, b);
    queue(&mut out, b, if all { usize::MAX } else { QUEUE_SHOWN });
    running(&mut out, b);
    data(&mut out, b);
    out
}

fn grid(out: &mut String, b: &Board) {
    out.push_str("<h2>GPUs</h2><div class=\"grid\">");
    for n in &b.nodes {
        node_card(out, b, n);
    }
    out.push_str("</div>");
}

fn node_card(out: &mut String, b: &Board, n: &NodeStatus) {
    let up = n.health == NodeHealth::Up;
    let health = match n.health {
        NodeHealth::Up => "up".to_string(),
        NodeHealth::Down { since } => {
            format!("down for {}", span(b.now.saturating_sub(since / 1000)))
        }
    };
    let _ = write!(
        out,
        "<section class=\"node {cls}\" data-node=\"{name}\"><h3>{name} <small>{health}, labsync {v}, \
         cache {used} of {max}</small></h3>",
        cls = if up { "up" } else { "down" },
        name = esc(n.name.as_str()),
        v = esc(&n.version),
        used = human_bytes(n.cache_used),
        max = human_bytes(n.cache_max),
    );
    if n.gpus.is_empty() {
        out.push_str("<p class=\"muted\">no GPUs</p>");
    }
    out.push_str("<table class=\"gpus\">");
    for g in &n.gpus {
        gpu_row(out, b, n, g, up);
    }
    out.push_str("</table>");
    for s in &n.suspect {
        let _ = write!(out, "<p class=\"warn\">{}</p>", esc(s));
    }
    out.push_str("</section>");
}

fn gpu_row(out: &mut String, b: &Board, n: &NodeStatus, g: &GpuStatus, up: bool) {
    let state = gpu_state(up, &g.state);
    let mem = g.info.as_ref().map_or(String::from("?"), |i| {
        format!(
            "{} / {}",
            human_bytes(i.memory_used),
            human_bytes(i.memory_total)
        )
    });
    let model = g.info.as_ref().map_or(String::new(), |i| esc(&i.name));
    let what = match (&g.state, up) {
        (_, false) => "node down: last known state unknown".to_string(),
        (GpuState::Free, _) => "free".into(),
        (GpuState::Leased { job, others }, _) => {
            let mut s = job_link(job);
            if let Some(j) = b.job(job) {
                let _ = write!(s, " {}", user_link(&j.user));
                if let Some(t) = j.started_at {
                    let _ = write!(s, " · {}", span(b.now.saturating_sub(t)));
                }
                if let Some(h) = j.meta.hold_s {
                    let _ = write!(s, " · hold of {}", span(h));
                    match j.meta.idle_since_ms {
                        Some(t) => {
                            let idle = b.now.saturating_sub(t / 1000);
                            let _ = write!(s, ", <span class=\"warn\">idle {}</span>", span(idle));
                        }
                        None => s.push_str(", in use"),
                    }
                }
            }
            if !others.is_empty() {
                let _ = write!(s, " <span class=\"warn\">also: {}</span>", procs(others));
            }
            s
        }
        (GpuState::Foreign { processes }, _) => format!("foreign: {}", procs(processes)),
        (GpuState::Unknown { reason }, _) => format!("unknown: {}", esc(reason)),
    };
    let _ = write!(
        out,
        "<tr><th>{idx}</th><td class=\"model\">{model}</td><td class=\"mem\">{mem}</td>\
         <td class=\"gpu {state}\" data-node=\"{node}\" data-gpu=\"{idx}\" data-state=\"{state}\">{what}</td></tr>",
        idx = g.index,
        node = esc(n.name.as_str()),
    );
}

fn procs(ps: &[ForeignProcess]) -> String {
    ps.iter()
        .map(|p| {
            let mut s = format!("pid {}", p.pid);
            if let Some(u) = &p.user {
                let _ = write!(s, " ({})", esc(u));
            }
            if let Some(j) = &p.job {
                let _ = write!(s, " of {}", job_link(j));
            }
            if let Some(m) = p.used_bytes {
                let _ = write!(s, " {}", human_bytes(m));
            }
            s
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn tier<'a>(b: &'a Board, id: &str) -> &'a str {
    b.standings.job_tiers.get(id).map_or("", String::as_str)
}

fn queue(out: &mut String, b: &Board, shown: usize) {
    out.push_str("<h2>Queue</h2>");
    let waiting: Vec<&JobView> = (b.jobs.iter())
        .filter(|j| j.state == JobState::Queued)
        .collect();
    if waiting.is_empty() {
        out.push_str("<p class=\"muted\">nothing waiting</p>");
        return;
    }
    let more = waiting.len().saturating_sub(shown);
    out.push_str(
        "<table class=\"queue\"><tr><th>job</th><th>tier</th><th>user</th><th>GPUs</th>\
         <th>waiting</th><th>why</th></tr>",
    );
    for j in waiting.into_iter().take(shown) {
        let why = j.why.as_deref().unwrap_or("");
        let why = match why.char_indices().nth(WHY_SHOWN) {
            Some((cut, _)) => format!("{}…", &why[..cut]),
            None => why.to_string(),
        };
        let _ = write!(
            out,
            "<tr data-job=\"{id}\"><td>{link}</td><td>{tier}</td><td>{user}</td><td>{gpus}</td>\
             <td>{waited}</td><td>{why}</td></tr>",
            id = esc(j.id.as_str()),
            link = job_link(j.id.as_str()),
            tier = esc(tier(b, j.id.as_str())),
            user = user_link(&j.user),
            gpus = j.gpus_wanted,
            waited = span(b.now.saturating_sub(j.submitted_at)),
            why = esc(&why),
        );
    }
    out.push_str("</table>");
    if more > 0 {
        let _ = write!(
            out,
            "<p><a href=\"/queue\">{more} more waiting</a> (in the queue's order)</p>"
        );
    }
}

fn running(out: &mut String, b: &Board) {
    out.push_str("<h2>Running</h2>");
    let running: Vec<&JobView> = (b.jobs.iter())
        .filter(|j| matches!(j.state, JobState::Running { .. }))
        .collect();
    if running.is_empty() {
        out.push_str("<p class=\"muted\">nothing running</p>");
        return;
    }
    out.push_str(
        "<table class=\"running\"><tr><th>job</th><th>user</th><th>node</th><th>GPUs</th>\
         <th>for</th><th>command</th></tr>",
    );
    for j in running {
        let _ = write!(
            out,
            "<tr data-job=\"{id}\"><td>{link}</td><td>{user}</td><td>{node}</td><td>{gpus}</td>\
             <td>{runs}</td><td><code>{cmd}</code></td></tr>",
            id = esc(j.id.as_str()),
            link = job_link(j.id.as_str()),
            user = user_link(&j.user),
            node = esc(j.node.as_ref().map_or("", |n| n.as_str())),
            gpus = gpu_list(&j.gpus),
            runs = span(b.now.saturating_sub(j.started_at.unwrap_or(b.now))),
            cmd = esc(&j.argv.join(" ")),
        );
    }
    out.push_str("</table>");
}

fn gpu_list(gpus: &[u32]) -> String {
    if gpus.is_empty() {
        return "none".into();
    }
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn data(out: &mut String, b: &Board) {
    out.push_str(
        "<h2>Data</h2><table class=\"data\"><tr><th>node</th><th>dataset</th>\
                  <th>present</th><th></th></tr>",
    );
    let mut any = false;
    for n in &b.nodes {
        for d in &n.data {
            any = true;
            let pct = if d.total_bytes == 0 {
                100.0
            } else {
                100.0 * d.present_bytes as f64 / d.total_bytes as f64
            };
            let mut notes = Vec::new();
            if d.pinned {
                notes.push("pinned");
            }
            if d.materialised {
                notes.push("materialised");
            }
            let _ = write!(
                out,
                "<tr><td>{node}</td><td>{label}</td><td>{pct:.0}% of {total}</td><td>{notes}</td></tr>",
                node = esc(n.name.as_str()),
                label = esc(&d.label),
                total = human_bytes(d.total_bytes),
                notes = notes.join(", "),
            );
        }
        for w in &n.warming {
            any = true;
            let done = match w.total_bytes {
                Some(t) if t > 0 => format!(
                    "{:.0}% of {}",
                    100.0 * w.done_bytes as f64 / t as f64,
                    human_bytes(t)
                ),
                _ => human_bytes(w.done_bytes),
            };
            let state = match &w.error {
                Some(e) => format!("<span class=\"error\">failed: {}</span>", esc(e)),
                None => "warming".into(),
            };
            let _ = write!(
                out,
                "<tr><td>{node}</td><td>{label}</td><td>{done}</td><td>{state}</td></tr>",
                node = esc(n.name.as_str()),
                label = esc(&w.label),
            );
        }
    }
    if !any {
        out.push_str("<tr><td colspan=\"4\" class=\"muted\">no node has data cached</td></tr>");
    }
    out.push_str("</table>");
}

fn state_words(j: &JobView) -> String {
    match &j.state {
        JobState::Queued if j.meta.preparing.is_some() => "preparing".into(),
        JobState::Queued => "queued".into(),
        JobState::Running { .. } => "running".into(),
        JobState::Exited { code: Some(c), .. } => format!("exited {c}"),
        JobState::Exited {
            signal: Some(s), ..
        } => format!("killed by signal {s}"),
        JobState::Exited { .. } => "exited".into(),
        JobState::Failed { reason } => format!("failed: {reason}"),
    }
}

/// A job's page.
pub fn job(b: &Board, j: &JobView, tier: Option<&str>, log: &LogTail, told: &[String]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<h1>{id} <small class=\"state\" data-state=\"{st}\">{st}</small></h1><table class=\"facts\">",
        id = esc(j.id.as_str()),
        st = esc(&state_words(j)),
    );
    let mut row = |k: &str, v: String| {
        let _ = write!(out, "<tr><th>{k}</th><td>{v}</td></tr>");
    };
    row("user", user_link(&j.user));
    row(
        "command",
        format!("<code>{}</code>", esc(&j.argv.join(" "))),
    );
    let req = j.meta.request.as_ref();
    // Live, the coordinator's word; ended, the one its node recorded.
    let tier = tier.or(req.and_then(|r| r.priority.as_deref()));
    if let Some(t) = tier.filter(|t| !t.is_empty()) {
        row("tier", esc(t));
    }
    let tree = |t: &crate::proto::TreeRef| {
        format!(
            "{} <code title=\"snapshot\">{}</code>",
            esc(&t.label),
            esc(&t.snapshot.to_string())
        )
    };
    match req {
        Some(r) => {
            row("code", r.code.as_ref().map_or("none".into(), tree));
            let data: Vec<String> = r.data.iter().map(|d| tree(&d.tree)).collect();
            row(
                "data",
                if data.is_empty() {
                    "none".into()
                } else {
                    data.join("<br>")
                },
            );
        }
        // Recorded by an older labd: the labels alone.
        None => {
            row("code", esc(j.meta.code.as_deref().unwrap_or("none")));
            row(
                "data",
                j.meta
                    .data
                    .iter()
                    .map(|d| esc(d))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
        }
    }
    row(
        "where",
        format!(
            "{} · GPU(s) {} ({} asked)",
            esc(j.node.as_ref().map_or("not placed", |n| n.as_str())),
            gpu_list(&j.gpus),
            j.gpus_wanted
        ),
    );
    if let Some(why) = &j.why {
        row("why", esc(why));
    }
    let mut history = vec![format!("submitted {}", at(j.submitted_at, b.now))];
    if let Some(r) = req.filter(|r| r.restarts > 0) {
        history.push(format!(
            "requeued after a preemption (run {}){}",
            r.restarts + 1,
            r.resume_from.as_deref().map_or(String::new(), |f| format!(
                ", resuming from <code>{}</code>",
                esc(f)
            ))
        ));
    }
    if let Some(t) = j.meta.placed_at {
        let node = j.node.as_ref().map_or("", |n| n.as_str());
        history.push(format!("placed on {} {}", esc(node), at(t, b.now)));
    }
    if let Some(t) = j.started_at {
        history.push(format!("started {}", at(t, b.now)));
    }
    if let Some(s) = &j.meta.stopped_for {
        history.push(format!("preempted: {}", esc(s)));
    }
    if let Some(t) = j.ended_at {
        history.push(format!("ended {} ({})", at(t, b.now), esc(&state_words(j))));
    }
    row("history", history.join("<br>"));
    if let Some(o) = &j.meta.outputs {
        let saved = match (&j.meta.outputs_saved, &j.meta.outputs_error) {
            (_, Some(e)) => format!("<span class=\"error\">{}</span>", esc(e)),
            (Some(s), None) => format!("<code>{}</code>", esc(s)),
            (None, None) => "not saved yet".into(),
        };
        row("outputs", format!("{} → {saved}", esc(o)));
    }
    if let Some(r) = &j.meta.released {
        row("hold", esc(r));
    }
    if !told.is_empty() {
        row(
            "notified",
            told.iter().map(|t| esc(t)).collect::<Vec<_>>().join("<br>"),
        );
    }
    if req.is_some_and(|r| r.hold_s.is_none()) {
        row(
            "run again",
            format!("<code>labrun rerun {}</code>", esc(j.id.as_str())),
        );
    }
    let _ = out.write_str("</table><h2>Log</h2>");
    match log {
        LogTail::Text(t) if t.is_empty() => out.push_str("<p class=\"muted\">nothing yet</p>"),
        LogTail::Text(t) => {
            let _ = write!(out, "<pre class=\"log\">{}</pre>", esc(t));
        }
        LogTail::Hidden(why) => {
            let _ = write!(out, "<p class=\"muted\">{}</p>", esc(why));
        }
        LogTail::Failed(e) => {
            let _ = write!(out, "<p class=\"error\">{}</p>", esc(e));
        }
    }
    out
}

/// A user's page: their standing, running and recent jobs.
pub fn user(b: &Board, user: &str) -> String {
    let mut out = format!("<h1>{}</h1>", esc(user));
    match b.standing(user) {
        Some(s) => {
            let rank = (b.standings.users.iter())
                .filter(|o| o.usage_gpu_secs < s.usage_gpu_secs)
                .count()
                + 1;
            let _ = write!(
                out,
                "<p>Tier <b>{tier}</b>. Fair share: {h:.1} GPU-hours (decayed), {rank} of {n} \
                 in the queue's order among equals (least used first).</p>",
                tier = esc(&s.tier),
                h = s.usage_gpu_secs / 3600.0,
                n = b.standings.users.len(),
            );
            if let (Some(until), Some(d)) = (s.deadline_until, &b.standings.deadline) {
                let word = if until / 1000 > b.now {
                    "runs until"
                } else {
                    "lapsed"
                };
                let _ = write!(
                    out,
                    "<p>{} grant {word} {}.</p>",
                    esc(d),
                    at(until / 1000, b.now)
                );
            }
        }
        None if b.cluster => out.push_str("<p class=\"muted\">no tier set: the lab's lowest</p>"),
        None => {}
    }
    let mine: Vec<&JobView> = b.jobs.iter().filter(|j| j.user == user).collect();
    out.push_str("<h2>Jobs</h2>");
    if mine.is_empty() {
        out.push_str("<p class=\"muted\">no job in the last day</p>");
        return out;
    }
    out.push_str(
        "<table class=\"jobs\"><tr><th>job</th><th>state</th><th>node</th><th>GPUs</th>\
         <th>submitted</th><th>command</th></tr>",
    );
    for j in mine.iter().rev() {
        let _ = write!(
            out,
            "<tr><td>{link}</td><td>{st}</td><td>{node}</td><td>{gpus}</td><td>{sub}</td>\
             <td><code>{cmd}</code></td></tr>",
            link = job_link(j.id.as_str()),
            st = esc(&state_words(j)),
            node = esc(j.node.as_ref().map_or("", |n| n.as_str())),
            gpus = gpu_list(&j.gpus),
            sub = at(j.submitted_at, b.now),
            cmd = esc(&j.argv.join(" ")),
        );
    }
    out.push_str("</table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_members_choose_is_text_not_markup() {
        assert_eq!(
            esc("<script>alert('x')</script>&\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
        assert_eq!(seg("j7"), "j7");
        assert_eq!(seg("a/../b?c"), "a%2F..%2Fb%3Fc");
        let link = user_link("\"><img src=x onerror=alert(1)>");
        assert!(!link.contains("<img"), "{link}");
        assert!(link.starts_with("<a href=\"/user/%22%3E%3Cimg"), "{link}");
    }

    #[test]
    fn spans_read_as_people_say_them() {
        assert_eq!(span(45), "45 s");
        assert_eq!(span(600), "10 min");
        assert_eq!(span(3900), "1 h 05 min");
        assert_eq!(span(2 * 86_400 + 7200), "2 d 2 h");
    }
}
