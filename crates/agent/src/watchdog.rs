//! Reads the inventory off the caller's thread, under a deadline.
//!
//! A wedged driver makes NVML calls hang for minutes (`nvidia-smi` hangs with
//! it). One worker thread does the reads; a caller waits at most the deadline
//! and otherwise gets [`Reading::Unknown`]. While the worker is still stuck,
//! later polls answer `Unknown` at once instead of piling up threads; when it
//! comes back, the next poll reads fresh data again.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::InventoryError;
use crate::gpu::{GpuInfo, GpuInventory};

/// The outcome of one poll.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Reading {
    /// The inventory answered.
    Known(Vec<GpuInfo>),
    /// It did not answer in time, or failed: no GPU may be leased.
    Unknown {
        /// Why.
        reason: String,
    },
}

struct Worker {
    requests: Sender<()>,
    answers: Receiver<Result<Vec<GpuInfo>, InventoryError>>,
    /// Set while a request is outstanding.
    pending_since: Option<Instant>,
}

/// Polls a [`GpuInventory`] with a deadline.
pub struct Watchdog {
    deadline: Duration,
    worker: Mutex<Worker>,
    describe: String,
}

impl Watchdog {
    /// Starts the worker thread.
    pub fn new(inventory: Arc<dyn GpuInventory>, deadline: Duration) -> Watchdog {
        let (req_tx, req_rx) = mpsc::channel::<()>();
        let (ans_tx, ans_rx) = mpsc::channel();
        let describe = inventory.describe();
        std::thread::Builder::new()
            .name("gpu-inventory".into())
            .spawn(move || {
                while req_rx.recv().is_ok() {
                    if ans_tx.send(inventory.read()).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn the inventory thread");
        Watchdog {
            deadline,
            worker: Mutex::new(Worker {
                requests: req_tx,
                answers: ans_rx,
                pending_since: None,
            }),
            describe,
        }
    }

    /// What the inventory is.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// Reads the GPUs, or says why it could not within the deadline.
    pub fn poll(&self) -> Reading {
        let mut w = self.worker.lock().expect("watchdog poisoned");
        if w.pending_since.is_none() {
            if w.requests.send(()).is_err() {
                return Reading::Unknown {
                    reason: "inventory thread is gone".into(),
                };
            }
            w.pending_since = Some(Instant::now());
        }
        let since = w.pending_since.expect("set above");
        let wait = self.deadline.saturating_sub(since.elapsed());
        match w.answers.recv_timeout(wait) {
            Ok(r) => {
                w.pending_since = None;
                match r {
                    Ok(gpus) => Reading::Known(gpus),
                    Err(e) => Reading::Unknown {
                        reason: e.to_string(),
                    },
                }
            }
            Err(RecvTimeoutError::Timeout) => Reading::Unknown {
                reason: format!(
                    "{}; waiting for {:.0?}",
                    InventoryError::Hung(self.deadline),
                    since.elapsed()
                ),
            },
            Err(RecvTimeoutError::Disconnected) => Reading::Unknown {
                reason: "inventory thread is gone".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FakeGpus;

    #[test]
    fn hang_gives_unknown_then_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let ctl = dir.path().join("ctl.toml");
        let fake = FakeGpus::new("2x11GiB", Some(ctl.clone())).unwrap();
        let w = Watchdog::new(Arc::new(fake), Duration::from_millis(200));
        assert!(matches!(w.poll(), Reading::Known(g) if g.len() == 2));
        std::fs::write(&ctl, "hang = true\n").unwrap();
        let t = Instant::now();
        let r = w.poll();
        assert!(
            matches!(&r, Reading::Unknown { reason } if reason.contains("did not answer")),
            "{r:?}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the caller is not held hostage"
        );
        // Still hung: answered at once, no new thread.
        let t = Instant::now();
        assert!(matches!(w.poll(), Reading::Unknown { .. }));
        assert!(t.elapsed() < Duration::from_secs(1));
        std::fs::write(&ctl, "hang = false\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Reading::Known(g) = w.poll() {
                assert_eq!(g.len(), 2);
                break;
            }
            assert!(Instant::now() < deadline, "did not recover");
        }
    }
}
