//! Counters with the kernel's names (vmstat `zswpout`, debugfs `stored_pages`, ...),
//! in total and per folio size, as `/sys/kernel/mm/transparent_hugepage/hugepages-*kB/stats`
//! keeps them. Totals count 4 KiB pages, as vmstat does; per-size counters count folios.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Defines a struct of atomics and its plain snapshot with the same field names.
macro_rules! counters {
    ($live:ident => $snap:ident { $($(#[$doc:meta])* $field:ident,)* }) => {
        #[derive(Default)]
        pub(crate) struct $live { $(pub(crate) $field: AtomicU64,)* }

        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct $snap { $($(#[$doc])* pub $field: u64,)* }

        impl $live {
            pub(crate) fn snapshot(&self) -> $snap {
                $snap { $($field: self.$field.load(Relaxed),)* }
            }
        }
    };
}

counters!(LiveTotals => Totals {
    /// Pages stored (cumulative).
    zswpout,
    /// Pages loaded back (cumulative).
    zswpin,
    /// Pages written back to the backing file (cumulative).
    zswpwb,
    /// Pages written to the backing file (cumulative).
    pswpout,
    /// Pages read back from the backing file (cumulative).
    pswpin,
    /// Pages held now in memory: in the pool or as same-filled markers (not those
    /// written back).
    stored_pages,
    /// Pages held now whose units are kept raw because they did not compress.
    stored_incompressible_pages,
    /// Pages held now as a same-filled marker, with no pool memory.
    same_filled_pages,
    /// Pages held now in the backing file.
    backing_pages,
    /// Pages written back (cumulative; debugfs name for zswpwb).
    written_back_pages,
    /// Stores refused because compression failed or verify-after-compress mismatched.
    reject_compress_fail,
    /// Stores refused because the folio did not compress and raw storage is off.
    reject_compress_poor,
    /// Stores refused because the pool could not allocate.
    reject_alloc_fail,
    /// Writebacks that failed (the entry stayed in the pool).
    reject_reclaim_fail,
    /// Loads whose data failed to decode or verify.
    decompress_fail,
    /// Stores refused because the pool was over its limit.
    pool_limit_hit,
    /// Pages of cold records cut small that were cut whole again to make room
    /// (cumulative; the store's recut, as zram's recompression of idle pages).
    recut_pages,
    /// Compactions of the pool (cumulative).
    compactions,
    /// Bytes of pool memory compaction gave back (cumulative; zsmalloc counts
    /// `pages_compacted`).
    compacted_bytes,
});

counters!(LiveSizeCounters => SizeCounters {
    /// Folios stored (cumulative).
    zswpout,
    /// Folios loaded back (cumulative).
    zswpin,
    /// Folios written back (cumulative).
    zswpwb,
    /// Folios read back from the backing file (cumulative).
    pswpin,
    /// Folios held now, in memory or in the backing file.
    stored,
});

/// Folio sizes from 4 KiB (order 0) to 2 MiB (order 9).
pub const ORDERS: usize = 10;
pub const PAGE_SIZE: usize = 4096;

#[derive(Default)]
pub(crate) struct LiveStats {
    pub(crate) totals: LiveTotals,
    pub(crate) per_order: [LiveSizeCounters; ORDERS],
    /// Bytes of encoded folios held in the pool now.
    pub(crate) compressed_bytes: AtomicU64,
}

impl LiveStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        counter.fetch_sub(n, Relaxed);
    }
}

/// One folio size's counters.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct SizeStats {
    pub folio_bytes: u64,
    #[serde(flatten)]
    pub counters: SizeCounters,
}

/// A snapshot of the store's counters. Deserialized (from a runtime's stats file),
/// a missing field reads as its default.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Stats {
    #[serde(flatten)]
    pub totals: Totals,
    /// Bytes of memory the store holds: pool memory plus entry metadata.
    pub pool_total_size: u64,
    /// Bytes of encoded folio data held in the pool.
    pub compressed_bytes: u64,
    /// Folio sizes that have been used, smallest first.
    pub per_size: Vec<SizeStats>,
}

impl Stats {
    /// Original bytes per byte of memory held, for what is in memory now (1.0 if empty).
    pub fn compression_ratio(&self) -> f64 {
        let held = (self.totals.stored_pages * PAGE_SIZE as u64) as f64;
        if self.pool_total_size == 0 { 1.0 } else { held / self.pool_total_size as f64 }
    }
}

impl LiveStats {
    pub(crate) fn snapshot(&self, pool_total_size: u64) -> Stats {
        let per_size = self
            .per_order
            .iter()
            .enumerate()
            .map(|(order, c)| SizeStats { folio_bytes: (PAGE_SIZE << order) as u64, counters: c.snapshot() })
            .filter(|s| s.counters != SizeCounters::default())
            .collect();
        Stats {
            totals: self.totals.snapshot(),
            pool_total_size,
            compressed_bytes: self.compressed_bytes.load(Relaxed),
            per_size,
        }
    }
}
