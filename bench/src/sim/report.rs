//! Figures of a simulated run, the Markdown tables and the SVG plot.

use std::fmt::Write as _;

use super::engine::{Outcome, Policy};

/// One policy's figures over one workload.
#[derive(Clone, Debug)]
pub struct Summary {
    pub policy: Policy,
    pub jobs: usize,
    /// Submit → running (GPUs assigned and data there), seconds.
    pub wait_mean: f64,
    pub wait_median: f64,
    pub wait_p95: f64,
    /// Submit → GPUs assigned.
    pub queueing_mean: f64,
    /// GPUs assigned → data there.
    pub staging_mean: f64,
    /// Submit → end.
    pub jct_mean: f64,
    pub bytes_moved: u64,
    pub bytes_prefetch: u64,
    pub bytes_peer: u64,
    /// Bytes found in the node's cache at placement / bytes needed.
    pub hit_rate: f64,
    /// GPU time computing / GPU time of the span.
    pub utilisation: f64,
    pub held_idle_gpu_h: f64,
    /// Per tier: (tier, jobs, mean wait, p95 wait).
    pub tiers: Vec<(u8, usize, f64, f64)>,
    /// Jobs asking for 4 GPUs or more: (jobs, mean wait, p95 wait).
    pub big: (usize, f64, f64),
    pub waits: Vec<f64>,
    pub wall: f64,
}

/// The `q`-quantile of sorted values (nearest rank).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

pub fn summarise(o: &Outcome) -> Summary {
    let mut waits: Vec<f64> = o.jobs.iter().map(|j| j.ready - j.submit).collect();
    waits.sort_by(f64::total_cmp);
    let mut tiers = Vec::new();
    for t in 0..5u8 {
        let mut w: Vec<f64> = o
            .jobs
            .iter()
            .filter(|j| j.tier == t)
            .map(|j| j.ready - j.submit)
            .collect();
        if w.is_empty() {
            continue;
        }
        w.sort_by(f64::total_cmp);
        tiers.push((t, w.len(), mean(w.iter().copied()), quantile(&w, 0.95)));
    }
    let mut big: Vec<f64> = (o.jobs.iter())
        .filter(|j| j.asked >= 4)
        .map(|j| j.ready - j.submit)
        .collect();
    big.sort_by(f64::total_cmp);
    let big = (big.len(), mean(big.iter().copied()), quantile(&big, 0.95));
    let needed: u64 = o.jobs.iter().map(|j| j.needed).sum();
    let hit: u64 = o.jobs.iter().map(|j| j.hit).sum();
    Summary {
        policy: o.policy,
        jobs: o.jobs.len(),
        wait_mean: mean(waits.iter().copied()),
        wait_median: quantile(&waits, 0.5),
        wait_p95: quantile(&waits, 0.95),
        queueing_mean: mean(o.jobs.iter().map(|j| j.assigned - j.submit)),
        staging_mean: mean(o.jobs.iter().map(|j| j.ready - j.assigned)),
        jct_mean: mean(o.jobs.iter().map(|j| j.end - j.submit)),
        bytes_moved: o.bytes_store + o.bytes_peer,
        bytes_prefetch: o.bytes_prefetch,
        bytes_peer: o.bytes_peer,
        hit_rate: if needed == 0 {
            1.0
        } else {
            hit as f64 / needed as f64
        },
        utilisation: if o.span > 0.0 {
            o.busy / (o.gpus as f64 * o.span)
        } else {
            0.0
        },
        held_idle_gpu_h: o.held_idle / 3600.0,
        tiers,
        big,
        waits,
        wall: o.wall,
    }
}

/// `3.2 h`, `41 min`, `12 s`.
pub fn dur(s: f64) -> String {
    if s >= 7200.0 {
        format!("{:.1} h", s / 3600.0)
    } else if s >= 120.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{s:.0} s")
    }
}

fn tb(b: u64) -> String {
    let gb = b as f64 / 1e9;
    if gb >= 1000.0 {
        format!("{:.2} TB", gb / 1000.0)
    } else {
        format!("{gb:.0} GB")
    }
}

const TIER_NAMES: [&str; 5] = ["lead", "deadline", "phd", "master", "undergrad"];

