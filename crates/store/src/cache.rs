//! The node cache: packs fetched from the store, kept under a size cap with
//! LRU eviction over whole snapshots. Pinned snapshots are never evicted.
//!
//! ```text
//! <root>/packs-v1/<hh>/<pack id>   cached packs (hard links when the store is a local folder)
//! <root>/state-v1.json             which snapshots are cached, their packs, last use, pins
//! <root>/files-v1/                 push's files caches
//! <root>/index-v1/<store id>/      copies of immutable index objects of remote stores
//! <root>/lock                      serialises state updates between processes
//! ```
//! Every chunk read from a cached pack is verified against its id before use,
//! so a corrupt cache costs a re-fetch, never a corrupt file.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::arrive::Arrivals;
pub(crate) use crate::arrive::Fresh;
use crate::behind::CacheWrites;
use crate::error::{Error, Result};
use crate::fsutil::{blocking, tmp_name, write_atomic, write_atomic_direct};
use crate::id::{PackId, SnapshotId};
use crate::index::IndexPack;
use crate::pack::PackEntry;
use crate::pack::MAX_PACK_BYTES;
use crate::progress::Progress;
use crate::repo::{now_secs, pack_key, Repo};

/// Where pulls hold the snapshots they read ([`NodeCache::hold`]).
const PULLING: &str = "pulling";

/// A pull's hold on a snapshot ([`NodeCache::hold`]), given back when
/// dropped.
#[derive(Debug)]
pub struct PullHold {
    _file: std::fs::File,
    path: PathBuf,
}

impl Drop for PullHold {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One cached snapshot.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CachedSnapshot {
    /// `name@vN` when it was last used.
    pub label: String,
    /// The store it came from.
    pub store: String,
    /// Its packs and their sizes.
    pub packs: Vec<(PackId, u64)>,
    /// Last use, seconds since the Unix epoch.
    pub last_used: i64,
    /// Pinned snapshots are never evicted.
    pub pinned: bool,
}

#[derive(Default, Serialize, Deserialize)]
struct State {
    snapshots: BTreeMap<SnapshotId, CachedSnapshot>,
    /// Packs found corrupt here and removed ([`NodeCache::drop_pack`]):
    /// the node says it lacks them until they are cached again.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    dropped: BTreeSet<PackId>,
}

impl State {
    fn used(&self) -> u64 {
        let mut seen = HashSet::new();
        self.snapshots
            .values()
            .flat_map(|s| s.packs.iter())
            .filter(|(p, _)| seen.insert(*p))
            .map(|(_, n)| n)
            .sum()
    }
}

/// What `cache status` shows.
#[derive(Clone, Debug, Serialize)]
pub struct CacheStatus {
    /// The cache folder.
    pub root: PathBuf,
    /// The cap in bytes.
    pub max_bytes: u64,
    /// Bytes of cached packs owned by snapshots.
    pub used_bytes: u64,
    /// Cached snapshots, most recently used first.
    pub snapshots: Vec<(SnapshotId, CachedSnapshot, u64)>,
    /// Packs found corrupt and removed, not cached again since.
    pub dropped: Vec<PackId>,
}

/// (packs checked, chunks checked, corrupt packs with the reason).
pub type CacheVerify = (u64, u64, Vec<(PackId, String)>);

/// What happened to one pack fetched through [`PackPeers`].
#[derive(Clone, Debug, PartialEq)]
pub enum PeerEvent {
    /// Verified and cached, from `peer`.
    FromPeer {
        /// The peer.
        peer: String,
        /// Its bytes.
        bytes: u64,
    },
    /// Fetched from the object store (no peer had it, or none gave it).
    FromStore {
        /// Its bytes.
        bytes: u64,
    },
    /// `peer` sent bytes that do not match the pack's id or its chunks'
    /// ids: refused, never cached.
    Corrupt {
        /// The peer.
        peer: String,
        /// The pack.
        pack: PackId,
        /// What was wrong.
        why: String,
    },
    /// A whole fetch is done: bytes from each source, and its wall time
    /// (several packs at a time, so the rates a node can take in).
    Fetched {
        /// Bytes from peers.
        from_peers: u64,
        /// Bytes from the store.
        from_store: u64,
        /// Seconds it took.
        secs: f64,
    },
    /// `peer` did not deliver it (gone, timed out, no longer has it).
    Failed {
        /// The peer.
        peer: String,
        /// The pack.
        pack: PackId,
        /// Why.
        why: String,
    },
}

/// Other nodes a cache can fetch packs from before the object store (labd
/// in a cluster implements it over its peers' pack routes). Every pack a
/// peer sends is checked against its id and every chunk's before it is
/// cached; a peer that fails or lies costs a try elsewhere.
pub trait PackPeers: Send + Sync {
    /// Learns which peers hold which of `packs` (one question for all,
    /// before they are fetched).
    fn locate<'a>(&'a self, packs: &'a [PackId]) -> futures::future::BoxFuture<'a, ()>;
    /// The peers holding `pack`, as located.
    fn holders(&self, pack: &PackId) -> Vec<String>;
    /// The pack's bytes from `peer`, unverified.
    fn get<'a>(
        &'a self,
        peer: &'a str,
        pack: &'a PackId,
    ) -> futures::future::BoxFuture<'a, std::result::Result<Bytes, String>>;
    /// What happened, for the node's counters and log.
    fn report(&self, event: PeerEvent);
}

