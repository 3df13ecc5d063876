//! The folder a push reads, held open for the whole push: every folder
//! listed and every file read under it is opened relative to it with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
//!
//! The scan never follows a symlink, but paths are looked up again when a
//! folder is listed and when a file is read. A folder swapped for a symlink
//! in between was followed: out of the source, and, when root's labd
//! pushes a job's outputs as the job's user, through a `/proc/self/fd/N`
//! magic link into whatever folder labd holds open at that moment (another
//! user's job folder being filled, say), whose parents' permissions a
//! magic link skips. Now such a path is refused (`ELOOP`, or `EXDEV` for
//! one that would leave the source), and the source's own path is opened
//! once, with no symlink in it (it is the canonical path).
//!
//! Kernels before 5.6 (and sandboxes whose seccomp filter refuses the
//! call) have no `openat2`: there the opens are relative to the source's
//! folder with `O_NOFOLLOW`, which refuses a symlink as the last name only.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rustix::fs::{Mode, OFlags, ResolveFlags, CWD};
use rustix::io::Errno;

/// The source folder of a push, open.
pub(super) struct Beneath {
    dir: OwnedFd,
    /// Its path, as the walk's paths start.
    at: PathBuf,
}

impl Beneath {
    /// Opens `root` (a canonical path: no symlink in it), or, when it is
    /// a file, the folder holding it.
    pub fn open(root: &Path) -> std::io::Result<Beneath> {
        let fd = resolve(CWD, root, OFlags::PATH, ResolveFlags::NO_SYMLINKS)?;
        let st = rustix::fs::fstat(&fd)?;
        // Without openat2 a last name that is a symlink opens as one
        // (O_PATH|O_NOFOLLOW): refused as openat2 refuses it.
        if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink {
            return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
        }
        if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory {
            return Ok(Beneath {
                dir: fd,
                at: root.to_path_buf(),
            });
        }
        let parent = root.parent().unwrap_or(Path::new("/"));
        Ok(Beneath {
            dir: resolve(
                CWD,
                parent,
                OFlags::PATH | OFlags::DIRECTORY,
                ResolveFlags::NO_SYMLINKS,
            )?,
            at: parent.to_path_buf(),
        })
    }

    /// Opens `path`, a path under the source as the walk makes them, with
    /// `flags` (and `O_CLOEXEC`): `ELOOP` when a symlink is on the way or
    /// is the file itself, `EXDEV` when the path leads out of the source.
    pub fn open_at(&self, path: &Path, flags: OFlags) -> std::io::Result<OwnedFd> {
        let rel = path.strip_prefix(&self.at).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} is not under the source {}",
                    path.display(),
                    self.at.display()
                ),
            )
        })?;
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS;
        resolve(self.dir.as_fd(), rel, flags, how)
    }
}

/// Opens `path` relative to `dir` as `how` says (`O_NOFOLLOW` only,
/// without `openat2`).
fn resolve(
    dir: BorrowedFd<'_>,
    path: &Path,
    flags: OFlags,
    how: ResolveFlags,
) -> std::io::Result<OwnedFd> {
    let flags = flags | OFlags::CLOEXEC;
    if !has_openat2() {
        return walk(dir, path, flags);
    }
    // EAGAIN: a rename elsewhere raced the lookup; the kernel asks for a retry.
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(dir, path, flags, Mode::empty(), how) {
            Err(Errno::AGAIN) if tries < 16 => tries += 1,
            r => return Ok(r?),
        }
    }
}

/// [`resolve`] without `openat2`: `path` walked a name at a time from
/// `dir` (from `/` when absolute), every name opened with `O_NOFOLLOW`,
/// the folders on the way as folders; `..` is refused (`EXDEV`).
fn walk(dir: BorrowedFd<'_>, path: &Path, flags: OFlags) -> std::io::Result<OwnedFd> {
    use std::path::Component;
    let on_way = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let names: Vec<_> = path.components().collect();
    let mut at: Option<OwnedFd> = None;
    for (i, c) in names.iter().enumerate() {
        let last = i + 1 == names.len();
        let name: &std::ffi::OsStr = match c {
            Component::RootDir if last => {
                return Ok(rustix::fs::open(
                    "/",
                    flags | OFlags::NOFOLLOW,
                    Mode::empty(),
                )?);
            }
            Component::RootDir => {
                at = Some(rustix::fs::open("/", on_way, Mode::empty())?);
                continue;
            }
            Component::CurDir => ".".as_ref(),
            Component::Normal(n) => n,
            Component::ParentDir | Component::Prefix(_) => {
                return Err(std::io::Error::from_raw_os_error(libc::EXDEV));
            }
        };
        let from = at.as_ref().map_or(dir, |f| f.as_fd());
        let opened = if last {
            rustix::fs::openat(from, name, flags | OFlags::NOFOLLOW, Mode::empty())?
        } else {
            rustix::fs::openat(from, name, on_way, Mode::empty())?
        };
        if last {
            return Ok(opened);
        }
        at = Some(opened);
    }
    Ok(rustix::fs::openat(dir, ".", flags, Mode::empty())?)
}

