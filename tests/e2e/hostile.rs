//! The store as a hostile lab member writes it: every member can put any
//! key, and every labd (root) and every client reads what they put.

use super::{heap_capped, s, support, Lab};

/// Four GiB: what one planted object costs a reader that reads it whole.
const HUGE: u64 = 4 << 30;

/// A sparse file of [`HUGE`] bytes at `key` of the lab's local store: the
/// size a server would give, at no disk cost.
fn plant(lab: &Lab, key: &str) {
    let path = lab.path("store").join(key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::File::create(&path).unwrap().set_len(HUGE).unwrap();
}

/// `labsync ARGS` with its heap capped at 512 MiB (RLIMIT_DATA: what a
/// whole read of a planted object would need is eight times that): its
/// exit code and its output, both streams.
fn capped(lab: &Lab, args: &[&str]) -> (Option<i32>, String) {
    let o = heap_capped(&lab.cmd(args), 512 << 20).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), text)
}

/// Issue 40, point 2: a 4 GiB object under `index/`, `snapshots/` or
/// `refs/` is refused from its size, naming its key, and never read:
/// pull, verify and push each work on in capped memory, where a whole read
/// (as before) dies for want of memory.
#[test]
fn a_huge_planted_object_is_refused_by_name_not_read() {
    let lab = Lab::new();
    let src = lab.path("ds");
    support::write_tree(&src, 1);
    support::wait_until_at_rest(&src);
    lab.ok(&["push", s(&src), "--name", "ds"]);

    // Under index/, named as an index object is: every load of the index meets it.
    let junk_index = format!("index/{}", "ab".repeat(32));
    plant(&lab, &junk_index);
    let dest = lab.path("out");
    let (code, out) = capped(&lab, &["pull", "ds", s(&dest)]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&junk_index), "pull names the key: {out}");
    support::assert_same_tree(&src, &dest);
    let (code, out) = capped(&lab, &["verify"]);
    assert_ne!(code, Some(0), "a refused index object is a problem: {out}");
    assert!(
        out.contains(&junk_index) && out.contains("more than the"),
        "verify names the key and why: {out}"
    );
    std::fs::write(src.join("new.txt"), "a new file").unwrap();
    let (code, out) = capped(&lab, &["push", s(&src), "--name", "ds"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&junk_index), "push names the key: {out}");

    // A version record planted as the next version, and an object planted
    // under a snapshot's name: refused by name, and the versions before it
    // still pull.
    let log = lab.json(&["log", "ds"]);
    let snap = (log["versions"].as_array().unwrap().iter())
        .find(|v| v["version"] == 1)
        .and_then(|v| v["snapshot"].as_str())
        .unwrap_or_else(|| panic!("no snapshot id of v1 in {log}"))
        .to_string();
    plant(&lab, "refs/ds/@/0000000003");
    let (code, out) = capped(&lab, &["pull", "ds", s(&lab.path("out3"))]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("refs/ds/@/0000000003"), "{out}");
    let (code, out) = capped(&lab, &["pull", "ds@v2", s(&lab.path("out2"))]);
    assert_eq!(code, Some(0), "{out}");
    plant(&lab, &format!("snapshots/{snap}"));
    let (code, out) = capped(&lab, &["pull", "ds@v1", s(&lab.path("out1"))]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains(&format!("snapshots/{snap}")), "{out}");
}

/// The snapshot id a version names, from `labsync log`.
fn snapshot_of(lab: &Lab, name: &str, version: u64) -> String {
    let log = lab.json(&["log", name]);
    (log["versions"].as_array().unwrap().iter())
        .find(|v| v["version"] == version)
        .and_then(|v| v["snapshot"].as_str())
        .unwrap_or_else(|| panic!("no snapshot of {name}@v{version} in {log}"))
        .to_string()
}

/// Issue 40, point 1: a member overwrites `refs/ds/@/0000000001` with a
/// record naming their own snapshot. A version pinned to its id (as labd
/// hands a checkpoint over, `LABRUN_RESUME_FROM=runs/j12@v3#ID`) is
/// refused, naming the key; so is a version the user pulled before, and
/// `verify` reports it. A user who never saw the version cannot tell (the
/// README says so, and how a bucket policy prevents it).
#[test]
fn a_rewritten_version_is_refused_not_followed() {
    let lab = Lab::new();
    let (good, evil) = (lab.path("good"), lab.path("evil"));
    std::fs::create_dir_all(&good).unwrap();
    std::fs::create_dir_all(&evil).unwrap();
    std::fs::write(good.join("ckpt.pt"), "the real checkpoint").unwrap();
    std::fs::write(evil.join("ckpt.pt"), "a pickle that runs code").unwrap();
    lab.ok(&["push", s(&good), "--name", "ds"]);
    lab.ok(&["push", s(&evil), "--name", "mine"]);
    let (real, planted) = (snapshot_of(&lab, "ds", 1), snapshot_of(&lab, "mine", 1));
    // This user pulls ds@v1 once: it is remembered.
    lab.ok(&["pull", "ds@v1", s(&lab.path("first"))]);

    // The attack: the record of ds@v1 now names the member's snapshot.
    let key = lab.path("store/refs/ds/@/0000000001");
    let mut rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&key).unwrap()).unwrap();
    rec["snapshot"] = planted.clone().into();
    std::fs::write(&key, serde_json::to_vec(&rec).unwrap()).unwrap();

    let refused = |args: &[&str]| {
        let o = lab.run(args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(1), "{args:?} was followed: {err}");
        assert!(
            err.contains("rewritten") && err.contains("refs/ds/@/0000000001"),
            "{args:?}: {err}"
        );
        err
    };
    let pinned = format!("ds@v1#{real}");
    let err = refused(&["pull", &pinned, s(&lab.path("pinned"))]);
    assert!(err.contains(&planted), "names what it names now: {err}");
    assert!(!lab.path("pinned/ckpt.pt").exists());
    refused(&["pull", "ds@v1", s(&lab.path("again"))]);
    refused(&["pull", "ds", s(&lab.path("latest"))]);
    let o = lab.run(&["verify"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && out.contains("rewritten") && out.contains("refs/ds/@/0000000001"),
        "{out}"
    );
    // Another user, who never saw ds@v1, is not protected by memory.
    let mut other = lab.cmd(&["pull", "ds@v1", s(&lab.path("other"))]);
    other.env("LABSYNC_CACHE", lab.path("other-cache"));
    assert!(other.output().unwrap().status.success());
}
