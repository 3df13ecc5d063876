//! Issue 17: the store on servers that honour, ignore or refuse conditional
//! writes, and under `503 SlowDown`. A real S3 server (`s3s-fs`) behind the
//! fault-injecting proxy (`support/proxy.rs`) plays each.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use labsync_store::{
    gc, push, verify, ConditionalWrites, Error, NoProgress, NodeCache, Remote, Repo,
};

use super::proxy::{Fault, Proxy};
use super::support::{random_bytes, S3Server};
use super::{conformance, np, plain_opts};

/// An unsigned `s3s-fs` (so the proxy may change headers) behind a proxy
/// doing `fault`.
async fn server_behind(fault: Fault) -> Option<(S3Server, Proxy)> {
    let s3 = S3Server::start_unsigned()?;
    let proxy = Proxy::start(s3.addr(), fault).await;
    Some((s3, proxy))
}

fn remote_via(proxy: &Proxy, prefix: &str) -> Remote {
    let options = S3Server::unsigned_options(&proxy.endpoint());
    Remote::open(&format!("s3://labsync/{prefix}"), &options).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3_ignoring_conditional_writes() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    conformance(remote_via(&proxy, "conformance")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3_refusing_conditional_writes() {
    let Some((_s3, proxy)) = server_behind(Fault::RefuseConditions).await else {
        return;
    };
    conformance(remote_via(&proxy, "conformance")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3_answering_slow_down() {
    let Some((_s3, proxy)) = server_behind(Fault::SlowDown).await else {
        return;
    };
    conformance(remote_via(&proxy, "conformance")).await;
    assert!(
        !proxy.retry_delays().is_empty(),
        "requests were slowed down"
    );
}

/// Point 4: `503 SlowDown` is retried, after the server's `Retry-After`.
/// One client, one request at a time, each for a key of its own: the next
/// request for a key that was slowed down is its retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_down_is_retried_after_the_servers_retry_after() {
    let Some((_s3, proxy)) = server_behind(Fault::SlowDown).await else {
        return;
    };
    let remote = remote_via(&proxy, "slow");
    for i in 0..30 {
        let key = format!("data/k{i}");
        remote.put(&key, format!("v{i}").into()).await.unwrap();
        assert_eq!(
            &remote.get_at_most(&key, 1 << 30).await.unwrap()[..],
            format!("v{i}").as_bytes()
        );
    }
    let delays = proxy.retry_delays();
    assert!(delays.len() >= 2, "one request in twenty: {}", delays.len());
    for d in &delays {
        let d = d.expect("every slowed-down request was sent again");
        // `Retry-After: 1`, with a little room for the clock.
        assert!(d >= Duration::from_millis(950), "retried after {d:?}");
        assert!(d < Duration::from_secs(3), "retried after {d:?}");
    }
}

/// Point 2: what the server does is probed at the first open and recorded
/// in the config; every client uses the scheme it names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_open_probes_and_records_what_the_server_does() {
    let cases = [
        (Fault::None, ConditionalWrites::Honoured),
        (Fault::DropConditions, ConditionalWrites::Ignored),
        (Fault::RefuseConditions, ConditionalWrites::Refused),
    ];
    for (fault, expected) in cases {
        let Some((_s3, proxy)) = server_behind(fault).await else {
            return;
        };
        let repo = Repo::open(remote_via(&proxy, "probed"), None)
            .await
            .unwrap();
        assert_eq!(
            repo.config().conditional_writes,
            Some(expected),
            "{fault:?}"
        );
        // Another client reads it from the config, without asking again.
        let before = proxy.requests();
        let again = Repo::open(remote_via(&proxy, "probed"), None)
            .await
            .unwrap();
        assert_eq!(again.config().conditional_writes(), expected);
        assert_eq!(proxy.requests() - before, 1, "one read of the config");
        // The probe's throw-away key is gone.
        assert!(repo.remote().list("probe/").await.unwrap().is_empty());
    }
}

/// Ten pushes of different trees racing to `race` in `repo`: every push
/// lands as its own version, and what each reported is what is recorded.
async fn race_ten(repo: &Repo, dir: &std::path::Path, label: &str) {
    let pushes = (0..10u64).map(|i| {
        let src = dir.join(format!("src{i}"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("ckpt.pt"), random_bytes(50_000, 100 + i)).unwrap();
        let repo = repo.clone();
        tokio::spawn(async move { push(&repo, &src, &plain_opts("race"), np()).await })
    });
    let mut told = BTreeMap::new();
    let mut conflicts = 0;
    for p in futures::future::join_all(pushes).await {
        match p.unwrap() {
            Ok(o) => {
                assert!(o.created, "{label}: every tree differs");
                let before = told.insert(o.record.version, o.record.snapshot);
                assert!(
                    before.is_none(),
                    "{label}: v{} told twice",
                    o.record.version
                );
            }
            Err(Error::Conflict { .. }) => conflicts += 1,
            Err(e) => panic!("{label}: {e}"),
        }
    }
    let recorded: BTreeMap<_, _> = repo
        .versions("race")
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.version, r.snapshot))
        .collect();
    assert_eq!(
        recorded, told,
        "{label}: what the pushes said is what is recorded"
    );
    assert_eq!(told.len() + conflicts, 10);
    assert_eq!(told.len(), 10, "{label}: {conflicts} pushes lost the race");
}

/// Point 1: ten pushes racing to one name each land as a distinct version
/// or fail loudly with a conflict, whatever the server does; every version
/// a push reported names that push's snapshot; verify is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_pushes_lose_no_version_whatever_the_server_does() {
    for fault in [Fault::None, Fault::DropConditions, Fault::RefuseConditions] {
        let Some((_s3, proxy)) = server_behind(fault).await else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let repo = Repo::open(remote_via(&proxy, "race"), None).await.unwrap();
        race_ten(&repo, dir.path(), &format!("{fault:?}")).await;
        let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
        let report = verify(&repo, &cache, None, true, np()).await.unwrap();
        assert!(
            report.problems.is_empty(),
            "{fault:?}: {:?}",
            report.problems
        );
        assert!(
            report.warnings.is_empty(),
            "{fault:?}: {:?}",
            report.warnings
        );
        // Every claim was withdrawn; only the folder's keeper stays.
        let left: Vec<_> = repo.remote().list("claims/").await.unwrap();
        let left: Vec<_> = left.into_iter().map(|o| o.key).collect();
        assert!(
            left.iter().all(|k| k == "claims/keep"),
            "{fault:?}: {left:?}"
        );
    }
}

