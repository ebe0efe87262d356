//! uzswap-index: our xarray (zswap's tree since it moved from an rbtree to an
//! xarray) — maps a u64 key (a swap slot or a folio number) to a value, with lookups that take no lock and writers that do not
//! contend unless they touch the same 64 keys.
//!
//! # Structures
//!
//! ```text
//!  Index
//!   directory[512] ──► Shard(id) ──► Shard(id') ...   hashed on key >> 18, chains are push-only
//!                        root[64] ──► Mid ──► Leaf ──► Box<V>
//!                        (bits 12..18)  (6..12) (0..6)
//! ```
//!
//! - A **shard** covers 2^18 consecutive keys (1 GiB of 4 KiB slots), the
//!   analogue of zswap_trees' one-tree-per-64-MiB split: writers in different
//!   shards never share a cache line. Shards are found through a fixed directory
//!   of 512 buckets, each a push-only list, so sparse 64-bit keys (user
//!   addresses >> 12 reach 2^36 and beyond) cost one shard per GiB actually used
//!   rather than a tall tree. The shard holds the root level inline.
//! - **Mid** and **leaf** nodes are 64-way arrays of `AtomicPtr`s plus a `count`.
//!   Leaf slots point to a boxed `V` (behind one word, its link once retired).
//!
//! # Concurrency
//!
//! Nobody takes a lock. Readers (`get`, `with`) pin (see `reclaim`) and
//! follow Acquire loads: directory bucket, shard chain, root, mid, leaf, value
//! — five dependent loads after the pin. A writer changes a leaf slot with one
//! atomic swap/CAS, so a reader sees the old or the new value, never a mix; the
//! displaced box is retired, so a reader still cloning it keeps valid memory.
//! Nodes are created by CAS into a null slot; the loser frees its
//! never-published node at once.
//!
//! # On a signal handler's path
//!
//! The runtime's SIGBUS handler looks entries up and removes them, on a thread
//! interrupted anywhere (in its own malloc included). So `get`, `with`, `remove`,
//! `remove_if` and `replace` (of a value boxed beforehand by `prepare`) allocate
//! nothing, free nothing, take no lock and never wait
//! for another thread: their primitives are atomic loads, swaps and CASes, a
//! pin that is an atomic add on a striped counter plus a fence (no per-thread
//! registration: the stripe is a const-initialised thread-local without a
//! destructor), and a retire that pushes the unlinked box or node onto a
//! lock-free list through its own first word (no memory needed). Only `insert`
//! (which allocates anyway) and `reclaim` free retired memory, under a
//! `try_lock` that losers skip. crossbeam-epoch is not used for this reason: its
//! first pin on a thread registers it (allocates), its deferred bags allocate
//! when full, and any pin may collect, i.e. free.
//!
//! # Life cycle of nodes
//!
//! Leaves and mid nodes are freed when they empty, as the kernel's xarray frees
//! its nodes, so an index whose keys wander over the address space does not keep
//! a node per range it ever touched. `count` is the number of children plus
//! writers that are about to add one (a *reservation*). An inserter reserves a
//! node (`fetch_add`) before it fills a null slot; whoever drops `count` to 0
//! may mark the node `DEAD` with a CAS 0 -> DEAD, after which no reservation
//! succeeds, every slot stays null, and the node is unlinked from its parent
//! (CAS node -> null: the one winner retires it and releases the parent's
//! count). A writer that finds a `DEAD` node helps unlink it and restarts from
//! the root, so nobody waits on a thread preempted in between. A reservation can
//! only succeed on a linked node, and a linked node keeps its parent's count
//! above zero, so an insert never lands in a detached subtree. Shards and the
//! directory live until the index is dropped: an empty shard costs
//! `size_of::<Shard>()` (~530 B) per GiB of key space ever used.
//!
//! The displaced value is destroyed only after the grace period, on whichever
//! thread next reclaims (an `insert` or `reclaim`); that is why `insert`, `remove` and
//! `remove_if` return a *clone* of the old value (a reader may be cloning the
//! original right now). `V` is best a small handle or an `Arc`; do not put a
//! resource in it whose `Drop` must run at a precise moment.
//!
//! # Memory
//!
//! Dense keys cost one 8 B slot each (a 528 B leaf per 64 keys) plus the value
//! box (`size_of::<V>()` plus its 8 B link, rounded up by malloc, at least 32 B
//! with glibc); mid
//! nodes and shards add < 0.2 B per key. A lone key in its own 64-key range costs
//! a whole leaf, so number folios densely (folio index, not address >> 12, when
//! folios are large). `memory_bytes` counts all of this as glibc malloc
//! hands it out.
//!
//! # What it is not
//!
//! Not ordered: there is no range scan or iteration (the store keeps its own
//! LRU). `len` is the sum of per-thread counters: exact when writers are
//! quiescent, approximate while they run.
//!
//! # Testing under loom
//!
//! With `--cfg loom` the fan-out shrinks to 2, the directory to 2 buckets, and
//! the atomics (fences included) come from loom: the models run the real
//! reclamation protocol, whose "free" then poisons instead, so a use after free
//! or a retire after free fails the model (see `reclaim`). The models are in
//! tests/loom.rs:
//! `CARGO_TARGET_DIR=/work/target-loom RUSTFLAGS="--cfg loom" cargo test -p uzswap-index --release --test loom`

