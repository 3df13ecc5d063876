//! The tools under test and the exact command line each step runs.
//!
//! Every tool runs with its defaults except where a flag is needed to make
//! it non-interactive or to keep its state inside the benchmark's work dir.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::runner::Cmd;

/// Snapshot / dataset name used for labsync, borg archives and casync indexes.
const DS_NAME: &str = "ds";
/// Dummy password: restic always encrypts, and `--insecure-no-password` only
/// exists from restic 0.17, so a fixed password works on every version.
const RESTIC_PASSWORD: &str = "labsync-bench";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tool {
    Labsync,
    Rsync,
    Rclone,
    Restic,
    Borg,
    Casync,
}

impl Tool {
    pub const ALL: [Tool; 6] = [
        Tool::Labsync,
        Tool::Rsync,
        Tool::Rclone,
        Tool::Restic,
        Tool::Borg,
        Tool::Casync,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Tool::Labsync => "labsync",
            Tool::Rsync => "rsync",
            Tool::Rclone => "rclone",
            Tool::Restic => "restic",
            Tool::Borg => "borg",
            Tool::Casync => "casync",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Executable to run; labsync's comes from `--labsync`.
    pub fn program(self, labsync: &Path) -> PathBuf {
        match self {
            Tool::Labsync => labsync.to_path_buf(),
            other => PathBuf::from(other.name()),
        }
    }

    /// Debian package providing the tool (what `sync.sh` installs).
    pub fn debian_package(self) -> Option<&'static str> {
        match self {
            Tool::Labsync => None,
            Tool::Borg => Some("borgbackup"),
            other => Some(other.name()),
        }
    }

    /// Arguments that print the version (restic has a subcommand instead).
    pub fn version_args(self) -> &'static [&'static str] {
        match self {
            Tool::Restic => &["version"],
            _ => &["--version"],
        }
    }

    /// What the tool's own documentation says about fsync on the write path.
    /// The report puts the strace probe's observed count next to it.
    pub fn fsync_doc(self) -> &'static str {
        match self {
            Tool::Labsync => "yes by design (labsync spec): packs, index and snapshot fsynced before the ref is updated",
            Tool::Rsync => "no by default: rsync(1) offers `--fsync` (\"fsync every written file\") as an opt-in",
            Tool::Rclone => "no: rclone(1) documents no fsync/sync option for the local backend",
            Tool::Restic => "yes: the local backend syncs each file it writes to the repository",
            Tool::Borg => "yes: segment files, index and hints are fsynced on commit (borg/platform/base.py SyncFile)",
            Tool::Casync => "no: casync(1) documents no sync option; chunks are written and renamed",
        }
    }

    /// Defaults that matter when reading the numbers.
    pub fn defaults_note(self) -> &'static str {
        match self {
            Tool::Labsync => "FastCDC v2020 256 KiB/1 MiB/4 MiB, BLAKE3 ids, packs, LZ4 where a chunk compresses (default `--compression lz4`); local files cache in --cache-dir",
            Tool::Rsync => "`-a`, quick check by size+mtime, whole-file copies locally (delta algorithm is off for local paths)",
            Tool::Rclone => "size+mtime check, 4 transfers/8 checkers, MD5 verified after each copy; no history",
            Tool::Restic => "repo format v2, compression `auto` (zstd), AES-256 encryption always on, ~1 MiB Rabin chunks; cache in --cache-dir",
            Tool::Borg => "`-e none`, compression lz4 (default), ~2 MiB buzhash chunks; files cache in BORG_BASE_DIR",
            Tool::Casync => "~64 KiB buzhash chunks, zstd-compressed chunk files; encoder cache (`--cache`) off by default, so every make re-chunks",
        }
    }
}

/// A tool bound to its binary and to its private directories for one data
/// set. Nothing here is shared between tools, so one tool's caches can never
/// help another.
#[derive(Debug, Clone)]
pub struct ToolRun {
    pub tool: Tool,
    pub program: PathBuf,
    /// Parent of everything this tool owns for the data set.
    pub root: PathBuf,
    /// The store or target, when not under `root` (`--repo-dir`).
    pub repo_at: Option<PathBuf>,
}

