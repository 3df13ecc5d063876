//! The chunk index: chunk id → (pack, offset, lengths).
//!
//! Index objects are immutable and written only after every pack they name is
//! durable. Several may exist (one per push, plus partial ones written during
//! long pushes so that an interrupted push resumes); `gc` consolidates them.
//! Losing them all is recoverable: `rebuild-index` reads the pack footers.

use std::collections::HashMap;
use std::hash::BuildHasher;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};
use crate::pack::PackEntry;

const MAGIC: &[u8; 4] = b"LSIX";
const VERSION: u8 = 1;

/// One pack's entries as written in an index object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexPack {
    /// The pack.
    pub pack: PackId,
    /// Its size in bytes.
    pub size: u64,
    /// `(id, offset, stored_len, raw_len, flags)` for every chunk in it.
    pub chunks: Vec<(ChunkId, u64, u32, u32, u8)>,
}

impl IndexPack {
    /// Builds the index record of a pack from its footer entries.
    pub fn new(pack: PackId, size: u64, entries: &[PackEntry]) -> Self {
        IndexPack {
            pack,
            size,
            chunks: entries
                .iter()
                .map(|e| (e.id, e.offset, e.stored_len, e.raw_len, e.flags))
                .collect(),
        }
    }
}

/// Encodes an index object.
pub fn encode(packs: &[IndexPack]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(VERSION);
    postcard::to_extend(packs, out).expect("Vec writer cannot fail")
}

/// Decodes an index object named `key`.
pub fn decode(bytes: &[u8], key: &str) -> Result<Vec<IndexPack>> {
    if bytes.len() < 5 || &bytes[..4] != MAGIC {
        return Err(Error::corrupt(
            format!("index {key}"),
            "not a labsync index object",
        ));
    }
    if bytes[4] != VERSION {
        return Err(Error::corrupt(
            format!("index {key}"),
            format!("format version {}; this labsync reads {VERSION}", bytes[4]),
        ));
    }
    let packs: Vec<IndexPack> = postcard::from_bytes(&bytes[5..])
        .map_err(|e| Error::corrupt(format!("index {key}"), e.to_string()))?;
    // Every entry is checked against its pack's size and the chunk limits:
    // a lying length would otherwise size a buffer (4 GiB for a u32) or
    // overflow an offset on every pull that reads it.
    for p in &packs {
        for e in p.chunks.iter().map(entry_of) {
            if let Some(why) = e.problem(p.size) {
                return Err(Error::corrupt(
                    format!("index {key}"),
                    format!("chunk {} of pack {}: {why}", e.id.short(), p.pack),
                ));
            }
        }
    }
    Ok(packs)
}

/// One chunk of the index: its id and where it lives, 56 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    id: ChunkId,
    offset: u64,
    /// Position of the pack in [`Index::packs`].
    pack: u32,
    stored_len: u32,
    raw_len: u32,
    flags: u8,
}

impl Slot {
    fn entry(&self) -> PackEntry {
        PackEntry {
            id: self.id,
            offset: self.offset,
            stored_len: self.stored_len,
            raw_len: self.raw_len,
            flags: self.flags,
        }
    }
}

/// The in-memory index of a whole store.
///
/// Chunks sit in one dense vector and a table of their positions, hashed
/// with a per-process key (index objects come from any lab member, and
/// chunk ids they list need not be real hashes): about 66 bytes per chunk,
/// where a map from id to location took about 200 (id twice, padding, and a
/// table twice the entries at unlucky sizes). A store of a million files
/// has at least a million chunks, and every push and pull holds its index.
#[derive(Default, Clone)]
pub struct Index {
    packs: Vec<(PackId, u64)>,
    pack_pos: HashMap<PackId, u32>,
    slots: Vec<Slot>,
    table: hashbrown::HashTable<u32>,
    hasher: std::collections::hash_map::RandomState,
    /// Index objects left out, and why: the first [`MAX_REFUSED_KEPT`].
    refused: Vec<(String, String)>,
    /// Index objects left out past those.
    refused_more: u64,
    /// Other places index objects give for chunks already placed (the
    /// first place is the one used until [`Index::relocate`]): pack
    /// position and entry, at most [`MAX_OTHER_PLACES`] in all.
    others: HashMap<ChunkId, Vec<(u32, PackEntry)>>,
    others_len: usize,
}

