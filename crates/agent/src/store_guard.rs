//! Root (labd, or an admin's `labsync push`) with a store in a local
//! folder: refused when anyone but root can write in that folder.
//!
//! The store's objects are reached by path (`object_store`'s local backend
//! follows symlinks, and so do plain `open` and `rename`). A user who can
//! write in the folder can replace `packs/3f` with a symlink to
//! `/etc/cron.d`, and labd, saving a job's outputs as root, then writes a
//! root-owned file of that user's bytes there. Every lab member writing the
//! shared store is the design, so such a folder cannot be made safe for
//! root by checking it now and then: a shared store for a root labd is an
//! object store server (`s3://…`), where there are no symlinks to plant.

use std::path::{Path, PathBuf};

/// Checks that no one but root can write in `root` (the store's folder),
/// in anything it holds, or change what its path leads to, and that it
/// holds nothing but folders and plain files (root's, not writable by
/// others; folders without a default ACL). `Err` says what is wrong and
/// what to do.
pub fn check_root_store(root: &Path) -> Result<(), crate::SetupError> {
    check(root).map_err(crate::SetupError::UnsafeStore)
}

fn check(root: &Path) -> Result<(), String> {
    let canon = root
        .canonicalize()
        .map_err(|e| format!("{}: {e}", root.display()))?;
    let unsafe_store = |what: String| {
        Err(format!(
            "this runs as root and its store {} is a local folder other users can \
             change: {what}. Whoever can write there can plant a symlink and have root \
             write wherever it points (labd saving a job's outputs, an admin's push). \
             Run this as a lab user rather than root, keep a store that users write on \
             an S3-compatible server (store = \"s3://…\"), or make this folder root's \
             alone (chown -R root: {0}; chmod -R go-w {0}) if only root writes it.",
            canon.display()
        ))
    };
    use std::os::unix::fs::MetadataExt;
    // The folders above it: another user's, or writable by others without
    // the sticky bit (as /tmp has), and the store could be swapped.
    for above in canon.ancestors().skip(1) {
        let md =
            std::fs::symlink_metadata(above).map_err(|e| format!("{}: {e}", above.display()))?;
        if md.uid() != 0 {
            return unsafe_store(format!("{} belongs to uid {}", above.display(), md.uid()));
        }
        if others_write(&md) && md.mode() & 0o1000 == 0 {
            return unsafe_store(format!(
                "{} is writable by others (mode {:o})",
                above.display(),
                md.mode() & 0o7777
            ));
        }
    }
    // The store itself, folder by folder (no recursion, no symlink followed).
    let mut folders: Vec<PathBuf> = vec![canon.clone()];
    while let Some(dir) = folders.pop() {
        let md = std::fs::symlink_metadata(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if md.uid() != 0 {
            return unsafe_store(format!("{} belongs to uid {}", dir.display(), md.uid()));
        }
        if others_write(&md) {
            return unsafe_store(format!(
                "{} is writable by others (mode {:o})",
                dir.display(),
                md.mode() & 0o7777
            ));
        }
        // A default ACL could make the folders made in it later writable
        // by others, after this check.
        if rustix::fs::lgetxattr_query(&dir, "system.posix_acl_default").is_ok_and(|n| n > 0) {
            return unsafe_store(format!(
                "{} has a default ACL (getfacl shows it)",
                dir.display()
            ));
        }
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for e in entries {
            let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
            let kind = e
                .file_type()
                .map_err(|err| format!("{}: {err}", e.path().display()))?;
            if kind.is_dir() {
                folders.push(e.path());
            } else if kind.is_symlink() {
                return unsafe_store(format!("{} is a symlink", e.path().display()));
            } else if !kind.is_file() {
                return unsafe_store(format!(
                    "{} is neither a file nor a folder",
                    e.path().display()
                ));
            } else {
                let md = e
                    .metadata()
                    .map_err(|err| format!("{}: {err}", e.path().display()))?;
                if md.uid() != 0 {
                    return unsafe_store(format!(
                        "{} belongs to uid {}",
                        e.path().display(),
                        md.uid()
                    ));
                }
                if others_write(&md) {
                    return unsafe_store(format!(
                        "{} is writable by others (mode {:o})",
                        e.path().display(),
                        md.mode() & 0o7777
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Whether someone other than root may write it: anyone (o+w), or its
/// group when that is not root's (a root labd started with umask 002
/// makes its folders writable by group root, which is fine).
fn others_write(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    md.mode() & 0o002 != 0 || (md.mode() & 0o020 != 0 && md.gid() != 0)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn set_mode(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A store as root's pushes leave it: folders 755, files 644.
    fn store(dir: &Path) -> PathBuf {
        let s = dir.join("store");
        std::fs::create_dir_all(s.join("packs/3f")).unwrap();
        std::fs::create_dir_all(s.join("refs/div2k")).unwrap();
        std::fs::write(s.join("packs/3f/3f00"), b"pack").unwrap();
        std::fs::write(s.join("refs/div2k/1"), b"{}").unwrap();
        for d in [
            s.clone(),
            s.join("packs"),
            s.join("packs/3f"),
            s.join("refs"),
            s.join("refs/div2k"),
        ] {
            set_mode(&d, 0o755);
        }
        s
    }

    #[test]
    fn a_store_only_root_can_change_passes_and_any_opening_is_named() {
        if crate::euid() != 0 {
            eprintln!("not root: the folders are not root's");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        set_mode(dir.path(), 0o755);
        let s = store(dir.path());
        check_root_store(&s).unwrap();

        // A folder of it group-writable: fine for group root (umask 002);
        // not for another group (a lab's shared store).
        set_mode(&s.join("packs"), 0o775);
        check_root_store(&s).unwrap();
        std::os::unix::fs::chown(s.join("packs"), None, Some(100)).unwrap();
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("packs is writable by others (mode 775)"), "{e}");
        assert!(e.contains("s3://"), "{e}");
        set_mode(&s.join("packs"), 0o755);
        std::os::unix::fs::chown(s.join("packs"), None, Some(0)).unwrap();

        // A folder another user made.
        std::os::unix::fs::chown(s.join("refs/div2k"), Some(65534), None).unwrap();
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("div2k belongs to uid 65534"), "{e}");
        std::os::unix::fs::chown(s.join("refs/div2k"), Some(0), None).unwrap();

        // A file of another user's, or writable by others.
        let file = s.join("refs/div2k/1");
        std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("refs/div2k/1 belongs to uid 65534"), "{e}");
        std::os::unix::fs::chown(&file, Some(0), None).unwrap();
        set_mode(&file, 0o666);
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("1 is writable by others (mode 666)"), "{e}");
        set_mode(&file, 0o644);

        // A default ACL giving the group write (where the file system takes
        // ACLs): user::rwx, group::rwx, other::r-x, in the kernel's format.
        let mut acl = 2u32.to_le_bytes().to_vec();
        for (tag, perm) in [(0x01u16, 7u16), (0x04, 7), (0x20, 5)] {
            acl.extend(tag.to_le_bytes());
            acl.extend(perm.to_le_bytes());
            acl.extend(u32::MAX.to_le_bytes());
        }
        let name = "system.posix_acl_default";
        let flags = rustix::fs::XattrFlags::empty();
        if rustix::fs::lsetxattr(s.join("packs"), name, &acl, flags).is_ok() {
            let e = check_root_store(&s).unwrap_err().to_string();
            assert!(e.contains("packs has a default ACL"), "{e}");
            rustix::fs::lremovexattr(s.join("packs"), name).unwrap();
        } else {
            eprintln!("no ACLs on this file system: the default ACL is not tried");
        }
        check_root_store(&s).unwrap();

        // A symlink planted in it, and a FIFO.
        std::os::unix::fs::symlink("/etc/cron.d", s.join("packs/40")).unwrap();
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("packs/40 is a symlink"), "{e}");
        std::fs::remove_file(s.join("packs/40")).unwrap();
        let fifo = s.join("refs/div2k/2");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("neither a file nor a folder"), "{e}");
        std::fs::remove_file(&fifo).unwrap();
        check_root_store(&s).unwrap();

        // The folder above it writable by others: the store could be
        // swapped; with the sticky bit (as /tmp) it cannot.
        set_mode(dir.path(), 0o777);
        let e = check_root_store(&s).unwrap_err().to_string();
        assert!(e.contains("is writable by others (mode 777)"), "{e}");
        set_mode(dir.path(), 0o1777);
        check_root_store(&s).unwrap();
    }
}