/// Point 2: two first opens racing on a server without conditional writes
/// end with one config that both use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_opens_agree_on_one_config() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let opens = (0..6).map(|_| Repo::open(remote_via(&proxy, "first"), None));
    let repos: Vec<Repo> = futures::future::try_join_all(opens).await.unwrap();
    let ids: HashSet<_> = repos.iter().map(|r| r.config().id.clone()).collect();
    assert_eq!(ids.len(), 1, "one config: {ids:?}");
    let stored = Repo::open(remote_via(&proxy, "first"), None).await.unwrap();
    assert!(ids.contains(&stored.config().id));
}

/// Point 3: a store written by labsync before it took claims, on a server
/// that ignored conditional creates, had versions overwritten: the second
/// of two racing pushes wrote the same version key. What is left of the
/// lost version (its snapshot, named by no version) is reported by
/// `verify`, not called clean. A create today refuses that overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_a_version_overwritten_on_a_server_that_ignored_the_condition() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = Repo::open(remote_via(&proxy, "old"), None).await.unwrap();
    let tree = |name: &str, seed| {
        let p = dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), random_bytes(10_000, seed)).unwrap();
        p
    };
    let first = push(&repo, &tree("a", 1), &plain_opts("ds"), np())
        .await
        .unwrap();
    let other = push(&repo, &tree("b", 2), &plain_opts("other"), np())
        .await
        .unwrap();
    // What a racing push did before: the same version number, created with
    // a condition the server ignored.
    let mut lost_race = other.record.clone();
    lost_race.name = "ds".into();
    lost_race.version = 1;
    let key = "refs/ds/@/0000000001";
    let json = serde_json::to_vec(&lost_race).unwrap();
    assert!(!repo
        .remote()
        .create(key, json.clone().into())
        .await
        .unwrap());
    // The server ignored the condition: the create was a plain write.
    repo.remote().put(key, json.into()).await.unwrap();

    let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
    let report = verify(&repo, &cache, None, true, np()).await.unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    let lost = first.record.snapshot.to_string();
    assert!(report.warnings[0].contains(&lost), "{:?}", report.warnings);
    assert!(report.warnings[0].contains("named by no version"));
}

