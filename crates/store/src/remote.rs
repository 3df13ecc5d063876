//! The object store behind a labsync store: any `object_store` backend, plus
//! batched durability for local directories.
//!
//! `object_store`'s `LocalFileSystem` can fsync every write, but one fsync per
//! 32 MiB pack runs at a quarter of the disk's speed. Instead local writes are
//! recorded and [`Remote::sync`] makes them durable in one batch, which the
//! push calls before it writes anything that points at them (index before
//! snapshot before ref). Remote backends are durable when `put` returns.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::error::{Error, Result};
use crate::http::Unnamable;

/// How many oversized keys a [`Remote`] remembers (it forgets them all
/// past this, and learns them again from their sizes).
const MAX_OVERSIZED_KEPT: usize = 4096;

/// The objects under `prefix` of the local store at `root`, as a walk of
/// its folders finds them, passing by names no command can name
/// ([`Unnamable`]) and staging files (`key#N`). `object_store`'s own
/// walk ends its listing at the first name it cannot parse, without a word
/// past the error: a listing skipping that error would have lost every
/// object after it (the index, the versions gc keeps). Symlinks are taken
/// for what they point at, and folders they name are not entered.
fn list_local(
    root: PathBuf,
    prefix: &str,
    unnamable: Unnamable,
) -> impl futures::Stream<Item = Result<ObjectInfo>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<ObjectInfo>>(1024);
    let start = root.join(prefix.trim_end_matches('/'));
    tokio::task::spawn_blocking(move || {
        let mut stack = vec![start];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    let _ = tx.blocking_send(Err(Error::io("list", &dir)(e)));
                    return;
                }
            };
            for e in entries {
                let e = match e {
                    Ok(e) => e,
                    Err(err) => {
                        let _ = tx.blocking_send(Err(Error::io("list", &dir)(err)));
                        return;
                    }
                };
                let path = e.path();
                let Ok(kind) = e.file_type() else { continue };
                if kind.is_dir() {
                    stack.push(path);
                    continue;
                }
                let rel = path.strip_prefix(&root).unwrap_or(&path);
                let Some(key) = rel.to_str() else {
                    unnamable.note(&rel.to_string_lossy());
                    continue;
                };
                if key.contains('#') {
                    continue;
                }
                if Path::parse(key).is_err() {
                    unnamable.note(key);
                    continue;
                }
                // Gone meanwhile, or a symlink to nothing or to a folder.
                let Ok(meta) = std::fs::metadata(&path) else {
                    continue;
                };
                if !meta.is_file() {
                    continue;
                }
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs() as i64);
                let info = ObjectInfo {
                    key: key.to_string(),
                    size: meta.len(),
                    modified,
                };
                if tx.blocking_send(Ok(info)).is_err() {
                    return;
                }
            }
        }
    });
    tokio_stream_of(rx)
}

/// The receiving end of a channel as a stream.
fn tokio_stream_of<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|t| (t, rx)) })
}

/// An object's key (relative to the store root), size and age.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Key relative to the store root, e.g. `packs/3f/3fa1…`.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification, seconds since the Unix epoch.
    pub modified: i64,
}

/// A handle on the store's objects.
#[derive(Clone)]
pub struct Remote {
    inner: Arc<dyn ObjectStore>,
    url: String,
    local_root: Option<PathBuf>,
    unsynced: Arc<Mutex<BTreeSet<String>>>,
    /// What the server does with conditional creates (from the store's
    /// config): how keys that must not exist are created.
    conditional: ConditionalWrites,
    /// Whether this client wrote `claims/keep` already ([`crate::claims`]).
    claims_kept: Arc<std::sync::atomic::AtomicBool>,
    /// Keys refused for their size, with the size the store gave: asked
    /// again with no larger bound, they are refused without a request (a
    /// 50 GB object planted under `index/` is met by every load of the index).
    oversized: Arc<Mutex<HashMap<String, u64>>>,
    /// Keys its listings passed by ([`Unnamable`]).
    unnamable: Unnamable,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote").field("url", &self.url).finish()
    }
}

impl Remote {
    /// Opens `url`: `file:///path` (created if missing), `memory://`, or
    /// anything `object_store` parses (`s3://bucket/prefix`, `gs://`, `az://`).
    /// `options` are backend settings such as `aws_endpoint`, `aws_region`,
    /// `aws_access_key_id` (the caller collects them from flags and environment).
    pub fn open(url: &str, options: &[(String, String)]) -> Result<Remote> {
        let invalid = |d: String| Error::invalid(format!("store URL {url:?}"), d);
        let parsed = url::Url::parse(url)
            .map_err(|e| invalid(format!("{e}; use file:///path or s3://bucket/prefix")))?;
        if parsed.scheme() == "file" {
            let path = parsed
                .to_file_path()
                .map_err(|_| invalid("not an absolute local path".into()))?;
            return Remote::local(&path);
        }
        if parsed.scheme() == "memory" {
            return Ok(Remote::memory());
        }
        let unnamable = Unnamable::default();
        let (store, prefix) =
            open_backend(&parsed, options, &unnamable).map_err(|e| invalid(e.to_string()))?;
        let inner: Arc<dyn ObjectStore> = if prefix.as_ref().is_empty() {
            Arc::from(store)
        } else {
            Arc::new(PrefixStore::new(store, prefix))
        };
        Ok(Remote {
            inner,
            url: url.to_string(),
            local_root: None,
            unsynced: Default::default(),
            conditional: ConditionalWrites::Honoured,
            claims_kept: Default::default(),
            oversized: Default::default(),
            unnamable,
        })
    }

