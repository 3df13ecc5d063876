//! A version's tree as a pull holds it.
//!
//! As [`Entry`] values a million-file tree took about 176 bytes a file (a
//! record of three vectors, each path and chunk list its own allocation,
//! each chunk id 32 bytes): more than half of a pull's memory. Here each
//! entry is one 48-byte record, paths and link targets sit in one arena,
//! and a chunk is its position in the store's index (4 bytes, looked up
//! once as the tree loads instead of at every use).

use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};
use crate::index::Index;
use crate::pack::PackEntry;
use crate::repo::TreeSink;
use crate::snapshot::{allowed_mode, check_paths, find_before, Entry, Kind, Listed};

/// Chunk numbers from here on stand for chunks the index does not hold:
/// the rest of the number is their place in [`Listing::unknown`]. A file
/// needing one fails when it is written, not when the tree loads: a file
/// already complete in the destination needs none of its chunks.
const UNKNOWN: u32 = 1 << 31;

/// One entry, 48 bytes.
#[derive(Clone, Copy)]
struct Rec {
    /// Where the path starts in [`Listing::bytes`]; a link's target follows it.
    at: u64,
    mtime_ns: i64,
    size: u64,
    path_len: u32,
    target_len: u32,
    /// Its first chunk in [`Listing::chunks`].
    first: u32,
    chunks: u32,
    mode: u32,
    kind: Kind,
}

/// A version's entries in path order (validated: see [`load`]).
#[derive(Default)]
pub(crate) struct Listing {
    recs: Vec<Rec>,
    bytes: Vec<u8>,
    chunks: Vec<u32>,
    unknown: Vec<ChunkId>,
}

/// One entry of a [`Listing`].
#[derive(Clone, Copy)]
pub(crate) struct Item<'a> {
    list: &'a Listing,
    rec: &'a Rec,
}

impl<'a> Item<'a> {
    pub(crate) fn path(self) -> &'a [u8] {
        let at = self.rec.at as usize;
        &self.list.bytes[at..at + self.rec.path_len as usize]
    }

    /// What a symlink points to, or the path of the file a hard link names.
    pub(crate) fn target(self) -> &'a [u8] {
        let at = self.rec.at as usize + self.rec.path_len as usize;
        &self.list.bytes[at..at + self.rec.target_len as usize]
    }

    pub(crate) fn kind(self) -> Kind {
        self.rec.kind
    }

    /// Mode as it is to be written (masked, and made shared when asked).
    pub(crate) fn mode(self) -> u32 {
        self.rec.mode
    }

    pub(crate) fn mtime_ns(self) -> i64 {
        self.rec.mtime_ns
    }

    pub(crate) fn size(self) -> u64 {
        self.rec.size
    }

    /// A file's chunks, in order, for [`Listing::chunk`].
    pub(crate) fn chunks(self) -> &'a [u32] {
        let first = self.rec.first as usize;
        &self.list.chunks[first..first + self.rec.chunks as usize]
    }

    /// The path for messages.
    pub(crate) fn path_lossy(self) -> String {
        String::from_utf8_lossy(self.path()).into_owned()
    }
}

impl Listing {
    pub(crate) fn len(&self) -> usize {
        self.recs.len()
    }

    pub(crate) fn get(&self, i: usize) -> Item<'_> {
        Item {
            list: self,
            rec: &self.recs[i],
        }
    }

    /// Every entry, in path order.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = Item<'_>> {
        self.recs.iter().map(move |rec| Item { list: self, rec })
    }

    /// Position of the entry at `path`.
    pub(crate) fn find(&self, path: &[u8]) -> Option<usize> {
        find_before(self, self.len(), path)
    }

    /// Where chunk `c` of an item lives, or the id the index does not hold.
    pub(crate) fn chunk(
        &self,
        index: &Index,
        c: u32,
    ) -> std::result::Result<(PackId, PackEntry), ChunkId> {
        if c >= UNKNOWN {
            Err(self.unknown[(c - UNKNOWN) as usize])
        } else {
            Ok(index.at(c as usize))
        }
    }

    fn push(&mut self, e: Entry, mode: u32, index: &Index) -> Result<()> {
        let too_big = || Error::corrupt("tree", "more entries or chunks than a pull can hold");
        let links = matches!(e.kind, Kind::Symlink | Kind::HardLink);
        let target: &[u8] = if links { &e.target } else { &[] };
        let at = self.bytes.len() as u64;
        let path_len = u32::try_from(e.path.len()).map_err(|_| too_big())?;
        let target_len = u32::try_from(target.len()).map_err(|_| too_big())?;
        self.bytes.extend_from_slice(&e.path);
        self.bytes.extend_from_slice(target);
        let first = u32::try_from(self.chunks.len()).map_err(|_| too_big())?;
        // Only a file's chunks are ever read: the rest are not kept.
        let chunks: &[ChunkId] = if e.kind == Kind::File { &e.chunks } else { &[] };
        // What the chunks hold, by the index (an unknown one a byte at
        // least: no chunk is empty): a file's chunks give its size (a
        // hostile tree listing one chunk a million times for a small file
        // would have root write terabytes).
        let (mut held, mut all_known) = (0u64, true);
        for c in chunks {
            let n = match index.position(c) {
                Some(p) if p < UNKNOWN as usize => {
                    held = held.saturating_add(u64::from(index.at(p).1.raw_len.max(1)));
                    p as u32
                }
                Some(_) => return Err(too_big()),
                None => {
                    let n = u32::try_from(self.unknown.len())
                        .ok()
                        .filter(|&n| n < UNKNOWN)
                        .ok_or_else(too_big)?;
                    self.unknown.push(*c);
                    held = held.saturating_add(1);
                    all_known = false;
                    UNKNOWN + n
                }
            };
            self.chunks.push(n);
        }
        if held > e.size || (all_known && held != e.size) {
            return Err(Error::corrupt(
                format!("file {}", e.path_lossy()),
                format!(
                    "its chunks hold {held} bytes{}, the snapshot says {}",
                    if all_known { "" } else { " or more" },
                    e.size
                ),
            ));
        }
        self.recs.push(Rec {
            at,
            mtime_ns: e.mtime_ns,
            size: e.size,
            path_len,
            target_len,
            first,
            chunks: u32::try_from(chunks.len()).map_err(|_| too_big())?,
            mode,
            kind: e.kind,
        });
        u32::try_from(self.recs.len()).map_err(|_| too_big())?;
        Ok(())
    }
}

