//! How a region is read back: the swap-in pattern, which sizes a swap-in and picks
//! the cut a folio is stored with. Policy only (atomics, no userfaultfd, no store):
//! fault.rs asks [`Pattern::note`] at every swap-in, reclaim asks [`Pattern::cut`]
//! at every store.
//!
//! As the kernel's readahead sizes its window from the faults it sees, a swap-in that
//! follows the last one of a pass through the region (the same folio or the next) is
//! sequential, and brings the whole folio; one at random brings only the unit around
//! it (partial swap-in, folio.rs), if the folio was stored in units smaller than
//! itself. A region follows up to [`STREAMS`] passes at once (threads each reading
//! their own part): with one record of the last fault, usemem's 4 threads each
//! reading its quarter in order looked random, and its re-read ran at a third of one
//! thread's speed.
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
//! The first touch of fresh memory has a pattern too: a program filling a buffer
//! writes its folios in order, and on the thread path each would cost a round trip
//! to the reader. A zero-fill that follows the last one (the next folio) fills
//! folios ahead of the writer, a window that doubles with every fault of the pass
//! (up to [`AHEAD_BYTES`]) and closes at the first fault elsewhere, as readahead's
//! does ([`Pattern::zero_filled`]).
//!
//! `auto` is not the default: on real data 4 KiB units compress to 0.39 of the folio
//! against 0.16 whole (lz4, the corpus) and encode at half the speed, and the real
//! programs that read their memory back mostly whole paid for it (`bench programs
//! --quick`: java 2.4-2.6 s against 1.9 s, redis 14-15 s against 12 s). A program
//! that reads a large heap at random, a page at a time, should ask for it.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
use uzswap_store::Granularity;

/// The most bytes of folios one fault fills with zeros ahead of a writer, or brings
/// back ahead of a sequential pass.
pub(crate) const AHEAD_BYTES: usize = 256 << 10;

/// Sequential swap-ins in a row, counted up to this ...
const SCORE_MAX: u8 = 8;
/// ... of which a region needs this many to have its folios stored whole. A swap-in
/// at random halves the count: a pass at random turns a region over within a few
/// faults, a stray fault in a sequential pass does not.
const SEQUENTIAL_AT: u8 = 4;

/// Passes a region follows at once: each thread of a program may run its own (usemem
/// with 16 threads, each through its own part of one mapping), and interleaved they
/// would look random to a single record of the last fault. As the kernel's readahead
/// keeps its state per open file, not per inode.
const STREAMS: usize = 16;

/// One pass through a region: its swap-ins and its zero-fills, each tracked apart.
#[derive(Debug, Default)]
struct Stream {
    /// The folio the pass's last swap-in was for, plus one (0: none yet).
    last: AtomicUsize,
    /// The pass's sequential score, 0..=SCORE_MAX.
    score: AtomicU8,
    /// The folios its last swap-in brought back ahead, `[ahead_lo, ahead_hi)`.
    ahead_lo: AtomicUsize,
    ahead_hi: AtomicUsize,
    /// How many folios a swap-in brings back ahead (0: not sized yet, the most).
    in_window: AtomicUsize,
    /// The folio after the last one filled with zeros (by a fault or ahead), plus one
    /// (0: none yet).
    zero_next: AtomicUsize,
    /// Folios to fill ahead at the pass's next zero-fill.
    zero_window: AtomicUsize,
}

#[derive(Debug, Default)]
pub(crate) struct Pattern {
    streams: [Stream; STREAMS],
    /// The slot a swap-in (a zero-fill) that continues no pass takes for a new one,
    /// round robin: the one started longest ago goes.
    next_in: AtomicUsize,
    next_zero: AtomicUsize,
    /// The region's recent swap-ins' sequential score, 0..=SCORE_MAX: whether they
    /// continued a pass, whichever (for the cut).
    score: AtomicU8,
}

impl Pattern {
    /// The pass whose last swap-in was folio `idx`.
    fn at(&self, idx: usize) -> Option<&Stream> {
        self.streams.iter().find(|s| s.last.load(Relaxed) == idx + 1)
    }