/// A node's cache folder.
#[derive(Clone)]
pub struct NodeCache {
    root: PathBuf,
    max_bytes: u64,
    /// Where packs are looked for before the object store.
    peers: Option<Arc<dyn PackPeers>>,
}

impl std::fmt::Debug for NodeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCache")
            .field("root", &self.root)
            .field("max_bytes", &self.max_bytes)
            .field("peers", &self.peers.is_some())
            .finish()
    }
}

impl NodeCache {
    /// Opens (creating) the cache at `root` with a cap of `max_bytes`.
    pub fn open(root: &Path, max_bytes: u64) -> Result<NodeCache> {
        std::fs::create_dir_all(root.join("packs-v1"))
            .map_err(Error::io("create cache directory", root))?;
        Ok(NodeCache {
            root: root.to_path_buf(),
            max_bytes,
            peers: None,
        })
    }

    /// The same cache, fetching from `peers` before the object store.
    pub fn with_peers(mut self, peers: Arc<dyn PackPeers>) -> NodeCache {
        self.peers = Some(peers);
        self
    }

    /// Whether packs may come from peers here.
    pub(crate) fn has_peers(&self) -> bool {
        self.peers.is_some()
    }

    /// The cache folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where push keeps its files caches.
    pub fn files_cache_dir(&self) -> PathBuf {
        self.root.join("files-v1")
    }

    /// This user's memory of the versions of store `store_id` they have
    /// used (see [`crate::SeenVersions`]): per uid, so users sharing a
    /// cache never share it.
    pub fn seen_versions(&self, store_id: &str) -> crate::SeenVersions {
        crate::SeenVersions::in_cache(&self.root, store_id)
    }

    /// Where index objects of a remote store are copied.
    pub fn index_dir(&self, store_id: &str) -> PathBuf {
        self.root.join("index-v1").join(store_id)
    }

    /// The cached file of a pack.
    pub fn pack_path(&self, id: &PackId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join("packs-v1").join(&hex[..2]).join(hex)
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let lock_path = self.root.join("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(Error::io("open", &lock_path))?;
        lock.lock().map_err(Error::io("lock", &lock_path))?;
        let path = self.root.join("state-v1.json");
        let mut state: State = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                Error::corrupt(format!("cache state {}", path.display()), e.to_string())
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(Error::io("read", &path)(e)),
        };
        let out = f(&mut state)?;
        write_atomic(
            &path,
            &serde_json::to_vec_pretty(&state).expect("state serialises"),
        )?;
        Ok(out)
    }

    /// Records that `snapshot` is (being) cached and used now. Call before
    /// fetching its packs, so an interrupted pull keeps what it fetched.
    /// `packs` join those it already has: a pull into an up-to-date folder
    /// needs none, and an admin's warm (or pin) keeps all of them.
    pub fn touch(
        &self,
        snapshot: SnapshotId,
        label: &str,
        store: &str,
        packs: Vec<(PackId, u64)>,
    ) -> Result<()> {
        self.with_state(|s| {
            let e = s
                .snapshots
                .entry(snapshot)
                .or_insert_with(|| CachedSnapshot {
                    label: label.to_string(),
                    store: store.to_string(),
                    packs: Vec::new(),
                    last_used: 0,
                    pinned: false,
                });
            e.label = label.to_string();
            for (p, size) in packs {
                if !e.packs.iter().any(|(q, _)| *q == p) {
                    e.packs.push((p, size));
                }
            }
            e.last_used = now_secs();
            s.dropped.retain(|p| !self.pack_path(p).exists());
            Ok(())
        })
    }

