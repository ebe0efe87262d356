//! Changes of user and group ids that uzswap's threads cannot follow.
//!
//! glibc applies set*id and setgroups to every thread of the process (`__nptl_setxid`
//! signals each one, uzswap's threads too) and aborts the process when they do not all
//! get the same result. They do not where the calling thread kept a capability across
//! an earlier change of user that uzswap's threads lost (capabilities belong to a
//! thread): setpriv sets PR_SET_KEEPCAPS, changes its user, raises CAP_SETGID again on
//! its own thread with capset, and only then changes its group, which uzswap's threads
//! are refused; `uzswap run -- setpriv --reuid=... --regid=... CMD` died of SIGABRT
//! before CMD ran. Programs that change their group before their user (sudo, su,
//! nginx) never meet this.
//!
//! Where it would happen and the calling thread is the program's only one, the change
//! is made on that thread alone, with the system call itself (a launcher such as
//! setpriv then execs, and its program starts with the ids it asked for). uzswap's
//! threads keep the ids they had, without any capability (they lost them with the
//! change of user). With other threads of the program's about, which must follow, the
//! call goes to glibc as it is, and the program is told why it is about to abort.
//!
//! Nothing here allocates (a vfork child may call these): the thread count is read
//! from /proc/self/status by system calls into a buffer on the stack.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering::*};

const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

/// uzswap's own threads (their tids) while they run: a slot each.
static OURS: [AtomicU32; 64] = [const { AtomicU32::new(0) }; 64];

/// Notes the calling thread, one of uzswap's, until [`ours_gone`].
pub(crate) fn ours_started() -> Option<usize> {
    // SAFETY: gettid takes nothing and cannot fail.
    let tid = unsafe { libc::gettid() } as u32;
    OURS.iter().position(|s| s.compare_exchange(0, tid, AcqRel, Relaxed).is_ok())
}

/// The thread noted in `slot` ends.
pub(crate) fn ours_gone(slot: Option<usize>) {
    if let Some(i) = slot {
        OURS[i].store(0, Release);
    }
}

/// The effective capabilities of thread `tid` (0: the calling thread), or None.
fn effective(tid: u32) -> Option<u64> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // _LINUX_CAPABILITY_VERSION_3: two 32-bit words of each set.
    let mut h = Header { version: 0x2008_0522, pid: tid as c_int };
    let mut d = [Data::default(); 2];
    // SAFETY: capget writes two `Data` (version 3) into `d`, which we own.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
    (rc == 0).then(|| u64::from(d[0].effective) | u64::from(d[1].effective) << 32)
}

/// The threads of this process ("Threads:" of /proc/self/status), or None.
fn threads() -> Option<usize> {
    let mut buf = [0u8; 4096];
    // SAFETY: raw open/read/close of a path we own (a C string literal), into `buf`;
    // the descriptor is closed before return. (Raw: the shim wraps libc's close.)
    let n = unsafe {
        let fd = libc::syscall(libc::SYS_openat, libc::AT_FDCWD, c"/proc/self/status".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return None;
        }
        let n = libc::syscall(libc::SYS_read, fd, buf.as_mut_ptr(), buf.len());
        libc::syscall(libc::SYS_close, fd);
        n
    };
    let text = buf.get(..usize::try_from(n).ok()?)?;
    let at = text.windows(9).position(|w| w == b"Threads:\t")? + 9;
    let digits = &text[at..][..text[at..].iter().take_while(|b| b.is_ascii_digit()).count()];
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Makes a change of ids that needs capability `cap` where the caller has it: with
/// `call` (glibc's, for every thread), or with `raw` (the system call, this thread
/// only) where glibc would abort and this is the program's only thread (module
/// comment).
fn change(cap: u32, call: impl FnOnce() -> c_int, raw: impl FnOnce() -> libc::c_long) -> c_int {
    let need = 1u64 << cap;
    let lacking = effective(0).is_some_and(|mine| mine & need != 0)
        && OURS.iter().any(|s| match s.load(Acquire) {
            0 => false,
            tid => effective(tid).is_some_and(|theirs| theirs & need == 0),
        });
    if !lacking {
        return call();
    }
    let ours = OURS.iter().filter(|s| s.load(Acquire) != 0).count();
    if threads() == Some(ours + 1) {
        // -1 with errno set, as the libc call.
        return raw() as c_int;
    }
    let msg = b"uzswap: this program changes its ids with a capability its thread kept across a change of user (as setpriv does); uzswap's threads lost it and cannot follow, and glibc aborts the process when one is refused. Start the launcher outside uzswap run (setpriv ... uzswap run ...).\n";
    // SAFETY: write reads `msg.len()` bytes of a live static.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    call()
}

/// setgroups, `list` in memory the kernel can read (proc.rs copies it there).
///
/// # Safety
/// The C setgroups contract.
pub(crate) unsafe fn setgroups(size: usize, list: *const libc::gid_t) -> c_int {
    change(CAP_SETGID, || crate::real::setgroups()(size, list), || libc::syscall(libc::SYS_setgroups, size, list))
}

macro_rules! ids {
    ($($name:ident($($arg:ident: $t:ty),*) $cap:ident => $sys:ident($($sysarg:expr),*);)*) => {$(
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $t),*) -> c_int {
            change($cap, || crate::real::$name()($($arg),*), || libc::syscall(libc::$sys, $($sysarg),*))
        }
    )*};
}

const KEEP: u32 = u32::MAX; // -1: the id stays

ids! {
    setuid(u: libc::uid_t) CAP_SETUID => SYS_setuid(u);
    seteuid(u: libc::uid_t) CAP_SETUID => SYS_setresuid(KEEP, u, KEEP);
    setreuid(r: libc::uid_t, e: libc::uid_t) CAP_SETUID => SYS_setreuid(r, e);
    setresuid(r: libc::uid_t, e: libc::uid_t, s: libc::uid_t) CAP_SETUID => SYS_setresuid(r, e, s);
    setgid(g: libc::gid_t) CAP_SETGID => SYS_setgid(g);
    setegid(g: libc::gid_t) CAP_SETGID => SYS_setresgid(KEEP, g, KEEP);
    setregid(r: libc::gid_t, e: libc::gid_t) CAP_SETGID => SYS_setregid(r, e);
    setresgid(r: libc::gid_t, e: libc::gid_t, s: libc::gid_t) CAP_SETGID => SYS_setresgid(r, e, s);
}
