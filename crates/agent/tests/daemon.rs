//! labd's operations (the layer under the HTTP API) with a local store and
//! fake GPUs: listings, their cost, and the per-user queue cap.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use labsync_agent::proto::{JobView, SubmitRequest};
use labsync_agent::{
    Caller, Clock, ConnLimits, Daemon, DaemonConfig, FakeGpus, GpuInfo, GpuInventory,
    InventoryError, JobError, JobState, Secret,
};

/// Fake GPUs that count how often they are read.
struct Counting {
    inner: FakeGpus,
    reads: AtomicUsize,
}

impl GpuInventory for Counting {
    fn read(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn devices(&self) -> Result<Option<labsync_agent::GpuDevices>, labsync_agent::SetupError> {
        self.inner.devices()
    }
}

fn config(dir: &Path) -> DaemonConfig {
    DaemonConfig {
        node_name: "n1".parse().unwrap(),
        state_dir: dir.join("state"),
        store: format!("file://{}", dir.join("store").display()),
        store_options: vec![],
        cache_dir: dir.join("cache"),
        cache_max: 1 << 30,
        compression: Default::default(),
        trees_max: 1 << 30,
        foreign_limit: 256 << 20,
        inventory_deadline: Duration::from_secs(2),
        kill_grace: Duration::from_millis(200),
        idle_hold: Duration::from_secs(1800),
        outputs_every: Duration::from_secs(300),
        outputs_every_min: Duration::from_secs(60),
        outputs_retry: Duration::from_secs(10),
        work_keep: Duration::from_secs(86_400),
        history_keep: Duration::from_secs(90 * 86_400),
        log_max: 100 << 20,
        run_as_submitter: false,
        tokens: vec![("alice".into(), Secret::new("tok-alice-0123456789"))],
        tokens_file: None,
        admins: vec![],
        tick: Duration::from_millis(50),
        conn_limits: ConnLimits::default(),
        max_queued_per_user: 5,
        max_cpu_jobs_per_user: 100,
        job_limits: Default::default(),
        login_limits: Default::default(),
        log_keeper: None,
        trees_per_user: None,
        cluster: None,
        slurm_check: None,
        slurm_rerank: None,
        web: labsync_agent::WebConfig::default(),
        notify: labsync_agent::NotifyConfig::default(),
    }
}

fn alice() -> Caller {
    Caller {
        user: "alice".into(),
        admin: false,
    }
}

fn bash(script: &str, gpus: u32) -> SubmitRequest {
    SubmitRequest {
        argv: vec!["bash".into(), "-c".into(), script.into()],
        gpus,
        ..Default::default()
    }
}

/// Issue 9, point 12: a listing reads the GPUs once, however many jobs
/// wait for them (it used to read them once per queued job); a user's
/// queued jobs are capped; older jobs come a page at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_read_the_gpus_once_and_the_queue_is_capped_per_user() {
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(Counting {
        inner: FakeGpus::new("1x11GiB", None).unwrap(),
        reads: AtomicUsize::new(0),
    });
    let d = Daemon::open(config(dir.path()), inv.clone()).await.unwrap();
    let me = alice();
    // Three that end at once, for the history.
    let mut ended = Vec::new();
    for _ in 0..3 {
        ended.push(d.submit(&me, bash("true", 0)).await.unwrap().id);
    }
    let runner = d.submit(&me, bash("sleep 300", 1)).await.unwrap().id;
    let waiting = async {
        loop {
            d.tick().await;
            let jobs = d.jobs().await.unwrap();
            let done = ended
                .iter()
                .all(|id| jobs.iter().any(|j| &j.id == id && j.ended()));
            let running = jobs
                .iter()
                .any(|j| j.id == runner && matches!(j.state, JobState::Running { .. }));
            if done && running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("jobs to start and end");
    let mut queued = Vec::new();
    for _ in 0..5 {
        queued.push(d.submit(&me, bash("true", 1)).await.unwrap().id);
    }
    let over = d.submit(&me, bash("true", 1)).await.unwrap_err();
    assert!(
        matches!(&over, JobError::Busy(m) if m.contains("max_queued_per_user")),
        "{over}"
    );
    // Wait until all five are queued behind the running job (prepared).
    tokio::time::timeout(Duration::from_secs(30), async {
        while d
            .jobs()
            .await
            .unwrap()
            .iter()
            .filter(|j| j.why.as_deref().is_some_and(|w| w.starts_with("waits for")))
            .count()
            < 5
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the five to queue");

    let before = inv.reads.load(Ordering::SeqCst);
    let jobs = d.jobs().await.unwrap();
    assert_eq!(
        inv.reads.load(Ordering::SeqCst) - before,
        1,
        "one GPU reading for a listing of {} jobs",
        jobs.len()
    );
    assert!(jobs.iter().filter(|j| j.why.is_some()).count() >= 5);

    let page = d.history(None, 2).await.unwrap();
    let ids: Vec<&str> = page.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, [ended[2].as_str(), ended[1].as_str()], "newest first");
    let n: u64 = ended[1][1..].parse().unwrap();
    let next = d.history(Some(n), 2).await.unwrap();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].id, ended[0]);

    d.kill(&me, &runner).await.unwrap();
    for id in &queued {
        let _ = d.kill(&me, id).await;
    }
}

/// A client that goes away while its job is being recorded (its request's
/// future dropped half way) does not leave the job reserved and never
/// prepared: it is prepared and runs all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_dropped_half_way_still_prepares_its_job() {
    use std::future::Future;
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let d = Daemon::open(config(dir.path()), inv).await.unwrap();
    let me = alice();
    let mut submit = Box::pin(d.submit(&me, bash("true", 1)));
    // Polled until the job is being recorded (off the runtime), then
    // dropped without being polled again: what a closed connection does.
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let id = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            assert!(
                submit.as_mut().poll(&mut cx).is_pending(),
                "the submission ended before the test could drop it"
            );
            for _ in 0..200 {
                if let Some(j) = d.jobs().await.unwrap().into_iter().next() {
                    return j.id;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    })
    .await
    .expect("the job to be recorded");
    drop(submit);
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            d.tick().await;
            let j = d.jobs().await.unwrap().into_iter().find(|j| j.id == id);
            if j.is_some_and(|j| j.ended()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the job dropped half way to be prepared, run and ended");
    let view = d.job(&id).await.unwrap();
    assert!(
        matches!(view.state, JobState::Exited { code: Some(0), .. }),
        "{view:?}"
    );
}

/// Issue 13: one labd has no tiers; a job asking for one is refused at
/// submit, saying so, instead of being taken first come, first served as
/// if the tier had been granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_asked_of_a_single_labd_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let d = Daemon::open(config(dir.path()), inv).await.unwrap();
    let mut req = bash("true", 0);
    req.priority = Some("deadline".into());
    let err = d.submit(&alice(), req).await.unwrap_err();
    assert!(matches!(err, JobError::Invalid(_)), "{err}");
    assert!(
        err.to_string()
            .contains("--priority deadline: tiers order a cluster's queue"),
        "{err}"
    );
    assert!(d.jobs().await.unwrap().is_empty());
}

