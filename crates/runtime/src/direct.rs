//! Direct reclaim: a faulting thread makes room itself by evicting clean folios, as the
//! kernel's allocation path reclaims when kswapd falls behind (mm/vmscan.c,
//! try_to_free_pages).
//!
//! Why: an eviction takes the folio's pages out of the program's view with UFFDIO_MOVE,
//! and the TLB flush that comes with it interrupts every other CPU running the program
//! (an IPI, and a VM exit on each side on virtual machines). Done by the reclaimer on
//! another CPU, a 4 KiB random re-read paid one IPI per fault, and the reclaimer spent
//! three quarters of its time sending them. Done by the thread that faults, while the
//! reclaimer sleeps, the flush stays on this CPU.
//!
//! What: only clean folios (CLEAN: the store holds their copy), so an eviction is a MOVE
//! to the shadow and a DONTNEED there: no compression, no allocation, atomics and
//! system calls only, which the SIGBUS handler may do. Candidates come oldest first
//! through `Shared::clean_queue`: the reclaimer moves the heads of its clean list
//! there (`reclaim::feed_clean_queue`) and is kicked when it runs low. Each entry is
//! checked against its folio under the folio lock, as the reclaimer checks its own.
//! Dirty folios, probation and writeback stay with the reclaimer.

use crate::fault::TableGuard;
use crate::queue::Queued;
use crate::reclaim::take_out;
use crate::region::*;
use crate::{ReclaimPolicy, Shared};
use std::sync::atomic::Ordering::*;

/// Queue entries a fault takes before it leaves the rest to the reclaimer.
const MAX_TRIES: usize = 8;
/// Longest run of contiguous clean folios one entry names (a sequential re-read queues
/// folios in address order): one MOVE and one DONTNEED for all of it.
pub(crate) const MAX_RUN_BYTES: usize = 256 << 10;
/// The reclaimer leaves clean folios to faulting threads while one has evicted within
/// this many milliseconds (`Shared::direct_reclaiming`).
pub(crate) const DIRECT_ACTIVE_MS: u32 = 10;

/// Evicts clean folios until usage is at most `target`: with the `Probation` policy it
/// keeps `Shared::probation_queue` filled from the clean queue and evicts from its head,
/// as the reclaimer does; with `Fifo` it evicts from the clean queue. Returns whether
/// usage is at most `target`. Async-signal-safe; only for threads that may wait (see
/// `fault::may_wait`): a MOVE may have to be retried, or put back.
pub(crate) fn direct_reclaim(sh: &Shared, target: u64) -> bool {
    let guard = TableGuard::enter();
    let probation = sh.cfg.policy == ReclaimPolicy::Probation;
    for _ in 0..MAX_TRIES {
        if sh.usage() <= target {
            break;
        }
        // Probation: evict its head once it is full, fill it from the clean queue until
        // then (which frees nothing: go on), and evict its head if that queue is empty.
        if probation
            && sh.probation.load(Relaxed) >= sh.probation_target()
            && evict_probation_head(sh, &guard, true)
        {
            continue;
        }
        match sh.clean_queue.pop() {
            Some(e) => {
                if let Some(r) = guard.at(e.slot, sh.id) {
                    for_each_locked(r, e, lock_clean, |first, count| {
                        take_out_clean(sh, r, first, count, probation)
                    });
                }
            }
            None if probation && evict_probation_head(sh, &guard, true) => {}
            None => break,
        }
    }
    // Ask for more once; the reclaimer clears the flag when it scans.
    if sh.clean_queue.len() < sh.clean_queue.capacity() / 4 && !sh.clean_wanted.swap(true, Relaxed)
    {
        sh.kick_reclaimer();
    }
    sh.usage() <= target
}

