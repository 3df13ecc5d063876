//! Each binary starts and teaches: `--help` exits 0 and names its commands.
//!
//! Also the reason `cargo test --workspace` builds the binaries themselves
//! (cargo builds a package's binaries for its integration tests): the
//! end-to-end tests in `tests/` (labsync-e2e) run them from `target/`.

use std::process::Command;

fn help(bin: &str) -> String {
    let o = Command::new(bin).arg("--help").output().unwrap();
    assert!(o.status.success(), "{bin} --help: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn every_binary_explains_itself() {
    let labsync = help(env!("CARGO_BIN_EXE_labsync"));
    for cmd in ["push", "pull", "verify", "gc", "cache"] {
        assert!(
            labsync.contains(cmd),
            "labsync --help lacks {cmd}:\n{labsync}"
        );
    }
    let labrun = help(env!("CARGO_BIN_EXE_labrun"));
    for word in ["--data", "--gpus", "status", "logs"] {
        assert!(
            labrun.contains(word),
            "labrun --help lacks {word}:\n{labrun}"
        );
    }
    let labd = help(env!("CARGO_BIN_EXE_labd"));
    assert!(
        labd.contains("--config"),
        "labd --help lacks --config:\n{labd}"
    );
}
