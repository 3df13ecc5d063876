//! An agent's heartbeats: its GPUs, active jobs and cache, with the cache
//! inventory sent as the packs added and removed since the heartbeat the
//! coordinator last acknowledged (the whole of it when asked).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use labsync_store::{NodeCache, PackId, SnapshotId};

use super::Daemon;
use crate::blocking::off_runtime;
use crate::client::Client;
use crate::cluster::{ClusterConfig, Coordinator};
use crate::ids::JobId;
use crate::proto::{CacheSummary, CachedTree, Heartbeat, InventoryDelta};
use crate::request::Caller;

/// The cache as last read: packs with sizes, snapshots with their packs.
#[derive(Clone, Default)]
struct Inventory {
    packs: HashMap<PackId, u64>,
    snapshots: HashMap<SnapshotId, Vec<(PackId, u64)>>,
    summary: CacheSummary,
}

/// Sends one node's heartbeats.
pub struct Reporter {
    daemon: Arc<Daemon>,
    cfg: ClusterConfig,
    /// Set on the coordinator's own node: heartbeats go in-process.
    local: Option<Arc<Coordinator>>,
    instance: String,
    seq: u64,
    /// What the coordinator acknowledged, and at which seq.
    acked: Option<(u64, Inventory)>,
    current: Inventory,
    /// The cache state file's (mtime, length) when `current` was read.
    stamp: Option<(SystemTime, u64)>,
    /// The materialised trees, and their folder's mtime when listed (a
    /// tree made or removed changes it): listed again only then.
    trees: (Option<SystemTime>, Vec<labsync_store::SnapshotId>),
    /// Jobs the coordinator had ended while this node was down, with when
    /// their kill was started (not started again within [`KILL_AGAIN`]).
    killing: HashMap<JobId, Instant>,
}

/// How long a kill the coordinator asked for is given before it is asked
/// for again.
const KILL_AGAIN: Duration = Duration::from_secs(60);

/// What the node cache holds, for the web page of a labd alone.
pub(crate) fn cache_summary(cache: &NodeCache) -> Result<CacheSummary, String> {
    read_inventory(cache).map(|i| i.summary)
}

fn read_inventory(cache: &NodeCache) -> Result<Inventory, String> {
    let st = cache.status().map_err(|e| e.to_string())?;
    let mut inv = Inventory::default();
    // A pack found corrupt here and dropped is not offered to peers.
    let dropped: std::collections::HashSet<_> = st.dropped.iter().collect();
    for (id, c, bytes) in &st.snapshots {
        for (p, n) in c.packs.iter().filter(|(p, _)| !dropped.contains(p)) {
            inv.packs.insert(*p, *n);
        }
        inv.snapshots.insert(*id, c.packs.clone());
        inv.summary.trees.push(CachedTree {
            snapshot: *id,
            label: c.label.clone(),
            bytes: *bytes,
            pinned: c.pinned,
        });
    }
    inv.summary.used_bytes = st.used_bytes;
    inv.summary.max_bytes = st.max_bytes;
    Ok(inv)
}

