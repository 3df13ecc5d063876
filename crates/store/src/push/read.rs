//! Stage 3, read and chunk: a few threads read the files the plan names, cut
//! them with FastCDC, hash every chunk and pack the new ones. The chunker and
//! BLAKE3 are CPU-bound, so this is where the cores go.
//!
//! Files to read come through [`Jobs`], a queue the walk fills in path order
//! and the readers empty; the prefetchers ([`prefetch`]) read ahead in the
//! same queue. Results go back tagged with the entry's place in the walk.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::beneath::Beneath;
use super::prefetch;
pub(super) use super::queue::{upload_stopped, BufferPool, Jobs};
use crate::chunker::{ChunkerParams, StreamChunker};
use crate::error::{Error, Result};
use crate::id::ChunkId;
use crate::index::Index;
use crate::pack::{self, Codec, PackBuilder, SealedPack};
use crate::progress::Progress;

/// What the readers need besides the files.
pub(super) struct ReadSettings {
    pub threads: usize,
    pub read_as: Option<crate::RunAs>,
    pub params: ChunkerParams,
    pub pack_size: usize,
    pub codec: Codec,
}

/// Sends a failure for job `seq` and stops the other readers when dropped
/// by a panic (forgotten otherwise).
struct SayIfPanicking<'a> {
    jobs: &'a Jobs,
    done: &'a std::sync::mpsc::Sender<ReadResult>,
    front: &'a Front,
    seq: u64,
}

impl Drop for SayIfPanicking<'_> {
    fn drop(&mut self) {
        let failed = Error::Io {
            op: "read (a reader panicked)",
            path: PathBuf::new(),
            source: std::io::Error::other("reader panicked"),
        };
        let _ = self.done.send((self.seq, Err(failed)));
        self.front.sent(self.seq, true);
        self.jobs.abandon();
    }
}

/// Where the walk waits for a read: the job it waits for, and its thread.
/// A reader wakes it only for that job (or a failure): one wake-up per file
/// read was most of a cold push's system time on 100,000 small files.
pub(super) struct Front {
    pub seq: std::sync::atomic::AtomicU64,
    pub waiter: std::thread::Thread,
}

impl Front {
    /// Called by a reader after sending the result of job `seq`.
    fn sent(&self, seq: u64, failed: bool) {
        use std::sync::atomic::{fence, Ordering::SeqCst};
        // Either the walk sees the result, or this sees what it waits for.
        fence(SeqCst);
        if failed || seq <= self.seq.load(SeqCst) {
            self.waiter.unpark();
        }
    }
}

/// What a reader sends back: the job's place in the walk and its result.
pub(super) type ReadResult = (u64, Result<FileRead>);

/// Starts `settings.threads` readers and the prefetchers in `scope`,
/// taking files from `jobs` and sending results on `done`. New chunks
/// `index` lacks go into packs handed to `tx`. They end when `jobs` is
/// closed and empty.
pub(super) fn start_readers<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    jobs: &'scope Jobs,
    pipe: &'scope Pipeline<'scope>,
    settings: &'scope ReadSettings,
    done: std::sync::mpsc::Sender<ReadResult>,
    front: &'scope Front,
) -> Vec<std::thread::ScopedJoinHandle<'scope, ()>> {
    let warm = &pipe.warm;
    for _ in 0..prefetch::IO_DEPTH {
        scope.spawn(move || {
            let _as = crate::fsutil::ReadAs::enter(settings.read_as);
            prefetch::run(jobs, warm, pipe.beneath);
        });
    }
    let mut readers = Vec::new();
    for _ in 0..settings.threads.max(1) {
        let done = done.clone();
        readers.push(scope.spawn(move || {
            let _as = crate::fsutil::ReadAs::enter(settings.read_as);
            let mut buf = Vec::new();
            while let Some(job) = jobs.take() {
                // A panic reading it must not leave the walk waiting for it.
                let guard = SayIfPanicking {
                    jobs,
                    done: &done,
                    front,
                    seq: job.seq,
                };
                let r = pipe.read_file(&job.path, job.size, settings.params, &mut buf);
                std::mem::forget(guard);
                if r.is_ok() {
                    pipe.progress.advance(0, 1);
                }
                let failed = r.is_err();
                let gone = done.send((job.seq, r)).is_err();
                front.sent(job.seq, failed);
                if gone || failed {
                    jobs.abandon();
                    return;
                }
            }
        }));
    }
    readers
}

/// Sets the chunks packed by a push are kept in (see [`Pipeline`]).
const SEEN_SHARDS: usize = 64;

/// Where the readers put new chunks: one shared pack builder, whose full
/// packs go to the uploader.
pub(super) struct Pipeline<'a> {
    index: &'a Index,
    /// The source folder, open: every file is opened through it.
    pub beneath: &'a Beneath,
    pool: Arc<BufferPool>,
    /// Chunks packed by this push, by the first 16 bytes of their ids:
    /// half the memory of whole ids at a million chunks, and two different
    /// chunks sharing them takes about 2^64 BLAKE3 evaluations to find.
    /// In [`SEEN_SHARDS`] sets, each growing on its own: one set doubling
    /// from a million entries held both tables, 53 MB at the million-file
    /// push's peak against 36 MB for the sets at rest.
    seen: Box<[Mutex<std::collections::HashSet<u128>>]>,
    packer: Mutex<PackBuilder>,
    pack_size: usize,
    codec: Codec,
    tx: mpsc::Sender<SealedPack>,
    pub progress: &'a dyn Progress,
    /// Set when prefetching is pointless (the source is in memory).
    pub warm: prefetch::Warm,
    /// Stored bytes of the chunks packed (each once).
    pub new_stored: std::sync::atomic::AtomicU64,
}

