//! Whole-program coverage: the program's private anonymous memory that never came
//! through a malloc or mmap request we serve (glibc's brk heap and arenas, grown by
//! calls inside libc; allocators' own mappings, jemalloc's extents; runtimes that call
//! the kernel directly, Go; reservations committed with mprotect or MAP_FIXED, the JVM
//! and V8) is found where it is and adopted in place (runtime `adopt_region`).
//!
//! How: a scanner thread reads /proc/self/maps every `PERIOD` (sooner after the program
//! maps memory through libc, or once its anonymous memory grew by a `growth_step`: a
//! brk heap or a runtime's arena grows unmanaged between two scans) and adopts, whole
//! folios at a time, every private anonymous read-write mapping of at least `MIN_ADOPT` (up to `MAX_ADOPTED` of them)
//! that is not:
//! - uzswap's own (own.rs records every mapping uzswap's code makes; regions and their
//!   shadows are also registered with a userfaultfd, which smaps shows);
//! - a thread's stack (`[stack]`, and every mapping holding the stack pointer a thread
//!   had when it started: own.rs), or grows down;
//! - locked (mlock, MAP_LOCKED), shared, hugetlb, I/O, or registered with a
//!   userfaultfd (ours or the program's) (smaps `VmFlags`).
//!
//! After that the kernel's events follow it whatever the program does: munmap, brk
//! shrinking or MAP_FIXED over it (UNMAP), MADV_DONTNEED/FREE (REMOVE), mremap (REMAP;
//! through libc, the region is released first, since a partial move cannot be
//! followed). A region the program has unmapped entirely is dropped at the next scan.
//!
//! All of that only where the kernel waits for faults that system calls take (the
//! thread path with a userfaultfd that serves them, [`Adoption::All`]): libc's own
//! system calls on its heap (stdio's buffered write, readdir's getdents, a futex word)
//! would otherwise fail with EFAULT on swapped-out memory, which no wrapper can help.
//! With UFFD_USER_MODE_ONLY on the thread path ([`Adoption::RuntimeReservations`]) only
//! what a JVM or Node's V8 reserved through libc (mmap PROT_NONE: the JVM's heap,
//! metaspace, code cache and collector's tables; V8's heap pages) and then committed
//! is adopted: their objects reach the kernel only through copies into native memory
//! or through the calls the shim wraps (proc.rs, which then helps calls on these
//! reservations as on managed ranges), and neither keeps a futex, stdio buffer or
//! directory stream there. Go reserves the same way but makes its system calls itself,
//! on its heap: reservations are adopted only in a process that runs one of those two
//! (`reserving_runtime`). Elsewhere nothing is adopted and the summary says so.

use crate::{own, Inside};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::time::Duration;
use uzswap_runtime::ranges::PageRanges;
use uzswap_runtime::{MemoryKind, Region, Runtime};

const PERIOD: Duration = Duration::from_millis(200);
/// How often, between scans, the program's growth is looked at (statm: a read of a
/// few counters). Go fills 256 MiB in 100 ms: looked at every 25 ms, a 64 MiB budget
/// peaked at 102 MiB (median of 40 runs; 150 and 269 at worst), every 5 ms at 65
/// (87 at worst in 20). sqlite3's brk heap (1M rows) and the CPU time: the same.
const GROWTH_CHECKS: u32 = 40;
const PAGE: usize = 4096;
/// A scan comes sooner once the program's anonymous memory (statm, which costs no
/// walk of the page tables, unlike smaps) grew this much since the last one: a
/// sixteenth of the budget, at least 2 MiB. Memory grown between scans counts
/// against the budget and cannot be swapped out until adopted: sqlite3 building a
/// table in its brk heap, or cc1, ran 15-20% over their budgets with scans 200 ms apart.
fn growth_step(budget: u64) -> u64 {
    (budget / 16).max(2 << 20)
}

