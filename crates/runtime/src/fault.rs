//! Fault resolution (shared by both fault paths), the uffd reader thread (faults in
//! thread mode, events in both modes) and the SIGBUS handler.

use crate::region::*;
use crate::stats::bump;
use crate::uffd::{self, Partial, UffdMsg};
use crate::{FaultPath, Shared};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::*};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub(crate) const PAGE: usize = 4096;
/// The longest a fault waits for the reclaimer when usage is over the budget.
const THROTTLE_MAX: Duration = Duration::from_millis(100);

// ---- The region table: lock-free lookup by address, usable from a signal handler. ----

const MAX_REGIONS: usize = 4096;
static TABLE: [AtomicPtr<RegionInner>; MAX_REGIONS] = [const { AtomicPtr::new(null_mut()) }; MAX_REGIONS];
static TABLE_HIGH: AtomicUsize = AtomicUsize::new(0);
/// Lookups in progress: a removed region is freed only once this drops to zero.
static READERS: AtomicUsize = AtomicUsize::new(0);

pub(crate) struct TableGuard;
impl TableGuard {
    pub fn enter() -> TableGuard {
        READERS.fetch_add(1, SeqCst);
        TableGuard
    }
    /// The region containing `addr`. The reference is valid while the guard lives.
    pub fn find(&self, addr: usize, runtime: Option<u64>) -> Option<&RegionInner> {
        let high = TABLE_HIGH.load(Acquire);
        for slot in &TABLE[..high] {
            let p = slot.load(SeqCst);
            if p.is_null() {
                continue;
            }
            // SAFETY: entries stay alive until removed and READERS has drained.
            let r = unsafe { &*p };
            let base = r.base.load(Acquire);
            if addr >= base && addr < base + r.len && runtime.is_none_or(|id| r.shared.id == id) {
                return Some(r);
            }
        }
        None
    }
    /// The region in table slot `slot`, if it belongs to `runtime`.
    pub fn at(&self, slot: usize, runtime: u64) -> Option<&RegionInner> {
        let p = TABLE.get(slot)?.load(SeqCst);
        // SAFETY: as in find.
        (!p.is_null()).then(|| unsafe { &*p }).filter(|r| r.shared.id == runtime)
    }
    pub fn all(&self, runtime: u64) -> impl Iterator<Item = &RegionInner> {
        let high = TABLE_HIGH.load(Acquire);
        TABLE[..high].iter().filter_map(move |slot| {
            let p = slot.load(SeqCst);
            // SAFETY: as in find.
            (!p.is_null()).then(|| unsafe { &*p }).filter(|r| r.shared.id == runtime)
        })
    }
}
impl Drop for TableGuard {
    fn drop(&mut self) {
        READERS.fetch_sub(1, SeqCst);
    }
}

pub(crate) fn table_insert(r: &Arc<RegionInner>) -> bool {
    let p = Arc::as_ptr(r) as *mut RegionInner;
    for (i, slot) in TABLE.iter().enumerate() {
        // Named before it can be found: a fault on it queues it by this slot.
        r.slot.store(i, SeqCst);
        if slot.compare_exchange(null_mut(), p, SeqCst, Relaxed).is_ok() {
            TABLE_HIGH.fetch_max(i + 1, SeqCst);
            return true;
        }
    }
    false
}

/// Removes the region and waits until no lookup can still be using it.
pub(crate) fn table_remove(r: &Arc<RegionInner>) {
    let p = Arc::as_ptr(r) as *mut RegionInner;
    for slot in &TABLE {
        let _ = slot.compare_exchange(p, null_mut(), SeqCst, Relaxed);
    }
    while READERS.load(SeqCst) != 0 {
        std::thread::yield_now();
    }
}

// ---- Resolution. ----

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolve {
    Done,
    /// Cannot finish without waiting (folio busy, a pending event, over budget): the
    /// reader retries later, after reading more messages.
    Defer,
    NotOurs,
}

/// Lock order: the uffd reader thread never waits for anything (it defers instead), so
/// every other thread may wait for the reader (e.g. an ioctl returning EAGAIN until it
/// reads a pending event) while holding a folio lock.
fn may_wait(path: FaultPath, on_reader: bool) -> bool {
    !on_reader && path == FaultPath::Sigbus
}

