//! An opened store: its config, index, snapshots and refs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::chunker::{ChunkerParams, ALGORITHM};
use crate::claims::ConditionalWrites;
use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId, SnapshotId};
use crate::index::{self, Index, IndexPack};
use crate::pack::{self, PackEntry};
use crate::remote::Remote;
use crate::snapshot::{self, Entry, SnapshotObject};
pub(crate) use crate::version::version_key;
pub use crate::version::{Provenance, VersionRecord};

/// Version of the store layout this code reads and writes.
pub const FORMAT: u32 = 1;
const CONFIG_KEY: &str = "config";

/// The store's `config` object, written once when the store is created.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreConfig {
    /// Store layout version.
    pub format: u32,
    /// Random id, so caches of different stores never mix.
    pub id: String,
    /// `fastcdc-v2020`.
    pub chunker: String,
    /// Chunk sizes.
    pub params: ChunkerParams,
    /// `blake3`.
    pub hash: String,
    /// Target pack size in bytes.
    pub pack_size: u32,
    /// Unreferenced data younger than this is never deleted by `gc`.
    pub gc_grace_secs: u64,
    /// What the server did with a conditional create when the store was
    /// made, and so how keys that must not exist are created. Absent in
    /// stores made before labsync asked: they assumed it honoured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditional_writes: Option<ConditionalWrites>,
}

/// The shortest grace period gc and pushes take, whatever the store's
/// `config` says: any member can write `config`, and a grace of 0 would
/// make an honest gc delete the packs of pushes still running.
pub const GC_GRACE_FLOOR_SECS: u64 = 3600;

impl StoreConfig {
    /// The grace period gc and pushes go by: the config's, never below
    /// [`GC_GRACE_FLOOR_SECS`].
    pub fn gc_grace(&self) -> u64 {
        self.gc_grace_secs.max(GC_GRACE_FLOOR_SECS)
    }

    /// The defaults for a new store with the given chunk parameters.
    pub fn new(params: ChunkerParams) -> Self {
        let mut id = [0u8; 16];
        let seed = format!(
            "{:?}{}{:?}",
            SystemTime::now(),
            std::process::id(),
            std::thread::current().id()
        );
        id.copy_from_slice(&blake3::hash(seed.as_bytes()).as_bytes()[..16]);
        StoreConfig {
            format: FORMAT,
            id: id.iter().map(|b| format!("{b:02x}")).collect(),
            chunker: ALGORITHM.into(),
            params,
            hash: "blake3".into(),
            pack_size: 32 << 20,
            gc_grace_secs: 6 * 3600,
            conditional_writes: None,
        }
    }

    /// How keys that must not exist are created in this store.
    pub fn conditional_writes(&self) -> ConditionalWrites {
        self.conditional_writes
            .unwrap_or(ConditionalWrites::Honoured)
    }

    fn check(&self, url: &str) -> Result<()> {
        let bad = |d: String| Error::invalid(format!("store {url}"), d);
        if self.format != FORMAT {
            return Err(bad(format!(
                "store format {} but this labsync speaks {FORMAT}; upgrade labsync",
                self.format
            )));
        }
        if self.chunker != ALGORITHM || self.hash != "blake3" {
            return Err(bad(format!(
                "chunker {} / hash {}: this labsync only knows {ALGORITHM} / blake3",
                self.chunker, self.hash
            )));
        }
        // It names folders in every node's cache (labd's runs as root):
        // anything but the 32 hex digits a store is made with is refused.
        let hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        if self.id.len() != 32 || !self.id.chars().all(hex) {
            return Err(bad(format!(
                "store id {:?} is not 32 lowercase hex digits",
                self.id
            )));
        }
        self.params.validate()?;
        if !(16 << 20..=64 << 20).contains(&self.pack_size) {
            return Err(bad(format!(
                "pack size {} outside 16..=64 MiB",
                self.pack_size
            )));
        }
        Ok(())
    }
}

/// Checks a name: letters, digits, `._-`, and `/` between non-empty parts.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |d: &str| Err(Error::invalid(format!("name {name:?}"), d.to_string()));
    if name.is_empty() || name.len() > 200 {
        return bad("must be 1 to 200 characters");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c))
    {
        return bad("use letters, digits, '.', '_', '-' and '/' only");
    }
    if name
        .split('/')
        .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return bad("'/' must separate non-empty parts other than '.' and '..'");
    }
    Ok(())
}

/// `NAME`, `NAME@vN` or `NAME@latest`, and `NAME@vN#ID`: a version pinned
/// to the snapshot it named when it was written (labd hands a job's
/// checkpoint over so, in `LABRUN_RESUME_FROM`): a record rewritten since is
/// refused, not followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefSpec {
    /// The name.
    pub name: String,
    /// A version, or `None` for the latest.
    pub version: Option<u64>,
    /// The snapshot the version must still name.
    pub snapshot: Option<SnapshotId>,
}

impl std::str::FromStr for RefSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let (spec, snapshot) = match s.split_once('#') {
            None => (s, None),
            Some((spec, id)) => {
                let id: SnapshotId = id.parse().map_err(|_| {
                    Error::invalid(
                        format!("version {s:?}"),
                        "after '#' comes the snapshot's whole id (64 hex digits)",
                    )
                })?;
                (spec, Some(id))
            }
        };
        let (name, version) = match spec.split_once('@') {
            None => (spec, None),
            Some((n, "latest")) => (n, None),
            Some((n, v)) => {
                let num = v
                    .strip_prefix('v')
                    .unwrap_or(v)
                    .parse::<u64>()
                    .map_err(|_| {
                        Error::invalid(
                            format!("version {s:?}"),
                            "write NAME, NAME@vN, NAME@vN#SNAPSHOT or NAME@latest",
                        )
                    })?;
                (n, Some(num))
            }
        };
        if snapshot.is_some() && version.is_none() {
            return Err(Error::invalid(
                format!("version {s:?}"),
                "a snapshot id pins a version: write NAME@vN#SNAPSHOT",
            ));
        }
        validate_name(name)?;
        Ok(RefSpec {
            name: name.to_string(),
            version,
            snapshot,
        })
    }
}

impl std::fmt::Display for RefSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.version {
            Some(v) => write!(f, "{}@v{v}", self.name)?,
            None => f.write_str(&self.name)?,
        }
        match &self.snapshot {
            Some(id) => write!(f, "#{id}"),
            None => Ok(()),
        }
    }
}

pub(crate) fn pack_key(id: &PackId) -> String {
    let hex = id.to_hex();
    format!("packs/{}/{hex}", &hex[..2])
}

pub(crate) fn snapshot_key(id: &SnapshotId) -> String {
    format!("snapshots/{id}")
}

fn version_prefix(name: &str) -> String {
    format!("refs/{name}/@/")
}

pub(crate) fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// An opened, checked store.
#[derive(Clone, Debug)]
pub struct Repo {
    remote: Remote,
    config: StoreConfig,
    index_cache: Option<PathBuf>,
    /// The versions this user saw, and what each named
    /// ([`Repo::with_seen`]).
    seen: Option<std::sync::Arc<crate::seen::SeenVersions>>,
    /// The index kept between loads ([`Repo::with_index_memo`]).
    index_memo: Option<std::sync::Arc<IndexMemo>>,
    /// How often a push pins its packs; `None`: a quarter of the grace
    /// (tests pin at once).
    pin_every: Option<std::time::Duration>,
}

