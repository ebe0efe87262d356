//! uzswap's own mappings (its heap, regions' shadows, pool spans, thread stacks), as the
//! scan that adopts a program's memory must know them: a mapping of ours taken for the
//! program's would be registered with the userfaultfd and swapped out, and the next
//! thread of ours to touch it would wait for the reader, possibly the reader itself
//! (a JVM hung so, run as root: the reader faulted on a pool span it was reading).
//!
//! Not what each mapping is for: only where they are, in a [`PageRanges`] (atomics, no
//! lock), and a [`Gate`] that the scan closes from its last look at a range to the
//! range's registration. The rules that make "not recorded" mean "not ours":
//! - a mapping is recorded after it is made, inside the gate ([`OwnMaps::making`]);
//! - it is forgotten *before* it is unmapped, inside the gate ([`OwnMaps::unmap`]):
//!   forgotten after, the kernel may already have handed its addresses to a new
//!   mapping of another thread of ours, recorded meanwhile, whose record the late
//!   forget then erased (the reader's fault above: a pool span freed on one thread,
//!   one made on another at the same address);
//! - a record that cannot be kept (no slot) marks the set [`OwnMaps::lost`], and the
//!   scan stops adopting.
//!
//! Not a record of the program's memory, and no judgement of what may be adopted
//! (the shim's cover.rs).

use crate::gate::{Closed, Gate};
use crate::ranges::PageRanges;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

const PAGE: usize = 4096;

pub struct OwnMaps<const N: usize> {
    ranges: PageRanges<N>,
    gate: Gate,
    lost: AtomicBool,
}

/// A mapping of ours being made, from before the system call to its record.
pub struct Making<'a, const N: usize>(&'a OwnMaps<N>);

impl<const N: usize> Drop for Making<'_, N> {
    fn drop(&mut self) {
        self.0.gate.leave();
    }
}

impl<const N: usize> Making<'_, N> {
    /// Hands the mark to another thread, which ends it with [`OwnMaps::made`] (a new
    /// thread, whose stack glibc maps inside pthread_create, records it when it starts).
    pub fn hand_over(self) {
        std::mem::forget(self);
    }
}

fn page_span(start: usize, len: usize) -> (usize, usize) {
    (start & !(PAGE - 1), start.saturating_add(len).next_multiple_of(PAGE))
}

