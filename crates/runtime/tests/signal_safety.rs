//! The SIGBUS fault path is async-signal-safe: a program thread resolves its own fault
//! inside a signal handler, after being interrupted anywhere (in its own malloc,
//! holding its allocator's lock, included), so nothing the handler runs may allocate
//! or free through the global allocator.
//!
//! This binary's global allocator wraps the system allocator and *aborts* (a message
//! written with `write(2)`, then `abort(3)`) when it is called on a thread that is
//! inside the runtime's SIGBUS handler ([`uzswap_runtime::in_fault_handler`]). The
//! tests then swap data out (to the pool and on to a backing file) and fault it back
//! on the SIGBUS path from several threads:
//! - `sigbus_handler_does_not_allocate_*`: threads write distinct patterns to a region
//!   much larger than the budget and read every byte back, allocating and freeing
//!   between touches;
//! - `fault_inside_the_programs_allocator`: the threads' own allocations are served
//!   from a managed region by a small allocator with a spin lock, so its arena is
//!   swapped out and faults while that lock is held: a handler that allocated would
//!   abort here (or, without the check, deadlock on the lock).
//!
//! Skips (printing `SKIP: <reason>`) when userfaultfd is unavailable.

mod common;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Arc, Barrier, Mutex};
use uzswap_runtime::*;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

/// The system allocator, and the arena of `fault_inside_the_programs_allocator`.
struct Checked;

fn die(msg: &str) -> ! {
    // SAFETY: write(2) and abort(3) are async-signal-safe and take plain memory.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::abort()
    }
}

fn check_not_in_handler(what: &str) {
    if in_fault_handler() {
        die(what);
    }
}