/// The policies' table for one workload.
pub fn table(out: &mut String, rows: &[Summary]) {
    out.push_str("| policy | wait mean | median | p95 | queueing mean | staging mean | JCT mean | bytes moved (prefetch) | cache hit | GPU util | GPU-h held idle | sim time |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} ({}) | {:.0}% | {:.0}% | {:.0} | {:.2} s |",
            r.policy.name(),
            dur(r.wait_mean),
            dur(r.wait_median),
            dur(r.wait_p95),
            dur(r.queueing_mean),
            dur(r.staging_mean),
            dur(r.jct_mean),
            tb(r.bytes_moved),
            tb(r.bytes_prefetch),
            r.hit_rate * 100.0,
            r.utilisation * 100.0,
            r.held_idle_gpu_h,
            r.wall
        );
    }
    out.push('\n');
    out.push_str("Wait per tier (mean / p95):\n\n| policy |");
    let tiers: Vec<u8> = rows
        .first()
        .map(|r| r.tiers.iter().map(|t| t.0).collect())
        .unwrap_or_default();
    for t in &tiers {
        let _ = write!(out, " {} |", TIER_NAMES.get(*t as usize).unwrap_or(&"?"));
    }
    out.push_str("\n|---|");
    for _ in &tiers {
        out.push_str("---|");
    }
    out.push('\n');
    for r in rows {
        let _ = write!(out, "| {} |", r.policy.name());
        for t in &tiers {
            match r.tiers.iter().find(|x| x.0 == *t) {
                Some(&(_, n, m, p)) => {
                    let _ = write!(out, " {} / {} ({n}) |", dur(m), dur(p));
                }
                None => out.push_str(" — |"),
            }
        }
        out.push('\n');
    }
    out.push('\n');
}

/// A row of the targets table: (metric, figure, target, met).
pub type Target = (String, String, String, bool);

fn find(rows: &[Summary], p: Policy) -> &Summary {
    rows.iter()
        .find(|r| r.policy == p)
        .expect("every policy was run")
}

/// The issue's targets, measured on one workload.
pub fn targets(rows: &[Summary], deadline_ff_p95: f64, deadline_ls_p95: f64) -> Vec<Target> {
    let ff = find(rows, Policy::FirstFit);
    let ls = find(rows, Policy::Labsync);
    let lp = find(rows, Policy::LabsyncPrefetch);
    let sheet = find(rows, Policy::Spreadsheet);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let mut t = Vec::new();
    let r = ratio(lp.bytes_moved as f64, ff.bytes_moved as f64);
    t.push((
        "bytes moved, labsync+prefetch / first-fit".into(),
        format!("{r:.2}× ({} / {})", tb(lp.bytes_moved), tb(ff.bytes_moved)),
        "≤ 0.5×".into(),
        r <= 0.5,
    ));
    for (name, s) in [("labsync", ls), ("labsync+prefetch", lp)] {
        let r = ratio(s.staging_mean, ff.staging_mean);
        t.push((
            format!("staging mean, {name} / first-fit"),
            format!(
                "{r:.2}× ({} / {})",
                dur(s.staging_mean),
                dur(ff.staging_mean)
            ),
            "≤ 0.25×".into(),
            r <= 0.25,
        ));
    }
    for (name, s) in [("labsync", ls), ("labsync+prefetch", lp)] {
        let (m, p) = (
            ratio(s.wait_mean, ff.wait_mean),
            ratio(s.wait_p95, ff.wait_p95),
        );
        t.push((
            format!("total wait mean / p95, {name} / first-fit"),
            format!("{m:.2}× / {p:.2}×"),
            "≤ 1× both".into(),
            m <= 1.0 && p <= 1.0,
        ));
    }
    let r = ratio(deadline_ls_p95, deadline_ff_p95);
    let has_deadline = ff.tiers.iter().any(|x| x.0 == 1);
    t.extend(has_deadline.then(|| {
        (
            "deadline-tier p95 wait, labsync / first-fit".into(),
            format!(
                "{r:.2}× ({} / {})",
                dur(deadline_ls_p95),
                dur(deadline_ff_p95)
            ),
            "≤ 0.33×".into(),
            r <= 0.33,
        )
    }));
    let r = ratio(ls.held_idle_gpu_h, sheet.held_idle_gpu_h);
    t.push((
        "GPU-hours held idle, labsync / spreadsheet".into(),
        format!(
            "{r:.3}× ({:.0} / {:.0})",
            ls.held_idle_gpu_h, sheet.held_idle_gpu_h
        ),
        "≤ 0.10×".into(),
        r <= 0.10,
    ));
    t
}

/// Deadline-tier p95 of a run (tier 1), 0 when it has none.
pub fn deadline_p95(s: &Summary) -> f64 {
    s.tiers.iter().find(|t| t.0 == 1).map_or(0.0, |t| t.3)
}

const COLOURS: [&str; 6] = [
    "#7f7f7f", "#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c",
];