/// What the faulting access was, as far as we know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    /// The platform does not say (SIGBUS off x86-64): treated as a read where that is
    /// cheaper (a write then faults once more) and as a write where that is safe.
    Unknown,
}

/// Waits, from the time a fault was first seen (`since`), while usage is past the
/// throttle limit and the reclaimer can bring it down: true when the fault may go on,
/// false when it must be retried later (a caller that may not wait). It does not wait
/// when the pool alone is past the limit (evicting folios cannot help: they only move
/// into it; writeback keeps the pool under it), nor for a reclaimer that has nothing
/// to evict or keeps being refused (`reclaim_stuck`), nor longer than THROTTLE_MAX,
/// after which it declares the reclaimer stuck. Async-signal-safe.
fn wait_for_room(sh: &Shared, order: usize, since: Instant, wait: bool) -> bool {
    let st = &sh.stats.sizes[order];
    let mut throttled = false;
    while sh.usage() > sh.throttle_limit() {
        if sh.pool_cached.load(Relaxed) >= sh.throttle_limit() {
            bump(&st.over_budget);
            return true;
        }
        if sh.reclaim_stuck.load(Relaxed) || since.elapsed() >= THROTTLE_MAX {
            sh.reclaim_stuck.store(true, Relaxed);
            bump(&st.over_budget);
            return true;
        }
        if !throttled {
            throttled = true;
            bump(&st.throttled);
        }
        if !wait {
            return false;
        }
        // Sleep rather than spin: the reclaimer needs the CPU. nanosleep is async-signal-safe.
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 20_000 };
        // SAFETY: plain nanosleep.
        unsafe { libc::nanosleep(&ts, null_mut()) };
    }
    true
}

