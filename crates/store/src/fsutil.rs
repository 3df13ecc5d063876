//! Small file-system helpers shared by the cache, the files cache and pull.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes `data` to `path` through a temporary file and a rename, so a reader
/// sees the old content or the new, never half of it, and a power cut
/// leaves one or the other, never an empty or zero-filled file: the data
/// is synced before the rename. The temporary name is new (`O_EXCL`, a
/// random part per process): a symlink planted in the folder is never
/// followed, and concurrent writers of one path never share one. The file
/// gets mode `0o644` less the umask, and missing folders above it are
/// made; [`write_atomic_mode`] sets another mode and makes no folder.
/// The one atomic write of the workspace: labd's records use it too.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
    }
    write_atomic_mode(path, data, 0o644)
}

/// [`write_atomic`] with the file's mode (less the umask), `0o600` for a
/// record only root may read, into a folder that must exist: a record
/// written as its folder is removed fails, and does not make it again.
pub fn write_atomic_mode(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = tmp_name(path);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(Error::io("create", &tmp))?;
        f.write_all(data).map_err(Error::io("write", &tmp))?;
        f.sync_data().map_err(Error::io("sync", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(Error::io("rename into place", path))
    })();
    if written.is_err() {
        // A full disk must not also keep the half-written copy.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// [`write_atomic`] with `O_DIRECT` where the file system allows it: the
/// bytes go to the disk from an aligned buffer, not through the page cache.
/// For packs a pull has just fetched and uses from memory: copying them into
/// the page cache as well cost a third of the CPU of a pull from a peer.
pub(crate) fn write_atomic_direct(path: &Path, data: &[u8]) -> Result<()> {
    #[cfg(target_os = "linux")]
    if let Some(done) = write_direct(path, data) {
        return done;
    }
    write_atomic(path, data)
}

/// Writes `data` at the start of `file`, opened with `O_DIRECT`. Data that
/// starts at an aligned address (packs are built so, and peers' packs are
/// received so) goes to the disk from where it is, all but its last partial
/// block: copying every pack through a bounce buffer cost a second copy of
/// every byte pushed or fetched. The rest (all of it when misaligned) is
/// copied through a per-thread aligned bounce buffer no bigger than it
/// needs, the last block padded with zeros: the caller truncates the file
/// to `data.len()`. `EINVAL` is the kernel refusing the alignment.
#[cfg(target_os = "linux")]
pub(crate) fn write_all_direct(file: &std::fs::File, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    /// Bytes per write: big enough for full device throughput, small
    /// enough that a bounce buffer costs nothing next to a 32 MiB pack.
    const PIECE: usize = 4 << 20;
    thread_local! {
        static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let direct = if (data.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN) {
        data.len() / DIRECT_ALIGN * DIRECT_ALIGN
    } else {
        0
    };
    for (k, piece) in data[..direct].chunks(PIECE).enumerate() {
        file.write_all_at(piece, (k * PIECE) as u64)?;
    }
    let rest = &data[direct..];
    if rest.is_empty() {
        return Ok(());
    }
    let window = rest.len().next_multiple_of(DIRECT_ALIGN).min(PIECE);
    BOUNCE.with(|b| {
        let mut b = b.borrow_mut();
        let start = aligned_window(&mut b, window)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        for (k, piece) in rest.chunks(window).enumerate() {
            let padded = piece.len().next_multiple_of(DIRECT_ALIGN);
            let w = &mut b[start..start + padded];
            w[..piece.len()].copy_from_slice(piece);
            w[piece.len()..].fill(0);
            file.write_all_at(w, (direct + k * window) as u64)?;
        }
        Ok(())
    })
}

/// Writes `size` bytes to `path` (through a temporary name, renamed into
/// place) that `fill` gives in order, piece by piece: `fill(offset,
/// piece)` fills `piece` with the bytes from `offset` on. The pieces pass
/// through one aligned buffer of the calling thread and go to the disk,
/// with `direct`, by `O_DIRECT` where the file system allows it, so what
/// is written is never whole in memory, nor in the page cache. An error
/// (of `fill` or of the disk) ends the write, and nothing is left at
/// `path` or the temporary name.
pub(crate) fn write_atomic_pieces(
    path: &Path,
    size: u64,
    direct: bool,
    fill: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    /// Bytes per piece, as [`write_all_direct`] writes.
    const PIECE: usize = 4 << 20;
    thread_local! {
        static WINDOW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
    }
    let tmp = tmp_name(path);
    let create = |direct: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(target_os = "linux")]
        if direct {
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&tmp)
    };
    let direct = direct && cfg!(target_os = "linux");
    let (file, direct) = match create(direct) {
        Ok(f) => (f, direct),
        Err(_) => {
            // A file system that refuses O_DIRECT may have created the
            // file before it said so.
            if direct {
                let _ = std::fs::remove_file(&tmp);
            }
            (create(false).map_err(Error::io("create", &tmp))?, false)
        }
    };
    let written = WINDOW.with(|w| {
        let mut w = w.borrow_mut();
        let start = aligned_window(&mut w, PIECE).ok_or_else(|| {
            Error::io("align a buffer for", &tmp)(std::io::Error::from_raw_os_error(libc::EINVAL))
        })?;
        let mut at = 0u64;
        while at < size {
            let len = (size - at).min(PIECE as u64) as usize;
            // With O_DIRECT the last piece is padded to whole blocks, and
            // the file cut back to `size` after.
            let padded = if direct {
                len.next_multiple_of(DIRECT_ALIGN)
            } else {
                len
            };
            let piece = &mut w[start..start + padded];
            fill(at, &mut piece[..len])?;
            piece[len..].fill(0);
            file.write_all_at(piece, at)
                .map_err(Error::io("write", &tmp))?;
            at += len as u64;
        }
        file.set_len(size).map_err(Error::io("write", &tmp))
    });
    drop(file);
    match written {
        Ok(()) => std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("rename into place", path)(e)
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `None` where `O_DIRECT` cannot be used (the caller writes buffered).
#[cfg(target_os = "linux")]
fn write_direct(path: &Path, data: &[u8]) -> Option<Result<()>> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        if let Err(e) = std::fs::create_dir_all(dir) {
            return Some(Err(Error::io("create directory", dir)(e)));
        }
    }
    let tmp = tmp_name(path);
    let f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&tmp)
    {
        Ok(f) => f,
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
            return None;
        }
    };
    let written = write_all_direct(&f, data)
        // The last block was padded to the alignment.
        .and_then(|()| f.set_len(data.len() as u64));
    drop(f);
    match written {
        Ok(()) => Some(std::fs::rename(&tmp, path).map_err(Error::io("rename into place", path))),
        Err(_) => {
            // Refused for this file (an odd file system, a full disk): the
            // buffered write says which.
            let _ = std::fs::remove_file(&tmp);
            None
        }
    }
}