/// Whether this kernel (and its seccomp filter) lets `openat2` work:
/// `ENOSYS`, or `EPERM` from older container profiles, says it does not
/// (for good); any other failure of the probe (out of descriptors, say)
/// says nothing, and it is asked again next time.
fn has_openat2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    if let Some(&has) = HAS.get() {
        return has;
    }
    let probe = rustix::fs::openat2(
        CWD,
        "/",
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS,
    );
    match probe {
        Ok(_) => *HAS.get_or_init(|| true),
        Err(e @ (Errno::NOSYS | Errno::PERM)) => *HAS.get_or_init(|| {
            tracing::warn!(
                "openat2 is not available ({e}): pushes walk paths a folder at a time \
                 instead (O_NOFOLLOW at each)"
            );
            false
        }),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_through_symlinks_or_magic_links_are_refused() {
        let t = tempfile::tempdir().unwrap();
        // Canonical, as a push's source is (TMPDIR may hold a symlink).
        let base = t.path().canonicalize().unwrap();
        let src = base.join("src");
        std::fs::create_dir_all(src.join("a")).unwrap();
        std::fs::write(src.join("a/f"), b"mine").unwrap();
        // Someone else's folder, held open by this process (as labd holds
        // a job folder it fills), with a file in it.
        let other = base.join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("secret"), b"theirs").unwrap();
        let held = std::fs::File::open(&other).unwrap();
        let magic = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held));
        std::os::unix::fs::symlink(&magic, src.join("magic")).unwrap();
        std::os::unix::fs::symlink(&other, src.join("plain")).unwrap();
        std::os::unix::fs::symlink("../other", src.join("up")).unwrap();

        let b = Beneath::open(&src).unwrap();
        let read = |rel: &str| -> std::io::Result<Vec<u8>> {
            let fd = b.open_at(&src.join(rel), OFlags::RDONLY)?;
            Ok(std::io::Read::bytes(std::fs::File::from(fd))
                .collect::<Result<_, _>>()
                .unwrap())
        };
        assert_eq!(read("a/f").unwrap(), b"mine");
        // The old way (a path lookup) reaches the other folder's file.
        assert_eq!(
            std::fs::read(src.join("magic/secret")).unwrap(),
            b"theirs",
            "the test's premise"
        );
        for rel in [
            "magic/secret",
            "plain/secret",
            "up/secret",
            "a/../../other/secret",
        ] {
            let e = read(rel).expect_err(rel);
            let code = e.raw_os_error();
            assert!(
                code == Some(libc::ELOOP) || code == Some(libc::EXDEV),
                "{rel}: {e}"
            );
        }
        // A symlink as the file itself is refused too.
        std::os::unix::fs::symlink(src.join("a/f"), src.join("link")).unwrap();
        assert_eq!(read("link").unwrap_err().raw_os_error(), Some(libc::ELOOP));
        // The walk without openat2 refuses the same.
        let src_fd =
            rustix::fs::open(&src, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let walked = |rel: &str| walk(src_fd.as_fd(), Path::new(rel), OFlags::RDONLY);
        assert!(walked("a/f").is_ok());
        for rel in [
            "magic/secret",
            "plain/secret",
            "up/secret",
            "a/../../other/secret",
            "link",
        ] {
            let code = walked(rel).expect_err(rel).raw_os_error();
            assert!(
                code == Some(libc::ELOOP)
                    || code == Some(libc::EXDEV)
                    || code == Some(libc::ENOTDIR),
                "{rel}: {code:?}"
            );
        }
        assert!(walk(CWD, &src.join("a/f"), OFlags::RDONLY).is_ok());
        // A source that is a symlink (swapped in after it was resolved).
        let e = Beneath::open(&src.join("link")).err().expect("refused");
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        // A path outside the source is not taken at all.
        assert!(b.open_at(&other.join("secret"), OFlags::RDONLY).is_err());
        // The source as one file: opened in its folder.
        let one = Beneath::open(&src.join("a/f")).unwrap();
        assert!(one.open_at(&src.join("a/f"), OFlags::RDONLY).is_ok());
    }
}
