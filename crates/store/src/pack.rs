//! Pack objects: many chunks in one object, with a self-describing footer.
//!
//! ```text
//! chunk bytes (plain, LZ4 block or zstd frame) …
//! footer:  per chunk  id[32] offset:u64 stored_len:u32 raw_len:u32 flags:u8   (49 bytes)
//! trailer: footer_len:u32 count:u32 footer_check[8] magic "LSPK" version:u32    (24 bytes)
//! ```
//!
//! The footer alone is enough to rebuild the index (`rebuild-index`). The pack
//! id is the BLAKE3 of footer and trailer: it names every chunk in the pack by
//! id, place, lengths and codec, and each chunk's bytes are covered by the
//! chunk's own id, checked on every read. So a pack is still verified with no
//! other metadata, without a second BLAKE3 pass over every byte pushed (which
//! was a fifth of the CPU of a 1 GB push). Integers are little-endian.

use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};

const MAGIC: &[u8; 4] = b"LSPK";
/// 2: the pack id is the BLAKE3 of footer and trailer, and chunks may be LZ4.
/// Version 1 packs (id = BLAKE3 of the whole object, zstd only) are still read.
const VERSION: u32 = 2;
const ENTRY_LEN: usize = 49;
const TRAILER_LEN: usize = 24;

/// Flag bit: the stored bytes are a zstd frame.
pub const FLAG_ZSTD: u8 = 1;
/// Flag bit: the chunk is snapshot metadata (a tree segment), not file data.
pub const FLAG_TREE: u8 = 2;
/// Flag bit: the stored bytes are one LZ4 block (no frame: `raw_len` bounds it).
pub const FLAG_LZ4: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_ZSTD | FLAG_TREE | FLAG_LZ4;

/// The largest file chunk any store holds: `ChunkerParams::validate` caps
/// the chunker's maximum at 16 MiB. An entry claiming more is refused before
/// anything is allocated for it.
pub const MAX_FILE_CHUNK: u32 = 16 << 20;
/// The largest tree segment labsync reads: at most 512 entries, so only a
/// segment of files with millions of chunks each comes near it.
pub const MAX_TREE_CHUNK: u32 = 256 << 20;

/// The most bytes a pack read whole may have: the largest pack size a
/// store may set (64 MiB), its largest chunk past it (a tree chunk) and
/// room for its footer. A larger object named as a pack is not one.
pub const MAX_PACK_BYTES: u64 = 512 << 20;

/// How `push` compresses the file chunks that look compressible. Either way a
/// chunk's id is the BLAKE3 of its plain bytes, so the codec never affects
/// dedup, and every labsync reads both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Codec {
    /// LZ4 (the default): on a 2-core machine, zstd level 1 on source text
    /// ran at 280 MB/s per core against LZ4's 500 MB/s, and was most of
    /// the time of a push of 50,000 small files; LZ4 stores about an eighth
    /// more for such trees and decompresses 2.5 times faster.
    #[default]
    Lz4,
    /// zstd level 1: about 30% smaller than LZ4 on text, at half the speed.
    Zstd,
}

impl std::str::FromStr for Codec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Codec> {
        match s {
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd),
            _ => Err(Error::invalid(
                format!("compression {s:?}"),
                "expected lz4 or zstd",
            )),
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        })
    }
}

/// Where one chunk lives inside a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackEntry {
    /// The chunk's id.
    pub id: ChunkId,
    /// Byte offset of the stored bytes in the pack.
    pub offset: u64,
    /// Stored (possibly compressed) length.
    pub stored_len: u32,
    /// Plain length.
    pub raw_len: u32,
    /// `FLAG_*` bits.
    pub flags: u8,
}

