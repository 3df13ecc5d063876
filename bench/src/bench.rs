//! The benchmark itself: data set by data set, step by step, tool by tool.
//!
//! Steps are the outer loop and tools the inner one, because the 1 %
//! modification must be applied exactly once to the shared source tree: all
//! tools push the very same bytes at every step.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, SystemTime};

use crate::datagen::{self, Dataset, DatasetKind, Modification};
use crate::fsutil::{fresh_dir, remove_all, tree_bytes, tree_digest};
use crate::runner::{count_fsyncs, run_plain, run_timed, Logs};
use crate::tools::{Tool, ToolRun};

/// Share of files touched by the modification step.
pub const MODIFIED_FRACTION: f64 = 0.01;
/// Bytes overwritten in each modified file.
pub const PATCH_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Cold,
    Unchanged,
    Modified,
    Pull,
}

impl Step {
    pub const ALL: [Step; 4] = [Step::Cold, Step::Unchanged, Step::Modified, Step::Pull];

    pub fn label(self) -> &'static str {
        match self {
            Step::Cold => "cold push",
            Step::Unchanged => "re-push, unchanged",
            Step::Modified => "re-push, 1% modified",
            Step::Pull => "pull (restore)",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Step::Cold => "cold",
            Step::Unchanged => "unchanged",
            Step::Modified => "modified",
            Step::Pull => "pull",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// Binary not found; nothing was run.
    Missing,
    /// Non-zero exit, timeout, or setup failure.
    Error,
    /// The pull "succeeded" but the restored tree differs from the source.
    Mismatch,
}

impl Status {
    pub fn label(&self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Missing => "missing",
            Status::Error => "error",
            Status::Mismatch => "mismatch",
        }
    }
}

#[derive(Clone, Debug)]
pub struct StepResult {
    pub tool: Tool,
    pub step: Step,
    pub status: Status,
    /// Median over the repetitions.
    pub wall_s: Option<f64>,
    /// Every repetition's wall time, in run order.
    pub walls: Vec<f64>,
    pub peak_rss_kib: Option<u64>,
    /// Size of the repo/target after the step.
    pub stored: Option<u64>,
    /// Change in stored bytes caused by this step.
    pub added: Option<i64>,
    /// Why the step is not ok (last stderr line, mismatch details...).
    pub note: Option<String>,
    pub command: String,
    /// The page cache was emptied before it (in every repetition).
    pub cold: bool,
}

#[derive(Clone, Debug)]
pub struct DatasetResult {
    pub kind: DatasetKind,
    pub files: usize,
    pub bytes: u64,
    pub modification: Modification,
    pub results: Vec<StepResult>,
    /// With `--cold`: the source read cold by N parallel readers
    /// (`xargs -P N cat`), N of 1, 4, 16 and 64, wall seconds each.
    pub floor: Vec<(usize, f64)>,
    /// With `--cold`: every entry of the source stat'ed cold by 16 parallel
    /// walkers (one `find` per top-level entry), wall seconds.
    pub stat_floor: Option<f64>,
    /// With `--cold`: the source read cold by 16 readers while the bytes
    /// read are written to the work disk with `O_DIRECT`, wall seconds.
    pub copy_floor: Option<f64>,
}

impl DatasetResult {
    pub fn get(&self, step: Step, tool: Tool) -> Option<&StepResult> {
        self.results
            .iter()
            .find(|r| r.step == step && r.tool == tool)
    }

    /// The added-bytes allowance of the 1 % step: 1.5 x changed chunk bytes
    /// (room for pack/index overhead and neighbouring chunks) plus 1 MiB of
    /// fixed per-snapshot metadata.
    pub fn budget(&self) -> f64 {
        1.5 * self.modification.changed_chunk_bytes as f64 + 1_048_576.0
    }
}

pub struct Config {
    pub work: PathBuf,
    /// Where the stores/targets go, when not under `work`.
    pub repo_dir: Option<PathBuf>,
    pub scale: f64,
    pub tools: Vec<Tool>,
    pub datasets: Vec<DatasetKind>,
    pub labsync: PathBuf,
    pub step_timeout: Duration,
    pub keep: bool,
    /// Empty the page cache before every timed step.
    pub cold: bool,
}

