//! Cache copies of fetched packs rebuilt from the files a pull wrote.
//!
//! A pack from a peer is verified chunk by chunk as it arrives, and its
//! files are written from memory; the node cache's copy used to be
//! written from that memory too, after the pull ([`crate::behind`]), so
//! every pack stayed in memory until the pull's end: a gigabyte of fresh
//! buffers, page-faulted one 4 KiB page at a time. Most packs of a data
//! set are its files' chunks, stored plain, in order: the same bytes the
//! pull has just written to the files. Such a pack leaves memory as soon
//! as its files are written (its buffer goes to the next fetch,
//! [`crate::reuse`]), and its copy is rebuilt after the pull from the
//! files (still in the page cache) and the few bytes of it that are in no
//! file (its footer, compressed chunks), kept aside.
//!
//! A rebuilt chunk is checked against its id as it is read back: a file
//! changed meanwhile, or a recipe made from a lying index, gives no copy
//! (said in the log), never a wrong one. The files are read through the
//! pull's own open destination, no symlink followed.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use rustix::fs::{Mode, OFlags};

use crate::at::Tree;
use crate::error::{Error, Result};
use crate::fsutil::write_atomic_pieces;
use crate::id::{ChunkId, PackId};
use crate::index::Index;
use crate::pack::PackEntry;

use crate::listing::Listing;

/// Where a pull's files hold the chunks of the packs it fetches.
pub(crate) struct Written {
    tree: Arc<Tree>,
    entries: Arc<Listing>,
    /// Per chunk, a file the pull writes that holds it (its listing
    /// index), and where in that file.
    places: HashMap<ChunkId, (usize, u64)>,
}

/// One piece of a pack to rebuild, in the pack's order.
#[derive(Debug)]
enum Piece {
    /// Bytes of the pack in no file: its footer, and chunks stored
    /// compressed or in no file of the pull.
    Kept(Bytes),
    /// A chunk stored plain: `len` bytes of file `file` (the listing's)
    /// from `at`, which must hash to `id`.
    File {
        file: usize,
        at: u64,
        len: u32,
        id: ChunkId,
    },
}

impl Piece {
    fn len(&self) -> u64 {
        match self {
            Piece::Kept(b) => b.len() as u64,
            Piece::File { len, .. } => u64::from(*len),
        }
    }
}

/// How to rebuild one pack.
#[derive(Debug)]
pub(crate) struct Recipe {
    size: u64,
    pieces: Vec<Piece>,
    /// Its kept bytes' share of [`KEPT_MAX`], given back with it.
    _kept: Kept,
}

/// Bytes every recipe of the process may keep in memory together: a
/// pack's footer is a few KiB, so this holds thousands of packs' recipes;
/// past it a pack is held whole, within the budget of held copies.
const KEPT_MAX: u64 = 64 << 20;

/// The most bytes one recipe keeps.
const KEPT_PER_PACK: u64 = 1 << 20;

/// Bytes kept by recipes now, every pull together.
static KEPT_NOW: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A share of [`KEPT_MAX`].
#[derive(Debug)]
struct Kept(u64);