/// Evicts the clean folios of the head of the probation queue. `direct`: for a
/// faulting thread (else the reclaimer, when no fault does it). False if the queue is
/// empty.
pub(crate) fn evict_probation_head(sh: &Shared, guard: &TableGuard, direct: bool) -> bool {
    let Some(e) = sh.probation_queue.pop() else {
        return false;
    };
    if let Some(r) = guard.at(e.slot, sh.id) {
        for_each_locked(r, e, lock_clean_probation, |first, count| {
            sh.probation
                .fetch_sub((count << r.folio_shift) as u64, Relaxed);
            free_shadow(sh, r, first, count, direct);
        });
    }
    true
}

/// Calls `f(first, count)` for each stretch of the run `e` names whose folios `lock`
/// locked (it leaves any other folio as it was).
fn for_each_locked(
    r: &RegionInner,
    e: Queued,
    lock: fn(&RegionInner, usize) -> bool,
    mut f: impl FnMut(usize, usize),
) {
    let end = (e.idx + e.tag as usize).min(r.folios());
    let mut idx = e.idx;
    while idx < end {
        let first = idx;
        while idx < end && lock(r, idx) {
            idx += 1;
        }
        if idx > first {
            f(first, idx - first);
        } else {
            idx += 1;
        }
    }
}

/// Locks the folio if it is clean and nothing forbids moving its pages to the shadow.
fn lock_clean(r: &RegionInner, idx: usize) -> bool {
    match r.try_lock(idx) {
        Some(CLEAN) if !r.zap_may_be_pending(idx) && !r.shadow_pending[idx].load(Acquire) => true,
        Some(s) => {
            r.unlock(idx, s);
            false
        }
        None => false,
    }
}

/// Locks the folio if it is on probation and went out clean (its copy is in the store).
fn lock_clean_probation(r: &RegionInner, idx: usize) -> bool {
    match r.try_lock(idx) {
        Some(PROBATION) if r.kept[idx].load(Relaxed) => true,
        Some(s) => {
            r.unlock(idx, s);
            false
        }
        None => false,
    }
}

/// Moves `count` clean folios from `first`, locked by us, to the shadow; then puts them
/// on probation (`to_probation`) or frees them.
fn take_out_clean(sh: &Shared, r: &RegionInner, first: usize, count: usize, to_probation: bool) {
    let unlock_all = |state| (first..first + count).for_each(|idx| r.unlock(idx, state));
    // Not while the reader takes in a REMOVE event (see `Shared::begin_move`).
    if !sh.begin_move() {
        return unlock_all(CLEAN);
    }
    let moved = take_out(sh, r, first, count);
    sh.end_move();
    if !moved {
        // Whatever moved came back writable: the copies are no longer the content.
        (first..first + count).for_each(|idx| {
            r.drop_kept(idx, false);
        });
        return unlock_all(RESIDENT);
    }
    sh.direct_at.store(sh.clock_ms(), Relaxed);
    if to_probation
        && sh
            .probation_queue
            .push(r.slot.load(Relaxed), first, count as u64)
    {
        sh.stats.sizes[r.order()]
            .probation_out
            .fetch_add(count as u64, Relaxed);
        sh.probation
            .fetch_add((count << r.folio_shift) as u64, Relaxed);
        return unlock_all(PROBATION);
    }
    free_shadow(sh, r, first, count, true);
}

/// Frees the shadow pages of `count` clean folios from `first`, locked by us, whose
/// copies are in the store, and unlocks them SWAPPED.
fn free_shadow(sh: &Shared, r: &RegionInner, first: usize, count: usize, direct: bool) {
    let len = count << r.folio_shift;
    // SAFETY: our shadow range, holding just these folios' pages; the staging context
    // has no REMOVE events.
    unsafe { libc::madvise(r.shadow_addr(first) as *mut _, len, libc::MADV_DONTNEED) };
    let st = &sh.stats.sizes[r.order()];
    st.clean_evict.fetch_add(count as u64, Relaxed);
    if direct {
        st.direct_evict.fetch_add(count as u64, Relaxed);
    }
    sh.resident.fetch_sub(len as u64, Relaxed);
    (first..first + count).for_each(|idx| r.unlock(idx, SWAPPED));
}
