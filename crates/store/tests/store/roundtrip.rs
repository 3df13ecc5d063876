//! Issue 19, point 6: every tree push accepts, pull restores. Seeded
//! generated trees: names of any bytes but `/` and NUL up to 255 long, deep
//! paths, empty files and folders, hard links, sparse files, symlinks
//! (absolute, relative, dangling, looping) and varied modes and mtimes.
//! Each is pushed, then pulled fresh, pulled over an older version of
//! itself, and pulled with `delete` over an unrelated folder; each result is
//! compared with the source by content, mode, mtime, link target, link
//! groups and holes.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use labsync_store::{push, NoProgress, NodeCache, Pull, PullOptions, Remote, Repo};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Trees generated; each is pushed twice and pulled three times.
const TREES: u64 = 300;

/// A file name: any bytes but `/` and NUL, never `.` or `..`; some long
/// (up to the 255-byte limit), some not UTF-8, some with a newline.
fn name(rng: &mut StdRng, taken: &mut Vec<Vec<u8>>) -> Vec<u8> {
    loop {
        let len = match rng.gen_range(0..10) {
            0 => rng.gen_range(200..=255),
            1..=2 => rng.gen_range(1..40),
            _ => rng.gen_range(1..12),
        };
        let mut n: Vec<u8> = (0..len)
            .map(|_| match rng.gen_range(0..8) {
                0 => rng.gen_range(1..=255u8),
                1 => b'\n',
                _ => b"abcdefghijklmnopqrstuvwxyz0123456789._-"[rng.gen_range(0..39)],
            })
            .map(|b| if b == b'/' { b'_' } else { b })
            .collect();
        if n == b"." || n == b".." {
            n.push(b'x');
        }
        // Our own temporary names are not for users to take.
        if !n.starts_with(b".labsync-tmp") && !taken.contains(&n) {
            taken.push(n.clone());
            return n;
        }
    }
}

fn set_mtime(p: &Path, rng: &mut StdRng) {
    let t = filetime::FileTime::from_unix_time(
        rng.gen_range(1_000_000_000..1_900_000_000),
        rng.gen_range(0..1_000_000_000),
    );
    filetime::set_symlink_file_times(p, t, t).unwrap();
}

