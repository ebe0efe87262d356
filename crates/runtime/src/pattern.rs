//! How a region is read back: the swap-in pattern, which sizes a swap-in and picks
//! the cut a folio is stored with. Policy only (atomics, no userfaultfd, no store):
//! fault.rs asks [`Pattern::note`] at every swap-in, reclaim asks [`Pattern::cut`]
//! at every store.
//!
//! As the kernel's readahead sizes its window from the faults it sees, a swap-in that
//! follows the region's last one (the same folio or the next) is sequential, and
//! brings the whole folio; one at random brings only the unit around it (partial
//! swap-in, folio.rs), if the folio was stored in units smaller than itself.
//!
//! The cut (the adaptive unit, `granularity = auto`): small units decode alone, so a
//! read at random pays for one page, not a whole folio; one unit for the whole folio
//! compresses best and a sequential pass decodes it all anyway. With `auto` a folio
//! is stored whole when its region's recent swap-ins ran sequentially, and in 4 KiB
//! units otherwise, including before the region was ever read back: a folio's first
//! store cannot know, and a whole-unit record read at random costs a whole folio's
//! decode and charge for each page. On usemem's random pass (64 KiB folios, 192M
//! budget) that is 1.7 s against 9.1 s with whole folios; its sequential pass is
//! within 10%. Cold records cut small are cut whole again when the pool fills (the
//! store's recut). Kernel swap has no such choice: zswap and zram store every page
//! alone; zram's multi-page compression fixes one size for all.
//!
//! `auto` is not the default: on real data 4 KiB units compress to 0.39 of the folio
//! against 0.16 whole (lz4, the corpus) and encode at half the speed, and the real
//! programs that read their memory back mostly whole paid for it (`bench programs
//! --quick`: java 2.4-2.6 s against 1.9 s, redis 14-15 s against 12 s). A program
//! that reads a large heap at random, a page at a time, should ask for it.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
use uzswap_store::Granularity;

/// Sequential swap-ins in a row, counted up to this ...
const SCORE_MAX: u8 = 8;
/// ... of which a region needs this many to have its folios stored whole. A swap-in
/// at random halves the count: a pass at random turns a region over within a few
/// faults, a stray fault in a sequential pass does not.
const SEQUENTIAL_AT: u8 = 4;

#[derive(Debug, Default)]
pub(crate) struct Pattern {
    /// The folio the last swap-in was for, plus one (0: none yet).
    last: AtomicUsize,
    /// Recent swap-ins' sequential score, 0..=SCORE_MAX.
    score: AtomicU8,
}

impl Pattern {
    /// Notes a swap-in of folio `idx`; true if it follows the last one (the same folio
    /// or the next): a sequential pass, which brings the whole folio. Racing faults of
    /// other threads may interleave: each sees some order, and a wrong guess costs
    /// speed, never data. Lock-free, for the fault path.
    pub fn note(&self, idx: usize) -> bool {
        let last = self.last.swap(idx + 1, Relaxed);
        let sequential = last == idx + 1 || last == idx;
        // Relaxed read-modify-write: a lost update between racing faults only moves a hint.
        let _ = self.score.fetch_update(Relaxed, Relaxed, |s| {
            Some(if sequential { (s + 1).min(SCORE_MAX) } else { s / 2 })
        });
        sequential
    }

    /// Whether the region's recent swap-ins ran sequentially.
    pub fn sequential(&self) -> bool {
        self.score.load(Relaxed) >= SEQUENTIAL_AT
    }

    /// The cut for a folio of this region stored now, given the configured unit
    /// `small` and whether the cut adapts: whole if read sequentially, else `small`.
    pub fn cut(&self, small: Granularity, adaptive: bool) -> Granularity {
        if adaptive && self.sequential() {
            Granularity::Folio
        } else {
            small
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Granularity = Granularity::Bytes(4096);

    #[test]
    fn unknown_is_small_sequential_is_whole() {
        let p = Pattern::default();
        assert_eq!(p.cut(SMALL, true), SMALL, "never read back: small units");
        assert!(!p.note(10), "a first swap-in follows nothing");
        for idx in 10..10 + SEQUENTIAL_AT as usize {
            assert!(p.note(idx), "10 again, then 11, 12, 13: sequential");
        }
        assert!(p.sequential());
        assert_eq!(p.cut(SMALL, true), Granularity::Folio);
        assert_eq!(p.cut(SMALL, false), SMALL, "a fixed granularity never adapts");
    }

    #[test]
    fn random_turns_a_region_over_quickly_a_stray_fault_does_not() {
        let p = Pattern::default();
        for idx in 0..100 {
            p.note(idx);
        }
        assert!(p.sequential());
        p.note(5000);
        assert!(p.sequential(), "one stray fault in a pass");
        for idx in [77, 3, 901, 42] {
            p.note(idx);
        }
        assert!(!p.sequential(), "a pass at random");
        assert_eq!(p.cut(SMALL, true), SMALL);
    }

    /// Threads faulting at once, each sequentially in its own part: the score stays
    /// in range and every call returns; a hint, never a wrong result.
    #[test]
    fn hammered_from_threads() {
        let p = Pattern::default();
        std::thread::scope(|s| {
            for t in 0..4usize {
                let p = &p;
                s.spawn(move || {
                    for i in 0..100_000 {
                        p.note(t * 1_000_000 + i);
                        assert!(p.score.load(Relaxed) <= SCORE_MAX);
                    }
                });
            }
        });
        assert!(p.score.load(Relaxed) <= SCORE_MAX);
    }
}
