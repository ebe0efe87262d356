//! The few system calls the pool needs: anonymous mappings for spans, large objects and
//! the handle table, and MADV_DONTNEED to hand back the tail of a compacted span.

use crate::PoolError;
use std::ptr::NonNull;
use std::sync::OnceLock;

/// The system page size, read once.
pub(crate) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            p as usize
        } else {
            4096
        }
    })
}

pub(crate) fn round_up_to_page(len: usize) -> usize {
    let p = page_size();
    len.div_ceil(p) * p
}

/// A fresh private anonymous mapping of `len` bytes (a multiple of the page size),
/// zero-filled. The kernel backs it lazily: only touched pages become memory.
pub(crate) fn map(len: usize) -> Result<NonNull<u8>, PoolError> {
    // SAFETY: anonymous private mapping, no address hint; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(PoolError::OutOfMemory);
    }
    // Pool accounting counts 4 KiB pages as they are touched; a transparent huge page
    // would make the process hold more than the pool says, so opt out (best effort).
    // SAFETY: the range was just mapped by us.
    unsafe { libc::madvise(ptr, len, libc::MADV_NOHUGEPAGE) };
    // A forked child has no use for its parent's compressed data (it starts a runtime
    // of its own, or none), and inherited, it would be charged the parent's whole pool.
    // SAFETY: as above.
    unsafe { libc::madvise(ptr, len, libc::MADV_DONTFORK) };
    NonNull::new(ptr.cast()).ok_or(PoolError::OutOfMemory)
}

/// # Safety
/// `ptr, len` must be exactly a mapping returned by [`map`], with no reference into it alive.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    let rc = libc::munmap(ptr.as_ptr().cast(), len);
    debug_assert_eq!(rc, 0, "munmap failed");
}

/// Give the pages of `[ptr, ptr + len)` back to the system; they read as zero afterwards.
///
/// # Safety
/// The range must be page-aligned, inside one of our mappings, and hold no live data.
pub(crate) unsafe fn discard(ptr: *mut u8, len: usize) {
    let rc = libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED);
    debug_assert_eq!(rc, 0, "madvise(MADV_DONTNEED) failed");
}
