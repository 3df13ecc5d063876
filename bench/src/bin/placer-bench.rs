//! How long the placer takes to decide, as the cluster grows.
//!
//! ```text
//! placer-bench [--nodes 50,100,200,500,1000] [--snapshots 100] [--jobs 2000] [--out PATH]
//! ```
//!
//! For each node count, a seeded synthetic cluster view: 4 GPUs of 11 GiB
//! per node (half free, 40% busy with no known end, 10% busy with a known
//! end), `--snapshots` datasets of 50 MB to 50 GB (log-uniform, 32 MiB
//! packs, one in five a new version sharing 80% of an older one's packs),
//! 20 small code snapshots, and each node caching 8 datasets and 5 code
//! snapshots at random. Jobs ask for 1 GPU (70%), 2 or 4, one code
//! snapshot and one dataset.
//!
//! Measured: the time of one `rank` call (every node priced, the choice
//! and the explain rows built), p50 / p99 / max over `--jobs` jobs on a
//! fixed view, and the time per job of `plan` passes over queues of 100
//! jobs (ranking plus the view updated with each start). Written to PATH
//! (Markdown) and PATH with `.json`.

use std::path::PathBuf;
use std::time::Instant;

use labsync_placer::{
    plan, rank, Cluster, Gpu, Job, Ladder, NodeName, PackKey, Pass, Policy, Queued, Rates, Slot,
    SnapshotKey, Tier, Usage,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const GIB: u64 = 1 << 30;
const PACK: u64 = 32 << 20;

struct Args {
    nodes: Vec<usize>,
    snapshots: usize,
    jobs: usize,
    out: PathBuf,
}

fn die(msg: &str) -> ! {
    eprintln!("placer-bench: {msg}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        nodes: vec![50, 100, 200, 500, 1000],
        snapshots: 100,
        jobs: 2000,
        out: PathBuf::from("bench/results/placer"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| die(&format!("{flag} needs a value")))
        };
        let num = |v: &str| v.parse::<usize>().unwrap_or_else(|_| die(&format!("{v}?")));
        match flag.as_str() {
            "--nodes" => a.nodes = val().split(',').map(num).collect(),
            "--snapshots" => a.snapshots = num(&val()),
            "--jobs" => a.jobs = num(&val()).max(1),
            "--out" => a.out = val().into(),
            "-h" | "--help" => {
                println!(
                    "placer-bench [--nodes 50,100,200,500,1000] [--snapshots 100] [--jobs 2000] \
                     [--out PATH]"
                );
                std::process::exit(0)
            }
            other => die(&format!("unknown option {other}; try --help")),
        }
    }
    a
}

/// The synthetic view and the jobs to place on it.
fn build(nodes: usize, snapshots: usize, jobs: usize, seed: u64) -> (Cluster, Vec<Job>, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut c = Cluster::new();
    let mut next_pack = 0u64;
    let mut pack = |rng: &mut ChaCha8Rng| {
        next_pack += 1;
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&next_pack.to_le_bytes());
        k[8] = rng.gen();
        PackKey(k)
    };
    let mut data: Vec<(SnapshotKey, Vec<(PackKey, u64)>)> = Vec::new();
    for s in 0..snapshots {
        let packs: Vec<(PackKey, u64)> = if s > 0 && rng.gen_bool(0.2) {
            // A new version: 80% of an older dataset's packs, the rest new.
            let (_, old) = &data[rng.gen_range(0..data.len())];
            let mut p: Vec<(PackKey, u64)> =
                old.iter().filter(|_| rng.gen_bool(0.8)).cloned().collect();
            let fresh = (old.len() / 5).max(1);
            p.extend((0..fresh).map(|_| (pack(&mut rng), PACK)));
            p
        } else {
            let bytes = (50e6 * 1000f64.powf(rng.gen::<f64>())) as u64;
            let n = (bytes / PACK).max(1);
            (0..n).map(|_| (pack(&mut rng), PACK)).collect()
        };
        let mut key = [1u8; 32];
        key[..8].copy_from_slice(&(s as u64).to_le_bytes());
        data.push((SnapshotKey(key), packs));
    }
    let code: Vec<(SnapshotKey, Vec<(PackKey, u64)>)> = (0..20u64)
        .map(|s| {
            let mut key = [2u8; 32];
            key[..8].copy_from_slice(&s.to_le_bytes());
            (SnapshotKey(key), vec![(pack(&mut rng), 4 << 20)])
        })
        .collect();
    for (k, p) in data.iter().chain(&code) {
        c.add_snapshot(*k, p.iter().cloned());
    }
    for i in 0..nodes {
        let name: NodeName = format!("gpu{i}").parse().expect("a node name");
        let v = c.node_entry(&name);
        v.rates = Rates {
            peer: rng.gen_range(50e6..200e6),
            store: rng.gen_range(20e6..100e6),
        };
        v.gpus = (0..4)
            .map(|g| {
                let x: f64 = rng.gen();
                let slot = if x < 0.5 {
                    Slot::Free
                } else if x < 0.9 {
                    Slot::Busy { until: None }
                } else {
                    Slot::Busy {
                        until: Some(rng.gen_range(1..3_600_000)),
                    }
                };
                let free = if slot == Slot::Free { 11 * GIB } else { 0 };
                Gpu {
                    index: g,
                    memory_total: 11 * GIB,
                    memory_free: free,
                    slot,
                }
            })
            .collect();
        for _ in 0..8 {
            for (p, size) in &data[rng.gen_range(0..data.len())].1 {
                c.set_cached(&name, *p, *size, true);
            }
        }
        for _ in 0..5 {
            for (p, size) in &code[rng.gen_range(0..code.len())].1 {
                c.set_cached(&name, *p, *size, true);
            }
        }
    }
    let total_packs = next_pack as usize;
    let jobs = (0..jobs)
        .map(|_| {
            let x: f64 = rng.gen();
            Job {
                gpus: if x < 0.7 {
                    1
                } else if x < 0.85 {
                    2
                } else {
                    4
                },
                gpu_mem: 0,
                needs: vec![
                    code[rng.gen_range(0..code.len())].0,
                    data[rng.gen_range(0..data.len())].0,
                ],
                expected_secs: None,
                limited: false,
            }
        })
        .collect();
    (c, jobs, total_packs)
}

