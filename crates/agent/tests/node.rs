//! The node engine with real processes and fake GPUs.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use labsync_agent::{
    session_members, FakeGpus, GpuInventory, GpuState, JobState, NoGpus, Node, NodeConfig,
    NodeError, Submit,
};

fn node(dir: &Path, inv: Arc<dyn GpuInventory>) -> Node {
    let cfg = NodeConfig {
        state_dir: dir.join("state"),
        foreign_limit: 256 << 20,
        inventory_deadline: Duration::from_millis(300),
        max_queued_per_user: 1000,
        max_cpu_jobs_per_user: 100,
        limits: Default::default(),
        login_limits: Default::default(),
        log_keeper: None,
    };
    Node::open(cfg, inv).unwrap()
}

fn job(script: &str, gpus: u32, cwd: &Path) -> Submit {
    Submit {
        user: "alice".into(),
        argv: vec!["bash".into(), "-c".into(), script.into()],
        cwd: cwd.to_path_buf(),
        env: vec![],
        gpus,
        min_free_bytes: 0,
        run_as: None,
        meta: Default::default(),
    }
}

fn state_of(n: &Node, id: &str) -> JobState {
    n.jobs()
        .unwrap()
        .into_iter()
        .find(|j| j.id == id)
        .unwrap()
        .state
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn racing_submissions_for_one_gpu_run_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let n = Arc::new(node(
        dir.path(),
        Arc::new(FakeGpus::new("1x11GiB", None).unwrap()),
    ));
    let cwd = dir.path().to_path_buf();
    let ids: Vec<labsync_agent::proto::JobId> = (0..6)
        .map(|_| {
            let (n, cwd) = (n.clone(), cwd.clone());
            std::thread::spawn(move || {
                n.submit(job("echo gpu=$CUDA_VISIBLE_DEVICES; sleep 0.1", 1, &cwd))
                    .unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    wait_until("all jobs to end", || {
        n.reap().unwrap();
        let jobs = n.jobs().unwrap();
        let running = jobs
            .iter()
            .filter(|j| matches!(j.state, JobState::Running { .. }))
            .count();
        assert!(running <= 1, "two jobs on one GPU");
        jobs.iter()
            .all(|j| matches!(j.state, JobState::Exited { .. }))
    });
    for id in &ids {
        assert_eq!(
            state_of(&n, id),
            JobState::Exited {
                code: Some(0),
                signal: None
            }
        );
        assert_eq!(std::fs::read_to_string(n.log_path(id)).unwrap(), "gpu=0\n");
    }
    assert!(
        n.gpus().unwrap().iter().all(|g| g.state == GpuState::Free),
        "leases all released"
    );
}

#[test]
fn foreign_process_keeps_its_gpu_out_and_is_shown() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl.toml");
    std::fs::write(&ctl, "foreign = [{ gpu = 0, pid = 4242, mib = 3000 }]\n").unwrap();
    let n = node(
        dir.path(),
        Arc::new(FakeGpus::new("2x11GiB", Some(ctl.clone())).unwrap()),
    );
    let g = n.gpus().unwrap();
    assert!(
        matches!(&g[0].state, GpuState::Foreign { processes } if processes[0].pid == 4242 && processes[0].used_bytes == Some(3000 << 20))
    );
    let id = n.submit(job("true", 2, dir.path())).unwrap();
    assert_eq!(state_of(&n, &id), JobState::Queued);
    assert!(n
        .why_waiting(&id, &n.gpus().unwrap())
        .unwrap()
        .contains("1 free"));
    std::fs::write(&ctl, "").unwrap();
    assert_eq!(n.schedule().unwrap(), vec![id.clone()]);
    wait_until("job end", || !n.reap().unwrap().is_empty());
}

#[test]
fn hung_inventory_leases_nothing_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl.toml");
    let n = node(
        dir.path(),
        Arc::new(FakeGpus::new("2x11GiB", Some(ctl.clone())).unwrap()),
    );
    std::fs::write(&ctl, "hang = true\n").unwrap();
    let id = n.submit(job("true", 1, dir.path())).unwrap();
    assert_eq!(
        state_of(&n, &id),
        JobState::Queued,
        "nothing leased while unknown"
    );
    assert!(n
        .gpus()
        .unwrap()
        .iter()
        .all(|g| matches!(g.state, GpuState::Unknown { .. })));
    assert!(n
        .why_waiting(&id, &n.gpus().unwrap())
        .unwrap()
        .contains("unknown"));
    std::fs::write(&ctl, "hang = false\n").unwrap();
    wait_until("recovery", || !n.schedule().unwrap().is_empty());
    wait_until("job end", || !n.reap().unwrap().is_empty());
}

#[test]
fn kill_ends_the_whole_session_and_frees_the_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(
        dir.path(),
        Arc::new(FakeGpus::new("1x11GiB", None).unwrap()),
    );
    let id = n
        .submit(job(
            "trap '' TERM; (sleep 300 & sleep 300 & wait) & set -m; (sleep 300) & wait",
            1,
            dir.path(),
        ))
        .unwrap();
    let JobState::Running { sid, .. } = state_of(&n, &id) else {
        panic!("not running")
    };
    wait_until("children", || session_members(sid).len() >= 4);
    let next = n.submit(job("true", 1, dir.path())).unwrap();
    assert_eq!(state_of(&n, &next), JobState::Queued);
    n.kill(&id, Duration::from_millis(200)).unwrap();
    assert!(
        session_members(sid).is_empty(),
        "left alive: {:?}",
        session_members(sid)
    );
    assert!(matches!(
        state_of(&n, &id),
        JobState::Exited {
            signal: Some(9),
            ..
        }
    ));
    assert!(
        matches!(
            state_of(&n, &next),
            JobState::Running { .. } | JobState::Exited { .. }
        ),
        "the GPU went to the next job"
    );
}

/// Jobs that end leaving processes which ignore SIGTERM each cost a grace
/// period (2 s) before those are killed: their leftovers are killed all at
/// once, so five such jobs hold one reap for about 2 s, not 10 (one after
/// another, the reap cannot take less than five grace periods).
#[test]
fn leftovers_of_jobs_ending_together_are_killed_together() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), Arc::new(NoGpus));
    let ids: Vec<labsync_agent::proto::JobId> = (0..5)
        .map(|_| {
            n.submit(job("trap '' TERM; sleep 300 & echo up", 0, dir.path()))
                .unwrap()
        })
        .collect();
    let sids: Vec<u32> = ids
        .iter()
        .map(|id| match state_of(&n, id) {
            JobState::Running { sid, .. } => sid,
            s => panic!("{id} is {s:?}"),
        })
        .collect();
    // Every leader has exited (a zombie is no member) and left its sleep.
    wait_until("the leaders to exit", || {
        ids.iter()
            .all(|id| std::fs::read_to_string(n.log_path(id)).unwrap_or_default() == "up\n")
            && sids.iter().all(|&sid| session_members(sid).len() == 1)
    });
    let t = Instant::now();
    let mut ended = Vec::new();
    while ended.len() < ids.len() {
        ended.extend(n.reap().unwrap().into_iter().map(|(id, _)| id));
        assert!(t.elapsed() < Duration::from_secs(30), "ended: {ended:?}");
    }
    let took = t.elapsed();
    for sid in &sids {
        assert!(
            session_members(*sid).is_empty(),
            "left alive: {:?}",
            session_members(*sid)
        );
    }
    assert!(
        took < Duration::from_secs(7),
        "the leftovers of five jobs were killed one job after another: {took:?}"
    );
}

