//! Threads, fork, SIGBUS chaining and system calls on managed memory (SIGBUS path).

use crate::table::{self, TABLE};
use uzswap_runtime::fork::{ForkHold, Inheritance};
use crate::{inside, own, real, Inside};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};

// ---- Threads. ----

struct Start {
    f: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
}

extern "C" fn start_inside(p: *mut c_void) -> *mut c_void {
    // SAFETY: `p` is the Box::into_raw of pthread_create below, handed to this one
    // thread only, which takes it back exactly once.
    let s = unsafe { Box::from_raw(p.cast::<Start>()) };
    Inside::forever();
    // Lives as long as the process: the slot is never given back.
    own::note_stack();
    own::note_dtv();
    own::made();
    let slot = crate::creds::ours_started();
    let r = (s.f)(s.arg);
    crate::creds::ours_gone(slot);
    r
}

/// The program's threads: their stacks are recorded, so that adoption leaves them
/// alone (cover.rs), for as long as the thread runs its start routine.
extern "C" fn start_program(p: *mut c_void) -> *mut c_void {
    let s = {
        let _inside = Inside::enter();
        // SAFETY: as in `start_inside`.
        unsafe { Box::from_raw(p.cast::<Start>()) }
    };
    let slot = own::note_stack();
    own::note_dtv();
    own::made();
    let r = (s.f)(s.arg);
    own::unnote_stack(slot);
    r
}

/// A thread created by shim or runtime code (the runtime's reader and reclaimer) runs
/// inside the shim for life: its allocations and mappings go straight to libc. Every
/// thread's stack is recorded (own.rs) so that adoption never takes it. What glibc
/// allocates to make any thread, the program's too, comes from uzswap's heap (the call
/// runs inside) when glibc's calloc is ours: among it the thread's DTV, which every
/// access to a thread-local of this library reads (own.rs `note_dtv`), so it is never
/// adopted and swapped out. A program that defines calloc itself gets that call: the
/// DTV is then recorded where it landed.
///
/// # Safety
/// The C pthread_create contract: `t` is valid for writing, `attr` null or initialised.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    t: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    f: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
) -> c_int {
    let start = if inside() { start_inside } else { start_program };
    let s = {
        let _inside = Inside::enter();
        Box::into_raw(Box::new(Start { f, arg }))
    };
    // Until the thread has recorded its stack (the trampolines), no scan adopts: its
    // stack is a fresh anonymous mapping that nothing else marks as a stack.
    own::start_making().hand_over();
    let rc = {
        let _inside = Inside::enter();
        real::pthread_create()(t, attr, start, s.cast())
    };
    if rc != 0 {
        own::made();
        let _inside = Inside::enter();
        drop(Box::from_raw(s));
    }
    rc
}

// ---- fork. ----
//
// Every fork that goes through libc (fork, and the forks inside forkpty and daemon,
// which no preload sees) runs the pthread_atfork handlers, so the work is done there:
// `prepare` takes TABLE for writing and holds every folio, making the regions
// inheritable (runtime `hold_for_fork`, crates/runtime fork.rs): swapped-out folios of
// a range the child gets whole stay out, and the child takes them over encoded; the
// rest is brought back; `parent` undoes that; `child` forgets its parent's runtime and
// starts one of its own (lib.rs `restart_in_child`), which takes over the ranges the
// hold carried, joins the group and adopts what it can; the other managed ranges are
// plain memory in the child (orphans). _Fork(), vfork and
// raw clone(2) run no handlers: vfork and posix_spawn children share or replace the
// memory and need nothing; a raw fork's child has no managed memory at all (regions are
// MADV_DONTFORK, so that it faults instead of reading zeros).

/// The hold between `prepare` and `parent`/`child`; set and taken only while TABLE is
/// held for writing (by the forking thread, its guard forgotten), so by one fork at a time.
static FORK_HOLD: std::sync::Mutex<Option<ForkHold>> = std::sync::Mutex::new(None);

// Order. glibc runs the prepare handlers in the reverse order of their registration,
// the parent and child handlers in that order. Ours must come first: their prepare
// runs after everyone else's, the parent and child ones before, so that no other
// library's handler touches a folio the hold keeps swapped out and locked (in the
// parent: a fault never served) or one the child has not taken over yet (in the child:
// a hole that reads as zeros). Registering in shim_init is not enough: a preloaded
// library is initialised after the program's shared libraries, whose constructors may
// register theirs first (libjemalloc does, under redis-server). So every registration
// comes through our `__register_atfork` (pthread_atfork is a stub in each caller that
// calls it), which registers ours first.

/// Registers uzswap's fork handlers, once, before anyone else's (see "Order" above).
pub(crate) fn register_ours_first() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The own heap's lock first: its prepare handler runs after the others' (which
        // may allocate), its parent and child handlers before them.
        crate::own::follow_forks();
        register_atfork(prepare, parent, child);
    });
}

/// One registration of ours, with libc's `__register_atfork` (not our interposed one).
pub(crate) fn register_atfork(prepare: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    extern "C" {
        /// This library's handle, which glibc uses to drop its handlers if it is
        /// unloaded (never: it is preloaded).
        static __dso_handle: u8;
    }
    // SAFETY: three `extern "C" fn()` that live as long as the process (this library
    // is preloaded, never unloaded); `__dso_handle` is this object's, as the stub
    // pthread_atfork would pass.
    let rc = unsafe { real::__register_atfork()(Some(prepare), Some(parent), Some(child), (&raw const __dso_handle).cast_mut().cast()) };
    if rc != 0 {
        // Without its handlers a fork cannot keep managed memory: say so, loudly.
        let msg = b"uzswap shim: registering the fork handlers failed: managed memory would be lost at fork\n";
        // SAFETY: write reads `msg.len()` bytes of a live static; abort never returns.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::abort();
        }
    }
}

/// setgroups(2) through glibc is applied by every thread of the process (glibc's
/// `__nptl_setxid` signals each with SIGSETXID, which no thread can block), uzswap's
/// own threads too, each passing `list` to the kernel. Were it in swapped-out memory,
/// the reader would fault on it inside the kernel and wait for itself (a forked
/// child of CPython's test_subprocess hung so, its list in the heap it had just taken
/// over). The kernel gets a copy in memory uzswap never manages: this thread's stack,
/// or a private mapping for a long list. Copying it here faults on this thread, which
/// the reader serves. No allocation: a vfork child may call it.
///
/// # Safety
/// The C setgroups contract: `list` points to `size` group ids (or `size` is 0).
#[no_mangle]
pub unsafe extern "C" fn setgroups(size: usize, list: *const libc::gid_t) -> c_int {
    const ON_STACK: usize = 1024;
    if size == 0 || list.is_null() {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { crate::creds::setgroups(size, list) };
    }
    let bytes = size.saturating_mul(std::mem::size_of::<libc::gid_t>());
    let mut stack = [0 as libc::gid_t; ON_STACK];
    let copy = if size <= ON_STACK {
        stack.as_mut_ptr()
    } else {
        // Recorded as uzswap's while it lives, so that the scan never adopts it.
        let making = crate::own::start_making();
        // SAFETY: a fresh private anonymous mapping of `bytes`, ours alone (the raw
        // system call: no allocator, no interposed mmap).
        let p = unsafe { libc::syscall(libc::SYS_mmap, 0usize, bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0usize) };
        if p < 0 {
            drop(making);
            // SAFETY: the caller's arguments, passed on (as without uzswap).
            return unsafe { crate::creds::setgroups(size, list) };
        }
        crate::own::note(p as usize, bytes);
        drop(making);
        p as *mut libc::gid_t
    };
    // SAFETY: `list` holds `size` ids (the caller's contract); `copy` has room for them.
    unsafe { std::ptr::copy_nonoverlapping(list, copy, size) };
    // SAFETY: `copy` holds the same `size` ids.
    let rc = unsafe { crate::creds::setgroups(size, copy) };
    if size > ON_STACK {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        crate::own::unmap(copy as usize, bytes, || {
            // SAFETY: the mapping made above, no longer used.
            unsafe { libc::syscall(libc::SYS_munmap, copy as usize, bytes) == 0 }
        });
        // SAFETY: this thread's errno, kept for the caller.
        unsafe { *libc::__errno_location() = errno };
    }
    rc
}

/// Every fork handler registration in the process (pthread_atfork's stub in the
/// caller, or a direct call): ours first (see "Order" above), then the caller's.
///
/// # Safety
/// glibc's contract for `__register_atfork`: handlers that may be called at any fork
/// while `dso` is loaded.
#[no_mangle]
pub unsafe extern "C" fn __register_atfork(
    prepare: Option<extern "C" fn()>,
    parent: Option<extern "C" fn()>,
    child: Option<extern "C" fn()>,
    dso: *mut c_void,
) -> c_int {
    register_ours_first();
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe { real::__register_atfork()(prepare, parent, child, dso) }
}