/// Bytes an unprivileged writer may still use on the file system of `path`
/// (the nearest existing folder above it); `None` if it cannot be asked.
pub(crate) fn free_space(path: &Path) -> Option<u64> {
    disk_space(path).map(|(_, free, _)| free)
}

/// The file system of `path`, asked at the nearest existing folder above
/// it (returned): the bytes an unprivileged writer may still use, and its
/// size; `None` if it cannot be asked.
#[allow(unsafe_code)]
pub fn disk_space(path: &Path) -> Option<(std::path::PathBuf, u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value; statvfs(3) fills it from
    // a NUL-terminated path that outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| {
        (
            existing.to_path_buf(),
            st.f_bavail.saturating_mul(st.f_frsize),
            st.f_blocks.saturating_mul(st.f_frsize),
        )
    })
}

/// How far the reader's time zone (`TZ`, else `/etc/localtime`) is ahead
/// of UTC at Unix second `secs`, in seconds (summer time included); `None`
/// if the C library cannot say.
#[allow(unsafe_code)]
pub fn utc_offset(secs: i64) -> Option<i32> {
    // time_t is i64 here, narrower on some 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let t: libc::time_t = secs.try_into().ok()?;
    // SAFETY: an all-zero tm is a valid value; localtime_r fills it from a
    // time_t that outlives the call, and is the thread-safe form.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::localtime_r(&t, &mut tm) };
    (!r.is_null()).then_some(tm.tm_gmtoff as i32)
}

