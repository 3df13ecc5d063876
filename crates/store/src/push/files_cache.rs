//! Stage 2, plan: the files cache says which files are unchanged since the
//! last push (their chunks are known) and which must be read.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::scan::Scanned;
use crate::chunker::ChunkerParams;
use crate::fsutil::write_atomic;
use crate::id::ChunkId;
use crate::index::Index;
use crate::progress::Progress;
use crate::snapshot::Kind;

/// The files cache: what each file looked like when its chunks were computed.
/// Keyed by store, chunker parameters and source folder; an entry is trusted
/// only if size, mtime, ctime and inode all match (restic's and borg's rule)
/// and it was not racily clean (see [`racily_clean`]).
#[derive(Serialize, Deserialize, Default)]
pub(super) struct FilesCache {
    store: String,
    params: Option<ChunkerParams>,
    /// Wall clock (ns since the epoch) when the push that wrote it started
    /// its scan: no entry was looked at before then.
    recorded_at_ns: i64,
    files: Vec<CachedFile>,
}

/// How far a file's timestamps may trail the moment they were read and still
/// hide a later change. Whole seconds on NFS servers and on ext4 with 128-byte
/// inodes (2 s on FAT), plus some skew between a file server's clock and
/// ours; a jiffy (at most 10 ms) on file systems with nanosecond fields.
const RACY_WINDOW_COARSE_NS: i64 = 3_000_000_000;
const RACY_WINDOW_FINE_NS: i64 = 100_000_000;

/// Git's "racy git" rule: a file whose mtime or ctime is not clearly older
/// than the moment its entry was recorded may have been rewritten, with the
/// same size, within the same timestamp tick after it was read. Such an entry
/// proves nothing and the file is read again. A file system keeps whole
/// seconds when both times have no sub-second part (ctime is the kernel's
/// own, so a tar-extracted mtime does not fool it). Costs a re-read of files
/// changed just before a push; a stale `config.py` pushed as new code would
/// cost a training run.
fn racily_clean(c: &CachedFile, recorded_at_ns: i64) -> bool {
    const SECOND: i64 = 1_000_000_000;
    let coarse = c.mtime_ns.rem_euclid(SECOND) == 0 && c.ctime_ns.rem_euclid(SECOND) == 0;
    let window = if coarse {
        RACY_WINDOW_COARSE_NS
    } else {
        RACY_WINDOW_FINE_NS
    };
    c.mtime_ns.max(c.ctime_ns) >= recorded_at_ns.saturating_sub(window)
}

#[derive(Serialize, Deserialize, Clone)]
pub(super) struct CachedFile {
    pub path: Vec<u8>,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    pub chunks: Vec<ChunkId>,
}

/// 2: `recorded_at_ns` (the racy rule); a version 1 cache is read as empty.
const FILES_CACHE_VERSION: u8 = 2;

/// Where the files cache of one source folder in one store lives.
pub(super) struct FilesCacheFile {
    path: PathBuf,
    store: String,
    params: ChunkerParams,
}

impl FilesCacheFile {
    /// The cache file for `root` in the folder `dir`.
    pub fn new(dir: &Path, store: &str, params: ChunkerParams, root: &Path) -> FilesCacheFile {
        let key = blake3::hash(format!("{store}\0{}", root.display()).as_bytes()).to_hex();
        FilesCacheFile {
            path: dir.join(format!("{}.bin", &key[..32])),
            store: store.to_string(),
            params,
        }
    }

    /// What the last push recorded; empty when there is none, when it was
    /// written by another format, store or chunker, or cannot be read.
    pub fn load(&self) -> FilesCache {
        let Ok(bytes) = std::fs::read(&self.path) else {
            return FilesCache::default();
        };
        match bytes.split_first() {
            Some((&FILES_CACHE_VERSION, rest)) => match postcard::from_bytes::<FilesCache>(rest) {
                Ok(c) if c.store == self.store && c.params == Some(self.params) => c,
                _ => FilesCache::default(),
            },
            _ => FilesCache::default(),
        }
    }

