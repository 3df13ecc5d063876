//! Integration tests of the store: one conformance suite run against every
//! backend (in memory, a local folder, and a real S3 server on 127.0.0.1), plus
//! the crash, race, corruption and traversal cases.

mod support;

#[path = "support/proxy.rs"]
mod proxy;

#[path = "store/faults.rs"]
mod faults;

#[path = "store/roundtrip.rs"]
mod roundtrip;

#[path = "store/servers.rs"]
mod servers;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use labsync_store::{
    gc, push, verify, ChunkId, Codec, Entry, Error, IndexPack, Kind, NoProgress, NodeCache,
    PackBuilder, Pull, PullOutcome, PushOptions, Remote, Repo, SnapshotObject, VersionRecord,
    FLAG_LZ4, FLAG_ZSTD,
};
use support::{assert_same_tree, random_bytes, write_tree, S3Server};

fn opts(name: &str, cache: &NodeCache) -> PushOptions {
    PushOptions {
        files_cache: Some(cache.files_cache_dir()),
        ..plain_opts(name)
    }
}

/// Push options with no files cache (every file read).
fn plain_opts(name: &str) -> PushOptions {
    PushOptions::new(name)
}

/// Makes `env.root/dir` holding one file `file` with `bytes`, pushes it as
/// `name`; returns the folder.
async fn push_one_file(env: &Env, dir: &str, name: &str, file: &str, bytes: &[u8]) -> PathBuf {
    let src = env.root.join(dir);
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join(file), bytes).unwrap();
    push(&env.repo, &src, &opts(name, &env.cache), np())
        .await
        .unwrap();
    src
}

fn np() -> Arc<NoProgress> {
    Arc::new(NoProgress)
}

struct Env {
    _dir: tempfile::TempDir,
    root: std::path::PathBuf,
    repo: Repo,
    cache: NodeCache,
}

impl Env {
    async fn new(remote: Remote) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let cache = NodeCache::open(&root.join("cache"), 1 << 30).unwrap();
        let repo = Repo::open(remote, None).await.unwrap();
        Env {
            _dir: dir,
            root,
            repo,
            cache,
        }
    }

    /// Pulls `spec` into `root/dest` with the shared cache and checks it equals `src`.
    async fn pull_matches(&self, spec: &str, src: &Path, dest: &str) {
        let out = self.root.join(dest);
        Pull::new(&self.repo, &self.cache, &spec.parse().unwrap(), &out)
            .threads(2)
            .progress(np())
            .run()
            .await
            .unwrap();
        assert_same_tree(src, &out);
    }

    /// Pulls `spec` into `out` with `delete`: `out` made equal to the version.
    async fn pull_deleting(&self, spec: &str, out: &Path) -> labsync_store::Result<PullOutcome> {
        let opts = labsync_store::PullOptions {
            threads: 2,
            delete: true,
            shared: false,
            expect: None,
        };
        let spec = spec.parse().unwrap();
        labsync_store::Pull::new(&self.repo, &self.cache, &spec, out)
            .options(opts)
            .progress(np())
            .run()
            .await
    }

    /// Pulls `spec` into `out` with the shared cache.
    async fn pull_into(&self, spec: &str, out: &Path) -> labsync_store::Result<PullOutcome> {
        Pull::new(&self.repo, &self.cache, &spec.parse().unwrap(), out)
            .threads(2)
            .progress(np())
            .run()
            .await
    }

    fn fresh_cache(&self, name: &str) -> NodeCache {
        NodeCache::open(&self.root.join(name), 1 << 30).unwrap()
    }
}

// ---------------------------------------------------------------- conformance

async fn check_round_trip(env: &Env) {
    let src = env.root.join("src");
    write_tree(&src, 1);
    support::wait_until_at_rest(&src);
    let r = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    assert!(r.created);
    assert_eq!(r.record.label(), "ds@v1");
    let dest = env.root.join("out");
    let p = Pull::new(&env.repo, &env.cache, &"ds".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert!(p.files_written > 5);
    assert_same_tree(&src, &dest);
}

async fn check_unchanged_repush_creates_nothing(env: &Env) {
    let src = env.root.join("src");
    let before = env.repo.remote().list("").await.unwrap().len();
    let r = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    assert!(!r.created, "unchanged tree must not create a version");
    assert_eq!(r.record.version, 1);
    assert_eq!(
        r.files_read, 0,
        "files cache: no unchanged file is read again"
    );
    assert_eq!(
        env.repo.remote().list("").await.unwrap().len(),
        before,
        "no object written"
    );
}

async fn check_small_change_stores_little(env: &Env) {
    let src = env.root.join("src");
    support::overwrite_middle(&src.join("big.bin"), 4096);
    let r = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    assert!(r.created);
    assert_eq!(r.record.version, 2);
    assert_eq!(
        (r.record.modified, r.record.added, r.record.removed),
        (1, 0, 0)
    );
    // big.bin is ~9 MB; a 4 KiB overwrite rewrites one chunk (<= 4 MiB).
    assert!(
        r.record.new_bytes < 4_400_000,
        "stored {} bytes for a 4 KiB edit",
        r.record.new_bytes
    );
    env.pull_matches("ds@v2", &src, "out2").await;
    // The old version is still intact.
    let v1 = env.root.join("out1");
    Pull::new(&env.repo, &env.cache, &"ds@v1".parse().unwrap(), &v1)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_ne!(
        std::fs::read(v1.join("big.bin")).unwrap(),
        std::fs::read(src.join("big.bin")).unwrap()
    );
}

async fn check_conditional_create(env: &Env) {
    let r = env.repo.remote();
    assert!(r.create("refs/cc/@/0000000001", "a".into()).await.unwrap());
    assert!(
        !r.create("refs/cc/@/0000000001", "b".into()).await.unwrap(),
        "second create must lose"
    );
    assert_eq!(
        &r.get_at_most("refs/cc/@/0000000001", 1 << 20)
            .await
            .unwrap()[..],
        b"a"
    );
    r.delete("refs/cc/@/0000000001").await.unwrap();
}

async fn check_concurrent_pushes_keep_both_versions(env: &Env) {
    let (a, b) = (env.root.join("race-a"), env.root.join("race-b"));
    write_tree(&a, 11);
    write_tree(&b, 12);
    let (c1, c2) = (env.fresh_cache("c1"), env.fresh_cache("c2"));
    let (o1, o2) = (opts("race", &c1), opts("race", &c2));
    let (r1, r2) = tokio::join!(
        push(&env.repo, &a, &o1, np()),
        push(&env.repo, &b, &o2, np())
    );
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    let mut vs = [r1.record.version, r2.record.version];
    vs.sort();
    assert_eq!(vs, [1, 2], "both pushes land as distinct versions");
    let versions = env.repo.versions("race").await.unwrap();
    let snaps: HashSet<_> = versions.iter().map(|v| v.snapshot).collect();
    assert_eq!(snaps.len(), 2);
}

async fn check_corrupt_chunk_is_never_materialised(env: &Env) {
    let bytes = support::random_bytes(300_000, 77);
    push_one_file(env, "corrupt-src", "victim", "victim.bin", &bytes).await;
    let (index, _) = env.repo.load_index().await.unwrap();
    let (_, entries) = env
        .repo
        .load_tree(
            &index,
            &env.repo
                .resolve(&"victim".parse().unwrap())
                .await
                .unwrap()
                .snapshot,
        )
        .await
        .unwrap();
    let chunk = entries
        .iter()
        .find(|e| e.kind == Kind::File)
        .unwrap()
        .chunks[0];
    let (pack, e) = index.get(&chunk).unwrap();
    let key = labsync_store::pack_key(&pack);
    let original = env.repo.remote().get_at_most(&key, 1 << 30).await.unwrap();
    let mut bytes = original.to_vec();
    bytes[e.offset as usize + 10] ^= 0xff;
    // Delete first: on a local store the cache may hold a hard link to the original file.
    env.repo.remote().delete(&key).await.unwrap();
    env.repo.remote().put(&key, bytes.into()).await.unwrap();

    let cache = env.fresh_cache("corrupt-cache");
    let dest = env.root.join("corrupt-out");
    let err = Pull::new(&env.repo, &cache, &"victim".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains(&pack.to_string()),
        "names the pack: {err}"
    );
    let left: Vec<_> = std::fs::read_dir(&dest).unwrap().collect();
    assert!(
        left.is_empty(),
        "nothing materialised, no temp file left: {left:?}"
    );
    let report = verify(
        &env.repo,
        &cache,
        Some(&"victim".parse().unwrap()),
        true,
        np(),
    )
    .await
    .unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains(&pack.to_string())),
        "{:?}",
        report.problems
    );
    env.repo.remote().delete(&key).await.unwrap();
    env.repo.remote().put(&key, original).await.unwrap();
}

async fn check_rebuild_index(env: &Env) {
    for o in env.repo.remote().list("index/").await.unwrap() {
        env.repo.remote().delete(&o.key).await.unwrap();
    }
    let (idx, _) = env.repo.load_index().await.unwrap();
    assert!(idx.is_empty());
    let (packs, chunks) = env.repo.rebuild_index().await.unwrap();
    assert!(packs > 0 && chunks > 0);
    let dest = env.root.join("after-rebuild");
    Pull::new(
        &env.repo,
        &env.fresh_cache("rebuild-cache"),
        &"ds".parse().unwrap(),
        &dest,
    )
    .threads(2)
    .progress(np())
    .run()
    .await
    .unwrap();
    assert_same_tree(&env.root.join("src"), &dest);
}