    /// Fetches the packs that are not cached yet; returns (packs, bytes) fetched.
    /// A local store's packs are hard-linked (copied across file systems).
    pub async fn fetch_packs(
        &self,
        repo: &Repo,
        packs: &[(PackId, u64)],
        progress: &Arc<dyn Progress>,
    ) -> Result<(u64, u64)> {
        self.fetch_packs_then(repo, packs, progress, None, None)
            .await
    }

    /// [`NodeCache::fetch_packs`], in about the order given, telling
    /// `arrivals` of each pack: offered from memory as soon as it is
    /// fetched (and checked, from a peer), then once it is in the cache, so
    /// files can be written while the rest arrive. With `behind`, packs
    /// from peers are written to the cache later ([`crate::behind`]).
    pub(crate) async fn fetch_packs_then(
        &self,
        repo: &Repo,
        packs: &[(PackId, u64)],
        progress: &Arc<dyn Progress>,
        arrivals: Option<&Arc<Arrivals>>,
        behind: Option<&CacheWrites>,
    ) -> Result<(u64, u64)> {
        let (missing, present): (Vec<_>, Vec<_>) = packs
            .iter()
            .copied()
            .partition(|(p, _)| !self.pack_path(p).exists());
        // Cached since the caller looked (another pull's): there already.
        if let Some(a) = arrivals {
            for (p, _) in &present {
                a.arrived(*p);
            }
        }
        let total: u64 = missing.iter().map(|(_, n)| *n).fold(0, u64::saturating_add);
        let needed = self.space_for_packs(repo, total);
        if let Some(available) = crate::fsutil::free_space(&self.root) {
            if available < needed {
                return Err(Error::NoSpace {
                    path: self.root.clone(),
                    needed,
                    available,
                });
            }
        }
        progress.phase("fetch", Some(total), Some(missing.len() as u64));
        // Buffers of packs that left memory serve the next fetches.
        let _reuse = crate::reuse::Fetching::start();
        if let Some(peers) = &self.peers {
            let ids: Vec<PackId> = missing.iter().map(|(p, _)| *p).collect();
            if !ids.is_empty() {
                let t = std::time::Instant::now();
                peers.locate(&ids).await;
                tracing::debug!(
                    "located {} packs at peers in {:.3} s",
                    ids.len(),
                    t.elapsed().as_secs_f64()
                );
            }
        }
        // Futures collected before streaming them: a closure inside the
        // stream made the whole future non-`Send` for tokio::spawn
        // ("FnOnce is not general enough", rust-lang/rust#102211).
        let fetches: Vec<_> = missing
            .iter()
            .map(|(p, n)| async move {
                let _slot = FETCHING.acquire().await.expect("never closed");
                let (size, from_peer) = match self.fetch_from_peers(p, arrivals, behind).await? {
                    Some(size) => (size, true),
                    None => {
                        let size = self
                            .fetch_pack_bytes(repo, p, arrivals.map(|a| &**a))
                            .await?;
                        if let Some(peers) = &self.peers {
                            peers.report(PeerEvent::FromStore { bytes: size });
                        }
                        (size, false)
                    }
                };
                if let Some(a) = arrivals {
                    a.arrived(*p);
                }
                progress.advance(*n, 1);
                Ok::<_, Error>((size, from_peer))
            })
            .collect();
        let started = std::time::Instant::now();
        // What was read, not what the index claims (anyone may write an index).
        // Eight at a time: with four, a 1 GB pull from a peer on loopback
        // left the disk and both CPUs half idle (2.1 s against 1.4 s);
        // sixteen were no faster.
        let fetched: Vec<(u64, bool)> = futures::stream::iter(fetches)
            .buffer_unordered(FETCHES_AT_ONCE)
            .try_collect()
            .await?;
        let from_peers: u64 = fetched.iter().filter(|f| f.1).map(|f| f.0).sum();
        let total: u64 = fetched.iter().map(|f| f.0).sum();
        if let Some(peers) = self.peers.as_ref().filter(|_| !fetched.is_empty()) {
            peers.report(PeerEvent::Fetched {
                from_peers,
                from_store: total - from_peers,
                secs: started.elapsed().as_secs_f64(),
            });
        }
        Ok((missing.len() as u64, total))
    }

