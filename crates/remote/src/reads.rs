//! Reads from the remote store for a fault, which may run in a signal handler.
//!
//! A fault may not allocate, take a lock the interrupted code may hold, or wait for
//! another thread without bound, and a client library does all three. So a fault
//! never talks to the server: it fills one of a fixed table of request slots (all
//! atomics), wakes the *reader thread*, and sleeps on the slot's state word (a
//! futex) until the reader has copied the object into the fault's buffer, or until
//! its deadline. The reader sends every posted request as one pipeline (many faults,
//! one round trip), and refreshes the store's expiry while it is idle.
//!
//! A slot's life (`state`):
//! ```text
//!   FREE -claim-> CLAIMED -post-> POSTED -reader takes-> TAKEN -reader copies-> FILLING -> DONE -fault reads-> FREE
//!                                   |                      |
//!                                   +---- fault's deadline passed: ABANDONED -reader sees it-> FREE
//! ```
//! Who may touch the buffer: the reader, only between a successful TAKEN->FILLING
//! exchange and DONE; a fault that gives up exchanges POSTED/TAKEN->ABANDONED, and
//! one that finds FILLING instead waits for DONE (a memcpy away). So the reader never
//! writes into a buffer its fault has left.

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::time::{Duration, Instant};
use uzswap_sync::futex;

pub(crate) const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const POSTED: u32 = 2;
const TAKEN: u32 = 3;
const FILLING: u32 = 4;
const DONE: u32 = 5;
const ABANDONED: u32 = 6;

/// What the reader found for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Outcome {
    Ok = 0,
    /// The server has no such object (expired, flushed, or lost with its node).
    Missing = 1,
    /// The connection failed or timed out; the fault may post again.
    Link = 2,
    /// The object is not the length the slot says.
    Size = 3,
}

impl Outcome {
    fn from_u32(v: u32) -> Outcome {
        match v {
            0 => Outcome::Ok,
            1 => Outcome::Missing,
            3 => Outcome::Size,
            _ => Outcome::Link,
        }
    }
}

/// Faults that can be in flight at once; more wait for a slot (bounded by their deadline).
pub(crate) const SLOTS: usize = 64;

#[derive(Default)]
pub(crate) struct Request {
    state: AtomicU32,
    /// The object's number (its hash field).
    id: AtomicU64,
    /// Bytes of data the object holds (sealed: without nonce and tag).
    len: AtomicUsize,
    buf: AtomicPtr<u8>,
    outcome: AtomicU32,
    /// Sealed objects: the nonce and tag the reader found beside the data.
    nonce: AtomicU64,
    tag: [AtomicU64; 2],
}

/// The request table shared by faults and the reader thread.
pub(crate) struct Reads {
    pub(crate) slots: [Request; SLOTS],
    /// Bumped on every post: the reader's futex.
    pub(crate) posted: AtomicU32,
    /// Set when the tier is dropped: the reader exits.
    pub(crate) stop: AtomicU32,
    /// Whether objects carry a nonce and a tag.
    pub(crate) sealed: bool,
}

/// What a finished request gives its fault besides the bytes.
pub(crate) struct Got {
    pub(crate) outcome: Outcome,
    pub(crate) nonce: u64,
    pub(crate) tag: [u8; 16],
}

impl Reads {
    pub(crate) fn new(sealed: bool) -> Reads {
        Reads {
            slots: std::array::from_fn(|_| Request::default()),
            posted: AtomicU32::new(0),
            stop: AtomicU32::new(0),
            sealed,
        }
    }

    /// Fetches object `id` of `buf.len()` bytes into `buf`, waiting until `deadline`.
    /// Signal-safe: atomics, futexes and the clock. `None`: the deadline passed.
    pub(crate) fn fetch(&self, id: u64, buf: &mut [u8], deadline: Instant) -> Option<Got> {
        let slot = self.claim(deadline)?;
        let r = &self.slots[slot];
        r.id.store(id, Relaxed);
        r.len.store(buf.len(), Relaxed);
        r.buf.store(buf.as_mut_ptr(), Relaxed);
        r.state.store(POSTED, Release);
        self.posted.fetch_add(1, Release);
        futex::wake(&self.posted, 1);
        loop {
            let s = r.state.load(Acquire);
            if s == DONE {
                break;
            }
            let now = Instant::now();
            if now >= deadline && s != FILLING {
                if r.state.compare_exchange(s, ABANDONED, AcqRel, Acquire).is_ok() {
                    // The reader frees the slot when it next looks at it.
                    return None;
                }
                continue;
            }
            // FILLING is a copy away from DONE: wait without a deadline for it.
            futex::wait(&r.state, s, if s == FILLING { None } else { Some(deadline - now) });
        }
        let got = Got {
            outcome: Outcome::from_u32(r.outcome.load(Relaxed)),
            nonce: r.nonce.load(Relaxed),
            tag: tag_bytes(&r.tag),
        };
        r.state.store(FREE, Release);
        Some(got)
    }

