//! Workloads for the placement simulator: Gavel's Philly-derived traces
//! (any folder of `.trace` files in their format) and the lab's own
//! super-resolution workload from a seeded generator.

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bytes in a GB (datasets are sized in decimal units, as published).
pub const GB: u64 = 1_000_000_000;

/// Datasets are cut into packs of at most this many bytes: what a node
/// caches and fetches, and what two datasets share.
pub const PACK: u64 = GB;

/// A dataset: the packs it reads (shared packs are shared chunks).
#[derive(Clone, Debug)]
pub struct Dataset {
    pub name: String,
    /// Pack numbers (global) and their sizes.
    pub packs: Vec<(u32, u64)>,
}

impl Dataset {
    pub fn bytes(&self) -> u64 {
        self.packs.iter().map(|p| p.1).sum()
    }
}

/// What a job does with its GPUs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// Runs for `Job::secs` and ends.
    Batch,
    /// An interactive hold (`labrun --hold`): the GPUs are held for
    /// `Job::secs`, but used only for the first `active` seconds.
    Hold { active: f64 },
}

/// One job of a workload.
#[derive(Clone, Debug)]
pub struct Job {
    pub id: u32,
    pub user: u16,
    /// Tier index into the default ladder (0 lead … 4 undergraduate).
    pub tier: u8,
    /// Seconds from the start of the workload.
    pub submit: f64,
    pub gpus: u32,
    /// Run time on `gpus` GPUs once its data is there, seconds.
    pub secs: f64,
    pub data: Option<usize>,
    pub kind: Kind,
}

/// Jobs, datasets and users.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    /// How it was made, for the report.
    pub notes: Vec<String>,
    pub datasets: Vec<Dataset>,
    pub jobs: Vec<Job>,
    /// Users, with their own tiers.
    pub users: Vec<u8>,
}

/// Builds datasets out of shared and fresh packs.
#[derive(Default)]
struct Packer {
    next: u32,
    datasets: Vec<Dataset>,
}

impl Packer {
    fn fresh(&mut self, bytes: u64) -> Vec<(u32, u64)> {
        let mut out = Vec::new();
        let mut left = bytes.max(1);
        while left > 0 {
            let b = left.min(PACK);
            out.push((self.next, b));
            self.next += 1;
            left -= b;
        }
        out
    }

    fn add(&mut self, name: &str, packs: Vec<(u32, u64)>) -> usize {
        self.datasets.push(Dataset {
            name: name.to_string(),
            packs,
        });
        self.datasets.len() - 1
    }
}

/// Users' tiers: 2 project leads, 12 PhD students, 10 master's, 6
/// undergraduates (tier indices of the default ladder).
fn lab_users(n: usize) -> Vec<u8> {
    (0..n)
        .map(|u| match u * 30 / n.max(1) {
            0..2 => 0,
            2..14 => 2,
            14..24 => 3,
            _ => 4,
        })
        .collect()
}

/// Sizes of the datasets in Gavel's traces (approximate public sizes).
fn philly_dataset_gb(name: &str) -> f64 {
    match name {
        "imagenet" => 145.0,
        "cifar10" => 0.17,
        "ml-20m" => 0.9,
        "monet2photo" => 0.3,
        "translation" => 0.1,
        "wikitext2" => 0.01,
        _ => 1.0,
    }
}

/// Steps per second of each job type on one V100, and at larger scale
/// factors where the json has them.
pub struct Throughputs(HashMap<(String, u32), f64>);

impl Throughputs {
    /// Reads Gavel's `simulation_throughputs.json` (its `v100` table).
    pub fn read(path: &Path) -> Result<Throughputs, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let table = v
            .get("v100")
            .and_then(|t| t.as_object())
            .ok_or_else(|| format!("{}: no v100 table", path.display()))?;
        let mut out = HashMap::new();
        for (key, per) in table {
            // "('ResNet-50 (batch size 128)', 1)"
            let Some(inner) = key.strip_prefix("('").and_then(|k| k.strip_suffix(')')) else {
                continue;
            };
            let Some((name, scale)) = inner.rsplit_once("', ") else {
                continue;
            };
            let (Ok(scale), Some(alone)) = (
                scale.trim().parse::<u32>(),
                per.get("null").and_then(|x| x.as_f64()),
            ) else {
                continue;
            };
            out.insert((name.to_string(), scale), alone);
        }
        Ok(Throughputs(out))
    }

    /// Steps per second of `job_type` on `gpus` GPUs: the json's figure for
    /// that scale, else the 1-GPU figure times `gpus` (linear scaling, an
    /// assumption).
    pub fn of(&self, job_type: &str, gpus: u32) -> Option<f64> {
        self.0
            .get(&(job_type.to_string(), gpus))
            .copied()
            .or_else(|| {
                self.0
                    .get(&(job_type.to_string(), 1))
                    .map(|t| t * gpus as f64)
            })
    }
}