extern "C" fn prepare() {
    if inside() || crate::STATE.load(Acquire) != crate::ACTIVE {
        return;
    }
    let _inside = Inside::enter();
    let Some(rt) = crate::runtime() else { return };
    // Held until `parent` or `child` unlocks them: the list of adopted regions (first:
    // the scan holds it while it adopts, and waits for nothing we hold), then the
    // table: no managed range changes meanwhile, and the child's copies are whole.
    crate::cover::hold_for_fork();
    std::mem::forget(TABLE.write());
    // A child takes over a range's swapped-out folios (they stay out, locked, across
    // the fork), whether malloc gave it to the program or it was mmap'd (other
    // libraries' handlers run outside ours, see "Order" above), only where the child
    // gets the whole range as it is: no part unmapped, marked MADV_DONTFORK or
    // MADV_WIPEONFORK, and no protection changed (the child reads and writes it in
    // place). Adopted ranges too, but for what glibc touches between the handlers
    // (`glibc_touches_in_child`) and the locale data every new thread reads first
    // (`locale_data`), put in place. Bringing mmap'd ranges back too made forks fast
    // and broke the budget at each: redis-server's BGSAVE (jemalloc maps its memory)
    // of 500,000 keys under 64M saved in about 1 s with its tree at 145 MiB; carried,
    // in 150-195 s within 66-78 MiB, where the kernel's memory cgroup of 64M had not
    // saved after 600 s (README). `fork_carry = no` brings everything back.
    let reprotected = crate::table::REPROTECTED.load(Relaxed);
    // Adopted ranges are carried too, where the child gets one whole with its
    // protection unchanged (cover.rs `may_carry`), but for what glibc touches in the
    // child before our handler runs (`glibc_touches_in_child`).
    let rw = crate::cover::rw_mappings();
    let locale = locale_data();
    // SAFETY: this thread holds the write lock (guard forgotten just above) and the
    // list of adopted regions (`hold_for_fork`).
    let hold = rt.hold_for_fork(
        |base, len| unsafe {
            match (*TABLE.as_mut_ptr()).get(&base) {
                Some(e) => !reprotected && !e.orphan && !e.wiped_on_fork && e.holes.is_empty() && e.dontfork.is_empty() && e.cap() == len,
                None => crate::cover::may_carry(base, len, &rw),
            }
        },
        |pin| {
            glibc_touches_in_child(pin, &rw);
            for &(at, len) in &locale {
                pin(at, len);
            }
        },
    );
    // What the program marked MADV_DONTFORK stays out of the child.
    // SAFETY: this thread holds the write lock (guard forgotten just above); the
    // ranges lie inside their live regions.
    unsafe {
        for e in (*TABLE.as_mut_ptr()).values() {
            for &(lo, hi) in &e.dontfork {
                real::madvise()((e.base() + lo) as *mut c_void, hi - lo, libc::MADV_DONTFORK);
            }
        }
    }
    *FORK_HOLD.lock().unwrap_or_else(|e| e.into_inner()) = Some(hold);
}

/// Names (`pin(addr, len)`) the memory glibc's fork writes in the child before the
/// fork handlers run (glibc 2.36 `fork`, then `__malloc_fork_unlock_child` and
/// `fresetlockfiles`; 2.34 to 2.41 alike), and in the parent between our prepare
/// handler and the fork (`__malloc_fork_lock_parent`), wherever it is in memory we
/// may carry: there a child would find a hole that reads as zeros (and the parent a
/// folio the hold keeps locked). Each `pin` puts that memory in place before it is
/// read here. What is written:
/// - every arena's `malloc_state` (its mutex, free list links): for arenas other than
///   the main one, at the start of their first heap, which glibc aligns to
///   `HEAP_MAX_SIZE` (64 MiB on 64-bit): the first page at every such address in the
///   program's read-write mappings (`rw`) is named, whatever it holds;
/// - the lock of every FILE on `_IO_list_all`, which a FILE from fopen keeps beside it
///   in one malloc'd block: the FILE (its `_chain` is read) and its lock are named.
///
/// What glibc reads or writes in static data (libc's own, the main arena) is never
/// managed. A write this misses is not lost silently: the child finds a page present
/// in a carried folio and lays it over the parent's data, and says so (runtime fork.rs).
fn glibc_touches_in_child(pin: &mut dyn FnMut(usize, usize), rw: &[(usize, usize)]) {
    const HEAP_MAX_SIZE: usize = 64 << 20;
    const PAGE: usize = 4096;
    for &(start, end) in rw {
        let mut at = start.next_multiple_of(HEAP_MAX_SIZE);
        while at < end {
            pin(at, PAGE);
            at += HEAP_MAX_SIZE;
        }
    }
    // Read with process_vm_readv: another thread may be closing a FILE as we walk
    // (glibc takes its list lock only after our handler), and a stale pointer must
    // end the walk, not the program.
    let word = |addr: usize| -> Option<usize> {
        let mut v = 0usize;
        let local = libc::iovec { iov_base: (&raw mut v).cast(), iov_len: 8 };
        let remote = libc::iovec { iov_base: addr as *mut c_void, iov_len: 8 };
        // SAFETY: reads 8 bytes of this process at `addr` into `v`, which we own; a
        // bad address fails with EFAULT instead of faulting.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        (n == 8).then_some(v)
    };
    // The head of the list, at the exported static (taking its address reads nothing).
    let mut fp = word(&raw const _IO_list_all as usize).unwrap_or(0);
    // A bound on the walk: a list garbled by a close under way could loop.
    for _ in 0..1 << 16 {
        if fp == 0 || fp % 8 != 0 {
            break;
        }
        pin(fp, FILE_PLUS);
        match word(fp + std::mem::offset_of!(FileHead, lock)) {
            Some(lock) if lock != 0 => pin(lock, LOCK_SIZE),
            _ => {}
        }
        fp = word(fp + std::mem::offset_of!(FileHead, chain)).unwrap_or(0);
    }
}

/// Where the global locale's data is (each category's `struct __locale_data`, and the
/// ctype tables): what every new thread reads first (glibc's `start_thread` calls
/// `__ctype_init`), the child's runtime threads too, before their reader serves a
/// fault: carried to the child swapped out, a program's locale data loaded by
/// setlocale (malloc'd, in its brk heap: bash, Python) left them waiting on a fault
/// only they could serve. Found through public interfaces: `duplocale` copies the
/// global locale's category pointers (`struct __locale_struct`, <bits/types/
/// __locale_t.h>), and this thread's ctype tables (`__ctype_b_loc`...) are the global
/// locale's unless it called uselocale. Called before the hold, where a fault on any
/// of it is served.
fn locale_data() -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    // SAFETY: duplocale of the global locale returns a new locale object or null; its
    // first field is the array of 13 category pointers; freed once, below.
    unsafe {
        // LC_GLOBAL_LOCALE: ((locale_t) -1) in <locale.h>.
        let dup = libc::duplocale(usize::MAX as libc::locale_t);
        if !dup.is_null() {
            let cats = dup.cast::<[usize; 13]>().read();
            // A category's data: a header and its values (LC_CTYPE's ~90 words).
            out.extend(cats.iter().filter(|&&p| p != 0).map(|&p| (p, 1024)));
            libc::freelocale(dup);
        }
    }
    extern "C" {
        fn __ctype_b_loc() -> *const *const u16;
        fn __ctype_toupper_loc() -> *const *const i32;
        fn __ctype_tolower_loc() -> *const *const i32;
    }
    // SAFETY: glibc's ctype accessors return this thread's pointers to tables indexed
    // from -128 to 255 (384 entries).
    unsafe {
        out.push(((*__ctype_b_loc()) as usize - 128 * 2, 384 * 2));
        out.push(((*__ctype_toupper_loc()) as usize - 128 * 4, 384 * 4));
        out.push(((*__ctype_tolower_loc()) as usize - 128 * 4, 384 * 4));
    }
    out
}

fn take_hold() -> Option<ForkHold> {
    FORK_HOLD.lock().unwrap_or_else(|e| e.into_inner()).take()
}

extern "C" fn parent() {
    let _inside = Inside::enter();
    if let Some(hold) = take_hold() {
        hold.resume();
        // SAFETY: `prepare` took the write lock on this thread and forgot its guard.
        unsafe { TABLE.force_write_unlock() };
        crate::cover::resume_after_fork();
        crate::cover::forked();
    }
}

extern "C" fn child() {
    let _inside = Inside::enter();
    if let Some(hold) = take_hold() {
        crate::become_passive();
        let inherited: Inheritance = hold.into_child();
        // SAFETY: this thread holds the write lock (taken in `prepare`, guard forgotten),
        // so it alone may touch the table; then it lets it go.
        unsafe {
            for e in (*TABLE.as_mut_ptr()).values_mut() {
                e.orphan = true;
            }
            TABLE.force_write_unlock();
        }
        // A runtime of its own, in the same group: the child is managed too.
        crate::restart_in_child(inherited);
    }
}

// ---- SIGBUS (SIGBUS fault path only). ----

/// The program's SIGBUS disposition, kept here while the runtime's handler owns the
/// signal: handler address, sa_flags, sa_mask (signals 1 to 64, all there are on
/// Linux x86-64), then a "taken over" flag.
static PROG_HANDLER: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PROG_FLAGS: AtomicUsize = AtomicUsize::new(0);
static PROG_MASK: AtomicU64 = AtomicU64::new(0);
static TAKEN: AtomicBool = AtomicBool::new(false);