impl<const N: usize> OwnMaps<N> {
    #[cfg(not(loom))]
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        OwnMaps { ranges: PageRanges::new(), gate: Gate::new(), lost: AtomicBool::new(false) }
    }

    /// Enters the gate to make a mapping (waits while the scan registers a range).
    pub fn making(&self) -> Making<'_, N> {
        self.gate.enter();
        Making(self)
    }

    /// Ends a mark handed over with [`Making::hand_over`].
    pub fn made(&self) {
        self.gate.leave();
    }

    /// Records `[start, start + len)` as ours (under a [`Making`], or for memory made
    /// before anything could scan).
    pub fn note(&self, start: usize, len: usize) {
        let (s, e) = page_span(start, len);
        if !self.ranges.record(s, e) {
            self.lost.store(true, Relaxed);
        }
    }

    fn forget(&self, start: usize, len: usize) {
        let (s, e) = page_span(start, len);
        // Most often the head or tail of a mapping just made (an aligned one: runtime
        // `map_anon`): its record is the last, and no other can meet it but one noted
        // over it, which kept is the safe side (a record too many is only memory left
        // unadopted). A child taking over 1,024 regions scanned every record twice per
        // region for these.
        if !self.ranges.forget_from_last(s, e).unwrap_or_else(|| self.ranges.forget(s, e)) {
            self.lost.store(true, Relaxed);
        }
    }

    /// Unmaps `[start, start + len)` with `unmap` (true if it did): its record goes
    /// first (module comment), and comes back if the unmapping failed.
    pub fn unmap(&self, start: usize, len: usize, unmap: impl FnOnce() -> bool) -> bool {
        let _making = self.making();
        self.forget(start, len);
        let done = unmap();
        if !done {
            self.note(start, len);
        }
        done
    }

    /// Moves a mapping of ours with `remap` (mremap: the new address, or None): the old
    /// record goes first and comes back if it failed; the new one is made before the
    /// mark ends (as for a new mapping).
    pub fn remap(&self, old: usize, old_len: usize, new_len: usize, remap: impl FnOnce() -> Option<usize>) -> Option<usize> {
        let _making = self.making();
        self.forget(old, old_len);
        let moved = remap();
        match moved {
            Some(p) => self.note(p, new_len),
            None => self.note(old, old_len),
        }
        moved
    }

    /// Whether a record could not be kept: what is not recorded may be ours.
    pub fn lost(&self) -> bool {
        self.lost.load(Relaxed)
    }

    /// Whether a mapping of ours is being made now.
    pub fn busy(&self) -> bool {
        self.gate.busy()
    }

    /// Waits out the mappings being made or unmapped, and keeps new ones from starting
    /// until the result drops. The scan only, from its last look at a range to its
    /// registration; it must make or unmap no mapping of ours meanwhile.
    pub fn exclude(&self) -> Closed<'_> {
        self.gate.close()
    }

    /// After fork, in the child: marks of the parent's other threads never end here.
    pub fn reset_in_child(&self) {
        self.gate.reset_in_child();
    }

    /// Whether any of `[start, end)` is ours (async-signal-safe: atomic loads).
    pub fn any_within(&self, start: usize, end: usize) -> bool {
        self.ranges.meets(start, end)
    }

    /// Whether one record holds all of `[start, end)`.
    pub fn covers(&self, start: usize, end: usize) -> bool {
        self.ranges.covers(start, end)
    }

    /// The parts of `[start, end)` that are ours, in address order (allocates).
    pub fn within(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        self.ranges.parts_within(start, end)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const LEN: usize = 64 << 10;

    fn mmap_anon() -> usize {
        // SAFETY: a fresh private anonymous mapping at an address of the kernel's choosing.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    }

    fn munmap(p: usize) -> bool {
        // SAFETY: `p` is a mapping of LEN bytes this test made and no longer uses.
        unsafe { libc::munmap(p as *mut _, LEN) == 0 }
    }

    /// Threads map and unmap mappings of the same size at once, so that the kernel hands
    /// one thread's just-freed addresses to another: a live mapping is always recorded.
    /// With the record forgotten after the munmap, another thread's fresh record at the
    /// same address was erased (this failed within a few thousand rounds).
    #[test]
    fn a_live_mapping_stays_recorded_while_others_come_and_go() {
        static OWN: OwnMaps<64> = OwnMaps::new();
        std::thread::scope(|s| {
            for t in 0..3 {
                s.spawn(move || {
                    for round in 0..20_000 {
                        let p = {
                            let _m = OWN.making();
                            let p = mmap_anon();
                            OWN.note(p, LEN);
                            p
                        };
                        for _ in 0..3 {
                            assert!(OWN.covers(p, p + LEN), "thread {t} round {round}: a live mapping's record is gone");
                            std::thread::yield_now();
                        }
                        // A munmap that takes a while to return (preempted): another
                        // thread may map at the freed address meanwhile.
                        assert!(OWN.unmap(p, LEN, || munmap(p) && {
                            std::thread::yield_now();
                            true
                        }));
                    }
                });
            }
        });
        assert!(!OWN.lost());
        assert!(!OWN.busy());
    }

    #[test]
    fn a_failed_unmap_keeps_the_record_and_a_full_set_says_so() {
        let own = OwnMaps::<2>::new();
        own.note(0x10000, 3 * PAGE);
        assert!(!own.unmap(0x10000, PAGE, || false));
        assert!(own.covers(0x10000, 0x10000 + 3 * PAGE) || own.within(0x10000, 0x13000) == vec![(0x10000, 0x11000), (0x11000, 0x13000)]);
        assert_eq!(own.remap(0x10000, 3 * PAGE, 2 * PAGE, || Some(0x40000)), Some(0x40000));
        assert!(!own.any_within(0x10000, 0x13000) && own.covers(0x40000, 0x42000));
        own.note(0x80000, PAGE);
        own.note(0x90000, 100); // rounded up to a page; no slot left
        assert!(own.lost());
    }
}
