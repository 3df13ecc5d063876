//! Each job in a cgroup of its own, so that killing it reaches every
//! process it started, including those that left its Unix session
//! (`setsid`, `subprocess.Popen(start_new_session=True)`, tmux, a daemon).
//!
//! A job's cgroup is `<hierarchy>/labsync/<labd>/<job-id>`, where `<labd>`
//! names this labd's state folder, so two labds on one machine (a shared
//! one and a personal one, or the tests) never share a job's cgroup. It sits
//! outside labd's own cgroup: jobs outlive a labd restart by design, and a
//! service manager stopping labd must not take them along.
//!
//! The unified (v2) hierarchy is used where it is mounted — alone, or beside
//! v1 in a hybrid mount — and a job is killed by `cgroup.kill`. Otherwise the
//! v1 freezer: the group is frozen (no process forks while it is killed),
//! every member SIGKILLed, then thawed. Where no cgroup can be made (labd not
//! root, no hierarchy mounted), labd says so once and kills sessions only.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Which kind of hierarchy holds the jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// cgroup v2 (`cgroup.kill`, `cgroup.procs`).
    V2,
    /// cgroup v1 with the freezer controller.
    V1Freezer,
}

/// The cgroups of one labd's jobs.
#[derive(Clone, Debug)]
pub struct Cgroups {
    /// `<hierarchy>/labsync/<labd>`.
    base: PathBuf,
    /// `/labsync/<labd>/`, as paths read in `/proc/PID/cgroup`.
    prefix: String,
    flavor: Flavor,
}

impl Cgroups {
    /// Finds a hierarchy and makes this labd's folder in it; `labd` names
    /// this labd (a hash of its state folder). The error says why not, for
    /// labd's log.
    pub fn open(labd: &str) -> Result<Cgroups, String> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")
            .map_err(|e| format!("cannot read /proc/self/mounts: {e}"))?;
        let mut tried = Vec::new();
        for (flavor, root) in hierarchies(&mounts) {
            let base = root.join("labsync").join(labd);
            // Folders of labds that are gone and left no job behind (a
            // non-empty one refuses to go): tests start hundreds of labds.
            if let Ok(rd) = std::fs::read_dir(root.join("labsync")) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
            match std::fs::create_dir_all(&base) {
                Ok(()) => {
                    return Ok(Cgroups {
                        base,
                        prefix: format!("/labsync/{labd}/"),
                        flavor,
                    })
                }
                Err(e) => tried.push(format!("{}: {e}", base.display())),
            }
        }
        if tried.is_empty() {
            Err("no cgroup v2 or v1 freezer hierarchy is mounted".into())
        } else {
            Err(format!("cannot create a cgroup ({})", tried.join("; ")))
        }
    }

    /// Which hierarchy.
    pub fn flavor(&self) -> Flavor {
        self.flavor
    }

    fn path(&self, job: &str) -> PathBuf {
        self.base.join(job)
    }

    /// The `cgroup.procs` of the hierarchy's root (tests move a process
    /// out of its job's cgroup with it).
    #[cfg(test)]
    pub(crate) fn root_procs(&self) -> PathBuf {
        self.base
            .ancestors()
            .nth(2)
            .expect("<hierarchy>/labsync/<labd>")
            .join("cgroup.procs")
    }

    /// Makes the job's cgroup and opens its `cgroup.procs` for the job's
    /// first process to write itself into before it runs anything.
    pub fn create(&self, job: &str) -> std::io::Result<File> {
        let p = self.path(job);
        // _all: another labd may have pruned this labd's empty folder.
        match std::fs::create_dir_all(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        File::options().write(true).open(p.join("cgroup.procs"))
    }

    /// The live processes in the job's cgroup (none if it has no cgroup).
    pub fn members(&self, job: &str) -> Vec<u32> {
        std::fs::read_to_string(self.path(job).join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// SIGTERM to every process of the job's cgroup.
    pub fn terminate(&self, job: &str) {
        for pid in self.members(job) {
            crate::runner::signal(pid, libc::SIGTERM);
        }
    }

    /// Kills every process of the job's cgroup and waits (up to `wait`) for
    /// it to be empty; true when it is.
    pub fn kill(&self, job: &str, wait: Duration) -> bool {
        let p = self.path(job);
        if !p.exists() {
            return true;
        }
        let deadline = Instant::now() + wait;
        loop {
            match self.flavor {
                Flavor::V2 if p.join("cgroup.kill").exists() => {
                    let _ = write_to(&p.join("cgroup.kill"), "1");
                }
                Flavor::V2 => {
                    // Before Linux 5.14 (no cgroup.kill): frozen first
                    // where it can be (5.2+), so no member forks a new one
                    // between the read of the list and the signals; a
                    // frozen process still dies of SIGKILL.
                    let freeze = p.join("cgroup.freeze");
                    let frozen = write_to(&freeze, "1").is_ok();
                    for pid in self.members(job) {
                        crate::runner::signal(pid, libc::SIGKILL);
                    }
                    if frozen {
                        let _ = write_to(&freeze, "0");
                    }
                }
                Flavor::V1Freezer => {
                    // Frozen first: no member forks a new one between the
                    // read of the list and the signals.
                    let state = p.join("freezer.state");
                    let _ = write_to(&state, "FROZEN");
                    for pid in self.members(job) {
                        crate::runner::signal(pid, libc::SIGKILL);
                    }
                    let _ = write_to(&state, "THAWED");
                }
            }
            std::thread::sleep(Duration::from_millis(10));
            if self.members(job).is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// Removes the job's cgroup once it is empty (a non-empty one stays).
    pub fn remove(&self, job: &str) {
        let p = self.path(job);
        if p.exists() {
            if let Err(e) = std::fs::remove_dir(&p) {
                tracing::warn!("cannot remove cgroup {}: {e}", p.display());
            }
        }
    }

    /// The job a process belongs to, from its cgroup.
    pub fn job_of(&self, pid: u32) -> Option<String> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        job_in(&text, self.flavor, &self.prefix)
    }
}

/// The job named by a `/proc/PID/cgroup` text, for `flavor`'s hierarchy.
fn job_in(text: &str, flavor: Flavor, prefix: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let ours = match flavor {
            Flavor::V2 => controllers.is_empty(),
            Flavor::V1Freezer => controllers.split(',').any(|c| c == "freezer"),
        };
        if !ours {
            return None;
        }
        // The whole path from the hierarchy's root: the same names deeper
        // down (in a cgroup a user was delegated) are not this labd's.
        let job = path.strip_prefix(prefix)?;
        (!job.is_empty() && !job.contains('/')).then(|| job.to_string())
    })
}

/// Hierarchies that can hold jobs, best first: v2 (alone or in a hybrid
/// mount), then the v1 freezer.
fn hierarchies(mounts: &str) -> Vec<(Flavor, PathBuf)> {
    let mut v2 = Vec::new();
    let mut v1 = Vec::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let (dir, fstype, opts) = (Path::new(f[1]), f[2], f[3]);
        if fstype == "cgroup2" {
            v2.push((Flavor::V2, dir.to_path_buf()));
        } else if fstype == "cgroup" && opts.split(',').any(|o| o == "freezer") {
            v1.push((Flavor::V1Freezer, dir.to_path_buf()));
        }
    }
    v2.extend(v1);
    v2
}

