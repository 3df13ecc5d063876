//! The chunk index: chunk id → (pack, offset, lengths).
//!
//! Index objects are immutable and written only after every pack they name is
//! durable. Several may exist (one per push, plus partial ones written during
//! long pushes so that an interrupted push resumes); `gc` consolidates them.
//! Losing them all is recoverable: `rebuild-index` reads the pack footers.

use std::collections::HashMap;

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
        for &(id, offset, stored_len, raw_len, flags) in &p.chunks {
            let e = PackEntry {
                id,
                offset,
                stored_len,
                raw_len,
                flags,
            };
            if let Some(why) = e.problem(p.size) {
                return Err(Error::corrupt(
                    format!("index {key}"),
                    format!("chunk {} of pack {}: {why}", id.short(), p.pack),
                ));
            }
        }
    }
    Ok(packs)
}

/// Where a chunk lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// Position of the pack in [`Index::packs`].
    pub pack: u32,
    /// The footer entry.
    pub entry: PackEntry,
}

/// The in-memory index of a whole store.
#[derive(Default, Clone, Debug)]
pub struct Index {
    packs: Vec<(PackId, u64)>,
    pack_pos: HashMap<PackId, u32>,
    chunks: HashMap<ChunkId, Location>,
    /// Index objects left out, and why.
    refused: Vec<(String, String)>,
}

impl Index {
    /// Adds a pack's entries. A chunk already known keeps its first location.
    pub fn add(&mut self, rec: &IndexPack) {
        let pos = *self.pack_pos.entry(rec.pack).or_insert_with(|| {
            self.packs.push((rec.pack, rec.size));
            (self.packs.len() - 1) as u32
        });
        for &(id, offset, stored_len, raw_len, flags) in &rec.chunks {
            self.chunks.entry(id).or_insert(Location {
                pack: pos,
                entry: PackEntry {
                    id,
                    offset,
                    stored_len,
                    raw_len,
                    flags,
                },
            });
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
            if let Some(l) = self.chunks.get_mut(&id) {
                if l.pack == pos {
                    l.entry = PackEntry {
                        id,
                        offset,
                        stored_len,
                        raw_len,
                        flags,
                    };
                }
            }
        }
    }

    /// Records an index object that was left out, and why.
    pub(crate) fn refuse(&mut self, key: String, why: String) {
        self.refused.push((key, why));
    }

    /// Index objects that were left out (not matching their name, or not
    /// decoding), with why: the chunks only they described are missing, and
    /// `labsync rebuild-index` restores them from the packs.
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    /// Looks a chunk up.
    pub fn get(&self, id: &ChunkId) -> Option<(PackId, PackEntry)> {
        self.chunks
            .get(id)
            .map(|l| (self.packs[l.pack as usize].0, l.entry))
    }

    /// True if the chunk is stored.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.chunks.contains_key(id)
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
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
        for loc in self.chunks.values() {
            let e = loc.entry;
            recs[loc.pack as usize]
                .chunks
                .push((e.id, e.offset, e.stored_len, e.raw_len, e.flags));
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
