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
//!   acomp contexts, without pinning to a CPU. Loads first use a separate set made
//!   by [`Store::reserve_contexts`], which is never grown or waited for.
//! - **Pool** (`uzswap-pool`, our zsmalloc): holds the encoded folios; an entry keeps
//!   a pool handle that stays valid across compaction.
//! - **Index** (`uzswap-index`, our xarray): key -> `Entry`; lookups take no lock.
//! - **LRU** ([`lru`]): pool entries in store order, raw ones included, under one mutex.
//! - **Stats** ([`stats`]): kernel-named counters, in total and per folio size.
//!
//! An entry is a same-filled marker (no memory: the folio is one repeated 8-byte
//! word), an encoded folio in the pool, or an encoded folio written back to the
//! backing file (`uzswap-backing`), which keeps the record's checksum in its slot.
//! A folio none of whose units shrank is kept as its own bytes (as zswap keeps an
//! incompressible page): no header, an exact size class, a memcpy to load.
//!
//! # Life cycle and locking
//! - store: encode with a codec context, copy into the pool, link on the LRU (pool
//!   entries only), then publish in the index. An older entry under the key is
//!   invalidated first.
//! - load: claim the entry (take its LRU node, so writeback leaves it alone), decode
//!   into the caller's buffer, and only when that succeeded erase the entry (exclusive
//!   load, as zswap does; a failed decode leaves the entry in place and counts
//!   `decompress_fail`). `read_range` decodes without erasing, and `commit_load`
//!   erases later, for a caller that must place the bytes first. A lookup that only
//!   asks whether a key is there (`contains`) takes no lock.
//! - invalidate: claim and erase.
//! - erase does not free: it *buries* the pool object's LRU node (the node keeps the
//!   handle) and queues a file slot with [`Tier::free_deferred`]; [`Store::reap`]
//!   frees both. Every store, writeback and compaction reaps first.
//! - writeback (zswap's shrink worker): when the pool passes `max_pool_bytes`, take
//!   the coldest LRU nodes, copy their objects into one buffer, write them to the
//!   backing file as one batch (large sequential writes), and only when that
//!   succeeded swap each index entry to its file slot and free the pool object. A
//!   failed write puts the nodes back where they were and counts
//!   `reject_reclaim_fail`: nothing is lost. After the limit is hit, the pool is
//!   written back down to `accept_threshold_percent` of it before the next store
//!   goes in, so it does not thrash at the edge.
//! - cut: a store is cut into units as the caller asks ([`Store::store_cut`]: small
//!   units for a folio read a page at a time, one for a folio read whole); the entry
//!   knows its cut ([`Store::unit_len`]). Before writing back, cold records cut small
//!   are cut whole again, in the pool (recut.rs, as zram recompresses idle pages):
//!   writeback's hand-over, with the pool as the destination.
//!
//! Who may free a pool object: whoever *holds* its LRU node (see [`lru`]). A load or
//! invalidate takes the node before it touches the object; writeback takes the nodes
//! of a batch. A load never waits for writeback: one that finds its node held by
//! writeback joins it (`WritebackPinned`) and reads the object alongside, which stays
//! valid because writeback now leaves it to the load — the last one out frees it:
//! - writeback done first: it publishes the file entry and hands the node over
//!   (`Orphan`); the load buries it when done (and, if it was erasing, erases the
//!   file entry too);
//! - the load erases first: it removes the index entry (`WritebackErased`); writeback
//!   then frees the object and the slot it wrote, and publishes nothing;
//! - the write failed: the load now holds the node alone (`Loader`).
//!
//! All of these transitions happen under the LRU lock, as do all changes to index
//! entries of pool objects, so a node id read from the index under that lock is the
//! entry's own.
//!
//! # On a signal handler's path
//! The runtime's SIGBUS handler runs `load`, `read_range`, `commit_load` and
//! `invalidate` on a program thread interrupted anywhere, in its own malloc included.
//! These allocate nothing, free nothing, park nowhere and never wait on another
//! thread without bound. What they use, and why each is safe:
//! - the index's lookups and removals: atomics only, removals retire without memory
//!   and free nothing (`uzswap-index`);
//! - the LRU lock, a futex (`uzswap-sync`: nothing allocated to wait), held for a few
//!   list operations, none of which allocates (taking, putting back and burying nodes);
//! - a reserved load context, popped and pushed under a mutex from a vector whose
//!   capacity was reserved for all of them; with all reserved contexts busy a load
//!   falls back to the general ones, which may allocate or wait, so a caller must
//!   reserve one per load that may run at once on that path;
//! - the pool's `read`: a std rwlock on the object's span, shared (`uzswap-pool`);
//! - the backing file's `read_in_place` into the context's aligned, block-rounded
//!   buffer (no bounce buffer) and `free_deferred` (`uzswap-backing`);
//! - the decoder of the context, whose state exists from the context's creation (a
//!   record is always in the store's own algorithm, made ready with the codec);
//! - relaxed atomic counters, and errors that hold no heap memory.
//!
//! Frees happen in [`Store::reap`], on the next store or writeback.
//!
//! A lock the handler may wait for must never be held by anyone, on any thread, while
//! calling the allocator: the handler's own thread may hold the malloc lock that
//! holder waits for. So nothing under the LRU lock allocates or frees: the LRU slab
//! grows outside it and frees nodes onto an intrusive list; `publish` makes the node
//! under the lock but inserts into the index outside it, and lists the node only
//! then; writeback sizes its buffers and prepares the index's boxes for the file
//! entries ([`Index::prepare`], then the allocation-free `Index::replace` under the
//! lock) before taking it, and frees pool objects after; `reap` frees outside it.
//! The same holds for the load contexts' lock, the backing file's queue and seal
//! table, and the pool's span locks.
//!
//! The caller guarantees what zswap gets from the folio lock: operations on the same
//! key never overlap. Operations on different keys run in parallel; they meet only on
//! the codec stack's and the LRU's short critical sections and inside the pool.

