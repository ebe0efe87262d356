//! Folio queues: bounded lock-free FIFOs of folio names, the hand-offs between the
//! fault paths, direct reclaim (direct.rs) and the reclaimer. Three of them:
//! - the *fault queue*: folios in the order they were faulted in, from the fault paths
//!   to the reclaimer, so that it learns of new candidates without scanning every
//!   folio of every region and sorting them (what it did before: a third of its time
//!   at 4 KiB folios, where a random re-read keeps emptying its lists). A full queue
//!   drops the entry and says so (`take_overflow`): the reclaimer then scans once.
//! - the *clean queue*: the oldest clean folios, from the reclaimer to faulting threads
//!   that evict them themselves;
//! - the *probation queue*: clean folios those threads put on probation, in order.
//!
//! Dmitry Vyukov's bounded MPMC queue (a sequence number per cell says whether it is
//! free for the lap, or filled; producers and consumers each claim a position with a
//! CAS): SIGBUS handlers push and pop, so both take atomics only, never a lock or an
//! allocation. An entry names a folio by its region's table slot and its index, with
//! an 18-bit tag (the low bits of its fault stamp, or the length of a run). It may be
//! stale when read (the folio faulted again, was evicted, dropped, or its region went
//! away): whoever pops it checks it against the folio as it is, under the folio lock.
//!
//! A producer interrupted between claiming a cell and filling it (a signal, preemption)
//! holds up consumers at that cell until it finishes: they see the queue as empty
//! meanwhile and work from what they have. A loom model checks the protocol
//! (`RUSTFLAGS="--cfg loom" cargo test -p uzswap-runtime --lib --release loom`).

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::atomic::Ordering::*;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU64};

/// Entries of the fault queue: a few tens of milliseconds of faults at 4 KiB.
pub(crate) const FAULT_QUEUE_CAPACITY: usize = 1 << 16;
/// Entries of the clean queue (direct reclaim's candidates); refilled below half.
pub(crate) const CLEAN_QUEUE_CAPACITY: usize = 1 << 13;
/// Entries of the probation queue of direct reclaim (runs of clean folios).
pub(crate) const PROBATION_QUEUE_CAPACITY: usize = 1 << 16;
const SLOT_BITS: u32 = 12;
const IDX_BITS: u32 = 34;
const STAMP_BITS: u32 = 64 - SLOT_BITS - IDX_BITS;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;

struct Cell {
    /// `pos` when free for the producer of position `pos`, `pos + 1` once filled.
    seq: AtomicU64,
    value: AtomicU64,
}

pub(crate) struct FolioQueue {
    cells: Box<[Cell]>,
    enqueue: AtomicU64,
    dequeue: AtomicU64,
    overflowed: AtomicBool,
}

/// A folio as the queue names it, with a tag: the low bits of its fault stamp in the
/// fault queue, the length of the run it starts in the clean queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Queued {
    pub slot: usize,
    pub idx: usize,
    pub tag: u64,
}

impl Queued {
    /// Whether `stamp` is (as far as the kept bits tell) the stamp it was queued with.
    pub fn stamp_matches(&self, stamp: u64) -> bool {
        stamp & STAMP_MASK == self.tag
    }
}

impl FolioQueue {
    /// A queue of `capacity` entries (a power of two).
    pub fn new(capacity: usize) -> FolioQueue {
        assert!(capacity.is_power_of_two());
        FolioQueue {
            cells: (0..capacity as u64)
                .map(|i| Cell {
                    seq: AtomicU64::new(i),
                    value: AtomicU64::new(0),
                })
                .collect(),
            enqueue: AtomicU64::new(0),
            dequeue: AtomicU64::new(0),
            overflowed: AtomicBool::new(false),
        }
    }