/// Reads every `.trace` file of `dir` (Gavel's format), in name order, as
/// one workload. Jobs asking for more than `max_gpus` GPUs are capped to
/// it with their GPU time kept (they run longer); users are assigned from
/// a seeded generator (the traces have none).
pub fn philly(
    dir: &Path,
    only: Option<&str>,
    tp: &Throughputs,
    max_gpus: u32,
    users: usize,
    seed: u64,
) -> Result<Workload, String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "trace"))
        .filter(|p| only.is_none_or(|o| p.file_name().is_some_and(|f| f.to_string_lossy() == o)))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "{}: no {} here",
            dir.display(),
            only.unwrap_or(".trace files")
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tiers = lab_users(users);
    let mut packer = Packer::default();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    let mut jobs = Vec::new();
    let (mut capped, mut no_data) = (0usize, 0usize);
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: &str| format!("{}:{}: {what}", f.display(), n + 1);
            let fields: Vec<&str> = line.split('\t').collect();
            if fields.len() != 7 {
                return Err(bad(&format!("{} fields, expected 7", fields.len())));
            }
            let steps: f64 = fields[4].trim().parse().map_err(|_| bad("total steps"))?;
            let arrival: f64 = fields[5].trim().parse().map_err(|_| bad("arrival time"))?;
            let asked: u32 = fields[6].trim().parse().map_err(|_| bad("GPU count"))?;
            let asked = asked.max(1);
            let rate = tp
                .of(fields[0], asked)
                .ok_or_else(|| bad(&format!("no throughput for {:?}", fields[0])))?;
            let mut secs = steps / rate;
            let gpus = if asked > max_gpus {
                capped += 1;
                secs *= asked as f64 / max_gpus as f64;
                max_gpus
            } else {
                asked
            };
            let data = match fields[1].split("%s/data/").nth(1) {
                Some(rest) => {
                    // `%s/data/cifar10 --batch_size 32`: the name ends at
                    // a `/` or a space (issue 45: it ended at `/` only, so
                    // `cifar10 --batch_size 32` was a 1 GB dataset of its own).
                    let name = (rest.split(|c: char| c == '/' || c.is_whitespace()))
                        .next()
                        .unwrap_or(rest)
                        .to_string();
                    let i = match by_name.get(&name) {
                        Some(&i) => i,
                        None => {
                            let bytes = (philly_dataset_gb(&name) * GB as f64) as u64;
                            let packs = packer.fresh(bytes);
                            let i = packer.add(&name, packs);
                            by_name.insert(name, i);
                            i
                        }
                    };
                    Some(i)
                }
                None => {
                    no_data += 1;
                    None
                }
            };
            let user = rng.gen_range(0..users) as u16;
            jobs.push(Job {
                id: 0,
                user,
                tier: tiers[user as usize],
                submit: arrival,
                gpus,
                secs: secs.max(1.0),
                data,
                kind: Kind::Batch,
            });
        }
    }
    jobs.sort_by(|a, b| a.submit.total_cmp(&b.submit));
    for (i, j) in jobs.iter_mut().enumerate() {
        j.id = i as u32;
    }
    let names: Vec<String> = files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let notes = vec![
        format!(
            "Gavel's Philly-derived trace {} ({} jobs), arrivals as recorded (no time scaling)",
            names.join(", "),
            jobs.len()
        ),
        format!(
            "run time = total steps / V100 throughput alone (json; 1-GPU figure × GPUs where a scale is missing); an RTX 2080 Ti taken to train like a V100"
        ),
        format!(
            "{capped} jobs asking for more than {max_gpus} GPUs capped to {max_gpus}, run time stretched to keep their GPU-hours; {no_data} jobs read no dataset"
        ),
        format!(
            "dataset sizes (GB): imagenet 145, ml-20m 0.9, monet2photo 0.3, cifar10 0.17, translation 0.1, wikitext2 0.01; users: {users}, assigned at random (seeded), tiers as the lab's"
        ),
    ];
    Ok(Workload {
        name: names.join("+"),
        notes,
        datasets: packer.datasets,
        jobs,
        users: tiers,
    })
}

