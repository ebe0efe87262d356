//! Read-ahead for sequential passes over remote memory.
//!
//! Object numbers follow writeback order, and writeback takes the coldest folios
//! first: memory written in address order goes out, and gets its numbers, in
//! address order. So when faults ask for object `n` just after `n - 1`, the reader
//! thread takes it as a sequential pass and fetches the next objects in the same
//! round trip, into the buffers here; a fault that finds its object here copies it
//! and makes no round trip at all. A random pass fetches nothing ahead.
//!
//! A buffer's life (`state`):
//! ```text
//!   EMPTY -reader claims-> BUSY -filled-> READY(id) -a fault claims-> TAKEN -copied-> EMPTY
//!                                           |
//!                                           +-reader claims it back (oldest first, to make room)-> BUSY
//! ```
//! Only the reader touches a BUSY buffer (it may allocate: it is the tier's own
//! thread), only the one fault that claimed it a TAKEN one (a copy: no allocation,
//! no lock). Objects are never rewritten (a number is used once), so a buffer holds
//! its object's bytes for as long as it is READY; one whose object was freed is just
//! never asked for, and is the first reused.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

/// Objects fetched ahead of a sequential pass, and the most bytes they may hold.
pub(crate) const AHEAD: u64 = 8;
const SLOTS: usize = 2 * AHEAD as usize;
const MAX_BYTES: usize = 8 << 20;

const EMPTY: u32 = 0;
const BUSY: u32 = 1;
const READY: u32 = 2;
const TAKEN: u32 = 3;

#[derive(Default)]
struct Buffer {
    state: AtomicU32,
    id: AtomicU64,
    /// When it was filled (the reader's count): the oldest goes first.
    filled: AtomicU64,
    data: UnsafeCell<Vec<u8>>,
}

pub(crate) struct Ahead {
    bufs: [Buffer; SLOTS],
    /// Memory the buffers hold (their capacity): at most MAX_BYTES.
    held: AtomicUsize,
    fills: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) fetched: AtomicU64,
}

// SAFETY: a buffer's data is touched only by whoever moved its state to BUSY (the
// reader) or TAKEN (one fault), each exclusive by the exchange that got it there.
unsafe impl Sync for Ahead {}

impl Ahead {
    pub(crate) fn new() -> Ahead {
        Ahead {
            bufs: std::array::from_fn(|_| Buffer::default()),
            held: AtomicUsize::new(0),
            fills: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
        }
    }

    /// A fault's side: if object `id` is here, calls `with` on its bytes and lets the
    /// buffer go (its memory stays, for the reader to reuse or give back).
    /// Signal-safe: atomics and what `with` does.
    pub(crate) fn take<T>(&self, id: u64, with: impl FnOnce(&[u8]) -> T) -> Option<T> {
        for b in &self.bufs {
            if b.state.load(Acquire) != READY || b.id.load(Relaxed) != id {
                continue;
            }
            if b.state.compare_exchange(READY, TAKEN, Acquire, Relaxed).is_err() {
                continue;
            }
            // The reader may have refilled it between the check and the exchange.
            if b.id.load(Relaxed) != id {
                b.state.store(READY, Release);
                continue;
            }
            // SAFETY: TAKEN is ours alone (see the type's Sync note).
            let out = with(unsafe { &*b.data.get() });
            b.state.store(EMPTY, Release);
            self.hits.fetch_add(1, Relaxed);
            return Some(out);
        }
        None
    }

    /// The reader's side: whether object `id` is here already.
    pub(crate) fn has(&self, id: u64) -> bool {
        self.bufs.iter().any(|b| b.state.load(Acquire) == READY && b.id.load(Relaxed) == id)
    }

    /// The reader's side: keeps object `id`, in an empty buffer or the oldest ready
    /// one, within MAX_BYTES (giving back empty buffers' memory, then the oldest).
    pub(crate) fn put(&self, id: u64, value: &[u8]) {
        while self.held.load(Relaxed) + value.len() > MAX_BYTES {
            let Some(b) = self.claim(|b| b.state.load(Relaxed) == EMPTY && b.has_memory()).or_else(|| self.claim_oldest()) else {
                return;
            };
            // SAFETY: BUSY is ours alone.
            let data = std::mem::take(unsafe { &mut *b.data.get() });
            self.held.fetch_sub(data.capacity(), Relaxed);
            b.state.store(EMPTY, Release);
        }
        let Some(b) = self.claim(|b| b.state.load(Relaxed) == EMPTY).or_else(|| self.claim_oldest()) else { return };
        // SAFETY: BUSY is ours alone.
        let data = unsafe { &mut *b.data.get() };
        let before = data.capacity();
        data.clear();
        data.extend_from_slice(value);
        self.held.fetch_add(data.capacity() - before, Relaxed);
        b.id.store(id, Relaxed);
        b.filled.store(self.fills.fetch_add(1, Relaxed), Relaxed);
        self.fetched.fetch_add(1, Relaxed);
        b.state.store(READY, Release);
    }

    /// The first buffer `pick` chooses that is still in the state it saw: now BUSY.
    fn claim(&self, pick: impl Fn(&Buffer) -> bool) -> Option<&Buffer> {
        self.bufs.iter().filter(|b| pick(b)).find(|b| {
            let seen = b.state.load(Relaxed);
            (seen == EMPTY || seen == READY) && b.state.compare_exchange(seen, BUSY, Acquire, Relaxed).is_ok()
        })
    }

    /// The oldest READY buffer, now BUSY.
    fn claim_oldest(&self) -> Option<&Buffer> {
        let oldest = self.bufs.iter().filter(|b| b.state.load(Relaxed) == READY).min_by_key(|b| b.filled.load(Relaxed))?;
        oldest.state.compare_exchange(READY, BUSY, Acquire, Relaxed).ok().map(|_| oldest)
    }
}

impl Buffer {
    /// Reader-only (the capacity of a buffer no fault holds).
    fn has_memory(&self) -> bool {
        // SAFETY: only called on EMPTY buffers by the reader, which alone changes them.
        unsafe { (*self.data.get()).capacity() > 0 }
    }
}