    /// Records `files` as seen by a scan that started at `recorded_at_ns`. A
    /// failure only costs the next push a full read, so it is a warning.
    pub fn save(&self, recorded_at_ns: i64, files: Vec<CachedFile>, progress: &dyn Progress) {
        let fc = FilesCache {
            store: self.store.clone(),
            params: Some(self.params),
            recorded_at_ns,
            files,
        };
        let mut bytes = vec![FILES_CACHE_VERSION];
        bytes = postcard::to_extend(&fc, bytes).expect("Vec writer cannot fail");
        if let Err(e) = write_atomic(&self.path, &bytes) {
            progress.warn(&format!(
                "could not save the files cache ({e}); the next push re-reads every file"
            ));
        }
    }
}

/// Which files must be read, and the chunks of those that need not be.
pub(super) struct ReadPlan {
    /// Per scanned entry: its chunks, when known without reading it.
    pub chunks_of: Vec<Option<Vec<ChunkId>>>,
    /// Entries to read, in path order.
    pub to_read: Vec<usize>,
    /// Files left out of the version: being written, with nothing recorded.
    pub left_out: HashSet<usize>,
}

/// Merge-joins the scan and the cache (both sorted by path): a file whose
/// entry matches and whose chunks are all in `index` keeps its chunks. With
/// `settle`, a file modified within it keeps its last recorded content (and
/// its scanned metadata becomes the recorded one), or is left out.
pub(super) fn plan_reads(
    scanned: &mut [Scanned],
    cache: &FilesCache,
    index: &Index,
    settle: Option<Duration>,
    progress: &dyn Progress,
) -> ReadPlan {
    let mut chunks_of: Vec<Option<Vec<ChunkId>>> = vec![None; scanned.len()];
    let unsettled_after = settle.map(|d| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.saturating_sub(d).as_nanos() as i64
    });
    let mut left_out = HashSet::new();
    let mut to_read = Vec::new();
    let mut ci = 0;
    for i in 0..scanned.len() {
        let s = &scanned[i];
        if s.kind != Kind::File {
            continue;
        }
        while ci < cache.files.len() && cache.files[ci].path < s.path {
            ci += 1;
        }
        let hit = cache.files.get(ci).filter(|c| {
            c.path == s.path
                && c.size == s.size
                && c.mtime_ns == s.mtime_ns
                && c.ctime_ns == s.ctime_ns
                && c.ino == s.ino
                && !racily_clean(c, cache.recorded_at_ns)
                && c.chunks.iter().all(|id| index.contains(id))
        });
        if let Some(c) = hit {
            chunks_of[i] = Some(c.chunks.clone());
            continue;
        }
        if unsettled_after.is_some_and(|t| s.mtime_ns > t) {
            // Being written: the last recorded content, as it was recorded.
            let previous = cache
                .files
                .get(ci)
                .filter(|c| c.path == s.path && c.chunks.iter().all(|id| index.contains(id)));
            let name = String::from_utf8_lossy(&s.path).into_owned();
            match previous {
                Some(c) => {
                    progress.warn(&format!(
                        "{name} changed in the last seconds: keeping its previous content"
                    ));
                    chunks_of[i] = Some(c.chunks.clone());
                    let s = &mut scanned[i];
                    (s.size, s.mtime_ns, s.ctime_ns, s.ino) =
                        (c.size, c.mtime_ns, c.ctime_ns, c.ino);
                }
                None => {
                    progress.warn(&format!(
                        "leaving out {name}: it changed in the last seconds and may be half written"
                    ));
                    left_out.insert(i);
                }
            }
            continue;
        }
        to_read.push(i);
    }
    tracing::debug!(
        to_read = to_read.len(),
        "push: index loaded, files cache compared"
    );
    ReadPlan {
        chunks_of,
        to_read,
        left_out,
    }
}
