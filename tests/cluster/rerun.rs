//! Issue 44: every job records what it ran on, its outputs' versions say
//! so, and `labrun rerun` runs it again on the same snapshots.

use std::collections::BTreeMap;
use std::path::Path;

use crate::lab::*;
use crate::support::write_tree;

/// Every file under `root`, by its path there.
fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let (p, kind) = (e.path(), e.file_type().unwrap());
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if kind.is_dir() {
                stack.push(p);
            } else if kind.is_symlink() {
                let to = std::fs::read_link(&p).unwrap();
                out.insert(rel, format!("-> {}", to.display()).into_bytes());
            } else {
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// The job's outputs, pulled from the store.
fn outputs(lab: &Lab, job: &str) -> BTreeMap<String, Vec<u8>> {
    let to = lab.dir.path().join(format!("pulled-{job}"));
    lab.labsync(0, &["pull", &format!("runs/{job}"), to.to_str().unwrap()]);
    files(&to)
}

/// A deterministic job's outputs come back byte for byte from `labrun
/// rerun`, though its code and dataset have new versions since (the rerun
/// reads the snapshots by id); `--data NAME@vN` swaps one dataset; the
/// outputs' versions say which job, code, data, node and GPUs made them.
#[test]
fn a_rerun_reproduces_a_jobs_outputs_on_the_same_snapshots() {
    let Some(lab) = Lab::start(2) else { return };
    let ds = lab.dataset("ds", 1);
    let code = lab.dir.path().join("code");
    std::fs::create_dir_all(&code).unwrap();
    // Reads every byte of the data and of itself into its outputs.
    let script = "set -e\nmkdir -p out\n\
                  (cd \"$LABRUN_DATA\" && find . -type f | sort | xargs cat | sha256sum) > out/data.sum\n\
                  sha256sum gen.sh > out/code.sum\necho \"$@\" > out/args\n\
                  cp -r \"$LABRUN_DATA\" out/copy\n";
    std::fs::write(code.join("gen.sh"), script).unwrap();
    let args = [
        "--data",
        "ds",
        "--outputs",
        "out",
        "--gpus",
        "1",
        "--",
        "sh",
        "gen.sh",
        "a b",
    ];
    lab.ok(&args);
    let first = lab.jobs().last().unwrap().id.to_string();
    let made = outputs(&lab, &first);
    assert!(made.len() > 4, "{:?}", made.keys());
    assert_eq!(made["args"], b"a b\n");

    // The code and the data move on.
    std::fs::write(
        code.join("gen.sh"),
        format!("{script}echo changed > out/new\n"),
    )
    .unwrap();
    write_tree(&ds.join("more"), 9);
    lab.labsync(0, &["push", ds.to_str().unwrap(), "--name", "ds"]);

    let out = lab.ok(&["rerun", &first]);
    let again = lab.jobs().last().unwrap().id.to_string();
    assert_ne!(again, first, "{out}");
    assert_eq!(
        outputs(&lab, &again),
        made,
        "the rerun's outputs differ from {first}'s"
    );

    // The outputs say what made them.
    let log = lab.labsync(0, &["log", &format!("runs/{again}")]);
    for want in [
        format!("made by job {again} on gpu"),
        "GPU(s) ".into(),
        ": sh gen.sh a b".into(),
        "code code/alice/code@v1 (".into(),
        "data ds@v1 (".into(),
        "(exit 0)".into(),
    ] {
        assert!(log.contains(&want), "{want:?} in {log}");
    }
    // The job's record has both snapshots by id.
    let rec = lab.job(&again).meta.request.unwrap();
    assert_eq!(rec.data[0].tree.label, "ds@v1");
    assert_eq!(rec.code.unwrap().label, "code/alice/code@v1");

    // Another version of its dataset, by name.
    lab.ok(&["rerun", &first, "--data", "ds@v2", "--detach"]);
    let swapped = lab.jobs().last().unwrap().id.to_string();
    crate::common::wait_until(&format!("{swapped} to end"), 60, || {
        let j = lab.job(&swapped);
        j.ended() && !j.meta.outputs_pending
    });
    let other = outputs(&lab, &swapped);
    assert_ne!(other["data.sum"], made["data.sum"]);
    assert_eq!(
        other["code.sum"], made["code.sum"],
        "the code stays the first run's"
    );

    // Mistakes are named.
    let o = lab.labrun(&["rerun", &first, "--data", "nope@v1"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("read no dataset nope; it read ds@v1"),
        "{e}"
    );
    let o = lab.labrun(&["rerun", "j999"]);
    assert!(!o.status.success(), "{o:?}");
}
