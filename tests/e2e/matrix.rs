//! Issue 17, point 5: the store's checks against every S3-compatible server
//! of the compatibility matrix, each installed from its package registry
//! by `scripts/test.sh` and started here on 127.0.0.1. Real `labsync` and
//! `labd` processes. (The same server behind a proxy that ignores, refuses
//! or slows down conditional writes is in the store's tests, `servers.rs`.)
//!
//! Each server's row of the README's table is printed (`--nocapture`) and,
//! with `LABSYNC_MATRIX_OUT` set to a folder, written there.

use super::labrun::{wait_until, Node, ALICE};
use super::proxy::{Fault, Proxy};
use super::support::{assert_same_tree, write_tree, S3Server, ServerKind};
use super::{
    gc_next_to_push, killed_pushes_leave_the_store_verifiable, race, random_files, s, Lab,
};

/// The checks against a server of `kind`.
fn matrix(kind: ServerKind) {
    let Some(server) = S3Server::start_kind(kind, true) else {
        return;
    };
    check(kind.label(), server.env());
}

/// The checks against unsigned `s3s-fs` behind the proxy doing `fault`.
fn behind_proxy(fault: Fault, label: &str) {
    let Some(server) = S3Server::start_unsigned() else {
        return;
    };
    // The proxy's tasks run on this runtime's workers while the test blocks.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt.block_on(Proxy::start(server.addr(), fault));
    let env = vec![
        ("AWS_ENDPOINT".into(), proxy.endpoint()),
        ("AWS_SKIP_SIGNATURE".into(), "true".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
    ];
    check(label, env);
}

/// Round trip, ten racing pushes, gc next to a push, killed pushes then
/// verify, and a labd job's outputs, on the server `env` points at; prints
/// the server's row of the README's table.
fn check(label: &str, env: Vec<(String, String)>) {
    let mut lab = Lab::new();
    lab.store = "s3://labsync/matrix".into();
    lab.extra_env = env.clone();

    // Round trip, and what the server does with conditional writes.
    let src = lab.path("ds");
    write_tree(&src, 21);
    lab.ok(&["push", s(&src)]);
    let dest = lab.path("ds-out");
    lab.ok(&["pull", "ds", s(&dest)]);
    assert_same_tree(&src, &dest);
    let info = lab.json(&["info"]);
    let conditional = info["conditional_writes"].as_str().unwrap().to_string();

    // Ten pushes racing to one name: each lands, or fails loudly.
    let r = race(&lab, "race", 10, 500);
    assert_eq!(r.recorded, r.told, "{label}: every version accounted for");
    assert!(!r.told.is_empty(), "{label}: every push lost the race");

    let data = random_files(&lab, "gc-data", 8, 1_000_000, 600);
    gc_next_to_push(&lab, &data, "gc-data");

    let data = random_files(&lab, "crash-data", 12, 1_000_000, 700);
    killed_pushes_leave_the_store_verifiable(&lab, &data, &[50, 200, 500]);

    // A labd job's outputs, saved to this store when it ends.
    let node = Node::start_with_store("s3://labsync/matrix", env);
    let script = "mkdir -p ckpt; echo epoch-3 > ckpt/model.pt";
    let id = node.detach(
        ALICE,
        &[
            "--gpus",
            "0",
            "--outputs",
            "ckpt",
            "--",
            "bash",
            "-c",
            script,
        ],
    );
    wait_until("the job's outputs to be saved", 60, || node.ended(&id));
    let job = node.job(&id);
    assert_eq!(node.saved_outputs(&job, "model.pt"), "epoch-3\n");

    let verify = lab.json(&["verify", "--remote"]);
    assert_eq!(verify["ok"], true, "{verify}");
    let row = format!(
        "| {label} | {conditional} | {} | {} | {} | {} problems, {} warnings | saved as {} |",
        r.told.len(),
        r.failed,
        r.recorded.len(),
        verify["report"]["problems"].as_array().unwrap().len(),
        verify["report"]["warnings"].as_array().unwrap().len(),
        job.meta.outputs_saved.as_deref().unwrap_or("-"),
    );
    eprintln!("{row}");
    if let Some(dir) = std::env::var_os("LABSYNC_MATRIX_OUT") {
        let name: String = label.chars().filter(char::is_ascii_alphanumeric).collect();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(std::path::Path::new(&dir).join(name), row + "\n").unwrap();
    }
}

#[test]
fn s3_matrix_s3s_fs() {
    matrix(ServerKind::S3sFs);
}

#[test]
fn s3_matrix_moto() {
    matrix(ServerKind::Moto);
}

#[test]
fn s3_matrix_ministack() {
    matrix(ServerKind::Ministack);
}

#[test]
fn s3_matrix_s3rver() {
    matrix(ServerKind::S3rver);
}

#[test]
fn s3_matrix_proxy_ignoring_conditional_writes() {
    behind_proxy(
        Fault::DropConditions,
        "s3s-fs behind a proxy that drops If-None-Match and If-Match",
    );
}

#[test]
fn s3_matrix_proxy_refusing_conditional_writes() {
    behind_proxy(
        Fault::RefuseConditions,
        "s3s-fs behind a proxy that answers 501 to conditional writes",
    );
}

#[test]
fn s3_matrix_proxy_answering_slow_down() {
    behind_proxy(
        Fault::SlowDown,
        "s3s-fs behind a proxy that answers 503 SlowDown to one request in 20",
    );
}
