//! Fault resolution (shared by both fault paths), the uffd reader thread (faults in
//! thread mode, events in both modes) and the SIGBUS handler.

use crate::region::*;
use crate::stats::bump;
use crate::uffd::{self, Exist, IoctlError, Partial, UffdMsg};
use crate::{FaultPath, Shared};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::*};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub(crate) const PAGE: usize = 4096;
/// The longest a fault waits for the reclaimer when usage is over the budget.
const THROTTLE_MAX: Duration = Duration::from_millis(100);
/// The longest a fault waits for a reclaimer declared starved (`Shared::reclaim_starved`).
const ROOM_NAP: Duration = Duration::from_millis(1);

// ---- The region table: lock-free lookup by address, usable from a signal handler. ----

const MAX_REGIONS: usize = 4096;
static TABLE: [AtomicPtr<RegionInner>; MAX_REGIONS] = [const { AtomicPtr::new(null_mut()) }; MAX_REGIONS];
static TABLE_HIGH: AtomicUsize = AtomicUsize::new(0);
/// Lookups in progress: a removed region is freed only once this drops to zero.
static READERS: AtomicUsize = AtomicUsize::new(0);

/// In a forked child (fork.rs `forget_parent_in_child`): the parent's regions
/// leave the table, unfreed (they are the child's plain memory, their runtime is not
/// here), and no lookup is in progress, whatever a thread of the parent was doing.
pub(crate) fn forget_regions_in_child() {
    for slot in &TABLE {
        slot.store(null_mut(), SeqCst);
    }
    TABLE_HIGH.store(0, SeqCst);
    READERS.store(0, SeqCst);
}

