//! The tier trait: what the store needs from wherever its coldest folios go.
//!
//! [`crate::BackingFile`] (a private local file) is one tier; a remote store (the
//! `uzswap-remote` crate) is another, and a remote tier with a file behind it for
//! when the remote one cannot take a batch is a third. The store holds a
//! `Box<dyn Tier>` and knows nothing of which.
//!
//! A tier keeps *records* (a key and its bytes) and hands back a [`Slot`] for each:
//! where the record is (a file offset, a remote object's number) and the checksum
//! that proves it on the way back. The slot's offset is the tier's to choose; a
//! tier that wraps two others marks which one holds a record in the offset's top bit.
//!
//! Two calls run on a signal handler's path and must allocate nothing, take no lock
//! the interrupted code may hold, and wait for no other thread without bound:
//! [`Tier::read_in_place`] and [`Tier::free_deferred`]. Their errors hold no heap
//! memory.

use crate::{BackingError, BackingFile, BackingStats, Record, Slot};
use std::os::fd::RawFd;

/// Where the store writes back to. All methods take `&self`; a tier is shared.
pub trait Tier: Send + Sync {
    /// Writes a batch of records; all of them or none (on error nothing is kept,
    /// so the caller keeps its copies). One slot per record, in order.
    fn write_batch(&self, records: &[Record<'_>]) -> Result<Vec<Slot>, BackingError>;

    /// Reads and verifies the record of `slot` into the front of `buf` (block-aligned,
    /// at least [`Slot::disk_len`] long; the rest is scratch). Signal-safe. On error
    /// the record's bytes in `buf` are zeroed, never left wrong.
    fn read_in_place(&self, slot: &Slot, buf: &mut [u8]) -> Result<(), BackingError>;

    /// Frees `slot` now. Not for a signal handler.
    fn free(&self, slot: Slot) -> Result<(), BackingError>;

    /// Frees `slot` at the next [`Tier::reap`]. Signal-safe: allocates nothing.
    fn free_deferred(&self, slot: Slot) -> Result<(), BackingError>;

    /// Does the frees queued by `free_deferred`; returns how many.
    fn reap(&self) -> Result<usize, BackingError>;

    /// Marks a loan to a forked child (the store's `lend`): the child may read every
    /// record live now. Returns the mark for [`Tier::reap_keeping`]. A tier that does
    /// not tell records written before and after apart returns 1 and keeps every
    /// queued free while any loan is out.
    fn mark_lend(&self) -> u32 {
        1
    }

    /// As [`Tier::reap`], keeping the queued frees of records a child holding loan
    /// mark `before`, or an earlier one, may read (0: no loan is out).
    fn reap_keeping(&self, before: u32) -> Result<usize, BackingError> {
        if before == 0 {
            self.reap()
        } else {
            Ok(0)
        }
    }

    /// Makes what was written durable, as far as the tier can.
    fn flush(&self) -> Result<(), BackingError>;

    /// The counters of the local file (for a remote tier, of its fallback file, if any).
    fn stats(&self) -> BackingStats;

    /// The tier's counters as `(name, value)` pairs beyond [`BackingStats`] (a
    /// remote tier's round trips, fallbacks, latency); none for a file.
    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Whether a forked child can read `slot` through its copy of this tier while the
    /// parent keeps it (fork without swap-in, see the store's `carry`): a file record
    /// can (the descriptor is inherited); a tier served by threads of its own cannot.
    fn survives_fork(&self, _slot: &Slot) -> bool {
        true
    }

    /// The local file's descriptor, if there is one.
    fn raw_fd(&self) -> Option<RawFd>;

    /// One line saying what the tier is, for summaries ("file in /var/tmp", "redis at ...").
    fn describe(&self) -> String;
}

impl Tier for BackingFile {
    fn write_batch(&self, records: &[Record<'_>]) -> Result<Vec<Slot>, BackingError> {
        BackingFile::write_batch(self, records)
    }
    fn read_in_place(&self, slot: &Slot, buf: &mut [u8]) -> Result<(), BackingError> {
        BackingFile::read_in_place(self, slot, buf)
    }
    fn free(&self, slot: Slot) -> Result<(), BackingError> {
        BackingFile::free(self, slot)
    }
    fn free_deferred(&self, slot: Slot) -> Result<(), BackingError> {
        BackingFile::free_deferred(self, slot)
    }
    fn reap(&self) -> Result<usize, BackingError> {
        BackingFile::reap(self)
    }
    fn mark_lend(&self) -> u32 {
        BackingFile::mark_lend(self)
    }
    fn reap_keeping(&self, before: u32) -> Result<usize, BackingError> {
        BackingFile::reap_keeping(self, before)
    }
    fn flush(&self) -> Result<(), BackingError> {
        BackingFile::flush(self)
    }
    fn stats(&self) -> BackingStats {
        BackingFile::stats(self)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        BackingFile::raw_fd(self)
    }
    fn describe(&self) -> String {
        format!("a private file of up to {} MiB", self.capacity_bytes() >> 20)
    }
}