/// The device holding `path` (or the nearest existing folder above it).
pub(crate) fn device_of(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    std::fs::metadata(existing).ok().map(|m| m.dev())
}

/// `dir/.labsync-tmp.<pid>.<n>`: hidden, unique per process and call, and
/// short whatever the final name. It used to embed the final name, so a
/// file named with 255 bytes (the Linux limit, which push accepts) got a
/// temporary name too long to create, and its whole version could never be
/// pulled.
pub(crate) fn tmp_name(path: &Path) -> PathBuf {
    path.with_file_name(tmp_leaf())
}

/// The name part of [`tmp_name`]: `.labsync-tmp.<pid>.<salt>.<n>`, the salt
/// random per process so that nobody who can write in the folder can take
/// the names ahead of us (a name taken makes the create fail, never
/// overwrite: it is `O_EXCL`).
pub(crate) fn tmp_leaf() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    // getpid is a system call (glibc stopped caching it): once per process.
    static PID: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    let (pid, salt) = *PID.get_or_init(|| {
        let h = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        (std::process::id(), h as u32)
    });
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!(".labsync-tmp.{pid}.{salt:08x}.{n}")
}

/// Runs blocking work (file I/O, hashing a tree, forking, scanning
/// `/proc`) off the async runtime and waits for it; a panic in it goes on
/// in the caller. The one such helper of the workspace.
pub async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only a runtime shutting down cancels a blocking task.
        Err(e) => panic!("blocking task cancelled: {e}"),
    }
}

/// [`off_runtime`] for work that returns the store's `Result`.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    off_runtime(f).await
}

/// While alive, this thread reads files as another user: its file-system
/// uid and gid (setfsuid(2), setfsgid(2)) are switched, its supplementary
/// groups dropped and its effective capabilities cleared, so permission
/// checks are that user's. setfsuid alone drops only the file capabilities:
/// with CAP_SYSLOG, CAP_SYS_PTRACE or CAP_SYS_ADMIN still in force, a job
/// that swaps a folder of its outputs for a symlink to `/proc` would have
/// root read kernel addresses (`kallsyms`) or other users' memory maps into
/// its snapshot. Linux keeps all of these per thread; the raw system calls
/// are used because libc wrappers may apply id changes to every thread.
/// labd, running as root, pushes a job's outputs this way, so a job cannot
/// make it read what its user may not (a symlink to `/root`, say).
pub(crate) struct ReadAs {
    saved: Option<(libc::c_long, libc::c_long, Vec<libc::gid_t>)>,
    /// The thread's capabilities before, put back first when it leaves.
    caps: Option<rustix::thread::CapabilitySets>,
}

