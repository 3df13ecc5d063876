//! Stage 4, upload: sealed packs travel through a channel of capacity one to
//! one task that keeps two uploads in flight and indexes every 32 packs
//! (or 64 Ki chunks).

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub(super) use super::queue::upload_stopped;
use super::queue::BufferPool;
use crate::error::{Error, Result};
use crate::index::IndexPack;
use crate::pack::SealedPack;
use crate::pack::FLAG_TREE;
use crate::repo::{pack_key, Repo};

/// What a push uploaded. Index records are kept only where they are still
/// needed: a million new chunks' records would be 56 MB.
pub(super) struct Uploaded {
    /// Packs uploaded.
    pub packs: u64,
    /// Chunks in them.
    pub chunks: u64,
    /// Bytes of them.
    pub bytes: u64,
    /// Index objects written while uploading, and their bytes.
    pub index_objects: u64,
    pub index_bytes: u64,
    /// The last packs, not yet in an index object.
    pub unindexed: Vec<IndexPack>,
    /// The packs of tree segments (the diff against the latest version
    /// reads the new ones).
    pub tree_packs: Vec<IndexPack>,
    /// The pin naming the packs uploaded, where the push ran long enough
    /// to write one ([`crate::gc::write_pin`]): removed once committed.
    pub pin: Option<String>,
}

/// The running uploader: where packs go and the buffers they come back to.
pub(super) struct Uploads {
    tx: mpsc::Sender<SealedPack>,
    task: Option<JoinHandle<Result<Uploaded>>>,
    pool: Arc<BufferPool>,
}

impl Uploads {
    /// Starts the uploader. Three pack buffers for a local store (one
    /// filling, two writing), four for a remote one, where uploads take
    /// longer: well under 200 MB.
    pub fn start(repo: &Repo) -> Uploads {
        let (tx, rx) = mpsc::channel::<SealedPack>(1);
        let pool = BufferPool::new(if repo.remote().local_path("").is_some() {
            3
        } else {
            4
        });
        let task = tokio::spawn(upload(repo.clone(), rx, pool.clone()));
        Uploads {
            tx,
            task: Some(task),
            pool,
        }
    }

    /// Where the readers send full packs from their threads.
    pub fn sender(&self) -> mpsc::Sender<SealedPack> {
        self.tx.clone()
    }

    /// The buffers packs are built in.
    pub fn pool(&self) -> Arc<BufferPool> {
        self.pool.clone()
    }

    /// After `cause` stopped the push: the uploader's own error if it failed
    /// (a full disk, the store gone: the root cause), else `cause`.
    pub async fn fail(mut self, cause: Error) -> Error {
        drop(self.tx);
        match self.task.take() {
            Some(task) => match task.await {
                Ok(Err(up)) => up,
                _ => cause,
            },
            None => cause,
        }
    }

    /// Waits for every pack handed over to be uploaded and indexed.
    pub async fn finish(mut self, root: &Path) -> Result<Uploaded> {
        drop(self.tx);
        let Some(task) = self.task.take() else {
            return Err(upload_stopped());
        };
        task.await.map_err(|e| Error::Io {
            op: "upload",
            path: root.to_path_buf(),
            source: std::io::Error::other(e),
        })?
    }
}

/// Uploads packs as they come, two at a time, making them durable and
/// indexing them every 32 packs (or 64 Ki chunks) so an interrupted push
/// resumes from there.
async fn upload(
    repo: Repo,
    rx: mpsc::Receiver<SealedPack>,
    pool: Arc<BufferPool>,
) -> Result<Uploaded> {
    // Readers waiting for a buffer must learn that no more will come,
    // however the uploader ends (a panic included).
    let _close = ClosePool(pool.clone());
    upload_packs(repo, rx, pool).await
}

struct ClosePool(Arc<BufferPool>);

impl Drop for ClosePool {
    fn drop(&mut self) {
        self.0.close();
    }
}

async fn upload_packs(
    repo: Repo,
    mut rx: mpsc::Receiver<SealedPack>,
    pool: Arc<BufferPool>,
) -> Result<Uploaded> {
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut puts = stream
        .map(|p: SealedPack| {
            let (repo, pool) = (repo.clone(), pool.clone());
            async move {
                let size = p.object().len() as u64;
                let rec = IndexPack::new(p.id, size, &p.entries);
                let key = pack_key(&p.id);
                let buffer = Bytes::from(p.bytes);
                let bytes = buffer.slice(p.start..);
                repo.remote().put(&key, bytes.clone()).await?;
                repo.remote().start_writeback(&key).await?;
                // Hand the buffer back (a fresh one if the backend still holds it).
                drop(bytes);
                pool.give(buffer.try_into_mut().map(Vec::from).unwrap_or_default());
                Ok::<_, Error>(rec)
            }
        })
        .buffer_unordered(2);
    let mut up = Uploaded {
        packs: 0,
        chunks: 0,
        bytes: 0,
        index_objects: 0,
        index_bytes: 0,
        unindexed: Vec::new(),
        tree_packs: Vec::new(),
        pin: None,
    };
    let mut unindexed_chunks = 0;
    // A push running longer than the grace period would see gc take the
    // packs it uploaded first, which no version names yet: from a quarter
    // of the grace on it pins them, and pins again as often.
    let started = std::time::Instant::now();
    let every = repo.pin_every();
    let mut own: Vec<crate::id::PackId> = Vec::new();
    let mut pinned_at = started;
    while let Some(rec) = puts.next().await {
        let rec = rec?;
        own.push(rec.pack);
        if pinned_at.elapsed() >= every {
            let key = up.pin.get_or_insert_with(crate::gc::pin_key);
            crate::gc::write_pin(&repo, key, &own).await?;
            pinned_at = std::time::Instant::now();
        }
        up.packs += 1;
        up.chunks += rec.chunks.len() as u64;
        up.bytes += rec.size;
        if rec.chunks.iter().any(|c| c.4 & FLAG_TREE != 0) {
            up.tree_packs.push(rec.clone());
        }
        unindexed_chunks += rec.chunks.len();
        up.unindexed.push(rec);
        // Every 32 packs, or 64 Ki chunks (56 bytes each held, ~43 encoded)
        // when the chunks are small: an interrupted push resumes from there.
        if up.unindexed.len() >= 32 || unindexed_chunks >= 64 * 1024 {
            unindexed_chunks = 0;
            repo.remote().sync().await?;
            let written = repo.write_index(&up.unindexed).await?;
            up.index_bytes += written.iter().map(|(_, n)| n).sum::<u64>();
            up.index_objects += written.len() as u64;
            up.unindexed.clear();
        }
    }
    Ok(up)
}
