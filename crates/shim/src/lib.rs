//! uzswap-shim: `libuzswap_shim.so`, preloaded (LD_PRELOAD) into an unmodified program
//! by `uzswap run`, gives it a memory budget: its large private anonymous memory lives
//! in uzswap regions (crates/runtime), so whatever does not fit the budget is compressed
//! a folio at a time, and comes back on the next touch.
//!
//! # What is managed
//! - `mmap` of private, anonymous, read-write memory of at least `threshold` bytes (no
//!   MAP_FIXED, no hint honoured, not MAP_SHARED/HUGETLB/GROWSDOWN/LOCKED/STACK).
//! - The malloc family for requests of at least `threshold` bytes: glibc's malloc maps
//!   big chunks with its internal `__mmap`, which no preload can see, so we serve such
//!   requests ourselves, one region per allocation, and forward everything else to the
//!   real functions. A managed allocation starts at its region's base, so no header:
//!   the table below knows its size.
//! - Everything else private and anonymous that the program has, wherever it came from
//!   (brk heap, glibc arenas, allocators' and runtimes' own mappings, raw system
//!   calls): adopted in place by [`cover`], on the thread path with a userfaultfd that
//!   serves system calls (with UFFD_USER_MODE_ONLY, a JVM's or V8's reservations
//!   only). Not stacks, locked, shared or hugetlb memory, nor uzswap's own ([`own`]
//!   records it).
//!
//! # Structures
//! - [`table`]: managed ranges by base address, under one RwLock, with the lowest and
//!   highest managed address in atomics so the common `free` of a small pointer costs
//!   two loads. Entries own their `Region`; removing an entry (free, munmap of all of it)
//!   drops the region, which unmaps it and frees what it held in every tier.
//! - One `Runtime`, started by our constructor, before main: never lazily inside an
//!   interposed call, where the caller may hold its allocator's lock and the runtime's
//!   start (thread creation allocates TLS through the program's malloc) would take it
//!   again. A forked child starts its own inside fork (the atfork child handler,
//!   where only the forking thread exists and no lock of the program's is held by
//!   a thread that could release it); an exec'd program starts its own.
//! - [`own`]: the heap every Rust allocation here comes from, over raw mmap: never the
//!   program's malloc, whichever allocator it brings.
//!
//! # Reentrancy
//! The shim's own C dependencies and glibc, working for the runtime's threads, call the
//! very symbols we interpose. A thread-local flag ([`Inside`]) marks "the shim is
//! running here": while it is set every interposed call goes straight to libc, but for
//! the malloc family, which serves it from uzswap's own heap ([`own`]), and mappings,
//! which are recorded as uzswap's. Threads created
//! while it is set (the runtime's reader and reclaimer) keep it for life (see
//! `proc::pthread_create`). dlsym may allocate while we look malloc up: those requests
//! come from a static bump buffer (real.rs).
//!
//! # Locking
//! TABLE (RwLock) is never held while creating or dropping a region: regions are made
//! first and inserted, or removed and then dropped, so a region's own mmap/munmap and
//! the runtime's locks never nest inside it. The exception is fork, which holds it for
//! writing across the fork so the child's copy is consistent.
//!
//! # Changes to the mapping (see map.rs)
//! munmap of a whole managed range drops its region; of part of one, the part is
//! dropped (MADV_DONTNEED frees it in every tier) and made PROT_NONE, so it faults as
//! unmapped memory would, until the rest goes. mremap of a managed range shrinks in
//! place, grows in place within the region, or moves (MREMAP_MAYMOVE) to a new region
//! by copying. madvise is passed through: the runtime follows DONTNEED/FREE.
//!
//! # Fault paths and system calls
//! With the thread path, system calls reading or writing managed memory just work (the
//! kernel waits for the handler thread). With the SIGBUS path, or a userfaultfd for
//! user-mode faults only, they would get EFAULT on a swapped-out page, so the shim
//! wraps read, write, pread, pwrite, recv, recvfrom, send, sendto, sendmsg, recvmsg,
//! and stdio's fread, fwrite and fputs (libc makes their system calls inside, on the
//! program's buffer, where no preload sees them) (proc.rs):
//! - a call that reads the buffer (a write) or fills it from a file first touches each
//!   page of it (for writing, with an atomic OR of zero, where the kernel will write:
//!   a read would leave a clean folio write-protected); if the kernel still meets a
//!   missing page (EFAULT), the call is redone through a bounce buffer of plain memory
//!   of uzswap's own heap, copied in user mode where every fault is served;
//! - a receive (a socket, a pipe, a terminal) always goes through the bounce buffer:
//!   the kernel drops a datagram it fails to copy, so there is no second try;
//! - stdio goes through the bounce buffer a piece at a time, under the stream's lock;
//!   a stream's own buffer in managed memory is held in place across the call, and a
//!   stream opened with its FILE in managed memory (the program's allocator maps its
//!   own: jemalloc), and then stdout, get a buffer of uzswap's heap instead, so that
//!   no stdio call flushes or fills a buffer that went out (proc.rs `give_buffer`).
//!
//! read/write/pread/pwrite on anything but a socket go in 1 MiB pieces, each
//! touched first, since a buffer larger than the budget is never resident all at once
//! (a write goes on until all is written, as a blocking write does; a read stops early
//! only where a short read is allowed: pipes, terminals, or end of file); readv,
//! writev, preadv and pwritev likewise, a vector of more than 1 MiB buffer by buffer.
//! Other system calls (preadv2, io_uring, O_DIRECT, printf of a long managed string
//! ...) are not wrapped: use the thread path for them.
//! The SIGBUS path needs its own SIGBUS handler (see Signals).
//!
//! # fork and exec
//! fork (followed with pthread_atfork handlers, so that the forks inside forkpty and
//! daemon are seen too, registered before anyone else's; proc.rs): every folio is
//! held and the regions made inheritable for the duration of the fork (runtime
//! fork.rs `hold_for_fork`); with `fork_carry` the swapped-out folios of malloc'd and mmap'd
//! ranges stay out, and everything else is brought back.
//! In the child uzswap's descriptors are closed, it forgets its parent's runtime (a copy
//! whose threads do not exist) and starts one of its own, which takes over those
//! ranges (its store borrows their swapped-out folios' records, still encoded), joins
//! the group and adopts the heaps it inherited; what the parent had in other regions
//! stays plain memory in the child, counted as not managed. exec:
//! LD_PRELOAD and the UZSWAP_* variables carry over, and the new program starts a
//! fresh runtime with the same settings, which joins the
//! group `uzswap run` made (`UZSWAP_GROUP`; runtime group.rs) and takes back the
//! slot the process had before exec. The group's share of the budget is left at
//! exit (`at_exit`); a process that dies without exit handlers is reaped by
//! `uzswap run`.
//!
//! # Signals
//! uzswap uses one signal, SIGBUS, and only on the SIGBUS path: the kernel raises it
//! for a fault on a missing page of a managed region, and the runtime's handler
//! (SA_ONSTACK, as Go asks; its work runs on a stack of its own) resolves it. Anything
//! else is the program's: its SIGBUS disposition is kept aside, reported back by
//! sigaction as installed, and served as the kernel would (proc.rs `dispatch`: sa_mask,
//! SA_RESETHAND, SA_NODEFER, the default action, kill/raise). The thread path uses no
//! signal. uzswap's threads block every signal from birth, so process-directed signals
//! reach the program's threads only; `uzswap run` passes its own signal mask and
//! ignored dispositions on to the program unchanged.
//!
//! # Descriptors
//! The runtime's descriptors sit at the top of the descriptor limit, close-on-exec;
//! close, close_range, closefrom, dup2 and dup3 leave them alone (fd.rs), and the
//! runtime restores any a raw system call closes (runtime fds.rs).
//!
//! # Exit
//! An atexit handler writes the final counters where the `stats` setting says: "stderr"
//! (a kernel-style summary), a file (one JSON object per process, appended; `uzswap run`
//! prints it), or "none". Where the kernel's accesses fail (`kernel_faults_fail`) it
//! first stops the reclaimer for good and brings in every stdio stream's buffer:
//! libc flushes them after it, with system calls no preload sees (proc.rs).

