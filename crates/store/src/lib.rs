//! The labsync chunk store: content-addressed, deduplicated, verified storage
//! of directory trees on any object store, with a bounded cache per node.
//!
//! Files are cut with FastCDC v2020 ([`ChunkerParams`]), each chunk named by
//! its BLAKE3 id ([`ChunkId`]) and appended to ~32 MiB packs with a
//! self-describing footer. Immutable index objects map chunks to packs; a
//! snapshot ([`SnapshotObject`]) lists the tree in content-defined segments;
//! a name's versions (`div2k@v3`, [`VersionRecord`]) are created with a
//! conditional create, so concurrent pushes never lose one. Writes go packs →
//! index → snapshot → ref, each durable before the next: a crash leaves no ref
//! to missing data. [`gc`] is mark-and-sweep with a grace period.
//!
//! ```no_run
//! # async fn demo() -> labsync_store::Result<()> {
//! use std::sync::Arc;
//! use labsync_store::{push, NodeCache, NoProgress, Pull, PushOptions, Remote, Repo};
//!
//! let repo = Repo::open(Remote::open("file:///tmp/store", &[])?, None).await?;
//! let cache = NodeCache::open("/tmp/cache".as_ref(), 10 << 30)?;
//! let opts = PushOptions {
//!     files_cache: Some(cache.files_cache_dir()),
//!     ..PushOptions::new("div2k")
//! };
//! let pushed = push(&repo, "./div2k".as_ref(), &opts, Arc::new(NoProgress)).await?;
//! println!("{}", pushed.record.label());
//! let spec = "div2k".parse()?;
//! Pull::new(&repo, &cache, &spec, "/scratch/div2k".as_ref()).threads(2).run().await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod arrive;
mod at;
mod behind;
mod cache;
mod chunker;
mod claims;
mod error;
mod fsutil;
#[doc(hidden)]
pub mod fuzzing;
mod gc;
mod http;
mod id;
mod index;
mod listing;
mod pack;
mod progress;
mod pull;
mod push;
mod rebuild;
mod remote;
mod repo;
pub mod reuse;
mod run_as;
mod seen;
mod snapshot;
mod verify;
mod version;

pub use at::{empty_tree_as, remove_tree};
pub use behind::{CacheWrites, CacheWritten, BEHIND_MAX_MIB};
pub use cache::{CacheStatus, CachedSnapshot, NodeCache, PackPeers, PeerEvent, PullHold};
pub use chunker::{ChunkerParams, StreamChunker, ALGORITHM};
pub use claims::{Claim, ConditionalWrites};
pub use error::{Error, Result};
pub use fsutil::{
    as_user, blocking, disk_space, off_runtime, utc_offset, write_atomic, write_atomic_mode,
};
pub use gc::{condemned_packs, gc, GcOutcome};
pub use id::{ChunkId, PackId, SnapshotId};
pub use index::{Index, IndexPack};
pub use pack::{
    Codec, PackBuilder, PackEntry, SealedPack, FLAG_LZ4, FLAG_TREE, FLAG_ZSTD, MAX_FILE_CHUNK,
    MAX_TREE_CHUNK,
};
pub use progress::{NoProgress, Progress};
pub use pull::{snapshot_packs, warm, Pull, PullOptions, PullOutcome};
pub use push::{push, PushOptions, PushOutcome};
pub use remote::{ObjectInfo, Remote};
pub use repo::{
    validate_name, IndexMemo, Provenance, RefSpec, Repo, StoreConfig, VersionRecord, FORMAT,
    GC_GRACE_FLOOR_SECS, MAX_CONFIG_OBJECT, MAX_INDEX_OBJECT, MAX_RECORD_OBJECT,
    MAX_SNAPSHOT_OBJECT, MAX_TREE_BYTES,
};
pub use run_as::RunAs;
pub use seen::SeenVersions;
pub use snapshot::{
    allowed_mode, decode_segment, diff, encode_segment, validate_entries, Changes, Entry, Kind,
    SegmentRef, SnapshotObject,
};
pub use verify::{verify, VerifyReport};

/// Pack key of a pack id (`packs/<hh>/<id>`), for tools and tests that look at the store.
pub fn pack_key(id: &PackId) -> String {
    repo::pack_key(id)
}