use std::marker::PhantomData;
use std::mem::size_of;
use std::ptr::null_mut;

use crossbeam_utils::CachePadded;

mod reclaim;
mod sync {
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{fence, AtomicIsize, AtomicPtr, AtomicUsize, Ordering};
    #[cfg(loom)]
    pub(crate) use loom::sync::Mutex;
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{fence, AtomicIsize, AtomicPtr, AtomicUsize, Ordering};
    #[cfg(not(loom))]
    pub(crate) use std::sync::Mutex;
}

use reclaim::{Guard, Link, Reclaim, KIND_BITS};
use sync::Ordering::{AcqRel, Acquire, Relaxed, Release};
use sync::{AtomicIsize, AtomicPtr, AtomicUsize};

/// Key bits per tree level.
#[cfg(not(loom))]
const LEVEL_BITS: u32 = 6;
#[cfg(loom)]
const LEVEL_BITS: u32 = 1;
const FANOUT: usize = 1 << LEVEL_BITS;
const LEVEL_MASK: u64 = FANOUT as u64 - 1;
/// Keys per shard: root, mid and leaf levels.
const SHARD_BITS: u32 = 3 * LEVEL_BITS;

#[cfg(not(loom))]
const DIRECTORY_BITS: u32 = 9;
#[cfg(loom)]
const DIRECTORY_BITS: u32 = 1;

/// Write counters are spread over this many cache lines, one picked per thread.
#[cfg(not(loom))]
const STRIPES: usize = 16;
#[cfg(loom)]
const STRIPES: usize = 1;

/// Set in `Node::count` once the node has emptied and is being unlinked.
const DEAD: usize = 1 << (usize::BITS - 1);

#[repr(C)]
struct Node<T> {
    /// Its next pointer once retired (see `reclaim`): first, as every retired type.
    link: Link,
    /// Linked children plus reservations of writers about to link one; `DEAD`
    /// once it reached zero and was condemned.
    count: AtomicUsize,
    slots: [AtomicPtr<T>; FANOUT],
}

/// What a leaf slot points to: the value behind the link it is retired through.
#[repr(C)]
struct ValueBox<V> {
    link: Link,
    value: V,
}

type Leaf<V> = Node<ValueBox<V>>;
type Mid<V> = Node<Leaf<V>>;

/// Kinds of retired allocations, in the low bits of their retired-list pointers.
const RETIRED_VALUE: usize = 0;
const RETIRED_LEAF: usize = 1;
const RETIRED_MID: usize = 2;

/// Frees a retired allocation of the index, by its kind tag.
///
/// # Safety
/// `tagged` came from `retire` of an `Index<V>` and its grace period is over.
unsafe fn destroy<V>(tagged: usize) {
    let addr = tagged & !KIND_BITS;
    match tagged & KIND_BITS {
        RETIRED_VALUE => drop(Box::from_raw(addr as *mut ValueBox<V>)),
        RETIRED_LEAF => drop(Box::from_raw(addr as *mut Leaf<V>)),
        RETIRED_MID => drop(Box::from_raw(addr as *mut Mid<V>)),
        kind => unreachable!("retired kind {kind}"),
    }
}