async fn check_gc_sweeps_only_unreferenced(env: &Env) {
    // An orphan pack, as a push that crashed after uploading would leave.
    let mut b = PackBuilder::default();
    let data = b"orphaned chunk".to_vec();
    b.add(ChunkId::of(&data), &data, data.len() as u32, 0);
    let orphan = b.seal();
    let key = labsync_store::pack_key(&orphan.id);
    env.repo
        .remote()
        .put(&key, orphan.bytes.into())
        .await
        .unwrap();

    // Young: kept under the default grace period.
    let g = gc(&env.repo, false, None, &NoProgress).await.unwrap();
    assert!(g.deleted.is_empty() && g.condemned.is_empty());
    assert!(env.repo.remote().head(&key).await.unwrap().is_some());
    // Dry run changes nothing.
    let g = gc(&env.repo, true, Some(0), &NoProgress).await.unwrap();
    assert!(g.deleted.contains(&orphan.id));
    assert!(env.repo.remote().head(&key).await.unwrap().is_some());
    // Grace 0: condemned and deleted; everything referenced survives.
    let g = gc(&env.repo, false, Some(0), &NoProgress).await.unwrap();
    assert_eq!(g.deleted, vec![orphan.id]);
    assert!(env.repo.remote().head(&key).await.unwrap().is_none());
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

async fn check_malicious_snapshots_are_refused(env: &Env) {
    let evil = |path: &str, kind: Kind, target: &str| Entry {
        path: path.as_bytes().to_vec(),
        kind,
        mode: 0o644,
        mtime_ns: 0,
        size: if kind == Kind::File { 4 } else { 0 },
        chunks: if kind == Kind::File {
            vec![ChunkId::of(b"pwnd")]
        } else {
            vec![]
        },
        target: target.as_bytes().to_vec(),
    };
    let cases: Vec<(&str, Vec<Entry>)> = vec![
        ("dotdot", vec![evil("../escaped", Kind::File, "")]),
        ("absolute", vec![evil("/tmp/escaped", Kind::File, "")]),
        (
            "via-symlink",
            vec![
                evil("link", Kind::Symlink, "/tmp"),
                evil("link/escaped", Kind::File, ""),
            ],
        ),
    ];
    for (name, entries) in cases {
        let rec = plant_snapshot(&env.repo, name, &entries).await;
        let dest = env.root.join(format!("evil-{name}"));
        let err = Pull::new(&env.repo, &env.cache, &name.parse().unwrap(), &dest)
            .threads(2)
            .progress(np())
            .run()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::UnsafePath { .. }), "{name}: {err}");
        assert!(!env.root.join("escaped").exists() && !Path::new("/tmp/escaped").exists());
        assert!(rec.version == 1);
    }
}

/// Writes a hand-made snapshot and ref, bypassing push's checks.
async fn plant_snapshot(repo: &Repo, name: &str, entries: &[Entry]) -> VersionRecord {
    let seg = labsync_store::encode_segment(entries);
    let id = ChunkId::of(&seg);
    let mut b = PackBuilder::default();
    b.add(id, &seg, seg.len() as u32, 2);
    b.add(ChunkId::of(b"pwnd"), b"pwnd", 4, 0);
    let p = b.seal();
    repo.remote()
        .put(&labsync_store::pack_key(&p.id), p.bytes.clone().into())
        .await
        .unwrap();
    repo.write_index(&[IndexPack::new(p.id, p.bytes.len() as u64, &p.entries)])
        .await
        .unwrap();
    let snap = SnapshotObject {
        files: 1,
        dirs: 0,
        symlinks: 0,
        bytes: 4,
        segments: vec![labsync_store::SegmentRef {
            id,
            entries: entries.len() as u32,
        }],
    };
    let (sid, bytes) = snap.encode();
    repo.remote()
        .put(&format!("snapshots/{sid}"), bytes.into())
        .await
        .unwrap();
    let rec = VersionRecord {
        name: name.into(),
        version: 0,
        snapshot: sid,
        time: 0,
        user: "mallory".into(),
        host: "x".into(),
        files: 1,
        bytes: 4,
        stored_bytes: 4,
        new_bytes: 0,
        added: 0,
        removed: 0,
        modified: 0,
        forgotten: false,
        provenance: None,
    };
    repo.commit_version(rec).await.unwrap().0
}

async fn check_interrupted_pull_resumes(env: &Env) {
    let dest = env.root.join("resume");
    let cache = env.fresh_cache("resume-cache");
    let first = Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    // Simulate an interruption: some files never got renamed into place.
    let mut removed = 0;
    for e in std::fs::read_dir(&dest).unwrap().flatten() {
        if e.file_type().unwrap().is_file() && removed < 3 {
            std::fs::remove_file(e.path()).unwrap();
            removed += 1;
        }
    }
    let again = Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_eq!(again.files_written, removed);
    assert_eq!(again.files_skipped, first.files_written - removed);
    assert_eq!(again.packs_fetched, 0, "nothing downloaded twice");
    assert_same_tree(&env.root.join("src"), &dest);
}

async fn conformance(remote: Remote) {
    let env = Env::new(remote).await;
    check_conditional_create(&env).await;
    check_round_trip(&env).await;
    check_unchanged_repush_creates_nothing(&env).await;
    check_small_change_stores_little(&env).await;
    check_interrupted_pull_resumes(&env).await;
    check_concurrent_pushes_keep_both_versions(&env).await;
    check_corrupt_chunk_is_never_materialised(&env).await;
    check_malicious_snapshots_are_refused(&env).await;
    check_rebuild_index(&env).await;
    check_gc_sweeps_only_unreferenced(&env).await;
}

/// Regression: push and pull futures were not `Send` for every lifetime
/// `tokio::spawn` asks of them ("implementation of `FnOnce` is not general
/// enough": closures inside `stream::iter(..).map(..)`), so labd had to run
/// them on blocking threads. This test stops compiling if that comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_futures_can_be_spawned() {
    let env = Arc::new(Env::new(Remote::memory()).await);
    let src = env.root.join("src");
    write_tree(&src, 3);
    let e = env.clone();
    let s = src.clone();
    let pushed = tokio::spawn(async move { push(&e.repo, &s, &opts("ds", &e.cache), np()).await })
        .await
        .unwrap()
        .unwrap();
    assert!(pushed.created);
    let e = env.clone();
    tokio::spawn(async move { e.pull_matches("ds", &src, "spawned").await })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_memory() {
    conformance(Remote::memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_local_folder() {
    let dir = tempfile::tempdir().unwrap();
    conformance(Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap()).await;
}

/// A local store on another file system than the cache: packs cannot be
/// hard-linked and are read through memory, so every hostile case (a
/// corrupt chunk, malicious snapshots) goes through that path too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_local_folder_on_another_file_system() {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    let shm = Path::new("/dev/shm");
    if dev(shm).is_none() || dev(shm) == dev(&std::env::temp_dir()) {
        eprintln!("SKIPPED: /dev/shm is missing or on the temporary folder's file system");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    conformance(Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3() {
    let Some(s3) = S3Server::start() else { return };
    conformance(s3.remote("conformance")).await;
}

// ------------------------------------------------------------- local-only cases

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_codec_compresses_text_keeps_random_plain_and_pulls_back() {
    let dir = tempfile::tempdir().unwrap();
    let remote = Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap();
    let env = Env::new(remote).await;
    let mut random = vec![0u8; 200_000]; // under the minimum chunk: one chunk
    for (codec, flag) in [(Codec::Lz4, FLAG_LZ4), (Codec::Zstd, FLAG_ZSTD)] {
        let src = env.root.join(format!("src-{codec}"));
        std::fs::create_dir_all(&src).unwrap();
        let text = format!("def step_{codec}(model, batch):\n    return model(batch).mean()\n")
            .repeat(2000)
            .into_bytes();
        blake3::Hasher::new()
            .update(codec.to_string().as_bytes())
            .finalize_xof()
            .fill(&mut random);
        std::fs::write(src.join("train.py"), &text).unwrap();
        std::fs::write(src.join("weights.bin"), &random).unwrap();
        let o = PushOptions {
            compression: codec,
            ..opts(&format!("code-{codec}"), &env.cache)
        };
        push(&env.repo, &src, &o, np()).await.unwrap();
        let (index, _) = env.repo.load_index().await.unwrap();
        let (_, t) = index.get(&ChunkId::of(&text)).unwrap();
        assert_eq!(t.flags, flag, "{codec}: text is compressed with it");
        assert!(t.stored_len * 10 < t.raw_len, "{codec}: {t:?}");
        let (_, r) = index.get(&ChunkId::of(&random)).unwrap();
        assert_eq!(r.flags, 0, "{codec}: random bytes are stored plain");
        env.pull_matches(&format!("code-{codec}"), &src, &format!("out-{codec}"))
            .await;
    }
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_during_push_never_deletes_what_the_push_references() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("big");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..40 {
        std::fs::write(
            src.join(format!("f{i}")),
            support::random_bytes(1_000_000, i),
        )
        .unwrap();
    }
    // Leftovers of an earlier crashed push, condemned by a gc two hours ago:
    // this gc deletes them while the push's own young packs must survive.
    let mut b = PackBuilder::default();
    b.add(ChunkId::of(b"old"), b"old", 3, 0);
    let orphan = b.seal();
    let key = labsync_store::pack_key(&orphan.id);
    env.repo
        .remote()
        .put(&key, orphan.bytes.into())
        .await
        .unwrap();
    let two_hours_ago =
        filetime::FileTime::from_unix_time(filetime::FileTime::now().unix_seconds() - 7200, 0);
    filetime::set_file_mtime(env.repo.remote().local_path(&key).unwrap(), two_hours_ago).unwrap();
    let rec = serde_json::json!({"time": two_hours_ago.unix_seconds(), "packs": [orphan.id]});
    env.repo
        .remote()
        .put("gc/condemned-old", serde_json::to_vec(&rec).unwrap().into())
        .await
        .unwrap();
    // Its age is the store's, not its own word (anyone may write one).
    let rec_path = env.repo.remote().local_path("gc/condemned-old").unwrap();
    filetime::set_file_mtime(rec_path, two_hours_ago).unwrap();
    let o = opts("big", &env.cache);
    let (pushed, swept) = tokio::join!(push(&env.repo, &src, &o, np()), async {
        let mut runs = Vec::new();
        for _ in 0..10 {
            runs.push(gc(&env.repo, false, Some(60), &NoProgress).await.unwrap());
            tokio::task::yield_now().await;
        }
        runs
    });
    pushed.unwrap();
    let deleted: Vec<_> = swept
        .iter()
        .flat_map(|g| g.deleted.iter().copied())
        .collect();
    assert_eq!(
        deleted,
        vec![orphan.id],
        "only the old orphan goes; the running push's packs are young"
    );
    assert!(env.repo.remote().head(&key).await.unwrap().is_none());
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    env.pull_matches("big", &src, "out").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_of_many_small_files_writes_few_objects() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("small");
    for d in 0..20 {
        std::fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
        for f in 0..250 {
            std::fs::write(
                src.join(format!("d{d}/f{f}.py")),
                format!("print({d} * {f})\n").repeat(1 + f % 7),
            )
            .unwrap();
        }
    }
    let r = push(&env.repo, &src, &opts("small", &env.cache), np())
        .await
        .unwrap();
    // 5,000 files: data pack(s) + tree pack + index + snapshot + ref.
    assert!(
        r.objects_written <= 8,
        "{} objects for 5,000 files",
        r.objects_written
    );
    env.pull_matches("small", &src, "out").await;
}

/// Pushes a folder `name` holding one file of `len` random bytes (`seed`)
/// as `name@v1`.
async fn push_random(env: &Env, name: &str, len: usize, seed: u64) {
    let src = env.root.join(name);
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("data"), support::random_bytes(len, seed)).unwrap();
    push(&env.repo, &src, &opts(name, &env.cache), np())
        .await
        .unwrap();
}

/// Issue 41, point 6: `labsync cache pin ds`, then a pull of `ds` into
/// an up-to-date folder (which needs no pack): the pin keeps every pack
/// it had. Before, the cache showed `ds@v1 0 B pinned` and the packs
/// were gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_pull_keeps_a_pins_packs() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    push_random(&env, "ds", 1_200_000, 7).await;
    let dest = env.root.join("D");
    env.pull_into("ds", &dest).await.unwrap();
    let held = |env: &Env| {
        let st = env.cache.status().unwrap();
        let (id, c, present) = st
            .snapshots
            .iter()
            .find(|(_, c, _)| c.label == "ds@v1")
            .expect("ds@v1 cached")
            .clone();
        (id, present, c.packs)
    };
    let (id, bytes, packs) = held(&env);
    assert!(bytes > 1_000_000, "{bytes}");
    env.cache.set_pinned(id, true).unwrap();
    env.pull_into("ds", &dest).await.unwrap();
    let (_, after, _) = held(&env);
    assert_eq!(after, bytes, "the pin's packs are kept");
    for (p, _) in &packs {
        assert!(env.cache.pack_path(p).exists(), "pack {p} removed");
    }
}

/// Issue 41, point 5: a snapshot a pull is reading (held) is never
/// evicted, whoever evicts; once the pull lets go, it is evicted as any
/// other. Before, a pull that finished first evicted the one another pull
/// was still reading, which then failed blaming the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_being_pulled_is_never_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    push_random(&env, "a", 1_200_000, 11).await;
    let a = labsync_store::warm(&env.repo, &env.cache, &"a".parse().unwrap(), np())
        .await
        .unwrap()
        .0;
    let hold = env.cache.hold(a.snapshot).unwrap();
    // Another process's view of the same cache evicts everything it may.
    let other = NodeCache::open(&env.root.join("cache"), 1 << 30).unwrap();
    assert_eq!(other.evict_to(0, None).unwrap(), Vec::<String>::new());
    let st = env.cache.status().unwrap();
    assert!(st.snapshots.iter().any(|(_, c, _)| c.label == "a@v1"));
    assert!(st.used_bytes > 1_000_000, "{}", st.used_bytes);
    drop(hold);
    assert_eq!(other.evict_to(0, None).unwrap(), vec!["a@v1".to_string()]);
    assert_eq!(env.cache.status().unwrap().used_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_evicts_lru_whole_snapshots_but_never_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let cache = NodeCache::open(&env.root.join("small-cache"), 3_000_000).unwrap();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        push_random(&env, name, 1_200_000, 100 + i as u64).await;
    }
    let a = labsync_store::warm(&env.repo, &cache, &"a".parse().unwrap(), np())
        .await
        .unwrap()
        .0;
    cache.set_pinned(a.snapshot, true).unwrap();
    for name in ["b", "c"] {
        let dest = env.root.join(format!("o{name}"));
        Pull::new(&env.repo, &cache, &name.parse().unwrap(), &dest)
            .threads(2)
            .progress(np())
            .run()
            .await
            .unwrap();
    }
    let st = cache.status().unwrap();
    let labels: Vec<_> = st.snapshots.iter().map(|s| s.1.label.clone()).collect();
    assert!(
        labels.contains(&"a@v1".to_string()),
        "pinned survives: {labels:?}"
    );
    assert!(
        labels.contains(&"c@v1".to_string()),
        "most recent survives: {labels:?}"
    );
    assert!(
        !labels.contains(&"b@v1".to_string()),
        "LRU evicted: {labels:?}"
    );
    assert!(st.used_bytes <= 3_000_000);
    cache.set_pinned(a.snapshot, false).unwrap();
    cache.evict_to(0, None).unwrap();
    assert_eq!(cache.status().unwrap().used_bytes, 0);
    let left = walk_files(&env.root.join("small-cache/packs-v1"));
    assert_eq!(left, 0, "evicted packs are deleted from disk");

    // Regression: eviction removed the temporary file of a pack another
    // pull was writing, whose rename then failed ("No such file"). A fresh
    // one stays; one a killed process left an hour ago goes.
    let fan = env.root.join("small-cache/packs-v1/ab");
    std::fs::create_dir_all(&fan).unwrap();
    let (writing, stale) = (
        fan.join(".labsync-tmp.1.2.3"),
        fan.join(".labsync-tmp.4.5.6"),
    );
    std::fs::write(&writing, b"half a pack").unwrap();
    std::fs::write(&stale, b"left by a crash").unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::options()
        .write(true)
        .open(&stale)
        .unwrap()
        .set_modified(old)
        .unwrap();
    cache.evict_to(0, None).unwrap();
    assert!(writing.exists(), "a pack being written is not removed");
    assert!(!stale.exists(), "a stale temporary file is removed");
}

/// Warms alone (a coordinator prefetching for a long queue) keep the node
/// cache under its cap, as pulls do: the least recently used goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warms_keep_the_cache_under_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let cache = NodeCache::open(&env.root.join("small-cache"), 3_000_000).unwrap();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        push_random(&env, name, 1_200_000, 200 + i as u64).await;
        labsync_store::warm(&env.repo, &cache, &name.parse().unwrap(), np())
            .await
            .unwrap();
    }
    let st = cache.status().unwrap();
    let labels: Vec<_> = st.snapshots.iter().map(|s| s.1.label.clone()).collect();
    assert!(
        st.used_bytes <= 3_000_000,
        "{} bytes: {labels:?}",
        st.used_bytes
    );
    // The one just warmed stays; one of the others (all used within the
    // same second here) made room.
    assert!(labels.contains(&"c@v1".to_string()), "{labels:?}");
    assert_eq!(labels.len(), 2, "{labels:?}");
}