fn stamp(cache: &NodeCache) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(cache.root().join("state-v1.json")).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl Reporter {
    /// A reporter for `daemon`'s node; `local` is the coordinator when it
    /// runs in this same labd.
    pub fn new(daemon: Arc<Daemon>, cfg: ClusterConfig, local: Option<Arc<Coordinator>>) -> Self {
        let instance =
            blake3::hash(format!("{:?}{}", SystemTime::now(), std::process::id()).as_bytes())
                .to_hex()[..16]
                .to_string();
        Reporter {
            daemon,
            cfg,
            local,
            instance,
            seq: 0,
            acked: None,
            current: Inventory::default(),
            stamp: None,
            trees: (None, Vec::new()),
            killing: HashMap::new(),
        }
    }

    /// Re-reads the cache's state when its file changed (no scan of the
    /// packs: the state lists them).
    async fn refresh(&mut self) {
        let cache = self.daemon.cache().clone();
        let now = stamp(&cache);
        if now.is_some() && now == self.stamp {
            return;
        }
        match off_runtime(move || read_inventory(&cache).map(|i| (i, stamp(&cache)))).await {
            Ok((inv, st)) => {
                self.current = inv;
                self.stamp = st;
            }
            Err(e) => tracing::warn!("heartbeat: cannot read the node cache: {e}"),
        }
    }

    /// The snapshots materialised on this node, listed again only when
    /// the trees' folder changed.
    async fn materialised(&mut self) -> Vec<labsync_store::SnapshotId> {
        let root = self.daemon.cache().root().to_path_buf();
        let now = std::fs::metadata(root.join(crate::trees::TREES_DIR))
            .and_then(|m| m.modified())
            .ok();
        // A change within the folder time's grain of the last listing could
        // leave it unchanged: a folder changed in the last 2 s is listed anew.
        let recent = now.is_some_and(|t| t.elapsed().map_or(true, |e| e < Duration::from_secs(2)));
        if now.is_none() || now != self.trees.0 || recent {
            let listed =
                off_runtime(move || Ok::<_, String>(crate::trees::materialised_trees(&root)))
                    .await
                    .unwrap_or_default();
            self.trees = (now, listed.into_iter().map(|(id, _)| id).collect());
        }
        self.trees.1.clone()
    }

    fn delta(&self) -> InventoryDelta {
        let cur = &self.current;
        match &self.acked {
            None => InventoryDelta {
                full: true,
                base: 0,
                added: cur.packs.iter().map(|(p, n)| (*p, *n)).collect(),
                removed: Vec::new(),
                snapshots: cur.snapshots.iter().map(|(s, p)| (*s, p.clone())).collect(),
            },
            Some((base, old)) => InventoryDelta {
                full: false,
                base: *base,
                added: (cur.packs.iter())
                    .filter(|(p, _)| !old.packs.contains_key(p))
                    .map(|(p, n)| (*p, *n))
                    .collect(),
                removed: (old.packs.keys())
                    .filter(|p| !cur.packs.contains_key(p))
                    .copied()
                    .collect(),
                snapshots: (cur.snapshots.iter())
                    .filter(|(s, _)| !old.snapshots.contains_key(s))
                    .map(|(s, p)| (*s, p.clone()))
                    .collect(),
            },
        }
    }

    /// One heartbeat. Errors are the caller's to log.
    pub(crate) async fn beat(&mut self) -> Result<(), String> {
        self.refresh().await;
        let gpus = self.daemon.gpus().await.map_err(|e| e.to_string())?;
        // Without their commands: the coordinator has each job's own, and
        // a user's many jobs with long command lines (up to 256 KiB each)
        // would push a heartbeat past what the coordinator reads, and get
        // the node marked down.
        // Ended ones still saving their outputs too: they hold no GPU, and
        // the coordinator must not count them against their user's cap.
        let jobs = (self.daemon.active_jobs().await.map_err(|e| e.to_string())?)
            .into_iter()
            .map(|mut j| {
                j.argv = Vec::new();
                j
            })
            .collect();
        self.seq += 1;
        let hb = Heartbeat {
            node: self.daemon.node_name().clone(),
            addr: self.cfg.advertise.clone(),
            instance: self.instance.clone(),
            seq: self.seq,
            gpus,
            jobs,
            cache: CacheSummary {
                fetched: self.daemon.fetched(),
                warming: self.daemon.warms().snapshot(),
                materialised: self.materialised().await,
                ..self.current.summary.clone()
            },
            inventory: self.delta(),
            gpu_confinement: self.daemon.gpu_confinement().to_string(),
            version: crate::proto::VERSION.into(),
            protocol: crate::proto::PROTOCOL,
        };
        let reply = match &self.local {
            Some(c) => c
                .heartbeat(&hb.node.clone(), hb, c.now_ms())
                .map_err(|e| e.to_string())?,
            None => {
                let client = Client::for_cluster(
                    self.cfg.coordinator.clone(),
                    self.cfg.key.clone(),
                    self.daemon.node_name(),
                    crate::cluster::TO_COORDINATOR,
                )
                .with_tls(self.cfg.tls.clone());
                // A stopped coordinator accepts connections and never
                // answers: the next beat must not wait behind this one.
                tokio::time::timeout(
                    self.cfg.heartbeat.max(Duration::from_secs(2)) * 5,
                    client.heartbeat(&hb),
                )
                .await
                .map_err(|_| format!("coordinator {} did not answer", self.cfg.coordinator))?
                .map_err(|e| e.to_string())?
            }
        };
        self.acked = if reply.want_full {
            None
        } else {
            Some((self.seq, self.current.clone()))
        };
        self.kill_ended(reply.kill);
        Ok(())
    }

    /// Kills, in the background, the jobs the coordinator ended while this
    /// node was down (their owner killed them meanwhile).
    fn kill_ended(&mut self, ids: Vec<JobId>) {
        let clock = self.daemon.clock().clone();
        self.killing
            .retain(|id, at| ids.contains(id) && clock.since(*at) < KILL_AGAIN);
        for id in ids {
            if self.killing.contains_key(&id) {
                continue;
            }
            self.killing.insert(id.clone(), clock.instant());
            let daemon = self.daemon.clone();
            tokio::spawn(async move {
                let by = Caller {
                    user: "the coordinator (killed while this node was down)".into(),
                    admin: true,
                };
                match daemon.kill(&by, &id).await {
                    Ok(_) => tracing::info!(
                        "job {id} killed: the coordinator ended it while this node was down"
                    ),
                    Err(e) => tracing::warn!("job {id}, ended by the coordinator: {e}"),
                }
            });
        }
    }

    /// Beats every `heartbeat`, and at once when a job ends, until
    /// `shutdown`; says when the coordinator
    /// stops and starts answering, not at every beat.
    pub async fn run(mut self, shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut shutdown = shutdown;
        let mut every = tokio::time::interval(self.cfg.heartbeat);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        let daemon = self.daemon.clone();
        loop {
            tokio::select! {
                _ = every.tick() => {}
                // A job ended: its GPUs are free now, say so now.
                _ = daemon.beat_now().notified() => {}
                _ = shutdown.changed() => return,
            }
            match self.beat().await {
                Ok(()) if failing => {
                    tracing::info!("coordinator {} answers again", self.cfg.coordinator);
                    failing = false;
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    tracing::warn!("heartbeat: {e}");
                    failing = true;
                }
                Err(_) => {}
            }
        }
    }
}