impl<T> Node<T> {
    /// A node already holding `reservations`, so it cannot be condemned before
    /// its creator has filled the slot it was made for.
    fn new_raw(reservations: usize) -> *mut Self {
        Box::into_raw(Box::new(Node {
            link: Link::new(),
            count: AtomicUsize::new(reservations),
            slots: std::array::from_fn(|_| AtomicPtr::new(null_mut())),
        }))
    }

    /// Takes a reservation; false if the node is condemned.
    fn reserve(&self) -> bool {
        // A failed attempt leaves its increment in a dead count; nothing reads it.
        self.count.fetch_add(1, AcqRel) & DEAD == 0
    }

    /// Drops a reservation or a child; true if this condemned the node, and the
    /// caller must then unlink it.
    fn release(&self) -> bool {
        let before = self.count.fetch_sub(1, AcqRel);
        debug_assert!(before & DEAD == 0 && before > 0, "release of a dead or empty node");
        before == 1 && self.count.compare_exchange(0, DEAD, AcqRel, Relaxed).is_ok()
    }

    fn is_dead(&self) -> bool {
        self.count.load(Acquire) & DEAD != 0
    }
}

struct Shard<V> {
    id: u64,
    /// Next shard in the same directory bucket; fixed before publication.
    next: *mut Shard<V>,
    root: [AtomicPtr<Mid<V>>; FANOUT],
}

/// Per-stripe write counters; summed by `len`, `stats` and `memory_bytes`.
struct Counters {
    entries: AtomicIsize,
    nodes: AtomicIsize,
    shards: AtomicIsize,
}

/// Where a key lives, as seen by one traversal under one guard.
struct Path<'g, V> {
    shard: &'g Shard<V>,
    root_index: usize,
    mid: *mut Mid<V>,
    mid_index: usize,
    leaf: *mut Leaf<V>,
    leaf_index: usize,
}

/// A value boxed ahead of time by [`Index::prepare`], for [`Index::replace`]: the
/// allocation happens where the caller may allocate (outside its locks), the
/// replacement where it may not. Dropping an unused one frees its box.
pub struct Prepared<V>(*mut ValueBox<V>);

// SAFETY: a Prepared owns its box exclusively, as a Box<V> would.
unsafe impl<V: Send> Send for Prepared<V> {}

impl<V> Drop for Prepared<V> {
    fn drop(&mut self) {
        // SAFETY: never published (`replace` forgets a Prepared it consumes).
        drop(unsafe { Box::from_raw(self.0) });
    }
}

/// Counters and memory use of an [`Index`] (see [`Index::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStats {
    /// Keys present.
    pub entries: usize,
    /// Mid and leaf nodes linked into the trees.
    pub nodes: usize,
    /// Shards (2^18-key ranges) created; they live until the index is dropped.
    pub shards: usize,
    /// Same as [`Index::memory_bytes`].
    pub memory_bytes: usize,
}

/// A lock-free map from u64 keys to values; see the crate documentation.
pub struct Index<V> {
    directory: Box<[AtomicPtr<Shard<V>>]>,
    counters: Box<[CachePadded<Counters>]>,
    reclaim: Reclaim,
    _owns: PhantomData<V>,
}

/// glibc malloc's footprint for a request: 8 B header, 16 B granules, 32 B minimum.
const fn malloc_footprint(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    let chunk = (bytes + 8 + 15) & !15;
    if chunk < 32 {
        32
    } else {
        chunk
    }
}

fn split_key(key: u64) -> (u64, usize, usize, usize) {
    let at = |level: u32| ((key >> (level * LEVEL_BITS)) & LEVEL_MASK) as usize;
    (key >> SHARD_BITS, at(2), at(1), at(0))
}

/// This thread's stripe (of `STRIPES`, also used for `reclaim`'s reader counts).
#[cfg(not(loom))]
pub(crate) fn stripe() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
    static NEXT: StdAtomicUsize = StdAtomicUsize::new(0);
    thread_local! {
        // Const-initialised, no destructor: first use allocates nothing (a handler may
        // be that first use).
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, StdOrdering::Relaxed) % STRIPES);
        }
        s.get()
    })
}