/// The index as a long-lived process (labd) last loaded it, and which
/// index objects it was made of: the next load lists the store's index
/// objects and reads only those it has not seen. A push every minute of
/// each of a thousand jobs' outputs read every index object each time.
#[derive(Default)]
pub struct IndexMemo {
    held: tokio::sync::Mutex<Option<HeldIndex>>,
    /// Index entries a push confirmed by their pack's footer
    /// ([`Repo::vouched`]): packs never change under their id, so an entry
    /// found true stays true while its pack is there.
    vouched: std::sync::Mutex<HashSet<u128>>,
}

/// Packs whose footers are read at once to confirm index entries.
const CONFIRMING: usize = 16;

/// Entries a process remembers as confirmed, at most (16 bytes each, a
/// million chunks' worth of the store's data in 32 MiB); past it the memory
/// is started afresh.
const MAX_VOUCHED: usize = 2 << 20;

/// One index entry as a key of [`IndexMemo::vouched`]: a hash of where it
/// says the chunk is.
fn vouch_key(pack: &PackId, e: &PackEntry) -> u128 {
    let mut h = blake3::Hasher::new();
    h.update(pack.as_bytes());
    h.update(e.id.as_bytes());
    h.update(&e.offset.to_le_bytes());
    h.update(&e.stored_len.to_le_bytes());
    h.update(&e.raw_len.to_le_bytes());
    h.update(&[e.flags]);
    u128::from_le_bytes(h.finalize().as_bytes()[..16].try_into().expect("16 bytes"))
}

impl std::fmt::Debug for IndexMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IndexMemo")
    }
}

struct HeldIndex {
    index: std::sync::Arc<Index>,
    /// The index objects it holds.
    loaded: HashSet<blake3::Hash>,
    /// Those left out (not matching their names, not decoding): not read
    /// again while the store lists them.
    refused: HashSet<blake3::Hash>,
}

/// The most a snapshot's tree may decode to: about ten million files.
pub const MAX_TREE_BYTES: u64 = 2 << 30;

/// Each kind of object is read whole only up to its bound, and refused past
/// it naming the key (see [`Remote::get_at_most`]): any member can write any
/// key, and one 50 GB object must not make every labd and client run out of
/// memory. The store's `config`: a few hundred bytes.
pub const MAX_CONFIG_OBJECT: u64 = 1 << 20;
/// A version record (`refs/…`): a few hundred bytes.
pub const MAX_RECORD_OBJECT: u64 = 1 << 20;
/// A snapshot object: its counts and one reference per tree segment of up
/// to 512 entries, about 1.5 MB at the most entries a tree may have (16 Mi).
pub const MAX_SNAPSHOT_OBJECT: u64 = 16 << 20;
/// An index object: at least 36 bytes per chunk, so about 1.8 million
/// chunks (near 2 TB of data at 1 MiB chunks). Writers split larger ones.
pub const MAX_INDEX_OBJECT: u64 = 64 << 20;

/// Where [`Repo::load_tree_into`] puts a tree's entries, in path order.
pub(crate) trait TreeSink {
    /// Room for about `entries` more, when the system grants it.
    fn room(&mut self, entries: usize);
    /// The next entries.
    fn add(&mut self, entries: Vec<Entry>) -> Result<()>;
}

impl TreeSink for Vec<Entry> {
    fn room(&mut self, entries: usize) {
        let _ = self.try_reserve_exact(entries);
    }
    fn add(&mut self, entries: Vec<Entry>) -> Result<()> {
        Extend::extend(self, entries);
        Ok(())
    }
}

impl Repo {
    /// Opens the store at `remote`, creating it with `params` when it is empty.
    /// `params` given explicitly must match an existing store's: a mismatch is
    /// an error, not a silent loss of dedup.
    pub async fn open(remote: Remote, params: Option<ChunkerParams>) -> Result<Repo> {
        let mut stored = None;
        let config = match remote.get_at_most(CONFIG_KEY, MAX_CONFIG_OBJECT).await {
            Ok(bytes) => {
                let cfg = Self::parse_config(&bytes, remote.url())?;
                stored = Some(bytes);
                cfg
            }
            Err(e) if e.is_not_found() => {
                // What the server does with conditional writes decides how
                // the config itself, and every version after it, is created.
                let mut cfg = StoreConfig::new(params.unwrap_or_default());
                let probed = remote.probe_conditional_writes().await?;
                cfg.conditional_writes = Some(probed);
                cfg.check(remote.url())?;
                let json = serde_json::to_vec_pretty(&cfg).expect("config serialises");
                let creator = remote.clone().with_conditional_writes(probed);
                if creator.create(CONFIG_KEY, json.into()).await? {
                    remote.sync().await?;
                    cfg
                } else {
                    // Another client created the store at the same moment: use theirs.
                    Self::parse_config(
                        &remote.get_at_most(CONFIG_KEY, MAX_CONFIG_OBJECT).await?,
                        remote.url(),
                    )?
                }
            }
            Err(e) => return Err(e),
        };
        let mut config = config;
        if config.conditional_writes.is_none() && remote.is_server() {
            // Made before labsync probed: ask now, once, and record it, so a
            // server that ignores conditional writes stops losing versions.
            // Best effort: a client that may only read goes on as before.
            match remote.probe_conditional_writes().await {
                Ok(probed) => {
                    config.conditional_writes = Some(probed);
                    // Into the config as stored: fields this labsync does
                    // not know, and edits by hand, stay as they are.
                    let mut doc: serde_json::Value = stored
                        .as_deref()
                        .and_then(|b| serde_json::from_slice(b).ok())
                        .unwrap_or_default();
                    if let Some(fields) = doc.as_object_mut() {
                        let answer = serde_json::to_value(probed).expect("serialises");
                        fields.insert("conditional_writes".into(), answer);
                        let json = serde_json::to_vec_pretty(&doc).expect("config serialises");
                        if let Err(e) = remote.put(CONFIG_KEY, json.into()).await {
                            tracing::warn!("cannot record conditional writes in the config: {e}");
                        }
                    }
                }
                Err(e) => tracing::warn!("cannot probe conditional writes: {e}"),
            }
        }
        let remote = remote.with_conditional_writes(config.conditional_writes());
        if let Some(p) = params {
            if p != config.params {
                return Err(Error::invalid(
                    format!("chunker parameters for store {}", remote.url()),
                    format!(
                        "the store uses {}/{}/{} (min/avg/max) but {}/{}/{} were requested; dedup only works between equal parameters",
                        config.params.min, config.params.avg, config.params.max, p.min, p.avg, p.max
                    ),
                ));
            }
        }
        Ok(Repo {
            remote,
            config,
            index_cache: None,
            seen: None,
            index_memo: None,
            pin_every: None,
        })
    }

    fn parse_config(bytes: &[u8], url: &str) -> Result<StoreConfig> {
        let cfg: StoreConfig = serde_json::from_slice(bytes)
            .map_err(|e| Error::corrupt(format!("config of store {url}"), e.to_string()))?;
        cfg.check(url)?;
        Ok(cfg)
    }