    /// Bytes fetching `total` bytes of packs takes in the cache: none when
    /// the store is a local folder on the cache's file system (hard links).
    pub(crate) fn space_for_packs(&self, repo: &Repo, total: u64) -> u64 {
        let linked = repo.remote().local_path("packs").is_some_and(|p| {
            let dev = crate::fsutil::device_of(&p);
            dev.is_some() && dev == crate::fsutil::device_of(&self.root)
        });
        if linked {
            0
        } else {
            total
        }
    }

    /// Fetches a pack from the peers that hold it, each pack starting at a
    /// different one (so a fetch spreads over them), each copy verified
    /// whole before it is cached (and offered to `arrivals` before it is
    /// written there, or kept there until it is written `behind`, or, when
    /// `behind` can rebuild it from the pull's files, kept there only
    /// while its files need it); its size, `None` when no peer gave a
    /// good copy.
    async fn fetch_from_peers(
        &self,
        id: &PackId,
        arrivals: Option<&Arc<Arrivals>>,
        behind: Option<&CacheWrites>,
    ) -> Result<Option<u64>> {
        let Some(peers) = &self.peers else {
            return Ok(None);
        };
        let holders = peers.holders(id);
        if holders.is_empty() {
            return Ok(None);
        }
        let first = id.as_bytes()[0] as usize % holders.len();
        for k in 0..holders.len() {
            let peer = &holders[(first + k) % holders.len()];
            let bytes = match peers.get(peer, id).await {
                Ok(b) => b,
                Err(why) => {
                    peers.report(PeerEvent::Failed {
                        peer: peer.clone(),
                        pack: *id,
                        why,
                    });
                    continue;
                }
            };
            let (pack, b) = (*id, bytes.clone());
            let checked = blocking(move || verified_entries(&b, &pack)).await;
            match checked {
                Ok(entries) => {
                    let size = bytes.len() as u64;
                    let dest = self.pack_path(id);
                    let fresh = || Fresh {
                        bytes: bytes.clone(),
                        verified: Some(entries.iter().map(|e| (e.id, *e)).collect()),
                    };
                    match (arrivals, behind) {
                        (Some(a), Some(w)) => match w.recipe(&bytes, &entries) {
                            // Its files' bytes: it leaves memory with them,
                            // and its copy is rebuilt from them.
                            Some(recipe) if a.offer_rebuilt(*id, fresh()) => {
                                w.defer_rebuilt(*id, dest, recipe, a.clone());
                            }
                            _ => {
                                a.offer_pending(*id, fresh());
                                w.defer(*id, dest, bytes, a.clone()).await;
                            }
                        },
                        (a, _) => {
                            if let Some(a) = a {
                                a.offer(*id, fresh());
                            }
                            blocking(move || write_atomic_direct(&dest, &bytes)).await?;
                        }
                    }
                    peers.report(PeerEvent::FromPeer {
                        peer: peer.clone(),
                        bytes: size,
                    });
                    return Ok(Some(size));
                }
                Err(e @ Error::Corrupt { .. }) => peers.report(PeerEvent::Corrupt {
                    peer: peer.clone(),
                    pack: *id,
                    why: e.to_string(),
                }),
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Fetches one pack, replacing any cached copy; returns its size.
    pub async fn fetch_pack(&self, repo: &Repo, id: &PackId) -> Result<u64> {
        self.fetch_pack_bytes(repo, id, None).await
    }

    /// [`NodeCache::fetch_pack`], offering the pack to `arrivals` before
    /// it is written to the cache when it passed through memory (not when
    /// hard-linked from a local store on the cache's file system).
    async fn fetch_pack_bytes(
        &self,
        repo: &Repo,
        id: &PackId,
        arrivals: Option<&Arrivals>,
    ) -> Result<u64> {
        let dest = self.pack_path(id);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
        }
        let key = pack_key(id);
        if let Some(src) = repo.remote().local_path(&key) {
            let (tmp, to) = (tmp_name(&dest), dest.clone());
            let linked = blocking(move || {
                if std::fs::hard_link(&src, &tmp).is_err() {
                    return Ok(None);
                }
                let size = std::fs::metadata(&tmp).map_or(0, |m| m.len());
                if let Err(e) = std::fs::rename(&tmp, &to) {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(Error::io("rename into place", &to)(e));
                }
                Ok(Some(size))
            })
            .await?;
            if let Some(size) = linked {
                return Ok(size);
            }
            // On another file system (a second disk, an NFS mount), or not
            // ours to link: read like any store's, through memory, so the
            // files are written from it while it goes to the cache. Copied
            // file to file, the files were read back from the new copy
            // with O_DIRECT, which first wrote it all to the disk: a pull
            // from a store on a tmpfs took 2.8 s against rsync's 1.2 s.
        }
        let bytes = repo.remote().get_at_most(&key, MAX_PACK_BYTES).await?;
        let size = bytes.len() as u64;
        if let Some(a) = arrivals {
            // Unchecked as yet: each chunk is, as it is read.
            let fresh = Fresh {
                bytes: bytes.clone(),
                verified: None,
            };
            a.offer(*id, fresh);
        }
        blocking(move || write_atomic_direct(&dest, &bytes)).await?;
        Ok(size)
    }

    /// The index record of a cached pack, from its own footer; `None` when
    /// the pack is not cached or its footer is damaged.
    pub fn footer_record(&self, id: &PackId) -> Option<IndexPack> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(self.pack_path(id)).ok()?;
        let size = f.metadata().ok()?.len();
        if size > MAX_PACK_BYTES {
            return None;
        }
        let tl = crate::pack::trailer_len() as u64;
        let mut trailer = vec![0; tl as usize];
        f.read_exact_at(&mut trailer, size.checked_sub(tl)?).ok()?;
        let flen = crate::pack::parse_trailer(&trailer, id).ok()? as u64;
        let start = (size - tl).checked_sub(flen)?;
        let mut footer = vec![0; flen as usize];
        f.read_exact_at(&mut footer, start).ok()?;
        let entries = crate::pack::parse_footer(&footer, &trailer, size, id).ok()?;
        Some(IndexPack::new(*id, size, &entries))
    }

    /// Drops a cached pack (after corruption was found in it).
    pub fn forget_pack(&self, id: &PackId) {
        let _ = std::fs::remove_file(self.pack_path(id));
    }

    /// Drops a cached pack found corrupt here, and says so in the cache's
    /// state ([`CacheStatus::dropped`]): a node then stops telling its
    /// peers it holds the pack, and the snapshots it belongs to are no
    /// longer whole, until it is fetched again.
    pub fn drop_pack(&self, id: &PackId) -> Result<()> {
        self.forget_pack(id);
        self.with_state(|s| {
            s.dropped.insert(*id);
            Ok(())
        })
    }

    /// Holds `snapshot` while a pull (or warm) reads it: no eviction, in
    /// this process or another on the node, takes it until the hold is
    /// dropped. A pull that finished first evicted the least recently used
    /// snapshot, which could be the one another pull was still reading;
    /// that pull then failed blaming the store. The hold is a file under
    /// `pulling/`, locked shared for its life: a holder that crashed holds
    /// nothing.
    pub fn hold(&self, snapshot: SnapshotId) -> Result<PullHold> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = self.root.join(PULLING);
        std::fs::create_dir_all(&dir).map_err(Error::io("create", &dir))?;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{snapshot}.{}.{n}", std::process::id());
        // Locked before it gets its name: an evictor never finds it
        // unlocked and takes it for a crashed holder's.
        let tmp = dir.join(format!(".{name}"));
        let file = std::fs::File::create(&tmp).map_err(Error::io("create", &tmp))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockShared)
            .map_err(|e| Error::io("lock", &tmp)(e.into()))?;
        let path = dir.join(name);
        std::fs::rename(&tmp, &path).map_err(Error::io("rename", &tmp))?;
        Ok(PullHold { _file: file, path })
    }

    /// Snapshots some pull holds now ([`NodeCache::hold`]); the files of
    /// holders that are gone are removed.
    fn held(&self) -> HashSet<SnapshotId> {
        let dir = self.root.join(PULLING);
        let mut held = HashSet::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.split('.').next().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let Ok(f) = std::fs::File::open(e.path()) else {
                continue;
            };
            let free = rustix::fs::FlockOperation::NonBlockingLockExclusive;
            match rustix::fs::flock(&f, free) {
                Ok(()) => {
                    let _ = std::fs::remove_file(e.path());
                }
                Err(_) => {
                    held.insert(id);
                }
            }
        }
        held
    }

    /// Evicts least recently used unpinned snapshots until the cache holds at
    /// most `target` bytes, never `keep` nor one a pull holds
    /// ([`NodeCache::hold`]). Returns the evicted labels.
    pub fn evict_to(&self, target: u64, keep: Option<SnapshotId>) -> Result<Vec<String>> {
        let held = self.held();
        let (evicted, live) = self.with_state(|s| {
            let mut order: Vec<(i64, SnapshotId)> = s
                .snapshots
                .iter()
                .filter(|(id, c)| !c.pinned && Some(**id) != keep && !held.contains(id))
                .map(|(id, c)| (c.last_used, *id))
                .collect();
            order.sort();
            let mut evicted = Vec::new();
            for (_, id) in order {
                if s.used() <= target {
                    break;
                }
                if let Some(c) = s.snapshots.remove(&id) {
                    evicted.push(c.label);
                }
            }
            let live: HashSet<PackId> = s
                .snapshots
                .values()
                .flat_map(|c| c.packs.iter().map(|(p, _)| *p))
                .collect();
            Ok((evicted, live))
        })?;
        self.remove_unowned(&live)?;
        Ok(evicted)
    }

    /// Applies the cap after a pull.
    pub fn enforce_cap(&self, keep: Option<SnapshotId>) -> Result<Vec<String>> {
        self.evict_to(self.max_bytes, keep)
    }

    fn remove_unowned(&self, live: &HashSet<PackId>) -> Result<()> {
        /// A temporary file younger than this may still be being written.
        const IN_FLIGHT: std::time::Duration = std::time::Duration::from_secs(3600);
        let in_flight = |f: &std::fs::DirEntry| {
            f.file_name().to_string_lossy().starts_with(".labsync-tmp.")
                && f.metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age < IN_FLIGHT)
        };
        let dir = self.root.join("packs-v1");
        for fan in std::fs::read_dir(&dir)
            .map_err(Error::io("list", &dir))?
            .flatten()
        {
            for f in std::fs::read_dir(fan.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = f.file_name();
                let keep = name
                    .to_str()
                    .and_then(|n| n.parse::<PackId>().ok())
                    .is_some_and(|p| live.contains(&p));
                // A pack another pull is writing right now (its temporary
                // name): removing it failed that pull's rename ("No such
                // file"). Only a leftover of a killed process goes.
                if !keep && !in_flight(&f) {
                    let _ = std::fs::remove_file(f.path());
                }
            }
        }
        Ok(())
    }

    /// Pins or unpins a cached snapshot.
    pub fn set_pinned(&self, snapshot: SnapshotId, pinned: bool) -> Result<()> {
        self.with_state(|s| match s.snapshots.get_mut(&snapshot) {
            Some(c) => {
                c.pinned = pinned;
                Ok(())
            }
            None => Err(Error::NotFound {
                what: format!("snapshot {} in the node cache", snapshot.short()),
                hint: "; pull or pin it first".into(),
            }),
        })
    }

    /// What the cache holds.
    pub fn status(&self) -> Result<CacheStatus> {
        self.with_state(|s| {
            let mut snaps: Vec<(SnapshotId, CachedSnapshot, u64)> = s
                .snapshots
                .iter()
                .map(|(id, c)| (*id, c.clone(), c.packs.iter().map(|p| p.1).sum()))
                .collect();
            snaps.sort_by_key(|(_, c, _)| -c.last_used);
            // Those cached again since no longer count as dropped.
            let dropped = (s.dropped.iter())
                .filter(|p| !self.pack_path(p).exists())
                .copied()
                .collect();
            Ok(CacheStatus {
                root: self.root.clone(),
                max_bytes: self.max_bytes,
                used_bytes: s.used(),
                snapshots: snaps,
                dropped,
            })
        })
    }

    /// Re-hashes every chunk of every cached pack (of `only`, when given).
    /// Corrupt packs are removed from the cache, to be fetched again on next
    /// use. Returns (packs checked, chunks checked, corrupt pack ids).
    pub fn verify(
        &self,
        only: Option<&HashSet<PackId>>,
        progress: &dyn Progress,
    ) -> Result<CacheVerify> {
        let dir = self.root.join("packs-v1");
        let mut files = Vec::new();
        for fan in std::fs::read_dir(&dir)
            .map_err(Error::io("list", &dir))?
            .flatten()
        {
            for f in std::fs::read_dir(fan.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Some(id) = f
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<PackId>().ok())
                {
                    if only.is_none_or(|o| o.contains(&id)) {
                        files.push((id, f.path(), f.metadata().map(|m| m.len()).unwrap_or(0)));
                    }
                }
            }
        }
        progress.phase(
            "verify cache",
            Some(files.iter().map(|f| f.2).sum()),
            Some(files.len() as u64),
        );
        let (mut chunks, mut bad) = (0u64, Vec::new());
        for (id, path, size) in &files {
            let mut bytes = Vec::new();
            std::fs::File::open(path)
                .and_then(|mut f| f.read_to_end(&mut bytes))
                .map_err(Error::io("read", path))?;
            match verify_pack_bytes(&bytes, id) {
                Ok(n) => chunks += n,
                Err(e) => {
                    bad.push((*id, e.to_string()));
                    self.drop_pack(id)?;
                }
            }
            progress.advance(*size, 1);
        }
        Ok((files.len() as u64, chunks, bad))
    }
}