fn mask_bits(set: &libc::sigset_t) -> u64 {
    // SAFETY: a sigset_t is at least 8 bytes of plain bits, signal n at bit n - 1.
    unsafe { std::ptr::read_unaligned((set as *const libc::sigset_t).cast::<u64>()) }
}

fn mask_set(bits: u64) -> libc::sigset_t {
    // SAFETY: all-zero is an empty sigset_t; its first 8 bytes are signals 1 to 64.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        std::ptr::write_unaligned((&mut set as *mut libc::sigset_t).cast::<u64>(), bits);
        set
    }
}

/// Installs `dispatch` as the SIGBUS handler, remembering the program's. Called just
/// before the runtime installs its own, which chains to whatever was there: us.
pub(crate) fn take_over_sigbus() {
    if TAKEN.load(Acquire) {
        // Once per process: a forked child starting its own runtime has it from its
        // parent, and taking it again would make our dispatcher the program's handler.
        return;
    }
    // SAFETY: `old` and `sa` are live, zero-initialised sigaction structs (all-zero is a
    // valid sigaction); `dispatch` has the SA_SIGINFO handler signature.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        real::sigaction()(libc::SIGBUS, std::ptr::null(), &mut old);
        PROG_HANDLER.store(old.sa_sigaction, Relaxed);
        PROG_FLAGS.store(old.sa_flags as usize, Relaxed);
        PROG_MASK.store(mask_bits(&old.sa_mask), Relaxed);
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = dispatch as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        real::sigaction()(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
    TAKEN.store(true, Release);
}

/// A SIGBUS the runtime did not resolve, delivered as the kernel would deliver it to
/// the program's disposition: its handler (SA_SIGINFO or not) with its sa_mask added
/// and SA_RESETHAND and SA_NODEFER obeyed; or the default action (a fault returns
/// and faults again under SIG_DFL; a SIGBUS sent by kill or raise is raised again);
/// or, for a sent one, SIG_IGN. The kernel ignores SIG_IGN for a real fault, and so
/// do we.
extern "C" fn dispatch(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let h = PROG_HANDLER.load(Relaxed);
    let flags = PROG_FLAGS.load(Relaxed) as c_int;
    // SAFETY: the kernel passes a valid siginfo.
    let sent = unsafe { (*info).si_code } <= 0;
    // SAFETY: `h` is what the program gave sigaction for SIGBUS (neither SIG_DFL nor
    // SIG_IGN in the call branch), so a function of the signature its recorded
    // SA_SIGINFO flag says; it is called with the kernel's own arguments. The masks and
    // dispositions set here are plain sigset_t/sigaction values we own.
    unsafe {
        if h == libc::SIG_IGN && sent {
            return;
        }
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            real::sigaction()(libc::SIGBUS, &sa, std::ptr::null_mut());
            if sent {
                // Blocked while this handler runs: delivered, and fatal, on return.
                libc::raise(sig);
            }
            return;
        }
        if flags & libc::SA_RESETHAND != 0 {
            PROG_HANDLER.store(libc::SIG_DFL, Relaxed);
            PROG_FLAGS.store(0, Relaxed);
        }
        let mut old = mask_set(0);
        let add = mask_set(PROG_MASK.load(Relaxed));
        libc::pthread_sigmask(libc::SIG_BLOCK, &add, &mut old);
        if flags & libc::SA_NODEFER != 0 {
            let only = mask_set(1u64 << (sig - 1));
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
        }
        if flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(c_int) = std::mem::transmute(h);
            f(sig);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

/// While the runtime owns SIGBUS, the program's SIGBUS disposition is kept aside,
/// reported back as it was given, and served by `dispatch` for faults that are not
/// ours. Every other signal, and SIGBUS on the thread path, goes to libc.
///
/// # Safety
/// The C sigaction contract: `act` is null or readable, `old` null or writable.
#[no_mangle]
pub unsafe extern "C" fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    if sig != libc::SIGBUS || !TAKEN.load(Acquire) || inside() {
        return real::sigaction()(sig, act, old);
    }
    if !old.is_null() {
        std::ptr::write_bytes(old, 0, 1);
        (*old).sa_sigaction = PROG_HANDLER.load(Relaxed);
        (*old).sa_flags = PROG_FLAGS.load(Relaxed) as c_int;
        (*old).sa_mask = mask_set(PROG_MASK.load(Relaxed));
    }
    if !act.is_null() {
        PROG_MASK.store(mask_bits(&(*act).sa_mask), Relaxed);
        PROG_FLAGS.store((*act).sa_flags as usize, Relaxed);
        PROG_HANDLER.store((*act).sa_sigaction, Relaxed);
    }
    0
}

/// # Safety
/// The C signal contract: `handler` is SIG_DFL, SIG_IGN or a `fn(c_int)`.
#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    let mut sa: libc::sigaction = std::mem::zeroed();
    sa.sa_sigaction = handler;
    sa.sa_flags = libc::SA_RESTART;
    libc::sigemptyset(&mut sa.sa_mask);
    let mut old: libc::sigaction = std::mem::zeroed();
    if sigaction(sig, &sa, &mut old) != 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}

// ---- System calls on managed memory (SIGBUS path, or user-mode faults only). ----

/// Faults in every page of `[p, p+len)` (from user mode, where every fault is served:
/// on the SIGBUS path the handler brings the folio back): a read per page, or with
/// `write` an atomic OR of zero, which changes nothing, even under another thread's
/// store to the same byte, but opens a page a read would leave write-protected (a clean
/// folio), where the kernel's copy into it would fail.
///
/// # Safety
/// `[p, p+len)` is a buffer the program handed to a system call: readable, and
/// writable if `write`.
unsafe fn touch(p: *const c_void, len: usize, write: bool) {
    let end = p as usize + len;
    let mut a = p as usize;
    while a < end {
        if write {
            (*(a as *const std::sync::atomic::AtomicU8)).fetch_or(0, Relaxed);
        } else {
            std::ptr::read_volatile(a as *const u8);
        }
        a = (a & !4095) + 4096;
    }
}

/// Whether a system call on `[p, p+len)` needs help: managed memory (a range we
/// serve, or a JVM's or V8's reservation adopted in place: cover.rs), and the kernel does not
/// wait for its faults (`kernel_faults_fail`).
fn needs_help(p: *const c_void, len: usize) -> bool {
    len > 0
        && (table::maybe_managed(p as usize, len) || crate::cover::maybe_reserved(p as usize, len))
        && !inside()
        && crate::kernel_faults_fail()
}

/// Which way a transfer moves data through the program's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    /// The call reads the buffer (write, send): one that fails on a missing page moved
    /// nothing, and may be made again.
    Out,
    /// The call fills the buffer from a source that keeps the data when the copy fails
    /// (a file, an attribute): tried in place first.
    In,
    /// The call fills the buffer with data it takes from its source (a socket, a pipe,
    /// a terminal): a datagram whose copy to a missing page fails is dropped, so the
    /// data always goes through plain memory, at most CHUNK bytes of it (a short read,
    /// which such a source may give)...
    Take,
    /// ... or all of it, where the caller asked for all (MSG_WAITALL).
    TakeAll,
}

/// `Take`, or `TakeAll` for a receive with MSG_WAITALL in `flags`.
fn take(flags: c_int) -> Dir {
    if flags & libc::MSG_WAITALL != 0 { Dir::TakeAll } else { Dir::Take }
}

/// Runs `call(buf, len)` on the buffer `[p, p+len)` after faulting it in. If the
/// kernel still finds a page missing (EFAULT: the reclaimer took a folio back out
/// between the touch and the call), the call goes through a bounce buffer of plain
/// memory instead: copied from the managed buffer before a write, into it after a
/// read. A [`Dir::Take`] goes through the bounce buffer at once, for at most CHUNK
/// bytes (a short read, as a socket or pipe may give). The copies run in user mode,
/// where every fault is served.
///
/// # Safety
/// `[p, p+len)` is a buffer the call may read (`Out`) or write, as the wrapped system
/// call requires of its caller; `call(buf, len)` does that call on `len` bytes at `buf`.
unsafe fn with_buffer(p: *const c_void, len: usize, dir: Dir, mut call: impl FnMut(*const c_void, usize) -> isize) -> isize {
    if !needs_help(p, len) {
        return call(p, len);
    }
    let mut n = len;
    if dir == Dir::Take {
        n = len.min(CHUNK);
    } else if dir != Dir::TakeAll {
        touch(p, len, dir == Dir::In);
        let r = call(p, len);
        if r >= 0 || *libc::__errno_location() != libc::EFAULT {
            return r;
        }
    }
    let Some(tmp) = Bounce::new(n) else {
        *libc::__errno_location() = libc::EFAULT;
        return -1;
    };
    if dir == Dir::Out {
        std::ptr::copy_nonoverlapping(p.cast::<u8>(), tmp.0, n);
    }
    let r = call(tmp.0.cast(), n);
    let errno = *libc::__errno_location();
    if dir != Dir::Out && r > 0 {
        std::ptr::copy_nonoverlapping(tmp.0, p as *mut u8, r as usize);
    }
    drop(tmp);
    *libc::__errno_location() = errno;
    r
}

