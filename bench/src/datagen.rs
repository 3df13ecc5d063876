//! Seeded, reproducible test data and the 1 % modification.
//!
//! Every byte comes from ChaCha8 streams with fixed seeds so two runs (and
//! two machines) benchmark identical trees. `rand` 0.8 / `rand_chacha` 0.3
//! are pinned through Cargo.lock because `gen_range` sampling is only stable
//! within a rand release.

use std::fs::{self, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rand::seq::index;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::chunks::changed_chunk_bytes;

/// Fixed seed of every data stream ("labsync!" in ASCII).
pub const SEED: u64 = 0x6c61_6273_796e_6321;
/// Separate stream for choosing and patching files, so changing the data
/// generator's consumption never silently changes which files get modified.
const MODIFY_STREAM: u64 = 0x6d6f_6469_6679;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatasetKind {
    /// Few large incompressible files (think super-resolution PNG frames).
    Sr,
    /// Many small files, half random, half source-code-like text.
    Small,
    /// A million tiny files (ImageNet, BasicSR's extracted sub-images).
    Million,
}

impl DatasetKind {
    /// The default data sets.
    pub const ALL: [DatasetKind; 2] = [DatasetKind::Sr, DatasetKind::Small];
    /// Every data set `--datasets` takes.
    pub const KNOWN: [DatasetKind; 3] = [DatasetKind::Sr, DatasetKind::Small, DatasetKind::Million];

    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::Sr => "sr",
            DatasetKind::Small => "small",
            DatasetKind::Million => "million",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::KNOWN.into_iter().find(|k| k.name() == s)
    }

    /// File count at `--scale 1`.
    pub fn base_files(self) -> usize {
        match self {
            DatasetKind::Sr => 400,
            DatasetKind::Small => 50_000,
            DatasetKind::Million => 1_000_000,
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            DatasetKind::Sr => "random (incompressible) files of 2.3-2.7 MB, flat directory",
            DatasetKind::Small => {
                "files of 1-16 KiB in 100 folders; half random bytes, half Python/Rust-like text"
            }
            DatasetKind::Million => "random files of 1-4 KiB in 1,000 folders",
        }
    }

    fn stream(self) -> u64 {
        match self {
            DatasetKind::Sr => 1,
            DatasetKind::Small => 2,
            DatasetKind::Million => 3,
        }
    }

    fn rng(self, extra: u64) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(SEED);
        rng.set_stream(self.stream() ^ extra);
        rng
    }
}

/// `base * scale`, rounded, but never zero so a tiny smoke run still has data.
pub fn scaled_count(base: usize, scale: f64) -> usize {
    ((base as f64 * scale).round() as usize).max(1)
}

/// A generated source tree.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub kind: DatasetKind,
    pub root: PathBuf,
    /// Paths relative to `root`, in generation order.
    pub files: Vec<PathBuf>,
    pub bytes: u64,
}

/// Writes `count` files of `kind` under `root` (which must not exist yet).
pub fn generate(kind: DatasetKind, count: usize, root: &Path) -> io::Result<Dataset> {
    fs::create_dir_all(root)?;
    let mut rng = kind.rng(0);
    let mut files = Vec::with_capacity(count);
    let mut bytes = 0u64;
    let mut buf = Vec::new();
    let folders = count.min(100);
    for i in 0..count {
        let rel = match kind {
            DatasetKind::Sr => {
                buf.resize(rng.gen_range(2_300_000..=2_700_000), 0);
                rng.fill_bytes(&mut buf);
                PathBuf::from(format!("{:04}.png", i + 1))
            }
            DatasetKind::Small => {
                let size = rng.gen_range(1024..=16 * 1024);
                let dir = PathBuf::from(format!("d{:03}", i % folders));
                if i < folders {
                    fs::create_dir_all(root.join(&dir))?;
                }
                if i % 2 == 0 {
                    buf.resize(size, 0);
                    rng.fill_bytes(&mut buf);
                    dir.join(format!("f{i:05}.bin"))
                } else {
                    let lang = if rng.gen_bool(0.5) {
                        Lang::Python
                    } else {
                        Lang::Rust
                    };
                    buf = source_text(&mut rng, size, lang);
                    dir.join(format!("f{i:05}.{}", lang.ext()))
                }
            }
            DatasetKind::Million => {
                let dir = PathBuf::from(format!("d{:04}", i % count.min(1000)));
                if i < count.min(1000) {
                    fs::create_dir_all(root.join(&dir))?;
                }
                buf.resize(rng.gen_range(1024..=4096), 0);
                rng.fill_bytes(&mut buf);
                dir.join(format!("f{i:07}.bin"))
            }
        };
        fs::write(root.join(&rel), &buf)?;
        bytes += buf.len() as u64;
        files.push(rel);
    }
    Ok(Dataset {
        kind,
        root: root.to_path_buf(),
        files,
        bytes,
    })
}

