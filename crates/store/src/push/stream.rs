//! Stages 1 to 5 as one stream: the walk's entries, in path order, are
//! planned against the files cache, the files that must be read go to the
//! readers, and every entry, once its read is back, goes on in path order
//! to the files cache being written and to the tree. Nothing here holds
//! the whole tree: at most [`WINDOW`] entries wait for their reads.

use std::collections::{HashSet, VecDeque};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{fence, Ordering::SeqCst};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::beneath::Beneath;
use super::files_cache::{self, CacheReader, CacheWriter, CachedFile, FilesCacheFile, Planned};
use super::queue::BufferPool;
use super::read::{self, FileRead, Front, Jobs, Pipeline, ReadResult, ReadSettings};
use super::scan::{LinkGroups, Listers, Scanned, StopListers, Walk};
use super::{prefetch, tree};
use crate::error::{Error, Result};
use crate::id::ChunkId;
use crate::index::Index;
use crate::pack::SealedPack;
use crate::progress::Progress;
use crate::snapshot::{Entry, Kind, SnapshotObject};

/// Entries between the first still being read and the last walked, at
/// most: room for the prefetchers' 1,024 files ahead and more.
const WINDOW: usize = 8192;

/// Entries sent to the tree thread at a time.
const BATCH: usize = 256;

/// What the stream made.
pub(super) struct Streamed {
    /// The tree, its packs handed to the uploader.
    pub object: SnapshotObject,
    /// The chunks of the tree the store had before the push, as bits over
    /// the index's positions (1M chunks in 128 KB).
    pub used: Vec<u64>,
    /// Stored bytes of the chunks the push added (all of them are the
    /// tree's: only files in it are read).
    pub new_stored: u64,
    /// The files cache for the next push, to put in place once the version is.
    pub cache: Option<CacheWriter>,
    /// Files read and their bytes.
    pub files_read: u64,
    pub bytes_read: u64,
}

/// Where the stream's packs go.
pub(super) struct Sink {
    pub tx: mpsc::Sender<SealedPack>,
    pub pool: Arc<BufferPool>,
}

/// Walks `root`, reads what changed and builds the tree, on threads of its
/// own (call it off the async runtime).
pub(super) fn run(
    root: &Path,
    index: &Index,
    cache_file: Option<&FilesCacheFile>,
    settle: Option<std::time::Duration>,
    settings: &ReadSettings,
    sink: Sink,
    progress: &dyn Progress,
) -> Result<Streamed> {
    let started_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    progress.phase("scan", None, None);
    // The files cache is ours (labd's, in its node cache), not the source
    // owner's: opened before this thread reads as them.
    let cache = cache_file.map_or_else(CacheReader::empty, |f| f.load());
    let mut writer = cache_file.map(|f| f.writer(started_ns, progress));
    let streamed = {
        let _as = crate::fsutil::ReadAs::enter(settings.read_as);
        let files = FilesCache {
            read: cache,
            write: writer.as_mut(),
            settle,
        };
        stream(root, index, files, settings, sink, progress)
    };
    // Dropped (its temporary file removed) as ourselves when the push failed.
    let mut streamed = streamed?;
    streamed.cache = writer;
    Ok(streamed)
}

/// The files cache as a push uses it: what it says of the files seen last
/// time, where this push's is written (`None`: no files cache), and how
/// long a file must have been still for its entry to be trusted next time.
struct FilesCache<'a> {
    read: CacheReader,
    write: Option<&'a mut CacheWriter>,
    settle: Option<std::time::Duration>,
}

