//! The fault queue: folios in the order they were faulted in, from the fault paths to
//! the reclaimer, so that it learns of new candidates without scanning every folio of
//! every region and sorting them (what it did before: a third of its time at 4 KiB
//! folios, where a random re-read keeps emptying its lists).
//!
//! A bounded multi-producer queue after Dmitry Vyukov's (a sequence number per cell
//! says whether it is free for the lap, or filled): producers are SIGBUS handlers and
//! the reader thread, so pushing takes atomics only, never a lock or an allocation. One
//! consumer, the reclaimer. An entry names a folio by its region's table slot, its
//! index and the low bits of its fault stamp; it may be stale when read (the folio
//! faulted again, was evicted, dropped, or its region went away) and the reclaimer
//! checks it against the folio as it is. A full queue drops the entry and says so
//! (`take_overflow`): the reclaimer then falls back to one full scan.
//!
//! A producer interrupted between claiming a cell and filling it (a signal on the
//! reader thread, preemption) holds up the consumer at that cell until it finishes:
//! the reclaimer then just works from what it has. A loom model checks the protocol
//! (`RUSTFLAGS="--cfg loom" cargo test -p uzswap-runtime --lib --release loom`).

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU64};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::atomic::Ordering::*;

const CAPACITY: usize = 1 << 16;
const SLOT_BITS: u32 = 12;
const IDX_BITS: u32 = 34;
const STAMP_BITS: u32 = 64 - SLOT_BITS - IDX_BITS;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;

struct Cell {
    /// `pos` when free for the producer of position `pos`, `pos + 1` once filled; kept
    /// less the cell's index, so that a new queue is all zeros: fresh pages that cost
    /// no memory until used (a mebibyte in every process otherwise, most of an idle
    /// one's).
    seq: AtomicU64,
    value: AtomicU64,
}

pub(crate) struct FaultQueue {
    cells: Box<[Cell]>,
    enqueue: AtomicU64,
    dequeue: AtomicU64,
    overflowed: AtomicBool,
}

/// A folio as the queue names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Queued {
    pub slot: usize,
    pub idx: usize,
    stamp_bits: u64,
}

impl Queued {
    /// Whether `stamp` is (as far as the kept bits tell) the stamp it was queued with.
    pub fn stamp_matches(&self, stamp: u64) -> bool {
        stamp & STAMP_MASK == self.stamp_bits
    }
}

impl FaultQueue {
    pub fn new() -> FaultQueue {
        FaultQueue::with_capacity(CAPACITY)
    }

