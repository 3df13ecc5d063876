//! A fake GPU inventory driven by config, for tests and demos.
//!
//! `fake_gpus = "4x11GiB"` gives four 11 GiB GPUs. An optional control file
//! (TOML, re-read on every call) injects what real nodes suffer:
//!
//! ```toml
//! hang = true                                        # every call blocks until this is false again
//! foreign = [{ gpu = 0, pid = 4242, mib = 3000 }]    # a process labd did not start
//! utilization = [{ gpu = 1, percent = 80 }]          # computing (default 0%)
//! reserved = [{ gpu = 0, mib = 400 }]                # used with no process, as real idle cards report
//! ```
//! The hang is real: the calling thread blocks, exactly like a wedged driver.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::devices::GpuDevices;
use crate::error::InventoryError;
use crate::gpu::{GpuInfo, GpuInventory, GpuProcess};

/// GPUs that exist only in config.
#[derive(Debug, Clone)]
pub struct FakeGpus {
    spec: String,
    sizes: Vec<u64>,
    control: Option<PathBuf>,
    /// A folder with a character device `nvidia<i>` for each GPU `i`
    /// (`fake_gpus_dev`), which jobs are confined to as to real cards.
    dev: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Control {
    #[serde(default)]
    hang: bool,
    #[serde(default)]
    foreign: Vec<Foreign>,
    /// Processes to report as running on a GPU (e.g. a job's own pid).
    #[serde(default)]
    processes: Vec<Foreign>,
    /// GPUs to report busy computing.
    #[serde(default)]
    utilization: Vec<Busy>,
    /// Memory a GPU reports used with no process on it (the driver's own:
    /// a real idle card never reports all its memory free).
    #[serde(default)]
    reserved: Vec<Reserved>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Reserved {
    gpu: u32,
    mib: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Busy {
    gpu: u32,
    percent: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Foreign {
    gpu: u32,
    pid: u32,
    mib: u64,
}

/// `11GiB`, `512MiB`, `24G` → bytes.
fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim_end_matches("iB").trim_end_matches('B') {
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

impl FakeGpus {
    /// Parses `NxSIZE[,NxSIZE…]`, e.g. `4x11GiB` or `2x24GiB,1x80GiB`.
    pub fn new(spec: &str, control: Option<PathBuf>) -> Result<FakeGpus, InventoryError> {
        let bad =
            || InventoryError::BadSpec(format!("{spec:?}: write e.g. 4x11GiB or 2x24GiB,1x80GiB"));
        let mut sizes = Vec::new();
        for part in spec.split(',') {
            let (n, size) = part.trim().split_once('x').ok_or_else(bad)?;
            let n: usize = n.parse().map_err(|_| bad())?;
            let size = parse_size(size).ok_or_else(bad)?;
            sizes.extend(std::iter::repeat_n(size, n));
        }
        if sizes.is_empty() || sizes.len() > 64 {
            return Err(bad());
        }
        Ok(FakeGpus {
            spec: spec.to_string(),
            sizes,
            control,
            dev: None,
        })
    }

    /// The GPUs' device nodes are `dev/nvidia<i>` (made by a test with
    /// `mknod`, of one major).
    pub fn with_devices(mut self, dev: PathBuf) -> FakeGpus {
        self.dev = Some(dev);
        self
    }

    fn control(&self) -> Result<Control, InventoryError> {
        let Some(path) = &self.control else {
            return Ok(Control::default());
        };
        match std::fs::read_to_string(path) {
            Ok(t) => toml::from_str(&t)
                .map_err(|e| InventoryError::BadSpec(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Control::default()),
            Err(e) => Err(InventoryError::BadSpec(format!("{}: {e}", path.display()))),
        }
    }
}

impl GpuInventory for FakeGpus {
    fn read(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        let mut ctl = self.control()?;
        while ctl.hang {
            std::thread::sleep(Duration::from_millis(50));
            ctl = self.control()?;
        }
        let mut gpus: Vec<GpuInfo> = self
            .sizes
            .iter()
            .enumerate()
            .map(|(i, &total)| GpuInfo {
                index: i as u32,
                uuid: format!("GPU-fake-{i:04}"),
                name: "Fake GPU".into(),
                memory_total: total,
                memory_used: 0,
                utilization: Some(0),
                temperature: Some(30),
                processes: Vec::new(),
            })
            .collect();
        for b in &ctl.utilization {
            let n = gpus.len();
            let g = gpus.get_mut(b.gpu as usize).ok_or_else(|| {
                InventoryError::BadSpec(format!("utilization of GPU {} but only {n} GPUs", b.gpu))
            })?;
            g.utilization = Some(b.percent.min(100));
        }
        for r in &ctl.reserved {
            let n = gpus.len();
            let g = gpus.get_mut(r.gpu as usize).ok_or_else(|| {
                InventoryError::BadSpec(format!("reserved on GPU {} but only {n} GPUs", r.gpu))
            })?;
            g.memory_used = (r.mib.saturating_mul(1 << 20)).min(g.memory_total);
        }
        for f in ctl.foreign.iter().chain(&ctl.processes) {
            let g = gpus.get_mut(f.gpu as usize).ok_or_else(|| {
                InventoryError::BadSpec(format!(
                    "process {} on GPU {} but only {} GPUs",
                    f.pid,
                    f.gpu,
                    self.sizes.len()
                ))
            })?;
            let bytes = f.mib.saturating_mul(1 << 20);
            g.memory_used = g.memory_used.saturating_add(bytes);
            g.processes.push(GpuProcess {
                pid: f.pid,
                used_bytes: Some(bytes),
            });
        }
        Ok(gpus)
    }

    fn describe(&self) -> String {
        format!("fake {}", self.spec)
    }

    fn devices(&self) -> Result<Option<GpuDevices>, crate::SetupError> {
        let Some(dev) = &self.dev else {
            return Err(crate::SetupError::Devices(
                "the fake GPUs have no device nodes (fake_gpus_dev)".into(),
            ));
        };
        let mut major = None;
        let mut minors = std::collections::BTreeMap::new();
        for i in 0..self.sizes.len() as u32 {
            let (ma, mi) = GpuDevices::of_node(&dev.join(format!("nvidia{i}")))?;
            if *major.get_or_insert(ma) != ma {
                return Err(crate::SetupError::Devices(format!(
                    "{}: the fake GPUs' majors differ",
                    dev.display()
                )));
            }
            minors.insert(i, mi);
        }
        Ok(Some(GpuDevices {
            major: major.unwrap_or(0),
            minors,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let f = FakeGpus::new("4x11GiB", None).unwrap();
        let g = f.read().unwrap();
        assert_eq!(g.len(), 4);
        assert_eq!(g[3].memory_total, 11 << 30);
        assert_eq!(
            FakeGpus::new("2x24GiB,1x80G", None)
                .unwrap()
                .read()
                .unwrap()
                .len(),
            3
        );
        for bad in ["", "4", "x11GiB", "4x11", "4x11Qb", "100x1GiB"] {
            assert!(FakeGpus::new(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn control_file_injects_foreign_processes() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = dir.path().join("ctl.toml");
        std::fs::write(&ctl, "foreign = [{ gpu = 1, pid = 4242, mib = 3000 }]\n").unwrap();
        let f = FakeGpus::new("2x11GiB", Some(ctl.clone())).unwrap();
        let g = f.read().unwrap();
        assert_eq!(
            g[1].processes,
            vec![GpuProcess {
                pid: 4242,
                used_bytes: Some(3000 << 20)
            }]
        );
        assert_eq!(g[1].memory_used, 3000 << 20);
        std::fs::write(&ctl, "foreign = [{ gpu = 7, pid = 1, mib = 1 }]\n").unwrap();
        assert!(f.read().is_err());
    }
}