    /// A store in a local directory.
    pub fn local(root: &FsPath) -> Result<Remote> {
        std::fs::create_dir_all(root).map_err(Error::io("create store directory", root))?;
        let root = root
            .canonicalize()
            .map_err(Error::io("resolve store directory", root))?;
        let fs = LocalFileSystem::new_with_prefix(&root).map_err(|e| Error::Unavailable {
            op: "open",
            key: root.display().to_string(),
            error: e,
        })?;
        Ok(Remote {
            inner: Arc::new(fs),
            url: format!("file://{}", root.display()),
            local_root: Some(root),
            unsynced: Default::default(),
            conditional: ConditionalWrites::Honoured,
            claims_kept: Default::default(),
            oversized: Default::default(),
            unnamable: Default::default(),
        })
    }

    /// A store in memory (tests).
    pub fn memory() -> Remote {
        Remote {
            inner: Arc::new(InMemory::new()),
            url: "memory://".into(),
            local_root: None,
            unsynced: Default::default(),
            conditional: ConditionalWrites::Honoured,
            claims_kept: Default::default(),
            oversized: Default::default(),
            unnamable: Default::default(),
        }
    }

    /// The same store, creating keys as `mode` requires (see
    /// [`ConditionalWrites`]).
    pub fn with_conditional_writes(mut self, mode: ConditionalWrites) -> Remote {
        self.conditional = mode;
        self
    }

    /// What the server does with conditional creates, as the config says.
    pub(crate) fn conditional(&self) -> ConditionalWrites {
        self.conditional
    }

    /// Whether this client wrote `claims/keep` already.
    pub(crate) fn claims_kept(&self) -> bool {
        self.claims_kept.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Notes that `claims/keep` is written.
    pub(crate) fn set_claims_kept(&self) {
        self.claims_kept
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// True for a server, false for a local folder or memory (which honour
    /// conditional creates by construction).
    pub fn is_server(&self) -> bool {
        self.local_root.is_none() && self.url != "memory://"
    }

    /// The backend.
    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The URL it was opened with (normalised for local paths).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The file behind `key` when the store is a local directory.
    pub fn local_path(&self, key: &str) -> Option<PathBuf> {
        self.local_root.as_ref().map(|r| r.join(key))
    }

    fn unavailable<'k>(
        op: &'static str,
        key: &'k str,
    ) -> impl FnOnce(object_store::Error) -> Error + 'k {
        move |source| match source {
            object_store::Error::NotFound { .. } => Error::not_found(format!("object {key}")),
            error => Error::Unavailable {
                op,
                key: key.to_string(),
                error,
            },
        }
    }

    fn note_write(&self, key: &str) {
        if self.local_root.is_some() {
            self.unsynced
                .lock()
                .expect("unsynced set poisoned")
                .insert(key.to_string());
        }
    }

