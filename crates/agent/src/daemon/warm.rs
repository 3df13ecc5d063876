//! `labsync warm`, a node's side: fetch a snapshot's packs into this
//! node's cache and pin them (or unpin them), in the background, with the
//! progress in the heartbeats. The coordinator's side, which nodes are
//! told, is `cluster/warm.rs`.

use std::sync::{Arc, Mutex};

use labsync_store::{Progress, RefSpec};

use super::Daemon;
use crate::error::JobError;
use crate::proto::{WarmOrder, Warming};

/// Counts a warm's fetch into its [`Warming`] entry.
struct Meter(Arc<Mutex<Warming>>);

impl Progress for Meter {
    fn phase(&self, name: &str, total_bytes: Option<u64>, _: Option<u64>) {
        if name == "fetch" {
            let mut w = self.0.lock().expect("warm poisoned");
            w.total_bytes = total_bytes;
            w.done_bytes = 0;
        }
    }

    fn advance(&self, bytes: u64, _: u64) {
        self.0.lock().expect("warm poisoned").done_bytes += bytes;
    }

    fn warn(&self, message: &str) {
        tracing::warn!("warm: {message}");
    }
}

/// The warms of one node.
#[derive(Default)]
pub struct Warms {
    list: Mutex<Vec<Arc<Mutex<Warming>>>>,
}

impl Warms {
    /// What heartbeats carry.
    pub fn snapshot(&self) -> Vec<Warming> {
        self.list
            .lock()
            .expect("warm poisoned")
            .iter()
            .map(|w| w.lock().expect("warm poisoned").clone())
            .collect()
    }
}

impl Daemon {
    /// Starts fetching and pinning `o` on this node (or unpins it); the
    /// fetch goes on in the background, its progress in the heartbeats.
    pub async fn warm(self: &Arc<Self>, o: WarmOrder) -> Result<(), JobError> {
        let spec: RefSpec = o
            .label
            .parse()
            .map_err(|e| JobError::Invalid(format!("{}: {e}", o.label)))?;
        let cache = self.cache().clone();
        let repo = self.repo()?.clone();
        if o.unpin {
            let snapshot = o.snapshot;
            return crate::blocking::off_runtime(move || cache.set_pinned(snapshot, false))
                .await
                .map_err(|e| JobError::Conflict(e.to_string()));
        }
        let entry = Arc::new(Mutex::new(Warming {
            label: o.label.clone(),
            snapshot: Some(o.snapshot),
            ..Default::default()
        }));
        {
            let mut list = self.warms().list.lock().expect("warm poisoned");
            list.retain(|w| w.lock().expect("warm poisoned").label != o.label);
            list.push(entry.clone());
        }
        let me = self.clone();
        tokio::spawn(async move {
            let meter: Arc<dyn Progress> = Arc::new(Meter(entry.clone()));
            let done = labsync_store::warm(&repo, &cache, &spec, meter).await;
            let result = match done {
                Ok((rec, _, _)) if rec.snapshot != o.snapshot => Err(format!(
                    "{} is now {}, not the {} asked for",
                    o.label,
                    rec.snapshot.short(),
                    o.snapshot.short()
                )),
                Ok((_, packs, bytes)) if !o.pin => {
                    tracing::info!(
                        "prefetched {} for queued jobs: {packs} packs, {bytes} bytes fetched",
                        o.label
                    );
                    Ok(())
                }
                Ok((rec, packs, bytes)) => {
                    let c = cache.clone();
                    crate::blocking::off_runtime(move || c.set_pinned(rec.snapshot, true))
                        .await
                        .map(|()| {
                            tracing::info!(
                                "warmed and pinned {}: {packs} packs, {bytes} bytes fetched",
                                o.label
                            )
                        })
                        .map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            };
            let mut list = me.warms().list.lock().expect("warm poisoned");
            match result {
                Ok(()) => list.retain(|w| !Arc::ptr_eq(w, &entry)),
                Err(e) => {
                    tracing::warn!("warm of {} failed: {e}", o.label);
                    entry.lock().expect("warm poisoned").error = Some(e);
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meter_counts_the_fetch_phase() {
        let w = Arc::new(Mutex::new(Warming::default()));
        let m = Meter(w.clone());
        m.phase("fetch", Some(100), Some(2));
        m.advance(30, 1);
        m.advance(20, 1);
        let got = w.lock().unwrap().clone();
        assert_eq!((got.done_bytes, got.total_bytes), (50, Some(100)));
    }
}