/// Plain memory for a transfer the kernel cannot make from managed memory: uzswap's
/// own heap, never the program's allocator (a jemalloc-linked program may hold its
/// lock around the very call we are in).
struct Bounce(*mut u8);

impl Bounce {
    fn new(len: usize) -> Option<Bounce> {
        let _inside = Inside::enter();
        let p = own::c_malloc(len.max(1)).cast::<u8>();
        (!p.is_null()).then_some(Bounce(p))
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let _inside = Inside::enter();
        // SAFETY: from own::c_malloc in `new`, freed once, here.
        unsafe { own::c_free(self.0.cast()) }
    }
}

/// Pieces that fit well inside any budget: the touched piece is still resident when
/// the kernel copies it.
const CHUNK: usize = 1 << 20;

/// For read/write/pread/pwrite on anything but a socket: the transfer is done in
/// pieces of CHUNK bytes, each faulted in first (a buffer larger than the budget
/// could never be resident all at once). `call(offset, len)` transfers at `p+offset`.
/// Reads stop at the first short piece, or after the first piece unless the file is
/// a regular file or a block device (where a short read would mean end of file);
/// writes go on until all is written, as a blocking write does.
///
/// # Safety
/// As [`with_buffer`], for `fd`'s read or write of `[p, p+len)`.
unsafe fn chunked(fd: c_int, p: *const c_void, len: usize, reading: bool, mut call: impl FnMut(*const c_void, usize, usize) -> isize) -> isize {
    if !needs_help(p, len) {
        return call(p, 0, len);
    }
    let kind = file_type(fd);
    let whole = is_file(kind);
    let dir = match (reading, whole) {
        (false, _) => Dir::Out,
        (true, true) => Dir::In,
        (true, false) => Dir::Take,
    };
    if kind == libc::S_IFSOCK {
        return with_buffer(p, len, dir, |b, n| call(b, 0, n));
    }
    let mut done = 0usize;
    while done < len {
        let n = CHUNK.min(len - done);
        let r = with_buffer((p as usize + done) as *const c_void, n, dir, |b, n| call(b, done, n));
        if r < 0 {
            return if done > 0 { done as isize } else { r };
        }
        done += r as usize;
        // A short piece of a file is not its end: the kernel stops at a page the
        // reclaimer took back out since the touch, and the next piece starts there
        // (only a read of nothing is the end of the file).
        if r == 0 || (reading && !whole) {
            break;
        }
    }
    done as isize
}

/// The type bits of `fd`'s mode (S_IFREG, S_IFSOCK ...); 0 if fstat fails.
fn file_type(fd: c_int) -> libc::mode_t {
    // SAFETY: all zeros is a valid stat struct (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes the struct we own.
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
    if ok { st.st_mode & libc::S_IFMT } else { 0 }
}

/// Whether short transfers on a descriptor of this type (`file_type`) are only ever
/// the end of the data (a regular file or a block device), not a pipe's or a
/// socket's partial ones.
fn is_file(kind: libc::mode_t) -> bool {
    matches!(kind, libc::S_IFREG | libc::S_IFBLK)
}

/// # Safety
/// The C read contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    chunked(fd, buf, n, true, |b, _, l| real::read()(fd, b as *mut c_void, l))
}

/// # Safety
/// The C write contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    chunked(fd, buf, n, false, |b, _, l| real::write()(fd, b, l))
}

/// readv, writev, preadv and pwritev on `fd`, where a buffer of the vector needs help
/// ([`needs_help`]). On a file, or past CHUNK bytes in all: one buffer at a time
/// through the scalar wrappers (`one(buffer, len, done so far)`, which go on past a
/// short piece of a file, as `chunked` does), stopping at the first short buffer.
/// Otherwise (a pipe, a socket: one call, whose short transfers are the program's to
/// see): every buffer is faulted in and the call made; if the kernel still finds a
/// page missing (EFAULT), the whole vector goes through one bounce buffer of plain
/// memory (gathered before a write, scattered after a read).
///
/// # Safety
/// `iov` holds `cnt` buffers the call may read (writing) or write (`reading`), as the
/// wrapped system call requires of its caller; `call` does that call on a vector,
/// `one` the scalar call on one buffer.
unsafe fn vectored(
    fd: c_int,
    iov: *const libc::iovec,
    cnt: c_int,
    reading: bool,
    mut call: impl FnMut(*const libc::iovec, c_int) -> isize,
    mut one: impl FnMut(*mut c_void, usize, usize) -> isize,
) -> isize {
    if iov.is_null() || !(1..=libc::UIO_MAXIOV).contains(&cnt) {
        return call(iov, cnt); // the kernel's answer (EINVAL, EFAULT), as without us
    }
    let v = std::slice::from_raw_parts(iov, cnt as usize);
    if !v.iter().any(|b| needs_help(b.iov_base, b.iov_len)) {
        return call(iov, cnt);
    }
    let total = v.iter().fold(0usize, |t, b| t.saturating_add(b.iov_len));
    if total > CHUNK || is_file(file_type(fd)) {
        let mut done = 0usize;
        for b in v {
            let r = one(b.iov_base, b.iov_len, done);
            if r < 0 {
                return if done > 0 { done as isize } else { r };
            }
            done += r as usize;
            if (r as usize) < b.iov_len {
                break;
            }
        }
        return done as isize;
    }
    in_one_call(v, if reading { Dir::Take } else { Dir::Out }, call)
}

/// A vectored call that must stay one call (a datagram, a message with ancillary
/// data), as [`with_buffer`] makes a scalar one: a write is tried in place after every
/// buffer is faulted in, and made again from one bounce buffer of plain memory (the
/// vector gathered) if the kernel still finds a page missing; a read (`Take`) goes
/// through the bounce buffer at once (at most CHUNK bytes) and is scattered after.
///
/// # Safety
/// As [`vectored`], for the buffers of `v`.
unsafe fn in_one_call(v: &[libc::iovec], dir: Dir, mut call: impl FnMut(*const libc::iovec, c_int) -> isize) -> isize {
    let reading = dir != Dir::Out;
    let mut total = v.iter().fold(0usize, |t, b| t.saturating_add(b.iov_len));
    if dir == Dir::Take {
        total = total.min(CHUNK);
    } else if dir != Dir::TakeAll {
        for b in v {
            touch(b.iov_base, b.iov_len, false);
        }
        let r = call(v.as_ptr(), v.len() as c_int);
        if r >= 0 || *libc::__errno_location() != libc::EFAULT {
            return r;
        }
    }
    let Some(tmp) = Bounce::new(total) else {
        *libc::__errno_location() = libc::EFAULT;
        return -1;
    };
    if !reading {
        let mut at = 0;
        for b in v {
            std::ptr::copy_nonoverlapping(b.iov_base.cast::<u8>(), tmp.0.add(at), b.iov_len);
            at += b.iov_len;
        }
    }
    let bounce = libc::iovec { iov_base: tmp.0.cast(), iov_len: total };
    let r = call(&bounce, 1);
    let errno = *libc::__errno_location();
    if reading && r > 0 {
        let mut left = r as usize;
        let mut at = 0;
        for b in v {
            let n = b.iov_len.min(left);
            std::ptr::copy_nonoverlapping(tmp.0.add(at), b.iov_base.cast::<u8>(), n);
            (at, left) = (at + n, left - n);
        }
    }
    drop(tmp);
    *libc::__errno_location() = errno;
    r
}

/// # Safety
/// The C readv contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> isize {
    vectored(fd, iov, cnt, true, |v, n| real::readv()(fd, v, n), |b, l, _| read(fd, b, l))
}

/// # Safety
/// The C writev contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> isize {
    vectored(fd, iov, cnt, false, |v, n| real::writev()(fd, v, n), |b, l, _| write(fd, b, l))
}

/// # Safety
/// The C preadv contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn preadv64(fd: c_int, iov: *const libc::iovec, cnt: c_int, off: libc::off64_t) -> isize {
    vectored(fd, iov, cnt, true, |v, n| real::preadv64()(fd, v, n, off), |b, l, done| pread64(fd, b, l, off + done as libc::off64_t))
}

/// # Safety
/// The C preadv contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn preadv(fd: c_int, iov: *const libc::iovec, cnt: c_int, off: libc::off64_t) -> isize {
    preadv64(fd, iov, cnt, off)
}

/// # Safety
/// The C pwritev contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn pwritev64(fd: c_int, iov: *const libc::iovec, cnt: c_int, off: libc::off64_t) -> isize {
    vectored(fd, iov, cnt, false, |v, n| real::pwritev64()(fd, v, n, off), |b, l, done| pwrite64(fd, b, l, off + done as libc::off64_t))
}

/// # Safety
/// The C pwritev contract: `iov` holds `cnt` valid buffers.
#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const libc::iovec, cnt: c_int, off: libc::off64_t) -> isize {
    pwritev64(fd, iov, cnt, off)
}

// ---- The kernel's accesses to managed memory that userfaultfd cannot serve. ----
//
// /proc/self/mem (both paths) and process_vm_readv/writev of our own pid (SIGBUS
// path) fail on a page not in place (see the runtime's shim_support): the range is put
// in place first (runtime `fault_in`), a piece at a time, and the call retried a few
// times if the reclaimer took part of it out again. Another process reading ours (a
// debugger's ptrace or /proc/<pid>/mem) gets EIO for pages not in place: never zeros.

