//! A fixed set of page-aligned address ranges, changed and read with atomics only: no
//! lock, so usable from an interposed mmap or munmap in a forked child whose other
//! threads vanished mid-call, and from a wrapped system call in a signal handler. Its
//! uses: the reservations a program made (the shim's cover.rs), which decide what may
//! be adopted where the kernel does not wait for faults in system calls; and uzswap's
//! own mappings (own_maps.rs).
//!
//! Each range is one word (first page << PAGES_BITS | pages; 0 is a free slot), so a
//! reader sees it whole. A range too big to pack, or with no slot left, is not kept,
//! and `record` and `forget` say so: for reservations what is not here is not taken
//! (the safe side); own_maps stops adoption altogether.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

const PAGE: usize = 4096;
const PAGES_BITS: u32 = 29;

pub struct PageRanges<const N: usize> {
    slots: [AtomicU64; N],
    /// Slots past this one never held a range: scans stop here. Only ever raised,
    /// before a slot is taken. (A forked child's take-over of 1,024 regions scanned
    /// all 8,192 slots of the shim's set at every mapping of its own: a fifth of the
    /// fork.)
    used: AtomicUsize,
    /// Where `record` starts looking for a free slot: a hint, never trusted.
    free: AtomicUsize,
}

fn pack(start: usize, end: usize) -> Option<u64> {
    let (first, pages) = ((start / PAGE) as u64, (end.saturating_sub(start) / PAGE) as u64);
    (pages > 0 && pages < 1 << PAGES_BITS && first < 1 << (64 - PAGES_BITS)).then_some(first << PAGES_BITS | pages)
}

fn unpack(w: u64) -> (usize, usize) {
    let (first, pages) = ((w >> PAGES_BITS) as usize, (w & ((1 << PAGES_BITS) - 1)) as usize);
    (first * PAGE, (first + pages) * PAGE)
}