    fn claim(&self, deadline: Instant) -> Option<usize> {
        loop {
            for (i, r) in self.slots.iter().enumerate() {
                if r.state.compare_exchange(FREE, CLAIMED, Acquire, Relaxed).is_ok() {
                    return Some(i);
                }
            }
            // Every slot is busy: as many faults wait on the server as there are slots.
            if Instant::now() >= deadline {
                return None;
            }
            // SAFETY: sched_yield has no arguments and no memory effects.
            unsafe { libc::sched_yield() };
        }
    }

    // ---- The reader thread's side. ----

    /// Takes every posted request: (slot, object id). Frees abandoned ones.
    pub(crate) fn take_posted(&self, out: &mut Vec<(usize, u64)>) {
        for (i, r) in self.slots.iter().enumerate() {
            if r.state.compare_exchange(POSTED, TAKEN, AcqRel, Relaxed).is_ok() {
                out.push((i, r.id.load(Relaxed)));
            } else {
                let _ = r.state.compare_exchange(ABANDONED, FREE, AcqRel, Relaxed);
            }
        }
    }

    /// Finishes a taken request with what the server answered (`None`: the link
    /// failed before an answer).
    pub(crate) fn finish(&self, slot: usize, answer: Option<Option<&[u8]>>) {
        let r = &self.slots[slot];
        if r.state.compare_exchange(TAKEN, FILLING, AcqRel, Acquire).is_err() {
            // The fault gave up (ABANDONED): its buffer is not ours to write.
            r.state.store(FREE, Release);
            return;
        }
        let len = r.len.load(Relaxed);
        let outcome = match answer {
            None => Outcome::Link,
            Some(None) => Outcome::Missing,
            Some(Some(v)) => {
                match unpack(v, len, self.sealed) {
                    Some((d, nonce, tag)) => {
                        // SAFETY: the fault posted `buf` of `len` bytes and waits (it cannot
                        // leave while the state is FILLING), so the buffer is live and ours.
                        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), r.buf.load(Relaxed), len) };
                        r.nonce.store(nonce, Relaxed);
                        for (w, c) in r.tag.iter().zip(tag.chunks_exact(8)) {
                            w.store(u64::from_le_bytes(c.try_into().unwrap()), Relaxed);
                        }
                        Outcome::Ok
                    }
                    None => Outcome::Size,
                }
            }
        };
        r.outcome.store(outcome as u32, Relaxed);
        r.state.store(DONE, Release);
        futex::wake(&r.state, 1);
    }

    /// Sleeps until a request is posted (after `seen` posts), the tier stops, or `timeout`.
    pub(crate) fn sleep(&self, seen: u32, timeout: Duration) {
        if self.stop.load(Acquire) == 0 {
            futex::wait(&self.posted, seen, Some(timeout));
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(1, Release);
        self.posted.fetch_add(1, Release);
        futex::wake(&self.posted, i32::MAX);
    }
}

/// An object's parts: its `len` bytes of data and, sealed, the nonce before them and
/// the tag after (`nonce || data || tag`). None: it is not that long.
pub(crate) fn unpack(v: &[u8], len: usize, sealed: bool) -> Option<(&[u8], u64, [u8; 16])> {
    if !sealed {
        return (v.len() == len).then_some((v, 0, [0; 16]));
    }
    if v.len() != len + 24 {
        return None;
    }
    let mut tag = [0u8; 16];
    tag.copy_from_slice(&v[8 + len..]);
    Some((&v[8..8 + len], u64::from_le_bytes(v[..8].try_into().unwrap()), tag))
}

fn tag_bytes(t: &[AtomicU64; 2]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&t[0].load(Relaxed).to_le_bytes());
    out[8..].copy_from_slice(&t[1].load(Relaxed).to_le_bytes());
    out
}

