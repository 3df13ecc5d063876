//! Markdown (for humans and the repo) and JSON (for later comparison) output.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde_json::{json, Value};

use crate::bench::{
    DatasetResult, FsyncProbe, Status, Step, StepResult, MODIFIED_FRACTION, PATCH_BYTES,
};
use crate::chunks::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
use crate::datagen::SEED;
use crate::machine::{Machine, ToolVersion};
use crate::tools::Tool;

pub struct Report {
    pub command: String,
    pub scale: f64,
    pub work: PathBuf,
    /// `--repo-dir` and its file system type.
    pub repo_dir: Option<(PathBuf, String)>,
    pub step_timeout_s: u64,
    pub machine: Machine,
    pub load_before: String,
    pub load_after: String,
    pub versions: Vec<ToolVersion>,
    pub probes: Vec<FsyncProbe>,
    pub datasets: Vec<DatasetResult>,
}

const DASH: &str = "—";

fn mb(bytes: f64) -> f64 {
    bytes / 1e6
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| DASH.to_string())
}

/// `cell` with pipes escaped so free text cannot break the table.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// Fastest successful peer (any tool but labsync) for one step.
pub fn fastest_peer(ds: &DatasetResult, step: Step) -> Option<&StepResult> {
    ds.results
        .iter()
        .filter(|r| r.step == step && r.tool != Tool::Labsync && r.status == Status::Ok)
        .filter(|r| r.wall_s.is_some())
        .min_by(|a, b| {
            a.wall_s
                .partial_cmp(&b.wall_s)
                .unwrap_or(std::cmp::Ordering::Equal)
        })
}

/// labsync wall / fastest peer wall; < 1 means labsync was faster.
pub fn labsync_ratio(ds: &DatasetResult, step: Step) -> Option<(f64, Tool)> {
    let lab = ds
        .get(step, Tool::Labsync)
        .filter(|r| r.status == Status::Ok)?
        .wall_s?;
    let peer = fastest_peer(ds, step)?;
    let pw = peer.wall_s?;
    (pw > 0.0).then(|| (lab / pw, peer.tool))
}