/// glibc's top pad (`M_TOP_PAD`) while heaps are adopted: the budget, from 2 to 64
/// MiB. glibc grows its brk heap and arenas by what a request needs plus this pad (128
/// KiB by default), and memory grown between two scans is unmanaged until the next:
/// a heap grown a little at a time keeps a tail of fresh unmanaged pages. With a large
/// pad the heap grows in big steps of untouched pages, adopted before the program
/// writes most of them: Python filling 440 MiB of bytearrays under 64M peaked at
/// 98-114 MiB (group peak, 6 runs; 118-129 with the default pad). Untouched pad costs
/// nothing but address space; glibc trims the top back past it as before.
pub(crate) fn top_pad(budget: u64) -> i32 {
    budget.clamp(2 << 20, 64 << 20) as i32
}
/// Smaller mappings are left alone: each region costs a shadow and a slot. V8 maps its
/// heap one page at a time: 256 KiB for small objects, and a page of its own, just over
/// 128 KiB and up, for each large one (an array of 16k elements: 136 KiB). At 256 KiB
/// here, Node holding such arrays had 13% of its memory managed.
const MIN_ADOPT: usize = 128 << 10;
/// Regions adopted at most (the runtime has 4096 slots; the rest are the shim's).
const MAX_ADOPTED: usize = 3072;

struct Adopted {
    len: usize,
    region: Region,
    fork: ForkCopy,
}

/// What a forked child gets of an adopted region, as far as the program said (its
/// `VmFlags` when adopted, its madvise through libc since).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ForkCopy {
    /// All of it, as it is: its swapped-out folios may be carried (runtime fork.rs).
    Whole,
    /// None of it (MADV_DONTFORK over all of it: V8 marks its heap so). Its swapped-out
    /// folios stay out in the parent, untouched by the fork: the child has no mapping
    /// there, and its take-over leaves out what it does not map (runtime fork.rs
    /// `take_over`). Brought back, every spawn of a child process by Node (libuv forks)
    /// held the whole heap at once: 1.2 s and twice the budget a fork.
    Nothing,
    /// Some of it, or wiped (MADV_WIPEONFORK): brought back before the fork.
    Part,
}

impl ForkCopy {
    fn from_flags(flags: &str) -> ForkCopy {
        let has = |want: &str| flags.split_ascii_whitespace().any(|f| f == want);
        if has("wf") {
            ForkCopy::Part
        } else if has("dc") {
            ForkCopy::Nothing
        } else {
            ForkCopy::Whole
        }
    }

    /// After the program's madvise `advice` over `[lo, hi)` of the region `[b, e)`.
    fn advised(self, advice: i32, lo: usize, hi: usize, b: usize, e: usize) -> ForkCopy {
        let all = lo <= b && e <= hi;
        match (self, advice) {
            (ForkCopy::Whole | ForkCopy::Nothing, libc::MADV_DONTFORK) if all => ForkCopy::Nothing,
            (ForkCopy::Nothing, libc::MADV_DONTFORK) => ForkCopy::Nothing,
            _ => ForkCopy::Part,
        }
    }
}

/// A spin lock (yielding): a fork's child must be able to let go of it by hand (a
/// forked bash hung at its next fork when this was a parking_lot lock, which hands the
/// lock on release to a parked thread of the parent's, not in the child).
static ADOPTED: spin::mutex::SpinMutex<Vec<Adopted>, spin::relax::Yield> = spin::mutex::SpinMutex::new(Vec::new());
/// The /proc files of the scan running now (its descriptors), for a forked child to
/// close: they name its parent.
static PROC_FDS: [std::sync::atomic::AtomicI32; 4] = [const { std::sync::atomic::AtomicI32::new(-1) }; 4];