pub mod carry;
pub mod faults;
pub mod lru;
mod recut;
pub mod stats;

use lru::{Holder, Lru};
use uzswap_sync::{Condvar, Freeze, Mutex};
use stats::{LiveStats, PAGE_SIZE};
use uzswap_compress::{max_encoded_len, Encoded, FolioCodec};
use uzswap_index::{Index, Prepared};
use uzswap_backing::{AlignedBuf, Record, Slot, Tier, BLOCK_SIZE};
use uzswap_pool::{Handle, Pool};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

pub use carry::{carry_buffer, decode_carried, Carried};
use carry::{Borrowed, Lent};
pub use faults::StoreFaults;

pub use stats::{SizeCounters, SizeStats, Stats, Totals};
pub use uzswap_compress::{Algorithm, CodecConfig, Granularity};

/// Largest folio the store keeps.
pub const MAX_FOLIO: usize = 2 * 1024 * 1024;

/// The finest cut a folio may be stored with: a page per unit.
pub const SMALLEST_CUT: Granularity = Granularity::Bytes(PAGE_SIZE);

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub codec: CodecConfig,
    /// Keep folios that do not compress, raw (as zswap stores incompressible pages
    /// raw), so they still leave through writeback in LRU order. If false such folios are rejected.
    pub store_incompressible: bool,
    /// The pool's limit in bytes (zswap's `max_pool_percent`, applied by the caller
    /// to its budget); `None` for no limit.
    pub max_pool_bytes: Option<u64>,
    /// Once the limit is hit, write back (or refuse stores) until the pool is below
    /// this share of the limit (zswap's `accept_threshold_percent`).
    pub accept_threshold_percent: u8,
    /// Failure injection for tests ([`faults`]); `None` in production.
    pub faults: Option<Arc<StoreFaults>>,
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
            max_pool_bytes: None,
            accept_threshold_percent: 90,
            faults: None,
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
    #[error(transparent)]
    Backing(#[from] uzswap_backing::BackingError),
    #[error("the pool is at its limit of {limit} bytes and there is no backing file to write back to")]
    PoolLimit { limit: u64 },
    #[error("accept_threshold_percent {0} must be from 1 to 100")]
    AcceptThreshold(u8),
    #[error("injected failure: {0}")]
    Injected(&'static str),
    #[error("a record carried at fork: {0}")]
    Carry(&'static str),
}

/// Where a stored folio's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Location {
    /// Every 8-byte word of the folio is `word`.
    SameFilled { word: u64 },
    /// Encoded in the pool; `lru` is the entry's LRU node.
    Pool { handle: Handle, len: u32, lru: u32 },
    /// Encoded in the backing file: its [`Slot`] without the key, which is the
    /// entry's own (this keeps an index value box in glibc's 48-byte class).
    File { offset: u64, len: u32, crc: u32 },
    /// Encoded in the backing file of the parent this store's process was forked
    /// from, lent for as long as the child lives (carry.rs "Loans"): a slot of that
    /// file under the same key.
    Lent { offset: u64, len: u32, crc: u32 },
    /// Encoded in this process's copy of its parent's pool (carry.rs "Loans"): `len`
    /// bytes at `addr`, copy-on-write memory no one else changes.
    LentPool { addr: u64, len: u32 },
}

/// What the index holds per key: small and `Copy`, so a lookup is a plain load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    location: Location,
    /// Folio size is `PAGE_SIZE << order`.
    order: u8,
    /// Pages of the folio whose units are kept raw.
    raw_pages: u16,
    /// The cut the folio was stored with: units of `PAGE_SIZE << unit_order` bytes,
    /// each decodable alone (a same-filled folio or one kept raw reads in any part as
    /// cheaply, and keeps the cut asked for, so that a caller sizes its reads alike).
    unit_order: u8,
}

// An entry is boxed in the index behind an 8-byte link: 32 + 8 bytes stay in glibc's
// 48-byte chunk class; 40 + 8 would take 64.
const _: () = assert!(std::mem::size_of::<Entry>() <= 32);

impl Entry {
    fn file(slot: Slot, like: &Entry) -> Entry {
        let location = Location::File { offset: slot.offset(), len: slot.data_len() as u32, crc: slot.checksum() };
        Entry { location, ..*like }
    }

    /// The backing file slot of a file entry under `key`.
    fn slot(&self, key: u64) -> Option<Slot> {
        match self.location {
            Location::File { offset, len, crc } => Some(Slot::from_parts(offset, key, len, crc)),
            _ => None,
        }
    }

    /// The slot in the lender's backing file of a lent entry under `key`.
    fn lent_slot(&self, key: u64) -> Option<Slot> {
        match self.location {
            Location::Lent { offset, len, crc } => Some(Slot::from_parts(offset, key, len, crc)),
            _ => None,
        }
    }

    fn folio_len(&self) -> usize {
        PAGE_SIZE << self.order
    }
    fn pages(&self) -> u64 {
        1 << self.order
    }
    fn unit_len(&self) -> usize {
        PAGE_SIZE << self.unit_order
    }
    /// Whether the folio is held as its own bytes, not encoded: nothing in it shrank.
    fn is_kept_raw(&self) -> bool {
        self.raw_pages as u64 == self.pages()
    }
}

/// A codec with the buffer it encodes into (and reads written-back records into:
/// block-aligned and a whole number of blocks, so a read needs no bounce buffer).
struct CodecContext {
    codec: FolioCodec,
    buf: AlignedBuf,
}

/// The idle codec contexts, and how many exist in all.
struct ContextStack {
    free: Vec<CodecContext>,
    made: usize,
}

/// Codec contexts are big (an encode buffer of a largest folio, compressor state):
/// beyond this many, threads wait for one rather than make another.
pub const MAX_CONTEXTS: usize = 64;

