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

// ---- Listings of the program's own descriptors. ----
//
// A program that lists /proc/self/fd (os.listdir, ls, a close loop) must not see
// uzswap's descriptors: readdir skips them in a directory stream opened on this
// process's fd directory (/proc/self/fd, /dev/fd, /proc/<pid>/fd, a task's fd).
// glibc's own scandir and raw getdents64 are not covered.

use std::sync::atomic::{AtomicUsize, Ordering::*};

/// Open directory streams on our own fd directory (DIR pointers; 0 = free).
static FD_DIRS: [AtomicUsize; 16] = [const { AtomicUsize::new(0) }; 16];

/// Whether `d` lists this process's descriptors.
fn lists_our_fds(d: *mut libc::DIR) -> bool {
    let _inside = crate::Inside::enter();
    // SAFETY: `d` is a stream libc just opened.
    let fd = unsafe { libc::dirfd(d) };
    let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else { return false };
    let pid = std::process::id().to_string();
    let parts: Vec<_> = target.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    // /proc/<pid>/fd or /proc/<pid>/task/<tid>/fd
    matches!(parts.iter().map(|s| s.as_str()).collect::<Vec<_>>()[..], ["/", "proc", p, "fd"] | ["/", "proc", p, "task", _, "fd"] if p == pid)
}

fn note(d: *mut libc::DIR) -> *mut libc::DIR {
    if !d.is_null() && !inside() && fds::ours(&mut [0; fds::SLOTS]) > 0 && lists_our_fds(d) {
        for s in &FD_DIRS {
            if s.compare_exchange(0, d as usize, AcqRel, Relaxed).is_ok() {
                break;
            }
        }
    }
    d
}

fn is_fd_dir(d: *mut libc::DIR) -> bool {
    !d.is_null() && FD_DIRS.iter().any(|s| s.load(Relaxed) == d as usize)
}

/// # Safety
/// The C opendir contract.
#[no_mangle]
pub unsafe extern "C" fn opendir(name: *const std::ffi::c_char) -> *mut libc::DIR {
    note(real::opendir()(name))
}

/// # Safety
/// The C fdopendir contract.
#[no_mangle]
pub unsafe extern "C" fn fdopendir(fd: c_int) -> *mut libc::DIR {
    note(real::fdopendir()(fd))
}

/// # Safety
/// The C closedir contract.
#[no_mangle]
pub unsafe extern "C" fn closedir(d: *mut libc::DIR) -> c_int {
    for s in &FD_DIRS {
        let _ = s.compare_exchange(d as usize, 0, AcqRel, Relaxed);
    }
    real::closedir()(d)
}

/// Whether a directory entry names one of uzswap's descriptors.
///
/// # Safety
/// `e` is an entry readdir returned (NUL-terminated name).
unsafe fn names_ours(e: *const libc::dirent64) -> bool {
    let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr());
    name.to_str().ok().and_then(|n| n.parse::<c_int>().ok()).is_some_and(fds::is_ours)
}

/// # Safety
/// The C readdir contract.
#[no_mangle]
pub unsafe extern "C" fn readdir64(d: *mut libc::DIR) -> *mut libc::dirent64 {
    loop {
        let e = real::readdir64()(d);
        if e.is_null() || inside() || !is_fd_dir(d) || !names_ours(e) {
            return e;
        }
    }
}

/// # Safety
/// The C readdir contract (on 64-bit glibc, readdir and readdir64 are one function).
#[no_mangle]
pub unsafe extern "C" fn readdir(d: *mut libc::DIR) -> *mut libc::dirent64 {
    readdir64(d)
}
