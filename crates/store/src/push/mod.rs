//! `push`: scan a tree, chunk and hash what changed, pack what is new, and
//! commit it in the order packs → index → snapshot → ref.
//!
//! The stages, one module each: [`scan`] (the walk, in path order) →
//! [`files_cache`] (plan what to read) → [`read`] (read, chunk, pack) →
//! [`tree`] (cut the tree into segments), run as one stream by [`stream`];
//! [`upload`] beside them; then [`commit`] (index, snapshot, version).
//!
//! Files are read by a few threads (the chunker and BLAKE3 are CPU-bound);
//! new chunks go into one shared pack builder; full packs travel through a
//! channel of capacity one to the uploader, which keeps two uploads in flight.
//! That bounds memory to about four packs whatever the dataset size, and the
//! stream holds a window of entries, never the whole tree: what grows with
//! the tree is the index (~66 bytes per chunk in the store) and the tree's
//! chunk ids (32 bytes each, for its stored size).

mod beneath;
mod commit;
mod files_cache;
mod prefetch;
mod queue;
mod read;
mod scan;
mod stream;
mod tree;
mod upload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::fsutil::blocking;
use crate::index::Index;
use crate::pack::Codec;
use crate::progress::Progress;
use crate::repo::{validate_name, Repo, VersionRecord};
use files_cache::FilesCacheFile;
use read::ReadSettings;
use upload::Uploads;

/// What to push and how.
#[derive(Clone, Debug)]
pub struct PushOptions {
    /// The name to create a version of.
    pub name: String,
    /// Folder of the files cache (`None`: read every file).
    pub files_cache: Option<PathBuf>,
    /// Reader threads.
    pub threads: usize,
    /// Recorded in the version.
    pub user: String,
    /// Recorded in the version.
    pub host: String,
    /// Read the source as this uid/gid (Linux file-system ids, per thread):
    /// a root labd pushing a job's outputs reads only what the job's user may.
    pub read_as: Option<crate::RunAs>,
    /// Files modified less than this long ago may be half written (a
    /// checkpoint being saved while a running job's outputs are pushed):
    /// the version keeps the content the files cache last recorded for
    /// them, or leaves them out when it has none. `None` takes every file
    /// as it is (a push after the writer stopped).
    pub settle: Option<std::time::Duration>,
    /// How compressible file chunks are compressed (trees always use zstd).
    pub compression: Codec,
    /// Recorded in the version: what made a job's outputs.
    pub provenance: Option<crate::Provenance>,
}

impl PushOptions {
    /// Options to push a version of `name`: every file read (no files
    /// cache), two reader threads, files taken as they are, read as this
    /// process, the default compression, and this process's user and host
    /// recorded. Change what differs with `PushOptions { .., ..new(name) }`.
    pub fn new(name: impl Into<String>) -> PushOptions {
        PushOptions {
            name: name.into(),
            files_cache: None,
            threads: 2,
            user: crate::claims::user_name(),
            host: crate::claims::host_name(),
            read_as: None,
            settle: None,
            compression: Codec::default(),
            provenance: None,
        }
    }

    /// Options for the crate's tests: `name`, one reader, no files cache.
    #[cfg(test)]
    pub(crate) fn for_test(name: &str) -> PushOptions {
        PushOptions {
            threads: 1,
            compression: Codec::Lz4,
            ..PushOptions::new(name)
        }
    }
}