pub struct Store {
    cfg: StoreConfig,
    contexts: Mutex<ContextStack>,
    context_returned: Condvar,
    /// Contexts made by `reserve_contexts` for loads: taken and given back under a
    /// mutex, never made or waited for (see the design comment).
    load_contexts: Mutex<Vec<CodecContext>>,
    /// How many load contexts exist; held while `reserve_contexts` makes more.
    load_contexts_made: Mutex<usize>,
    pool: Pool,
    index: Index<Entry>,
    /// Loads on a signal handler's path take it (held briefly, nothing allocated).
    lru: Mutex<Lru>,
    /// The LRU's memory, kept outside its lock so that `pool_total_size` takes none.
    lru_bytes: AtomicU64,
    /// Buried LRU nodes and deferred slot frees since the last `reap`.
    deferred: AtomicU64,
    backing: Option<Box<dyn Tier>>,
    /// One writeback at a time, with its batch buffer.
    writeback: Mutex<Vec<u8>>,
    /// Held by whatever changes where stored bytes are (a pool store, reap,
    /// writeback, compaction), frozen by a fork ([`carry`]). Never held on a signal
    /// handler's path, nor nested.
    moves: Freeze,
    /// The pool's limit now (`max_pool_bytes`, `u64::MAX` for none): a budget may
    /// change while the store is in use ([`Store::set_max_pool_bytes`]).
    pool_limit: AtomicU64,
    /// Set when the pool hit its limit; cleared when it is back under the threshold.
    full: AtomicBool,
    /// In a forked child: the parent's store it borrows records from (carry.rs, "Loans").
    borrowed: std::sync::OnceLock<Borrowed>,
    /// In a parent: the loans its children hold (carry.rs, "Loans").
    lent: Lent,
    stats: LiveStats,
}

/// A writeback batch is written with one call to the backing file.
const WRITEBACK_BATCH_BYTES: usize = 8 << 20;
/// ... and holds at most this many entries (room for them is made before the LRU
/// lock is taken).
const WRITEBACK_BATCH_ENTRIES: usize = 4096;

fn order_of(folio_len: usize) -> Result<u8, StoreError> {
    if folio_len.is_power_of_two() && (PAGE_SIZE..=MAX_FOLIO).contains(&folio_len) {
        Ok((folio_len / PAGE_SIZE).trailing_zeros() as u8)
    } else {
        Err(StoreError::FolioSize(folio_len))
    }
}

impl Store {
    /// A store with no backing file: when the pool is at its limit, stores are refused.
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> {
        Self::with_tier(cfg, None)
    }

    /// The backing file's descriptor, if there is a backing file with one.
    pub fn backing_fd(&self) -> Option<std::os::fd::RawFd> {
        self.backing.as_ref().and_then(|b| b.raw_fd())
    }

    /// The tier written back to, if any (a file, a remote store, or both).
    pub fn tier(&self) -> Option<&dyn Tier> {
        self.backing.as_deref()
    }

    /// A store that writes its coldest entries back to `backing` when the pool is full.
    pub fn with_backing(cfg: StoreConfig, backing: Option<impl Tier + 'static>) -> Result<Self, StoreError> {
        Self::with_tier(cfg, backing.map(|b| Box::new(b) as Box<dyn Tier>))
    }

    /// A store that writes its coldest entries back to `tier` when the pool is full.
    pub fn with_tier(cfg: StoreConfig, backing: Option<Box<dyn Tier>>) -> Result<Self, StoreError> {
        if !(1..=100).contains(&cfg.accept_threshold_percent) {
            return Err(StoreError::AcceptThreshold(cfg.accept_threshold_percent));
        }
        // Build one context now so a bad codec configuration fails here, not on first store.
        let first = Self::new_context(&cfg)?;
        Ok(Store {
            pool_limit: AtomicU64::new(cfg.max_pool_bytes.unwrap_or(u64::MAX)),
            cfg,
            contexts: Mutex::new(ContextStack { free: vec![first], made: 1 }),
            context_returned: Condvar::new(),
            load_contexts: Mutex::new(Vec::new()),
            load_contexts_made: Mutex::new(0),
            pool: Pool::new(),
            index: Index::new(),
            lru: Mutex::new(Lru::default()),
            lru_bytes: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
            backing,
            writeback: Mutex::new(Vec::new()),
            moves: Freeze::new(),
            full: AtomicBool::new(false),
            borrowed: std::sync::OnceLock::new(),
            lent: Lent::default(),
            stats: LiveStats::default(),
        })
    }

    /// The configuration the store was made with (see [`Store::max_pool_bytes`] for
    /// the pool limit in force).
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The pool limit in force.
    pub fn max_pool_bytes(&self) -> Option<u64> {
        Some(self.pool_limit.load(Relaxed)).filter(|&l| l != u64::MAX)
    }

    /// Changes the pool limit (a budget changed). A lower limit takes effect at the
    /// next store, which writes back (or is refused) until the pool fits, or at the
    /// next [`Store::fit_limit`].
    pub fn set_max_pool_bytes(&self, limit: Option<u64>) {
        self.pool_limit.store(limit.unwrap_or(u64::MAX), Relaxed);
    }

    fn new_context(cfg: &StoreConfig) -> Result<CodecContext, StoreError> {
        let codec = FolioCodec::new(&cfg.codec)?;
        // Room for any cut (`store_cut`): the smallest unit has the longest table.
        let buf = AlignedBuf::zeroed(max_encoded_len(MAX_FOLIO, SMALLEST_CUT).next_multiple_of(BLOCK_SIZE));
        Ok(CodecContext { codec, buf })
    }