/// One row of the plot: the wait CDF (log time) and bytes moved, per
/// policy, for one workload.
fn panel(svg: &mut String, y0: f64, title: &str, rows: &[Summary]) {
    let (x0, w, h) = (70.0, 420.0, 220.0);
    let _ = writeln!(
        svg,
        r#"<text x="{x0}" y="{}" font-size="14" font-weight="bold">{title}</text>"#,
        y0 - 12.0
    );
    // Wait CDF: 1 s … 30 days, log.
    let (lo, hi) = (1f64.ln(), (30.0 * 86_400f64).ln());
    let px = |s: f64| x0 + (s.max(1.0).ln() - lo) / (hi - lo) * w;
    let py = |f: f64| y0 + h - f * h;
    let _ = writeln!(
        svg,
        r##"<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#444"/>"##
    );
    for (label, s) in [
        ("1 s", 1.0),
        ("1 min", 60.0),
        ("1 h", 3600.0),
        ("1 d", 86_400.0),
        ("30 d", 30.0 * 86_400.0),
    ] {
        let x = px(s);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{label}</text>"##,
            y0 + h,
            y0 + h + 14.0
        );
    }
    for f in [0.0, 0.5, 0.95, 1.0] {
        let y = py(f);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{f}</text>"##,
            x0 + w,
            x0 - 4.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">wait, submit → running (fraction of jobs waiting at most)</text>"#,
        x0 + w / 2.0,
        y0 + h + 30.0
    );
    for (i, r) in rows.iter().enumerate() {
        let n = r.waits.len().max(1) as f64;
        let step = (r.waits.len() / 400).max(1);
        let mut pts = String::new();
        for (k, s) in r.waits.iter().enumerate().step_by(step) {
            let _ = write!(pts, "{:.1},{:.1} ", px(*s), py((k + 1) as f64 / n));
        }
        if let Some(s) = r.waits.last() {
            let _ = write!(pts, "{:.1},{:.1}", px(*s), py(1.0));
        }
        let _ = writeln!(
            svg,
            r#"<polyline points="{pts}" fill="none" stroke="{}" stroke-width="2"/>"#,
            COLOURS[i % COLOURS.len()]
        );
    }
    // Bytes moved.
    let bx = x0 + w + 90.0;
    let bw = 300.0;
    let max = rows.iter().map(|r| r.bytes_moved).max().unwrap_or(1).max(1) as f64;
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">bytes moved over the network</text>"#,
        bx + bw / 2.0,
        y0 + h + 30.0
    );
    let bar_h = h / rows.len().max(1) as f64;
    for (i, r) in rows.iter().enumerate() {
        let y = y0 + i as f64 * bar_h + 4.0;
        let len = r.bytes_moved as f64 / max * bw;
        let _ = writeln!(
            svg,
            r#"<rect x="{bx:.1}" y="{y:.1}" width="{len:.1}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            bar_h - 8.0,
            COLOURS[i % COLOURS.len()],
            bx - 4.0,
            y + bar_h / 2.0,
            r.policy.name(),
            bx + len + 4.0,
            y + bar_h / 2.0,
            tb(r.bytes_moved)
        );
    }
}