/// Resolves a fault at `addr` in `r`: brings the whole folio back (one COPY or MOVE)
/// and marks it resident, or lifts the write protection of a clean folio. `buf` must
/// hold a folio. `since` is when the fault was first seen (for throttling).
pub(crate) fn resolve(r: &RegionInner, addr: usize, buf: &mut [u8], on_reader: bool, since: Instant, access: Access) -> Resolve {
    let sh = &*r.shared;
    let wait = may_wait(sh.cfg.fault_path, on_reader);
    let base = r.base.load(Acquire);
    if addr < base || addr >= base + r.len {
        return Resolve::NotOurs;
    }
    let idx = (addr - base) >> r.folio_shift;
    let fs = r.folio_size;
    if wait {
        while sh.events_busy.load(SeqCst) {
            // SAFETY: async-signal-safe.
            unsafe { libc::sched_yield() };
        }
    }
    let prev = if wait {
        r.lock(idx)
    } else {
        match r.try_lock(idx) {
            Some(s) => s,
            None => return Resolve::Defer,
        }
    };
    let fs_u64 = fs as u64;
    // Charge first (as a memory cgroup does). The reclaimer runs ahead of the budget
    // (from the high watermark); past the throttle limit a fault waits its turn.
    let charged = prev == EMPTY || prev == SWAPPED;
    if charged {
        sh.resident.fetch_add(fs_u64, Relaxed);
        if sh.usage() > sh.high_watermark() {
            sh.kick_reclaimer();
        }
        if !wait_for_room(sh, r.order(), since, wait) {
            sh.resident.fetch_sub(fs_u64, Relaxed);
            r.unlock(idx, prev);
            return Resolve::Defer;
        }
    }
    let uncharge = || {
        if charged {
            sh.resident.fetch_sub(fs_u64, Relaxed);
        }
    };
    let folio = base + (idx << r.folio_shift);
    let ord = r.order();
    let st = &sh.stats.sizes[ord];
    let keep_clean = sh.cfg.keep_clean;
    let next = match prev {
        UNMAPPED => {
            r.unlock(idx, UNMAPPED);
            return Resolve::NotOurs;
        }
        RESIDENT => {
            // A hole left by MADV_DONTNEED/FREE, a second fault that lost the race to
            // the one that brought the folio in, or a write to a page still protected
            // after its clean copy was dropped: the page reads as zeros, or is there,
            // and is made writable.
            r.drop_kept(idx, false);
            let page = addr & !(PAGE - 1);
            let unprotect = keep_clean && access != Access::Read;
            if fill(sh, page, sh.zeros as *const u8, PAGE, wait).is_err()
                || (unprotect && unprotect_range(sh, page, PAGE, wait).is_err())
            {
                r.unlock(idx, RESIDENT);
                return Resolve::Defer;
            }
            RESIDENT
        }
        POISONED => {
            // On the SIGBUS path this is the poison's own SIGBUS (this kernel sends
            // BUS_ADRERR for it, as for a missing page): the program's. On the thread
            // path only a missing page reaches us: one whose marker a partial
            // MADV_DONTNEED dropped, now a fresh page of zeros.
            if wait {
                r.unlock(idx, POISONED);
                return Resolve::NotOurs;
            }
            let page = addr & !(PAGE - 1);
            if fill(sh, page, sh.zeros as *const u8, PAGE, wait).is_err() {
                r.unlock(idx, POISONED);
                return Resolve::Defer;
            }
            POISONED
        }
        CLEAN if access == Access::Read => CLEAN, // lost the race to the fault that brought it back
        CLEAN => {
            // The first write since a clean reload: the kept copy goes stale, so free it
            // while we hold the lock (nobody can reuse it meanwhile), then let the write in.
            r.drop_kept(idx, false);
            if unprotect_range(sh, folio, fs, wait).is_err() {
                // Still protected: the retry faults as RESIDENT and unprotects then.
                r.unlock(idx, RESIDENT);
                return Resolve::Defer;
            }
            RESIDENT
        }
        EMPTY => {
            r.drop_kept(idx, false);
            if fill(sh, folio, sh.zeros as *const u8, fs, wait).is_err() {
                // Whatever went in reads as zeros, as the rest will: no data to lose.
                uncharge();
                r.unlock(idx, EMPTY);
                return Resolve::Defer;
            }
            bump(&st.zero_fill);
            RESIDENT
        }
        SWAPPED => {
            let key = r.key(idx);
            let buf = &mut buf[..fs];
            // A read keeps the entry as the folio's clean copy (non-exclusive load); a
            // write takes it (exclusive), as the kernel's do_swap_page does.
            let keep = keep_clean && access != Access::Write;
            // A thread that may not wait (the reader) may fail to place the folio: it
            // reads without taking the entry and takes it once the folio is in place,
            // so a failure leaves the entry as it was (nothing to store again).
            let two_step = !keep && !wait;
            let loaded = if keep || two_step { sh.store.read_range(key, 0, buf) } else { sh.store.load(key, buf) };
            match loaded {
                Ok(true) => {}
                Ok(false) => fatal(b"uzswap: swapped folio missing from the store\n"),
                Err(_) => {
                    // Unreadable (an I/O error or a corrupt record in the backing file):
                    // never map wrong bytes. The folio is poisoned as a hardware memory
                    // error would be: its accesses get SIGBUS (BUS_MCEERR_AR).
                    uncharge();
                    if !poison(r, idx, wait) {
                        r.unlock(idx, SWAPPED);
                        return Resolve::Defer;
                    }
                    r.unlock(idx, POISONED);
                    if sh.cfg.fault_path == FaultPath::Thread {
                        sh.uffd.wake(folio, fs);
                    }
                    // SIGBUS path: the access faults again and gets the poison's SIGBUS.
                    return Resolve::Done;
                }
            }
            if fill_protected(sh, folio, buf.as_ptr(), fs, wait, keep).is_err() {
                debug_assert!(keep || two_step, "only a thread that may not wait fails to fill");
                uncharge();
                r.unlock(idx, SWAPPED);
                return Resolve::Defer;
            }
            if two_step {
                sh.store.commit_load(key);
            }
            bump(&st.zswpin);
            if keep {
                bump(&st.zswpin_kept);
                CLEAN
            } else {
                r.kept[idx].store(false, Relaxed);
                st.stored.fetch_sub(1, Relaxed);
                RESIDENT
            }
        }
        PROBATION => {
            let shadow = r.shadow_addr(idx);
            if r.kept[idx].load(Relaxed) && access != Access::Write {
                // Went out clean and is read: copy the pages back protected and keep
                // the entry; no decompression either way.
                if fill_protected(sh, folio, shadow as *const u8, fs, wait, true).is_err() {
                    r.unlock(idx, PROBATION);
                    return Resolve::Defer;
                }
                // SAFETY: our shadow range; the staging context has no REMOVE events.
                unsafe { libc::madvise(shadow as *mut _, fs, libc::MADV_DONTNEED) };
                bump(&st.probation_refault);
                sh.probation.fetch_sub(fs_u64, Relaxed);
                CLEAN
            } else {
                if move_back(sh, folio, shadow, fs, wait).is_err() {
                    r.unlock(idx, PROBATION);
                    return Resolve::Defer;
                }
                // The pages come back writable: a kept copy would go stale.
                r.drop_kept(idx, false);
                bump(&st.probation_refault);
                sh.probation.fetch_sub(fs_u64, Relaxed);
                RESIDENT
            }
        }
        _ => unreachable!("folio state word out of range"),
    };
    bump(&st.faults);
    if next == RESIDENT || next == CLEAN {
        r.unlock_faulted_in(idx, next);
    } else {
        r.unlock(idx, next);
    }
    if sh.cfg.fault_path == FaultPath::Thread {
        sh.uffd.wake(folio, fs);
    }
    Resolve::Done
}

