//! The few userfaultfd calls the runtime needs, as raw ioctls with `#[repr(C)]`
//! structs (include/uapi/linux/userfaultfd.h). The `userfaultfd` crate lacks MOVE and
//! the newer features, and `linux-raw-sys` lacks some request numbers, so the numbers
//! are encoded here by hand.
//!
//! Every call here is async-signal-safe: one syscall, no allocation, no lock. That is
//! what lets the SIGBUS fault path use them from inside a signal handler.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const UFFDIO: u64 = 0xAA;
pub const UFFD_API: u64 = 0xAA;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (UFFDIO << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioc(IOC_READ | IOC_WRITE, 0x00, size_of::<UffdioRegister>());
const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0x01, size_of::<UffdioRange>());
const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, 0x03, size_of::<UffdioCopy>());
const UFFDIO_MOVE: u64 = ioc(IOC_READ | IOC_WRITE, 0x05, size_of::<UffdioMove>());
const UFFDIO_WRITEPROTECT: u64 = ioc(IOC_READ | IOC_WRITE, 0x06, size_of::<UffdioWriteprotect>());
const UFFDIO_POISON: u64 = ioc(IOC_READ | IOC_WRITE, 0x08, size_of::<UffdioPoison>());
/// _IO(0xAA, 0x00) on /dev/userfaultfd.
const USERFAULTFD_IOC_NEW: u64 = UFFDIO << 8;

pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
pub const FEATURE_SIGBUS: u64 = 1 << 7;
pub const FEATURE_MOVE: u64 = 1 << 16;

pub const REGISTER_MODE_MISSING: u64 = 1;
pub const REGISTER_MODE_WP: u64 = 2;

const COPY_MODE_DONTWAKE: u64 = 1;
const COPY_MODE_WP: u64 = 2;
const WRITEPROTECT_MODE_WP: u64 = 1;
const WRITEPROTECT_MODE_DONTWAKE: u64 = 2;
const MOVE_MODE_DONTWAKE: u64 = 1;
const POISON_MODE_DONTWAKE: u64 = 1;
const MOVE_MODE_ALLOW_SRC_HOLES: u64 = 2;

pub const EVENT_PAGEFAULT: u8 = 0x12;
pub const EVENT_REMAP: u8 = 0x14;
pub const EVENT_REMOVE: u8 = 0x15;
pub const EVENT_UNMAP: u8 = 0x16;

/// `uffd_msg.arg[0]` of a page fault: the access was a write.
pub const PAGEFAULT_FLAG_WRITE: u64 = 1;

#[repr(C)]
#[derive(Default)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}

/// struct uffd_msg: 32 bytes; `arg` is a union whose first three u64 hold
/// pagefault {flags, address, ptid}, remap {from, to, len} or remove {start, end}.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UffdMsg {
    pub event: u8,
    _reserved1: u8,
    _reserved2: u16,
    _reserved3: u32,
    pub arg: [u64; 3],
}

/// Result of an ioctl that may have done part of its work.
#[derive(Debug, PartialEq, Eq)]
pub enum Partial {
    Done,
    /// The errno and how many bytes were done before it.
    Failed { errno: i32, done: usize },
}

/// Why an ioctl on a range did not finish, once [`retry`] has retried what it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoctlError {
    /// EAGAIN: a change of the mapping is pending (an event not yet read), and the
    /// caller may not wait for the reader to read it.
    Again,
    /// ENOENT or ESRCH: the range, or the whole address space, is gone (a munmap or
    /// an exit raced with us): there is nothing left to act on.
    Gone,
    /// Any other errno: not a state userfaultfd documents for this use. Callers
    /// treat it as an error (see `fault::lose` and `fault::unexpected`), never as success.
    Unexpected(i32),
}

/// What EEXIST means to the caller of [`retry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exist {
    /// The page is already there, as wanted (a fill of missing pages, a poison):
    /// skip it.
    Skip,
    /// A page where none may be: an error.
    Error,
}

