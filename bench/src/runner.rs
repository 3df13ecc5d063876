//! Running tool commands: under GNU time for the measurements, under strace
//! for the fsync probe, always with a timeout and with output kept in log
//! files so a failure can be explained in the report.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// GNU time by absolute path: the shell keyword `time` has no `-o`/`-f`.
pub const GNU_TIME: &str = "/usr/bin/time";

/// One external command, independent of how it will be wrapped.
#[derive(Debug, Clone, Default)]
pub struct Cmd {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub cwd: Option<PathBuf>,
    pub env: Vec<(OsString, OsString)>,
}

impl Cmd {
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Cmd {
            program: program.as_ref().to_owned(),
            ..Cmd::default()
        }
    }

    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    pub fn cwd(mut self, dir: &Path) -> Self {
        self.cwd = Some(dir.to_path_buf());
        self
    }

    pub fn env(mut self, k: &str, v: impl AsRef<OsStr>) -> Self {
        self.env.push((k.into(), v.as_ref().to_owned()));
        self
    }

    /// Shell-like rendering for the report, e.g. `(cd DIR && X=1 prog a b)`.
    pub fn display(&self) -> String {
        let mut parts: Vec<String> = self
            .env
            .iter()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), quote(v)))
            .collect();
        parts.push(quote(&self.program));
        parts.extend(self.args.iter().map(|a| quote(a)));
        let line = parts.join(" ");
        match &self.cwd {
            Some(d) => format!("(cd {} && {line})", quote(d.as_os_str())),
            None => line,
        }
    }
}

fn quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Wall time and peak RSS of one measured command.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    pub wall_s: f64,
    pub peak_rss_kib: u64,
}

/// Where a command's stdout, stderr and wrapper output go.
pub struct Logs {
    dir: PathBuf,
    label: String,
}

impl Logs {
    pub fn new(dir: &Path, label: &str) -> Self {
        Logs {
            dir: dir.to_path_buf(),
            label: label.replace(['/', ' '], "_"),
        }
    }
    fn path(&self, ext: &str) -> PathBuf {
        self.dir.join(format!("{}.{ext}", self.label))
    }
}

