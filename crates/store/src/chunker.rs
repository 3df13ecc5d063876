//! Content-defined chunking: FastCDC v2020 cut points, pure and synchronous.
//!
//! Cut points are part of the store format. They depend on the crate version
//! (pinned exactly in the workspace manifest) and on the parameters, which are
//! written in the store's `config` object and checked on every open: two
//! clients with different parameters would silently stop deduplicating.

use std::io::Read;
use std::ops::Range;

use fastcdc::v2020::{FastCDC, Normalization};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The only algorithm format v1 knows.
pub const ALGORITHM: &str = "fastcdc-v2020";

/// Chunk size parameters, fixed per store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkerParams {
    /// Smallest chunk (a file shorter than this is one chunk).
    pub min: u32,
    /// Target average chunk size.
    pub avg: u32,
    /// Largest chunk.
    pub max: u32,
    /// FastCDC normalisation level (0–3).
    pub normalization: u8,
}

impl Default for ChunkerParams {
    /// 256 KiB / 1 MiB / 4 MiB: multi-MB compressed images split into a few
    /// chunks (so a partial rewrite keeps most of a file), while a code file is
    /// always one chunk.
    fn default() -> Self {
        ChunkerParams {
            min: 256 << 10,
            avg: 1 << 20,
            max: 4 << 20,
            normalization: 1,
        }
    }
}

impl ChunkerParams {
    /// Checks the parameters against what FastCDC v2020 accepts.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| Err(Error::invalid("chunker parameters", detail));
        // fastcdc 5 only debug_asserts these; out of range values would give
        // garbage cut points in release builds.
        if !(64..=1 << 20).contains(&self.min) {
            return bad(format!("min {} outside 64 B..=1 MiB", self.min));
        }
        if !(256..=4 << 20).contains(&self.avg) {
            return bad(format!("avg {} outside 256 B..=4 MiB", self.avg));
        }
        if !(1024..=16 << 20).contains(&self.max) {
            return bad(format!("max {} outside 1 KiB..=16 MiB", self.max));
        }
        if !(self.min <= self.avg && self.avg <= self.max) {
            return bad(format!(
                "need min <= avg <= max, got {}/{}/{}",
                self.min, self.avg, self.max
            ));
        }
        if self.normalization > 3 {
            return bad(format!(
                "normalization {} outside 0..=3",
                self.normalization
            ));
        }
        Ok(())
    }

    fn level(&self) -> Normalization {
        match self.normalization {
            0 => Normalization::Level0,
            1 => Normalization::Level1,
            2 => Normalization::Level2,
            _ => Normalization::Level3,
        }
    }

    /// The chunk ranges of `data`, which must be a whole file.
    pub fn cut(&self, data: &[u8]) -> Vec<Range<usize>> {
        if data.is_empty() {
            return Vec::new();
        }
        FastCDC::with_level(
            data,
            self.min as usize,
            self.avg as usize,
            self.max as usize,
            self.level(),
        )
        .map(|c| c.offset..c.offset + c.length)
        .collect()
    }
}

/// Reads a file in bounded blocks and yields exactly the chunks that
/// [`ChunkerParams::cut`] would give for the whole file.
///
/// A FastCDC cut found before the end of the buffer does not depend on the
/// bytes after it, so only the last chunk of each block is provisional: it is
/// carried into the next block. Memory stays at one block whatever the file size.
pub struct StreamChunker<R> {
    reader: R,
    params: ChunkerParams,
    buf: Vec<u8>,
    block: usize,
    eof: bool,
}

impl<R: Read> StreamChunker<R> {
    /// `block` must be at least `params.max`; 16 MiB is a good size.
    pub fn new(reader: R, params: ChunkerParams, block: usize) -> Self {
        let block = block.max(params.max as usize * 2);
        StreamChunker {
            reader,
            params,
            buf: Vec::new(),
            block,
            eof: false,
        }
    }

