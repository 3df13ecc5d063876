//! A job's resource limits are its user's login limits, not root's.
//!
//! labd runs as root, often with limits raised for itself (a service
//! manager's `LimitNOFILE`, root's `memlock`), and a job forked from it
//! would inherit them: a user whose login the lab holds to 4096 open files
//! or no core dumps would escape that by running through labd. So a job
//! starts from the limits a login starts from, those of the first process
//! (`/proc/1/limits`, what every session inherits), with the entries of
//! pam_limits' files for its user applied on top, the way pam_limits
//! applies them at a login: `limits.conf`, then `limits.d/*.conf` in name
//! order; an entry for the user beats one for a group of theirs, which
//! beats a `*` (never applied to root) or a uid range; among equals the
//! later one wins. Items that are no resource limit (`maxlogins`,
//! `priority`, `nonewprivs`) are left to logins.

use std::path::{Path, PathBuf};

/// One limit: the resource, soft and hard values (`RLIM_INFINITY` for
/// unlimited).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rlimit {
    /// `RLIMIT_*`.
    pub resource: libc::__rlimit_resource_t,
    /// The soft limit.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Where pam_limits' files are: `limits.conf` and the `limits.d` folder
/// beside it.
#[derive(Clone, Debug)]
pub struct LoginLimits {
    conf: PathBuf,
}

impl Default for LoginLimits {
    fn default() -> Self {
        LoginLimits::new("/etc/security/limits.conf")
    }
}

/// Who a job runs as, for matching entries.
pub struct Who<'a> {
    /// Login name.
    pub name: &'a str,
    /// User id.
    pub uid: u32,
    /// Primary and supplementary group ids.
    pub gids: &'a [u32],
}

/// The resources pam_limits knows: its item name, the resource, `/proc`'s
/// name of it, and the unit of the file's values in bytes or seconds.
const ITEMS: [(&str, libc::__rlimit_resource_t, &str, u64); 15] = [
    ("core", libc::RLIMIT_CORE, "Max core file size", 1024),
    ("data", libc::RLIMIT_DATA, "Max data size", 1024),
    ("fsize", libc::RLIMIT_FSIZE, "Max file size", 1024),
    ("memlock", libc::RLIMIT_MEMLOCK, "Max locked memory", 1024),
    ("nofile", libc::RLIMIT_NOFILE, "Max open files", 1),
    ("rss", libc::RLIMIT_RSS, "Max resident set", 1024),
    ("stack", libc::RLIMIT_STACK, "Max stack size", 1024),
    ("cpu", libc::RLIMIT_CPU, "Max cpu time", 60),
    ("nproc", libc::RLIMIT_NPROC, "Max processes", 1),
    ("as", libc::RLIMIT_AS, "Max address space", 1024),
    ("locks", libc::RLIMIT_LOCKS, "Max file locks", 1),
    (
        "sigpending",
        libc::RLIMIT_SIGPENDING,
        "Max pending signals",
        1,
    ),
    ("msgqueue", libc::RLIMIT_MSGQUEUE, "Max msgqueue size", 1),
    ("nice", libc::RLIMIT_NICE, "Max nice priority", 1),
    ("rtprio", libc::RLIMIT_RTPRIO, "Max realtime priority", 1),
];

/// How specific an entry's domain is; a more specific one is never
/// overridden by a less specific one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Default,
    Range,
    Group,
    User,
}

impl LoginLimits {
    /// pam_limits' files at `conf` (its `limits.d` beside it).
    pub fn new(conf: impl Into<PathBuf>) -> LoginLimits {
        LoginLimits { conf: conf.into() }
    }

