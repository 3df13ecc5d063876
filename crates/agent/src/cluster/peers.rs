//! A node's peers as a source of packs ([`labsync_store::PackPeers`]): the
//! coordinator says who holds what, the packs come from those nodes over
//! their signed pack route, and the store checks every copy before it is
//! cached. What came from where is counted for `labrun status`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use labsync_store::{PackId, PackPeers, PeerEvent};

use crate::client::{Client, Endpoint};
use crate::cluster::ClusterKey;
use crate::proto::FetchCounts;
use crate::tls::ClientConfig;

/// What the store's trait returns (`futures::future::BoxFuture`).
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// How long one pack may take from a peer (packs are at most 64 MiB).
const PACK_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the coordinator may take to say who holds what.
const LOCATE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a peer that failed a pack is passed over: the rest of a pull,
/// not every wave of it (issue 43: a peer unreachable but not yet marked
/// down was tried for every wave, and a job waited 26.6 s where the store
/// alone took 11.5 s).
const SUSPECT_FOR: Duration = Duration::from_secs(60);

/// The file in the node cache's folder that keeps the counts, so they
/// outlive labd and `labsync cache status` shows them.
pub const COUNTS_FILE: &str = "fetched-v1.json";

/// This node's peers.
pub struct ClusterPeers {
    me: String,
    key: ClusterKey,
    tls: Option<Arc<ClientConfig>>,
    coordinator: Endpoint,
    /// Pack → (node, address) of the peers holding it, as last located.
    located: Mutex<HashMap<PackId, Vec<(String, String)>>>,
    counts: Mutex<FetchCounts>,
    /// Peers that failed a pack, and when: passed over for [`SUSPECT_FOR`].
    suspect: Mutex<HashMap<String, std::time::Instant>>,
    /// Counts changed since they were last written (packs served).
    unsaved: std::sync::atomic::AtomicBool,
    /// Where the counts are kept ([`COUNTS_FILE`] in the cache folder).
    file: PathBuf,
}

impl ClusterPeers {
    /// The peers of node `me`, located through `coordinator`, reached with
    /// `tls` when the cluster has it; the counts go on from those kept in
    /// `cache_dir`.
    pub fn new(
        me: &str,
        key: ClusterKey,
        tls: Option<Arc<ClientConfig>>,
        coordinator: Endpoint,
        cache_dir: &Path,
    ) -> ClusterPeers {
        let file = cache_dir.join(COUNTS_FILE);
        let counts = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        ClusterPeers {
            me: me.to_string(),
            key,
            tls,
            coordinator,
            located: Mutex::new(HashMap::new()),
            counts: Mutex::new(counts),
            suspect: Mutex::new(HashMap::new()),
            unsaved: std::sync::atomic::AtomicBool::new(false),
            file,
        }
    }

    /// Writes the counts (whole, then renamed into place; labd runs as
    /// root: the temporary file is made anew, `O_EXCL`, so a symlink
    /// planted in its place is never followed, only refused).
    fn keep(&self, c: &FetchCounts) {
        let json = serde_json::to_vec(c).expect("counts serialise");
        if let Err(e) = labsync_store::write_atomic(&self.file, &json) {
            tracing::warn!(
                "cannot keep the fetch counts in {}: {e}",
                self.file.display()
            );
        }
    }

    /// `bytes` of a pack sent to a peer, with `sendfile` or as a body.
    /// Counted in memory: written at the next fetch or [`ClusterPeers::save`]
    /// (packs go out several at once, and the file has one writer).
    pub fn served(&self, bytes: u64, by_sendfile: bool) {
        let mut c = self.counts.lock().expect("peers poisoned");
        c.served_to_peers += bytes;
        if by_sendfile {
            c.served_by_sendfile += bytes;
        }
        self.unsaved
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Writes the counts if packs were served since they were last
    /// written: `labsync cache status` reads the file (issue 43: it said
    /// 0 B served while `labrun status` said 0.6 GiB).
    pub fn save(&self) {
        if self
            .unsaved
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            let c = self.counts.lock().expect("peers poisoned");
            self.keep(&c);
        }
    }