/// Empties the page cache (`sync`, then `3 > /proc/sys/vm/drop_caches`), so
/// the next step reads everything from the device; false where the machine
/// does not allow it (not root, a container).
pub fn drop_caches() -> bool {
    let _ = Command::new("sync").status();
    fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

/// A shell command that reads every file under the current folder with
/// `readers` `cat`s at once, `per_reader` files each, to `/dev/null`.
pub fn read_script(readers: usize, per_reader: usize) -> String {
    format!("find . -type f -print0 | xargs -0 -P {readers} -n {per_reader} cat > /dev/null")
}

/// A shell script that reads every file under the current folder cold
/// with 16 `cat`s (`per_reader` files each) and, at the same time, writes
/// `bytes` with four `dd oflag=direct`, spread over `outs` (one per
/// writer, four of them): what a disk takes to do a copy's reads and its
/// writes at once. It fails if any part failed. `outs` are left for the
/// caller to remove.
pub fn read_and_write_script(per_reader: usize, bytes: u64, outs: &[PathBuf; 4]) -> String {
    const BLOCK: u64 = 4 << 20;
    let blocks = bytes.div_ceil(outs.len() as u64 * BLOCK).max(1);
    let mut script = format!("{} & r=$!\n", read_script(16, per_reader));
    for (i, o) in outs.iter().enumerate() {
        script += &format!(
            "dd if=/dev/zero of='{}' bs={BLOCK} count={blocks} oflag=direct status=none & w{i}=$!\n",
            o.display()
        );
    }
    script += "wait $r";
    for i in 0..outs.len() {
        script += &format!(" && wait $w{i}");
    }
    script + "\n"
}

/// Runs `cmd` under `/usr/bin/time -f '%e %M'`, after emptying the page
/// cache when `cold` (false when that was asked and not allowed). `Err`
/// carries a one-line reason (exit status plus the last line of stderr).
pub fn run_timed(
    cmd: &Cmd,
    logs: &Logs,
    timeout: Duration,
    cold: bool,
) -> Result<(Timed, bool), String> {
    // Untimed: flush every dirty page first, so no step pays for the
    // writeback of data generation or of the previous tool (which would bill
    // whichever tool fsyncs next, and only the tools that fsync).
    let _ = Command::new("sync").status();
    let dropped = cold && drop_caches();
    let time_file = logs.path("time");
    let wrapper = [
        OsString::from(GNU_TIME),
        "-f".into(),
        "%e %M".into(),
        "-o".into(),
        time_file.clone().into(),
    ];
    run_wrapped(&wrapper, cmd, logs, timeout)?;
    let out = fs::read_to_string(&time_file)
        .map_err(|e| format!("reading {}: {e}", time_file.display()))?;
    let timed =
        parse_time_output(&out).ok_or_else(|| format!("unparsable GNU time output: {out:?}"))?;
    Ok((timed, dropped))
}

/// Runs an untimed setup command (repository init and the like).
pub fn run_plain(cmd: &Cmd, logs: &Logs, timeout: Duration) -> Result<(), String> {
    run_wrapped(&[], cmd, logs, timeout)
}

/// Runs `cmd` under `strace -f -c` and returns how many fsync-family calls
/// it and its children made; this checks the documented durability claims.
pub fn count_fsyncs(cmd: &Cmd, logs: &Logs, timeout: Duration) -> Result<u64, String> {
    let out = logs.path("strace");
    let wrapper = [
        OsString::from("strace"),
        "-f".into(),
        "-qq".into(),
        "-c".into(),
        "-e".into(),
        "trace=fsync,fdatasync,sync_file_range,syncfs,sync,msync".into(),
        "-o".into(),
        out.clone().into(),
    ];
    run_wrapped(&wrapper, cmd, logs, timeout)?;
    // strace writes nothing at all when none of the traced calls happened.
    let text = fs::read_to_string(&out).unwrap_or_default();
    Ok(parse_strace_summary(&text))
}

fn run_wrapped(
    wrapper: &[OsString],
    cmd: &Cmd,
    logs: &Logs,
    timeout: Duration,
) -> Result<(), String> {
    let (stdout_path, stderr_path) = (logs.path("stdout"), logs.path("stderr"));
    let open = |p: &Path| File::create(p).map_err(|e| format!("creating {}: {e}", p.display()));
    let mut argv = wrapper.to_vec();
    argv.push(cmd.program.clone());
    argv.extend(cmd.args.iter().cloned());
    let mut command = Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(open(&stdout_path)?)
        .stderr(open(&stderr_path)?)
        // Own process group, so a timeout can kill the tool's children too.
        .process_group(0);
    if let Some(dir) = &cmd.cwd {
        command.current_dir(dir);
    }
    for (k, v) in &cmd.env {
        command.env(k, v);
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", argv[0].to_string_lossy()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > timeout => {
                kill_group(child.id());
                let _ = child.wait();
                return Err(format!("timed out after {} s", timeout.as_secs()));
            }
            // Polling only decides when we notice the exit; the wall time
            // itself comes from GNU time, so 20 ms granularity costs nothing.
            Ok(None) => sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for child: {e}")),
        }
    };
    if status.success() {
        Ok(())
    } else {
        Err(failure_reason(status, &stderr_path, &stdout_path))
    }
}

fn kill_group(pgid: u32) {
    // std has no killpg; the kill(1) utility does, and avoids a libc dependency.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn failure_reason(status: ExitStatus, stderr: &Path, stdout: &Path) -> String {
    let tail = |p: &Path| {
        fs::read_to_string(p)
            .ok()
            .and_then(|s| last_line(&s).map(str::to_owned))
    };
    let how = match status.code() {
        Some(c) => format!("exit {c}"),
        None => "killed by signal".to_string(),
    };
    match tail(stderr).or_else(|| tail(stdout)) {
        Some(line) => format!("{how}: {line}"),
        None => how,
    }
}

