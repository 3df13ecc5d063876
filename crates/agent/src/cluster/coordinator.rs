//! The coordinator's cluster view, built from heartbeats: each node's GPUs,
//! jobs and cache, and the placer's model of them. A node that misses
//! heartbeats for `down_after` is marked down (never chosen, its jobs shown
//! as they were); its next heartbeat brings it back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use labsync_placer::{
    Cluster, Gpu, Health, Members, Millis, NodeName, PackKey, Policy, Rates, Slot, SnapshotKey,
    Usage,
};
use labsync_store::{PackId, SnapshotId};

use crate::clock::Clock;
use crate::cluster::queue::{ClusterJobs, Placement};
use crate::cluster::LabConfig;
use crate::error::{JobError, LeaseError};
use crate::ids::JobId;
use crate::proto::{
    CacheSummary, ClusterStatus, Heartbeat, HeartbeatReply, JobView, NodeHealth, NodeStatus,
    Presence, Refused,
};
use crate::status::{GpuState, GpuStatus};

/// What the coordinator remembers of one node.
pub(super) struct Member {
    pub(super) addr: String,
    instance: String,
    /// The last heartbeat applied.
    seq: u64,
    last_seen: Millis,
    gpus: Vec<GpuStatus>,
    pub(super) jobs: Vec<JobView>,
    cache: CacheSummary,
    gpu_confinement: String,
    version: String,
}

pub(super) struct View {
    pub(super) cluster: Cluster,
    pub(super) members: BTreeMap<NodeName, Member>,
    /// Labels of the snapshots cached anywhere, for `labrun status`.
    labels: HashMap<SnapshotId, String>,
    /// GPUs promised to dispatches, until a heartbeat shows them leased
    /// to that job (or the dispatch is refused): counted busy meanwhile,
    /// so no pass offers them twice.
    pub(super) promised: BTreeMap<NodeName, BTreeMap<u32, JobId>>,
    /// Snapshots no live job and no cache needed at the last look:
    /// forgotten if still so at the next ([`Coordinator::forget_unused`]).
    unused: HashSet<SnapshotKey>,
    /// Nodes whose requests were refused for their protocol version: why,
    /// and when last (shown until the node's next heartbeat is taken).
    refused: BTreeMap<NodeName, (String, Millis)>,
    /// Peers a node could not get packs from: (peer, reporter) → why and
    /// when; their packs are not offered for [`SUSPECT_FOR`].
    suspect: BTreeMap<(NodeName, String), (String, Millis)>,
}

/// Refusals and suspicions kept at most: a member signs with any node
/// name it likes, and each new name would otherwise add one.
const NOTES_MAX: usize = 256;

/// Drops the oldest entries of `m` (by the time they hold) past `max`.
fn keep_newest<K: Ord + Clone>(m: &mut BTreeMap<K, (String, Millis)>, max: usize) {
    while m.len() > max {
        let oldest = (m.iter())
            .min_by_key(|(_, (_, at))| *at)
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => m.remove(&k),
            None => break,
        };
    }
}

/// How long a peer a node could not get packs from is not offered.
const SUSPECT_FOR: Duration = Duration::from_secs(60);

impl View {
    /// What the placer plans on.
    pub(super) fn planning(&self) -> Cluster {
        super::jobs::with_promises(&self.cluster, &self.promised)
    }
}