/// ADOPTED for the scan thread, which waits without spinning: a fork holds the lock
/// from its prepare handler to its parent handler, which may wait for the child (the
/// records it reads from the backing file), and a scan yielding in a loop meanwhile
/// was a third of the process tree's CPU samples (perf, forking a 384 MiB program).
fn lock_for_scan() -> spin::mutex::SpinMutexGuard<'static, Vec<Adopted>> {
    loop {
        if let Some(guard) = ADOPTED.try_lock() {
            return guard;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Before fork (proc.rs `prepare`): the list of adopted regions is held across it, so
/// that the child's copy is whole (the scan may be adopting as the program forks).
pub(crate) fn hold_for_fork() {
    std::mem::forget(ADOPTED.lock());
}

/// Whether a fork now may leave the swapped-out folios of the adopted region at `base`
/// (`len` bytes) out (proc.rs `prepare`): it reaches the child whole, or not at all
/// (`ForkCopy`), and `rw` (the program's private read-write anonymous mappings, from
/// /proc/self/maps) has it in one piece, so no protection changed within it.
///
/// # Safety
/// The caller holds the list (`hold_for_fork`, on this thread).
pub(crate) unsafe fn may_carry(base: usize, len: usize, rw: &[(usize, usize)]) -> bool {
    // SAFETY: the caller's contract: the list is locked by this thread.
    let list = unsafe { &*ADOPTED.as_mut_ptr() };
    list.iter().any(|a| a.fork != ForkCopy::Part && a.region.as_ptr() as usize == base && a.len == len)
        && rw.iter().any(|&(s, e)| s <= base && base + len <= e)
}

/// The program gave fork advice (MADV_DONTFORK, MADV_DOFORK, MADV_WIPEONFORK,
/// MADV_KEEPONFORK) over `[lo, hi)` through libc (map.rs), before the call: an adopted
/// region it meets may no longer reach a child as it did.
pub(crate) fn fork_advice(lo: usize, hi: usize, advice: i32) {
    for a in lock_for_scan().iter_mut() {
        let b = a.region.as_ptr() as usize;
        if b < hi && lo < b + a.len {
            a.fork = a.fork.advised(advice, lo, hi, b, b + a.len);
        }
    }
}

/// In a forked child: the adopted regions it took over from its parent
/// (`restart_in_child`), listed as its own.
pub(crate) fn adopted_in_child(regions: Vec<Region>) {
    let mut list = ADOPTED.lock();
    for region in regions {
        let len = region.len();
        list.push(Adopted { len, region, fork: ForkCopy::Whole });
    }
}

/// The private read-write anonymous mappings of the process, from /proc/self/maps
/// (empty if it cannot be read): what a fork may carry adopted regions within.
pub(crate) fn rw_mappings() -> Vec<(usize, usize)> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return Vec::new() };
    // Neighbouring lines with the same flags are one piece for this purpose.
    let mut out: Vec<(usize, usize)> = Vec::new();
    for l in candidates(&maps) {
        match out.last_mut() {
            Some(last) if last.1 == l.start => last.1 = l.end,
            _ => out.push((l.start, l.end)),
        }
    }
    out
}

/// After fork, in the parent.
pub(crate) fn resume_after_fork() {
    // SAFETY: `hold_for_fork` locked it on this thread and forgot the guard.
    unsafe { ADOPTED.force_unlock() };
}

/// After fork, in the child (held by `hold_for_fork`): the parent's adopted regions
/// are forgotten, not dropped (their runtime is not here: the memory is plain again),
/// and the parent's scan's /proc files closed.
pub(crate) fn forget_in_child() {
    own::forget_in_child();
    // SAFETY: the lock is held by `hold_for_fork`, on this thread, the only one.
    unsafe { ADOPTED.force_unlock() };
    for a in ADOPTED.lock().drain(..) {
        std::mem::forget(a.region);
    }
    let me = format!("/proc/{}/", std::process::id());
    for fd in &PROC_FDS {
        let fd = fd.swap(-1, Relaxed);
        // Still the parent's /proc file (the program may have closed it, and the
        // number may be the program's now: then it is not ours to close).
        let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else { continue };
        let t = target.to_string_lossy();
        if fd >= 0 && t.starts_with("/proc/") && !t.starts_with(&me) && ["/maps", "/smaps", "/smaps_rollup", "/statm"].iter().any(|f| t.ends_with(f)) {
            // SAFETY: a descriptor of the parent's scan, which is not here to use it.
            unsafe { libc::close(fd) };
        }
    }
}
/// What the scan may adopt (module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Adoption {
    /// Nothing: it only measures.
    Off,
    /// Every mapping that qualifies.
    All,
    /// Only mappings inside reservations the program made (`RESERVED`), in a process
    /// that runs a JVM or V8 (`reserving_runtime`).
    RuntimeReservations,
}

// ---- Reservations (for `Adoption::RuntimeReservations`). ----

/// Whether this process runs a runtime whose reservations may be adopted with
/// UFFD_USER_MODE_ONLY (module comment): the JVM (libjvm.so in /proc/self/maps) or
/// Node (its executable, node or nodejs, or libnode.so; V8 is linked into it). Other V8
/// embedders are not known here, and are left alone.
fn reserving_runtime(maps: &str) -> bool {
    let node = std::fs::read_link("/proc/self/exe").is_ok_and(|exe| exe.file_name().is_some_and(|n| n == "node" || n == "nodejs"));
    node || maps.lines().any(|l| l.ends_with("/libjvm.so") || l.contains("/libnode.so"))
}

