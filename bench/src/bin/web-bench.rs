//! The web page and `/metrics` at a lab's largest size (issue 44): a
//! coordinator that sees 50 nodes × 8 GPUs and 1,000 queued jobs.
//!
//! ```text
//! web-bench [--bin DIR] [--nodes N] [--gpus G] [--jobs J] [--pages P] [--seconds S] [--out PATH]
//! ```
//!
//! One real labd coordinates (8 fake GPUs, all held by a foreign process so
//! nothing is placed on it); this program plays the other N-1 nodes, each
//! heartbeating every second with a signed request as a labd does: G GPUs,
//! mostly leased (with a running job each), some foreign, a few unknown.
//! It then submits J one-GPU jobs as 10 users over the API, which wait
//! (every GPU is taken). Measured, each in the same run:
//! - `/metrics`: the time of a scrape (fresh: 600 ms apart, past the page's
//!   500 ms board cache), over 20 scrapes;
//! - the page's first render in a real headless Chromium: navigation start
//!   to the load event (the page is whole then: labd renders it), over 5
//!   loads of a fresh window;
//! - labd's CPU (utime + stime from /proc) over S seconds with the
//!   heartbeats alone, then with P windows open on the page, each fetching
//!   its live part every second (`app.js`).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use labsync_agent::cluster::{ClusterKey, Route, TO_COORDINATOR};
use labsync_agent::Secret;
use labsync_bench::browser::Browser;
use serde_json::{json, Value};

const SECRET: &str = "web-bench-cluster-secret-0123456789abcdef";
const USERS: usize = 10;

struct Args {
    bin: PathBuf,
    nodes: usize,
    gpus: usize,
    jobs: usize,
    pages: usize,
    seconds: u64,
    out: PathBuf,
}

fn parse_args() -> Args {
    let mut a = Args {
        bin: PathBuf::from("target/release"),
        nodes: 50,
        gpus: 8,
        jobs: 1000,
        pages: 20,
        seconds: 30,
        out: PathBuf::from("bench/results/web.md"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--bin" => a.bin = v().into(),
            "--nodes" => a.nodes = v().parse().expect("--nodes N"),
            "--gpus" => a.gpus = v().parse().expect("--gpus G"),
            "--jobs" => a.jobs = v().parse().expect("--jobs J"),
            "--pages" => a.pages = v().parse().expect("--pages P"),
            "--seconds" => a.seconds = v().parse().expect("--seconds S"),
            "--out" => a.out = v().into(),
            _ => panic!("unknown argument {k} (see the file's doc)"),
        }
    }
    a
}

/// One HTTP/1.1 exchange on loopback: status and body.
fn http(port: u16, head: &str, body: &[u8]) -> (u16, Vec<u8>) {
    // Refused while labd starts: status 0.
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, Vec::new());
    };
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(raw.len());
    let status = String::from_utf8_lossy(&raw[9..12]).parse().unwrap_or(0);
    (status, raw[(split + 4).min(raw.len())..].to_vec())
}

fn get(port: u16, path: &str) -> (u16, Vec<u8>) {
    http(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: labd\r\nConnection: close\r\n\r\n"),
        b"",
    )
}

/// A heartbeat of fake node `n` with `gpus` GPUs: most leased, every
/// fifth foreign, every node's last unknown on one node in ten.
fn heartbeat(n: usize, gpus: usize, seq: u64, now: u64) -> Value {
    let name = format!("gpu{n:02}");
    let mut states = Vec::new();
    let mut jobs = Vec::new();
    for g in 0..gpus {
        let info = json!({
            "index": g, "uuid": format!("GPU-{n}-{g}"), "name": "NVIDIA A100 80GB",
            "memory_total": 85_899_345_920u64, "memory_used": 40_000_000_000u64 + g as u64,
            "utilization": 90, "temperature": 60, "processes": []
        });
        let state = if n % 10 == 3 && g + 1 == gpus {
            json!({"state": "unknown", "reason": "NVML did not answer within 2000 ms"})
        } else if g % 5 == 4 {
            json!({"state": "foreign", "processes": [{"pid": 4000 + g, "user": "zombie", "used_bytes": 3_000_000_000u64}]})
        } else {
            let id = format!("j{}", 100_000 + n * 100 + g);
            jobs.push(json!({
                "id": id, "node": name, "user": format!("user{}", g % USERS),
                "argv": [], "gpus_wanted": 1, "gpus": [g],
                "state": {"state": "running", "sid": 1000 + g},
                "why": null, "submitted_at": now - 7200, "started_at": now - 7000,
                "ended_at": null,
                "meta": {"code": "code/u/sr@v3", "data": ["div2k@v1"], "work": null, "outputs": null,
                         "outputs_every_s": 300, "outputs_saved": null, "outputs_error": null,
                         "outputs_pending": false, "preparing": null}
            }));
            json!({"state": "leased", "job": id})
        };
        states.push(json!({"index": g, "info": info, "state": state}));
    }
    json!({
        "node": name, "addr": "http://127.0.0.1:1", "instance": format!("bench-{n}"), "seq": seq,
        "gpus": states, "jobs": jobs,
        "cache": {"used_bytes": 300_000_000_000u64, "max_bytes": 500_000_000_000u64, "trees": [],
                  "fetched": {"from_peers": 0, "from_store": 0, "corrupt_from_peers": 0, "failed_from_peers": 0}},
        "inventory": {"full": true, "base": 0, "added": [], "removed": [], "snapshots": []},
        "gpu_confinement": "", "version": "0.2.0", "protocol": 2
    })
}