/// The one loop for userfaultfd ioctls that make partial progress (COPY, MOVE,
/// POISON, WRITEPROTECT): `op(offset, n)` acts on `[offset, offset + n)` of the range;
/// bytes done before a failure are skipped, EEXIST skips one page or fails as `exist`
/// says, EAGAIN is retried (yielding the CPU: the reader, which clears it, may need
/// ours) while `wait`, else returned; at most `max_again` times when given. ENOENT on
/// a stretch of pages (it spans mappings, e.g. a part the program unmapped or
/// mprotected: the ioctls want one mapping) goes on a page at a time, skipping pages
/// with no mapping of ours. Async-signal-safe.
pub fn retry(len: usize, wait: bool, exist: Exist, max_again: Option<u32>, mut op: impl FnMut(usize, usize) -> Partial) -> Result<(), IoctlError> {
    const PAGE: usize = 4096;
    let mut off = 0;
    let mut again = 0u32;
    let mut by_page = false;
    while off < len {
        let n = if by_page { PAGE.min(len - off) } else { len - off };
        match op(off, n) {
            Partial::Done if by_page => off += n,
            Partial::Done => return Ok(()),
            Partial::Failed { done, .. } if done > 0 => off += done,
            Partial::Failed { errno: libc::EEXIST, .. } if exist == Exist::Skip => off += PAGE,
            Partial::Failed { errno: libc::EAGAIN, .. } if wait && max_again.is_none_or(|m| again < m) => {
                again += 1;
                // SAFETY: sched_yield takes no arguments and is async-signal-safe.
                unsafe { libc::sched_yield() };
            }
            Partial::Failed { errno: libc::ENOENT, .. } if n > PAGE => by_page = true,
            Partial::Failed { errno: libc::ENOENT, .. } if by_page => off += PAGE,
            Partial::Failed { errno, .. } => return Err(classify(errno)),
        }
    }
    Ok(())
}

/// The errno of a range ioctl, classified (see [`IoctlError`]).
pub fn classify(errno: i32) -> IoctlError {
    match errno {
        libc::EAGAIN => IoctlError::Again,
        libc::ENOENT | libc::ESRCH => IoctlError::Gone,
        e => IoctlError::Unexpected(e),
    }
}

/// One userfaultfd context, on a descriptor placed out of the program's way (fds.rs).
pub struct Uffd {
    fd: OwnedFd,
    /// Fault injection for tests ([`Uffd::inject_again`]): fills and moves of more than
    /// a page still to be cut short.
    cut: std::sync::atomic::AtomicU32,
    /// A cut one did half its range: the next COPY or MOVE fails with EAGAIN.
    cut_pending: std::sync::atomic::AtomicBool,
}

impl From<OwnedFd> for Uffd {
    fn from(fd: OwnedFd) -> Uffd {
        Uffd { fd, cut: Default::default(), cut_pending: Default::default() }
    }
}

impl Drop for Uffd {
    fn drop(&mut self) {
        crate::fds::unregister(self.fd.as_raw_fd());
    }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// userfaultfd(2)'s flag for a context that handles faults taken in user mode only.
const USER_MODE_ONLY: i32 = 1;

/// How this process may use userfaultfd, best first. Every user has the last; with it
/// the kernel's own accesses to a missing page (a system call's copy to or from a
/// buffer) fail with EFAULT instead of waiting for the page, as on the SIGBUS path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// /dev/userfaultfd (root's, or a group's: see the README).
    Device,
    /// The system call, allowed to everyone by vm.unprivileged_userfaultfd=1.
    Sysctl,
    /// The system call, allowed by CAP_SYS_PTRACE (root has it).
    Capability,
    /// The system call with UFFD_USER_MODE_ONLY.
    UserModeOnly,
}

impl Access {
    /// Whether the kernel waits for faults its own accesses take (system calls).
    pub fn serves_kernel_faults(self) -> bool {
        self != Access::UserModeOnly
    }

    pub fn describe(self) -> &'static str {
        match self {
            Access::Device => "/dev/userfaultfd",
            Access::Sysctl => "vm.unprivileged_userfaultfd=1",
            Access::Capability => "CAP_SYS_PTRACE",
            Access::UserModeOnly => "UFFD_USER_MODE_ONLY (user-mode faults only: system calls on swapped-out memory are helped by the shim)",
        }
    }
}

fn unprivileged_sysctl() -> bool {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").is_ok_and(|v| v.trim() == "1")
}