    /// How often a push pins the packs it uploaded
    /// ([`crate::gc`]'s pins): a quarter of the grace period.
    pub(crate) fn pin_every(&self) -> std::time::Duration {
        self.pin_every
            .unwrap_or_else(|| std::time::Duration::from_secs(self.config.gc_grace() / 4))
    }

    /// Pushes pin their packs every `every` (tests: at once).
    #[cfg(test)]
    pub(crate) fn with_pin_every(mut self, every: std::time::Duration) -> Self {
        self.pin_every = Some(every);
        self
    }

    /// Keeps copies of immutable index objects in `dir` (for remote stores).
    pub fn with_index_cache(mut self, dir: Option<PathBuf>) -> Self {
        self.index_cache = dir;
        self
    }

    /// The same store, refusing versions this user saw name another
    /// snapshot (see [`crate::SeenVersions`]), and remembering those it
    /// resolves.
    pub fn with_seen(mut self, seen: Option<std::sync::Arc<crate::seen::SeenVersions>>) -> Self {
        self.seen = seen;
        self
    }

    /// What [`Repo::with_seen`] gave.
    pub fn seen(&self) -> Option<&crate::seen::SeenVersions> {
        self.seen.as_deref()
    }

    /// The same store, keeping its index between
    /// [`Repo::load_index_shared`]s (for a long-lived process: labd).
    pub fn with_index_memo(mut self) -> Self {
        self.index_memo = Some(std::sync::Arc::default());
        self
    }

    /// The index, shared: with [`Repo::with_index_memo`], the one kept
    /// since the last load plus the index objects written since (read
    /// whole again when one it was made of is gone: a gc consolidated
    /// them); else loaded as [`Repo::load_index`] does.
    pub async fn load_index_shared(&self) -> Result<std::sync::Arc<Index>> {
        let Some(memo) = &self.index_memo else {
            return Ok(std::sync::Arc::new(self.load_index().await?.0));
        };
        let mut held = memo.held.lock().await;
        let mut listed = HashSet::new();
        let mut listing = std::pin::pin!(self.remote.list_stream("index/"));
        while let Some(o) = listing.try_next().await? {
            if let Some(id) = index_object_id(&o.key) {
                listed.insert(id);
            }
        }
        if let Some(h) = held.as_mut().filter(|h| h.loaded.is_subset(&listed)) {
            let new: Vec<blake3::Hash> = listed
                .iter()
                .filter(|k| !h.loaded.contains(*k) && !h.refused.contains(*k))
                .copied()
                .collect();
            if new.is_empty() {
                return Ok(h.index.clone());
            }
            let mut index = (*h.index).clone();
            for id in new {
                let key = format!("index/{}", id.to_hex());
                match self.get_index_object(&key).await {
                    Ok(recs) => {
                        recs.iter().for_each(|r| index.add(r));
                        h.loaded.insert(id);
                    }
                    Err(Error::Corrupt { detail, .. }) => {
                        tracing::warn!("index object {key} is not used: {detail}");
                        index.refuse(key, detail);
                        h.refused.insert(id);
                    }
                    Err(e) => return Err(e),
                }
            }
            h.index = std::sync::Arc::new(index);
            h.refused.retain(|k| listed.contains(k));
            return Ok(h.index.clone());
        }
        // First load, or an object it was made of is gone: read whole.
        let (index, keys) = self.load_index().await?;
        let loaded: HashSet<blake3::Hash> =
            keys.iter().filter_map(|k| index_object_id(k)).collect();
        // Listed before that load and not in it: refused (or deleted since).
        let refused = listed.difference(&loaded).copied().collect();
        let index = std::sync::Arc::new(index);
        *held = Some(HeldIndex {
            index: index.clone(),
            loaded,
            refused,
        });
        Ok(index)
    }

    /// The object store.
    pub fn remote(&self) -> &Remote {
        &self.remote
    }

    /// The store's config.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Reads the index object `key` (from the local copy when there is one)
    /// and checks it against its name, the BLAKE3 of its bytes. A copy that
    /// fails the check is read again from the store.
    async fn get_index_object(&self, key: &str) -> Result<Vec<IndexPack>> {
        let cached = match (&self.index_cache, self.remote.local_path(key)) {
            (Some(dir), None) => Some(dir.join(key.trim_start_matches("index/"))),
            _ => None,
        };
        if let Some(path) = &cached {
            let bounded = std::fs::metadata(path).is_ok_and(|m| m.len() <= MAX_INDEX_OBJECT);
            if let Ok(b) = std::fs::read(path)
                .map_err(drop)
                .and_then(|b| bounded.then_some(b).ok_or(()))
            {
                if let Ok(recs) = check_index_object(&b, key) {
                    return Ok(recs);
                }
            }
        }
        let bytes = self.remote.get_at_most(key, MAX_INDEX_OBJECT).await?;
        let recs = check_index_object(&bytes, key)?;
        if let Some(path) = cached {
            // Best effort: the copy is only an optimisation, the store has the original.
            let _ = crate::fsutil::write_atomic(&path, &bytes);
        }
        Ok(recs)
    }

    /// Loads every index object. Returns the index and the keys it was read
    /// from. An object that does not match its name or does not decode is
    /// never used: it is listed in [`Index::refused`] (verify reports it,
    /// gc refuses to run) and the chunks only it described are missing.
    ///
    /// An object listed and gone when read was consolidated by a gc in
    /// between (it wrote the objects replacing it first): the index is
    /// listed and read again, up to three times in all.
    pub async fn load_index(&self) -> Result<(Index, Vec<String>)> {
        let mut tries = 1;
        loop {
            match self.load_index_once().await {
                Err(e) if e.is_not_found() && tries < INDEX_LOAD_TRIES => {
                    tracing::debug!("index: {e}; listing again (a gc consolidated it?)");
                    tries += 1;
                }
                r => return r,
            }
        }
    }