impl PackEntry {
    /// Why this entry cannot describe a chunk of a pack whose chunk data
    /// ends at `data_end`; `None` when it can. Every entry read from a
    /// footer or an index passes here, so a hostile one is refused before
    /// a buffer is sized by its lengths or an offset is added.
    pub fn problem(&self, data_end: u64) -> Option<String> {
        if self.flags & !KNOWN_FLAGS != 0
            || self.flags & (FLAG_ZSTD | FLAG_LZ4) == FLAG_ZSTD | FLAG_LZ4
        {
            return Some(format!(
                "unknown flags {:#04x} (written by a newer labsync?)",
                self.flags
            ));
        }
        let max = if self.flags & FLAG_TREE != 0 {
            MAX_TREE_CHUNK
        } else {
            MAX_FILE_CHUNK
        };
        if self.raw_len > max {
            return Some(format!(
                "claims {} bytes, more than any chunk holds ({max})",
                self.raw_len
            ));
        }
        let (stored, raw) = (u64::from(self.stored_len), u64::from(self.raw_len));
        if self.flags & (FLAG_ZSTD | FLAG_LZ4) == 0 && stored != raw {
            return Some(format!("stored plain in {stored} bytes but {raw} long"));
        }
        // A tree segment decodes into memory that labd (root) holds whole:
        // no honest segment compresses 128-fold, a zstd bomb does.
        if self.flags & FLAG_TREE != 0
            && self.flags & (FLAG_ZSTD | FLAG_LZ4) != 0
            && raw > stored * 128 + (1 << 20)
        {
            return Some(format!(
                "{raw} bytes from {stored} stored: more than a tree segment compresses"
            ));
        }
        // Compressed data is stored only when smaller, but a tiny tree
        // segment's zstd frame may exceed it by its headers.
        if stored > raw + raw / 64 + 1024 {
            return Some(format!(
                "{stored} stored bytes for {raw} bytes: no codec expands that much"
            ));
        }
        match self.offset.checked_add(stored) {
            Some(end) if end <= data_end => None,
            _ => Some("points past the chunk data".into()),
        }
    }

    /// Turns stored bytes back into the chunk and checks them against the id.
    /// Plain chunks are returned borrowed, without a copy.
    pub fn decode<'a>(
        &self,
        stored: &'a [u8],
        pack: &PackId,
    ) -> Result<std::borrow::Cow<'a, [u8]>> {
        let plain = self.decompress(stored, pack)?;
        if ChunkId::of(&plain) != self.id {
            return Err(Error::corrupt(
                format!("chunk {} in pack {}", self.id.short(), pack),
                "content does not match its BLAKE3 id",
            ));
        }
        Ok(plain)
    }

    /// [`PackEntry::decode`] without the BLAKE3 check, for chunks already
    /// checked (a pack verified whole as it arrived, still in memory).
    /// Lengths are still checked.
    pub(crate) fn decompress<'a>(
        &self,
        stored: &'a [u8],
        pack: &PackId,
    ) -> Result<std::borrow::Cow<'a, [u8]>> {
        let corrupt = |detail: String| {
            Error::corrupt(
                format!("chunk {} in pack {}", self.id.short(), pack),
                detail,
            )
        };
        if stored.len() != self.stored_len as usize {
            return Err(corrupt(format!(
                "expected {} stored bytes, got {}",
                self.stored_len,
                stored.len()
            )));
        }
        // The lengths are checked before the output buffer is sized by them.
        if let Some(why) = self.problem(u64::MAX) {
            return Err(corrupt(why));
        }
        let plain = if self.flags & FLAG_LZ4 != 0 {
            // A fresh output buffer: lz4_flex's safe decoder into new memory
            // cannot leak earlier contents (RUSTSEC-2026-0041 concerns reused
            // buffers), and the BLAKE3 check below stands behind it anyway.
            let out = lz4_flex::block::decompress(stored, self.raw_len as usize)
                .map_err(|e| corrupt(format!("lz4: {e}")))?;
            std::borrow::Cow::Owned(out)
        } else if self.flags & FLAG_ZSTD != 0 {
            // One context per thread: a fresh one per chunk was 3.6% of a
            // 50,000-file pull. The output is capped at the recorded length.
            thread_local! {
                static ZSTD: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
                    const { std::cell::RefCell::new(None) };
            }
            let out = ZSTD.with(|z| {
                let mut z = z.borrow_mut();
                if z.is_none() {
                    *z = Some(zstd::bulk::Decompressor::new()?);
                }
                z.as_mut()
                    .expect("just made")
                    .decompress(stored, self.raw_len as usize)
            });
            std::borrow::Cow::Owned(out.map_err(|e| corrupt(format!("zstd: {e}")))?)
        } else {
            std::borrow::Cow::Borrowed(stored)
        };
        if plain.len() != self.raw_len as usize {
            return Err(corrupt(format!(
                "{} bytes once decompressed, not {}",
                plain.len(),
                self.raw_len
            )));
        }
        Ok(plain)
    }
}

