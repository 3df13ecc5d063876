//! A job's output goes through a pipe to a log keeper, never to its log.
//!
//! Were the job's stdout the log file itself (opened by root), a job could
//! pass that descriptor out (`SCM_RIGHTS` to a process of its user's
//! login, a daemon it double-forked out of its cgroup's reach before
//! cgroups, `/proc/PID/fd` while it runs) and keep writing to it after the
//! job ended: unbounded, and charged to root, whom no quota stops. So the
//! job gets the write end of a pipe, and a keeper holds the read end and
//! appends what comes to the log, which labd keeps under its cap
//! (labd's log bounding). When the job has ended, labd ends the
//! keeper: it has drained the pipe and exited by itself once the last
//! writer was gone (the usual end, nothing lost), or is killed after a
//! grace period when a writer outlives the job, whose writes then fail
//! (`EPIPE`).
//!
//! A job outlives a labd restart, and so must its output's reader: a read
//! end held by labd would close with it and kill the job on its next line
//! (`SIGPIPE`). So the keeper is a process of its own, labd's own binary
//! run as `labd keep-log <job>` ([`keep_log_if_asked`] is the first thing
//! labd's `main` does), in a session of its own and, where labd has
//! cgroups, in the cgroup of this labd's keepers: outside labd's (a service
//! manager stopping labd leaves it) and outside the job's (the job's kill
//! does not stop it before it has drained the pipe).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The first argument that makes labd a log keeper (`labd keep-log j12`).
pub const KEEP_LOG: &str = "keep-log";

/// Runs as a log keeper, and exits, when labd's arguments say so:
/// copies standard input (the job's pipe) to standard output (its log,
/// opened by labd) until every writer is gone.
pub fn keep_log_if_asked() {
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|a| a == KEEP_LOG) && args.next().is_some() {
        use std::os::fd::AsFd;
        // Unbuffered both ways: a progress bar's `\r` line is in the log
        // when it is written, not at the next newline.
        let fd = |f: std::io::Result<std::os::fd::OwnedFd>| f.map(File::from);
        let from = fd(std::io::stdin().as_fd().try_clone_to_owned());
        let to = fd(std::io::stdout().as_fd().try_clone_to_owned());
        let code = match (from, to) {
            (Ok(from), Ok(to)) => keep(from, to),
            _ => 1,
        };
        std::process::exit(code);
    }
}

/// Copies `from` to `to` until end of file. A write that fails (a full
/// disk) loses that piece, never the job: the pipe keeps being drained.
fn keep(mut from: impl Read, mut to: impl Write) -> i32 {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return 0,
            Ok(n) => {
                let _ = to.write_all(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return 1,
        }
    }
}

/// Starts the keeper of job `id`: `exe` (labd's binary) reading `from`,
/// appending to `log`, in a session of its own, joining the cgroup
/// `cgroup` (a folder) first.
pub(crate) fn spawn(
    exe: &Path,
    id: &str,
    from: std::os::fd::OwnedFd,
    log: File,
    cgroup: Option<&Path>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args([KEEP_LOG, id])
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::from(from))
        .stdout(log)
        .stderr(Stdio::null());
    join(&mut cmd, cgroup)?;
    cmd.spawn()
}

/// The keeper leads a session of its own and joins the cgroup `cgroup`.
/// The keepers' cgroup is empty between jobs, and another labd's start
/// (tests start hundreds on one machine) may remove it then: the child
/// makes it again and retries. Where it still cannot join, it stays in
/// labd's cgroup rather than lose the job's output.
#[allow(unsafe_code)]
fn join(cmd: &mut Command, cgroup: Option<&Path>) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let paths = match cgroup {
        Some(dir) => {
            let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes());
            Some((c(dir)?, c(&dir.join("cgroup.procs"))?))
        }
        None => None,
    };
    // SAFETY: the closure runs in the forked child before exec and makes
    // only setsid, mkdir, open, write and close system calls, all
    // async-signal-safe, on C strings made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some((dir, procs)) = &paths {
                for _ in 0..3 {
                    libc::mkdir(dir.as_ptr(), 0o755);
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd >= 0 {
                        let joined = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                        libc::close(fd);
                        if joined {
                            break;
                        }
                    }
                }
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything is copied, in order, up to the end of the input.
    #[test]
    fn the_keeper_copies_everything_to_the_end() {
        let input: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let mut out = Vec::new();
        assert_eq!(keep(&input[..], &mut out), 0);
        assert_eq!(out, input);
    }

    /// A writer that fails does not stop the draining.
    #[test]
    fn a_failing_write_does_not_stop_the_drain() {
        struct Full(usize);
        impl Write for Full {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0 += 1;
                if self.0.is_multiple_of(2) {
                    Err(std::io::Error::other("no space left"))
                } else {
                    Ok(b.len())
                }
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let input = vec![7u8; 1 << 20];
        let mut out = Full(0);
        assert_eq!(keep(&input[..], &mut out), 0);
        assert!(out.0 >= 16, "{} writes", out.0);
    }
}
