//! Buffers for answers as large as packs: reused once a pack has left
//! memory, backed by huge pages where they pay, kept out of the children
//! labd forks to start jobs.

/// Answers from this size on (packs) get a buffer of their own, reused
/// by the next fetch once the pack has left memory
/// ([`labsync_store::reuse`]).
const BIG: usize = 4 << 20;

/// A buffer for an answer of `n` bytes: from [`BIG`] on, one whose pack
/// has left memory when there is one (its pages are faulted already),
/// else a new [`big_buffer`]. Handed out again as
/// [`labsync_store::reuse::recycled`] bytes.
pub(crate) fn answer_buffer(n: usize) -> (Vec<u8>, usize) {
    if n >= BIG {
        if let Some(kept) = labsync_store::reuse::reused(n) {
            return kept;
        }
    }
    big_buffer(n)
}

/// An empty buffer with room for `n` bytes, and where its contents are to
/// start. From 4 MiB on (packs), the kernel is asked to back it with huge
/// pages (one fault per 2 MiB, not per 4 KiB) unless [`huge_pages_pay`]
/// says they cost more here, and the contents start at a 4 KiB boundary,
/// so the node cache writes them to the disk with `O_DIRECT` from where
/// they are, without a copy.
///
/// Such a buffer is also left out of the children labd forks to start
/// jobs (`MADV_DONTFORK`; they only exec): with the packs of a pull held
/// for the cache (up to a gigabyte), each job's fork copied their page
/// tables (20 ms per GiB of 4 KiB pages here), and every page written to
/// the cache after faulted once more. In the follow benchmark, 12 pairs
/// each: the fetching node's CPU to the first line 2.33 → 1.95 s, the
/// peer run 1.15 → 1.10× rsync's time (paired medians).
///
/// A large buffer is at least 32 MiB and a page, rounded up to a power of
/// two (64 MiB for the usual pack, so a buffer kept for reuse fits the
/// next pack, [`answer_buffer`]): glibc maps any allocation above 32 MiB
/// on its own and unmaps it when freed, so the advice ends with the
/// buffer, never reaching memory the allocator hands out later (smaller
/// buffers may come from its reused heap). The pages beyond the largest
/// answer a buffer held are never touched, so they cost address space
/// only.
pub(crate) fn big_buffer(n: usize) -> (Vec<u8>, usize) {
    const ALIGN: usize = 4096;
    const OWN_MAPPING: usize = (32 << 20) + ALIGN;
    if n < BIG {
        return (Vec::with_capacity(n), 0);
    }
    let mut buf = Vec::with_capacity((n + ALIGN).max(OWN_MAPPING).next_power_of_two());
    #[cfg(target_os = "linux")]
    {
        if huge_pages_pay() {
            advise(&buf, libc::MADV_HUGEPAGE);
        }
        advise(&buf, libc::MADV_DONTFORK);
    }
    let start = buf.as_ptr().align_offset(ALIGN).min(ALIGN);
    buf.resize(start, 0);
    (buf, start)
}

/// False on a virtual machine whose memory balloon has free page
/// reporting (virtio feature 5): there the guest hands freed memory back
/// to the hypervisor, and a huge page faulted into such memory cost 20×
/// more than into memory still held (2.2 s per GiB against 0.1, measured
/// on a Firecracker guest with `page_reporting_order=9`), where 4 KiB pages
/// cost 0.5 s per GiB either way. Packs land in such memory whenever the
/// node has been idle a few seconds: in the follow benchmark on that guest
/// the huge-page faults were a quarter of both CPUs' time, and gpu2's
/// fetch took 3.5 CPU seconds (median of 12) against 2.0 without them.
/// Read once from sysfs.
#[cfg(target_os = "linux")]
pub(crate) fn huge_pages_pay() -> bool {
    static PAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAY.get_or_init(|| {
        !balloon_reports_free_pages(std::path::Path::new("/sys/bus/virtio/devices"))
    })
}

/// Whether a virtio memory balloon (device id 5) under `devices` (a sysfs
/// `virtio/devices` folder) was given the free page reporting feature
/// (bit 5 of its `features`, one character per bit, lowest first).
#[cfg(target_os = "linux")]
fn balloon_reports_free_pages(devices: &std::path::Path) -> bool {
    const BALLOON: u32 = 5;
    const FREE_PAGE_REPORTING: usize = 5;
    let Ok(entries) = std::fs::read_dir(devices) else {
        return false;
    };
    entries.flatten().any(|e| {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).unwrap_or_default();
        let id = read("device");
        let balloon = u32::from_str_radix(id.trim().trim_start_matches("0x"), 16) == Ok(BALLOON);
        balloon && read("features").as_bytes().get(FREE_PAGE_REPORTING) == Some(&b'1')
    })
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn advise(buf: &Vec<u8>, advice: libc::c_int) {
    let page = 4096;
    let start = (buf.as_ptr() as usize).next_multiple_of(page);
    // Rounded down: madvise rounds a length up to whole pages.
    let end = (buf.as_ptr() as usize + buf.capacity()) / page * page;
    if end <= start {
        return;
    }
    // SAFETY: the whole pages in [start, end) lie inside `buf`'s
    // allocation, which outlives the call. MADV_HUGEPAGE changes only how
    // the kernel backs them; MADV_DONTFORK leaves them out of children,
    // which labd makes only to exec (std's `Command`, never a bare fork),
    // so no child reads them. Neither changes their contents or this
    // process's mapping; errors are ignored.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, advice);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn huge_pages_are_left_out_only_under_a_balloon_that_reports_free_pages() {
        let dir = tempfile::tempdir().unwrap();
        let devices = dir.path();
        let device = |name: &str, id: &str, features: &str| {
            let d = devices.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("device"), format!("{id}\n")).unwrap();
            std::fs::write(d.join("features"), format!("{features}\n")).unwrap();
        };
        assert!(!balloon_reports_free_pages(&devices.join("none")));
        // A block device with bit 5 set, and a balloon without it.
        device("virtio1", "0x0002", "011001");
        device("virtio0", "0x0005", "0110000000");
        assert!(!balloon_reports_free_pages(devices));
        // This machine's balloon: statistics, deflate on OOM, reporting.
        device("virtio0", "0x0005", "0110010000000000000000000000000010");
        assert!(balloon_reports_free_pages(devices));
    }
}