    /// Notes a swap-in of folio `idx`; true if it continues a pass (its last swap-in
    /// was the same folio or the one before): a sequential pass, which brings the
    /// whole folio. One that continues none starts a pass of its own in place of the
    /// oldest. Racing faults of other threads may interleave: each sees some order,
    /// and a wrong guess costs speed, never data. Lock-free, for the fault path.
    ///
    /// A swap-in of a folio the pass's last one brought back ahead is a miss: it was
    /// evicted before the pass got there (the reclaimer wanted the room), so the window
    /// halves; one just after them, a pass through them all, doubles it (as the kernel's
    /// swap readahead sizes its window from its hits). A miss is still part of the pass.
    pub fn note(&self, idx: usize) -> bool {
        let follows = |s: &Stream| {
            let (last, lo, hi) = (s.last.load(Relaxed), s.ahead_lo.load(Relaxed), s.ahead_hi.load(Relaxed));
            last == idx + 1 || (last != 0 && last == idx) || (lo..hi).contains(&idx) || (hi != 0 && idx == hi)
        };
        let s = match self.streams.iter().find(|s| follows(s)) {
            Some(s) => s,
            None => {
                let s = &self.streams[self.next_in.fetch_add(1, Relaxed) % STREAMS];
                s.score.store(0, Relaxed);
                s.ahead_lo.store(0, Relaxed);
                s.ahead_hi.store(0, Relaxed);
                s.in_window.store(0, Relaxed);
                s.last.store(0, Relaxed);
                s
            }
        };
        let last = s.last.swap(idx + 1, Relaxed);
        let (lo, hi) = (s.ahead_lo.load(Relaxed), s.ahead_hi.load(Relaxed));
        let missed = (lo..hi).contains(&idx);
        if missed || (hi != 0 && idx == hi) {
            s.ahead_lo.store(0, Relaxed);
            s.ahead_hi.store(0, Relaxed);
            let n = hi.saturating_sub(lo);
            s.in_window.store(if missed { (n / 2).max(1) } else { n * 2 }, Relaxed);
        }
        let sequential = last == idx + 1 || (last != 0 && last == idx) || missed;
        // Relaxed read-modify-writes: a lost update between racing faults only moves a hint.
        for score in [&s.score, &self.score] {
            let _ = score.fetch_update(Relaxed, Relaxed, |s| Some(if sequential { (s + 1).min(SCORE_MAX) } else { s / 2 }));
        }
        sequential
    }

    /// Notes a zero-fill of folio `idx` (of `folio_size` bytes) by a fault; returns how
    /// many folios after it to fill ahead: none unless it continues a pass (the folio
    /// after the last one that pass filled), then a window that doubles up to
    /// [`AHEAD_BYTES`]. One that continues none starts a pass in place of the oldest.
    /// The caller says with [`Pattern::filled_ahead`] how many it filled. A hint,
    /// lock-free: racing faults only move it.
    pub fn zero_filled(&self, idx: usize, folio_size: usize) -> usize {
        let max = AHEAD_BYTES / folio_size.max(1);
        let (s, sequential) = match self.streams.iter().find(|s| s.zero_next.load(Relaxed) == idx + 1) {
            Some(s) => (s, true),
            None => (&self.streams[self.next_zero.fetch_add(1, Relaxed) % STREAMS], false),
        };
        s.zero_next.store(idx + 2, Relaxed);
        let window = if sequential && max > 0 { (s.zero_window.load(Relaxed) * 2).clamp(1, max) } else { 0 };
        s.zero_window.store(window, Relaxed);
        window
    }

    /// `n` folios after `idx` were filled ahead: the pass goes on after them.
    pub fn filled_ahead(&self, idx: usize, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(s) = self.streams.iter().find(|s| s.zero_next.load(Relaxed) == idx + 2) {
            let _ = s.zero_next.compare_exchange(idx + 2, idx + n + 2, Relaxed, Relaxed);
        }
    }

    /// How many folios after `idx` (just swapped in) to bring back ahead of its pass:
    /// up to [`AHEAD_BYTES`] of them once the pass's last [`SCORE_MAX`] swap-ins ran
    /// in order (so that the first at random stops it), else none.
    /// The caller says with [`Pattern::swapped_ahead`] how many it brought.
    pub fn swapin_ahead(&self, idx: usize, folio_size: usize) -> usize {
        let most = AHEAD_BYTES / folio_size.max(1);
        let Some(s) = self.at(idx) else { return 0 };
        match s.in_window.load(Relaxed) {
            // A pass well under way: a fault at random ends it at once.
            _ if s.score.load(Relaxed) < SCORE_MAX => 0,
            0 => most,
            w => w.min(most),
        }
    }

