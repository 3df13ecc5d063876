//! labd under load: many users submitting at once through `labrun -d`.
//!
//! ```text
//! labd-load [--bin DIR] [--jobs N] [--seconds S] [--clients C] [--users U] [--nodes K] [--work DIR] [--out PATH]
//! ```
//!
//! With `--nodes K` (K ≥ 2) it starts a cluster instead: K labd processes on
//! 127.0.0.1 (the first coordinates), 4 fake GPUs each, and the clients
//! submit to the coordinator, which places every job on a node.
//!
//! Starts one labd with 4 fake GPUs on a Unix socket, then `--clients`
//! threads submit `--jobs` one-GPU jobs with `labrun -d`, paced evenly over
//! `--seconds`, as `--users` different users. Each job appends its GPU and
//! start and end times (ns) to a trace. Reported: how many were accepted, the
//! latency of each `labrun -d` as its user sees it (p50, p99, max), labd's RSS
//! before and after, and whether any GPU was ever held by two jobs at once:
//! from the jobs' records (every job ran once, on one GPU, and exited 0) and
//! from the trace (no two intervals on one GPU overlap).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Args {
    bin: PathBuf,
    jobs: usize,
    seconds: f64,
    clients: usize,
    users: usize,
    nodes: usize,
    work: PathBuf,
    out: PathBuf,
}

fn parse_args() -> Args {
    let mut a = Args {
        bin: PathBuf::from("target/release"),
        jobs: 1000,
        seconds: 10.0,
        clients: 50,
        users: 10,
        nodes: 1,
        work: std::env::temp_dir().join("labd-load"),
        out: PathBuf::from("bench/results/labd-load"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| die(&format!("{flag} needs a value")))
        };
        let num = |v: String| v.parse::<usize>().unwrap_or_else(|_| die(&format!("{v}?")));
        match flag.as_str() {
            "--bin" => a.bin = val().into(),
            "--jobs" => a.jobs = num(val()),
            "--seconds" => a.seconds = val().parse().unwrap_or_else(|_| die("--seconds S")),
            "--clients" => a.clients = num(val()).max(1),
            "--users" => a.users = num(val()).max(1),
            "--nodes" => a.nodes = num(val()).max(1),
            "--work" => a.work = val().into(),
            "--out" => a.out = val().into(),
            "-h" | "--help" => {
                println!(
                    "labd-load [--bin DIR] [--jobs N] [--seconds S] [--clients C] [--users U] \
                     [--nodes K] [--work DIR] [--out PATH]"
                );
                std::process::exit(0);
            }
            other => die(&format!("unknown option {other}")),
        }
    }
    a
}

