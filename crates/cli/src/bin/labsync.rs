//! `labsync`: push, pull and inspect datasets and code in a content-addressed store.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use labsync_cli::progress::Bar;
use labsync_cli::{human_bytes, human_time, parse_size, Overrides, Settings};
use labsync_store::{self as store, NodeCache, Progress, PushOptions, RefSpec, Remote, Repo};
use serde_json::json;

const ABOUT: &str = "Content-addressed sync of datasets and code between a lab's machines.";
const LONG_ABOUT: &str = "\
Content-addressed sync of datasets and code between a lab's machines.

Files are cut into chunks (FastCDC), named by their BLAKE3 hash and packed
into a store: a local folder, or any S3/GCS/Azure bucket. A push uploads only
chunks the store does not have; a pull writes a byte-identical tree (modes,
symlinks, mtimes), verifying every chunk before it touches the disk.

Examples:
  labsync push ./div2k --name div2k      store a folder as div2k@v1, v2, ...
  labsync pull div2k /scratch/div2k      materialise the latest version
  labsync pull div2k@v1 ./old            ... or any version
  labsync ls                             what is stored
  labsync log div2k                      versions and what changed
  labsync diff div2k@v1 div2k@v2         added / removed / modified paths

The store is --store, else LABSYNC_STORE, else `store` in the config file,
else a folder under your data directory (~/.local/share/labsync/store).
S3: --store s3://bucket/prefix with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_REGION and --s3-endpoint (or AWS_ENDPOINT) for MinIO, Ceph and the like.

Exit codes: 0 success, 1 error, 2 usage error.";