/// [`run`] once the files cache is open, reading as the source's owner.
fn stream(
    root: &Path,
    index: &Index,
    files: FilesCache,
    settings: &ReadSettings,
    sink: Sink,
    progress: &dyn Progress,
) -> Result<Streamed> {
    let FilesCache {
        read: cache,
        write: writer,
        settle,
    } = files;
    let beneath = Beneath::open(root).map_err(Error::io("open source", root))?;
    let listers = Listers::new(root, &beneath);
    let jobs = Jobs::new();
    let pipe = Pipeline::new(
        index,
        &beneath,
        sink.pool,
        sink.tx.clone(),
        settings,
        progress,
    )?;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<ReadResult>();
    let front = Front {
        seq: Default::default(),
        waiter: std::thread::current(),
    };
    let (tree_tx, tree_rx) = std::sync::mpsc::sync_channel::<Vec<Entry>>(4);
    let streamed = std::thread::scope(|s| {
        // However the walk ends, listers, readers and prefetchers stop.
        let _stop = StopListers(&listers);
        let _abandon = AbandonOnDrop(&jobs);
        for _ in 0..prefetch::IO_DEPTH.max(settings.threads) {
            s.spawn(|| {
                let _as = crate::fsutil::ReadAs::enter(settings.read_as);
                listers.run();
            });
        }
        let readers = read::start_readers(s, &jobs, &pipe, settings, done_tx, &front);
        let tree_tx_packs = sink.tx.clone();
        let tree = s.spawn(move || tree::build(tree_rx, index, settings.pack_size, tree_tx_packs));
        let mut window = Window {
            root,
            single: !root.is_dir(),
            index,
            cache,
            writer,
            settle: files_cache::unsettled_after(settle),
            jobs: &jobs,
            done: done_rx,
            front: &front,
            tree: Some(tree_tx),
            batch: Vec::with_capacity(BATCH),
            pending: VecDeque::new(),
            first_seq: 0,
            links: LinkGroups::default(),
            dropped: HashSet::new(),
            used: vec![0; index.len().div_ceil(64)],
            files_read: 0,
            bytes_read: 0,
            progress,
        };
        let walked = Walk::start(&listers, progress).and_then(|walk| window.run(walk));
        if walked.is_err() {
            jobs.abandon();
        }
        jobs.close();
        for r in readers {
            if let Err(panic) = r.join() {
                std::panic::resume_unwind(panic);
            }
        }
        // The tree thread ends when its sender is dropped.
        window.tree = None;
        let object = match tree.join() {
            Ok(object) => object,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        // The tree's own error first: the walk only saw that it stopped.
        let object = object?;
        walked?;
        Ok::<_, Error>(Streamed {
            object,
            used: window.used,
            new_stored: pipe.new_stored.load(std::sync::atomic::Ordering::Relaxed),
            cache: None,
            files_read: window.files_read,
            bytes_read: window.bytes_read,
        })
    })?;
    pipe.finish()?;
    Ok(streamed)
}

/// Closes the jobs, so readers and prefetchers stop, however the walk ends.
struct AbandonOnDrop<'a>(&'a Jobs);

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// One walked entry waiting for its turn.
struct Pending {
    s: Scanned,
    state: State,
}

enum State {
    /// Chunks known, and the bytes read when it was read.
    Ready(Vec<ChunkId>, Option<u64>),
    /// A reader has it.
    Reading,
    /// Not in the version: left out, or gone when it was read.
    Gone,
}

/// The entries between the walk and the tree, in path order.
struct Window<'a> {
    root: &'a Path,
    /// The source is one file.
    single: bool,
    index: &'a Index,
    cache: CacheReader,
    writer: Option<&'a mut CacheWriter>,
    settle: Option<i64>,
    jobs: &'a Jobs,
    done: Receiver<ReadResult>,
    front: &'a Front,
    tree: Option<SyncSender<Vec<Entry>>>,
    batch: Vec<Entry>,
    pending: VecDeque<Pending>,
    /// The walk's number of `pending[0]`.
    first_seq: u64,
    links: LinkGroups,
    /// Files with several names left out of the version: their other names
    /// go too (pull refuses a link to nothing). One path per such file.
    dropped: HashSet<Vec<u8>>,
    /// The chunks the tree uses that the store had, by index position.
    used: Vec<u64>,
    files_read: u64,
    bytes_read: u64,
    progress: &'a dyn Progress,
}

