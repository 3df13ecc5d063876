//! One module per subcommand of `labsync` and `labrun`, as uv keeps its
//! commands: each is a function from resolved settings (and the command's own
//! arguments, already parsed) to its result, rendered as text or as one
//! `--json` document. The binaries under `src/bin/` only parse arguments,
//! resolve settings and call one of these. A new command (the cluster's
//! `warm`, `explain`) gets a file here.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use labsync_store::{NodeCache, Progress, Remote, Repo};

use crate::progress::Bar;
use crate::Settings;

/// `212.4 GiB`: GPU memory, caches and disks as `labrun status` and
/// `labd doctor` show them.
fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

// labsync
pub mod cache;
pub mod claims;
pub mod diff;
pub mod forget;
pub mod gc;
pub mod info;
pub mod log;
pub mod ls;
pub mod pull;
pub mod push;
pub mod rebuild_index;
pub mod verify;
pub mod warm;

// labd
pub mod doctor;
pub mod init;

// labrun
pub mod admin;
pub mod explain;
mod job_words;
pub mod kill;
pub mod logs;
pub mod ps;
pub mod rerun;
pub mod run;
pub mod status;

// labd
pub mod labd;

/// Where a command's result goes: one JSON document on stdout, human text,
/// or (quiet) nothing but errors. Owns the progress bar, which it clears
/// before printing.
pub struct Printer {
    json: bool,
    quiet: bool,
    bar: Arc<Bar>,
}

impl Printer {
    /// `json` wins over `quiet`; a bar is drawn only for humans on a terminal.
    pub fn new(json: bool, quiet: bool) -> Printer {
        Printer {
            json,
            quiet,
            bar: Arc::new(Bar::new(quiet || json)),
        }
    }

    /// True when the result is printed as JSON.
    pub fn json(&self) -> bool {
        self.json
    }

    /// True when nothing but errors is printed.
    pub fn quiet(&self) -> bool {
        self.quiet
    }

    /// The progress bar, for library calls.
    pub fn progress(&self) -> Arc<dyn Progress> {
        self.bar.clone()
    }

    /// A line of progress for humans, on stderr (nothing with JSON or quiet).
    pub fn info(&self, line: &str) {
        if !self.json && !self.quiet {
            eprintln!("{line}");
        }
    }

    /// Prints the human text (unless empty or quiet), or the JSON document.
    pub fn out(&self, human: impl FnOnce() -> String, doc: serde_json::Value) {
        self.bar.finish();
        if self.json {
            println!("{}", serde_json::to_string_pretty(&doc).expect("json"));
        } else if !self.quiet {
            let text = human();
            if !text.is_empty() {
                // Records and names from the store are anyone's to write.
                println!("{}", crate::shown_but(&text, &['\n', '\t']));
            }
        }
    }
}

/// What every `labsync` command starts from: the resolved settings, and how
/// to print.
pub struct StoreContext {
    /// Store, cache and the rest, resolved from flags, environment and config.
    pub settings: Settings,
    /// Where the result goes.
    pub printer: Printer,
}

impl StoreContext {
    /// Opens the store; as root, only a local one that no one else can
    /// change ([`labsync_agent::check_root_store`]). Versions this user
    /// used are remembered, and one rewritten since is refused
    /// ([`labsync_store::SeenVersions`]).
    pub async fn repo(&self) -> Result<Repo> {
        let remote = Remote::open(&self.settings.store, &self.settings.store_options)?;
        refuse_shared_local_store_as_root(&remote).await?;
        let repo = Repo::open(remote, None)
            .await
            .with_context(|| format!("cannot open store {}", self.settings.store))?;
        Ok(with_seen(repo, &self.settings.cache_dir))
    }

    /// Opens this node's cache.
    pub fn cache(&self) -> Result<NodeCache> {
        Ok(NodeCache::open(
            &self.settings.cache_dir,
            self.settings.cache_max,
        )?)
    }
}

/// `repo` remembering the versions this user used, in the cache at `cache_dir`.
pub fn with_seen(repo: Repo, cache_dir: &std::path::Path) -> Repo {
    let seen = labsync_store::SeenVersions::in_cache(cache_dir, &repo.config().id);
    repo.with_seen(Some(std::sync::Arc::new(seen)))
}

/// As root, a store in a local folder others can write is refused: a
/// lab member could plant a symlink in it and have root's push (or prune,
/// or any write) go wherever it points.
pub async fn refuse_shared_local_store_as_root(remote: &labsync_store::Remote) -> Result<()> {
    let Some(root) = remote.local_path("").filter(|_| labsync_agent::euid() == 0) else {
        return Ok(());
    };
    labsync_agent::off_runtime(move || labsync_agent::check_root_store(&root))
        .await
        .map_err(anyhow::Error::msg)
}

/// Exit status 0 or 1.
fn exit(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Reader or writer threads: `n`, else one per CPU.
fn threads(n: Option<usize>) -> usize {
    n.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
        .max(1)
}

/// labd's refusals as errors; the client's messages already say what to do.
/// A labd client's error, for a command's result.
pub(crate) fn explain_client(e: labsync_agent::ClientError) -> anyhow::Error {
    anyhow::Error::new(e)
}