#[derive(Parser, Debug)]
#[command(name = "labsync", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    /// Store URL: file:///path, s3://bucket/prefix, gs://…, az://… (or a plain path)
    #[arg(long, global = true, env = "LABSYNC_STORE", value_name = "URL")]
    store: Option<String>,
    /// Node cache folder [default: ~/.cache/labsync]
    #[arg(long, global = true, env = "LABSYNC_CACHE", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Node cache size cap, e.g. 200G [default: 50G]
    #[arg(long, global = true, env = "LABSYNC_CACHE_MAX", value_name = "SIZE")]
    cache_max: Option<String>,
    /// Config file [default: ~/.config/labsync/config.toml]
    #[arg(long, global = true, env = "LABSYNC_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// S3-compatible endpoint, e.g. http://10.0.0.5:9000
    #[arg(long, global = true, env = "AWS_ENDPOINT", value_name = "URL")]
    s3_endpoint: Option<String>,
    /// S3 region
    #[arg(long, global = true, env = "AWS_REGION", value_name = "REGION")]
    s3_region: Option<String>,
    /// Print nothing but errors
    #[arg(short, long, global = true)]
    quiet: bool,
    /// Print the result as one JSON document on stdout
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Store a folder (or file) as a new version of a name
    #[command(
        long_about = "Store a folder (or file) as a new version of a name.\n\n\
        Only chunks the store lacks are uploaded; files unchanged since the last push from\n\
        this folder (same size, mtime, ctime, inode) are not even read. Pushing an unchanged\n\
        tree creates no new version and prints the existing one."
    )]
    Push {
        /// Folder or file to push
        src: PathBuf,
        /// Name to store it under [default: the folder's name]
        #[arg(long, short)]
        name: Option<String>,
        /// Reader threads [default: number of CPUs]
        #[arg(long)]
        threads: Option<usize>,
        /// How compressible chunks are stored: lz4 (fast) or zstd (about 30%
        /// smaller on text, half the speed); incompressible data (images,
        /// archives) is stored as it is either way [default: lz4]
        #[arg(long, env = "LABSYNC_COMPRESSION", value_name = "CODEC")]
        compression: Option<String>,
    },
    /// Write a stored version into a folder
    #[command(
        long_about = "Write a stored version into a folder (created if missing).\n\n\
        Every chunk is checked against its BLAKE3 id before it is written; files are written\n\
        under a temporary name and renamed into place. Re-running an interrupted pull skips\n\
        the files it finished and the packs already in the node cache."
    )]
    Pull {
        /// NAME, NAME@vN or NAME@latest
        spec: String,
        /// Destination folder [default: ./NAME]
        dest: Option<PathBuf>,
        /// Writer threads [default: number of CPUs, at least 4: large
        /// chunks are read straight from disk, and more reads in flight keep
        /// it busy]
        #[arg(long)]
        threads: Option<usize>,
    },
    /// List stored names: latest version, logical size, stored size, when
    Ls,
    /// Show the versions of a name and what changed in each
    Log {
        /// The name
        name: String,
    },
    /// Show paths added (A), removed (D) and modified (M) between two versions
    Diff {
        /// Old version, e.g. div2k@v1
        a: String,
        /// New version, e.g. div2k@v2
        b: String,
    },
    /// Check every reachable chunk against its BLAKE3 id
    #[command(long_about = "Check every reachable chunk against its BLAKE3 id.\n\n\
        Without --remote: reads every version's tree, checks that each chunk is indexed, and\n\
        re-hashes the copies in this node's cache (corrupt ones are dropped and fetched again\n\
        on next use). With --remote: downloads and re-hashes every pack in the store.\n\
        Exits 1 when anything is wrong.")]
    Verify {
        /// Only this name (or NAME@vN)
        name: Option<String>,
        /// Read the packs from the store itself, not the node cache
        #[arg(long)]
        remote: bool,
    },
    /// Remove data no version references (safe next to running pushes)
    #[command(long_about = "Remove data no version references.\n\n\
        Mark and sweep with a grace period: unreferenced packs younger than the grace period\n\
        are kept; older ones are condemned, and deleted by a later gc once the condemnation\n\
        is older than the grace period, if still unreferenced. A push running meanwhile never\n\
        loses data. --grace 0 deletes at once: only when no push can be running.")]
    Gc {
        /// Report what would be removed, change nothing
        #[arg(long)]
        dry_run: bool,
        /// Grace period, e.g. 6h, 30m, 0 [default: the store's, 6h]
        #[arg(long, value_name = "DURATION")]
        grace: Option<String>,
    },
    /// Forget versions: they are no longer listed, and gc may free their data
    #[command(
        long_about = "Forget versions: they are no longer listed, and a later gc may free\n\
        the data only they used. Version numbers are never reused.\n\n\
        Example: labsync forget div2k@v1 div2k@v2 && labsync gc"
    )]
    Forget {
        /// Versions to forget, e.g. div2k@v1
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// Inspect and manage this node's cache
    Cache {
        #[command(subcommand)]
        cmd: CacheCmd,
    },
    /// Rebuild the index from the pack footers (after a lost or corrupt index)
    RebuildIndex,
}

#[derive(Subcommand, Debug)]
enum CacheCmd {
    /// Size, cap and the cached versions
    Status,
    /// Fetch a version into the cache and never evict it
    Pin {
        /// NAME or NAME@vN
        name: String,
    },
    /// Allow a pinned version to be evicted again
    Unpin {
        /// NAME or NAME@vN
        name: String,
    },
    /// Evict least recently used unpinned versions
    Evict {
        /// Evict until the cache holds at most this much, e.g. 10G [default: 0]
        #[arg(long, value_name = "SIZE")]
        to: Option<String>,
    },
}

struct Ctx {
    settings: Settings,
    json: bool,
    quiet: bool,
    bar: Arc<Bar>,
}

impl Ctx {
    async fn repo(&self) -> Result<Repo> {
        let remote = Remote::open(&self.settings.store, &self.settings.store_options)?;
        Repo::open(remote, None)
            .await
            .with_context(|| format!("cannot open store {}", self.settings.store))
    }

    fn cache(&self) -> Result<NodeCache> {
        Ok(NodeCache::open(
            &self.settings.cache_dir,
            self.settings.cache_max,
        )?)
    }

    fn progress(&self) -> Arc<dyn Progress> {
        self.bar.clone()
    }