pub(crate) struct TableGuard;
impl TableGuard {
    pub fn enter() -> TableGuard {
        READERS.fetch_add(1, SeqCst);
        TableGuard
    }
    /// The region containing `addr`, of those `which` accepts. The reference is valid
    /// while the guard lives. Two may hold it: a region made where the program unmapped
    /// part of another (a hole of an adopted mapping, which the kernel hands out again)
    /// before that unmap's event was read. The one whose page is still there is the one
    /// that has it, and of two, the newer (the other's unmap is still to be read): a
    /// region is made over memory that is mapped, after whatever unmapped it before. One
    /// that lost the page, only if none other has it (the drop of that page is its own
    /// to process). Async-signal-safe.
    pub fn find(&self, addr: usize, which: impl Fn(&RegionInner) -> bool) -> Option<&RegionInner> {
        let high = TABLE_HIGH.load(Acquire);
        let (mut found, mut lost): (Option<&RegionInner>, Option<&RegionInner>) = (None, None);
        let newer = |a: Option<&RegionInner>, b: &RegionInner| a.is_none_or(|a| b.id > a.id);
        for slot in &TABLE[..high] {
            let p = slot.load(SeqCst);
            if p.is_null() {
                continue;
            }
            // SAFETY: entries stay alive until removed and READERS has drained.
            let r = unsafe { &*p };
            let base = r.base.load(Acquire);
            if addr >= base && addr < base + r.len && which(r) {
                if !r.gone_at(addr) {
                    if newer(found, r) {
                        found = Some(r);
                    }
                } else if newer(lost, r) {
                    lost = Some(r);
                }
            }
        }
        found.or(lost)
    }
    /// The region in table slot `slot`, if it belongs to `runtime`.
    pub fn at(&self, slot: usize, runtime: u64) -> Option<&RegionInner> {
        let p = TABLE.get(slot)?.load(SeqCst);
        // SAFETY: as in find.
        (!p.is_null()).then(|| unsafe { &*p }).filter(|r| r.shared.id == runtime)
    }
    /// [`TableGuard::all`], with the table's extent read in the same total order as
    /// the inserts (`claimed_by_another`, `mark_stale_claims`).
    fn every(&self, runtime: u64) -> impl Iterator<Item = &RegionInner> {
        let high = TABLE_HIGH.load(SeqCst);
        TABLE[..high].iter().filter_map(move |slot| {
            let p = slot.load(SeqCst);
            // SAFETY: as in find.
            (!p.is_null()).then(|| unsafe { &*p }).filter(|r| r.shared.id == runtime)
        })
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
        if !slot.load(Relaxed).is_null() {
            continue;
        }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
/// Every other caller (a SIGBUS handler, `Runtime::fault_in` on a program thread) may.
fn may_wait(caller: Caller) -> bool {
    caller != Caller::Reader
}

/// Which thread resolves a fault or brings a folio in: what it may wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The reader: never waits (a thread it would wait for may wait for it), and reads
    /// no event while it fills a folio.
    Reader,
    /// A SIGBUS handler: waits for the folio lock and the budget, and fills a folio
    /// under `Shared::begin_fill`, so no drop of it is read meanwhile.
    Handler,
    /// A fork or kernel-access hold on a program thread: waits and fills as a handler
    /// does, with other folios locked (fills wait only for the reader to read and
    /// mark, never for it to process a range, which may be over a folio we hold).
    Holder,
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
/// false when it must be retried later (a caller that may not wait). It sleeps on the
/// charges' futex, woken as folios are freed (one fault per folio: the one that gets
/// the room). It does not wait when the pool alone is past the limit (evicting folios
/// cannot help: they only move into it; writeback keeps the pool under it), nor for a
/// reclaimer that has nothing to evict or keeps being refused (`reclaim_stuck`), nor
/// longer than THROTTLE_MAX; a fault that waited so long while the reclaimer evicted
/// nothing declares it starved (`reclaim_starved`), and faults then wait ROOM_NAP at
/// most until it evicts again: a bound on the wait for another thread, which still
/// gives a reclaimer short of CPU most of it. Async-signal-safe.
fn wait_for_room(sh: &Shared, order: usize, since: Instant, wait: bool) -> bool {
    let st = &sh.stats.sizes[order];
    // What the reclaimer had evicted when this fault began to wait (None: it has not).
    let mut evicted_before = None;
    let full = || sh.usage() > sh.throttle_limit();
    while full() {
        // Waiting cannot help when what the reclaimer cannot shrink is past the limit.
        if sh.pool_cached.load(Relaxed) + sh.unmanaged_charge() >= sh.throttle_limit() {
            bump(&st.over_budget);
            note_peak(sh);
            return true;
        }
        let most = if sh.reclaim_starved.load(Relaxed) { ROOM_NAP } else { THROTTLE_MAX };
        let waited = since.elapsed();
        if sh.reclaim_stuck.load(Relaxed) || waited >= most {
            // This fault goes on over the budget. It declares the reclaimer starved only
            // if it evicted nothing while we waited: one that evicts, but slower than
            // many threads fault, is not (16 threads writing at once kept declaring it,
            // and reached twice the budget). A caller that may not wait (the reader,
            // which retries the fault later) has not watched the reclaimer: it declares.
            // A waiting caller that came in already past the time has seen nothing
            // either way: it goes on without declaring.
            if !sh.reclaim_stuck.load(Relaxed) && (!wait || evicted_before == Some(sh.evicted())) {
                sh.reclaim_starved.store(true, Relaxed);
            }
            bump(&st.over_budget);
            note_peak(sh);
            return true;
        }
        if evicted_before.is_none() {
            evicted_before = Some(sh.evicted());
            bump(&st.throttled);
        }
        if !wait {
            return false;
        }
        // Sleep rather than spin: the reclaimer needs the CPU.
        sh.charges.sleep_for_room(most - waited, full);
    }
    note_peak(sh);
    true
}

/// The peak of usage, taken where a charge is let through: the reclaimer's samples miss
/// a burst it is too busy to see (16 threads writing at once went to twice the budget
/// while its samples said "within it").
fn note_peak(sh: &Shared) {
    sh.peak_usage.fetch_max(sh.usage(), Relaxed);
}

/// Resolves a fault at `addr` in `r`: brings the whole folio back (one COPY or MOVE)
/// and marks it resident, or lifts the write protection of a clean folio. `buf` must
/// hold a folio. `since` is when the fault was first seen (for throttling). Each arm
/// runs the mechanism and then records the transition it made (folio.rs).
pub(crate) fn resolve(r: &RegionInner, addr: usize, buf: &mut [u8], caller: Caller, since: Instant, access: Access) -> Resolve {
    let sh = &*r.shared;
    let wait = may_wait(caller);
    let base = r.base.load(Acquire);
    if addr < base || addr >= base + r.len {
        return Resolve::NotOurs;
    }
    let idx = (addr - base) >> r.folio_shift;
    let fs = r.folio_size;
    if wait {
        while sh.events_busy.load(SeqCst) {
            // SAFETY: sched_yield takes no arguments and is async-signal-safe.
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
    let book = r.book();
    let keep_clean = sh.cfg.keep_clean;
    // A read at random in a swapped-out folio maps only the unit around it (partial
    // swap-in: folio.rs); one that follows the last swap-in of the region (the same
    // folio, or the next) brings the whole folio, as readahead grows its window.
    let out = matches!(prev, SWAPPED | PARTIAL);
    let unit = if out { r.swapin_unit(idx) } else { fs };
    let sequential = out && r.pattern.note(idx);
    let part = out
        && !sequential
        && access == Access::Read
        && keep_clean
        && unit < fs
        && !r.has_drop_pending(idx)
        && !r.torn(idx);
    // Charge first (as a memory cgroup does). The reclaimer runs ahead of the budget
    // (from the high watermark); past the throttle limit a fault waits its turn.
    let res = if prev == EMPTY || crate::folio::charged_on_return(prev) {
        let res = if part { book.reserve_bytes(unit as u64) } else { book.reserve(idx, prev) };
        if sh.usage() > sh.high_watermark() {
            sh.kick_reclaimer();
        }
        if !wait_for_room(sh, r.order(), since, wait) {
            book.release(res);
            r.unlock(idx, prev);
            return Resolve::Defer;
        }
        Some(res)
    } else {
        None
    };
    // Gives back what was taken and leaves the folio as it was, to be retried.
    let defer = |res: Option<Reservation>| {
        r.put_back(idx, prev, res);
        Resolve::Defer
    };
    let folio = base + (idx << r.folio_shift);
    let page = addr & !(PAGE - 1);
    // Folios to fill with zeros ahead of a writer, or to bring back ahead of a
    // sequential pass, after this one (pattern.rs).
    let (mut ahead, mut ahead_in) = (0, 0);
    match prev {
        UNMAPPED => {
            r.unlock(idx, UNMAPPED);
            return Resolve::NotOurs;
        }
        // A hole left by MADV_DONTNEED/FREE, a second fault that lost the race to the
        // one that brought the folio in, or a write to a page still protected after
        // its clean copy was dropped: the page reads as zeros, or is there, and is
        // made writable.
        RESIDENT => {
            let unprotect = keep_clean && access != Access::Read;
            let done = match fill_zeros(r, page, PAGE, wait) {
                Err(IoctlError::Unexpected(e)) => lose(sh, r.order(), b"UFFDIO_COPY", e, page, PAGE),
                other => other,
            };
            let done = done.and_then(|()| if unprotect { unprotect_range(sh, page, PAGE, wait) } else { Ok(()) });
            match done {
                Err(IoctlError::Again) => return defer(res),
                Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT", e),
                Ok(()) | Err(IoctlError::Gone) => r.finish(idx, prev, Transition::Touched, res),
            };
        }
        // The first touch of a folio shared with the parent since fork (folio.rs): made
        // ours, charged (reserved above), its protection lifted: a write goes on into
        // a copy the kernel makes; a page the parent never had reads as zeros.
        SHARED => {
            let done = match fill_zeros(r, page, PAGE, wait) {
                Err(IoctlError::Unexpected(e)) => lose(sh, r.order(), b"UFFDIO_COPY", e, page, PAGE),
                other => other,
            };
            match done.and_then(|()| r.unprotect_folio(idx, wait)) {
                Err(IoctlError::Again) => return defer(res),
                Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT (a folio shared since fork)", e),
                Ok(()) | Err(IoctlError::Gone) => {
                    let next = book.record(idx, prev, Transition::Unshared, res);
                    r.unlock_in(idx, next);
                }
            };
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
            match fill_zeros(r, page, PAGE, wait) {
                Err(IoctlError::Again) => return defer(res),
                Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_COPY", e),
                Ok(()) | Err(IoctlError::Gone) => r.finish(idx, prev, Transition::Touched, res),
            };
        }
        // Lost the race to the fault that brought it back.
        CLEAN if access == Access::Read => {
            r.finish(idx, prev, Transition::Touched, res);
        }
        CLEAN => {
            // The first write since a clean reload: the kept copy goes stale, so it is
            // freed while we hold the lock (nobody can reuse it meanwhile), then the
            // write is let in. If the protection stays, the retry faults as RESIDENT.
            let now = book.record(idx, prev, Transition::Dirtied, None);
            match r.unprotect_folio(idx, wait) {
                Err(IoctlError::Again) => {
                    r.unlock(idx, now);
                    return Resolve::Defer;
                }
                Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT", e),
                Ok(()) | Err(IoctlError::Gone) => r.finish(idx, now, Transition::Touched, None),
            };
        }
        EMPTY => match r.live_runs(idx, folio, folio + fs, |at, n| fill_zeros(r, at, n, wait)) {
            // Whatever went in reads as zeros, as the rest will: no data to lose.
            Err(IoctlError::Again) => return defer(res),
            Err(IoctlError::Unexpected(e)) => {
                if lose_folio(r, idx, b"UFFDIO_COPY", e).is_err() {
                    return defer(res);
                }
                r.finish(idx, prev, Transition::Poisoned, res);
            }
            Ok(()) | Err(IoctlError::Gone) => {
                r.finish(idx, prev, Transition::ZeroFilled, res);
                ahead = r.pattern.zero_filled(idx, fs);
            }
        },
        SWAPPED | PARTIAL if part => match swap_in_part(r, idx, prev, page, unit, buf, caller, res) {
            Some(next) => r.unlock_in(idx, next),
            None => return Resolve::Defer,
        },
        SWAPPED | PARTIAL | PROBATION => {
            // A read keeps the store entry as the folio's clean copy (non-exclusive
            // load); a write takes it, as the kernel's do_swap_page does. (A folio
            // cut small and read whole keeps its cut until it is written: cutting it
            // anew at eviction cost usemem's sequential pass 60% more time for 6% of
            // room.)
            let keep = keep_clean && access != Access::Write;
            match bring_back(r, idx, prev, buf, Why::Fault { keep }, caller, res) {
                Some(next) => r.unlock_in(idx, next),
                None => return Resolve::Defer,
            }
            if sequential && keep_clean {
                ahead_in = r.pattern.swapin_ahead(idx, fs);
            }
        }
        _ => unreachable!("folio state word out of range"),
    }
    if sh.cfg.fault_path == FaultPath::Thread {
        wake(sh, r.order(), folio, fs);
    }
    if ahead > 0 {
        fill_ahead(r, idx, ahead);
    }
    if ahead_in > 0 {
        swap_in_ahead(r, idx, ahead_in, buf, caller);
    }
    Resolve::Done
}

/// Brings back up to `n` SWAPPED folios after folio `idx` of `r` ahead of a
/// sequential pass (pattern.rs), once the faulting thread is on its way, as the
/// kernel's swap readahead does (it maps nothing, but its minor faults are cheap; a
/// fault here is a round trip to the reader on the thread path). Each comes back as
/// a read brings it: write-protected, its entry kept (`InAhead`), so evicting it
/// again costs no compression. Only folios that are SWAPPED (no drop pending) and
/// free now, under the high watermark; it stops at the first that is not, and never waits
/// for a folio lock (`bring_back` waits as it does for a fault: off the reader, for
/// the reader to read a drop). `buf` holds a folio.
fn swap_in_ahead(r: &RegionInner, idx: usize, n: usize, buf: &mut [u8], caller: Caller) {
    let mut brought = 0;
    for j in idx + 1..(idx + 1 + n).min(r.folios()) {
        let Some(res) = lock_ahead(r, j, SWAPPED) else { break };
        match bring_back(r, j, SWAPPED, buf, Why::Ahead, caller, Some(res)) {
            Some(next) => {
                r.unlock_in(j, next);
                if next != CLEAN {
                    break;
                }
                brought += 1;
            }
            None => break,
        }
    }
    r.pattern.swapped_ahead(idx, brought);
}

/// Locks folio `j` of `r` for work ahead of the program (`swap_in_ahead`,
/// `fill_ahead`) and charges it, if it is in state `want` with no drop pending, free
/// now, and fits under the high watermark (where the reclaimer starts: work ahead
/// never makes it run, nor pushes a group's process past its share while the shares
/// move). Never waits.
fn lock_ahead(r: &RegionInner, j: usize, want: u8) -> Option<Reservation> {
    let sh = &*r.shared;
    if sh.usage() + r.folio_size as u64 > sh.high_watermark() {
        return None;
    }
    match r.try_lock(j)? {
        s if s == want && !r.has_drop_pending(j) && !r.torn(j) => Some(r.book().reserve(j, want)),
        s => {
            r.unlock(j, s);
            None
        }
    }
}

/// Fills up to `n` folios after folio `idx` of `r` with zeros ahead of a program
/// writing fresh memory in order (pattern.rs), once the faulting thread is on its way:
/// each is one less fault for it to take. Only folios that are EMPTY and free now,
/// while usage stays under the high watermark; it stops at the first that is not, and
/// never waits. A fill that fails leaves the folio EMPTY (an unexpected errno counted
/// and said once: nothing was lost, and the program's own fault there meets it again).
fn fill_ahead(r: &RegionInner, idx: usize, n: usize) {
    let sh = &*r.shared;
    let mut filled = 0;
    for j in idx + 1..(idx + 1 + n).min(r.folios()) {
        let Some(res) = lock_ahead(r, j, EMPTY) else { break };
        match fill_zeros(r, r.folio_addr(j), r.folio_size, false) {
            Ok(()) => {
                r.finish(j, EMPTY, Transition::FilledAhead, Some(res));
                filled += 1;
            }
            Err(e) => {
                if let IoctlError::Unexpected(errno) = e {
                    let then = b": the folio is left to the program's own fault (said once; see ioctl_errors)\n";
                    unexpected_once!(sh, r.order(), b"UFFDIO_COPY (zeros ahead of a writer)", errno, then);
                }
                r.put_back(j, EMPTY, Some(res));
                break;
            }
        }
    }
    r.pattern.filled_ahead(idx, filled);
}

/// Locks folio `idx` of `r` with its data in place, as a fork hold needs it (and the
/// release of an adopted region): a folio out of place (folio.rs `out_of_place`) is
/// brought back first, and one that cannot be read is poisoned, as a fault would find
/// it. Returns the state it is locked in. Waits: a bring-in put off (a drop of the
/// folio being taken in) is tried again with the folio unlocked meanwhile; one whose
/// range was unmapped under us is left for the UNMAP event (which may need folios the
/// caller holds), locked as it is. `buf` holds a folio.
pub(crate) fn lock_in_place(r: &RegionInner, idx: usize, buf: &mut [u8]) -> u8 {
    put_in_place(r, idx, r.lock(idx), buf)
}

/// [`lock_in_place`] for a folio the caller has locked already, in state `now`.
pub(crate) fn put_in_place(r: &RegionInner, idx: usize, mut now: u8, buf: &mut [u8]) -> u8 {
    while crate::folio::out_of_place(now) {
        let res = crate::folio::charged_on_return(now).then(|| r.book().reserve(idx, now));
        now = match bring_back(r, idx, now, buf, Why::Fork, Caller::Holder, res) {
            Some(next) => next,
            None if !still_mapped(r.folio_addr(idx)) => return r.lock(idx),
            None => {
                std::thread::yield_now();
                r.lock(idx)
            }
        };
    }
    now
}

/// How many times the reader retries the faults it put off before it reads again
/// (`reader_loop`).
const READER_RETRIES: u32 = 16;

/// Why a folio is brought back in (see [`bring_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// A fault; `keep`: a read, which may keep the store entry as the clean copy.
    Fault { keep: bool },
    /// A fork hold.
    Fork,
    /// Ahead of a sequential pass (`swap_in_ahead`): as a read, with no fault.
    Ahead,
}

/// Brings folio `idx` (locked, SWAPPED, PARTIAL or PROBATION, charged by `res` for
/// what it lacks if SWAPPED or PARTIAL)
/// back into the region, records the transition and returns the state the folio is
/// in now, still locked; or `None` when it must be retried later (the folio is
/// unlocked as it was, the charge given back). A read fault brings it back
/// write-protected with its store entry kept as its clean copy, if it has one. Pages
/// the program dropped whose drop the reader has not applied yet (pending marks,
/// region.rs) come in as zeros, never with their old bytes, and the folio then keeps
/// no copy. An unreadable entry or an unexpected ioctl error poisons the folio. The
/// one place that moves a folio's data back in, for faults and fork.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bring_back(r: &RegionInner, idx: usize, prev: u8, buf: &mut [u8], why: Why, caller: Caller, res: Option<Reservation>) -> Option<u8> {
    let sh = &*r.shared;
    let book = r.book();
    let (folio, fs) = (r.folio_addr(idx), r.folio_size);
    let defer = |res: Option<Reservation>| {
        r.put_back(idx, prev, res);
        None
    };
    // Off the reader no drop may be read from here to the fill (`begin_fill`), and
    // then nothing below may wait for EAGAIN.
    let Ok(mut filling) = fill_gate(sh, caller) else { return defer(res) };
    // Inside the gate (or on the reader) no ioctl may wait for EAGAIN.
    let wait = false;
    let keep = matches!(why, Why::Fault { keep: true } | Why::Ahead) && !r.has_drop_pending(idx);
    // Pages found already there (a PARTIAL folio's, or an earlier attempt's) stay as
    // they are; the fill skips them and notes them here, with those it fills.
    let mut placed;
    // Copies go in write-protected wherever the region allows it, and are opened for
    // writing only once all are in: a fill that gives up half-way (EAGAIN) leaves
    // copies of what the store or the shadow still holds, which nobody can write
    // into (a write there would be lost with the next clean eviction).
    let protect = sh.cfg.keep_clean;
    let kept = r.folios.kept(idx);
    // The data is copied from `buf` (decoded, or the shadow's copy of a folio that
    // went out clean or is torn, left as it is until the end), or moved from the
    // shadow. A torn folio's pages are copied in where they are still the program's
    // (region.rs: a move covers the folio's whole range). The reader
    // copies too: it cannot wait for the read a move stopped half-way needs (it is the
    // one to read), and could only leave the folio split between region and shadow.
    let copied = prev != PROBATION || kept || r.torn(idx) || caller == Caller::Reader;
    let buf = &mut buf[..fs];
    if prev == SWAPPED || prev == PARTIAL {
        // Read without taking the entry, taken only once the folio is in place: a
        // failure leaves the entry as it was.
        match read_stored(r, idx, 0, buf) {
            Ok(true) => {}
            Ok(false) => fatal(b"uzswap: swapped folio missing from the store\n"),
            Err(_) => {
                // Unreadable (an I/O error or a corrupt record in the backing file):
                // never map wrong bytes. The folio is poisoned as a hardware memory
                // error would be: its accesses get SIGBUS.
                if r.live_runs(idx, folio, folio + fs, |at, n| place_poison(sh, at, n, wait)).is_err() {
                    return defer(res);
                }
                say_poisoned();
                return Some(book.record(idx, prev, Transition::Poisoned, res));
            }
        }
    } else if copied {
        // SAFETY: the folio's shadow range (locked: nobody else touches it); holes read
        // as zeros (the staging context does not handle missing pages).
        buf.copy_from_slice(unsafe { std::slice::from_raw_parts(r.shadow_addr(idx) as *const u8, fs) });
    }
    let done = loop {
        // The drops read so far: zeros in what is copied, holes in the shadow for a
        // move (settled where the region has no page left to zap).
        if r.has_drop_pending(idx) {
            if copied {
                r.zero_drop_pending(idx, buf);
            } else {
                r.discard_drop_pending(idx);
            }
        }
        // What this attempt fills and finds: pages an earlier one placed are found
        // present, and if the program dropped them since, stay marked.
        placed = Placed::default();
        let done = if copied {
            r.live_runs(idx, folio, folio + fs, |at, n| {
                // SAFETY: `at - folio` is within the folio, so within `buf`.
                let from = unsafe { buf.as_ptr().add(at - folio) };
                fill_protected(sh, at, from, n, wait, protect, Some(&mut placed))
            })
        } else {
            // A handler or hold that stops half-way goes on below; the reader copies.
            move_back(sh, folio, r.shadow_addr(idx), fs, wait)
        };
        if done != Err(IoctlError::Again) {
            break done;
        }
        if caller == Caller::Reader {
            break done;
        }
        // A handler or hold stopped by a drop another thread queued: it keeps the folio locked
        // and its data decoded, lets the reader read (and mark) that drop, and goes on
        // where it was. Refaulting instead, it decoded the folio again each time and,
        // against a thread dropping in a loop, almost never got a fill through. The
        // reader never waits for a folio lock, so this waits only for it to read.
        drop(filling);
        filling = loop {
            // SAFETY: sched_yield takes no arguments and is async-signal-safe.
            unsafe { libc::sched_yield() };
            if let Ok(f) = fill_gate(sh, caller) {
                break f;
            }
        };
    };
    let clean = keep && (prev == SWAPPED || kept);
    if done.is_ok() && protect && !clean {
        // Opened for writing now that every page is in. If that must wait (EAGAIN),
        // the folio is RESIDENT with protected pages: a write faults once more and
        // opens its page (`resolve`, RESIDENT).
        if let Err(IoctlError::Unexpected(e)) = r.unprotect_folio(idx, wait) {
            ioctl_fatal(b"UFFDIO_WRITEPROTECT", e);
        }
    }
    let t = match (done, prev) {
        // Gone: the range was unmapped under us; the UNMAP event frees the folio.
        // What it placed stays, unsettled: the folio is still out, its data for a
        // dropped page the old bytes, and a zap still to come may yet take our page of
        // zeros away (a later attempt finds the page present and leaves it marked;
        // marked and present, it keeps the folio in until dropped again).
        (Err(IoctlError::Again | IoctlError::Gone), _) => {
            let present = placed.present.count() as u16;
            crate::trace::note(r.key(idx), crate::trace::Event::PutOff { from: prev, present, copied });
            return defer(res);
        }
        (Err(IoctlError::Unexpected(e)), _) => {
            let what: &[u8] = if copied { b"UFFDIO_COPY" } else { b"UFFDIO_MOVE" };
            if lose_folio(r, idx, what, e).is_err() {
                return defer(res);
            }
            Transition::Poisoned
        }
        (Ok(()), _) if why == Why::Fork => Transition::ForkIn,
        (Ok(()), SWAPPED) if clean && why == Why::Ahead => Transition::InAhead,
        (Ok(()), SWAPPED) if clean => Transition::SwappedInClean,
        (Ok(()), PARTIAL) if clean => Transition::PartFilled,
        (Ok(()), SWAPPED | PARTIAL) => Transition::SwappedIn,
        (Ok(()), _) if clean => Transition::RefaultedClean,
        (Ok(()), _) => Transition::Refaulted,
    };
    if t != Transition::Poisoned {
        if (prev == SWAPPED || prev == PARTIAL) && !clean {
            sh.store.commit_load(r.key(idx));
        }
        // The drops of the pages filled are settled: they were absent, so zapped, and
        // hold zeros now. A page found there (a PARTIAL folio's, or one the program
        // dropped after an earlier attempt mapped it) may still wait for its zap: it
        // stays marked.
        r.filled(idx, &placed.filled);
    }
    if prev == PROBATION {
        free_shadow(r, idx);
    }
    Some(book.record(idx, prev, t, res))
}

/// Whether the page at `addr` is still mapped in this process (a bring-in that gave
/// up may have met a range unmapped under it). Async-signal-safe.
pub(crate) fn still_mapped(addr: usize) -> bool {
    // SAFETY: msync(MS_ASYNC) on one page touches nothing; ENOMEM means unmapped.
    unsafe { libc::msync(addr as *mut _, PAGE, libc::MS_ASYNC) == 0 || *libc::__errno_location() != libc::ENOMEM }
}

/// The move gate for a fill by `caller` (`Shared::begin_fill`): every fill but the
/// reader's takes it; Err while it is shut (retry later).
fn fill_gate(sh: &Shared, caller: Caller) -> Result<Option<crate::Filling<'_>>, ()> {
    match caller {
        Caller::Handler | Caller::Holder => sh.begin_fill().map(Some).ok_or(()),
        Caller::Reader => Ok(None),
    }
}

/// Reads `buf.len()` bytes at `offset` of folio `idx`'s store entry, which stays (see
/// `Store::read_range`): Ok(false) if there is none.
fn read_stored(r: &RegionInner, idx: usize, offset: usize, buf: &mut [u8]) -> Result<bool, uzswap_store::StoreError> {
    let restores = crate::fds::restores();
    let read = r.shared.store.read_range(r.key(idx), offset, buf);
    if read.is_ok() {
        return read;
    }
    // Perhaps the program closed the backing file behind the shim (fds.rs): if it was
    // restored since the read began (by us or another thread), read again; if it
    // cannot be, the program stops.
    if let Err(fd) = crate::fds::restore_all() {
        crate::fds::lost(fd);
    }
    if crate::fds::restores() != restores {
        return r.shared.store.read_range(r.key(idx), offset, buf);
    }
    read
}

/// Partial swap-in (folio.rs): maps the `unit` of folio `idx` (locked, SWAPPED or
/// PARTIAL, charged `res` for a unit) around `page`, write-protected, from its store
/// entry, which stays; only that unit is decoded. Returns the state to unlock with,
/// or `None` when it must be retried later (unlocked as it was, the charge given back).
#[allow(clippy::too_many_arguments)]
fn swap_in_part(r: &RegionInner, idx: usize, prev: u8, page: usize, unit: usize, buf: &mut [u8], caller: Caller, res: Option<Reservation>) -> Option<u8> {
    let sh = &*r.shared;
    let book = r.book();
    let folio = r.folio_addr(idx);
    let off = (page - folio) & !(unit - 1);
    // As in `bring_back`: no drop read from here to the fill, no wait for EAGAIN; a
    // drop read since the fault looked sends it there.
    let Ok(filling) = fill_gate(sh, caller) else {
        r.put_back(idx, prev, res);
        return None;
    };
    if r.has_drop_pending(idx) {
        drop(filling);
        return bring_back(r, idx, prev, buf, Why::Fault { keep: true }, caller, res);
    }
    let wait = false;
    match read_stored(r, idx, off, &mut buf[..unit]) {
        Ok(true) => {}
        Ok(false) => fatal(b"uzswap: swapped folio missing from the store\n"),
        // Unreadable: the whole folio is handled (poisoned) as a whole swap-in does it.
        Err(_) => {
            drop(filling);
            return bring_back(r, idx, prev, buf, Why::Fault { keep: true }, caller, res);
        }
    }
    let mut placed = Placed::default();
    match fill_protected(sh, folio + off, buf.as_ptr(), unit, wait, true, Some(&mut placed)) {
        Ok(()) => {}
        // Pages mapped before it stopped stay, as copies of the entry: at worst
        // uncharged until the folio next changes state.
        Err(IoctlError::Again | IoctlError::Gone) => {
            r.put_back(idx, prev, res);
            return None;
        }
        Err(IoctlError::Unexpected(e)) => {
            // The rest of the folio is missing too: all of it is poisoned, never zeros.
            if lose_folio(r, idx, b"UFFDIO_COPY", e).is_err() {
                r.put_back(idx, prev, res);
                return None;
            }
            return Some(book.record(idx, prev, Transition::Poisoned, res));
        }
    }
    let new = (0..unit / PAGE).filter(|&i| !placed.present.has(folio + off + i * PAGE)).count() as u16;
    let had = if prev == PARTIAL { r.folios.placed(idx) } else { 0 };
    Some(match (prev, new) {
        // Lost the race to the fault that mapped it.
        (PARTIAL, 0) => book.record(idx, prev, Transition::Touched, res),
        (PARTIAL, _) if usize::from(had + new) == r.folio_size / PAGE => book.record(idx, prev, Transition::PartFilled, res),
        _ => book.record_part(idx, prev, had + new, res),
    })
}

/// Frees what is left of folio `idx`'s pages in the shadow.
fn free_shadow(r: &RegionInner, idx: usize) {
    crate::region::discard_shadow(r.shadow_addr(idx), r.folio_size);
}

/// Writes to stderr and aborts: used where going on would return wrong data.
/// Async-signal-safe.
///
/// The program's SIGABRT handler is not run: it would run on this thread, which may be
/// the reader (nobody else serves a fault) or hold the move gate (the reader waits for
/// it), and a crash handler reads memory (redis' tests all of it): the process hung
/// instead of dying. So the disposition is set to the default first, by the system
/// call itself (the shim's `sigaction` would record it as the program's).
pub fn fatal(msg: &[u8]) -> ! {
    // The kernel's struct sigaction: handler SIG_DFL (0), no flags, no restorer, an
    // empty mask.
    let default = [0u64; 4];
    say(msg);
    // SAFETY: rt_sigaction(2) and abort(3) are async-signal-safe; `default` is a
    // valid buffer of the size given (the kernel's sigset is 8 bytes).
    unsafe {
        libc::syscall(libc::SYS_rt_sigaction, libc::SIGABRT, default.as_ptr(), std::ptr::null_mut::<u64>(), 8);
        libc::abort()
    }
}

/// Writes `uzswap: <what> failed unexpectedly (errno N)<tail>` to stderr without
/// allocating. Async-signal-safe.
fn say_errno(what: &[u8], errno: i32, tail: &[u8]) {
    let mut msg = [0u8; 256];
    let mut n = 0;
    let mut put = |b: &[u8]| {
        let k = b.len().min(msg.len() - n);
        msg[n..n + k].copy_from_slice(&b[..k]);
        n += k;
    };
    put(b"uzswap: ");
    put(what);
    put(b" failed unexpectedly (errno ");
    let mut digits = [0u8; 10];
    let (mut v, mut d) = (errno.unsigned_abs(), digits.len());
    loop {
        d -= 1;
        digits[d] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(&digits[d..]);
    put(b")");
    put(tail);
    say(&msg[..n]);
}

/// An ioctl failed with an errno userfaultfd does not document for this use, where no
/// safe way on remains (the pages are present and cannot be poisoned): stop loudly.
pub(crate) fn ioctl_fatal(what: &[u8], errno: i32) -> ! {
    say_errno(what, errno, b": stopping rather than risk the program's memory\n");
    fatal(b"")
}

/// An ioctl failed unexpectedly (`errno`) placing the data of `[start, start + len)`:
/// counted (`ioctl_errors`), said once per process, and the range's missing pages
/// poisoned, so the program gets SIGBUS there, as for a swap read error, never zeros
/// or stale bytes. Err(Again) if the poison must wait and the caller may not.
pub(crate) fn lose(sh: &Shared, order: usize, what: &[u8], errno: i32, start: usize, len: usize) -> Result<(), IoctlError> {
    unexpected_once!(sh, order, what, errno, b": the folio is poisoned, accesses get SIGBUS (said once; see ioctl_errors)\n");
    place_poison(sh, start, len, false)
}

/// [`lose`] for the whole of folio `idx` of `r` (locked): the pages still the
/// program's (region.rs `live_runs`).
fn lose_folio(r: &RegionInner, idx: usize, what: &[u8], errno: i32) -> Result<(), IoctlError> {
    let sh = &*r.shared;
    unexpected_once!(sh, r.order(), what, errno, b": the folio is poisoned, accesses get SIGBUS (said once; see ioctl_errors)\n");
    let folio = r.folio_addr(idx);
    r.live_runs(idx, folio, folio + r.folio_size, |at, n| place_poison(sh, at, n, false))
}

/// [`unexpected`] with a flag of the call site's own: each site says its errno once.
macro_rules! unexpected_once {
    ($sh:expr, $order:expr, $what:expr, $errno:expr, $then:expr) => {{
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        $crate::fault::unexpected($sh, $order, &SAID, $what, $errno, $then)
    }};
}
pub(crate) use unexpected_once;

/// An errno no path expects, where nothing was lost (the data stayed where it was):
/// counted (`ioctl_errors`) and said once per `said`, with `what` and `then`.
pub(crate) fn unexpected(sh: &Shared, order: usize, said: &std::sync::atomic::AtomicBool, what: &[u8], errno: i32, then: &[u8]) {
    bump(&sh.stats.sizes[order].ioctl_errors);
    if !said.swap(true, Relaxed) {
        say_errno(what, errno, then);
    }
}

/// Tells the program's stderr that a folio was poisoned because its data could not be read.
pub(crate) fn say_poisoned() {
    const MSG: &[u8] = b"uzswap: a swapped-out folio could not be read back (I/O error or corrupt record); poisoned: accesses get SIGBUS\n";
    say(MSG);
}

/// Writes `msg` to the program's stderr, as it is: no allocation, no lock.
/// Async-signal-safe.
pub(crate) fn say(msg: &[u8]) {
    // SAFETY: write(2) is async-signal-safe and reads a live byte slice.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Places poison markers (UFFDIO_POISON) on the missing pages of `[start, start+len)`;
/// the caller then records `Transition::Poisoned`. Err(Again) if that must wait and
/// the caller may not. A kernel that refuses UFFDIO_POISON leaves no safe way on: abort.
pub(crate) fn place_poison(sh: &Shared, start: usize, len: usize, wait: bool) -> Result<(), IoctlError> {
    match uffd::retry(len, wait, Exist::Skip, None, |off, n| sh.uffd.poison(start + off, n)) {
        Ok(()) | Err(IoctlError::Gone) => Ok(()),
        Err(IoctlError::Again) => Err(IoctlError::Again),
        Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_POISON (a folio that cannot be placed)", e),
    }
}

/// UFFDIO_COPY `len` bytes into missing pages at `dst`, skipping pages already present.
/// The caller wakes the range.
pub(crate) fn fill(sh: &Shared, dst: usize, src: *const u8, len: usize, wait: bool) -> Result<(), IoctlError> {
    fill_protected(sh, dst, src, len, wait, false, None)
}

/// Fills `[dst, dst + len)` of a folio of `r` (locked: EMPTY, RESIDENT or POISONED, so
/// with no data anywhere else) with zeros where pages are missing, and settles the
/// drops of the pages it filled (region.rs), even if it stopped half-way: a zap still
/// to come takes only zeros away.
fn fill_zeros(r: &RegionInner, dst: usize, len: usize, wait: bool) -> Result<(), IoctlError> {
    let sh = &*r.shared;
    let mut placed = Placed::default();
    let done = fill_protected(sh, dst, sh.zeros as *const u8, len, wait, false, Some(&mut placed));
    r.filled((dst - r.base.load(Acquire)) >> r.folio_shift, &placed.filled);
    done
}

/// What a fill did, page by page (`fill_protected`).
#[derive(Default)]
pub(crate) struct Placed {
    /// The pages it placed, even if it then stopped (EAGAIN).
    pub filled: PageSet,
    /// The pages it found there and left as they were.
    pub present: PageSet,
}

/// `fill`, with the pages write-protected when `protect` (the region must be
/// registered for write protection: `keep_clean`). Pages found already there are
/// skipped; `placed`, if given, notes which were and which were filled.
pub(crate) fn fill_protected(
    sh: &Shared,
    dst: usize,
    src: *const u8,
    len: usize,
    wait: bool,
    protect: bool,
    mut placed: Option<&mut Placed>,
) -> Result<(), IoctlError> {
    uffd::retry(len, wait, Exist::Skip, None, |off, n| {
        // SAFETY: src points to at least len bytes, and off < len.
        let from = unsafe { src.add(off) };
        let r = sh.uffd.copy(dst + off, from, n, protect);
        if let Some(p) = placed.as_deref_mut() {
            match r {
                Partial::Done => p.filled.add_range(dst + off, n),
                Partial::Failed { errno: libc::EEXIST, done: 0 } => p.present.add(dst + off),
                Partial::Failed { done, .. } => p.filled.add_range(dst + off, done),
            }
        }
        r
    })
}

/// Makes the present pages of `[start, start+len)` writable.
pub(crate) fn unprotect_range(sh: &Shared, start: usize, len: usize, wait: bool) -> Result<(), IoctlError> {
    uffd::retry(len, wait, Exist::Error, None, |off, n| match sh.uffd.write_protect(start + off, n, false) {
        Ok(()) => Partial::Done,
        Err(errno) => Partial::Failed { errno, done: 0 },
    })
}

/// Moves a folio's pages from the shadow back into the region. A page already in
/// the region where the folio's own page should go is an error. Where the program
/// changed the region's protection (MOVE wants both sides alike: EINVAL), the pages
/// are copied instead, the shadow's holes left holes (a PARTIAL folio's missing pages
/// must stay missing: their data is in the store); the caller frees the shadow.
///
/// When it must stop half-way (EAGAIN, and `wait` is false) it returns `Again` and
/// leaves what moved in the region: the caller keeps the folio locked and calls again
/// once the reader has read the change, and that call moves what the shadow still
/// holds (pagemap: what moved left holes there; 6.18's UFFDIO_MOVE can move pages it
/// does not count, see the reclaimer's `put_back_present`). It never moves pages out
/// of the region again: by the staging context (the only one without EAGAIN) that
/// could take what another thread mapped at those addresses after an unmap not yet
/// read (reclaim.rs, "Take-outs"), and nothing else could undo it before the read.
/// If the pagemap cannot be read, the program stops rather than guess.
pub(crate) fn move_back(sh: &Shared, dst: usize, src: usize, len: usize, wait: bool) -> Result<(), IoctlError> {
    let done = uffd::retry(len, wait, Exist::Error, None, |off, n| sh.uffd.move_pages(dst + off, src + off, n));
    match done {
        Err(IoctlError::Unexpected(libc::EINVAL)) => copy_present(sh, dst, src, len, wait),
        // The region holds what an earlier call moved: move the rest, run by run.
        Err(IoctlError::Unexpected(libc::EEXIST)) => match move_present(sh, &sh.uffd, dst, src, len, wait, Exist::Error) {
            Err(IoctlError::Unexpected(libc::EINVAL)) => copy_present(sh, dst, src, len, wait),
            Err(e) => Err(e),
            Ok(false) => ioctl_fatal(b"pagemap (a swap-in moving the rest of a folio)", libc::EIO),
            Ok(true) => Ok(()),
        },
        other => other,
    }
}

/// Moves, on context `ctx`, every page `[src, src + len)` holds (pagemap: present or
/// swapped) to the same offset from `dst`, run by run, stopping at the first error;
/// EEXIST as `exist` says. Ok(false) if the pagemap could not be read. For moves that
/// must follow the pages rather than the kernel's count of them (what a move stopped
/// half-way left, what reached the reclaimer's pivot).
pub(crate) fn move_present(sh: &Shared, ctx: &uffd::Uffd, dst: usize, src: usize, len: usize, wait: bool, exist: Exist) -> Result<bool, IoctlError> {
    let mut failed = Ok(());
    let read = sh.page_runs(src, len, crate::holds_data, |at, bytes| {
        let to = dst + (at - src);
        failed = uffd::retry(bytes, wait, exist, None, |off, n| ctx.move_pages(to + off, at + off, n));
        failed.is_ok()
    });
    failed.map(|()| read)
}

/// Copies the pages present in `[src, src+len)` (the shadow) to `dst`; holes stay
/// holes. EINVAL if the shadow's pagemap cannot be read. The copies go in protected
/// where the region allows it and are opened once all are in, so a give-up leaves
/// nothing writable beside the shadow's pages (see `bring_back`).
pub(crate) fn copy_present(sh: &Shared, dst: usize, src: usize, len: usize, wait: bool) -> Result<(), IoctlError> {
    let protect = sh.cfg.keep_clean;
    let mut failed = None;
    let done = sh.page_runs(src, len, crate::holds_data, |start, bytes| {
        let off = start - src;
        failed = fill_protected(sh, dst + off, start as *const u8, bytes, wait, protect, None).err();
        failed.is_none()
    });
    match failed {
        Some(e) => Err(e),
        None if !done => Err(IoctlError::Unexpected(libc::EINVAL)),
        None if protect => match unprotect_range(sh, dst, len, wait) {
            // Left protected: a write faults as RESIDENT and opens its page.
            Ok(()) | Err(IoctlError::Again | IoctlError::Gone) => Ok(()),
            Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT", e),
        },
        None => Ok(()),
    }
}

// ---- The reader thread. ----

enum Pending {
    Fault { addr: usize, since: Instant, access: Access },
    /// `read`: which of the reader's reads (`Shared::reads`) brought it.
    Range { event: u8, start: usize, end: usize, since: Instant, read: u64 },
}

/// Reads the region context: page faults (thread mode) and REMOVE/UNMAP/REMAP events
/// (both modes). Never blocks on a folio: whatever cannot finish now is retried.
///
/// It allocates nothing once started (its buffers are made here, with room for
/// `PENDING` messages held at once: one per thread blocked in a fault or a madvise).
/// Before a read that could overflow them, the faults put off longest are handed back
/// to the kernel (woken: the access faults again and comes back as a new message); only
/// more than `PENDING` drops at once, which cannot be handed back, would make them grow.
/// A thread blocked in a fault may hold its allocator's lock; if we allocated, we could
/// wait for it forever.
pub(crate) fn reader_loop(sh: Arc<Shared>) {
    const PENDING: usize = 256;
    let mut buf = vec![0u8; crate::MAX_FOLIO];
    let mut msgs = [UffdMsg::default(); 64];
    let mut pending: Vec<Pending> = Vec::with_capacity(PENDING);
    let mut blocked: Vec<(usize, usize)> = Vec::with_capacity(PENDING);
    // From here on the reader is on the fault path as a SIGBUS handler is (tests'
    // allocators check both with `in_fault_handler`).
    let _serving = HandlerFlag::enter();
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
        if fds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
            // The program closed ours behind the shim (a raw close_range).
            crate::fds::restore_or_stop();
        }
        // Room for a whole read without growing `pending` (see above).
        while pending.len() + msgs.len() > PENDING {
            let Some(i) = pending.iter().position(|p| matches!(p, Pending::Fault { .. })) else { break };
            if let Pending::Fault { addr, .. } = pending.remove(i) {
                wake(&sh, 0, addr & !(PAGE - 1), PAGE);
            }
        }
        // Raised before the read that releases a thread blocked in madvise/munmap, and
        // lowered once its range is processed: a SIGBUS fault that follows the madvise
        // waits for it instead of finding the folio's old state.
        sh.events_busy.store(true, SeqCst);
        // No reclaimer MOVE, nor a handler's fill (`Shared::begin_fill`), may be under
        // way when a REMOVE is read (the kernel zaps right after); one that started
        // before never waits for us, so this wait is short.
        sh.moves.close_and_drain();
        let n = match sh.uffd.read_msgs(&mut msgs) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => 0,
            Err(e) => {
                // Without the reader no fault or drop is served again: every thread that
                // touches swapped-out memory would wait for ever. Stop, and say why.
                say_errno(b"reading the userfaultfd", e.raw_os_error().unwrap_or(0), b": faults and drops can no longer be served\n");
                fatal(b"")
            }
        };
        let read = sh.reads.fetch_add(1, Release) + 1;
        let removes = msgs[..n].iter().any(|m| m.event == uffd::EVENT_REMOVE);
        let now = Instant::now();
        for m in &msgs[..n] {
            match m.event {
                uffd::EVENT_PAGEFAULT => pending.push(Pending::Fault {
                    addr: m.arg[1] as usize,
                    since: now,
                    access: if m.arg[0] & uffd::PAGEFAULT_FLAG_WRITE != 0 { Access::Write } else { Access::Read },
                }),
                uffd::EVENT_REMOVE | uffd::EVENT_UNMAP => {
                    mark_range(&sh, m.event, m.arg[0] as usize, m.arg[1] as usize);
                    pending.push(Pending::Range {
                    event: m.event,
                    start: m.arg[0] as usize,
                    end: m.arg[1] as usize,
                    since: now,
                    read,
                    })
                }
                uffd::EVENT_REMAP => remap(&sh, m.arg[0] as usize, m.arg[1] as usize, m.arg[2] as usize),
                // None other is asked for (UFFDIO_API's features): counted and said.
                other => {
                    unexpected_once!(&sh, 0, b"an unknown userfaultfd event", i32::from(other), b": ignored (said once; see ioctl_errors)\n");
                }
            }
        }
        // The drops and unmaps just read are marked: take-outs may look (they pass
        // torn folios by) unless drops are left to process; fills may look (moves.rs).
        sh.moves.set_closed(removes || holds_removes(&pending));
        sh.moves.marked();
        // In arrival order; a fault inside a range event still pending waits behind it.
        let mut process = |pending: &mut Vec<Pending>| {
            blocked.clear();
            pending.retain_mut(|p| match p {
                Pending::Fault { addr, since, access } => {
                    blocked.iter().any(|&(s, e)| (s..e).contains(addr))
                        || !fault_on_reader(&sh, *addr, &mut buf, *since, *access)
                }
                Pending::Range { event, start, end, read, .. } => {
                    *start = range_event(&sh, *event, *start, *end, *read);
                    if *start < *end {
                        blocked.push((*start, *end));
                    }
                    *start < *end
                }
            });
        };
        process(&mut pending);
        // A fault put off because a drop was pending (EAGAIN): the drop just read clears
        // only once the dropping thread runs again, and that thread's next drop blocks
        // fills anew, so a fill must fall in between. Retried right after the read it
        // never does (a thread dropping in a loop starved faults for minutes); retried
        // a few times while that thread runs, it does. Bounded: then as before.
        for _ in 0..READER_RETRIES {
            if !pending.iter().any(|p| matches!(p, Pending::Fault { .. })) {
                break;
            }
            std::thread::yield_now();
            process(&mut pending);
        }
        sh.events_busy.store(!blocked.is_empty(), SeqCst);
        // REMOVE ranges are processed (their pages were marked when read): moves may go on.
        sh.moves.set_closed(holds_removes(&pending));
        if n > 0 {
            sh.refresh_usage();
        }
    }
}

