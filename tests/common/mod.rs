//! What every end-to-end test binary needs: the binaries under test, and
//! waiting for a condition (never a fixed sleep).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One of labsync-cli's binaries, from the folder cargo put this test in
/// (`target/<profile>/deps/<test>-*` → `target/<profile>/NAME`).
/// `cargo test --workspace` builds them before any test runs; a test run
/// of this package alone does not, and says so here.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests with `scripts/test.sh` or `cargo test --workspace` \
         (which build labsync-cli's binaries), or `cargo build -p labsync-cli --bins` first",
        path.display()
    );
    path
}

/// Polls `f` every 25 ms until it holds; fails the test after `secs`.
pub fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}