impl Listed for Listing {
    fn count(&self) -> usize {
        self.len()
    }
    fn path_of(&self, i: usize) -> &[u8] {
        self.get(i).path()
    }
    fn kind_of(&self, i: usize) -> Kind {
        self.recs[i].kind
    }
    fn target_of(&self, i: usize) -> &[u8] {
        self.get(i).target()
    }
}

/// Builds a [`Listing`] from decoded segments.
pub(crate) struct Loader<'i> {
    index: &'i Index,
    shared: bool,
    list: Listing,
    /// Entries whose special mode bits were dropped, and the first of them.
    masked: usize,
    first_masked: Option<String>,
}

impl<'i> Loader<'i> {
    /// Chunks are looked up in `index`; with `shared`, modes are made
    /// those of a tree shared by all users ([`shared_mode`]).
    pub(crate) fn new(index: &'i Index, shared: bool) -> Self {
        Loader {
            index,
            shared,
            list: Listing::default(),
            masked: 0,
            first_masked: None,
        }
    }

    /// The listing, once its paths are checked ([`check_paths`]: nothing in
    /// it can be written outside the destination), and how many entries
    /// lost special mode bits, with the first of them.
    pub(crate) fn finish(self, snapshot: &str) -> Result<(Listing, usize, Option<String>)> {
        check_paths(&self.list, snapshot)?;
        Ok((self.list, self.masked, self.first_masked))
    }
}

impl TreeSink for Loader<'_> {
    fn room(&mut self, entries: usize) {
        let _ = self.list.recs.try_reserve_exact(entries);
    }

    fn add(&mut self, entries: Vec<Entry>) -> Result<()> {
        for e in entries {
            // Setuid and setgid never reach a file (see `allowed_mode`).
            let mut mode = allowed_mode(e.kind, e.mode);
            if mode != e.mode {
                self.masked += 1;
                self.first_masked.get_or_insert_with(|| e.path_lossy());
            }
            if self.shared {
                mode = shared_mode(e.kind, mode);
            }
            self.list.push(e, mode, self.index)?;
        }
        Ok(())
    }
}