/// Writes to stderr and aborts: used where going on would return wrong data.
/// Async-signal-safe.
pub(crate) fn fatal(msg: &[u8]) -> ! {
    // SAFETY: write(2) and abort(3) are async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::abort()
    }
}

/// Poisons folio `idx` (locked, SWAPPED, its entry unreadable) and frees the entry.
/// False if the poison could not be placed without waiting (the entry then stays and
/// the caller retries). A kernel without UFFDIO_POISON leaves no safe way on: abort.
pub(crate) fn poison(r: &RegionInner, idx: usize, wait: bool) -> bool {
    let sh = &*r.shared;
    let (folio, fs) = (r.folio_addr(idx), r.folio_size);
    let mut off = 0;
    while off < fs {
        match sh.uffd.poison(folio + off, fs - off) {
            Partial::Done => break,
            Partial::Failed { done, .. } if done > 0 => off += done,
            Partial::Failed { errno: libc::EEXIST, .. } => off += PAGE,
            Partial::Failed { errno: libc::EAGAIN, .. } if !wait => return false,
            // SAFETY: async-signal-safe.
            Partial::Failed { errno: libc::EAGAIN, .. } => unsafe {
                libc::sched_yield();
            },
            // The range is gone (munmap raced with us): nothing left to protect.
            Partial::Failed { errno: libc::ENOENT, .. } => break,
            Partial::Failed { .. } => {
                fatal(b"uzswap: a folio could not be read back and UFFDIO_POISON failed: stopping rather than map wrong data\n")
            }
        }
    }
    if r.kept[idx].swap(false, Relaxed) && sh.store.invalidate(r.key(idx)) {
        r.shared.stats.sizes[r.order()].stored.fetch_sub(1, Relaxed);
    }
    bump(&sh.stats.sizes[r.order()].poisoned);
    const MSG: &[u8] = b"uzswap: a swapped-out folio could not be read back (I/O error or corrupt record); poisoned: accesses get SIGBUS\n";
    // SAFETY: write(2) is async-signal-safe.
    unsafe { libc::write(2, MSG.as_ptr().cast(), MSG.len()) };
    true
}

/// UFFDIO_COPY `len` bytes into missing pages at `dst`, skipping pages already present.
/// The caller wakes the range.
/// Err(()) on EAGAIN (an event is pending) when the caller may not wait.
pub(crate) fn fill(sh: &Shared, dst: usize, src: *const u8, len: usize, wait: bool) -> Result<(), ()> {
    fill_protected(sh, dst, src, len, wait, false)
}