/// Other places of chunks an [`Index`] keeps, at most: a store where every
/// chunk was indexed twice (two racing pushes of one data set) keeps them
/// all up to a few million chunks; past it a planted object's second
/// places are not all kept.
const MAX_OTHER_PLACES: usize = 4 << 20;

/// Other places of one chunk an [`Index`] keeps, at most: honest stores
/// have one or two; a planted object giving a chunk a million places would
/// have a pull ask after each.
const MAX_PLACES_PER_CHUNK: usize = 4;

/// An index record's chunk as a pack entry.
fn entry_of(&(id, offset, stored_len, raw_len, flags): &(ChunkId, u64, u32, u32, u8)) -> PackEntry {
    PackEntry {
        id,
        offset,
        stored_len,
        raw_len,
        flags,
    }
}

/// How many refused index objects an [`Index`] names (a store may hold
/// millions of junk keys; their count is kept, not their names).
const MAX_REFUSED_KEPT: usize = 100;

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("packs", &self.packs.len())
            .field("chunks", &self.slots.len())
            .field("refused", &self.refused)
            .finish()
    }
}

impl Index {
    fn hash(&self, id: &ChunkId) -> u64 {
        self.hasher.hash_one(id)
    }

    /// Where the chunk is among [`Index::len`] positions (stable while no
    /// chunk is added), for sets of chunks kept as bits.
    pub fn position(&self, id: &ChunkId) -> Option<usize> {
        let slots = &self.slots;
        self.table
            .find(self.hash(id), |&i| slots[i as usize].id == *id)
            .map(|&i| i as usize)
    }

    /// Makes room for `chunks` more chunks at once (a load knows about how
    /// many it will add; growing by doubling would briefly hold both copies).
    pub fn reserve(&mut self, chunks: usize) {
        self.slots.reserve_exact(chunks);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table
            .reserve(chunks, |&i| hasher.hash_one(slots[i as usize].id));
    }

    /// Adds a pack's entries. A chunk already known keeps its first location.
    pub fn add(&mut self, rec: &IndexPack) {
        let pos = *self.pack_pos.entry(rec.pack).or_insert_with(|| {
            self.packs.push((rec.pack, rec.size));
            (self.packs.len() - 1) as u32
        });
        for &(id, offset, stored_len, raw_len, flags) in &rec.chunks {
            let hash = self.hash(&id);
            let (slots, hasher) = (&mut self.slots, &self.hasher);
            let found = self.table.entry(
                hash,
                |&i| slots[i as usize].id == id,
                |&i| hasher.hash_one(slots[i as usize].id),
            );
            match found {
                hashbrown::hash_table::Entry::Vacant(v) => {
                    v.insert(slots.len() as u32);
                    slots.push(Slot {
                        id,
                        offset,
                        pack: pos,
                        stored_len,
                        raw_len,
                        flags,
                    });
                }
                hashbrown::hash_table::Entry::Occupied(o) => {
                    let s = &slots[*o.get() as usize];
                    let e = entry_of(&(id, offset, stored_len, raw_len, flags));
                    if (s.pack, s.entry()) != (pos, e) && self.others_len < MAX_OTHER_PLACES {
                        let others = self.others.entry(id).or_default();
                        if others.len() < MAX_PLACES_PER_CHUNK && !others.contains(&(pos, e)) {
                            others.push((pos, e));
                            self.others_len += 1;
                        }
                    }
                }
            }
        }
    }

