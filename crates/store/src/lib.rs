//! uzswap-store: our zswap — keeps whole folios compressed in memory.
//!
//! # What it is for, and what it is not
//! The store takes a folio (4 KiB to 2 MiB of bytes) under a key and gives it back,
//! bit for bit, on a later load. It is the part every other part stands on, and it
//! knows nothing of userfaultfd, mappings or budgets: the runtime decides what to
//! store and when; the store decides how to keep it small.
//!
//! # Structures
//! - **Codec contexts** (`uzswap-compress`): a small stack of [`FolioCodec`]s with
//!   their encode buffers, taken for one operation and given back — zswap's per-CPU
//!   acomp contexts, without pinning to a CPU.
//! - **Pool** (`uzswap-pool`, our zsmalloc): holds the encoded folios; an entry keeps
//!   a pool handle that stays valid across compaction.
//! - **Index** (`uzswap-index`, our xarray): key -> [`Entry`]; lookups take no lock.
//! - **LRU** ([`lru`]): pool entries in store order, raw ones included, under one mutex.
//! - **Stats** ([`stats`]): kernel-named counters, in total and per folio size.
//!
//! An entry is either a same-filled marker (no pool memory: the folio is one repeated
//! 8-byte word) or an encoded folio in the pool.
//!
//! # Life cycle and locking
//! - store: encode with a codec context, copy into the pool, link on the LRU (pool
//!   entries only), then publish in the index. An older entry under the key is
//!   invalidated first.
//! - load: look up (no lock), decode into the caller's buffer, and only when that
//!   succeeded erase the entry and free its memory (exclusive load, as zswap does; a
//!   failed decode leaves the entry in place and counts `decompress_fail`).
//! - invalidate: erase from the index, unlink from the LRU, free the pool object.
//!
//! The caller guarantees what zswap gets from the folio lock: operations on the same
//! key never overlap. Operations on different keys run in parallel; they meet only on
//! the codec stack's and the LRU's short critical sections and inside the pool.

pub mod lru;
pub mod stats;

use lru::Lru;
use parking_lot::Mutex;
use stats::{LiveStats, PAGE_SIZE};
use uzswap_compress::{Encoded, FolioCodec};
use uzswap_index::Index;
use uzswap_pool::{Handle, Pool};

pub use stats::{SizeCounters, SizeStats, Stats, Totals};
pub use uzswap_compress::{Algorithm, CodecConfig, Granularity};

/// Largest folio the store keeps.
pub const MAX_FOLIO: usize = 2 * 1024 * 1024;

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub codec: CodecConfig,
    /// Keep folios that do not compress, raw (seed 001), so they still leave through
    /// writeback in LRU order. If false such folios are rejected.
    pub store_incompressible: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            codec: CodecConfig {
                algorithm: Algorithm::Lz4,
                level: 0,
                granularity: Granularity::Folio,
                raw_threshold_percent: 90,
                verify: false,
            },
            store_incompressible: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Codec(#[from] uzswap_compress::Error),
    #[error(transparent)]
    Pool(#[from] uzswap_pool::PoolError),
    #[error("folio of {0} bytes: must be a power of two from 4 KiB to 2 MiB")]
    FolioSize(usize),
    #[error("entry {key:#x} holds a folio of {stored} bytes, not {asked}")]
    SizeMismatch { key: u64, stored: usize, asked: usize },
    #[error("folio does not compress and store_incompressible is off")]
    Incompressible,
}

/// Where a stored folio's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Location {
    /// Every 8-byte word of the folio is `word`.
    SameFilled { word: u64 },
    /// Encoded in the pool; `lru` is the entry's LRU node.
    Pool { handle: Handle, len: u32, lru: u32 },
}

/// What the index holds per key: small and `Copy`, so a lookup is a plain load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    location: Location,
    /// Folio size is `PAGE_SIZE << order`.
    order: u8,
    /// Pages of the folio whose units are kept raw.
    raw_pages: u16,
}

impl Entry {
    fn folio_len(&self) -> usize {
        PAGE_SIZE << self.order
    }
    fn pages(&self) -> u64 {
        1 << self.order
    }
}