/// Issue 41, point 10: on a server that ignores conditional writes, a
/// writer frozen past its claim (a stopped process, a paused VM) sends its
/// write of `ds@v2` late, after this push wrote `v2`: the later write
/// replaced the earlier without a word, and this push reported a version
/// the store no longer had. Reading the key back finds the other writer's
/// bytes: `v2` stays theirs, and this push becomes `v3`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_over_a_new_version_is_found_and_the_push_goes_next() {
    let Some((_s3, proxy)) = server_behind(Fault::LateWrite).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = Repo::open(remote_via(&proxy, "late"), None).await.unwrap();
    assert_eq!(
        repo.config().conditional_writes,
        Some(ConditionalWrites::Ignored)
    );
    let tree = |name: &str, seed| {
        let p = dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), random_bytes(10_000, seed)).unwrap();
        p
    };
    push(&repo, &tree("a", 1), &plain_opts("ds"), np())
        .await
        .unwrap();
    let frozen = push(&repo, &tree("f", 2), &plain_opts("frozen"), np())
        .await
        .unwrap();
    // What the frozen writer sends, late: its own record as `ds@v2`.
    let mut late = frozen.record.clone();
    late.name = "ds".into();
    late.version = 2;
    proxy.land_late_write(serde_json::to_vec(&late).unwrap().into());

    let b = tree("b", 3);
    let mine = push(&repo, &b, &plain_opts("ds"), np()).await.unwrap();
    // Landed at the first read of `v2` after this push wrote it; a push
    // that never read it back, just after it.
    match proxy.late_write_landed() {
        Some(landed) => assert!(landed.ends_with("refs/ds/@/0000000002"), "{landed}"),
        None => {
            let json = serde_json::to_vec(&late).unwrap();
            (repo.remote())
                .put("refs/ds/@/0000000002", json.into())
                .await
                .unwrap();
        }
    }
    assert_eq!(
        mine.record.version, 3,
        "the push went on to the next version"
    );
    let versions = repo.versions("ds").await.unwrap();
    let snaps: Vec<_> = versions.iter().map(|v| (v.version, v.snapshot)).collect();
    assert_eq!(snaps.len(), 3, "{snaps:?}");
    assert_eq!(
        snaps[1],
        (2, frozen.record.snapshot),
        "v2 is the late writer's"
    );
    assert_eq!(snaps[2], (3, mine.record.snapshot));
    let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
    let out = dir.path().join("out");
    labsync_store::Pull::new(&repo, &cache, &"ds".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(out.join("f")).unwrap(),
        std::fs::read(b.join("f")).unwrap()
    );
}

/// Point 4: a conditional write the server refuses is not retried, and the
/// error is one line naming the operation, the key and the server's
/// message once, with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_conditional_write_fails_at_once_in_one_line() {
    let Some((_s3, proxy)) = server_behind(Fault::RefuseConditions).await else {
        return;
    };
    let repo = Repo::open(remote_via(&proxy, "refusing"), None)
        .await
        .unwrap();
    // A client that still asks the server (a config edited by hand, a proxy
    // put in front later).
    let asking = repo
        .remote()
        .clone()
        .with_conditional_writes(ConditionalWrites::Honoured);
    let refused_before = proxy.refused();
    let started = Instant::now();
    let err = asking
        .create("refs/x/@/0000000001", "r".into())
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(proxy.refused() - refused_before, 1, "asked once");
    let msg = format!("{:#}", anyhow_chain(&err));
    assert!(!msg.contains('\n'), "{msg}");
    assert!(msg.contains("create refs/x/@/0000000001"), "{msg}");
    assert_eq!(msg.matches("501").count(), 1, "{msg}");
    assert_eq!(msg.matches("not implemented").count(), 1, "{msg}");
    assert!(msg.contains("remove \"conditional_writes\""), "{msg}");
}

/// The error and its sources, joined as the CLI prints them.
fn anyhow_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out += &format!(": {s}");
        source = s.source();
    }
    out
}

