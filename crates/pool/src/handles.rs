//! The handle table: one 64-bit word per handle (see `word`), in page-aligned
//! mappings that double in size, so a slot never moves and readers index it without
//! a lock. Slots are handed out in order, so the table's memory is the pages under its
//! high-water mark; it does not shrink (like a slab that keeps its pages), but freed
//! handles are reused before new ones are issued.
//!
//! Free handles sit on intrusive chains threaded through their own words: each size
//! class keeps a small chain of its own (under its class lock, so a store or free
//! takes no other lock), and the pool keeps a spare chain for the rest.

use crate::word::{decode_free, free_word};
use crate::{sys, PoolError};
use uzswap_sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

const FIRST_SEGMENT_LOG2: u32 = 9;
const SEGMENTS: usize = 19;
/// Number of handles a pool can issue (just under 2^28).
pub(crate) const MAX_HANDLES: usize = (1 << FIRST_SEGMENT_LOG2) * ((1 << SEGMENTS) - 1);

/// (segment, offset) of element `index` in tables whose segment `s` holds
/// `2^(first_log2 + s)` elements.
pub(crate) fn locate(index: usize, first_log2: u32) -> (usize, usize) {
    let x = (index >> first_log2) + 1;
    let segment = (usize::BITS - 1 - x.leading_zeros()) as usize;
    (segment, index - (((1 << segment) - 1) << first_log2))
}

pub(crate) fn segment_len(segment: usize, first_log2: u32) -> usize {
    1 << (first_log2 as usize + segment)
}

pub(crate) struct HandleTable {
    segments: [AtomicPtr<AtomicU64>; SEGMENTS],
    /// Slots handed out so far: the high-water mark.
    issued: AtomicU32,
    grow: Mutex<()>,
    /// Free handles no class holds.
    pub spare: Mutex<FreeChain>,
}

impl HandleTable {
    pub fn new() -> HandleTable {
        HandleTable {
            segments: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
            issued: AtomicU32::new(0),
            grow: Mutex::new(()),
            spare: Mutex::new(FreeChain::default()),
        }
    }

    /// The word of handle slot `index`, if that slot was ever issued.
    pub fn slot(&self, index: u32) -> Option<&AtomicU64> {
        if index >= self.issued.load(Ordering::Acquire) {
            return None;
        }
        let (segment, offset) = locate(index as usize, FIRST_SEGMENT_LOG2);
        let base = self.segments[segment].load(Ordering::Acquire);
        // SAFETY: a non-null segment is a live mapping of segment_len words, never
        // unmapped before the table is dropped; zero bytes are a valid AtomicU64.
        (!base.is_null()).then(|| unsafe { &*base.add(offset) })
    }

    /// A never-used slot (its word is 0: free, generation 0).
    pub fn fresh(&self) -> Result<u32, PoolError> {
        let index = self
            .issued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                ((n as usize) < MAX_HANDLES).then_some(n + 1)
            })
            .map_err(|_| PoolError::OutOfMemory)?;
        let (segment, _) = locate(index as usize, FIRST_SEGMENT_LOG2);
        if self.segments[segment].load(Ordering::Acquire).is_null() {
            let _grow = self.grow.lock();
            if self.segments[segment].load(Ordering::Acquire).is_null() {
                let len = segment_len(segment, FIRST_SEGMENT_LOG2) * 8;
                let base = sys::map(sys::round_up_to_page(len))?;
                self.segments[segment].store(base.as_ptr().cast(), Ordering::Release);
            }
        }
        Ok(index)
    }

    /// Bytes of the pages the issued slots cover.
    pub fn resident_bytes(&self) -> u64 {
        let mut left = self.issued.load(Ordering::Acquire) as usize;
        let mut bytes = 0;
        for segment in 0..SEGMENTS {
            if left == 0 {
                break;
            }
            let here = left.min(segment_len(segment, FIRST_SEGMENT_LOG2));
            if !self.segments[segment].load(Ordering::Acquire).is_null() {
                bytes += sys::round_up_to_page(here * 8);
            }
            left -= here;
        }
        bytes as u64
    }
}

impl Drop for HandleTable {
    fn drop(&mut self) {
        for (segment, ptr) in self.segments.iter_mut().enumerate() {
            if let Some(base) = std::ptr::NonNull::new(*ptr.get_mut()) {
                let len = sys::round_up_to_page(segment_len(segment, FIRST_SEGMENT_LOG2) * 8);
                // SAFETY: mapped in `fresh` with this length; `&mut self` means no
                // reference into it is alive.
                unsafe { sys::unmap(base.cast(), len) };
            }
        }
    }
}