/// The reservations the program made through libc (mmap of PROT_NONE private anonymous
/// memory, MIN_ADOPT or more, not MAP_FIXED), as munmap through libc leaves them.
/// Atomics only (uzswap-runtime `ranges`): an interposed mmap or munmap may run in a
/// forked child whose other threads vanished mid-call, and `maybe_reserved` reads it on
/// every system call the shim helps. One not kept (no slot left) is never adopted. V8
/// reserves a page of its own for each large object (2,000 arrays of 16k elements:
/// 2,000 reservations), so there are many.
static RESERVED: PageRanges<8192> = PageRanges::new();

/// The program reserved `[p, p + len)` (mmap PROT_NONE through libc, not MAP_FIXED).
pub(crate) fn program_reserved(p: usize, len: usize) {
    if len >= MIN_ADOPT && p.is_multiple_of(PAGE) {
        RESERVED.record(p, p + len.next_multiple_of(PAGE));
    }
}

/// The program unmapped `[start, end)` (page-aligned) through libc.
pub(crate) fn program_unmapped(start: usize, end: usize) {
    RESERVED.forget(start, end);
}

/// Set by the scan once it adopts reservations (`Adoption::RuntimeReservations`, in a
/// JVM or Node).
static ADOPTS_RESERVATIONS: AtomicBool = AtomicBool::new(false);

/// Whether `[p, p + len)` may hold adopted memory that system calls need help with
/// (proc.rs `needs_help`): it meets a reservation, in a process whose reservations are
/// adopted. Async-signal-safe: atomic loads.
pub(crate) fn maybe_reserved(p: usize, len: usize) -> bool {
    ADOPTS_RESERVATIONS.load(Relaxed) && RESERVED.meets(p, p.saturating_add(len))
}

/// Whether this process's reservations are adopted (the exit summary says so).
pub(crate) fn adopts_reservations() -> bool {
    ADOPTS_RESERVATIONS.load(Relaxed)
}

/// Set when the program maps memory through libc: scan soon.
static NUDGE: AtomicBool = AtomicBool::new(false);
/// The program mapped memory through libc (mmap we did not serve).
pub(crate) fn program_mapped() {
    NUDGE.store(true, Relaxed);
}

/// Set when the program forked: measure the unmanaged memory again soon (see
/// [`forked`]).
static FORKED: AtomicBool = AtomicBool::new(false);
/// The program forked (in the parent, after fork). The child shares the parent's
/// pages, and each is charged half of them by PSS; the child measures at its first
/// scan, and the parent, measured before the fork, would count its half again until
/// its next scan (a forked Python child that sleeps: the group read 56-60 MiB under
/// 48M for a tree at 49-53). Measured a few milliseconds after the fork, not in
/// it: a child that execs at once shares nothing by then, and a parent that forks
/// and execs in a loop (a shell, a build) would count half its memory otherwise.
pub(crate) fn forked() {
    FORKED.store(true, Relaxed);
}

/// The program made `len` bytes writable (mprotect): a reservation committed, which
/// the scan adopts if it is big enough. Async-signal-safe.
pub(crate) fn program_committed(len: usize) {
    if len >= MIN_ADOPT {
        NUDGE.store(true, Relaxed);
    }
}

/// The /proc files the scan reads, opened once before the runtime starts (so that they
/// sit with its descriptors above the sealed limit): opening them on every scan would
/// take the lowest free descriptor for a moment, one the program may be about to get.
pub(crate) struct Proc {
    maps: OwnedFd,
    smaps: OwnedFd,
    rollup: OwnedFd,
    statm: OwnedFd,
}

impl Proc {
    pub fn open() -> Option<Proc> {
        // Placed high but not registered: nothing is lost if the program closes them
        // (the runtime would stop the program for a registered one it cannot
        // restore); the scan then just ends.
        let open = |p: &str| {
            let fd = uzswap_runtime::fds::place(OwnedFd::from(std::fs::File::open(p).ok()?));
            uzswap_runtime::fds::unregister(fd.as_raw_fd());
            Some(fd)
        };
        Some(Proc {
            maps: open("/proc/self/maps")?,
            smaps: open("/proc/self/smaps")?,
            rollup: open("/proc/self/smaps_rollup")?,
            statm: open("/proc/self/statm")?,
        })
    }
}

