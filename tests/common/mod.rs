//! What every end-to-end test binary needs: the binaries under test, and
//! waiting for a condition (never a fixed sleep).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One of labsync-cli's binaries, from the folder cargo put this test in
/// (`target/<profile>/deps/<test>-*` → `target/<profile>/NAME`).
/// `cargo test --workspace` builds them before any test runs; a test run
/// of this package alone does not, and says so here: when one is missing,
/// and when one is older than the workspace's sources (a test would
/// otherwise pass or fail on what the code was, not what it is).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    let build = "run the tests with `scripts/test.sh` or `cargo test --workspace` (which \
                 build labsync-cli's binaries), or `cargo build -p labsync-cli --bins` first";
    assert!(path.is_file(), "{} is missing: {build}", path.display());
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .expect("the binary's time");
    if let Some((changed, source)) = newest_source(&dir.join(format!("{name}.d"))) {
        assert!(
            changed <= built,
            "{} is older than {}, which it is built from: {build}",
            path.display(),
            source.display()
        );
    }
    path
}

/// The newest of the files cargo built a binary from, as its dep-info file
/// `deps` (next to the binary, `target/<profile>/NAME.d`) lists them, and
/// its time; `None` when there is no such file.
///
/// Cargo writes that file when it builds the binary as one of the units
/// asked for (`cargo build -p labsync-cli --bins`), not when it builds it
/// for `cargo test --workspace`'s own use: after only the latter there may
/// be none (no check) or an older list (files added since are not looked
/// at). Either way a binary is never called stale while cargo would call
/// it fresh, except with a source dated in the future.
fn newest_source(deps: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let text = std::fs::read_to_string(deps).ok()?;
    // `target: dep dep …`, a space inside a name escaped as `\ `.
    let (_, list) = text.lines().next()?.split_once(": ")?;
    let mut names = Vec::new();
    let mut name = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => name.extend(chars.next()),
            ' ' => names.push(std::mem::take(&mut name)),
            c => name.push(c),
        }
    }
    names.push(name);
    names
        .into_iter()
        .filter(|n| !n.is_empty())
        .filter_map(|n| {
            let p = PathBuf::from(n);
            let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
            Some((t, p))
        })
        .max_by_key(|(t, _)| *t)
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