    /// Runs `f` with a codec context taken from the stack. If all are busy, makes a
    /// new one while fewer than `MAX_CONTEXTS` exist, else waits for one to come back.
    fn with_context<R>(&self, f: impl FnOnce(&mut CodecContext) -> R) -> Result<R, StoreError> {
        let mut ctx = loop {
            let mut stack = self.contexts.lock();
            if let Some(ctx) = stack.free.pop() {
                break ctx;
            }
            if stack.made < MAX_CONTEXTS {
                stack.made += 1;
                drop(stack);
                match Self::new_context(&self.cfg) {
                    Ok(ctx) => break ctx,
                    Err(e) => {
                        self.contexts.lock().made -= 1;
                        return Err(e);
                    }
                }
            }
            stack = self.context_returned.wait(stack);
        };
        let r = f(&mut ctx);
        self.contexts.lock().free.push(ctx);
        self.context_returned.notify_one();
        Ok(r)
    }

    /// Makes codec contexts for loads until `n` exist (at most `MAX_CONTEXTS`), so that
    /// up to `n` loads can run at once without the store allocating or waiting for a
    /// context. A caller that loads from a signal handler (the runtime's SIGBUS path)
    /// reserves one per thread that may load at once. Loads beyond `n` at once use the
    /// general contexts (which may allocate or wait, so not from a handler).
    pub fn reserve_contexts(&self, n: usize) -> Result<(), StoreError> {
        let n = n.min(MAX_CONTEXTS);
        let mut made = self.load_contexts_made.lock();
        if *made >= n {
            return Ok(());
        }
        let fresh = (*made..n).map(|_| Self::new_context(&self.cfg)).collect::<Result<Vec<_>, _>>()?;
        // Room for all `n` (some may be out on loan now), so that giving one back never
        // grows the vector; allocated here, not under the lock loads take.
        let mut all = Vec::with_capacity(n);
        let old = {
            let mut contexts = self.load_contexts.lock();
            all.append(&mut contexts);
            all.extend(fresh);
            std::mem::replace(&mut *contexts, all)
        };
        drop(old);
        *made = n;
        Ok(())
    }

    /// Runs `f` with a context reserved for loads, or, if none is free, a general one.
    /// With one free: allocation-free, and its one lock is a std mutex held for a
    /// push or a pop.
    fn with_load_context<R>(&self, f: impl FnOnce(&mut CodecContext) -> R) -> Result<R, StoreError> {
        let Some(mut ctx) = self.load_contexts.lock().pop() else { return self.with_context(f) };
        let r = f(&mut ctx);
        self.load_contexts.lock().push(ctx);
        Ok(r)
    }

    /// Compresses `folio` and keeps it under `key`, replacing any older entry; cut as
    /// the configuration says.
    pub fn store(&self, key: u64, folio: &[u8]) -> Result<(), StoreError> {
        self.store_cut(key, folio, self.cfg.codec.granularity)
    }

    /// [`Store::store`] with the folio cut into units of `granularity`, which a caller
    /// that knows how the folio will be read back picks (see [`Store::unit_len`]).
    pub fn store_cut(&self, key: u64, folio: &[u8], granularity: Granularity) -> Result<(), StoreError> {
        let order = order_of(folio.len())?;
        let unit_order = order_of(granularity.unit_len(folio.len()))?;
        self.reap();
        self.invalidate(key);
        let totals = &self.stats.totals;
        let entry = self.with_context(|ctx| -> Result<Entry, StoreError> {
            if self.cfg.faults.as_ref().is_some_and(|f| f.compression_fails()) {
                LiveStats::add(&totals.reject_compress_fail, 1);
                return Err(StoreError::Injected("compression"));
            }
            let encoded = ctx.codec.encode_cut(folio, &mut ctx.buf[..], granularity).inspect_err(|_| {
                LiveStats::add(&totals.reject_compress_fail, 1);
            })?;
            match encoded {
                Encoded::SameFilled { word } => {
                    Ok(Entry { location: Location::SameFilled { word }, order, raw_pages: 0, unit_order })
                }
                Encoded::Stored { len, units, raw_units, .. } => {
                    if raw_units == units && !self.cfg.store_incompressible {
                        LiveStats::add(&totals.reject_compress_poor, 1);
                        return Err(StoreError::Incompressible);
                    }
                    // A folio none of whose units shrank is kept as it is, as zswap keeps
                    // an incompressible page: no header, an exact size class, memcpy back.
                    let bytes = if raw_units == units { folio } else { &ctx.buf[..len] };
                    self.make_room(bytes.len())?;
                    if self.cfg.faults.as_ref().is_some_and(|f| f.allocation_fails()) {
                        LiveStats::add(&totals.reject_alloc_fail, 1);
                        return Err(StoreError::Injected("pool allocation"));
                    }
                    let handle = {
                        let _moves = self.moves.hold();
                        self.pool.store(bytes).inspect_err(|_| {
                            LiveStats::add(&totals.reject_alloc_fail, 1);
                        })?
                    };
                    let raw_pages = (raw_units as usize * (folio.len() / units as usize) / PAGE_SIZE) as u16;
                    let len = bytes.len() as u32;
                    Ok(Entry { location: Location::Pool { handle, len, lru: 0 }, order, raw_pages, unit_order })
                }
            }
        })??;
        self.account(&entry, 1);
        LiveStats::add(&totals.zswpout, entry.pages());
        LiveStats::add(&self.stats.per_order[order as usize].zswpout, 1);
        self.publish(key, entry);
        Ok(())
    }

    /// Links a new entry on the LRU and publishes it in the index, both under the LRU
    /// lock, so writeback never finds a node whose entry is not in the index.
    ///
    /// Nothing under the LRU lock calls the allocator (a handler may wait for that
    /// lock on a thread that holds the malloc lock): the node is made under the lock
    /// but held by us, the index insert (which allocates) runs outside it, and only
    /// then does the node go on the list, where writeback can find it.
    fn publish(&self, key: u64, mut entry: Entry) {
        if let Location::Pool { lru: ref mut node, .. } = entry.location {
            *node = self.new_lru_node(key);
        }
        let old = self.index.insert(key, entry);
        debug_assert!(old.is_none(), "a store raced with another operation on key {key:#x}");
        if let Location::Pool { lru: node, .. } = entry.location {
            self.lru.lock().put_back(node, true);
        }
    }

