//! Read-around: a sequential pass over records in an O_DIRECT file reads a window of
//! the file at once, as the kernel's swap readahead reads a cluster of swap slots
//! (vm.page-cluster) and keeps them in the swap cache.
//!
//! O_DIRECT keeps what went out of memory from coming back as page cache, but each
//! read is then one request to the device: on this kind of virtual disk a 4 KiB read
//! takes about 65 us (62 MB/s, `dd iflag=direct bs=4k`) and a 128 KiB read about
//! 240 us (548 MB/s). Writeback writes cold folios in address order into clusters
//! filled front to back, so the records a sequential pass asks for next sit just
//! after the one it asks for now.
//!
//! When a read starts within [`GAP`] after the end of one of the last few reads, it
//! is taken as part of a pass: a [`WINDOW`] of the file from its offset (within its
//! cluster) is read into one of [`WINDOWS`] preallocated buffers, and later reads
//! inside a window are copies. A read at random reads only its record, as before.
//!
//! A window must never give bytes the file no longer has. Every write to the file
//! counts, per bucket of clusters, a write begun (`started`) before it and a write
//! done (`finished`) after it. A window is filled only when no write is in flight in
//! its bucket (`finished` read before `started`, equal), and is tagged with
//! `started`; it serves a read only while `started` still equals its tag, so no
//! write has begun there since. The record asked for is live (the caller's contract:
//! no read of a slot that is freed), so it was written before the window was read.
//! The caller checks every record's checksum as always.
//!
//! A window's life (`state`): EMPTY -a read claims-> BUSY -filled-> READY -a read
//! claims-> TAKEN -copied-> READY; a READY one is claimed back for a new window
//! (oldest first). Only the thread that moved a window to BUSY or TAKEN touches its
//! buffer. Everything here is atomics, pread and copies into buffers made when the
//! file was opened: safe on the fault path (the SIGBUS handler, the reader).
//!
//! A loom model checks the generations (`RUSTFLAGS="--cfg loom" cargo test -p
//! uzswap-backing --lib --release loom`).

use crate::io::AlignedBuf;
#[cfg(all(test, loom))]
use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicU32, AtomicU64, AtomicUsize},
};
use std::sync::atomic::Ordering::*;
#[cfg(not(all(test, loom)))]
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};

/// std's UnsafeCell with loom's interface.
#[cfg(not(all(test, loom)))]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(all(test, loom)))]
impl<T> UnsafeCell<T> {
    fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Bytes read at once for a pass.
#[cfg(not(all(test, loom)))]
const WINDOW: usize = 256 << 10;
#[cfg(all(test, loom))]
const WINDOW: usize = 4 * crate::BLOCK_SIZE;
/// Windows kept (several passes, or the clusters of several record sizes, in turn).
#[cfg(not(all(test, loom)))]
const WINDOWS: usize = 4;
#[cfg(all(test, loom))]
const WINDOWS: usize = 2;
/// A read starting this far after the end of a recent one continues a pass.
const GAP: u64 = 64 << 10;
/// Recent read ends remembered.
const RECENT: usize = 4;
#[cfg(not(all(test, loom)))]
const BUCKETS: usize = 256;
#[cfg(all(test, loom))]
const BUCKETS: usize = 2;

const EMPTY: u32 = 0;
const BUSY: u32 = 1;
const READY: u32 = 2;
const TAKEN: u32 = 3;

struct Window {
    state: AtomicU32,
    start: AtomicU64,
    len: AtomicU64,
    /// Its bucket's `started` count when it was read.
    tag: AtomicU64,
    /// When it was filled (a count): the oldest is reused first.
    filled: AtomicU64,
    buf: UnsafeCell<AlignedBuf>,
}

pub(crate) struct ReadAround {
    windows: [Window; WINDOWS],
    started: [AtomicU64; BUCKETS],
    finished: [AtomicU64; BUCKETS],
    cluster: u64,
    recent: [AtomicU64; RECENT],
    next_recent: AtomicUsize,
    // Counters (std's atomics even in the loom model: no part of the protocol).
    pub(crate) fills: std::sync::atomic::AtomicU64,
    pub(crate) hits: std::sync::atomic::AtomicU64,
    /// Records that failed their check after a window gave them, read again.
    pub(crate) refetched: std::sync::atomic::AtomicU64,
}

// SAFETY: a window's buffer is touched only by the thread whose exchange moved it to
// BUSY or TAKEN (module comment); everything else is atomics.
unsafe impl Sync for ReadAround {}

impl ReadAround {
    /// Windows for a file of clusters of `cluster` bytes (its buffers made now: none
    /// is made on a read).
    pub(crate) fn new(cluster: u64) -> ReadAround {
        ReadAround {
            windows: std::array::from_fn(|_| Window {
                state: AtomicU32::new(EMPTY),
                start: AtomicU64::new(0),
                len: AtomicU64::new(0),
                tag: AtomicU64::new(0),
                filled: AtomicU64::new(0),
                buf: UnsafeCell::new(AlignedBuf::zeroed(WINDOW)),
            }),
            started: std::array::from_fn(|_| AtomicU64::new(0)),
            finished: std::array::from_fn(|_| AtomicU64::new(0)),
            cluster: cluster.max(1),
            recent: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            next_recent: AtomicUsize::new(0),
            fills: Default::default(),
            hits: Default::default(),
            refetched: Default::default(),
        }
    }

