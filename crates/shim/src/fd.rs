//! The program's descriptor calls, with uzswap's own descriptors out of their reach
//! (the runtime's fds.rs places them at the top of the limit and keeps them): close,
//! close_range, closefrom, dup2 and dup3 treat them as not open, and answer EBADF
//! where one is named, as the kernel answers for a descriptor the program does not
//! have. A range closes everything else in it. fcntl(F_DUPFD) needs nothing: it takes
//! a free number and replaces none. Raw system calls still reach them; the runtime
//! then restores them from its keeper (fds.rs).

use crate::{inside, real};
use std::ffi::{c_int, c_uint};
use uzswap_runtime::fds;

fn hidden(fd: c_int) -> bool {
    fd >= 0 && !inside() && fds::is_ours(fd)
}

fn ebadf() -> c_int {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::EBADF };
    -1
}

/// # Safety
/// The C close contract.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if hidden(fd) {
        return ebadf();
    }
    real::close()(fd)
}

/// close_range(2) of everything in `[first, last]` but ours. Called by raw system call:
/// glibc before 2.34 has no wrapper to forward to.
///
/// # Safety
/// The C close_range contract.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    let sys = |a: c_uint, b: c_uint| libc::syscall(libc::SYS_close_range, a, b, flags) as c_int;
    if inside() || first > last {
        return sys(first, last);
    }
    let mut ours = [0; fds::SLOTS];
    let n = fds::ours(&mut ours);
    let mut from = first as u64;
    for &fd in &ours[..n] {
        let fd = fd as u64;
        if fd < from || fd > last as u64 {
            continue;
        }
        if fd > from && sys(from as c_uint, (fd - 1) as c_uint) != 0 {
            return -1;
        }
        from = fd + 1;
    }
    if from <= last as u64 {
        return sys(from as c_uint, last);
    }
    0
}

/// # Safety
/// The C closefrom contract.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    close_range(low.max(0) as c_uint, c_uint::MAX, 0);
}

/// # Safety
/// The C dup2 contract.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if hidden(old) || hidden(new) {
        return ebadf();
    }
    real::dup2()(old, new)
}

/// # Safety
/// The C dup3 contract.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if hidden(old) || hidden(new) {
        return ebadf();
    }
    real::dup3()(old, new, flags)
}