#[test]
fn no_gpus_node_refuses_gpu_jobs_and_runs_cpu_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), Arc::new(NoGpus));
    let err = n.submit(job("true", 1, dir.path())).unwrap_err();
    assert!(
        matches!(&err, NodeError::Refused(m) if m.contains("no GPUs") && m.contains("--gpus 0")),
        "{err}"
    );
    let id = n.submit(job("exit 7", 0, dir.path())).unwrap();
    wait_until("job end", || !n.reap().unwrap().is_empty());
    assert_eq!(
        state_of(&n, &id),
        JobState::Exited {
            code: Some(7),
            signal: None
        }
    );
}

#[test]
fn restart_adopts_a_live_job_and_fails_a_dead_one() {
    let dir = tempfile::tempdir().unwrap();
    let inv: Arc<dyn GpuInventory> = Arc::new(FakeGpus::new("2x11GiB", None).unwrap());
    let (live, dead) = {
        let n = node(dir.path(), inv.clone());
        let live = n.submit(job("sleep 300", 1, dir.path())).unwrap();
        let dead = n.submit(job("sleep 0.2", 1, dir.path())).unwrap();
        (live, dead)
    }; // the engine is gone without cleaning up, as after kill -9
    std::thread::sleep(Duration::from_millis(600)); // `dead` ends meanwhile
    let n = node(dir.path(), inv);
    assert!(
        matches!(state_of(&n, &live), JobState::Running { .. }),
        "adopted"
    );
    assert!(matches!(state_of(&n, &dead), JobState::Failed { .. }));
    let g = n.gpus().unwrap();
    assert_eq!(
        g.iter()
            .filter(|g| matches!(g.state, GpuState::Leased { .. }))
            .count(),
        1,
        "only the live job holds a GPU"
    );
    n.kill(&live, Duration::from_millis(100)).unwrap();
    assert!(n.gpus().unwrap().iter().all(|g| g.state == GpuState::Free));
}

