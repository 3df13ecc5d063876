//! Snapshots: the tree of a pushed directory.
//!
//! Entries are sorted by path and cut into *segments* at content-defined
//! boundaries chosen from the path alone (a BLAKE3 of the path), so editing a
//! few files of a 50,000-file tree rewrites only the segments that hold them:
//! a re-push stores a few hundred KB of metadata, not the whole tree again.
//! Segments are chunks (flag `FLAG_TREE`, zstd) in their own packs; the
//! snapshot object lists them. Its id is the BLAKE3 of its bytes and holds no
//! time or host, so pushing an unchanged tree yields the same id.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::id::{ChunkId, SnapshotId};

const MAGIC: &[u8; 4] = b"LSSN";
const VERSION: u8 = 1;
/// 2: a segment holding a hard link (older labsync refuses it by this
/// number instead of misreading it); a segment without one is still
/// written as 1, so its id, and dedup against older pushes, do not change.
const SEGMENT_VERSION: u8 = 2;
/// On average one boundary per 16 entries; at most 512 entries per segment.
const BOUNDARY_MASK: u8 = 0x0f;
pub(crate) const MAX_SEGMENT_ENTRIES: usize = 512;

/// The most entries a tree read from a store may hold: far past the ten
/// million files labsync is built for, and bounded before any segment is
/// fetched (a hostile tree of 8-byte entries would decode to billions).
pub const MAX_TREE_ENTRIES: u64 = 16 << 20;

/// What an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Another name of a regular file earlier in the tree (`target`), as
    /// `ln` makes: the data is stored and written once. Its `size` is 0 (the
    /// file's bytes count once) and it has no chunks.
    HardLink,
}

/// One path in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Relative path, `/`-separated, raw bytes (Unix file names need not be UTF-8).
    pub path: Vec<u8>,
    /// File, dir or symlink.
    pub kind: Kind,
    /// Permission bits: `st_mode & 0o777`, plus the sticky bit for
    /// directories ([`allowed_mode`]). Never setuid or setgid.
    pub mode: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// File size in bytes (0 for dirs and links).
    pub size: u64,
    /// File chunks in order.
    pub chunks: Vec<ChunkId>,
    /// Link target: what a symlink points to, or the path of the file a
    /// hard link names.
    pub target: Vec<u8>,
}

impl Entry {
    /// The path for messages.
    pub fn path_lossy(&self) -> String {
        String::from_utf8_lossy(&self.path).into_owned()
    }
}

/// A reference from the snapshot object to one tree segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    /// The segment's chunk id.
    pub id: ChunkId,
    /// How many entries it holds.
    pub entries: u32,
}

/// The snapshot object (`snapshots/<id>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotObject {
    /// Regular files in the tree.
    pub files: u64,
    /// Directories.
    pub dirs: u64,
    /// Symlinks.
    pub symlinks: u64,
    /// Sum of file sizes.
    pub bytes: u64,
    /// The tree, in path order.
    pub segments: Vec<SegmentRef>,
}

impl SnapshotObject {
    /// Encodes the object; its id is the BLAKE3 of the result.
    pub fn encode(&self) -> (SnapshotId, Vec<u8>) {
        let mut out = MAGIC.to_vec();
        out.push(VERSION);
        let out = postcard::to_extend(self, out).expect("Vec writer cannot fail");
        (SnapshotId::of(&out), out)
    }

    /// Decodes and checks the object against its id.
    pub fn decode(bytes: &[u8], id: &SnapshotId) -> Result<Self> {
        let what = || format!("snapshot {id}");
        if SnapshotId::of(bytes) != *id {
            return Err(Error::corrupt(
                what(),
                "content does not match its BLAKE3 id",
            ));
        }
        if bytes.len() < 5 || &bytes[..4] != MAGIC {
            return Err(Error::corrupt(what(), "not a labsync snapshot"));
        }
        if bytes[4] != VERSION {
            return Err(Error::corrupt(
                what(),
                format!("format version {}; this labsync reads {VERSION}", bytes[4]),
            ));
        }
        postcard::from_bytes(&bytes[5..]).map_err(|e| Error::corrupt(what(), e.to_string()))
    }
}