fn walk_files(p: &Path) -> usize {
    std::fs::read_dir(p).map_or(0, |rd| {
        rd.flatten()
            .map(|e| {
                if e.file_type().unwrap().is_dir() {
                    walk_files(&e.path())
                } else {
                    1
                }
            })
            .sum()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_node_cache_is_refetched_not_materialised() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 3);
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    // A cache filled by copy, not hard link, so corrupting it leaves the store intact.
    let cache = env.fresh_cache("copy-cache");
    labsync_store::warm(&env.repo, &cache, &"ds".parse().unwrap(), np())
        .await
        .unwrap();
    for p in support::files_under(&cache.root().join("packs-v1")) {
        let mut b = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        b[5] ^= 0x55;
        std::fs::write(&p, b).unwrap();
    }
    let out = env.root.join("out");
    Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &out);
}

/// Regression: readers wait for pack buffers the uploader hands back; when an
/// upload fails, the push must end with that error instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_upload_ends_the_push_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let remote = Remote::local(&store).unwrap();
    let env = Env::new(remote).await;
    // `packs` as a plain file: every pack write fails.
    std::fs::write(store.join("packs"), b"in the way").unwrap();
    let src = env.root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..6 {
        std::fs::write(
            src.join(format!("f{i}")),
            support::random_bytes(20 << 20, 500 + i),
        )
        .unwrap();
    }
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        push(&env.repo, &src, &opts("x", &env.cache), np()),
    )
    .await;
    let err = r.expect("push must not hang").unwrap_err();
    assert!(
        err.to_string().contains("packs/"),
        "names the object: {err}"
    );
    assert!(
        env.repo.versions("x").await.unwrap().is_empty(),
        "no ref without its data"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_then_gc_frees_only_the_forgotten_versions_data() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = push_one_file(&env, "src", "ds", "a", &support::random_bytes(3_000_000, 1)).await;
    std::fs::write(src.join("a"), support::random_bytes(3_000_000, 2)).unwrap();
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let before = env.repo.remote().list("packs/").await.unwrap().len();

    assert!(
        env.repo.forget(&"ds".parse().unwrap()).await.is_err(),
        "a version must be named"
    );
    env.repo.forget(&"ds@v1".parse().unwrap()).await.unwrap();
    assert_eq!(
        env.repo
            .versions("ds")
            .await
            .unwrap()
            .iter()
            .map(|v| v.version)
            .collect::<Vec<_>>(),
        vec![2]
    );
    let g = gc(&env.repo, false, Some(0), &NoProgress).await.unwrap();
    // v1's data pack and its tree pack (its only segment changed in v2).
    assert_eq!(g.deleted.len(), 2, "v1's own packs go");
    assert_eq!(
        env.repo.remote().list("packs/").await.unwrap().len(),
        before - 2
    );
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    Pull::new(
        &env.repo,
        &env.cache,
        &"ds".parse().unwrap(),
        &env.root.join("out"),
    )
    .threads(2)
    .progress(np())
    .run()
    .await
    .unwrap();
    assert_same_tree(&src, &env.root.join("out"));

    // Numbers are never reused: v1's content again becomes v3.
    std::fs::write(src.join("a"), support::random_bytes(3_000_000, 1)).unwrap();
    let r = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    assert_eq!(r.record.version, 3);
}

/// A push killed mid-pack leaves a staging file (`key#N`) on a local store:
/// gc removes it once it is older than the grace period, keeps a young one
/// (a write that may still be in progress), and never touches real packs.
#[tokio::test]
async fn gc_removes_stale_staging_files_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let env = Env::new(Remote::local(&store).unwrap()).await;
    push_one_file(&env, "src", "ds", "a", &support::random_bytes(2_000_000, 5)).await;
    let packs = env.repo.remote().list("packs/").await.unwrap();
    let real = store.join(&packs[0].key);
    let stale = real.with_file_name("0123abcd#4242-0");
    let young = real.with_file_name("4567cdef#4242-1");
    std::fs::write(&stale, vec![7u8; 5000]).unwrap();
    std::fs::write(&young, vec![7u8; 3000]).unwrap();
    let two_days_ago = filetime::FileTime::from_unix_time(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
            - 2 * 86400,
        0,
    );
    filetime::set_file_mtime(&stale, two_days_ago).unwrap();

    let g = gc(&env.repo, true, None, &NoProgress).await.unwrap();
    assert_eq!((g.deleted_staging, g.deleted_staging_bytes), (1, 5000));
    assert!(stale.exists(), "a dry run removes nothing");
    let g = gc(&env.repo, false, None, &NoProgress).await.unwrap();
    assert_eq!((g.deleted_staging, g.deleted_staging_bytes), (1, 5000));
    assert!(!stale.exists() && young.exists() && real.exists());
    assert!(g.deleted.is_empty());
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// A directory in the destination where the snapshot has a file is reported
/// as such (not as a bare rename error), and left as it was.
#[tokio::test]
async fn pull_refuses_a_directory_in_place_of_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    push_one_file(&env, "src", "ds", "model.pt", b"weights").await;
    let out = env.root.join("out");
    std::fs::create_dir_all(out.join("model.pt")).unwrap();
    std::fs::write(out.join("model.pt/keep"), b"mine").unwrap();
    let err = Pull::new(&env.repo, &env.cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("is a directory where the snapshot has a file"),
        "{err}"
    );
    assert_eq!(std::fs::read(out.join("model.pt/keep")).unwrap(), b"mine");
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, ["model.pt"], "no temporary file is left behind");
}