/// `fill`, with the pages write-protected when `protect` (the region must be
/// registered for write protection: `keep_clean`).
pub(crate) fn fill_protected(sh: &Shared, dst: usize, src: *const u8, len: usize, wait: bool, protect: bool) -> Result<(), ()> {
    let mut off = 0;
    while off < len {
        // SAFETY: src points to at least len bytes.
        match sh.uffd.copy(dst + off, unsafe { src.add(off) }, len - off, protect) {
            Partial::Done => return Ok(()),
            Partial::Failed { done, .. } if done > 0 => off += done,
            Partial::Failed { errno: libc::EEXIST, .. } => off += PAGE,
            Partial::Failed { errno: libc::EAGAIN, .. } => {
                if !wait {
                    return Err(());
                }
                // SAFETY: async-signal-safe.
                unsafe { libc::sched_yield() };
            }
            // The range is gone (munmap raced with us): nothing to fill.
            Partial::Failed { .. } => return Ok(()),
        }
    }
    Ok(())
}

/// Makes the present pages of `[start, start+len)` writable. Err(()) on EAGAIN when the
/// caller may not wait.
pub(crate) fn unprotect_range(sh: &Shared, start: usize, len: usize, wait: bool) -> Result<(), ()> {
    loop {
        match sh.uffd.write_protect(start, len, false) {
            Ok(()) => return Ok(()),
            Err(libc::EAGAIN) if wait => {
                // SAFETY: async-signal-safe.
                unsafe { libc::sched_yield() };
            }
            Err(libc::EAGAIN) => return Err(()),
            // The range is gone (munmap raced with us): nothing to unprotect.
            Err(_) => return Ok(()),
        }
    }
}

/// Moves a probation folio's pages from the shadow back into the region.
pub(crate) fn move_back(sh: &Shared, dst: usize, src: usize, len: usize, wait: bool) -> Result<(), ()> {
    let mut off = 0;
    while off < len {
        match sh.uffd.move_pages(dst + off, src + off, len - off) {
            Partial::Done => return Ok(()),
            Partial::Failed { done, .. } if done > 0 => off += done,
            Partial::Failed { errno: libc::EAGAIN, .. } => {
                if !wait {
                    return Err(());
                }
                // SAFETY: async-signal-safe.
                unsafe { libc::sched_yield() };
            }
            Partial::Failed { errno: libc::EEXIST, .. } => off += PAGE,
            Partial::Failed { .. } => return Ok(()),
        }
    }
    Ok(())
}

// ---- The reader thread. ----

enum Pending {
    Fault { addr: usize, since: Instant, access: Access },
    Range { event: u8, start: usize, end: usize, since: Instant },
}

/// Reads the region context: page faults (thread mode) and REMOVE/UNMAP/REMAP events
/// (both modes). Never blocks on a folio: whatever cannot finish now is retried.
pub(crate) fn reader_loop(sh: Arc<Shared>) {
    let mut buf = vec![0u8; crate::MAX_FOLIO];
    let mut msgs = [UffdMsg::default(); 64];
    let mut pending: Vec<Pending> = Vec::new();
    let mut fds = [
        libc::pollfd { fd: sh.uffd.raw(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: sh.stop_fd, events: libc::POLLIN, revents: 0 },
    ];
    loop {
        let spin = pending.iter().any(|p| match p {
            Pending::Fault { since, .. } | Pending::Range { since, .. } => since.elapsed() < Duration::from_micros(300),
        });
        let timeout = if pending.is_empty() { 1000 } else if spin { 0 } else { 1 };
        if spin {
            std::thread::yield_now();
        }
        // SAFETY: valid pollfd array.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if sh.stopping() {
            return;
        }
        // Raised before the read that releases a thread blocked in madvise/munmap, and
        // lowered once its range is processed: a SIGBUS fault that follows the madvise
        // waits for it instead of finding the folio's old state.
        sh.events_busy.store(true, SeqCst);
        // No reclaimer MOVE may be under way when a REMOVE is read (the kernel zaps right
        // after); a MOVE that started before never waits for us, so this wait is short.
        sh.removes_in_flight.store(true, SeqCst);
        while sh.moves_in_flight.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
        let n = match sh.uffd.read_msgs(&mut msgs) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("uzswap: reading the userfaultfd failed: {e}");
                return;
            }
        };
        let removes = msgs[..n].iter().any(|m| m.event == uffd::EVENT_REMOVE);
        sh.removes_in_flight.store(removes || holds_removes(&pending), SeqCst);
        let now = Instant::now();
        for m in &msgs[..n] {
            match m.event {
                uffd::EVENT_PAGEFAULT => pending.push(Pending::Fault {
                    addr: m.arg[1] as usize,
                    since: now,
                    access: if m.arg[0] & uffd::PAGEFAULT_FLAG_WRITE != 0 { Access::Write } else { Access::Read },
                }),
                uffd::EVENT_REMOVE | uffd::EVENT_UNMAP => pending.push(Pending::Range {
                    event: m.event,
                    start: m.arg[0] as usize,
                    end: m.arg[1] as usize,
                    since: now,
                }),
                uffd::EVENT_REMAP => remap(&sh, m.arg[0] as usize, m.arg[1] as usize, m.arg[2] as usize),
                _ => {}
            }
        }
        // In arrival order; a fault inside a range event still pending waits behind it.
        let mut blocked: Vec<(usize, usize)> = Vec::new();
        pending.retain_mut(|p| match p {
            Pending::Fault { addr, since, access } => {
                blocked.iter().any(|&(s, e)| (s..e).contains(addr))
                    || !fault_on_reader(&sh, *addr, &mut buf, *since, *access)
            }
            Pending::Range { event, start, end, .. } => {
                *start = range_event(&sh, *event, *start, *end, &mut buf);
                if *start < *end {
                    blocked.push((*start, *end));
                }
                *start < *end
            }
        });
        sh.events_busy.store(!blocked.is_empty(), SeqCst);
        // Processed REMOVE ranges mark their folios (`dropped_at`): moves may go on.
        sh.removes_in_flight.store(holds_removes(&pending), SeqCst);
        if n > 0 {
            sh.refresh_usage();
        }
    }
}