/// Retries of one piece before its error is returned.
const TRIES: u32 = 8;

/// Whether `fd` is this process's own /proc/<pid>/mem (or one of its threads').
fn is_own_mem(fd: c_int) -> bool {
    let _inside = Inside::enter();
    let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else { return false };
    let pid = std::process::id().to_string();
    let parts: Vec<String> = target.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    matches!(parts[..], ["/", "proc", p, "mem"] | ["/", "proc", p, "task", _, "mem"] if p == pid)
}

/// `call(done, len)` transfers `len` bytes between address `addr + done` of
/// /proc/self/mem and `buf + done`; each piece of both is put in place first (the
/// buffer may be managed too, and on the SIGBUS path the kernel cannot wait for it).
///
/// # Safety
/// `call` is a pread/pwrite the caller may make.
unsafe fn own_mem(addr: usize, buf: usize, n: usize, reading: bool, mut call: impl FnMut(usize, usize) -> isize) -> isize {
    let Some(rt) = ({
        let _inside = Inside::enter();
        crate::runtime()
    }) else {
        return call(0, n);
    };
    let mut done = 0usize;
    while done < n {
        let len = CHUNK.min(n - done);
        let mut tries = 0;
        let r = loop {
            let held = {
                let _inside = Inside::enter();
                // The buffer too where the kernel does not wait for its faults; where
                // it does, it must not find the buffer held.
                let mut ranges = vec![(addr + done, len, !reading)];
                if crate::kernel_faults_fail() {
                    ranges.push((buf + done, len, reading));
                }
                rt.hold_in_place(&ranges)
            };
            let r = call(done, len);
            {
                let _inside = Inside::enter();
                drop(held);
            }
            tries += 1;
            if r >= 0 || tries == TRIES {
                break r;
            }
        };
        if r <= 0 {
            return if done > 0 { done as isize } else { r };
        }
        done += r as usize;
    }
    done as isize
}

/// The managed ranges a list of iovecs names, for `hold_in_place`.
///
/// # Safety
/// `iov` is valid for `cnt` entries.
unsafe fn iov_ranges(iov: *const libc::iovec, cnt: libc::c_ulong, write: bool) -> Vec<(usize, usize, bool)> {
    (0..cnt as usize)
        .map(|i| &*iov.add(i))
        .filter(|v| table::maybe_managed(v.iov_base as usize, v.iov_len))
        .map(|v| (v.iov_base as usize, v.iov_len, write))
        .collect()
}

type VmCall = unsafe extern "C" fn(libc::pid_t, *const libc::iovec, libc::c_ulong, *const libc::iovec, libc::c_ulong, libc::c_ulong) -> isize;

/// process_vm_readv/writev of our own pid on the SIGBUS path: retried with its ranges
/// held in place while it falls short (`reading`: readv, which writes the local side).
///
/// # Safety
/// The C contract of `call`.
#[allow(clippy::too_many_arguments)] // the system call's six, the call and its direction
unsafe fn vm_call(
    call: VmCall,
    reading: bool,
    pid: libc::pid_t,
    local: *const libc::iovec,
    lcnt: libc::c_ulong,
    remote: *const libc::iovec,
    rcnt: libc::c_ulong,
    flags: libc::c_ulong,
) -> isize {
    let want: usize = (0..rcnt as usize).map(|i| (*remote.add(i)).iov_len).sum();
    let mut r = call(pid, local, lcnt, remote, rcnt, flags);
    if r == want as isize || inside() || pid != libc::getpid() || !crate::kernel_faults_fail() {
        return r;
    }
    let _inside = Inside::enter();
    let Some(rt) = crate::runtime() else { return r };
    for _ in 0..TRIES {
        let mut ranges = iov_ranges(remote, rcnt, !reading);
        ranges.extend(iov_ranges(local, lcnt, reading));
        let held = rt.hold_in_place(&ranges);
        r = call(pid, local, lcnt, remote, rcnt, flags);
        drop(held);
        if r == want as isize {
            break;
        }
    }
    r
}

/// # Safety
/// The C process_vm_readv contract.
#[no_mangle]
pub unsafe extern "C" fn process_vm_readv(
    pid: libc::pid_t,
    local: *const libc::iovec,
    lcnt: libc::c_ulong,
    remote: *const libc::iovec,
    rcnt: libc::c_ulong,
    flags: libc::c_ulong,
) -> isize {
    vm_call(real::process_vm_readv(), true, pid, local, lcnt, remote, rcnt, flags)
}

/// # Safety
/// The C process_vm_writev contract.
#[no_mangle]
pub unsafe extern "C" fn process_vm_writev(
    pid: libc::pid_t,
    local: *const libc::iovec,
    lcnt: libc::c_ulong,
    remote: *const libc::iovec,
    rcnt: libc::c_ulong,
    flags: libc::c_ulong,
) -> isize {
    vm_call(real::process_vm_writev(), false, pid, local, lcnt, remote, rcnt, flags)
}

/// Whether a pread/pwrite at `off` may be of our own /proc/self/mem over managed memory.
fn own_mem_range(fd: c_int, off: libc::off64_t, n: usize) -> bool {
    n > 0 && off > 0 && !inside() && crate::STATE.load(Acquire) == crate::ACTIVE && table::maybe_managed(off as usize, n) && is_own_mem(fd)
}

/// # Safety
/// The C pread contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, n: usize, off: libc::off64_t) -> isize {
    if own_mem_range(fd, off, n) {
        return own_mem(off as usize, buf as usize, n, true, |d, l| real::pread64()(fd, buf.cast::<u8>().add(d).cast(), l, off + d as libc::off64_t));
    }
    chunked(fd, buf, n, true, |b, o, l| real::pread64()(fd, b as *mut c_void, l, off + o as libc::off64_t))
}

/// # Safety
/// The C pread contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: usize, off: libc::off64_t) -> isize {
    pread64(fd, buf, n, off)
}

/// # Safety
/// The C pwrite contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: usize, off: libc::off64_t) -> isize {
    if own_mem_range(fd, off, n) {
        return own_mem(off as usize, buf as usize, n, false, |d, l| real::pwrite64()(fd, buf.cast::<u8>().add(d).cast(), l, off + d as libc::off64_t));
    }
    chunked(fd, buf, n, false, |b, o, l| real::pwrite64()(fd, b, l, off + o as libc::off64_t))
}

/// # Safety
/// The C pwrite contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: usize, off: libc::off64_t) -> isize {
    pwrite64(fd, buf, n, off)
}

/// # Safety
/// The C recv contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: usize, flags: c_int) -> isize {
    with_buffer(buf, n, take(flags), |b, n| real::recv()(fd, b as *mut c_void, n, flags))
}

/// # Safety
/// The C send contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize {
    with_buffer(buf, n, Dir::Out, |b, n| real::send()(fd, b, n, flags))
}

/// # Safety
/// The C recvfrom contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    from: *mut libc::sockaddr,
    from_len: *mut libc::socklen_t,
) -> isize {
    with_buffer(buf, n, take(flags), |b, n| real::recvfrom()(fd, b as *mut c_void, n, flags, from, from_len))
}

/// # Safety
/// The C sendto contract: `buf` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    to: *const libc::sockaddr,
    to_len: libc::socklen_t,
) -> isize {
    with_buffer(buf, n, Dir::Out, |b, n| real::sendto()(fd, b, n, flags, to, to_len))
}

/// sendmsg and recvmsg: one call (a datagram, or ancillary data, must not be split),
/// see [`in_one_call`].
///
/// # Safety
/// `msg` is null or a valid msghdr whose vector holds valid buffers, as the call
/// requires; `call` makes it on a header.
unsafe fn message(msg: *const libc::msghdr, dir: Dir, mut call: impl FnMut(*const libc::msghdr) -> isize) -> isize {
    let reading = dir != Dir::Out;
    if msg.is_null() || (*msg).msg_iov.is_null() || !(1..=libc::UIO_MAXIOV as usize).contains(&(*msg).msg_iovlen) {
        return call(msg); // the kernel's answer, as without us
    }
    let v = std::slice::from_raw_parts((*msg).msg_iov, (*msg).msg_iovlen);
    if !v.iter().any(|b| needs_help(b.iov_base, b.iov_len)) {
        return call(msg);
    }
    in_one_call(v, dir, |iov, cnt| {
        let mut h = *msg;
        (h.msg_iov, h.msg_iovlen) = (iov as *mut libc::iovec, cnt as usize);
        let r = call(&h);
        if reading && r >= 0 {
            // What the kernel says of the message (truncation, ancillary data).
            let m = msg as *mut libc::msghdr;
            ((*m).msg_flags, (*m).msg_controllen, (*m).msg_namelen) = (h.msg_flags, h.msg_controllen, h.msg_namelen);
        }
        r
    })
}

/// # Safety
/// The C sendmsg contract: `msg` describes valid buffers.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> isize {
    message(msg, Dir::Out, |h| real::sendmsg()(fd, h, flags))
}