impl ToolRun {
    pub fn new(tool: Tool, program: PathBuf, root: PathBuf) -> Self {
        ToolRun {
            tool,
            program,
            root,
            repo_at: None,
        }
    }

    /// The store or target directory whose size is reported as "stored".
    pub fn repo(&self) -> PathBuf {
        self.repo_at
            .clone()
            .unwrap_or_else(|| self.root.join("repo"))
    }

    /// Push-side cache (labsync, restic); kept across pushes, never counted
    /// as stored bytes, like a user's ~/.cache.
    pub fn cache(&self) -> PathBuf {
        self.root.join("cache")
    }

    /// Fresh cache for the pull so that it starts cold.
    pub fn pull_cache(&self) -> PathBuf {
        self.root.join("pull-cache")
    }

    /// Directory a pull writes into.
    pub fn pull_dest(&self) -> PathBuf {
        self.root.join("pulled")
    }

    /// BORG_BASE_DIR: keeps borg's cache, config and security dirs out of $HOME.
    fn borg_home(&self) -> PathBuf {
        self.root.join("borg-home")
    }

    fn casync_store(&self) -> OsString {
        let mut s = OsString::from("--store=");
        s.push(self.repo().join("store.castr"));
        s
    }

    fn casync_index(&self, generation: u32) -> PathBuf {
        self.repo().join(format!("{DS_NAME}-{generation}.caidx"))
    }

    fn cmd(&self) -> Cmd {
        let c = Cmd::new(&self.program);
        match self.tool {
            Tool::Restic => c.env("RESTIC_PASSWORD", RESTIC_PASSWORD),
            Tool::Borg => c
                .env("BORG_BASE_DIR", self.borg_home())
                .env("BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK", "yes")
                .env("BORG_RELOCATED_REPO_ACCESS_IS_OK", "yes"),
            _ => c,
        }
    }

    /// Creates the directories the commands expect. labsync and casync want
    /// an existing repo dir; restic and borg refuse to init a non-empty one
    /// and rsync/rclone create their target, so those are left to the tool.
    pub fn prepare_dirs(&self) -> io::Result<()> {
        fs::create_dir_all(&self.root)?;
        if matches!(self.tool, Tool::Labsync | Tool::Casync) {
            fs::create_dir_all(self.repo())?;
        }
        Ok(())
    }

    /// Untimed one-off setup (repository creation), run before the cold push.
    pub fn setup(&self) -> Vec<Cmd> {
        match self.tool {
            Tool::Restic => vec![self
                .cmd()
                .arg("-r")
                .arg(self.repo())
                .arg("--cache-dir")
                .arg(self.cache())
                .arg("init")],
            Tool::Borg => vec![self
                .cmd()
                .arg("init")
                .arg("-e")
                .arg("none")
                .arg(self.repo())],
            // labsync creates its store layout on first push.
            _ => Vec::new(),
        }
    }

    /// `labsync --store file://REPO --cache-dir CACHE --quiet`, ready for a subcommand.
    fn labsync(&self, repo: &Path, cache: PathBuf) -> Cmd {
        self.cmd()
            .arg("--store")
            .arg(file_url(repo))
            .arg("--cache-dir")
            .arg(cache)
            .arg("--quiet")
    }

    /// Push `src` as snapshot number `generation` (1, 2, 3, ...).
    ///
    /// restic and borg run inside `src` and back up `.`, so that snapshots
    /// hold relative paths and a restore lands directly in the target dir.
    pub fn push(&self, src: &Path, generation: u32) -> Cmd {
        let repo = self.repo();
        match self.tool {
            Tool::Labsync => self
                .labsync(&repo, self.cache())
                .arg("push")
                .arg(src)
                .arg("--name")
                .arg(DS_NAME),
            Tool::Rsync => self.cmd().arg("-a").arg(slash(src)).arg(slash(&repo)),
            Tool::Rclone => self
                .cmd()
                .arg("--config")
                .arg("/dev/null")
                .arg("copy")
                .arg(src)
                .arg(&repo),
            Tool::Restic => self
                .cmd()
                .cwd(src)
                .arg("-r")
                .arg(&repo)
                .arg("--cache-dir")
                .arg(self.cache())
                .arg("backup")
                .arg("."),
            Tool::Borg => self
                .cmd()
                .cwd(src)
                .arg("create")
                .arg(borg_archive(&repo, generation))
                .arg("."),
            Tool::Casync => self
                .cmd()
                .arg("make")
                .arg(self.casync_store())
                .arg(self.casync_index(generation))
                .arg(src),
        }
    }