impl<'a> Pipeline<'a> {
    /// A pipeline packing chunks `index` lacks, with buffers from `pool`.
    pub fn new(
        index: &'a Index,
        beneath: &'a Beneath,
        pool: Arc<BufferPool>,
        tx: mpsc::Sender<SealedPack>,
        settings: &ReadSettings,
        progress: &'a dyn Progress,
    ) -> Result<Pipeline<'a>> {
        let pipe = Pipeline {
            index,
            beneath,
            pool,
            seen: (0..SEEN_SHARDS).map(|_| Mutex::default()).collect(),
            packer: Mutex::new(PackBuilder::default()),
            pack_size: settings.pack_size,
            codec: settings.codec,
            tx,
            progress,
            warm: prefetch::Warm::default(),
            new_stored: Default::default(),
        };
        *pipe.packer.lock().expect("fresh") = pipe.new_builder()?;
        Ok(pipe)
    }

    /// Hands the last, partly filled pack to the uploader.
    pub fn finish(self) -> Result<()> {
        let last = self.packer.into_inner().expect("poisoned");
        if !last.is_empty() {
            self.tx
                .blocking_send(last.seal())
                .map_err(|_| upload_stopped())?;
        }
        Ok(())
    }

    fn new_builder(&self) -> Result<PackBuilder> {
        // Room for the last chunk past the target and a footer of small chunks,
        // so sealing never reallocates (a doubling would briefly cost 64 MiB).
        Ok(PackBuilder::reuse(
            self.pool.take()?,
            self.pack_size + (6 << 20),
        ))
    }

    fn store_chunk(&self, data: &[u8]) -> Result<ChunkId> {
        let id = ChunkId::of(data);
        let short = u128::from_le_bytes(id.as_bytes()[..16].try_into().expect("16 bytes"));
        let shard = &self.seen[(short % SEEN_SHARDS as u128) as usize];
        if self.index.contains(&id) || !shard.lock().expect("seen poisoned").insert(short) {
            return Ok(id);
        }
        let full = pack::with_stored(data, self.codec, |stored, flags| {
            (self.new_stored).fetch_add(stored.len() as u64, std::sync::atomic::Ordering::Relaxed);
            let mut p = self.packer.lock().expect("packer poisoned");
            p.add(id, stored, data.len() as u32, flags);
            Ok::<_, Error>(if p.len() >= self.pack_size {
                Some(std::mem::replace(&mut *p, self.new_builder()?))
            } else {
                None
            })
        })?;
        if let Some(b) = full {
            self.tx
                .blocking_send(b.seal())
                .map_err(|_| upload_stopped())?;
        }
        Ok(id)
    }

    /// Opens the file the scan found, if it is still a regular file: not
    /// through a symlink swapped in since, for it or a folder on the way
    /// (see [`Beneath`]), and never waiting on a FIFO (`O_NONBLOCK`, which
    /// regular files ignore). `None`, said once, when it is gone or no
    /// longer a file.
    fn open_regular(&self, path: &Path) -> Result<Option<std::fs::File>> {
        use rustix::fs::OFlags;
        let skip = |why: &str| {
            let shown = path.display();
            self.progress
                .warn(&format!("skipping {shown}: {why} during the push"));
            Ok(None)
        };
        let opened = self
            .beneath
            .open_at(path, OFlags::RDONLY | OFlags::NONBLOCK);
        let f = match opened {
            Ok(f) => std::fs::File::from(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return skip("removed"),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return skip("replaced by a symlink, or moved under one,")
            }
            Err(e) => return Err(Error::io("open", path)(e)),
        };
        match f.metadata() {
            Ok(m) if m.is_file() => Ok(Some(f)),
            Ok(_) => skip("replaced by something that is not a file"),
            Err(e) => Err(Error::io("stat", path)(e)),
        }
    }

    /// Reads one file; returns its chunks and byte count. Files up to one
    /// block are read whole into the worker's buffer (no per-file allocation:
    /// a 50,000-file code tree is mostly that case); larger ones stream.
    /// `scanned_len` (the size the scan saw) only picks the way to read, so
    /// no second stat is needed; the bytes read are what counts.
    fn read_file(
        &self,
        path: &Path,
        scanned_len: u64,
        params: ChunkerParams,
        buf: &mut Vec<u8>,
    ) -> Result<Option<(Vec<ChunkId>, u64)>> {
        use std::io::{Read, Seek};
        let Some(mut f) = self.open_regular(path)? else {
            return Ok(None);
        };
        let mut chunks = Vec::new();
        let mut n = 0u64;
        if scanned_len < READ_BLOCK as u64 {
            buf.clear();
            (&mut f)
                .take(READ_BLOCK as u64)
                .read_to_end(buf)
                .map_err(Error::io("read", path))?;
            if buf.len() < READ_BLOCK {
                for r in params.cut(buf) {
                    chunks.push(self.store_chunk(&buf[r])?);
                }
                self.progress.advance(buf.len() as u64, 0);
                return Ok(Some((chunks, buf.len() as u64)));
            }
            // It grew past one block while we looked: stream it from the start.
            f.rewind().map_err(Error::io("read", path))?;
        }
        StreamChunker::new(f, params, READ_BLOCK)
            .for_each(|c| {
                n += c.len() as u64;
                self.progress.advance(c.len() as u64, 0);
                chunks.push(self.store_chunk(c)?);
                Ok(())
            })
            .map_err(Error::io("read", path))??;
        Ok(Some((chunks, n)))
    }
}

/// Read size per worker; twice the largest chunk so streaming stays exact.
const READ_BLOCK: usize = 8 << 20;

/// A file's chunks and the bytes read, or `None` when it vanished.
pub(super) type FileRead = Option<(Vec<ChunkId>, u64)>;
