//! Issue 45: a queue that knows time, end to end on real labd processes.
//! Time limits stop jobs (their outputs saved) and say so; running jobs'
//! limits and estimates from history reach the placer, whose reasons name
//! them and whose bounded locality wait weighs them; the first job that
//! cannot start holds its GPUs while only jobs that end first backfill;
//! a waiting job ages up the tiers; admins change grants, tiers and the
//! cap with no restart; running jobs weigh on fair share as they run.

use std::process::Output;
use std::time::{Duration, Instant};

use labsync_agent::proto::{AdminView, Expected};
use labsync_agent::JobState;

use crate::common::wait_until;
use crate::lab::*;

fn id(o: Output) -> String {
    assert!(o.status.success(), "{o:?}");
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

/// `while [ ! -e NAME ]; do sleep 0.05; done`: a job that runs until the
/// test creates NAME in the lab's folder.
fn until(lab: &Lab, name: &str) -> String {
    let f = lab.dir.path().join(name);
    format!("while [ ! -e {} ]; do sleep 0.05; done", f.display())
}

fn release(lab: &Lab, name: &str) {
    std::fs::write(lab.dir.path().join(name), "").unwrap();
}

fn why(lab: &Lab, id: &str) -> String {
    lab.job(id).why.unwrap_or_default()
}

fn queued(lab: &Lab, id: &str) -> bool {
    matches!(lab.job(id).state, JobState::Queued)
}

/// Point 1: at its limit (its own, or its tier's default) a job gets
/// SIGTERM, its outputs are saved, and `labrun ps` says it ran out of
/// time; a job with neither is planned with an estimate from its user's
/// earlier runs, shown as one.
#[test]
fn a_job_at_its_limit_is_stopped_saved_and_said_and_others_are_estimated() {
    let rules = "[lab]\n[lab.users]\nbob = \"phd\"\n[lab.time_limits]\nundergrad = \"2s\"\n";
    let Some(lab) = Lab::start_full(1, false, "", rules) else {
        return;
    };
    // alice stands at undergrad: her tier's 2 s. The job saves a
    // checkpoint when told to stop, as a training loop would.
    let script = "mkdir -p out; trap 'echo term-seen; echo saved > out/ckpt; exit 0' TERM; \
                  while true; do sleep 0.1; done";
    let started = Instant::now();
    let j1 = id(lab.labrun(&["-d", "--outputs", "out", "--", "bash", "-c", script]));
    wait_until("j1 to end at its limit", 60, || {
        let j = lab.job(&j1);
        j.ended() && !j.meta.outputs_pending
    });
    let j = lab.job(&j1);
    assert!(
        j.why
            .as_deref()
            .is_some_and(|w| w.contains("ran out of time (its limit of 2 s)")),
        "{j:?}"
    );
    let ran = j.ended_at.unwrap() - j.started_at.unwrap();
    assert!((2..=4).contains(&ran), "ran {ran} s: {j:?}");
    assert!(started.elapsed() >= Duration::from_secs(2));
    let log = lab.ok(&["logs", &j1]);
    assert!(log.contains("term-seen"), "{log}");
    assert!(
        log.contains("labd: ran out of time (its limit of 2 s): SIGTERM now"),
        "{log}"
    );
    let saved = j.meta.outputs_saved.clone().expect("its outputs saved");
    let out = lab.dir.path().join("j1-out");
    lab.labsync(0, &["pull", &saved, out.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(out.join("ckpt")).unwrap(),
        "saved\n"
    );
    // Her own --time wins over her tier's; `labrun ps` says it.
    let j2 = id(lab.labrun(&["-d", "--time", "1s", "--", "sleep", "30"]));
    wait_until("j2 to end", 30, || lab.job(&j2).ended());
    let ps = lab.ok(&["ps"]);
    let line = ps.lines().find(|l| l.starts_with(&j2)).unwrap_or_default();
    assert!(line.contains("ran out of time (its limit of 1 s)"), "{ps}");
    // bob (phd) has no default: two runs of the same command teach the
    // coordinator how long it takes; the third is planned with that,
    // shown as an estimate.
    let cmd = ["-d", "--", "bash", "-c", "sleep 2"];
    for _ in 0..2 {
        let j = id(lab.labrun_as_bob(&cmd));
        wait_until("bob's run to end", 30, || lab.job(&j).ended());
        assert!(
            matches!(lab.job(&j).state, JobState::Exited { code: Some(0), .. }),
            "{:?}",
            lab.job(&j)
        );
    }
    let j5 = id(lab.labrun_as_bob(&cmd));
    let j = lab.job(&j5);
    let Some(Expected { secs, limit: false }) = j.meta.expected else {
        panic!("an estimate for {j5}: {j:?}")
    };
    assert!((2..=3).contains(&secs), "{secs}: {j:?}");
    let ps = String::from_utf8(lab.labrun_as_bob(&["ps"]).stdout).unwrap();
    let line = ps.lines().find(|l| l.starts_with(&j5)).unwrap_or_default();
    assert!(line.contains(&format!("/~0:00:0{secs}")), "{ps}");
    // alice's limited job shows its limit, not an estimate.
    let j6 = id(lab.labrun(&["-d", "--time", "1h", "--", "sleep", "30"]));
    let j = lab.job(&j6);
    assert_eq!(
        j.meta.expected,
        Some(Expected {
            secs: 3600,
            limit: true
        }),
        "{j:?}"
    );
    lab.ok(&["kill", &j6]);
}

/// Point 2: the bounded locality wait in the real coordinator. gpu1's
/// labd measured its peer fetches at 0.25 MB/s (its counts file says so),
/// so bringing the dataset there takes ~37 s: a job waits for gpu0, which
/// holds the data and frees at a job's 4 s limit (planned with the 12 s a
/// stop may take), and says so;
/// when gpu0's GPUs are held for a day it goes to gpu1 at once.
#[test]
fn a_job_waits_for_its_datas_node_that_frees_soon_and_not_for_one_that_frees_in_a_day() {
    let Some(mut lab) = Lab::start(2) else { return };
    let counts = r#"{"from_peers":0,"from_store":0,"corrupt_from_peers":0,"failed_from_peers":0,"peer_rate":250000}"#;
    std::fs::create_dir_all(lab.cache(1)).unwrap();
    std::fs::write(
        lab.cache(1).join(labsync_agent::cluster::COUNTS_FILE),
        counts,
    )
    .unwrap();
    lab.crash(1);
    lab.restart(1);
    lab.dataset("ds", 45);
    lab.cache_on(0, "ds");
    lab.wait_for("gpu1 to be up", 30, |s| {
        Lab::node(s, "gpu1").is_some_and(|n| n.health == labsync_agent::proto::NodeHealth::Up)
    });
    // Soon: the data's node frees at a 2 s limit.
    let blocker = id(lab.labrun(&[
        "-d", "--gpus", "2", "--data", "ds", "--time", "4s", "--", "sleep", "60",
    ]));
    assert_eq!(lab.running(&blocker), "gpu0");
    let waiter = id(lab.labrun(&["-d", "--gpus", "1", "--data", "ds", "--", "true"]));
    let mut said = Vec::new();
    wait_until("the waiter to run or end", 60, || {
        let j = lab.job(&waiter);
        said.extend(j.why.clone());
        !matches!(j.state, JobState::Queued)
    });
    assert!(
        said.iter().any(|w| w.contains("gpu0: 1 GPU(s) free in ~")
            && w.contains(&format!("({blocker}'s limit)"))),
        "{said:?}"
    );
    wait_until("the waiter to end", 60, || lab.job(&waiter).ended());
    let j = lab.job(&waiter);
    assert_eq!(j.node.as_deref(), Some("gpu0"), "{j:?}");
    assert!(lab
        .job(&blocker)
        .why
        .unwrap_or_default()
        .contains("ran out of time"));
    // Not for a day: elsewhere, now, fetching there.
    let day = id(lab.labrun(&[
        "-d", "--gpus", "2", "--data", "ds", "--time", "1d", "--", "sleep", "600",
    ]));
    assert_eq!(lab.running(&day), "gpu0");
    let t = Instant::now();
    let other = id(lab.labrun(&["-d", "--gpus", "1", "--data", "ds", "--", "true"]));
    assert_eq!(lab.running_or_ended(&other), "gpu1");
    assert!(t.elapsed() < Duration::from_secs(30));
    lab.ok(&["kill", &day]);
}

/// Point 3: EASY backfill. The 2-GPU job at the head of the queue holds
/// gpu0's GPUs from when they are expected free (a running job's day-long
/// limit): a 1-GPU job with no known end may not take the free one, one
/// whose --time ends before the reservation may, and once the GPUs free
/// the big job starts before the small ones that came after it.
#[test]
fn a_big_job_holds_its_gpus_and_only_jobs_that_end_first_backfill() {
    // At once: the lab's default waits reserve_after_minutes first.
    let Some(lab) = Lab::start_full(1, false, "", "[lab]\nreserve_after_minutes = 0\n") else {
        return;
    };
    let a = id(lab.labrun(&[
        "-d",
        "--gpus",
        "1",
        "--time",
        "1d",
        "--",
        "bash",
        "-c",
        &until(&lab, "a"),
    ]));
    lab.running(&a);
    let big = id(lab.labrun(&["-d", "--gpus", "2", "--", "true"]));
    wait_until("the big job's reservation", 30, || {
        why(&lab, &big).contains("gpu0's GPU(s) 0,1 are held for it from then")
    });
    assert!(
        why(&lab, &big).contains(&format!("({a}'s limit)")),
        "{}",
        why(&lab, &big)
    );
    // A stream of small jobs with no known end: none takes the free GPU.
    let mut small = Vec::new();
    for _ in 0..3 {
        small.push(id(
            lab.labrun_as_bob(&["-d", "--gpus", "1", "--", "sleep", "1"])
        ));
    }
    wait_until("the small jobs to say why they wait", 30, || {
        small
            .iter()
            .all(|s| why(&lab, s).contains(&format!("{big} holds gpu0's GPU(s) 0,1 from ~")))
    });
    // One that ends long before the reservation: backfilled at once.
    let short = id(lab.labrun_as_bob(&["-d", "--gpus", "1", "--time", "5s", "--", "true"]));
    wait_until("the short job to run and end", 30, || {
        lab.job(&short).ended()
    });
    assert!(small.iter().all(|s| queued(&lab, s)), "{:?}", lab.jobs());
    // The day-long job ends early: the big job goes first.
    release(&lab, "a");
    wait_until("the big job to end", 60, || lab.job(&big).ended());
    let big_start = lab.job(&big).started_at.unwrap();
    wait_until("the small jobs to end", 60, || {
        small.iter().all(|s| lab.job(s).ended())
    });
    for s in &small {
        let j = lab.job(s);
        assert!(
            j.started_at.unwrap() >= big_start,
            "{s} before {big}: {j:?}"
        );
    }
}

/// Point 4: a waiting job rises one tier per `aging_hours` (3.6 s here):
/// after two steps alice's undergraduate job is ordered with PhD jobs, so
/// it goes before bob's PhD job submitted later; a deadline job still goes
/// before both.
#[test]
fn an_old_undergraduate_job_goes_before_a_new_phd_job_and_after_a_deadline_job() {
    let rules = "[lab]\naging_hours = 0.001\n[lab.users]\nbob = \"phd\"\nadmin = \"master\"\n\
                 [lab.grants]\nadmin = \"2099-12-31\"\n";
    let Some(lab) = Lab::start_full(1, false, "", rules) else {
        return;
    };
    let x1 = id(lab.labrun_as_bob(&["-d", "--gpus", "1", "--", "bash", "-c", &until(&lab, "x1")]));
    let x2 = id(lab.labrun_as_bob(&["-d", "--gpus", "1", "--", "bash", "-c", &until(&lab, "x2")]));
    lab.running(&x1);
    lab.running(&x2);
    let old = id(lab.labrun(&["-d", "--gpus", "1", "--", "bash", "-c", &until(&lab, "old")]));
    std::thread::sleep(Duration::from_millis(7500));
    let phd = id(lab.labrun_as_bob(&["-d", "--gpus", "1", "--", "true"]));
    let until_dl = until(&lab, "dl");
    let dl = id(lab
        .labrun_cmd(&[
            "-d",
            "--priority",
            "deadline",
            "--gpus",
            "1",
            "--",
            "bash",
            "-c",
            &until_dl,
        ])
        .env("LABRUN_TOKEN", ADMIN)
        .output()
        .unwrap());
    // One GPU frees: the deadline job's, though the others waited longer.
    release(&lab, "x1");
    lab.running(&dl);
    assert!(queued(&lab, &old) && queued(&lab, &phd), "{:?}", lab.jobs());
    // The next: the old undergraduate job's, not the newer PhD one's.
    release(&lab, "x2");
    lab.running(&old);
    assert!(queued(&lab, &phd), "{:?}", lab.job(&phd));
    release(&lab, "dl");
    release(&lab, "old");
    wait_until("the PhD job to end", 60, || lab.job(&phd).ended());
}

fn admin_show(lab: &Lab) -> AdminView {
    let o = lab
        .labrun_cmd(&["admin", "show", "--json"])
        .env("LABRUN_TOKEN", ADMIN)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    serde_json::from_slice(&o.stdout).unwrap()
}

fn admin(lab: &Lab, args: &[&str]) -> Output {
    let mut all = vec!["admin"];
    all.extend_from_slice(args);
    lab.labrun_cmd(&all)
        .env("LABRUN_TOKEN", ADMIN)
        .output()
        .unwrap()
}

/// Points 5 and 6: `labrun admin grant / tier / cap` change the rules at
/// once, with no restart, are listed by `labrun admin show` with who made
/// each change, outlive a restart of the coordinator, and are refused to
/// users who are not admins; a running job is charged to its user's fair
/// share while it runs.
#[test]
fn admins_change_the_rules_with_no_restart_and_running_jobs_weigh_on_fair_share() {
    let Some(mut lab) = Lab::start_full(1, false, "", "[lab]\nmax_gpus_per_user = 2\n") else {
        return;
    };
    // alice may not ask for the deadline tier, until granted.
    let o = lab.labrun(&["-d", "--priority", "deadline", "--", "true"]);
    assert!(!o.status.success());
    let o = admin(
        &lab,
        &["grant", "alice", "deadline", "--until", "2099-12-31"],
    );
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("alice") && out.contains("until 2099-12-31 (UTC)"),
        "{out}"
    );
    let j = id(lab.labrun(&["-d", "--priority", "deadline", "--gpus", "0", "--", "true"]));
    wait_until("the granted job to end", 30, || lab.job(&j).ended());
    // Tiers and the cap.
    assert!(admin(&lab, &["tier", "bob", "phd"]).status.success());
    assert!(admin(&lab, &["cap", "1"]).status.success());
    let o = lab.labrun_as_bob(&["-d", "--gpus", "2", "--", "true"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("the lab's cap is 1 per user"),
        "{err}"
    );
    let o = lab.labrun_as_bob(&["-d", "--priority", "master", "--", "true"]);
    assert!(o.status.success(), "bob at phd may ask for master: {o:?}");
    // Bad changes are refused, saying why; users are not admins.
    let o = admin(&lab, &["tier", "bob", "postdoc"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no tier is named \"postdoc\""),
        "{o:?}"
    );
    let o = admin(&lab, &["grant", "bob", "phd", "--until", "2099-12-31"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not the lab's deadline tier"),
        "{o:?}"
    );
    let o = lab.labrun(&["admin", "cap", "9"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("is for the lab's admins"),
        "{err}"
    );
    let o = lab.labrun(&["admin", "show"]);
    assert!(!o.status.success(), "{o:?}");
    // Kept across a restart, with who and when.
    lab.crash(0);
    lab.restart(0);
    let v = admin_show(&lab);
    assert_eq!(v.cap, Some(1));
    let bob = v.users.iter().find(|u| u.user == "bob").expect("bob");
    assert_eq!(bob.tier, "phd");
    let alice = v.users.iter().find(|u| u.user == "alice").expect("alice");
    assert!(alice.deadline_until.is_some());
    assert_eq!(v.changes.len(), 3, "{:?}", v.changes);
    assert!(v.changes.iter().all(|c| c.by == "admin"));
    let text = String::from_utf8(admin(&lab, &["show"]).stdout).unwrap();
    assert!(text.contains("admin      cap 1"), "{text}");
    assert!(admin(&lab, &["cap", "none"]).status.success());
    assert_eq!(admin_show(&lab).cap, None);
    // Fair share: charged while the job runs, not only once it ends.
    let used = |v: &AdminView| {
        v.usage
            .iter()
            .find(|(u, _)| u == "bob")
            .map_or(0.0, |(_, h)| *h)
    };
    let before = used(&admin_show(&lab));
    let long = id(lab.labrun_as_bob(&[
        "-d",
        "--gpus",
        "2",
        "--",
        "bash",
        "-c",
        &until(&lab, "long"),
    ]));
    lab.running(&long);
    wait_until("bob's running job to be charged", 30, || {
        used(&admin_show(&lab)) > before
    });
    assert!(matches!(lab.job(&long).state, JobState::Running { .. }));
    let charged = used(&admin_show(&lab)) - before;
    // Two GPUs for at least the 5 s between charges.
    assert!(charged >= 2.0 * 5.0 / 3600.0 * 0.99, "{charged}");
    release(&lab, "long");
    wait_until("the long job to end", 30, || lab.job(&long).ended());
    let j = lab.job(&long);
    let ran = (j.ended_at.unwrap() - j.started_at.unwrap()) as f64;
    let total = used(&admin_show(&lab)) - before;
    // Charged once in all: two GPUs for as long as it ran (whole seconds).
    assert!(
        (total - 2.0 * ran / 3600.0).abs() <= 2.0 * 2.0 / 3600.0,
        "{total} for {ran} s"
    );
}