/// MADV_DONTNEED/FREE (REMOVE) or munmap (UNMAP) of `[start, end)` was just read: its
/// pages are marked at once, before any folio lock is taken. Dropped ones are marked
/// pending, so nothing brings their old bytes back in or takes them out while the
/// kernel has yet to zap them; unmapped ones gone, so nothing moves what the program
/// maps there next (region.rs).
fn mark_range(sh: &Shared, event: u8, start: usize, end: usize) {
    let guard = TableGuard::enter();
    for r in guard.all(sh.id) {
        if event == uffd::EVENT_UNMAP {
            r.mark_gone_range(start, end);
        } else {
            r.mark_drop_range(start, end);
        }
    }
}

/// Whether a region of runtime `id` other than `me` has a folio in `[start, end)` it
/// has not lost to an unmap. Read after `me` went into the table, as
/// [`mark_stale_claims`] is: of two regions installed at once, one sees the other.
pub(crate) fn claimed_by_another(id: u64, me: &RegionInner, start: usize, end: usize) -> bool {
    let guard = TableGuard::enter();
    let claimed = guard.every(id).any(|r| !std::ptr::eq(r, me) && r.live_within(start, end));
    claimed
}

/// `me` was just put in the table over a mapping the kernel has just made for us, at
/// addresses no mapping held: whatever another region of runtime `id` claims there
/// is stale (a hole it was registered over: registered.rs) and is marked gone, as an
/// UNMAP would have.
pub(crate) fn mark_stale_claims(id: u64, me: &RegionInner) {
    let guard = TableGuard::enter();
    let start = me.base.load(Acquire);
    for r in guard.every(id).filter(|r| !std::ptr::eq(*r, me)) {
        r.mark_gone_range(start, start + me.len);
    }
}