    async fn load_index_once(&self) -> Result<(Index, Vec<String>)> {
        // Kept as ids while listing: any member can put millions of objects
        // under `index/`, and those not named as index objects are refused
        // unread (and only the first few kept, see `Index::refuse`).
        let mut idx = Index::default();
        let mut listed: Vec<(blake3::Hash, u64)> = Vec::new();
        let mut listing = std::pin::pin!(self.remote.list_stream("index/"));
        while let Some(o) = listing.try_next().await? {
            match index_object_id(&o.key) {
                Some(id) => listed.push((id, o.size)),
                None => idx.refuse(
                    o.key,
                    "not named as an index object is (index/ and 64 hex digits)".into(),
                ),
            }
        }
        // At least 36 encoded bytes per chunk (id, three varints, flags):
        // room for all of them at once, a little more than needed, so the
        // table never grows by doubling (which held both copies at once).
        let room = listed
            .iter()
            .map(|o| o.1.min(MAX_INDEX_OBJECT) / 36)
            .sum::<u64>();
        // Futures are collected before streaming them (see NodeCache::fetch_packs).
        let reads: Vec<_> = listed
            .iter()
            .map(|(id, _)| async move {
                let k = format!("index/{}", id.to_hex());
                match self.get_index_object(&k).await {
                    Ok(recs) => Ok((k, Ok(recs))),
                    Err(Error::Corrupt { detail, .. }) => Ok((k, Err(detail))),
                    Err(e) => Err(e),
                }
            })
            .collect();
        // Each object is added as it arrives and then dropped: a million
        // chunks decoded all at once would double what the index holds.
        let mut loaded = futures::stream::iter(reads).buffer_unordered(8);
        // Capped: the table's control bytes are written when reserved, and
        // a junk object is only found out when read. Past 4 Mi chunks the
        // index grows as it goes.
        idx.reserve(usize::try_from(room).unwrap_or(0).min(1 << 22));
        let mut keys = Vec::new();
        while let Some((key, r)) = loaded.try_next().await? {
            match r {
                Ok(recs) => {
                    recs.iter().for_each(|r| idx.add(r));
                    keys.push(key);
                }
                Err(why) => {
                    tracing::warn!("index object {key} is not used: {why}");
                    idx.refuse(key, why);
                }
            }
        }
        drop(loaded);
        if let Some(dir) = self.index_cache.clone() {
            // The first run after an upgrade may remove thousands.
            let live = keys.clone();
            crate::fsutil::off_runtime(move || prune_index_copies(&dir, &live)).await;
        }
        Ok((idx, keys))
    }

    /// Writes the index objects for `packs` (which must already be
    /// durable): one, or several where one would pass [`MAX_INDEX_OBJECT`]
    /// (which readers refuse). Returns their keys and sizes.
    pub async fn write_index(&self, packs: &[IndexPack]) -> Result<Vec<(String, u64)>> {
        self.write_index_within(packs, MAX_INDEX_OBJECT).await
    }

    async fn write_index_within(
        &self,
        packs: &[IndexPack],
        max: u64,
    ) -> Result<Vec<(String, u64)>> {
        let mut written = Vec::new();
        let mut todo = vec![packs];
        while let Some(part) = todo.pop() {
            if part.is_empty() {
                continue;
            }
            let bytes = index::encode(part);
            if bytes.len() as u64 > max && part.len() > 1 {
                let (a, b) = part.split_at(part.len() / 2);
                todo.extend([b, a]);
                continue;
            }
            let (key, n) = (
                format!("index/{}", blake3::hash(&bytes).to_hex()),
                bytes.len() as u64,
            );
            self.remote.put(&key, bytes.into()).await?;
            written.push((key, n));
        }
        Ok(written)
    }

    /// Reads chunks (any mix of packs), verifying each against its id.
    /// Ranges of one pack go out as one coalesced request.
    pub async fn read_chunks(
        &self,
        index: &Index,
        ids: &[ChunkId],
    ) -> Result<HashMap<ChunkId, Vec<u8>>> {
        let mut by_pack: BTreeMap<PackId, Vec<PackEntry>> = BTreeMap::new();
        for id in ids {
            let (pack, e) = index.get(id).ok_or_else(|| Error::NotFound {
                what: format!("chunk {id}"),
                hint: "; the index may be lost: run `labsync rebuild-index`".into(),
            })?;
            by_pack.entry(pack).or_default().push(e);
        }
        let reads: Vec<_> = by_pack
            .into_iter()
            .map(|(pack, entries)| async move {
                let ranges: Vec<_> = entries
                    .iter()
                    .map(|e| e.offset..e.offset + e.stored_len as u64)
                    .collect();
                let datas = self.remote.get_ranges(&pack_key(&pack), &ranges).await?;
                entries
                    .iter()
                    .zip(datas)
                    .map(|(e, d)| Ok((e.id, e.decode(&d, &pack)?.into_owned())))
                    .collect::<Result<Vec<_>>>()
            })
            .collect();
        let parts: Vec<Vec<(ChunkId, Vec<u8>)>> = futures::stream::iter(reads)
            .buffer_unordered(8)
            .try_collect()
            .await?;
        Ok(parts.into_iter().flatten().collect())
    }

    /// Reads a snapshot object.
    pub async fn load_snapshot(&self, id: &SnapshotId) -> Result<SnapshotObject> {
        let bytes = self
            .remote
            .get_at_most(&snapshot_key(id), MAX_SNAPSHOT_OBJECT)
            .await
            .map_err(|e| match e {
                Error::NotFound { .. } => Error::not_found(format!("snapshot {id}")),
                e => e,
            })?;
        SnapshotObject::decode(&bytes, id)
    }

    /// Reads a snapshot and its whole tree, in path order. A tree whose
    /// segments decode to more than [`MAX_TREE_BYTES`] is refused.
    pub async fn load_tree(
        &self,
        index: &Index,
        id: &SnapshotId,
    ) -> Result<(SnapshotObject, Vec<Entry>)> {
        let mut entries = Vec::new();
        let snap = self.load_tree_into(index, id, &mut entries).await?;
        Ok((snap, entries))
    }

    /// Decodes snapshot `id`'s tree into `sink`, a batch of segments at a
    /// time: a million entries' encoded bytes are never held beside the
    /// entries decoded from them, and a sink keeping a compact form never
    /// holds the whole tree as [`Entry`] values.
    pub(crate) async fn load_tree_into<S: TreeSink>(
        &self,
        index: &Index,
        id: &SnapshotId,
        sink: &mut S,
    ) -> Result<SnapshotObject> {
        let snap = self.load_snapshot(id).await?;
        self.decode_tree_into(index, id, &snap, sink).await?;
        Ok(snap)
    }

    /// [`Repo::load_tree_into`] for a snapshot object already read (its
    /// read needs no index, so callers do it while the index loads).
    pub(crate) async fn decode_tree_into<S: TreeSink>(
        &self,
        index: &Index,
        id: &SnapshotId,
        snap: &SnapshotObject,
        sink: &mut S,
    ) -> Result<()> {
        // Paths are strictly sorted across segments, so a segment listed
        // twice is never a real tree; refused before it multiplies memory.
        let mut seen = std::collections::HashSet::with_capacity(snap.segments.len());
        if let Some(s) = snap.segments.iter().find(|s| !seen.insert(s.id)) {
            return Err(Error::corrupt(
                format!("snapshot {id}"),
                format!("tree segment {} listed twice", s.id.short()),
            ));
        }
        // The tree is held whole once decoded: bounded by what the index
        // says its segments decode to, before any is fetched.
        let claimed = snap
            .segments
            .iter()
            .filter_map(|s| index.get(&s.id))
            .map(|(_, e)| u64::from(e.raw_len))
            .fold(0u64, u64::saturating_add);
        if claimed > MAX_TREE_BYTES {
            return Err(Error::corrupt(
                format!("snapshot {id}"),
                format!("its tree segments claim {claimed} bytes, more than {MAX_TREE_BYTES}"),
            ));
        }
        // Room for the entries the object claims (a lie only costs growing
        // as the entries are decoded): a vector doubling from 2^19 to 2^20
        // entries held both copies. An entry takes at least 8 encoded bytes.
        let counted: u64 = snap.segments.iter().map(|s| u64::from(s.entries)).sum();
        let most = crate::snapshot::MAX_SEGMENT_ENTRIES;
        if let Some(s) = snap.segments.iter().find(|s| s.entries as usize > most) {
            return Err(Error::corrupt(
                format!("snapshot {id}"),
                format!(
                    "tree segment {} claims {} entries, more than a segment holds ({most})",
                    s.id.short(),
                    s.entries
                ),
            ));
        }
        if counted > crate::snapshot::MAX_TREE_ENTRIES {
            return Err(Error::corrupt(
                format!("snapshot {id}"),
                format!(
                    "its tree claims {counted} entries, more than {}",
                    crate::snapshot::MAX_TREE_ENTRIES
                ),
            ));
        }
        sink.room(usize::try_from(counted.min(claimed / 8)).unwrap_or(0));
        for batch in snap.segments.chunks(4096) {
            let ids: Vec<ChunkId> = batch.iter().map(|s| s.id).collect();
            let segs = self.read_chunks(index, &ids).await?;
            for s in batch {
                sink.add(Self::decoded_segment(id, s, &segs)?)?;
            }
        }
        Ok(())
    }