    /// Replaces the entries of `rec`'s pack with the pack's own (from its
    /// footer), for chunks this index places in that pack: the footer is
    /// what the pack holds, the index only a copy of it.
    pub fn correct_from_footer(&mut self, rec: &IndexPack) {
        let Some(&pos) = self.pack_pos.get(&rec.pack) else {
            return;
        };
        self.packs[pos as usize].1 = rec.size;
        for &(id, offset, stored_len, raw_len, flags) in &rec.chunks {
            if let Some(i) = self.position(&id) {
                let s = &mut self.slots[i];
                if s.pack == pos {
                    (s.offset, s.stored_len, s.raw_len, s.flags) =
                        (offset, stored_len, raw_len, flags);
                }
            }
        }
    }

    /// Whether any chunk has more than one place.
    pub(crate) fn has_other_places(&self) -> bool {
        !self.others.is_empty()
    }

    /// Every place the index objects give for chunk `id`, the one in use
    /// first.
    pub(crate) fn places(&self, id: &ChunkId) -> Vec<(PackId, PackEntry)> {
        let Some(first) = self.get(id) else {
            return Vec::new();
        };
        let mut out = vec![first];
        for (pos, e) in self.others.get(id).into_iter().flatten() {
            let place = (self.packs[*pos as usize].0, *e);
            if !out.contains(&place) {
                out.push(place);
            }
        }
        out
    }

    /// Uses `entry` of `pack` (one of [`Index::places`]) for chunk `id`.
    pub(crate) fn relocate(&mut self, id: &ChunkId, pack: &PackId, entry: &PackEntry) {
        let (Some(i), Some(&pos)) = (self.position(id), self.pack_pos.get(pack)) else {
            return;
        };
        let s = &mut self.slots[i];
        (s.pack, s.offset, s.stored_len, s.raw_len, s.flags) = (
            pos,
            entry.offset,
            entry.stored_len,
            entry.raw_len,
            entry.flags,
        );
    }

    /// This index less the chunks `chunks` (a push's that it found were
    /// not where the index placed them): pushed again, they are uploaded.
    pub(crate) fn without(&self, chunks: &std::collections::HashSet<ChunkId>) -> Index {
        let mut out = Index::default();
        out.reserve(self.len());
        for mut r in self.to_records(|_| true) {
            r.chunks.retain(|c| !chunks.contains(&c.0));
            out.add(&r);
        }
        out.keep_refused_of(self);
        out
    }

    /// Records an index object that was left out, and why.
    pub(crate) fn refuse(&mut self, key: String, why: String) {
        if self.refused.len() < MAX_REFUSED_KEPT {
            self.refused.push((key, why));
        } else {
            self.refused_more += 1;
        }
    }

    /// Takes over what `other` left out (an index rebuilt from it).
    pub(crate) fn keep_refused_of(&mut self, other: &Index) {
        self.refused = other.refused.clone();
        self.refused_more = other.refused_more;
    }

    /// Index objects left out beyond those [`Index::refused`] names.
    pub fn refused_more(&self) -> u64 {
        self.refused_more
    }

    /// Index objects that were left out (not matching their name, or not
    /// decoding), with why: the chunks only they described are missing, and
    /// `labsync rebuild-index` restores them from the packs.
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    /// Looks a chunk up.
    pub fn get(&self, id: &ChunkId) -> Option<(PackId, PackEntry)> {
        self.position(id).map(|i| {
            let s = &self.slots[i];
            (self.packs[s.pack as usize].0, s.entry())
        })
    }

    /// The chunk at `position`.
    pub fn at(&self, position: usize) -> (PackId, PackEntry) {
        let s = &self.slots[position];
        (self.packs[s.pack as usize].0, s.entry())
    }

    /// True if the chunk is stored.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.position(id).is_some()
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Every pack and its size.
    pub fn packs(&self) -> &[(PackId, u64)] {
        &self.packs
    }

    /// Size of a pack, if indexed.
    pub fn pack_size(&self, pack: &PackId) -> Option<u64> {
        self.pack_pos.get(pack).map(|&p| self.packs[p as usize].1)
    }