/// A push with `settle` (labd's periodic push of a running job's outputs)
/// never stores a file that is being written: one modified in the last
/// seconds keeps the content the previous push recorded, one that has no
/// previous content is left out, and both are taken once they are still.
#[tokio::test]
async fn settle_keeps_the_last_whole_copy_of_a_file_being_written() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    let ago = |secs: i64| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        filetime::FileTime::from_unix_time(now - secs, 0)
    };
    std::fs::write(src.join("model.pt"), b"epoch 1, whole").unwrap();
    filetime::set_file_mtime(src.join("model.pt"), ago(600)).unwrap();
    push(&env.repo, &src, &opts("runs/j1", &env.cache), np())
        .await
        .unwrap();

    // Mid-save: model.pt half rewritten, best.pt just created.
    std::fs::write(src.join("model.pt"), b"epoch 2, half").unwrap();
    std::fs::write(src.join("best.pt"), b"being written").unwrap();
    let settle = PushOptions {
        settle: Some(std::time::Duration::from_secs(60)),
        ..opts("runs/j1", &env.cache)
    };
    let pulled = |v: &str| {
        let out = env.root.join(format!("out-{v}"));
        let (repo, cache) = (env.repo.clone(), env.cache.clone());
        let spec: labsync_store::RefSpec = format!("runs/j1@{v}").parse().unwrap();
        async move {
            Pull::new(&repo, &cache, &spec, &out)
                .threads(2)
                .progress(np())
                .run()
                .await
                .unwrap();
            out
        }
    };
    let r = push(&env.repo, &src, &settle, np()).await.unwrap();
    assert!(!r.created, "nothing settled changed: still v1");
    let out = pulled("v1").await;
    assert_eq!(
        std::fs::read(out.join("model.pt")).unwrap(),
        b"epoch 1, whole"
    );
    assert!(!out.join("best.pt").exists());

    // Both still for long enough: taken as they are.
    std::fs::write(src.join("model.pt"), b"epoch 2, whole").unwrap();
    filetime::set_file_mtime(src.join("model.pt"), ago(120)).unwrap();
    filetime::set_file_mtime(src.join("best.pt"), ago(120)).unwrap();
    let r = push(&env.repo, &src, &settle, np()).await.unwrap();
    assert_eq!(r.record.version, 2);
    let out = pulled("v2").await;
    assert_eq!(
        std::fs::read(out.join("model.pt")).unwrap(),
        b"epoch 2, whole"
    );
    assert_eq!(
        std::fs::read(out.join("best.pt")).unwrap(),
        b"being written"
    );
}

/// Collects warnings (what a user would see).
#[derive(Default)]
struct Warnings(std::sync::Mutex<Vec<String>>);

impl labsync_store::Progress for Warnings {
    fn phase(&self, _: &str, _: Option<u64>, _: Option<u64>) {}
    fn advance(&self, _: u64, _: u64) {}
    fn warn(&self, message: &str) {
        self.0.lock().unwrap().push(message.to_string());
    }
}

/// Issue 9, point 1: `chmod 4755 x && labsync push` then a pull as root used
/// to give a root-owned setuid file (labd materialises code trees as root).
/// Push records permission bits only, and pull masks whatever a hand-made
/// snapshot says, and says so.
#[tokio::test]
async fn setuid_and_setgid_bits_never_pass_through_the_store() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(src.join("shared")).unwrap();
    std::fs::write(src.join("x"), b"#!/bin/sh\nid\n").unwrap();
    std::fs::set_permissions(src.join("x"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::fs::set_permissions(src.join("shared"), std::fs::Permissions::from_mode(0o3775)).unwrap();
    assert_eq!(mode(&src.join("x")), 0o4755);
    push(&env.repo, &src, &opts("su", &env.cache), np())
        .await
        .unwrap();
    let out = env.root.join("out");
    env.pull_into("su", &out).await.unwrap();
    assert_eq!(mode(&out.join("x")), 0o755, "setuid dropped at push");
    assert_eq!(
        mode(&out.join("shared")),
        0o1775,
        "setgid dropped, sticky kept"
    );

    // A hand-made snapshot says 4755 (and 6777 on a folder): masked at pull, with a warning.
    let file = Entry {
        path: b"d/su".to_vec(),
        kind: Kind::File,
        mode: 0o4755,
        mtime_ns: 0,
        size: 4,
        chunks: vec![ChunkId::of(b"pwnd")],
        target: vec![],
    };
    let folder = Entry {
        path: b"d".to_vec(),
        kind: Kind::Dir,
        mode: 0o6777,
        size: 0,
        chunks: vec![],
        ..file.clone()
    };
    plant_snapshot(&env.repo, "evil-su", &[folder, file]).await;
    let out = env.root.join("evil-out");
    let warnings = Arc::new(Warnings::default());
    Pull::new(&env.repo, &env.cache, &"evil-su".parse().unwrap(), &out)
        .threads(2)
        .progress(warnings.clone())
        .run()
        .await
        .unwrap();
    assert_eq!(mode(&out.join("d/su")), 0o755);
    assert_eq!(mode(&out.join("d")), 0o777);
    let w = warnings.0.lock().unwrap().join("\n");
    assert!(
        w.contains("2 entries of evil-su@v1") && w.contains("setuid"),
        "{w}"
    );

    // A setuid copy left by an older pull is not taken as complete: rewritten without the bit.
    std::fs::set_permissions(out.join("d/su"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let t = filetime::FileTime::from_unix_time(0, 0);
    filetime::set_file_mtime(out.join("d/su"), t).unwrap();
    env.pull_into("evil-su", &out).await.unwrap();
    assert_eq!(mode(&out.join("d/su")), 0o755);
}

/// Issue 41, point 1: a pull survives a power cut. On a file system that
/// keeps names and sizes through a cut but not data it was not asked to
/// sync, a pull that had finished before the cut left files of zeros at
/// their size and time (which a re-pull took for complete) and a node
/// cache whose state no pull could read. Each file's data is synced before
/// its rename, and the cache's own files before theirs: after the cut the
/// pulled folder is whole, or a re-pull makes it so.
#[tokio::test]
async fn a_pull_survives_power_loss() {
    let fs = support::Mounted::ext4_losing_unsynced(64);
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 41);
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let (cache_dir, dest) = (fs.path.join("cache"), fs.path.join("out"));
    let cache = NodeCache::open(&cache_dir, 1 << 30).unwrap();
    Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &dest);
    drop(cache);

    fs.lose_power();
    let cache = NodeCache::open(&cache_dir, 1 << 30).unwrap();
    let again = Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &dest);
    assert_eq!(again.files_written, 0, "every file was whole after the cut");
}

/// Issue 41, point 11: dedup trusts only what the packs hold. A member
/// who knows the chunks of a common file (anyone can chunk a public data
/// set) plants an index object placing them in a pack that does not exist,
/// and others in a real pack that does not hold them. A push of that file
/// skipped uploading every one of them, and its version did not restore.
/// The push confirms each chunk it did not upload by its pack's footer,
/// and uploads those that are not where the index says.
#[tokio::test]
async fn a_planted_index_entry_is_not_trusted_by_a_push() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    // Someone's data, in a real pack.
    let other = env.root.join("other");
    write_tree(&other, 3);
    push(&env.repo, &other, &plain_opts("other"), np())
        .await
        .unwrap();
    let (index, _) = env.repo.load_index().await.unwrap();
    let (real_pack, real_size) = *index.packs().iter().max_by_key(|p| p.1).unwrap();

    // The common file's chunks, as mallory learns them: pushed to a store
    // of her own.
    let common = env.root.join("common");
    std::fs::create_dir_all(&common).unwrap();
    std::fs::write(common.join("DIV2K_0001.png"), random_bytes(9_000_000, 41)).unwrap();
    let hers = Repo::open(Remote::memory(), None).await.unwrap();
    push(&hers, &common, &plain_opts("div2k"), np())
        .await
        .unwrap();
    let (learned, _) = hers.load_index().await.unwrap();
    let mut chunks: Vec<_> = learned
        .to_records(|_| true)
        .into_iter()
        .flat_map(|r| r.chunks)
        .collect();
    assert!(
        chunks.len() >= 4,
        "a file of several chunks: {}",
        chunks.len()
    );
    let mut second_half = chunks.split_off(chunks.len() / 2);
    // At the start of the real pack, where other chunks are.
    for c in &mut second_half {
        c.1 = 0;
    }
    let nowhere = IndexPack {
        pack: labsync_store::PackId::of(b"no such pack"),
        size: 64 << 20,
        chunks,
    };
    let elsewhere = IndexPack {
        pack: real_pack,
        size: real_size,
        chunks: second_half,
    };
    // Two objects: each is used (or refused) whole.
    for planted in [nowhere, elsewhere] {
        env.repo.write_index(&[planted]).await.unwrap();
    }
    let (index, _) = env.repo.load_index().await.unwrap();
    assert!(index.refused().is_empty(), "{:?}", index.refused());

    // Bob pushes the data set: every chunk of it is uploaded after all.
    let out = push(&env.repo, &common, &plain_opts("div2k"), np())
        .await
        .unwrap();
    assert!(out.created);
    assert!(
        out.new_chunks >= 4,
        "the planted chunks uploaded: {}",
        out.new_chunks
    );
    let fresh = env.fresh_cache("bob");
    let dest = env.root.join("restored");
    Pull::new(&env.repo, &fresh, &"div2k".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&common, &dest);
    // The data it did not upload was confirmed too: the other data set
    // pushed again under a new name uploads nothing.
    let again = push(&env.repo, &other, &plain_opts("other-copy"), np())
        .await
        .unwrap();
    assert_eq!(again.new_chunks, 0);
}

