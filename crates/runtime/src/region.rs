//! A managed region: the program's mapping, its shadow, and one state word per folio.

use crate::Shared;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Arc;

pub(crate) use crate::folio::*;

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
    /// States and kept flags (folio.rs owns their rules).
    pub folios: Folios,
    /// Fault-in order (a global sequence): smaller is older, i.e. colder.
    pub stamps: Box<[AtomicU64]>,
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
        self.folios.len()
    }

    /// What a transition of one of this region's folios touches (folio.rs).
    pub fn book(&self) -> Book<'_> {
        let sh = &*self.shared;
        Book {
            folios: &self.folios,
            charges: &sh.charges,
            stats: &sh.stats.sizes[self.order()],
            store: &sh.store,
            key_base: self.id << 40,
            folio_bytes: self.folio_size as u64,
        }
    }

    pub fn key(&self, idx: usize) -> u64 {
        (self.id << 40) | idx as u64
    }

    pub fn order(&self) -> usize {
        (self.folio_shift - 12) as usize
    }

    pub fn try_lock(&self, idx: usize) -> Option<u8> {
        self.folios.try_lock(idx)
    }

    pub fn lock(&self, idx: usize) -> u8 {
        self.folios.lock(idx)
    }

    pub fn unlock(&self, idx: usize, state: u8) {
        self.folios.unlock(idx, state)
    }

    /// Records transition `t` of folio `idx` (locked, in `prev`) and unlocks it in its
    /// new state; a folio a fault brought in gets a fresh stamp and a fault-queue entry.
    pub fn finish(&self, idx: usize, prev: u8, t: Transition, res: Option<Reservation>) -> u8 {
        let next = self.book().record(idx, prev, t, res);
        let fault_in = matches!(
            t,
            Transition::ZeroFilled
                | Transition::Touched
                | Transition::SwappedIn
                | Transition::SwappedInClean
                | Transition::Refaulted
                | Transition::RefaultedClean
                | Transition::ForkIn
        );
        if fault_in && (next == RESIDENT || next == CLEAN) {
            self.unlock_faulted_in(idx, next);
        } else {
            self.unlock(idx, next);
        }
        next
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
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        // SAFETY: the shadow is ours, and with the last reference gone nobody uses it.
        unsafe { libc::munmap(self.shadow as *mut _, self.len) };
    }
}