impl ReadAs {
    /// Switches this thread to `who` (`None`: stays itself), or says it
    /// cannot. setfsuid and setfsgid say nothing when they fail (a process
    /// without CAP_SETUID or CAP_SETGID, root in a capability-bound unit
    /// say): an invalid id (-1) changes nothing and returns the one in
    /// force, so the ids are read back. Reading on with the process's own
    /// rights could read what the user may not.
    #[allow(unsafe_code)]
    pub(crate) fn try_enter(who: Option<crate::RunAs>) -> std::io::Result<ReadAs> {
        let Some(crate::RunAs { uid, gid }) = who else {
            return Ok(ReadAs {
                saved: None,
                caps: None,
            });
        };
        let refused = |why: String| {
            std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "cannot read files as uid {uid} gid {gid}: {why}; refusing to read with \
                     this process's own rights instead"
                ),
            )
        };
        let caps = rustix::thread::capabilities(None)
            .map_err(|e| refused(format!("cannot read this thread's capabilities ({e})")))?;
        // SAFETY: these system calls change only this thread's credentials;
        // the buffers passed are valid for the lengths given.
        unsafe {
            let n = libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<libc::gid_t>());
            let mut groups = vec![0 as libc::gid_t; n.max(0) as usize];
            let n = libc::syscall(libc::SYS_getgroups, groups.len(), groups.as_mut_ptr());
            groups.truncate(n.max(0) as usize);
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>());
            let old_gid = libc::syscall(libc::SYS_setfsgid, gid);
            let old_uid = libc::syscall(libc::SYS_setfsuid, uid);
            // Dropped on the error too: the thread is itself again.
            let mut entered = ReadAs {
                saved: Some((old_uid, old_gid, groups)),
                caps: None,
            };
            let now_uid = libc::syscall(libc::SYS_setfsuid, u32::MAX);
            let now_gid = libc::syscall(libc::SYS_setfsgid, u32::MAX);
            let now_groups =
                libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<libc::gid_t>());
            if (now_uid, now_gid, now_groups)
                != (libc::c_long::from(uid), libc::c_long::from(gid), 0)
            {
                return Err(refused(
                    "this process may not switch its file-system ids (it lacks CAP_SETUID or \
                     CAP_SETGID)"
                        .into(),
                ));
            }
            // Last: switching the ids above needs CAP_SETUID and CAP_SETGID.
            let mut none = caps;
            none.effective = rustix::thread::CapabilitySet::empty();
            rustix::thread::set_capabilities(None, none)
                .map_err(|e| refused(format!("cannot clear its capabilities ({e})")))?;
            // Only once cleared: restoring what was never changed could fail.
            entered.caps = Some(caps);
            Ok(entered)
        }
    }

    /// [`ReadAs::try_enter`] on a worker thread of a push whose start
    /// already switched once ([`try_enter`](ReadAs::try_enter) in
    /// `source_root`): a thread that cannot is a broken invariant, and
    /// reads nothing.
    pub(crate) fn enter(who: Option<crate::RunAs>) -> ReadAs {
        ReadAs::try_enter(who).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for ReadAs {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // First: setting the ids back needs CAP_SETUID and CAP_SETGID.
        if let Some(caps) = self.caps.take() {
            if let Err(e) = rustix::thread::set_capabilities(None, caps) {
                // Within the permitted set, raising them back cannot fail.
                panic!("cannot restore this thread's capabilities: {e}");
            }
        }
        if let Some((uid, gid, groups)) = self.saved.take() {
            // SAFETY: as in `enter`; restores what it saved, on the same thread.
            unsafe {
                libc::syscall(libc::SYS_setfsuid, uid);
                libc::syscall(libc::SYS_setfsgid, gid);
                libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr());
            }
        }
    }
}

/// Runs `f` on this thread with the file-system rights of user `who`
/// (uid, gid; `None`: the caller's own), as a push reads a job's files: a
/// look at a path a user controls (a job's outputs folder, which may be a
/// symlink to anywhere) then tells root's caller only what that user may
/// see. Call it off the async runtime: a look can block (an automount, a
/// dead NFS server). `Err` when this thread cannot switch to `who`.
pub fn as_user<T>(who: Option<crate::RunAs>, f: impl FnOnce() -> T) -> std::io::Result<T> {
    let _as = ReadAs::try_enter(who)?;
    Ok(f())
}

/// The alignment `O_DIRECT` asks of buffer address, file offset and length:
/// the largest logical block size in use (4096 on every common disk).
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Where a `DIRECT_ALIGN`-aligned window of `len` bytes starts inside `buf`,
/// which is grown (and then reused: its pages are already faulted in) to
/// hold it; `None` if no aligned start can be found.
pub(crate) fn aligned_window(buf: &mut Vec<u8>, len: usize) -> Option<usize> {
    if buf.len() < len + DIRECT_ALIGN {
        buf.resize(len + DIRECT_ALIGN, 0);
    }
    let start = buf.as_ptr().align_offset(DIRECT_ALIGN);
    (start < DIRECT_ALIGN).then_some(start)
}