/// Whether REMOVE ranges read earlier are still unprocessed.
fn holds_removes(pending: &[Pending]) -> bool {
    pending.iter().any(|p| matches!(p, Pending::Range { event: uffd::EVENT_REMOVE, .. }))
}

/// Returns true when the fault is finished with.
fn fault_on_reader(sh: &Shared, addr: usize, buf: &mut [u8], since: Instant, access: Access) -> bool {
    let guard = TableGuard::enter();
    match guard.find(addr, |r| r.shared.id == sh.id) {
        Some(r) => {
            let done = resolve(r, addr, buf, Caller::Reader, since, access);
            trace_fault(r, addr, access, done);
            match done {
                Resolve::Done => true,
                Resolve::Defer => false,
                Resolve::NotOurs => zero_unknown(sh, addr, access),
            }
        }
        None => zero_unknown(sh, addr, access),
    }
}

/// Records in the flight recorder (trace.rs) a fault at `addr` in `r` and what came of it.
fn trace_fault(r: &RegionInner, addr: usize, access: Access, done: Resolve) {
    if !crate::trace::on() {
        return;
    }
    let base = r.base.load(Acquire);
    if addr < base || addr >= base + r.len {
        return;
    }
    let idx = (addr - base) >> r.folio_shift;
    let page = ((addr - r.folio_addr(idx)) / PAGE) as u16;
    let outcome = match done {
        Resolve::Done => 0,
        Resolve::Defer => 1,
        Resolve::NotOurs => 2,
    };
    crate::trace::note(r.key(idx), crate::trace::Event::Fault { page, write: access == Access::Write, outcome });
}