/// Issue 9, point 9 ("racy git"): on a file system with whole-second
/// timestamps, a file rewritten with the same size in the same second as the
/// push that recorded it has the same size, mtime, ctime and inode. The next
/// push must still read it again, not push the stale content as new code.
#[tokio::test]
async fn racily_clean_files_are_read_again_on_coarse_timestamps() {
    use std::os::unix::fs::MetadataExt;
    let fs = support::Mounted::coarse_ext4(16);
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = fs.path.join("code");
    std::fs::create_dir_all(&src).unwrap();
    let file = src.join("config.py");
    let times = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec(),
            m.ino(),
        )
    };
    let mut raced = 0;
    for round in 0..20 {
        std::fs::write(&file, format!("lr = 0.{round:02}\n")).unwrap();
        let before = times(&file);
        assert_eq!((before.1, before.3), (0, 0), "whole-second timestamps");
        push(&env.repo, &src, &opts("code", &env.cache), np())
            .await
            .unwrap();
        std::fs::write(&file, format!("lr = 9.{round:02}\n")).unwrap();
        if times(&file) != before {
            continue; // a second boundary passed: not the racy case
        }
        raced += 1;
        let r = push(&env.repo, &src, &opts("code", &env.cache), np())
            .await
            .unwrap();
        assert_eq!(r.files_read, 1, "the racily clean file is read again");
        let out = env.root.join(format!("again{round}"));
        env.pull_into("code", &out).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(out.join("config.py")).unwrap(),
            format!("lr = 9.{round:02}\n"),
            "the new content was pushed"
        );
        if raced == 3 {
            break;
        }
    }
    assert!(
        raced > 0,
        "never wrote twice within one second in 20 rounds"
    );
}

/// Issue 9, point 11: the fuzzers' corpora (fuzz/corpus/<target>/, real
/// objects of a store plus what the fuzzers found) run through the same
/// decoders on every test run: none may panic.
#[test]
fn fuzz_corpora_decode_without_panicking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    type Decoder = fn(&[u8]);
    let targets: [(&str, Decoder); 5] = [
        ("snapshot_object", labsync_store::fuzzing::snapshot_object),
        ("tree_segment", labsync_store::fuzzing::tree_segment),
        ("index_object", labsync_store::fuzzing::index_object),
        ("pack", labsync_store::fuzzing::pack),
        ("version_ref", labsync_store::fuzzing::version_ref),
    ];
    for (name, decode) in targets {
        let dir = root.join(name);
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.unwrap().path();
            // A fuzzer running beside the tests replaces inputs it reduces.
            match std::fs::read(&p) {
                Ok(bytes) => decode(&bytes),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => panic!("{}: {e}", p.display()),
            }
            n += 1;
        }
        assert!(n > 0, "no corpus for {name}");
    }
}

/// Issue 9, point 11: a snapshot that lists one tree segment twice, or
/// claims more entries than a segment holds, is refused before its tree is
/// built (a repeated segment multiplied memory by the repeat count).
#[tokio::test]
async fn snapshots_with_repeated_or_miscounted_segments_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let file = Entry {
        path: b"x".to_vec(),
        kind: Kind::File,
        mode: 0o644,
        mtime_ns: 0,
        size: 4,
        chunks: vec![ChunkId::of(b"pwnd")],
        target: vec![],
    };
    let good = plant_snapshot(&env.repo, "good", std::slice::from_ref(&file)).await;
    let (index, _) = env.repo.load_index().await.unwrap();
    let obj = env.repo.load_snapshot(&good.snapshot).await.unwrap();
    let seg = obj.segments[0];
    for (name, segments, why) in [
        ("twice", vec![seg; 100_000], "listed twice"),
        (
            "miscounted",
            vec![labsync_store::SegmentRef {
                id: seg.id,
                entries: u32::MAX,
            }],
            "4294967295 entries, more than a segment holds (512)",
        ),
        (
            // 8-byte entries by the billion: refused before any is fetched.
            "too many",
            (0u32..(16 << 20) / 512 + 1)
                .map(|i| labsync_store::SegmentRef {
                    id: ChunkId::of(&i.to_le_bytes()),
                    entries: 512,
                })
                .collect(),
            "claims 16777728 entries, more than 16777216",
        ),
    ] {
        let (sid, bytes) = SnapshotObject {
            segments,
            ..obj.clone()
        }
        .encode();
        env.repo
            .remote()
            .put(&format!("snapshots/{sid}"), bytes.into())
            .await
            .unwrap();
        let err = env.repo.load_tree(&index, &sid).await.unwrap_err();
        assert!(err.to_string().contains(why), "{name}: {err}");
    }
}

/// Issue 9, point 10: a pull onto a full disk (here a small tmpfs, with a
/// filler file) fails at once with a clear error naming the folder and the
/// space needed, leaves the node cache consistent (`verify` clean), and the
/// same pull succeeds once space is freed. Then the same with the node cache
/// itself on the full disk, the store elsewhere.
#[tokio::test]
async fn pull_onto_a_full_disk_says_so_and_succeeds_once_space_is_freed() {
    let fs = support::Mounted::tmpfs(8 << 10);
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..4u64 {
        std::fs::write(
            src.join(format!("{i}.png")),
            support::random_bytes(1_500_000, i),
        )
        .unwrap();
    }
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let filler = fs.path.join("filler");
    std::fs::write(&filler, vec![7u8; 4 << 20]).unwrap();

    // The destination is full.
    let dest = fs.path.join("ds");
    let err = env.pull_into("ds", &dest).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::NoSpace { needed, .. } if needed >= 6_000_000),
        "{msg}"
    );
    assert!(
        msg.contains(&dest.display().to_string()) && msg.contains("needed"),
        "{msg}"
    );
    let report = verify(&env.repo, &env.cache, None, false, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    std::fs::remove_file(&filler).unwrap();
    env.pull_into("ds", &dest).await.unwrap();
    assert_same_tree(&src, &dest);
    std::fs::remove_dir_all(&dest).unwrap();

    // The node cache is on the full disk and the store elsewhere: the packs
    // cannot be fetched, and nothing half-fetched stays in the cache.
    std::fs::write(&filler, vec![7u8; 4 << 20]).unwrap();
    let cache = NodeCache::open(&fs.path.join("cache"), 1 << 30).unwrap();
    let out = env.root.join("out");
    let err = Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::NoSpace { path, .. } if path.starts_with(&fs.path)),
        "{err}"
    );
    let report = verify(&env.repo, &cache, None, false, np()).await.unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    std::fs::remove_file(&filler).unwrap();
    Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &out);
}

/// Issue 18, points 1 and 2: an index object that lies about where a chunk
/// sits, written under its correct BLAKE3 name, is found by a plain
/// `verify` (the footers are compared with the index), which names the
/// repair; `pull` falls back to the pack's own footer and restores the tree;
/// `rebuild-index` repairs it. An index object that does not match its name
/// is never used, and verify says which.
#[tokio::test]
async fn an_index_that_disagrees_with_the_packs_is_found_and_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 4);
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let (index, keys) = env.repo.load_index().await.unwrap();
    let mut recs = index.to_records(|_| true);
    let rec = recs
        .iter_mut()
        .find(|r| r.chunks.iter().any(|c| c.4 & labsync_store::FLAG_TREE == 0))
        .unwrap();
    // The first chunk one byte later: still inside the pack, so only the
    // footer can tell.
    rec.chunks.sort_by_key(|c| c.1);
    rec.chunks[0].1 += 1;
    let lying = env.repo.write_index(&recs).await.unwrap().remove(0).0;
    for k in &keys {
        env.repo.remote().delete(k).await.unwrap();
    }

    let report = verify(&env.repo, &env.cache, None, false, np())
        .await
        .unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains("differ from the pack's footer")),
        "{:?}",
        report.problems
    );
    assert!(report.repair.as_deref().unwrap().contains("rebuild-index"));

    let warnings = Arc::new(Warnings::default());
    let out = env.root.join("out");
    Pull::new(&env.repo, &env.cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(warnings.clone())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &out);
    let said = warnings.0.lock().unwrap().join("\n");
    assert!(
        said.contains("disagrees with pack") && said.contains("rebuild-index"),
        "{said}"
    );
    // The same from a peer, the cache copies written behind (labd's
    // pull): the footer is read once the copy it needs is written, which
    // the pull has written then rather than after its own end.
    let cache = cache_with_good_peers(&env, &dir.path().join("store"));
    let writes = labsync_store::CacheWrites::new();
    let (out, spec) = (env.root.join("out-behind"), "ds".parse().unwrap());
    let behind = labsync_store::Pull::new(&env.repo, &cache, &spec, &out)
        .options(PLAIN_PULL)
        .progress(np())
        .writing_behind(&writes)
        .run();
    tokio::time::timeout(std::time::Duration::from_secs(60), behind)
        .await
        .expect("the pull does not wait for its own end")
        .unwrap();
    assert_same_tree(&src, &out);
    assert_eq!(writes.finish().await.failed, 0);

    env.repo.rebuild_index().await.unwrap();
    let report = verify(&env.repo, &env.cache, None, true, np())
        .await
        .unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert!(report.repair.is_none());

    // A flipped bit in an index object: refused by name, reported, not used.
    let key = env.repo.remote().list("index/").await.unwrap()[0]
        .key
        .clone();
    let path = env.repo.remote().local_path(&key).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let (index, _) = env.repo.load_index().await.unwrap();
    assert_eq!(index.refused().len(), 1);
    assert!(index.is_empty());
    let report = verify(&env.repo, &env.cache, None, false, np())
        .await
        .unwrap();
    assert!(
        report.problems[0].contains(&key) && report.problems[0].contains("does not match its name"),
        "{:?}",
        report.problems
    );
    let err = gc(&env.repo, true, None, &NoProgress).await.unwrap_err();
    assert!(err.to_string().contains("rebuild-index"), "{err}");
    assert!(lying.starts_with("index/"));
}

/// Issue 19, point 1: a file whose name is 255 bytes (the Linux limit) is
/// pushed, and its version pulls back: the temporary name a file is written
/// under no longer grows with the final name ("File name too long").
#[tokio::test]
async fn a_name_of_255_bytes_pulls_back() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    // Three-byte characters up to 255 bytes, as Korean captions make them.
    let long = format!("{}xyz", "가".repeat(84));
    assert_eq!(long.len(), 255);
    std::fs::write(src.join(&long), b"a caption").unwrap();
    std::fs::write(src.join("sub").join(&long), random_bytes(300_000, 9)).unwrap();
    push(&env.repo, &src, &opts("long", &env.cache), np())
        .await
        .unwrap();
    env.pull_matches("long", &src, "out").await;
}

/// `base/rel`, opened one name at a time: the whole path is too long to
/// name at once. Returns the folder holding it and its last name.
fn deep_parent(base: &Path, rel: &Path) -> (std::os::fd::OwnedFd, std::ffi::OsString) {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW;
    let mut fd = rustix::fs::open(base, flags, Mode::empty()).unwrap();
    let names: Vec<_> = rel.iter().collect();
    for name in &names[..names.len() - 1] {
        fd = rustix::fs::openat(&fd, *name, flags, Mode::empty()).unwrap();
    }
    (fd, names[names.len() - 1].to_owned())
}