/// A tool's state across the steps of one data set.
struct Lane {
    run: ToolRun,
    /// `Err((status, note))` when steps cannot run at all.
    usable: Result<(), (Status, String)>,
    stored: u64,
}

fn progress(msg: &str) {
    eprintln!("[sync-bench] {msg}");
}

/// Runs every step for every tool on a freshly generated data set. `rotate`
/// shifts which tool goes first: measured here, the first tool to read a data
/// set just written was up to 3x slower than the next (rsync 3.6 s vs 1.2 s),
/// so repetitions rotate the order instead of always billing one tool.
pub fn run_dataset(cfg: &Config, kind: DatasetKind, rotate: usize) -> io::Result<DatasetResult> {
    let base = cfg.work.join(kind.name());
    fresh_dir(&base)?;
    if let Some(r) = &cfg.repo_dir {
        fresh_dir(&r.join(kind.name()))?;
    }
    let logs_dir = base.join("logs");
    fs::create_dir_all(&logs_dir)?;
    let count = datagen::scaled_count(kind.base_files(), cfg.scale);
    progress(&format!("{}: generating {count} files", kind.name()));
    let ds = datagen::generate(kind, count, &base.join("src"))?;
    let generated_at = SystemTime::now();
    progress(&format!(
        "{}: {} files, {:.1} MB",
        kind.name(),
        count,
        ds.bytes as f64 / 1e6
    ));

    let mut lanes: Vec<Lane> = cfg
        .tools
        .iter()
        .map(|&t| new_lane(cfg, t, &base, &logs_dir))
        .collect();
    if !lanes.is_empty() {
        let n = lanes.len();
        lanes.rotate_left(rotate % n);
    }
    // Untimed: read the whole source once, so every tool starts from the same
    // warm page cache (cold: each step starts from an empty one instead).
    let (floor, stat_floor, copy_floor) = if cfg.cold {
        let stat = stat_floor(&ds.root, &logs_dir, cfg.step_timeout);
        // Written where the stores are: a push's writes go there.
        let stores = match &cfg.repo_dir {
            Some(r) => r.join(kind.name()),
            None => base.clone(),
        };
        let files = ds.files.len();
        let copy = copy_floor(
            &ds.root,
            files,
            ds.bytes,
            &stores,
            &logs_dir,
            cfg.step_timeout,
        );
        (
            read_floor(&ds.root, files, &logs_dir, cfg.step_timeout),
            stat,
            copy,
        )
    } else {
        for f in &ds.files {
            let _ = fs::read(ds.root.join(f));
        }
        (Vec::new(), None, None)
    };
    let mut results = Vec::new();
    let mut modification = Modification::default();

    for (generation, step) in (1u32..).zip(Step::ALL) {
        let expected = match step {
            Step::Modified => {
                // rsync's quick check compares mtimes in whole seconds by
                // default (rsync(1) --modify-window); an edit in the same
                // second as generation would be invisible to it and would
                // show up as a stale restore. Only short smoke runs can get
                // here that fast.
                if let Ok(wait) =
                    (generated_at + Duration::from_secs(1)).duration_since(SystemTime::now())
                {
                    sleep(wait);
                }
                modification = datagen::modify(&ds, MODIFIED_FRACTION, PATCH_BYTES)?;
                progress(&format!(
                    "{}: modified {} files, changed chunk bytes {}",
                    kind.name(),
                    modification.files.len(),
                    modification.changed_chunk_bytes
                ));
                None
            }
            Step::Pull => Some(tree_digest(&ds.root)?),
            _ => None,
        };
        for lane in &mut lanes {
            let r = match step {
                // The pull restores the newest snapshot, which is number 3.
                Step::Pull => run_pull(cfg, lane, generation - 1, &logs_dir, expected.as_ref()),
                _ => run_push(cfg, lane, step, &ds, generation, &logs_dir),
            };
            progress(&format!(
                "{}: {:<22} {:<8} {:>8} {}",
                kind.name(),
                step.label(),
                r.tool.name(),
                r.wall_s.map(|w| format!("{w:.2} s")).unwrap_or_default(),
                if r.status == Status::Ok {
                    ""
                } else {
                    r.status.label()
                }
            ));
            results.push(r);
        }
    }

    if !cfg.keep {
        remove_all(&base)?;
    }
    Ok(DatasetResult {
        kind,
        files: ds.files.len(),
        bytes: ds.bytes,
        modification,
        results,
        floor,
        stat_floor,
        copy_floor,
    })
}