impl Window<'_> {
    fn run(&mut self, mut walk: Walk<'_, '_>) -> Result<()> {
        let mut walking = true;
        let mut first = true;
        loop {
            while let Ok(done) = self.done.try_recv() {
                self.record(done)?;
            }
            self.pass_on()?;
            if walking && self.pending.len() < WINDOW {
                match walk.next_entry()? {
                    Some(s) => {
                        if first {
                            // Listed, nothing read yet.
                            self.progress.phase("read", None, None);
                            first = false;
                        }
                        self.plan(s);
                    }
                    None => walking = false,
                }
                continue;
            }
            if self.pending.is_empty() {
                break;
            }
            // Wait for the front's read (a reader wakes this thread for it).
            self.front.seq.store(self.first_seq, SeqCst);
            fence(SeqCst);
            match self.done.try_recv() {
                Ok(done) => self.record(done)?,
                Err(TryRecvError::Empty) => std::thread::park_timeout(Duration::from_millis(50)),
                Err(TryRecvError::Disconnected) => {
                    return Err(Error::Io {
                        op: "read (a reader stopped)",
                        path: self.root.to_path_buf(),
                        source: std::io::Error::other("reader gone"),
                    })
                }
            }
        }
        self.send_batch()
    }

    /// Plans one walked entry and queues its read when it needs one.
    fn plan(&mut self, mut s: Scanned) {
        self.links.apply(&mut s);
        let planned = files_cache::plan_entry(
            &mut s,
            &mut self.cache,
            self.index,
            self.settle,
            self.progress,
        );
        let state = match planned {
            Planned::Known(chunks) => State::Ready(chunks, None),
            Planned::LeftOut => State::Gone,
            Planned::Read => {
                let seq = self.first_seq + self.pending.len() as u64;
                let path = if self.single {
                    self.root.to_path_buf()
                } else {
                    self.root.join(std::ffi::OsStr::from_bytes(&s.path))
                };
                self.jobs.push(seq, path, s.size);
                State::Reading
            }
        };
        self.pending.push_back(Pending { s, state });
    }

    /// Records a reader's result.
    fn record(&mut self, (seq, r): (u64, Result<FileRead>)) -> Result<()> {
        let i = (seq - self.first_seq) as usize;
        let p = &mut self.pending[i];
        p.state = match r? {
            Some((chunks, n)) => {
                self.files_read += 1;
                self.bytes_read += n;
                State::Ready(chunks, Some(n))
            }
            None => State::Gone,
        };
        Ok(())
    }

    /// Passes the entries at the front whose reads are back to the files
    /// cache and the tree.
    fn pass_on(&mut self) -> Result<()> {
        while self
            .pending
            .front()
            .is_some_and(|p| !matches!(p.state, State::Reading))
        {
            let Pending { s, state } = self.pending.pop_front().expect("front exists");
            self.first_seq += 1;
            let State::Ready(chunks, read) = state else {
                if s.kind == Kind::File && s.nlink > 1 {
                    self.dropped.insert(s.path);
                }
                continue;
            };
            if s.kind == Kind::HardLink && self.dropped.contains(&s.target) {
                continue;
            }
            // A file that changed size while it was read is recorded as read,
            // and left out of the files cache so the next push reads it again.
            let size = read.unwrap_or(s.size);
            if s.kind == Kind::File && size == s.size {
                if let Some(w) = &mut self.writer {
                    w.add(
                        &CachedFile {
                            path: s.path.clone(),
                            size: s.size,
                            mtime_ns: s.mtime_ns,
                            ctime_ns: s.ctime_ns,
                            ino: s.ino,
                            chunks: chunks.clone(),
                        },
                        self.progress,
                    );
                }
            }
            for c in &chunks {
                if let Some(i) = self.index.position(c) {
                    self.used[i / 64] |= 1 << (i % 64);
                }
            }
            self.batch.push(Entry {
                path: s.path,
                kind: s.kind,
                mode: s.mode,
                mtime_ns: s.mtime_ns,
                size,
                chunks,
                target: s.target,
            });
            if self.batch.len() >= BATCH {
                self.send_batch()?;
            }
        }
        Ok(())
    }

    fn send_batch(&mut self) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        let sent = self.tree.as_ref().map(|t| t.send(batch));
        match sent {
            Some(Ok(())) => Ok(()),
            // The tree thread stopped: its own error says why.
            _ => Err(super::upload::upload_stopped()),
        }
    }
}
