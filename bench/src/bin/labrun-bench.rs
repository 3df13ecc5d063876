//! labrun latency: time from starting `labrun` to the job's first line of
//! output, with code and data already cached on the node, and how it grows
//! with the number of files in the code.
//!
//! ```text
//! labrun-bench [--bin DIR] [--reps N] [--data-mb MB] [--work DIR] [--out PATH]
//! ```
//!
//! It builds nothing: `--bin` is a folder with release `labsync`, `labrun`
//! and `labd` (default `target/release`). It writes seeded data (1 GB of
//! incompressible files; code trees of 5,000 and 50,000 small files), starts
//! one labd with a fake GPU on a Unix socket, pushes the data, runs each code
//! tree once untimed (push, materialisation), then times `--reps` runs of
//! `labrun --data bench-data --gpus 1 train.py` for each, next to running
//! `python3 train.py` directly (the floor: interpreter start-up).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};

struct Args {
    bin: PathBuf,
    reps: usize,
    data_mb: u64,
    work: PathBuf,
    out: PathBuf,
}

fn parse_args() -> Args {
    let mut a = Args {
        bin: PathBuf::from("target/release"),
        reps: 9,
        data_mb: 1000,
        work: std::env::temp_dir().join("labrun-bench"),
        out: PathBuf::from("bench/results/labrun"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| die(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--bin" => a.bin = val().into(),
            "--reps" => a.reps = val().parse().unwrap_or_else(|_| die("--reps N")),
            "--data-mb" => a.data_mb = val().parse().unwrap_or_else(|_| die("--data-mb MB")),
            "--work" => a.work = val().into(),
            "--out" => a.out = val().into(),
            "-h" | "--help" => {
                println!(
                    "labrun-bench [--bin DIR] [--reps N] [--data-mb MB] [--work DIR] [--out PATH]"
                );
                std::process::exit(0);
            }
            other => die(&format!("unknown option {other}")),
        }
    }
    a
}

fn die(msg: &str) -> ! {
    eprintln!("labrun-bench: {msg}");
    std::process::exit(2)
}

fn write_data(dir: &Path, mb: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    std::fs::create_dir_all(dir).unwrap();
    let mut buf = vec![0u8; 10 << 20];
    for i in 0..mb.div_ceil(10) {
        rng.fill_bytes(&mut buf);
        std::fs::write(dir.join(format!("{i:04}.png")), &buf).unwrap();
    }
}

fn write_code(dir: &Path, files: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("train.py"), "print('first line', flush=True)\n").unwrap();
    for i in 0..files {
        let sub = dir.join(format!("pkg{:03}", i / 100));
        if i % 100 == 0 {
            std::fs::create_dir_all(&sub).unwrap();
        }
        let body = format!("# module {i}\n").repeat(60 + i % 40);
        std::fs::write(sub.join(format!("m{i:05}.py")), body).unwrap();
    }
}