/// The cluster view of a coordinating labd, and its queue.
pub struct Coordinator {
    name: NodeName,
    down_after: Duration,
    pub(super) view: Mutex<View>,
    /// Jobs of the cluster, persistent.
    pub(super) jobs: ClusterJobs,
    /// New job numbers start above this (the highest `runs/j<N>` in the store).
    pub(super) floor: AtomicU64,
    /// Jobs whose dispatch is on its way.
    pub(super) inflight: Mutex<HashSet<JobId>>,
    /// Pack lists of snapshots priced lately and not kept in the view (an
    /// explain's, a Slurm ranking's), at most [`super::jobs::PRICED_LATELY`].
    pub(super) priced_lately: Mutex<std::collections::VecDeque<super::jobs::Priced>>,
    /// When old job records were last looked for.
    pruned_at: Mutex<Option<std::time::Instant>>,
    /// Wakes the scheduler early (a submission).
    pub(super) wake: tokio::sync::Notify,
    /// When ended jobs were last looked for.
    pub(super) collected: Mutex<Option<std::time::Instant>>,
    /// The placement rule's settings (the user cap changes with `labrun
    /// admin cap`).
    policy: std::sync::RwLock<Policy>,
    /// Who stands in which tier, and the grants (changed by `labrun
    /// admin`).
    members: std::sync::RwLock<Members>,
    /// Each tier's default time limit, seconds.
    pub(super) time_limits: HashMap<labsync_placer::Tier, u64>,
    /// Users' latest successful runs, for estimates (read from the ended
    /// jobs at the first pass, then learnt as jobs end).
    pub(super) runs: Mutex<Option<super::times::Runs>>,
    /// Each user's decaying GPU time (fair share), saved with the jobs.
    pub(super) usage: Mutex<Usage>,
    /// Held while an ended job is recorded (charged, requeued): once.
    pub(super) ending: Mutex<()>,
    /// Prefetches sent: (node, snapshot) → when.
    pub(super) prefetched: Mutex<HashMap<(String, SnapshotId), std::time::Instant>>,
    /// Version labels (`NAME@vN`, which never move) checked against the
    /// store: label → snapshot id.
    pub(super) checked_labels: Mutex<HashMap<String, SnapshotId>>,
    /// What the coordinator reads the time from (down-after, prices,
    /// prunes).
    pub(super) clock: Clock,
}

/// The placer's slot for a GPU as the agent classified it.
fn slot(g: &GpuStatus) -> Gpu {
    let (total, used) = g
        .info
        .as_ref()
        .map_or((0, 0), |i| (i.memory_total, i.memory_used));
    Gpu {
        index: g.index,
        memory_total: total,
        memory_free: total.saturating_sub(used),
        slot: match &g.state {
            GpuState::Free => Slot::Free,
            GpuState::Leased { .. } => Slot::Busy { until: None },
            GpuState::Foreign { .. } | GpuState::Unknown { .. } => Slot::Unavailable,
        },
    }
}

impl Coordinator {
    /// A coordinator named `name` (its node's name) that marks a node down
    /// after `down_after` without a heartbeat, with its jobs in `state_dir`.
    pub fn new(
        name: &NodeName,
        down_after: Duration,
        state_dir: &Path,
        lab: &LabConfig,
    ) -> Result<Coordinator, LeaseError> {
        let jobs = ClusterJobs::open(&state_dir.join("cluster-v1.redb"))?;
        let mut usage = Usage::new(lab.half_life.as_millis().max(1) as Millis);
        for (user, gpu_secs, at) in jobs.usage()? {
            usage.restore(&user, gpu_secs, at);
        }
        let mut policy = Policy {
            user_gpu_cap: lab.user_gpu_cap,
            aging_secs: lab.aging.map(|d| d.as_secs().max(1)),
            reserve_after_secs: lab.reserve_after.as_secs(),
            ..Policy::default()
        };
        let mut members = lab.members.clone();
        // The admins' changes, over the config's defaults.
        for rec in jobs.admin_log()? {
            if let Err(e) = super::admin::apply(&mut members, &mut policy, &rec.change) {
                tracing::warn!(
                    "[lab] the change {} made at {} no longer applies: {e}",
                    rec.by,
                    rec.at
                );
            }
        }
        Ok(Coordinator {
            name: name.clone(),
            down_after,
            view: Mutex::new(View {
                cluster: Cluster::new(),
                members: BTreeMap::new(),
                labels: HashMap::new(),
                promised: BTreeMap::new(),
                unused: HashSet::new(),
                refused: BTreeMap::new(),
                suspect: BTreeMap::new(),
            }),
            jobs,
            floor: AtomicU64::new(0),
            inflight: Mutex::new(HashSet::new()),
            priced_lately: Mutex::new(std::collections::VecDeque::new()),
            pruned_at: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            collected: Mutex::new(None),
            policy: std::sync::RwLock::new(policy),
            time_limits: lab.time_limits.clone(),
            runs: Mutex::new(None),
            members: std::sync::RwLock::new(members),
            usage: Mutex::new(usage),
            ending: Mutex::new(()),
            prefetched: Mutex::new(HashMap::new()),
            checked_labels: Mutex::new(HashMap::new()),
            clock: Clock::system(),
        })
    }