/// A fault in our context outside every region (the part of a region a program
/// mremapped elsewhere, or the tail it grew): plain anonymous semantics, a zero page;
/// a write to a page that kept its write protection through the move is let in.
fn zero_unknown(sh: &Shared, addr: usize, access: Access) -> bool {
    let page = addr & !(PAGE - 1);
    if access == Access::Write {
        match unprotect_range(sh, page, PAGE, false) {
            Err(IoctlError::Again) => return false,
            Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT", e),
            Ok(()) | Err(IoctlError::Gone) => {}
        }
    }
    let done = match fill(sh, page, sh.zeros as *const u8, PAGE, false) {
        Err(IoctlError::Unexpected(e)) => lose(sh, 0, b"UFFDIO_COPY", e, page, PAGE),
        other => other,
    };
    if done == Err(IoctlError::Again) {
        return false;
    }
    wake(sh, 0, page, PAGE);
    true
}

/// Wakes the threads waiting for `[start, start + len)`. A wake that fails leaves them
/// waiting (their access faults again only if something else wakes them): counted and
/// said, as no errno is expected here.
fn wake(sh: &Shared, order: usize, start: usize, len: usize) {
    if let Err(errno) = sh.uffd.wake(start, len) {
        unexpected_once!(sh, order, b"UFFDIO_WAKE", errno, b": a thread may stay blocked on that folio (said once; see ioctl_errors)\n");
    }
}