/// The plot: one row per workload.
pub fn svg(workloads: &[(String, Vec<Summary>)]) -> String {
    let (w, row_h) = (920.0, 300.0);
    let h = 40.0 + row_h * workloads.len() as f64;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    for (i, (name, rows)) in workloads.iter().enumerate() {
        panel(&mut s, 40.0 + i as f64 * row_h, name, rows);
    }
    // Legend.
    if let Some((_, rows)) = workloads.first() {
        for (i, r) in rows.iter().enumerate() {
            let x = 70.0 + i as f64 * 150.0;
            let _ = writeln!(
                s,
                r#"<rect x="{x}" y="6" width="14" height="10" fill="{}"/><text x="{}" y="15" font-size="12">{}</text>"#,
                COLOURS[i % COLOURS.len()],
                x + 18.0,
                r.policy.name()
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// `a / b` as a ratio, `—` where `b` is 0.
fn ratio_text(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else if a > 0.0 {
        "∞".into()
    } else {
        "—".into()
    }
}

/// One (workload, cache size) of the matrix (issue 45, point 9): every
/// policy's wait mean and p95, p95 per tier, 4-GPU jobs' mean and p95,
/// staging mean, bytes moved and GPU-hours held idle; then labsync's
/// ratios to first-fit (first come, first served, passing over what does
/// not fit) and to first-fit+queue (the lab's queue rule, placement blind
/// to data).
pub fn matrix_table(out: &mut String, rows: &[Summary]) {
    out.push_str("| policy | wait mean | p95 | p95 lead / deadline / phd / master / undergrad | 4-GPU jobs: mean / p95 | staging mean | bytes moved | GPU-h held idle |\n|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let tiers: Vec<String> = (0..5u8)
            .map(|t| {
                r.tiers
                    .iter()
                    .find(|x| x.0 == t)
                    .map_or("—".into(), |x| dur(x.3))
            })
            .collect();
        let big = match r.big.0 {
            0 => "—".into(),
            n => format!("{} / {} ({n})", dur(r.big.1), dur(r.big.2)),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {big} | {} | {} | {:.0} |",
            r.policy.name(),
            dur(r.wait_mean),
            dur(r.wait_p95),
            tiers.join(" / "),
            dur(r.staging_mean),
            tb(r.bytes_moved),
            r.held_idle_gpu_h
        );
    }
    let of = |p| rows.iter().find(|r| r.policy == p);
    for base in [Policy::FirstFit, Policy::FirstFitQueue] {
        let (Some(b), Some(ls)) = (of(base), of(Policy::Labsync)) else {
            continue;
        };
        let tiers: Vec<String> = (0..5u8)
            .filter_map(|t| {
                let l = ls.tiers.iter().find(|x| x.0 == t)?;
                let f = b.tiers.iter().find(|x| x.0 == t)?;
                Some(ratio_text(l.3, f.3))
            })
            .collect();
        let _ = writeln!(
            out,
            "| *labsync / {}* | {} | {} | {} | — / {} | {} | {} | {} |",
            base.name(),
            ratio_text(ls.wait_mean, b.wait_mean),
            ratio_text(ls.wait_p95, b.wait_p95),
            tiers.join(" / "),
            ratio_text(ls.big.2, b.big.2),
            ratio_text(ls.staging_mean, b.staging_mean),
            ratio_text(ls.bytes_moved as f64, b.bytes_moved as f64),
            ratio_text(ls.held_idle_gpu_h, b.held_idle_gpu_h),
        );
    }
    out.push('\n');
}

/// The issue's targets on one (workload, cache size): (name, met, figure).
pub fn matrix_targets(rows: &[Summary], small_cache: bool) -> Vec<(&'static str, bool, String)> {
    let (Some(ff), Some(ls)) = (
        rows.iter().find(|r| r.policy == Policy::FirstFit),
        rows.iter().find(|r| r.policy == Policy::Labsync),
    ) else {
        return Vec::new();
    };
    let r = |a: f64, b: f64| {
        if b > 0.0 {
            a / b
        } else if a > 0.0 {
            f64::INFINITY
        } else {
            1.0
        }
    };
    let mut t = vec![
        (
            "wait mean ≤ first-fit",
            ls.wait_mean <= ff.wait_mean,
            format!("{:.2}×", r(ls.wait_mean, ff.wait_mean)),
        ),
        (
            "wait p95 ≤ first-fit",
            ls.wait_p95 <= ff.wait_p95,
            format!("{:.2}×", r(ls.wait_p95, ff.wait_p95)),
        ),
    ];
    let worst = (ls.tiers.iter())
        .filter_map(|l| {
            let f = ff.tiers.iter().find(|x| x.0 == l.0)?;
            // A tier's p95 within a minute of first-fit's is as good as it.
            Some((l.0, if l.3 <= f.3 + 60.0 { 1.0 } else { r(l.3, f.3) }))
        })
        .fold((0u8, 0.0f64), |a, b| if b.1 > a.1 { b } else { a });
    t.push((
        "no tier's p95 over 3× first-fit's",
        worst.1 <= 3.0,
        format!(
            "worst {} {:.2}×",
            TIER_NAMES.get(worst.0 as usize).unwrap_or(&"?"),
            worst.1
        ),
    ));
    if ls.big.0 > 0 {
        t.push((
            "4-GPU p95 ≤ first-fit",
            ls.big.2 <= ff.big.2 + 60.0,
            format!("{:.2}×", r(ls.big.2, ff.big.2)),
        ));
    }
    if small_cache {
        let b = r(ls.bytes_moved as f64, ff.bytes_moved as f64);
        t.push((
            "bytes moved ≤ 0.6× first-fit (100 GB)",
            b <= 0.6,
            format!("{b:.2}×"),
        ));
        let s = r(ls.staging_mean, ff.staging_mean);
        t.push((
            "staging mean ≤ 0.5× first-fit (100 GB)",
            s <= 0.5,
            format!("{s:.2}×"),
        ));
    }
    t
}