    /// A node for `key`, held by us; grows the slab outside the lock when it is full.
    fn new_lru_node(&self, key: u64) -> u32 {
        loop {
            let want = {
                let mut lru = self.lru.lock();
                if let Some(node) = lru.push_taken(key) {
                    return node;
                }
                lru.wants_room().expect("a full slab wants room")
            };
            let bigger = Vec::with_capacity(want);
            let old = {
                let mut lru = self.lru.lock();
                let old = lru.grow(bigger);
                self.lru_bytes.store(lru.memory_bytes() as u64, Relaxed);
                old
            };
            drop(old);
        }
    }

    /// Adds (`sign` = 1) or removes (`sign` = -1) an entry from the gauges.
    fn account(&self, e: &Entry, sign: i8) {
        let t = &self.stats.totals;
        let op = if sign > 0 { LiveStats::add } else { LiveStats::sub };
        op(&self.stats.per_order[e.order as usize].stored, 1);
        match e.location {
            Location::File { .. } | Location::Lent { .. } => return op(&t.backing_pages, e.pages()),
            Location::SameFilled { .. } => op(&t.same_filled_pages, e.pages()),
            Location::Pool { len, .. } => op(&self.stats.compressed_bytes, len as u64),
            // Not this store's pool: the memory is the parent's copy, which the process
            // is charged for as it is (its PSS).
            Location::LentPool { .. } => {}
        }
        op(&t.stored_pages, e.pages());
        op(&t.stored_incompressible_pages, e.raw_pages as u64);
    }

    /// Exclusive load: decodes the folio under `key` into `folio` and frees the entry.
    /// `Ok(false)` if there is none. On a decode error the entry stays.
    ///
    /// Safe on a signal handler's path (with a context reserved, see
    /// [`Store::reserve_contexts`]): no allocation, no free, no unbounded wait; what it
    /// frees is left for [`Store::reap`]. So are `read_range`, `commit_load` and
    /// `invalidate`.
    pub fn load(&self, key: u64, folio: &mut [u8]) -> Result<bool, StoreError> {
        let Some(entry) = self.claim(key) else { return Ok(false) };
        if entry.folio_len() != folio.len() {
            self.unclaim(&entry, true);
            return Err(StoreError::SizeMismatch { key, stored: entry.folio_len(), asked: folio.len() });
        }
        if let Err(e) = self.decode(key, &entry, 0, folio) {
            self.unclaim(&entry, false);
            return Err(e);
        }
        self.erase(key, &entry);
        LiveStats::add(&self.stats.totals.zswpin, entry.pages());
        LiveStats::add(&self.stats.per_order[entry.order as usize].zswpin, 1);
        Ok(true)
    }

    /// The second half of an exclusive load done in two steps: `read_range` of the
    /// whole folio, then, once the caller has put the bytes where they belong, this
    /// frees the entry and counts the load as `load` does. A caller that cannot be
    /// sure of placing the bytes (the runtime's reader thread, which may not wait)
    /// loads this way so that a failure leaves the entry, not a folio to store again.
    pub fn commit_load(&self, key: u64) -> bool {
        let Some(entry) = self.claim(key) else { return false };
        self.erase(key, &entry);
        LiveStats::add(&self.stats.totals.zswpin, entry.pages());
        LiveStats::add(&self.stats.per_order[entry.order as usize].zswpin, 1);
        true
    }

    /// Makes the entry under `key` ours until `erase` or `unclaim`. A pool entry's
    /// LRU node is taken so writeback leaves it alone; if writeback holds it already,
    /// we join it (`WritebackPinned`): the pool object stays valid, because writeback
    /// now leaves it to us. Never waits for writeback.
    fn claim(&self, key: u64) -> Option<Entry> {
        let mut lru = self.lru.lock();
        // Under the LRU lock the index entry and its node agree: writeback changes
        // both under this lock.
        let entry = self.index.get(key)?;
        if let Location::Pool { lru: node, .. } = entry.location {
            if lru.is_taken(node) {
                // Operations on one key never overlap, so only writeback can hold it.
                debug_assert_eq!(lru.holder(node), Holder::Writeback);
                lru.set_holder(node, Holder::WritebackPinned);
            } else {
                lru.take(node);
            }
        }
        Some(entry)
    }

    /// Gives a claimed entry back, still in the index. Its old place on the LRU is
    /// lost: it goes back as the newest if its folio was just used, else as the
    /// coldest (a folio that cannot be decoded should leave memory first).
    fn unclaim(&self, entry: &Entry, newest: bool) {
        let Location::Pool { handle, lru: node, .. } = entry.location else { return };
        let mut lru = self.lru.lock();
        match lru.holder(node) {
            Holder::Loader => lru.put_back(node, newest),
            // Writeback still has it; it may free it now.
            Holder::WritebackPinned => lru.set_holder(node, Holder::Writeback),
            // Writeback moved the entry to the file meanwhile: this copy is ours to free.
            Holder::Orphan => self.bury(&mut lru, node, handle),
            other => unreachable!("a claimed node held by {other:?}"),
        }
    }

    /// The unit of the cut the folio under `key` was stored with (what a
    /// [`Store::read_range`] of one page decodes at most). `None` if there is no
    /// entry. Lock-free and allocation-free, for a fault.
    pub fn unit_len(&self, key: u64) -> Option<usize> {
        self.index.with(key, |e| e.unit_len())
    }

    /// Non-exclusive partial read: decodes only the units that cover
    /// `[offset, offset + out.len())` of the folio under `key`; the entry stays.
    pub fn read_range(&self, key: u64, offset: usize, out: &mut [u8]) -> Result<bool, StoreError> {
        let Some(entry) = self.claim(key) else { return Ok(false) };
        let result = if offset.checked_add(out.len()).is_none_or(|end| end > entry.folio_len()) {
            Err(StoreError::SizeMismatch { key, stored: entry.folio_len(), asked: offset.saturating_add(out.len()) })
        } else {
            self.decode(key, &entry, offset, out)
        };
        self.unclaim(&entry, true);
        result.map(|()| true)
    }