#[cfg(loom)]
pub(crate) fn stripe() -> usize {
    0
}

/// Inserts per thread between two attempts to free retired memory.
#[cfg(not(loom))]
const RECLAIM_EVERY: u32 = 16;
#[cfg(loom)]
const RECLAIM_EVERY: u32 = 1;

/// Whether this insert should try to reclaim: one in `RECLAIM_EVERY` per thread.
#[cfg(not(loom))]
fn reclaim_turn() -> bool {
    use std::cell::Cell;
    thread_local! {
        static TURN: Cell<u32> = const { Cell::new(0) };
    }
    TURN.with(|t| {
        let n = t.get().wrapping_add(1);
        t.set(n);
        n % RECLAIM_EVERY == 0
    })
}

#[cfg(loom)]
fn reclaim_turn() -> bool {
    RECLAIM_EVERY == 1
}

impl<V: Clone + Send + Sync + 'static> Index<V> {
    pub fn new() -> Self {
        Index {
            directory: (0..1usize << DIRECTORY_BITS).map(|_| AtomicPtr::new(null_mut())).collect(),
            counters: (0..STRIPES)
                .map(|_| {
                    CachePadded::new(Counters {
                        entries: AtomicIsize::new(0),
                        nodes: AtomicIsize::new(0),
                        shards: AtomicIsize::new(0),
                    })
                })
                .collect(),
            reclaim: Reclaim::new(),
            _owns: PhantomData,
        }
    }

    /// Lock-free lookup; returns a clone of the value.
    pub fn get(&self, key: u64) -> Option<V> {
        self.with(key, V::clone)
    }

    /// Lock-free lookup that runs `f` on the value in place. `f` runs pinned
    /// (it holds back reclamation everywhere), so keep it short.
    pub fn with<R>(&self, key: u64, f: impl FnOnce(&V) -> R) -> Option<R> {
        let guard = self.reclaim.pin();
        let path = self.find(key, &guard)?;
        // SAFETY: `path.leaf` was loaded under `guard`.
        let leaf = unsafe { guard.deref(path.leaf) };
        let value = leaf.slots[path.leaf_index].load(Acquire);
        if value.is_null() {
            return None;
        }
        // SAFETY: loaded under `guard`; retired values outlive every guard that saw them.
        Some(f(&unsafe { guard.deref(value) }.value))
    }

    /// Insert or replace; returns (a clone of) the previous value.
    ///
    /// Allocates, and now and then frees memory retired by earlier removals: unlike
    /// the other operations it is not for a signal handler's path.
    pub fn insert(&self, key: u64, value: V) -> Option<V> {
        let previous = self.insert_pinned(key, value);
        if reclaim_turn() && self.reclaim.has_retired() {
            // SAFETY: everything on the retired lists came from this index's `retire`.
            self.reclaim.try_reclaim(|tagged| unsafe { destroy::<V>(tagged) });
        }
        previous
    }

    /// Frees what removals retired, as far as readers allow (see `reclaim`); `insert`
    /// does this on its own now and then. Not for a signal handler's path.
    pub fn reclaim(&self) {
        // SAFETY: as in `insert`.
        self.reclaim.try_reclaim(|tagged| unsafe { destroy::<V>(tagged) });
    }

    fn insert_pinned(&self, key: u64, value: V) -> Option<V> {
        let new = Box::into_raw(Box::new(ValueBox { link: Link::new(), value }));
        let guard = self.reclaim.pin();
        let (shard_id, root_index, mid_index, leaf_index) = split_key(key);
        let shard = self.shard_or_create(shard_id);
        loop {
            let (mid, mid_reserved) = self.mid_or_create(shard, root_index);
            let Some((leaf, mut leaf_reserved)) =
                self.leaf_or_create(shard, root_index, mid, mid_reserved, mid_index, &guard)
            else {
                continue;
            };
            let path = Path { shard, root_index, mid, mid_index, leaf, leaf_index };
            // SAFETY: loaded (or created) under `guard`.
            let leaf_node = unsafe { guard.deref(leaf) };
            let slot = &leaf_node.slots[leaf_index];
            if !leaf_reserved {
                // Replacing a present value moves its share of `count` to the
                // new one: no reservation, no write to the leaf header.
                let current = slot.load(Acquire);
                if !current.is_null() && slot.compare_exchange(current, new, AcqRel, Acquire).is_ok() {
                    // SAFETY: we unlinked `current`; only we retire it.
                    return Some(unsafe { self.retire_value(current, &guard) });
                }
                if !leaf_node.reserve() {
                    self.unlink_leaf(&path, &guard);
                    continue;
                }
                leaf_reserved = true;
            }
            debug_assert!(leaf_reserved);
            let old = slot.swap(new, AcqRel);
            if old.is_null() {
                self.counters().entries.fetch_add(1, Relaxed);
                return None;
            }
            // The slot was refilled between our look and our swap: `old` gives
            // back its share of `count` (ours is now held by `new`).
            // SAFETY: we unlinked `old`; only we retire it.
            let previous = unsafe { self.retire_value(old, &guard) };
            if leaf_node.release() {
                self.unlink_leaf(&path, &guard);
            }
            return Some(previous);
        }
    }

    /// Boxes `value` for a later [`Index::replace`].
    pub fn prepare(&self, value: V) -> Prepared<V> {
        Prepared(Box::into_raw(Box::new(ValueBox { link: Link::new(), value })))
    }

    /// Replaces the value under `key` with a prepared one and returns (a clone of) the
    /// old value; if `key` has none, gives `value` back. Allocates nothing, frees
    /// nothing, takes no lock (a present key's leaf exists and cannot die under it):
    /// for a caller holding a lock that a signal handler may take.
    pub fn replace(&self, key: u64, value: Prepared<V>) -> Result<V, Prepared<V>> {
        let guard = self.reclaim.pin();
        let Some(path) = self.find(key, &guard) else { return Err(value) };
        // SAFETY: loaded under `guard`.
        let slot = &unsafe { guard.deref(path.leaf) }.slots[path.leaf_index];
        let mut current = slot.load(Acquire);
        loop {
            if current.is_null() {
                return Err(value);
            }
            match slot.compare_exchange(current, value.0, AcqRel, Acquire) {
                Ok(_) => {
                    // Published: the box now belongs to the index.
                    std::mem::forget(value);
                    // SAFETY: our CAS unlinked `current`; the new value holds its
                    // share of the leaf's count.
                    return Ok(unsafe { self.retire_value(current, &guard) });
                }
                Err(now) => current = now,
            }
        }
    }

    /// Allocation-free and lock-free, and frees nothing (what it unlinks is retired
    /// for a later `insert` or `reclaim` to free): safe on a signal handler's path,
    /// as `get`, `with` and `remove_if` are.
    pub fn remove(&self, key: u64) -> Option<V> {
        let guard = self.reclaim.pin();
        let path = self.find(key, &guard)?;
        // SAFETY: loaded under `guard`.
        let slot = &unsafe { guard.deref(path.leaf) }.slots[path.leaf_index];
        // Look first: removing an absent key should not dirty the leaf's line.
        if slot.load(Relaxed).is_null() {
            return None;
        }
        let old = slot.swap(null_mut(), AcqRel);
        if old.is_null() {
            return None;
        }
        // SAFETY: our swap unlinked `old`.
        Some(unsafe { self.finish_removal(&path, old, &guard) })
    }

    /// Remove only if `pred` holds for the current value (writeback's
    /// `entry == xa_load()` re-check). `pred` sees the value present when the
    /// call looked; if another writer replaces or removes it before the removal
    /// commits (a CAS on the slot), nothing is removed and `None` is returned.
    /// That is exact for an identity test like writeback's, the intended use:
    /// a replacement is by definition not the entry the caller meant.
    pub fn remove_if(&self, key: u64, pred: impl FnOnce(&V) -> bool) -> Option<V> {
        let guard = self.reclaim.pin();
        let path = self.find(key, &guard)?;
        // SAFETY: loaded under `guard`.
        let slot = &unsafe { guard.deref(path.leaf) }.slots[path.leaf_index];
        let current = slot.load(Acquire);
        if current.is_null() {
            return None;
        }
        // SAFETY: loaded under `guard`.
        if !pred(&unsafe { guard.deref(current) }.value) {
            return None;
        }
        slot.compare_exchange(current, null_mut(), AcqRel, Relaxed).ok()?;
        // SAFETY: our CAS unlinked `current`.
        Some(unsafe { self.finish_removal(&path, current, &guard) })
    }

    pub fn len(&self) -> usize {
        self.sum(|c| &c.entries)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of memory the index itself holds (directory, shards, nodes and
    /// value boxes), as glibc malloc hands them out. Nodes and values waiting
    /// for the epoch grace period are not counted.
    pub fn memory_bytes(&self) -> usize {
        self.stats().memory_bytes
    }

    /// Entries, nodes, shards and memory in one reading.
    pub fn stats(&self) -> IndexStats {
        let entries = self.sum(|c| &c.entries);
        let nodes = self.sum(|c| &c.nodes);
        let shards = self.sum(|c| &c.shards);
        let fixed = size_of::<Self>()
            + malloc_footprint(self.directory.len() * size_of::<AtomicPtr<Shard<V>>>())
            + malloc_footprint(self.counters.len() * size_of::<CachePadded<Counters>>());
        let memory_bytes = fixed
            + shards * malloc_footprint(size_of::<Shard<V>>())
            + nodes * malloc_footprint(size_of::<Leaf<V>>())
            + entries * malloc_footprint(size_of::<ValueBox<V>>());
        IndexStats { entries, nodes, shards, memory_bytes }
    }

    fn counters(&self) -> &Counters {
        &self.counters[stripe()]
    }

    fn sum(&self, field: impl Fn(&Counters) -> &AtomicIsize) -> usize {
        let total: isize = self.counters.iter().map(|c| field(c).load(Relaxed)).sum();
        total.max(0) as usize
    }

    fn bucket(&self, shard_id: u64) -> &AtomicPtr<Shard<V>> {
        let hash = shard_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - DIRECTORY_BITS);
        &self.directory[hash as usize]
    }

    fn find_shard(&self, shard_id: u64) -> Option<&Shard<V>> {
        Self::search_chain(self.bucket(shard_id).load(Acquire), shard_id)
    }

    fn search_chain<'a>(mut shard: *mut Shard<V>, shard_id: u64) -> Option<&'a Shard<V>> {
        while !shard.is_null() {
            // SAFETY: shards are published with Release and freed only by Drop.
            let s = unsafe { &*shard };
            if s.id == shard_id {
                return Some(s);
            }
            shard = s.next;
        }
        None
    }

    fn shard_or_create(&self, shard_id: u64) -> &Shard<V> {
        let bucket = self.bucket(shard_id);
        let mut head = bucket.load(Acquire);
        let mut fresh: *mut Shard<V> = null_mut();
        loop {
            // Search the very chain we are about to push onto: a shard pushed
            // since an earlier look must be found, not duplicated.
            if let Some(shard) = Self::search_chain(head, shard_id) {
                if !fresh.is_null() {
                    // SAFETY: never published.
                    drop(unsafe { Box::from_raw(fresh) });
                }
                return shard;
            }
            if fresh.is_null() {
                fresh = Box::into_raw(Box::new(Shard {
                    id: shard_id,
                    next: null_mut(),
                    root: std::array::from_fn(|_| AtomicPtr::new(null_mut())),
                }));
            }
            // SAFETY: `fresh` is ours until the CAS publishes it.
            unsafe { (*fresh).next = head };
            match bucket.compare_exchange(head, fresh, Release, Acquire) {
                Ok(_) => {
                    self.counters().shards.fetch_add(1, Relaxed);
                    // SAFETY: published; lives until Drop.
                    return unsafe { &*fresh };
                }
                Err(now) => head = now,
            }
        }
    }

    /// The mid node for `root_index`, created if missing; true if we created it
    /// and so hold a reservation on it.
    fn mid_or_create(&self, shard: &Shard<V>, root_index: usize) -> (*mut Mid<V>, bool) {
        let slot = &shard.root[root_index];
        let mid = slot.load(Acquire);
        if !mid.is_null() {
            return (mid, false);
        }
        let fresh = Node::new_raw(1);
        match slot.compare_exchange(null_mut(), fresh, AcqRel, Acquire) {
            Ok(_) => {
                self.counters().nodes.fetch_add(1, Relaxed);
                (fresh, true)
            }
            Err(mid) => {
                // SAFETY: never published.
                drop(unsafe { Box::from_raw(fresh) });
                (mid, false)
            }
        }
    }

    /// The leaf for `mid_index`, created if missing; true if we created it and
    /// so hold a reservation on it. `None`: the mid node was condemned, restart.
    fn leaf_or_create(
        &self,
        shard: &Shard<V>,
        root_index: usize,
        mid: *mut Mid<V>,
        mid_reserved: bool,
        mid_index: usize,
        guard: &Guard<'_>,
    ) -> Option<(*mut Leaf<V>, bool)> {
        // SAFETY: loaded (or created) under `guard`.
        let mid_node = unsafe { guard.deref(mid) };
        let slot = &mid_node.slots[mid_index];
        let leaf = slot.load(Acquire);
        if !leaf.is_null() {
            if mid_reserved {
                // Someone filled our brand-new mid node first.
                self.release_mid(shard, root_index, mid, guard);
            }
            return Some((leaf, false));
        }
        if !mid_reserved && !mid_node.reserve() {
            self.unlink_mid(shard, root_index, mid, guard);
            return None;
        }
        let fresh = Node::new_raw(1);
        match slot.compare_exchange(null_mut(), fresh, AcqRel, Acquire) {
            Ok(_) => {
                self.counters().nodes.fetch_add(1, Relaxed);
                Some((fresh, true))
            }
            Err(leaf) => {
                // SAFETY: never published.
                drop(unsafe { Box::from_raw(fresh) });
                self.release_mid(shard, root_index, mid, guard);
                // `leaf` may since have been condemned; reserving it will tell.
                Some((leaf, false))
            }
        }
    }

    fn find<'g>(&'g self, key: u64, guard: &'g Guard<'_>) -> Option<Path<'g, V>> {
        let (shard_id, root_index, mid_index, leaf_index) = split_key(key);
        let shard = self.find_shard(shard_id)?;
        let mid = shard.root[root_index].load(Acquire);
        if mid.is_null() {
            return None;
        }
        // SAFETY: loaded under `guard`.
        let leaf = unsafe { guard.deref(mid) }.slots[mid_index].load(Acquire);
        if leaf.is_null() {
            return None;
        }
        Some(Path { shard, root_index, mid, mid_index, leaf, leaf_index })
    }

    /// Accounts for a value that our swap/CAS took out of `path`'s leaf.
    ///
    /// # Safety
    /// `value` was loaded under `guard` and the caller unlinked it.
    unsafe fn finish_removal(&self, path: &Path<'_, V>, value: *mut ValueBox<V>, guard: &Guard<'_>) -> V {
        self.counters().entries.fetch_sub(1, Relaxed);
        let previous = self.retire_value(value, guard);
        if guard.deref(path.leaf).release() {
            self.unlink_leaf(path, guard);
        }
        previous
    }

    /// Clones a value just unlinked from its slot and schedules the original's
    /// destruction after the grace period.
    ///
    /// # Safety
    /// `value` was loaded under `guard` and the caller's swap/CAS unlinked it.
    unsafe fn retire_value(&self, value: *mut ValueBox<V>, guard: &Guard<'_>) -> V {
        let boxed = guard.deref(value);
        let copy = boxed.value.clone();
        self.reclaim.retire(value as usize | RETIRED_VALUE, &boxed.link);
        copy
    }

    /// Unlinks a condemned leaf (we condemned it, or found it condemned) and
    /// releases its parent.
    fn unlink_leaf(&self, path: &Path<'_, V>, guard: &Guard<'_>) {
        // SAFETY: loaded under `guard`.
        let mid = unsafe { guard.deref(path.mid) };
        debug_assert!(unsafe { guard.deref(path.leaf) }.is_dead());
        if mid.slots[path.mid_index].compare_exchange(path.leaf, null_mut(), AcqRel, Relaxed).is_ok() {
            self.counters().nodes.fetch_sub(1, Relaxed);
            // SAFETY: we unlinked it; a condemned node has only null slots.
            unsafe { self.reclaim.retire(path.leaf as usize | RETIRED_LEAF, &guard.deref(path.leaf).link) };
            self.release_mid(path.shard, path.root_index, path.mid, guard);
        }
    }

    fn release_mid(&self, shard: &Shard<V>, root_index: usize, mid: *mut Mid<V>, guard: &Guard<'_>) {
        // SAFETY: loaded under `guard`.
        if unsafe { guard.deref(mid) }.release() {
            self.unlink_mid(shard, root_index, mid, guard);
        }
    }

    fn unlink_mid(&self, shard: &Shard<V>, root_index: usize, mid: *mut Mid<V>, guard: &Guard<'_>) {
        debug_assert!(unsafe { guard.deref(mid) }.is_dead());
        if shard.root[root_index].compare_exchange(mid, null_mut(), AcqRel, Relaxed).is_ok() {
            self.counters().nodes.fetch_sub(1, Relaxed);
            // SAFETY: we unlinked it; a condemned node has only null slots.
            unsafe { self.reclaim.retire(mid as usize | RETIRED_MID, &guard.deref(mid).link) };
        }
    }
}