/// What the 1 % step changed, for the report and the added-bytes budget.
#[derive(Debug, Clone, Default)]
pub struct Modification {
    pub files: Vec<PathBuf>,
    pub bytes_overwritten: u64,
    /// Sum of [`changed_chunk_bytes`] over the modified files.
    pub changed_chunk_bytes: u64,
}

/// Overwrites `patch` bytes (fewer if the file is shorter) at a random offset
/// in `fraction` of the files, in place. In place on purpose: size and inode
/// stay the same, as with a real edit, so tools must notice mtime/ctime or
/// content rather than a size change.
pub fn modify(ds: &Dataset, fraction: f64, patch: usize) -> io::Result<Modification> {
    let mut rng = ds.kind.rng(MODIFY_STREAM);
    let n = ds.files.len();
    let k = scaled_count(n, fraction).min(n);
    let mut picked = index::sample(&mut rng, n, k).into_vec();
    picked.sort_unstable();
    let mut out = Modification::default();
    for i in picked {
        let rel = &ds.files[i];
        let path = ds.root.join(rel);
        let old = fs::read(&path)?;
        let len = patch.min(old.len());
        let off = rng.gen_range(0..=old.len() - len);
        let mut new = old.clone();
        rng.fill_bytes(&mut new[off..off + len]);
        let mut f = OpenOptions::new().write(true).open(&path)?;
        f.seek(SeekFrom::Start(off as u64))?;
        f.write_all(&new[off..off + len])?;
        out.bytes_overwritten += len as u64;
        out.changed_chunk_bytes += changed_chunk_bytes(&old, &new);
        out.files.push(rel.clone());
    }
    Ok(out)
}

#[derive(Clone, Copy)]
enum Lang {
    Python,
    Rust,
}

impl Lang {
    fn ext(self) -> &'static str {
        match self {
            Lang::Python => "py",
            Lang::Rust => "rs",
        }
    }
}

const WORDS: &[&str] = &[
    "data", "index", "chunk", "value", "buffer", "path", "config", "result", "error", "count",
    "offset", "len", "node", "tree", "item", "key", "cache", "store", "pack", "reader", "writer",
    "stream", "hash", "size", "name", "file", "entry", "record", "parse", "load", "save", "update",
    "build", "check", "merge", "split", "filter", "apply", "state", "context", "batch", "sample",
    "model", "layer", "input", "output", "weight", "grad", "loss", "step", "epoch", "train",
    "eval", "metric", "logger", "device", "tensor", "shape", "dtype", "queue", "worker", "task",
    "event", "handle", "request", "response", "client", "server", "token", "session", "user",
    "table", "column", "row", "schema", "query", "limit", "timeout", "retry",
];

const RUST_TYPES: &[&str] = &[
    "u64",
    "usize",
    "String",
    "Vec<u8>",
    "Option<u32>",
    "Result<()>",
    "&str",
    "bool",
    "f32",
    "HashMap<String, u64>",
    "PathBuf",
    "Arc<Mutex<State>>",
];

fn word(rng: &mut impl Rng) -> &'static str {
    WORDS[rng.gen_range(0..WORDS.len())]
}

fn rust_type(rng: &mut impl Rng) -> &'static str {
    RUST_TYPES[rng.gen_range(0..RUST_TYPES.len())]
}

fn camel(rng: &mut impl Rng) -> String {
    let w = word(rng);
    let mut s = w[..1].to_ascii_uppercase();
    s.push_str(&w[1..]);
    s
}

