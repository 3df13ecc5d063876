//! The GPU inventory: what each GPU holds right now.
//!
//! [`GpuInventory`] is the one seam between labd and the hardware. NVML is the
//! real implementation; [`FakeGpus`](crate::FakeGpus) is driven by config for
//! tests and demos; [`NoGpus`] is what a node without the NVML library has,
//! chosen explicitly and logged, never a silent fake.

use serde::{Deserialize, Serialize};

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
    /// NVML index (the `CUDA_VISIBLE_DEVICES` number with default ordering).
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
            let procs = d
                .running_compute_processes()
                .map_err(|e| err(&format!("processes of GPU {index}"), e))?;
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
                processes: procs
                    .into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        used_bytes: match p.used_gpu_memory {
                            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                        },
                    })
                    .collect(),
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