/// The lab's super-resolution workload, as `../shared/traces/README.md`
/// describes it. `days` of work for 30 users on 32 GPUs; `load` scales
/// the arrival rate (1.0: about 80% of the GPUs' time asked for).
pub fn lab(seed: u64, days: f64, load: f64) -> Workload {
    const USERS: usize = 30;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut p = Packer::default();
    let div2k_packs = p.fresh(7 * GB);
    let flickr_packs = p.fresh(25 * GB);
    let div2k = p.add("DIV2K", div2k_packs.clone());
    let flickr = p.add("Flickr2K", flickr_packs.clone());
    let df2k = p.add("DF2K", [div2k_packs, flickr_packs].concat());
    let sub = p.fresh(10 * GB);
    let div2k_sub = p.add("DIV2K-sub", sub);
    let eval = p.fresh(GB / 2);
    let eval = p.add("Set5+Set14+B100+Urban100", eval);
    let imagenet = p.fresh(145 * GB);
    let imagenet = p.add("ImageNet", imagenet);
    let shared = [
        (df2k, 0.30),
        (div2k, 0.20),
        (flickr, 0.05),
        (div2k_sub, 0.10),
        (imagenet, 0.05),
    ];
    // Each user's own derived data: 1-3 sets of 5-50 GB.
    let own: Vec<Vec<usize>> = (0..USERS)
        .map(|u| {
            (0..rng.gen_range(1..=3))
                .map(|k| {
                    let gb = rng.gen_range(5..=50);
                    let packs = p.fresh(gb * GB);
                    p.add(&format!("user{u}-derived{k}"), packs)
                })
                .collect()
        })
        .collect();
    let tiers = lab_users(USERS);
    let span = days * 86_400.0;
    // Deadline bursts: every three weeks or so, 3-5 users hold a grant
    // for 7 days, submit twice as much, and run at the deadline tier.
    let mut bursts: Vec<(f64, f64, Vec<usize>)> = Vec::new();
    let mut t = rng.gen_range(5.0..15.0) * 86_400.0;
    while t < span {
        let n = rng.gen_range(3..=5);
        let who: Vec<usize> = (0..n).map(|_| rng.gen_range(2..USERS)).collect();
        bursts.push((t, t + 7.0 * 86_400.0, who));
        t += rng.gen_range(18.0..25.0) * 86_400.0;
    }
    let mut jobs = Vec::new();
    for u in 0..USERS {
        // Current dataset, changed every 2-4 weeks.
        let mut current = pick(&mut rng, &shared, &own[u]);
        let mut switch = rng.gen_range(14.0..28.0) * 86_400.0;
        // Trainings (1-3 days on 1-4 GPUs: 5.2 GPU-days each), debugging
        // runs and holds, as Poisson arrivals per user: at load 1, 0.14 +
        // 1.33 + 0.5 a day each, about 80% of 32 GPUs' time.
        let day = 86_400.0;
        let rates = [
            (0.14 * load / day, 0u8),
            (1.33 * load / day, 1),
            (0.5 * load / day, 2),
        ];
        for (rate, what) in rates {
            let mut t = 0.0;
            loop {
                let in_burst = bursts
                    .iter()
                    .any(|(a, b, who)| t >= *a && t < *b && who.contains(&u));
                let r = if in_burst { rate * 2.0 } else { rate };
                t += -rng.gen::<f64>().max(1e-12).ln() / r;
                if t >= span {
                    break;
                }
                while t >= switch {
                    current = pick(&mut rng, &shared, &own[u]);
                    switch += rng.gen_range(14.0..28.0) * 86_400.0;
                }
                let deadline = bursts
                    .iter()
                    .any(|(a, b, who)| t >= *a && t < *b && who.contains(&u));
                let tier = if deadline && tiers[u] > 1 {
                    1
                } else {
                    tiers[u]
                };
                let (gpus, secs, data, kind) = match what {
                    0 => (
                        *[1, 2, 2, 4, 4].get(rng.gen_range(0..5)).unwrap_or(&1),
                        rng.gen_range(1.0..3.0) * 86_400.0,
                        Some(current),
                        Kind::Batch,
                    ),
                    1 => (
                        1,
                        rng.gen_range(5.0..60.0) * 60.0,
                        Some(if rng.gen_bool(0.2) { eval } else { current }),
                        Kind::Batch,
                    ),
                    _ => {
                        let held = rng.gen_range(2.0..8.0) * 3600.0;
                        let active = rng.gen_range(15.0..60.0) * 60.0;
                        (1, held, Some(current), Kind::Hold { active })
                    }
                };
                jobs.push(Job {
                    id: 0,
                    user: u as u16,
                    tier,
                    submit: t,
                    gpus,
                    secs,
                    data,
                    kind,
                });
            }
        }
    }
    jobs.sort_by(|a, b| a.submit.total_cmp(&b.submit));
    for (i, j) in jobs.iter_mut().enumerate() {
        j.id = i as u32;
    }
    let total: u64 = p
        .datasets
        .iter()
        .filter(|d| d.name != "DF2K")
        .map(Dataset::bytes)
        .sum();
    let notes = vec![
        format!(
            "the lab's super-resolution workload, seed {seed}: {USERS} users (2 leads, 12 PhD, 10 master's, 6 undergraduates), {days} days, load ×{load}, {} jobs",
            jobs.len()
        ),
        "per user, Poisson arrivals of trainings (1-3 days, 1/2/2/4/4 GPUs), debugging runs (5-60 min, 1 GPU, 20% on the evaluation sets) and interactive holds (2-8 h held, used for the first 15-60 min)".to_string(),
        format!(
            "deadline bursts: every 18-25 days 3-5 users get a 7-day grant ({} bursts), submit twice as much and run at the deadline tier",
            bursts.len()
        ),
        format!(
            "datasets: DIV2K 7 GB, Flickr2K 25 GB, DF2K = both (shares every pack), DIV2K-sub 10 GB, evaluation sets 0.5 GB, ImageNet 145 GB, and each user's 1-3 derived sets of 5-50 GB; {:.0} GB in all; a user keeps one dataset for 2-4 weeks",
            total as f64 / GB as f64
        ),
    ];
    Workload {
        name: format!("lab (seed {seed})"),
        notes,
        datasets: p.datasets,
        jobs,
        users: tiers,
    }
}