/// Encodes one segment (plain bytes; the chunk id is their BLAKE3).
pub fn encode_segment(entries: &[Entry]) -> Vec<u8> {
    let version = if entries.iter().any(|e| e.kind == Kind::HardLink) {
        SEGMENT_VERSION
    } else {
        1
    };
    postcard::to_extend(entries, vec![version]).expect("Vec writer cannot fail")
}

/// Decodes one segment.
pub fn decode_segment(bytes: &[u8], id: &ChunkId) -> Result<Vec<Entry>> {
    let what = || format!("tree segment {id}");
    match bytes.first() {
        Some(1..=SEGMENT_VERSION) => {
            // Its count first: never more entries decoded than a segment holds.
            let (n, _) = postcard::take_from_bytes::<usize>(&bytes[1..])
                .map_err(|e| Error::corrupt(what(), e.to_string()))?;
            if n > MAX_SEGMENT_ENTRIES {
                return Err(Error::corrupt(
                    what(),
                    format!("{n} entries, more than a segment holds ({MAX_SEGMENT_ENTRIES})"),
                ));
            }
            postcard::from_bytes(&bytes[1..]).map_err(|e| Error::corrupt(what(), e.to_string()))
        }
        Some(v) => Err(Error::corrupt(
            what(),
            format!("format version {v}; this labsync reads {SEGMENT_VERSION}"),
        )),
        None => Err(Error::corrupt(what(), "empty")),
    }
}

/// Splits sorted entries into segments as a push streaming them cuts them
/// ([`ends_segment`], and the last entry ends the last segment).
#[cfg(test)]
pub fn split_segments(entries: &[Entry]) -> Vec<&[Entry]> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, e) in entries.iter().enumerate() {
        if ends_segment(e, i + 1 - start) || i + 1 == entries.len() {
            out.push(&entries[start..=i]);
            start = i + 1;
        }
    }
    out
}

/// True when a segment holding `len` entries, the last `e`, ends there: a
/// boundary follows every entry whose path hash has its low bits clear, and
/// a segment holds at most 512 entries. Depends on paths only, never on
/// content, so editing a few files rewrites only the segments that hold them.
pub fn ends_segment(e: &Entry, len: usize) -> bool {
    blake3::hash(&e.path).as_bytes()[0] & BOUNDARY_MASK == 0 || len >= MAX_SEGMENT_ENTRIES
}

/// The mode bits a tree may carry for an entry of `kind`: permissions, and
/// the sticky bit on folders. Setuid and setgid never pass: labd
/// materialises trees as root, and every lab member can write to the store,
/// so a setuid bit from the store would be a setuid-root binary on the node.
pub fn allowed_mode(kind: Kind, mode: u32) -> u32 {
    match kind {
        Kind::Dir => mode & 0o1777,
        Kind::File | Kind::Symlink | Kind::HardLink => mode & 0o777,
    }
}

/// The deepest a path may be, in names (`a/b/c` is 3). Real trees are tens
/// deep; a limit keeps what pull and labd do per level (a descriptor and a
/// stack frame while removing a folder) bounded against a hostile snapshot.
/// Push refuses deeper trees with the same words.
pub const MAX_DEPTH: usize = 256;

/// Why a path is refused; `None` when it is a plain relative path.
fn path_problem(path: &[u8]) -> Option<&'static str> {
    if path.is_empty() {
        return Some("empty path");
    }
    if path.contains(&0) {
        return Some("NUL byte in path");
    }
    if path[0] == b'/' {
        return Some("absolute path");
    }
    if path.iter().filter(|&&b| b == b'/').count() >= MAX_DEPTH {
        return Some("more than 256 folders deep (labsync keeps trees up to 256 deep)");
    }
    for comp in path.split(|&b| b == b'/') {
        match comp {
            b"" => return Some("empty path component"),
            b"." => return Some("'.' path component"),
            b".." => return Some("'..' path component would escape the destination"),
            _ => {}
        }
    }
    None
}

/// Checks that materialising `entries` cannot write outside the destination:
/// relative paths without `..`, strictly sorted (so no duplicates), every
/// parent a directory of the snapshot and never a symlink (a link to `/etc`
/// followed by a file `link/passwd` is the classic tar attack).
///
/// Modes are masked to [`allowed_mode`] (push never records more; a
/// hand-made or older snapshot may): returns the paths whose setuid, setgid
/// or other non-permission bits were dropped, for the caller to report.
pub fn validate_entries(entries: &mut [Entry], snapshot: &str) -> Result<Vec<String>> {
    let mut masked = Vec::new();
    for e in entries.iter_mut() {
        let allowed = allowed_mode(e.kind, e.mode);
        if allowed != e.mode {
            masked.push(e.path_lossy());
            e.mode = allowed;
        }
    }
    check_paths(&*entries, snapshot)?;
    Ok(masked)
}