impl<V: Clone + Send + Sync + 'static> Default for Index<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> Drop for Index<V> {
    fn drop(&mut self) {
        // `&mut self`: no reader or writer is left, so free directly.
        fn linked<T>(slots: &[AtomicPtr<T>]) -> impl Iterator<Item = *mut T> + '_ {
            slots.iter().map(|slot| slot.load(Relaxed)).filter(|p| !p.is_null())
        }
        for bucket in self.directory.iter() {
            let mut shard = bucket.load(Relaxed);
            while !shard.is_null() {
                // SAFETY: every pointer below is linked, owned by the index and
                // reachable only from here.
                let owned = unsafe { Box::from_raw(shard) };
                for mid in linked(&owned.root) {
                    let mid = unsafe { Box::from_raw(mid) };
                    for leaf in linked(&mid.slots) {
                        let leaf = unsafe { Box::from_raw(leaf) };
                        for value in linked(&leaf.slots) {
                            drop(unsafe { Box::from_raw(value) });
                        }
                    }
                }
                shard = owned.next;
            }
        }
        // SAFETY: no guard is left; everything retired came from this index.
        self.reclaim.reclaim_all(|tagged| unsafe { destroy::<V>(tagged) });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn key_split_covers_all_bits() {
        let key = 0xDEAD_BEEF_1234_5678u64;
        let (shard, r, m, l) = split_key(key);
        let rebuilt = (shard << SHARD_BITS)
            | ((r as u64) << (2 * LEVEL_BITS))
            | ((m as u64) << LEVEL_BITS)
            | l as u64;
        assert_eq!(rebuilt, key);
    }

    #[test]
    fn malloc_footprint_matches_glibc_classes() {
        assert_eq!(malloc_footprint(0), 0);
        assert_eq!(malloc_footprint(8), 32);
        assert_eq!(malloc_footprint(24), 32);
        assert_eq!(malloc_footprint(25), 48);
        assert_eq!(malloc_footprint(520), 528);
    }

    #[test]
    fn nodes_are_freed_when_emptied() {
        let index = Index::<u64>::new();
        let empty = index.stats();
        for key in 0..10_000u64 {
            assert_eq!(index.insert(key * 7, key), None);
        }
        let full = index.stats();
        assert_eq!(full.entries, 10_000);
        assert!(full.nodes > 10_000 * 7 / 64);
        for key in 0..10_000u64 {
            assert_eq!(index.remove(key * 7), Some(key));
        }
        let after = index.stats();
        assert_eq!(after.entries, 0);
        assert_eq!(after.nodes, 0, "emptied nodes must be unlinked");
        assert_eq!(after.shards, full.shards, "shards stay until drop");
        assert_eq!(
            after.memory_bytes - empty.memory_bytes,
            full.shards * malloc_footprint(size_of::<Shard<u64>>())
        );
    }

    #[test]
    fn dense_keys_cost_about_a_slot_plus_a_box() {
        let index = Index::<u64>::new();
        let n = 1u64 << 16;
        let base = index.memory_bytes();
        for key in 0..n {
            index.insert(key, key);
        }
        let per_entry = (index.memory_bytes() - base) as f64 / n as f64;
        // 528/64 = 8.25 B of leaf, 32 B box, mids + one shard ~0.14 B.
        assert!((40.0..41.0).contains(&per_entry), "{per_entry} B per entry");
    }
}