/// What a push did.
#[derive(Clone, Debug, Serialize)]
pub struct PushOutcome {
    /// The version (new, or the latest when nothing changed).
    pub record: VersionRecord,
    /// False when the tree equals the latest version and nothing was written.
    pub created: bool,
    /// Files whose content was read (not found unchanged in the files cache).
    pub files_read: u64,
    /// Bytes read from those files.
    pub bytes_read: u64,
    /// Chunks that were new to the store.
    pub new_chunks: u64,
    /// Objects written (packs, index, snapshot, ref).
    pub objects_written: u64,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Pushes `src` as a new version of `opts.name`.
pub async fn push(
    repo: &Repo,
    src: &Path,
    opts: &PushOptions,
    progress: Arc<dyn Progress>,
) -> Result<PushOutcome> {
    let started = Instant::now();
    tracing::debug!(src = %src.display(), "push: start");
    validate_name(&opts.name)?;
    let root = source_root(src, opts.read_as).await?;
    let config = repo.config().clone();
    // The name's latest version is read while the index loads: an
    // unchanged tree is found equal to it with one store round trip after
    // the scan (that it is still the newest) instead of two.
    let (index, latest) = tokio::join!(live_index(repo), repo.latest(&opts.name));
    let (mut index, latest) = (index?, latest?);
    crate::pull::warn_refused(&index, progress.as_ref());
    let mut pins = Vec::new();
    let mut attempt = 0;
    let (streamed, uploaded, mut written, snapshot) = loop {
        attempt += 1;
        let (streamed, uploaded) = stream_and_upload(repo, &root, &index, opts, &progress).await?;
        pins.extend(uploaded.pin.clone());

        let mut written = commit::write_index(repo, &uploaded).await?;
        let snapshot = commit::write_snapshot(
            repo,
            &opts.name,
            latest.clone(),
            streamed.object.clone(),
            &mut written,
        )
        .await?;
        if snapshot.unchanged {
            break (streamed, uploaded, written, snapshot);
        }
        // Every chunk the push did not upload is where the index says, by
        // its pack's own footer: an index object anyone wrote decides
        // nothing a version will need.
        let bad = commit::unconfirmed_hits(repo, &index, &streamed.used, &snapshot.object).await?;
        if bad.is_empty() {
            break (streamed, uploaded, written, snapshot);
        }
        if attempt >= 2 {
            return Err(Error::corrupt(
                "the store's index",
                format!(
                    "{} chunks it places in packs that do not hold them, twice; the push \
                     was not committed: run `labsync rebuild-index`, then push again",
                    bad.len()
                ),
            ));
        }
        progress.warn(&format!(
            "the index places {} chunks of this tree in packs that do not hold them \
             (run `labsync rebuild-index` to repair it): their files are read and \
             uploaded again",
            bad.len()
        ));
        // What the first pass uploaded is indexed now, and used.
        index = Arc::new(live_index(repo).await?.without(&bad));
    };
    // Positions in `used` are the index's before the new tree packs join it.
    if !snapshot.unchanged && started.elapsed().as_secs() * 2 > config.gc_grace() {
        commit::check_still_present(repo, &index, &streamed.used).await?;
    }
    // Every thread that shared it is done.
    let mut index = Arc::try_unwrap(index).unwrap_or_else(|shared| (*shared).clone());
    for p in &uploaded.tree_packs {
        index.add(p);
    }
    let stats =
        commit::tree_stats(repo, &index, &streamed.used, streamed.new_stored, &snapshot).await?;
    let (record, created) =
        commit::commit_version(repo, opts, &snapshot, &stats, &mut written).await?;
    // A version names the packs now; a pin left behind is swept by gc.
    for pin in &pins {
        let _ = repo.remote().delete(pin).await;
    }

    if let Some(cache) = streamed.cache {
        cache.commit(progress.as_ref());
    }
    tracing::debug!("push: files cache saved");
    Ok(PushOutcome {
        record,
        created,
        files_read: streamed.files_read,
        bytes_read: streamed.bytes_read,
        new_chunks: uploaded.chunks,
        objects_written: written.objects,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Stages 1 to 5 over the tree at `root` (scan, plan, read and chunk, the
/// tree), with the uploads of stage 4 beside them, deduplicating against
/// `index`: what the tree is, and what was uploaded.
async fn stream_and_upload(
    repo: &Repo,
    root: &Path,
    index: &Arc<Index>,
    opts: &PushOptions,
    progress: &Arc<dyn Progress>,
) -> Result<(stream::Streamed, upload::Uploaded)> {
    let config = repo.config();
    let cache_file = (opts.files_cache.as_deref()).map(|dir| {
        let uid = opts.read_as.map(|r| r.uid);
        FilesCacheFile::new(dir, &config.id, config.params, root, uid)
    });
    let uploads = Uploads::start(repo);
    let settings = ReadSettings {
        threads: opts.threads.max(1),
        read_as: opts.read_as,
        params: config.params,
        pack_size: config.pack_size as usize,
        codec: opts.compression,
    };
    let sink = stream::Sink {
        tx: uploads.sender(),
        pool: uploads.pool(),
    };
    let (root_dir, index, settle, progress) = (
        root.to_path_buf(),
        index.clone(),
        opts.settle,
        progress.clone(),
    );
    let streamed = blocking(move || {
        let cache_file = cache_file.as_ref();
        stream::run(
            &root_dir,
            &index,
            cache_file,
            settle,
            &settings,
            sink,
            progress.as_ref(),
        )
    })
    .await;
    match streamed {
        Ok(s) => Ok((s, uploads.finish(root).await?)),
        Err(e) => Err(uploads.fail(e).await),
    }
}

/// The source as an absolute path with no symlinks, resolved as `read_as`.
async fn source_root(src: &Path, read_as: Option<crate::RunAs>) -> Result<PathBuf> {
    let src = src.to_path_buf();
    blocking(move || {
        // The first switch of the push: a process that cannot switch
        // stops here with an error (its worker threads would panic).
        let _as = crate::fsutil::ReadAs::try_enter(read_as)
            .map_err(Error::io("read as its owner", &src))?;
        src.canonicalize().map_err(Error::io("open source", &src))
    })
    .await
}

/// The store's index without the packs gc has condemned: a push never
/// deduplicates against data scheduled for deletion.
async fn live_index(repo: &Repo) -> Result<Arc<Index>> {
    let index = repo.load_index_shared().await?;
    let condemned = crate::gc::condemned_packs(repo).await?;
    if condemned.is_empty() {
        return Ok(index);
    }
    let mut live = Index::default();
    for r in index.to_records(|p| !condemned.contains(p)) {
        live.add(&r);
    }
    live.keep_refused_of(&index);
    Ok(Arc::new(live))
}