// Every unsafe block says why it is sound, every unsafe fn what it asks of callers.
// unsafe_op_in_unsafe_fn is left off: nearly every function here is an interposed
// `unsafe extern "C"` entry point whose whole body works under the C contract that its
// `# Safety` section states.
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

mod alloc;
mod cover;
mod creds;
mod fd;
mod map;
mod own;
mod proc;
mod real;
mod table;

use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::OnceLock;
use uzswap_runtime::shim_support::Settings;
use uzswap_runtime::{FaultPath, Runtime};

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// True while shim (or runtime) code runs on this thread: interposed calls go to libc.
pub(crate) fn inside() -> bool {
    // A thread being torn down has no TLS left: treat it as inside (plain libc).
    INSIDE.try_with(|c| c.get()).unwrap_or(true)
}

/// Marks this thread as inside the shim until dropped.
pub(crate) struct Inside(bool);
impl Inside {
    pub fn enter() -> Inside {
        Inside(INSIDE.with(|c| c.replace(true)))
    }
    /// For threads that run shim code only: never leaves.
    pub fn forever() {
        INSIDE.with(|c| c.set(true));
    }
}
impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.0));
    }
}

// STATE: what the shim does for this process.
const UNINIT: u8 = 0; // before our constructor ran: forward everything
const PASSIVE: u8 = 1; // no budget, bad settings, runtime failed, or a forked child
const ARMED: u8 = 2; // settings good; the runtime is starting (shim_init)
const ACTIVE: u8 = 3; // runtime running
static STATE: AtomicU8 = AtomicU8::new(UNINIT);
/// Requests of at least this many bytes are managed (meaningful once ARMED).
pub(crate) static THRESHOLD: AtomicUsize = AtomicUsize::new(usize::MAX);
/// The process that started the runtime (a forked child is not it).
static OWNER: AtomicU32 = AtomicU32::new(0);
static SETTINGS: OnceLock<Settings> = OnceLock::new();
/// The group to join (`uzswap run`'s ledger), read once from the environment before
/// main: a forked child, which starts its runtime inside fork, must not read the
/// environment there (another thread of the parent may have held its lock).
static GROUP: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
/// The runtime's configuration, made once before main for the same reason (the
/// backing file's directory is looked up in the environment and on disk).
static CONFIG: OnceLock<uzswap_runtime::RuntimeConfig> = OnceLock::new();
/// This process's runtime, leaked (it lives as long as the process). A forked child
/// replaces its parent's, whose threads did not come with it.
static RUNTIME: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());