    /// Segment `s` of snapshot `id`, from `segs`, checked against its count.
    fn decoded_segment(
        id: &SnapshotId,
        s: &crate::snapshot::SegmentRef,
        segs: &HashMap<ChunkId, Vec<u8>>,
    ) -> Result<Vec<Entry>> {
        let bytes = segs
            .get(&s.id)
            .expect("read_chunks returns every id or fails");
        let seg = snapshot::decode_segment(bytes, &s.id)?;
        if seg.len() != s.entries as usize {
            return Err(Error::corrupt(
                format!("snapshot {id}"),
                format!(
                    "tree segment {} holds {} entries, the snapshot says {}",
                    s.id.short(),
                    seg.len(),
                    s.entries
                ),
            ));
        }
        Ok(seg)
    }

    async fn version_keys(&self, name: &str) -> Result<Vec<String>> {
        validate_name(name)?;
        let prefix = version_prefix(name);
        let mut keys: Vec<String> = self
            .remote
            .list(&prefix)
            .await?
            .into_iter()
            .map(|o| o.key)
            .filter(|k| k.strip_prefix(&prefix).is_some_and(|v| !v.contains('/')))
            .collect();
        // Zero-padded numbers: lexical order is version order.
        keys.sort();
        Ok(keys)
    }

    /// Reads a version record; one that names another name or version than
    /// its key does is refused (it would restore another version's tree).
    async fn read_record(&self, key: &str) -> Result<VersionRecord> {
        let bytes = self.remote.get_at_most(key, MAX_RECORD_OBJECT).await?;
        let rec: VersionRecord = serde_json::from_slice(&bytes)
            .map_err(|e| Error::corrupt(format!("ref {key}"), e.to_string()))?;
        if validate_name(&rec.name).is_err() || version_key(&rec.name, rec.version) != key {
            return Err(Error::corrupt(
                format!("ref {key}"),
                format!(
                    "it says it is {}@v{}, which is stored under another key",
                    rec.name, rec.version
                ),
            ));
        }
        Ok(rec)
    }

    /// Every live (not forgotten) version of `name`, oldest first.
    pub async fn versions(&self, name: &str) -> Result<Vec<VersionRecord>> {
        let all = self.records(name).await?;
        Ok(all.into_iter().filter(|r| !r.forgotten).collect())
    }

    /// Every version record of `name`, forgotten ones included, in order.
    pub async fn records(&self, name: &str) -> Result<Vec<VersionRecord>> {
        let keys = self.version_keys(name).await?;
        let reads: Vec<_> = keys
            .into_iter()
            .map(|k| async move { self.read_record(&k).await })
            .collect();
        let all: Vec<VersionRecord> = futures::stream::iter(reads)
            .buffered(16)
            .try_collect()
            .await?;
        Ok(all)
    }