fn write_to(path: &Path, what: &str) -> std::io::Result<()> {
    File::options()
        .write(true)
        .open(path)?
        .write_all(what.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hierarchies_prefer_v2_then_the_v1_freezer() {
        let mounts = "proc /proc proc rw 0 0\n\
            cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0\n\
            cgroup /sys/fs/cgroup/freezer cgroup rw,nosuid,freezer 0 0\n\
            cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid 0 0\n";
        assert_eq!(
            hierarchies(mounts),
            vec![
                (Flavor::V2, PathBuf::from("/sys/fs/cgroup/unified")),
                (Flavor::V1Freezer, PathBuf::from("/sys/fs/cgroup/freezer")),
            ]
        );
        assert!(hierarchies("proc /proc proc rw 0 0\n").is_empty());
    }

    #[test]
    fn the_job_is_read_from_proc_cgroup() {
        let text = "6:freezer:/labsync/ab12/j7\n1:cpu:/\n0::/labsync/ab12/j9\n";
        let pre = "/labsync/ab12/";
        assert_eq!(job_in(text, Flavor::V2, pre).as_deref(), Some("j9"));
        assert_eq!(job_in(text, Flavor::V1Freezer, pre).as_deref(), Some("j7"));
        assert_eq!(job_in("0::/user.slice\n", Flavor::V2, pre), None);
        assert_eq!(job_in("0::/labsync/other/j1\n", Flavor::V2, pre), None);
        assert_eq!(job_in("0::/labsync/ab12/j1/x\n", Flavor::V2, pre), None);
        // A user's delegated cgroup with the same names is not the job's.
        let spoof = "0::/user.slice/user-1000.slice/user@1000.service/labsync/ab12/j1\n";
        assert_eq!(job_in(spoof, Flavor::V2, pre), None);
    }

    /// A process that left the job's session is still in its cgroup, and
    /// the cgroup's kill reaches it (needs root, as labd has): on the
    /// hierarchy labd picks, and on the v1 freezer where one is mounted.
    #[test]
    fn a_process_that_left_the_session_is_killed_with_the_cgroup() {
        if crate::users::euid() != 0 {
            eprintln!("not root: no cgroups to make");
            return;
        }
        let ns = format!("test-{}", std::process::id());
        let best = Cgroups::open(&ns).expect("root can make a cgroup here");
        escaped_child_dies_with(&best);
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        if let Some((_, root)) = hierarchies(&mounts)
            .into_iter()
            .find(|(f, _)| *f == Flavor::V1Freezer)
        {
            let base = root.join("labsync").join(format!("{ns}-v1"));
            std::fs::create_dir_all(&base).unwrap();
            escaped_child_dies_with(&Cgroups {
                base,
                prefix: format!("/labsync/{ns}-v1/"),
                flavor: Flavor::V1Freezer,
            });
        }
    }

    fn escaped_child_dies_with(cg: &Cgroups) {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::runner::JobSpec {
            argv: vec![
                "bash".into(),
                "-c".into(),
                "setsid sleep 300 & echo $! > pid; wait".into(),
            ],
            cwd: dir.path().to_path_buf(),
            env: vec![],
            log: dir.path().join("log"),
            user: None,
            cgroup: Some(cg.create("j1").unwrap()),
        };
        let mut job = crate::runner::spawn(&spec).unwrap();
        let pid_file = dir.path().join("pid");
        let t = Instant::now();
        let escaped: u32 = loop {
            let pid = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            match pid {
                Some(p) if cg.members("j1").len() >= 2 => break p,
                _ => {
                    assert!(t.elapsed() < Duration::from_secs(10), "job did not start");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        while crate::process_session(escaped) == Some(job.sid()) {
            assert!(t.elapsed() < Duration::from_secs(10), "setsid did not run");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(cg.job_of(escaped).as_deref(), Some("j1"));
        assert!(cg.kill("j1", Duration::from_secs(5)));
        let _ = job.child.wait();
        assert!(cg.members("j1").is_empty());
        cg.remove("j1");
        let _ = std::fs::remove_dir(&cg.base);
    }
}