/// Whether requests of `len` bytes from the program (not from inside) may be managed.
#[inline]
pub(crate) fn wants(len: usize) -> bool {
    len >= THRESHOLD.load(Relaxed) && STATE.load(Relaxed) >= ARMED && !inside()
}

pub(crate) fn settings() -> &'static Settings {
    SETTINGS.get().expect("settings are parsed before the shim is armed")
}

/// Whether the kernel's own accesses to a missing page of managed memory fail with
/// EFAULT instead of waiting for it: on the SIGBUS path, and with a userfaultfd for
/// user-mode faults only (the access every user has). System calls on managed
/// buffers then need the shim's help (proc.rs `with_buffer`).
pub(crate) fn kernel_faults_fail() -> bool {
    STATE.load(Relaxed) == ACTIVE && KERNEL_FAULTS_FAIL.load(Relaxed)
}
static KERNEL_FAULTS_FAIL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The runtime (started by `shim_init`, or in a forked child by `restart_in_child`).
/// Call with the Inside guard held.
pub(crate) fn runtime() -> Option<&'static Runtime> {
    if STATE.load(Acquire) < ARMED {
        return None;
    }
    // SAFETY: a pointer from Box::leak in `start_runtime`, never freed.
    unsafe { RUNTIME.load(Acquire).as_ref() }
}