/// Builds one pack in memory. Not thread-safe by itself; the push pipeline
/// guards it with a mutex.
#[derive(Default)]
pub struct PackBuilder {
    /// Padding up to `start`, then the pack.
    data: Vec<u8>,
    /// Where the pack starts in `data`.
    start: usize,
    entries: Vec<PackEntry>,
}

/// A finished pack, ready to upload.
pub struct SealedPack {
    /// The pack's id (see [`PackId::of`]).
    pub id: PackId,
    /// The object is `bytes[start..]`; what is before is padding that puts
    /// it at a 4 KiB boundary of the buffer (see [`PackBuilder::reuse`]).
    pub bytes: Vec<u8>,
    /// Where the object starts in `bytes`.
    pub start: usize,
    /// The footer's entries.
    pub entries: Vec<PackEntry>,
}

impl SealedPack {
    /// The object's bytes.
    pub fn object(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

impl PackBuilder {
    /// An empty builder with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        PackBuilder {
            data: Vec::with_capacity(capacity),
            start: 0,
            entries: Vec::new(),
        }
    }

    /// An empty builder reusing `buf`'s allocation (already faulted-in pages:
    /// a fresh 32 MiB buffer per pack cost 15% of a 1 GB push in page faults).
    ///
    /// The pack starts at a 4 KiB boundary of the buffer, so a local store
    /// writes it with `O_DIRECT` from where it is: copying each pack through
    /// a bounce buffer cost every byte pushed a second copy, and a 4 MiB
    /// bounce buffer per writing thread.
    pub fn reuse(mut buf: Vec<u8>, capacity: usize) -> Self {
        use crate::fsutil::DIRECT_ALIGN;
        buf.clear();
        buf.reserve(capacity + DIRECT_ALIGN);
        let start = buf.as_ptr().align_offset(DIRECT_ALIGN).min(DIRECT_ALIGN);
        buf.resize(start, 0);
        PackBuilder {
            data: buf,
            start,
            entries: Vec::new(),
        }
    }

    /// Appends a chunk's stored bytes.
    pub fn add(&mut self, id: ChunkId, stored: &[u8], raw_len: u32, flags: u8) {
        self.entries.push(PackEntry {
            id,
            offset: (self.data.len() - self.start) as u64,
            stored_len: stored.len() as u32,
            raw_len,
            flags,
        });
        self.data.extend_from_slice(stored);
    }

    /// Bytes of chunk data so far.
    pub fn len(&self) -> usize {
        self.data.len() - self.start
    }

    /// True when no chunk was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Writes the footer and trailer and computes the id.
    pub fn seal(self) -> SealedPack {
        let PackBuilder {
            mut data,
            start,
            entries,
        } = self;
        let footer_start = data.len();
        data.reserve(entries.len() * ENTRY_LEN + TRAILER_LEN);
        for e in &entries {
            data.extend_from_slice(e.id.as_bytes());
            data.extend_from_slice(&e.offset.to_le_bytes());
            data.extend_from_slice(&e.stored_len.to_le_bytes());
            data.extend_from_slice(&e.raw_len.to_le_bytes());
            data.push(e.flags);
        }
        let footer_len = (data.len() - footer_start) as u32;
        let check = blake3::hash(&data[footer_start..]);
        data.extend_from_slice(&footer_len.to_le_bytes());
        data.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        data.extend_from_slice(&check.as_bytes()[..8]);
        data.extend_from_slice(MAGIC);
        data.extend_from_slice(&VERSION.to_le_bytes());
        SealedPack {
            id: PackId::of(&data[footer_start..]),
            bytes: data,
            start,
            entries,
        }
    }
}

/// How many bytes from the end of a pack hold the trailer.
pub const fn trailer_len() -> usize {
    TRAILER_LEN
}