    /// `n` folios after `idx` were brought back ahead: the pass goes on after them,
    /// so the fault after them follows it, and a fault on one of them is a miss.
    pub fn swapped_ahead(&self, idx: usize, n: usize) {
        let Some(s) = self.at(idx).filter(|_| n > 0) else { return };
        if s.last.compare_exchange(idx + 1, idx + n + 1, Relaxed, Relaxed).is_ok() {
            s.ahead_lo.store(idx + 1, Relaxed);
            s.ahead_hi.store(idx + n + 1, Relaxed);
        }
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

    #[test]
    fn zero_fill_ahead_grows_along_a_pass_and_closes_elsewhere() {
        let p = Pattern::default();
        let fs = 4096;
        assert_eq!(p.zero_filled(100, fs), 0, "a first fill follows nothing");
        let mut idx = 101;
        let mut windows = Vec::new();
        for _ in 0..9 {
            let n = p.zero_filled(idx, fs);
            p.filled_ahead(idx, n);
            windows.push(n);
            idx += n + 1;
        }
        assert_eq!(windows, [1, 2, 4, 8, 16, 32, 64, 64, 64], "doubles up to 256 KiB of 4 KiB folios");
        assert_eq!(p.zero_filled(idx + 5, fs), 0, "a fault elsewhere starts a pass of its own");
        assert_eq!(p.zero_filled(idx + 6, fs), 1, "which opens its window");
        // Fewer filled than asked (a folio in the way): the pass goes on after them.
        p.filled_ahead(idx + 6, 0);
        assert_eq!(p.zero_filled(idx + 7, fs), 2);
        assert_eq!(p.zero_filled(4 << 20, 2 << 20), 0);
        assert_eq!(p.zero_filled((4 << 20) + 1, 2 << 20), 0, "no 2 MiB folio fits the window");
        assert_eq!(p.zero_filled(0, 64 << 10), 0);
        assert_eq!(p.zero_filled(1, 64 << 10), 1);
        p.filled_ahead(1, 1);
        assert_eq!(p.zero_filled(3, 64 << 10), 2);
        p.filled_ahead(3, 2);
        assert_eq!(p.zero_filled(6, 64 << 10), 4);
        p.filled_ahead(6, 4);
        assert_eq!(p.zero_filled(11, 64 << 10), 4, "at most 256 KiB");
    }

    #[test]
    fn swapin_ahead_once_sequential_and_the_pass_goes_on_after_it() {
        let p = Pattern::default();
        assert_eq!(p.swapin_ahead(9, 4096), 0, "never read back");
        // The first swap-in follows nothing; SCORE_MAX more in a row make a pass.
        for idx in 10..=10 + SCORE_MAX as usize {
            p.note(idx);
            assert_eq!(p.swapin_ahead(idx, 4096) > 0, idx == 10 + SCORE_MAX as usize);
        }
        let at = 10 + SCORE_MAX as usize;
        assert_eq!(p.swapin_ahead(at, 4096), 64);
        assert_eq!(p.swapin_ahead(at, 64 << 10), 4);
        assert_eq!(p.swapin_ahead(at, 2 << 20), 0);
        assert_eq!(p.swapin_ahead(at + 1, 4096), 0, "not the pass's last swap-in");
        p.swapped_ahead(at, 64);
        assert!(p.note(at + 65), "the fault after the folios brought ahead follows the pass");
        assert!(p.sequential());
        assert_eq!(p.swapin_ahead(at + 65, 4096), 64, "a pass through them all: the most");
        // Brought ahead, then evicted before the pass got there: a miss halves the
        // window, and is still part of the pass.
        let at = at + 65;
        p.swapped_ahead(at, 64);
        assert!(p.note(at + 10), "a miss");
        assert_eq!(p.swapin_ahead(at + 10, 4096), 32);
        p.swapped_ahead(at + 10, 32);
        assert!(p.note(at + 11));
        assert_eq!(p.swapin_ahead(at + 11, 4096), 16);
        let mut at = at + 11;
        for _ in 0..10 {
            p.swapped_ahead(at, p.swapin_ahead(at, 4096));
            at += 1;
            p.note(at);
        }
        assert_eq!(p.swapin_ahead(at, 4096), 1, "misses all along: one folio at a time");
        p.swapped_ahead(at, 1);
        p.note(at + 2);
        assert_eq!(p.swapin_ahead(at + 2, 4096), 2, "hits grow it again");
        assert!(p.sequential());
        for idx in [5000, 3, 901, 42, 7777] {
            p.note(idx);
            assert_eq!(p.swapin_ahead(idx, 4096), 0, "a fault at random");
        }
        assert!(!p.sequential(), "a region read at random");
    }

    /// Passes through different parts at once, interleaved fault by fault (threads of
    /// one program): each stays a pass, brings folios ahead and fills zeros ahead.
    #[test]
    fn interleaved_passes_each_stay_sequential() {
        let p = Pattern::default();
        let passes: Vec<usize> = (0..STREAMS).map(|t| t * 1_000_000).collect();
        for step in 0..=SCORE_MAX as usize {
            for &base in &passes {
                assert_eq!(p.note(base + step), step > 0, "pass at {base}, step {step}");
                assert_eq!(p.zero_filled(base + step, 4096) > 0, step > 0);
            }
        }
        for &base in &passes {
            let at = base + SCORE_MAX as usize;
            assert_eq!(p.swapin_ahead(at, 4096), 64, "pass at {base}");
        }
        assert!(p.sequential());
        // One pass more than the streams: the oldest goes, each new one starts afresh.
        assert!(!p.note(99_000_000));
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
                        let n = p.zero_filled(t * 1_000_000 + i, 4096);
                        assert!(n <= AHEAD_BYTES / 4096);
                        p.filled_ahead(t * 1_000_000 + i, n);
                    }
                });
            }
        });
        assert!(p.score.load(Relaxed) <= SCORE_MAX);
    }
}