/// The stat floor: every entry of the source stat'ed from an empty page
/// cache by 16 walkers (`find` per top-level entry, printing each size, so
/// each entry is stat'ed); what an unchanged re-push after a reboot is
/// compared with. `None` where the cache cannot be emptied.
fn stat_floor(src: &Path, logs_dir: &Path, timeout: Duration) -> Option<f64> {
    let script = "find . -mindepth 1 -maxdepth 1 -print0 | \
                  xargs -0 -P 16 -n 1 sh -c 'find \"$0\" -printf \"%s\\n\"' > /dev/null";
    let cmd = crate::runner::Cmd::new("sh").arg("-c").arg(script).cwd(src);
    match run_timed(&cmd, &Logs::new(logs_dir, "stat-floor"), timeout, true) {
        Ok((t, true)) => Some(t.wall_s),
        Ok((_, false)) => None,
        Err(e) => {
            progress(&format!("stat floor: {e}"));
            None
        }
    }
}

/// The copy floor: what the devices take to do a push's reads and its
/// writes at once. The source is read from an empty page cache by 16
/// readers (`cat`, as the read floor) while four `dd oflag=direct` write as
/// many bytes as it holds to files in `stores` (where the stores are, and
/// labsync writes packs with `O_DIRECT`), all at the same time. A push to a
/// store on the disk it reads from writes what it reads, and on a disk
/// whose reads and writes share its bandwidth the read floor alone is out
/// of reach. A push of compressible data writes fewer bytes than this
/// floor does. (Earlier reports piped the reads into one `dd`, which
/// measured the pipe and one writer as much as the disk: 1.23 s against
/// 0.97 s for `sr` on the same machine.) `None` where the cache cannot be
/// emptied.
fn copy_floor(
    src: &Path,
    files: usize,
    bytes: u64,
    stores: &Path,
    logs_dir: &Path,
    timeout: Duration,
) -> Option<f64> {
    let out = [0, 1, 2, 3].map(|i| stores.join(format!("copy-floor.{i}")));
    let script = crate::runner::read_and_write_script(per_reader(files, 16), bytes, &out);
    let cmd = crate::runner::Cmd::new("sh").arg("-c").arg(script).cwd(src);
    let timed = run_timed(&cmd, &Logs::new(logs_dir, "copy-floor"), timeout, true);
    for o in &out {
        let _ = fs::remove_file(o);
    }
    match timed {
        Ok((t, true)) => Some(t.wall_s),
        Ok((_, false)) => None,
        Err(e) => {
            progress(&format!("copy floor: {e}"));
            None
        }
    }
}

/// Files per `cat` so that `readers` of them all run: `xargs -P N -n 64`
/// over `sr`'s 400 files made 7 `cat`s, so N = 16 and N = 64 both measured
/// 7 readers. At most 64 (one process per small file would measure fork).
fn per_reader(files: usize, readers: usize) -> usize {
    (files / readers).clamp(1, 64)
}

/// The parallel-read floor: the source read from an empty page cache by N
/// readers (`find | xargs -0 -P N -n K cat > /dev/null`, K files each, at
/// most 64, few enough that N of them run), for N of 1, 4, 16 and 64; the
/// steps are compared with the best. Empty where the cache cannot be
/// emptied.
fn read_floor(src: &Path, files: usize, logs_dir: &Path, timeout: Duration) -> Vec<(usize, f64)> {
    let mut out = Vec::new();
    for n in [1usize, 4, 16, 64] {
        let script = crate::runner::read_script(n, per_reader(files, n));
        let cmd = crate::runner::Cmd::new("sh").arg("-c").arg(script).cwd(src);
        let logs = Logs::new(logs_dir, &format!("floor-{n}"));
        match run_timed(&cmd, &logs, timeout, true) {
            Ok((t, true)) => out.push((n, t.wall_s)),
            Ok((_, false)) => return Vec::new(),
            Err(e) => progress(&format!("floor with {n} readers: {e}")),
        }
    }
    out
}