/// Parses a trailer; returns the footer length.
pub fn parse_trailer(trailer: &[u8], pack: &PackId) -> Result<usize> {
    let corrupt = |d: &str| Error::corrupt(format!("pack {pack}"), d.to_string());
    if trailer.len() != TRAILER_LEN {
        return Err(corrupt("shorter than a pack trailer"));
    }
    if &trailer[16..20] != MAGIC {
        return Err(corrupt("no pack magic at the end (not a labsync pack?)"));
    }
    let version = u32::from_le_bytes(trailer[20..24].try_into().expect("4 bytes"));
    if !(1..=VERSION).contains(&version) {
        return Err(corrupt(&format!(
            "pack format version {version}; this labsync reads 1 to {VERSION}: upgrade labsync"
        )));
    }
    let footer_len = u32::from_le_bytes(trailer[0..4].try_into().expect("4 bytes")) as usize;
    let count = u32::from_le_bytes(trailer[4..8].try_into().expect("4 bytes")) as usize;
    if footer_len != count * ENTRY_LEN {
        return Err(corrupt("footer length does not match entry count"));
    }
    Ok(footer_len)
}

fn trailer_version(trailer: &[u8]) -> u32 {
    u32::from_le_bytes(trailer[20..24].try_into().expect("4 bytes"))
}

/// True when the pack's id covers only footer and trailer (version 2 on):
/// then the chunk ids vouch for the rest. A version 1 pack's id is the hash
/// of the whole object, which only a check holding all of it can compare.
pub fn id_covers_footer_only(pack_bytes: &[u8]) -> bool {
    pack_bytes.len() >= TRAILER_LEN
        && trailer_version(&pack_bytes[pack_bytes.len() - TRAILER_LEN..]) >= 2
}

/// Parses a footer (the `footer_len` bytes before the trailer), checking it
/// against the trailer's checksum, the pack id and the pack size.
pub fn parse_footer(
    footer: &[u8],
    trailer: &[u8],
    pack_size: u64,
    pack: &PackId,
) -> Result<Vec<PackEntry>> {
    let corrupt = |d: String| Error::corrupt(format!("pack {pack}"), d);
    if blake3::hash(footer).as_bytes()[..8] != trailer[8..16] {
        return Err(corrupt("footer checksum mismatch".into()));
    }
    let named = blake3::Hasher::new()
        .update(footer)
        .update(trailer)
        .finalize();
    if trailer_version(trailer) >= 2 && named.as_bytes() != pack.as_bytes() {
        return Err(corrupt(
            "footer does not match the pack's id (a damaged or misnamed object)".into(),
        ));
    }
    let data_end = pack_size.saturating_sub((footer.len() + TRAILER_LEN) as u64);
    footer
        .chunks_exact(ENTRY_LEN)
        .map(|b| {
            let e = PackEntry {
                id: ChunkId::from_bytes(b[0..32].try_into().expect("32 bytes")),
                offset: u64::from_le_bytes(b[32..40].try_into().expect("8 bytes")),
                stored_len: u32::from_le_bytes(b[40..44].try_into().expect("4 bytes")),
                raw_len: u32::from_le_bytes(b[44..48].try_into().expect("4 bytes")),
                flags: b[48],
            };
            match e.problem(data_end) {
                Some(why) => Err(corrupt(format!("entry {}: {why}", e.id.short()))),
                None => Ok(e),
            }
        })
        .collect()
}

/// Parses the footer of a whole pack held in memory.
pub fn read_entries(pack_bytes: &[u8], pack: &PackId) -> Result<Vec<PackEntry>> {
    if pack_bytes.len() < TRAILER_LEN {
        return Err(Error::corrupt(
            format!("pack {pack}"),
            "shorter than a pack trailer",
        ));
    }
    let trailer = &pack_bytes[pack_bytes.len() - TRAILER_LEN..];
    let footer_len = parse_trailer(trailer, pack)?;
    let end = pack_bytes.len() - TRAILER_LEN;
    let start = end
        .checked_sub(footer_len)
        .ok_or_else(|| Error::corrupt(format!("pack {pack}"), "footer longer than the pack"))?;
    parse_footer(
        &pack_bytes[start..end],
        trailer,
        pack_bytes.len() as u64,
        pack,
    )
}