    /// Writes `key`, replacing what is there. For content-addressed objects,
    /// where a concurrent writer of the same key writes the same bytes.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        if let Some(path) = self.local_path(key).filter(|_| data.len() >= DIRECT_MIN) {
            let bytes = data.clone();
            let staged = crate::blocking(move || {
                direct::write(&path, &bytes).map_err(Error::io("write", &path))
            })
            .await?;
            if staged {
                self.note_write(key);
                return Ok(());
            }
            // The filesystem refused O_DIRECT (tmpfs, some FUSE): write as usual.
            return self.put_buffered(key, data).await;
        }
        self.put_buffered(key, data).await
    }

    async fn put_buffered(&self, key: &str, data: Bytes) -> Result<()> {
        self.inner
            .put(&Path::from(key), PutPayload::from(data))
            .await
            .map_err(Self::unavailable("put", key))?;
        self.note_write(key);
        Ok(())
    }

    /// Writes `key` only if it does not exist (conditional create: `If-None-Match`
    /// on S3, a hard link on local disk; a claim where the server does not
    /// honour conditional writes, see [`ConditionalWrites`]). Returns `false`
    /// when it already existed.
    pub async fn create(&self, key: &str, data: Bytes) -> Result<bool> {
        if self.is_server() {
            return self.create_by_claim(key, data).await;
        }
        self.create_if_absent(key, data).await
    }

    /// Writes `key` with a conditional create. On a server, only under a
    /// claim ([`crate::claims`]): `s3s-fs` honours `If-None-Match` one
    /// request at a time but let two racing creates of one key both succeed.
    pub(crate) async fn create_if_absent(&self, key: &str, data: Bytes) -> Result<bool> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .inner
            .put_opts(&Path::from(key), PutPayload::from(data), opts)
            .await
        {
            Ok(_) => {
                self.note_write(key);
                Ok(true)
            }
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) if is_refusal(&e) => Err(Error::Refused {
                op: "create",
                key: key.to_string(),
                detail: crate::http::summary(&e),
                hint: "the store's config says its server honours conditional writes, but it \
                       refused this one: remove \"conditional_writes\" from the store's `config` \
                       object, and labsync asks the server again and creates keys with claims \
                       if it must",
            }),
            Err(e) => Err(Self::unavailable("create", key)(e)),
        }
    }

    /// Reads a whole object of at most `max` bytes: one larger is refused
    /// from the size the store gives, before its body is read, with an
    /// error naming the key (anyone may write a 50 GB "pack" or index
    /// object, which a whole read would hold in memory). A key refused is
    /// remembered: asked again with no larger bound, it is refused without
    /// a request. Every whole read of the store goes through here, each kind
    /// of object with its bound ([`crate::MAX_INDEX_OBJECT`] and its siblings).
    pub async fn get_at_most(&self, key: &str, max: u64) -> Result<Bytes> {
        let known = self
            .oversized
            .lock()
            .expect("oversized poisoned")
            .get(key)
            .copied();
        if let Some(size) = known.filter(|&s| s > max) {
            return Err(Self::too_large(key, size, max));
        }
        let r = self
            .inner
            .get(&Path::from(key))
            .await
            .map_err(Self::unavailable("get", key))?;
        if r.meta.size > max {
            self.refuse_oversized(key, r.meta.size);
            return Err(Self::too_large(key, r.meta.size, max));
        }
        let bytes = r.bytes().await.map_err(Self::unavailable("get", key))?;
        // The size said before the body is the server's word; the body is
        // what counts (a local object appended to while it was read).
        if bytes.len() as u64 > max {
            self.refuse_oversized(key, bytes.len() as u64);
            return Err(Self::too_large(key, bytes.len() as u64, max));
        }
        Ok(bytes)
    }

    fn refuse_oversized(&self, key: &str, size: u64) {
        tracing::warn!("refused object {key}: {size} bytes, more than it may have");
        let mut known = self.oversized.lock().expect("oversized poisoned");
        // Bounded too: a store can hold any number of them.
        if known.len() >= MAX_OVERSIZED_KEPT {
            known.clear();
        }
        known.insert(key.to_string(), size);
    }

    fn too_large(key: &str, size: u64, max: u64) -> Error {
        Error::corrupt(
            format!("object {key}"),
            format!(
                "{size} bytes, more than the {max} it may have: refused unread \
                 (planted or damaged; remove it from the store)"
            ),
        )
    }

    /// Reads a byte range of an object.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        self.inner
            .get_range(&Path::from(key), range)
            .await
            .map_err(Self::unavailable("get range of", key))
    }

    /// Reads several ranges of one object (coalesced by the backend).
    pub async fn get_ranges(&self, key: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.inner
            .get_ranges(&Path::from(key), ranges)
            .await
            .map_err(Self::unavailable("get ranges of", key))
    }

    /// Size and age of an object, or `None`.
    pub async fn head(&self, key: &str) -> Result<Option<ObjectInfo>> {
        match self.inner.head(&Path::from(key)).await {
            Ok(m) => Ok(Some(ObjectInfo {
                key: key.to_string(),
                size: m.size,
                modified: m.last_modified.timestamp(),
            })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::unavailable("head", key)(e)),
        }
    }

    /// Keys this handle's listings passed by because no command can name
    /// them, and how many more beyond those named.
    pub fn unnamable_keys(&self) -> (Vec<String>, u64) {
        self.unnamable.keys()
    }

    /// Every object under `prefix` (a folder such as `packs/`), in no order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.list_stream(prefix).try_collect().await
    }

    /// [`Remote::list`] as the objects arrive, for folders any member can
    /// fill with millions of keys: the caller keeps only what it needs.
    pub fn list_stream<'a>(
        &self,
        prefix: &'a str,
    ) -> impl futures::Stream<Item = Result<ObjectInfo>> + Send + 'a {
        if let Some(root) = &self.local_root {
            return list_local(root.clone(), prefix, self.unnamable.clone()).left_stream();
        }
        let p = Path::from(prefix.trim_end_matches('/'));
        self.inner
            .list(Some(&p))
            .map_err(move |e| Self::unavailable("list", prefix)(e))
            // Local staging files (`key#N`) of writes in progress are not objects yet.
            .try_filter(|m| std::future::ready(!m.location.as_ref().contains('#')))
            .map_ok(|m| ObjectInfo {
                key: m.location.to_string(),
                size: m.size,
                modified: m.last_modified.timestamp(),
            })
            .right_stream()
    }

    /// The objects of `folder` whose keys begin with `start` (a key prefix
    /// inside it, not a folder), in key order. On a server the listing
    /// starts after `start` (S3's `start-after`) and stops at the first key
    /// past the prefix: the keys of a million others are never read. Other
    /// backends list the folder and keep what matches.
    pub async fn list_beginning(&self, folder: &str, start: &str) -> Result<Vec<ObjectInfo>> {
        let p = Path::from(folder.trim_end_matches('/'));
        let info = |m: object_store::ObjectMeta| ObjectInfo {
            key: m.location.to_string(),
            size: m.size,
            modified: m.last_modified.timestamp(),
        };
        if !self.is_server() {
            let mut all: Vec<ObjectInfo> = self
                .list_stream(folder)
                .try_filter(|o| std::future::ready(o.key.starts_with(start)))
                .try_collect()
                .await?;
            all.sort_by(|a, b| a.key.cmp(&b.key));
            return Ok(all);
        }
        // Every key beginning with `start` sorts after `start` less its
        // last character.
        let after = Path::from(&start[..start.len().saturating_sub(1)]);
        let mut stream = self.inner.list_with_offset(Some(&p), &after);
        let mut out = Vec::new();
        while let Some(m) = stream.next().await {
            let m = m.map_err(Self::unavailable("list", folder))?;
            if !m.location.as_ref().starts_with(start) {
                break;
            }
            out.push(info(m));
        }
        Ok(out)
    }

    /// Staging files (`key#N`) of local writes that never finished (a push
    /// killed mid-pack) and were last modified at least `min_age_secs` ago:
    /// their keys and sizes. Empty for remote backends, which stage nothing
    /// visible.
    pub async fn stale_staging(&self, min_age_secs: i64) -> Result<Vec<ObjectInfo>> {
        let Some(root) = self.local_root.clone() else {
            return Ok(Vec::new());
        };
        crate::blocking(move || {
            let now = std::time::SystemTime::now();
            let mut out = Vec::new();
            let mut dirs = vec![root.clone()];
            while let Some(dir) = dirs.pop() {
                let rd = match std::fs::read_dir(&dir) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(Error::io("list", &dir)(e)),
                };
                for ent in rd {
                    let ent = ent.map_err(Error::io("list", &dir))?;
                    let Ok(meta) = ent.metadata() else { continue };
                    if meta.is_dir() {
                        dirs.push(ent.path());
                        continue;
                    }
                    if !ent.file_name().as_encoded_bytes().contains(&b'#') {
                        continue;
                    }
                    let age = meta
                        .modified()
                        .ok()
                        .and_then(|m| now.duration_since(m).ok())
                        .map_or(0, |d| d.as_secs() as i64);
                    if age < min_age_secs {
                        continue; // a write in progress, or one that just finished
                    }
                    let path = ent.path();
                    let Ok(rel) = path.strip_prefix(&root) else {
                        continue;
                    };
                    out.push(ObjectInfo {
                        key: rel.to_string_lossy().into_owned(),
                        size: meta.len(),
                        modified: now_secs_of(meta.modified().ok()),
                    });
                }
            }
            Ok(out)
        })
        .await
    }

    /// Removes a staging file found by [`Remote::stale_staging`].
    pub async fn remove_staging(&self, key: &str) -> Result<()> {
        let Some(path) = self.local_path(key) else {
            return Ok(());
        };
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io("remove", &path)(e))
            }
            _ => Ok(()),
        }
    }

    /// Deletes an object; deleting what is already gone is not an error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        if self.local_root.is_some() {
            self.unsynced
                .lock()
                .expect("unsynced set poisoned")
                .remove(key);
        }
        match self.inner.delete(&Path::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Self::unavailable("delete", key)(e)),
        }
    }

    /// Starts writing `key` back to disk now, without waiting (local stores;
    /// a no-op elsewhere). The batched [`Remote::sync`] at the end of a push
    /// then finds most pages already clean instead of flushing 1 GB at once.
    pub async fn start_writeback(&self, key: &str) -> Result<()> {
        let Some(path) = self.local_path(key) else {
            return Ok(());
        };
        crate::blocking(move || {
            let f = std::fs::File::open(&path).map_err(Error::io("open for writeback", &path))?;
            writeback_hint(&f);
            Ok(())
        })
        .await
    }

    /// Makes every write so far durable (fsync of files, then of their
    /// directories). A no-op for remote backends.
    pub async fn sync(&self) -> Result<()> {
        let Some(root) = self.local_root.clone() else {
            return Ok(());
        };
        let keys = std::mem::take(&mut *self.unsynced.lock().expect("unsynced set poisoned"));
        if keys.is_empty() {
            return Ok(());
        }
        crate::blocking(move || {
            let mut dirs = BTreeSet::new();
            for key in &keys {
                let path = root.join(key);
                let f = match std::fs::File::open(&path) {
                    Ok(f) => f,
                    // Deleted since it was written (gc, a test): nothing to make durable.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(Error::io("open for fsync", &path)(e)),
                };
                f.sync_all().map_err(Error::io("fsync", &path))?;
                let mut dir = path.parent().map(FsPath::to_path_buf);
                // New fan-out folders (`packs/3f`) must reach the disk too.
                while let Some(d) = dir {
                    if !d.starts_with(&root) || !dirs.insert(d.clone()) {
                        break;
                    }
                    dir = d.parent().map(FsPath::to_path_buf);
                }
            }
            for d in dirs {
                let f = std::fs::File::open(&d).map_err(Error::io("open for fsync", &d))?;
                f.sync_all().map_err(Error::io("fsync", &d))?;
            }
            Ok(())
        })
        .await
    }
}