fn new_lane(cfg: &Config, tool: Tool, base: &Path, logs_dir: &Path) -> Lane {
    let program = tool.program(&cfg.labsync);
    let mut run = ToolRun::new(tool, program.clone(), base.join(tool.name()));
    if let (Some(r), Some(set)) = (&cfg.repo_dir, base.file_name()) {
        run.repo_at = Some(r.join(set).join(tool.name()));
    }
    let usable = if crate::fsutil::find_program(&program).is_none() {
        Err((
            Status::Missing,
            format!("`{}` not found", program.display()),
        ))
    } else {
        setup(cfg, &run, logs_dir).map_err(|e| (Status::Error, e))
    };
    Lane {
        run,
        usable,
        stored: 0,
    }
}

fn setup(cfg: &Config, run: &ToolRun, logs_dir: &Path) -> Result<(), String> {
    run.prepare_dirs()
        .map_err(|e| format!("creating dirs: {e}"))?;
    for (i, cmd) in run.setup().iter().enumerate() {
        let logs = Logs::new(logs_dir, &format!("{}-setup{i}", run.tool.name()));
        run_plain(cmd, &logs, cfg.step_timeout)
            .map_err(|e| format!("setup `{}`: {e}", cmd.display()))?;
    }
    Ok(())
}

fn blank(tool: Tool, step: Step, command: String) -> StepResult {
    StepResult {
        tool,
        step,
        status: Status::Ok,
        wall_s: None,
        walls: Vec::new(),
        peak_rss_kib: None,
        stored: None,
        added: None,
        note: None,
        command,
        cold: false,
    }
}

fn unusable(mut r: StepResult, status: &Status, note: &str) -> StepResult {
    r.status = status.clone();
    r.note = Some(note.to_string());
    r
}

fn run_push(
    cfg: &Config,
    lane: &mut Lane,
    step: Step,
    ds: &Dataset,
    generation: u32,
    logs_dir: &Path,
) -> StepResult {
    let cmd = lane.run.push(&ds.root, generation);
    let r = blank(lane.run.tool, step, cmd.display());
    if let Err((status, note)) = &lane.usable {
        return unusable(r, status, note);
    }
    let logs = Logs::new(
        logs_dir,
        &format!("{}-{}", lane.run.tool.name(), step.key()),
    );
    let outcome = run_timed(&cmd, &logs, cfg.step_timeout, cfg.cold);
    finish(r, lane, outcome)
}

fn run_pull(
    cfg: &Config,
    lane: &mut Lane,
    generation: u32,
    logs_dir: &Path,
    expected: Option<&crate::fsutil::TreeDigest>,
) -> StepResult {
    let dest = lane.run.pull_dest();
    let cmd = lane.run.pull(&dest, generation);
    let r = blank(lane.run.tool, Step::Pull, cmd.display());
    if let Err((status, note)) = &lane.usable {
        return unusable(r, status, note);
    }
    if let Err(e) = fresh_dir(&dest).and_then(|_| remove_all(&lane.run.pull_cache())) {
        return unusable(
            r,
            &Status::Error,
            &format!("preparing {}: {e}", dest.display()),
        );
    }
    let logs = Logs::new(logs_dir, &format!("{}-pull", lane.run.tool.name()));
    let outcome = run_timed(&cmd, &logs, cfg.step_timeout, cfg.cold);
    let mut r = finish(r, lane, outcome);
    if r.status == Status::Ok {
        match (tree_digest(&dest), expected) {
            (Ok(got), Some(want)) if &got != want => {
                r.status = Status::Mismatch;
                r.note = Some(format!(
                    "restored {} files / {} bytes, source has {} files / {} bytes{}",
                    got.files,
                    got.bytes,
                    want.files,
                    want.bytes,
                    if got.bytes == want.bytes {
                        " (content differs)"
                    } else {
                        ""
                    }
                ));
            }
            (Err(e), _) => {
                r.status = Status::Error;
                r.note = Some(format!("reading restored tree: {e}"));
            }
            _ => {}
        }
    }
    // Restored copies are only needed for the check; drop them to save disk.
    let _ = remove_all(&dest);
    let _ = remove_all(&lane.run.pull_cache());
    r
}