    /// Bytes fetched by source so far.
    pub fn counts(&self) -> FetchCounts {
        self.counts.lock().expect("peers poisoned").clone()
    }

    /// Tells the coordinator (in the background) that `peer` failed a
    /// fetch here: it stops offering `peer`'s packs to every node for a
    /// while, and `labrun status` says so.
    fn tell_suspect(&self, peer: &str, why: String) {
        let Ok(peer_name) = peer.parse::<crate::proto::NodeName>() else {
            return;
        };
        let client = self.client(self.coordinator.clone(), super::TO_COORDINATOR);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let report = crate::proto::SuspectPeer {
            peer: peer_name,
            why,
        };
        rt.spawn(async move {
            match tokio::time::timeout(LOCATE_TIMEOUT, client.report_suspect(&report)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("telling the coordinator of {}: {e}", report.peer),
                Err(_) => tracing::warn!("the coordinator did not answer about {}", report.peer),
            }
        });
    }

    /// Tells `peer` (in the background: the fetch goes on elsewhere) that
    /// the copy of `pack` it served was corrupt, so it checks its copy
    /// again and drops it, rather than offering it to the next node.
    fn tell_corrupt(&self, peer: &str, pack: PackId, why: String) {
        let addr = {
            let l = self.located.lock().expect("peers poisoned");
            l.get(&pack)
                .and_then(|h| h.iter().find(|(n, _)| n == peer))
                .map(|(_, a)| a.clone())
        };
        let Some(ep) = addr.and_then(|a| a.parse::<Endpoint>().ok()) else {
            return;
        };
        let (client, peer) = (self.client(ep, peer), peer.to_string());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            match tokio::time::timeout(PACK_TIMEOUT, client.report_corrupt(&pack, &why)).await {
                Ok(Ok(a)) => tracing::info!(
                    "told {peer} its copy of pack {} was corrupt: {}",
                    pack.short(),
                    if a.dropped {
                        "it found it so and dropped it"
                    } else {
                        "sound there (it went bad on the way)"
                    }
                ),
                Ok(Err(e)) => {
                    tracing::warn!("telling {peer} of corrupt pack {}: {e}", pack.short())
                }
                Err(_) => {
                    tracing::warn!("{peer} did not answer about corrupt pack {}", pack.short())
                }
            }
        });
    }

    /// A copy of `pack` this node served was reported corrupt by a peer;
    /// `dropped`: it failed the check here too and is gone.
    pub fn reported_corrupt(&self, dropped: bool) {
        let mut c = self.counts.lock().expect("peers poisoned");
        c.reported_corrupt += 1;
        c.dropped_corrupt += u64::from(dropped);
        self.keep(&c);
    }

    /// Peers passed over now: those that failed a pack less than
    /// [`SUSPECT_FOR`] ago.
    fn suspects(&self) -> Vec<String> {
        let mut s = self.suspect.lock().expect("peers poisoned");
        s.retain(|_, t| t.elapsed() < SUSPECT_FOR);
        s.keys().cloned().collect()
    }

    /// A client of `to` (a node's name, or [`super::TO_COORDINATOR`]) at `ep`.
    fn client(&self, ep: Endpoint, to: &str) -> Client {
        Client::for_cluster(ep, self.key.clone(), &self.me, to).with_tls(self.tls.clone())
    }
}