/// Starts this process's runtime (STATE is ARMED): ACTIVE if it starts, else PASSIVE.
fn start_runtime() -> Option<&'static Runtime> {
    let s = settings();
    let mut cfg = CONFIG.get_or_init(|| s.runtime_config()).clone();
    if !s.budget_per_process {
        cfg.group = GROUP.get().cloned().flatten();
    }
    if cfg.fault_path == FaultPath::Sigbus {
        // Before the runtime installs its handler, so that it chains to ours.
        proc::take_over_sigbus();
    }
    let dir = cfg.writeback_dir.clone();
    let rt = Runtime::new(cfg).map_err(|e| match &dir {
        Some(dir) => format!("{e} (writeback directory {})", dir.display()),
        None => e.to_string(),
    });
    match rt {
        Ok(rt) => {
            KERNEL_FAULTS_FAIL.store(s.fault_path == FaultPath::Sigbus || !rt.access().serves_kernel_faults(), Relaxed);
            uzswap_runtime::fds::seal();
            let first = OWNER.swap(std::process::id(), Relaxed) == 0;
            let rt: &'static Runtime = Box::leak(Box::new(rt));
            RUNTIME.store(rt as *const Runtime as *mut Runtime, Release);
            STATE.store(ACTIVE, Release);
            if first {
                // SAFETY: at_exit is an `extern "C" fn()` that lives as long as the
                // process (this library is never unloaded: it is preloaded). A forked
                // child inherits the registration.
                unsafe { libc::atexit(at_exit) };
            }
            Some(rt)
        }
        Err(e) => {
            eprintln!("uzswap: cannot start, running without a budget: {e}");
            STATE.store(PASSIVE, Release);
            None
        }
    }
}

/// What the scan may adopt in place (cover.rs): asked for, and on the thread path;
/// everything with a userfaultfd that serves system calls, only a JVM's or V8's reservations
/// with UFFD_USER_MODE_ONLY. Elsewhere it only measures.
fn may_adopt() -> cover::Adoption {
    if !settings().adopt || settings().fault_path != FaultPath::Thread {
        cover::Adoption::Off
    } else if kernel_faults_fail() {
        cover::Adoption::RuntimeReservations
    } else {
        cover::Adoption::All
    }
}

/// A forked child: nothing is managed until it has a runtime of its own (proc.rs).
pub(crate) fn become_passive() {
    STATE.store(PASSIVE, Release);
}

/// A forked child (proc.rs, after it forgot its parent's runtime): starts a runtime
/// of its own with the same settings, in the same group, takes over the ranges the
/// fork carried (their swapped-out folios stay swapped out, in the child's store),
/// and adopts its memory. The other managed ranges it inherited (brought in for the
/// fork) stay plain memory, counted as not managed.
pub(crate) fn restart_in_child(inherited: uzswap_runtime::fork::Inheritance) {
    cover::forget_in_child();
    RUNTIME.store(std::ptr::null_mut(), Release);
    STATE.store(ARMED, Release);
    // The scan's files first, as at start: placed with the runtime's descriptors.
    let files = cover::Proc::open();
    let rt = start_runtime();
    // Before the scan starts: it must not find these ranges unregistered.
    let (adopted, regions): (Vec<_>, Vec<_>) = inherited.take_over(rt).into_iter().partition(|(_, r)| r.adopted().is_some());
    cover::adopted_in_child(adopted.into_iter().map(|(_, r)| r).collect());
    {
        let mut t = table::TABLE.write();
        for (base, region) in regions {
            let e = t.get_mut(&base).expect("a carried range is in the table");
            // The parent's region, whose runtime is not here: forgotten, not dropped.
            std::mem::forget(std::mem::replace(&mut e.region, region));
            e.orphan = false;
        }
    }
    if let (Some(rt), Some(files)) = (rt, files) {
        cover::start(rt, files, may_adopt());
    }
}

/// Why the program's other memory is not adopted, for the summaries (None: it all may
/// be). The scan says it again once it adopts a JVM's or V8's reservations.
pub(crate) fn not_adopted() -> Option<&'static str> {
    match may_adopt() {
        cover::Adoption::All => None,
        cover::Adoption::Off if !settings().adopt => Some("only big malloc and mmap requests were managed: adoption is off (--adopt no)"),
        cover::Adoption::Off => Some("only big malloc and mmap requests were managed: adoption needs the thread fault path (system calls inside libc touch the heap)"),
        cover::Adoption::RuntimeReservations if cover::adopts_reservations() => Some("with UFFD_USER_MODE_ONLY only the runtime's reservations (a JVM's or V8's heap) were adopted besides big malloc and mmap requests; the rest needs a userfaultfd that serves system calls (see the README)"),
        cover::Adoption::RuntimeReservations => Some("only big malloc and mmap requests were managed: adoption needs a userfaultfd that serves system calls; this one is UFFD_USER_MODE_ONLY (see the README)"),
    }
}

