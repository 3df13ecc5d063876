//! `sync-bench`: runs the labsync sync benchmark and writes the report.
//! See `sync-bench --help` and bench/README for what is measured.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use labsync_bench::bench::{self, Config};
use labsync_bench::cli::{self, USAGE};
use labsync_bench::fsutil::fresh_dir;
use labsync_bench::machine::{self, Machine};
use labsync_bench::report::Report;
use labsync_bench::runner::GNU_TIME;

/// Marks a directory as ours, so `--work` never wipes a user's directory.
const WORK_MARKER: &str = ".labsync-bench-work";

fn main() -> ExitCode {
    let opts = match cli::parse(std::env::args().skip(1)) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("sync-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sync-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn absolute(p: &Path) -> Result<PathBuf, String> {
    std::env::current_dir()
        .map(|cwd| cwd.join(p))
        .map_err(|e| format!("current dir: {e}"))
}

/// Wipes and recreates the work dir, refusing dirs we did not create.
fn claim_work_dir(work: &Path) -> Result<(), String> {
    let foreign = fs::read_dir(work)
        .map(|mut entries| entries.next().is_some() && !work.join(WORK_MARKER).exists())
        .unwrap_or(false);
    if foreign {
        return Err(format!(
            "{} is not empty and was not created by sync-bench; refusing to wipe it",
            work.display()
        ));
    }
    fresh_dir(work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    fs::write(work.join(WORK_MARKER), b"").map_err(|e| format!("writing marker: {e}"))
}

fn run(opts: cli::Options) -> Result<(), String> {
    if !Path::new(GNU_TIME).exists() {
        return Err(format!("{GNU_TIME} not found (Debian package `time`)"));
    }
    let work = absolute(&opts.work)?;
    claim_work_dir(&work)?;
    let repo_dir = match &opts.repo_dir {
        Some(d) => {
            let d = absolute(d)?;
            claim_work_dir(&d)?;
            // Read now: the folder is gone when the report is written.
            let fs = machine::fs_type(&d);
            Some((d, fs))
        }
        None => None,
    };
    let cfg = Config {
        work: work.clone(),
        repo_dir: repo_dir.as_ref().map(|(d, _)| d.clone()),
        scale: opts.scale,
        tools: opts.tools.clone(),
        datasets: opts.datasets.clone(),
        labsync: absolute(&opts.labsync)?,
        step_timeout: opts.step_timeout,
        keep: opts.keep,
        cold: opts.cold,
    };

    let machine = Machine::probe(&work);
    let load_before = machine::loadavg();
    let versions = cfg
        .tools
        .iter()
        .map(|&t| machine::tool_version(t, &cfg.labsync))
        .collect();
    let probes = if opts.fsync_probe {
        bench::probe_fsync(&cfg).map_err(|e| format!("fsync probe: {e}"))?
    } else {
        Vec::new()
    };
    let mut datasets = Vec::new();
    for &kind in &cfg.datasets {
        let mut reps = Vec::new();
        for rep in 1..=opts.reps {
            eprintln!(
                "[sync-bench] {}: repetition {rep} of {}",
                kind.name(),
                opts.reps
            );
            reps.push(
                bench::run_dataset(&cfg, kind, rep - 1)
                    .map_err(|e| format!("data set {}: {e}", kind.name()))?,
            );
        }
        datasets.push(bench::merge_reps(reps));
    }
    if !cfg.keep {
        let _ = fs::remove_dir_all(&work);
        if let Some((d, _)) = &repo_dir {
            let _ = fs::remove_dir_all(d);
        }
    }

    let report = Report {
        command: std::iter::once("sync-bench".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
        scale: opts.scale,
        work,
        repo_dir,
        step_timeout_s: opts.step_timeout.as_secs(),
        machine,
        load_before,
        load_after: machine::loadavg(),
        versions,
        probes,
        datasets,
    };
    let md = report.markdown();
    print!("{md}");
    if let Some(dir) = opts.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    fs::write(&opts.out, &md).map_err(|e| format!("writing {}: {e}", opts.out.display()))?;
    let json_path = opts.out.with_extension("json");
    let json =
        serde_json::to_string_pretty(&report.json()).map_err(|e| format!("encoding JSON: {e}"))?;
    fs::write(&json_path, json + "\n")
        .map_err(|e| format!("writing {}: {e}", json_path.display()))?;
    eprintln!(
        "[sync-bench] wrote {} and {}",
        opts.out.display(),
        json_path.display()
    );
    Ok(())
}
