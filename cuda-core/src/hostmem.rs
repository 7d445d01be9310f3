//! Host memory that large transfers land in.
//!
//! A transfer into freshly allocated host memory pays a page fault per
//! 4 KiB page the first time each page is written. In a virtual machine
//! that is most of the cost of filling fresh memory, several times the
//! cost with 2 MiB pages.
//! [`prefer_huge_pages`] asks the kernel to back a large buffer with
//! transparent huge pages, one fault per 2 MiB.

/// Buffers smaller than this are left alone (they may share pages with
/// other allocations, and their faults cost little).
pub const HUGE_PAGE_MIN_BYTES: usize = 8 << 20;

/// Asks the kernel to back `buf` with transparent huge pages (Linux
/// `madvise(MADV_HUGEPAGE)` on the 4 KiB pages wholly inside it) when it
/// is at least [`HUGE_PAGE_MIN_BYTES`] long. Call it on memory not yet
/// written, before the transfer fills it. Its contents do not change; on
/// other systems, when transparent huge pages are turned off, or when the
/// kernel refuses, nothing happens.
///
/// ```
/// let mut v = vec![0u8; 16 << 20];
/// cuda_core::hostmem::prefer_huge_pages(&v);
/// v[0] = 1; // faults in a 2 MiB page where the kernel has one
/// assert_eq!(v.iter().map(|&b| u64::from(b)).sum::<u64>(), 1);
/// ```
pub fn prefer_huge_pages<T>(buf: &[T]) {
    let len = std::mem::size_of_val(buf);
    if len < HUGE_PAGE_MIN_BYTES {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (buf.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (buf.as_ptr() as usize + len) & !(PAGE - 1);
        if end > start {
            // SAFETY: the range lies inside `buf`'s allocation, page
            // aligned; MADV_HUGEPAGE changes how the kernel backs the
            // pages, never their contents.
            let _ = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            };
        }
    }
}