/// A tree's entries as [`check_paths`] reads them: in their order, by
/// position. Pull keeps a million-file tree in a compact form rather than
/// as [`Entry`] values, and checks it with the same code.
pub(crate) trait Listed {
    /// Number of entries.
    fn count(&self) -> usize;
    /// Path of entry `i`.
    fn path_of(&self, i: usize) -> &[u8];
    /// Kind of entry `i`.
    fn kind_of(&self, i: usize) -> Kind;
    /// Link target of entry `i`.
    fn target_of(&self, i: usize) -> &[u8];
}

impl Listed for [Entry] {
    fn count(&self) -> usize {
        self.len()
    }
    fn path_of(&self, i: usize) -> &[u8] {
        &self[i].path
    }
    fn kind_of(&self, i: usize) -> Kind {
        self[i].kind
    }
    fn target_of(&self, i: usize) -> &[u8] {
        &self[i].target
    }
}

/// Position of `path` among the first `n` entries of `list`, which are
/// strictly sorted.
pub(crate) fn find_before<L: Listed + ?Sized>(list: &L, n: usize, path: &[u8]) -> Option<usize> {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match list.path_of(mid).cmp(path) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return Some(mid),
        }
    }
    None
}

/// See [`validate_entries`]. Lookups are binary searches of the entries
/// already checked (sorted by then), not sets of every path: a million
/// paths in hash sets cost as much memory as the tree itself.
pub(crate) fn check_paths<L: Listed + ?Sized>(list: &L, snapshot: &str) -> Result<()> {
    let refuse = |i: usize, why: &'static str| Error::UnsafePath {
        path: String::from_utf8_lossy(list.path_of(i)).into_owned(),
        snapshot: snapshot.to_string(),
        why,
    };
    let is = |i: usize, path: &[u8], kind: Kind| {
        find_before(list, i, path).is_some_and(|j| list.kind_of(j) == kind)
    };
    // Consecutive entries mostly share their folder: checked once.
    let mut parent_ok: Option<&[u8]> = None;
    for i in 0..list.count() {
        let path = list.path_of(i);
        let kind = list.kind_of(i);
        // A hard link names a file of this snapshot written before it, so
        // pull never links a path outside its destination (labd pulls as
        // root: a link to /etc/shadow in a job's data would be a way in).
        if kind == Kind::HardLink && !is(i, list.target_of(i), Kind::File) {
            return Err(refuse(
                i,
                "hard link to a path that is not a file earlier in the snapshot",
            ));
        }
        if let Some(why) = path_problem(path) {
            return Err(refuse(i, why));
        }
        if i > 0 && list.path_of(i - 1) >= path {
            return Err(refuse(i, "entries out of order or duplicated"));
        }
        if let Some(slash) = path.iter().rposition(|&b| b == b'/') {
            let parent = &path[..slash];
            if parent_ok != Some(parent) {
                if !is(i, parent, Kind::Dir) {
                    return Err(refuse(
                        i,
                        "parent is not a directory of the snapshot (a symlink or missing)",
                    ));
                }
                parent_ok = Some(parent);
            }
        }
    }
    Ok(())
}

/// What changed between two trees.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changes {
    /// Paths only in the new tree.
    pub added: Vec<String>,
    /// Paths only in the old tree.
    pub removed: Vec<String>,
    /// Paths in both whose kind, content, mode or link target differ.
    pub modified: Vec<String>,
}

/// True when two entries of one path differ in kind, content, mode or link
/// target (mtime alone is not a modification).
pub fn modified(a: &Entry, b: &Entry) -> bool {
    a.kind != b.kind
        || a.chunks != b.chunks
        || a.mode != b.mode
        || a.target != b.target
        || a.size != b.size
}

