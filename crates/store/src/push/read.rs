//! Stage 3, read and chunk: a few threads read the files the plan names, cut
//! them with FastCDC, hash every chunk and pack the new ones. The chunker and
//! BLAKE3 are CPU-bound, so this is where the cores go.

use std::collections::HashSet;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::prefetch;
use super::scan::Scanned;
use super::upload::{upload_stopped, Uploads};
use crate::chunker::{ChunkerParams, StreamChunker};
use crate::error::{Error, Result};
use crate::fsutil::blocking;
use crate::id::ChunkId;
use crate::index::Index;
use crate::pack::{self, Codec, PackBuilder, SealedPack};
use crate::progress::Progress;

/// What the readers need besides the files.
pub(super) struct ReadSettings {
    pub threads: usize,
    pub read_as: Option<(u32, u32)>,
    pub params: ChunkerParams,
    pub pack_size: usize,
    pub codec: Codec,
}

/// Reads `to_read` (indexes into `scanned`, relative to `root`) on
/// `settings.threads` threads off the runtime, packing chunks `index` lacks
/// and handing full packs to `uploads`. Returns, per file read, its chunks
/// and bytes, or `None` when it vanished meanwhile, in no particular order.
pub(super) async fn read_and_chunk(
    root: &Path,
    scanned: &Arc<Vec<Scanned>>,
    to_read: Vec<usize>,
    index: &Arc<Index>,
    settings: ReadSettings,
    uploads: &Uploads,
    progress: &Arc<dyn Progress>,
) -> Result<Vec<(usize, FileRead)>> {
    let total: u64 = to_read.iter().map(|&i| scanned[i].size).sum();
    progress.phase("read", Some(total), Some(to_read.len() as u64));
    let (index, scanned, root, progress) = (
        index.clone(),
        scanned.clone(),
        root.to_path_buf(),
        progress.clone(),
    );
    let (tx, pool) = (uploads.sender(), uploads.pool());
    blocking(move || {
        let pipe = Pipeline {
            index: &index,
            pool,
            seen: Mutex::new(HashSet::new()),
            packer: Mutex::new(PackBuilder::default()),
            pack_size: settings.pack_size,
            codec: settings.codec,
            tx,
            progress: progress.as_ref(),
        };
        *pipe.packer.lock().expect("fresh") = pipe.new_builder()?;
        let results = read_all(&pipe, &root, &scanned, &to_read, &settings)?;
        let last = pipe.packer.into_inner().expect("poisoned");
        if !last.is_empty() {
            pipe.tx
                .blocking_send(last.seal())
                .map_err(|_| upload_stopped())?;
        }
        Ok(results)
    })
    .await
}

/// The reader threads: each takes the next file until all are read or one failed.
fn read_all(
    pipe: &Pipeline<'_>,
    root: &Path,
    scanned: &[Scanned],
    to_read: &[usize],
    settings: &ReadSettings,
) -> Result<Vec<(usize, FileRead)>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, FileRead)>> = Mutex::new(Vec::new());
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    let path_of = |k: usize| {
        let i = to_read[k];
        if scanned.len() == 1 && !root.is_dir() {
            root.to_path_buf()
        } else {
            root.join(std::ffi::OsStr::from_bytes(&scanned[i].path))
        }
    };
    let ahead = prefetch::Progress::new(to_read.iter().map(|&i| scanned[i].size), &next);
    std::thread::scope(|s| {
        // However the readers end (a panic starting one included), the
        // prefetchers stop, so the scope can end.
        let _stop = prefetch::StopOnDrop(&ahead.stop);
        for _ in 0..prefetch::IO_DEPTH.min(to_read.len()) {
            s.spawn(|| {
                let _as = crate::fsutil::ReadAs::enter(settings.read_as);
                prefetch::run(&ahead, &path_of);
            });
        }
        let readers: Vec<_> = (0..settings.threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let _as = crate::fsutil::ReadAs::enter(settings.read_as);
                    let mut buf = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = to_read.get(k) else { break };
                        if first_err.lock().expect("poisoned").is_some() {
                            break;
                        }
                        let path = path_of(k);
                        match pipe.read_file(&path, scanned[i].size, settings.params, &mut buf) {
                            Ok(r) => {
                                pipe.progress.advance(0, 1);
                                results.lock().expect("poisoned").push((i, r));
                            }
                            Err(e) => {
                                first_err.lock().expect("poisoned").get_or_insert(e);
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for r in readers {
            if let Err(panic) = r.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    if let Some(e) = first_err.into_inner().expect("poisoned") {
        return Err(e);
    }
    Ok(results.into_inner().expect("poisoned"))
}

/// A fixed number of pack buffers circulating between the readers and the
/// uploader. A reader that needs a new pack waits for the uploader to hand one
/// back, which bounds memory to `n` packs whatever the dataset size, and the
/// reused allocations are already faulted in (a fresh 32 MiB buffer per pack
/// cost 15% of a 1 GB push in page faults).
pub(super) struct BufferPool {
    state: Mutex<(Vec<Vec<u8>>, bool)>,
    returned: std::sync::Condvar,
}

impl BufferPool {
    pub fn new(n: usize) -> Arc<BufferPool> {
        Arc::new(BufferPool {
            state: Mutex::new(((0..n).map(|_| Vec::new()).collect(), false)),
            returned: Default::default(),
        })
    }

    /// Blocks until a buffer is free; fails once the uploader has stopped.
    fn take(&self) -> Result<Vec<u8>> {
        let mut st = self.state.lock().expect("pool poisoned");
        loop {
            if st.1 {
                return Err(upload_stopped());
            }
            if let Some(b) = st.0.pop() {
                return Ok(b);
            }
            st = self.returned.wait(st).expect("pool poisoned");
        }
    }

    pub fn give(&self, buf: Vec<u8>) {
        self.state.lock().expect("pool poisoned").0.push(buf);
        self.returned.notify_one();
    }

    pub fn close(&self) {
        self.state.lock().expect("pool poisoned").1 = true;
        self.returned.notify_all();
    }
}

struct Pipeline<'a> {
    index: &'a Index,
    pool: Arc<BufferPool>,
    seen: Mutex<HashSet<ChunkId>>,
    packer: Mutex<PackBuilder>,
    pack_size: usize,
    codec: Codec,
    tx: mpsc::Sender<SealedPack>,
    progress: &'a dyn Progress,
}

impl Pipeline<'_> {
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
        if self.index.contains(&id) || !self.seen.lock().expect("seen poisoned").insert(id) {
            return Ok(id);
        }
        let full = pack::with_stored(data, self.codec, |stored, flags| {
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
    /// through a symlink swapped in since (`O_NOFOLLOW`), and never waiting
    /// on a FIFO (`O_NONBLOCK`, which regular files ignore). `None`, said
    /// once, when it is gone or no longer a file.
    fn open_regular(&self, path: &Path) -> Result<Option<std::fs::File>> {
        use std::os::unix::fs::OpenOptionsExt;
        let skip = |why: &str| {
            let shown = path.display();
            self.progress
                .warn(&format!("skipping {shown}: {why} during the push"));
            Ok(None)
        };
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path);
        let f = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return skip("removed"),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return skip("replaced by a symlink")
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