/// Whether REMOVE ranges read earlier are still unprocessed.
fn holds_removes(pending: &[Pending]) -> bool {
    pending.iter().any(|p| matches!(p, Pending::Range { event: uffd::EVENT_REMOVE, .. }))
}

/// Returns true when the fault is finished with.
fn fault_on_reader(sh: &Shared, addr: usize, buf: &mut [u8], since: Instant, access: Access) -> bool {
    let guard = TableGuard::enter();
    match guard.find(addr, Some(sh.id)) {
        Some(r) => match resolve(r, addr, buf, true, since, access) {
            Resolve::Done => true,
            Resolve::Defer => false,
            Resolve::NotOurs => zero_unknown(sh, addr),
        },
        None => zero_unknown(sh, addr),
    }
}

/// A fault in our context outside every region (the part of a region a program
/// mremapped elsewhere, or the tail it grew): plain anonymous semantics, a zero page.
fn zero_unknown(sh: &Shared, addr: usize) -> bool {
    let page = addr & !(PAGE - 1);
    let _ = fill(sh, page, sh.zeros as *const u8, PAGE, false);
    sh.uffd.wake(page, PAGE);
    true
}

/// REMOVE (MADV_DONTNEED/FREE/REMOVE) or UNMAP of `[start, end)`: frees what the range
/// held in every tier. Processes folios in order; returns where it stopped (a busy
/// folio) or `end`.
fn range_event(sh: &Shared, event: u8, start: usize, end: usize, buf: &mut [u8]) -> usize {
    let guard = TableGuard::enter();
    let mut at = start;
    while at < end {
        let Some(r) = guard.find(at, Some(sh.id)) else {
            // Skip to the next region start inside the range, if any.
            match guard.all(sh.id).map(|r| r.base.load(Acquire)).filter(|&b| b > at && b < end).min() {
                Some(b) => {
                    at = b;
                    continue;
                }
                None => return end,
            }
        };
        let base = r.base.load(Acquire);
        let idx = (at - base) >> r.folio_shift;
        let folio = base + (idx << r.folio_shift);
        let folio_end = folio + r.folio_size;
        let (lo, hi) = (at.max(folio), end.min(folio_end));
        let whole = lo == folio && hi == folio_end;
        let Some(prev) = r.try_lock(idx) else { return at };
        let Some(next) = drop_range(r, idx, prev, lo - folio, hi - lo, whole, event == uffd::EVENT_UNMAP, buf) else {
            r.unlock(idx, prev);
            return at;
        };
        r.unlock(idx, next);
        at = folio_end;
    }
    end
}