/// Added bytes of the 1 % step relative to the budget.
pub fn budget_ratio(ds: &DatasetResult, r: &StepResult) -> Option<f64> {
    (r.step == Step::Modified && r.status == Status::Ok).then_some(r.added? as f64 / ds.budget())
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "# labsync sync benchmark\n");
        let _ = writeln!(s, "Generated {} by `{}`.\n", m.date_utc, self.command);
        let _ = writeln!(s, "## Setup\n");
        let _ = writeln!(
            s,
            "- Machine: {} CPUs ({}), {:.1} GiB RAM, kernel {}, {}.",
            m.nproc,
            m.cpu,
            m.mem_total_kib as f64 / 1048576.0,
            m.kernel,
            m.os
        );
        match &self.repo_dir {
            None => {
                let _ = writeln!(
                    s,
                    "- Work dir `{}` ({}): sources, repos/targets and restores all on the same disk.",
                    self.work.display(),
                    m.work_fs
                );
            }
            Some((dir, fs)) => {
                let _ = writeln!(
                    s,
                    "- Work dir `{}` ({}): sources and restores. Repos/targets in `{}` ({fs}, `--repo-dir`): a push's writes do not share the device it reads from{}.",
                    self.work.display(),
                    m.work_fs,
                    dir.display(),
                    if fs == "tmpfs" {
                        "; a tmpfs is never emptied by dropping the page cache, so pulls read their stores from memory"
                    } else {
                        ""
                    }
                );
            }
        }
        let _ = writeln!(
            s,
            "- Load average (1/5/15 min) before: {}, after: {}. The machine may be shared; a high load means noisy timings.",
            self.load_before, self.load_after
        );
        let page_cache = if self.command.contains("--cold") {
            "- Page cache: emptied (`sync; echo 3 > /proc/sys/vm/drop_caches`, untimed) before every timed step (`--cold`; each data set's section says whether this machine allowed it), so every step reads its source from the disk, for all tools alike."
        } else {
            "- Page cache: not dropped between steps (run with `--cold` to empty it). Data was warm in the page cache for all tools alike: every step reads the same freshly written source tree. Dirty pages are flushed (`sync`, untimed) before every timed step, so no tool pays for another's writeback."
        };
        let _ = writeln!(s, "{page_cache}");
        let _ = writeln!(
            s,
            "- Data: ChaCha8 seed `{SEED:#x}`, scale {}. The 1% step overwrites {PATCH_BYTES} bytes at a random offset in place in {:.0}% of the files (the same files for every tool, applied once to the shared source tree).",
            self.scale,
            MODIFIED_FRACTION * 100.0
        );
        let _ = writeln!(
            s,
            "- Units: MB = 10^6 bytes. Wall time = GNU time `%e` (10 ms resolution), the median over the repetitions (each run in brackets, in order; every repetition regenerates the same seeded data, reads it once untimed, starts from empty repos and rotates which tool goes first), peak RSS the largest over them, peak RSS = `%M` (the largest single process of the tool, not a sum: rsync runs 2-3 processes). MB/s = logical data-set bytes / wall time, also for re-pushes (i.e. scan throughput)."
        );
        let _ = writeln!(
            s,
            "- Stored = sum of apparent sizes of the regular files in the tool's repo/target dir after the step (like `du -sb` without directory entries); added = change caused by the step. Local caches (labsync `--cache-dir`, restic `--cache-dir`, borg `BORG_BASE_DIR`) are not counted. rsync and rclone keep only the latest copy, so their ~0 added bytes in the 1% step are overwrites, not dedup."
        );
        let _ = writeln!(
            s,
            "- Untimed setup: `restic init`, `borg init -e none`. Pulls write into an empty dir; labsync and restic get a fresh empty cache dir so the pull is cold. Each restore is compared with the source (paths, sizes, BLAKE3 of contents) and marked `mismatch` if it differs."
        );
        let _ = writeln!(
            s,
            "- Budget for the 1% step: 1.5 × changed chunk bytes + 1 MiB, where changed chunk bytes = for each modified file, the bytes of new-version FastCDC v2020 chunks ({} KiB / {} KiB / {} KiB, BLAKE3 ids) not present among the old version's chunks.",
            MIN_CHUNK / 1024,
            AVG_CHUNK / 1024,
            MAX_CHUNK / 1024
        );
        let _ = writeln!(s, "- Per-step timeout: {} s.\n", self.step_timeout_s);

        let _ = writeln!(s, "### Tools\n");
        let _ = writeln!(s, "| tool | version | package | fsync on push (documented) | fsync-family calls seen (strace, cold push of 3 files) | defaults that matter |");
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for v in &self.versions {
            let probe = self
                .probes
                .iter()
                .find(|p| p.tool == v.tool)
                .map(|p| match &p.result {
                    Ok(n) => n.to_string(),
                    Err(e) => format!("n/a ({e})"),
                })
                .unwrap_or_else(|| "not probed".into());
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                v.tool.name(),
                cell(v.version.as_deref().unwrap_or("missing")),
                cell(v.package.as_deref().unwrap_or(DASH)),
                cell(v.tool.fsync_doc()),
                cell(&probe),
                cell(v.tool.defaults_note())
            );
        }
        let _ = writeln!(s);

        let _ = writeln!(s, "### Data sets\n");
        let _ = writeln!(s, "| data set | files | MB | description | files modified | bytes overwritten | changed chunk bytes | budget bytes |");
        let _ = writeln!(s, "|---|---:|---:|---|---:|---:|---:|---:|");
        for d in &self.datasets {
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {} | {} | {} | {} | {:.0} |",
                d.kind.name(),
                d.files,
                mb(d.bytes as f64),
                d.kind.description(),
                d.modification.files.len(),
                d.modification.bytes_overwritten,
                d.modification.changed_chunk_bytes,
                d.budget()
            );
        }
        let _ = writeln!(s);

        for d in &self.datasets {
            s.push_str(&self.dataset_table(d));
        }
        s.push_str(&self.commands_section());
        s
    }

    /// One data set's result table plus the notes explaining non-ok rows.
    pub fn dataset_table(&self, d: &DatasetResult) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## Results: {} ({} files, {:.1} MB)\n",
            d.kind.name(),
            d.files,
            mb(d.bytes as f64)
        );
        s.push_str(&cold_note(d, self.command.contains("--cold")));
        let _ = writeln!(s, "| step | tool | status | wall s | MB/s | peak RSS MB | stored MB | added MB | added / budget | labsync / fastest peer |");
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---|");
        let mut notes: Vec<(Tool, String, Vec<&str>)> = Vec::new();
        for step in Step::ALL {
            for r in d.results.iter().filter(|r| r.step == step) {
                let ratio = if r.tool == Tool::Labsync {
                    opt(labsync_ratio(d, step), |(x, t)| {
                        format!("{x:.2} (vs {})", t.name())
                    })
                } else {
                    String::new()
                };
                let timed = r.status == Status::Ok || r.status == Status::Mismatch;
                let wall = r.wall_s.filter(|_| timed);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    step.label(),
                    r.tool.name(),
                    r.status.label(),
                    opt(wall, |w| if r.walls.len() > 1 {
                        let all: Vec<String> = r.walls.iter().map(|x| format!("{x:.2}")).collect();
                        format!("{w:.2} ({})", all.join(" "))
                    } else {
                        format!("{w:.2}")
                    }),
                    opt(wall.filter(|w| *w > 0.0), |w| format!(
                        "{:.1}",
                        mb(d.bytes as f64) / w
                    )),
                    opt(r.peak_rss_kib.filter(|_| timed), |k| format!(
                        "{:.1}",
                        k as f64 * 1024.0 / 1e6
                    )),
                    opt(
                        r.stored.filter(|_| r.status != Status::Missing),
                        |b| format!("{:.2}", mb(b as f64))
                    ),
                    opt(
                        r.added.filter(|_| r.status != Status::Missing),
                        |b| format!("{:.3}", mb(b as f64))
                    ),
                    if step == Step::Modified {
                        opt(budget_ratio(d, r), |x| format!("{x:.2}"))
                    } else {
                        String::new()
                    },
                    ratio
                );
                if let Some(n) = r.note.as_ref().filter(|_| r.status != Status::Ok) {
                    // One line per distinct reason: a missing binary would
                    // otherwise repeat the same sentence for every step.
                    match notes
                        .iter_mut()
                        .find(|(t, note, _)| *t == r.tool && note == n)
                    {
                        Some((_, _, steps)) => steps.push(step.label()),
                        None => notes.push((r.tool, n.clone(), vec![step.label()])),
                    }
                }
            }
        }
        let _ = writeln!(s);
        if !notes.is_empty() {
            let _ = writeln!(s, "Notes:\n");
            for (tool, note, steps) in notes {
                let steps = if steps.len() == Step::ALL.len() {
                    "all steps".to_string()
                } else {
                    steps.join("; ")
                };
                let _ = writeln!(s, "- {} [{steps}]: {}", tool.name(), cell(&note));
            }
            let _ = writeln!(s);
        }
        s
    }

    fn commands_section(&self) -> String {
        let Some(d) = self.datasets.first() else {
            return String::new();
        };
        let work = self.work.to_string_lossy();
        let mut s = format!(
            "## Command lines (data set {}, `$WORK` = `{work}`)\n\n\
             Setup commands (`restic init`, `borg init -e none`) run untimed with the same environment.\n\n```sh\n",
            d.kind.name()
        );
        for tool in Tool::ALL {
            for r in d.results.iter().filter(|r| r.tool == tool) {
                let _ = writeln!(
                    s,
                    "# {} / {}\n{}",
                    tool.name(),
                    r.step.label(),
                    r.command.replace(work.as_ref(), "$WORK")
                );
            }
        }
        s.push_str("```\n");
        s
    }

    pub fn json(&self) -> Value {
        let datasets: Vec<Value> = self
            .datasets
            .iter()
            .map(|d| {
                let rows: Vec<Value> = d
                    .results
                    .iter()
                    .map(|r| {
                        json!({
                            "tool": r.tool.name(), "step": r.step.key(), "status": r.status.label(),
                            "wall_s": r.wall_s, "walls_s": r.walls, "peak_rss_kib": r.peak_rss_kib, "stored_bytes": r.stored,
                            "added_bytes": r.added, "note": r.note, "command": r.command, "cold": r.cold,
                            "budget_ratio": budget_ratio(d, r),
                            "labsync_vs_fastest_peer": if r.tool == Tool::Labsync { labsync_ratio(d, r.step).map(|x| x.0) } else { None },
                        })
                    })
                    .collect();
                json!({
                    "name": d.kind.name(), "files": d.files, "bytes": d.bytes,
                    "modified_files": d.modification.files.len(),
                    "bytes_overwritten": d.modification.bytes_overwritten,
                    "changed_chunk_bytes": d.modification.changed_chunk_bytes,
                    "budget_bytes": d.budget(), "results": rows,
                    "floor_s": d.floor.iter().map(|(n, t)| json!({"readers": n, "wall_s": t})).collect::<Vec<_>>(),
                    "stat_floor_s": d.stat_floor,
                    "copy_floor_s": d.copy_floor,
                })
            })
            .collect();
        let m = &self.machine;
        json!({
            "date_utc": m.date_utc, "command": self.command, "scale": self.scale, "seed": SEED,
            "machine": { "nproc": m.nproc, "cpu": m.cpu, "mem_total_kib": m.mem_total_kib,
                         "kernel": m.kernel, "os": m.os, "work_fs": m.work_fs },
            "load_before": self.load_before, "load_after": self.load_after,
            "tools": self.versions.iter().map(|v| json!({
                "tool": v.tool.name(), "version": v.version, "package": v.package,
                "fsync_calls": self.probes.iter().find(|p| p.tool == v.tool).and_then(|p| p.result.as_ref().ok()),
            })).collect::<Vec<_>>(),
            "datasets": datasets,
        })
    }
}