    /// A queue of `capacity` entries (a power of two; tests use small ones).
    fn with_capacity(capacity: usize) -> FaultQueue {
        assert!(capacity.is_power_of_two());
        #[cfg(not(loom))]
        let cells = {
            let layout = std::alloc::Layout::array::<Cell>(capacity).expect("queue size");
            // SAFETY: a layout of non-zero size; all zeros is a valid Cell (two
            // AtomicU64 of 0: every cell free for the first lap), so the block holds
            // `capacity` initialised cells, and Box frees it with the same layout.
            unsafe {
                let p = std::alloc::alloc_zeroed(layout).cast::<Cell>();
                if p.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, capacity))
            }
        };
        #[cfg(loom)]
        let cells = (0..capacity).map(|_| Cell { seq: AtomicU64::new(0), value: AtomicU64::new(0) }).collect();
        FaultQueue {
            cells,
            enqueue: AtomicU64::new(0),
            dequeue: AtomicU64::new(0),
            overflowed: AtomicBool::new(false),
        }
    }

    /// Queues folio `idx` of the region in table slot `slot`, faulted in at `stamp`.
    /// Async-signal-safe (atomics only).
    pub fn push(&self, slot: usize, idx: usize, stamp: u64) {
        if slot >= 1 << SLOT_BITS || idx >= 1 << IDX_BITS {
            // Not nameable in an entry (a region of more than 64 TiB): the scan finds it.
            self.overflowed.store(true, Relaxed);
            return;
        }
        let value = (slot as u64) << (IDX_BITS + STAMP_BITS) | (idx as u64) << STAMP_BITS | stamp & STAMP_MASK;
        let mut pos = self.enqueue.load(Relaxed);
        loop {
            let (cell, seq) = self.seq(pos);
            match seq.cmp(&pos) {
                std::cmp::Ordering::Equal => match self.enqueue.compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed) {
                    Ok(_) => {
                        cell.value.store(value, Relaxed);
                        self.set_seq(cell, pos, pos + 1);
                        return;
                    }
                    Err(now) => pos = now,
                },
                // The cell still holds the entry of the lap before: full.
                std::cmp::Ordering::Less => {
                    self.overflowed.store(true, Relaxed);
                    return;
                }
                std::cmp::Ordering::Greater => pos = self.enqueue.load(Relaxed),
            }
        }
    }

    /// The oldest entry, if one is ready. Only the reclaimer calls this.
    pub fn pop(&self) -> Option<Queued> {
        let pos = self.dequeue.load(Relaxed);
        let (cell, seq) = self.seq(pos);
        if seq != pos + 1 {
            return None;
        }
        let v = cell.value.load(Relaxed);
        self.set_seq(cell, pos, pos + self.cells.len() as u64);
        self.dequeue.store(pos + 1, Relaxed);
        Some(Queued {
            slot: (v >> (IDX_BITS + STAMP_BITS)) as usize,
            idx: ((v >> STAMP_BITS) & ((1 << IDX_BITS) - 1)) as usize,
            stamp_bits: v & STAMP_MASK,
        })
    }

    /// The cell of position `pos`, and its sequence number (Acquire).
    fn seq(&self, pos: u64) -> (&Cell, u64) {
        let i = pos & (self.cells.len() as u64 - 1);
        let cell = &self.cells[i as usize];
        (cell, cell.seq.load(Acquire).wrapping_add(i))
    }

    /// Sets the sequence number of `cell`, the cell of position `pos` (Release).
    fn set_seq(&self, cell: &Cell, pos: u64, seq: u64) {
        cell.seq.store(seq.wrapping_sub(pos & (self.cells.len() as u64 - 1)), Release);
    }

    /// Whether entries were dropped since the last call (the queue was full).
    pub fn take_overflow(&self) -> bool {
        self.overflowed.swap(false, Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn order_and_overflow() {
        let q = FaultQueue::new();
        for i in 0..CAPACITY {
            q.push(3, i, i as u64);
        }
        assert!(!q.take_overflow());
        q.push(3, 0, 0);
        assert!(q.take_overflow(), "a full queue says it dropped an entry");
        for i in 0..CAPACITY {
            let e = q.pop().unwrap();
            assert_eq!((e.slot, e.idx), (3, i));
            assert!(e.stamp_matches(i as u64));
        }
        assert_eq!(q.pop(), None);
        q.push(4095, (1 << IDX_BITS) - 1, u64::MAX);
        let e = q.pop().unwrap();
        assert_eq!((e.slot, e.idx), (4095, (1 << IDX_BITS) - 1));
        assert!(e.stamp_matches(u64::MAX) && !e.stamp_matches(u64::MAX - 1));
    }

    /// Several producers and the consumer at once: every entry comes out exactly once,
    /// each producer's in its own order, none invented.
    #[test]
    fn producers_and_consumer_hammer() {
        let q = Arc::new(FaultQueue::new());
        let (producers, per) = (4, 200_000usize);
        let handles: Vec<_> = (0..producers)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        q.push(p, i, 0);
                        if i % 1024 == 0 {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = vec![0usize; producers];
        let mut got = 0;
        let mut dropped = false;
        while got < producers * per {
            match q.pop() {
                Some(e) => {
                    // Entries may be missing (overflow), never out of order or repeated.
                    assert!(e.idx >= next[e.slot], "producer {} went back from {} to {}", e.slot, next[e.slot], e.idx);
                    dropped |= e.idx > next[e.slot];
                    next[e.slot] = e.idx + 1;
                    got += 1;
                }
                None if handles.iter().all(|h| h.is_finished()) && q.pop().is_none() => break,
                None => std::thread::yield_now(),
            }
        }
        for h in handles {
            h.join().unwrap();
        }
        while let Some(e) = q.pop() {
            assert!(e.idx >= next[e.slot]);
            next[e.slot] = e.idx + 1;
            got += 1;
        }
        let overflowed = q.take_overflow();
        assert_eq!(dropped || got < producers * per, overflowed, "drops and the overflow flag agree");
        assert!(got <= producers * per);
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Two producers and a consumer on a queue of two cells, on the second lap of the
    //! ring: loom checks every interleaving. Both entries fit (the queue was empty),
    //! each comes out exactly once, whole, and nothing is invented (a cell read before
    //! it was filled would show the first lap's entry, or zeros).
    use super::*;
    use loom::sync::Arc;

    #[test]
    fn loom_entries_once_each() {
        loom::model(|| {
            let q = Arc::new(FaultQueue::with_capacity(2));
            // One lap first, so the producers below wrap around the ring.
            q.push(9, 9, 0);
            assert_eq!(q.pop().map(|e| e.slot), Some(9));
            let producers: Vec<_> = (0..2)
                .map(|p| {
                    let q = q.clone();
                    loom::thread::spawn(move || q.push(p, p + 1, 0))
                })
                .collect();
            let consumer = {
                let q = q.clone();
                loom::thread::spawn(move || q.pop().map(|e| (e.slot, e.idx)))
            };
            for h in producers {
                h.join().unwrap();
            }
            let mut got: Vec<(usize, usize)> = consumer.join().unwrap().into_iter().collect();
            while let Some(e) = q.pop() {
                got.push((e.slot, e.idx));
            }
            got.sort_unstable();
            assert_eq!(got, [(0, 1), (1, 2)]);
            assert!(!q.take_overflow());
        });
    }
}
