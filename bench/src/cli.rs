//! Command-line options. Hand-rolled: the harness is allowed only a handful
//! of dependencies and needs just `--flag value` pairs.

use std::path::PathBuf;
use std::time::Duration;

use crate::datagen::DatasetKind;
use crate::tools::Tool;

pub const USAGE: &str = "\
Usage: sync-bench [OPTIONS]

Benchmarks labsync push/pull against rsync, rclone, restic, borg and casync
on seeded data and writes a Markdown report (plus a JSON twin).

Options:
  --scale F            multiply file counts (default 1.0; smoke run: 0.02)
  --out PATH           Markdown report (default bench/results/sync.md);
                       raw numbers go to the same path with .json
  --work DIR           scratch dir on the disk under test
                       (default target/sync-bench-work); wiped on start
  --repo-dir DIR       put the stores/targets here instead of under --work
                       (a tmpfs or another disk: a push's writes then do not
                       share the device it reads from); wiped on start
  --labsync PATH       labsync binary (default target/release/labsync)
  --tools LIST         comma-separated subset of labsync,rsync,rclone,restic,borg,casync
  --datasets LIST      comma-separated subset of sr,small,million
                       (default sr,small; million: 1,000,000 files)
  --step-timeout SECS  kill a step after this long (default 3600)
  --no-fsync-probe     skip the strace fsync probe
  --reps N             repeat every data set N times, report the median
                       wall time (default 3; the machine is shared and noisy)
  --cold               empty the page cache before every timed step (needs
                       root; the report says where it could not) and
                       measure the parallel-read floor of each data set
  --keep               keep the work dir (repos, logs) afterwards
  -h, --help           show this help
";

#[derive(Debug, Clone)]
pub struct Options {
    pub scale: f64,
    pub out: PathBuf,
    pub work: PathBuf,
    pub repo_dir: Option<PathBuf>,
    pub labsync: PathBuf,
    pub tools: Vec<Tool>,
    pub datasets: Vec<DatasetKind>,
    pub step_timeout: Duration,
    pub fsync_probe: bool,
    pub keep: bool,
    pub cold: bool,
    pub reps: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scale: 1.0,
            out: "bench/results/sync.md".into(),
            work: "target/sync-bench-work".into(),
            repo_dir: None,
            labsync: "target/release/labsync".into(),
            tools: Tool::ALL.to_vec(),
            datasets: DatasetKind::ALL.to_vec(),
            step_timeout: Duration::from_secs(3600),
            fsync_probe: true,
            keep: false,
            cold: false,
            reps: 3,
        }
    }
}

/// `Ok(None)` means help was requested.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Options>, String> {
    let mut o = Options::default();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        // Accept both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--scale" => {
                let v = value()?;
                o.scale = v.parse().map_err(|_| format!("bad --scale {v:?}"))?;
                if !(o.scale.is_finite() && o.scale > 0.0) {
                    return Err("--scale must be a positive number".into());
                }
            }
            "--out" => o.out = value()?.into(),
            "--work" => o.work = value()?.into(),
            "--repo-dir" => o.repo_dir = Some(value()?.into()),
            "--labsync" => o.labsync = value()?.into(),
            "--tools" => o.tools = list(&value()?, Tool::parse, "tool")?,
            "--datasets" => o.datasets = list(&value()?, DatasetKind::parse, "data set")?,
            "--step-timeout" => {
                let v = value()?;
                let secs: u64 = v.parse().map_err(|_| format!("bad --step-timeout {v:?}"))?;
                o.step_timeout = Duration::from_secs(secs.max(1));
            }
            "--no-fsync-probe" => o.fsync_probe = false,
            "--keep" => o.keep = true,
            "--cold" => o.cold = true,
            "--reps" => {
                let v = value()?;
                o.reps = v
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| format!("bad --reps {v:?}: a count of 1 or more"))?;
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    Ok(Some(o))
}

fn list<T: PartialEq>(s: &str, parse: fn(&str) -> Option<T>, what: &str) -> Result<Vec<T>, String> {
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let v = parse(name).ok_or_else(|| format!("unknown {what} {name:?}"))?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    if out.is_empty() {
        return Err(format!("empty {what} list"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Option<Options>, String> {
        parse(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_flags() {
        let o = p(&[
            "--scale",
            "0.02",
            "--out=x.md",
            "--tools",
            "rsync,borg",
            "--keep",
            "--repo-dir",
            "/dev/shm/r",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(o.repo_dir, Some(PathBuf::from("/dev/shm/r")));
        assert_eq!(p(&[]).unwrap().unwrap().repo_dir, None);
        assert_eq!(o.scale, 0.02);
        assert_eq!(o.out, PathBuf::from("x.md"));
        assert_eq!(o.tools, vec![Tool::Rsync, Tool::Borg]);
        assert!(o.keep);
        assert!(p(&["--help"]).unwrap().is_none());
        assert!(p(&["--scale", "-1"]).is_err());
        assert!(p(&["--scale"]).is_err());
        assert!(p(&["--tools", "git"]).is_err());
        assert!(p(&["--bogus"]).is_err());
    }
}