impl PackPeers for ClusterPeers {
    fn locate<'a>(&'a self, packs: &'a [PackId]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let asked = self.client(self.coordinator.clone(), super::TO_COORDINATOR);
            match tokio::time::timeout(LOCATE_TIMEOUT, asked.locate(packs)).await {
                Ok(Ok(found)) => {
                    let mut l = self.located.lock().expect("peers poisoned");
                    for (p, holders) in found {
                        l.insert(p, holders);
                    }
                }
                // The store has every pack: a coordinator that does not
                // answer costs speed, not the job.
                Ok(Err(e)) => tracing::warn!("cannot locate packs at peers: {e}; using the store"),
                Err(_) => tracing::warn!(
                    "the coordinator did not say where packs are within {LOCATE_TIMEOUT:?}; using the store"
                ),
            }
        })
    }

    fn holders(&self, pack: &PackId) -> Vec<String> {
        let suspect = self.suspects();
        let l = self.located.lock().expect("peers poisoned");
        l.get(pack)
            .map(|h| {
                h.iter()
                    .filter(|(n, _)| !suspect.contains(n))
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn get<'a>(
        &'a self,
        peer: &'a str,
        pack: &'a PackId,
    ) -> BoxFuture<'a, Result<bytes::Bytes, String>> {
        Box::pin(async move {
            let addr = {
                let l = self.located.lock().expect("peers poisoned");
                l.get(pack)
                    .and_then(|h| h.iter().find(|(n, _)| n == peer))
                    .map(|(_, a)| a.clone())
            };
            let ep: Endpoint = addr
                .ok_or_else(|| format!("{peer} was not located"))?
                .parse()?;
            match tokio::time::timeout(PACK_TIMEOUT, self.client(ep, peer).pack(pack)).await {
                Ok(Ok(b)) => Ok(b),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no whole answer within {PACK_TIMEOUT:?}")),
            }
        })
    }

    fn report(&self, event: PeerEvent) {
        let mut c = self.counts.lock().expect("peers poisoned");
        match event {
            PeerEvent::FromPeer { bytes, .. } => c.from_peers += bytes,
            PeerEvent::FromStore { bytes } => c.from_store += bytes,
            PeerEvent::Fetched {
                from_peers,
                from_store,
                secs,
            } => {
                c.measure(from_peers, from_store, secs);
                // Once per fetch, not per pack.
                self.keep(&c);
            }
            PeerEvent::Corrupt { peer, pack, why } => {
                c.corrupt_from_peers += 1;
                tracing::warn!(
                    "refused pack {} from {peer}: {why}; fetching it elsewhere and telling {peer}",
                    pack.short()
                );
                self.tell_corrupt(&peer, pack, why);
            }
            PeerEvent::Failed { peer, pack, why } => {
                c.failed_from_peers += 1;
                let mut suspect = self.suspect.lock().expect("peers poisoned");
                let fresh = suspect
                    .insert(peer.clone(), std::time::Instant::now())
                    .is_none_or(|t| t.elapsed() >= SUSPECT_FOR);
                if fresh {
                    tracing::warn!(
                        "pack {} from {peer} failed: {why}; {peer} is passed over for {} s, \
                         its packs fetched elsewhere",
                        pack.short(),
                        SUSPECT_FOR.as_secs()
                    );
                    drop(suspect);
                    self.tell_suspect(&peer, why);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that failed a pack is passed over for the next ones: one
    /// failure, not one per wave of packs.
    #[test]
    fn a_peer_that_failed_a_pack_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let key = ClusterKey::new(&crate::Secret::new("s".repeat(40))).unwrap();
        let p = ClusterPeers::new(
            "gpu2",
            key,
            None,
            "127.0.0.1:1".parse().unwrap(),
            dir.path(),
        );
        let (a, b) = (PackId::from_bytes([1; 32]), PackId::from_bytes([2; 32]));
        {
            let mut l = p.located.lock().unwrap();
            for pack in [a, b] {
                l.insert(
                    pack,
                    vec![
                        ("gpu1".into(), "http://127.0.0.1:2".into()),
                        ("gpu3".into(), "http://127.0.0.1:3".into()),
                    ],
                );
            }
        }
        assert_eq!(p.holders(&b), ["gpu1", "gpu3"]);
        p.report(PeerEvent::Failed {
            peer: "gpu1".into(),
            pack: a,
            why: "connection refused".into(),
        });
        assert_eq!(
            p.holders(&b),
            ["gpu3"],
            "gpu1 passed over for the next pack"
        );
        assert_eq!(p.holders(&a), ["gpu3"]);
        // Once the time is up, it is tried again.
        p.suspect
            .lock()
            .unwrap()
            .insert("gpu1".into(), std::time::Instant::now() - SUSPECT_FOR);
        assert_eq!(p.holders(&b), ["gpu1", "gpu3"]);
    }

    #[test]
    fn fetches_are_counted_by_source_and_rates_measured() {
        let dir = tempfile::tempdir().unwrap();
        let key = || ClusterKey::new(&crate::Secret::new("s".repeat(40))).unwrap();
        let p = ClusterPeers::new(
            "gpu2",
            key(),
            None,
            "127.0.0.1:1".parse().unwrap(),
            dir.path(),
        );
        let pack = PackId::from_bytes([1; 32]);
        p.report(PeerEvent::FromPeer {
            peer: "gpu1".into(),
            bytes: 30 << 20,
        });
        p.report(PeerEvent::FromStore { bytes: 1 << 20 });
        p.report(PeerEvent::Corrupt {
            peer: "gpu3".into(),
            pack,
            why: "bad".into(),
        });
        p.report(PeerEvent::Failed {
            peer: "gpu4".into(),
            pack,
            why: "gone".into(),
        });
        // 31 MiB in 0.5 s, 97% from peers: a peer rate of 65 MB/s.
        p.report(PeerEvent::Fetched {
            from_peers: 30 << 20,
            from_store: 1 << 20,
            secs: 0.5,
        });
        let c = p.counts();
        assert_eq!((c.from_peers, c.from_store), (30 << 20, 1 << 20));
        assert_eq!((c.corrupt_from_peers, c.failed_from_peers), (1, 1));
        assert_eq!(c.peer_rate, Some((31u64 << 20) * 2));
        assert_eq!(c.store_rate, None);
        // A second measure is averaged in; a small or mixed fetch is not.
        p.report(PeerEvent::Fetched {
            from_peers: 0,
            from_store: 10 << 20,
            secs: 1.0,
        });
        p.report(PeerEvent::Fetched {
            from_peers: 0,
            from_store: 1 << 20,
            secs: 10.0,
        });
        p.report(PeerEvent::Fetched {
            from_peers: 5 << 20,
            from_store: 5 << 20,
            secs: 10.0,
        });
        p.report(PeerEvent::Fetched {
            from_peers: 31 << 20,
            from_store: 0,
            secs: 1.0,
        });
        let c = p.counts();
        // Kept in the cache folder: a new labd goes on from them.
        let again = ClusterPeers::new(
            "gpu2",
            key(),
            None,
            "127.0.0.1:1".parse().unwrap(),
            dir.path(),
        );
        assert_eq!(again.counts(), c);
        assert_eq!(c.store_rate, Some(10 << 20));
        // A symlink planted where a temporary file went is not written
        // through (labd is root; the cache folder could be someone's): the
        // store's atomic write takes a new, unguessable name (`O_EXCL`).
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep me").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("fetched-v1.json.tmp")).unwrap();
        p.report(PeerEvent::Fetched {
            from_peers: 0,
            from_store: 10 << 20,
            secs: 1.0,
        });
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
        let kept = ClusterPeers::new(
            "gpu2",
            key(),
            None,
            "127.0.0.1:1".parse().unwrap(),
            dir.path(),
        );
        assert_eq!(kept.counts(), p.counts(), "the counts were still kept");
        assert_eq!(
            c.peer_rate,
            Some((((31u64 << 20) * 2 + (31 << 20)) as f64 / 2.0) as u64)
        );
    }
}
