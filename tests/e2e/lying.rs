//! Issue 18, point 4: every length, offset, size and count an index entry
//! or a pack footer holds, set to its maximum in an object written under its
//! correct BLAKE3 name (as any lab member can), is refused by `verify` and
//! `verify --remote`, and by `pull` unless every chunk it writes still
//! verifies, all within a bounded peak RSS: the number is never used to size
//! a buffer.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

use labsync_store::{IndexPack, PackId, Remote, Repo};

use crate::{s, Lab};

/// What a refused command may hold at its peak, whatever the object claims.
/// labsync itself needs about 20 MB here; a 4 GiB claim honoured would be
/// far above.
const PEAK_RSS_LIMIT_KB: i64 = 100 * 1024;

/// Runs `cmd` to its end; returns its exit status and its own peak RSS (KB),
/// from `wait4`, so no other test's process counts.
#[allow(unsafe_code)]
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which also gives its rusage
fn run_measured(cmd: Command) -> (std::process::ExitStatus, i64, String, i64) {
    let err = tempfile::NamedTempFile::new().unwrap();
    // A child spawned with vfork (as std does) takes its parent's peak RSS
    // into its own ru_maxrss at exec: this test process's peak, which other
    // tests running in it may have raised far above what labsync uses
    // (CI once read 333 MB for a verify that needs 20). Reset our peak to
    // what we hold now (proc(5), clear_refs "5") before spawning.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    // What this process holds now is the floor of what wait4 will say
    // (other tests in it may hold 100 MB): the caller knows not to read
    // the peak as labsync's own when that floor is high.
    let ours: i64 = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))?
                .to_string();
            l.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or(0);
    // And a cap on its heap (RLIMIT_DATA, 512 MiB) that holds whatever this
    // process holds: a claim of gigabytes honoured fails there, not cleanly.
    let child = crate::heap_capped(&cmd, 512 << 20)
        .stdout(Stdio::null())
        .stderr(err.reopen().unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: wait4 on our own child's pid with out-pointers to locals.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid, "wait4: {}", std::io::Error::last_os_error());
    let stderr = std::fs::read_to_string(err.path()).unwrap_or_default();
    (
        std::process::ExitStatus::from_raw(status),
        usage.ru_maxrss,
        stderr,
        ours,
    )
}

/// The store's one pack of file data and its index record.
async fn file_pack(repo: &Repo) -> IndexPack {
    let (index, _) = repo.load_index().await.unwrap();
    index
        .to_records(|_| true)
        .into_iter()
        .find(|r| r.chunks.iter().any(|c| c.4 & labsync_store::FLAG_TREE == 0))
        .expect("a pack of file chunks")
}