fn die(msg: &str) -> ! {
    eprintln!("labd-load: {msg}");
    std::process::exit(2)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time (user + system) of a process so far, in milliseconds.
fn cpu_ms(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rfind(')').map_or("", |i| &stat[i + 2..]);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the name.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    // USER_HZ is 100 on Linux.
    ticks * 10
}

fn token(user: usize) -> String {
    format!("tok-user{user:02}-0123456789abcdef")
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Where the clients reach labd (the coordinator, in a cluster).
fn address(w: &Path) -> String {
    std::fs::read_to_string(w.join("address"))
        .unwrap_or_else(|_| format!("unix://{}", w.join("labd.sock").display()))
}

fn labrun(bin: &Path, w: &Path, tok: &str) -> Command {
    let mut c = Command::new(bin.join("labrun"));
    c.current_dir(w.join("code"))
        .env("HOME", w.join("home"))
        .env("LABRUN_LABD", address(w))
        .env("LABRUN_TOKEN", tok)
        .env(
            "LABSYNC_STORE",
            format!("file://{}", w.join("store").display()),
        )
        .env("LABSYNC_CACHE", w.join("client-cache"))
        .stdin(Stdio::null());
    c
}

fn main() {
    let a = parse_args();
    for b in ["labrun", "labd"] {
        if !a.bin.join(b).exists() {
            die(&format!(
                "no {b} in {} (cargo build --release --bins)",
                a.bin.display()
            ));
        }
    }
    let bin = a.bin.canonicalize().unwrap();
    let w = &a.work;
    if w.exists() {
        std::fs::remove_dir_all(w).unwrap();
    }
    std::fs::create_dir_all(w.join("code")).unwrap();
    std::fs::create_dir_all(w.join("home")).unwrap();
    let trace = w.join("trace");
    // One labd, or a cluster of `nodes` on 127.0.0.1 (the first coordinates);
    // `labd` is the one the clients talk to.
    let ports: Vec<u16> = (0..a.nodes)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        })
        .collect();
    if a.nodes > 1 {
        std::fs::write(w.join("address"), format!("http://127.0.0.1:{}", ports[0])).unwrap();
        std::fs::write(
            w.join("cluster.secret"),
            "labd-load-cluster-secret-0123456789abcdef",
        )
        .unwrap();
        std::fs::set_permissions(
            w.join("cluster.secret"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
    }
    let mut daemons: Vec<std::process::Child> = (0..a.nodes)
        .map(|i| {
            let d = if a.nodes > 1 {
                w.join(format!("gpu{i}"))
            } else {
                w.to_path_buf()
            };
            std::fs::create_dir_all(&d).unwrap();
            let listen = if a.nodes > 1 {
                format!("127.0.0.1:{}", ports[i])
            } else {
                format!("unix://{}", w.join("labd.sock").display())
            };
            let mut config = format!(
                "listen = \"{listen}\"\nnode_name = \"gpu{i}\"\nstate_dir = \"{state}\"\n\
                 store = \"file://{store}\"\ncache_dir = \"{cache}\"\nfake_gpus = \"4x11GiB\"\n\
                 run_as = \"labd\"\n[tokens]\n",
                state = d.join("state").display(),
                store = w.join("store").display(),
                cache = d.join("cache").display(),
            );
            for u in 0..a.users {
                config += &format!("user{u:02} = \"{}\"\n", token(u));
            }
            if a.nodes > 1 {
                config += &format!(
                    "[cluster]\ncoordinator = \"http://127.0.0.1:{}\"\ncoordinate = {}\n\
                     secret_file = \"{}\"\ninsecure_cleartext = true\n",
                    ports[0],
                    i == 0,
                    w.join("cluster.secret").display()
                );
            }
            let cfg = d.join("labd.toml");
            std::fs::write(&cfg, config).unwrap();
            std::fs::set_permissions(&cfg, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .unwrap();
            let log = std::fs::File::create(d.join("labd.log")).unwrap();
            Command::new(bin.join("labd"))
                .arg("--config")
                .arg(&cfg)
                .env("HOME", w.join("home"))
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    let t = Instant::now();
    let up = |i: usize| {
        if a.nodes > 1 {
            std::net::TcpStream::connect(("127.0.0.1", ports[i])).is_ok()
        } else {
            std::os::unix::net::UnixStream::connect(w.join("labd.sock")).is_ok()
        }
    };
    while !(0..a.nodes).all(up) {
        if t.elapsed() > Duration::from_secs(30) {
            die("labd did not start (see labd.log)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut labd = daemons.remove(0);
    // A GPU is a node's GPU: the trace names both.
    let script = format!(
        "echo s $LABRUN_NODE:$CUDA_VISIBLE_DEVICES $LABRUN_JOB_ID $(date +%s%N) >> {t}; sleep 0.05; \
         echo e $LABRUN_NODE:$CUDA_VISIBLE_DEVICES $LABRUN_JOB_ID $(date +%s%N) >> {t}",
        t = trace.display()
    );
    let submit_args = ["-d", "--gpus", "1", "--", "bash", "-c", script.as_str()];
    // The code folder is pushed once; later submissions find it unchanged.
    let warm = labrun(&bin, w, &token(0))
        .args(submit_args)
        .output()
        .unwrap();
    if !warm.status.success() {
        die(&format!(
            "first submission failed: {}",
            String::from_utf8_lossy(&warm.stderr)
        ));
    }
    let state = if a.nodes > 1 {
        w.join("gpu0/state")
    } else {
        w.join("state")
    };
    let admin = std::fs::read_to_string(state.join("token")).unwrap();
    if a.nodes > 1 {
        // Every node's heartbeat in before the clock starts.
        let t = Instant::now();
        loop {
            let o = labrun(&bin, w, admin.trim())
                .args(["status", "--json"])
                .output()
                .unwrap();
            let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            if st["nodes"].as_array().is_some_and(|n| n.len() == a.nodes) {
                break;
            }
            if t.elapsed() > Duration::from_secs(30) {
                die("the cluster's nodes did not all report");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let list = |admin: &str| -> Vec<serde_json::Value> {
        let o = labrun(&bin, w, admin.trim())
            .args(["ps", "--all", "--json"])
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout).unwrap_or_default()
    };
    // A JobView's state is `{"state": "exited", "code": 0, ...}`.
    let ended =
        |j: &serde_json::Value| matches!(j["state"]["state"].as_str(), Some("exited" | "failed"));
    let wait_all_ended = |n: usize| {
        let t = Instant::now();
        loop {
            let jobs = list(&admin);
            if jobs.len() >= n && jobs.iter().all(ended) {
                return (jobs, t.elapsed());
            }
            if t.elapsed() > Duration::from_secs(600) {
                die("jobs did not all end within 10 minutes");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait_all_ended(1);
    let rss_before = rss_kib(labd.id());

    println!(
        "labd-load: {} submissions over {} s from {} clients as {} users",
        a.jobs, a.seconds, a.clients, a.users
    );
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::<(f64, bool, String)>::new()));
    let start = Instant::now();
    let gap = a.seconds / a.jobs.max(1) as f64;
    let workers: Vec<_> = (0..a.clients)
        .map(|_| {
            let (next, results, bin, w) = (next.clone(), results.clone(), bin.clone(), w.clone());
            let script = script.clone();
            let (jobs, users) = (a.jobs, a.users);
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= jobs {
                    return;
                }
                let due = start + Duration::from_secs_f64(gap * i as f64);
                if let Some(d) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
                let t = Instant::now();
                let o = labrun(&bin, &w, &token(i % users))
                    .args(["-d", "--gpus", "1", "--", "bash", "-c", &script])
                    .output()
                    .unwrap();
                let secs = t.elapsed().as_secs_f64();
                let what = if o.status.success() {
                    String::from_utf8_lossy(&o.stdout).trim().to_string()
                } else {
                    String::from_utf8_lossy(&o.stderr).trim().to_string()
                };
                results
                    .lock()
                    .unwrap()
                    .push((secs, o.status.success(), what));
            })
        })
        .collect();
    for t in workers {
        t.join().unwrap();
    }
    let submit_wall = start.elapsed().as_secs_f64();
    let results = results.lock().unwrap().clone();
    let accepted = results.iter().filter(|r| r.1).count();
    let mut lat: Vec<f64> = results.iter().map(|r| r.0).collect();
    lat.sort_by(|x, y| x.total_cmp(y));
    for r in results.iter().filter(|r| !r.1).take(5) {
        eprintln!("labd-load: refused: {}", r.2);
    }
    let rss_submitted = rss_kib(labd.id());
    let (jobs, drain) = wait_all_ended(accepted + 1);
    let rss_after = rss_kib(labd.id());

    // From the records: every job exited 0 and holds no GPU now.
    let bad_records: Vec<String> = jobs
        .iter()
        .filter(|j| {
            j["state"]["state"] != "exited"
                || j["state"]["code"] != 0
                || j["gpus"].as_array().is_some_and(|g| !g.is_empty())
        })
        .map(|j| j["id"].to_string())
        .collect();
    // From the trace: on each GPU, no job starts before the previous one ended.
    let text = std::fs::read_to_string(&trace).unwrap_or_default();
    let mut events: Vec<(String, u128, bool, String)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() != 4 {
                return None;
            }
            Some((
                f[1].to_string(),
                f[3].parse().ok()?,
                f[0] == "s",
                f[2].to_string(),
            ))
        })
        .collect();
    events.sort_by(|x, y| (&x.0, x.1, x.2).cmp(&(&y.0, y.1, y.2)));
    let mut overlaps = 0;
    let mut holder: std::collections::HashMap<String, String> = Default::default();
    for (gpu, _, is_start, job) in &events {
        if *is_start {
            if holder.contains_key(gpu) {
                overlaps += 1;
            }
            holder.insert(gpu.clone(), job.clone());
        } else if holder.get(gpu) == Some(job) {
            holder.remove(gpu);
        }
    }
    let ran = events.iter().filter(|e| e.2).count();

    // Idle followers: `labrun logs -f` of a job that prints nothing. labd
    // wakes them when the log grows (the ticker watches it), so waiting
    // costs it next to nothing; polling would cost it per follower.
    let quiet = labrun(&bin, w, &token(0))
        .args(["-d", "--gpus", "0", "--", "sleep", "60"])
        .output()
        .unwrap();
    let quiet_id = String::from_utf8_lossy(&quiet.stdout).trim().to_string();
    let followers: Vec<_> = (0..a.clients)
        .map(|_| {
            labrun(&bin, w, &token(0))
                .args(["logs", "-f", &quiet_id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let cpu0 = cpu_ms(labd.id());
    let idle = Duration::from_secs(5);
    std::thread::sleep(idle);
    let idle_cpu_ms_per_s = (cpu_ms(labd.id()) - cpu0) as f64 / idle.as_secs_f64();
    for mut f in followers {
        let _ = f.kill();
        let _ = f.wait();
    }
    let _ = labd.kill();
    let _ = labd.wait();
    for mut d in daemons {
        let _ = d.kill();
        let _ = d.wait();
    }

    let report = serde_json::json!({
        "jobs": a.jobs, "seconds": a.seconds, "clients": a.clients, "users": a.users,
        "nodes": a.nodes,
        "accepted": accepted, "submit_wall_s": submit_wall,
        "latency_s": {"p50": percentile(&lat, 0.5), "p99": percentile(&lat, 0.99), "max": lat.last()},
        "jobs_ran": ran, "drain_s": drain.as_secs_f64(),
        "double_leases_in_trace": overlaps, "bad_records": bad_records.len(),
        "idle_followers": a.clients, "labd_cpu_ms_per_s_with_idle_followers": idle_cpu_ms_per_s,
        "labd_rss_kib": {"before": rss_before, "after_submit": rss_submitted, "after_drain": rss_after},
        "machine": {"cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)},
    });
    let md = format!(
        "# labd under load\n\n{} `labrun -d` submissions of one-GPU jobs, paced over {} s, from {} \
         concurrent clients as {} users, against {} \
         ({} CPUs; `bench/labd-load.sh`).\n\n\
         | what | measured |\n|---|---|\n\
         | accepted | {accepted} of {} |\n\
         | submitting took | {submit_wall:.1} s |\n\
         | `labrun -d` latency p50 / p99 / max | {:.0} / {:.0} / {:.0} ms |\n\
         | jobs that ran (trace) | {ran} |\n\
         | GPU held by two jobs at once | {overlaps} in the trace; {} bad records (not exited 0, or a GPU still held) |\n\
         | queue drained after the last submission | {:.1} s |\n\
         | labd RSS before / after submitting / after draining | {} / {} / {} MiB |\n\
         | labd CPU while {} `labrun logs -f` wait on a silent job | {idle_cpu_ms_per_s:.1} ms per second |\n",
        a.jobs,
        a.seconds,
        a.clients,
        a.users,
        if a.nodes > 1 {
            format!(
                "the coordinator of a cluster of {} labd processes on 127.0.0.1 with 4 fake GPUs \
                 each (it places every job; labd figures below are the coordinator's)",
                a.nodes
            )
        } else {
            "one labd with 4 fake GPUs".to_string()
        },
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        a.jobs,
        percentile(&lat, 0.5) * 1e3,
        percentile(&lat, 0.99) * 1e3,
        lat.last().copied().unwrap_or(f64::NAN) * 1e3,
        bad_records.len(),
        drain.as_secs_f64(),
        rss_before / 1024,
        rss_submitted / 1024,
        rss_after / 1024,
        a.clients,
    );
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(
        a.out.with_extension("json"),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .unwrap();
    std::fs::write(a.out.with_extension("md"), &md).unwrap();
    println!("{md}");
    if accepted != a.jobs || overlaps > 0 || !bad_records.is_empty() {
        std::process::exit(1);
    }
}