/// REMOVE (MADV_DONTNEED/FREE/REMOVE) or UNMAP of `[start, end)`: frees what the range
/// held in every tier. Processes folios in order; returns where it stopped (a busy
/// folio) or `end`. Where two regions hold an address (see `TableGuard::find`), the
/// folios of both there are locked first and then dropped together, so that a retry
/// never drops one of them twice (the program may have refilled it meanwhile).
/// `read` is the read that brought the event: regions put in the table since are
/// passed by.
fn range_event(sh: &Shared, event: u8, start: usize, end: usize, read: u64) -> usize {
    const MAX_OVERLAP: usize = 8;
    let guard = TableGuard::enter();
    let mut at = start;
    while at < end {
        let mut here: [Option<(&RegionInner, usize, u8)>; MAX_OVERLAP] = [None; MAX_OVERLAP];
        let mut n = 0;
        // Past `at`: the nearest end of a folio dropped here, or start of a region.
        let mut next = end;
        // A region put in the table since the read is over what the program maps
        // there now, not what the event dropped (its pages were never marked).
        for r in guard.all(sh.id).filter(|r| r.born.load(Relaxed) < read) {
            let base = r.base.load(Acquire);
            if at < base || at >= base + r.len {
                if base > at {
                    next = next.min(base);
                }
                continue;
            }
            let idx = (at - base) >> r.folio_shift;
            next = next.min(base + ((idx + 1) << r.folio_shift));
            // Gone before (UNMAPPED is for good): nothing to lock. So only folios that
            // still have pages meet here: a torn one and one beside its gone pages.
            if r.folios.peek(idx) == UNMAPPED {
                continue;
            }
            let Some(prev) = r.try_lock(idx) else {
                for &(r, idx, prev) in here[..n].iter().flatten() {
                    r.unlock(idx, prev);
                }
                return at;
            };
            if n == MAX_OVERLAP {
                fatal(b"uzswap: more managed regions over one address than the reader can drop together\n");
            }
            here[n] = Some((r, idx, prev));
            n += 1;
        }
        for &(r, idx, prev) in here[..n].iter().flatten() {
            let folio = r.folio_addr(idx);
            let (lo, hi) = (start.max(folio), end.min(folio + r.folio_size));
            drop_range(r, idx, prev, lo == folio && hi == folio + r.folio_size, event == uffd::EVENT_UNMAP);
        }
        at = next;
    }
    end
}

