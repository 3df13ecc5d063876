//! A job opens only the GPUs it leased.
//!
//! `CUDA_VISIBLE_DEVICES` only names a job's GPUs: a job that unsets it
//! runs on another user's card, and the out-of-memory that kills both is
//! the lab's oldest pain. So, as Slurm's `ConstrainDevices` does, the
//! kernel refuses a job's opening of a GPU it did not lease: every GPU of
//! the node is a character device of one major (NVIDIA's 195), the card's
//! minor its number; the minors from 254 up are the driver's control
//! devices (`nvidiactl`, `nvidia-modeset`), which every CUDA program
//! needs, and other majors (`nvidia-uvm`, `/dev/null`) are no card. A job
//! is denied every minor below 254 of that major except its leased cards',
//! whether or not the card is known yet, so a card labd has not read is
//! denied too.
//!
//! Where the jobs' cgroup is v2, a device program (`BPF_PROG_TYPE_CGROUP_DEVICE`)
//! attached to it says so; where it is not, the v1 `devices` controller's
//! `devices.deny`. Where neither can be had (labd not root, a kernel
//! without them), labd says so at its start and `labrun status` says
//! the jobs are not confined.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// The first minor of the driver's control devices (`nvidia-modeset` is
/// 254, `nvidiactl` 255): never a card.
pub const FIRST_CONTROL_MINOR: u32 = 254;

/// The character devices of a node's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevices {
    /// The GPUs' major (NVIDIA's is 195).
    pub major: u32,
    /// Each GPU's minor, by its index.
    pub minors: BTreeMap<u32, u32>,
}

impl GpuDevices {
    /// The minors of the GPUs `leased` (by index) that a job may open;
    /// an index with no known minor gives none.
    pub fn allowed(&self, leased: &[u32]) -> Vec<u32> {
        leased
            .iter()
            .filter_map(|i| self.minors.get(i).copied())
            .collect()
    }

    /// The device numbers of a character device node, from its `rdev`.
    pub fn of_node(path: &Path) -> Result<(u32, u32), crate::SetupError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let said = crate::SetupError::Devices;
        let m = std::fs::metadata(path).map_err(|e| said(format!("{}: {e}", path.display())))?;
        if !m.file_type().is_char_device() {
            return Err(said(format!("{} is no character device", path.display())));
        }
        let rdev = m.rdev();
        Ok((libc::major(rdev), libc::minor(rdev)))
    }
}

/// One BPF instruction (`struct bpf_insn`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Insn {
    code: u8,
    /// `dst_reg` in the low four bits, `src_reg` in the high four.
    regs: u8,
    off: i16,
    imm: i32,
}

const BPF_LDX_MEM_W: u8 = 0x61;
const BPF_ALU64_AND_K: u8 = 0x57;
const BPF_ALU64_MOV_K: u8 = 0xb7;
const BPF_JMP_JEQ_K: u8 = 0x15;
const BPF_JMP_JNE_K: u8 = 0x55;
const BPF_JMP_JGE_K: u8 = 0x35;
const BPF_EXIT: u8 = 0x95;
/// `BPF_DEVCG_DEV_CHAR`, in the low 16 bits of `access_type`.
const DEV_CHAR: i32 = 2;

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// The device program: 1 (allow) for every access but one to a character
/// device of `major` with a minor below [`FIRST_CONTROL_MINOR`] that is not
/// in `allowed`, 0 (EPERM) for that. Its context is `struct
/// bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`.
fn program(major: u32, allowed: &[u32]) -> Vec<Insn> {
    let n = allowed.len();
    // Jumps count instructions after the next one: `to_allow(at)` is the
    // offset from instruction `at` to the last two (allow).
    let total = 7 + n + 4;
    let to_allow = |at: usize| (total - 2 - (at + 1)) as i16;
    let mut p = vec![
        insn(BPF_LDX_MEM_W, 2, 1, 0, 0),
        insn(BPF_ALU64_AND_K, 2, 0, 0, 0xffff),
        insn(BPF_LDX_MEM_W, 3, 1, 4, 0),
        insn(BPF_LDX_MEM_W, 4, 1, 8, 0),
        insn(BPF_JMP_JNE_K, 2, 0, to_allow(4), DEV_CHAR),
        insn(BPF_JMP_JNE_K, 3, 0, to_allow(5), major as i32),
        insn(BPF_JMP_JGE_K, 4, 0, to_allow(6), FIRST_CONTROL_MINOR as i32),
    ];
    for (i, &minor) in allowed.iter().enumerate() {
        p.push(insn(BPF_JMP_JEQ_K, 4, 0, to_allow(7 + i), minor as i32));
    }
    p.extend([
        insn(BPF_ALU64_MOV_K, 0, 0, 0, 0),
        insn(BPF_EXIT, 0, 0, 0, 0),
        insn(BPF_ALU64_MOV_K, 0, 0, 0, 1),
        insn(BPF_EXIT, 0, 0, 0, 0),
    ]);
    debug_assert_eq!(p.len(), total);
    p
}

