//! Managed ranges by base address.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use uzswap_runtime::Region;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Returned by the malloc family: freed with free().
    Malloc,
    /// Returned by mmap: released with munmap().
    Mmap,
}

pub struct Entry {
    pub region: Region,
    pub kind: Kind,
    /// What the program asked for (page-rounded for mmap); the region may be longer
    /// (whole folios).
    pub user_len: usize,
    /// Parts of `[0, user_len)` the program unmapped, as sorted disjoint offset ranges.
    pub holes: Vec<(usize, usize)>,
    /// Inherited through fork: plain memory now, no runtime behind it.
    pub orphan: bool,
    /// Parts the program marked MADV_DONTFORK (sorted disjoint offset ranges): kept out
    /// of a child, while fork makes the rest of the region inheritable (proc.rs).
    pub dontfork: Vec<(usize, usize)>,
    /// Some part was marked MADV_WIPEONFORK (a child reads zeros there, as the kernel
    /// gives it): its swapped-out folios are never carried into a child.
    pub wiped_on_fork: bool,
}

impl Entry {
    pub fn base(&self) -> usize {
        self.region.as_ptr() as usize
    }
    pub fn cap(&self) -> usize {
        self.region.len()
    }
    /// Records `[lo, hi)` (offsets) as unmapped; true once all of `[0, user_len)` is.
    pub fn punch(&mut self, lo: usize, hi: usize) -> bool {
        let mut merged = Vec::with_capacity(self.holes.len() + 1);
        let (mut lo, mut hi) = (lo, hi);
        for &(a, b) in &self.holes {
            if b < lo || a > hi {
                merged.push((a, b));
            } else {
                lo = lo.min(a);
                hi = hi.max(b);
            }
        }
        merged.push((lo, hi));
        merged.sort_unstable();
        self.holes = merged;
        self.holes.iter().map(|&(a, b)| b.min(self.user_len).saturating_sub(a)).sum::<usize>() >= self.user_len
    }

    /// Marks `[lo, hi)` (offsets) as MADV_DONTFORK (`on`) or MADV_DOFORK.
    pub fn set_dontfork(&mut self, lo: usize, hi: usize, on: bool) {
        let mut kept = Vec::with_capacity(self.dontfork.len() + 2);
        for &(a, b) in &self.dontfork {
            if b <= lo || a >= hi {
                kept.push((a, b));
            } else {
                if a < lo {
                    kept.push((a, lo));
                }
                if b > hi {
                    kept.push((hi, b));
                }
            }
        }
        if on {
            kept.push((lo, hi));
        }
        kept.sort_unstable();
        self.dontfork = kept;
    }

    /// Releases the entry: drops the region (which unmaps it), or for an orphan (whose
    /// runtime is the parent's) forgets it and unmaps the plain memory.
    pub fn release(self) {
        MANAGED.fetch_sub(self.cap(), Relaxed);
        if self.orphan {
            let (base, cap) = (self.base(), self.cap());
            std::mem::forget(self.region);
            // SAFETY: an orphan is the child's plain copy of a parent's region, just taken
            // out of TABLE: no runtime backs it and no one else refers to it, so the memory
            // is the program's, which gave it up (free or munmap) to get here.
            unsafe { crate::real::munmap()(base as *mut _, cap) };
        } else {
            drop(self.region);
        }
    }
}

/// A spin lock (yielding): fork holds it across (proc.rs), and the child lets go of it
/// by hand, which std's locks do not allow.
pub static TABLE: spin::rwlock::RwLock<BTreeMap<usize, Entry>, spin::relax::Yield> = spin::rwlock::RwLock::new(BTreeMap::new());
static LO: AtomicUsize = AtomicUsize::new(usize::MAX);
static HI: AtomicUsize = AtomicUsize::new(0);
/// The program changed the protection of memory that may be managed (mprotect to
/// other than read-write): a child then never takes over swapped-out folios, which
/// it would read and write in place (fork.rs), for fear of a page it may not touch.
pub static REPROTECTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Bytes of managed ranges now, and at most (for the exit summary).
pub static MANAGED: AtomicUsize = AtomicUsize::new(0);
pub static MANAGED_PEAK: AtomicUsize = AtomicUsize::new(0);

/// Cheap filter: could `[p, p+len)` touch a managed range? (Bounds only ever widen.)
#[inline]
pub fn maybe_managed(p: usize, len: usize) -> bool {
    p < HI.load(Relaxed) && p.saturating_add(len) > LO.load(Relaxed)
}

pub fn insert(e: Entry) {
    let (base, cap) = (e.base(), e.cap());
    LO.fetch_min(base, Relaxed);
    HI.fetch_max(base + cap, Relaxed);
    MANAGED_PEAK.fetch_max(MANAGED.fetch_add(cap, Relaxed) + cap, Relaxed);
    TABLE.write().insert(base, e);
}

/// The base and capacity of the entry containing `p`, if any.
pub fn containing(map: &BTreeMap<usize, Entry>, p: usize) -> Option<usize> {
    let (&base, e) = map.range(..=p).next_back()?;
    (p < base + e.cap()).then_some(base)
}