/// Drops the folio `idx` (locked, in state `prev`), the `whole` of it or the part the
/// event named (its pages are marked pending: region.rs), and unlocks it. Maps and
/// moves nothing, so it cannot fail: a fill or a move would meet EAGAIN while any
/// other drop is queued (folio.rs).
fn drop_range(r: &RegionInner, idx: usize, prev: u8, whole: bool, unmap: bool) {
    // Given back or unmapped in pieces, the last piece frees it as a drop of the whole
    // would (a folio that is out would otherwise keep its entry until touched again; a
    // resident one unmapped in pieces, taken out later, carried off what the program
    // had mapped there since: region.rs, "Pages unmapped").
    let whole = whole || if unmap { r.all_gone(idx) } else { r.all_drop_pending(idx) };
    let t = if whole { Transition::Dropped { unmap } } else { Transition::PartDropped };
    match prev {
        UNMAPPED => return r.unlock(idx, prev),
        // The dropped pages leave the shadow (they were marked when the event was read);
        // all of them, once the folio is gone whole (unmapped pages are not marked
        // dropped: a torn folio's are left there, and never copied back).
        PROBATION => {
            r.discard_drop_pending(idx);
            if whole {
                free_shadow(r, idx);
            }
        }
        // Its pages stay mapped until the madvise thread zaps them: they were marked
        // pending when the event was read (region.rs), so they are not taken out
        // meanwhile. Moving them out from here instead races that zap (UFFDIO_MOVE
        // was seen to spin in the kernel). Pages a clean folio keeps stay
        // write-protected; their first write faults as RESIDENT and unprotects them.
        // A clean folio's copy: gone with the whole folio, wrong for a part.
        RESIDENT | CLEAN => {}
        // Part of a folio that is out (SWAPPED, PARTIAL): its marked pages come in as
        // zeros whenever it does. Dropped whole, its entry or poison goes.
        _ => {}
    }
    r.finish(idx, prev, t, None);
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
            // The kernel moved the pages that were in place (write protection and
            // all: `zero_unknown` lets a write in); it could not move what we hold
            // elsewhere (swapped out, on probation), and the new range is no region of
            // ours. With nothing elsewhere, the moved part is plain memory now.
            // Otherwise stop rather than let those pages read as zeros at their new
            // place (a busy folio is taken as holding data elsewhere).
            let first = (from.max(base) - base) >> r.folio_shift;
            let last = ((from + len).min(base + r.len) - 1 - base) >> r.folio_shift;
            if (first..=last).any(|idx| !matches!(r.folios.peek(idx), EMPTY | RESIDENT | CLEAN | SHARED | UNMAPPED)) {
                fatal(
                    b"uzswap: the program moved part of its managed memory (mremap) while some of it was swapped out; \
                      uzswap cannot follow a partial move and stops the program rather than let that memory read as zeros\n",
                );
            }
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
        // SA_ONSTACK as Go asks of every handler (its goroutine stacks are a few KiB);
        // the work itself runs on a stack of ours (`on_stack`).
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
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
    // A SIGBUS sent by kill/raise/sigqueue (si_code <= 0) is never a fault: its si_addr
    // is the sender's pid and uid.
    // SAFETY: as above.
    let code = unsafe { (*info).si_code };
    if code == BUS_MCEERR_AR || code <= 0 {
        return chain(sig, info, ctx);
    }
    {
        let guard = TableGuard::enter();
        // Only a region registered for SIGBUS raises one: a thread-path runtime's
        // region over the same page (tests run both in one process) is a stale one.
        if let Some(r) = guard.find(addr, |r| r.shared.cfg.fault_path == FaultPath::Sigbus) {
            let mut slot = r.shared.buffers.take();
            let access = sigbus_access(ctx);
            let mut done = Resolve::NotOurs;
            // On the slot's own stack: the interrupted one may be a goroutine's few
            // KiB, or the alternate signal stack, too small for a decompressor. With
            // every signal blocked meanwhile: a signal taken while we are off the
            // alternate stack would be delivered at its top again, over this
            // handler's own frame and saved context (the kernel sees we left it).
            let (stack, buf) = slot.parts();
            // SAFETY: pthread_sigmask on sigset_t values we own; the mask is put back
            // before the handler goes on.
            let old = unsafe {
                let (mut all, mut old): (libc::sigset_t, libc::sigset_t) = (std::mem::zeroed(), std::mem::zeroed());
                libc::sigfillset(&mut all);
                libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
                old
            };
            on_stack(stack, &mut || done = resolve(r, addr, buf, Caller::Handler, Instant::now(), access));
            trace_fault(r, addr, access, done);
            // SAFETY: as above.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, null_mut()) };
            drop(slot);
            // Deferred (a drop being taken in, the range changing): the access
            // is retried, and faults again until it is served; the CPU goes to
            // the reader meanwhile.
            if done == Resolve::Defer {
                // SAFETY: sched_yield takes no arguments and is async-signal-safe.
                unsafe { libc::sched_yield() };
            }
            if done != Resolve::NotOurs {
                return;
            }
        }
    }
    chain(sig, info, ctx);
}