/// Issue 19, point 1: a tree whose paths are near `PATH_MAX` (pushed from
/// a short folder) pulls into a destination whose own path takes them past
/// it, where no whole path can be named: every name is reached from its
/// folder. A second pull finds the files complete; a `--delete` pull counts
/// and removes an extra file as deep; the tree can be removed again.
#[tokio::test]
async fn paths_past_path_max_at_a_long_destination_pull_back() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    // 15 folders of 250 bytes: a relative path of 3,773 bytes.
    let deep: PathBuf = (0..15)
        .map(|i| format!("{i:03}{}", "d".repeat(247)))
        .collect();
    let rel = deep.join("file.bin");
    std::fs::create_dir_all(src.join(&deep)).unwrap();
    let data = random_bytes(300_000, 12);
    std::fs::write(src.join(&rel), &data).unwrap();
    std::fs::set_permissions(src.join(&rel), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(src.join("top.txt"), b"at the top").unwrap();
    push(&env.repo, &src, &opts("deep", &env.cache), np())
        .await
        .unwrap();

    let out = env.root.join("o".repeat(250)).join("p".repeat(250));
    let err = std::fs::read(out.join(&rel)).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENAMETOOLONG),
        "past PATH_MAX"
    );
    let got = env.pull_into("deep", &out).await.unwrap();
    assert_eq!((got.files_written, got.files_skipped), (2, 0));
    assert_eq!(std::fs::read(out.join("top.txt")).unwrap(), b"at the top");
    let (folder, name) = deep_parent(&out, &rel);
    let st = rustix::fs::statat(&folder, &name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).unwrap();
    let src_st = std::fs::metadata(src.join(&rel)).unwrap();
    assert_eq!(st.st_mode & 0o7777, 0o640);
    assert_eq!(st.st_size as u64, data.len() as u64);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (st.st_mtime, st.st_mtime_nsec as i64),
        (src_st.mtime(), src_st.mtime_nsec())
    );
    let fd = rustix::fs::openat(&folder, &name, rustix::fs::OFlags::RDONLY, 0.into()).unwrap();
    let mut back = Vec::new();
    std::io::Read::read_to_end(&mut std::fs::File::from(fd), &mut back).unwrap();
    assert!(back == data, "the deep file's content came back");

    let again = env.pull_into("deep", &out).await.unwrap();
    assert_eq!((again.files_written, again.files_skipped), (0, 2));

    let extra = rustix::fs::openat(
        &folder,
        "extra",
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
        0o644.into(),
    );
    drop(extra.unwrap());
    let deleting = env.pull_deleting("deep", &out).await.unwrap();
    assert_eq!((deleting.extra, deleting.deleted), (1, 1));
    let gone = rustix::fs::statat(&folder, "extra", rustix::fs::AtFlags::SYMLINK_NOFOLLOW);
    assert_eq!(gone.unwrap_err(), rustix::io::Errno::NOENT);

    labsync_store::remove_tree(&out).unwrap();
    assert!(!out.exists());
}

/// A tree deeper than `MAX_DEPTH` (256) names is refused by push, naming
/// the path, so pull never meets one it would refuse; 256 deep is kept.
#[tokio::test]
async fn trees_deeper_than_256_are_refused_at_push_and_256_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    let at_limit: PathBuf = std::iter::repeat_n("d", 255).collect();
    std::fs::create_dir_all(src.join(&at_limit)).unwrap();
    std::fs::write(src.join(&at_limit).join("f"), b"256 names deep").unwrap();
    push(&env.repo, &src, &opts("deep", &env.cache), np())
        .await
        .unwrap();
    env.pull_matches("deep", &src, "out").await;
    std::fs::create_dir(src.join(&at_limit).join("d")).unwrap();
    std::fs::write(src.join(&at_limit).join("d/f"), b"257 names deep").unwrap();
    let err = push(&env.repo, &src, &opts("deep", &env.cache), np())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("more than 256 folders deep"),
        "{err}"
    );
}

/// Swaps files of the source for a FIFO and a symlink to a secret when the
/// read stage starts: after the scan saw them as regular files.
struct SwapAtRead {
    src: PathBuf,
    secret: PathBuf,
    warnings: Warnings,
}

impl labsync_store::Progress for SwapAtRead {
    fn phase(&self, name: &str, _: Option<u64>, _: Option<u64>) {
        if name == "read" {
            let (fifo, link) = (self.src.join("fifo.bin"), self.src.join("link.bin"));
            std::fs::remove_file(&fifo).unwrap();
            let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
            #[allow(unsafe_code)]
            // SAFETY: a NUL-terminated path that outlives the call.
            let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
            assert_eq!(rc, 0, "mkfifo");
            std::fs::remove_file(&link).unwrap();
            std::os::unix::fs::symlink(&self.secret, &link).unwrap();
        }
    }
    fn advance(&self, _: u64, _: u64) {}
    fn warn(&self, message: &str) {
        self.warnings.warn(message);
    }
}

/// As an attacker: files swapped for a FIFO and for a symlink to a secret
/// between the scan and the read (labd pushes job outputs as root) are
/// skipped with a warning. The push neither hangs on the FIFO nor reads
/// the secret through the link.
#[tokio::test]
async fn files_swapped_for_a_fifo_or_a_symlink_mid_push_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for name in ["fifo.bin", "link.bin", "kept.bin"] {
        std::fs::write(src.join(name), random_bytes(5_000, 3)).unwrap();
    }
    let secret = env.root.join("secret");
    std::fs::write(&secret, b"root's secret").unwrap();
    let progress = Arc::new(SwapAtRead {
        src: src.clone(),
        secret,
        warnings: Warnings(Default::default()),
    });
    let pushed = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        push(&env.repo, &src, &plain_opts("swapped"), progress.clone()),
    )
    .await
    .expect("the push did not hang on the FIFO")
    .unwrap();
    assert_eq!(pushed.files_read, 1, "only kept.bin was read");
    let warned = progress.warnings.0.lock().unwrap().join("\n");
    assert!(
        warned.contains("fifo.bin: replaced by something that is not a file"),
        "{warned}"
    );
    assert!(
        warned.contains("link.bin: replaced by a symlink"),
        "{warned}"
    );
    let out = env.root.join("out");
    env.pull_into("swapped", &out).await.unwrap();
    assert!(out.join("kept.bin").exists());
    for name in ["fifo.bin", "link.bin"] {
        let back = std::fs::read(out.join(name)).unwrap_or_default();
        assert!(!back.windows(6).any(|w| w == b"secret"), "{name}");
    }
}

/// Issue 19, point 4: what the destination holds beyond the version is
/// counted (and left) by a plain pull, and removed by `delete`, leaving the
/// folder equal to the version. A symlink in the way is removed, never
/// followed.
#[tokio::test]
async fn pull_counts_extras_and_delete_removes_them() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 6);
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let out = env.root.join("out");
    let outside = env.root.join("outside");
    std::fs::create_dir_all(out.join("a/old/deeper")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("keep"), b"not ours").unwrap();
    std::fs::write(out.join("stale.txt"), b"x").unwrap();
    std::fs::write(out.join("a/old/deeper/f"), b"y").unwrap();
    std::os::unix::fs::symlink(&outside, out.join("a/escape")).unwrap();

    let first = env.pull_into("ds", &out).await.unwrap();
    // stale.txt, a/escape, and a/old with deeper/ and f.
    assert_eq!((first.extra, first.deleted), (5, 0));
    assert!(out.join("stale.txt").exists());

    let deleted = env.pull_deleting("ds", &out).await.unwrap();
    assert_eq!((deleted.extra, deleted.deleted), (5, 5));
    assert_same_tree(&src, &out);
    assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"not ours");

    // Into an empty folder there is nothing to count.
    let fresh = env.pull_into("ds", &env.root.join("fresh")).await.unwrap();
    assert_eq!((fresh.extra, fresh.deleted), (0, 0));
}

/// A caller told which snapshot a name holds (a node, by the coordinator)
/// gets that snapshot or, when the name has moved on since, an error naming
/// both, before any file is written.
#[tokio::test]
async fn a_pull_expecting_a_snapshot_refuses_a_name_that_moved() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 7);
    let v1 = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap()
        .record;
    std::fs::write(src.join("new.txt"), b"v2").unwrap();
    let v2 = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap()
        .record;
    assert_ne!(v1.snapshot, v2.snapshot);
    let (repo, cache) = (&env.repo, &env.cache);
    let pull_expecting = |snapshot, out| {
        let opts = labsync_store::PullOptions {
            threads: 2,
            delete: false,
            shared: false,
            expect: Some(snapshot),
        };
        let spec = "ds".parse().unwrap();
        async move {
            labsync_store::Pull::new(repo, cache, &spec, out)
                .options(opts)
                .progress(np())
                .run()
                .await
        }
    };
    let stale = env.root.join("stale");
    let err = pull_expecting(v1.snapshot, &stale).await.unwrap_err();
    assert!(matches!(err, labsync_store::Error::Moved { .. }), "{err}");
    let said = err.to_string();
    assert!(
        said.contains("ds@v2") && said.contains(&v1.snapshot.to_string()),
        "{said}"
    );
    assert!(!stale.exists(), "nothing is written for a name that moved");

    let out = env.root.join("out");
    let got = pull_expecting(v2.snapshot, &out).await.unwrap();
    assert_eq!(got.record.snapshot, v2.snapshot);
    assert_same_tree(&src, &out);
}

/// A local store on another file system than the node cache (a second
/// disk, an NFS mount) cannot be hard-linked from: its packs are read like
/// a remote store's (through memory, which `sync-cold-tmpfs.md` times), the
/// cache gets copies of its own, and the files come out whole.
#[tokio::test]
async fn a_local_store_on_another_file_system_pulls_into_copies() {
    use std::os::unix::fs::MetadataExt;
    let shm = Path::new("/dev/shm");
    let dir = tempfile::tempdir().unwrap();
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    if dev(shm).is_none() || dev(shm) == dev(dir.path()) {
        eprintln!("SKIPPED: /dev/shm is missing or on the temporary folder's file system");
        return;
    }
    let store = tempfile::tempdir_in(shm).unwrap();
    let env = Env::new(Remote::local(store.path()).unwrap()).await;
    let src = env.root.join("src");
    write_tree(&src, 8);
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let cache = env.fresh_cache("node-cache");
    let out = env.root.join("out");
    let got = Pull::new(&env.repo, &cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &out);
    assert!(got.packs_fetched > 0);
    let mut cached = 0;
    for sub in std::fs::read_dir(env.root.join("node-cache/packs-v1")).unwrap() {
        for e in std::fs::read_dir(sub.unwrap().path()).unwrap() {
            let e = e.unwrap().path();
            assert_eq!(
                e.metadata().unwrap().nlink(),
                1,
                "{} is its own copy",
                e.display()
            );
            cached += 1;
        }
    }
    assert_eq!(cached, got.packs_fetched);
}

