//! The GPU inventory: what each GPU holds right now.
//!
//! [`GpuInventory`] is the one seam between labd and the hardware. NVML is the
//! real implementation; [`FakeGpus`](crate::FakeGpus) is driven by config for
//! tests and demos; [`NoGpus`] is what a node without the NVML library has,
//! chosen explicitly and logged, never a silent fake.

use serde::{Deserialize, Serialize};

use crate::devices::GpuDevices;
use crate::error::InventoryError;

/// A process holding memory on a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Process id (in the host's pid namespace).
    pub pid: u32,
    /// GPU memory it holds, when the driver says.
    pub used_bytes: Option<u64>,
}

/// One GPU as read from the inventory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index: PCI bus order, which is the `CUDA_VISIBLE_DEVICES`
    /// number only under `CUDA_DEVICE_ORDER=PCI_BUS_ID` (labd sets it for
    /// every job; CUDA's default order is fastest first).
    pub index: u32,
    /// Stable id, e.g. `GPU-5b3c…`.
    pub uuid: String,
    /// Model name.
    pub name: String,
    /// Memory installed, bytes.
    pub memory_total: u64,
    /// Memory in use, bytes.
    pub memory_used: u64,
    /// Utilisation in percent, when available.
    pub utilization: Option<u32>,
    /// Temperature in °C, when available.
    pub temperature: Option<u32>,
    /// Compute processes on it.
    pub processes: Vec<GpuProcess>,
}

/// Reads the GPUs of this node. Calls block and may hang (a wedged driver);
/// labd only calls through a [`Watchdog`](crate::Watchdog).
pub trait GpuInventory: Send + Sync + 'static {
    /// Every GPU with its memory and processes.
    fn read(&self) -> Result<Vec<GpuInfo>, InventoryError>;
    /// What this inventory is, for logs and `labrun status` (`nvml`, `fake 4x11GiB`, `none`).
    fn describe(&self) -> String;
    /// The GPUs' character devices, for keeping each job from the cards
    /// it did not lease ([`crate::devices`]); `None` without GPUs; the
    /// error says why they are not known. Blocks like [`GpuInventory::read`].
    fn devices(&self) -> Result<Option<GpuDevices>, crate::SetupError>;
}

/// The inventory of a node without GPUs (no NVML library).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoGpus;

impl GpuInventory for NoGpus {
    fn read(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        Ok(Vec::new())
    }

    fn describe(&self) -> String {
        "none (no NVML library on this node)".into()
    }

    fn devices(&self) -> Result<Option<GpuDevices>, crate::SetupError> {
        Ok(None)
    }
}

/// NVML through `nvml-wrapper`, which loads `libnvidia-ml.so` at run time.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
}

impl Nvml {
    /// Loads and initialises NVML.
    pub fn init() -> Result<Nvml, InventoryError> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| Nvml { nvml })
            .map_err(|e| InventoryError::Unavailable(e.to_string()))
    }
}

impl GpuInventory for Nvml {
    fn read(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        let err = |what: &str, e: nvml_wrapper::error::NvmlError| {
            InventoryError::Failed(format!("{what}: {e}"))
        };
        let n = self
            .nvml
            .device_count()
            .map_err(|e| err("device count", e))?;
        let mut out = Vec::with_capacity(n as usize);
        for index in 0..n {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| err(&format!("GPU {index}"), e))?;
            let mem = d
                .memory_info()
                .map_err(|e| err(&format!("memory of GPU {index}"), e))?;
            let compute = d
                .running_compute_processes()
                .map_err(|e| err(&format!("processes of GPU {index}"), e))?;
            // An X server, a visualiser or an OpenGL renderer holds memory
            // as surely as a CUDA process does.
            let graphics = d
                .running_graphics_processes()
                .map_err(|e| err(&format!("graphics processes of GPU {index}"), e))?;
            let used = |p: &nvml_wrapper::struct_wrappers::device::ProcessInfo| GpuProcess {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                },
            };
            out.push(GpuInfo {
                index,
                uuid: d.uuid().unwrap_or_default(),
                name: d.name().unwrap_or_default(),
                memory_total: mem.total,
                memory_used: mem.used,
                utilization: d.utilization_rates().ok().map(|u| u.gpu),
                temperature: d
                    .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                    .ok(),
                processes: merge_processes(
                    compute.iter().map(used).collect(),
                    graphics.iter().map(used).collect(),
                ),
            });
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        let driver = self
            .nvml
            .sys_driver_version()
            .unwrap_or_else(|_| "?".into());
        format!("nvml (driver {driver})")
    }

    /// Each card's minor from NVML; the major from `/dev/nvidiactl`, the
    /// driver's control device, which every CUDA program opens.
    fn devices(&self) -> Result<Option<GpuDevices>, crate::SetupError> {
        let (major, _) = GpuDevices::of_node(std::path::Path::new("/dev/nvidiactl"))?;
        let n = self
            .nvml
            .device_count()
            .map_err(|e| crate::SetupError::Devices(format!("device count: {e}")))?;
        let mut minors = std::collections::BTreeMap::new();
        for index in 0..n {
            let minor = self
                .nvml
                .device_by_index(index)
                .and_then(|d| d.minor_number())
                .map_err(|e| {
                    crate::SetupError::Devices(format!("minor number of GPU {index}: {e}"))
                })?;
            minors.insert(index, minor);
        }
        Ok(Some(GpuDevices { major, minors }))
    }
}

/// One entry per pid from NVML's compute and graphics lists: a process in
/// both (CUDA and OpenGL in one program) is reported with the larger figure
/// NVML gives for it, not twice.
fn merge_processes(compute: Vec<GpuProcess>, graphics: Vec<GpuProcess>) -> Vec<GpuProcess> {
    let mut out: Vec<GpuProcess> = Vec::with_capacity(compute.len() + graphics.len());
    for p in compute.into_iter().chain(graphics) {
        match out.iter_mut().find(|q| q.pid == p.pid) {
            Some(q) => {
                q.used_bytes = match (q.used_bytes, p.used_bytes) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                }
            }
            None => out.push(p),
        }
    }
    out
}

/// NVML when its library loads, otherwise [`NoGpus`]; says which in the log, once.
pub fn detect() -> Box<dyn GpuInventory> {
    match Nvml::init() {
        Ok(n) => {
            tracing::info!("GPU inventory: {}", n.describe());
            Box::new(n)
        }
        Err(e) => {
            tracing::info!("no NVML ({e}); this node has no GPUs");
            Box::new(NoGpus)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 9, point 13: graphics processes hold a GPU as compute ones do.
    #[test]
    fn graphics_processes_count_once_each() {
        let p = |pid, b: Option<u64>| GpuProcess { pid, used_bytes: b };
        let merged = merge_processes(
            vec![p(1, Some(100)), p(2, Some(5))],
            vec![p(3, Some(7)), p(2, Some(9)), p(1, None)],
        );
        assert_eq!(merged, vec![p(1, None), p(2, Some(9)), p(3, Some(7))]);
    }

    /// Without the NVML library the node has no GPUs; it never falls back to a fake.
    #[test]
    fn detect_is_nvml_or_no_gpus() {
        let inv = detect();
        match Nvml::init() {
            Ok(_) => assert!(inv.describe().starts_with("nvml"), "{}", inv.describe()),
            Err(_) => {
                assert!(inv.describe().starts_with("none"), "{}", inv.describe());
                assert!(inv.read().unwrap().is_empty());
            }
        }
    }
}
