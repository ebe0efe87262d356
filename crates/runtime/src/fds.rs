//! uzswap's own file descriptors, out of the program's way and out of its reach.
//!
//! The runtime shares the program's descriptor table, and the program treats that
//! table as its own: daemons and fork-then-exec children close everything above 2
//! (close_range, closefrom, a /proc/self/fd loop), shells dup2 over low numbers, test
//! suites count their descriptors. Were the program to close the userfaultfd, the
//! kernel would unregister every range and swapped-out pages would read as zeros;
//! closing the backing file would free all that was written back. So:
//!
//! 1. **Placed high.** Every descriptor the runtime keeps is moved ([`place`]) to the
//!    top of the soft RLIMIT_NOFILE (below 64 Ki), close-on-exec, where a program
//!    that gets the lowest free number never reaches; then ([`seal`], from the shim)
//!    the soft limit is lowered to just below them, as valgrind does: the program sees
//!    a limit [`RESERVE`] lower and never scans up to them.
//! 2. **Registered.** [`is_ours`] names them, so that the shim's close, close_range,
//!    closefrom, dup2 and dup3 leave them alone (and answer EBADF, as the kernel does
//!    for a descriptor that is not open).
//! 3. **Kept.** A keeper thread per runtime works from a private copy of the table
//!    (unshare(CLONE_FILES)) that holds the runtime's descriptors and nothing else,
//!    so no close in the program's table releases one of our files: the kernel's
//!    registrations and the backing file live on. Whoever then meets EBADF on one of
//!    ours (a raw close_range system call the shim never saw) calls [`restore_all`]:
//!    each missing descriptor is fetched back from the keeper's table (pidfd_getfd on
//!    the keeper thread) into its own number. If one cannot be, [`lost`] stops the
//!    program with a message: anything else would let a missing page read as zeros.
//!
//! Program descriptors are never kept: the keeper closes them in its copy at once,
//! so a program that closes a pipe or socket is not kept waiting for its EOF.
//!
//! Everything but [`place`] and [`keep`] is async-signal-safe (atomics and system
//! calls): the fault path calls [`restore_all`] and [`lost`].

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};

/// Descriptors set aside at the top of the limit.
pub const RESERVE: i32 = 32;
/// The top is taken at most here: the kernel sizes a process's table by its highest
/// descriptor, and a limit of a million would cost megabytes of kernel memory.
const CEILING: i32 = 1 << 16;
/// The registry: `keeper tid << 32 | (fd + 1)`, 0 for a free entry.
pub const SLOTS: usize = 64;
static OURS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

fn low(v: u64) -> i64 {
    (v & 0xffff_ffff) as i64 - 1
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Moves `fd` to the top of the descriptor limit (close-on-exec) and registers it.
/// Where the top is full or the limit too small, `fd` stays where it is (registered).
pub fn place(fd: OwnedFd) -> OwnedFd {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the rlimit struct we own.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(CEILING as u64) as i32
    } else {
        0
    };
    let fd = if soft >= 3 + 2 * RESERVE {
        // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own makes a new one or fails.
        let hi = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, soft - RESERVE) };
        if hi >= 0 {
            // SAFETY: `hi` was just made for us alone; `fd` drops (closes) here.
            unsafe { OwnedFd::from_raw_fd(hi) }
        } else {
            fd
        }
    } else {
        fd
    };
    register(fd.as_raw_fd());
    fd
}

static SEALED: AtomicBool = AtomicBool::new(false);

