//! Failure injection: hooks on the store's own failure paths, so that the runtime's
//! tests can see what a failed compression or a pool that cannot allocate does to a
//! program's memory. Off (no [`StoreFaults`] in the config) they cost one branch on
//! a `None`; on, a relaxed atomic per store. Lock-free, so safe from the paths a
//! signal handler runs.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How many of the coming operations of each kind fail (`u64::MAX`: all of them).
/// Share it through `Arc` between the config and the test.
#[derive(Debug, Default)]
pub struct StoreFaults {
    compress: AtomicU64,
    alloc: AtomicU64,
    injected: AtomicU64,
}

/// Fail every operation of the kind from now on.
pub const ALWAYS: u64 = u64::MAX;

impl StoreFaults {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next `n` compressions fail as a broken compressor would (counted as
    /// `reject_compress_fail`); replaces what was left of an earlier count.
    pub fn fail_compressions(&self, n: u64) {
        self.compress.store(n, Relaxed);
    }

    /// The next `n` pool allocations fail as an exhausted pool would (counted as
    /// `reject_alloc_fail`).
    pub fn fail_allocations(&self, n: u64) {
        self.alloc.store(n, Relaxed);
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Relaxed)
    }

    pub(crate) fn compression_fails(&self) -> bool {
        self.take(&self.compress)
    }

    pub(crate) fn allocation_fails(&self) -> bool {
        self.take(&self.alloc)
    }

    fn take(&self, left: &AtomicU64) -> bool {
        let hit = left
            .fetch_update(Relaxed, Relaxed, |n| match n {
                0 => None,
                ALWAYS => Some(ALWAYS),
                n => Some(n - 1),
            })
            .is_ok();
        if hit {
            self.injected.fetch_add(1, Relaxed);
        }
        hit
    }
}