    /// The placement rule's settings now.
    pub(super) fn policy(&self) -> Policy {
        self.policy.read().expect("coordinator poisoned").clone()
    }

    /// Who stands where now.
    pub(super) fn members(&self) -> std::sync::RwLockReadGuard<'_, Members> {
        self.members.read().expect("coordinator poisoned")
    }

    /// Both, to change (`labrun admin`).
    pub(super) fn rules_mut(
        &self,
    ) -> (
        std::sync::RwLockWriteGuard<'_, Members>,
        std::sync::RwLockWriteGuard<'_, Policy>,
    ) {
        (
            self.members.write().expect("coordinator poisoned"),
            self.policy.write().expect("coordinator poisoned"),
        )
    }

    /// The same coordinator, reading the time from `clock`.
    pub fn with_clock(self, clock: Clock) -> Coordinator {
        Coordinator { clock, ..self }
    }

    /// Now, Unix ms, by its clock.
    pub fn now_ms(&self) -> u64 {
        self.clock.unix_ms()
    }

    /// Forgets the cluster's jobs that ended more than `keep` ago, once
    /// per `every` (each look reads every ended record).
    pub async fn prune_if_due(self: &std::sync::Arc<Self>, keep: Duration, every: Duration) {
        {
            let mut at = self.pruned_at.lock().expect("coordinator poisoned");
            if at.is_some_and(|t| self.clock.since(t) < every) {
                return;
            }
            *at = Some(self.clock.instant());
        }
        let me = self.clone();
        let before = self.clock.unix_secs().saturating_sub(keep.as_secs());
        match crate::off_runtime(move || me.jobs.prune_ended(before)).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                "forgot {n} cluster jobs that ended more than {} days ago",
                keep.as_secs() / 86_400
            ),
            Err(e) => tracing::warn!("cannot forget old cluster jobs: {e}"),
        }
        self.forget_unused();
    }

    /// Forgets the pack lists of snapshots that neither a live job (queued
    /// or running) nor any node's cache has needed since the last look, and
    /// the labels of trees no node caches any more. Every submission, every
    /// new version of code, left its pack list in the view for good, and
    /// every scheduling pass copies the view. The grace of one look covers
    /// a submission priced but not yet recorded; a snapshot forgotten and
    /// needed again is read from the store again.
    fn forget_unused(&self) {
        let mut needed: HashSet<SnapshotKey> = (self.jobs.live().iter())
            .filter(|j| !matches!(j.placement, Placement::Ended { .. }))
            .flat_map(|j| super::jobs::snapshots_of(&j.req))
            .map(|s| SnapshotKey(*s.as_bytes()))
            .collect();
        let mut v = self.view.lock().expect("coordinator poisoned");
        // Cached, or materialised somewhere (a tree whose packs were
        // evicted is still where its jobs start at once).
        let cached: HashSet<SnapshotId> = (v.members.values())
            .flat_map(|m| {
                (m.cache.trees.iter().map(|t| t.snapshot))
                    .chain(m.cache.materialised.iter().copied())
            })
            .collect();
        v.labels.retain(|s, _| cached.contains(s));
        needed.extend(cached.iter().map(|s| SnapshotKey(*s.as_bytes())));
        let unused: HashSet<SnapshotKey> = (v.cluster.snapshot_keys())
            .filter(|s| !needed.contains(s))
            .copied()
            .collect();
        let before = std::mem::take(&mut v.unused);
        let forgotten = v
            .cluster
            .retain_snapshots(|s| !(unused.contains(s) && before.contains(s)));
        v.unused = unused.into_iter().filter(|s| !before.contains(s)).collect();
        if forgotten > 0 {
            tracing::info!("forgot the pack lists of {forgotten} snapshots no job or cache needs");
        }
    }

    /// New job numbers start above `n`.
    pub fn ids_above(&self, n: u64) {
        self.floor
            .fetch_max(n.saturating_add(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the view knows a snapshot's packs.
    pub(super) fn knows(&self, s: &SnapshotId) -> bool {
        let v = self.view.lock().expect("coordinator poisoned");
        v.cluster.knows_snapshot(&SnapshotKey(*s.as_bytes()))
    }

    /// Records a snapshot's packs.
    pub(super) fn learn(&self, s: &SnapshotId, packs: &[(PackId, u64)]) {
        let mut v = self.view.lock().expect("coordinator poisoned");
        v.cluster.add_snapshot(
            SnapshotKey(*s.as_bytes()),
            packs.iter().map(|(p, n)| (PackKey(*p.as_bytes()), *n)),
        );
    }

    /// Waits until a submission asks for a pass, or `t`.
    pub async fn wait_for_work(&self, t: Duration) {
        let _ = tokio::time::timeout(t, self.wake.notified()).await;
    }

    /// Remembers that `node`'s request was refused at `now` for its
    /// protocol version, for `labrun status` and `labd doctor`.
    pub fn refuse(&self, node: &NodeName, why: &str, now: Millis) {
        let mut v = self.view.lock().expect("coordinator poisoned");
        v.refused.insert(node.clone(), (why.to_string(), now));
        keep_newest(&mut v.refused, NOTES_MAX);
    }

    /// `reporter` could not get packs from `peer` at `now`: `peer`'s packs
    /// are not offered to anyone for 60 s (it is likely down,
    /// before its heartbeats say so), and `labrun status` says why.
    /// A peer that is no member of the cluster is not taken (a signed
    /// request may name any node).
    pub fn suspect(&self, reporter: &str, peer: &NodeName, why: &str, now: Millis) {
        let why: String = why.chars().take(300).collect();
        let mut v = self.view.lock().expect("coordinator poisoned");
        if !v.members.contains_key(peer) {
            return;
        }
        let cut = now.saturating_sub(SUSPECT_FOR.as_millis() as u64);
        v.suspect.retain(|_, (_, at)| *at > cut);
        v.suspect
            .insert((peer.clone(), reporter.to_string()), (why, now));
        keep_newest(&mut v.suspect, NOTES_MAX);
    }

    /// The peers suspected at `now`.
    fn suspected(v: &View, now: Millis) -> HashSet<&NodeName> {
        let cut = now.saturating_sub(SUSPECT_FOR.as_millis() as u64);
        (v.suspect.iter())
            .filter(|(_, (_, at))| *at > cut)
            .map(|((peer, _), _)| peer)
            .collect()
    }

    /// Applies a heartbeat `sender` signed (it must name itself) at `now`.
    pub fn heartbeat(
        &self,
        sender: &str,
        hb: Heartbeat,
        now: Millis,
    ) -> Result<HeartbeatReply, JobError> {
        if hb.node != sender {
            return Err(JobError::Forbidden(format!(
                "{sender} sent a heartbeat for {}: a node speaks for itself only",
                hb.node
            )));
        }
        let name = hb.node.clone();
        let kill = self.ended_here(sender, &hb.jobs);
        let mut v = self.view.lock().expect("coordinator poisoned");
        let follows = v
            .members
            .get(&name)
            .is_some_and(|m| m.instance == hb.instance && m.seq == hb.inventory.base);
        let View {
            cluster,
            members,
            labels,
            promised,
            ..
        } = &mut *v;
        let node = cluster.node_entry(&name);
        node.health = Health::Up;
        node.gpus = hb.gpus.iter().map(slot).collect();
        // What the node measured, else the defaults.
        let (measured, default) = (&hb.cache.fetched, Rates::default());
        node.rates = Rates {
            peer: measured.peer_rate.map_or(default.peer, |r| r as f64),
            store: measured.store_rate.map_or(default.store, |r| r as f64),
        };
        // A promise is kept until the agent reports the GPU leased to
        // that job: a heartbeat sent before the dispatch arrived says free.
        if let Some(p) = promised.get_mut(&name) {
            p.retain(|g, job| {
                !hb.gpus.iter().any(|s| {
                    s.index == *g && matches!(&s.state, GpuState::Leased { job: j, .. } if j == job)
                })
            });
        }
        let mut reply = HeartbeatReply {
            kill,
            ..HeartbeatReply::default()
        };
        if hb.inventory.full {
            cluster.clear_cached(&name);
        }
        if hb.inventory.full || follows {
            for (p, size) in &hb.inventory.added {
                cluster.set_cached(&name, PackKey(*p.as_bytes()), *size, true);
            }
            for p in &hb.inventory.removed {
                cluster.set_cached(&name, PackKey(*p.as_bytes()), 0, false);
            }
            for (s, packs) in &hb.inventory.snapshots {
                cluster.add_snapshot(
                    SnapshotKey(*s.as_bytes()),
                    packs.iter().map(|(p, n)| (PackKey(*p.as_bytes()), *n)),
                );
            }
        } else {
            // A restart on either side, or a lost reply: the delta does not
            // follow what is held here.
            reply.want_full = true;
        }
        for t in &hb.cache.trees {
            labels.insert(t.snapshot, t.label.clone());
        }
        cluster.set_trees(
            &name,
            (hb.cache.materialised.iter())
                .map(|s| SnapshotKey(*s.as_bytes()))
                .collect(),
        );
        let seq = if reply.want_full {
            members.get(&name).map_or(0, |m| m.seq)
        } else {
            hb.seq
        };
        members.insert(
            name,
            Member {
                addr: hb.addr,
                instance: hb.instance,
                seq,
                last_seen: now,
                gpus: hb.gpus,
                jobs: hb.jobs,
                cache: hb.cache,
                version: hb.version,
                gpu_confinement: hb.gpu_confinement,
            },
        );
        Ok(reply)
    }

    /// Of the jobs `node` lists as active, those ended here on that node
    /// (killed while it was down): it is to kill them.
    fn ended_here(&self, node: &str, jobs: &[JobView]) -> Vec<JobId> {
        jobs.iter()
            .filter(|j| !j.ended())
            .filter(|j| match self.jobs.get(&j.id) {
                Ok(Some(x)) => match &x.placement {
                    Placement::Ended { view } => view.node.as_deref() == Some(node),
                    _ => false,
                },
                _ => false,
            })
            .map(|j| j.id.clone())
            .collect()
    }

    /// The nodes that are up.
    pub fn members_up(&self, now: Millis) -> Vec<NodeName> {
        self.tick(now);
        let v = self.view.lock().expect("coordinator poisoned");
        v.members
            .keys()
            .filter(|n| v.cluster.node(n).is_some_and(|x| x.is_up()))
            .cloned()
            .collect()
    }

    /// Who holds each of `packs`, among the up nodes other than `asker`.
    pub fn locate(&self, asker: &str, packs: &[PackId]) -> crate::proto::Located {
        let v = self.view.lock().expect("coordinator poisoned");
        let suspect = Self::suspected(&v, self.now_ms());
        packs
            .iter()
            .map(|p| {
                let holders = v
                    .cluster
                    .holders(&PackKey(*p.as_bytes()))
                    .into_iter()
                    .filter(|n| n.as_str() != asker && !suspect.contains(n))
                    .filter_map(|n| Some((n.to_string(), v.members.get(n)?.addr.clone())))
                    .collect();
                (*p, holders)
            })
            .collect()
    }

    /// Marks nodes unheard of for `down_after` down.
    pub fn tick(&self, now: Millis) {
        let mut v = self.view.lock().expect("coordinator poisoned");
        let View {
            cluster, members, ..
        } = &mut *v;
        for (name, m) in members.iter() {
            if now.saturating_sub(m.last_seen) > self.down_after.as_millis() as u64 {
                if let Some(node) = cluster.node_mut(name) {
                    if node.health == Health::Up {
                        tracing::warn!(
                            "node {name} is down: no heartbeat for {} s",
                            (now - m.last_seen) / 1000
                        );
                        node.health = Health::Down { since: m.last_seen };
                    }
                }
            }
        }
    }

    /// Every node as `labrun status` shows it.
    pub fn status(&self, now: Millis) -> ClusterStatus {
        self.tick(now);
        let v = self.view.lock().expect("coordinator poisoned");
        let mut known: Vec<(&SnapshotId, &String)> = v.labels.iter().collect();
        known.sort_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)));
        let nodes = v
            .members
            .iter()
            .map(|(name, m)| {
                let health = match v.cluster.node(name).map(|n| n.health) {
                    Some(Health::Down { since }) => NodeHealth::Down { since },
                    _ => NodeHealth::Up,
                };
                let data = known
                    .iter()
                    .filter_map(|(s, label)| {
                        let key = SnapshotKey(*s.as_bytes());
                        let (present_bytes, total_bytes) = v.cluster.presence(name, &key)?;
                        let materialised = v.cluster.materialised(name, &key);
                        (present_bytes > 0 || materialised).then(|| Presence {
                            label: (*label).clone(),
                            snapshot: **s,
                            present_bytes,
                            total_bytes,
                            pinned: m.cache.trees.iter().any(|t| t.snapshot == **s && t.pinned),
                            materialised,
                        })
                    })
                    .collect();
                NodeStatus {
                    fetched: m.cache.fetched.clone(),
                    warming: m.cache.warming.clone(),
                    name: name.clone(),
                    addr: m.addr.clone(),
                    health,
                    last_heartbeat: m.last_seen,
                    gpus: m.gpus.clone(),
                    jobs: m.jobs.clone(),
                    cache_used: m.cache.used_bytes,
                    cache_max: m.cache.max_bytes,
                    data,
                    gpu_confinement: m.gpu_confinement.clone(),
                    version: m.version.clone(),
                    suspect: (v.suspect.range((name.clone(), String::new())..))
                        .take_while(|((peer, _), _)| peer == name)
                        .filter(|(_, (_, at))| {
                            now.saturating_sub(*at) < SUSPECT_FOR.as_millis() as u64
                        })
                        .map(|((_, by), (why, at))| {
                            format!(
                                "{by} could not get packs from it {} s ago: {why}",
                                now.saturating_sub(*at) / 1000
                            )
                        })
                        .collect(),
                }
            })
            .collect();
        let refused = v
            .refused
            .iter()
            .filter(|(n, (_, at))| v.members.get(*n).is_none_or(|m| m.last_seen <= *at))
            .map(|(node, (why, at_ms))| Refused {
                node: node.clone(),
                why: why.clone(),
                at_ms: *at_ms,
            })
            .collect();
        ClusterStatus {
            coordinator: self.name.clone(),
            nodes,
            version: crate::proto::VERSION.into(),
            refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use labsync_store::PackId;

    use super::*;
    use crate::proto::{CachedTree, InventoryDelta};

    fn hb(node: &str, instance: &str, seq: u64, inventory: InventoryDelta) -> Heartbeat {
        Heartbeat {
            node: node.parse().unwrap(),
            addr: format!("http://{node}:7420"),
            instance: instance.into(),
            seq,
            gpus: Vec::new(),
            jobs: Vec::new(),
            cache: CacheSummary::default(),
            inventory,
            gpu_confinement: String::new(),
            version: String::new(),
            protocol: 0,
        }
    }

    fn pack(i: u8) -> PackId {
        PackId::from_bytes([i; 32])
    }

    /// gpu1's coordinator with the default lab rules, its jobs in `dir`.
    fn coordinator(dir: &Path) -> Coordinator {
        let name = "gpu1".parse().unwrap();
        Coordinator::new(&name, Duration::from_secs(10), dir, &LabConfig::default()).unwrap()
    }

    /// An explain's or a ranking's snapshots are planned with, not kept:
    /// any user may ask about any snapshot anyone pushed, and the view is
    /// copied by every scheduling pass.
    #[test]
    fn a_view_planned_with_new_snapshots_does_not_keep_them() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let snap = SnapshotId::from_bytes([7; 32]);
        let fresh = vec![(snap, std::sync::Arc::new(vec![(pack(1), 100)]))];
        let key = SnapshotKey(*snap.as_bytes());
        assert!(c.planning_with(&fresh).knows_snapshot(&key));
        assert!(!c.knows(&snap));
        c.learn(&snap, &fresh[0].1);
        assert!(c.knows(&snap));
    }

    /// A peer a node could not get packs from is not offered to anyone for
    /// a while, and the status says who could not reach it and why.
    #[test]
    fn a_peer_reported_failing_is_not_offered_for_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let clock = c.now_ms();
        for n in ["gpu1", "gpu2", "gpu3"] {
            let mut inv = InventoryDelta {
                full: true,
                ..Default::default()
            };
            if n != "gpu2" {
                inv.added = vec![(pack(1), 100)];
            }
            c.heartbeat(n, hb(n, "i", 1, inv), clock).unwrap();
        }
        let holders = |asker: &str| -> Vec<String> {
            c.locate(asker, &[pack(1)])[0]
                .1
                .iter()
                .map(|(n, _)| n.clone())
                .collect()
        };
        assert_eq!(holders("gpu2"), ["gpu1", "gpu3"]);
        c.suspect(
            "gpu2",
            &"gpu1".parse().unwrap(),
            "connection refused",
            clock,
        );
        assert_eq!(holders("gpu2"), ["gpu3"]);
        assert_eq!(holders("gpu3"), Vec::<String>::new(), "to anyone");
        let s = c.status(clock);
        let gpu1 = s.nodes.iter().find(|n| n.name == "gpu1").unwrap();
        assert_eq!(gpu1.suspect.len(), 1);
        assert!(
            gpu1.suspect[0].starts_with("gpu2 could not get packs from it"),
            "{:?}",
            gpu1.suspect
        );
        assert!(gpu1.suspect[0].ends_with("connection refused"));
        // A peer that is no member is not taken; a thousand made-up
        // reporters leave the newest 256, the real one among them.
        c.suspect("gpu2", &"gpu9".parse().unwrap(), "made up", clock);
        assert!(!c
            .view
            .lock()
            .unwrap()
            .suspect
            .keys()
            .any(|(p, _)| p == "gpu9"));
        for i in 0..1000 {
            c.suspect(
                &format!("fake{i}"),
                &"gpu3".parse().unwrap(),
                "x",
                clock - 1000 + i,
            );
        }
        {
            let v = c.view.lock().unwrap();
            assert_eq!(v.suspect.len(), NOTES_MAX);
            assert!(v
                .suspect
                .contains_key(&("gpu3".parse().unwrap(), "fake999".into())));
        }
        for i in 0..300 {
            c.refuse(&format!("n{i}").parse().unwrap(), "old", clock + i);
        }
        assert_eq!(c.view.lock().unwrap().refused.len(), NOTES_MAX);
        // Later, it is offered again, and no longer said.
        let later = clock + SUSPECT_FOR.as_millis() as u64 + 1;
        let s = c.status(later);
        assert!(s.nodes.iter().all(|n| n.suspect.is_empty()));
    }

    /// Pack lists no live job and no cache needs are forgotten, after a
    /// look's grace; those a queued job or a node's cache needs stay.
    #[test]
    fn snapshots_nothing_needs_are_forgotten_after_a_grace() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let snap = |i: u8| SnapshotId::from_bytes([i; 32]);
        let (queued, cached, spent) = (snap(1), snap(2), snap(3));
        for (s, p) in [(queued, 1), (cached, 2), (spent, 3)] {
            c.learn(&s, &[(pack(p), 100)]);
        }
        let req = crate::proto::SubmitRequest {
            argv: vec!["true".into()],
            code: Some(crate::proto::TreeRef {
                label: "code/alice@v1".into(),
                snapshot: queued,
            }),
            ..Default::default()
        };
        c.jobs.create("alice", req, 1, 0).unwrap();
        let mut beat = hb(
            "gpu2",
            "i1",
            1,
            InventoryDelta {
                full: true,
                added: vec![(pack(2), 100)],
                snapshots: vec![(cached, vec![(pack(2), 100)])],
                ..Default::default()
            },
        );
        beat.cache.trees.push(CachedTree {
            snapshot: cached,
            label: "div2k@v1".into(),
            bytes: 100,
            pinned: false,
        });
        c.heartbeat("gpu2", beat, 1_000).unwrap();

        c.forget_unused();
        assert!(
            c.knows(&spent),
            "kept one look: it may be a submission not yet recorded"
        );
        c.forget_unused();
        assert!(!c.knows(&spent));
        assert!(c.knows(&queued) && c.knows(&cached));
        let st = c.status(1_000);
        assert_eq!(st.nodes[0].data[0].total_bytes, 100, "{st:?}");
        // Learned again, it needs a look without a need again to go.
        c.learn(&spent, &[(pack(3), 100)]);
        c.forget_unused();
        assert!(c.knows(&spent));
    }

    #[test]
    fn deltas_apply_in_order_and_a_gap_asks_for_everything() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let snap = SnapshotId::from_bytes([9; 32]);
        let full = InventoryDelta {
            full: true,
            base: 0,
            added: vec![(pack(1), 100)],
            removed: vec![],
            snapshots: vec![(snap, vec![(pack(1), 100), (pack(2), 300)])],
        };
        let mut first = hb("gpu2", "i1", 1, full);
        first.cache.trees.push(CachedTree {
            snapshot: snap,
            label: "div2k@v1".into(),
            bytes: 400,
            pinned: true,
        });
        assert!(!c.heartbeat("gpu2", first, 1_000).unwrap().want_full);
        let st = c.status(1_000);
        let d = &st.nodes[0].data[0];
        assert_eq!((d.present_bytes, d.total_bytes, d.pinned), (100, 400, true));
        // The next delta follows seq 1.
        let delta = InventoryDelta {
            base: 1,
            added: vec![(pack(2), 300)],
            ..Default::default()
        };
        assert!(
            !c.heartbeat("gpu2", hb("gpu2", "i1", 2, delta), 2_000)
                .unwrap()
                .want_full
        );
        assert_eq!(c.status(2_000).nodes[0].data[0].present_bytes, 400);
        // A delta after a lost reply (base 1 again) is not applied.
        let stale = InventoryDelta {
            base: 1,
            removed: vec![pack(2)],
            ..Default::default()
        };
        assert!(
            c.heartbeat("gpu2", hb("gpu2", "i1", 3, stale), 3_000)
                .unwrap()
                .want_full
        );
        assert_eq!(c.status(3_000).nodes[0].data[0].present_bytes, 400);
        // Nor one from a restarted agent.
        let fresh = InventoryDelta {
            base: 2,
            ..Default::default()
        };
        assert!(
            c.heartbeat("gpu2", hb("gpu2", "i2", 1, fresh), 3_000)
                .unwrap()
                .want_full
        );
    }

    #[test]
    fn measured_rates_reach_the_placer_and_defaults_stand_in_until_then() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let full = InventoryDelta {
            full: true,
            ..Default::default()
        };
        c.heartbeat("gpu2", hb("gpu2", "i", 1, full), 0).unwrap();
        let name: NodeName = "gpu2".parse().unwrap();
        let rates = |c: &Coordinator| c.view.lock().unwrap().cluster.node(&name).unwrap().rates;
        assert_eq!(rates(&c), Rates::default());
        let mut measured = hb(
            "gpu2",
            "i",
            2,
            InventoryDelta {
                base: 1,
                ..Default::default()
            },
        );
        measured.cache.fetched.peer_rate = Some(300_000_000);
        c.heartbeat("gpu2", measured, 1_000).unwrap();
        let r = rates(&c);
        assert_eq!((r.peer, r.store), (300e6, Rates::default().store));
    }

    #[test]
    fn a_silent_node_is_down_until_it_speaks_again() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let full = InventoryDelta {
            full: true,
            ..Default::default()
        };
        c.heartbeat("gpu2", hb("gpu2", "i", 1, full.clone()), 1_000)
            .unwrap();
        assert_eq!(c.status(11_000).nodes[0].health, NodeHealth::Up);
        assert_eq!(
            c.status(11_001).nodes[0].health,
            NodeHealth::Down { since: 1_000 }
        );
        c.heartbeat("gpu2", hb("gpu2", "i", 2, full), 20_000)
            .unwrap();
        assert_eq!(c.status(20_000).nodes[0].health, NodeHealth::Up);
    }

    #[test]
    fn a_node_speaks_for_itself_only() {
        let dir = tempfile::tempdir().unwrap();
        let c = coordinator(dir.path());
        let e = c
            .heartbeat("gpu3", hb("gpu2", "i", 1, InventoryDelta::default()), 0)
            .unwrap_err();
        assert!(e.to_string().contains("speaks for itself"), "{e}");
        // A name that is none does not make it past the wire.
        let mut body = serde_json::to_value(hb("gpu2", "i", 1, InventoryDelta::default())).unwrap();
        body["node"] = "bad name".into();
        let e = serde_json::from_value::<Heartbeat>(body).unwrap_err();
        assert!(
            e.to_string().contains("\"bad name\" is not a node name"),
            "{e}"
        );
    }
}