    /// The newest live version of `name`, if any; usually one list and one read.
    pub async fn latest(&self, name: &str) -> Result<Option<VersionRecord>> {
        for k in self.version_keys(name).await?.iter().rev() {
            let r = self.read_record(k).await?;
            if !r.forgotten {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    /// The highest-numbered record, forgotten or not (numbering never reuses).
    pub(crate) async fn newest_record(&self, name: &str) -> Result<Option<VersionRecord>> {
        match self.version_keys(name).await?.last() {
            Some(k) => self.read_record(k).await.map(Some),
            None => Ok(None),
        }
    }

    /// Forgets a version: it stops being listed and stops protecting its data
    /// from gc. The record stays (marked), so its number is never reused.
    pub async fn forget(&self, spec: &RefSpec) -> Result<VersionRecord> {
        if spec.version.is_none() {
            return Err(Error::invalid(
                format!("version {spec}"),
                "name the version to forget: NAME@vN",
            ));
        }
        let mut rec = self.resolve_unchecked(spec).await?;
        rec.forgotten = true;
        let json = serde_json::to_vec_pretty(&rec).expect("record serialises");
        self.remote
            .put(&version_key(&rec.name, rec.version), json.into())
            .await?;
        self.remote.sync().await?;
        Ok(rec)
    }

    /// Resolves `NAME[@vN]` to its version record. A record that names
    /// another snapshot than the spec's pin (`NAME@vN#ID`), or than this
    /// user saw it name ([`Repo::with_seen`]), is refused as rewritten.
    pub async fn resolve(&self, spec: &RefSpec) -> Result<VersionRecord> {
        let rec = self.resolve_unchecked(spec).await?;
        if let Some(pin) = spec.snapshot.filter(|p| *p != rec.snapshot) {
            return Err(Error::Rewritten {
                label: rec.label(),
                key: version_key(&rec.name, rec.version),
                expected: pin.to_string(),
                found: rec.snapshot.to_string(),
                seen: "it was saved (the id after '#')".into(),
            });
        }
        if let Some(seen) = &self.seen {
            seen.check_and_note(&rec)?;
        }
        Ok(rec)
    }

    async fn resolve_unchecked(&self, spec: &RefSpec) -> Result<VersionRecord> {
        // A version is one read; only a miss lists them all, to say what
        // there is.
        if let Some(v) = spec.version {
            match self.read_record(&version_key(&spec.name, v)).await {
                Ok(r) if !r.forgotten => return Ok(r),
                Ok(_) | Err(Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        // The latest: newest records first, usually one read. A name with
        // thousands of versions, or an old record anyone spoiled, costs the
        // newest ones, not every one.
        let Some(latest) = self.latest(&spec.name).await? else {
            return Err(Error::NotFound {
                what: format!("name {:?}", spec.name),
                hint: "; `labsync ls` lists the stored names".into(),
            });
        };
        match spec.version {
            None => Ok(latest),
            Some(_) => Err(Error::NotFound {
                what: format!("version {spec}"),
                hint: format!(
                    "; the latest is v{} (`labsync log {}`)",
                    latest.version, spec.name
                ),
            }),
        }
    }

    /// Writes the next version of a name with a conditional create, so two
    /// concurrent pushes can never overwrite each other: the loser moves to the
    /// next number. If the latest version already holds `snapshot`, no version
    /// is created and that one is returned with `false`.
    pub async fn commit_version(&self, mut rec: VersionRecord) -> Result<(VersionRecord, bool)> {
        for _attempt in 0..32 {
            let newest = self.newest_record(&rec.name).await?;
            if let Some(l) = &newest {
                if l.snapshot == rec.snapshot && !l.forgotten {
                    return Ok((l.clone(), false));
                }
            }
            // A version record anyone wrote may say u64::MAX.
            rec.version = match newest {
                None => 1,
                Some(l) => l.version.checked_add(1).ok_or_else(|| Error::Conflict {
                    what: format!("name {}", rec.name),
                    detail: format!(
                        "its newest version is v{}, the last there can be: push under another name",
                        l.version
                    ),
                })?,
            };
            let json = serde_json::to_vec_pretty(&rec).expect("record serialises");
            if self
                .remote
                .create(&version_key(&rec.name, rec.version), json.into())
                .await?
            {
                self.remote.sync().await?;
                return Ok((rec, true));
            }
        }
        Err(Error::Conflict {
            what: format!("name {}", rec.name),
            detail: "32 concurrent pushes won the race for the next version; run the push again (it will be quick)".into(),
        })
    }

    /// Every name with at least one version.
    pub async fn names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .remote
            .list("refs/")
            .await?
            .into_iter()
            .filter_map(|o| {
                let rest = o.key.strip_prefix("refs/")?;
                let (name, v) = rest.rsplit_once("/@/")?;
                (!v.contains('/')).then(|| name.to_string())
            })
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Every version of every name (gc's roots).
    pub async fn all_versions(&self) -> Result<Vec<VersionRecord>> {
        let mut out = Vec::new();
        for n in self.names().await? {
            out.extend(self.versions(&n).await?);
        }
        Ok(out)
    }

    /// Reads every pack's footer and writes one fresh index from them, then
    /// drops the old index objects. Recovers from lost or corrupt indexes.
    pub async fn rebuild_index(&self) -> Result<(usize, usize)> {
        let old: Vec<String> = self
            .remote
            .list("index/")
            .await?
            .into_iter()
            .map(|o| o.key)
            .collect();
        let packs = self.remote.list("packs/").await?;
        let reads: Vec<_> = packs
            .into_iter()
            .map(|o| async move {
                let id: PackId = o.key.rsplit('/').next().unwrap_or_default().parse()?;
                let entries = self.read_pack_footer(&id, o.size).await?;
                Ok::<_, Error>(IndexPack::new(id, o.size, &entries))
            })
            .collect();
        let recs: Vec<IndexPack> = futures::stream::iter(reads)
            .buffer_unordered(8)
            .try_collect()
            .await?;
        let chunks = recs.iter().map(|r| r.chunks.len()).sum();
        let n = recs.len();
        let new_keys: HashSet<String> = self
            .write_index(&recs)
            .await?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        self.remote.sync().await?;
        for k in old {
            if !new_keys.contains(&k) {
                self.remote.delete(&k).await?;
            }
        }
        Ok((n, chunks))
    }

    /// The index entries of `by_pack` that their pack does not confirm:
    /// the pack missing, or its own footer not placing the chunk where the
    /// entry says. Index objects are anyone's; a pack's footer is checked
    /// against its id. Each pack is asked its size and its footer read (two
    /// ranged reads), [`CONFIRMING`] packs at once; entries this process
    /// confirmed before are not asked again ([`Repo::with_index_memo`]).
    pub(crate) async fn confirm_entries(
        &self,
        by_pack: HashMap<PackId, Vec<PackEntry>>,
    ) -> Result<Vec<(PackId, PackEntry)>> {
        let checks = by_pack.into_iter().map(|(p, mut entries)| async move {
            entries.retain(|e| !self.vouched(&p, e));
            if entries.is_empty() {
                return Ok(Vec::new());
            }
            let all = |entries: Vec<PackEntry>| entries.into_iter().map(|e| (p, e)).collect();
            let Some(info) = self.remote.head(&pack_key(&p)).await? else {
                return Ok::<Vec<(PackId, PackEntry)>, Error>(all(entries));
            };
            let footer = match self.read_pack_footer(&p, info.size).await {
                Ok(f) => f,
                Err(Error::Corrupt { .. }) => return Ok(all(entries)),
                Err(e) => return Err(e),
            };
            let own: HashMap<ChunkId, PackEntry> = footer.into_iter().map(|e| (e.id, e)).collect();
            let (good, bad): (Vec<_>, Vec<_>) =
                entries.into_iter().partition(|e| own.get(&e.id) == Some(e));
            self.vouch(&p, &good);
            Ok(all(bad))
        });
        let bad: Vec<Vec<(PackId, PackEntry)>> = futures::stream::iter(checks)
            .buffer_unordered(CONFIRMING)
            .try_collect()
            .await?;
        Ok(bad.into_iter().flatten().collect())
    }

    /// Where index objects disagree on where a chunk of `ids` is (an
    /// honest store rarely has two places for one chunk; a planted object
    /// gives one that is wrong), the first place the packs' own footers
    /// confirm is the one `index` keeps. The places in use are asked first
    /// (their packs are few: the version's own); only the chunks they fail
    /// are asked at their other places, so planted places cost requests
    /// only where they were put first. A chunk with no confirmed place
    /// keeps its first, which fails by name when read.
    pub(crate) async fn settle_places(
        &self,
        index: &mut Index,
        ids: impl Iterator<Item = ChunkId>,
    ) -> Result<()> {
        if !index.has_other_places() {
            return Ok(());
        }
        let mut seen = HashSet::new();
        let mut asked: Vec<(ChunkId, Vec<(PackId, PackEntry)>)> = ids
            .filter(|id| seen.insert(*id))
            .map(|id| (id, index.places(&id)))
            .filter(|(_, places)| places.len() > 1)
            .collect();
        // Round by round: each chunk's next place, until one is confirmed.
        while !asked.is_empty() {
            let mut by_pack: HashMap<PackId, Vec<PackEntry>> = HashMap::new();
            for (_, places) in &asked {
                by_pack.entry(places[0].0).or_default().push(places[0].1);
            }
            let bad: HashSet<(PackId, ChunkId, u64)> = self
                .confirm_entries(by_pack)
                .await?
                .into_iter()
                .map(|(p, e)| (p, e.id, e.offset))
                .collect();
            asked.retain_mut(|(id, places)| {
                let (p, e) = places.remove(0);
                if !bad.contains(&(p, *id, e.offset)) {
                    index.relocate(id, &p, &e);
                    return false;
                }
                if places.is_empty() {
                    tracing::warn!("no pack holds chunk {id} where the index says");
                }
                !places.is_empty()
            });
        }
        Ok(())
    }

    /// Whether this process confirmed the index entry `e` of `pack` by the
    /// pack's footer already (only a process keeping its index, labd,
    /// remembers).
    pub(crate) fn vouched(&self, pack: &PackId, e: &PackEntry) -> bool {
        self.index_memo.as_ref().is_some_and(|m| {
            let v = m.vouched.lock().expect("vouched poisoned");
            v.contains(&vouch_key(pack, e))
        })
    }

    /// Remembers index entries of `pack` confirmed by its footer.
    pub(crate) fn vouch(&self, pack: &PackId, entries: &[PackEntry]) {
        if let Some(m) = &self.index_memo {
            let mut v = m.vouched.lock().expect("vouched poisoned");
            if v.len() + entries.len() > MAX_VOUCHED {
                v.clear();
            }
            v.extend(entries.iter().map(|e| vouch_key(pack, e)));
        }
    }

    /// Reads a pack's footer with two ranged reads.
    pub async fn read_pack_footer(&self, id: &PackId, size: u64) -> Result<Vec<PackEntry>> {
        let key = pack_key(id);
        let tl = pack::trailer_len() as u64;
        if size < tl {
            return Err(Error::corrupt(
                format!("pack {id}"),
                "shorter than a pack trailer",
            ));
        }
        // Any member can put a 4 GiB object under `packs/` whose trailer
        // says its footer is most of it: read, that footer would be 4 GiB
        // of memory. No pack is larger than this, so no footer is.
        if size > pack::MAX_PACK_BYTES {
            return Err(Error::corrupt(
                format!("pack {id}"),
                format!(
                    "{size} bytes, larger than a pack can be ({} MiB); its footer is not read",
                    pack::MAX_PACK_BYTES >> 20
                ),
            ));
        }
        let trailer = self.remote.get_range(&key, size - tl..size).await?;
        let flen = pack::parse_trailer(&trailer, id)? as u64;
        let fstart = (size - tl)
            .checked_sub(flen)
            .ok_or_else(|| Error::corrupt(format!("pack {id}"), "footer longer than the pack"))?;
        let footer = self.remote.get_range(&key, fstart..size - tl).await?;
        pack::parse_footer(&footer, &trailer, size, id)
    }
}

/// Decodes an index object after checking it against its name
/// (`index/<BLAKE3 of the bytes>`): a flipped bit anywhere, or an object
/// written under another's name, is refused before any entry is used.
fn check_index_object(bytes: &[u8], key: &str) -> Result<Vec<IndexPack>> {
    let named = key.strip_prefix("index/").unwrap_or(key);
    if blake3::hash(bytes).to_hex().as_str() != named {
        return Err(Error::corrupt(
            format!("index {key}"),
            "content does not match its name (BLAKE3)",
        ));
    }
    index::decode(bytes, key)
}

/// The id an index object's key names (`index/` and 64 hex digits).
fn index_object_id(key: &str) -> Option<blake3::Hash> {
    let hex = key.strip_prefix("index/")?;
    // Lower case only: the name is read back as `to_hex` writes it.
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| blake3::Hash::from_hex(hex).ok())
        .flatten()
}

/// Listings and reads of the index before [`Repo::load_index`] gives up on
/// objects that vanish between the two.
const INDEX_LOAD_TRIES: u32 = 3;

/// Removes the copies in `dir` of index objects the store no longer lists
/// (`keys`, just listed): gc consolidates index objects, and without this a
/// node's cache kept a copy of every index object the store ever had. Best
/// effort, like the copies: one removed that another process has just
/// listed is read from the store again. Only names of index objects (64 hex
/// digits) are touched.
fn prune_index_copies(dir: &std::path::Path, keys: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let live: HashSet<&str> = keys
        .iter()
        .map(|k| k.trim_start_matches("index/"))
        .collect();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        let object = name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit());
        if object && !live.contains(name) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version record anyone wrote as v18446744073709551615 makes the
    /// next push of that name an error, not v0 (or a panic).
    #[tokio::test]
    async fn the_last_version_number_there_can_be_is_an_error_to_follow() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let np = std::sync::Arc::new(crate::progress::NoProgress);
        let opts = crate::PushOptions::for_test("ds");
        std::fs::write(dir.path().join("f"), "one").unwrap();
        let v1 = crate::push(&repo, dir.path(), &opts, np.clone())
            .await
            .unwrap();
        let forged = VersionRecord {
            version: u64::MAX,
            ..v1.record
        };
        let key = version_key("ds", u64::MAX);
        let json = serde_json::to_vec(&forged).unwrap();
        repo.remote().put(&key, json.into()).await.unwrap();
        std::fs::write(dir.path().join("f"), "two").unwrap();
        let e = crate::push(&repo, dir.path(), &opts, np).await.unwrap_err();
        assert!(e.to_string().contains("the last there can be"), "{e}");
    }

    /// Issue 41, point 12: resolving a name reads its newest records, not
    /// every one: an old record anyone spoiled (or a thousand of them)
    /// does not stop, nor slow, a pull of the latest.
    #[tokio::test]
    async fn the_latest_version_is_resolved_without_reading_old_records() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let np = std::sync::Arc::new(crate::progress::NoProgress);
        let opts = crate::PushOptions::for_test("ds");
        for text in ["one", "two"] {
            std::fs::write(dir.path().join("f"), text).unwrap();
            crate::push(&repo, dir.path(), &opts, np.clone())
                .await
                .unwrap();
        }
        let spoiled = bytes::Bytes::from_static(b"not a version record");
        repo.remote()
            .put(&version_key("ds", 1), spoiled)
            .await
            .unwrap();
        let latest = repo.resolve(&"ds".parse().unwrap()).await.unwrap();
        assert_eq!(latest.version, 2);
        let miss = repo.resolve(&"ds@v9".parse().unwrap()).await.unwrap_err();
        assert!(miss.to_string().contains("the latest is v2"), "{miss}");
    }

    /// Issue 41, point 12: a 4 GiB object under `packs/` (sparse here)
    /// whose trailer says its footer is nearly all of it is refused from
    /// its size: its footer is never read into memory.
    #[tokio::test]
    async fn a_huge_object_named_as_a_pack_has_its_footer_left_unread() {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(Remote::local(dir.path()).unwrap(), None)
            .await
            .unwrap();
        let id = PackId::from_bytes([9; 32]);
        let path = dir.path().join(pack_key(&id));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let size: u64 = 4 << 30;
        let tl = pack::trailer_len() as u64;
        let count = (size - tl) / 49;
        let mut trailer = Vec::new();
        trailer.extend_from_slice(&((count * 49) as u32).to_le_bytes());
        trailer.extend_from_slice(&(count as u32).to_le_bytes());
        trailer.extend_from_slice(&[0; 8]);
        trailer.extend_from_slice(b"LSPK");
        trailer.extend_from_slice(&2u32.to_le_bytes());
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(size).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &trailer, size - tl).unwrap();
        let err = repo.read_pack_footer(&id, size).await.unwrap_err();
        assert!(
            err.to_string().contains("larger than a pack can be"),
            "{err}"
        );
    }

    /// The index objects gc consolidated away leave the local copies too.
    #[tokio::test]
    async fn copies_of_index_objects_the_store_dropped_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let copies = dir.path().join("index-copies");
        let repo = Repo::open(Remote::memory(), None)
            .await
            .unwrap()
            .with_index_cache(Some(copies.clone()));
        let np = std::sync::Arc::new(crate::progress::NoProgress);
        for (i, text) in ["one", "two"].iter().enumerate() {
            let src = dir.path().join(format!("src{i}"));
            std::fs::create_dir_all(&src).unwrap();
            std::fs::write(src.join("f"), text).unwrap();
            let opts = crate::PushOptions::for_test(&format!("ds{i}"));
            crate::push(&repo, &src, &opts, np.clone()).await.unwrap();
        }
        let listed = |d: &std::path::Path| {
            let mut v: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            v.sort();
            v
        };
        let (_, keys) = repo.load_index().await.unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(listed(&copies).len(), 2);
        std::fs::write(copies.join("notes.txt"), "mine").unwrap();

        repo.rebuild_index().await.unwrap();
        let (idx, keys) = repo.load_index().await.unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(idx.refused().len(), 0);
        let mut want = vec![
            keys[0].trim_start_matches("index/").to_string(),
            "notes.txt".to_string(),
        ];
        want.sort();
        assert_eq!(listed(&copies), want);
    }

    /// Issue 40, point 2: an index larger than one object may be is
    /// written as several; keys under `index/` not named as index objects
    /// are refused unread, and past the first hundred only counted.
    #[tokio::test]
    async fn index_objects_are_bounded_and_junk_keys_are_not_read() {
        let repo = Repo::open(Remote::memory(), None).await.unwrap();
        let packs: Vec<IndexPack> = (0..5u8)
            .map(|p| {
                let entries: Vec<PackEntry> = (0..20u8)
                    .map(|c| PackEntry {
                        id: ChunkId::of(&[p, c]),
                        offset: u64::from(c) * 10,
                        stored_len: 10,
                        raw_len: 10,
                        flags: 0,
                    })
                    .collect();
                IndexPack::new(PackId::of(&[p]), 4096, &entries)
            })
            .collect();
        let one = index::encode(&packs[..1]).len() as u64;
        let written = repo.write_index_within(&packs, one * 2).await.unwrap();
        assert!(written.len() >= 3, "{written:?}");
        assert!(written.iter().all(|(_, n)| *n <= one * 2), "{written:?}");
        for i in 0..150 {
            repo.remote()
                .put(&format!("index/junk-{i}"), bytes::Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        let (idx, keys) = repo.load_index().await.unwrap();
        assert_eq!(keys.len(), written.len());
        for c in packs.iter().flat_map(|p| &p.chunks) {
            assert!(idx.contains(&c.0), "every chunk of every part is indexed");
        }
        assert_eq!(idx.refused().len() as u64 + idx.refused_more(), 150);
        assert_eq!(idx.refused().len(), 100);
        assert!(idx.refused()[0].1.contains("not named as an index object"));
    }

    /// Issue 40, point 3: with a memo, a load reads only the index objects
    /// written since the last, and one that vanished (a gc consolidated
    /// the index) makes it read whole again.
    #[tokio::test]
    async fn a_kept_index_reads_only_what_is_new() {
        let repo = Repo::open(Remote::memory(), None)
            .await
            .unwrap()
            .with_index_memo();
        let pack = |p: u8| {
            let entries = [PackEntry {
                id: ChunkId::of(&[p]),
                offset: 0,
                stored_len: 10,
                raw_len: 10,
                flags: 0,
            }];
            IndexPack::new(PackId::of(&[p]), 4096, &entries)
        };
        let first = repo.write_index(&[pack(1)]).await.unwrap();
        let a = repo.load_index_shared().await.unwrap();
        assert!(a.contains(&ChunkId::of(&[1])));
        let b = repo.load_index_shared().await.unwrap();
        assert!(
            std::sync::Arc::ptr_eq(&a, &b),
            "nothing new: the same index"
        );
        // A junk object under an index object's name: refused once, not read again.
        repo.remote()
            .put(
                &format!("index/{}", "ef".repeat(32)),
                bytes::Bytes::from_static(b"junk"),
            )
            .await
            .unwrap();
        repo.write_index(&[pack(2)]).await.unwrap();
        let c = repo.load_index_shared().await.unwrap();
        assert!(c.contains(&ChunkId::of(&[1])) && c.contains(&ChunkId::of(&[2])));
        assert_eq!(c.refused().len(), 1);
        let d = repo.load_index_shared().await.unwrap();
        assert!(std::sync::Arc::ptr_eq(&c, &d), "the junk is not read again");
        // The first object goes (consolidated elsewhere): read whole.
        repo.remote().delete(&first[0].0).await.unwrap();
        let e = repo.load_index_shared().await.unwrap();
        assert!(!e.contains(&ChunkId::of(&[1])) && e.contains(&ChunkId::of(&[2])));
    }

    #[test]
    fn names_and_specs() {
        for ok in ["div2k", "runs/42", "a.b-c_d"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", "/abs", "a//b", "a/../b", "a b", "x@y", "a/"] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        assert_eq!(
            "div2k@v3".parse::<RefSpec>().unwrap(),
            RefSpec {
                name: "div2k".into(),
                version: Some(3),
                snapshot: None,
            }
        );
        let id = SnapshotId::of(b"x");
        let pinned: RefSpec = format!("runs/j12@v3#{id}").parse().unwrap();
        assert_eq!((pinned.version, pinned.snapshot), (Some(3), Some(id)));
        assert_eq!(pinned.to_string(), format!("runs/j12@v3#{id}"));
        for bad in [format!("runs/j12#{id}"), "runs/j12@v3#abc".into()] {
            assert!(bad.parse::<RefSpec>().is_err(), "{bad}");
        }
        assert_eq!("div2k@latest".parse::<RefSpec>().unwrap().version, None);
        assert!("div2k@vx"
            .parse::<RefSpec>()
            .unwrap_err()
            .to_string()
            .contains("NAME@vN"));
    }

    #[tokio::test]
    async fn params_mismatch_is_an_error() {
        let remote = Remote::memory();
        Repo::open(remote.clone(), None).await.unwrap();
        let other = ChunkerParams {
            avg: 512 << 10,
            ..Default::default()
        };
        let err = Repo::open(remote.clone(), Some(other)).await.unwrap_err();
        assert!(err.to_string().contains("dedup only works"), "{err}");
        Repo::open(remote, Some(ChunkerParams::default()))
            .await
            .unwrap();
    }

    /// The id names a folder in every node's cache, where labd writes as
    /// root: a store whose config says `../..` is refused.
    #[tokio::test]
    async fn a_store_id_that_is_not_hex_is_refused() {
        for id in ["../../etc", "ABCDEF0123456789ABCDEF0123456789", "abc"] {
            let remote = Remote::memory();
            let mut cfg = StoreConfig::new(ChunkerParams::default());
            cfg.id = id.into();
            remote
                .put(CONFIG_KEY, serde_json::to_vec(&cfg).unwrap().into())
                .await
                .unwrap();
            let err = Repo::open(remote, None).await.unwrap_err().to_string();
            assert!(err.contains("not 32 lowercase hex"), "{id}: {err}");
        }
    }

    #[tokio::test]
    async fn unknown_format_is_refused() {
        let remote = Remote::memory();
        let mut cfg = StoreConfig::new(ChunkerParams::default());
        cfg.format = 9;
        remote
            .put(CONFIG_KEY, serde_json::to_vec(&cfg).unwrap().into())
            .await
            .unwrap();
        assert!(Repo::open(remote, None)
            .await
            .unwrap_err()
            .to_string()
            .contains("format 9"));
    }
}