/// Writes a random tree under `root`.
fn generate(root: &Path, rng: &mut StdRng) {
    std::fs::create_dir_all(root).unwrap();
    let mut dirs = vec![root.to_path_buf()];
    let mut files: Vec<PathBuf> = Vec::new();
    // Names taken per folder; the fixed ones below are reserved up front.
    let mut names: HashMap<PathBuf, Vec<Vec<u8>>> = HashMap::new();
    names.insert(root.to_path_buf(), vec![b"d0".to_vec()]);
    let fresh = |names: &mut HashMap<PathBuf, Vec<Vec<u8>>>, dir: &Path, rng: &mut StdRng| {
        let taken = names
            .entry(dir.to_path_buf())
            .or_insert_with(|| vec![b"loop".to_vec()]);
        if !taken.iter().any(|n| n == b"loop") {
            taken.push(b"loop".to_vec());
        }
        dir.join(OsStr::from_bytes(&name(rng, taken)))
    };
    // A deep chain of folders (short names keep it under PATH_MAX).
    if rng.gen_bool(0.3) {
        let mut d = root.to_path_buf();
        for i in 0..rng.gen_range(10..40) {
            d = d.join(format!("d{i}"));
        }
        std::fs::create_dir_all(&d).unwrap();
        names.insert(d.clone(), vec![b"deep".to_vec(), b"loop".to_vec()]);
        std::fs::write(d.join("deep"), b"at the bottom").unwrap();
        files.push(d.join("deep"));
        dirs.push(d);
    }
    for _ in 0..rng.gen_range(3..25) {
        let dir = dirs[rng.gen_range(0..dirs.len())].clone();
        let p = fresh(&mut names, &dir, rng);
        match rng.gen_range(0..12) {
            0..=1 => {
                std::fs::create_dir(&p).unwrap();
                dirs.push(p);
            }
            2 => std::fs::write(&p, b"").unwrap(),
            3..=5 => {
                let len = rng.gen_range(1..40_000);
                let bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                std::fs::write(&p, bytes).unwrap();
                files.push(p.clone());
            }
            6 => {
                let text = "def train(): pass\n".repeat(rng.gen_range(1..500));
                std::fs::write(&p, text).unwrap();
                files.push(p.clone());
            }
            7 => {
                // Sparse: up to half a MB holding a few bytes (small, so
                // that hundreds of trees stay quick to read and hash).
                let f = std::fs::File::create(&p).unwrap();
                let len = rng.gen_range(64..512) << 10;
                f.set_len(len).unwrap();
                f.write_all_at(b"weights", rng.gen_range(0..len - 7))
                    .unwrap();
                files.push(p.clone());
            }
            8 => {
                let target: &[u8] = match rng.gen_range(0..4) {
                    0 => b"/etc/hostname",
                    1 => b"../../elsewhere",
                    2 => b"does/not/exist",
                    _ => b"loop",
                };
                std::os::unix::fs::symlink(OsStr::from_bytes(target), &p).unwrap();
                if target == b"loop" {
                    let _ = std::os::unix::fs::symlink(&p, dir.join("loop"));
                }
            }
            _ => match files.get(rng.gen_range(0..files.len().max(1))) {
                Some(f) => std::fs::hard_link(f, &p).unwrap(),
                None => std::fs::write(&p, b"alone").unwrap(),
            },
        }
    }
    let mode_of = |rng: &mut StdRng, dir: bool| {
        if dir {
            [0o755, 0o700, 0o1777, 0o750][rng.gen_range(0..4)]
        } else {
            [0o644, 0o600, 0o755, 0o444, 0o640][rng.gen_range(0..5)]
        }
    };
    for f in &files {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode_of(rng, false))).unwrap();
    }
    // Times last, deepest first, so making an entry does not move its
    // folder's time afterwards.
    let mut all = crate::support::files_under(root);
    all.extend(dirs.iter().skip(1).cloned());
    all.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in &all {
        if p.is_dir() && !p.is_symlink() {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode_of(rng, true)))
                .unwrap();
        }
        set_mtime(p, rng);
    }
}

/// Changes a tree the way a second push of it would see: some files
/// rewritten, some removed, some added. Types never change at a path.
fn evolve(root: &Path, rng: &mut StdRng) {
    for f in crate::support::files_under(root) {
        let m = std::fs::symlink_metadata(&f).unwrap();
        if !m.is_file() {
            continue;
        }
        match rng.gen_range(0..6) {
            0 => std::fs::remove_file(&f).unwrap(),
            1 => {
                let dir_mtime = std::fs::metadata(f.parent().unwrap()).unwrap();
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
                std::fs::write(&f, format!("rewritten {}", rng.gen::<u32>())).unwrap();
                set_mtime(&f, rng);
                let t = filetime::FileTime::from_last_modification_time(&dir_mtime);
                filetime::set_file_times(f.parent().unwrap(), t, t).unwrap();
            }
            _ => {}
        }
    }
    let extra = root.join(format!("added-{}", rng.gen::<u16>()));
    std::fs::write(&extra, b"new in v2").unwrap();
    set_mtime(&extra, rng);
    set_mtime(root, rng);
}

/// Everything a round trip must keep, per path: kind, mode, mtime, content
/// hash, link target, hard-link group (the first path of its inode) and
/// whether the file has holes.
fn describe(root: &Path) -> BTreeMap<Vec<u8>, String> {
    describe_only(root, None)
}

