//! A managed region: the program's mapping, its shadow, and one state word per folio.

use crate::Shared;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::Arc;

/// Folio states. Every folio is in exactly one; BUSY is the folio lock (the kernel's
/// PG_locked), taken by whoever changes where the folio's data lives.
pub(crate) const EMPTY: u8 = 0; // never touched, or dropped: faults in as zeros
pub(crate) const RESIDENT: u8 = 1; // mapped in the region (pages may have DONTNEED holes)
pub(crate) const SWAPPED: u8 = 2; // whole folio in the store under its key
pub(crate) const PROBATION: u8 = 3; // pages moved to the shadow, not yet compressed
pub(crate) const UNMAPPED: u8 = 4; // the program unmapped it; terminal
pub(crate) const BUSY: u8 = 5;
/// Mapped in the region, every page write-protected, and a copy of exactly these bytes
/// in the store under its key (a read fault brought it back without freeing the entry:
/// the swap cache, zswap's non-exclusive load). Evicting it costs no compression; the
/// first write faults and frees the copy before it can land.
pub(crate) const CLEAN: u8 = 6;
/// The store could not give the folio back (an I/O error or a corrupt record in the
/// backing file): its pages hold poison markers (UFFDIO_POISON), so every access
/// raises SIGBUS, as the kernel does for a hardware memory error, rather than read
/// wrong bytes. Not counted as resident. Dropping the whole folio (MADV_DONTNEED,
/// munmap) clears it; a page dropped alone faults back in as zeros on the thread
/// path and still raises SIGBUS on the SIGBUS path (the two look alike there).
pub(crate) const POISONED: u8 = 7;

/// How long after a drop of a mapped folio the reclaimer leaves it alone: far longer
/// than a woken thread waits for a CPU even on a loaded machine, short enough that
/// memory a program drops and reuses at once is not held over the budget for long.
pub(crate) const ZAP_GRACE_MS: u32 = 250;

pub(crate) struct RegionInner {
    pub id: u64,
    /// Start of the mapping; changes when the program mremaps the whole region.
    pub base: AtomicUsize,
    pub len: usize,
    pub folio_size: usize,
    pub folio_shift: u32,
    /// Same length as the region, registered with the staging context: a folio's pages
    /// are moved to the same offset here while it is on probation or being compressed.
    pub shadow: usize,
    pub states: Box<[AtomicU8]>,
    /// Fault-in order (a global sequence): smaller is older, i.e. colder.
    pub stamps: Box<[AtomicU64]>,
    /// Set while the store may hold an entry under the folio's key (always in SWAPPED
    /// and CLEAN; in PROBATION it says the pages went out clean, so the entry is still
    /// their copy). Changed only under the folio lock. In any other state a set flag
    /// is a leftover the next owner frees ([`RegionInner::drop_kept`]).
    pub kept: Box<[AtomicBool]>,
    /// When the program last dropped part of the folio while it was mapped
    /// (`Shared::clock_ms`, 0 = never): the kernel zaps those pages some time after the
    /// reader has seen the REMOVE event, and until it has, the reclaimer must not take
    /// the folio out, or the dropped pages would survive in the shadow. See
    /// `RegionInner::zap_may_be_pending`.
    pub dropped_at: Box<[AtomicU32]>,
    /// Its index in the region table (fault.rs), which names it in the fault queue.
    pub slot: AtomicUsize,
    pub shared: Arc<Shared>,
}

impl RegionInner {
    pub fn folios(&self) -> usize {
        self.states.len()
    }

    pub fn key(&self, idx: usize) -> u64 {
        (self.id << 40) | idx as u64
    }

    pub fn order(&self) -> usize {
        (self.folio_shift - 12) as usize
    }

    pub fn try_lock(&self, idx: usize) -> Option<u8> {
        let s = self.states[idx].load(Acquire);
        if s == BUSY {
            return None;
        }
        self.states[idx].compare_exchange(s, BUSY, Acquire, Relaxed).ok()
    }

    /// Spins until the folio is unlocked, then locks it. Only for threads that the
    /// current holder never waits for (see the lock order in lib.rs).
    pub fn lock(&self, idx: usize) -> u8 {
        let mut spins = 0u32;
        loop {
            if let Some(s) = self.try_lock(idx) {
                return s;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // SAFETY: sched_yield is async-signal-safe.
                unsafe { libc::sched_yield() };
            }
        }
    }

    pub fn unlock(&self, idx: usize, state: u8) {
        debug_assert!(state != BUSY);
        self.states[idx].store(state, Release);
    }

    /// Whether pages of the folio that the program dropped may still be mapped: the
    /// reclaimer leaves such a folio alone for `ZAP_GRACE_MS`. The thread that called
    /// madvise zaps right after the reader has read its event, so this is a matter of
    /// being scheduled; MADV_FREE'd pages, which the kernel leaves mapped, are taken
    /// out once the grace has passed (their content is theirs to keep).
    pub fn zap_may_be_pending(&self, idx: usize) -> bool {
        let at = self.dropped_at[idx].load(Relaxed);
        at != 0 && self.shared.clock_ms().wrapping_sub(at) < ZAP_GRACE_MS
    }

    /// Unlocks a folio just faulted in as `state` (RESIDENT or CLEAN): a fresh stamp,
    /// and an entry in the fault queue for the reclaimer, queued once the folio is
    /// unlocked so the reclaimer never finds it still locked. Async-signal-safe.
    pub fn unlock_faulted_in(&self, idx: usize, state: u8) {
        let sh = &*self.shared;
        let stamp = sh.stamp.fetch_add(1, Relaxed);
        self.stamps[idx].store(stamp, Relaxed);
        self.unlock(idx, state);
        sh.fault_queue.push(self.slot.load(Relaxed), idx, stamp);
    }

    pub fn folio_addr(&self, idx: usize) -> usize {
        self.base.load(Acquire) + (idx << self.folio_shift)
    }

    pub fn shadow_addr(&self, idx: usize) -> usize {
        self.shadow + (idx << self.folio_shift)
    }

    /// Frees the store entry the folio (locked) may still hold: a clean copy that is
    /// going stale (`invalidated` false: counted as `kept_freed`) or one the program
    /// dropped with the mapping (`invalidated` true). Returns whether there was one.
    pub fn drop_kept(&self, idx: usize, invalidated: bool) -> bool {
        if !self.kept[idx].swap(false, Relaxed) {
            return false;
        }
        let sh = &*self.shared;
        let freed = sh.store.invalidate(self.key(idx));
        if freed {
            let st = &sh.stats.sizes[self.order()];
            st.stored.fetch_sub(1, Relaxed);
            crate::stats::bump(if invalidated { &st.invalidated } else { &st.kept_freed });
        }
        freed
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        // SAFETY: the shadow is ours, and with the last reference gone nobody uses it.
        unsafe { libc::munmap(self.shadow as *mut _, self.len) };
    }
}