fn beat(port: u16, key: &ClusterKey, hb: &Value) -> (u16, String) {
    let body = serde_json::to_vec(hb).unwrap();
    let node = hb["node"].as_str().unwrap();
    let route = Route {
        method: "POST",
        path: "/v1/cluster/heartbeat",
        from: node,
        to: TO_COORDINATOR,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut head = format!(
        "POST /v1/cluster/heartbeat HTTP/1.1\r\nHost: labd\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\
         x-labsync-protocol: 2\r\nx-labsync-version: 0.2.0\r\n",
        body.len()
    );
    for (name, value) in key.sign(&route, now, &body) {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let (status, answer) = http(port, &head, &body);
    (status, String::from_utf8_lossy(&answer).into_owned())
}

/// How many requests labd answered on `route` and their total time, from
/// its own `/metrics`.
fn route_time(port: u16, route: &str) -> (f64, f64) {
    let (_, body) = get(port, "/metrics");
    let text = String::from_utf8_lossy(&body);
    let value = |name: &str| {
        let key = format!("labsync_request_duration_seconds_{name}{{route=\"{route}\"}} ");
        (text.lines())
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("count"), value("sum"))
}

/// labd's CPU time so far (utime + stime), seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let a = parse_args();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(d.join("cluster.secret"), format!("{SECRET}\n")).unwrap();
    std::fs::write(
        d.join("control.toml"),
        format!(
            "foreign = [{}]\n",
            (0..8)
                .map(|g| format!("{{ gpu = {g}, pid = 4242, mib = 3000 }}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
    .unwrap();
    let tokens: String = (0..USERS)
        .map(|u| format!("user{u} = \"tok-web-bench-user{u:02}-0123456789\"\n"))
        .collect();
    let config = d.join("labd.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"gpu00\"\nlisten = \"127.0.0.1:{port}\"\nstate_dir = \"{s}\"\n\
             store = \"file://{st}\"\ncache_dir = \"{c}\"\nfake_gpus = \"8x80GiB\"\n\
             fake_gpus_control = \"{ctl}\"\nrun_as = \"labd\"\n\
             max_queued_per_user = 1000\n[tokens]\n{tokens}\
             [cluster]\ncoordinator = \"http://127.0.0.1:{port}\"\ncoordinate = true\n\
             secret_file = \"{sec}\"\nheartbeat_ms = 1000\ndown_after_ms = 10000\n\
             insecure_cleartext = true\n[web]\naccess = \"lan\"\n",
            s = d.join("state").display(),
            st = d.join("store").display(),
            c = d.join("cache").display(),
            ctl = d.join("control.toml").display(),
            sec = d.join("cluster.secret").display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::set_permissions(
        d.join("cluster.secret"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let mut labd: Child = Command::new(a.bin.join("labd"))
        .args(["--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.join("labd.log")).unwrap())
        .spawn()
        .expect("labd");
    let pid = labd.id();
    let started = Instant::now();
    while get(port, "/v1/health").0 != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(30) && labd.try_wait().unwrap().is_none(),
            "labd did not start: {}",
            std::fs::read_to_string(d.join("labd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The other nodes, heartbeating every second until the end.
    let key = ClusterKey::new(&Secret::new(SECRET)).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beats = {
        let (stop, nodes, gpus) = (stop.clone(), a.nodes, a.gpus);
        std::thread::spawn(move || {
            let mut seq = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                seq += 1;
                let t = Instant::now();
                let now = labsync_agent::unix_now();
                for n in 1..nodes {
                    let (s, why) = beat(port, &key, &heartbeat(n, gpus, seq, now));
                    assert_eq!(s, 200, "heartbeat of gpu{n:02}: {why}");
                }
                std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
            }
        })
    };
    std::thread::sleep(Duration::from_secs(3));

    // The queue: J one-GPU jobs that wait (every GPU is taken).
    let t = Instant::now();
    for i in 0..a.jobs {
        let u = i % USERS;
        let body = serde_json::to_vec(&json!({
            "argv": ["python3", "train.py", "--seed", i.to_string()], "env": [],
            "code": null, "data": [], "gpus": 1, "gpu_mem": 0, "outputs": null, "outputs_every_s": null
        }))
        .unwrap();
        let head = format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: labd\r\nConnection: close\r\n\
             Authorization: Bearer tok-web-bench-user{u:02}-0123456789\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let (s, b) = http(port, &head, &body);
        assert_eq!(s, 201, "submission {i}: {}", String::from_utf8_lossy(&b));
    }
    let submit_s = t.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(2));

    // /metrics, fresh each time.
    let mut scrapes = Vec::new();
    let mut metrics_bytes = 0;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(600));
        let t = Instant::now();
        let (s, body) = get(port, "/metrics");
        scrapes.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(s, 200);
        metrics_bytes = body.len();
    }
    let (_, page) = get(port, "/");
    let page_bytes = page.len();
    let page_text = String::from_utf8_lossy(&page);
    let cells = page_text.matches("class=\"gpu ").count();
    let queued = page_text.matches("<tr data-job=").count();

    // CPU with the heartbeats alone.
    let cpu = |secs: u64| {
        let (c0, t0) = (cpu_secs(pid), Instant::now());
        std::thread::sleep(Duration::from_secs(secs));
        (cpu_secs(pid) - c0) / t0.elapsed().as_secs_f64() * 100.0
    };
    let idle_cpu = cpu(a.seconds);

    // The page in Chromium: first render, then P windows left open.
    let browser = Browser::start().expect("chromium and chromedriver");
    let url = format!("http://127.0.0.1:{port}/");
    let mut renders = Vec::new();
    for _ in 0..5 {
        browser.new_window();
        browser.open(&url);
        // Read once the load event has ended (WebDriver returns at
        // readyState complete, a moment before loadEventEnd is set).
        let script = "var n = performance.getEntriesByType('navigation')[0]; \
                      return n.loadEventEnd > 0 ? n.loadEventEnd - n.startTime : -1";
        let t = Instant::now();
        let ms = loop {
            let v = browser.eval(script).as_f64().unwrap();
            if v >= 0.0 || t.elapsed() > Duration::from_secs(10) {
                break v;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        renders.push(ms);
    }
    let shown = browser.eval("return document.querySelectorAll('td.gpu').length");
    let mut opened = 5;
    while opened < a.pages {
        browser.new_window();
        browser.open(&url);
        opened += 1;
    }
    std::thread::sleep(Duration::from_secs(5));
    let before = route_time(port, "/");
    let pages_cpu = cpu(a.seconds);
    let after = route_time(port, "/");
    let (polls_n, polls_s) = (after.0 - before.0, after.1 - before.1);
    let polls = browser.eval("return document.body.getAttribute('data-updated') !== null");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    beats.join().unwrap();
    drop(browser);
    let _ = labd.kill();
    let _ = labd.wait();

    let render = median(&mut renders.clone());
    let scrape = median(&mut scrapes.clone());
    let scrape_max = scrapes.iter().cloned().fold(0.0, f64::max);
    let machine = format!(
        "{} CPU(s), {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let report = format!(
        "# The web page and /metrics at a lab's largest size (web-bench)\n\n\
         `target/release/web-bench` on {machine} (load average at the end). One real \
         labd coordinates; the bench plays {n1} more nodes heartbeating every second with \
         {g} GPUs each ({cells} GPU cells on the page), and submitted {jobs} one-GPU jobs as \
         {USERS} users in {submit_s:.1} s, which wait ({queued} queue rows on the page).\n\n\
         | measure | figure | target |\n|---|---|---|\n\
         | page's first render in headless Chromium (navigation start to load event; median of 5, each a fresh window) | {render:.0} ms (all: {renders:?}) | < 1 s |\n\
         | page size | {kb} KiB, {shown} GPU cells in the DOM | |\n\
         | `/metrics` scrape, fresh board (median of 20; max) | {scrape:.1} ms; max {scrape_max:.1} ms | < 50 ms |\n\
         | `/metrics` size | {mkb} KiB | |\n\
         | labd's CPU, heartbeats of {nodes} nodes alone ({s} s) | {idle_cpu:.1}% of one core | |\n\
         | labd's CPU with {pages} pages open, each polling every second ({s} s) | {pages_cpu:.1}% of one core (+{extra:.1}% against the heartbeats alone; pages live: {polls}) | < 5% |\n\
         | the pages' polls, as labd timed them (`labsync_request_duration_seconds{{route=\"/\"}}`) | {polls_n:.0} polls in {s} s, {polls_ms:.2} ms each: {polls_pct:.2}% of one core | |\n",
        n1 = a.nodes - 1,
        g = a.gpus,
        jobs = a.jobs,
        renders = renders.iter().map(|r| r.round() as i64).collect::<Vec<_>>(),
        kb = page_bytes / 1024,
        mkb = metrics_bytes / 1024,
        nodes = a.nodes,
        s = a.seconds,
        pages = a.pages,
        extra = pages_cpu - idle_cpu,
        polls_ms = if polls_n > 0.0 { polls_s / polls_n * 1000.0 } else { 0.0 },
        polls_pct = polls_s / a.seconds as f64 * 100.0,
    );
    print!("{report}");
    std::fs::write(&a.out, report).unwrap();
}