/// Compares two entry lists sorted by path bytes (mtime alone is not a
/// modification). Byte order puts every directory before its contents.
pub fn diff(old: &[Entry], new: &[Entry]) -> Changes {
    use std::cmp::Ordering::*;
    let mut c = Changes::default();
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let ord = match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) => a.path.cmp(&b.path),
            (Some(_), None) => Less,
            _ => Greater,
        };
        match ord {
            Less => {
                c.removed.push(old[i].path_lossy());
                i += 1;
            }
            Greater => {
                c.added.push(new[j].path_lossy());
                j += 1;
            }
            Equal => {
                if modified(&old[i], &new[j]) {
                    c.modified.push(new[j].path_lossy());
                }
                i += 1;
                j += 1;
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file(path: &str, content: &[u8]) -> Entry {
        Entry {
            path: path.as_bytes().to_vec(),
            kind: Kind::File,
            mode: 0o644,
            mtime_ns: 1,
            size: content.len() as u64,
            chunks: vec![ChunkId::of(content)],
            target: vec![],
        }
    }

    fn dir(path: &str) -> Entry {
        Entry {
            kind: Kind::Dir,
            chunks: vec![],
            size: 0,
            ..file(path, b"")
        }
    }

    fn link(path: &str, target: &str) -> Entry {
        Entry {
            kind: Kind::Symlink,
            chunks: vec![],
            size: 0,
            target: target.as_bytes().to_vec(),
            ..file(path, b"")
        }
    }

    /// Folders `d/d/…` and a file at depth `n` (in names).
    fn deep(n: usize) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut p = String::new();
        for _ in 1..n {
            if !p.is_empty() {
                p.push('/');
            }
            p.push('d');
            out.push(dir(&p));
        }
        out.push(file(&format!("{p}/f"), b"deep"));
        out
    }

    #[test]
    fn traversal_and_symlink_parents_are_refused() {
        let mut ok = vec![dir("a"), file("a/x", b"1"), link("l", "/etc")];
        assert!(validate_entries(&mut ok, "s").unwrap().is_empty());
        let mut deepest = deep(MAX_DEPTH);
        assert!(validate_entries(&mut deepest, "s").unwrap().is_empty());
        for (bad, why) in [
            (vec![file("/etc/passwd", b"x")], "absolute"),
            (vec![file("../x", b"x")], ".."),
            (vec![dir("a"), file("a/../../x", b"x")], ".."),
            (vec![link("l", "/etc"), file("l/passwd", b"x")], "symlink"),
            (vec![file("a/x", b"x")], "not a directory"),
            (vec![file("x", b"1"), file("x", b"2")], "duplicated"),
            (vec![file("a//b", b"1")], "empty path component"),
            (deep(MAX_DEPTH + 1), "more than 256 folders deep"),
        ] {
            let mut bad = bad;
            let err = validate_entries(&mut bad, "snap1").unwrap_err();
            assert!(err.to_string().contains(why), "{err} should mention {why}");
            assert!(err.to_string().contains("snap1"));
        }
    }

    /// Issue 9, point 1: a hand-made snapshot with a setuid-root binary
    /// must not become one on the node that materialises it.
    #[test]
    fn setuid_and_setgid_bits_are_masked_and_reported() {
        let mut entries = vec![
            Entry {
                mode: 0o3775,
                ..dir("d")
            },
            Entry {
                mode: 0o4755,
                ..file("d/su", b"x")
            },
            file("plain", b"x"),
            Entry {
                mode: 0o1755,
                ..file("sticky", b"x")
            },
        ];
        let masked = validate_entries(&mut entries, "s").unwrap();
        assert_eq!(masked, ["d", "d/su", "sticky"]);
        let modes: Vec<u32> = entries.iter().map(|e| e.mode).collect();
        assert_eq!(modes, [0o1775, 0o755, 0o644, 0o755]);
    }

    #[test]
    fn snapshot_id_depends_on_content_only() {
        let s = SnapshotObject {
            files: 1,
            dirs: 0,
            symlinks: 0,
            bytes: 3,
            segments: vec![],
        };
        let (id1, bytes) = s.encode();
        assert_eq!(s.encode().0, id1);
        assert_eq!(SnapshotObject::decode(&bytes, &id1).unwrap(), s);
        let mut bad = bytes.clone();
        bad[6] ^= 1;
        assert!(SnapshotObject::decode(&bad, &id1).is_err());
    }

    #[test]
    fn editing_one_file_changes_one_segment() {
        let entries: Vec<Entry> = (0..2000)
            .map(|i| file(&format!("f{i:05}"), &[i as u8, 1]))
            .collect();
        let before: Vec<ChunkId> = split_segments(&entries)
            .iter()
            .map(|s| ChunkId::of(&encode_segment(s)))
            .collect();
        let mut edited = entries.clone();
        edited[1234] = file("f01234", b"changed");
        let after: Vec<ChunkId> = split_segments(&edited)
            .iter()
            .map(|s| ChunkId::of(&encode_segment(s)))
            .collect();
        assert_eq!(before.len(), after.len());
        assert_eq!(before.iter().zip(&after).filter(|(a, b)| a != b).count(), 1);
        assert!(
            before.len() > 60 && before.len() < 250,
            "about 16 entries a segment: {}",
            before.len()
        );
    }

    #[test]
    fn diff_reports_each_kind() {
        let old = vec![file("a", b"1"), file("b", b"1"), file("c", b"1")];
        let new = vec![file("a", b"1"), file("b", b"2"), file("d", b"1")];
        let d = diff(&old, &new);
        assert_eq!(
            (d.added, d.removed, d.modified),
            (vec!["d".into()], vec!["c".into()], vec!["b".into()])
        );
    }

    fn arb_entry() -> impl Strategy<Value = Entry> {
        (
            proptest::collection::vec(any::<u8>(), 1..40),
            0u8..3,
            any::<u32>(),
            any::<i64>(),
            any::<u64>(),
            proptest::collection::vec(any::<[u8; 32]>(), 0..5),
            proptest::collection::vec(any::<u8>(), 0..20),
        )
            .prop_map(|(path, k, mode, mtime_ns, size, chunks, target)| Entry {
                path,
                kind: [Kind::File, Kind::Dir, Kind::Symlink][k as usize],
                mode,
                mtime_ns,
                size,
                chunks: chunks.into_iter().map(ChunkId::from_bytes).collect(),
                target,
            })
    }

    proptest! {
        #[test]
        fn segment_encode_decode_is_identity(entries in proptest::collection::vec(arb_entry(), 0..50)) {
            let bytes = encode_segment(&entries);
            prop_assert_eq!(decode_segment(&bytes, &ChunkId::of(&bytes)).unwrap(), entries.clone());
            let total: usize = split_segments(&entries).iter().map(|s| s.len()).sum();
            prop_assert_eq!(total, entries.len());
        }
    }

    /// Issue 19: a hard link names a file of the same snapshot that comes
    /// before it, or the snapshot is refused: pull (as root, in labd) never
    /// links a path outside its destination or a folder.
    #[test]
    fn hard_links_name_an_earlier_file_of_the_snapshot() {
        let link = |path: &str, target: &str| Entry {
            path: path.as_bytes().to_vec(),
            kind: Kind::HardLink,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            chunks: Vec::new(),
            target: target.as_bytes().to_vec(),
        };
        let mut ok = vec![file("a", b"1"), link("b", "a")];
        validate_entries(&mut ok, "s").unwrap();
        for (mut bad, why) in [
            (vec![file("a", b"1"), link("b", "../etc/shadow")], "outside"),
            (vec![file("a", b"1"), link("b", "/etc/shadow")], "absolute"),
            (vec![link("a", "b"), file("b", b"1")], "a later file"),
            (vec![dir("d"), link("e", "d")], "a folder"),
            (vec![file("a", b"1"), link("b", "b")], "itself"),
        ] {
            let err = validate_entries(&mut bad, "s").unwrap_err().to_string();
            assert!(err.contains("hard link"), "{why}: {err}");
        }
        // A segment with a link says so by its version; others keep 1.
        assert_eq!(encode_segment(&ok)[0], 2);
        assert_eq!(encode_segment(&ok[..1])[0], 1);
        let id = ChunkId::of(b"x");
        assert_eq!(decode_segment(&encode_segment(&ok), &id).unwrap(), ok);
        // Never more decoded than a segment holds, whatever its count says.
        let many: Vec<Entry> = (0..513).map(|i| file(&format!("f{i:04}"), b"1")).collect();
        let e = decode_segment(&encode_segment(&many), &id).unwrap_err();
        assert!(
            e.to_string()
                .contains("513 entries, more than a segment holds"),
            "{e}"
        );
        decode_segment(&encode_segment(&many[..512]), &id).unwrap();
    }
}