    fn decode(&self, key: u64, entry: &Entry, offset: usize, out: &mut [u8]) -> Result<(), StoreError> {
        match entry.location {
            Location::SameFilled { word } => {
                // Same-filled words repeat every 8 bytes, so an offset shifts the pattern.
                let word = word.rotate_right(8 * (offset % 8) as u32);
                uzswap_compress::fill_same(out, word);
                Ok(())
            }
            Location::Pool { handle, .. } => self
                .with_load_context(|ctx| self.pool.read(handle, |bytes| decode_into(&mut ctx.codec, bytes, entry, offset, out)))?
                .map_err(|e| self.decode_failed(e.into())),
            Location::File { .. } | Location::Lent { .. } => {
                let (slot, tier) = match entry.slot(key) {
                    Some(slot) => (slot, self.backing.as_deref().expect("file entries exist only with a backing file")),
                    None => (entry.lent_slot(key).expect("a lent entry"), self.lender_tier().expect("lent entries exist only with a lender")),
                };
                self.with_load_context(|ctx| -> Result<(), StoreError> {
                    // The context's buffer is aligned and block-rounded: no bounce buffer.
                    tier.read_in_place(&slot, &mut ctx.buf[..])?;
                    Ok(decode_into(&mut ctx.codec, &ctx.buf[..slot.data_len()], entry, offset, out)?)
                })?
                .map_err(|e| self.decode_failed(e))?;
                LiveStats::add(&self.stats.totals.pswpin, entry.pages());
                LiveStats::add(&self.stats.per_order[entry.order as usize].pswpin, 1);
                Ok(())
            }
            Location::LentPool { addr, len } => {
                // SAFETY: a lent pool record is in the child's copy of the parent's pool,
                // which stays mapped while any lent entry names it (carry.rs "Loans") and
                // which nothing writes: this entry is claimed, so it is still there.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
                self.with_load_context(|ctx| decode_into(&mut ctx.codec, bytes, entry, offset, out))?
                    .map_err(|e| self.decode_failed(e.into()))
            }
        }
    }

    fn decode_failed(&self, e: StoreError) -> StoreError {
        LiveStats::add(&self.stats.totals.decompress_fail, 1);
        e
    }

    /// Erases a claimed entry from the index and lets go of what it held: a pool
    /// object is buried and a file slot's free deferred, both for `reap` (a free may
    /// allocate). Allocation-free.
    fn erase(&self, key: u64, entry: &Entry) {
        match entry.location {
            Location::Pool { handle, lru: node, .. } => {
                let mut lru = self.lru.lock();
                match lru.holder(node) {
                    Holder::Loader => {
                        self.index.remove(key);
                        self.bury(&mut lru, node, handle);
                        self.account(entry, -1);
                    }
                    Holder::WritebackPinned => {
                        // Writeback sees this when it is done: it frees the object and
                        // the slot it wrote, and publishes nothing.
                        self.index.remove(key);
                        lru.set_holder(node, Holder::WritebackErased);
                        self.account(entry, -1);
                    }
                    Holder::Orphan => {
                        // Writeback published a file entry meanwhile, or a recut a new
                        // pool record (recut.rs): erase that one.
                        let moved = self.index.remove(key).expect("writeback published the file entry");
                        self.bury(&mut lru, node, handle);
                        if let Location::Pool { handle: recut, lru: recut_node, .. } = moved.location {
                            // Its node is on the LRU, or held by a writeback (or recut)
                            // that took it since: that one frees it, as for any erase.
                            if lru.is_taken(recut_node) {
                                debug_assert_eq!(lru.holder(recut_node), Holder::Writeback);
                                lru.set_holder(recut_node, Holder::WritebackErased);
                            } else {
                                lru.take(recut_node);
                                self.bury(&mut lru, recut_node, recut);
                            }
                            self.account(&moved, -1);
                            return;
                        }
                        drop(lru);
                        self.erase_unclaimed(key, &moved);
                    }
                    other => unreachable!("a claimed node held by {other:?}"),
                }
            }
            Location::File { .. } | Location::SameFilled { .. } | Location::Lent { .. } | Location::LentPool { .. } => {
                self.index.remove(key);
                self.erase_unclaimed(key, entry);
            }
        }
    }

    /// Lets go of a file, lent or same-filled entry already erased from the index.
    fn erase_unclaimed(&self, key: u64, entry: &Entry) {
        // A loan's record is the lender's: nothing to free here.
        self.loan_returned(entry);
        if let Some(slot) = entry.slot(key) {
            let backing = self.backing.as_ref().expect("file entries exist only with a backing file");
            // A slot we own that the file does not know is a bug in one of us; the
            // data is being dropped anyway, so say so and go on.
            if let Err(e) = backing.free_deferred(slot) {
                debug_assert!(false, "freeing {slot:?}: {e}");
            }
            self.deferred.fetch_add(1, Relaxed);
        }
        self.account(entry, -1);
    }

    fn bury(&self, lru: &mut Lru, node: u32, handle: Handle) {
        lru.bury(node, handle.0);
        self.deferred.fetch_add(1, Relaxed);
    }

