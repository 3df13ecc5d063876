//! Filesystem helpers: sizes, content digests, directory hygiene.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Relative paths of all regular files under `root`, sorted. Symlinks are
/// not followed: none of the tools is asked to follow them either.
pub fn walk_files(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let ty = entry.file_type()?;
            let child = rel.join(entry.file_name());
            if ty.is_dir() {
                stack.push(child);
            } else if ty.is_file() {
                out.push(child);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Sum of apparent sizes of the regular files under `root` (0 if absent).
/// Directory entries are left out on purpose: their 4 KiB blocks say more
/// about the filesystem than about the tool (casync makes up to 65 536
/// prefix directories).
pub fn tree_bytes(root: &Path) -> io::Result<u64> {
    if !root.exists() {
        return Ok(0);
    }
    let mut total = 0;
    for rel in walk_files(root)? {
        total += fs::symlink_metadata(root.join(rel))?.len();
    }
    Ok(total)
}

/// Identity of a tree's content: paths, sizes and BLAKE3 of every file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeDigest {
    pub files: u64,
    pub bytes: u64,
    pub digest: blake3::Hash,
}

/// Digest of all regular files under `root`; a pull counts as correct only
/// if it reproduces the source's digest (modes, owners and times are not
/// compared, and empty directories are ignored).
pub fn tree_digest(root: &Path) -> io::Result<TreeDigest> {
    let mut h = blake3::Hasher::new();
    let (mut files, mut bytes) = (0u64, 0u64);
    for rel in walk_files(root)? {
        let data = fs::read(root.join(&rel))?;
        let name = rel.to_string_lossy();
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(data.len() as u64).to_le_bytes());
        h.update(blake3::hash(&data).as_bytes());
        files += 1;
        bytes += data.len() as u64;
    }
    Ok(TreeDigest {
        files,
        bytes,
        digest: h.finalize(),
    })
}

/// Removes `path` if present (no error if it is already gone).
pub fn remove_all(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Makes `path` an empty directory.
pub fn fresh_dir(path: &Path) -> io::Result<()> {
    remove_all(path)?;
    fs::create_dir_all(path)
}

/// `which`: the first executable named `program` on `$PATH`, or the path
/// itself if it contains a slash and is a file.
pub fn find_program(program: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| {
        fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if program.components().count() > 1 {
        return is_exec(program).then(|| program.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| is_exec(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_sees_content_and_names() {
        let root =
            std::env::temp_dir().join(format!("labsync-bench-fsutil-{}", std::process::id()));
        fresh_dir(&root.join("a/b")).unwrap();
        fs::write(root.join("a/b/x"), b"hello").unwrap();
        fs::write(root.join("y"), b"world!").unwrap();
        let d1 = tree_digest(&root).unwrap();
        assert_eq!((d1.files, d1.bytes), (2, 11));
        assert_eq!(tree_bytes(&root).unwrap(), 11);
        fs::write(root.join("y"), b"World!").unwrap();
        assert_ne!(tree_digest(&root).unwrap().digest, d1.digest);
        remove_all(&root).unwrap();
        assert_eq!(tree_bytes(&root).unwrap(), 0);
        assert!(find_program(Path::new("sh")).is_some());
        assert!(find_program(Path::new("./definitely/not/here")).is_none());
    }
}