/// The whole of a /proc file now (read again from the start).
fn read_all(fd: &OwnedFd) -> Option<String> {
    let mut out = Vec::with_capacity(64 << 10);
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // SAFETY: pread into `buf`, which we own, of at most its length.
        let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), out.len() as libc::off_t) };
        match n {
            0 => return String::from_utf8(out).ok(),
            n if n > 0 => out.extend_from_slice(&buf[..n as usize]),
            _ => return None,
        }
    }
}

/// Starts the scanner. It adopts what `adopt` allows (see the module comment); with
/// `Adoption::Off` it only measures the memory it would have adopted, so that the
/// budget counts it (a memory cgroup would).
pub(crate) fn start(rt: &'static Runtime, files: Proc, adopt: Adoption) {
    rt.set_not_adopted(crate::not_adopted());
    for (slot, fd) in PROC_FDS.iter().zip([&files.maps, &files.smaps, &files.rollup, &files.statm]) {
        slot.store(fd.as_raw_fd(), Relaxed);
    }
    let _ = uzswap_runtime::spawn_thread("uzswap-scan", Some(256 << 10), move || {
        Inside::forever();
        let mut scan = Scan { files, adopt, closed: false, unfit: HashMap::new() };
        while !scan.closed {
            let anon_before = anon_bytes(&scan.files.statm);
            let began = std::time::Instant::now();
            scan.once(rt);
            // A scan walks the page tables (smaps): its own length apart at least,
            // so a program that keeps growing has at most half a core spent on its
            // scans (Go's 256 MiB: no slower, median peak the same as back to back).
            let rest = began.elapsed();
            while began.elapsed() < rest * 2 && !scan.closed {
                std::thread::sleep((rest * 2).saturating_sub(began.elapsed()).min(PERIOD / GROWTH_CHECKS));
                scan.measure_if_forked(rt);
            }
            let step = growth_step(rt.budget());
            for _ in 0..GROWTH_CHECKS {
                if NUDGE.swap(false, Relaxed) || scan.closed {
                    break;
                }
                std::thread::sleep(PERIOD / GROWTH_CHECKS);
                scan.measure_if_forked(rt);
                if anon_bytes(&scan.files.statm).zip(anon_before).is_some_and(|(now, then)| now >= then + step) {
                    break;
                }
            }
        }
        // Not dropped: an OwnedFd whose number the program closed must not be closed
        // again (std aborts on that, and the number may be the program's by now).
        std::mem::forget(scan.files);
    });
}

/// Gives back, in place, adopted memory overlapping `[start, start + len)` (before the
/// program moves it with mremap).
pub(crate) fn release_overlapping(start: usize, len: usize) {
    let _inside = Inside::enter();
    let mut list = ADOPTED.lock();
    let end = start.saturating_add(len);
    let mut i = 0;
    while i < list.len() {
        let a = &list[i];
        let at = a.region.as_ptr() as usize;
        if at < end && at + a.len > start {
            drop(list.swap_remove(i).region);
        } else {
            i += 1;
        }
    }
}

/// One line of /proc/self/maps: a private anonymous read-write mapping, or not.
struct Line {
    start: usize,
    end: usize,
    heap: bool,
}

fn candidates(maps: &str) -> Vec<Line> {
    let mut out = Vec::new();
    for l in maps.lines() {
        let mut f = l.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(_off), Some(_dev), Some(inode)) = (f.next(), f.next(), f.next(), f.next(), f.next()) else {
            continue;
        };
        let name = f.next().unwrap_or("");
        if perms != "rw-p" || inode != "0" || !(name.is_empty() || name == "[heap]") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else { continue };
        out.push(Line { start, end, heap: name == "[heap]" });
    }
    out
}

/// `VmFlags` of every mapping, by start address.
fn vm_flags(smaps: &str) -> HashMap<usize, String> {
    let mut out = HashMap::new();
    let mut start = None;
    for l in smaps.lines() {
        if let Some(flags) = l.strip_prefix("VmFlags:") {
            if let Some(s) = start.take() {
                out.insert(s, flags.trim().to_string());
            }
            continue;
        }
        // A mapping's first line starts with its range; the others with "Key:".
        let first = l.split_ascii_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(s), Ok(_)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                start = Some(s);
            }
        }
    }
    out
}

