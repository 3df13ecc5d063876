//! Runs a job as its own Unix session, logs its output, and kills all of it.
//!
//! Each job leads a new session (`setsid`), so every process it forks — a
//! data loader's workers, a shell pipeline in its own process group, a
//! grandchild that ignores SIGTERM — carries the job's session id. Killing a
//! job signals every process of that session (found in `/proc`), SIGTERM
//! first and SIGKILL after a grace period, until none is left; GPU processes
//! of the session are the job's own, never "foreign".

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use labsync_store::RunAs;

/// What to run.
#[derive(Debug)]
pub struct JobSpec {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: PathBuf,
    /// The whole environment (the submitter's, plus `CUDA_VISIBLE_DEVICES`,
    /// `CUDA_DEVICE_ORDER` and `LABRUN_*`): nothing of labd's own leaks into a job. Without a
    /// `PATH`, the job gets a standard one.
    pub env: Vec<(String, String)>,
    /// File that receives stdout and stderr: through a keeper's pipe
    /// where `keeper` says, else the job's own descriptors.
    pub log: PathBuf,
    /// The keeper its output goes through ([`crate::keeper`]).
    pub keeper: Option<KeeperSpec>,
    /// Run as this uid/gid (labd running as root runs a job as its submitter).
    pub user: Option<RunAs>,
    /// The `cgroup.procs` of the job's cgroups ([`crate::Cgroups::create`]):
    /// the job's first process moves itself into each before it runs
    /// anything, so everything it starts is inside.
    pub cgroups: Vec<File>,
    /// Resource limits set before the switch to the user (its login's,
    /// [`crate::rlimits`]); none: labd's own are inherited.
    pub rlimits: Vec<crate::rlimits::Rlimit>,
}

/// How a job's output reaches its log through a keeper.
#[derive(Debug)]
pub struct KeeperSpec {
    /// labd's binary, run as `labd keep-log <job>`.
    pub exe: PathBuf,
    /// The keepers' cgroup (a folder), which it joins.
    pub cgroup: Option<PathBuf>,
}

/// A started job. Its pid is also its session id.
#[derive(Debug)]
pub struct Started {
    /// The session leader.
    pub child: Child,
    /// Its output's keeper, where it has one.
    pub keeper: Option<Child>,
}

impl Started {
    /// Pid of the session leader = the job's session id.
    pub fn sid(&self) -> u32 {
        self.child.id()
    }
}