/// A store made before labsync probed records nothing: the next open asks
/// the server once and writes the answer into the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_made_before_probing_is_probed_at_its_next_open() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let repo = Repo::open(remote_via(&proxy, "legacy"), None)
        .await
        .unwrap();
    let mut legacy = repo.config().clone();
    legacy.conditional_writes = None;
    let mut doc = serde_json::to_value(&legacy).unwrap();
    doc["note"] = "kept by hand".into();
    let json = serde_json::to_vec_pretty(&doc).unwrap();
    repo.remote().put("config", json.into()).await.unwrap();
    let reopened = Repo::open(remote_via(&proxy, "legacy"), None)
        .await
        .unwrap();
    assert_eq!(
        reopened.config().conditional_writes,
        Some(ConditionalWrites::Ignored)
    );
    let stored: labsync_store::StoreConfig =
        serde_json::from_slice(&repo.remote().get_at_most("config", 1 << 20).await.unwrap())
            .unwrap();
    assert_eq!(stored.conditional_writes, Some(ConditionalWrites::Ignored));
    assert_eq!(stored.id, legacy.id, "the same store");
    let doc: serde_json::Value =
        serde_json::from_slice(&repo.remote().get_at_most("config", 1 << 20).await.unwrap())
            .unwrap();
    assert_eq!(doc["note"], "kept by hand", "fields it does not know stay");
}

/// A claim left by a writer that crashed (older than 120 s by the server's
/// clock) does not block the key: the next writer passes it and deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_left_by_a_crashed_writer_does_not_block_the_key() {
    let Some((s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let repo = Repo::open(remote_via(&proxy, "crashed"), None)
        .await
        .unwrap();
    let key = "refs/ds/@/0000000001";
    let hash = blake3::hash(key.as_bytes()).to_hex();
    let left = format!("claims/{}.{}", &hash[..32], "f".repeat(32));
    repo.remote().put(&left, key.into()).await.unwrap();
    // s3s-fs gives an object its file's modification time.
    let file = s3.data_dir().join("labsync/crashed").join(&left);
    let long_ago = filetime::FileTime::from_unix_time(labsync_now() - 300, 0);
    filetime::set_file_mtime(&file, long_ago).unwrap();

    let started = Instant::now();
    assert!(repo.remote().create(key, "v1".into()).await.unwrap());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let claims = repo.remote().list("claims/").await.unwrap();
    assert!(
        claims.iter().all(|c| c.key != left),
        "the dead claim is deleted"
    );
}

fn labsync_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// As an attacker: a config that says the server honours conditional
/// writes, on one that ignores them (edited by hand, or written by a lying
/// client), loses no version: claims are taken on every server whatever
/// the config says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_claiming_honoured_on_an_ignoring_server_loses_no_version() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let first = Repo::open(remote_via(&proxy, "lying"), None).await.unwrap();
    let mut doc = serde_json::to_value(first.config()).unwrap();
    doc["conditional_writes"] = "honoured".into();
    let json = serde_json::to_vec_pretty(&doc).unwrap();
    first.remote().put("config", json.into()).await.unwrap();
    let repo = Repo::open(remote_via(&proxy, "lying"), None).await.unwrap();
    assert_eq!(
        repo.config().conditional_writes(),
        ConditionalWrites::Honoured
    );
    race_ten(&repo, dir.path(), "a lying config").await;
}

/// gc next to a push, in the order that lost a version's index entries:
/// gc lists the packs, a push then writes its packs, its index object and
/// its version, and only then does gc go on (the listing is held). The
/// pushed version stays readable and `verify --remote` finds nothing
/// wrong. (gc read the index after listing the packs, so it took in the
/// push's index object, dropped its packs, absent from the listing, from
/// the consolidated index, and deleted that object.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_while_gc_lists_the_packs_keeps_its_chunks_indexed() {
    let Some((_s3, proxy)) = server_behind(Fault::HoldPackListing).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = Repo::open(remote_via(&proxy, "gc-race"), None)
        .await
        .unwrap();
    let cache = NodeCache::open(&dir.path().join("cache"), 1 << 30).unwrap();
    // Two index objects: gc consolidates them (and deletes the old ones).
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        let src = dir.path().join(name);
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), random_bytes(200_000, i as u64)).unwrap();
        push(&repo, &src, &plain_opts(name), np()).await.unwrap();
    }
    let gc = {
        let repo = repo.clone();
        tokio::spawn(async move {
            labsync_store::gc(&repo, false, None, &labsync_store::NoProgress).await
        })
    };
    let t = Instant::now();
    while !proxy.holding() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "gc never listed the packs"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let src = dir.path().join("c");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f"), random_bytes(300_000, 7)).unwrap();
    push(&repo, &src, &plain_opts("c"), np()).await.unwrap();
    assert!(
        proxy.holding(),
        "the push ended while gc's listing was held"
    );
    gc.await.unwrap().unwrap();
    let report = verify(&repo, &cache, None, true, np()).await.unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let out = dir.path().join("c-out");
    labsync_store::Pull::new(&repo, &cache, &"c".parse().unwrap(), &out)
        .threads(2)
        .progress(np())
        .run()
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(out.join("f")).unwrap(),
        random_bytes(300_000, 7)
    );
}