/// Replaces every index object with one holding `recs`, under its name.
async fn replace_index(repo: &Repo, recs: &[IndexPack]) {
    let old: Vec<String> = repo
        .remote()
        .list("index/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    let new: Vec<String> = (repo.write_index(recs).await.unwrap())
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for k in old {
        if !new.contains(&k) {
            repo.remote().delete(&k).await.unwrap();
        }
    }
}

/// Rewrites the pack file `path` with `edit` applied to its footer's first
/// entry (49 bytes) or trailer (24 bytes), fixes the footer checksum and
/// renames it to its new id (BLAKE3 of footer and trailer). Returns the id.
fn forge_pack(store: &Path, pack: &PackId, edit: impl Fn(&mut [u8], &mut [u8])) -> PackId {
    let path = store.join(labsync_store::pack_key(pack));
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    let footer_len = u32::from_le_bytes(bytes[n - 24..n - 20].try_into().unwrap()) as usize;
    let (head, trailer) = bytes.split_at_mut(n - 24);
    let footer = &mut head[n - 24 - footer_len..];
    edit(&mut footer[..49], trailer);
    let check = blake3::hash(footer);
    trailer[8..16].copy_from_slice(&check.as_bytes()[..8]);
    let id = PackId::from_bytes(
        *blake3::Hasher::new()
            .update(footer)
            .update(trailer)
            .finalize()
            .as_bytes(),
    );
    std::fs::remove_file(&path).unwrap();
    let new = store.join(labsync_store::pack_key(&id));
    std::fs::create_dir_all(new.parent().unwrap()).unwrap();
    std::fs::write(new, &bytes).unwrap();
    id
}

#[test]
fn lying_numbers_are_refused_in_bounded_memory() {
    type Edit = Box<dyn Fn(&mut IndexPack)>;
    type Forge = Box<dyn Fn(&mut [u8], &mut [u8])>;
    let index_cases: Vec<(&str, Edit)> = vec![
        ("index: pack size", Box::new(|r| r.size = u64::MAX)),
        ("index: offset", Box::new(|r| r.chunks[0].1 = u64::MAX)),
        ("index: stored_len", Box::new(|r| r.chunks[0].2 = u32::MAX)),
        ("index: raw_len", Box::new(|r| r.chunks[0].3 = u32::MAX)),
        ("index: flags", Box::new(|r| r.chunks[0].4 = u8::MAX)),
    ];
    let footer_cases: Vec<(&str, Forge)> = vec![
        (
            "footer: offset",
            Box::new(|e, _| e[32..40].copy_from_slice(&u64::MAX.to_le_bytes())),
        ),
        (
            "footer: stored_len",
            Box::new(|e, _| e[40..44].copy_from_slice(&u32::MAX.to_le_bytes())),
        ),
        (
            "footer: raw_len",
            Box::new(|e, _| e[44..48].copy_from_slice(&u32::MAX.to_le_bytes())),
        ),
        ("footer: flags", Box::new(|e, _| e[48] = u8::MAX)),
        (
            "trailer: footer length",
            Box::new(|_, t| t[0..4].copy_from_slice(&u32::MAX.to_le_bytes())),
        ),
        (
            "trailer: count",
            Box::new(|_, t| t[4..8].copy_from_slice(&u32::MAX.to_le_bytes())),
        ),
        (
            "trailer: count and length agreeing",
            Box::new(|_, t| {
                let count = u32::MAX / 49;
                t[0..4].copy_from_slice(&(count * 49).to_le_bytes());
                t[4..8].copy_from_slice(&count.to_le_bytes());
            }),
        ),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut rows = Vec::new();
    let cases = index_cases
        .iter()
        .map(|(n, _)| *n)
        .chain(footer_cases.iter().map(|(n, _)| *n));
    for (i, case) in cases.enumerate() {
        let lab = Lab::new();
        let src = lab.path("ds");
        crate::support::write_tree(&src, 3);
        lab.ok(&["push", s(&src), "--name", "ds"]);
        let store = lab.path("store");
        rt.block_on(async {
            let repo = Repo::open(Remote::local(&store).unwrap(), None)
                .await
                .unwrap();
            let mut recs = repo.load_index().await.unwrap().0.to_records(|_| true);
            let target = file_pack(&repo).await;
            let at = recs.iter().position(|r| r.pack == target.pack).unwrap();
            if let Some((_, edit)) = index_cases.get(i) {
                edit(&mut recs[at]);
            } else {
                let (_, forge) = &footer_cases[i - index_cases.len()];
                let id = forge_pack(&store, &target.pack, forge);
                recs[at].pack = id;
                recs[at].size = std::fs::metadata(store.join(labsync_store::pack_key(&id)))
                    .unwrap()
                    .len();
            }
            replace_index(&repo, &recs).await;
        });
        let mut worst = 0;
        for args in [
            vec!["verify"],
            vec!["verify", "--remote"],
            vec!["pull", "ds", s(&lab.path("out"))],
        ] {
            // A fresh node cache each time: nothing cached hides the lie.
            let _ = std::fs::remove_dir_all(lab.path("cache"));
            let _ = std::fs::remove_dir_all(lab.path("out"));
            let (status, rss, stderr, ours) = run_measured(lab.cmd(&args));
            if args[0] == "pull" && status.success() {
                // A lie in a footer the index does not repeat: every chunk
                // still verified against its id, so the tree is whole.
                crate::support::assert_same_tree(&src, &lab.path("out"));
            } else {
                assert!(
                    status.code() == Some(1),
                    "{case}: labsync {args:?} was not refused cleanly ({status}): {stderr}"
                );
            }
            // The peak is labsync's own only while this process held less
            // than half the limit when it spawned it (else the heap cap
            // above is the check).
            assert!(
                rss < PEAK_RSS_LIMIT_KB || ours >= PEAK_RSS_LIMIT_KB / 2,
                "{case}: labsync {args:?} peaked at {rss} KB (this process held {ours} KB)"
            );
            worst = worst.max(rss);
        }
        rows.push(format!("| {case} | {:.1} MB |", worst as f64 / 1024.0));
    }
    eprintln!("| field set to its maximum | worst peak RSS of verify, verify --remote and pull |");
    eprintln!("|---|---:|");
    for r in rows {
        eprintln!("{r}");
    }
}