/// A codec with the buffer it encodes into.
struct CodecContext {
    codec: FolioCodec,
    buf: Vec<u8>,
}

pub struct Store {
    cfg: StoreConfig,
    contexts: Mutex<Vec<CodecContext>>,
    pool: Pool,
    index: Index<Entry>,
    lru: Mutex<Lru>,
    stats: LiveStats,
}

fn order_of(folio_len: usize) -> Result<u8, StoreError> {
    if folio_len.is_power_of_two() && (PAGE_SIZE..=MAX_FOLIO).contains(&folio_len) {
        Ok((folio_len / PAGE_SIZE).trailing_zeros() as u8)
    } else {
        Err(StoreError::FolioSize(folio_len))
    }
}

impl Store {
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> {
        // Build one context now so a bad codec configuration fails here, not on first store.
        let first = Self::new_context(&cfg)?;
        Ok(Store {
            cfg,
            contexts: Mutex::new(vec![first]),
            pool: Pool::new(),
            index: Index::new(),
            lru: Mutex::new(Lru::default()),
            stats: LiveStats::default(),
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    fn new_context(cfg: &StoreConfig) -> Result<CodecContext, StoreError> {
        let codec = FolioCodec::new(&cfg.codec)?;
        let buf = vec![0u8; codec.max_encoded_len(MAX_FOLIO)];
        Ok(CodecContext { codec, buf })
    }

    /// Runs `f` with a codec context taken from the stack (a new one if all are busy).
    fn with_context<R>(&self, f: impl FnOnce(&mut CodecContext) -> R) -> Result<R, StoreError> {
        let taken = self.contexts.lock().pop();
        let mut ctx = match taken {
            Some(ctx) => ctx,
            None => Self::new_context(&self.cfg)?,
        };
        let r = f(&mut ctx);
        self.contexts.lock().push(ctx);
        Ok(r)
    }

    /// Compresses `folio` and keeps it under `key`, replacing any older entry.
    pub fn store(&self, key: u64, folio: &[u8]) -> Result<(), StoreError> {
        let order = order_of(folio.len())?;
        self.invalidate(key);
        let totals = &self.stats.totals;
        let entry = self.with_context(|ctx| -> Result<Entry, StoreError> {
            let encoded = ctx.codec.encode(folio, &mut ctx.buf).inspect_err(|_| {
                LiveStats::add(&totals.reject_compress_fail, 1);
            })?;
            match encoded {
                Encoded::SameFilled { word } => {
                    Ok(Entry { location: Location::SameFilled { word }, order, raw_pages: 0 })
                }
                Encoded::Stored { len, units, raw_units, .. } => {
                    if raw_units == units && !self.cfg.store_incompressible {
                        LiveStats::add(&totals.reject_compress_poor, 1);
                        return Err(StoreError::Incompressible);
                    }
                    let handle = self.pool.store(&ctx.buf[..len]).inspect_err(|_| {
                        LiveStats::add(&totals.reject_alloc_fail, 1);
                    })?;
                    let raw_pages = (raw_units as usize * (folio.len() / units as usize) / PAGE_SIZE) as u16;
                    let lru = self.lru.lock().push(key);
                    Ok(Entry { location: Location::Pool { handle, len: len as u32, lru }, order, raw_pages })
                }
            }
        })??;
        self.account(&entry, 1);
        LiveStats::add(&totals.zswpout, entry.pages());
        LiveStats::add(&self.stats.per_order[order as usize].zswpout, 1);
        let old = self.index.insert(key, entry);
        debug_assert!(old.is_none(), "a store raced with another operation on key {key:#x}");
        Ok(())
    }

    /// Adds (`sign` = 1) or removes (`sign` = -1) an entry from the gauges.
    fn account(&self, e: &Entry, sign: i8) {
        let t = &self.stats.totals;
        let op = if sign > 0 { LiveStats::add } else { LiveStats::sub };
        op(&t.stored_pages, e.pages());
        op(&t.stored_incompressible_pages, e.raw_pages as u64);
        op(&self.stats.per_order[e.order as usize].stored, 1);
        match e.location {
            Location::SameFilled { .. } => op(&t.same_filled_pages, e.pages()),
            Location::Pool { len, .. } => op(&self.stats.compressed_bytes, len as u64),
        }
    }

    /// Exclusive load: decodes the folio under `key` into `folio` and frees the entry.
    /// `Ok(false)` if there is none. On a decode error the entry stays.
    pub fn load(&self, key: u64, folio: &mut [u8]) -> Result<bool, StoreError> {
        let Some(entry) = self.index.get(key) else { return Ok(false) };
        if entry.folio_len() != folio.len() {
            return Err(StoreError::SizeMismatch { key, stored: entry.folio_len(), asked: folio.len() });
        }
        self.decode(&entry, 0, folio)?;
        self.index.remove(key);
        self.release(&entry);
        LiveStats::add(&self.stats.totals.zswpin, entry.pages());
        LiveStats::add(&self.stats.per_order[entry.order as usize].zswpin, 1);
        Ok(true)
    }

    /// Non-exclusive partial read: decodes only the units that cover
    /// `[offset, offset + out.len())` of the folio under `key`; the entry stays.
    pub fn read_range(&self, key: u64, offset: usize, out: &mut [u8]) -> Result<bool, StoreError> {
        let Some(entry) = self.index.get(key) else { return Ok(false) };
        if offset.checked_add(out.len()).is_none_or(|end| end > entry.folio_len()) {
            return Err(StoreError::SizeMismatch { key, stored: entry.folio_len(), asked: offset + out.len() });
        }
        self.decode(&entry, offset, out)?;
        Ok(true)
    }

    fn decode(&self, entry: &Entry, offset: usize, out: &mut [u8]) -> Result<(), StoreError> {
        match entry.location {
            Location::SameFilled { word } => {
                // Same-filled words repeat every 8 bytes, so an offset shifts the pattern.
                let word = word.rotate_right(8 * (offset % 8) as u32);
                uzswap_compress::fill_same(out, word);
                Ok(())
            }
            Location::Pool { handle, .. } => self
                .with_context(|ctx| {
                    self.pool.read(handle, |bytes| {
                        if offset == 0 && out.len() == entry.folio_len() {
                            ctx.codec.decode(bytes, out)
                        } else {
                            ctx.codec.decode_range(bytes, offset, out)
                        }
                    })
                })?
                .map_err(|e| {
                    LiveStats::add(&self.stats.totals.decompress_fail, 1);
                    e.into()
                }),
        }
    }

    /// Frees what an entry already erased from the index held.
    fn release(&self, entry: &Entry) {
        if let Location::Pool { handle, lru, .. } = entry.location {
            self.lru.lock().remove(lru);
            self.pool.free(handle);
        }
        self.account(entry, -1);
    }

    /// Drops the entry under `key`, if any.
    pub fn invalidate(&self, key: u64) -> bool {
        match self.index.remove(key) {
            Some(entry) => {
                self.release(&entry);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, key: u64) -> bool {
        self.index.with(key, |_| ()).is_some()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of memory the store holds: the pool's memory plus entry metadata (index
    /// and LRU). This is what a budget charges for the store, as a memory cgroup
    /// charges zswap's pool.
    pub fn pool_total_size(&self) -> u64 {
        self.pool.total_size() + self.metadata_bytes()
    }

    /// Bytes of entry metadata: the index and the LRU.
    pub fn metadata_bytes(&self) -> u64 {
        (self.index.memory_bytes() + self.lru.lock().memory_bytes()) as u64
    }

    /// Bytes of memory the pool alone holds (zsmalloc's pages).
    pub fn pool_bytes(&self) -> u64 {
        self.pool.total_size()
    }

    /// Moves pool objects out of sparse spans and returns empty ones to the system.
    pub fn compact(&self) -> uzswap_pool::CompactStats {
        self.pool.compact()
    }

    pub fn stats(&self) -> Stats {
        self.stats.snapshot(self.pool_total_size())
    }

    /// Entries on the LRU (pool entries; same-filled markers hold no pool memory).
    pub fn lru_len(&self) -> usize {
        self.lru.lock().len()
    }

    /// The key of the coldest pool entry, if any.
    pub fn coldest(&self) -> Option<u64> {
        self.lru.lock().coldest().map(|(_, k)| k)
    }
}