/// Issue 19, point 5: FIFOs (like sockets and devices) are not kept, and a
/// push says so once, with a count and the first few paths, not once each.
#[tokio::test]
async fn special_files_are_skipped_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(src.join("pipes")).unwrap();
    std::fs::write(src.join("data.txt"), b"kept").unwrap();
    for i in 0..5 {
        let p = src.join(format!("pipes/fifo{i}"));
        let ok = std::process::Command::new("mkfifo")
            .arg(&p)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mkfifo {}", p.display());
    }
    let warnings = Arc::new(Warnings::default());
    let out = push(
        &env.repo,
        &src,
        &opts("pipes", &env.cache),
        warnings.clone(),
    )
    .await
    .unwrap();
    assert_eq!(out.record.files, 1);
    let said = warnings.0.lock().unwrap().clone();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("skipped 5 entries")
            && said[0].contains("pipes/fifo0")
            && said[0].ends_with(", ..."),
        "{said:?}"
    );
}

/// Issue 19, point 3: a sparse file (50 MB holding 8 KB of data, with a
/// hole at its end) comes back sparse: blocks of zeros are not written.
#[tokio::test]
async fn sparse_files_stay_sparse() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let f = std::fs::File::create(src.join("ckpt.pt")).unwrap();
    f.set_len(50 << 20).unwrap();
    f.write_all_at(&random_bytes(4096, 1), 10 << 20).unwrap();
    f.write_all_at(&random_bytes(4096, 2), 30 << 20).unwrap();
    drop(f);
    let allocated = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
    assert!(
        allocated(&src.join("ckpt.pt")) < 1 << 20,
        "the source is not sparse here"
    );
    push(&env.repo, &src, &opts("sparse", &env.cache), np())
        .await
        .unwrap();
    env.pull_matches("sparse", &src, "out").await;
    let out = env.root.join("out/ckpt.pt");
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 50 << 20);
    assert!(
        allocated(&out) < 1 << 20,
        "{} bytes allocated",
        allocated(&out)
    );
}

/// Issue 19, point 2: hard links are kept within a tree: the data is read,
/// stored and written once, and the pulled names share one inode.
#[tokio::test]
async fn hard_links_are_kept() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("df2k");
    std::fs::create_dir_all(src.join("DIV2K")).unwrap();
    std::fs::create_dir_all(src.join("all")).unwrap();
    std::fs::write(src.join("DIV2K/0001.png"), random_bytes(2_000_000, 21)).unwrap();
    std::fs::hard_link(src.join("DIV2K/0001.png"), src.join("all/0001.png")).unwrap();
    std::fs::hard_link(src.join("DIV2K/0001.png"), src.join("zz.png")).unwrap();
    std::fs::write(src.join("DIV2K/0002.png"), random_bytes(10_000, 22)).unwrap();
    let pushed = push(&env.repo, &src, &opts("df2k", &env.cache), np())
        .await
        .unwrap();
    assert_eq!(pushed.files_read, 2, "each inode is read once");
    assert_eq!(pushed.record.files, 4);
    assert!(pushed.record.bytes < 2_100_000, "{}", pushed.record.bytes);

    let out = env.root.join("out");
    let first = env.pull_into("df2k", &out).await.unwrap();
    assert_eq!(first.files_written, 2);
    assert_same_tree(&src, &out);
    let ino = |p: &str| std::fs::metadata(out.join(p)).unwrap().ino();
    assert_eq!(ino("all/0001.png"), ino("DIV2K/0001.png"));
    assert_eq!(ino("zz.png"), ino("DIV2K/0001.png"));
    assert_ne!(ino("DIV2K/0002.png"), ino("DIV2K/0001.png"));
    assert_eq!(std::fs::metadata(out.join("zz.png")).unwrap().nlink(), 3);

    // Again over itself: nothing to write, the links stay.
    let again = env.pull_into("df2k", &out).await.unwrap();
    assert_eq!((again.files_written, again.extra), (0, 0));
    assert_eq!(ino("zz.png"), ino("DIV2K/0001.png"));
}

/// Issue 19: with `delete`, a path whose type changed between the version
/// in the destination and the one pulled (a file that became a folder, a
/// folder that became a file, a symlink where a folder now is) is replaced;
/// without it the pull refuses and nothing is removed.
#[tokio::test]
async fn delete_replaces_a_path_whose_type_changed() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(src.join("was-file")).unwrap();
    std::fs::write(src.join("was-file/inside"), b"now a folder").unwrap();
    std::fs::write(src.join("was-dir"), b"now a file").unwrap();
    std::fs::create_dir_all(src.join("was-link")).unwrap();
    std::fs::write(src.join("was-link/x"), b"x").unwrap();
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();

    let out = env.root.join("out");
    let outside = env.root.join("outside");
    std::fs::create_dir_all(out.join("was-dir/old")).unwrap();
    std::fs::write(out.join("was-dir/old/f"), b"old").unwrap();
    std::fs::write(out.join("was-file"), b"old file").unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("x"), b"not ours").unwrap();
    std::os::unix::fs::symlink(&outside, out.join("was-link")).unwrap();

    let refused = env.pull_into("ds", &out).await.unwrap_err();
    assert!(matches!(refused, Error::UnsafePath { .. }), "{refused}");
    assert_eq!(std::fs::read(out.join("was-file")).unwrap(), b"old file");

    let done = env.pull_deleting("ds", &out).await.unwrap();
    assert_same_tree(&src, &out);
    // was-dir with old/ and f, the file was-file, the link was-link.
    assert_eq!(done.deleted, 5);
    assert_eq!(std::fs::read(outside.join("x")).unwrap(), b"not ours");
}

/// Issue 19, as an attacker: a symlink planted where the version has a hard
/// link (pointing at a file outside the destination) is replaced by the
/// link, never written through; a hard link in a hand-made snapshot that
/// names a path outside the tree is refused before anything is written.
#[tokio::test]
async fn hard_links_never_reach_outside_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a"), b"data").unwrap();
    std::fs::hard_link(src.join("a"), src.join("b")).unwrap();
    push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let out = env.root.join("out");
    let outside = env.root.join("secret");
    std::fs::write(&outside, b"not ours").unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::os::unix::fs::symlink(&outside, out.join("b")).unwrap();
    env.pull_into("ds", &out).await.unwrap();
    assert_same_tree(&src, &out);
    assert_eq!(std::fs::read(&outside).unwrap(), b"not ours");
    assert!(!std::fs::symlink_metadata(out.join("b"))
        .unwrap()
        .is_symlink());
    let mut hostile = vec![
        Entry {
            path: b"a".to_vec(),
            kind: Kind::File,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            chunks: Vec::new(),
            target: Vec::new(),
        },
        Entry {
            path: b"b".to_vec(),
            kind: Kind::HardLink,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            chunks: Vec::new(),
            target: outside.as_os_str().as_encoded_bytes().to_vec(),
        },
    ];
    let err = labsync_store::validate_entries(&mut hostile, "s").unwrap_err();
    assert!(matches!(err, Error::UnsafePath { .. }), "{err}");
}

/// Peers that hold every pack: `liar` answers with a flipped byte, `gone`
/// fails, `good` has the real copy (read from the store's folder); whether
/// `good` is offered at all is up to the test.
struct ScriptedPeers {
    store: PathBuf,
    offer_good: bool,
    events: std::sync::Mutex<Vec<labsync_store::PeerEvent>>,
}

impl labsync_store::PackPeers for ScriptedPeers {
    fn locate<'a>(
        &'a self,
        _packs: &'a [labsync_store::PackId],
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    fn holders(&self, _pack: &labsync_store::PackId) -> Vec<String> {
        let mut h = vec!["liar".to_string(), "gone".to_string()];
        if self.offer_good {
            h.push("good".into());
        }
        h
    }

    fn get<'a>(
        &'a self,
        peer: &'a str,
        pack: &'a labsync_store::PackId,
    ) -> futures::future::BoxFuture<'a, Result<bytes::Bytes, String>> {
        Box::pin(async move {
            let real = std::fs::read(self.store.join(labsync_store::pack_key(pack))).unwrap();
            match peer {
                "good" => Ok(real.into()),
                "liar" => {
                    let mut b = real;
                    let mid = b.len() / 2;
                    b[mid] ^= 1;
                    Ok(b.into())
                }
                _ => Err("connection refused".into()),
            }
        })
    }

    fn report(&self, event: labsync_store::PeerEvent) {
        self.events.lock().unwrap().push(event);
    }
}

/// A fresh node cache whose peers ([`ScriptedPeers`]) serve the packs of
/// the local store at `store`, after a corrupt copy and a failure.
fn cache_with_good_peers(env: &Env, store: &Path) -> NodeCache {
    let peers = Arc::new(ScriptedPeers {
        store: store.to_path_buf(),
        offer_good: true,
        events: Default::default(),
    });
    NodeCache::open(&env.root.join("behind-cache"), 1 << 30)
        .unwrap()
        .with_peers(peers)
}

/// A pull with two writers that deletes nothing and keeps the recorded modes.
const PLAIN_PULL: labsync_store::PullOptions = labsync_store::PullOptions {
    threads: 2,
    delete: false,
    shared: false,
    expect: None,
};