/// Flags that keep a mapping out (proc(5)): locked, grows down, hugetlb, I/O or
/// PFN map, registered with a userfaultfd (missing, write-protect, minor), shared.
/// MADV_DONTFORK memory is fine (V8 marks its heap so): a fork leaves it out as asked.
fn excluded_by_flags(flags: &str) -> bool {
    flags.split_ascii_whitespace().any(|f| matches!(f, "lo" | "gd" | "ht" | "io" | "pf" | "um" | "uw" | "ui" | "sh"))
}

struct Scan {
    files: Proc,
    /// What it adopts (`Off`: it only measures).
    adopt: Adoption,
    /// The program closed our /proc files: nothing more is adopted (what was, stays).
    closed: bool,
    /// Candidates found unfit, by (start, end): not looked at again while they stay.
    unfit: HashMap<(usize, usize), ()>,
}

impl Scan {
    fn once(&mut self, rt: &Runtime) {
        self.drop_unmapped();
        if !self.measure(rt) {
            return;
        }
        let reservations_only = self.adopt == Adoption::RuntimeReservations;
        // Nothing to read /proc/self/maps for: no adoption, or only of reservations and
        // the program has made none (most programs, every scan).
        if self.adopt == Adoption::Off || (reservations_only && RESERVED.is_empty()) {
            return;
        }
        let Some(maps) = read_all(&self.files.maps) else {
            // The program closed it (it is not ours to keep: see `Proc::open`). Closing
            // the others would be closing numbers the program may reuse: they are let be.
            self.closed = true;
            return;
        };
        if own::being_made() || own::records_lost() {
            return; // a mapping of ours may be in the text without its record
        }
        let fs = crate::settings().folio_size;
        let adopted = lock_for_scan().len();
        // Whether a region adopted before still has part of `[start, end)`. Where the
        // program unmapped one's folios (a brk heap trimmed), what it maps there next (the
        // heap regrown) is adopted anew.
        let managed = |start: usize, end: usize| lock_for_scan().iter().any(|a| a.region.manages(start, end));
        if reservations_only && !ADOPTS_RESERVATIONS.load(Relaxed) {
            if !reserving_runtime(&maps) {
                return;
            }
            // Before the first adoption: a system call on what is adopted gets help.
            ADOPTS_RESERVATIONS.store(true, Relaxed);
            rt.set_not_adopted(crate::not_adopted());
        }
        let mut fresh = Vec::new();
        for line in candidates(&maps) {
            // Its whole folios: a trimmed heap's regrown line starts inside the torn
            // folio the trim left, which stays the old region's (runtime region.rs).
            if self.unfit.contains_key(&(line.start, line.end)) || managed(line.start.next_multiple_of(fs), line.end / fs * fs) {
                continue;
            }
            // Not marked unfit: the reservation may be recorded by the next scan (the
            // mapping changed since, or a mmap was in flight).
            if reservations_only && (line.heap || !RESERVED.covers(line.start, line.end)) {
                continue;
            }
            if own::holds_stack(line.start, line.end) {
                self.unfit.insert((line.start, line.end), ());
                continue;
            }
            // Whole folios, aligned, around what is ours inside (a thread's DTV in the
            // heap; a mapping wholly ours leaves nothing).
            let mut pieces = 0;
            let mut at = line.start.next_multiple_of(fs);
            for (a, b) in own::within(line.start, line.end).into_iter().chain([(line.end, line.end)]) {
                let end = a / fs * fs;
                if end > at && end - at >= MIN_ADOPT {
                    fresh.push(((line.start, line.end), line.heap, at, end));
                    pieces += 1;
                }
                at = at.max(b.next_multiple_of(fs));
            }
            if pieces == 0 {
                self.unfit.insert((line.start, line.end), ());
            }
        }
        if fresh.is_empty() {
            return;
        }
        let Some(smaps) = read_all(&self.files.smaps) else { return };
        let flags = vm_flags(&smaps);
        let mut count = adopted;
        let before = count;
        for (key, heap, start, end) in fresh {
            if count >= MAX_ADOPTED {
                break;
            }
            let fork = match flags.get(&key.0) {
                Some(f) if !excluded_by_flags(f) => ForkCopy::from_flags(f),
                _ => {
                    self.unfit.insert(key, ());
                    continue;
                }
            };
            // Since /proc/self/maps was read, the program may have unmapped the range
            // and uzswap mapped something of its own there (a pool span), which must
            // never be registered (uzswap's threads would fault on it): looked at
            // again just before the registration, with uzswap's mappings held off
            // until it is done.
            let kind = if heap { MemoryKind::Heap } else { MemoryKind::Mapping };
            let gate = || {
                let held = own::exclude_makers();
                (!own::any_within(start, end)).then_some(held)
            };
            match rt.adopt_region_gated(start, end - start, fs, kind, gate) {
                Ok(region) => {
                    count += 1;
                    lock_for_scan().push(Adopted { len: end - start, region, fork });
                }
                // The mapping changed under us (gone, mprotected, merged), cannot be
                // registered, or is managed already (a mapping that grew while the
                // maps were read shows twice, from the same start: the runtime refuses
                // the second): left alone (its resident memory counts as not managed).
                Err(_) => {
                    self.unfit.insert(key, ());
                }
            }
        }
        // What was just adopted is charged as resident now, and was measured as not
        // managed at the start of this scan: measured again, or it counts twice until
        // the next scan (sqlite3's brk heap, adopted as it grew, had the group's peak
        // read 95 MiB for a process that never held more than 58).
        if count > before {
            self.measure(rt);
        }
        // Forget unfit ranges that are gone, so the table does not grow forever.
        let live: std::collections::HashSet<(usize, usize)> = candidates(&maps).iter().map(|l| (l.start, l.end)).collect();
        self.unfit.retain(|k, _| live.contains(k));
    }