impl Uffd {
    /// Opens a context with the best access this process has ([`Access`]: the device,
    /// then the system call, then the system call for user-mode faults only) and
    /// negotiates `features`. The error says what is missing.
    pub fn open(features: u64) -> Result<(Uffd, Access), String> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let mut fd = -1;
        let mut access = Access::Device;
        // SAFETY: open gets a NUL-terminated literal; USERFAULTFD_IOC_NEW and the syscall
        // take their flags by value; `dev` is ours and closed once. No memory of ours is
        // written.
        unsafe {
            let dev = libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if dev >= 0 {
                fd = libc::ioctl(dev, USERFAULTFD_IOC_NEW as _, flags);
                libc::close(dev);
            }
            if fd < 0 {
                fd = libc::syscall(libc::SYS_userfaultfd, flags) as i32;
                access = if unprivileged_sysctl() { Access::Sysctl } else { Access::Capability };
            }
            if fd < 0 && last_errno() == libc::EPERM {
                fd = libc::syscall(libc::SYS_userfaultfd, flags | USER_MODE_ONLY) as i32;
                access = Access::UserModeOnly;
            }
        }
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(format!(
                "userfaultfd is unavailable ({e}): needs Linux >= 6.8 and no seccomp filter blocking it"
            ));
        }
        // SAFETY: fd >= 0 was just returned by the ioctl or syscall above and nothing
        // else has it: the OwnedFd is its only owner.
        let uffd = Uffd::from(crate::fds::place(unsafe { OwnedFd::from_raw_fd(fd) }));
        let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
        if uffd.ioctl(UFFDIO_API, &mut api) < 0 {
            let e = io::Error::last_os_error();
            // Ask for nothing to learn what the kernel offers, for the message.
            let offered = Uffd::offered_features().unwrap_or(0);
            return Err(format!(
                "UFFDIO_API refused features {features:#x} ({e}); this kernel offers {offered:#x}, \
                 missing {:#x} (bits: 2 EVENT_REMAP, 3 EVENT_REMOVE, 6 EVENT_UNMAP, 7 SIGBUS, 16 MOVE (6.8))",
                features & !offered
            ));
        }
        Ok((uffd, access))
    }

    fn offered_features() -> Option<u64> {
        // SAFETY: the syscall takes its flags by value and touches no memory.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) } as i32;
        if fd < 0 {
            return None;
        }
        // SAFETY: fd >= 0 was just returned by the syscall; the OwnedFd is its only owner.
        let uffd = Uffd::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut api = UffdioApi { api: UFFD_API, features: 0, ioctls: 0 };
        (uffd.ioctl(UFFDIO_API, &mut api) == 0).then_some(api.features)
    }

    /// Issues a userfaultfd request with its argument struct. The kernel reads and
    /// writes only `arg` (the size its request number encodes: each UFFDIO_* constant
    /// is built from its struct's size, checked in debug builds) and the
    /// ranges named in it, which it checks against this context's registrations.
    fn ioctl<T>(&self, req: u64, arg: &mut T) -> i32 {
        debug_assert_eq!((req >> 16) & 0x3fff, size_of::<T>() as u64, "ioctl argument of the wrong size");
        let fd = self.fd.as_raw_fd();
        // SAFETY: `arg` is a live, exclusive, #[repr(C)] struct of plain integers (valid
        // for any bytes the kernel writes) of exactly the size `req` encodes.
        let call = |arg: &mut T| unsafe { libc::ioctl(fd, req as _, arg as *mut T) };
        let rc = call(arg);
        if rc < 0 && crate::fds::was_ebadf() {
            // The program closed it behind the shim: back from the keeper, or stop.
            crate::fds::restore_or_stop();
            return call(arg);
        }
        rc
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut r = UffdioRegister { range: UffdioRange { start: start as u64, len: len as u64 }, mode, ioctls: 0 };
        if self.ioctl(UFFDIO_REGISTER, &mut r) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange { start: start as u64, len: len as u64 };
        if self.ioctl(UFFDIO_UNREGISTER, &mut r) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn wake(&self, start: usize, len: usize) -> Result<(), i32> {
        let mut r = UffdioRange { start: start as u64, len: len as u64 };
        if self.ioctl(UFFDIO_WAKE, &mut r) < 0 {
            // SAFETY: errno of this thread, just set by the ioctl.
            return Err(unsafe { *libc::__errno_location() });
        }
        Ok(())
    }

    /// UFFDIO_COPY `len` bytes from `src` to the missing range at `dst`. Does not wake
    /// the faulting threads: the caller wakes them once its bookkeeping is done.
    /// With `write_protect` the pages go in write-protected: the first write to each
    /// faults (the range must be registered with REGISTER_MODE_WP).
    pub fn copy(&self, dst: usize, src: *const u8, len: usize, write_protect: bool) -> Partial {
        self.cut_short(len, |n| self.copy_raw(dst, src, n, write_protect))
    }

    fn copy_raw(&self, dst: usize, src: *const u8, len: usize, write_protect: bool) -> Partial {
        let mode = COPY_MODE_DONTWAKE | if write_protect { COPY_MODE_WP } else { 0 };
        let mut c = UffdioCopy { dst: dst as u64, src: src as u64, len: len as u64, mode, copy: 0 };
        if self.ioctl(UFFDIO_COPY, &mut c) < 0 {
            let errno = last_errno();
            return Partial::Failed { errno, done: c.copy.max(0) as usize };
        }
        Partial::Done
    }

    /// UFFDIO_MOVE the pages of `[src, src+len)` to `dst` (which must be registered with this
    /// context); holes in the source stay holes. Does not wake (see `copy`).
    pub fn move_pages(&self, dst: usize, src: usize, len: usize) -> Partial {
        self.cut_short(len, |n| self.move_raw(dst, src, n))
    }

    fn move_raw(&self, dst: usize, src: usize, len: usize) -> Partial {
        let mut m = UffdioMove {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: MOVE_MODE_ALLOW_SRC_HOLES | MOVE_MODE_DONTWAKE,
            moved: 0,
        };
        if self.ioctl(UFFDIO_MOVE, &mut m) < 0 {
            let errno = last_errno();
            return Partial::Failed { errno, done: m.moved.max(0) as usize };
        }
        Partial::Done
    }

    /// Test hook (fault injection): the next `n` COPY or MOVE ioctls of more than a
    /// page stop half-way as if an event had been queued there: they do the first
    /// half, report EAGAIN, and the next call fails with EAGAIN too, as a fill meets
    /// a drop another thread queued while it ran.
    pub fn inject_again(&self, n: u32) {
        self.cut.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// `op` over `len` bytes, or over its first half and cut short there when the
    /// test hook says so (see `inject_again`).
    fn cut_short(&self, len: usize, op: impl Fn(usize) -> Partial) -> Partial {
        use std::sync::atomic::Ordering::{Relaxed, SeqCst};
        // Loads first: off tests, the hook costs no shared write per ioctl.
        if self.cut_pending.load(Relaxed) && self.cut_pending.swap(false, SeqCst) {
            return Partial::Failed { errno: libc::EAGAIN, done: 0 };
        }
        if len <= 4096 || self.cut.load(Relaxed) == 0 || self.cut.fetch_update(SeqCst, SeqCst, |c| c.checked_sub(1)).is_err() {
            return op(len);
        }
        let half = (len / 2) & !4095;
        match op(half) {
            Partial::Done => {
                self.cut_pending.store(true, SeqCst);
                Partial::Failed { errno: libc::EAGAIN, done: half }
            }
            failed => failed,
        }
    }

    /// Write-protects (`protect`) or unprotects the present pages of a range registered
    /// with REGISTER_MODE_WP. Unprotecting does not wake (see `copy`); protecting wakes
    /// nobody anyway, and the kernel refuses DONTWAKE with it (EINVAL). Returns the
    /// errno on failure (EAGAIN while a mapping change is pending).
    pub fn write_protect(&self, start: usize, len: usize, protect: bool) -> Result<(), i32> {
        let mode = if protect { WRITEPROTECT_MODE_WP } else { WRITEPROTECT_MODE_DONTWAKE };
        let mut w = UffdioWriteprotect { range: UffdioRange { start: start as u64, len: len as u64 }, mode };
        if self.ioctl(UFFDIO_WRITEPROTECT, &mut w) < 0 {
            return Err(last_errno());
        }
        Ok(())
    }

    /// UFFDIO_POISON (Linux 6.6): marks the missing pages of a range poisoned, as the
    /// kernel marks memory with a hardware error: any access raises SIGBUS
    /// (BUS_MCEERR_AR) until the pages are dropped (MADV_DONTNEED, munmap). Does not
    /// wake (see `copy`). Present pages are skipped.
    pub fn poison(&self, start: usize, len: usize) -> Partial {
        let mut p = UffdioPoison { range: UffdioRange { start: start as u64, len: len as u64 }, mode: POISON_MODE_DONTWAKE, updated: 0 };
        if self.ioctl(UFFDIO_POISON, &mut p) < 0 {
            let errno = last_errno();
            return Partial::Failed { errno, done: p.updated.max(0) as usize };
        }
        Partial::Done
    }

    /// Reads pending messages without blocking; returns how many were read.
    pub fn read_msgs(&self, out: &mut [UffdMsg]) -> io::Result<usize> {
        // SAFETY: the kernel writes at most size_of_val(out) bytes into `out`, a live
        // exclusive buffer of #[repr(C)] messages made of integers, valid for any bytes.
        let mut read = || unsafe { libc::read(self.fd.as_raw_fd(), out.as_mut_ptr().cast(), std::mem::size_of_val(out)) };
        let mut n = read();
        if n < 0 && crate::fds::was_ebadf() {
            crate::fds::restore_or_stop();
            n = read();
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EAGAIN) {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(n as usize / size_of::<UffdMsg>())
    }
}

const _: () = assert!(size_of::<UffdMsg>() == 32);
const _: () = assert!(UFFDIO_COPY == 0xc028_aa03);
const _: () = assert!(UFFDIO_REGISTER == 0xc020_aa00);
const _: () = assert!(UFFDIO_API == 0xc018_aa3f);
const _: () = assert!(UFFDIO_MOVE == 0xc028_aa05);
const _: () = assert!(UFFDIO_WRITEPROTECT == 0xc018_aa06);
const _: () = assert!(UFFDIO_POISON == 0xc020_aa08);