/// Starts `spec` in a new session with output appended to its log.
pub fn spawn(spec: &JobSpec) -> std::io::Result<Started> {
    let (prog, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command"))?;
    let log = File::options().create(true).append(true).open(&spec.log)?;
    let (out, mut keeper) = match &spec.keeper {
        None => (log, None),
        Some(k) => {
            // Both ends close on exec: the keeper holds only the read
            // end, the job only the write end.
            let (from, to) = std::io::pipe()?;
            let label = spec.log.file_stem().unwrap_or_default().to_string_lossy();
            let cgroup = k.cgroup.as_deref();
            let child = crate::keeper::spawn(&k.exe, &label, from.into(), log, cgroup)?;
            (File::from(std::os::fd::OwnedFd::from(to)), Some(child))
        }
    };
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    if !spec.env.iter().any(|(k, _)| k == "PATH") {
        cmd.env("PATH", "/usr/local/bin:/usr/bin:/bin");
    }
    new_session(&mut cmd);
    if !spec.cgroups.is_empty() {
        // Before the switch to the user: moving a process needs root.
        let procs = spec.cgroups.iter().map(File::try_clone);
        join_cgroups(&mut cmd, procs.collect::<std::io::Result<_>>()?);
    }
    if !spec.rlimits.is_empty() {
        set_rlimits(&mut cmd, spec.rlimits.clone());
    }
    match spec.user {
        // The working folder is entered as the user, after the switch:
        // `Command::current_dir` would enter it as root, before any
        // pre-exec step, and a job would start inside a folder its user
        // could not enter.
        Some(RunAs { uid, gid }) => become_user(&mut cmd, uid, gid, &spec.cwd)?,
        None => {
            cmd.current_dir(&spec.cwd);
        }
    }
    match cmd.spawn() {
        Ok(child) => Ok(Started { child, keeper }),
        Err(e) => {
            // The pipe's last writer goes with `cmd`: the keeper ends.
            drop(cmd);
            if let Some(k) = keeper.as_mut() {
                let _ = k.wait();
            }
            Err(e)
        }
    }
}

#[allow(unsafe_code)]
fn new_session(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and calls only
    // setsid(2), which is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[allow(unsafe_code)]
fn join_cgroups(cmd: &mut Command, procs: Vec<File>) {
    use std::os::fd::AsRawFd;
    // SAFETY: the closure runs in the forked child before exec and makes
    // one write(2) to each descriptor opened before the fork ("0" means the
    // writing process); write is async-signal-safe. `procs` lives in the
    // closure, so the descriptors stay open until then.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                if libc::write(p.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

#[allow(unsafe_code)]
fn set_rlimits(cmd: &mut Command, limits: Vec<crate::rlimits::Rlimit>) {
    // SAFETY: the closure runs in the forked child before exec and makes
    // only setrlimit(2) calls, async-signal-safe, on memory prepared
    // before the fork. Root may raise a hard limit as well as lower it.
    unsafe {
        cmd.pre_exec(move || {
            for l in &limits {
                let r = libc::rlimit {
                    rlim_cur: l.soft,
                    rlim_max: l.hard,
                };
                // One the kernel refuses (past `fs.nr_open`) is left as
                // labd's: a job is not failed for it.
                libc::setrlimit(l.resource, &r);
            }
            Ok(())
        });
    }
}

/// The job runs as `uid` with its primary group and all its supplementary
/// groups (`video`/`render` for `/dev/nvidia*` on some systems, the lab's
/// data groups), in `cwd`, entered as that user. `Command::uid` would drop
/// the supplementary ones.
///
/// `cwd` is found by root (a `jobs/<id>/work` under labd's own folders,
/// however tight labd's umask made them) and opened without following a
/// symlink at its end; entering it (`fchdir`) after the switch asks the
/// user's search permission on that folder itself.
#[allow(unsafe_code)]
fn become_user(cmd: &mut Command, uid: u32, gid: u32, cwd: &Path) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    use std::os::fd::AsRawFd;
    let cwd = rustix::fs::open(
        cwd,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // Looked up before the fork: NSS is not async-signal-safe.
    let groups: Vec<libc::gid_t> = crate::users::user_by_uid(uid)
        .map_or_else(|| vec![gid], |u| crate::users::groups_of(&u.name, gid));
    // SAFETY: the closure runs in the forked child before exec and makes
    // only setgroups/setgid/setuid/fchdir system calls, which are
    // async-signal-safe, on memory and a descriptor prepared before the
    // fork (`cwd` lives in the closure; close-on-exec, the job does not
    // inherit it).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) == -1
                || libc::setgid(gid) == -1
                || libc::setuid(uid) == -1
                || libc::fchdir(cwd.as_raw_fd()) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Every live process whose session id is `sid`.
pub fn session_members(sid: u32) -> Vec<u32> {
    members_of(&HashSet::from([sid]))
}

/// Every live process whose session id is one of `sids` (one pass over
/// `/proc` for all of them).
fn members_of(sids: &HashSet<u32>) -> Vec<u32> {
    if sids.is_empty() {
        return Vec::new();
    }
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            crate::process_session(pid).is_some_and(|s| sids.contains(&s)) && !is_zombie(pid)
        })
        .collect()
}

/// Whether pid `sid`, whose process started at `start` clock ticks, is
/// another process's now. Linux hands a pid out again only when no
/// process has it as its session id any more: the session it led is then
/// empty, and processes with that session id are someone else's (a
/// login, another job).
pub fn changed_hands(sid: u32, start: Option<u64>) -> bool {
    start.is_some_and(|s| start_ticks(sid).is_some_and(|now| now != s))
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .unwrap_or(true)
}

#[allow(unsafe_code)]
pub(crate) fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions; a pid that is gone
    // gives ESRCH, which is what we want to ignore.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// SIGTERM to every process of the session, SIGKILL to what is left after
/// `grace`, repeated until the session is empty (a process forking while it
/// is killed is caught on the next round). Returns how many were SIGKILLed.
pub fn kill_session(sid: u32, grace: Duration) -> usize {
    kill_sessions(&[(sid, None)], grace)
}

/// [`kill_session`] for several sessions at once, under one grace period.
/// Each is its leader's pid and when that leader started (`None`: not
/// known); one whose pid [`changed_hands`] is left alone, as checked
/// before every round.
pub fn kill_sessions(sessions: &[(u32, Option<u64>)], grace: Duration) -> usize {
    let live = || -> HashSet<u32> {
        sessions
            .iter()
            .filter(|(sid, start)| !changed_hands(*sid, *start))
            .map(|(sid, _)| *sid)
            .collect()
    };
    for pid in members_of(&live()) {
        signal(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if members_of(&live()).is_empty() {
            return 0;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut killed = 0;
    for _ in 0..100 {
        let left = members_of(&live());
        if left.is_empty() {
            break;
        }
        for pid in &left {
            signal(*pid, libc::SIGKILL);
        }
        killed += left.len();
        std::thread::sleep(Duration::from_millis(20));
    }
    killed
}

/// Ends processes that are not a job's session (a hold's holder's, see
/// `daemon::holds`): SIGTERM, then SIGKILL to those left after `grace`.
/// Each is its pid and when it started; one whose pid changed hands (or
/// that is gone) is left alone, as checked before every signal. Returns
/// how many needed SIGKILL.
pub fn kill_processes(procs: &[(u32, u64)], grace: Duration) -> usize {
    let live = || -> Vec<u32> {
        procs
            .iter()
            .filter(|(pid, start)| start_ticks(*pid) == Some(*start) && !is_zombie(*pid))
            .map(|(pid, _)| *pid)
            .collect()
    };
    for pid in live() {
        signal(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !live().is_empty() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = live();
    for pid in &left {
        signal(*pid, libc::SIGKILL);
    }
    left.len()
}

/// When `pid` started, in clock ticks after boot (`/proc/PID/stat` field
/// 22); `None` if it is gone.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces;
    // what follows starts at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// True while the job led by `pid` lives (for adopting jobs after a
/// restart): the process exists, is not a zombie, still leads its own
/// session, as every job's leader does, and started when the job's leader
/// did (`start`, when the record has it), so a pid reused by another
/// process, session leader or not, is not taken for the job.
pub fn alive(pid: u32, start: Option<u64>) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !is_zombie(pid)
        && crate::process_session(pid) == Some(pid)
        && start.is_none_or(|s| start_ticks(pid) == Some(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, script: &str) -> JobSpec {
        JobSpec {
            argv: vec!["bash".into(), "-c".into(), script.into()],
            cwd: dir.to_path_buf(),
            env: vec![("LABRUN_JOB_ID".into(), "j1".into())],
            log: dir.join("log"),
            user: None,
            cgroups: vec![],
            rlimits: vec![],
            keeper: None,
        }
    }

    #[test]
    fn output_and_exit_status() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spawn(&spec(
            dir.path(),
            "echo out $LABRUN_JOB_ID; echo err >&2; exit 3",
        ))
        .unwrap();
        let status = s.child.wait().unwrap();
        assert_eq!(status.code(), Some(3));
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert!(log.contains("out j1") && log.contains("err"), "{log}");
    }

    /// A job run as its user enters its working folder as that user: one
    /// it could not enter itself is refused, not entered as root.
    #[test]
    fn the_working_folder_is_entered_as_the_user() {
        use std::os::unix::fs::PermissionsExt;
        if crate::euid() != 0 {
            eprintln!("not root: cannot run a job as another user");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        mode(dir.path(), 0o711);
        let (open, closed) = (dir.path().join("open"), dir.path().join("closed"));
        std::fs::create_dir(&open).unwrap();
        std::fs::create_dir(&closed).unwrap();
        mode(&open, 0o755);
        mode(&closed, 0o700);
        let as_nobody = |cwd: &Path| JobSpec {
            cwd: cwd.to_path_buf(),
            user: Some(RunAs {
                uid: 65534,
                gid: 65534,
            }),
            ..spec(dir.path(), "echo in $(pwd) as $(id -u)")
        };
        let mut s = spawn(&as_nobody(&open)).unwrap();
        assert!(s.child.wait().unwrap().success());
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert_eq!(log, format!("in {} as 65534\n", open.display()));
        let e = spawn(&as_nobody(&closed)).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        // A folder of the user's own inside root's tight ones (labd under
        // umask 077 makes jobs/<id> 0700): found by root, entered by the
        // user.
        let theirs = closed.join("work");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        mode(&theirs, 0o700);
        std::fs::remove_file(dir.path().join("log")).unwrap();
        let mut s = spawn(&as_nobody(&theirs)).unwrap();
        assert!(s.child.wait().unwrap().success());
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert_eq!(log, format!("in {} as 65534\n", theirs.display()));
    }

    /// A pid reused by a process that leads no session, or by a session
    /// leader that started at another time, is not the job.
    #[test]
    fn alive_means_the_same_live_session_leader() {
        let dir = tempfile::tempdir().unwrap();
        let mut job = spawn(&spec(dir.path(), "sleep 30")).unwrap();
        let mut plain = Command::new("sleep").arg("30").spawn().unwrap();
        let start = start_ticks(job.sid());
        assert!(start.is_some());
        assert!(alive(job.sid(), start));
        assert!(alive(job.sid(), None), "records without a start time");
        assert!(
            !alive(job.sid(), start.map(|s| s + 1)),
            "a leader that started at another time is another process"
        );
        assert!(!alive(plain.id(), None), "not a session leader");
        kill_session(job.sid(), Duration::from_millis(100));
        let _ = job.child.wait();
        assert!(!alive(job.sid(), start));
        plain.kill().unwrap();
        plain.wait().unwrap();
    }

    /// The job's grandchildren ignore SIGTERM and sit in another process
    /// group; all of them must be gone after the kill.
    #[test]
    fn kill_leaves_nothing_of_the_session() {
        let dir = tempfile::tempdir().unwrap();
        // Ignored signals stay ignored across exec, so the sleeps ignore TERM too;
        // `set -m` puts the second subshell in a process group of its own.
        let script = "trap '' TERM; (sleep 300 & sleep 300 & wait) & set -m; (sleep 300) & wait";
        let mut s = spawn(&spec(dir.path(), script)).unwrap();
        let sid = s.sid();
        let t = Instant::now();
        while session_members(sid).len() < 5 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "job did not start its children"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let killed = kill_session(sid, Duration::from_millis(300));
        assert!(
            killed >= 4,
            "SIGTERM was ignored, so SIGKILL did the work: {killed}"
        );
        let _ = s.child.wait();
        assert!(
            session_members(sid).is_empty(),
            "left: {:?}",
            session_members(sid)
        );
    }
}