    /// Queues folio `idx` of the region in table slot `slot` with `tag` (its low 18
    /// bits). False if it was dropped (the queue is full, or the
    /// folio not nameable). Async-signal-safe (atomics only).
    pub fn push(&self, slot: usize, idx: usize, tag: u64) -> bool {
        if slot >= 1 << SLOT_BITS || idx >= 1 << IDX_BITS {
            // Not nameable in an entry (a region of more than 64 TiB): the scan finds it.
            self.overflowed.store(true, Relaxed);
            return false;
        }
        let value = (slot as u64) << (IDX_BITS + STAMP_BITS)
            | (idx as u64) << STAMP_BITS
            | tag & STAMP_MASK;
        let mut pos = self.enqueue.load(Relaxed);
        loop {
            let cell = self.cell(pos);
            let seq = cell.seq.load(Acquire);
            match seq.cmp(&pos) {
                std::cmp::Ordering::Equal => {
                    match self
                        .enqueue
                        .compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed)
                    {
                        Ok(_) => {
                            cell.value.store(value, Relaxed);
                            cell.seq.store(pos + 1, Release);
                            return true;
                        }
                        Err(now) => pos = now,
                    }
                }
                // The cell still holds the entry of the lap before: full.
                std::cmp::Ordering::Less => {
                    self.overflowed.store(true, Relaxed);
                    return false;
                }
                std::cmp::Ordering::Greater => pos = self.enqueue.load(Relaxed),
            }
        }
    }

    /// The oldest entry, if one is ready. Any thread; async-signal-safe.
    pub fn pop(&self) -> Option<Queued> {
        let mut pos = self.dequeue.load(Relaxed);
        loop {
            let cell = self.cell(pos);
            let seq = cell.seq.load(Acquire);
            match seq.cmp(&(pos + 1)) {
                std::cmp::Ordering::Equal => {
                    match self
                        .dequeue
                        .compare_exchange_weak(pos, pos + 1, Relaxed, Relaxed)
                    {
                        Ok(_) => {
                            let v = cell.value.load(Relaxed);
                            cell.seq.store(pos + self.cells.len() as u64, Release);
                            return Some(Queued {
                                slot: (v >> (IDX_BITS + STAMP_BITS)) as usize,
                                idx: ((v >> STAMP_BITS) & ((1 << IDX_BITS) - 1)) as usize,
                                tag: v & STAMP_MASK,
                            });
                        }
                        Err(now) => pos = now,
                    }
                }
                // Not filled yet for this lap: empty (or its producer is still at it).
                std::cmp::Ordering::Less => return None,
                // Another consumer took it: look again.
                std::cmp::Ordering::Greater => pos = self.dequeue.load(Relaxed),
            }
        }
    }

    /// About how many entries it holds (exact when nobody pushes or pops meanwhile).
    pub fn len(&self) -> usize {
        let (e, d) = (self.enqueue.load(Relaxed), self.dequeue.load(Relaxed));
        e.saturating_sub(d) as usize
    }

    pub fn capacity(&self) -> usize {
        self.cells.len()
    }

    fn cell(&self, pos: u64) -> &Cell {
        &self.cells[pos as usize & (self.cells.len() - 1)]
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

    const CAPACITY: usize = 1 << 16;

    #[test]
    fn order_and_overflow() {
        let q = FolioQueue::new(CAPACITY);
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
        let q = Arc::new(FolioQueue::new(CAPACITY));
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

    /// Two producers and two consumers at once: every entry comes out exactly once.
    #[test]
    fn two_consumers_hammer() {
        let q = Arc::new(FolioQueue::new(1 << 10));
        let (producers, per) = (2usize, 100_000usize);
        let pushers: Vec<_> = (0..producers)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        while !q.push(p, i, 0) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let poppers: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let mut idle = 0;
                    while idle < 1_000_000 {
                        match q.pop() {
                            Some(e) => {
                                got.push((e.slot, e.idx));
                                idle = 0;
                            }
                            None => {
                                idle += 1;
                                std::hint::spin_loop();
                            }
                        }
                    }
                    got
                })
            })
            .collect();
        for h in pushers {
            h.join().unwrap();
        }
        let mut all: Vec<(usize, usize)> = poppers
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        while let Some(e) = q.pop() {
            all.push((e.slot, e.idx));
        }
        all.sort_unstable();
        let want: Vec<(usize, usize)> = (0..producers)
            .flat_map(|p| (0..per).map(move |i| (p, i)))
            .collect();
        assert_eq!(all, want, "every entry exactly once");
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Two producers and two consumers on a queue of two cells, one lap and a wrap:
    //! loom checks every interleaving; no entry may be lost, repeated or invented.
    use super::*;
    use loom::sync::Arc;

    #[test]
    fn loom_entries_once_each() {
        loom::model(|| {
            let q = Arc::new(FolioQueue::new(2));
            // Fill one cell ahead so the producers below wrap around the ring.
            assert!(q.push(9, 0, 0));
            assert_eq!(q.pop().map(|e| e.slot), Some(9));
            let producers: Vec<_> = (0..2)
                .map(|p| {
                    let q = q.clone();
                    loom::thread::spawn(move || q.push(p, p, 0))
                })
                .collect();
            let consumer = {
                let q = q.clone();
                loom::thread::spawn(move || q.pop().map(|e| e.slot))
            };
            let mut got: Vec<usize> = Vec::new();
            got.extend(q.pop().map(|e| e.slot));
            let pushed: Vec<bool> = producers.into_iter().map(|h| h.join().unwrap()).collect();
            got.extend(consumer.join().unwrap());
            while let Some(e) = q.pop() {
                got.push(e.slot);
            }
            got.sort_unstable();
            let want: Vec<usize> = (0..2).filter(|&p| pushed[p]).collect();
            assert_eq!(got, want);
            // Two cells, two producers: both fit.
            assert!(pushed.iter().all(|&p| p));
        });
    }
}