/// Issue 9, point 8: a job accepted while the inventory did not answer, that
/// turns out never to fit, is failed with a clear message once the inventory
/// answers, and the job behind it runs instead of waiting forever.
#[test]
fn a_job_that_can_never_fit_fails_instead_of_blocking_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl.toml");
    let n = node(
        dir.path(),
        Arc::new(FakeGpus::new("2x11GiB", Some(ctl.clone())).unwrap()),
    );
    std::fs::write(&ctl, "hang = true\n").unwrap();
    let big = n.submit(job("true", 3, dir.path())).unwrap();
    let small = n.submit(job("exit 4", 1, dir.path())).unwrap();
    assert_eq!(state_of(&n, &big), JobState::Queued, "unknown: accepted");
    std::fs::write(&ctl, "").unwrap();
    wait_until("the small job to run", || {
        n.schedule().unwrap();
        n.reap().unwrap();
        matches!(state_of(&n, &small), JobState::Exited { .. })
    });
    assert_eq!(
        state_of(&n, &small),
        JobState::Exited {
            code: Some(4),
            signal: None
        }
    );
    match state_of(&n, &big) {
        JobState::Failed { reason } => {
            assert!(
                reason.contains("never fits") && reason.contains("3 GPU(s)"),
                "{reason}"
            )
        }
        s => panic!("{s:?}"),
    }
}

/// Issue 9, point 8: a kill racing the reaper never turns the job's exit
/// code into a guess. The job exits with 3 on SIGTERM; whoever records the
/// ending, it is `Exited(3)`.
#[test]
fn a_kill_racing_the_reaper_keeps_the_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let n = Arc::new(node(
        dir.path(),
        Arc::new(FakeGpus::new("1x11GiB", None).unwrap()),
    ));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reaper = {
        let (n, stop) = (n.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n.reap().unwrap();
            }
        })
    };
    for _ in 0..20 {
        let id = n
            .submit(job(
                "trap 'exit 3' TERM; while :; do sleep 0.01; done",
                1,
                dir.path(),
            ))
            .unwrap();
        let JobState::Running { sid, .. } = state_of(&n, &id) else {
            panic!("not running")
        };
        // The trap is set once bash runs its loop's first sleep.
        wait_until("the job's loop", || session_members(sid).len() >= 2);
        n.kill(&id, Duration::from_secs(5)).unwrap();
        wait_until("the ending to be recorded", || {
            !matches!(state_of(&n, &id), JobState::Running { .. })
        });
        assert_eq!(
            state_of(&n, &id),
            JobState::Exited {
                code: Some(3),
                signal: None
            }
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reaper.join().unwrap();
}

/// A job the coordinator placed holds exactly its GPUs from the dispatch
/// on, runs on them, and a placement made on a stale view is refused.
#[test]
fn a_placed_job_gets_exactly_its_gpus_and_a_stale_placement_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(
        dir.path(),
        Arc::new(FakeGpus::new("2x11GiB", None).unwrap()),
    );
    let cwd = dir.path().to_path_buf();
    let s = job("echo gpu=$CUDA_VISIBLE_DEVICES; sleep 30", 1, &cwd);
    n.reserve_placed("j7", &s, &[1]).unwrap();
    // Held from the dispatch on, before it is queued.
    let gpus = n.gpus().unwrap();
    assert!(
        matches!(&gpus[1].state, GpuState::Leased { job, .. } if job == "j7"),
        "{gpus:?}"
    );
    // The same dispatch sent again changes nothing.
    n.reserve_placed("j7", &s, &[1]).unwrap();
    // Another job placed on GPU 1 on a stale view: refused as stale.
    let other = job("true", 1, &cwd);
    assert!(matches!(
        n.reserve_placed("j8", &other, &[1]),
        Err(NodeError::Stale(_))
    ));
    // A dispatch whose GPU count does not match the job is refused outright.
    assert!(matches!(
        n.reserve_placed("j9", &other, &[]),
        Err(NodeError::Refused(_))
    ));
    assert!(matches!(
        n.reserve_placed("x", &other, &[0]),
        Err(NodeError::Refused(_))
    ));
    // Queued, it starts on its own GPU 1, not on the free GPU 0.
    assert!(n.enqueue("j7", s).unwrap());
    wait_until("j7 to run", || {
        matches!(state_of(&n, "j7"), JobState::Running { .. })
    });
    let j = n
        .jobs()
        .unwrap()
        .into_iter()
        .find(|j| j.id == "j7")
        .unwrap();
    assert_eq!(j.gpus, vec![1]);
    wait_until("its first line", || {
        std::fs::read_to_string(n.log_path("j7")).is_ok_and(|l| l.contains("gpu=1"))
    });
    n.kill("j7", Duration::from_millis(100)).unwrap();
}
