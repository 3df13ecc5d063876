//! Stage 2, plan: the files cache says which files are unchanged since the
//! last push (their chunks are known) and which must be read.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::scan::Scanned;
use crate::chunker::ChunkerParams;
use crate::id::ChunkId;
use crate::index::Index;
use crate::progress::Progress;
use crate::snapshot::Kind;

/// The files cache: what each file looked like when its chunks were computed.
/// Keyed by store, chunker parameters and source folder; an entry is trusted
/// only if size, mtime, ctime and inode all match (restic's and borg's rule)
/// and it was not racily clean (see [`racily_clean`]).
///
/// On disk: a version byte, this header, then one length-prefixed record per
/// file in path order, read and written as a stream: a push holds one
/// record of it at a time, however many files the tree has.
#[derive(Serialize, Deserialize, Default)]
struct Header {
    store: String,
    params: Option<ChunkerParams>,
    /// Wall clock (ns since the epoch) when the push that wrote it started
    /// its scan: no entry was looked at before then.
    recorded_at_ns: i64,
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

/// 3: streamed records; an older cache is read as empty.
const FILES_CACHE_VERSION: u8 = 3;

/// A record longer than this is not one a push wrote (a file of 64 GiB at
/// the smallest chunks has 256 Ki chunk ids, 8 MiB).
const MAX_RECORD: usize = 64 << 20;

/// Where the files cache of one source folder in one store lives.
pub(super) struct FilesCacheFile {
    path: PathBuf,
    store: String,
    params: ChunkerParams,
}

impl FilesCacheFile {
    /// The cache file for `root` in the folder `dir`, read as user `uid`
    /// (`None`: as this process's own user).
    ///
    /// A hit skips opening the file: a cache shared by every user a root
    /// labd pushes for would let one user's push take in a file only
    /// another user could read, from that user's earlier push of the same
    /// folder. So each user's pushes have caches of their own.
    pub fn new(
        dir: &Path,
        store: &str,
        params: ChunkerParams,
        root: &Path,
        uid: Option<u32>,
    ) -> FilesCacheFile {
        let user = uid.map_or(String::new(), |u| format!("\0uid {u}"));
        let key = blake3::hash(format!("{store}\0{}{user}", root.display()).as_bytes()).to_hex();
        FilesCacheFile {
            path: dir.join(format!("{}.bin", &key[..32])),
            store: store.to_string(),
            params,
        }
    }

    /// What the last push recorded, to read in path order; empty when there
    /// is none, when it was written by another format, store or chunker, or
    /// cannot be read.
    pub fn load(&self) -> CacheReader {
        let empty = CacheReader::empty();
        let Ok(f) = std::fs::File::open(&self.path) else {
            return empty;
        };
        let mut input = BufReader::with_capacity(256 << 10, f);
        let mut version = [0u8];
        if input.read_exact(&mut version).is_err() || version[0] != FILES_CACHE_VERSION {
            return empty;
        }
        match read_record::<Header>(&mut input) {
            Some(h) if h.store == self.store && h.params == Some(self.params) => {
                let mut r = CacheReader {
                    input: Some(input),
                    recorded_at_ns: h.recorded_at_ns,
                    current: None,
                };
                r.step();
                r
            }
            _ => empty,
        }
    }

    /// Starts writing the cache of a scan that started at `recorded_at_ns`,
    /// beside the current one; [`CacheWriter::commit`] puts it in place. A
    /// failure only costs the next push a full read, so it is a warning.
    pub fn writer(&self, recorded_at_ns: i64, progress: &dyn Progress) -> CacheWriter {
        let tmp = crate::fsutil::tmp_name(&self.path);
        let opened = (|| {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            // A new name only (`O_EXCL`): see `tmp_name`.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            let mut out = BufWriter::with_capacity(256 << 10, f);
            out.write_all(&[FILES_CACHE_VERSION])?;
            let header = Header {
                store: self.store.clone(),
                params: Some(self.params),
                recorded_at_ns,
            };
            write_record(&mut out, &header)?;
            Ok::<_, std::io::Error>(out)
        })();
        let out = match opened {
            Ok(out) => Some(out),
            Err(e) => {
                warn_unsaved(progress, &e);
                let _ = std::fs::remove_file(&tmp);
                None
            }
        };
        CacheWriter {
            out,
            tmp,
            path: self.path.clone(),
            committed: false,
        }
    }
}

fn warn_unsaved(progress: &dyn Progress, e: &dyn std::fmt::Display) {
    progress.warn(&format!(
        "could not save the files cache ({e}); the next push re-reads every file"
    ));
}

fn read_record<T: for<'de> Deserialize<'de>>(input: &mut impl Read) -> Option<T> {
    let mut len = [0u8; 4];
    input.read_exact(&mut len).ok()?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_RECORD {
        return None;
    }
    let mut buf = vec![0u8; len];
    input.read_exact(&mut buf).ok()?;
    postcard::from_bytes(&buf).ok()
}

fn write_record<T: Serialize>(out: &mut impl Write, value: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(value).map_err(std::io::Error::other)?;
    out.write_all(&(bytes.len() as u32).to_le_bytes())?;
    out.write_all(&bytes)
}

/// The last push's records, taken in path order.
pub(super) struct CacheReader {
    input: Option<BufReader<std::fs::File>>,
    recorded_at_ns: i64,
    current: Option<CachedFile>,
}

impl CacheReader {
    /// No records: every file is read.
    pub fn empty() -> CacheReader {
        CacheReader {
            input: None,
            recorded_at_ns: 0,
            current: None,
        }
    }