/// # Safety
/// The C recvmsg contract: `msg` describes valid buffers.
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    message(msg, take(flags), |h| real::recvmsg()(fd, h as *mut libc::msghdr, flags))
}

// ---- stdio. ----
//
// fread and fwrite of a large buffer pass it to read(2) and write(2) from inside libc,
// where no preload sees the call. Where the buffer needs help ([`needs_help`]), the
// transfer goes a piece at a time through plain memory, under the stream's lock so
// that it stays one operation for other threads, as fread and fwrite are.

/// The piece a stdio transfer moves through plain memory at a time.
const STDIO_PIECE: usize = 256 << 10;

extern "C" {
    fn flockfile(f: *mut libc::FILE);
    fn funlockfile(f: *mut libc::FILE);
}

/// `size * n` bytes at `p` through plain memory with `call(plain, len)` (the
/// unlocked stdio call, which returns the bytes it moved); returns the items moved,
/// as fread and fwrite do. `locked`: the caller holds the stream's lock already.
///
/// # Safety
/// `[p, p + size * n)` is the caller's buffer, as fread/fwrite require; `f` a stream.
unsafe fn stdio(p: *mut u8, size: usize, n: usize, f: *mut libc::FILE, reading: bool, locked: bool, mut call: impl FnMut(*mut c_void, usize) -> usize) -> usize {
    let total = size * n;
    if !locked {
        flockfile(f);
    }
    let done = if !needs_help(p.cast(), total) {
        // Only the stream's buffer needs help: the data goes from where it lies.
        let _held = Held::stream(f);
        call(p.cast(), total).min(total)
    } else {
        let mut done = 0;
        match Bounce::new(STDIO_PIECE.min(total)) {
            None => *libc::__errno_location() = libc::ENOMEM,
            Some(tmp) => {
                while done < total {
                    let len = STDIO_PIECE.min(total - done);
                    // The program's data is copied with no hold standing: it may share
                    // a folio with the stream's buffer, and a fault there would wait
                    // for the hold.
                    if !reading {
                        std::ptr::copy_nonoverlapping(p.add(done), tmp.0, len);
                    }
                    let moved = {
                        let _held = Held::stream(f);
                        call(tmp.0.cast(), len).min(len)
                    };
                    if reading {
                        std::ptr::copy_nonoverlapping(tmp.0, p.add(done), moved);
                    }
                    done += moved;
                    if moved < len {
                        break; // end of file or an error, which the stream records
                    }
                }
            }
        }
        done
    };
    if !locked {
        funlockfile(f);
    }
    done / size
}

/// A stream's own buffer, held in place while a stdio call may flush or fill it.
///
/// glibc flushes a stream's buffer (and fills it, reading) with its own write(2) and
/// read(2), from inside the stdio call. Where the program's allocator placed the buffer
/// in managed memory (a jemalloc-linked program) and the kernel does not wait for
/// faults, a buffer whose folio had gone out failed the call with EFAULT: redis'
/// background save as an ordinary user ended "Write error saving DB on disk: Bad
/// address". So the calls that flush or fill (fwrite, fputs, fread, fflush, fclose)
/// hold the buffer in place, with the FILE and its lock, which the call touches (a
/// fault on a held folio would wait for the hold), and with the stream's lock taken
/// first (another thread inside a stdio call on it holds that lock and may touch the
/// buffer: taken the other way round, the two would wait for each other). A stream
/// the program opens, and stdout, get a buffer of uzswap's own instead (`give_buffer`);
/// on stdin and a buffer set by the program, other stdio calls (printf, putc, fgets,
/// ...) are not covered: a flush there can still meet a buffer that went out.
struct Held(Option<uzswap_runtime::shim_support::InPlace>);

impl Held {
    /// Stream `f`'s buffer, FILE and lock, if its buffer needs help.
    ///
    /// # Safety
    /// `f` is an open stream, whose lock the caller holds.
    unsafe fn stream(f: *mut libc::FILE) -> Held {
        let Some((base, end)) = buffer_needing_help(f) else { return Held(None) };
        let lock = (*(f as *const FileHead)).lock as usize;
        let mut ranges = vec![(base, end - base, true), (f as usize, FILE_PLUS, true)];
        if lock != 0 {
            ranges.push((lock, LOCK_SIZE, true));
        }
        Held::ranges(&ranges)
    }

    /// The hold, errno as it was: the call it is made for may set it, or the caller
    /// look at it after a call that sets none (a read at the end of a file).
    fn ranges(ranges: &[(usize, usize, bool)]) -> Held {
        let _errno = KeepErrno::new();
        let _inside = Inside::enter();
        let Some(rt) = crate::runtime() else { return Held(None) };
        let held = rt.hold_in_place(ranges);
        // With a page missing (the reclaimer won every race), glibc's own touch of it
        // would wait for this very hold: let go, and the call may fail as before.
        Held(Some(held).filter(|h| h.complete()))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.0.is_some() {
            // What the call held for set stays.
            let _errno = KeepErrno::new();
            let _inside = Inside::enter();
            self.0 = None;
        }
    }
}

/// errno as it was when made, put back when dropped.
struct KeepErrno(c_int);

impl KeepErrno {
    fn new() -> KeepErrno {
        // SAFETY: errno is this thread's.
        KeepErrno(unsafe { *libc::__errno_location() })
    }
}

impl Drop for KeepErrno {
    fn drop(&mut self) {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = self.0 };
    }
}

/// Whether stream `f` has a buffer in memory that needs help ([`needs_help`]).
///
/// # Safety
/// `f` is an open stream.
unsafe fn stream_needs_help(f: *mut libc::FILE) -> bool {
    buffer_needing_help(f).is_some()
}

/// Stream `f`'s buffer (start, end), if it is in memory that needs help.
///
/// # Safety
/// `f` is an open stream.
unsafe fn buffer_needing_help(f: *mut libc::FILE) -> Option<(usize, usize)> {
    if f.is_null() || inside() || !crate::kernel_faults_fail() {
        return None;
    }
    let head = f as *const FileHead;
    let (base, end) = ((*head).buf_base as usize, (*head).buf_end as usize);
    (base != 0 && end > base && needs_help(base as *const c_void, end - base)).then_some((base, end))
}

/// Whether a stdio transfer of `n` items of `size` at `p` needs help.
fn stdio_needs_help(p: *const c_void, size: usize, n: usize) -> bool {
    size.checked_mul(n).is_some_and(|total| needs_help(p, total))
}

/// # Safety
/// The C fread contract: `p` is valid for `size * n` bytes, `f` an open stream.
#[no_mangle]
pub unsafe extern "C" fn fread(p: *mut c_void, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    if !stdio_needs_help(p, size, n) && !stream_needs_help(f) {
        return real::fread()(p, size, n, f);
    }
    stdio(p.cast(), size, n, f, true, false, |b, l| real::fread_unlocked()(b, 1, l, f))
}

/// # Safety
/// The C fread_unlocked contract (the caller holds the stream).
#[no_mangle]
pub unsafe extern "C" fn fread_unlocked(p: *mut c_void, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    if !stdio_needs_help(p, size, n) && !stream_needs_help(f) {
        return real::fread_unlocked()(p, size, n, f);
    }
    stdio(p.cast(), size, n, f, true, true, |b, l| real::fread_unlocked()(b, 1, l, f))
}

/// # Safety
/// The contract of fread under _FORTIFY_SOURCE: `p` is valid for `plen` bytes.
#[no_mangle]
pub unsafe extern "C" fn __fread_chk(p: *mut c_void, plen: usize, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    // A buffer too small for the request is libc's to report (it aborts).
    if (!stdio_needs_help(p, size, n) && !stream_needs_help(f)) || size * n > plen {
        return real::__fread_chk()(p, plen, size, n, f);
    }
    stdio(p.cast(), size, n, f, true, false, |b, l| real::fread_unlocked()(b, 1, l, f))
}

/// # Safety
/// The contract of fread_unlocked under _FORTIFY_SOURCE: `p` is valid for `plen` bytes.
#[no_mangle]
pub unsafe extern "C" fn __fread_unlocked_chk(p: *mut c_void, plen: usize, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    if (!stdio_needs_help(p, size, n) && !stream_needs_help(f)) || size * n > plen {
        return real::__fread_unlocked_chk()(p, plen, size, n, f);
    }
    stdio(p.cast(), size, n, f, true, true, |b, l| real::fread_unlocked()(b, 1, l, f))
}

/// # Safety
/// The C fwrite contract: `p` is valid for `size * n` bytes, `f` an open stream.
#[no_mangle]
pub unsafe extern "C" fn fwrite(p: *const c_void, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    if !stdio_needs_help(p, size, n) && !stream_needs_help(f) {
        return real::fwrite()(p, size, n, f);
    }
    stdio(p as *mut u8, size, n, f, false, false, |b, l| real::fwrite_unlocked()(b, 1, l, f))
}