extern "C" fn at_exit() {
    if STATE.load(Acquire) != ACTIVE || OWNER.load(Relaxed) != std::process::id() {
        return;
    }
    let _inside = Inside::enter();
    let Some(rt) = runtime() else { return };
    if kernel_faults_fail() {
        // Output still in a stdio buffer goes out after us, by libc's own write(2):
        // its pages must be there, and stay (proc.rs `bring_in_stdio_buffers`).
        rt.hold_reclaim_for_exit();
        // SAFETY: at exit, on the thread running the exit handlers.
        unsafe { proc::bring_in_stdio_buffers() };
    }
    // The group no longer counts this process (its memory is about to go).
    rt.leave_group();
    let mut st = rt.stats();
    // Its live stats go: `uzswap run` reads those only of a process that ended without
    // exit handlers.
    let _ = std::fs::remove_file(uzswap_runtime::stats_path(std::process::id()));
    // A process that managed nothing (a shell, a helper) leaves no line.
    if table::MANAGED_PEAK.load(Relaxed) == 0 && !st.worth_a_line() {
        return;
    }
    st.managed_peak_bytes = Some(table::MANAGED_PEAK.load(Relaxed) as u64);
    st.command = std::fs::read_to_string("/proc/self/comm").ok().map(|c| c.trim().to_string());
    match settings().stats.as_str() {
        "none" => {}
        "stderr" | "-" => eprint!("{}", st.summary()),
        path => {
            use std::io::Write;
            let line = serde_json::to_string(&st).unwrap_or_default() + "\n";
            // One write with O_APPEND: processes sharing the file do not interleave lines.
            let r = std::fs::OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| f.write_all(line.as_bytes()));
            if let Err(e) = r {
                eprintln!("uzswap: cannot write stats to {path}: {e}");
            }
        }
    }
}

/// Parses the settings from the environment. Runs before main.
extern "C" fn shim_init() {
    let _inside = Inside::enter();
    proc::register_ours_first();
    own::note_image();
    own::note_dtv();
    // Resolve the libc functions while the process is still single-threaded.
    real::resolve_all();
    if let Some(orig) = std::env::var(uzswap_runtime::fds::LIMIT_VAR).ok().and_then(|v| v.parse().ok()) {
        uzswap_runtime::fds::undo_inherited_seal(orig);
    }
    let budget_var = uzswap_runtime::shim_support::SETTINGS.iter().find(|d| d.name == "budget").map(|d| d.env_var());
    if budget_var.is_none_or(|v| std::env::var_os(v).is_none()) && std::env::var_os("UZSWAP_CONFIG").is_none() {
        STATE.store(PASSIVE, Release);
        return;
    }
    let mut s = Settings::default();
    match s.apply_env().and_then(|_| s.validate()) {
        Ok(()) => {
            THRESHOLD.store(s.threshold, Relaxed);
            let _ = GROUP.set(std::env::var_os(uzswap_runtime::group::GROUP_VAR).map(std::path::PathBuf::from));
            let _ = CONFIG.set(s.runtime_config());
            let _ = SETTINGS.set(s);
            STATE.store(ARMED, Release);
            let files = cover::Proc::open();
            // Now, while no lock of the program's is held (see "Structures" above).
            if let (Some(rt), Some(files)) = (start_runtime(), files) {
                if may_adopt() == cover::Adoption::All {
                    // glibc moves the chunks it maps itself with an internal mremap,
                    // which an adopted region cannot follow in part: from the
                    // threshold up we serve them, below it they come from its heaps.
                    // SAFETY: mallopt takes plain integers.
                    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, settings().threshold.min(32 << 20) as i32) };
                    // Heaps grow in steps the scanner adopts before they are written.
                    // SAFETY: as above.
                    unsafe { libc::mallopt(libc::M_TOP_PAD, cover::top_pad(rt.budget())) };
                }
                cover::start(rt, files, may_adopt());
            }
        }
        Err(e) => {
            eprintln!("uzswap: bad settings, running without a budget: {e}");
            STATE.store(PASSIVE, Release);
        }
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = shim_init;