    /// The limits a job of `who` starts with: a login's, from the first
    /// process's limits and the files' entries for `who`. A file that
    /// cannot be read counts as empty (a machine without pam_limits); a
    /// line that cannot be read is skipped, as pam_limits skips it.
    pub fn for_user(&self, who: &Who) -> Vec<Rlimit> {
        let base = std::fs::read_to_string("/proc/1/limits")
            .or_else(|_| std::fs::read_to_string("/proc/self/limits"))
            .unwrap_or_default();
        let mut limits = proc_limits(&base);
        let mut texts = vec![std::fs::read_to_string(&self.conf).unwrap_or_default()];
        if let Some(dir) = self.conf.parent().map(|d| d.join("limits.d")) {
            texts.extend(
                conf_d(&dir)
                    .iter()
                    .filter_map(|p| std::fs::read_to_string(p).ok()),
            );
        }
        let mut rank = vec![[None::<Rank>; 2]; limits.len()];
        for text in &texts {
            apply(text, who, &mut limits, &mut rank);
        }
        for l in &mut limits {
            l.soft = l.soft.min(l.hard);
        }
        limits
    }
}

/// `limits.d`'s `*.conf` files, in name order.
fn conf_d(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conf") && p.is_file())
        .collect();
    files.sort();
    files
}

/// The limits of a `/proc/PID/limits` text, one per known resource (a
/// resource it does not name stays unlimited).
fn proc_limits(text: &str) -> Vec<Rlimit> {
    ITEMS
        .iter()
        .map(|&(_, resource, name, _)| {
            let values = text
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|rest| rest.split_whitespace().take(2).map(parse_proc).collect())
                .unwrap_or_else(|| vec![libc::RLIM_INFINITY; 2]);
            Rlimit {
                resource,
                soft: values.first().copied().unwrap_or(libc::RLIM_INFINITY),
                hard: values.get(1).copied().unwrap_or(libc::RLIM_INFINITY),
            }
        })
        .collect()
}

fn parse_proc(v: &str) -> u64 {
    v.parse().unwrap_or(libc::RLIM_INFINITY)
}

/// Applies one file's entries for `who`.
/// `rank` holds, per resource, how specific the entry was that set its
/// soft and its hard limit: pam_limits ranks them apart.
fn apply(text: &str, who: &Who, limits: &mut [Rlimit], rank: &mut [[Option<Rank>; 2]]) {
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let f: Vec<&str> = line.split_whitespace().collect();
        let [domain, kind, item, value] = f[..] else {
            continue;
        };
        let Some(r) = matches(domain, who) else {
            continue;
        };
        let Some(i) = ITEMS.iter().position(|(n, ..)| *n == item) else {
            continue;
        };
        let Some(v) = parse_value(item, value, ITEMS[i].3) else {
            continue;
        };
        let (soft, hard) = match kind {
            "soft" => (true, false),
            "hard" => (false, true),
            "-" => (true, true),
            _ => continue,
        };
        for (k, set) in [(0, soft), (1, hard)] {
            if !set || rank[i][k].is_some_and(|had| had > r) {
                continue;
            }
            rank[i][k] = Some(r);
            if k == 0 {
                limits[i].soft = v;
            } else {
                limits[i].hard = v;
            }
        }
    }
}

/// Whether an entry's domain names `who`, and how specifically.
fn matches(domain: &str, who: &Who) -> Option<Rank> {
    let range = |spec: &str, id: u32| -> Option<bool> {
        let (lo, hi) = spec.split_once(':')?;
        let lo: u32 = if lo.is_empty() { 0 } else { lo.parse().ok()? };
        let hi: u32 = if hi.is_empty() {
            u32::MAX
        } else {
            hi.parse().ok()?
        };
        Some((lo..=hi).contains(&id))
    };
    if domain == "*" {
        return (who.uid != 0).then_some(Rank::Default);
    }
    if let Some(g) = domain.strip_prefix('@') {
        if g.contains(':') {
            return who
                .gids
                .iter()
                .any(|&gid| range(g, gid) == Some(true))
                .then_some(Rank::Range);
        }
        let gid = crate::users::group_gid(g)?;
        return who.gids.contains(&gid).then_some(Rank::Group);
    }
    if domain.contains(':') {
        return (range(domain, who.uid) == Some(true)).then_some(Rank::Range);
    }
    (domain == who.name).then_some(Rank::User)
}