    /// Frees what loads and invalidations left behind (pool objects of erased
    /// entries, written-back slots): they may run where freeing is not allowed (a
    /// signal handler), so they defer it. Stores and writeback reap first; call it
    /// to give the memory back sooner. Not for a signal handler's path.
    pub fn reap(&self) {
        if self.deferred.load(Relaxed) == 0 || self.deferred.swap(0, Relaxed) == 0 {
            return;
        }
        let _moves = self.moves.hold();
        // A few at a time: the pool frees (which may free memory) run outside the LRU
        // lock, and a fixed array needs no allocation under it.
        loop {
            let mut handles = [0u64; 64];
            let mut n = 0;
            {
                let mut lru = self.lru.lock();
                while n < handles.len() {
                    let Some((node, handle)) = lru.unbury() else { break };
                    lru.free(node);
                    handles[n] = handle;
                    n += 1;
                }
            }
            for &handle in &handles[..n] {
                self.pool.free(Handle(handle));
            }
            if n < handles.len() {
                break;
            }
        }
        if let Some(backing) = &self.backing {
            // Under `moves`, as every loan is made (under freeze): none comes between
            // the mark read here and the reap.
            let mark = self.loans_mark();
            if mark > 0 {
                // A child may still read slots queued here: their frees wait (carry.rs
                // "Loans"); the next reap looks again.
                self.deferred.fetch_add(1, Relaxed);
            }
            if let Err(e) = backing.reap_keeping(mark) {
                debug_assert!(false, "reaping deferred slot frees: {e}");
            }
        }
    }

    /// Drops the entry under `key`, if any.
    pub fn invalidate(&self, key: u64) -> bool {
        let Some(entry) = self.claim(key) else { return false };
        self.erase(key, &entry);
        true
    }

    /// Before a store of `len` bytes: if the pool is at its limit, write back down to
    /// the accept threshold, or refuse if there is nowhere to write.
    /// Writes back (with a tier) until the pool fits its limit, as a store past it
    /// would: for a caller whose limit fell while it stores nothing (zswap's shrink
    /// worker, run when its pool is full). Nothing to do under the limit.
    pub fn fit_limit(&self) -> Result<(), StoreError> {
        if self.backing.is_none() {
            return Ok(());
        }
        self.make_room(0)
    }

    fn make_room(&self, len: usize) -> Result<(), StoreError> {
        let Some(limit) = self.max_pool_bytes() else { return Ok(()) };
        if !self.full.load(Relaxed) && self.pool_total_size() + len as u64 <= limit {
            return Ok(());
        }
        self.full.store(true, Relaxed);
        LiveStats::add(&self.stats.totals.pool_limit_hit, 1);
        let threshold = limit / 100 * self.cfg.accept_threshold_percent as u64;
        if self.backing.is_none() {
            // Nowhere to write: recut (recut.rs) is the only room there is.
            while self.pool_total_size() + len as u64 > threshold && self.recut_coldest(WRITEBACK_BATCH_BYTES) > 0 {}
            if self.pool_total_size() + len as u64 <= threshold {
                self.full.store(false, Relaxed);
                return Ok(());
            }
            return Err(StoreError::PoolLimit { limit });
        }
        self.shrink(threshold.saturating_sub(len as u64))?;
        self.full.store(false, Relaxed);
        Ok(())
    }

    /// Writes back the coldest entries until the store holds at most `target` bytes
    /// (or the LRU is empty). Returns the pages written back.
    pub fn shrink(&self, target: u64) -> Result<u64, StoreError> {
        let mut pages = 0;
        // An eighth of the pool's limit, 1 to 8 MiB: the batch's buffers (a copy here,
        // an O_DIRECT bounce in the backing file) are memory the process holds, which
        // a small budget cannot spare 16 MiB of.
        let batch = self.max_pool_bytes().map_or(WRITEBACK_BATCH_BYTES as u64, |l| (l / 8).clamp(1 << 20, WRITEBACK_BATCH_BYTES as u64));
        while self.pool_total_size() > target {
            // Room without a write first: cold records cut small, cut whole (recut.rs).
            if self.recut_coldest(batch as usize) > 0 {
                continue;
            }
            match self.writeback_batch(batch as usize)? {
                0 => break,
                n => pages += n,
            }
        }
        Ok(pages)
    }