/// Checks every chunk of a pack held in memory; returns the chunk count.
pub fn verify_pack_bytes(bytes: &[u8], id: &PackId) -> Result<u64> {
    Ok(verified_entries(bytes, id)?.len() as u64)
}

/// [`verify_pack_bytes`], giving the pack's entries, each checked.
fn verified_entries(bytes: &[u8], id: &PackId) -> Result<Vec<PackEntry>> {
    if !crate::pack::id_covers_footer_only(bytes) && PackId::of(bytes) != *id {
        return Err(Error::corrupt(
            format!("pack {id}"),
            "content does not match its BLAKE3 id",
        ));
    }
    let entries = crate::pack::read_entries(bytes, id)?;
    for e in &entries {
        let stored = bytes
            .get(e.offset as usize..e.offset as usize + e.stored_len as usize)
            .ok_or_else(|| Error::corrupt(format!("pack {id}"), "entry past the end"))?;
        e.decode(stored, id)?;
    }
    Ok(entries)
}

/// Keeps open file handles on cached packs for one materialising thread.
///
/// Large chunks are read with `O_DIRECT` into the caller's reused buffer: a
/// pull would otherwise pull every pack through the page cache next to the
/// files it writes, doubling the memory it churns (and on VMs whose balloon
/// returns freed pages to the host, each fresh page-cache page costs a host
/// fault: a 1 GB pull of packs not yet cached took 1.7 s instead of 0.35 s).
/// Small chunks stay buffered, where the kernel's read-ahead serves a run of
/// them from one disk read.
pub(crate) struct PackReader<'a> {
    cache: &'a NodeCache,
    open: HashMap<PackId, std::fs::File>,
    direct: HashMap<PackId, Option<std::fs::File>>,
    /// Packs of a pull just fetched into memory, read there first.
    fresh: Option<&'a Arrivals>,
}