/// A user's next dataset: a shared one by its weight, else one of their own.
fn pick(rng: &mut ChaCha8Rng, shared: &[(usize, f64)], own: &[usize]) -> usize {
    let mut x: f64 = rng.gen();
    for &(d, w) in shared {
        if x < w {
            return d;
        }
        x -= w;
    }
    own[rng.gen_range(0..own.len())]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 45, a hand-checked trace: four jobs whose commands name
    /// `%s/data/cifar10 --batch_size 32`, `%s/data/cifar10/train`,
    /// `%s/data/cifar10 --batch_size 64` and `%s/data/imagenet`: two
    /// datasets, cifar10 of 0.17 GB and imagenet of 145 GB. The name used
    /// to end at `/` only, which made `cifar10 --batch_size 32` and
    /// `cifar10 --batch_size 64` datasets of their own at the 1 GB fallback.
    #[test]
    fn a_dataset_name_ends_at_a_slash_or_a_space() {
        let dir = tempfile::tempdir().unwrap();
        let tp = dir.path().join("tp.json");
        std::fs::write(
            &tp,
            r#"{"v100": {"('ResNet-18 (batch size 32)', 1)": {"null": 10.0}}}"#,
        )
        .unwrap();
        let line = |cmd: &str, at: u32| {
            format!("ResNet-18 (batch size 32)\tcd %s/w && python3 main.py {cmd}\t-n\t1\t1000\t{at}\t1\n")
        };
        let trace = line("--data_dir=%s/data/cifar10 --batch_size 32", 0)
            + &line("--data_dir=%s/data/cifar10/train", 1)
            + &line("--data_dir=%s/data/cifar10 --batch_size 64", 2)
            + &line("--data %s/data/imagenet/ --arch resnet50", 3);
        std::fs::write(dir.path().join("t.trace"), trace).unwrap();
        let w = philly(dir.path(), None, &Throughputs::read(&tp).unwrap(), 8, 2, 0).unwrap();
        let sizes: Vec<(&str, u64)> = (w.datasets.iter())
            .map(|d| (d.name.as_str(), d.packs.iter().map(|p| p.1).sum()))
            .collect();
        assert_eq!(sizes, [("cifar10", 170_000_000), ("imagenet", 145 * GB)]);
        let read: Vec<Option<usize>> = w.jobs.iter().map(|j| j.data).collect();
        assert_eq!(read, [Some(0), Some(0), Some(0), Some(1)]);
    }
}