/// Calls `f` with the stack pointer at the top of `stack` (16-byte aligned), and returns
/// on the caller's stack. Async-signal-safe: a few register moves. Elsewhere than
/// x86-64, `f` runs on the caller's stack.
fn on_stack(stack: &mut [u8], f: &mut dyn FnMut()) {
    extern "C" fn trampoline(p: *mut libc::c_void) {
        // SAFETY: `p` is the `&mut &mut dyn FnMut()` passed below, alive for the call.
        let f = unsafe { &mut *(p as *mut &mut dyn FnMut()) };
        f();
    }
    let mut f = f;
    let arg = (&mut f as *mut &mut dyn FnMut()).cast::<libc::c_void>();
    #[cfg(target_arch = "x86_64")]
    {
        let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
        // SAFETY: `top` is the 16-byte-aligned end of memory we own exclusively and that
        // outlives the call; r12 (callee-saved, so the callee keeps it) holds our stack
        // pointer across the call, and the call's clobbers are declared by clobber_abi.
        unsafe {
            std::arch::asm!(
                "mov r12, rsp",
                "mov rsp, {top}",
                "call {f}",
                "mov rsp, r12",
                top = in(reg) top,
                f = in(reg) trampoline as extern "C" fn(*mut libc::c_void),
                in("rdi") arg,
                out("r12") _,
                clobber_abi("C"),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = stack;
        trampoline(arg);
    }
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
    /// Set while this thread runs `on_sigbus`, and on the reader thread while it serves
    /// faults and events (neither may allocate). Const-initialised with no destructor:
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

/// Whether the calling thread is inside the runtime's SIGBUS handler, or is the
/// runtime's reader thread serving faults. For tests that check the fault path is
/// async-signal-safe (e.g. a global allocator that aborts when called from it).
pub fn in_fault_handler() -> bool {
    IN_FAULT_HANDLER.with(|f| f.get())
}