/// Drops `[off, off+len)` of folio `idx` (locked, in state `prev`); returns the new
/// state, or `None` if it must be retried later (the folio is as it was).
#[allow(clippy::too_many_arguments)]
fn drop_range(r: &RegionInner, idx: usize, prev: u8, off: usize, len: usize, whole: bool, unmap: bool, buf: &mut [u8]) -> Option<u8> {
    let sh = &*r.shared;
    let fs = r.folio_size;
    let gone = if unmap { UNMAPPED } else { EMPTY };
    Some(match prev {
        SWAPPED if whole => {
            r.drop_kept(idx, true);
            gone
        }
        SWAPPED => {
            // Part of a compressed folio: that part now reads as zeros.
            let key = r.key(idx);
            let buf = &mut buf[..fs];
            match sh.store.load(key, buf) {
                Ok(true) => {}
                Ok(false) => fatal(b"uzswap: swapped folio missing from the store\n"),
                // Unreadable: the part kept is poisoned (the dropped part is zapped
                // by the kernel after this, and reads zeros). Busy: retried later.
                Err(_) => return if poison(r, idx, false) { Some(POISONED) } else { None },
            }
            buf[off..off + len].fill(0);
            if sh.store.store(key, buf).is_ok() {
                return Some(SWAPPED);
            }
            // The store refused it (compression failed, the pool is full): the folio
            // comes back into the region instead, less the dropped part.
            r.kept[idx].store(false, Relaxed);
            let st = &sh.stats.sizes[r.order()];
            st.stored.fetch_sub(1, Relaxed);
            bump(&st.zswpin);
            bump(&st.reject_reclaim_fail);
            let folio = r.folio_addr(idx);
            for (from, to) in [(0, off), (off + len, fs)] {
                if from < to && fill(sh, folio + from, buf[from..].as_ptr(), to - from, false).is_err() {
                    fatal(b"uzswap: the store refused a folio and it could not be mapped back either\n");
                }
            }
            sh.resident.fetch_add(fs as u64, Relaxed);
            // Rare: left to the reclaimer's full scan rather than queued.
            r.stamps[idx].store(sh.stamp.fetch_add(1, Relaxed), Relaxed);
            RESIDENT
        }
        PROBATION => {
            // Any part dropped makes a kept copy wrong; a whole drop frees it anyway.
            r.drop_kept(idx, true);
            // SAFETY: the shadow range is ours; it has no REMOVE events, so this cannot block.
            unsafe { libc::madvise((r.shadow_addr(idx) + off) as *mut _, len, libc::MADV_DONTNEED) };
            if whole {
                sh.probation.fetch_sub(fs as u64, Relaxed);
                sh.resident.fetch_sub(fs as u64, Relaxed);
                gone
            } else {
                PROBATION
            }
        }
        RESIDENT | CLEAN => {
            // A clean folio's copy: gone with the whole folio, wrong for a part.
            r.drop_kept(idx, true);
            if unmap {
                if whole {
                    sh.resident.fetch_sub(fs as u64, Relaxed);
                    return Some(UNMAPPED);
                }
                return Some(RESIDENT);
            }
            // The kernel zaps the range only after we have read the event, on the thread
            // that called madvise: until it has, the pages are still mapped, and the
            // reclaimer must not save them in the shadow (`zap_may_be_pending`). Moving
            // them out from here instead races that zap (UFFDIO_MOVE was seen to spin
            // in the kernel). Pages a clean folio keeps stay write-protected; their
            // first write faults as RESIDENT and unprotects them.
            r.dropped_at[idx].store(sh.clock_ms(), Relaxed);
            if whole {
                sh.resident.fetch_sub(fs as u64, Relaxed);
                EMPTY
            } else {
                RESIDENT
            }
        }
        EMPTY if whole && unmap => UNMAPPED,
        // Dropped whole, the poison goes with the pages.
        POISONED if whole => gone,
        s => s,
    })
}