/// Seconds from spawn to the first line on stdout, and to exit.
fn first_line(mut cmd: Command) -> (f64, f64) {
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let first = t.elapsed().as_secs_f64();
    assert_eq!(line.trim(), "first line", "unexpected output");
    let status = child.wait().unwrap();
    assert!(status.success(), "run failed: {status}");
    (first, t.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let a = parse_args();
    for b in ["labsync", "labrun", "labd"] {
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
        Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(w)
            .status()
            .unwrap();
        std::fs::remove_dir_all(w).unwrap();
    }
    std::fs::create_dir_all(w).unwrap();
    let w = w.canonicalize().unwrap();
    eprintln!(
        "labrun-bench: writing {} MB of data and code trees in {}",
        a.data_mb,
        w.display()
    );
    write_data(&w.join("data"), a.data_mb);
    let variants = [("5k", 5_000usize), ("50k", 50_000)];
    for (name, n) in variants {
        write_code(&w.join(format!("code-{name}")), n);
    }
    let sock = w.join("labd.sock");
    std::fs::write(
        w.join("labd.toml"),
        format!(
            "listen = \"unix://{}\"\nstate_dir = \"{}\"\nstore = \"file://{}\"\ncache_dir = \"{}\"\n\
             fake_gpus = \"1x11GiB\"\nrun_as = \"labd\"\n",
            sock.display(),
            w.join("state").display(),
            w.join("store").display(),
            w.join("cache").display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(w.join("labd.log")).unwrap();
    let mut labd = Command::new(bin.join("labd"))
        .arg("--config")
        .arg(w.join("labd.toml"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t.elapsed() < Duration::from_secs(30), "labd did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let token = std::fs::read_to_string(w.join("state/token")).unwrap();
    let env = |c: &mut Command| {
        c.env(
            "LABSYNC_STORE",
            format!("file://{}", w.join("store").display()),
        )
        .env("LABSYNC_CACHE", w.join("client-cache"))
        .env("LABRUN_LABD", format!("unix://{}", sock.display()))
        .env("LABRUN_TOKEN", token.trim());
    };
    let mut push = Command::new(bin.join("labsync"));
    push.args(["push", "--quiet", "--name", "bench-data"])
        .arg(w.join("data"));
    env(&mut push);
    assert!(push.status().unwrap().success(), "data push failed");

    let labrun = |code: &Path| {
        let mut c = Command::new(bin.join("labrun"));
        c.args(["--quiet", "--data", "bench-data", "--gpus", "1", "train.py"])
            .current_dir(code);
        env(&mut c);
        c
    };
    let direct = |code: &Path| {
        let mut c = Command::new("python3");
        c.arg("train.py").current_dir(code);
        c
    };
    let mut rows = Vec::new();
    for (name, files) in variants {
        let code = w.join(format!("code-{name}"));
        let t = Instant::now();
        first_line(labrun(&code));
        let cold = t.elapsed().as_secs_f64();
        let (mut lr_first, mut lr_total, mut py_first) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.reps {
            let (f, total) = first_line(labrun(&code));
            lr_first.push(f);
            lr_total.push(total);
            py_first.push(first_line(direct(&code)).0);
        }
        let row = (
            name,
            files,
            cold,
            median(&mut lr_first),
            lr_first[0],
            lr_first[lr_first.len() - 1],
            median(&mut lr_total),
            median(&mut py_first),
        );
        eprintln!(
            "labrun-bench: {name}: first line median {:.3} s (python alone {:.3} s)",
            row.3, row.7
        );
        rows.push(row);
    }
    let _ = labd.kill();
    let _ = labd.wait();

    let growth = rows[1].3 - rows[0].3;
    let mut md = String::new();
    md += "# labrun latency\n\n";
    md += &format!(
        "Time from starting `labrun --quiet --data bench-data --gpus 1 train.py` to the job's first \
         line on labrun's stdout, with the code and the {} MB dataset already pushed and \
         materialised on the node (one untimed run first). `train.py` prints one line; \
         \"python alone\" runs it directly, the floor. {} repetitions, median (min–max). \
         labd with one fake GPU on a Unix socket, local store. Machine: {} cores, {}.\n\n",
        a.data_mb,
        a.reps,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .map(|l| format!("load average {}", l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")))
            .unwrap_or_default()
    );
    md += "| code files | first run (push + materialise), s | first line, s | labrun to exit, s | python alone, s | labrun overhead, s |\n|---|---|---|---|---|---|\n";
    for r in &rows {
        md += &format!(
            "| {} | {:.3} | **{:.3}** ({:.3}–{:.3}) | {:.3} | {:.3} | {:.3} |\n",
            r.1,
            r.2,
            r.3,
            r.4,
            r.5,
            r.6,
            r.7,
            r.3 - r.7
        );
    }
    md += &format!(
        "\nTargets: first line under 0.300 s with 5,000 files: **{}** ({:.3} s). \
         A re-run of unchanged code with 50,000 files adds under 0.200 s: **{}** (+{:.3} s).\n",
        if rows[0].3 < 0.3 { "met" } else { "missed" },
        rows[0].3,
        if growth < 0.2 { "met" } else { "missed" },
        growth
    );
    let json = serde_json::json!({
        "reps": a.reps,
        "data_mb": a.data_mb,
        "rows": rows.iter().map(|r| serde_json::json!({
            "files": r.1, "cold_s": r.2, "first_line_median_s": r.3, "first_line_min_s": r.4,
            "first_line_max_s": r.5, "to_exit_median_s": r.6, "python_alone_s": r.7,
        })).collect::<Vec<_>>(),
        "growth_50k_minus_5k_s": growth,
    });
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(a.out.with_extension("md"), &md).unwrap();
    std::fs::write(
        a.out.with_extension("json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    std::io::stdout().write_all(md.as_bytes()).unwrap();
    Command::new("chmod")
        .args(["-R", "u+w"])
        .arg(&w)
        .status()
        .unwrap();
    let _ = std::fs::remove_dir_all(&w);
}