    /// Writes back up to `max_bytes` of the coldest pool entries in one batch (at most
    /// 8 MiB and 4096 entries: room for a batch is made before the LRU lock is taken).
    /// Returns the pages written back (0 if the LRU is empty).
    pub fn writeback_batch(&self, max_bytes: usize) -> Result<u64, StoreError> {
        let Some(backing) = self.backing.as_ref() else {
            return Err(StoreError::PoolLimit { limit: self.max_pool_bytes().unwrap_or(0) });
        };
        self.reap();
        let _moves = self.moves.hold();
        let mut buf = self.writeback.lock();
        buf.clear();
        // Everything step 1 and 3 need is allocated here, outside the LRU lock (a
        // handler may wait for it on a thread holding the malloc lock): the copy
        // buffer, room for the batch, and the index's boxes for the file entries.
        let max_bytes = max_bytes.min(WRITEBACK_BATCH_BYTES);
        buf.reserve(max_bytes.max(MAX_FOLIO) + MAX_FOLIO);
        let mut batch: Vec<(u64, Entry, usize)> = Vec::with_capacity(WRITEBACK_BATCH_ENTRIES);
        // 1. Take the coldest nodes: from now on their pool objects are ours.
        {
            let mut lru = self.lru.lock();
            while buf.len() < max_bytes && batch.len() < batch.capacity() {
                let Some((node, key)) = lru.take_coldest() else { break };
                let entry = self.index.get(key).expect("an LRU node's entry is in the index");
                let Location::Pool { handle, len, .. } = entry.location else { unreachable!("only pool entries are on the LRU") };
                if buf.len() + len as usize > buf.capacity() {
                    lru.put_back(node, false);
                    break;
                }
                let start = buf.len();
                self.pool.read(handle, |bytes| buf.extend_from_slice(bytes));
                batch.push((key, entry, start));
            }
        }
        if batch.is_empty() {
            return Ok(0);
        }
        // 2. Write them out, outside every lock but our own.
        let ends = batch.iter().skip(1).map(|b| b.2).chain([buf.len()]);
        let records: Vec<Record<'_>> =
            batch.iter().zip(ends).map(|(&(key, _, start), end)| Record { key, data: &buf[start..end] }).collect();
        let written = backing.write_batch(&records);
        // Pool objects to free and slots to drop once the lock is released.
        let mut to_free: Vec<Handle> = Vec::with_capacity(batch.len());
        let mut orphaned_slots: Vec<Slot> = Vec::with_capacity(batch.len());
        let slots = match written {
            Ok(slots) => slots,
            Err(e) => {
                // 3a. Nothing was written: the entries stay in the pool, coldest first.
                let mut lru = self.lru.lock();
                for (_, entry, _) in batch.iter().rev() {
                    let Location::Pool { handle, lru: node, .. } = entry.location else { unreachable!() };
                    give_back_taken(&mut lru, node, handle, &mut to_free);
                }
                drop(lru);
                for handle in to_free {
                    self.pool.free(handle);
                }
                LiveStats::add(&self.stats.totals.reject_reclaim_fail, 1);
                return Err(e.into());
            }
        };
        let mut moved: Vec<(Entry, Option<Prepared<Entry>>)> = batch
            .iter()
            .zip(&slots)
            .map(|(&(_, entry, _), &slot)| {
                let file = Entry::file(slot, &entry);
                (file, Some(self.index.prepare(file)))
            })
            .collect();
        // 3b. Written: point each entry at its slot, then free its pool object.
        let mut pages = 0;
        let mut lru = self.lru.lock();
        for (((key, entry, _), slot), (file, prepared)) in batch.iter().zip(slots).zip(moved.iter_mut()) {
            let Location::Pool { handle, lru: node, .. } = entry.location else { unreachable!() };
            let holder = lru.holder(node);
            if holder == Holder::WritebackErased {
                // A load erased the entry while it was being written: drop both copies.
                lru.free(node);
                to_free.push(handle);
                orphaned_slots.push(slot);
                continue;
            }
            let prepared = prepared.take().expect("one prepared entry each");
            let replaced = self.index.replace(*key, prepared);
            debug_assert!(replaced.as_ref().is_ok_and(|old| old == entry), "{key:#x}: {:?}", replaced.as_ref().ok());
            release_moved(&mut lru, node, handle, &mut to_free);
            self.account(entry, -1);
            self.account(file, 1);
            pages += entry.pages();
            LiveStats::add(&self.stats.per_order[entry.order as usize].zswpwb, 1);
        }
        drop(lru);
        drop(moved);
        for handle in to_free {
            self.pool.free(handle);
        }
        for slot in orphaned_slots {
            if let Err(e) = backing.free(slot) {
                debug_assert!(false, "freeing {slot:?}: {e}");
            }
        }
        let t = &self.stats.totals;
        for counter in [&t.zswpwb, &t.written_back_pages, &t.pswpout] {
            LiveStats::add(counter, pages);
        }
        Ok(pages)
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

    /// Bytes of the folios held in the backing file now (as pages: what they took in
    /// memory, not on disk).
    pub fn written_back_bytes(&self) -> u64 {
        self.stats.totals.backing_pages.load(std::sync::atomic::Ordering::Relaxed) * 4096
    }

    /// Bytes of entry metadata: the index and the LRU.
    pub fn metadata_bytes(&self) -> u64 {
        self.index.memory_bytes() as u64 + self.lru_bytes.load(Relaxed)
    }

    /// Objects the pool holds: one per pool entry, once what was buried is reaped
    /// (a leak check for tests).
    pub fn pool_objects(&self) -> u64 {
        self.pool.stats().objects
    }

    /// Bytes of memory the pool alone holds (zsmalloc's pages).
    pub fn pool_bytes(&self) -> u64 {
        self.pool.total_size()
    }

    /// Moves pool objects out of sparse spans and returns empty ones to the system.
    pub fn compact(&self) -> uzswap_pool::CompactStats {
        self.reap();
        let _moves = self.moves.hold();
        let done = self.pool.compact();
        LiveStats::add(&self.stats.totals.compactions, 1);
        LiveStats::add(&self.stats.totals.compacted_bytes, done.freed_bytes);
        done
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

/// A node writeback (or recut) took whose record stays where it was (nothing written,
/// not recut), under the LRU lock: back on the list as the coldest; or to the load
/// reading it alongside, which owns it now as if it had taken it; or, if a load erased
/// the entry meanwhile (and counted it gone), freed with its object (`to_free`, which
/// has room: nothing here allocates).
fn give_back_taken(lru: &mut Lru, node: u32, handle: Handle, to_free: &mut Vec<Handle>) {
    match lru.holder(node) {
        Holder::Writeback => lru.put_back(node, false),
        Holder::WritebackPinned => lru.set_holder(node, Holder::Loader),
        Holder::WritebackErased => {
            lru.free(node);
            to_free.push(handle);
        }
        other => unreachable!("writeback's node held by {other:?}"),
    }
}

/// A node writeback (or recut) took whose record was just published elsewhere, under
/// the LRU lock (not one a load erased): freed with its old object (`to_free`); or,
/// with a load reading that object alongside, handed to it (`Orphan`): it frees it
/// when done.
fn release_moved(lru: &mut Lru, node: u32, handle: Handle, to_free: &mut Vec<Handle>) {
    match lru.holder(node) {
        Holder::Writeback => {
            lru.free(node);
            to_free.push(handle);
        }
        Holder::WritebackPinned => lru.set_holder(node, Holder::Orphan),
        other => unreachable!("writeback's node held by {other:?}"),
    }
}


/// Decodes the whole folio, or only the units that cover `out` at `offset`; a folio
/// kept as it is is copied.
fn decode_into(
    codec: &mut FolioCodec,
    bytes: &[u8],
    entry: &Entry,
    offset: usize,
    out: &mut [u8],
) -> Result<(), uzswap_compress::Error> {
    if entry.is_kept_raw() {
        let src = bytes.get(offset..offset + out.len()).ok_or(uzswap_compress::Error::Corrupt("raw folio is short"))?;
        out.copy_from_slice(src);
        Ok(())
    } else if offset == 0 && out.len() == entry.folio_len() {
        codec.decode(bytes, out)
    } else {
        codec.decode_range(bytes, offset, out)
    }
}