/// Packs fetched at once by a pull or a warm (at most 64 MiB each).
const FETCHES_AT_ONCE: usize = 8;

/// Packs in flight in the whole process, every pull and warm together:
/// what labd holds of them in memory stays bounded whatever number of jobs
/// and data sets are being prepared at once (with the buffers kept for
/// the next fetch while fetches run, [`crate::reuse`], as many).
static FETCHING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(16);

/// Chunks at least this large are read with `O_DIRECT`.
const DIRECT_READ_MIN: u32 = 128 << 10;

impl<'a> PackReader<'a> {
    pub(crate) fn new(cache: &'a NodeCache) -> Self {
        PackReader {
            cache,
            open: HashMap::new(),
            direct: HashMap::new(),
            fresh: None,
        }
    }

    /// Reads packs a pull holds in memory there, the others from the cache.
    pub(crate) fn with_fresh(mut self, arrivals: &'a Arrivals) -> Self {
        self.fresh = Some(arrivals);
        self
    }

    /// Gives `f` the plain bytes of the chunk `entry` locates in `pack`,
    /// verified (from memory when the pull holds the pack there, else read
    /// from the cache into `buf`).
    pub(crate) fn with_plain<T>(
        &mut self,
        pack: &PackId,
        entry: &PackEntry,
        buf: &mut Vec<u8>,
        f: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<T> {
        if let Some(fresh) = self.fresh.and_then(|a| a.fresh(pack)) {
            return f(&fresh.plain(pack, entry)?);
        }
        let stored = self.read(pack, entry.offset, entry.stored_len, buf)?;
        // Verified before a single byte reaches the caller.
        f(&entry.decode(stored, pack)?)
    }

    /// Reads `len` stored bytes at `offset` of a cached pack, into `buf`;
    /// returns them.
    pub(crate) fn read<'b>(
        &mut self,
        pack: &PackId,
        offset: u64,
        len: u32,
        buf: &'b mut Vec<u8>,
    ) -> Result<&'b [u8]> {
        use std::os::unix::fs::FileExt;
        if len >= DIRECT_READ_MIN {
            if let Some(at) = self.read_direct(pack, offset, len, buf) {
                return Ok(&buf[at..at + len as usize]);
            }
        }
        if !self.open.contains_key(pack) {
            if self.open.len() >= 64 {
                self.open.clear();
            }
            let path = self.cache.pack_path(pack);
            let f = std::fs::File::open(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    Error::corrupt(format!("pack {pack}"), "missing from the node cache")
                }
                _ => Error::io("open", &path)(e),
            })?;
            self.open.insert(*pack, f);
        }
        buf.resize(len as usize, 0);
        let f = &self.open[pack];
        f.read_exact_at(buf, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                Error::corrupt(format!("pack {pack}"), "truncated in the node cache")
            }
            _ => Error::io("read", self.cache.pack_path(pack))(e),
        })?;
        Ok(&buf[..])
    }

    /// The aligned read around the wanted bytes; returns where they start in
    /// `buf`, or `None` for anything unusual (no `O_DIRECT`, a short read, an
    /// error), which the buffered path then reads again and reports.
    fn read_direct(
        &mut self,
        pack: &PackId,
        offset: u64,
        len: u32,
        buf: &mut Vec<u8>,
    ) -> Option<usize> {
        use crate::fsutil::{aligned_window, open_direct, DIRECT_ALIGN};
        use std::os::unix::fs::FileExt;
        if !self.direct.contains_key(pack) {
            if self.direct.len() >= 64 {
                self.direct.clear();
            }
            let f = open_direct(&self.cache.pack_path(pack));
            self.direct.insert(*pack, f);
        }
        let f = self.direct[pack].as_ref()?;
        let align = DIRECT_ALIGN as u64;
        let from = offset - offset % align;
        let wanted = (offset + len as u64 - from) as usize;
        let window = wanted.next_multiple_of(DIRECT_ALIGN);
        let start = aligned_window(buf, window)?;
        // One read; at the end of the file it returns less than the window.
        let n = f.read_at(&mut buf[start..start + window], from).ok()?;
        (n >= wanted).then_some(start + (offset - from) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ChunkId;
    use crate::pack::PackBuilder;

    /// A pack checked on arrival is trusted only where the index's entry is
    /// the pack's own: an index naming one chunk at another's place is
    /// caught by the hash, as it would be read from the cache.
    #[test]
    fn a_fresh_pack_vouches_only_for_its_own_entries() {
        let (a, b) = (vec![1u8; 5000], vec![2u8; 5000]);
        let mut builder = PackBuilder::with_capacity(1 << 16);
        builder.add(ChunkId::of(&a), &a, a.len() as u32, 0);
        builder.add(ChunkId::of(&b), &b, b.len() as u32, 0);
        let sealed = builder.seal();
        let entries = verified_entries(&sealed.bytes, &sealed.id).unwrap();
        let fresh = Fresh {
            bytes: Bytes::from(sealed.bytes.clone()),
            verified: Some(entries.iter().map(|e| (e.id, *e)).collect()),
        };
        let (ea, eb) = (entries[0], entries[1]);
        assert_eq!(&*fresh.plain(&sealed.id, &ea).unwrap(), &a[..]);
        assert_eq!(&*fresh.plain(&sealed.id, &eb).unwrap(), &b[..]);
        // The index says chunk a lies where b does.
        let lying = PackEntry {
            offset: eb.offset,
            ..ea
        };
        let e = fresh.plain(&sealed.id, &lying).unwrap_err();
        assert!(
            e.to_string().contains("does not match its BLAKE3 id"),
            "{e}"
        );
        // Nothing checked on arrival (from the store): every chunk is hashed.
        let unchecked = Fresh {
            bytes: Bytes::from(sealed.bytes),
            verified: None,
        };
        assert_eq!(&*unchecked.plain(&sealed.id, &eb).unwrap(), &b[..]);
        assert!(unchecked.plain(&sealed.id, &lying).is_err());
    }
}