/// Last non-blank line, trimmed.
pub fn last_line(s: &str) -> Option<&str> {
    s.lines().map(str::trim).rev().find(|l| !l.is_empty())
}

/// Parses GNU time's `-f '%e %M'` output. On a non-zero exit GNU time puts
/// a "Command exited with non-zero status N" line first, hence last line.
pub fn parse_time_output(s: &str) -> Option<Timed> {
    let mut it = last_line(s)?.split_whitespace();
    let wall_s = it.next()?.parse().ok()?;
    let peak_rss_kib = it.next()?.parse().ok()?;
    Some(Timed {
        wall_s,
        peak_rss_kib,
    })
}

/// Total `calls` from an `strace -c` summary (4th column of the `total` row).
pub fn parse_strace_summary(s: &str) -> u64 {
    s.lines()
        .find(|l| l.trim_end().ends_with(" total"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(0)
}

/// First line of `program args` stdout (or stderr), for version strings.
pub fn first_line_of(program: &OsStr, args: &[&str]) -> Option<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    let text = String::from_utf8_lossy(&text);
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    Some(line.split_whitespace().collect::<Vec<_>>().join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gnu_time() {
        assert_eq!(
            parse_time_output("1.25 20480\n"),
            Some(Timed {
                wall_s: 1.25,
                peak_rss_kib: 20480
            })
        );
        let failed = "Command exited with non-zero status 1\n0.00 1924\n";
        assert_eq!(parse_time_output(failed).unwrap().peak_rss_kib, 1924);
        assert_eq!(parse_time_output(""), None);
    }

    #[test]
    fn parses_strace_summary() {
        let s = "% time     seconds  usecs/call     calls    errors syscall\n\
                 ------ ----------- ----------- --------- --------- ----------------\n\
                 \x2056.42    0.000826          48        17           fsync\n\
                 \x2043.58    0.000638          79         8           fdatasync\n\
                 ------ ----------- ----------- --------- --------- ----------------\n\
                 100.00    0.001464          58        25           total\n";
        assert_eq!(parse_strace_summary(s), 25);
        assert_eq!(parse_strace_summary(""), 0);
    }

    #[test]
    fn failing_command_reports_stderr_and_success_is_timed() {
        if !Path::new(GNU_TIME).exists() {
            eprintln!("skipped: {GNU_TIME} not installed (Debian package `time`)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("labsync-bench-runner-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let bad = Cmd::new("sh").arg("-c").arg("echo boom >&2; exit 3");
        let logs = Logs::new(&dir, "bad");
        let err = run_timed(&bad, &logs, Duration::from_secs(30), false).unwrap_err();
        assert_eq!(err, "exit 3: boom");
        let ok = Cmd::new("true");
        let (t, cold) =
            run_timed(&ok, &Logs::new(&dir, "ok"), Duration::from_secs(30), false).unwrap();
        assert!(!cold, "not asked");
        assert!(t.wall_s >= 0.0 && t.peak_rss_kib > 0);
        let slow = Cmd::new("sleep").arg("5");
        let err =
            run_plain(&slow, &Logs::new(&dir, "slow"), Duration::from_millis(200)).unwrap_err();
        assert!(err.starts_with("timed out"));
        let missing = Cmd::new("/nonexistent/tool");
        assert!(run_timed(
            &missing,
            &Logs::new(&dir, "missing"),
            Duration::from_secs(5),
            false
        )
        .is_err());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn display_quotes() {
        let c = Cmd::new("borg")
            .arg("create")
            .arg("a b")
            .env("X", "1")
            .cwd(Path::new("/t"));
        assert_eq!(c.display(), "(cd /t && X=1 borg create 'a b')");
    }
}
