//! Unix accounts, through NSS (getpwnam_r), so LDAP users of a lab resolve
//! like local ones.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// A Unix account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnixUser {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home folder.
    pub home: PathBuf,
}

#[allow(unsafe_code)]
fn from_passwd(
    lookup: impl FnOnce(*mut libc::passwd, *mut libc::c_char, usize, *mut *mut libc::passwd) -> i32,
) -> Option<UnixUser> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero passwd is a valid value (null pointers, zero ids);
    // the lookup fills it with pointers into `buf`, which outlives every read.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    let rc = lookup(&mut pw, buf.as_mut_ptr(), buf.len(), &mut out);
    if rc != 0 || out.is_null() {
        return None;
    }
    // SAFETY: on success pw_name and pw_dir point at NUL-terminated strings in `buf`.
    let (name, home) = unsafe {
        (
            CStr::from_ptr(pw.pw_name).to_string_lossy().into_owned(),
            CStr::from_ptr(pw.pw_dir).to_string_lossy().into_owned(),
        )
    };
    Some(UnixUser {
        name,
        uid: pw.pw_uid,
        gid: pw.pw_gid,
        home: home.into(),
    })
}

/// The account called `name`, if this node knows it.
#[allow(unsafe_code)]
pub fn user_by_name(name: &str) -> Option<UnixUser> {
    let c = CString::new(name).ok()?;
    from_passwd(|pw, buf, len, out| {
        // SAFETY: every pointer is valid for the call; `len` is buf's length.
        unsafe { libc::getpwnam_r(c.as_ptr(), pw, buf, len, out) }
    })
}

/// The account of `uid`.
#[allow(unsafe_code)]
pub fn user_by_uid(uid: u32) -> Option<UnixUser> {
    from_passwd(|pw, buf, len, out| {
        // SAFETY: as above.
        unsafe { libc::getpwuid_r(uid, pw, buf, len, out) }
    })
}

/// The gid of the group called `name`, if this node knows it.
#[allow(unsafe_code)]
pub fn group_gid(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 64 * 1024];
    // SAFETY: an all-zero group is a valid value (null pointers, zero id);
    // getgrnam_r fills it with pointers into `buf`, read only for its gid.
    let mut gr: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; the length is buf's.
    let rc =
        unsafe { libc::getgrnam_r(c.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut out) };
    (rc == 0 && !out.is_null()).then_some(gr.gr_gid)
}

/// The groups of the user `name` whose primary group is `gid`: that one
/// and every supplementary group (getgrouplist); just `gid` where the
/// lookup fails.
#[allow(unsafe_code)]
pub fn groups_of(name: &str, gid: u32) -> Vec<u32> {
    let Ok(name) = CString::new(name) else {
        return vec![gid];
    };
    let mut n: libc::c_int = 64;
    loop {
        let mut buf = vec![0 as libc::gid_t; n as usize];
        let want = n;
        // SAFETY: `buf` holds `n` entries, and `n` says so.
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, buf.as_mut_ptr(), &mut n) };
        if rc >= 0 {
            buf.truncate(n as usize);
            return buf;
        }
        if n <= want {
            return vec![gid];
        }
    }
}

/// The effective uid of this process.
#[allow(unsafe_code)]
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The login name of this process's effective user (`uid N` if it has none).
pub fn current_user() -> String {
    let uid = euid();
    user_by_uid(uid).map_or_else(|| format!("uid {uid}"), |u| u.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_up_this_process_and_root() {
        let me = user_by_uid(euid()).expect("this process's account");
        assert_eq!(user_by_name(&me.name).unwrap().uid, me.uid);
        assert_eq!(user_by_name("root").unwrap().uid, 0);
        assert_eq!(user_by_name("no-such-user-labsync"), None);
    }
}