thread_local! {
    /// Serve this thread's allocations from the arena (the "program" allocator).
    static USE_ARENA: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards to System, or to the arena, which hands out disjoint blocks of
// the requested size and alignment from a live mapping.
unsafe impl GlobalAlloc for Checked {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check_not_in_handler("FATAL: allocation inside the SIGBUS fault handler\n");
        if USE_ARENA.with(|a| a.get()) {
            if let Some(p) = arena::alloc(layout) {
                return p;
            }
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check_not_in_handler("FATAL: allocation inside the SIGBUS fault handler\n");
        if USE_ARENA.with(|a| a.get()) {
            if let Some(p) = arena::alloc(layout) {
                p.write_bytes(0, layout.size());
                return p;
            }
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        check_not_in_handler("FATAL: deallocation inside the SIGBUS fault handler\n");
        if !arena::free(ptr, layout) {
            System.dealloc(ptr, layout)
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check_not_in_handler("FATAL: reallocation inside the SIGBUS fault handler\n");
        if arena::contains(ptr) || USE_ARENA.with(|a| a.get()) {
            // SAFETY: the caller's contract for realloc; copy then free the old block.
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            return new;
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Checked = Checked;

/// A size-class allocator over one managed region: free blocks are linked through
/// their first word, and the bump pointer and lists sit behind one spin lock. Every
/// alloc and free touches arena memory under that lock, so with the arena swapped
/// out the allocator faults while holding it, as a real malloc would.
mod arena {
    use super::*;

    static BASE: AtomicUsize = AtomicUsize::new(0);
    static LEN: AtomicUsize = AtomicUsize::new(0);
    static LOCK: AtomicBool = AtomicBool::new(false);
    /// Classes of 16 B << c, c < CLASSES (up to 256 KiB).
    const CLASSES: usize = 15;
    struct State {
        next: usize,
        free: [usize; CLASSES],
    }
    static mut STATE: State = State { next: 0, free: [0; CLASSES] };

    /// A fresh arena over `[base, base + len)` (nothing of an earlier one is kept).
    pub fn install(base: usize, len: usize) {
        locked(|s| {
            s.next = 0;
            s.free = [0; CLASSES];
        });
        LEN.store(len, Relaxed);
        BASE.store(base, Release);
    }

    pub fn uninstall() {
        BASE.store(0, Release);
    }

    pub fn contains(p: *mut u8) -> bool {
        let (base, len) = (BASE.load(Acquire), LEN.load(Relaxed));
        base != 0 && (base..base + len).contains(&(p as usize))
    }

    fn class(layout: Layout) -> Option<usize> {
        let size = layout.size().max(layout.align()).max(16).next_power_of_two();
        let c = (size / 16).trailing_zeros() as usize;
        (c < CLASSES).then_some(c)
    }

    fn locked<R>(f: impl FnOnce(&mut State) -> R) -> R {
        while LOCK.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
            std::hint::spin_loop();
        }
        // SAFETY: LOCK gives us STATE exclusively.
        let r = f(unsafe { &mut *std::ptr::addr_of_mut!(STATE) });
        LOCK.store(false, Release);
        r
    }

    pub fn alloc(layout: Layout) -> Option<*mut u8> {
        let base = BASE.load(Acquire);
        let c = class(layout)?;
        if base == 0 {
            return None;
        }
        let size = 16usize << c;
        locked(|s| {
            let head = s.free[c];
            if head != 0 {
                // SAFETY: a free block of ours: its first word links the next one.
                // This read may fault (the block was swapped out) with LOCK held.
                s.free[c] = unsafe { (head as *const usize).read_volatile() };
                return Some(head as *mut u8);
            }
            let at = (base + s.next).next_multiple_of(size);
            if at + size > base + LEN.load(Relaxed) {
                return None;
            }
            s.next = at + size - base;
            Some(at as *mut u8)
        })
    }

    pub fn free(p: *mut u8, layout: Layout) -> bool {
        if !contains(p) {
            return false;
        }
        let c = class(layout).expect("arena blocks have a class");
        locked(|s| {
            // SAFETY: the block is ours again; this write may fault with LOCK held.
            unsafe { (p as *mut usize).write_volatile(s.free[c]) };
            s.free[c] = p as usize;
        });
        true
    }
}

/// One SIGBUS runtime at a time: each test swaps heavily, and two cores are shared.
static SERIAL: Mutex<()> = Mutex::new(());

/// Where written-back folios go: the file in `dir`, or (`remote`) a redis-server's URL.
fn runtime_on(path: FaultPath, budget: usize, dir: &std::path::Path, keep_clean: bool, remote: Option<String>) -> Option<Runtime> {
    let mut cfg = RuntimeConfig::new(budget as u64);
    cfg.fault_path = path;
    cfg.publish_stats = false;
    cfg.keep_clean = keep_clean;
    match remote {
        None => cfg.writeback_dir = Some(dir.to_path_buf()),
        Some(url) => cfg.remote = Some(uzswap_remote::RemoteConfig::new(uzswap_remote::Target::parse(&url).unwrap())),
    }
    cfg.backing_max_bytes = 256 << 20;
    // The pages below compress well: a small pool share makes writeback happen,
    // so loads come from the backing file too.
    cfg.max_pool_percent = 3;
    common::or_skip(Runtime::new(cfg))
}

/// Word `w` of page `page` written by thread `t` in round `round`: distinct per
/// thread and page, and mostly one repeated word so that it compresses.
fn word(t: usize, page: usize, round: u64, w: usize) -> u64 {
    if w < 8 {
        ((t as u64) << 56) ^ (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round.rotate_left(29) ^ w as u64
    } else {
        ((t as u64) << 48) ^ round ^ 0x5A5A_0000
    }
}

fn assert_store_moved(rt: &Runtime) {
    let s = rt.store().stats();
    assert!(
        s.totals.zswpout > 0 && s.totals.zswpin > 0 && s.totals.zswpwb > 0 && s.totals.pswpin > 0,
        "the store swapped out, wrote back and read back from the file: {s:?}"
    );
}

fn handler_does_not_allocate(path: FaultPath, keep_clean: bool, folio: usize) {
    handler_does_not_allocate_to(path, keep_clean, folio, None);
}

fn handler_does_not_allocate_to(path: FaultPath, keep_clean: bool, folio: usize, remote: Option<String>) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let budget = 8 * MIB;
    let Some(rt) = runtime_on(path, budget, dir.path(), keep_clean, remote) else { return };
    let len = 48 * MIB;
    let region = rt.create_region(len, folio).expect("region");
    let base = region.as_ptr() as usize;
    let threads = 4;
    let pages = len / PAGE;
    let barrier = Arc::new(Barrier::new(threads));
    std::thread::scope(|s| {
        for t in 0..threads {
            let barrier = barrier.clone();
            s.spawn(move || {
                let mine = (t..pages).step_by(threads);
                let mut junk: Vec<Box<[u64]>> = Vec::new();
                for round in 1..=2u64 {
                    for p in mine.clone() {
                        let words = (base + p * PAGE) as *mut u64;
                        for w in 0..PAGE / 8 {
                            // SAFETY: inside the live region; each thread has its own pages.
                            unsafe { words.add(w).write_volatile(word(t, p, round, w)) };
                        }
                        // Allocate and free between touches.
                        junk.push(vec![p as u64; 1 + p % 61].into_boxed_slice());
                        if junk.len() > 32 {
                            junk.drain(..16);
                        }
                    }
                    barrier.wait();
                    for p in mine.clone() {
                        let words = (base + p * PAGE) as *const u64;
                        for w in 0..PAGE / 8 {
                            // SAFETY: as above.
                            let got = unsafe { words.add(w).read_volatile() };
                            assert_eq!(got, word(t, p, round, w), "thread {t} page {p} word {w} round {round}");
                        }
                        let b = Box::new([p; 7]);
                        assert_eq!(b[6], p);
                        junk.push(vec![round; 1 + p % 13].into_boxed_slice());
                        if junk.len() > 32 {
                            junk.drain(..16);
                        }
                    }
                    barrier.wait();
                }
            });
        }
    });
    assert_store_moved(&rt);
    eprintln!("keep_clean {keep_clean} folio {folio}: {:?}", rt.store().stats().totals);
}

#[test]
fn sigbus_handler_does_not_allocate_exclusive_loads() {
    handler_does_not_allocate(FaultPath::Sigbus, false, 16384);
}

#[test]
fn sigbus_handler_does_not_allocate_kept_clean() {
    handler_does_not_allocate(FaultPath::Sigbus, true, 65536);
}

/// The thread path: the reader thread, which serves every fault, allocates nothing
/// once started (it counts as "in the handler" for the checking allocator).
#[test]
fn reader_does_not_allocate_exclusive_loads() {
    handler_does_not_allocate(FaultPath::Thread, false, 16384);
}

#[test]
fn reader_does_not_allocate_kept_clean() {
    handler_does_not_allocate(FaultPath::Thread, true, 65536);
}

/// With a remote tier (uzswap-remote) instead of the file: a fault's read goes through
/// the tier's reader thread and allocates nothing on the faulting side, in the handler
/// as in the userfaultfd reader.
#[test]
fn sigbus_handler_does_not_allocate_reading_from_redis() {
    let Some(server) = uzswap_remote::testing::Server::start(&[]) else { return };
    handler_does_not_allocate_to(FaultPath::Sigbus, false, 16384, Some(server.url()));
}

#[test]
fn reader_does_not_allocate_reading_from_redis() {
    let Some(server) = uzswap_remote::testing::Server::start(&[]) else { return };
    handler_does_not_allocate_to(FaultPath::Thread, true, 65536, Some(server.url()));
}

/// More threads fault at once than the reader holds messages for (`PENDING` in
/// fault.rs), each on a swapped-out page of its own: rather than grow its buffers, the
/// reader hands the faults it put off longest back to the kernel (they fault again),
/// and this binary's allocator aborts if it allocates. Every thread gets its data.
#[test]
fn reader_does_not_allocate_with_more_faults_than_it_holds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let Some(rt) = runtime_on(FaultPath::Thread, 2 * MIB, dir.path(), true, None) else { return };
    let (folio, threads) = (16 << 10, 600);
    let region = rt.create_region(threads * folio, folio).expect("region");
    let base = region.as_ptr() as usize;
    let at = |t: usize| (base + t * folio) as *mut u64;
    for t in 0..threads {
        for w in 0..PAGE / 8 {
            // SAFETY: inside the live region.
            unsafe { at(t).add(w).write_volatile(word(t, t, 1, w)) };
        }
    }
    // With the reclaimer held, the faults past the throttle limit wait for room (up
    // to its 100 ms each) on the reader's pending list: all of them at once. Let go
    // after a while, so that they end sooner (they would anyway, over the budget).
    rt.pause_reclaimer(true);
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        s.spawn(|| {
            barrier.wait();
            std::thread::sleep(std::time::Duration::from_millis(300));
            rt.pause_reclaimer(false);
        });
        for t in 0..threads {
            let barrier = &barrier;
            std::thread::Builder::new()
                .stack_size(64 << 10)
                .spawn_scoped(s, move || {
                    barrier.wait();
                    for w in 0..PAGE / 8 {
                        // SAFETY: as above.
                        assert_eq!(unsafe { at(t).add(w).read_volatile() }, word(t, t, 1, w), "thread {t} word {w}");
                    }
                })
                .unwrap();
        }
    });
    let s = rt.store().stats().totals;
    assert!(s.zswpin + s.pswpin >= threads as u64 / 2, "most pages came back from the store: {s:?}");
}

#[test]
fn fault_inside_the_programs_allocator() {
    fault_inside_allocator(FaultPath::Sigbus);
}

#[test]
fn fault_inside_the_programs_allocator_thread_path() {
    fault_inside_allocator(FaultPath::Thread);
}

fn fault_inside_allocator(path: FaultPath) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let budget = 8 * MIB;
    let Some(rt) = runtime_on(path, budget, dir.path(), false, None) else { return };
    let len = 64 * MIB;
    let region = rt.create_region(len, 16384).expect("region");
    arena::install(region.as_ptr() as usize, len);
    let threads = 4;
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..threads {
            let failed = &failed;
            s.spawn(move || {
                USE_ARENA.with(|a| a.set(true));
                // Live blocks, each filled with a pattern naming it; the Vec of them
                // lives in the arena too.
                let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
                let mut x = 0x2545_F491_4F6C_DD1Du64 ^ t as u64;
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let mut bytes = 0usize;
                for id in 0..5_000u64 {
                    let r = next();
                    // Keep about 10 MiB live per thread: 40 MiB over an 8 MiB budget.
                    if bytes > 10 * MIB || (r % 3 == 0 && !live.is_empty()) {
                        let i = (next() as usize) % live.len();
                        let (tag, v) = live.swap_remove(i);
                        if v.iter().any(|&w| w != tag) {
                            failed.store(true, Relaxed);
                        }
                        bytes -= v.len() * 8;
                    }
                    let words = 1 + (r as usize >> 8) % 8192;
                    let tag = (t as u64) << 56 | id;
                    live.push((tag, vec![tag; words]));
                    bytes += words * 8;
                }
                for (tag, v) in &live {
                    if v.iter().any(|w| w != tag) {
                        failed.store(true, Relaxed);
                    }
                }
                drop(live);
                USE_ARENA.with(|a| a.set(false));
            });
        }
    });
    arena::uninstall();
    assert!(!failed.load(Relaxed), "a block of the arena came back with wrong bytes");
    if path == FaultPath::Sigbus {
        assert_store_moved(&rt);
    } else {
        // Slower here (a round trip per fault): swapping in and out is what counts.
        let s = rt.store().stats();
        assert!(s.totals.zswpout > 0 && s.totals.zswpin > 0, "the store swapped out and in: {s:?}");
    }
    eprintln!("arena: {:?}", rt.store().stats().totals);
    drop(region);
}