/// Issue 13, as an attacker: what only the coordinator may set when it
/// requeues a preempted job (restarts, resume_from) is refused from a
/// submission; a "hold" that runs a command of its own is refused; and a
/// LABRUN_RESTARTS in the submitter's environment does not reach the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_fields_and_fake_holds_cannot_be_submitted() {
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let d = Daemon::open(config(dir.path()), inv).await.unwrap();
    let refused = |req: SubmitRequest, why: &'static str| {
        let d = d.clone();
        async move {
            let err = d.submit(&alice(), req).await.unwrap_err();
            assert!(matches!(err, JobError::Invalid(_)), "{err}");
            assert!(err.to_string().contains(why), "{err}");
        }
    };
    let mut r = bash("true", 0);
    r.restarts = 3;
    refused(r, "set by the coordinator").await;
    let mut r = bash("true", 0);
    r.resume_from = Some("runs/j1@v1".into());
    refused(r, "set by the coordinator").await;
    let mut r = bash("touch /tmp/pwned", 0);
    r.hold_s = Some(60);
    refused(r, "a hold runs no command of its own").await;
    let mut r = SubmitRequest {
        argv: vec!["sleep".into(), "999999999".into()],
        hold_s: Some(999_999_999),
        ..Default::default()
    };
    r.gpus = 0;
    refused(r, "hold GPUs for 1 s to 7 days").await;
    assert!(d.jobs().await.unwrap().is_empty());
    // The submitter's environment cannot fake a restart.
    let mut r = bash(
        "test \"$LABRUN_RESTARTS\" = 0 && test -z \"$LABRUN_RESUME_FROM\"",
        0,
    );
    r.env = vec![
        ("LABRUN_RESTARTS".into(), "7".into()),
        ("LABRUN_RESUME_FROM".into(), "runs/j9@v1".into()),
    ];
    let id = d.submit(&alice(), r).await.unwrap().id;
    let ended = async {
        loop {
            d.tick().await;
            let j = d.job(&id).await.unwrap();
            if j.ended() {
                break j;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let j = tokio::time::timeout(Duration::from_secs(30), ended)
        .await
        .expect("the job to end");
    assert!(
        matches!(j.state, JobState::Exited { code: Some(0), .. }),
        "{j:?}"
    );
}

/// labd as root refuses a store folder other users can write: any of them
/// could plant a symlink there and have labd write, as root, through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_labd_refuses_a_local_store_others_can_write() {
    use std::os::unix::fs::PermissionsExt;
    if labsync_agent::euid() != 0 {
        eprintln!("not root: the check is root's");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir_all(store.join("packs")).unwrap();
    std::fs::set_permissions(store.join("packs"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let e = match Daemon::open(config(dir.path()), inv.clone()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("labd opened a store others can write"),
    };
    assert!(
        e.contains("packs is writable by others (mode 777)") && e.contains("s3://"),
        "{e}"
    );
    // Made root's alone, it opens.
    std::fs::set_permissions(store.join("packs"), std::fs::Permissions::from_mode(0o755)).unwrap();
    Daemon::open(config(dir.path()), inv).await.unwrap();
}

/// Two versions of one dataset, 700 KB each, pushed to the daemon's store.
async fn two_versions(dir: &Path) -> [labsync_agent::proto::TreeRef; 2] {
    use labsync_store::{push, NoProgress, PushOptions, Remote, Repo};
    let repo = Repo::open(Remote::local(&dir.join("store")).unwrap(), None)
        .await
        .unwrap();
    let mut refs = Vec::new();
    for byte in [1u8, 2] {
        let src = dir.join(format!("div2k-{byte}"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("0001.png"), vec![byte; 700_000]).unwrap();
        let opts = PushOptions::new("div2k");
        let pushed = push(&repo, &src, &opts, Arc::new(NoProgress))
            .await
            .unwrap();
        refs.push(labsync_agent::proto::TreeRef {
            label: pushed.record.label(),
            snapshot: pushed.record.snapshot,
        });
    }
    refs.try_into().unwrap()
}

/// Issue 40, point 5, under Slurm: a stage's trees are charged to its
/// user as a job's are. With a share of 1 MB, alice's stage on v1 holds
/// 700 KB; her stage on v2 is refused before anything is pulled, another
/// on v1 costs nothing more, bob's on v2 is his own; once her v1 stages
/// are released, v2 fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_are_charged_to_their_user_against_the_share() {
    use labsync_agent::proto::{DataRef, StageAsk, StageDone, StageOrder};
    let dir = tempfile::tempdir().unwrap();
    let [v1, v2] = two_versions(dir.path()).await;
    let mut cfg = config(dir.path());
    cfg.trees_per_user = Some(1_000_000);
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let d = Daemon::open(cfg, inv).await.unwrap();
    let order = |user: &str, job: &str, tree: &labsync_agent::proto::TreeRef| StageOrder {
        user: user.into(),
        ask: StageAsk {
            node: "n1".parse().unwrap(),
            job: job.into(),
            code: None,
            data: vec![DataRef {
                env: "LABRUN_DATA_DIV2K".into(),
                tree: tree.clone(),
            }],
            outputs: None,
        },
    };
    let first = d.stage(order("alice", "101", &v1)).await.unwrap();
    match d.stage(order("alice", "102", &v2)).await {
        Err(JobError::Conflict(m)) => assert!(
            m.contains("alice's jobs and stages on n1 hold 683.59 KiB")
                && m.contains("past alice's share of 976.56 KiB (trees_per_user)"),
            "{m}"
        ),
        other => panic!("alice's stage on v2: {other:?}"),
    }
    let again = d.stage(order("alice", "103", &v1)).await.unwrap();
    d.stage(order("bob", "104", &v2)).await.unwrap();
    for s in [first, again] {
        let done = StageDone {
            node: "n1".parse().unwrap(),
            stage: s.stage,
            user: "alice".into(),
        };
        d.stage_done(done).await.unwrap();
    }
    d.stage(order("alice", "105", &v2)).await.unwrap();
}

/// The followers of a fresh job see its first line as it comes, with no
/// ticker to wake them: one task per job looks at its log for them all
/// (each follower reading it every 20 ms itself cost labd three times its
/// idle CPU with 50 of them, `bench/labd-load.sh`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_of_a_fresh_job_see_its_first_line_without_a_tick() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::open(
        config(dir.path()),
        Arc::new(FakeGpus::new("1x11GiB", None).unwrap()),
    )
    .await
    .unwrap();
    let me = alice();
    let id = (d
        .submit(&me, bash("sleep 0.5; echo first; sleep 30", 0))
        .await)
        .unwrap()
        .id;
    let t = std::time::Instant::now();
    let followers = (0..20).map(|_| {
        let (d, me, id) = (d.clone(), me.clone(), id.clone());
        tokio::spawn(async move {
            let mut offset = 0;
            let mut got = Vec::new();
            while !String::from_utf8_lossy(&got).contains("first") {
                let r = d
                    .log(&me, &id, offset, Duration::from_secs(20))
                    .await
                    .unwrap();
                offset = r.next;
                got.extend(r.bytes);
            }
        })
    });
    let all = futures::future::join_all(followers);
    tokio::time::timeout(Duration::from_secs(10), all)
        .await
        .expect("each follower sees the first line before its 20 s wait ends");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    d.kill(&me, &id).await.unwrap();
}

/// Issue 42, point 7: every route of the table (`proto::routes`) is served
/// where it says, with its method: without a token each answers 200
/// (health) or 401, never the router's 404 or 405; a path the table does
/// not hold is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_table_is_served_with_its_method() {
    use labsync_agent::proto::{routes, Verb};
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let d = Daemon::open(config(dir.path()), inv).await.unwrap();
    let sock = dir.path().join("labd.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(labsync_agent::serve(
        d,
        labsync_agent::Listener::Unix(listener),
        async move {
            let _ = stopped.await;
        },
    ));
    let status = |verb: &str, path: &str| {
        let sock = sock.clone();
        let head = format!(
            "{verb} {path} HTTP/1.1\r\nHost: labd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        tokio::task::spawn_blocking(move || {
            let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            answer.split_whitespace().nth(1).unwrap_or("").to_string()
        })
    };
    assert!(routes::ALL.len() >= 27, "{}", routes::ALL.len());
    for (verb, path) in routes::ALL {
        let verb = match verb {
            Verb::Get => "GET",
            Verb::Post => "POST",
        };
        let path = path.replace("{id}", "j1");
        let got = status(verb, &path).await.unwrap();
        assert!(got == "200" || got == "401", "{verb} {path}: {got}");
    }
    assert_eq!(status("GET", "/v1/nope").await.unwrap(), "404");
    assert_eq!(status("DELETE", "/v1/jobs").await.unwrap(), "405");
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}

