//! The cluster as the coordinator sees it: nodes, their GPUs, which packs
//! each one has cached, and which packs each snapshot needs.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::bitset::Bitset;

/// Absolute time in milliseconds (since the Unix epoch in labd, since the
/// trace's start in the simulator). The placer never reads a clock: every
/// call that needs "now" takes it as an argument.
pub type Millis = u64;

/// A node's name, as in its config and on the command line (`gpu3`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeName(String);

/// A node name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a node name: use 1 to 63 letters, digits, '-', '_' or '.', \
     starting with a letter or digit"
)]
pub struct BadNodeName(pub String);

impl NodeName {
    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for NodeName {
    type Err = BadNodeName;

    /// Host-name-like names only: a name lands in tables, paths of the
    /// coordinator's state and log lines, so nothing that could break them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = (1..=63).contains(&s.len())
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if ok {
            Ok(NodeName(s.to_string()))
        } else {
            Err(BadNodeName(s.to_string()))
        }
    }
}

impl TryFrom<String> for NodeName {
    type Error = BadNodeName;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<NodeName> for String {
    fn from(n: NodeName) -> String {
        n.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Read as text wherever text is asked for (a name is checked once, when
/// it is made, never changed after).
impl std::ops::Deref for NodeName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for NodeName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for NodeName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for NodeName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for NodeName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for NodeName {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<NodeName> for str {
    fn eq(&self, other: &NodeName) -> bool {
        self == other.0
    }
}

impl PartialEq<NodeName> for &str {
    fn eq(&self, other: &NodeName) -> bool {
        *self == other.0
    }
}

impl PartialEq<NodeName> for String {
    fn eq(&self, other: &NodeName) -> bool {
        *self == other.0
    }
}

/// A pack's id, opaque to the placer (the store's BLAKE3 pack id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackKey(pub [u8; 32]);

/// A snapshot's id, opaque to the placer (the store's snapshot id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SnapshotKey(pub [u8; 32]);

/// What a GPU is doing, as far as placement cares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "slot", rename_all = "snake_case")]
pub enum Slot {
    /// Not leased, and no foreign process holds more than the node's limit.
    Free,
    /// Leased to a job; `until` is when that job is expected to end, where
    /// anyone knows (the simulator does; a job with no time limit does not).
    Busy {
        /// Expected end.
        until: Option<Millis>,
    },
    /// Held by a process labd did not start, or its reading is unknown:
    /// never chosen, and no one can say when it will be usable.
    Unavailable,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Its NVML index on its node.
    pub index: u32,
    /// Memory installed, bytes.
    pub memory_total: u64,
    /// Memory free now, bytes (a small foreign process may hold some).
    pub memory_free: u64,
    /// What it is doing.
    pub slot: Slot,
}

impl Gpu {
    /// A free GPU with all of `memory` free.
    pub fn free(index: u32, memory: u64) -> Gpu {
        Gpu {
            index,
            memory_total: memory,
            memory_free: memory,
            slot: Slot::Free,
        }
    }
}

/// Whether the coordinator hears from a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "health", rename_all = "snake_case")]
pub enum Health {
    /// Heartbeats arrive.
    Up,
    /// No heartbeat since `since`: never chosen, and its packs are not
    /// offered to peers.
    Down {
        /// The last heartbeat.
        since: Millis,
    },
}

/// Measured rates at which a node receives packs, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// From peers that hold the pack.
    pub peer: f64,
    /// From the object store.
    pub store: f64,
}

impl Default for Rates {
    /// Before anything is measured: a 1 Gbit/s LAN between nodes, half
    /// that from the object store. Measurements replace them quickly.
    fn default() -> Self {
        Rates {
            peer: 110e6,
            store: 55e6,
        }
    }
}

/// One node.
#[derive(Clone, Debug)]
pub struct NodeView {
    name: NodeName,
    /// Whether it is heard from.
    pub health: Health,
    /// Its GPUs, any order.
    pub gpus: Vec<Gpu>,
    /// How fast it receives packs.
    pub rates: Rates,
    present: Bitset,
    /// Snapshots whose trees are materialised there: a job on one starts
    /// with no fetch, whatever packs the node has kept.
    trees: Vec<SnapshotKey>,
}

impl NodeView {
    /// The node's name.
    pub fn name(&self) -> &NodeName {
        &self.name
    }

    /// Whether it can be chosen at all.
    pub fn is_up(&self) -> bool {
        self.health == Health::Up
    }
}

/// Every pack the view has heard of, numbered densely.
#[derive(Clone, Debug, Default)]
struct Packs {
    number: HashMap<PackKey, u32>,
    size: Vec<u64>,
}

impl Packs {
    fn intern(&mut self, key: PackKey, size: u64) -> u32 {
        let next = self.size.len() as u32;
        let n = *self.number.entry(key).or_insert(next);
        if n == next {
            self.size.push(size);
        }
        n
    }
}

/// The cluster view: nodes, the packs each holds, the packs each known
/// snapshot needs.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    nodes: Vec<NodeView>,
    packs: Packs,
    snapshots: HashMap<SnapshotKey, Vec<u32>>,
}

impl Cluster {
    /// An empty view.
    pub fn new() -> Cluster {
        Cluster::default()
    }

    /// Adds a node (up, no GPUs, nothing cached, default rates), or returns
    /// the one of that name.
    pub fn node_entry(&mut self, name: &NodeName) -> &mut NodeView {
        let at = match self.nodes.binary_search_by(|n| n.name.cmp(name)) {
            Ok(at) => at,
            Err(at) => {
                let node = NodeView {
                    name: name.clone(),
                    health: Health::Up,
                    gpus: Vec::new(),
                    rates: Rates::default(),
                    present: Bitset::default(),
                    trees: Vec::new(),
                };
                self.nodes.insert(at, node);
                at
            }
        };
        &mut self.nodes[at]
    }

    /// Forgets a node and what it cached.
    pub fn remove_node(&mut self, name: &NodeName) -> bool {
        match self.nodes.binary_search_by(|n| n.name.cmp(name)) {
            Ok(at) => {
                self.nodes.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    /// Every node, sorted by name.
    pub fn nodes(&self) -> &[NodeView] {
        &self.nodes
    }

    /// The node of that name.
    pub fn node(&self, name: &NodeName) -> Option<&NodeView> {
        self.index_of(name).map(|i| &self.nodes[i])
    }

    /// The node of that name, to update its GPUs, health or rates.
    pub fn node_mut(&mut self, name: &NodeName) -> Option<&mut NodeView> {
        self.index_of(name).map(|i| &mut self.nodes[i])
    }

    pub(crate) fn index_of(&self, name: &NodeName) -> Option<usize> {
        self.nodes.binary_search_by(|n| n.name.cmp(name)).ok()
    }

    pub(crate) fn nodes_mut(&mut self) -> &mut [NodeView] {
        &mut self.nodes
    }

    /// Records the packs a snapshot needs (from its index), with their
    /// sizes. A snapshot is immutable, so a second call changes nothing.
    pub fn add_snapshot(
        &mut self,
        key: SnapshotKey,
        packs: impl IntoIterator<Item = (PackKey, u64)>,
    ) {
        if self.snapshots.contains_key(&key) {
            return;
        }
        let mut numbers: Vec<u32> = packs
            .into_iter()
            .map(|(p, size)| self.packs.intern(p, size))
            .collect();
        numbers.sort_unstable();
        numbers.dedup();
        self.snapshots.insert(key, numbers);
    }

    /// Whether the view knows what the snapshot needs.
    pub fn knows_snapshot(&self, key: &SnapshotKey) -> bool {
        self.snapshots.contains_key(key)
    }

    /// The snapshots the view knows.
    pub fn snapshot_keys(&self) -> impl Iterator<Item = &SnapshotKey> {
        self.snapshots.keys()
    }

    /// Forgets the snapshots `keep` says no to, then the packs no snapshot
    /// left needs and no node holds: a coordinator that runs for months
    /// keeps what its queue and the caches need, not every snapshot it
    /// ever priced. Everything kept reads as before. Returns how many
    /// snapshots were forgotten.
    pub fn retain_snapshots(&mut self, keep: impl Fn(&SnapshotKey) -> bool) -> usize {
        let before = self.snapshots.len();
        self.snapshots.retain(|k, _| keep(k));
        let mut live = vec![false; self.packs.size.len()];
        let held = self.nodes.iter().flat_map(|n| n.present.iter());
        for p in self.snapshots.values().flatten().copied().chain(held) {
            live[p as usize] = true;
        }
        // Numbered again in the same order, so every list stays sorted.
        let mut renumber = vec![u32::MAX; live.len()];
        let mut size = Vec::new();
        for (old, _) in live.iter().enumerate().filter(|(_, l)| **l) {
            renumber[old] = size.len() as u32;
            size.push(self.packs.size[old]);
        }
        self.packs.number.retain(|_, n| {
            *n = renumber[*n as usize];
            *n != u32::MAX
        });
        self.packs.size = size;
        for numbers in self.snapshots.values_mut() {
            for n in numbers.iter_mut() {
                *n = renumber[*n as usize];
            }
        }
        for node in &mut self.nodes {
            let mut present = Bitset::default();
            for p in node.present.iter() {
                present.insert(renumber[p as usize]);
            }
            node.present = present;
        }
        before - self.snapshots.len()
    }

    /// Records that a node now has (or no longer has) a pack: the deltas a
    /// heartbeat carries. False when the node is unknown.
    pub fn set_cached(&mut self, node: &NodeName, pack: PackKey, size: u64, cached: bool) -> bool {
        let n = self.packs.intern(pack, size);
        match self.node_mut(node) {
            Some(v) if cached => {
                v.present.insert(n);
                true
            }
            Some(v) => {
                v.present.remove(n);
                true
            }
            None => false,
        }
    }

    /// The snapshots whose trees are materialised on `node` (each
    /// heartbeat's list): their packs count as there for placement and
    /// presence (a job starts on the tree), though the node cannot serve
    /// them to peers. False when the node is unknown.
    pub fn set_trees(&mut self, node: &NodeName, trees: Vec<SnapshotKey>) -> bool {
        self.node_mut(node).map(|v| v.trees = trees).is_some()
    }

    /// The packs of `needs` that node `i` needs no copy of, their
    /// snapshots being materialised there: those of the materialised ones,
    /// but for packs a snapshot not materialised there needs too (its tree
    /// is built from packs, not from another tree).
    pub(crate) fn tree_packs(&self, i: usize, needs: &[SnapshotKey]) -> Bitset {
        let trees = &self.nodes[i].trees;
        let mut b = Bitset::default();
        if trees.is_empty() {
            return b;
        }
        let packs = |s: &SnapshotKey| self.snapshots.get(s).map_or(&[][..], Vec::as_slice);
        for s in needs.iter().filter(|s| trees.contains(s)) {
            for &p in packs(s) {
                b.insert(p);
            }
        }
        for s in needs.iter().filter(|s| !trees.contains(s)) {
            for &p in packs(s) {
                b.remove(p);
            }
        }
        b
    }

    /// Forgets everything a node had cached (a full inventory follows).
    pub fn clear_cached(&mut self, node: &NodeName) -> bool {
        self.node_mut(node)
            .map(|v| v.present = Bitset::default())
            .is_some()
    }

    /// Bytes of the snapshot's packs that the node has cached, and their
    /// total: `labrun status`'s "% present" (a tree materialised there is
    /// said apart: [`Cluster::materialised`]). `None` for an unknown node
    /// or snapshot.
    pub fn presence(&self, node: &NodeName, snapshot: &SnapshotKey) -> Option<(u64, u64)> {
        let v = self.node(node)?;
        let packs = self.snapshots.get(snapshot)?;
        let (mut have, mut total) = (0, 0);
        for &p in packs {
            let size = self.packs.size[p as usize];
            total += size;
            if v.present.contains(p) {
                have += size;
            }
        }
        Some((have, total))
    }

    /// Whether the snapshot's tree is materialised on the node: a job on
    /// it starts there with no fetch, whatever packs are cached.
    pub fn materialised(&self, node: &NodeName, snapshot: &SnapshotKey) -> bool {
        self.node(node).is_some_and(|v| v.trees.contains(snapshot))
    }

    /// The up nodes that hold `pack`: where a node can fetch it from.
    pub fn holders(&self, pack: &PackKey) -> Vec<&NodeName> {
        let Some(&n) = self.packs.number.get(pack) else {
            return Vec::new();
        };
        self.nodes
            .iter()
            .filter(|v| v.is_up() && v.present.contains(n))
            .map(|v| &v.name)
            .collect()
    }

    /// Bytes of packs the node has cached, as far as the view knows.
    pub fn cached_bytes(&self, node: &NodeName) -> Option<u64> {
        let v = self.node(node)?;
        Some(v.present.iter().map(|p| self.packs.size[p as usize]).sum())
    }

    /// The distinct packs of some snapshots, with the ones the view does
    /// not know.
    pub(crate) fn packs_of(&self, snapshots: &[SnapshotKey]) -> (Vec<u32>, Vec<SnapshotKey>) {
        let mut unknown = Vec::new();
        let mut all = Vec::new();
        for s in snapshots {
            match self.snapshots.get(s) {
                Some(p) => all.extend_from_slice(p),
                None => unknown.push(*s),
            }
        }
        all.sort_unstable();
        all.dedup();
        (all, unknown)
    }

    pub(crate) fn pack_size(&self, p: u32) -> u64 {
        self.packs.size[p as usize]
    }

    pub(crate) fn has(&self, node: usize, p: u32) -> bool {
        self.nodes[node].present.contains(p)
    }

    pub(crate) fn mark(&mut self, node: usize, p: u32) {
        self.nodes[node].present.insert(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> NodeName {
        s.parse().unwrap()
    }

    #[test]
    fn node_names_are_host_like() {
        for good in ["gpu3", "a", "node-1.lab_x", &"x".repeat(63)] {
            assert!(good.parse::<NodeName>().is_ok(), "{good}");
        }
        for bad in ["", "-gpu", ".x", "gpu 3", "gpu/3", "gpü", &"x".repeat(64)] {
            let e = bad.parse::<NodeName>().unwrap_err();
            assert!(e.to_string().contains("is not a node name"), "{e}");
        }
        assert_eq!(String::from(name("gpu3")), "gpu3");
    }

    #[test]
    fn presence_counts_shared_packs_once_per_snapshot() {
        let mut c = Cluster::new();
        let (a, b) = (name("a"), name("b"));
        c.node_entry(&b);
        c.node_entry(&a);
        assert_eq!(c.nodes()[0].name(), &a, "sorted by name");
        let p = |i: u8| PackKey([i; 32]);
        let div2k = SnapshotKey([1; 32]);
        let df2k = SnapshotKey([2; 32]);
        c.add_snapshot(div2k, [(p(1), 100), (p(2), 100)]);
        c.add_snapshot(df2k, [(p(1), 100), (p(2), 100), (p(3), 50), (p(1), 100)]);
        c.set_cached(&a, p(1), 100, true);
        c.set_cached(&a, p(2), 100, true);
        assert_eq!(c.presence(&a, &div2k), Some((200, 200)));
        assert_eq!(c.presence(&a, &df2k), Some((200, 250)));
        assert_eq!(c.presence(&b, &df2k), Some((0, 250)));
        assert_eq!(c.cached_bytes(&a), Some(200));
        assert_eq!(c.holders(&p(1)), vec![&a]);
        assert!(c.holders(&p(9)).is_empty(), "a pack nobody reported");
        c.node_mut(&a).unwrap().health = Health::Down { since: 0 };
        assert!(c.holders(&p(1)).is_empty(), "a down node offers nothing");
        c.node_mut(&a).unwrap().health = Health::Up;
        assert!(c.set_cached(&a, p(2), 100, false));
        assert_eq!(c.presence(&a, &df2k), Some((100, 250)));
        assert!(!c.set_cached(&name("zz"), p(2), 100, true), "unknown node");
        assert_eq!(c.presence(&a, &SnapshotKey([9; 32])), None);
        assert!(c.clear_cached(&a));
        assert_eq!(c.cached_bytes(&a), Some(0));
        assert!(c.remove_node(&a));
        assert!(c.node(&a).is_none());
    }

    #[test]
    fn forgotten_snapshots_take_only_the_packs_nothing_else_needs() {
        let mut c = Cluster::new();
        let (a, b) = (name("a"), name("b"));
        let p = |i: u8| PackKey([i; 32]);
        let (old, kept, other) = (
            SnapshotKey([1; 32]),
            SnapshotKey([2; 32]),
            SnapshotKey([3; 32]),
        );
        // old: 1, 2, 3; kept: 3, 4; other: 5, 6 (6 cached on b).
        c.add_snapshot(old, [(p(1), 10), (p(2), 20), (p(3), 30)]);
        c.add_snapshot(kept, [(p(3), 30), (p(4), 40)]);
        c.add_snapshot(other, [(p(5), 50), (p(6), 60)]);
        c.node_entry(&a);
        c.node_entry(&b);
        c.set_cached(&a, p(4), 40, true);
        c.set_cached(&b, p(6), 60, true);
        c.set_cached(&b, p(2), 20, true);
        assert_eq!(c.packs.size.len(), 6);

        assert_eq!(c.retain_snapshots(|s| *s == kept), 2);
        assert!(c.knows_snapshot(&kept) && !c.knows_snapshot(&old) && !c.knows_snapshot(&other));
        // 1 and 5 went: no snapshot needs them and no node holds them; 2
        // and 6 stay, held by b.
        assert_eq!(c.packs.size.len(), 4);
        assert!(!c.packs.number.contains_key(&p(1)) && !c.packs.number.contains_key(&p(5)));
        assert_eq!(c.presence(&a, &kept), Some((40, 70)));
        assert_eq!(c.presence(&b, &kept), Some((0, 70)));
        assert_eq!(c.holders(&p(6)), vec![&b]);
        assert_eq!(c.holders(&p(2)), vec![&b]);
        assert_eq!(c.holders(&p(4)), vec![&a]);
        assert_eq!(c.cached_bytes(&b), Some(80));
        // What comes after numbers on from there, and reads right.
        c.add_snapshot(old, [(p(1), 10), (p(2), 20)]);
        c.set_cached(&a, p(1), 10, true);
        assert_eq!(c.presence(&a, &old), Some((10, 30)));
        assert_eq!(c.presence(&b, &old), Some((20, 30)));
        let mut numbers: Vec<u32> = c.packs.number.values().copied().collect();
        numbers.sort_unstable();
        assert_eq!(numbers, (0..5).collect::<Vec<u32>>(), "dense");
        assert_eq!(c.retain_snapshots(|_| true), 0);
    }
}