    /// Measures the unmanaged memory again if the program forked since (see [`forked`]).
    fn measure_if_forked(&mut self, rt: &Runtime) {
        if FORKED.swap(false, Relaxed) {
            self.measure(rt);
        }
    }

    /// [`measure_unmanaged`]; false, and the scan closed, if the program closed the file.
    fn measure(&mut self, rt: &Runtime) -> bool {
        self.closed |= !measure_unmanaged(rt, &self.files.rollup);
        !self.closed
    }

    /// Drops the regions whose memory the program has unmapped entirely.
    fn drop_unmapped(&mut self) {
        let gone: Vec<Adopted> = {
            let mut list = lock_for_scan();
            let (gone, kept): (Vec<Adopted>, Vec<Adopted>) = list.drain(..).partition(|a| a.region.all_unmapped());
            *list = kept;
            gone
        };
        drop(gone);
    }
}

/// The process's resident memory that is neither file-backed nor shared (statm's
/// resident less shared: anonymous memory, ours included), bytes; `None` if the file
/// cannot be read. Cheap: the kernel's counters, no walk.
fn anon_bytes(statm: &OwnedFd) -> Option<u64> {
    let mut buf = [0u8; 128];
    // SAFETY: pread into `buf`, which we own, of at most its length.
    let n = unsafe { libc::pread(statm.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let text = std::str::from_utf8(buf.get(..usize::try_from(n).ok()?)?).ok()?;
    let mut fields = text.split_whitespace().skip(1).map(|f| f.parse::<u64>().ok());
    let (resident, shared) = (fields.next()??, fields.next()??);
    Some(resident.saturating_sub(shared) * 4096)
}

/// The program's resident anonymous memory that uzswap does not hold (its anonymous
/// PSS, less what is charged: managed resident folios, the pages of folios on
/// probation, and the pool), handed to the runtime, which counts it against the
/// budget. PSS, as a memory cgroup charges a page once: a forked child shares its
/// parent's pages until either writes, and RssAnon would charge both in full.
/// Managed folios a child shares with its parent (SHARED) are the parent's, charged
/// there in full; the child's PSS holds half of each (while the parent maps it too),
/// which is not the child's to count again: counted, a Python parent of 232 MiB
/// under 256M made each child it forked look 116 MiB big, and the group's peak read
/// 331-394 MiB where its tree's PSS peaked at 242-259. So are the parent's pool
/// mappings a child keeps for the records it borrowed (the parent charges its pool
/// in full): counted, the same program's group peak read 304-323 MiB against its
/// tree's 245.
/// False if the file can no longer be read (the program closed it).
fn measure_unmanaged(rt: &Runtime, rollup: &OwnedFd) -> bool {
    let Some(text) = read_all(rollup) else { return false };
    let field = |name| uzswap_runtime::group::rollup_field(&text, name);
    if let Some(bytes) = field("Pss_Anon:").or_else(|| field("Anonymous:")) {
        let parents = rt.shared_bytes() + rt.borrowed_pool_bytes();
        rt.set_unmanaged(bytes.saturating_sub(rt.charged_bytes() + parents / 2));
    }
    true
}