impl<const N: usize> PageRanges<N> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        PageRanges { slots: [const { AtomicU64::new(0) }; N], used: AtomicUsize::new(0), free: AtomicUsize::new(0) }
    }

    /// The slots that may hold a range.
    fn live(&self) -> &[AtomicU64] {
        &self.slots[..self.used.load(Relaxed).min(N)]
    }

    /// Keeps `[start, end)` (page-aligned); false if it does not pack or no slot is free.
    pub fn record(&self, start: usize, end: usize) -> bool {
        let Some(w) = pack(start, end) else { return false };
        let from = self.free.load(Relaxed).min(N);
        (from..N).chain(0..from).any(|i| {
            if self.slots[i].load(Relaxed) != 0 {
                return false;
            }
            self.used.fetch_max(i + 1, Relaxed);
            let taken = self.slots[i].compare_exchange(0, w, Relaxed, Relaxed).is_ok();
            if taken {
                self.free.store(i + 1, Relaxed);
            }
            taken
        })
    }

    /// Takes `[start, end)` (page-aligned) out of every range it meets. A range cut in
    /// two keeps both sides: the right one recorded before the left is shrunk, so a
    /// reader meanwhile sees too much, never too little. False if a right side found no
    /// slot (it is then lost: less is kept than was).
    pub fn forget(&self, start: usize, end: usize) -> bool {
        (0..self.live().len()).fold(true, |whole, i| self.cut(i, start, end) & whole)
    }

    /// [`forget`](Self::forget) when the range in the slot just before the free hint
    /// (most often the one recorded last: a mapping trimmed right after it was
    /// recorded) covers all of `[start, end)`; `None` when it does not. Only for a set
    /// whose ranges never overlap, or where keeping too much is the safe side: no other
    /// range is looked at.
    pub fn forget_from_last(&self, start: usize, end: usize) -> Option<bool> {
        let i = self.free.load(Relaxed).checked_sub(1).filter(|&i| i < N)?;
        let w = self.slots[i].load(Relaxed);
        let (s, e) = unpack(w);
        (w != 0 && s <= start && end <= e).then(|| self.cut(i, start, end))
    }

    /// Takes `[start, end)` out of the range in slot `i`, if they meet (see `forget`).
    fn cut(&self, i: usize, start: usize, end: usize) -> bool {
        let slot = &self.slots[i];
        let mut whole = true;
        let mut w = slot.load(Relaxed);
        while w != 0 {
            let (s, e) = unpack(w);
            if s >= end || e <= start {
                break;
            }
            if e > end && s < start {
                whole &= self.record(end, e);
            }
            let keep = if s < start { pack(s, start) } else if e > end { pack(end, e) } else { None };
            match slot.compare_exchange(w, keep.unwrap_or(0), Relaxed, Relaxed) {
                Ok(_) => {
                    if keep.is_none() {
                        self.free.fetch_min(i, Relaxed);
                    }
                    break;
                }
                Err(now) => w = now,
            }
        }
        whole
    }

    fn any(&self, f: impl Fn(usize, usize) -> bool) -> bool {
        self.live().iter().any(|slot| {
            let w = slot.load(Relaxed);
            let (s, e) = unpack(w);
            w != 0 && f(s, e)
        })
    }

    /// Whether one range holds all of `[start, end)`.
    pub fn covers(&self, start: usize, end: usize) -> bool {
        self.any(|s, e| s <= start && end <= e)
    }

    /// Whether no range is kept.
    pub fn is_empty(&self) -> bool {
        self.live().iter().all(|slot| slot.load(Relaxed) == 0)
    }

    /// Whether any range meets `[start, end)`.
    pub fn meets(&self, start: usize, end: usize) -> bool {
        self.any(|s, e| s < end && start < e)
    }

    /// The parts of `[start, end)` that ranges kept now cover, in address order (it
    /// allocates: not for a signal handler).
    pub fn parts_within(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = self
            .live()
            .iter()
            .map(|slot| slot.load(Relaxed))
            .filter(|&w| w != 0)
            .map(unpack)
            .filter(|&(s, e)| s < end && start < e)
            .map(|(s, e)| (s.max(start), e.min(end)))
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn record_forget_cover() {
        let r = PageRanges::<8>::new();
        r.record(16 * MIB, 32 * MIB);
        assert!(r.covers(16 * MIB, 32 * MIB) && !r.covers(15 * MIB, 17 * MIB));
        r.forget(20 * MIB, 21 * MIB); // a hole: both sides stay
        assert!(r.covers(16 * MIB, 20 * MIB) && r.covers(21 * MIB, 32 * MIB));
        assert!(!r.meets(20 * MIB, 21 * MIB) && !r.covers(19 * MIB, 22 * MIB));
        r.forget(0, 18 * MIB); // the left end
        assert!(!r.meets(16 * MIB, 18 * MIB) && r.covers(18 * MIB, 20 * MIB));
        r.forget(30 * MIB, 64 * MIB); // the right end
        assert!(r.covers(21 * MIB, 30 * MIB) && !r.meets(30 * MIB, 32 * MIB));
        r.forget(0, 64 * MIB);
        assert!(!r.meets(0, 64 * MIB) && r.is_empty());
        // Too big to pack (2 TiB and more), or past the slots: not kept.
        r.record(0, 1 << 41);
        assert!(!r.meets(0, PAGE));
        for i in 0..9 {
            r.record(i * MIB, i * MIB + PAGE);
        }
        assert!(r.meets(0, PAGE) && !r.meets(8 * MIB, 8 * MIB + PAGE));
    }

    /// A slot freed anywhere is found again (the hint only says where to start), and a
    /// cut of the range kept last needs no scan; one elsewhere is left to `forget`.
    #[test]
    fn freed_slots_are_reused_and_the_last_range_is_cut_in_place() {
        let r = PageRanges::<4>::new();
        for i in 0..4 {
            assert!(r.record(i * MIB, (i + 1) * MIB));
        }
        assert!(!r.record(8 * MIB, 9 * MIB), "full");
        assert!(r.forget(MIB, 2 * MIB));
        assert!(r.record(8 * MIB, 10 * MIB), "the freed slot is taken again");
        assert!(r.covers(8 * MIB, 10 * MIB) && !r.meets(MIB, 2 * MIB));
        // A mapping trimmed right after it was made: its head and tail.
        assert_eq!(r.forget_from_last(8 * MIB, 8 * MIB + PAGE), Some(true));
        assert_eq!(r.forget_from_last(10 * MIB - PAGE, 10 * MIB), Some(true));
        assert!(r.covers(8 * MIB + PAGE, 10 * MIB - PAGE) && !r.meets(8 * MIB, 8 * MIB + PAGE) && !r.meets(10 * MIB - PAGE, 10 * MIB));
        assert_eq!(r.forget_from_last(0, PAGE), None, "not in the range kept last");
        assert!(r.covers(0, MIB));
    }

    /// Threads record and cut ranges of their own at once in one set: each sees its own
    /// as it made them after every step, whatever the others do.
    #[test]
    fn hammered_from_threads() {
        static R: PageRanges<64> = PageRanges::new();
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    let base = (t + 1) << 32;
                    for round in 0..2000 {
                        let (a, b) = (base, base + 16 * MIB);
                        R.record(a, b);
                        assert!(R.covers(a, b), "thread {t} round {round}");
                        let cut = (round % 14 + 1) * MIB;
                        // The fast cut when ours is the last kept, else the scan.
                        if R.forget_from_last(a + cut, a + cut + MIB).is_none() {
                            R.forget(a + cut, a + cut + MIB);
                        }
                        assert!(R.covers(a, a + cut) && R.covers(a + cut + MIB, b) && !R.meets(a + cut, a + cut + MIB));
                        R.forget(a, b);
                        assert!(!R.meets(a, b), "thread {t} round {round}: left behind");
                    }
                });
            }
        });
    }
}