/// Ticks `d` until `id` is in a state `done` accepts (30 s at most).
async fn tick_until(d: &Arc<Daemon>, id: &str, what: &str, done: impl Fn(&JobView) -> bool) {
    let waiting = async {
        loop {
            d.tick().await;
            if done(&d.job(id).await.unwrap()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .unwrap_or_else(|_| panic!("job {id} to be {what}"));
}

fn running(j: &JobView) -> bool {
    matches!(j.state, JobState::Running { .. })
}

/// Issue 42, point 4, on a clock that moves only when the test moves it:
/// a hold whose GPU computes is kept through 16 readings over 8 s, four
/// times labd's idle time, none of them waited; once idle for that time
/// it is given back on the next reading, saying why. (The cluster test of
/// holds slept 8 s for the first half.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_hold_outlives_its_idle_time_on_a_paused_clock() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.toml");
    std::fs::write(&control, "utilization = [{ gpu = 0, percent = 60 }]\n").unwrap();
    let inv = Arc::new(FakeGpus::new("1x11GiB", Some(control.clone())).unwrap());
    let mut cfg = config(dir.path());
    cfg.idle_hold = Duration::from_secs(2);
    let (clock, hand) = Clock::manual(labsync_agent::unix_now());
    let d = Daemon::open_with_clock(cfg, inv, clock).await.unwrap();
    let hold = SubmitRequest {
        argv: vec!["sleep".into(), "3600".into()],
        gpus: 1,
        hold_s: Some(3600),
        ..Default::default()
    };
    let id = d.submit(&alice(), hold).await.unwrap().id;
    tick_until(&d, &id, "running", running).await;
    // Busy: labd reads the GPUs every 500 ms of its clock.
    for _ in 0..16 {
        hand.advance(Duration::from_millis(500));
        d.tick().await;
    }
    let j = d.job(&id).await.unwrap();
    assert!(running(&j) && j.why.is_none(), "{j:?}");
    // Idle: noticed at the next reading, given back 2 s of the clock later.
    std::fs::write(&control, "").unwrap();
    hand.advance(Duration::from_millis(500));
    d.tick().await;
    let j = d.job(&id).await.unwrap();
    assert!(running(&j) && j.why.is_none(), "idle for 0 s: {j:?}");
    hand.advance(Duration::from_millis(1_500));
    d.tick().await;
    assert!(d.job(&id).await.unwrap().why.is_none(), "idle for 1.5 s");
    hand.advance(Duration::from_millis(500));
    d.tick().await;
    let why = d.job(&id).await.unwrap().why.unwrap_or_default();
    assert!(
        why.contains("released: 1 GPU(s) on n1 held by alice showed no utilisation for"),
        "given back at 2 s of idle, by the clock: {why}"
    );
    tick_until(&d, &id, "ended", |j| j.ended()).await;
}

/// The shared trees holding `0001.png` under `dir`'s cache, with its first
/// byte (the version `two_versions` wrote).
fn data_trees(dir: &Path) -> Vec<u8> {
    let Ok(rd) = std::fs::read_dir(dir.join("cache/trees-v2")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| std::fs::read(e.path().join("0001.png")).ok())
        .map(|b| b[0])
        .collect()
}

/// Waits (30 s at most) until the shared trees under `dir` are `want`: a
/// housekeeping pass runs in a task of its own.
async fn trees_become(dir: &Path, want: &[u8], what: &str) {
    let pass = async {
        while data_trees(dir) != want {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), pass)
        .await
        .unwrap_or_else(|_| panic!("{what}: {:?}", data_trees(dir)));
}

/// Issue 42, point 4, on a clock that moves only when the test moves it:
/// over the trees' cap, a housekeeping pass (due every 5 s of labd's
/// clock, however often it ticks) removes the tree no job uses and keeps
/// the one a running job uses; once that job ends, the next pass removes
/// it too. (The end-to-end test slept 6 s for a pass to have run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_in_use_outlives_an_eviction_pass_on_a_paused_clock() {
    use labsync_agent::proto::DataRef;
    let dir = tempfile::tempdir().unwrap();
    let [v1, v2] = two_versions(dir.path()).await;
    let mut cfg = config(dir.path());
    cfg.trees_max = 1_000;
    let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
    let (clock, hand) = Clock::manual(labsync_agent::unix_now());
    let d = Daemon::open_with_clock(cfg, inv, clock).await.unwrap();
    let release = dir.path().join("release");
    let on = |tree: &labsync_agent::proto::TreeRef, script: String| {
        let mut r = bash(&script, 0);
        r.data = vec![DataRef {
            env: "LABRUN_DATA_DIV2K".into(),
            tree: tree.clone(),
        }];
        r
    };
    let used = d
        .submit(
            &alice(),
            on(&v1, "test -s $LABRUN_DATA_DIV2K/0001.png".into()),
        )
        .await
        .unwrap()
        .id;
    tick_until(&d, &used, "ended", |j| j.ended()).await;
    assert!(
        matches!(
            d.job(&used).await.unwrap().state,
            JobState::Exited { code: Some(0), .. }
        ),
        "the job read its data"
    );
    let keep = format!(
        "while [ ! -e {} ]; do sleep 0.05; done; test -s $LABRUN_DATA_DIV2K/0001.png",
        release.display()
    );
    let using = d.submit(&alice(), on(&v2, keep)).await.unwrap().id;
    tick_until(&d, &using, "running", running).await;
    let mut trees = data_trees(dir.path());
    trees.sort();
    assert_eq!(trees, [1, 2], "no pass was due yet, however many ticks");
    hand.advance(Duration::from_secs(5));
    d.tick().await;
    trees_become(
        dir.path(),
        &[2],
        "the pass to remove the unused tree and keep the one in use",
    )
    .await;
    std::fs::write(&release, "").unwrap();
    tick_until(&d, &using, "ended", |j| j.ended()).await;
    assert!(
        matches!(
            d.job(&using).await.unwrap().state,
            JobState::Exited { code: Some(0), .. }
        ),
        "its tree was there to the end"
    );
    hand.advance(Duration::from_secs(5));
    d.tick().await;
    trees_become(
        dir.path(),
        &[],
        "the next pass to remove the tree no job uses now",
    )
    .await;
}

/// One HTTP/1.1 exchange over labd's socket: the status, the head, the body.
fn exchange(sock: &Path, request: &str) -> (String, String, String) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("").to_string();
    (status, head.to_ascii_lowercase(), body.to_string())
}