/// Calls `f` with the bytes to store for the file chunk `raw` and their flag:
/// compressed with `codec` when that saves at least an eighth, else `raw`
/// itself with no flag.
///
/// Already-compressed data (PNG, JPEG, archives) is the common case for lab
/// datasets, so the byte entropy of a 1 KiB sample decides first: above 7.2
/// bits per byte, no coder can save an eighth on symbol statistics, and
/// compressing random-looking bytes was half the CPU of a 50,000-file push.
/// (A chunk of repeated high-entropy blocks is stored plain; rare in datasets.)
/// The output buffer and the zstd context are reused per thread: creating a
/// zstd context per call cost more than compressing a small source file.
pub fn with_stored<R>(raw: &[u8], codec: Codec, f: impl FnOnce(&[u8], u8) -> R) -> R {
    struct Scratch {
        out: Vec<u8>,
        zstd: Option<zstd::bulk::Compressor<'static>>,
    }
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> =
            const { std::cell::RefCell::new(Scratch { out: Vec::new(), zstd: None }) };
    }
    if raw.len() < 512 || looks_incompressible(raw) {
        return f(raw, 0);
    }
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let Scratch { out, zstd } = &mut *s;
        let compressed = match codec {
            Codec::Lz4 => {
                let need = lz4_flex::block::get_maximum_output_size(raw.len());
                if out.len() < need {
                    out.resize(need, 0);
                }
                lz4_flex::block::compress_into(raw, out)
                    .ok()
                    .map(|n| (&out[..n], FLAG_LZ4))
            }
            Codec::Zstd => {
                if zstd.is_none() {
                    *zstd = zstd::bulk::Compressor::new(1).ok();
                }
                out.clear();
                out.reserve(zstd::zstd_safe::compress_bound(raw.len()));
                match zstd.as_mut() {
                    Some(z) => z
                        .compress_to_buffer(raw, out)
                        .ok()
                        .map(|n| (&out[..n], FLAG_ZSTD)),
                    None => None,
                }
            }
        };
        match compressed {
            Some((stored, flag)) if stored.len() * 8 <= raw.len() * 7 => f(stored, flag),
            _ => f(raw, 0),
        }
    })
}