    fn buckets(&self, offset: u64, len: u64) -> impl Iterator<Item = usize> {
        let (first, last) = (offset / self.cluster, (offset + len.max(1) - 1) / self.cluster);
        // More clusters than buckets: each bucket once is enough.
        (first..=last.min(first + BUCKETS as u64 - 1)).map(|c| (c % BUCKETS as u64) as usize)
    }

    /// Before a write of `[offset, offset + len)`; [`ReadAround::written`] after it,
    /// whatever its outcome.
    pub(crate) fn writing(&self, offset: u64, len: u64) {
        for b in self.buckets(offset, len) {
            self.started[b].fetch_add(1, SeqCst);
        }
    }

    pub(crate) fn written(&self, offset: u64, len: u64) {
        for b in self.buckets(offset, len) {
            self.finished[b].fetch_add(1, SeqCst);
        }
    }

    /// Reads the `buf.len()` bytes at `offset` (block-aligned) from a window, filling
    /// one first if this read continues a pass. `pread` reads the file. `None`: not
    /// done here (a read at random, no window free, a window that failed); the
    /// caller reads the record itself.
    pub(crate) fn read<E>(&self, offset: u64, buf: &mut [u8], mut pread: impl FnMut(&mut [u8], u64) -> Result<usize, E>) -> Option<()> {
        let len = buf.len() as u64;
        let sequential = self.recent.iter().any(|r| {
            let end = r.load(Relaxed);
            end != u64::MAX && offset >= end && offset - end < GAP
        });
        let slot = self.next_recent.fetch_add(1, Relaxed) % RECENT;
        self.recent[slot].store(offset + len, Relaxed);
        if self.serve(offset, buf) {
            self.hits.fetch_add(1, Relaxed);
            return Some(());
        }
        if !sequential {
            return None;
        }
        let cluster_end = (offset / self.cluster + 1) * self.cluster;
        let want = (cluster_end - offset).min(WINDOW as u64);
        if want < len {
            return None;
        }
        let bucket = (offset / self.cluster % BUCKETS as u64) as usize;
        let w = self.claim()?;
        let done = self.finished[bucket].load(SeqCst);
        let tag = self.started[bucket].load(SeqCst);
        // SAFETY: BUSY is ours alone (module comment).
        let got = w.buf.with_mut(|p| unsafe {
            let wbuf = &mut *p;
            let mut got = 0usize;
            while (got as u64) < want {
                match pread(&mut wbuf[got..want as usize], offset + got as u64) {
                    // Whole blocks only (O_DIRECT); none at all: the end of the file.
                    Ok(n) if n >= crate::BLOCK_SIZE => got += n - n % crate::BLOCK_SIZE,
                    _ => break,
                }
            }
            if got as u64 >= len {
                buf.copy_from_slice(&wbuf[..len as usize]);
            }
            got
        });
        if (got as u64) < len {
            w.state.store(EMPTY, Release);
            return None;
        }
        // Kept only if no write was in flight when it was read, nor began while it was.
        if done == tag && self.started[bucket].load(SeqCst) == tag {
            w.start.store(offset, Relaxed);
            w.len.store(got as u64, Relaxed);
            w.tag.store(tag, Relaxed);
            w.filled.store(self.fills.fetch_add(1, Relaxed) + 1, Relaxed);
            w.state.store(READY, Release);
        } else {
            w.state.store(EMPTY, Release);
        }
        Some(())
    }

