//! Reference chunking used to size the "changed chunks" budget of the 1 % step.
//!
//! Uses the store's own chunker (FastCDC v2020, 256 KiB / 1 MiB / 4 MiB) and
//! BLAKE3 ids, so the budget describes exactly the chunking labsync does.

use std::collections::HashSet;
use std::ops::Range;

use labsync_store::ChunkerParams;

/// Minimum chunk size (the store's default parameters).
pub const MIN_CHUNK: usize = 256 * 1024;
/// Target average chunk size.
pub const AVG_CHUNK: usize = 1024 * 1024;
/// Hard upper bound on a chunk.
pub const MAX_CHUNK: usize = 4 * 1024 * 1024;

/// Byte ranges of the chunks of `data`, cut by the store's own chunker with
/// its default parameters (256 KiB / 1 MiB / 4 MiB).
pub fn chunk_ranges(data: &[u8]) -> Vec<Range<usize>> {
    let p = ChunkerParams::default();
    debug_assert_eq!(
        (p.min as usize, p.avg as usize, p.max as usize),
        (MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
    );
    p.cut(data)
}

/// Bytes a content-addressed store must newly write when a file changes from
/// `old` to `new`: the total length of the new version's chunks whose BLAKE3
/// id is not among the old version's chunk ids. Dedup against *other* files
/// is deliberately ignored, so this is an upper bound for one file.
pub fn changed_chunk_bytes(old: &[u8], new: &[u8]) -> u64 {
    let old_ids: HashSet<blake3::Hash> = chunk_ranges(old)
        .into_iter()
        .map(|r| blake3::hash(&old[r]))
        .collect();
    chunk_ranges(new)
        .into_iter()
        .filter(|r| !old_ids.contains(&blake3::hash(&new[r.clone()])))
        .map(|r| r.len() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(len: usize, seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut v);
        v
    }

    #[test]
    fn unchanged_file_costs_nothing() {
        let data = random(9 << 20, 1);
        assert_eq!(changed_chunk_bytes(&data, &data), 0);
    }

    #[test]
    fn small_file_is_one_chunk() {
        let old = random(10_000, 2);
        let mut new = old.clone();
        new[5000] ^= 1;
        assert_eq!(chunk_ranges(&old), vec![0..10_000]);
        assert_eq!(changed_chunk_bytes(&old, &new), 10_000);
        assert_eq!(changed_chunk_bytes(&[], &[]), 0);
    }

    #[test]
    fn local_edit_touches_few_chunks() {
        let old = random(16 << 20, 3);
        let mut new = old.clone();
        let off = 7 << 20;
        new[off..off + 4096].copy_from_slice(&random(4096, 4));
        let changed = changed_chunk_bytes(&old, &new);
        assert!(changed > 0);
        // The edited chunk, plus at most one neighbour when a cut point moves.
        assert!(changed <= 2 * MAX_CHUNK as u64, "changed = {changed}");
        assert!(changed < new.len() as u64 / 2);
    }
}