struct Row {
    nodes: usize,
    gpus: usize,
    packs: usize,
    needed_packs: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    plan_us: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn measure(nodes: usize, snapshots: usize, jobs: usize) -> Row {
    let (cluster, jobs, packs) = build(nodes, snapshots, jobs, 42);
    let policy = Policy::default();
    // Warm up caches and the allocator, then time every call.
    for j in jobs.iter().take(20) {
        std::hint::black_box(rank(&cluster, j, 0, &policy));
    }
    let mut times = Vec::with_capacity(jobs.len());
    for j in &jobs {
        let t = Instant::now();
        let r = rank(&cluster, j, 0, &policy);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(r);
    }
    times.sort_by(f64::total_cmp);
    let per_job_packs = jobs
        .iter()
        .map(|j| {
            j.needs
                .iter()
                .map(|s| {
                    let (_, total) = cluster
                        .presence(cluster.nodes()[0].name(), s)
                        .unwrap_or((0, 0));
                    total.div_ceil(PACK) as f64
                })
                .sum::<f64>()
        })
        .sum::<f64>()
        / jobs.len() as f64;
    let queue: Vec<Queued> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| Queued {
            id: format!("j{i}"),
            job: j.clone(),
            user: format!("u{}", i % 30),
            tier: Tier(2),
            submitted: i as u64,
            preemptible: false,
        })
        .collect();
    let (usage, ladder) = (Usage::default(), Ladder::default());
    let mut planned = 0usize;
    let t = Instant::now();
    for chunk in queue.chunks(100) {
        let mut view = cluster.clone();
        let pass = Pass {
            queue: chunk,
            running: &[],
            usage: &usage,
            ladder: &ladder,
            now: 0,
        };
        planned += plan(&mut view, &pass, &policy).len();
    }
    // One clone per pass is counted: a coordinator plans on its live view,
    // so this is an upper bound.
    let plan_us = t.elapsed().as_secs_f64() * 1e6 / planned as f64;
    Row {
        nodes,
        gpus: nodes * 4,
        packs,
        needed_packs: per_job_packs,
        p50_us: percentile(&times, 0.5),
        p99_us: percentile(&times, 0.99),
        max_us: *times.last().expect("jobs"),
        plan_us,
    }
}

fn main() {
    let args = parse_args();
    let mut rows = Vec::new();
    for &n in &args.nodes {
        let r = measure(n, args.snapshots, args.jobs);
        eprintln!(
            "{} nodes: rank p50 {:.1} µs, p99 {:.1} µs; plan {:.1} µs per job",
            r.nodes, r.p50_us, r.p99_us, r.plan_us
        );
        rows.push(r);
    }
    let mut md = String::new();
    md.push_str("# Placer decision time\n\n");
    md.push_str(&format!(
        "`placer-bench --snapshots {} --jobs {}`, release build, one thread, on {} \
         (load average {}). Synthetic views as `bench/src/bin/placer-bench.rs` describes: 4 GPUs \
         per node, {} datasets and 20 code snapshots in 32 MiB packs, 8 datasets cached per node. \
         `rank` prices every node for one job and builds the explain rows; `plan` is a \
         scheduling pass over 100 queued jobs (a clone of the view, then ranking and \
         reserving each start), per job. Target: under 1 ms per job at 50 nodes.\n\n",
        args.snapshots,
        args.jobs,
        cpu_model(),
        labsync_bench::machine::loadavg(),
        args.snapshots
    ));
    md.push_str("| nodes | GPUs | packs in view | packs per job | rank p50 µs | rank p99 µs | rank max µs | plan µs / job |\n");
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            r.nodes, r.gpus, r.packs, r.needed_packs, r.p50_us, r.p99_us, r.max_us, r.plan_us
        ));
    }
    print!("{md}");
    let json = serde_json::json!({
        "snapshots": args.snapshots,
        "jobs": args.jobs,
        "rows": rows.iter().map(|r| serde_json::json!({
            "nodes": r.nodes, "gpus": r.gpus, "packs": r.packs, "packs_per_job": r.needed_packs,
            "rank_p50_us": r.p50_us, "rank_p99_us": r.p99_us, "rank_max_us": r.max_us,
            "plan_us_per_job": r.plan_us,
        })).collect::<Vec<_>>(),
    });
    let md_path = args.out.with_extension("md");
    if let Some(dir) = md_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&md_path, md).unwrap_or_else(|e| die(&format!("{}: {e}", md_path.display())));
    let json_path = args.out.with_extension("json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&json).expect("json"),
    )
    .unwrap_or_else(|e| die(&format!("{}: {e}", json_path.display())));
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "an unknown CPU".into())
}