/// The mode an entry gets in a shared tree: no write bits, readable by all.
pub(crate) fn shared_mode(kind: Kind, mode: u32) -> u32 {
    match kind {
        Kind::Dir => mode & 0o1777 & !0o222 | 0o555,
        _ => mode & 0o777 & !0o222 | 0o444,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexPack;

    fn entry(path: &str, kind: Kind, mode: u32, chunks: Vec<ChunkId>, target: &str) -> Entry {
        Entry {
            path: path.as_bytes().to_vec(),
            kind,
            mode,
            mtime_ns: -5,
            size: 0,
            chunks,
            target: target.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_listing_gives_back_what_it_was_given() {
        let (a, b, lost) = (ChunkId::of(b"a"), ChunkId::of(b"b"), ChunkId::of(b"lost"));
        let pack = PackId::of(b"p");
        let mut index = Index::default();
        index.add(&IndexPack {
            pack,
            size: 10,
            chunks: vec![(a, 0, 5, 5, 0), (b, 5, 5, 5, 0)],
        });
        let mut loader = Loader::new(&index, false);
        let mut f = entry("d/f", Kind::File, 0o644, vec![b, lost, a], "ignored");
        f.size = 17;
        loader
            .add(vec![
                entry("d", Kind::Dir, 0o4755, vec![a], "ignored"),
                f,
                entry("d/h", Kind::HardLink, 0o644, vec![a], "d/f"),
                entry("s", Kind::Symlink, 0o777, Vec::new(), "d/../x"),
            ])
            .unwrap();
        let (list, masked, first) = loader.finish("snap").unwrap();
        assert_eq!((masked, first.as_deref()), (1, Some("d")));
        assert_eq!(list.len(), 4);
        let paths: Vec<&[u8]> = list.iter().map(|e| e.path()).collect();
        assert_eq!(paths, [&b"d"[..], b"d/f", b"d/h", b"s"]);
        let (d, f, h, s) = (list.get(0), list.get(1), list.get(2), list.get(3));
        assert_eq!(
            (d.kind(), d.mode(), d.target(), d.chunks()),
            (Kind::Dir, 0o755, &b""[..], &[][..])
        );
        assert_eq!((f.mode(), f.size(), f.mtime_ns()), (0o644, 17, -5));
        let got: Vec<_> = f.chunks().iter().map(|&c| list.chunk(&index, c)).collect();
        assert_eq!(got[0].as_ref().unwrap().1.id, b);
        assert_eq!(got[1].as_ref().unwrap_err(), &lost);
        assert_eq!(got[2].as_ref().unwrap(), &(pack, index.get(&a).unwrap().1));
        assert_eq!((h.target(), h.chunks()), (&b"d/f"[..], &[][..]));
        assert_eq!(s.target(), b"d/../x");
        assert_eq!(list.find(b"d/h"), Some(2));
        assert_eq!(list.find(b"d/g"), None);
    }

    #[test]
    fn a_shared_listing_takes_write_bits_away() {
        let index = Index::default();
        let mut loader = Loader::new(&index, true);
        loader
            .add(vec![
                entry("d", Kind::Dir, 0o1770, Vec::new(), ""),
                entry("d/f", Kind::File, 0o600, Vec::new(), ""),
            ])
            .unwrap();
        let (list, _, _) = loader.finish("snap").unwrap();
        assert_eq!((list.get(0).mode(), list.get(1).mode()), (0o1555, 0o444));
    }

    #[test]
    fn a_file_is_as_large_as_its_chunks() {
        let (a, lost) = (ChunkId::of(b"a"), ChunkId::of(b"lost"));
        let mut index = Index::default();
        index.add(&IndexPack {
            pack: PackId::of(b"p"),
            size: 16 << 20,
            chunks: vec![(a, 0, 100, 16 << 20, 0)],
        });
        let file = |size: u64, chunks: Vec<ChunkId>| Entry {
            size,
            ..entry("f", Kind::File, 0o644, chunks, "")
        };
        let listed = |e: Entry| Loader::new(&index, false).add(vec![e]);
        listed(file(16 << 20, vec![a])).unwrap();
        listed(file(32 << 20, vec![a, a])).unwrap();
        // A chunk not in the index: only more than the size is known wrong.
        listed(file(16 << 20 | 1, vec![a, lost])).unwrap();
        // One 100-byte upload naming its 16 MiB chunk 65,536 times for an
        // empty file: a terabyte written as root, if it were taken.
        let e = listed(file(0, vec![a; 65_536])).unwrap_err().to_string();
        assert!(
            e.contains("1099511627776 bytes, the snapshot says 0"),
            "{e}"
        );
        let e = listed(file(5, Vec::new())).unwrap_err().to_string();
        assert!(e.contains("hold 0 bytes, the snapshot says 5"), "{e}");
        let e = listed(file(16 << 20, vec![a, lost]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("16777217 bytes or more, the snapshot says"),
            "{e}"
        );
    }

    #[test]
    fn a_listing_is_checked_like_any_tree() {
        let index = Index::default();
        for (entries, why) in [
            (
                vec![entry("a/b", Kind::File, 0o644, Vec::new(), "")],
                "parent",
            ),
            (
                vec![
                    entry("a", Kind::Symlink, 0o777, Vec::new(), "/etc"),
                    entry("a/passwd", Kind::File, 0o644, Vec::new(), ""),
                ],
                "parent",
            ),
            (
                vec![entry("h", Kind::HardLink, 0o644, Vec::new(), "etc/shadow")],
                "hard link",
            ),
            (
                vec![
                    entry("b", Kind::File, 0o644, Vec::new(), ""),
                    entry("a", Kind::File, 0o644, Vec::new(), ""),
                ],
                "order",
            ),
        ] {
            let mut loader = Loader::new(&index, false);
            loader.add(entries).unwrap();
            let err = loader.finish("snap").err().expect("refused");
            assert!(err.to_string().contains(why), "{why}: {err}");
        }
    }
}