impl Kept {
    fn take(n: u64) -> Option<Kept> {
        use std::sync::atomic::Ordering;
        KEPT_NOW
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |k| {
                (k + n <= KEPT_MAX).then_some(k + n)
            })
            .ok()
            .map(|_| Kept(n))
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        KEPT_NOW.fetch_sub(self.0, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Recipe {
    /// The pack's size.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// The bytes the recipe holds in memory.
    #[cfg(test)]
    fn kept_bytes(&self) -> u64 {
        self.pieces
            .iter()
            .filter(|p| matches!(p, Piece::Kept(_)))
            .map(Piece::len)
            .sum()
    }
}

/// A pack is rebuilt only when at most this share of it (1 / N), and at
/// most [`KEPT_PER_PACK`], has to be kept in memory for it; else it is
/// held whole.
const KEPT_SHARE: u64 = 4;

impl Written {
    /// The files `files` (indices into `entries`) of a pull, written into
    /// `tree`: where each chunk of theirs lands.
    pub(crate) fn new(
        tree: Arc<Tree>,
        entries: Arc<Listing>,
        index: &Index,
        files: &[usize],
    ) -> Written {
        let mut places = HashMap::new();
        for &i in files {
            let mut at = 0u64;
            for &c in entries.get(i).chunks() {
                // A chunk the index does not know ends the file: the
                // writer reports it, and nothing after it has a place.
                let Ok((_, e)) = entries.chunk(index, c) else {
                    break;
                };
                places.entry(e.id).or_insert((i, at));
                at += u64::from(e.raw_len);
            }
        }
        Written {
            tree,
            entries,
            places,
        }
    }

    /// How to rebuild `bytes`, a pack whose `entries` (its footer's) were
    /// checked against it, from the pull's files: `None` when more than a
    /// quarter of it (or [`KEPT_PER_PACK`], or what is left of
    /// [`KEPT_MAX`]) would have to stay in memory (it is held whole), or
    /// its entries overlap. Decided before anything is copied.
    pub(crate) fn recipe(&self, bytes: &[u8], entries: &[PackEntry]) -> Option<Recipe> {
        let mut located: Vec<(&PackEntry, (usize, u64))> = entries
            .iter()
            .filter(|e| e.flags == 0 && e.stored_len == e.raw_len)
            .filter_map(|e| Some((e, *self.places.get(&e.id)?)))
            .collect();
        located.sort_by_key(|(e, _)| e.offset);
        let size = bytes.len() as u64;
        // The pack's bytes from each piece read back to the next.
        let mut gaps = Vec::with_capacity(located.len() + 1);
        let mut at = 0u64;
        for (e, _) in &located {
            if e.offset < at {
                return None;
            }
            gaps.push(at..e.offset);
            at = e.offset.checked_add(u64::from(e.stored_len))?;
        }
        if at > size {
            return None;
        }
        gaps.push(at..size);
        let kept: u64 = gaps.iter().map(|g| g.end - g.start).sum();
        if kept.saturating_mul(KEPT_SHARE) > size || kept > KEPT_PER_PACK {
            return None;
        }
        let share = Kept::take(kept)?;
        let mut pieces = Vec::with_capacity(located.len() * 2 + 1);
        let keep = |pieces: &mut Vec<Piece>, g: std::ops::Range<u64>| {
            if !g.is_empty() {
                // Within `bytes`: every gap ends at an entry's offset or at
                // `size`, checked above.
                let b = &bytes[g.start as usize..g.end as usize];
                pieces.push(Piece::Kept(Bytes::copy_from_slice(b)));
            }
        };
        let mut gaps = gaps.into_iter();
        for (e, (file, offset)) in located {
            keep(&mut pieces, gaps.next()?);
            pieces.push(Piece::File {
                file,
                at: offset,
                len: e.raw_len,
                id: e.id,
            });
        }
        keep(&mut pieces, gaps.next()?);
        Some(Recipe {
            size,
            pieces,
            _kept: share,
        })
    }

    /// Writes pack `pack` to `dest` as `recipe` says, every chunk read
    /// back from the files checked against its id.
    /// Written with `O_DIRECT`, and once more through the page cache
    /// where the disk refused that (some file systems take the flag and
    /// then refuse the writes).
    pub(crate) fn rebuild(&self, pack: &PackId, recipe: &Recipe, dest: &Path) -> Result<()> {
        let refused = |e: &std::io::Error| e.raw_os_error() == Some(libc::EINVAL);
        let write = |direct: bool| {
            let mut r = Rebuilding {
                written: self,
                pack,
                pieces: &recipe.pieces,
                next: 0,
                into: 0,
                open: None,
                hasher: blake3::Hasher::new(),
            };
            write_atomic_pieces(dest, recipe.size, direct, &mut |_, out| r.fill(out))
        };
        match write(true) {
            Err(Error::Io {
                op: "write",
                source,
                ..
            }) if refused(&source) => write(false),
            done => done,
        }
    }

    fn open(&self, file: usize) -> Result<std::fs::File> {
        let rel = self.entries.get(file).path();
        let shown = || self.tree.shown(rel);
        let (dir, name) = self.tree.parent(rel).map_err(Error::io("open", shown()))?;
        // Non-blocking: a FIFO put there would otherwise hold the open,
        // and every copy of the process behind it.
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&*dir, name, flags, Mode::empty())
            .map_err(|e| Error::io("open", shown())(e.into()))?;
        let f = std::fs::File::from(fd);
        let regular = f.metadata().is_ok_and(|m| m.file_type().is_file());
        if !regular {
            return Err(Error::invalid(
                format!("{}", shown().display()),
                "is no longer a regular file",
            ));
        }
        Ok(f)
    }
}

/// A rebuild under way: pieces are filled in order.
struct Rebuilding<'a> {
    written: &'a Written,
    pack: &'a PackId,
    pieces: &'a [Piece],
    /// The piece being filled, and how far into it.
    next: usize,
    into: u64,
    /// The file last read, open.
    open: Option<(usize, std::fs::File)>,
    /// The chunk being read back, so far.
    hasher: blake3::Hasher,
}