/// Issue 41, point 9: where the server ignores conditional writes a
/// create goes by claims, and it lists only its own key's claims (the
/// listing starts at their names), however many others the folder holds,
/// left over or planted. Before, every create listed the whole folder: a
/// million claims made every commit run out of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_lists_only_its_own_keys_claims() {
    let Some((_s3, proxy)) = server_behind(Fault::DropConditions).await else {
        return;
    };
    let remote = remote_via(&proxy, "claims41").with_conditional_writes(ConditionalWrites::Ignored);
    for i in 0..30u32 {
        let key = format!("claims/{i:032x}.planted");
        remote.put(&key, "data/elsewhere".into()).await.unwrap();
    }
    let before = proxy.passed().len();
    assert!(remote.create("data/one", "v1".into()).await.unwrap());
    assert!(!remote.create("data/one", "v2".into()).await.unwrap());
    let lists: Vec<String> = proxy.passed()[before..]
        .iter()
        .filter(|w| w.contains("list-type=2"))
        .cloned()
        .collect();
    assert!(!lists.is_empty(), "the create listed its claims");
    for l in &lists {
        assert!(l.contains("start-after="), "a listing of every claim: {l}");
    }
    assert_eq!(
        &remote.get_at_most("data/one", 64).await.unwrap()[..],
        b"v1"
    );
}

/// Issue 41, point 7: one key `object_store` cannot name (a control
/// character, as any member can write) in a folder made every listing of
/// that folder fail: every push, pull, gc and verify, on every node, on a
/// real S3 server and on a local folder alike. Listings pass such keys by;
/// `verify` names them for the server's own tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_no_command_can_name_stops_no_listing() {
    const FOLDERS: [&str; 7] = [
        "index",
        "refs/ds/@",
        "snapshots",
        "packs/00",
        "gc",
        "pins",
        "claims",
    ];
    let Some(s3) = S3Server::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local-store");
    let stores = [
        (s3.remote("odd"), s3.data_dir().join("labsync/odd")),
        (Remote::local(&local).unwrap(), local.clone()),
    ];
    for (k, (remote, on_disk)) in stores.into_iter().enumerate() {
        let repo = Repo::open(remote, None).await.unwrap();
        let src = dir.path().join(format!("src{k}"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), random_bytes(50_000, k as u64)).unwrap();
        push(&repo, &src, &plain_opts("ds"), np()).await.unwrap();
        for folder in FOLDERS {
            let d = on_disk.join(folder);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(format!("planted\u{1}{k}")), b"junk").unwrap();
        }
        std::fs::write(src.join("g"), b"more").unwrap();
        let pushed = push(&repo, &src, &plain_opts("ds"), np()).await.unwrap();
        assert_eq!(pushed.record.version, 2);
        let cache = NodeCache::open(&dir.path().join(format!("cache{k}")), 1 << 30).unwrap();
        let out = dir.path().join(format!("out{k}"));
        labsync_store::Pull::new(&repo, &cache, &"ds".parse().unwrap(), &out)
            .threads(2)
            .progress(np())
            .run()
            .await
            .unwrap();
        assert_eq!(std::fs::read(out.join("g")).unwrap(), b"more");
        gc(&repo, false, None, &NoProgress).await.unwrap();
        let report = verify(&repo, &cache, None, true, np()).await.unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        let named = |folder: &str| {
            let key = format!("{folder}/planted\u{1}{k}");
            report
                .warnings
                .iter()
                .any(|w| w.contains(&format!("{key:?}").trim_matches('"').to_string()))
        };
        for folder in ["index", "snapshots", "packs/00"] {
            assert!(named(folder), "{k} {folder}: {:?}", report.warnings);
        }
    }
}