/// Order-0 entropy of four 256-byte samples spread over the chunk, against
/// 7.2 bits/byte. 1 KiB in all is enough: the estimate for random bytes is
/// biased low by about (256 - 1) / (2 n ln 2) = 0.18 bits at n = 1024, so it
/// reads 7.8, while text and code read 4–6. Sampling 4 KiB per chunk was 3%
/// of a 50,000-small-file push.
fn looks_incompressible(raw: &[u8]) -> bool {
    const SAMPLE: usize = 256;
    let mut hist = [0u32; 256];
    let mut n = 0u32;
    let step = raw.len().saturating_sub(SAMPLE) / 3;
    let samples: [&[u8]; 4] = if raw.len() >= 4 * SAMPLE {
        [0, step, 2 * step, 3 * step].map(|s| &raw[s..s + SAMPLE])
    } else {
        // Smaller chunks (512 bytes up: below that nothing is compressed) whole.
        [raw, &[], &[], &[]]
    };
    for sample in samples {
        for &b in sample {
            hist[b as usize] += 1;
            n += 1;
        }
    }
    // H = log2(n) - Σ c·log2(c) / n, with c·log2(c) from a table: one
    // log2 per distinct byte value per chunk was a visible share of a
    // 50,000-small-file push.
    static C_LOG2_C: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();
    let table = C_LOG2_C.get_or_init(|| {
        (0..=4 * SAMPLE)
            .map(|c| {
                if c == 0 {
                    0.0
                } else {
                    c as f64 * (c as f64).log2()
                }
            })
            .collect()
    });
    let sum: f64 = hist.iter().map(|&c| table[c as usize]).sum();
    let n = n as f64;
    let bits = n.log2() - sum / n;
    // 512–1024 sampled bytes cannot show 8 bits even for random bytes (7.6–7.8,
    // see above); 7.2 is still well above any text or code.
    bits > 7.2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_check_tells_random_from_text() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let random: Vec<u8> = (0..8192)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let text = "fn main() { println!(\"hello\"); }\n".repeat(300);
        for len in [512, 600, 1023, 1024, 3000, 8192] {
            assert!(looks_incompressible(&random[..len]), "random, {len} bytes");
            assert!(
                !looks_incompressible(&text.as_bytes()[..len]),
                "text, {len} bytes"
            );
        }
        for codec in [Codec::Lz4, Codec::Zstd] {
            assert_eq!(flag_of(&random, codec), 0);
            assert_ne!(flag_of(text.as_bytes(), codec), 0);
        }
    }

    /// The flag `with_stored` picks for `raw`.
    fn flag_of(raw: &[u8], codec: Codec) -> u8 {
        with_stored(raw, codec, |_, flag| flag)
    }

    fn build_with(chunks: &[&[u8]], codec: Codec) -> SealedPack {
        let mut b = PackBuilder::default();
        for c in chunks {
            with_stored(c, codec, |stored, flags| {
                b.add(ChunkId::of(c), stored, c.len() as u32, flags)
            });
        }
        b.seal()
    }

    /// A pack built in a reused buffer starts at a 4 KiB boundary and
    /// reads back like any: offsets count from the pack, not the buffer.
    #[test]
    fn a_reused_buffer_holds_an_aligned_pack() {
        let mut buf = Vec::with_capacity(100);
        buf.extend_from_slice(b"left over from the last pack");
        let mut b = PackBuilder::reuse(buf, 1 << 16);
        let chunks: [&[u8]; 2] = [b"first chunk", b"second"];
        for c in chunks {
            b.add(ChunkId::of(c), c, c.len() as u32, 0);
        }
        assert_eq!(b.len(), 17);
        let pack = b.seal();
        assert_eq!(pack.object().as_ptr() as usize % 4096, 0);
        let entries = read_entries(pack.object(), &pack.id).unwrap();
        for (e, c) in entries.iter().zip(chunks) {
            assert_eq!(
                &pack.object()[e.offset as usize..][..e.stored_len as usize],
                c
            );
        }
    }

    fn build(chunks: &[&[u8]]) -> SealedPack {
        build_with(chunks, Codec::default())
    }

    #[test]
    fn footer_round_trip_and_decode() {
        let text = "fn main() { println!(\"hi\"); }\n".repeat(200);
        let chunks: Vec<&[u8]> = vec![b"abc", text.as_bytes(), &[7u8; 10]];
        for (codec, flag) in [(Codec::Lz4, FLAG_LZ4), (Codec::Zstd, FLAG_ZSTD)] {
            let pack = build_with(&chunks, codec);
            let footer_start = entries_end(&pack);
            assert_eq!(pack.id, PackId::of(&pack.bytes[footer_start..]));
            let entries = read_entries(&pack.bytes, &pack.id).unwrap();
            assert_eq!(entries, pack.entries);
            assert_eq!(entries[1].flags, flag, "{codec}: source text compresses");
            assert!(entries[1].stored_len * 4 < entries[1].raw_len);
            assert_eq!(entries[0].flags, 0, "tiny chunks stay plain");
            for (e, c) in entries.iter().zip(&chunks) {
                let stored = &pack.bytes[e.offset as usize..][..e.stored_len as usize];
                assert_eq!(&*e.decode(stored, &pack.id).unwrap(), *c);
            }
        }
    }

    #[test]
    fn damaged_compressed_chunks_and_unknown_flags_are_corrupt() {
        let text = "def f(x):\n    return x * 2  # double\n".repeat(100);
        for codec in [Codec::Lz4, Codec::Zstd] {
            let pack = build_with(&[text.as_bytes()], codec);
            let e = pack.entries[0];
            assert_ne!(e.flags, 0);
            let stored = &pack.bytes[e.offset as usize..][..e.stored_len as usize];
            // Every truncation and a flipped byte anywhere: an error, never a
            // panic and never different bytes.
            for cut in [0, 1, stored.len() / 2, stored.len() - 1] {
                let short = PackEntry {
                    stored_len: cut as u32,
                    ..e
                };
                assert!(
                    short.decode(&stored[..cut], &pack.id).is_err(),
                    "{codec} cut {cut}"
                );
            }
            for i in (0..stored.len()).step_by(7) {
                let mut bad = stored.to_vec();
                bad[i] ^= 0x5a;
                let err = e.decode(&bad, &pack.id).unwrap_err();
                assert!(
                    matches!(err, Error::Corrupt { .. }),
                    "{codec} byte {i}: {err}"
                );
            }
            // Both codecs at once, or a flag this labsync does not know.
            for flags in [FLAG_LZ4 | FLAG_ZSTD, e.flags | 0x40] {
                let err = PackEntry { flags, ..e }
                    .decode(stored, &pack.id)
                    .unwrap_err();
                assert!(err.to_string().contains("unknown flags"), "{err}");
            }
        }
        assert_eq!("zstd".parse::<Codec>().unwrap(), Codec::Zstd);
        assert_eq!(Codec::default().to_string(), "lz4");
        assert!("gzip"
            .parse::<Codec>()
            .unwrap_err()
            .to_string()
            .contains("lz4 or zstd"));
    }

    #[test]
    fn flipped_byte_is_corrupt_not_returned() {
        let pack = build(&[b"hello world"]);
        let e = pack.entries[0];
        let mut stored = pack.bytes[e.offset as usize..][..e.stored_len as usize].to_vec();
        stored[0] ^= 1;
        let err = e.decode(&stored, &pack.id).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(
            err.to_string().contains(&pack.id.to_string()),
            "names the pack: {err}"
        );
    }

    /// Where the footer of a sealed pack starts.
    fn entries_end(pack: &SealedPack) -> usize {
        pack.entries
            .iter()
            .map(|e| (e.offset + e.stored_len as u64) as usize)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn a_pack_under_another_name_is_refused() {
        let pack = build(&[b"one", b"two"]);
        let other = build(&[b"three"]);
        let err = read_entries(&pack.bytes, &other.id).unwrap_err();
        assert!(err.to_string().contains("misnamed"), "{err}");
    }

    #[test]
    fn version_1_packs_named_by_their_whole_bytes_are_still_read() {
        let mut pack = build(&[b"one", b"two"]);
        let n = pack.bytes.len();
        pack.bytes[n - 4..].copy_from_slice(&1u32.to_le_bytes());
        assert!(!id_covers_footer_only(&pack.bytes));
        let v1_id = PackId::of(&pack.bytes);
        assert_eq!(read_entries(&pack.bytes, &v1_id).unwrap(), pack.entries);
        pack.bytes[n - 4..].copy_from_slice(&3u32.to_le_bytes());
        let err = read_entries(&pack.bytes, &v1_id).unwrap_err();
        assert!(err.to_string().contains("upgrade labsync"), "{err}");
    }

    #[test]
    fn damaged_footer_is_detected() {
        let mut pack = build(&[b"one", b"two"]);
        let n = pack.bytes.len();
        pack.bytes[n - TRAILER_LEN - 3] ^= 0xff;
        assert!(read_entries(&pack.bytes, &pack.id).is_err());
        assert!(read_entries(b"short", &pack.id).is_err());
        let mut not_pack = vec![0u8; 100];
        not_pack[80..84].copy_from_slice(b"XXXX");
        assert!(read_entries(&not_pack, &pack.id)
            .unwrap_err()
            .to_string()
            .contains("magic"));
    }

    /// Issue 9, point 11: a footer whose checksum and id are right (any lab
    /// member can write one) but whose entry's offset plus length overflows
    /// is refused; it used to overflow the addition.
    #[test]
    fn a_footer_offset_that_overflows_is_refused() {
        let mut pack = build(&[b"one", b"two"]);
        let n = pack.bytes.len();
        let footer = n - TRAILER_LEN - 2 * ENTRY_LEN;
        pack.bytes[footer + 32..footer + 40].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        let sum = blake3::hash(&pack.bytes[footer..n - TRAILER_LEN]);
        pack.bytes[n - TRAILER_LEN + 8..n - TRAILER_LEN + 16].copy_from_slice(&sum.as_bytes()[..8]);
        let id = PackId::from_bytes(*blake3::hash(&pack.bytes[footer..]).as_bytes());
        let err = read_entries(&pack.bytes, &id).unwrap_err().to_string();
        assert!(err.contains("past the chunk data"), "{err}");
        crate::fuzzing::pack(&pack.bytes);
    }

    #[test]
    fn random_data_is_stored_plain() {
        let mut v = vec![0u8; 100_000];
        blake3::Hasher::new()
            .update(b"x")
            .finalize_xof()
            .fill(&mut v);
        let code = "fn main() { let x = compute(42); println!(\"{x}\"); }\n".repeat(50);
        for codec in [Codec::Lz4, Codec::Zstd] {
            assert_eq!(flag_of(&v, codec), 0);
            assert_ne!(flag_of(&vec![b'a'; 100_000], codec), 0);
            assert_ne!(flag_of(code.as_bytes(), codec), 0, "source text compresses");
            assert_eq!(flag_of(&v[..2000], codec), 0, "small random chunk skipped");
        }
    }
}