/// The backend for `url`. S3 gets labsync's retry policy ([`crate::http`])
/// in place of `object_store`'s; the other clouds keep their defaults.
fn open_backend(
    url: &url::Url,
    options: &[(String, String)],
    unnamable: &Unnamable,
) -> object_store::Result<(Box<dyn ObjectStore>, Path)> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use object_store::{ClientConfigKey, ObjectStoreScheme, RetryConfig};
    let (scheme, path) = ObjectStoreScheme::parse(url)?;
    if scheme != ObjectStoreScheme::AmazonS3 {
        return object_store::parse_url_opts(url, options.iter().map(|(k, v)| (k, v.clone())));
    }
    let path = Path::parse(path)?;
    let builder = options.iter().fold(
        AmazonS3Builder::new().with_url(url.to_string()),
        |b, (k, v)| match k.to_ascii_lowercase().parse() {
            Ok(k) => b.with_config(k, v),
            Err(_) => b,
        },
    );
    if let Some(why) = missing_keys(url, &builder) {
        return Err(object_store::Error::Generic {
            store: "S3",
            source: why.into(),
        });
    }
    // Over plain HTTP (a lab's own S3 server) no certificate is ever
    // checked: the system's trust store is not read. Reading it (every file
    // of /etc/ssl/certs) took 125 ms of a 190 ms `labsync push` with a cold
    // page cache, and labrun pushes the job's code first. Not where HTTPS
    // may still be spoken: credentials from STS (web identity), or a proxy.
    let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
    let https_elsewhere = builder
        .get_config_value(&AmazonS3ConfigKey::WebIdentityTokenFile)
        .is_some()
        || builder
            .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::ProxyUrl))
            .is_some();
    let plain = endpoint.is_some_and(|e| e.starts_with("http://")) && !https_elsewhere;
    let connector = crate::http::Connector {
        plain: own_client(plain, options, |k| std::env::var_os(k)),
        unnamable: unnamable.clone(),
    };
    let builder = if plain {
        let key = AmazonS3ConfigKey::Client(ClientConfigKey::NoSystemCertificates);
        builder.with_config(key, "true")
    } else {
        builder
    };
    let no_retries = RetryConfig {
        max_retries: 0,
        ..Default::default()
    };
    let store = builder
        .with_retry(no_retries)
        .with_http_connector(connector)
        .build()?;
    Ok((Box::new(store), path))
}

