//! `labsync`: push, pull and inspect datasets and code in a content-addressed store.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use labsync_cli::commands::{self, Printer, StoreContext};
use labsync_cli::{Overrides, Settings};
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
        /// Make DEST equal the version: remove files, links and folders it
        /// holds that the version does not, and replace a path whose type
        /// changed (without it extras stay, counted, and a type change is
        /// refused)
        #[arg(long)]
        delete: bool,
    },
    /// List stored names: latest version, logical size, stored size, when
    Ls,
    /// Show the store: URL, format, chunker, compression, and what its server
    /// does with conditional writes (honoured, ignored or refused, probed
    /// when the store was created) with the scheme versions are numbered by
    Info,
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
    /// Check that every version can be restored: names, index, packs, chunks
    #[command(long_about = "Check that every version can be restored.\n\n\
        Always: every ref, snapshot and tree segment is read and checked against its name; every\n\
        index object against its BLAKE3 name; every chunk a version uses must be indexed; and\n\
        every index entry is compared with its pack's own footer (two ranged reads of a few KB\n\
        per pack), the pack present at the size the index says. Then every chunk is re-hashed:\n\
        this node's cached copies (corrupt ones are dropped and fetched again on next use), or\n\
        with --remote the store's own packs, which downloads all of them.\n\n\
        When the packs are sound and the index is not, it says so and names the repair\n\
        (labsync rebuild-index). Exits 1 when anything is wrong. A clean --remote run means\n\
        every version restores byte for byte.")]
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
    /// Admins: list the claims writers hold on new versions, or remove one
    #[command(
        long_about = "List the claims writers hold on keys that must not exist yet
        (a new version, the store's config), or remove them.

        On a server that does not honour conditional writes, a writer claims a key for the
        few seconds of its write (claims/<hash>.<nonce>, saying who wrote it). A claim left
        by a crashed writer is removed by the next writer after 120 s; one renewed for ever
        keeps the name from everyone, and a push fails naming it. Remove it by its claim key,
        or every claim on a key by that key.

        Examples:
  labsync claims
  labsync claims --remove refs/div2k/@/0000000004"
    )]
    Claims {
        /// A claim (claims/...) or a key whose claims all go; repeatable
        #[arg(long, value_name = "KEY")]
        remove: Vec<String>,
    },
    /// Admins: fetch a version into cluster nodes' caches now and pin it there
    #[command(
        long_about = "Fetch a version into the caches of a cluster's nodes now, and pin it\n\
        there, ahead of a deadline week: jobs on it then start without waiting for data, and\n\
        the placer sends them to those nodes. Asks the cluster's coordinator (--labd or\n\
        LABRUN_LABD, with an admin's LABRUN_TOKEN) and follows each node's progress.\n\n\
        Examples:\n  labsync warm div2k --nodes gpu3,gpu4\n  labsync warm div2k@v3 --all\n  \
        labsync warm div2k --unpin --nodes gpu3"
    )]
    Warm {
        /// NAME or NAME@vN
        name: String,
        /// The nodes, comma-separated
        #[arg(long, value_delimiter = ',', value_name = "NODES")]
        nodes: Vec<labsync_agent::proto::NodeName>,
        /// Every node that is up
        #[arg(long, conflicts_with = "nodes")]
        all: bool,
        /// Release the pin (the data may be evicted again)
        #[arg(long)]
        unpin: bool,
        /// The coordinator: http://host:port
        #[arg(long, env = "LABRUN_LABD", value_name = "ADDR")]
        labd: Option<String>,
    },
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

/// Resolves the settings, then runs the one command.
async fn run(cli: Cli) -> Result<ExitCode> {
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
    let ctx = StoreContext {
        settings: Settings::resolve(&o, &env)?,
        printer: Printer::new(cli.json, cli.quiet),
    };
    match cli.cmd {
        Cmd::Push {
            src, name, threads, ..
        } => commands::push::push(&ctx, &src, name, threads).await,
        Cmd::Pull {
            spec,
            dest,
            threads,
            delete,
        } => commands::pull::pull(&ctx, &spec, dest, threads, delete).await,
        Cmd::Ls => commands::ls::ls(&ctx).await,
        Cmd::Info => commands::info::info(&ctx).await,
        Cmd::Log { name } => commands::log::log(&ctx, &name).await,
        Cmd::Diff { a, b } => commands::diff::diff(&ctx, &a, &b).await,
        Cmd::Verify { name, remote } => {
            commands::verify::verify(&ctx, name.as_deref(), remote).await
        }
        Cmd::Gc { dry_run, grace } => commands::gc::gc(&ctx, dry_run, grace.as_deref()).await,
        Cmd::Forget { specs } => commands::forget::forget(&ctx, &specs).await,
        Cmd::RebuildIndex => commands::rebuild_index::rebuild_index(&ctx).await,
        Cmd::Claims { remove } => commands::claims::claims(&ctx, &remove).await,
        Cmd::Warm {
            name,
            nodes,
            all,
            unpin,
            labd,
        } => {
            let a = commands::warm::WarmArgs {
                name,
                nodes,
                all,
                unpin,
                labd,
            };
            commands::warm::warm(&ctx.settings, &ctx.printer, a).await
        }
        Cmd::Cache { cmd } => match cmd {
            CacheCmd::Status => commands::cache::status(&ctx).await,
            CacheCmd::Pin { name } => commands::cache::pin(&ctx, &name).await,
            CacheCmd::Unpin { name } => commands::cache::unpin(&ctx, &name).await,
            CacheCmd::Evict { to } => commands::cache::evict(&ctx, to.as_deref()).await,
        },
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Parsing starts no thread: still early enough.
    if matches!(cli.cmd, Cmd::Push { .. }) {
        labsync_cli::cap_malloc_arenas();
    }
    let json = cli.json;
    let Some(rt) = labsync_cli::start("labsync", "LABSYNC_LOG", "error") else {
        return ExitCode::from(1);
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            if json {
                println!("{}", json!({"error": format!("{e:#}")}));
            }
            eprintln!("error: {}", labsync_cli::said_error(&e));
            ExitCode::from(1)
        }
    }
}