/// Opens `path` for reading with `O_DIRECT` (bypassing the page cache);
/// `None` where the file system does not support it.
#[cfg(target_os = "linux")]
pub(crate) fn open_direct(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

/// No `O_DIRECT` off Linux.
#[cfg(not(target_os = "linux"))]
pub(crate) fn open_direct(_: &Path) -> Option<std::fs::File> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A look as another user sees what that user may see: not a folder
    /// behind one only root can enter; and the thread is itself again after.
    #[test]
    fn a_look_as_a_user_has_that_users_rights() {
        use std::os::unix::fs::PermissionsExt;
        if !rustix::process::geteuid().is_root() {
            eprintln!("not root: cannot look as another user");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("root-only");
        std::fs::create_dir_all(private.join("inside")).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(private.join("inside"), &link).unwrap();
        let nobody = Some(crate::RunAs {
            uid: 65534,
            gid: 65534,
        });
        assert!(
            !as_user(nobody, || link.is_dir()).unwrap(),
            "seen through root's eyes"
        );
        assert!(as_user(None, || link.is_dir()).unwrap());
        assert!(link.is_dir(), "the thread's own rights are back");
        // None of root's capabilities is in force meanwhile (CAP_SYSLOG,
        // CAP_SYS_PTRACE: what /proc shows), and all are back after.
        use rustix::thread::capabilities;
        let before = capabilities(None).unwrap();
        let inside = as_user(nobody, || capabilities(None).unwrap()).unwrap();
        assert!(inside.effective.is_empty(), "{:?}", inside.effective);
        assert_eq!(inside.permitted, before.permitted);
        assert_eq!(capabilities(None).unwrap().effective, before.effective);
        assert!(
            as_user(nobody, || std::fs::read_dir(&private).is_err()).unwrap(),
            "nobody cannot list root's 0700 folder"
        );
    }

    /// A thread that cannot switch its file-system ids (no CAP_SETUID and
    /// CAP_SETGID in force) reads nothing as another user, rather than
    /// reading with its own rights, and is itself again after.
    #[test]
    fn a_look_that_cannot_switch_users_is_refused() {
        use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
        if !rustix::process::geteuid().is_root() {
            eprintln!("not root: cannot look as another user");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let probe = dir.path().to_path_buf();
        // Capabilities are per thread: only this one loses them.
        let (looked, emptied, fsuid) = std::thread::spawn(move || {
            let mut caps = capabilities(None).unwrap();
            caps.effective -= CapabilitySet::SETUID | CapabilitySet::SETGID;
            set_capabilities(None, caps).unwrap();
            let looked = as_user(
                Some(crate::RunAs {
                    uid: 65534,
                    gid: 65534,
                }),
                || probe.is_dir(),
            );
            let emptied = crate::empty_tree_as(
                &probe,
                Some(crate::RunAs {
                    uid: 65534,
                    gid: 65534,
                }),
            );
            // SAFETY: an invalid id changes nothing and returns the one in force.
            #[allow(unsafe_code)]
            let fsuid = unsafe { libc::syscall(libc::SYS_setfsuid, u32::MAX) };
            (looked, emptied, fsuid)
        })
        .join()
        .unwrap();
        let why = looked.expect_err("read on with root's rights").to_string();
        assert!(why.contains("cannot read files as uid 65534"), "{why}");
        let why = emptied.expect_err("emptied with root's rights").to_string();
        assert!(why.contains("lacks CAP_SETUID"), "{why}");
        assert_eq!(fsuid, 0, "the thread is root again");
    }

    /// From an aligned start (written from where it is) and from a
    /// misaligned one (copied through the bounce buffer) alike.
    #[test]
    fn direct_writes_keep_every_byte_whatever_the_size() {
        let dir = tempfile::tempdir().unwrap();
        let sizes = [0usize, 1, 4095, 4096, 4097, (4 << 20) + 17, 9 << 20];
        for (k, len) in sizes.into_iter().enumerate() {
            let mut buf = vec![0u8; len + 2 * DIRECT_ALIGN];
            let aligned = buf.as_ptr().align_offset(DIRECT_ALIGN);
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i * 7 + k) as u8;
            }
            for (m, start) in [aligned, aligned + 1].into_iter().enumerate() {
                let data = &buf[start..start + len];
                let path = dir.path().join("sub").join(format!("f{k}-{m}"));
                write_atomic_direct(&path, data).unwrap();
                assert_eq!(
                    std::fs::read(&path).unwrap(),
                    data,
                    "{len} bytes, start {m}"
                );
            }
        }
        let left: Vec<_> = std::fs::read_dir(dir.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().contains("tmp"))
            .collect();
        assert!(left.is_empty(), "no temporary file left: {left:?}");
    }
}