/// `union bpf_attr` for `BPF_PROG_LOAD`, as far as it is used.
#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for `BPF_PROG_ATTACH`.
#[repr(C)]
struct ProgAttach {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;

#[allow(unsafe_code)]
fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `repr(C)` prefix of `union
    // bpf_attr` for `cmd`, and its size is passed with it: the kernel
    // reads that many bytes and treats the rest of the union as zero.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(attr),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Loads the device program allowing `allowed` of `major`'s cards; the
/// verifier's log is in the error when it refuses it.
#[allow(unsafe_code)]
fn load(major: u32, allowed: &[u32]) -> std::io::Result<OwnedFd> {
    let insns = program(major, allowed);
    let license = c"Apache-2.0";
    let mut log = vec![0u8; 4096];
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"labsync_dev");
    let attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        prog_ifindex: 0,
        expected_attach_type: BPF_CGROUP_DEVICE,
    };
    match bpf(BPF_PROG_LOAD, &attr) {
        // SAFETY: on success the kernel returns a new descriptor, ours alone.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        Err(e) => {
            let said = String::from_utf8_lossy(&log);
            let said = said.trim_end_matches('\0').trim();
            if said.is_empty() {
                Err(e)
            } else {
                Err(std::io::Error::new(e.kind(), format!("{e}: {said}")))
            }
        }
    }
}

/// Confines the processes of the v2 cgroup `dir` (and its children) to
/// `allowed` of `major`'s cards: the program stays attached until the
/// cgroup is removed.
pub(crate) fn attach(dir: &Path, major: u32, allowed: &[u32]) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let prog = load(major, allowed)?;
    let cgroup = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let attr = ProgAttach {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
        replace_bpf_fd: 0,
    };
    bpf(BPF_PROG_ATTACH, &attr).map(drop)
}

/// The v1 `devices.deny` lines keeping a job from every card of `major`
/// but `allowed`.
pub(crate) fn v1_deny(major: u32, allowed: &[u32]) -> Vec<String> {
    (0..FIRST_CONTROL_MINOR)
        .filter(|m| !allowed.contains(m))
        .map(|m| format!("c {major}:{m} rwm"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The program, run by hand the way the kernel runs it: one access at
    /// a time, every jump where it says.
    fn run(p: &[Insn], access_type: u32, major: u32, minor: u32) -> u64 {
        let ctx = [access_type, major, minor];
        let mut r = [0u64; 11];
        let mut pc = 0usize;
        loop {
            let i = p[pc];
            let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
            let imm = i64::from(i.imm) as u64;
            let jump = |taken: bool| if taken { i.off as isize } else { 0 };
            let mut next = pc as isize + 1;
            match i.code {
                BPF_LDX_MEM_W => {
                    assert_eq!(src, 1);
                    r[dst] = u64::from(ctx[i.off as usize / 4]);
                }
                BPF_ALU64_AND_K => r[dst] &= imm,
                BPF_ALU64_MOV_K => r[dst] = imm,
                BPF_JMP_JEQ_K => next += jump(r[dst] == imm),
                BPF_JMP_JNE_K => next += jump(r[dst] != imm),
                BPF_JMP_JGE_K => next += jump(r[dst] >= imm),
                BPF_EXIT => return r[0],
                c => panic!("unknown code {c:#x}"),
            }
            pc = usize::try_from(next).unwrap();
        }
    }

    /// Leased cards, control devices, other majors and block devices are
    /// allowed; every other card of the major is not.
    #[test]
    fn the_program_denies_only_cards_not_leased() {
        let read = 2 << 16;
        for allowed in [vec![], vec![1], vec![0, 3]] {
            let p = program(195, &allowed);
            for minor in 0..260 {
                let want = u64::from(minor >= FIRST_CONTROL_MINOR || allowed.contains(&minor));
                assert_eq!(run(&p, read | 2, 195, minor), want, "{allowed:?} {minor}");
            }
            assert_eq!(run(&p, read | 2, 1, 3), 1, "/dev/null");
            assert_eq!(run(&p, read | 2, 507, 0), 1, "nvidia-uvm");
            assert_eq!(run(&p, read | 1, 195, 2), 1, "a block device");
        }
        assert_eq!(v1_deny(195, &[1]).len(), 253);
        assert!(!v1_deny(195, &[1]).contains(&"c 195:1 rwm".to_string()));
    }
}