    /// Restore snapshot `generation` into the (existing, empty) `dest`.
    pub fn pull(&self, dest: &Path, generation: u32) -> Cmd {
        let repo = self.repo();
        match self.tool {
            Tool::Labsync => self
                .labsync(&repo, self.pull_cache())
                .arg("pull")
                .arg(DS_NAME)
                .arg(dest),
            Tool::Rsync => self.cmd().arg("-a").arg(slash(&repo)).arg(slash(dest)),
            Tool::Rclone => self
                .cmd()
                .arg("--config")
                .arg("/dev/null")
                .arg("copy")
                .arg(&repo)
                .arg(dest),
            Tool::Restic => self
                .cmd()
                .arg("-r")
                .arg(&repo)
                .arg("--cache-dir")
                .arg(self.pull_cache())
                .arg("restore")
                .arg("latest")
                .arg("--target")
                .arg(dest),
            // borg extract always writes into the current directory.
            Tool::Borg => self
                .cmd()
                .cwd(dest)
                .arg("extract")
                .arg(borg_archive(&repo, generation)),
            Tool::Casync => self
                .cmd()
                .arg("extract")
                .arg(self.casync_store())
                .arg(self.casync_index(generation))
                .arg(dest),
        }
    }
}

fn file_url(path: &Path) -> OsString {
    let mut s = OsString::from("file://");
    s.push(path);
    s
}

/// `dir/`: rsync copies a directory's *contents* only with the trailing slash.
fn slash(path: &Path) -> OsString {
    let mut s = path.as_os_str().to_owned();
    s.push("/");
    s
}

fn borg_archive(repo: &Path, generation: u32) -> OsString {
    let mut s = repo.as_os_str().to_owned();
    s.push(format!("::{DS_NAME}-{generation}"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_match_the_documented_ones() {
        let run = |t| ToolRun::new(t, t.program(Path::new("/b/labsync")), PathBuf::from("/w/t"));
        let src = Path::new("/w/src");
        let dest = Path::new("/w/t/pulled");
        let line = |t, f: &dyn Fn(&ToolRun) -> Cmd| f(&run(t)).display();
        assert_eq!(
            line(Tool::Labsync, &|r| r.push(src, 1)),
            "/b/labsync --store file:///w/t/repo --cache-dir /w/t/cache --quiet push /w/src --name ds"
        );
        assert_eq!(
            line(Tool::Labsync, &|r| r.pull(dest, 3)),
            "/b/labsync --store file:///w/t/repo --cache-dir /w/t/pull-cache --quiet pull ds /w/t/pulled"
        );
        assert_eq!(
            line(Tool::Rsync, &|r| r.push(src, 1)),
            "rsync -a /w/src/ /w/t/repo/"
        );
        assert_eq!(
            line(Tool::Rclone, &|r| r.pull(dest, 1)),
            "rclone --config /dev/null copy /w/t/repo /w/t/pulled"
        );
        assert_eq!(
            line(Tool::Restic, &|r| r.push(src, 2)),
            "(cd /w/src && RESTIC_PASSWORD=labsync-bench restic -r /w/t/repo --cache-dir /w/t/cache backup .)"
        );
        assert!(line(Tool::Borg, &|r| r.pull(dest, 3)).ends_with("borg extract /w/t/repo::ds-3)"));
        assert_eq!(
            line(Tool::Casync, &|r| r.push(src, 2)),
            "casync make --store=/w/t/repo/store.castr /w/t/repo/ds-2.caidx /w/src"
        );
    }
}
