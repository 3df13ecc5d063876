//! `placement-sim`: replays the lab's workload and a Philly virtual cluster
//! through five placement policies (labsync's is `labsync-placer` itself)
//! and writes `bench/results/placement.md` and `placement.svg`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use labsync_bench::sim::report::{self, Summary};
use labsync_bench::sim::workload::{self, Throughputs, GB};
use labsync_bench::sim::{simulate, summarise, Policy, Setup, Workload};

const USAGE: &str = "\
Usage: placement-sim [OPTIONS]

Replays workloads through five placement policies on a simulated cluster
and reports waits, staging, bytes moved, cache hits, GPU utilisation and
GPU-hours held idle per policy (labsync's policy is labsync-placer itself).

Workloads:
  --trace DIR          a folder of Gavel-format .trace files
                       (default ../shared/traces/gavel-philly/seed=0)
  --vc FILE            replay only this file of DIR (default 103959.trace;
                       'all' for every file, merged)
  --throughputs FILE   Gavel's simulation_throughputs.json
                       (default DIR/../simulation_throughputs.json)
  --seed N             seed of the lab workload and of user assignment (1)
  --days D             days of the lab workload (60)
  --load X             arrival-rate factor of the lab workload (1.0)
  --max-gpus N         cap Philly jobs to N GPUs, keeping GPU-hours (4)

Cluster (defaults: the lab's):
  --nodes N            nodes (8)
  --gpus N             GPUs per node (4)
  --cache-gb X         cache per node, GB (500)
  --link-gbit X        each node's link, Gbit/s (1)
  --store-gbit X       the object store, Gbit/s (10)

Queue (the lab queue's settings, labsync and first-fit+queue):
  --no-backfill        no reservation for the first job that cannot start
  --aging-hours H      a waiting job rises a tier per H hours (24; 0: never)
  --cap N              GPUs one user may have running at once (none)
  --reserve-after-hours H  a job holds the GPUs it waits for only once it
                       has waited H hours (the placer's default)
  --oracle             tell the coordinator true run times (the simulator
                       before issue 45) instead of limits with users' error

Runs:
  --matrix             the issue-45 report: the lab workload and every
                       virtual cluster of seeds 0-2 under the trace folder's
                       parent with at least 500 jobs, at each --caches size,
                       every policy side by side with labsync's ratios and
                       the targets (replaces the default report)
  --caches LIST        cache sizes (GB) of --matrix (default 100,500,2000)
  --policies LIST      comma-separated: spreadsheet,first-fit,random,
                       labsync,labsync+prefetch (default all)
  --sweep LIST         cache sizes (GB) for the cache sweep
                       (default 100,200,500,1000,2000; 'none' to skip)
  --speed              also time labsync over every file of DIR merged
                       (a whole seed: 15,264 jobs)
  --out PATH           Markdown report (default bench/results/placement.md);
                       the plot goes to the same path with .svg
  -h, --help           this help
";

struct Args {
    trace: PathBuf,
    vc: String,
    throughputs: Option<PathBuf>,
    seed: u64,
    days: f64,
    load: f64,
    max_gpus: u32,
    setup: Setup,
    policies: Vec<Policy>,
    sweep: Vec<u64>,
    speed: bool,
    matrix: bool,
    caches: Vec<u64>,
    out: PathBuf,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        trace: PathBuf::from("../shared/traces/gavel-philly/seed=0"),
        vc: "103959.trace".into(),
        throughputs: None,
        seed: 1,
        days: 60.0,
        load: 1.0,
        max_gpus: 4,
        setup: Setup::default(),
        policies: Policy::ALL.to_vec(),
        sweep: vec![100, 200, 500, 1000, 2000],
        speed: false,
        matrix: false,
        caches: vec![100, 500, 2000],
        out: PathBuf::from("bench/results/placement.md"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            print!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--speed" {
            a.speed = true;
            continue;
        }
        if flag == "--matrix" {
            a.matrix = true;
            continue;
        }
        if flag == "--no-backfill" {
            a.setup.backfill = false;
            continue;
        }
        if flag == "--oracle" {
            a.setup.oracle = true;
            continue;
        }
        let v = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value (see --help)"))?;
        let num = |v: &str| -> Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("{flag} {v}: give a positive number"))
        };
        match flag.as_str() {
            "--trace" => a.trace = v.into(),
            "--vc" => a.vc = v,
            "--throughputs" => a.throughputs = Some(v.into()),
            "--seed" => a.seed = v.parse().map_err(|_| format!("--seed {v}: give a number"))?,
            "--days" => a.days = num(&v)?,
            "--load" => a.load = num(&v)?,
            "--max-gpus" => a.max_gpus = num(&v)? as u32,
            "--nodes" => a.setup.nodes = num(&v)? as usize,
            "--gpus" => a.setup.gpus_per_node = num(&v)? as u32,
            "--cache-gb" => a.setup.cache = (num(&v)? * GB as f64) as u64,
            "--link-gbit" => a.setup.link = num(&v)? * 1e9 / 8.0,
            "--store-gbit" => a.setup.store = num(&v)? * 1e9 / 8.0,
            "--aging-hours" => {
                a.setup.aging_secs = match v.parse::<f64>() {
                    Ok(0.0) => None,
                    Ok(h) if h > 0.0 && h.is_finite() => Some((h * 3600.0) as u64),
                    _ => return Err(format!("--aging-hours {v}: give hours, or 0 for none")),
                }
            }
            "--cap" => a.setup.cap = Some(num(&v)? as u32),
            "--reserve-after-hours" => {
                a.setup.reserve_after_secs = match v.parse::<f64>() {
                    Ok(h) if h >= 0.0 && h.is_finite() => (h * 3600.0) as u64,
                    _ => return Err(format!("--reserve-after-hours {v}: give hours (0: at once)")),
                }
            }
            "--policies" => {
                a.policies = v
                    .split(',')
                    .map(|p| {
                        Policy::parse(p).ok_or_else(|| {
                            format!("--policies: no policy {p:?}; the policies are spreadsheet, first-fit, random, labsync, labsync+prefetch")
                        })
                    })
                    .collect::<Result<_, _>>()?
            }
            "--sweep" => {
                a.sweep = if v == "none" {
                    Vec::new()
                } else {
                    v.split(',')
                        .map(|x| num(x).map(|g| g as u64))
                        .collect::<Result<_, _>>()?
                }
            }
            "--out" => a.out = v.into(),
            "--caches" => {
                a.caches = v
                    .split(',')
                    .map(|x| num(x).map(|g| g as u64))
                    .collect::<Result<_, _>>()?
            }
            _ => return Err(format!("unknown option {flag} (see --help)")),
        }
    }
    if a.max_gpus == 0 || a.max_gpus > a.setup.gpus_per_node {
        a.max_gpus = a.setup.gpus_per_node;
    }
    Ok(a)
}

/// CPU seconds this process has used (user and system), from
/// `/proc/self/stat`; 0 where it cannot be read.
fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command (which may hold spaces): utime is the 12th
    // and stime the 13th after the closing parenthesis, in clock ticks.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn run_all(w: &Workload, setup: &Setup, policies: &[Policy]) -> Vec<Summary> {
    policies
        .iter()
        .map(|&p| {
            let s = summarise(&simulate(w, setup, p));
            eprintln!(
                "  {:<17} wait mean {:>9}  p95 {:>9}  staging {:>8}  moved {:>6.0} GB ({:.0} from peers)  ({:.2} s)",
                p.name(),
                report::dur(s.wait_mean),
                report::dur(s.wait_p95),
                report::dur(s.staging_mean),
                s.bytes_moved as f64 / 1e9,
                s.bytes_peer as f64 / 1e9,
                s.wall
            );
            s
        })
        .collect()
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("placement-sim: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("placement-sim: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.matrix {
        return matrix(args);
    }
    let tp_path = args.throughputs.clone().unwrap_or_else(|| {
        args.trace
            .parent()
            .unwrap_or(&args.trace)
            .join("simulation_throughputs.json")
    });
    let tp = Throughputs::read(&tp_path)?;
    let only = (args.vc != "all").then_some(args.vc.as_str());
    let philly = workload::philly(&args.trace, only, &tp, args.max_gpus, 30, args.seed)?;
    let lab = workload::lab(args.seed, args.days, args.load);
    let setup = &args.setup;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Placement: five policies on a simulated lab cluster\n"
    );
    let _ = writeln!(
        md,
        "Produced by `cargo run --release -p labsync-bench --bin placement-sim{}` (the simulator runs `labsync-placer` itself for the labsync rows). Cluster: {} nodes × {} GPUs, {:.0} GB cache per node (LRU of 1 GB packs; packs of running jobs pinned), {:.1} Gbit/s per node link, {:.1} Gbit/s object store.\n",
        if std::env::args().len() > 1 {
            format!(" -- {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "))
        } else {
            String::new()
        },
        setup.nodes,
        setup.gpus_per_node,
        setup.cache as f64 / GB as f64,
        setup.link * 8.0 / 1e9,
        setup.store * 8.0 / 1e9
    );
    md.push_str(
        "Model: first-fit, random and the spreadsheet take the queue first come, first served, passing over jobs that do not fit; first-fit+queue, labsync and labsync+prefetch take it in the lab's order (tier, aged one tier per day waited up to phd; fair share by 7-day decaying GPU time, waived once a job has waited a day; submit time) with EASY backfill (the first job that cannot start, once it has waited 2 h, holds the GPUs it waits for from when they are expected free; only a job whose limit ends before then may use them). The simulated coordinator is told limits with users' error (70% of jobs, 1-5× their run time) or estimates from history, never the true run time. A job's GPUs are assigned at placement and it runs once its data is on the node: *queueing* is submit → GPUs assigned, *staging* assigned → data there, *wait* the sum. Transfers share bandwidth: each gets its destination link's share, capped by the store's share or the source peer's link share. first-fit, random, first-fit+queue and the spreadsheet copy from the object store (first-fit+queue places blind to data: the best fit); labsync fetches from a peer that caches the packs, else the store, and may wait for a busy node that has the data for at most the time the fetch elsewhere would take. labsync+prefetch also warms the data of the 16 jobs at the head of the queue on the nodes they likely get (up to 3 copies of data several jobs want; 2 prefetches per node at a time). The spreadsheet: users dealt to nodes in turn and each node's GPUs to its users; a job waits for its owner's GPUs and runs on as many as the owner has (longer, if fewer than asked), and every owned GPU not computing counts as held idle. Holds (`labrun --hold`): under the lab's queue released after 30 min without utilisation (the placer's `idle_holds`); elsewhere held to the end. Not simulated: preemption (no job in these workloads is preemptible), GPU memory sizes, failures; no per-user cap unless --cap.\n\n",
    );
    let mut plots = Vec::new();
    let mut all_targets = Vec::new();
    for (w, label) in [(&lab, "lab workload"), (&philly, "Philly virtual cluster")] {
        eprintln!("{} ({} jobs):", w.name, w.jobs.len());
        let rows = run_all(w, setup, &args.policies);
        let _ = writeln!(md, "## {label}: {}\n", w.name);
        for n in &w.notes {
            let _ = writeln!(md, "- {n}");
        }
        md.push('\n');
        report::table(&mut md, &rows);
        if args.policies.len() == Policy::ALL.len() {
            // The deadline tier under first-fit FIFO: the same jobs.
            let ff = rows.iter().find(|r| r.policy == Policy::FirstFit);
            let ls = rows.iter().find(|r| r.policy == Policy::Labsync);
            if let (Some(ff), Some(ls)) = (ff, ls) {
                let t = report::targets(&rows, report::deadline_p95(ff), report::deadline_p95(ls));
                all_targets.push((label, t));
            }
        }
        plots.push((format!("{label}: {}", w.name), rows));
    }
    if !all_targets.is_empty() {
        md.push_str("## Targets\n\n| workload | metric | measured | target | met |\n|---|---|---|---|---|\n");
        for (label, t) in &all_targets {
            for (metric, got, want, met) in t {
                let _ = writeln!(
                    md,
                    "| {label} | {metric} | {got} | {want} | {} |",
                    if *met { "yes" } else { "**no**" }
                );
            }
        }
        md.push('\n');
    }
    if !args.sweep.is_empty() {
        md.push_str("## Cache sweep: bytes moved (and mean staging) by cache size per node\n\n");
        md.push_str("Where every node's cache holds every dataset, each dataset crosses the network about once per node whatever the policy, and placement has little left to save.\n\n");
        for (w, label) in [(&lab, "lab workload"), (&philly, "Philly virtual cluster")] {
            let ratio = args.policies.contains(&Policy::FirstFit)
                && args.policies.contains(&Policy::Labsync);
            let _ = write!(md, "{label}:\n\n| cache per node |");
            for p in &args.policies {
                let _ = write!(md, " {} |", p.name());
            }
            if ratio {
                md.push_str(" labsync / first-fit: bytes, staging |");
            }
            md.push_str("\n|---|");
            for _ in 0..args.policies.len() + ratio as usize {
                md.push_str("---|");
            }
            md.push('\n');
            for &gb in &args.sweep {
                eprintln!("sweep {label}, {gb} GB per node:");
                let s = Setup {
                    cache: gb * GB,
                    ..setup.clone()
                };
                let rows = run_all(w, &s, &args.policies);
                let _ = write!(md, "| {gb} GB |");
                for r in &rows {
                    let _ = write!(
                        md,
                        " {:.0} GB ({}) |",
                        r.bytes_moved as f64 / 1e9,
                        report::dur(r.staging_mean)
                    );
                }
                let of = |p: Policy| rows.iter().find(|r| r.policy == p);
                if let (Some(ff), Some(ls)) = (of(Policy::FirstFit), of(Policy::Labsync)) {
                    let _ = write!(
                        md,
                        " {:.2}×, {:.2}× |",
                        ls.bytes_moved as f64 / ff.bytes_moved.max(1) as f64,
                        ls.staging_mean / ff.staging_mean.max(1e-9)
                    );
                }
                md.push('\n');
            }
            md.push('\n');
        }
    }
    if args.speed {
        let whole = workload::philly(&args.trace, None, &tp, args.max_gpus, 30, args.seed)?;
        eprintln!(
            "speed: labsync over {} ({} jobs)",
            whole.name,
            whole.jobs.len()
        );
        let (t, cpu0) = (Instant::now(), cpu_secs());
        let o = simulate(&whole, setup, Policy::Labsync);
        let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu_secs() - cpu0);
        eprintln!("  {secs:.1} s wall, {cpu:.1} s CPU");
        let _ = writeln!(
            md,
            "## Simulator speed\n\nlabsync over every file of `{}` merged ({} jobs, {} finished) on the cluster above, one thread: **{cpu:.1} s of CPU** ({secs:.1} s wall on a shared machine; target ≤ 10 s on one core). The merge is a months-long backlog on 32 GPUs: it measures the simulator, not placement.\n",
            args.trace.display(),
            whole.jobs.len(),
            o.jobs.len()
        );
    }
    let out = &args.out;
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    let svg_path = out.with_extension("svg");
    std::fs::write(&svg_path, report::svg(&plots))
        .map_err(|e| format!("{}: {e}", svg_path.display()))?;
    eprintln!("wrote {} and {}", out.display(), svg_path.display());
    Ok(())
}