/// A chain of free handles, linked through their words. The owner of the chain (a
/// class lock, or the spare mutex) is the only writer of those words.
#[derive(Default, Debug)]
pub(crate) struct FreeChain {
    head: Option<u32>,
    len: u32,
}

impl FreeChain {
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Adds free slot `index`; its next owner gets generation `gen`.
    pub fn push(&mut self, table: &HandleTable, index: u32, gen: u8) {
        let slot = table.slot(index).expect("only issued handles are chained");
        slot.store(free_word(gen, self.head), Ordering::Release);
        self.head = Some(index);
        self.len += 1;
    }

    /// (index, generation) of a free slot.
    pub fn pop(&mut self, table: &HandleTable) -> Option<(u32, u8)> {
        let index = self.head?;
        let word = table
            .slot(index)
            .expect("only issued handles are chained")
            .load(Ordering::Acquire);
        let (gen, next) = decode_free(word);
        self.head = next;
        self.len -= 1;
        Some((index, gen))
    }

    /// Splits off up to `n` handles from the front.
    pub fn take(&mut self, table: &HandleTable, n: u32) -> FreeChain {
        let n = n.min(self.len);
        if n == 0 {
            return FreeChain::default();
        }
        let taken_head = self.head;
        let mut last = taken_head.expect("non-empty chain");
        for _ in 1..n {
            last = self.next_of(table, last).expect("chain as long as its len");
        }
        let slot = table.slot(last).expect("only issued handles are chained");
        let (gen, rest) = decode_free(slot.load(Ordering::Acquire));
        slot.store(free_word(gen, None), Ordering::Release);
        self.head = rest;
        self.len -= n;
        FreeChain {
            head: taken_head,
            len: n,
        }
    }

    /// Moves every handle of `other` onto this chain.
    pub fn append(&mut self, table: &HandleTable, other: FreeChain) {
        let Some(other_head) = other.head else { return };
        let mut last = other_head;
        while let Some(next) = self.next_of(table, last) {
            last = next;
        }
        let slot = table.slot(last).expect("only issued handles are chained");
        let (gen, _) = decode_free(slot.load(Ordering::Acquire));
        slot.store(free_word(gen, self.head), Ordering::Release);
        self.head = Some(other_head);
        self.len += other.len;
    }

    fn next_of(&self, table: &HandleTable, index: u32) -> Option<u32> {
        let slot = table.slot(index).expect("only issued handles are chained");
        decode_free(slot.load(Ordering::Acquire)).1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_walks_doubling_segments() {
        let mut expect = (0, 0);
        for index in 0..(1 << 14) {
            assert_eq!(locate(index, 3), expect, "index {index}");
            expect.1 += 1;
            if expect.1 == segment_len(expect.0, 3) {
                expect = (expect.0 + 1, 0);
            }
        }
    }

    #[test]
    fn chains_keep_generations_and_order() {
        let table = HandleTable::new();
        let indices: Vec<u32> = (0..10).map(|_| table.fresh().unwrap()).collect();
        assert_eq!(indices, (0..10).collect::<Vec<_>>());
        assert!(table.slot(10).is_none());
        let mut a = FreeChain::default();
        for &i in &indices {
            a.push(&table, i, (i % 16) as u8);
        }
        let mut b = a.take(&table, 4);
        assert_eq!((a.len(), b.len()), (6, 4));
        b.append(&table, a);
        let mut popped = Vec::new();
        while let Some((i, gen)) = b.pop(&table) {
            assert_eq!(gen, (i % 16) as u8);
            popped.push(i);
        }
        assert_eq!(popped, vec![5, 4, 3, 2, 1, 0, 9, 8, 7, 6]);
        assert_eq!(b.len(), 0);
    }

    #[test]
    fn resident_bytes_follow_the_high_water_mark() {
        let table = HandleTable::new();
        assert_eq!(table.resident_bytes(), 0);
        table.fresh().unwrap();
        let page = sys::page_size() as u64;
        assert_eq!(table.resident_bytes(), page);
        for _ in 0..2000 {
            table.fresh().unwrap();
        }
        // 2001 slots of 8 bytes.
        let expect: u64 = (0..SEGMENTS)
            .scan(2001usize, |left, s| {
                let here = (*left).min(segment_len(s, FIRST_SEGMENT_LOG2));
                *left -= here;
                Some(sys::round_up_to_page(here * 8) as u64)
            })
            .sum();
        assert_eq!(table.resident_bytes(), expect);
        assert!(expect >= 2001 * 8 && expect < 2001 * 8 + 4 * page);
    }
}