    /// All chunks, grouped per pack, as index records (for consolidation).
    pub fn to_records(&self, keep: impl Fn(&PackId) -> bool) -> Vec<IndexPack> {
        let mut recs: Vec<IndexPack> = self
            .packs
            .iter()
            .map(|(p, size)| IndexPack {
                pack: *p,
                size: *size,
                chunks: Vec::new(),
            })
            .collect();
        for s in &self.slots {
            recs[s.pack as usize]
                .chunks
                .push((s.id, s.offset, s.stored_len, s.raw_len, s.flags));
        }
        recs.retain(|r| keep(&r.pack) && !r.chunks.is_empty());
        for r in &mut recs {
            r.chunks.sort_by_key(|c| c.1);
        }
        recs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As an attacker: index objects giving one chunk a thousand other
    /// places (each would cost a pull a request to its pack) are kept to
    /// a few.
    #[test]
    fn a_chunk_keeps_few_other_places() {
        let id = ChunkId::of(b"common");
        let mut index = Index::default();
        for k in 0..1000u32 {
            index.add(&IndexPack {
                pack: PackId::of(&k.to_le_bytes()),
                size: 1 << 20,
                chunks: vec![(id, 0, 10, 10, 0)],
            });
        }
        assert_eq!(index.places(&id).len(), 1 + MAX_PLACES_PER_CHUNK);
    }

    #[test]
    fn encode_decode_identity_and_lookup() {
        let rec = IndexPack {
            pack: PackId::of(b"p"),
            size: 99,
            chunks: vec![
                (ChunkId::of(b"a"), 0, 3, 3, 0),
                (ChunkId::of(b"b"), 3, 5, 9, 1),
            ],
        };
        let bytes = encode(std::slice::from_ref(&rec));
        assert_eq!(decode(&bytes, "k").unwrap(), vec![rec.clone()]);
        let mut idx = Index::default();
        idx.add(&rec);
        let (pack, e) = idx.get(&ChunkId::of(b"b")).unwrap();
        assert_eq!((pack, e.offset, e.raw_len), (PackId::of(b"p"), 3, 9));
        assert_eq!(idx.to_records(|_| true), vec![rec]);
        assert!(decode(b"LSIX\x09", "k")
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }

    /// Issue 9, point 11: an index object any lab member wrote, whose
    /// entries lie about lengths or offsets, is refused when it is read, not
    /// when a 4 GiB buffer has been allocated or an offset has overflowed.
    #[test]
    fn lying_entries_are_refused_at_decode() {
        let entry = |offset: u64, stored: u32, raw: u32, flags: u8| IndexPack {
            pack: PackId::of(b"p"),
            size: 1 << 20,
            chunks: vec![(ChunkId::of(b"a"), offset, stored, raw, flags)],
        };
        for (rec, why) in [
            (entry(0, u32::MAX, u32::MAX, 0), "more than any chunk"),
            (entry(0, 100, 5 << 20 << 5, 1), "more than any chunk"),
            (entry(u64::MAX - 2, 10, 10, 0), "past the chunk data"),
            (entry(1 << 20, 1, 1, 0), "past the chunk data"),
            (entry(0, 900_000, 1000, 1), "no codec expands"),
            (entry(0, 10, 20, 0), "stored plain"),
            (entry(0, 10, 20, 0x40), "unknown flags"),
            (
                entry(0, 1000, 200 << 20, 2 | 1),
                "more than a tree segment compresses",
            ),
        ] {
            let err = decode(&encode(&[rec]), "k").unwrap_err().to_string();
            assert!(err.contains(why), "{err} should say {why}");
            assert!(err.contains("index k"), "{err}");
        }
        // A tree segment may be larger than a file chunk, and its zstd frame
        // a little larger than a tiny segment.
        decode(&encode(&[entry(0, 300, 200, 2 | 1)]), "k").unwrap();
    }
}