/// In a forked child, whose parent's descriptors are closed (`drop_in_child`): the
/// soft limit back where it was before [`seal`], so that a runtime of the child's own
/// places its descriptors at the top and seals again.
pub fn unseal_in_child() {
    RESTORING.store(false, SeqCst);
    if !SEALED.swap(false, AcqRel) {
        return;
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur + RESERVE as u64 <= lim.rlim_max {
            lim.rlim_cur += RESERVE as u64;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The variable `uzswap run` sets to the program's soft RLIMIT_NOFILE, so that a
/// program exec'd by a process whose limit [`seal`] lowered gets it back.
pub const LIMIT_VAR: &str = "UZSWAP_FD_LIMIT";

/// Once per process, after its runtime placed its descriptors (the shim calls it):
/// lowers the soft RLIMIT_NOFILE to just below them, as valgrind does, so that a
/// program that scans every descriptor under its limit (sysconf(_SC_OPEN_MAX), a
/// close or fstat loop) never meets one, and the kernel itself refuses dup2 onto them.
/// Not done where the limit is above 64 Ki (they sit lower then) or where one of them
/// could not be placed at the top.
pub fn seal() {
    if SEALED.swap(true, AcqRel) {
        return;
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur > CEILING as u64 {
        return;
    }
    let floor = lim.rlim_cur as i32 - RESERVE;
    let mut all = [0; SLOTS];
    let n = ours(&mut all);
    if n == 0 || all[..n].iter().any(|&fd| fd < floor) {
        return;
    }
    lim.rlim_cur = floor as u64;
    // SAFETY: setrlimit reads the struct we own; lowering a soft limit is always allowed.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}

/// In a program just exec'd (before main): if its soft limit is exactly what [`seal`]
/// made of `orig` in a parent, it gets `orig` back, as it would have without uzswap.
pub fn undo_inherited_seal(orig: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur + RESERVE as u64 == orig && orig <= lim.rlim_max {
            lim.rlim_cur = orig;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// As [`place`], for a raw descriptor the caller owns (returns the one to use).
pub fn place_raw(fd: RawFd) -> RawFd {
    // SAFETY: the caller owns `fd` and hands it over; the result is handed back raw.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let placed = place(owned);
    let raw = placed.as_raw_fd();
    std::mem::forget(placed);
    raw
}

fn register(fd: RawFd) {
    let v = fd as u64 + 1;
    for s in &OURS {
        if s.compare_exchange(0, v, AcqRel, Relaxed).is_ok() {
            return;
        }
    }
    // A full registry (dozens of runtimes at once) leaves this one unprotected by the
    // shim; it is still placed high and kept.
}

/// Registers a socket the runtime holds (the remote tier's connections): the shim's
/// close, dup2 and close_range leave it alone, as for the others. It is not kept: a
/// raw close_range that took it only breaks that connection, which the tier makes
/// again; so [`restore_all`] passes over it.
pub fn register_socket(fd: RawFd) {
    register_unkept(fd)
}

/// Registers a descriptor that no keeper holds and whose loss its user settles (a
/// socket reconnects; a loan pipe's read end that reads as closed keeps its loan for
/// good): [`restore_all`] passes over it.
pub fn register_unkept(fd: RawFd) {
    let v = SOCKET << 32 | (fd as u64 + 1);
    for s in &OURS {
        if s.compare_exchange(0, v, AcqRel, Relaxed).is_ok() {
            return;
        }
    }
}

/// The keeper "tid" of a registered socket (no thread has that id).
const SOCKET: u64 = u32::MAX as u64;

/// Before the runtime closes one of its descriptors: the number is the program's again.
pub fn unregister(fd: RawFd) {
    for s in &OURS {
        let v = s.load(Acquire);
        if v != 0 && low(v) == fd as i64 {
            let _ = s.compare_exchange(v, 0, AcqRel, Relaxed);
        }
    }
}

/// Whether `fd` is one of uzswap's (the shim leaves these alone).
pub fn is_ours(fd: RawFd) -> bool {
    fd >= 0 && OURS.iter().any(|s| low(s.load(Relaxed)) == fd as i64)
}

/// Writes the registered descriptors, in order, to `out`; returns how many.
/// Async-signal-safe.
pub fn ours(out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for s in &OURS {
        let fd = low(s.load(Acquire));
        if fd >= 0 {
            out[n] = fd as RawFd;
            n += 1;
        }
    }
    out[..n].sort_unstable();
    n
}

/// In a forked child: the parent's runtime does not exist here, so its descriptors
/// are closed (a child that never execs would otherwise hold the parent's backing
/// file) and their numbers are the child's to use; all but `keep`, which the child
/// still reads (the parent's backing file and the loan pipe's end, fork.rs): those
/// stay registered, with no keeper until the child's runtime starts one.
pub fn drop_in_child(keep: &[RawFd]) {
    for s in &OURS {
        let v = s.swap(0, AcqRel);
        if v == 0 {
            continue;
        }
        let fd = low(v) as RawFd;
        if keep.contains(&fd) {
            s.store(v & 0xffff_ffff, Release);
        } else {
            // SAFETY: closes a descriptor of the parent's runtime, which has no user in
            // the child (its threads were not copied).
            unsafe { libc::close(fd) };
        }
    }
}

/// Runs on the keeper thread: makes its descriptor table private, holding `fds` and
/// nothing else, and records the thread as their keeper.
pub fn keep(fds: &[RawFd]) -> Result<(), String> {
    // SAFETY: unshare(CLONE_FILES) gives this thread a copy of the table; no memory.
    if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        return Err(format!("unshare(CLONE_FILES): {}", std::io::Error::last_os_error()));
    }
    let mut keep: Vec<RawFd> = fds.to_vec();
    keep.sort_unstable();
    // The descriptors open in this copy, as /proc lists them (from the table's bitmap
    // of open ones): close_range looks at every slot up to the table's size, which our
    // descriptors at the top of the limit make large (1 ms in every process at a limit
    // of 20,000; 0.2 this way). The listing's own descriptor is closed by then (EBADF).
    if let Ok(dir) = std::fs::read_dir("/proc/thread-self/fd") {
        let open: Vec<RawFd> = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
        for fd in open.into_iter().filter(|fd| keep.binary_search(fd).is_err()) {
            // SAFETY: closes a descriptor of this thread's private table only.
            unsafe { libc::close(fd) };
        }
        record_keeper(&keep);
        return Ok(());
    }
    let mut from: u32 = 0;
    for &k in keep.iter().chain(std::iter::once(&-1)) {
        let to = if k < 0 { u32::MAX } else { (k as u32).wrapping_sub(1) };
        if k < 0 || (k as u32) > from {
            // SAFETY: close_range on this thread's private table, sparing `keep`.
            if unsafe { libc::syscall(libc::SYS_close_range, from, to, 0) } != 0 {
                return Err(format!("close_range: {}", std::io::Error::last_os_error()));
            }
        }
        if k >= 0 {
            from = k as u32 + 1;
        }
    }
    record_keeper(&keep);
    Ok(())
}

/// Records this thread as the keeper of `keep` (sorted).
fn record_keeper(keep: &[RawFd]) {
    // SAFETY: gettid takes nothing.
    let tid = unsafe { libc::gettid() } as u64;
    for s in &OURS {
        let v = s.load(Acquire);
        if v != 0 && keep.binary_search(&(low(v) as RawFd)).is_ok() {
            let _ = s.compare_exchange(v, tid << 32 | (v & 0xffff_ffff), AcqRel, Relaxed);
        }
    }
}

/// The keeper is gone (its runtime stops): nothing can be restored from it.
pub fn unkeep(fds: &[RawFd]) {
    for s in &OURS {
        let v = s.load(Acquire);
        if v != 0 && fds.contains(&(low(v) as RawFd)) {
            let _ = s.compare_exchange(v, v & 0xffff_ffff, AcqRel, Relaxed);
        }
    }
}

const PIDFD_THREAD: libc::c_uint = libc::O_EXCL as libc::c_uint;

#[derive(PartialEq)]
enum Restore {
    Open,
    Restored,
    Failed,
}

/// Fetches `fd` back from its keeper into the same number, if it is closed.
/// Async-signal-safe.
fn restore(fd: RawFd, tid: u64) -> Restore {
    // SAFETY: fcntl, pidfd_open, pidfd_getfd and close take integers only, get/setrlimit
    // a struct we own; every descriptor made here is closed here, except `fd` itself,
    // which is ours.
    unsafe {
        if libc::fcntl(fd, libc::F_GETFD) >= 0 {
            return Restore::Open;
        }
        if tid == SOCKET {
            // Not kept (see `register_socket`): its owner finds it broken and reconnects.
            return Restore::Open;
        }
        if tid == 0 {
            return Restore::Failed;
        }
        let pidfd = libc::syscall(libc::SYS_pidfd_open, tid as libc::pid_t, PIDFD_THREAD) as RawFd;
        if pidfd < 0 {
            return Restore::Failed;
        }
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as RawFd;
        libc::close(pidfd);
        if got < 0 {
            return Restore::Failed;
        }
        // The lowest free number from `fd` up: `fd` itself, unless the program took
        // it meanwhile (then it stays the program's). Not dup3, which would replace it.
        let mut back = libc::fcntl(got, libc::F_DUPFD_CLOEXEC, fd);
        if back < 0 && *libc::__errno_location() == libc::EINVAL {
            // `fd` is at or above the soft limit `seal` lowered: raise it for this call.
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && (fd as u64) < lim.rlim_max {
                let soft = lim.rlim_cur;
                lim.rlim_cur = fd as u64 + 1;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                    back = libc::fcntl(got, libc::F_DUPFD_CLOEXEC, fd);
                    lim.rlim_cur = soft;
                    libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                }
            }
        }
        let ok = back == fd;
        if back >= 0 && !ok {
            libc::close(back);
        }
        libc::close(got);
        if ok {
            Restore::Restored
        } else {
            Restore::Failed
        }
    }
}

/// Restores every registered descriptor the program closed behind the shim (see the
/// module comment): how many were, or the first that could not be. Async-signal-safe.
pub fn restore_all() -> Result<usize, RawFd> {
    // One restorer at a time: two would each take the other's number for a moment.
    // The holder makes a few system calls and never faults, so the wait is short, and
    // no signal handler that takes it can interrupt it on its own thread (SIGBUS only
    // comes from managed memory, which restoring never touches).
    while RESTORING.swap(true, Acquire) {
        // SAFETY: sched_yield takes nothing.
        unsafe { libc::sched_yield() };
    }
    let r = restore_each();
    RESTORING.store(false, Release);
    r
}

static RESTORING: AtomicBool = AtomicBool::new(false);
/// Bumped by every restore: a caller whose I/O failed retries only if a restore
/// happened since it started (by it or by another thread).
static RESTORES: AtomicU64 = AtomicU64::new(0);

/// The count of restores so far (see [`restore_all`]). Async-signal-safe.
pub fn restores() -> u64 {
    RESTORES.load(SeqCst)
}

fn restore_each() -> Result<usize, RawFd> {
    let mut restored = 0;
    for s in &OURS {
        let v = s.load(Acquire);
        if v == 0 {
            continue;
        }
        match restore(low(v) as RawFd, v >> 32) {
            Restore::Open => {}
            Restore::Restored => {
                RESTORES.fetch_add(1, SeqCst);
                restored += 1
            }
            Restore::Failed => return Err(low(v) as RawFd),
        }
    }
    Ok(restored)
}

/// After EBADF on one of ours: restores what was closed, or stops the program.
/// Returns when the caller may retry. Async-signal-safe.
pub fn restore_or_stop() {
    if let Err(fd) = restore_all() {
        lost(fd);
    }
}

/// One of uzswap's descriptors was closed where the shim could not see it (a raw
/// system call) and cannot be brought back: the program is stopped, since its
/// swapped-out memory could otherwise read as zeros. Async-signal-safe.
pub fn lost(fd: RawFd) -> ! {
    let mut digits = [0u8; 20];
    let parts: [&[u8]; 3] = [
        b"uzswap: the program closed uzswap's file descriptor ",
        itoa(fd as u64, &mut digits),
        b" where the shim could not see it (a raw close or close_range system call) and it cannot be \
restored; stopping the program rather than let its swapped-out memory read as zeros\n",
    ];
    for p in parts {
        crate::fault::say(p);
    }
    crate::fault::fatal(b"")
}

fn itoa(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
    }
}

/// Whether the last system call failed because a descriptor was not open.
pub fn was_ebadf() -> bool {
    errno() == libc::EBADF
}