/// Why an S3 server of the lab's own (a store with an endpoint outside
/// AWS) cannot be spoken to with what `builder` was given: no keys, and
/// nothing else `object_store` takes credentials from. It would then ask a
/// cloud's instance metadata service (169.254.169.254), which a lab's own
/// server never takes: on a network where nothing answers there, every
/// command waited out connection timeouts, and where something does, its
/// refusal was reported as if the store had refused. Said at once instead.
/// AWS itself (no endpoint, or one under amazonaws.com: a VPC or FIPS
/// endpoint) keeps instance credentials.
fn missing_keys(url: &url::Url, builder: &object_store::aws::AmazonS3Builder) -> Option<String> {
    use object_store::aws::AmazonS3ConfigKey as K;
    let get = |k: K| {
        builder
            .get_config_value(&k)
            .filter(|v| !v.trim().is_empty())
    };
    let has = |k: K| get(k).is_some();
    // A store named by an https:// URL (Cloudflare R2, an AWS bucket's
    // own address) is spoken to there; otherwise `build` prefers
    // aws_endpoint_url_s3 to aws_endpoint.
    let named =
        matches!(url.scheme(), "http" | "https").then(|| url.origin().ascii_serialization());
    let endpoint = named.or_else(|| get(K::S3Endpoint).or_else(|| get(K::Endpoint)))?;
    let host = url::Url::parse(&endpoint)
        .ok()
        .and_then(|u| {
            u.host_str()
                .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
        })
        .unwrap_or_default();
    let aws = [".amazonaws.com", ".amazonaws.com.cn"]
        .iter()
        .any(|d| host.ends_with(d));
    // object_store's own reading of a boolean.
    let anonymous = get(K::SkipSignature).is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes" | "y"
        )
    });
    // Each source as `build` takes it: a pair where it needs both (one key
    // of a pair alone is object_store's own error, which names the other).
    let given = has(K::AccessKeyId)
        || has(K::SecretAccessKey)
        || (has(K::WebIdentityTokenFile) && has(K::RoleArn))
        || has(K::ContainerCredentialsRelativeUri)
        || (has(K::ContainerCredentialsFullUri) && has(K::ContainerAuthorizationTokenFile))
        || has(K::MetadataEndpoint);
    if aws || anonymous || given {
        return None;
    }
    Some(format!(
        "no credentials for the S3 server at {endpoint}: set AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY to the keys of your user there (AWS_SKIP_SIGNATURE=true \
         for a bucket anyone may read, AWS_METADATA_ENDPOINT for credentials from an \
         instance metadata service)"
    ))
}