/// # Safety
/// The C fwrite_unlocked contract (the caller holds the stream).
#[no_mangle]
pub unsafe extern "C" fn fwrite_unlocked(p: *const c_void, size: usize, n: usize, f: *mut libc::FILE) -> usize {
    if !stdio_needs_help(p, size, n) && !stream_needs_help(f) {
        return real::fwrite_unlocked()(p, size, n, f);
    }
    stdio(p as *mut u8, size, n, f, false, true, |b, l| real::fwrite_unlocked()(b, 1, l, f))
}

/// fputs and fputs_unlocked: a string longer than the stream's buffer is written
/// from where it lies, as fwrite's data is.
///
/// # Safety
/// `s` is a NUL-terminated string, `f` an open stream.
unsafe fn put_string(s: *const std::ffi::c_char, f: *mut libc::FILE, locked: bool, plain: impl FnOnce() -> c_int) -> c_int {
    // Whether its first byte may be managed, before the cost of strlen.
    if !needs_help(s.cast(), 1) && !stream_needs_help(f) {
        return plain();
    }
    let len = libc::strlen(s);
    if !needs_help(s.cast(), len) && !stream_needs_help(f) {
        return plain();
    }
    if stdio(s as *mut u8, 1, len, f, false, locked, |b, l| real::fwrite_unlocked()(b, 1, l, f)) == len { 1 } else { libc::EOF }
}

/// # Safety
/// The C fputs contract.
#[no_mangle]
pub unsafe extern "C" fn fputs(s: *const std::ffi::c_char, f: *mut libc::FILE) -> c_int {
    put_string(s, f, false, || real::fputs()(s, f))
}

/// # Safety
/// The C fputs_unlocked contract (the caller holds the stream).
#[no_mangle]
pub unsafe extern "C" fn fputs_unlocked(s: *const std::ffi::c_char, f: *mut libc::FILE) -> c_int {
    put_string(s, f, true, || real::fputs_unlocked()(s, f))
}

/// # Safety
/// The C fflush contract: `f` is an open stream, or null for all.
#[no_mangle]
pub unsafe extern "C" fn fflush(f: *mut libc::FILE) -> c_int {
    if !stream_needs_help(f) {
        return real::fflush()(f);
    }
    flockfile(f);
    let rc = {
        let _held = Held::stream(f);
        real::fflush_unlocked()(f)
    };
    funlockfile(f);
    rc
}

/// # Safety
/// The C fflush_unlocked contract (the caller holds the stream).
#[no_mangle]
pub unsafe extern "C" fn fflush_unlocked(f: *mut libc::FILE) -> c_int {
    let _held = Held::stream(f);
    real::fflush_unlocked()(f)
}

/// fclose flushes what the stream holds first, under a hold; the close itself frees the
/// buffer (the program's free, which may take its allocator's lock: no hold may stand
/// then, as a thread holding that lock may fault on the held folio).
///
/// # Safety
/// The C fclose contract: `f` is an open stream.
#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut libc::FILE) -> c_int {
    if stream_needs_help(f) {
        flockfile(f);
        let head = f as *const FileHead;
        // Output waiting (write_ptr past write_base): flushed here, where it can be held.
        if (*head)._write[1] > (*head)._write[0] {
            let _held = Held::stream(f);
            real::fflush_unlocked()(f);
        }
        funlockfile(f);
    }
    let old = own_buffer(f);
    let rc = real::fclose()(f);
    let_go(old, std::ptr::null_mut());
    rc
}

// ---- Stream buffers of uzswap's own. ----
//
// glibc mallocs a stream's buffer at its first use, with the program's malloc, and
// flushes and fills it with its own write(2) and read(2) from inside every stdio call
// (putc, printf, getc, fgets, scanf, and those wrapped above). Where the program's
// allocator places it in managed memory and the kernel does not wait for faults, a
// flush or fill that met it gone out failed with EFAULT: a stream error, the output
// lost (examples/stdiobuf.c: records that fill the buffer exactly, the program busy
// between them). A stream whose FILE the program's allocator placed in managed memory
// (a jemalloc-linked program's) is given a buffer from uzswap's heap when it is opened,
// sized and buffered as glibc would (st_blksize, at most BUFSIZ; line-buffered on a
// terminal): never managed, freed once the stream lets go of it (fclose, pclose,
// freopen, or setvbuf and its kin giving it another). The first such stream also tells
// that stdout's buffer, which glibc mallocs too, is (or will be) in managed memory:
// stdout then gets one of ours as well (`give_stdout_buffer`). stdin keeps libc's (a
// read stream cannot give back what it read ahead from a pipe): the calls wrapped above
// help it.

/// glibc's BUFSIZ: a stream's buffer is st_blksize bytes, at most this.
const BUFSIZ: usize = 8192;

/// Set once stdout was given a buffer of ours (or was looked at for one).
static STDOUT_GIVEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// After `f` was opened: a buffer of ours, if its FILE is in managed memory.
///
/// # Safety
/// `f` is null or a stream just opened, not yet used.
unsafe fn give_buffer(f: *mut libc::FILE) -> *mut libc::FILE {
    if f.is_null() || inside() || !crate::kernel_faults_fail() || !needs_help(f as *const c_void, FILE_PLUS) {
        return f;
    }
    // fstat and isatty (ENOTTY) set errno: the program's call succeeded.
    let _errno = KeepErrno::new();
    if !STDOUT_GIVEN.swap(true, Relaxed) {
        give_stdout_buffer();
    }
    let head = f as *const FileHead;
    let fd = (*head).fileno;
    if !(*head).buf_base.is_null() || fd < 0 {
        return f;
    }
    let _inside = Inside::enter();
    let (size, mode) = glibc_buffering(fd);
    let buf = crate::own::c_malloc(size);
    if !buf.is_null() && real::setvbuf()(f, buf.cast(), mode, size) != 0 {
        crate::own::c_free(buf);
    }
    f
}

/// The buffer size and mode glibc's `_IO_file_doallocate` gives a stream on `fd`.
///
/// # Safety
/// None beyond fstat's and isatty's (any `fd`).
unsafe fn glibc_buffering(fd: c_int) -> (usize, c_int) {
    let mut st: libc::stat = std::mem::zeroed();
    let (mut size, mut mode) = (BUFSIZ, libc::_IOFBF);
    if libc::fstat(fd, &mut st) == 0 {
        if st.st_mode & libc::S_IFMT == libc::S_IFCHR && libc::isatty(fd) == 1 {
            mode = libc::_IOLBF;
        }
        if st.st_blksize > 0 && (st.st_blksize as usize) < BUFSIZ {
            size = st.st_blksize as usize;
        }
    }
    (size, mode)
}

extern "C" {
    static mut stdout: *mut libc::FILE;
}
/// glibc's `_IO_UNBUFFERED` and `_IO_LINE_BUF` flags.
const IO_UNBUFFERED: c_int = 0x0002;
const IO_LINE_BUF: c_int = 0x0200;

/// stdout gets a buffer of ours, as `give_buffer`'s, in place of the one glibc made
/// (or will make) with the program's malloc. Where glibc made one, in the same mode and
/// size: what it holds is flushed first, held in place under the stream's lock as
/// fflush's is, and then setvbuf frees it (the program's free, with no hold standing:
/// see `fclose`). Unbuffered, or with a buffer the program set or glibc's outside
/// managed memory, stdout is left as it is.
///
/// # Safety
/// Called from an interposed call of the program's, not inside.
unsafe fn give_stdout_buffer() {
    let f = stdout;
    if f.is_null() {
        return;
    }
    flockfile(f);
    let head = f as *const FileHead;
    let (flags, base, end) = ((*head).flags, (*head).buf_base as usize, (*head).buf_end as usize);
    let wanted = if flags & IO_UNBUFFERED != 0 {
        None
    } else if base == 0 {
        // Line buffering the program asked for (setvbuf with no buffer) stays.
        let (size, mode) = glibc_buffering(libc::STDOUT_FILENO);
        Some((size, if flags & IO_LINE_BUF != 0 { libc::_IOLBF } else { mode }))
    } else if end > base && stream_needs_help(f) && flags & 1 == 0 {
        // (flag 1: `_IO_USER_BUF`, a buffer the program set.)
        Some((end - base, if flags & IO_LINE_BUF != 0 { libc::_IOLBF } else { libc::_IOFBF }))
    } else {
        None
    };
    if let Some((size, mode)) = wanted {
        let buf = {
            let _inside = Inside::enter();
            crate::own::c_malloc(size)
        };
        let rc = if buf.is_null() {
            -1
        } else {
            let flushed = {
                let _held = Held::stream(f);
                real::fflush_unlocked()(f)
            };
            if flushed == 0 { real::setvbuf()(f, buf.cast(), mode, size) } else { -1 }
        };
        if rc != 0 && !buf.is_null() {
            let _inside = Inside::enter();
            crate::own::c_free(buf);
        }
    }
    funlockfile(f);
}

/// Stream `f`'s buffer if it is one of ours (`give_buffer`), else null.
///
/// # Safety
/// `f` is null or an open stream.
unsafe fn own_buffer(f: *mut libc::FILE) -> *mut c_void {
    if f.is_null() {
        return std::ptr::null_mut();
    }
    let base = (*(f as *const FileHead)).buf_base.cast::<c_void>();
    if crate::own::is_heap(base) { base } else { std::ptr::null_mut() }
}