fn finish(
    mut r: StepResult,
    lane: &mut Lane,
    outcome: Result<(crate::runner::Timed, bool), String>,
) -> StepResult {
    match outcome {
        Ok((t, cold)) => {
            r.wall_s = Some(t.wall_s);
            r.walls = vec![t.wall_s];
            r.peak_rss_kib = Some(t.peak_rss_kib);
            r.cold = cold;
        }
        Err(e) => {
            r.status = Status::Error;
            r.note = Some(e);
        }
    }
    // Measured even after a failure, so the next step's "added" is relative
    // to what is really on disk.
    match tree_bytes(&lane.run.repo()) {
        Ok(now) => {
            r.stored = Some(now);
            r.added = Some(now as i64 - lane.stored as i64);
            lane.stored = now;
        }
        Err(e) => {
            r.note.get_or_insert_with(|| format!("measuring repo: {e}"));
        }
    }
    r
}

/// Observed fsync-family calls of one tool's cold push of a tiny tree.
pub struct FsyncProbe {
    pub tool: Tool,
    pub result: Result<u64, String>,
}

/// Pushes a three-file tree with each tool under strace and counts fsync,
/// fdatasync, sync_file_range, syncfs, sync and msync calls. This is what
/// backs the report's durability column instead of trusting the docs alone.
pub fn probe_fsync(cfg: &Config) -> io::Result<Vec<FsyncProbe>> {
    let base = cfg.work.join("fsync-probe");
    fresh_dir(&base)?;
    let src = base.join("src");
    fs::create_dir_all(src.join("sub"))?;
    fs::write(src.join("a.bin"), vec![7u8; 1 << 20])?;
    fs::write(src.join("sub/b.txt"), b"fsync probe\n")?;
    fs::write(src.join("sub/c.txt"), b"another file\n")?;
    let logs_dir = base.join("logs");
    fs::create_dir_all(&logs_dir)?;
    let strace = crate::fsutil::find_program(Path::new("strace")).is_some();
    let mut out = Vec::new();
    for &tool in &cfg.tools {
        let lane = new_lane(cfg, tool, &base, &logs_dir);
        let result = match lane.usable {
            _ if !strace => Err("strace not installed".to_string()),
            Err((_, note)) => Err(note),
            Ok(()) => {
                let logs = Logs::new(&logs_dir, &format!("{}-probe", tool.name()));
                count_fsyncs(&lane.run.push(&src, 1), &logs, cfg.step_timeout)
            }
        };
        out.push(FsyncProbe { tool, result });
    }
    if !cfg.keep {
        remove_all(&base)?;
    }
    Ok(out)
}

/// Merges repetitions of one data set: per step and tool, the median wall
/// time and the largest peak RSS; a repetition that failed wins, so a flaky
/// tool is never reported as ok. Stored bytes come from the first run (the
/// data is seeded, so they repeat).
pub fn merge_reps(mut reps: Vec<DatasetResult>) -> DatasetResult {
    let mut first = reps.remove(0);
    first.results.sort_by_key(|r| {
        (
            Step::ALL.iter().position(|s| *s == r.step),
            Tool::ALL.iter().position(|t| *t == r.tool),
        )
    });
    for r in &mut first.results {
        for other in &reps {
            let Some(o) = other.get(r.step, r.tool) else {
                continue;
            };
            if o.status != Status::Ok && r.status == Status::Ok {
                *r = o.clone();
                continue;
            }
            r.walls.extend(o.walls.iter().copied());
            r.peak_rss_kib = r.peak_rss_kib.max(o.peak_rss_kib);
            r.cold &= o.cold;
        }
        if !r.walls.is_empty() {
            let mut w = r.walls.clone();
            w.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
            r.wall_s = Some(w[w.len() / 2]);
        }
    }
    for other in &reps {
        first.stat_floor = match (first.stat_floor, other.stat_floor) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        first.copy_floor = match (first.copy_floor, other.copy_floor) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        for &(n, t) in &other.floor {
            match first.floor.iter_mut().find(|(m, _)| *m == n) {
                Some(f) => f.1 = f.1.min(t),
                None => first.floor.push((n, t)),
            }
        }
    }
    first
}