/// Whether labsync's own client ([`crate::http::Connector`]'s `plain`)
/// speaks to an S3 server reached in `plain` HTTP: only where reqwest would
/// add nothing, i.e. with no proxy in the environment (reqwest reads
/// `http_proxy` and `all_proxy`) and no client options (timeouts, pools,
/// headers) given for reqwest to apply.
fn own_client(
    plain: bool,
    options: &[(String, String)],
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> bool {
    use object_store::aws::AmazonS3ConfigKey;
    use object_store::ClientConfigKey;
    let client_options = options.iter().any(|(k, _)| {
        matches!(
            k.to_ascii_lowercase().parse(),
            Ok(AmazonS3ConfigKey::Client(c)) if c != ClientConfigKey::AllowHttp
        )
    });
    let proxy = ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"]
        .iter()
        .any(|k| env(k).is_some_and(|v| !v.is_empty()));
    // It speaks no TLS: not where any address given is https (an
    // `aws_endpoint_url_s3`, which object_store prefers to the endpoint, or
    // a credentials URI), nor where plain HTTP was refused outright.
    let tls_somewhere = options
        .iter()
        .any(|(_, v)| v.trim().to_ascii_lowercase().starts_with("https://"));
    let http_refused = options.iter().any(|(k, v)| {
        matches!(
            k.to_ascii_lowercase().parse(),
            Ok(AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        ) && !v.trim().eq_ignore_ascii_case("true")
    });
    plain && !client_options && !proxy && !tls_somewhere && !http_refused
}

fn now_secs_of(t: Option<std::time::SystemTime>) -> i64 {
    t.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs() as i64)
}

/// Objects at least this large (packs) bypass the page cache on local stores.
const DIRECT_MIN: usize = 1 << 20;

/// Pack writes with `O_DIRECT` on local stores.
///
/// A pack is written once and not read again by the push, so copying it into
/// the page cache only costs: on this project's VMs (a balloon hands freed
/// pages back to the host) a buffered 1 GB write spent 2.7 s of system time
/// faulting page-cache pages in, against 0.1 s for the same write with
/// `O_DIRECT` (`dd`, 32 × 32 MiB, with fsync). On any machine it also keeps a
/// multi-GB push from evicting the page cache that jobs are using.
#[cfg(target_os = "linux")]
mod direct {
    use std::io;
    use std::os::unix::fs::OpenOptionsExt;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::fsutil::write_all_direct;

    /// Writes `data` to `path` through a staging file (`path#N`, the
    /// convention `object_store` uses and `Remote::list` skips) renamed into
    /// place. Returns `Ok(false)`, leaving nothing behind, when the
    /// filesystem does not do `O_DIRECT`; the caller then writes normally.
    pub(super) fn write(path: &Path, data: &[u8]) -> io::Result<bool> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        // pid, sequence and clock: a staging file left by a killed push in a
        // container that reused our pid must not collide with ours.
        let staging_name = || {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let mut name = path.as_os_str().to_owned();
            name.push(format!(
                "#{}-{}-{nanos:x}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            PathBuf::from(name)
        };
        let open = |staging: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags(libc::O_DIRECT)
                .open(staging)
        };
        let mut staging = staging_name();
        let mut file = open(&staging);
        for _ in 0..3 {
            match &file {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if let Some(dir) = path.parent() {
                        std::fs::create_dir_all(dir)?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => staging = staging_name(),
                _ => break,
            }
            file = open(&staging);
        }
        let file = match file {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(false),
            Err(e) => return Err(e),
        };
        let result = match write_all_direct(&file, data) {
            Ok(()) => file
                .set_len(data.len() as u64)
                .and_then(|()| std::fs::rename(&staging, path))
                .map(|()| true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(e),
        };
        if !matches!(result, Ok(true)) {
            let _ = std::fs::remove_file(&staging);
        }
        result
    }
}

#[cfg(not(target_os = "linux"))]
mod direct {
    /// No `O_DIRECT` here: the caller writes through the page cache.
    pub(super) fn write(_: &std::path::Path, _: &[u8]) -> std::io::Result<bool> {
        Ok(false)
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn writeback_hint(f: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is valid for the whole call (borrowed from `f`),
    // and sync_file_range reads no memory of ours. It is only a hint: errors
    // are ignored because `sync` fsyncs the file before anything depends on it.
    unsafe {
        libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn writeback_hint(_: &std::fs::File) {}

/// What the store's server does with a conditional create
/// (`If-None-Match: *`), as probed when the store was created.
///
/// On a server, a key that must not exist (a version, the config) is
/// created under a short-lived claim, `claims/<hash of key>.<nonce>`: the
/// claim is written, the claims on that key are listed, and only a writer
/// alone with its claim writes the key (with `If-None-Match: *` where the
/// server honours it). This needs no conditional write, and holds where one
/// is honoured but not atomic. The README's store section says more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConditionalWrites {
    /// A second create of a key fails: versions are numbered by it.
    Honoured,
    /// The header is ignored (a second create overwrites): labsync claims
    /// keys instead.
    Ignored,
    /// Conditional writes are refused (`501` or another 4xx): labsync
    /// claims keys instead.
    Refused,
}

impl ConditionalWrites {
    /// How keys that must not exist are created on a server, in words.
    pub fn scheme(self) -> &'static str {
        match self {
            ConditionalWrites::Honoured => {
                "a claim (claims/<key>.<nonce>, listed before the write), then a conditional \
                 create (If-None-Match: *)"
            }
            _ => "a claim (claims/<key>.<nonce>, listed before the write), then a plain write",
        }
    }
}

impl std::fmt::Display for ConditionalWrites {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConditionalWrites::Honoured => "honoured",
            ConditionalWrites::Ignored => "ignored",
            ConditionalWrites::Refused => "refused",
        })
    }
}

/// True for an error that says the server does not do conditional writes:
/// `501`, or a 4xx other than the ones that mean something else (denied,
/// missing, exists, busy).
pub(crate) fn is_refusal(e: &object_store::Error) -> bool {
    if matches!(e, object_store::Error::NotImplemented { .. }) {
        return true;
    }
    match crate::http::status_of(e) {
        Some(501) => true,
        Some(s) => (400..500).contains(&s) && ![401, 403, 404, 409, 412, 429].contains(&s),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs go through `O_DIRECT` with a zero-padded last block: the object
    /// must still read back byte for byte at its exact length, in a fan-out
    /// folder that did not exist, with no staging file left behind, and a
    /// second write of the same key must replace it.
    #[tokio::test]
    async fn large_local_put_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let remote = Remote::local(dir.path()).unwrap();
        // From a buffer's 4 KiB boundary (as packs are built: written from
        // where they are) and from one byte past it (through the bounce buffer).
        let cases = [DIRECT_MIN, (5 << 20) + 4097, 9 << 20]
            .into_iter()
            .flat_map(|len| [(len, 0), (len, 1)]);
        for (len, skew) in cases {
            let mut buf = vec![0u8; len + 2 * 4096];
            let start = buf.as_ptr().align_offset(4096) + skew;
            for (i, b) in buf[start..start + len].iter_mut().enumerate() {
                *b = (i * 31 % 251) as u8;
            }
            let data = buf[start..start + len].to_vec();
            let key = "packs/ab/abcdef";
            let sent = Bytes::from(buf).slice(start..start + len);
            assert_eq!((sent.as_ptr() as usize).is_multiple_of(4096), skew == 0);
            remote.put(key, sent).await.unwrap();
            assert_eq!(
                remote.get_at_most(key, 16 << 20).await.unwrap(),
                data,
                "{len} bytes"
            );
            let names: Vec<_> = std::fs::read_dir(dir.path().join("packs/ab"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, ["abcdef"], "{len} bytes");
        }
        remote.sync().await.unwrap();
    }

    /// An object larger than the caller allows is refused from its size,
    /// on a local folder and in memory alike.
    #[tokio::test]
    async fn a_whole_read_is_bounded_by_the_size_the_store_gives() {
        let dir = tempfile::tempdir().unwrap();
        for remote in [Remote::local(dir.path()).unwrap(), Remote::memory()] {
            remote
                .put("packs/ab/big", vec![7u8; 100].into())
                .await
                .unwrap();
            let e = remote.get_at_most("packs/ab/big", 99).await.unwrap_err();
            assert!(e.to_string().contains("100 bytes, more than the 99"), "{e}");
            assert!(e.to_string().contains("packs/ab/big"), "names the key: {e}");
            // Refused again without a request (here, without seeing that
            // it shrank), under a larger bound read as usual.
            remote
                .put("packs/ab/big", vec![7u8; 10].into())
                .await
                .unwrap();
            let e = remote.get_at_most("packs/ab/big", 99).await.unwrap_err();
            assert!(e.to_string().contains("100 bytes, more than the 99"), "{e}");
            assert_eq!(
                remote.get_at_most("packs/ab/big", 100).await.unwrap().len(),
                10
            );
        }
    }

    /// Backend options from pairs.
    fn opts(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_labs_own_s3_server_without_keys_is_said_at_once() {
        // Port 9 (discard): nothing is asked of any server, and no
        // instance metadata service either.
        let server = [
            ("aws_endpoint", "http://127.0.0.1:9"),
            ("aws_allow_http", "true"),
            ("aws_region", "us-east-1"),
        ];
        let t = std::time::Instant::now();
        let Err(err) = Remote::open("s3://b/x", &opts(&server)) else {
            panic!("opened without keys");
        };
        let msg = err.to_string();
        assert!(
            msg.contains("no credentials for the S3 server at http://127.0.0.1:9"),
            "{msg}"
        );
        assert!(msg.contains("AWS_ACCESS_KEY_ID"), "{msg}");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "said at once"
        );
        let with = |kv: &[(&str, &str)]| {
            let mut o = opts(&server);
            o.extend(opts(kv));
            Remote::open("s3://b/x", &o)
        };
        assert!(with(&[("aws_access_key_id", "k"), ("aws_secret_access_key", "s")]).is_ok());
        for yes in ["true", "1", "Yes", "on"] {
            assert!(
                with(&[("aws_skip_signature", yes)]).is_ok(),
                "anonymous: {yes}"
            );
        }
        // Sources `build` takes only in pairs: one alone names none.
        for half in [
            ("aws_web_identity_token_file", "/run/token"),
            (
                "aws_container_credentials_full_uri",
                "http://127.0.0.1:9/creds",
            ),
            ("aws_skip_signature", "false"),
        ] {
            let Err(e) = with(&[half]) else {
                panic!("opened with only {half:?}");
            };
            assert!(e.to_string().contains("no credentials"), "{half:?}: {e}");
        }
        assert!(with(&[
            ("aws_web_identity_token_file", "/run/token"),
            ("aws_role_arn", "arn:aws:iam::1:role/r")
        ])
        .is_ok());
        // The endpoint `build` prefers is the one looked at.
        let mut preferred = opts(&[("aws_region", "us-east-1"), ("aws_allow_http", "true")]);
        preferred.extend(opts(&[("aws_endpoint_url_s3", "http://127.0.0.1:9")]));
        let Err(e) = Remote::open("s3://b/x", &preferred) else {
            panic!("aws_endpoint_url_s3 without keys opened");
        };
        assert!(e.to_string().contains("no credentials"), "{e}");
        // A store named by its https:// address is judged by it: R2 needs
        // keys, a bucket's own AWS address does not.
        let region = opts(&[("aws_region", "auto")]);
        let Err(e) = Remote::open("https://acct.r2.cloudflarestorage.com/b/x", &region) else {
            panic!("R2 without keys opened");
        };
        assert!(
            e.to_string()
                .contains("no credentials for the S3 server at https://acct.r2"),
            "{e}"
        );
        assert!(Remote::open("https://b.s3.us-east-1.amazonaws.com/x", &region).is_ok());
        // An AWS endpoint of its own (VPC, FIPS) may take instance credentials.
        let vpc = [
            (
                "aws_endpoint",
                "https://bucket.vpce-1a2b.s3.us-east-1.vpce.amazonaws.com.",
            ),
            ("aws_region", "us-east-1"),
        ];
        assert!(Remote::open("s3://b/x", &opts(&vpc)).is_ok());
        // Half a pair is object_store's own error, naming the missing half.
        let Err(half) = with(&[("aws_access_key_id", "k")]) else {
            panic!("opened with half a pair of keys");
        };
        assert!(half.to_string().contains("ecret"), "{half}");
        // The cloud itself (no endpoint) may take instance credentials.
        assert!(Remote::open("s3://b/x", &opts(&[("aws_region", "us-east-1")])).is_ok());
    }

    #[test]
    fn labsyncs_own_client_speaks_only_plain_http_with_nothing_for_reqwest_to_add() {
        let no_env = |_: &str| None;
        let allow = opts(&[("aws_allow_http", "true"), ("aws_region", "x")]);
        assert!(own_client(true, &allow, no_env));
        assert!(!own_client(false, &allow, no_env), "https");
        for k in [
            "timeout",
            "connect_timeout",
            "pool_max_idle_per_host",
            "user_agent",
        ] {
            assert!(!own_client(true, &opts(&[(k, "5s")]), no_env), "{k}");
        }
        for var in ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"] {
            let env = |k: &str| (k == var).then(|| "http://proxy:3128".into());
            assert!(!own_client(true, &allow, env), "{var}");
        }
        let empty = |k: &str| (k == "http_proxy").then(std::ffi::OsString::new);
        assert!(
            own_client(true, &allow, empty),
            "an empty proxy variable is none"
        );
        let https_only = |k: &str| (k == "https_proxy").then(|| "http://proxy:3128".into());
        assert!(own_client(true, &allow, https_only), "not for http:// URLs");
        // No TLS spoken: an https address anywhere, or http refused, keeps reqwest.
        for (k, v) in [
            ("aws_endpoint_url_s3", "https://s3.example.org"),
            (
                "aws_container_credentials_full_uri",
                "HTTPS://creds.example.org/x",
            ),
            ("aws_allow_http", "false"),
        ] {
            let mut o = allow.clone();
            o.retain(|(key, _)| key != k);
            o.push((k.to_string(), v.to_string()));
            assert!(!own_client(true, &o, no_env), "{k}={v}");
        }
    }
}