/// Frees `old`, a buffer of ours that stream `f` had, unless `f` (null: gone) still
/// has it.
///
/// # Safety
/// `old` is null or came from `give_buffer`; `f` is null or a stream.
unsafe fn let_go(old: *mut c_void, f: *mut libc::FILE) {
    if !old.is_null() && (f.is_null() || (*(f as *const FileHead)).buf_base.cast::<c_void>() != old) {
        let _errno = KeepErrno::new();
        let _inside = Inside::enter();
        crate::own::c_free(old);
    }
}

/// # Safety
/// The C fopen contract.
#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const std::ffi::c_char, mode: *const std::ffi::c_char) -> *mut libc::FILE {
    give_buffer(real::fopen()(path, mode))
}

/// # Safety
/// The C fopen64 contract.
#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const std::ffi::c_char, mode: *const std::ffi::c_char) -> *mut libc::FILE {
    give_buffer(real::fopen64()(path, mode))
}

/// # Safety
/// The C fdopen contract.
#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const std::ffi::c_char) -> *mut libc::FILE {
    give_buffer(real::fdopen()(fd, mode))
}

/// # Safety
/// The C tmpfile contract.
#[no_mangle]
pub unsafe extern "C" fn tmpfile() -> *mut libc::FILE {
    give_buffer(real::tmpfile()())
}

/// # Safety
/// The C tmpfile64 contract.
#[no_mangle]
pub unsafe extern "C" fn tmpfile64() -> *mut libc::FILE {
    give_buffer(real::tmpfile64()())
}

/// # Safety
/// The C popen contract.
#[no_mangle]
pub unsafe extern "C" fn popen(cmd: *const std::ffi::c_char, mode: *const std::ffi::c_char) -> *mut libc::FILE {
    give_buffer(real::popen()(cmd, mode))
}

/// # Safety
/// The C pclose contract: `f` came from popen.
#[no_mangle]
pub unsafe extern "C" fn pclose(f: *mut libc::FILE) -> c_int {
    let old = own_buffer(f);
    let rc = real::pclose()(f);
    let_go(old, std::ptr::null_mut());
    rc
}

/// freopen closes the stream (its buffer is let go of, ours not freed by glibc) and
/// opens it anew.
///
/// # Safety
/// The C freopen contract.
#[no_mangle]
pub unsafe extern "C" fn freopen(path: *const std::ffi::c_char, mode: *const std::ffi::c_char, f: *mut libc::FILE) -> *mut libc::FILE {
    let old = own_buffer(f);
    let r = real::freopen()(path, mode, f);
    // On failure glibc leaves the FILE allocated, closed, its buffer let go of.
    let_go(old, r);
    give_buffer(r)
}

/// # Safety
/// The C freopen64 contract.
#[no_mangle]
pub unsafe extern "C" fn freopen64(path: *const std::ffi::c_char, mode: *const std::ffi::c_char, f: *mut libc::FILE) -> *mut libc::FILE {
    let old = own_buffer(f);
    let r = real::freopen64()(path, mode, f);
    let_go(old, r);
    give_buffer(r)
}

/// # Safety
/// The C setvbuf contract.
#[no_mangle]
pub unsafe extern "C" fn setvbuf(f: *mut libc::FILE, buf: *mut std::ffi::c_char, mode: c_int, size: usize) -> c_int {
    let old = own_buffer(f);
    let rc = real::setvbuf()(f, buf, mode, size);
    let_go(old, f);
    rc
}

/// # Safety
/// The C setbuf contract.
#[no_mangle]
pub unsafe extern "C" fn setbuf(f: *mut libc::FILE, buf: *mut std::ffi::c_char) {
    let old = own_buffer(f);
    real::setbuf()(f, buf);
    let_go(old, f);
}

/// # Safety
/// The C setbuffer contract.
#[no_mangle]
pub unsafe extern "C" fn setbuffer(f: *mut libc::FILE, buf: *mut std::ffi::c_char, size: usize) {
    let old = own_buffer(f);
    real::setbuffer()(f, buf, size);
    let_go(old, f);
}

/// # Safety
/// The C setlinebuf contract.
#[no_mangle]
pub unsafe extern "C" fn setlinebuf(f: *mut libc::FILE) {
    let old = own_buffer(f);
    real::setlinebuf()(f);
    let_go(old, f);
}

/// The start of glibc's `struct _IO_FILE`, its public layout
/// (<bits/types/struct_FILE.h>, unchanged since glibc 2.1), to its lock: enough to find
/// a stream's buffer, its lock and the next stream.
#[repr(C)]
struct FileHead {
    flags: c_int,
    _read: [*mut u8; 3],
    _write: [*mut u8; 3],
    buf_base: *mut u8,
    buf_end: *mut u8,
    _save: [*mut u8; 3],
    _markers: *mut c_void,
    chain: *mut FileHead,
    fileno: c_int,
    _flags2: c_int,
    _old_offset: i64,
    _cur_column: u16,
    _vtable_offset: i8,
    _shortbuf: [u8; 1],
    /// An `_IO_lock_t` (`LOCK_SIZE` bytes), in the same malloc'd block as a FILE that
    /// fopen made.
    lock: *mut c_void,
}
// The offsets on x86-64, as glibc's headers place them.
const _: () = assert!(std::mem::offset_of!(FileHead, chain) == 104 && std::mem::offset_of!(FileHead, lock) == 136);
/// The whole `_IO_FILE` with the vtable pointer after it (`_IO_FILE_plus`).
const FILE_PLUS: usize = 224;
const LOCK_SIZE: usize = 16;

/// `_IO_MAGIC` in the top half of `flags` (`_IO_MAGIC_MASK`): a live stream.
const IO_MAGIC: u32 = 0xFBAD_0000;
const IO_MAGIC_MASK: u32 = 0xFFFF_0000;

extern "C" {
    /// Every open stream, chained (exported by glibc since 2.2.5, as are its lock).
    static _IO_list_all: *mut FileHead;
    fn _IO_list_lock();
    fn _IO_list_unlock();
}

/// At exit, once the reclaimer takes nothing out any more (runtime
/// `hold_reclaim_for_exit`): faults in the buffer of every stdio stream, so that
/// exit's flush, which libc makes after every exit handler with its own write(2),
/// where no preload sees it, finds the pages. An allocator that maps its own arenas
/// (a jemalloc-linked program's) places the buffers in managed memory; output that
/// waited in one whose folio had gone out was lost with EFAULT.
///
/// fclose unlinks a stream under the list lock before it frees the buffer, so none
/// met here goes away meanwhile. The streams' own locks are not taken: a thread
/// blocked in a read holds its stream's, and exit's flush does not take them either.
///
/// # Safety
/// Call at exit, on the thread that runs the exit handlers.
pub(crate) unsafe fn bring_in_stdio_buffers() {
    _IO_list_lock();
    let mut f = _IO_list_all;
    while !f.is_null() {
        // (The reads of a stream's fields in managed memory fault like any other.)
        let (flags, base, end) = ((*f).flags as u32, (*f).buf_base, (*f).buf_end);
        if flags & IO_MAGIC_MASK == IO_MAGIC && !base.is_null() && end > base {
            touch(base.cast(), end as usize - base as usize, false);
        }
        f = (*f).chain;
    }
    _IO_list_unlock();
}

// Extended attributes: a value or list read into, or written from, managed memory.
macro_rules! xattr_get {
    ($($name:ident($first:ident: $t:ty, $($arg:ident: $at:ty),*; $buf:ident: $bt:ty);)*) => {$(
        /// # Safety
        /// The C contract of the function of this name: the buffer is valid for `size` bytes.
        #[no_mangle]
        pub unsafe extern "C" fn $name($first: $t, $($arg: $at,)* $buf: $bt, size: usize) -> isize {
            with_buffer($buf as *const c_void, size, Dir::In, |b, size| real::$name()($first, $($arg,)* b as $bt, size))
        }
    )*};
}
xattr_get! {
    getxattr(path: *const std::ffi::c_char, name: *const std::ffi::c_char; value: *mut c_void);
    lgetxattr(path: *const std::ffi::c_char, name: *const std::ffi::c_char; value: *mut c_void);
    fgetxattr(fd: c_int, name: *const std::ffi::c_char; value: *mut c_void);
    listxattr(path: *const std::ffi::c_char,; list: *mut std::ffi::c_char);
    llistxattr(path: *const std::ffi::c_char,; list: *mut std::ffi::c_char);
    flistxattr(fd: c_int,; list: *mut std::ffi::c_char);
}

macro_rules! xattr_set {
    ($($name:ident($first:ident: $t:ty);)*) => {$(
        /// # Safety
        /// The C contract of the function of this name: `value` is valid for `size` bytes.
        #[no_mangle]
        pub unsafe extern "C" fn $name($first: $t, name: *const std::ffi::c_char, value: *const c_void, size: usize, flags: c_int) -> c_int {
            with_buffer(value, size, Dir::Out, |b, size| real::$name()($first, name, b, size, flags) as isize) as c_int
        }
    )*};
}
xattr_set! {
    setxattr(path: *const std::ffi::c_char);
    lsetxattr(path: *const std::ffi::c_char);
    fsetxattr(fd: c_int);
}