/// What `--cold` did for data set `d`: the parallel-read floor, and each of
/// labsync's cold steps against it; or that the cache could not be emptied.
fn cold_note(d: &DatasetResult, asked: bool) -> String {
    let best = d
        .floor
        .iter()
        .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
    let Some(&(best_n, best_s)) = best else {
        return if asked {
            "`--cold` was asked, but this machine does not allow emptying the page cache: \
             the figures below are warm.\n\n"
                .into()
        } else {
            String::new()
        };
    };
    let each: Vec<String> = d
        .floor
        .iter()
        .map(|(n, t)| format!("N={n}: {t:.2} s"))
        .collect();
    let mut s = format!(
        "Cold: the page cache was emptied before every timed step. Parallel-read floor \
         (the source read cold by `xargs -P N cat`): {}; best {best_s:.2} s (N={best_n}).\n",
        each.join(", ")
    );
    if let Some(stat) = d.stat_floor {
        s += &format!(
            "Stat floor (every entry stat'ed cold by 16 parallel `find`s): {stat:.2} s.\n"
        );
    }
    if let Some(copy) = d.copy_floor {
        s += &format!(
            "Copy floor (the source read cold by 16 `cat`s while four `dd oflag=direct` write \
             as many bytes where the stores are, all at once, as a push to a local store must): \
             {copy:.2} s.\n"
        );
    }
    for r in d.results.iter().filter(|r| r.tool == Tool::Labsync) {
        if let Some(w) = r.wall_s.filter(|_| r.cold && best_s > 0.0) {
            s += &format!("- labsync {}: {:.2}x the floor", r.step.label(), w / best_s);
            let stat = d
                .stat_floor
                .filter(|t| *t > 0.0 && r.step == Step::Unchanged);
            if let Some(stat) = stat {
                s += &format!(", {:.2}x the stat floor", w / stat);
            }
            let copy = d.copy_floor.filter(|t| *t > 0.0 && r.step == Step::Cold);
            if let Some(copy) = copy {
                s += &format!(", {:.2}x the copy floor", w / copy);
            }
            s += "\n";
        }
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datagen::{DatasetKind, Modification};

    fn row(tool: Tool, step: Step, status: Status, wall: f64, added: i64) -> StepResult {
        StepResult {
            tool,
            step,
            status,
            wall_s: Some(wall),
            walls: vec![wall],
            peak_rss_kib: Some(1000),
            stored: Some(10),
            added: Some(added),
            note: None,
            command: String::new(),
            cold: false,
        }
    }

    #[test]
    fn cold_runs_are_compared_with_the_read_floor() {
        let mut push = row(Tool::Labsync, Step::Cold, Status::Ok, 1.5, 0);
        push.cold = true;
        let mut d = DatasetResult {
            kind: DatasetKind::Sr,
            files: 1,
            bytes: 1,
            modification: Modification::default(),
            results: vec![push, {
                let mut r = row(Tool::Labsync, Step::Unchanged, Status::Ok, 0.3, 0);
                r.cold = true;
                r
            }],
            floor: vec![(1, 2.0), (16, 1.0)],
            stat_floor: Some(0.2),
            copy_floor: Some(2.5),
        };
        let note = cold_note(&d, true);
        assert!(note.contains("best 1.00 s (N=16)"), "{note}");
        assert!(
            note.contains("labsync cold push: 1.50x the floor, 0.60x the copy floor\n"),
            "{note}"
        );
        assert!(note.contains("16 parallel `find`s): 0.20 s"), "{note}");
        assert!(
            note.contains("all at once, as a push to a local store must): 2.50 s"),
            "{note}"
        );
        let unchanged = "re-push, unchanged: 0.30x the floor, 1.50x the stat floor";
        assert!(note.contains(unchanged), "{note}");
        d.floor.clear();
        assert!(cold_note(&d, true).contains("does not allow"));
        assert!(cold_note(&d, false).is_empty());
    }

    #[test]
    fn ratios_pick_the_fastest_ok_peer() {
        let d = DatasetResult {
            kind: DatasetKind::Sr,
            files: 1,
            bytes: 1_000_000,
            modification: Modification {
                changed_chunk_bytes: 1_000_000,
                ..Default::default()
            },
            results: vec![
                row(Tool::Labsync, Step::Modified, Status::Ok, 1.0, 2_548_576),
                row(Tool::Rsync, Step::Modified, Status::Ok, 4.0, 0),
                row(Tool::Restic, Step::Modified, Status::Ok, 2.0, 100),
                row(Tool::Borg, Step::Modified, Status::Error, 0.5, 0),
            ],
            floor: Vec::new(),
            stat_floor: None,
            copy_floor: None,
        };
        let (x, t) = labsync_ratio(&d, Step::Modified).unwrap();
        assert_eq!(t, Tool::Restic);
        assert!((x - 0.5).abs() < 1e-9);
        assert!((budget_ratio(&d, &d.results[0]).unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(labsync_ratio(&d, Step::Pull), None);
    }
}