    /// Reads the next record; a record out of order or unreadable ends the
    /// cache there (the files after it are read again).
    fn step(&mut self) {
        let next = self.input.as_mut().and_then(read_record::<CachedFile>);
        match (&self.current, next) {
            (Some(c), Some(n)) if n.path <= c.path => self.end(),
            (_, None) => self.end(),
            (_, n) => self.current = n,
        }
    }

    fn end(&mut self) {
        self.input = None;
        self.current = None;
    }

    /// The record of `path`, if there is one; records before it are passed.
    /// Paths must be asked for in increasing order.
    fn find(&mut self, path: &[u8]) -> Option<&CachedFile> {
        while self
            .current
            .as_ref()
            .is_some_and(|c| c.path.as_slice() < path)
        {
            self.step();
        }
        self.current.as_ref().filter(|c| c.path == path)
    }
}

/// The files cache being written for the next push.
pub(super) struct CacheWriter {
    out: Option<BufWriter<std::fs::File>>,
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

impl CacheWriter {
    /// Records one file (in path order).
    pub fn add(&mut self, file: &CachedFile, progress: &dyn Progress) {
        let Some(out) = &mut self.out else { return };
        if let Err(e) = write_record(out, file) {
            warn_unsaved(progress, &e);
            // Removed later, by `commit` or when dropped: this thread may be
            // reading as the source's owner, who cannot remove it.
            self.out = None;
        }
    }

    fn abandon(&mut self) {
        self.out = None;
        let _ = std::fs::remove_file(&self.tmp);
    }

    /// Makes the cache durable and puts it in place of the last one.
    pub fn commit(mut self, progress: &dyn Progress) {
        let Some(out) = self.out.take() else {
            self.abandon();
            return;
        };
        let done = (|| {
            let f = out.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            std::fs::rename(&self.tmp, &self.path)
        })();
        match done {
            Ok(()) => self.committed = true,
            Err(e) => {
                warn_unsaved(progress, &e);
                self.abandon();
            }
        }
    }
}

impl Drop for CacheWriter {
    /// A push that failed leaves the last cache as it was (and a cache that
    /// was put in place has no temporary file left to remove).
    fn drop(&mut self) {
        if !self.committed {
            self.abandon();
        }
    }
}

/// What the plan says of one scanned entry.
pub(super) enum Planned {
    /// Its chunks are known without reading it (or it has none).
    Known(Vec<ChunkId>),
    /// It must be read.
    Read,
    /// Left out of the version: being written, with nothing recorded.
    LeftOut,
}

/// Plans one entry (entries come in path order): a file whose record
/// matches and whose chunks are all in `index` keeps its chunks. With
/// `unsettled_after`, a file modified since then keeps its last recorded
/// content (and its scanned metadata becomes the recorded one), or is left
/// out.
pub(super) fn plan_entry(
    s: &mut Scanned,
    cache: &mut CacheReader,
    index: &Index,
    unsettled_after: Option<i64>,
    progress: &dyn Progress,
) -> Planned {
    if s.kind != Kind::File {
        return Planned::Known(Vec::new());
    }
    let recorded_at_ns = cache.recorded_at_ns;
    let record = cache.find(&s.path);
    let hit = record.filter(|c| {
        c.size == s.size
            && c.mtime_ns == s.mtime_ns
            && c.ctime_ns == s.ctime_ns
            && c.ino == s.ino
            && !racily_clean(c, recorded_at_ns)
            && c.chunks.iter().all(|id| index.contains(id))
    });
    if let Some(c) = hit {
        return Planned::Known(c.chunks.clone());
    }
    if unsettled_after.is_none_or(|t| s.mtime_ns <= t) {
        return Planned::Read;
    }
    // Being written: the last recorded content, as it was recorded.
    let previous = record.filter(|c| c.chunks.iter().all(|id| index.contains(id)));
    let name = String::from_utf8_lossy(&s.path).into_owned();
    match previous {
        Some(c) => {
            progress.warn(&format!(
                "{name} changed in the last seconds: keeping its previous content"
            ));
            (s.size, s.mtime_ns, s.ctime_ns, s.ino) = (c.size, c.mtime_ns, c.ctime_ns, c.ino);
            Planned::Known(c.chunks.clone())
        }
        None => {
            progress.warn(&format!(
                "leaving out {name}: it changed in the last seconds and may be half written"
            ));
            Planned::LeftOut
        }
    }
}

/// The moment (ns since the epoch) after which a file counts as being
/// written, for `settle`.
pub(super) fn unsettled_after(settle: Option<Duration>) -> Option<i64> {
    settle.map(|d| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.saturating_sub(d).as_nanos() as i64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root labd's pushes for different users never share a files cache
    /// (a hit skips opening the file), and a push as this process's own
    /// user keeps the cache it had.
    #[test]
    fn each_user_has_a_files_cache_of_their_own() {
        let (dir, root) = (Path::new("/cache/files"), Path::new("/data/shared"));
        let params = ChunkerParams::default();
        let path = |uid| FilesCacheFile::new(dir, "store-id", params, root, uid).path;
        let (own, alice, bob) = (path(None), path(Some(1000)), path(Some(1001)));
        assert!(own != alice && alice != bob && own != bob);
        assert_eq!(alice, path(Some(1000)), "the same user, the same cache");
        let key = blake3::hash(b"store-id\0/data/shared").to_hex();
        assert_eq!(own, dir.join(format!("{}.bin", &key[..32])), "unchanged");
    }
}