    /// Prints the human text, or the JSON document.
    fn out(&self, human: impl FnOnce() -> String, doc: serde_json::Value) {
        self.bar.finish();
        if self.json {
            println!("{}", serde_json::to_string_pretty(&doc).expect("json"));
        } else if !self.quiet {
            let text = human();
            if !text.is_empty() {
                println!("{text}");
            }
        }
    }
}

fn threads(n: Option<usize>) -> usize {
    n.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
        .max(1)
}

fn parse_duration(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .with_context(|| format!("invalid duration {s:?}: write e.g. 6h, 30m, 90s or 0"))?;
    Ok(n * match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => bail!("invalid duration {s:?}: unit must be s, m, h or d"),
    })
}

fn whoami() -> (String, String) {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    (user, host)
}

async fn run(cli: Cli) -> Result<bool> {
    let env: Vec<(String, String)> = std::env::vars().collect();
    let o = Overrides {
        store: cli.store,
        cache_dir: cli.cache_dir,
        cache_max: cli.cache_max,
        config: cli.config,
        s3_endpoint: cli.s3_endpoint,
        s3_region: cli.s3_region,
        compression: match &cli.cmd {
            Cmd::Push { compression, .. } => compression.clone(),
            _ => None,
        },
    };
    let settings = Settings::resolve(&o, &env)?;
    let ctx = Ctx {
        settings,
        json: cli.json,
        quiet: cli.quiet,
        bar: Arc::new(Bar::new(cli.quiet || cli.json)),
    };
    match cli.cmd {
        Cmd::Push {
            src,
            name,
            threads: t,
            compression: _,
        } => {
            let name = match name {
                Some(n) => n,
                None => src
                    .canonicalize()
                    .with_context(|| format!("cannot open {}", src.display()))?
                    .file_name()
                    .and_then(|n| n.to_str())
                    .map(str::to_string)
                    .context("cannot derive a name from the path; pass --name")?,
            };
            let repo = ctx.repo().await?;
            let cache = ctx.cache()?;
            let (user, host) = whoami();
            let opts = PushOptions {
                name,
                files_cache: Some(cache.files_cache_dir()),
                threads: threads(t),
                user,
                host,
                read_as: None,
                settle: None,
                compression: ctx.settings.compression,
            };
            let r = store::push(&repo, &src, &opts, ctx.progress()).await?;
            ctx.out(
                || {
                    format!(
                        "{}  {}  {}, {} new, {:.1} s{}",
                        r.record.label(),
                        r.record.snapshot.short(),
                        human_bytes(r.record.bytes),
                        human_bytes(if r.created { r.record.new_bytes } else { 0 }),
                        r.seconds,
                        if r.created {
                            ""
                        } else {
                            "  (unchanged: no new version)"
                        }
                    )
                },
                json!({"command": "push", "result": r}),
            );
        }
        Cmd::Pull {
            spec,
            dest,
            threads: t,
        } => {
            let spec: RefSpec = spec.parse()?;
            let dest = dest.unwrap_or_else(|| {
                PathBuf::from(spec.name.rsplit('/').next().unwrap_or(&spec.name))
            });
            let repo = ctx.repo().await?;
            let cache = ctx.cache()?;
            let r = store::pull(
                &repo,
                &cache,
                &spec,
                &dest,
                threads(t).max(if t.is_some() { 1 } else { 4 }),
                ctx.progress(),
            )
            .await?;
            ctx.out(
                || {
                    format!(
                        "{} -> {}: {} files written ({}), {} already there, {} fetched, {:.1} s",
                        r.record.label(),
                        dest.display(),
                        r.files_written,
                        human_bytes(r.bytes_written),
                        r.files_skipped,
                        human_bytes(r.bytes_fetched),
                        r.seconds
                    )
                },
                json!({"command": "pull", "dest": dest, "result": r}),
            );
        }
        Cmd::Ls => {
            let repo = ctx.repo().await?;
            let mut rows = Vec::new();
            for n in repo.names().await? {
                if let Some(l) = repo.latest(&n).await? {
                    rows.push(l);
                }
            }
            ctx.out(
                || {
                    if rows.is_empty() {
                        return format!(
                            "nothing stored yet in {} (try `labsync push DIR`)",
                            repo.remote().url()
                        );
                    }
                    let mut s = format!(
                        "{:<24} {:>7} {:>11} {:>11}  {}\n",
                        "NAME", "LATEST", "SIZE", "STORED", "PUSHED (UTC)"
                    );
                    for r in &rows {
                        s += &format!(
                            "{:<24} {:>7} {:>11} {:>11}  {} by {}@{}\n",
                            r.name,
                            format!("v{}", r.version),
                            human_bytes(r.bytes),
                            human_bytes(r.stored_bytes),
                            human_time(r.time),
                            r.user,
                            r.host
                        );
                    }
                    s.trim_end().to_string()
                },
                json!({"command": "ls", "names": rows}),
            );
        }
        Cmd::Log { name } => {
            let repo = ctx.repo().await?;
            let spec: RefSpec = name.parse()?;
            let versions = repo.versions(&spec.name).await?;
            if versions.is_empty() {
                repo.resolve(&spec).await?;
            }
            ctx.out(
                || {
                    let mut s = String::new();
                    for r in versions.iter().rev() {
                        s += &format!(
                            "v{:<4} {}  {}  {}@{}  {} files, {}, {} new  +{} ~{} -{}\n",
                            r.version,
                            r.snapshot.short(),
                            human_time(r.time),
                            r.user,
                            r.host,
                            r.files,
                            human_bytes(r.bytes),
                            human_bytes(r.new_bytes),
                            r.added,
                            r.modified,
                            r.removed
                        );
                    }
                    s.trim_end().to_string()
                },
                json!({"command": "log", "versions": versions}),
            );
        }
        Cmd::Diff { a, b } => {
            let repo = ctx.repo().await?;
            let (ra, rb) = (
                repo.resolve(&a.parse()?).await?,
                repo.resolve(&b.parse()?).await?,
            );
            let (index, _) = repo.load_index().await?;
            let (_, ea) = repo.load_tree(&index, &ra.snapshot).await?;
            let (_, eb) = repo.load_tree(&index, &rb.snapshot).await?;
            let d = store::diff(&ea, &eb);
            ctx.out(
                || {
                    let mut s = String::new();
                    for p in &d.added {
                        s += &format!("A {p}\n");
                    }
                    for p in &d.removed {
                        s += &format!("D {p}\n");
                    }
                    for p in &d.modified {
                        s += &format!("M {p}\n");
                    }
                    s + &format!(
                        "{} -> {}: {} added, {} removed, {} modified",
                        ra.label(),
                        rb.label(),
                        d.added.len(),
                        d.removed.len(),
                        d.modified.len()
                    )
                },
                json!({"command": "diff", "a": ra.label(), "b": rb.label(), "changes": d}),
            );
        }
        Cmd::Verify { name, remote } => {
            let repo = ctx.repo().await?;
            let cache = ctx.cache()?;
            let spec = name.map(|n| n.parse::<RefSpec>()).transpose()?;
            let r = store::verify(&repo, &cache, spec.as_ref(), remote, ctx.progress()).await?;
            let ok = r.problems.is_empty();
            ctx.out(
                || {
                    let mut s = String::new();
                    for p in &r.problems {
                        s += &format!("PROBLEM {p}\n");
                    }
                    s + &format!(
                        "{}: {} versions, {} chunks referenced; {} packs and {} chunks re-hashed ({}); {} problems",
                        if ok { "ok" } else { "FAILED" },
                        r.versions,
                        r.chunks,
                        r.packs_checked,
                        r.chunks_checked,
                        if remote { "from the store" } else { "node cache" },
                        r.problems.len()
                    )
                },
                json!({"command": "verify", "ok": ok, "report": r}),
            );
            return Ok(ok);
        }
        Cmd::Gc { dry_run, grace } => {
            let repo = ctx.repo().await?;
            let grace = grace.map(|g| parse_duration(&g)).transpose()?;
            let r = store::gc(&repo, dry_run, grace, ctx.bar.as_ref()).await?;
            ctx.out(
                || {
                    format!(
                        "{}{} versions, {} packs ({} referenced, {} young kept); {} condemned now; {} deleted ({}); {} snapshot objects and {} unfinished writes ({}) deleted",
                        if dry_run { "dry run: " } else { "" },
                        r.versions,
                        r.packs,
                        r.referenced_packs,
                        r.young_packs,
                        r.condemned.len(),
                        r.deleted.len(),
                        human_bytes(r.deleted_bytes),
                        r.deleted_snapshots,
                        r.deleted_staging,
                        human_bytes(r.deleted_staging_bytes)
                    )
                },
                json!({"command": "gc", "result": r}),
            );
        }
        Cmd::Forget { specs } => {
            let repo = ctx.repo().await?;
            let specs: Vec<RefSpec> = specs.iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
            let mut done = Vec::new();
            for spec in &specs {
                done.push(repo.forget(spec).await?.label());
            }
            ctx.out(
                || {
                    format!(
                        "forgot {} (run `labsync gc` to free their data)",
                        done.join(", ")
                    )
                },
                json!({"command": "forget", "forgotten": done}),
            );
        }
        Cmd::RebuildIndex => {
            let repo = ctx.repo().await?;
            let (packs, chunks) = repo.rebuild_index().await?;
            ctx.out(
                || format!("index rebuilt from {packs} pack footers: {chunks} chunks"),
                json!({"command": "rebuild-index", "packs": packs, "chunks": chunks}),
            );
        }
        Cmd::Cache { cmd } => {
            let cache = ctx.cache()?;
            match cmd {
                CacheCmd::Status => {
                    let s = cache.status()?;
                    ctx.out(
                        || {
                            let mut t = format!(
                                "{}: {} of {} used\n",
                                s.root.display(),
                                human_bytes(s.used_bytes),
                                human_bytes(s.max_bytes)
                            );
                            for (id, c, bytes) in &s.snapshots {
                                t += &format!(
                                    "  {:<24} {}  {:>10}  last used {}{}\n",
                                    c.label,
                                    id.short(),
                                    human_bytes(*bytes),
                                    human_time(c.last_used),
                                    if c.pinned { "  pinned" } else { "" }
                                );
                            }
                            t.trim_end().to_string()
                        },
                        json!({"command": "cache status", "status": s}),
                    );
                }
                CacheCmd::Pin { name } => {
                    let repo = ctx.repo().await?;
                    let (rec, n, bytes) =
                        store::warm(&repo, &cache, &name.parse()?, ctx.progress()).await?;
                    cache.set_pinned(rec.snapshot, true)?;
                    ctx.out(
                        || format!("pinned {} ({} packs fetched, {})", rec.label(), n, human_bytes(bytes)),
                        json!({"command": "cache pin", "version": rec.label(), "packs_fetched": n, "bytes_fetched": bytes}),
                    );
                }
                CacheCmd::Unpin { name } => {
                    let repo = ctx.repo().await?;
                    let rec = repo.resolve(&name.parse()?).await?;
                    cache.set_pinned(rec.snapshot, false)?;
                    ctx.out(
                        || format!("unpinned {}", rec.label()),
                        json!({"command": "cache unpin", "version": rec.label()}),
                    );
                }
                CacheCmd::Evict { to } => {
                    let target = to.map(|t| parse_size(&t)).transpose()?.unwrap_or(0);
                    let evicted = cache.evict_to(target, None)?;
                    let s = cache.status()?;
                    ctx.out(
                        || format!("evicted {} versions; {} used", evicted.len(), human_bytes(s.used_bytes)),
                        json!({"command": "cache evict", "evicted": evicted, "used_bytes": s.used_bytes}),
                    );
                }
            }
        }
    }
    Ok(true)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let Some(rt) = labsync_cli::start("labsync", "LABSYNC_LOG", "error") else {
        return ExitCode::from(1);
    };
    match rt.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            if json {
                println!("{}", json!({"error": format!("{e:#}")}));
            }
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