impl Rebuilding<'_> {
    /// Fills `out` with the pack's next bytes.
    fn fill(&mut self, mut out: &mut [u8]) -> Result<()> {
        while !out.is_empty() {
            let piece = self.pieces.get(self.next).ok_or_else(|| {
                Error::corrupt(format!("pack {}", self.pack), "rebuilt past its end")
            })?;
            let n = (piece.len() - self.into).min(out.len() as u64) as usize;
            let (now, rest) = out.split_at_mut(n);
            match piece {
                Piece::Kept(b) => now.copy_from_slice(&b[self.into as usize..][..n]),
                Piece::File { file, at, id, .. } => {
                    let written = self.written;
                    if self.open.as_ref().is_none_or(|(i, _)| i != file) {
                        self.open = Some((*file, written.open(*file)?));
                    }
                    let f = &self.open.as_ref().expect("just opened").1;
                    let shown = || written.tree.shown(written.entries.get(*file).path());
                    f.read_exact_at(now, at + self.into)
                        .map_err(Error::io("read back", shown()))?;
                    self.hasher.update(now);
                    if self.into + n as u64 == piece.len() {
                        let got = ChunkId::from_bytes(*self.hasher.finalize().as_bytes());
                        self.hasher.reset();
                        if got != *id {
                            return Err(Error::corrupt(
                                format!(
                                    "chunk {} read back from {}",
                                    id.short(),
                                    shown().display()
                                ),
                                "it changed since it was written",
                            ));
                        }
                    }
                }
            }
            self.into += n as u64;
            if self.into == piece.len() {
                self.next += 1;
                self.into = 0;
            }
            out = rest;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexPack;
    use crate::pack::{with_stored, Codec, PackBuilder};
    use crate::repo::TreeSink;
    use crate::snapshot::{Entry, Kind};

    /// Bytes that do not compress.
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn entry(path: &str, kind: Kind, chunks: Vec<ChunkId>, size: u64) -> Entry {
        Entry {
            path: path.as_bytes().to_vec(),
            kind,
            mode: if kind == Kind::Dir { 0o755 } else { 0o644 },
            mtime_ns: 0,
            size,
            chunks,
            target: Vec::new(),
        }
    }

    /// A pack of `chunks` (each plain, or LZ4 when it compresses), its
    /// index, and a destination holding the files `files` (path, chunks)
    /// as a pull writes them; the `Written` of those files.
    struct Case {
        dir: tempfile::TempDir,
        pack: PackId,
        object: Vec<u8>,
        entries: Vec<PackEntry>,
        written: Written,
    }

    fn case(chunks: &[Vec<u8>], compress: bool, files: &[(&str, &[usize])]) -> Case {
        let mut b = PackBuilder::with_capacity(1 << 20);
        let ids: Vec<ChunkId> = chunks.iter().map(|c| ChunkId::of(c)).collect();
        for (c, id) in chunks.iter().zip(&ids) {
            if compress {
                with_stored(c, Codec::Lz4, |stored, flags| {
                    b.add(*id, stored, c.len() as u32, flags)
                });
            } else {
                b.add(*id, c, c.len() as u32, 0);
            }
        }
        let sealed = b.seal();
        let object = sealed.object().to_vec();
        let mut index = Index::default();
        index.add(&IndexPack {
            pack: sealed.id,
            size: object.len() as u64,
            chunks: sealed
                .entries
                .iter()
                .map(|e| (e.id, e.offset, e.stored_len, e.raw_len, e.flags))
                .collect(),
        });
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tree");
        std::fs::create_dir_all(root.join("d")).unwrap();
        let mut listed = vec![entry("d", Kind::Dir, Vec::new(), 0)];
        for (path, parts) in files {
            let data: Vec<u8> = parts.iter().flat_map(|&k| chunks[k].clone()).collect();
            std::fs::write(root.join(path), &data).unwrap();
            let cids = parts.iter().map(|&k| ids[k]).collect();
            listed.push(entry(path, Kind::File, cids, data.len() as u64));
        }
        let mut loader = crate::listing::Loader::new(&index, false);
        loader.add(listed).unwrap();
        let (list, _, _) = loader.finish("snap").unwrap();
        let tree = Arc::new(Tree::open(&root).unwrap());
        let all: Vec<usize> = (1..list.len()).collect();
        let written = Written::new(tree, Arc::new(list), &index, &all);
        Case {
            dir,
            pack: sealed.id,
            object,
            entries: sealed.entries,
            written,
        }
    }

    #[test]
    fn a_pack_of_its_files_chunks_is_rebuilt_from_them_byte_for_byte() {
        let chunks = [noise(5000, 1), noise(3000, 2), noise(7000, 3)];
        // Chunk 1 is in two files, chunk 2 in none: it is kept.
        let c = case(&chunks[..], false, &[("d/f", &[0, 1]), ("g", &[1])]);
        // Chunks of 3 MB: one crosses the 4 MiB pieces the copy is
        // written in.
        let more = [noise(3_000_000, 1), noise(3_000_000, 2), noise(100, 3)];
        let small = case(&more[..], false, &[("d/f", &[0, 1]), ("g", &[1])]);
        let recipe = small
            .written
            .recipe(&small.object, &small.entries)
            .expect("rebuilt: only a little is kept");
        let footer = small.object.len() as u64 - 6_000_100;
        assert_eq!(recipe.kept_bytes(), 100 + footer);
        let dest = small.dir.path().join("cache/pack");
        small.written.rebuild(&small.pack, &recipe, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), small.object);
        // 7000 of 15000 bytes in no file: more than a quarter, held whole.
        assert!(c.written.recipe(&c.object, &c.entries).is_none());
    }

    #[test]
    fn compressed_chunks_are_kept_not_read_back() {
        let text: Vec<Vec<u8>> = (0..3)
            .map(|k| format!("line {k}\n").repeat(2000).into_bytes())
            .collect();
        let c = case(&text, true, &[("d/f", &[0, 1, 2])]);
        assert!(c.entries.iter().all(|e| e.flags != 0), "stored as LZ4");
        assert!(
            c.written.recipe(&c.object, &c.entries).is_none(),
            "nothing to read back: held whole"
        );
    }

    #[test]
    #[allow(unsafe_code)]
    fn a_file_changed_or_swapped_for_a_symlink_or_a_fifo_gives_no_copy() {
        let chunks = [noise(5000, 4), noise(3000, 5)];
        let c = case(&chunks[..], false, &[("d/f", &[0, 1])]);
        let recipe = c.written.recipe(&c.object, &c.entries).unwrap();
        let (f, dest) = (c.dir.path().join("tree/d/f"), c.dir.path().join("cache/p"));
        let mut changed = std::fs::read(&f).unwrap();
        changed[6000] ^= 1;
        std::fs::write(&f, &changed).unwrap();
        let e = c.written.rebuild(&c.pack, &recipe, &dest).unwrap_err();
        assert!(
            e.to_string().contains("changed since it was written"),
            "{e}"
        );
        let left: Vec<_> = std::fs::read_dir(dest.parent().unwrap()).unwrap().collect();
        assert!(left.is_empty(), "no copy and no temporary file: {left:?}");
        // The right bytes, but through a symlink: not followed.
        let elsewhere = c.dir.path().join("elsewhere");
        changed[6000] ^= 1;
        std::fs::write(&elsewhere, &changed).unwrap();
        std::fs::remove_file(&f).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &f).unwrap();
        assert!(c.written.rebuild(&c.pack, &recipe, &dest).is_err());
        assert!(!dest.exists());
        // A FIFO there: refused at once, not waited on (an open of a FIFO
        // for reading blocks until a writer comes).
        std::fs::remove_file(&f).unwrap();
        let fifo = std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let e = c.written.rebuild(&c.pack, &recipe, &dest).unwrap_err();
        assert!(e.to_string().contains("no longer a regular file"), "{e}");
        assert!(!dest.exists());
        // Put back, the copy is made.
        std::fs::remove_file(&f).unwrap();
        std::fs::rename(&elsewhere, &f).unwrap();
        c.written.rebuild(&c.pack, &recipe, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), c.object);
    }

    /// A rebuilt copy waits for the pull's end, not for held copies being
    /// started early; it is not written over a copy the cache has by then,
    /// nor after a failed pull.
    #[tokio::test]
    async fn a_rebuilt_copy_is_written_after_the_pull_and_only_then() {
        use crate::arrive::Arrivals;
        use crate::behind::CacheWrites;
        use crate::cache::Fresh;
        let chunks = [noise(5000, 6), noise(3000, 7)];
        // As a pull does: its files known, then each pack deferred.
        let copy = |c: Case, w: &CacheWrites, dest: &Path| {
            let recipe = c.written.recipe(&c.object, &c.entries).unwrap();
            w.rebuild_from(c.written);
            let arrivals = Arc::new(Arrivals::new([c.pack], [vec![c.pack]]));
            let fresh = Fresh {
                bytes: Bytes::from(c.object.clone()),
                verified: None,
            };
            assert!(arrivals.offer_rebuilt(c.pack, fresh));
            w.defer_rebuilt(c.pack, dest.to_path_buf(), recipe, arrivals);
            (c.dir, c.object)
        };

        let c = case(&chunks[..], false, &[("d/f", &[0, 1])]);
        let dest = c.dir.path().join("cache/p");
        let w = CacheWrites::new();
        let (_dir, object) = copy(c, &w, &dest);
        w.start_held();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!dest.exists(), "written before the pull's end");
        let done = w.finish().await;
        assert_eq!((done.packs, done.rebuilt, done.failed), (1, 1, 0));
        assert_eq!(std::fs::read(&dest).unwrap(), object);

        // In the cache by then: left as it is.
        let c = case(&chunks[..], false, &[("d/f", &[0, 1])]);
        let dest = c.dir.path().join("cache/p");
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::write(&dest, b"fetched again").unwrap();
        let w = CacheWrites::new();
        let _kept = copy(c, &w, &dest);
        let done = w.finish().await;
        assert_eq!((done.packs, done.rebuilt, done.failed), (1, 0, 0));
        assert_eq!(std::fs::read(&dest).unwrap(), b"fetched again");

        // The pull failed: no copy.
        let c = case(&chunks[..], false, &[("d/f", &[0, 1])]);
        let dest = c.dir.path().join("cache/p");
        let w = CacheWrites::new();
        let _kept = copy(c, &w, &dest);
        w.abandon_rebuilt();
        let done = w.finish().await;
        assert_eq!((done.packs, done.failed), (0, 1));
        assert!(!dest.exists());
    }
}
