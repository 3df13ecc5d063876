//! Entry points for the fuzz targets (`fuzz/`) and their regression tests:
//! each feeds arbitrary bytes to one decoder of store objects, which every
//! lab member can write, and must return (an error is fine) without
//! panicking or allocating more than the input justifies.
//!
//! Where a format carries a checksum or a content id, the entry point makes
//! it right first, so the fuzzer reaches the parser behind it instead of
//! stopping at the hash.

use crate::id::{ChunkId, PackId, SnapshotId};
use crate::pack::{self, PackEntry};
use crate::repo::VersionRecord;
use crate::snapshot::{self, SnapshotObject};

/// A snapshot object (`snapshots/<id>`), named by its own hash.
pub fn snapshot_object(data: &[u8]) {
    let _ = SnapshotObject::decode(data, &SnapshotId::of(data));
}

/// A tree segment, then the checks pull makes before it writes anything.
pub fn tree_segment(data: &[u8]) {
    if let Ok(mut entries) = snapshot::decode_segment(data, &ChunkId::of(data)) {
        let _ = snapshot::validate_entries(&mut entries, "fuzz");
    }
}

/// An index object (`index/<hash>`), then lookups through what it says.
pub fn index_object(data: &[u8]) {
    if let Ok(packs) = crate::index::decode(data, "fuzz") {
        let mut index = crate::index::Index::default();
        for p in &packs {
            index.add(p);
        }
        for p in &packs {
            for c in &p.chunks {
                if let Some((_, e)) = index.get(&c.0) {
                    // What pull does with an entry: decode a buffer of its
                    // stored length (here zeros; the check must refuse it).
                    let stored = vec![0u8; e.stored_len as usize];
                    let _ = e.decode(&stored, &p.pack);
                }
            }
        }
    }
}

/// A whole pack: the trailer's footer checksum is fixed up and the pack is
/// named by its footer (format 2), then its footer is parsed and every
/// entry it lists is decoded from the pack's bytes.
pub fn pack(data: &[u8]) {
    let tl = pack::trailer_len();
    let mut bytes = data.to_vec();
    if bytes.len() >= tl {
        let t = bytes.len() - tl;
        let footer_len = u32::from_le_bytes(bytes[t..t + 4].try_into().expect("4 bytes")) as usize;
        if let Some(start) = t.checked_sub(footer_len) {
            let sum = blake3::hash(&bytes[start..t]);
            bytes[t + 8..t + 16].copy_from_slice(&sum.as_bytes()[..8]);
            let id = PackId::from_bytes(
                *blake3::Hasher::new()
                    .update(&bytes[start..t])
                    .update(&bytes[t..])
                    .finalize()
                    .as_bytes(),
            );
            if let Ok(entries) = pack::read_entries(&bytes, &id) {
                for e in &entries {
                    decode_from(&bytes, e, &id);
                }
            }
            return;
        }
    }
    let _ = pack::read_entries(&bytes, &PackId::of(&bytes));
}

fn decode_from(bytes: &[u8], e: &PackEntry, id: &PackId) {
    let start = e.offset as usize;
    let end = start.checked_add(e.stored_len as usize);
    if let Some(stored) = end.and_then(|end| bytes.get(start..end)) {
        let _ = e.decode(stored, id);
    }
}

/// A version record (`refs/<name>/@/<version>`).
pub fn version_ref(data: &[u8]) {
    if let Ok(rec) = serde_json::from_slice::<VersionRecord>(data) {
        let _ = rec.label();
        let _ = crate::repo::validate_name(&rec.name);
    }
}