/// A value in the file's unit: `unlimited`, `infinity` and `-1` are no
/// limit; `nice` is a priority (-20..19) turned into the kernel's 1..40.
fn parse_value(item: &str, value: &str, unit: u64) -> Option<u64> {
    if matches!(value, "unlimited" | "infinity" | "-1") {
        return Some(libc::RLIM_INFINITY);
    }
    if item == "nice" {
        let n: i64 = value.parse().ok()?;
        return u64::try_from(20 - n.clamp(-20, 19)).ok();
    }
    let n: u64 = value.parse().ok()?;
    Some(n.saturating_mul(unit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(limits: &[Rlimit], resource: libc::__rlimit_resource_t) -> (u64, u64) {
        let l = limits.iter().find(|l| l.resource == resource).unwrap();
        (l.soft, l.hard)
    }

    /// A `/proc/PID/limits` text read, units as the kernel's.
    #[test]
    fn proc_limits_are_read() {
        let text = "Limit                     Soft Limit           Hard Limit           Units\n\
                    Max cpu time              unlimited            unlimited            seconds\n\
                    Max stack size            8388608              unlimited            bytes\n\
                    Max open files            1024                 524288               files\n";
        let l = proc_limits(text);
        assert_eq!(at(&l, libc::RLIMIT_NOFILE), (1024, 524_288));
        assert_eq!(at(&l, libc::RLIMIT_STACK), (8_388_608, libc::RLIM_INFINITY));
        assert_eq!(
            at(&l, libc::RLIMIT_CPU),
            (libc::RLIM_INFINITY, libc::RLIM_INFINITY)
        );
    }

    /// pam_limits' order: the user's entry beats a group's and `*`'s
    /// wherever it is; among equals the later wins; `*` is never root's;
    /// units are the file's (KiB, minutes); bad lines are skipped.
    #[test]
    fn entries_apply_as_pam_limits_applies_them() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("limits.conf");
        std::fs::write(
            &conf,
            "# comment\n\
             alice soft nofile 300\n\
             *     -    nofile 9000\n\
             *     hard core   0\n\
             @root hard nproc  77\n\
             1000:1999 soft stack 16\n\
             alice soft cpu 2 # minutes\n\
             garbage line\n\
             alice soft nofile many\n",
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("limits.d")).unwrap();
        std::fs::write(
            dir.path().join("limits.d/90-late.conf"),
            "alice soft nofile 400\n* soft memlock unlimited\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("limits.d/ignored.txt"),
            "alice - nofile 1\n",
        )
        .unwrap();
        let l = LoginLimits::new(&conf);
        let alice = l.for_user(&Who {
            name: "alice",
            uid: 1500,
            gids: &[1500, 0],
        });
        // The user's own, the later file's; the hard limit from `*`.
        assert_eq!(at(&alice, libc::RLIMIT_NOFILE), (400, 9000));
        assert_eq!(at(&alice, libc::RLIMIT_CORE).1, 0);
        assert_eq!(at(&alice, libc::RLIMIT_CORE).0, 0, "soft clamped to hard");
        assert_eq!(at(&alice, libc::RLIMIT_NPROC).1, 77, "root's group");
        assert_eq!(at(&alice, libc::RLIMIT_STACK).0, 16 * 1024);
        assert_eq!(at(&alice, libc::RLIMIT_CPU).0, 120);
        let memlock = at(&alice, libc::RLIMIT_MEMLOCK);
        assert_eq!(memlock.0, memlock.1, "unlimited soft, clamped to hard");
        let root = l.for_user(&Who {
            name: "root",
            uid: 0,
            gids: &[0],
        });
        let proc1 = proc_limits(&std::fs::read_to_string("/proc/1/limits").unwrap());
        assert_eq!(
            at(&root, libc::RLIMIT_NOFILE),
            at(&proc1, libc::RLIMIT_NOFILE),
            "`*` is never root's"
        );
    }
}