#[cfg(test)]
mod merge_tests {
    use super::*;
    use crate::datagen::Modification;

    fn ds(walls: &[(Tool, f64, Status)]) -> DatasetResult {
        DatasetResult {
            kind: DatasetKind::Sr,
            files: 1,
            bytes: 1,
            modification: Modification::default(),
            results: walls
                .iter()
                .map(|(tool, w, status)| StepResult {
                    status: status.clone(),
                    wall_s: Some(*w),
                    walls: vec![*w],
                    peak_rss_kib: Some((w * 10.0) as u64),
                    ..blank(*tool, Step::Cold, String::new())
                })
                .collect(),
            floor: Vec::new(),
            stat_floor: None,
            copy_floor: None,
        }
    }

    #[test]
    fn median_of_repetitions_and_failures_win() {
        let m = merge_reps(vec![
            ds(&[
                (Tool::Labsync, 3.0, Status::Ok),
                (Tool::Rsync, 1.0, Status::Ok),
            ]),
            ds(&[
                (Tool::Labsync, 1.0, Status::Ok),
                (Tool::Rsync, 1.0, Status::Error),
            ]),
            ds(&[
                (Tool::Labsync, 2.0, Status::Ok),
                (Tool::Rsync, 1.0, Status::Ok),
            ]),
        ]);
        let l = m.get(Step::Cold, Tool::Labsync).unwrap();
        assert_eq!(l.wall_s, Some(2.0));
        assert_eq!(l.walls, vec![3.0, 1.0, 2.0]);
        assert_eq!(l.peak_rss_kib, Some(30));
        assert_eq!(
            m.get(Step::Cold, Tool::Rsync).unwrap().status,
            Status::Error
        );
    }
}

#[cfg(test)]
mod floor_tests {
    use super::*;

    /// N readers means N `cat`s at once, whatever the number of files.
    #[test]
    fn every_reader_of_a_floor_gets_files() {
        for (files, readers) in [(400, 16), (400, 64), (30, 16), (50_000, 64), (3, 4)] {
            let k = per_reader(files, readers);
            let cats = files.div_ceil(k);
            assert!(
                cats >= readers.min(files),
                "{files} files, {readers}: {cats} cats"
            );
            assert!((1..=64).contains(&k));
        }
        assert_eq!(per_reader(1_000_000, 16), 64);
    }

    /// The script reads and writes at once and fails when any part fails.
    #[test]
    fn the_copy_floor_script_reads_and_writes_at_once_and_fails_loudly() {
        let dir = std::env::temp_dir().join(format!("copy-floor-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("a"), vec![7u8; 10_000]).unwrap();
        let outs = [0, 1, 2, 3].map(|i| dir.join(format!("o{i}")));
        let script = crate::runner::read_and_write_script(1, 5 << 20, &outs);
        let run = |script: &str| {
            std::process::Command::new("sh")
                .args(["-c", script])
                .current_dir(&src)
                .status()
                .unwrap()
        };
        // O_DIRECT may be refused where the temporary folder lives (a
        // tmpfs on an old kernel): then the failure is what is checked.
        let direct_ok = run(&script).success();
        for o in &outs {
            let written = std::fs::metadata(o).map(|m| m.len()).unwrap_or(0);
            if direct_ok {
                // 5 MiB over four writers, whole 4 MiB blocks each.
                assert_eq!(written, 4 << 20, "{}", o.display());
            }
        }
        let broken = outs.clone().map(|o| o.join("no/such/folder"));
        let script = crate::runner::read_and_write_script(1, 5 << 20, &broken);
        assert!(
            !run(&script).success(),
            "a writer that fails fails the floor"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