/// Pseudo source code: template lines filled from a small vocabulary, so it
/// compresses roughly like real code (repetitive tokens, indentation).
fn source_text(rng: &mut impl Rng, size: usize, lang: Lang) -> Vec<u8> {
    let mut out = String::with_capacity(size + 128);
    while out.len() < size {
        let line = match lang {
            Lang::Python => python_line(rng),
            Lang::Rust => rust_line(rng),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out.truncate(size);
    out.into_bytes()
}

fn python_line(rng: &mut impl Rng) -> String {
    let ind = "    ".repeat(rng.gen_range(0..3));
    match rng.gen_range(0..12) {
        0 => format!(
            "def {}_{}(self, {}, {}=None):",
            word(rng),
            word(rng),
            word(rng),
            word(rng)
        ),
        1 => format!("class {}{}({}):", camel(rng), camel(rng), camel(rng)),
        2 => format!(
            "{ind}{} = {}.{}({}, {})",
            word(rng),
            word(rng),
            word(rng),
            word(rng),
            rng.gen_range(0..4096)
        ),
        3 => format!(
            "{ind}if {} is None or len({}) > {}:",
            word(rng),
            word(rng),
            rng.gen_range(0..100)
        ),
        4 => format!(
            "{ind}return {}[{}:{}]",
            word(rng),
            rng.gen_range(0..16),
            rng.gen_range(16..64)
        ),
        5 => format!(
            "{ind}for {} in self.{}_{}:",
            word(rng),
            word(rng),
            word(rng)
        ),
        6 => format!(
            "{ind}# {} {} {} {} {}",
            word(rng),
            word(rng),
            word(rng),
            word(rng),
            word(rng)
        ),
        7 => format!("{ind}self.{}_{} = {}", word(rng), word(rng), word(rng)),
        8 => format!("from {}.{} import {}", word(rng), word(rng), camel(rng)),
        9 => format!(
            "{ind}raise ValueError(f\"{} {}: {{{}}}\")",
            word(rng),
            word(rng),
            word(rng)
        ),
        10 => format!("{ind}{}.append({}({}))", word(rng), word(rng), word(rng)),
        _ => String::new(),
    }
}

fn rust_line(rng: &mut impl Rng) -> String {
    let ind = "    ".repeat(rng.gen_range(0..3));
    match rng.gen_range(0..12) {
        0 => format!(
            "pub fn {}_{}(&self, {}: {}) -> {} {{",
            word(rng),
            word(rng),
            word(rng),
            rust_type(rng),
            rust_type(rng)
        ),
        1 => format!(
            "{ind}let {} = self.{}.{}({})?;",
            word(rng),
            word(rng),
            word(rng),
            word(rng)
        ),
        2 => format!(
            "{ind}let mut {}: {} = {}::new();",
            word(rng),
            rust_type(rng),
            camel(rng)
        ),
        3 => format!(
            "{ind}if {}.{}() > {} {{",
            word(rng),
            word(rng),
            rng.gen_range(0..1000)
        ),
        4 => format!("{ind}}}"),
        5 => format!(
            "{ind}// {} {} {} {} {}",
            word(rng),
            word(rng),
            word(rng),
            word(rng),
            word(rng)
        ),
        6 => format!(
            "{ind}{}.{}({}, {});",
            word(rng),
            word(rng),
            word(rng),
            rng.gen_range(0..4096)
        ),
        7 => format!("use crate::{}::{};", word(rng), camel(rng)),
        8 => format!("{ind}match {} {{", word(rng)),
        9 => "#[derive(Debug, Clone)]".to_string(),
        10 => format!("pub struct {}{} {{", camel(rng), camel(rng)),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("labsync-bench-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn generation_is_reproducible() {
        let (a, b) = (tmp("gen-a"), tmp("gen-b"));
        let da = generate(DatasetKind::Small, 40, &a).unwrap();
        let db = generate(DatasetKind::Small, 40, &b).unwrap();
        assert_eq!(da.files, db.files);
        assert_eq!(da.bytes, db.bytes);
        for f in &da.files {
            let len = fs::metadata(a.join(f)).unwrap().len();
            assert!((1024..=16384).contains(&len));
            assert_eq!(fs::read(a.join(f)).unwrap(), fs::read(b.join(f)).unwrap());
        }
        assert!(da.files.iter().any(|f| f.extension().unwrap() == "bin"));
        assert!(da.files.iter().any(|f| f.extension().unwrap() != "bin"));
        let ma = modify(&da, 0.1, 4096).unwrap();
        let mb = modify(&db, 0.1, 4096).unwrap();
        assert_eq!(ma.files, mb.files);
        assert_eq!(ma.files.len(), 4);
        // Small files are one chunk each, so the whole file is "changed".
        let total: u64 = ma
            .files
            .iter()
            .map(|f| fs::metadata(a.join(f)).unwrap().len())
            .sum();
        assert_eq!(ma.changed_chunk_bytes, total);
        fs::remove_dir_all(a).unwrap();
        fs::remove_dir_all(b).unwrap();
    }

    #[test]
    fn the_million_set_is_tiny_random_files_in_1000_folders() {
        let root = tmp("million");
        let d = generate(DatasetKind::Million, 1200, &root).unwrap();
        assert_eq!(d.files.len(), 1200);
        for f in &d.files {
            let len = fs::metadata(root.join(f)).unwrap().len();
            assert!((1024..=4096).contains(&len), "{len}");
        }
        let folders = fs::read_dir(&root).unwrap().count();
        assert_eq!(folders, 1000);
        assert_eq!(DatasetKind::parse("million"), Some(DatasetKind::Million));
        assert!(
            !DatasetKind::ALL.contains(&DatasetKind::Million),
            "not by default"
        );
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn text_is_ascii_and_exact_size() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let t = source_text(&mut rng, 5000, Lang::Rust);
        assert_eq!(t.len(), 5000);
        assert!(t.is_ascii());
    }
}