    /// Copies `[offset, offset + buf.len())` from a window that holds it and is
    /// still current; false if none does.
    fn serve(&self, offset: u64, buf: &mut [u8]) -> bool {
        let len = buf.len() as u64;
        let holds = |w: &Window| {
            let start = w.start.load(Relaxed);
            offset >= start && offset + len <= start + w.len.load(Relaxed)
        };
        for w in &self.windows {
            if w.state.load(Acquire) != READY || !holds(w) {
                continue;
            }
            if w.state.compare_exchange(READY, TAKEN, Acquire, Relaxed).is_err() {
                continue;
            }
            // Refilled between the look and the exchange: look again, now it is ours.
            let bucket = (w.start.load(Relaxed) / self.cluster % BUCKETS as u64) as usize;
            if !holds(w) || self.started[bucket].load(SeqCst) != w.tag.load(Relaxed) {
                // A write began in its clusters since: its bytes may be stale.
                w.state.store(EMPTY, Release);
                continue;
            }
            let at = (offset - w.start.load(Relaxed)) as usize;
            // SAFETY: TAKEN is ours alone (module comment).
            w.buf.with(|p| {
                let wbuf: &AlignedBuf = unsafe { &*p };
                buf.copy_from_slice(&wbuf[at..at + len as usize]);
            });
            w.state.store(READY, Release);
            return true;
        }
        false
    }

    /// Drops every window that holds a byte of `[offset, offset + len)`: one that gave
    /// a record failing its check. One in use elsewhere is left to its user.
    pub(crate) fn forget(&self, offset: u64, len: u64) {
        for w in &self.windows {
            let start = w.start.load(Relaxed);
            let overlaps = offset < start + w.len.load(Relaxed) && start < offset + len;
            if overlaps && w.state.compare_exchange(READY, BUSY, Acquire, Relaxed).is_ok() {
                w.state.store(EMPTY, Release);
            }
        }
    }

    /// An EMPTY window, or else the oldest READY one, moved to BUSY.
    fn claim(&self) -> Option<&Window> {
        for w in &self.windows {
            if w.state.compare_exchange(EMPTY, BUSY, Acquire, Relaxed).is_ok() {
                return Some(w);
            }
        }
        let mut order: [usize; WINDOWS] = std::array::from_fn(|i| i);
        order.sort_unstable_by_key(|&i| self.windows[i].filled.load(Relaxed));
        order.iter().map(|&i| &self.windows[i]).find(|w| w.state.compare_exchange(READY, BUSY, Acquire, Relaxed).is_ok())
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Three blocks of a file, each holding one number. A pass reads block 0, then
    //! block 1: that read fills a window over blocks 1 and 2. Meanwhile a writer
    //! writes block 2 anew (its record freed and the space reused). Once the writer
    //! is done, the reader reads block 2 and must get the new number, however the
    //! window's read and the write interleave.
    use super::*;
    use crate::BLOCK_SIZE as B;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;

    struct World {
        around: ReadAround,
        disk: [AtomicU64; 3],
        rewritten: AtomicBool,
    }

    impl World {
        /// pread: whole blocks from `at`, as many as `buf` holds and the file has.
        fn pread(&self, buf: &mut [u8], at: u64) -> Result<usize, ()> {
            let first = at as usize / B;
            let n = (buf.len() / B).min(3usize.saturating_sub(first));
            for i in 0..n {
                buf[i * B..i * B + 8].copy_from_slice(&self.disk[first + i].load(SeqCst).to_le_bytes());
            }
            Ok(n * B)
        }

        /// Reads block `i` as the backing file does: a window if it may, else the file.
        fn read(&self, i: usize) -> u64 {
            let mut buf = vec![0u8; B];
            if self.around.read((i * B) as u64, &mut buf, |b, at| self.pread(b, at)).is_none() {
                self.pread(&mut buf, (i * B) as u64).unwrap();
            }
            u64::from_le_bytes(buf[..8].try_into().unwrap())
        }
    }

    #[test]
    fn a_window_never_gives_space_written_since() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            let world = Arc::new(World {
                around: ReadAround::new(1 << 20),
                disk: [AtomicU64::new(10), AtomicU64::new(11), AtomicU64::new(12)],
                rewritten: AtomicBool::new(false),
            });
            let writer = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.around.writing(2 * B as u64, B as u64);
                    world.disk[2].store(22, SeqCst);
                    world.around.written(2 * B as u64, B as u64);
                    world.rewritten.store(true, SeqCst);
                })
            };
            assert_eq!(world.read(0), 10);
            assert_eq!(world.read(1), 11);
            while !world.rewritten.load(SeqCst) {
                loom::thread::yield_now();
            }
            assert_eq!(world.read(2), 22, "a window gave space written since it was read");
            writer.join().unwrap();
        });
    }
}