/// [`describe`] of the paths `only` holds (link groups among them alone).
fn describe_only(
    root: &Path,
    only: Option<&BTreeMap<Vec<u8>, String>>,
) -> BTreeMap<Vec<u8>, String> {
    let mut out = BTreeMap::new();
    let mut first_of: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    let mut paths = crate::support::files_under(root);
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                paths.push(e.path());
                stack.push(e.path());
            }
        }
    }
    paths.sort();
    for p in paths {
        let m = std::fs::symlink_metadata(&p).unwrap();
        let rel = p
            .strip_prefix(root)
            .unwrap()
            .as_os_str()
            .as_bytes()
            .to_vec();
        if only.is_some_and(|o| !o.contains_key(&rel)) {
            continue;
        }
        let mtime = (m.mtime(), m.mtime_nsec());
        let what = if m.is_dir() {
            format!("dir {:o} {mtime:?}", m.mode() & 0o7777)
        } else if m.file_type().is_symlink() {
            format!("link -> {:?} {mtime:?}", std::fs::read_link(&p).unwrap())
        } else {
            let group = first_of.entry((m.dev(), m.ino())).or_insert(rel.clone());
            let sparse = m.blocks() * 512 < m.len() / 2;
            format!(
                "file {:o} {} {mtime:?} {} group {:?} sparse {sparse}",
                m.mode() & 0o7777,
                m.len(),
                blake3::hash(&std::fs::read(&p).unwrap()),
                String::from_utf8_lossy(group),
            )
        };
        out.insert(rel, what);
    }
    out
}

fn first_difference(
    a: &BTreeMap<Vec<u8>, String>,
    b: &BTreeMap<Vec<u8>, String>,
) -> Option<String> {
    for (k, v) in a {
        match b.get(k) {
            Some(w) if w == v => {}
            other => {
                return Some(format!(
                    "{:?}: source {v}, pulled {other:?}",
                    String::from_utf8_lossy(k)
                ))
            }
        }
    }
    b.keys()
        .find(|k| !a.contains_key(*k))
        .map(|k| format!("{:?} only in the pull", String::from_utf8_lossy(k)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_trees_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repo::open(Remote::local(&dir.path().join("store")).unwrap(), None)
        .await
        .unwrap();
    let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
    let pull = |spec: String, dest: PathBuf, delete: bool| {
        let (repo, cache) = (&repo, &cache);
        async move {
            let opts = PullOptions {
                threads: 2,
                delete,
                shared: false,
                expect: None,
            };
            Pull::new(repo, cache, &spec.parse().unwrap(), &dest)
                .options(opts)
                .progress(Arc::new(NoProgress))
                .run()
                .await
                .unwrap_or_else(|e| panic!("pull {spec} into {}: {e}", dest.display()))
        }
    };
    for seed in 0..TREES {
        let mut rng = StdRng::seed_from_u64(seed);
        let case = dir.path().join(format!("t{seed}"));
        let src = case.join("src");
        generate(&src, &mut rng);
        let name = format!("t{seed}");
        let opts = crate::plain_opts(&name);
        let push_now = |src: PathBuf| {
            let (repo, opts) = (&repo, &opts);
            async move { push(repo, &src, opts, Arc::new(NoProgress)).await.unwrap() }
        };
        let v1 = push_now(src.clone()).await.record.version;
        let want1 = describe(&src);

        // Fresh.
        let fresh = case.join("fresh");
        pull(format!("{name}@v{v1}"), fresh.clone(), false).await;
        if let Some(d) = first_difference(&want1, &describe(&fresh)) {
            panic!("seed {seed}, fresh pull: {d}");
        }

        // Over an older version of itself: what v2 holds is exact, and what
        // only v1 held is left and counted.
        evolve(&src, &mut rng);
        let v2 = push_now(src.clone()).await.record.version;
        let want2 = describe(&src);
        let over = pull(format!("{name}@v{v2}"), fresh.clone(), false).await;
        let all = describe(&fresh);
        let left = all.keys().filter(|k| !want2.contains_key(*k)).count();
        assert_eq!(over.extra as usize, left, "seed {seed}: extras counted");
        // What only v1 held may still share an inode with a file of v2.
        let got = describe_only(&fresh, Some(&want2));
        if let Some(d) = first_difference(&want2, &got) {
            panic!("seed {seed}, pull over v{v1}: {d}");
        }

        // With delete over an unrelated folder.
        let other = case.join("other");
        generate(&other, &mut StdRng::seed_from_u64(seed + 1_000_000));
        pull(format!("{name}@v{v2}"), other.clone(), true).await;
        if let Some(d) = first_difference(&want2, &describe(&other)) {
            panic!("seed {seed}, pull --delete over another tree: {d}");
        }
        std::fs::remove_dir_all(&case).unwrap();
    }
}