    /// Calls `f` with every chunk's bytes, in order.
    pub fn for_each(
        mut self,
        mut f: impl FnMut(&[u8]) -> Result<()>,
    ) -> std::io::Result<Result<()>> {
        loop {
            while !self.eof && self.buf.len() < self.block {
                let start = self.buf.len();
                self.buf.resize(self.block, 0);
                let n = loop {
                    match self.reader.read(&mut self.buf[start..]) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                    }
                };
                self.buf.truncate(start + n);
                if n == 0 {
                    self.eof = true;
                }
            }
            let cuts = self.params.cut(&self.buf);
            let Some(last) = cuts.last().cloned() else {
                return Ok(Ok(()));
            };
            let keep_last = self.eof;
            for r in &cuts[..cuts.len() - 1] {
                if let Err(e) = f(&self.buf[r.clone()]) {
                    return Ok(Err(e));
                }
            }
            if keep_last {
                return Ok(f(&self.buf[last]));
            }
            self.buf.drain(..last.start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    fn seeded(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut v = vec![0u8; len];
        rng.fill_bytes(&mut v);
        v
    }

    /// A deterministic input that does not depend on any RNG crate's stream:
    /// BLAKE3 in XOF mode over a fixed key.
    fn golden_input(len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        blake3::Hasher::new()
            .update(b"labsync golden vector v1")
            .finalize_xof()
            .fill(&mut out);
        out
    }

    /// Golden vector: fixed input, fixed cut points and ids. A fastcdc or blake3
    /// upgrade that moves a cut point fails here instead of silently breaking
    /// dedup against every existing store.
    #[test]
    fn golden_cut_points_and_ids() {
        let data = golden_input(12 << 20);
        let params = ChunkerParams::default();
        let cuts = params.cut(&data);
        let got: Vec<(usize, usize, String)> = cuts
            .iter()
            .map(|r| {
                (
                    r.start,
                    r.len(),
                    crate::ChunkId::of(&data[r.clone()]).short(),
                )
            })
            .collect();
        let expected: Vec<(usize, usize, &str)> = GOLDEN.to_vec();
        let got_ref: Vec<(usize, usize, &str)> =
            got.iter().map(|(a, b, c)| (*a, *b, c.as_str())).collect();
        assert_eq!(got_ref, expected, "chunk boundaries changed: {got:#?}");
    }

    /// Recorded with fastcdc 5.0.0 and blake3 1.8 (default parameters).
    const GOLDEN: &[(usize, usize, &str)] = &[
        (0, 1387899, "6b77deedf009"),
        (1387899, 486133, "f3c273176dc3"),
        (1874032, 662627, "6f91a407c16d"),
        (2536659, 1125616, "2766ee3f09ea"),
        (3662275, 1659632, "04b9acb5cb91"),
        (5321907, 653589, "2373e05cc9df"),
        (5975496, 1429672, "6d2114460034"),
        (7405168, 747277, "6367b1fc72ff"),
        (8152445, 1755176, "9da33368b81e"),
        (9907621, 1128929, "c8a6c8fb1409"),
        (11036550, 955907, "b6ac74453f0a"),
        (11992457, 590455, "70f84008a8a7"),
    ];

    #[test]
    fn small_file_is_one_chunk() {
        let data = seeded(1000, 1);
        assert_eq!(ChunkerParams::default().cut(&data), vec![0..1000]);
        assert!(ChunkerParams::default().cut(&[]).is_empty());
    }

    #[test]
    fn stream_matches_whole_buffer() {
        let params = ChunkerParams {
            min: 4096,
            avg: 16384,
            max: 65536,
            normalization: 1,
        };
        for (len, seed) in [
            (0usize, 0u64),
            (100, 1),
            (65536, 2),
            (1 << 20, 3),
            (3_000_001, 4),
        ] {
            let data = seeded(len, seed);
            let whole: Vec<Vec<u8>> = params
                .cut(&data)
                .into_iter()
                .map(|r| data[r].to_vec())
                .collect();
            let mut streamed = Vec::new();
            StreamChunker::new(&data[..], params, 131072)
                .for_each(|c| {
                    streamed.push(c.to_vec());
                    Ok(())
                })
                .unwrap()
                .unwrap();
            assert_eq!(whole, streamed, "len {len}");
        }
    }

    #[test]
    fn params_are_validated() {
        assert!(ChunkerParams::default().validate().is_ok());
        let bad = ChunkerParams {
            avg: 8 << 20,
            ..ChunkerParams::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("avg"));
        let inverted = ChunkerParams {
            min: 1 << 20,
            avg: 512 << 10,
            ..ChunkerParams::default()
        };
        assert!(inverted.validate().is_err());
    }

    proptest::proptest! {
        #[test]
        fn cuts_cover_input_exactly(len in 0usize..300_000, seed in 0u64..1000) {
            let params = ChunkerParams { min: 1024, avg: 4096, max: 16384, normalization: 1 };
            let data = seeded(len, seed);
            let cuts = params.cut(&data);
            let mut pos = 0;
            for r in &cuts {
                proptest::prop_assert_eq!(r.start, pos);
                proptest::prop_assert!(r.len() <= 16384);
                pos = r.end;
            }
            proptest::prop_assert_eq!(pos, len);
        }
    }
}