/// A cache with peers takes a pack from the first peer with a good copy,
/// refuses a corrupt one and goes on past one that fails; with no good
/// copy at any peer the pack comes from the store. The pull is right
/// either way.
#[tokio::test]
async fn packs_come_from_peers_verified_and_from_the_store_when_no_peer_has_a_good_copy() {
    use labsync_store::PeerEvent;
    let dir = tempfile::tempdir().unwrap();
    let remote = Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap();
    let env = Env::new(remote).await;
    let src = env.root.join("src");
    write_tree(&src, 11);
    push(&env.repo, &src, &opts("data", &env.cache), np())
        .await
        .unwrap();
    for offer_good in [true, false] {
        let peers = Arc::new(ScriptedPeers {
            store: dir.path().to_path_buf(),
            offer_good,
            events: Default::default(),
        });
        let cache = NodeCache::open(&env.root.join(format!("peer-cache-{offer_good}")), 1 << 30)
            .unwrap()
            .with_peers(peers.clone());
        let dest = env.root.join(format!("out-{offer_good}"));
        let got = Pull::new(&env.repo, &cache, &"data".parse().unwrap(), &dest)
            .threads(2)
            .progress(np())
            .run()
            .await
            .unwrap();
        assert_same_tree(&src, &dest);
        let events = peers.events.lock().unwrap().clone();
        let count = |f: &dyn Fn(&PeerEvent) -> bool| events.iter().filter(|e| f(e)).count() as u64;
        let packs = got.packs_fetched;
        assert!(packs > 0);
        // With a good copy offered, every pack comes from it (after the
        // liar and the failing peer, where the rotation starts there); with
        // none, each pack is refused from the liar, fails at the other and
        // comes from the store.
        // One account of the whole fetch, every byte from one source or the other.
        let fetched: Vec<(u64, u64)> = events
            .iter()
            .filter_map(|e| match e {
                PeerEvent::Fetched {
                    from_peers,
                    from_store,
                    ..
                } => Some((*from_peers, *from_store)),
                _ => None,
            })
            .collect();
        assert_eq!(fetched.len(), 1, "{events:?}");
        assert_eq!(fetched[0].0 + fetched[0].1, got.bytes_fetched);
        assert_eq!(fetched[0].0 == 0, !offer_good);
        if offer_good {
            assert_eq!(
                count(&|e| matches!(e, PeerEvent::FromPeer { peer, .. } if peer == "good")),
                packs,
                "{events:?}"
            );
            assert_eq!(
                count(&|e| matches!(e, PeerEvent::FromStore { .. })),
                0,
                "{events:?}"
            );
        } else {
            assert_eq!(
                count(&|e| matches!(e, PeerEvent::Corrupt { .. })),
                packs,
                "{events:?}"
            );
            assert_eq!(
                count(&|e| matches!(e, PeerEvent::Failed { .. })),
                packs,
                "{events:?}"
            );
            assert_eq!(
                count(&|e| matches!(e, PeerEvent::FromStore { .. })),
                packs,
                "{events:?}"
            );
        }
    }
}

/// A pull writing behind (labd's) returns with the tree whole and leaves
/// the cache copies of what came from peers to be written after; once
/// they are, the cache holds every pack, checked, and a second pull needs
/// nothing fetched.
#[tokio::test]
async fn a_pull_writing_behind_leaves_the_cache_whole_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let remote = Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap();
    let env = Env::new(remote).await;
    let src = env.root.join("src");
    write_tree(&src, 13);
    push(&env.repo, &src, &opts("data", &env.cache), np())
        .await
        .unwrap();
    let cache = cache_with_good_peers(&env, dir.path());
    let writes = labsync_store::CacheWrites::new();
    let dest = env.root.join("out");
    let opts = PLAIN_PULL;
    let spec = "data".parse().unwrap();
    let got = labsync_store::Pull::new(&env.repo, &cache, &spec, &dest)
        .options(opts)
        .progress(np())
        .writing_behind(&writes)
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &dest);
    assert!(got.packs_fetched > 0);
    let done = writes.finish().await;
    assert_eq!(
        (done.packs, done.bytes, done.failed),
        (got.packs_fetched, got.bytes_fetched, 0)
    );
    // The pack is mostly big.bin's 9 MB of noise: it left memory with its
    // files and was rebuilt from them.
    assert_eq!(done.rebuilt, done.packs, "{done:?}");
    let (packs, _, corrupt) = cache.verify(None, np().as_ref()).unwrap();
    assert_eq!(packs, got.packs_fetched);
    assert!(corrupt.is_empty(), "{corrupt:?}");
    let again = Pull::new(&env.repo, &cache, &spec, &env.root.join("out2"))
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_eq!(again.packs_fetched, 0);
    assert_same_tree(&src, &env.root.join("out2"));
}

/// Files are written while packs arrive; a pack the store lost fails the
/// pull with its name, and no writer waits for it forever. With the pack
/// back, the same pull completes the tree.
#[tokio::test]
async fn a_pack_the_store_lost_fails_the_pull_by_name_and_nothing_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let remote = Remote::open(&format!("file://{}", dir.path().display()), &[]).unwrap();
    let env = Env::new(remote).await;
    let src = env.root.join("src");
    write_tree(&src, 12);
    push(&env.repo, &src, &opts("data", &env.cache), np())
        .await
        .unwrap();
    let packs: Vec<PathBuf> = files_under(&dir.path().join("packs"));
    assert!(packs.len() > 1, "the tree spans several packs");
    let lost = &packs[packs.len() / 2];
    let kept = env.root.join("kept-pack");
    std::fs::rename(lost, &kept).unwrap();
    let cache = NodeCache::open(&env.root.join("fresh-cache"), 1 << 30).unwrap();
    let dest = env.root.join("out");
    let pulled = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        Pull::new(&env.repo, &cache, &"data".parse().unwrap(), &dest)
            .threads(2)
            .progress(np())
            .run(),
    )
    .await
    .expect("the pull ends");
    let err = pulled.unwrap_err().to_string();
    let name = lost.file_name().unwrap().to_str().unwrap();
    assert!(err.contains(name), "{err}");
    std::fs::rename(&kept, lost).unwrap();
    Pull::new(&env.repo, &cache, &"data".parse().unwrap(), &dest)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_same_tree(&src, &dest);
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// A peer that holds every pack and never answers.
struct SilentPeer;

impl labsync_store::PackPeers for SilentPeer {
    fn locate<'a>(
        &'a self,
        _packs: &'a [labsync_store::PackId],
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    fn holders(&self, _pack: &labsync_store::PackId) -> Vec<String> {
        vec!["silent".into()]
    }

    fn get<'a>(
        &'a self,
        _peer: &'a str,
        _pack: &'a labsync_store::PackId,
    ) -> futures::future::BoxFuture<'a, Result<bytes::Bytes, String>> {
        Box::pin(std::future::pending())
    }

    fn report(&self, _event: labsync_store::PeerEvent) {}
}

/// A pull its caller gives up on (here a timeout; in labd another tree of
/// the job failing) leaves no writer thread waiting for packs: the
/// runtime, which waits for its blocking threads when dropped, shuts down.
#[test]
fn a_pull_given_up_leaves_no_writer_waiting() {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
            let src = env.root.join("src");
            write_tree(&src, 13);
            push(&env.repo, &src, &opts("data", &env.cache), np())
                .await
                .unwrap();
            let cache = NodeCache::open(&env.root.join("peer-cache"), 1 << 30)
                .unwrap()
                .with_peers(Arc::new(SilentPeer));
            let dest = env.root.join("out");
            let spec = "data".parse().unwrap();
            let pulling = Pull::new(&env.repo, &cache, &spec, &dest)
                .threads(2)
                .progress(np())
                .run();
            let given_up = tokio::time::timeout(std::time::Duration::from_millis(300), pulling);
            assert!(given_up.await.is_err(), "the silent peer holds the pull");
        });
        drop(rt);
        done.send(()).unwrap();
    });
    ended
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the runtime shut down: no writer was left waiting");
}

/// The version's counts as the streamed push makes them, against the same
/// counts taken from the stored trees: entries added, removed and modified
/// over a tree of many segments (most shared by both versions), and stored
/// bytes counting each distinct chunk once (files with equal content).
#[tokio::test]
async fn version_counts_match_the_stored_trees() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let src = env.root.join("src");
    for i in 0..3000u64 {
        let d = src.join(format!("d{:02}", i % 30));
        std::fs::create_dir_all(&d).unwrap();
        // Every tenth file has the content of another one.
        let seed = if i % 10 == 9 { i - 1 } else { i };
        std::fs::write(d.join(format!("f{i:04}")), random_bytes(2000, seed)).unwrap();
    }
    let stored_of = |v: u64| {
        let repo = env.repo.clone();
        async move {
            let (index, _) = repo.load_index().await.unwrap();
            let rec = repo
                .resolve(&format!("ds@v{v}").parse().unwrap())
                .await
                .unwrap();
            let (_, entries) = repo.load_tree(&index, &rec.snapshot).await.unwrap();
            let distinct: HashSet<ChunkId> = entries
                .iter()
                .flat_map(|e| e.chunks.iter().copied())
                .collect();
            let stored: u64 = (distinct.iter())
                .map(|c| u64::from(index.get(c).unwrap().1.stored_len))
                .sum();
            (rec, entries, stored)
        }
    };
    // Past the files cache's racy window, so the next push trusts them.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let first = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let (rec1, entries1, stored1) = stored_of(1).await;
    assert_eq!(first.record.added, entries1.len() as u64);
    assert_eq!(first.record.stored_bytes, stored1);
    assert!(
        stored1 < 3000 * 2000,
        "equal contents stored once: {stored1}"
    );

    for i in [3u64, 700, 1500, 2222, 2999] {
        let f = src.join(format!("d{:02}/f{i:04}", i % 30));
        std::fs::write(f, random_bytes(2000, 10_000 + i)).unwrap();
    }
    for i in [5u64, 1234] {
        std::fs::remove_file(src.join(format!("d{:02}/f{i:04}", i % 30))).unwrap();
    }
    for n in ["d00/new1", "d07/new2", "zz/new3"] {
        std::fs::create_dir_all(src.join(n).parent().unwrap()).unwrap();
        std::fs::write(src.join(n), n.as_bytes()).unwrap();
    }
    let second = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap();
    let (_, entries2, stored2) = stored_of(2).await;
    let r = &second.record;
    // Added: three files and the folder zz.
    assert_eq!((r.modified, r.added, r.removed), (5, 4, 2));
    assert_eq!(r.stored_bytes, stored2);
    assert_eq!(entries2.len(), entries1.len() + 4 - 2);
    assert_eq!(rec1.snapshot, first.record.snapshot);
    assert_eq!(second.files_read, 8, "only the changed files are read");
}

/// As an attacker: a latest version whose tree lists one segment 100,000
/// times (each read would decode it again) makes the next push to that name
/// fail at once with what is wrong, before any segment is read, instead of
/// reading it over and over.
#[tokio::test]
async fn a_latest_version_listing_a_segment_over_and_over_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(Remote::local(&dir.path().join("store")).unwrap()).await;
    let entry = Entry {
        path: b"a".to_vec(),
        kind: Kind::File,
        mode: 0o644,
        mtime_ns: 0,
        size: 4,
        chunks: vec![ChunkId::of(b"pwnd")],
        target: Vec::new(),
    };
    let planted = plant_snapshot(&env.repo, "ds", &[entry]).await;
    let mut snap = env.repo.load_snapshot(&planted.snapshot).await.unwrap();
    snap.segments = vec![snap.segments[0]; 100_000];
    let (sid, bytes) = snap.encode();
    (env.repo.remote())
        .put(&format!("snapshots/{sid}"), bytes.into())
        .await
        .unwrap();
    let rec = VersionRecord {
        snapshot: sid,
        version: 0,
        ..planted
    };
    env.repo.commit_version(rec).await.unwrap();

    let src = env.root.join("src");
    write_tree(&src, 1);
    let started = std::time::Instant::now();
    let err = push(&env.repo, &src, &opts("ds", &env.cache), np())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("listed twice"), "{err}");
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}