fn get(path: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: labd\r\n{extra}Connection: close\r\n\r\n")
}

/// Issue 44: the web page's access. With tokens (the default) a page
/// asks for a login, which sets an HttpOnly, SameSite=Strict cookie; a
/// wrong token is refused; pages forbid inline scripts; a job's log is
/// its user's (and admins'); nothing is writable. `lan` opens the pages
/// read-only, `logs = "lab"` opens the logs, `off` serves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_page_is_behind_tokens_read_only_and_logs_are_their_users() {
    use labsync_agent::{Access, LogsTo, WebConfig};
    let cases = [
        (Access::Token, LogsTo::Owner),
        (Access::Lan, LogsTo::Owner),
        (Access::Lan, LogsTo::Lab),
        (Access::Off, LogsTo::Owner),
    ];
    for (access, logs) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.tokens
            .push(("bob".into(), Secret::new("tok-bob-0123456789ab")));
        cfg.web = WebConfig {
            access,
            logs,
            secure_cookie: false,
        };
        let inv = Arc::new(FakeGpus::new("1x11GiB", None).unwrap());
        let d = Daemon::open(cfg, inv).await.unwrap();
        let id = d
            .submit(
                &alice(),
                bash("printf '%s-%s <script>\\n' secret output; sleep 30", 0),
            )
            .await
            .unwrap()
            .id;
        tick_until(&d, id.as_str(), "running", running).await;
        let sock = dir.path().join("labd.sock");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(labsync_agent::serve(
            d.clone(),
            labsync_agent::Listener::Unix(listener),
            async move {
                let _ = stopped.await;
            },
        ));
        let s = sock.clone();
        let job_page = format!("/job/{id}?live=1");
        let checks = tokio::task::spawn_blocking(move || {
            let ask = |r: &str| exchange(&s, r);
            let hex: String = "tok-alice-0123456789".bytes().map(|b| format!("{b:02x}")).collect();
            let alice = &format!("Cookie: labsync_web={hex}\r\n");
            let bob = "Authorization: Bearer tok-bob-0123456789ab\r\n";
            // Never writable: the page's routes take no POST but the login's.
            let (st, _, _) = ask("POST / HTTP/1.1\r\nHost: labd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            assert_eq!(st, "405", "{access:?}");
            match access {
                Access::Off => {
                    for path in ["/", "/login", "/metrics", &job_page] {
                        assert_eq!(ask(&get(path, alice)).0, "404", "{path}");
                    }
                    return;
                }
                Access::Token => {
                    let (st, head, _) = ask(&get("/", ""));
                    assert_eq!(st, "303");
                    assert!(head.contains("location: /login"), "{head}");
                    assert_eq!(ask(&get("/?live=1", "")).0, "401");
                    assert_eq!(ask(&get("/metrics", "")).0, "401");
                    assert_eq!(ask(&get(&job_page, "")).0, "401");
                    assert_eq!(ask(&get(&job_page.replace("?live=1", ""), "")).0, "303");
                    // A wrong token, and none.
                    for token in ["tok-alice-0123456789x", ""] {
                        let body = format!("token={token}");
                        let (st, head, _) = ask(&format!(
                            "POST /login HTTP/1.1\r\nHost: labd\r\nContent-Type: application/x-www-form-urlencoded\r\n\
                             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        ));
                        assert_eq!(st, "401", "{token}");
                        assert!(!head.contains("set-cookie"), "{head}");
                    }
                    let body = "token=tok-alice-0123456789";
                    let (st, head, _) = ask(&format!(
                        "POST /login HTTP/1.1\r\nHost: labd\r\nContent-Type: application/x-www-form-urlencoded\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    ));
                    assert_eq!(st, "303");
                    assert!(
                        head.contains(&format!("set-cookie: labsync_web={hex}; path=/; httponly; samesite=strict")),
                        "{head}"
                    );
                }
                Access::Lan => {
                    assert_eq!(ask(&get("/", "")).0, "200");
                    assert_eq!(ask(&get("/metrics", "")).0, "200");
                    let (st, _, body) = ask(&get(&job_page, ""));
                    assert_eq!(st, "200");
                    assert_eq!(body.contains("secret-output"), logs == LogsTo::Lab, "{body}");
                }
            }
            let (st, head, body) = ask(&get("/", alice));
            assert_eq!(st, "200", "{body}");
            assert!(head.contains("content-security-policy: default-src 'none'; script-src 'self'"), "{head}");
            assert!(body.contains("data-state=\"free\"") || body.contains("no GPUs"), "{body}");
            // The owner reads the log, its markup as text; bob does not
            // (unless the lab says so).
            let (_, _, mine) = ask(&get(&job_page, alice));
            assert!(mine.contains("secret-output &lt;script&gt;"), "{mine}");
            assert!(!mine.contains("<script>"), "{mine}");
            let (st, _, theirs) = ask(&get(&job_page, bob));
            assert_eq!(st, "200");
            assert_eq!(theirs.contains("secret-output"), logs == LogsTo::Lab, "{theirs}");
            if logs == LogsTo::Owner {
                assert!(theirs.contains("only its user and admins"), "{theirs}");
            }
            let (st, head, _) = ask(&get("/ui/app.js", ""));
            assert_eq!(st, "200");
            assert!(head.contains("text/javascript"), "{head}");
        })
        .await;
        let _ = stop.send(());
        d.kill(&alice(), id.as_str()).await.unwrap();
        served.await.unwrap().unwrap();
        checks.unwrap();
    }
}