/// Every (workload, cache size) of the matrix, run on every core.
fn matrix(args: &Args) -> Result<(), String> {
    let root = args.trace.parent().unwrap_or(&args.trace).to_path_buf();
    let tp = Throughputs::read(
        &args
            .throughputs
            .clone()
            .unwrap_or_else(|| root.join("simulation_throughputs.json")),
    )?;
    let mut workloads = vec![workload::lab(args.seed, args.days, args.load)];
    for seed in 0..3 {
        let dir = root.join(format!("seed={seed}"));
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".trace"))
            .collect();
        files.sort();
        for f in files {
            let mut w = workload::philly(&dir, Some(&f), &tp, args.max_gpus, 30, args.seed)?;
            if w.jobs.len() >= 500 {
                w.name = format!("seed={seed}/{f}");
                workloads.push(w);
            }
        }
    }
    let tasks: Vec<(usize, u64)> = (0..workloads.len())
        .flat_map(|w| args.caches.iter().map(move |&c| (w, c)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(w, gb)) = tasks.get(i) else { break };
                let setup = Setup {
                    cache: gb * GB,
                    ..args.setup.clone()
                };
                // Prefetch's passes cost ~10× labsync's on the Philly
                // traces: it runs on the lab workload only.
                let rows: Vec<Summary> = (args.policies.iter())
                    .filter(|&&p| w == 0 || p != Policy::LabsyncPrefetch)
                    .map(|&p| summarise(&simulate(&workloads[w], &setup, p)))
                    .collect();
                eprintln!(
                    "{} at {gb} GB: done ({:.0} s in)",
                    workloads[w].name,
                    t0.elapsed().as_secs_f64()
                );
                done.lock().unwrap().push((w, gb, rows));
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(w, gb, _)| (*w, *gb));
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Placement: a queue that knows time, on every virtual cluster\n"
    );
    let _ = writeln!(
        md,
        "Produced by `cargo run --release -p labsync-bench --bin placement-sim -- {}` ({:.0} s on {threads} threads). Cluster: {} nodes × {} GPUs, {:.1} Gbit/s per node link, {:.1} Gbit/s object store; cache per node {} GB (LRU of 1 GB packs, packs of running jobs pinned, trimmed back to its size when the pins go).\n",
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        t0.elapsed().as_secs_f64(),
        args.setup.nodes,
        args.setup.gpus_per_node,
        args.setup.link * 8.0 / 1e9,
        args.setup.store * 8.0 / 1e9,
        args.caches.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
    );
    let _ = writeln!(
        md,
        "Reservation age: {}. What the simulated coordinator knows: what a real one does. {:.0}% of jobs give a limit, drawn uniformly between 1× and {:.0}× their true run time; the others are planned with an estimate (the longest of their user's last 5 runs of the same kind: user, dataset, GPUs), or nothing; a hold's length is its limit. A running job's GPUs are planned free at its start + limit + 12 s (the stop), or + its estimate. {}Queue rules: *first-fit*, *random* and the *spreadsheet* take jobs first come, first served, passing over what does not fit (no reservation). *first-fit+queue*, *labsync* and *labsync+prefetch* take them in the lab's order (tier, aged one tier per {} waited up to phd; fair share by 7-day decaying GPU time, waived once a job has waited as long; submit time), {}; first-fit+queue places blind to data (the best fit, data from the store), labsync by start time with data (peers first, a bounded wait for the data's node). Per-user cap: {}. labsync+prefetch runs on the lab workload only (its prefetch passes take ~10× labsync's time on the Philly traces). Preemption is not simulated: no job of these workloads is preemptible. Not simulated either: GPU memory sizes, failures.\n",
        report::dur(args.setup.reserve_after_secs as f64),
        workload_limit_share() * 100.0,
        labsync_bench::sim::engine::LIMIT_MAX,
        if args.setup.oracle { "(**--oracle**: this run told it true run times instead.) " } else { "" },
        args.setup.aging_secs.map_or("never".into(), |s| report::dur(s as f64)),
        if args.setup.backfill {
            "with EASY backfill (the first job that cannot start, once it has waited the reservation age, holds the GPUs it waits for from when they are expected free; only a job whose limit ends before then may use them)"
        } else {
            "passing over what does not fit (no reservation: --no-backfill)"
        },
        args.setup.cap.map_or("none".into(), |c| format!("{c} GPUs")),
    );
    // The targets, one line per (workload, cache size).
    let mut summary = String::new();
    let mut met: Vec<(usize, usize)> = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for (w, gb, rows) in &done {
        let t = report::matrix_targets(rows, *gb <= 100);
        if names.is_empty() || t.len() > names.len() {
            names = t.iter().map(|x| x.0).collect();
        }
        let _ = write!(summary, "| {} | {gb} GB |", workloads[*w].name);
        for (k, name) in names.iter().enumerate() {
            if met.len() <= k {
                met.resize(k + 1, (0, 0));
            }
            match t.iter().find(|x| x.0 == *name) {
                Some((_, ok, fig)) => {
                    met[k].1 += 1;
                    met[k].0 += *ok as usize;
                    let _ = write!(summary, " {}{fig} |", if *ok { "" } else { "**no** " });
                }
                None => summary.push_str(" — |"),
            }
        }
        summary.push('\n');
    }
    md.push_str("## Targets (labsync against first-fit)\n\n| workload | cache |");
    for n in &names {
        let _ = write!(md, " {n} |");
    }
    md.push_str("\n|---|---|");
    for _ in &names {
        md.push_str("---|");
    }
    md.push('\n');
    md.push_str(&summary);
    md.push_str("| **met** | |");
    for (ok, of) in &met {
        let _ = write!(md, " {ok} of {of} |");
    }
    md.push_str("\n\n");
    for (w, gb, rows) in &done {
        if *gb == args.caches[0] {
            let _ = writeln!(
                md,
                "## {} ({} jobs)\n",
                workloads[*w].name,
                workloads[*w].jobs.len()
            );
            for n in &workloads[*w].notes {
                let _ = writeln!(md, "- {n}");
            }
            md.push('\n');
        }
        let _ = writeln!(md, "{gb} GB of cache per node:\n");
        report::matrix_table(&mut md, rows);
    }
    std::fs::write(&args.out, &md).map_err(|e| format!("{}: {e}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

fn workload_limit_share() -> f64 {
    labsync_bench::sim::engine::LIMIT_SHARE
}
