//! The span table: span id -> lock, base address and the span's bookkeeping.
//!
//! Slots live in heap segments that double in size and are never freed before the
//! pool, so a reader holding any span id from a handle word (even a stale one) can
//! lock that slot. Ids of released spans are reused.

use crate::access::RwSpanLock;
use crate::handles::{locate, segment_len};
use crate::word::SPAN_IDS;
use crate::PoolError;
use uzswap_sync::Mutex;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

const FIRST_SEGMENT_LOG2: u32 = 6;
const SEGMENTS: usize = 20;
const _: () = assert!((1usize << FIRST_SEGMENT_LOG2) * ((1 << SEGMENTS) - 1) >= SPAN_IDS);

/// "No span" in lists and chains.
pub(crate) const NO_SPAN: u32 = u32::MAX;
/// `SpanMeta::group` of a span on no partial list.
pub(crate) const UNLISTED: u8 = u8::MAX;

/// `rmap` entry of a free position: this bit, and the next free position in the rest.
pub(crate) const FREE_POS: u32 = 1 << 31;
/// End of a span's free-position chain.
pub(crate) const NO_POS: u32 = FREE_POS - 1;

pub(crate) struct SpanSlot {
    /// The zspage lock: shared while an object in the span is read or written, held
    /// exclusively to move objects out of it.
    pub lock: RwSpanLock,
    /// Start of the span's mapping; null while the id is unused.
    base: AtomicPtr<u8>,
    meta: UnsafeCell<SpanMeta>,
}

/// Bookkeeping of a span. Guarded by the lock of the class that owns the span (for a
/// large object's span: by the object's owner), or by the id allocator while unused.
pub(crate) struct SpanMeta {
    /// Per position: the handle index of the object there, or `FREE_POS | next free`.
    /// This reverse map is what lets compaction find the word to update.
    pub rmap: Box<[u32]>,
    /// Length of the mapping.
    pub map_len: usize,
    /// Pages of the span that have been written to (and so count as held): the span
    /// is filled from its start, so this is a prefix.
    pub touched_pages: u32,
    /// Live objects.
    pub inuse: u32,
    /// First free position, or `NO_POS`.
    pub free_pos: u32,
    /// Partial-list group, or `UNLISTED`.
    pub group: u8,
    pub prev: u32,
    /// Next span on the partial list; for an unused id, the next unused id.
    pub next: u32,
}

impl Default for SpanSlot {
    fn default() -> Self {
        SpanSlot {
            lock: RwSpanLock::default(),
            base: AtomicPtr::new(std::ptr::null_mut()),
            meta: UnsafeCell::new(SpanMeta {
                rmap: Box::new([]),
                map_len: 0,
                touched_pages: 0,
                inuse: 0,
                free_pos: NO_POS,
                group: UNLISTED,
                prev: NO_SPAN,
                next: NO_SPAN,
            }),
        }
    }
}

impl SpanSlot {
    pub fn base(&self) -> *mut u8 {
        self.base.load(Ordering::Acquire)
    }

    pub fn set_base(&self, base: *mut u8) {
        self.base.store(base, Ordering::Release)
    }

    /// # Safety
    /// The caller holds what guards this span's bookkeeping (see [`SpanMeta`]) and
    /// holds no other reference to it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn meta(&self) -> &mut SpanMeta {
        &mut *self.meta.get()
    }
}

struct SpanIds {
    /// First unused id below `issued`.
    free: u32,
    issued: u32,
}

pub(crate) struct SpanTable {
    segments: [AtomicPtr<SpanSlot>; SEGMENTS],
    ids: Mutex<SpanIds>,
}

// SAFETY: a slot's `meta` is only touched under the guards documented on `SpanMeta`;
// everything else in a slot is atomic or a lock.
unsafe impl Sync for SpanSlot {}
unsafe impl Send for SpanSlot {}

impl SpanTable {
    pub fn new() -> SpanTable {
        SpanTable {
            segments: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
            ids: Mutex::new(SpanIds {
                free: NO_SPAN,
                issued: 0,
            }),
        }
    }

    /// The slot of a span id that was ever handed out.
    pub fn get(&self, id: u32) -> &SpanSlot {
        let (segment, offset) = locate(id as usize, FIRST_SEGMENT_LOG2);
        let base = self.segments[segment].load(Ordering::Acquire);
        assert!(!base.is_null(), "span id {id} was never issued");
        // SAFETY: segments are never freed before the table, and `offset` is in range.
        unsafe { &*base.add(offset) }
    }

    /// An unused span id. New table segments are counted in `held`.
    pub fn alloc(&self, held: &AtomicU64) -> Result<u32, PoolError> {
        let mut ids = self.ids.lock();
        if ids.free != NO_SPAN {
            let id = ids.free;
            // SAFETY: unused ids' bookkeeping is guarded by `ids`, which we hold.
            ids.free = unsafe { self.get(id).meta() }.next;
            return Ok(id);
        }
        if ids.issued as usize >= SPAN_IDS {
            return Err(PoolError::OutOfMemory);
        }
        let id = ids.issued;
        let (segment, _) = locate(id as usize, FIRST_SEGMENT_LOG2);
        if self.segments[segment].load(Ordering::Acquire).is_null() {
            let len = segment_len(segment, FIRST_SEGMENT_LOG2);
            let slots: Box<[SpanSlot]> = (0..len).map(|_| SpanSlot::default()).collect();
            held.fetch_add(
                (len * std::mem::size_of::<SpanSlot>()) as u64,
                Ordering::Relaxed,
            );
            self.segments[segment].store(Box::into_raw(slots).cast(), Ordering::Release);
        }
        ids.issued += 1;
        Ok(id)
    }

    /// Returns an id; its owner must be done with its bookkeeping.
    pub fn free(&self, id: u32) {
        let mut ids = self.ids.lock();
        // SAFETY: the caller gave up the span, so `ids` guards it now.
        unsafe { self.get(id).meta() }.next = ids.free;
        ids.free = id;
    }

    /// Ids handed out so far (every id below this has a slot).
    pub fn issued(&self) -> u32 {
        self.ids.lock().issued
    }
}

impl Drop for SpanTable {
    fn drop(&mut self) {
        for (segment, ptr) in self.segments.iter_mut().enumerate() {
            let base = *ptr.get_mut();
            if !base.is_null() {
                let len = segment_len(segment, FIRST_SEGMENT_LOG2);
                // SAFETY: made from a Box<[SpanSlot]> of this length in `alloc`.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(base, len)) });
            }
        }
    }
}