/// mremap: a whole region that moved is followed; a part that moved elsewhere is not
/// (its resident pages move with it and later faults there read zeros) and is reported.
fn remap(sh: &Shared, from: usize, to: usize, len: usize) {
    let guard = TableGuard::enter();
    for r in guard.all(sh.id) {
        let base = r.base.load(Acquire);
        if from == base && len >= r.len {
            r.base.store(to, Release);
            return;
        }
        if from < base + r.len && from + len > base {
            eprintln!(
                "uzswap: mremap of part of a managed region ({len} bytes at {from:#x}) is not supported; \
                 remap whole regions"
            );
            return;
        }
    }
}

// ---- The SIGBUS path. ----

static OLD_SIGBUS: OnceLock<libc::sigaction> = OnceLock::new();
/// si_code of SIGBUS for an access to poisoned memory.
const BUS_MCEERR_AR: i32 = 4;

pub(crate) fn install_sigbus_handler() -> Result<(), String> {
    static INSTALL: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut done = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    if *done {
        return Ok(());
    }
    // SAFETY: installing a handler with a zeroed, then filled, sigaction.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        // Not SA_ONSTACK: Rust threads have a small alternate stack, too small for a decompressor.
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &sa, &mut old) != 0 {
            return Err(format!("sigaction(SIGBUS) failed: {}", std::io::Error::last_os_error()));
        }
        let _ = OLD_SIGBUS.set(old);
    }
    *done = true;
    Ok(())
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let _in_handler = HandlerFlag::enter();
    // SAFETY: the kernel passes a valid siginfo.
    let addr = unsafe { (*info).si_addr() } as usize;
    // A poisoned page (a folio the store could not give back) is the program's
    // SIGBUS, as for a hardware memory error. Kernels that report it as
    // BUS_ADRERR, like ours, are caught by the folio's state in `resolve`.
    // SAFETY: as above.
    if unsafe { (*info).si_code } == BUS_MCEERR_AR {
        return chain(sig, info, ctx);
    }
    {
        let guard = TableGuard::enter();
        if let Some(r) = guard.find(addr, None) {
            if r.shared.cfg.fault_path == FaultPath::Sigbus {
                let slot = r.shared.buffers.take();
                let done = resolve(r, addr, slot.buf(), false, Instant::now(), sigbus_access(ctx));
                drop(slot);
                if done == Resolve::Done {
                    return;
                }
            }
        }
    }
    chain(sig, info, ctx);
}

/// Whether the access that raised SIGBUS was a write: on x86-64 the page-fault error
/// code is in the signal context (bit 1: write).
fn sigbus_access(ctx: *mut libc::c_void) -> Access {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: an SA_SIGINFO handler's third argument is the interrupted ucontext.
        let err = unsafe { (*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_ERR as usize] };
        if err & 2 != 0 { Access::Write } else { Access::Read }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ctx;
        Access::Unknown
    }
}

/// Not one of ours: hand over to whoever had SIGBUS before, or die of it.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: calling the previous disposition as the kernel would.
    unsafe {
        if let Some(old) = OLD_SIGBUS.get() {
            let h = old.sa_sigaction;
            if h != libc::SIG_DFL && h != libc::SIG_IGN {
                if old.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(h);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
                    f(sig);
                }
                return;
            }
        }
        // Default action: restore it and return; the access faults again and kills us.
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &sa, null_mut());
    }
}

thread_local! {
    /// Set while this thread runs `on_sigbus`. Const-initialised with no destructor:
    /// reading or setting it never allocates, so a test's global allocator may ask it.
    static IN_FAULT_HANDLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets `IN_FAULT_HANDLER` for the life of one `on_sigbus`; restores the previous
/// value (a nested SIGBUS from the handler itself keeps the outer one's `true`).
struct HandlerFlag(bool);

impl HandlerFlag {
    fn enter() -> Self {
        HandlerFlag(IN_FAULT_HANDLER.with(|f| f.replace(true)))
    }
}

impl Drop for HandlerFlag {
    fn drop(&mut self) {
        IN_FAULT_HANDLER.with(|f| f.set(self.0));
    }
}

/// Whether the calling thread is inside the runtime's SIGBUS handler. For tests that
/// check the handler path is async-signal-safe (e.g. a global allocator that aborts
/// when called from it).
pub fn in_fault_handler() -> bool {
    IN_FAULT_HANDLER.with(|f| f.get())
}
