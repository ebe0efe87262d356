//! uzswap-pool: our zsmalloc — a compact pool of variable-size objects.
//!
//! # What it is for, and what it is not
//! The store keeps every encoded folio here: objects from a few bytes up to
//! [`Pool::MAX_OBJECT_SIZE`] (a 2 MiB folio plus a header). The pool packs them
//! tightly, lets readers in without a global lock, moves objects to give memory back
//! ([`Pool::compact`]), and says exactly how much memory it holds
//! ([`Pool::total_size`], zswap's `pool_total_size`). It knows nothing of what the
//! bytes mean, of limits or of eviction: the store decides what to keep.
//!
//! # Structures
//! - **Size classes** (`class`): 16 B steps up to 4 KiB, then 64 steps per doubling
//!   up to 128 KiB. Each class has a **span** length, a whole number of pages chosen to
//!   waste the least of the span's tail (up to 128 KiB, or 8 objects for big classes);
//!   objects are laid end to end and straddle page boundaries, as in a zspage. Classes
//!   with the same geometry are merged, as in zsmalloc.
//! - **Spans**: one contiguous anonymous `mmap` each. A span's bookkeeping (reverse map
//!   position -> handle, chain of free positions, fullness) sits in the **span table**,
//!   whose slots also hold the span's lock. Partial spans are on one of 8 lists per
//!   class by fullness (zsmalloc's fullness groups); full spans are on none; a span that
//!   becomes empty is unmapped at once.
//! - **Large objects** (over 128 KiB): a dedicated page-rounded mapping each; at that
//!   size page rounding costs less than class rounding, and they are never moved.
//! - **Handles**: an index into the **handle table** (zsmalloc's `zs_handle` slab). Its
//!   64-bit word holds the object's exact size, span and position, so objects carry no
//!   header; compaction moves an object by rewriting its word. A 4-bit generation in
//!   the word and the handle catches most uses of a freed handle. Freed handles are
//!   reused first (per-class chains, then a pool-wide spare chain).
//!
//! # Accounting
//! `total_size` counts what the process really holds for the pool: the pages of a span
//! that have been written to (a span fills from its start, and compaction gives the
//! unused tail of a span back with `MADV_DONTNEED`), large objects' mappings, the
//! handle table's pages under its high-water mark, the span table and reverse maps,
//! and the pool's fixed structures. A span's untouched pages are address space only
//! and are not counted. Spans ask for no transparent huge pages, so what is counted is
//! what is resident. The handle and span tables keep their high-water size (a few
//! bytes per object that was ever live at once), like the kernel's slabs of handles.
//!
//! # Locking
//! - **Class lock** (a mutex per class): allocation and freeing of positions, the
//!   class's lists, the bookkeeping of its spans, and moves within the class. Objects of
//!   different classes never share it. It is never held while user code runs.
//! - **Span lock** (a rwlock per span, zsmalloc's zspage lock): shared by everyone who
//!   reads or writes an object in the span, exclusive for moving objects out of it.
//! - **Migrate lock** (a mutex): one compaction at a time. Unlike zsmalloc's pool
//!   lock, readers and frees never take it.
//! - Leaf locks: the span id allocator, the handle table's growth and spare chain.
//!
//! Order: migrate -> class -> span (exclusive) -> leaves. A reader takes only its
//! object's span lock, shared; it finds the span through the handle's word and then
//! checks that the word did not change (the move protocol in `access`), so a reader
//! never sees a half-moved object, and readers of different spans never meet.
//!
//! # Life cycle of an object
//! - `store`: under the class lock, take a handle and a position in the fullest
//!   partial span (mapping a new span if none) and publish the word; then copy the
//!   bytes in under the span's shared lock, as a reader would. Compaction may move the
//!   position in between; the copy follows the word. Empty objects (size 0) are
//!   allowed and take only a handle.
//! - `read`: pin the object (span lock shared), run the closure on its bytes, unpin.
//! - `free`: under the class lock, free the position and the handle; unmap the span
//!   if it became empty. A handle that is not live (never issued, already freed, or of
//!   another generation) is ignored by `free` and reported by [`Pool::try_free`].
//! - `compact`: per class, move objects from the emptiest partial spans into the
//!   fullest until one partial span is left, unmapping the spans that empty; then pack
//!   the objects of that last span at its front and give back its pages behind them.
//!   Each source span is done under one hold of the class lock and its own span lock
//!   (exclusive); the class lock is dropped between spans so stores and frees of the
//!   class get in.
//!
//! On a signal handler's path (the runtime's SIGBUS loads) only `read` runs: it
//! allocates nothing, and its one lock is the span's std rwlock (futex-based: no
//! allocation to wait, a bounded wait on a move in progress). `store`, `free` and
//! `compact` may allocate or free (span tables, reverse maps, mappings) and take the
//! class locks, so the store keeps them off that path (it defers frees).
//!
//! The closure given to `read` must not call back into the pool: it runs under a span
//! lock that a compaction may be waiting for while holding a class lock.
//!
//! All locking is plain mutexes and rwlocks except the handle word's validate-after-
//! lock protocol, which has a loom model: `RUSTFLAGS="--cfg loom"
//! CARGO_TARGET_DIR=target/loom cargo test -p uzswap-pool --lib --release loom`.

mod access;
mod class;
mod handles;
mod spans;
mod sys;
mod word;

use access::{relocate, with_pinned, RwSpanLock, SpanLock};
use class::{ClassInfo, ClassTable};
use handles::{FreeChain, HandleTable};
use uzswap_sync::Mutex;
use spans::{SpanTable, FREE_POS, NO_POS, NO_SPAN, UNLISTED};
use std::sync::atomic::{AtomicU64, Ordering};
use word::{next_gen, Location};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Handle(pub u64);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("object of {0} bytes is larger than the pool's maximum")]
    TooLarge(usize),
    #[error("out of memory")]
    OutOfMemory,
    /// The handle names no live object: never issued, already freed, or reused since.
    #[error("invalid or stale pool handle")]
    InvalidHandle,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Live objects.
    pub objects: u64,
    /// Sum of live object sizes as passed to `store`.
    pub object_bytes: u64,
    /// Bytes of memory held from the system (spans, large objects, handle tables, metadata).
    pub total_size: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactStats {
    pub moved_objects: u64,
    pub freed_bytes: u64,
}

/// Fullness groups of partial spans per class.
const GROUPS: usize = 8;
/// Free handles a class keeps for itself before handing half to the spare chain.
const CLASS_HANDLE_CACHE: u32 = 64;

struct SizeClass {
    info: ClassInfo,
    state: Mutex<ClassState>,
    objects: AtomicU64,
    object_bytes: AtomicU64,
}

struct ClassState {
    /// Heads of the partial-span lists, emptiest group first.
    partial: [u32; GROUPS],
    /// This class's free handles.
    handles: FreeChain,
}

pub struct Pool {
    table: &'static ClassTable,
    classes: Box<[SizeClass]>,
    spans: SpanTable,
    handles: HandleTable,
    /// Bytes held, except the handle table's pages (which it counts itself).
    held: AtomicU64,
    /// Empty and large objects, which belong to no class.
    unclassed_objects: AtomicU64,
    unclassed_bytes: AtomicU64,
    migrate: Mutex<()>,
}

impl Pool {
    pub fn new() -> Self {
        let table = ClassTable::get();
        let classes: Box<[SizeClass]> = table
            .classes
            .iter()
            .map(|&info| SizeClass {
                info,
                state: Mutex::new(ClassState {
                    partial: [NO_SPAN; GROUPS],
                    handles: FreeChain::default(),
                }),
                objects: AtomicU64::new(0),
                object_bytes: AtomicU64::new(0),
            })
            .collect();
        let fixed = std::mem::size_of::<Pool>() + std::mem::size_of_val(&*classes);
        Pool {
            table,
            classes,
            spans: SpanTable::new(),
            handles: HandleTable::new(),
            held: AtomicU64::new(fixed as u64),
            unclassed_objects: AtomicU64::new(0),
            unclassed_bytes: AtomicU64::new(0),
            migrate: Mutex::new(()),
        }
    }

    /// Largest object `store` accepts.
    pub const MAX_OBJECT_SIZE: usize = 2 * 1024 * 1024 + 64 * 1024;

    /// Allocate an object and copy `data` into it (zs_malloc + zs_obj_write).
    /// Empty objects are allowed.
    pub fn store(&self, data: &[u8]) -> Result<Handle, PoolError> {
        let size = data.len();
        if size > Self::MAX_OBJECT_SIZE {
            return Err(PoolError::TooLarge(size));
        }
        match self.table.class_of(size) {
            Some(class) => self.store_in_class(class, data),
            None => self.store_unclassed(data),
        }
    }

    /// Run `f` on the object's bytes; they may move once `f` returns (zs_obj_read_begin/end).
    ///
    /// `f` must not call into the pool. Panics if the handle names no live object; see
    /// [`Pool::try_read`].
    pub fn read<R>(&self, handle: Handle, f: impl FnOnce(&[u8]) -> R) -> R {
        match self.try_read(handle, f) {
            Ok(result) => result,
            Err(err) => panic!("uzswap-pool: read of {handle:?}: {err}"),
        }
    }

    /// [`Pool::read`], with an error for a handle that names no live object.
    pub fn try_read<R>(&self, handle: Handle, f: impl FnOnce(&[u8]) -> R) -> Result<R, PoolError> {
        let (index, gen) = handle.parts().ok_or(PoolError::InvalidHandle)?;
        let word = self.handles.slot(index).ok_or(PoolError::InvalidHandle)?;
        with_pinned(
            word,
            |w| self.pin_lock(w),
            |w| {
                let loc = Location::decode(w)
                    .filter(|l| l.gen == gen)
                    .ok_or(PoolError::InvalidHandle)?;
                // SAFETY: `loc` is live and pinned (its span lock is held shared, or it
                // never moves); the caller does not free it while reading.
                Ok(f(unsafe {
                    std::slice::from_raw_parts(self.object_ptr(loc), loc.size)
                }))
            },
        )
    }

    /// Where the object's bytes are now (address, length): for a caller that keeps
    /// the pool from moving or freeing anything until it is done with them (the
    /// store's freeze, around fork: a forked child reads its copy of them there).
    pub fn object_addr(&self, handle: Handle) -> Result<(usize, usize), PoolError> {
        let (index, gen) = handle.parts().ok_or(PoolError::InvalidHandle)?;
        let word = self.handles.slot(index).ok_or(PoolError::InvalidHandle)?;
        let loc = Location::decode(word.load(std::sync::atomic::Ordering::Acquire))
            .filter(|l| l.gen == gen)
            .ok_or(PoolError::InvalidHandle)?;
        Ok((self.object_ptr(loc) as usize, loc.size))
    }

    /// Every mapping the pool holds (spans and large objects), as (address, length).
    ///
    /// # Safety
    /// No span may be mapped or unmapped meanwhile: nothing stores, frees or
    /// compacts until the caller is done with the list (the store's freeze).
    pub unsafe fn mappings(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for id in 0..self.spans.issued() {
            let slot = self.spans.get(id);
            let base = slot.base();
            if !base.is_null() {
                // SAFETY: the caller keeps every span as it is, so its bookkeeping is
                // not being changed under us.
                out.push((base as usize, unsafe { slot.meta() }.map_len));
            }
        }
        out
    }

    /// Frees the object. A handle that names no live object is ignored (see
    /// [`Pool::try_free`]); a stale handle whose slot was reused 16 times since is
    /// indistinguishable from the new owner's and frees it, as in zsmalloc.
    pub fn free(&self, handle: Handle) {
        let _ = self.try_free(handle);
    }

    /// [`Pool::free`], with an error for a handle that names no live object.
    pub fn try_free(&self, handle: Handle) -> Result<(), PoolError> {
        let (index, gen) = handle.parts().ok_or(PoolError::InvalidHandle)?;
        let word = self.handles.slot(index).ok_or(PoolError::InvalidHandle)?;
        let live = |w: u64| Location::decode(w).filter(|l| l.gen == gen);
        let loc = live(word.load(Ordering::Acquire)).ok_or(PoolError::InvalidHandle)?;
        let Some(class_index) = self.table.class_of(loc.size) else {
            return self.free_unclassed(index, word, loc);
        };
        let class = &self.classes[class_index];
        let mut state = class.state.lock();
        // Only holders of this class lock rewrite a live word of this class; read it
        // again in case the object moved, or a racing free got here first.
        let loc = live(word.load(Ordering::Acquire))
            .filter(|l| self.table.class_of(l.size) == Some(class_index))
            .ok_or(PoolError::InvalidHandle)?;
        if self.free_position(&mut state, class, loc.span, loc.pos) {
            self.release_span(&mut state, class, loc.span);
        }
        state.handles.push(&self.handles, index, next_gen(gen));
        if state.handles.len() > CLASS_HANDLE_CACHE {
            let surplus = state.handles.take(&self.handles, CLASS_HANDLE_CACHE / 2);
            self.handles.spare.lock().append(&self.handles, surplus);
        }
        class.objects.fetch_sub(1, Ordering::Relaxed);
        class
            .object_bytes
            .fetch_sub(loc.size as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Move objects out of sparse spans into fuller ones and give empty spans back.
    pub fn compact(&self) -> CompactStats {
        let _migrate = self.migrate.lock();
        let mut stats = CompactStats::default();
        for class in self.classes.iter() {
            self.compact_class(class, &mut stats);
        }
        // Moves may have touched more than was freed: then nothing was given back.
        if stats.freed_bytes > i64::MAX as u64 {
            stats.freed_bytes = 0;
        }
        // Let handles freed in one class serve stores in any other.
        for class in self.classes.iter() {
            let mut state = class.state.lock();
            let len = state.handles.len();
            if len > 0 {
                let chain = state.handles.take(&self.handles, len);
                self.handles.spare.lock().append(&self.handles, chain);
            }
        }
        stats
    }

    /// pool_total_size: bytes of memory the pool really holds.
    pub fn total_size(&self) -> u64 {
        self.held.load(Ordering::Relaxed) + self.handles.resident_bytes()
    }

    pub fn stats(&self) -> PoolStats {
        let (mut objects, mut object_bytes) = (
            self.unclassed_objects.load(Ordering::Relaxed),
            self.unclassed_bytes.load(Ordering::Relaxed),
        );
        for class in self.classes.iter() {
            objects += class.objects.load(Ordering::Relaxed);
            object_bytes += class.object_bytes.load(Ordering::Relaxed);
        }
        PoolStats {
            objects,
            object_bytes,
            total_size: self.total_size(),
        }
    }

    // ---- store and free paths ----

    fn store_in_class(&self, class_index: usize, data: &[u8]) -> Result<Handle, PoolError> {
        let class = &self.classes[class_index];
        let (index, gen) = {
            let mut state = class.state.lock();
            let (index, gen) = self.take_handle(&mut state.handles)?;
            let (span, pos) = match self.alloc_position(&mut state, class, index) {
                Ok(place) => place,
                Err(err) => {
                    state.handles.push(&self.handles, index, gen);
                    return Err(err);
                }
            };
            let loc = Location {
                gen,
                size: data.len(),
                span,
                pos,
            };
            self.word(index).store(loc.encode(), Ordering::Release);
            class.objects.fetch_add(1, Ordering::Relaxed);
            class
                .object_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            (index, gen)
        };
        // The copy runs outside the class lock, pinned like a read: if compaction moved
        // the (still unwritten) object meanwhile, the word says where it went.
        with_pinned(
            self.word(index),
            |w| self.pin_lock(w),
            |w| {
                let loc = Location::decode(w).expect("a store's own object stays live");
                // SAFETY: the position is ours and pinned; nobody else writes it.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), self.object_ptr(loc), data.len())
                };
            },
        );
        Ok(Handle::new(index, gen))
    }

    /// Empty objects (no memory) and large ones (a mapping of their own).
    fn store_unclassed(&self, data: &[u8]) -> Result<Handle, PoolError> {
        let size = data.len();
        let span = if size == 0 {
            0
        } else {
            let len = sys::round_up_to_page(size);
            let base = sys::map(len)?;
            // SAFETY: a fresh mapping of at least `size` bytes.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.as_ptr(), size) };
            let span = match self.spans.alloc(&self.held) {
                Ok(span) => span,
                Err(err) => {
                    // SAFETY: ours, unreferenced.
                    unsafe { sys::unmap(base, len) };
                    return Err(err);
                }
            };
            let slot = self.spans.get(span);
            // SAFETY: a freshly allocated id is ours.
            unsafe { slot.meta() }.map_len = len;
            slot.set_base(base.as_ptr());
            self.held.fetch_add(len as u64, Ordering::Relaxed);
            span
        };
        let taken = {
            let mut spare = self.handles.spare.lock();
            match spare.pop(&self.handles) {
                Some(handle) => Ok(handle),
                None => self.handles.fresh().map(|index| (index, 0)),
            }
        };
        let (index, gen) = match taken {
            Ok(handle) => handle,
            Err(err) => {
                if size > 0 {
                    self.release_large(span);
                }
                return Err(err);
            }
        };
        let loc = Location {
            gen,
            size,
            span,
            pos: 0,
        };
        self.word(index).store(loc.encode(), Ordering::Release);
        self.unclassed_objects.fetch_add(1, Ordering::Relaxed);
        self.unclassed_bytes
            .fetch_add(size as u64, Ordering::Relaxed);
        Ok(Handle::new(index, gen))
    }

    fn free_unclassed(&self, index: u32, word: &AtomicU64, loc: Location) -> Result<(), PoolError> {
        // Claim the word first, so of two racing frees only one goes on.
        let gen = next_gen(loc.gen);
        word.compare_exchange(
            loc.encode(),
            word::free_word(gen, None),
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .map_err(|_| PoolError::InvalidHandle)?;
        if loc.size > 0 {
            self.release_large(loc.span);
        }
        self.handles.spare.lock().push(&self.handles, index, gen);
        self.unclassed_objects.fetch_sub(1, Ordering::Relaxed);
        self.unclassed_bytes
            .fetch_sub(loc.size as u64, Ordering::Relaxed);
        Ok(())
    }

    fn release_large(&self, span: u32) {
        let slot = self.spans.get(span);
        // SAFETY: the caller owns this large object's span.
        let len = unsafe { slot.meta() }.map_len;
        let base = slot.base();
        slot.set_base(std::ptr::null_mut());
        // SAFETY: mapped by `store_unclassed` with this length; its object is gone.
        unsafe {
            sys::unmap(
                std::ptr::NonNull::new(base).expect("large span is mapped"),
                len,
            )
        };
        self.held.fetch_sub(len as u64, Ordering::Relaxed);
        self.spans.free(span);
    }

    /// A free handle for a store in a class: the class's own, else a batch from the
    /// spare chain, else a never-used one.
    fn take_handle(&self, cache: &mut FreeChain) -> Result<(u32, u8), PoolError> {
        if let Some(handle) = cache.pop(&self.handles) {
            return Ok(handle);
        }
        let batch = self
            .handles
            .spare
            .lock()
            .take(&self.handles, CLASS_HANDLE_CACHE / 2);
        cache.append(&self.handles, batch);
        match cache.pop(&self.handles) {
            Some(handle) => Ok(handle),
            None => Ok((self.handles.fresh()?, 0)),
        }
    }

    fn word(&self, index: u32) -> &AtomicU64 {
        self.handles.slot(index).expect("handle index was issued")
    }

    /// The lock that pins the object a word names, if that object can move.
    fn pin_lock(&self, word: u64) -> Option<&RwSpanLock> {
        let loc = Location::decode(word)?;
        self.table
            .class_of(loc.size)
            .map(|_| &self.spans.get(loc.span).lock)
    }

    /// Address of a live object.
    fn object_ptr(&self, loc: Location) -> *mut u8 {
        match self.table.class_of(loc.size) {
            None if loc.size == 0 => std::ptr::NonNull::dangling().as_ptr(),
            None => self.spans.get(loc.span).base(),
            Some(class) => {
                let slot_size = self.table.classes[class].size as usize;
                // SAFETY: pos < objs_per_span, so the slot is inside the span.
                unsafe {
                    self.spans
                        .get(loc.span)
                        .base()
                        .add(loc.pos as usize * slot_size)
                }
            }
        }
    }

    // ---- spans of a class; all of these run under the class lock ----

    fn map_span(&self, class: &SizeClass) -> Result<u32, PoolError> {
        let info = class.info;
        let base = sys::map(info.span_bytes as usize)?;
        let id = match self.spans.alloc(&self.held) {
            Ok(id) => id,
            Err(err) => {
                // SAFETY: ours, unreferenced.
                unsafe { sys::unmap(base, info.span_bytes as usize) };
                return Err(err);
            }
        };
        let slot = self.spans.get(id);
        // SAFETY: a freshly allocated id is ours; the class lock guards it from now on.
        let meta = unsafe { slot.meta() };
        let objs = info.objs_per_span;
        meta.rmap = (0..objs)
            .map(|pos| FREE_POS | if pos + 1 < objs { pos + 1 } else { NO_POS })
            .collect();
        meta.map_len = info.span_bytes as usize;
        meta.touched_pages = 0;
        meta.inuse = 0;
        meta.free_pos = 0;
        meta.group = UNLISTED;
        slot.set_base(base.as_ptr());
        self.held.fetch_add(objs as u64 * 4, Ordering::Relaxed);
        Ok(id)
    }

    /// Unmaps an empty span and returns its id. Returns the bytes given back.
    fn release_span(&self, state: &mut ClassState, class: &SizeClass, id: u32) -> u64 {
        self.unlist(state, id);
        let slot = self.spans.get(id);
        // SAFETY: class lock held.
        let meta = unsafe { slot.meta() };
        debug_assert_eq!(meta.inuse, 0);
        let freed = meta.touched_pages as u64 * sys::page_size() as u64
            + class.info.objs_per_span as u64 * 4;
        meta.rmap = Box::new([]);
        meta.touched_pages = 0;
        let base = slot.base();
        slot.set_base(std::ptr::null_mut());
        // SAFETY: mapped by `map_span` with this length; no object is left in it, and a
        // reader holding a stale word never dereferences the base (it revalidates).
        unsafe {
            sys::unmap(
                std::ptr::NonNull::new(base).expect("span is mapped"),
                meta.map_len,
            )
        };
        self.held.fetch_sub(freed, Ordering::Relaxed);
        self.spans.free(id);
        freed
    }

    /// A position for handle `index` in the fullest partial span.
    fn alloc_position(
        &self,
        state: &mut ClassState,
        class: &SizeClass,
        index: u32,
    ) -> Result<(u32, u32), PoolError> {
        let id = match self.fullest_partial(state, NO_SPAN) {
            Some(id) => id,
            None => self.map_span(class)?,
        };
        Ok((id, self.alloc_position_in(state, class, id, index).0))
    }

    /// Takes a free position in span `id` for handle `index`; returns it and the
    /// bytes of pages it touched for the first time.
    fn alloc_position_in(
        &self,
        state: &mut ClassState,
        class: &SizeClass,
        id: u32,
        index: u32,
    ) -> (u32, u64) {
        // SAFETY: class lock held.
        let meta = unsafe { self.spans.get(id).meta() };
        let pos = meta.free_pos;
        debug_assert!(pos != NO_POS && meta.rmap[pos as usize] & FREE_POS != 0);
        meta.free_pos = meta.rmap[pos as usize] & !FREE_POS;
        meta.rmap[pos as usize] = index;
        meta.inuse += 1;
        let page = sys::page_size();
        let end_page = ((pos as usize + 1) * class.info.size as usize).div_ceil(page) as u32;
        let mut touched = 0;
        if end_page > meta.touched_pages {
            touched = u64::from(end_page - meta.touched_pages) * page as u64;
            self.held.fetch_add(touched, Ordering::Relaxed);
            meta.touched_pages = end_page;
        }
        self.regroup(state, class, id);
        (pos, touched)
    }

    /// Frees a position; true if the span is now empty (the caller releases it).
    fn free_position(&self, state: &mut ClassState, class: &SizeClass, id: u32, pos: u32) -> bool {
        // SAFETY: class lock held.
        let meta = unsafe { self.spans.get(id).meta() };
        debug_assert!(meta.rmap[pos as usize] & FREE_POS == 0);
        meta.rmap[pos as usize] = FREE_POS | meta.free_pos;
        meta.free_pos = pos;
        meta.inuse -= 1;
        if meta.inuse == 0 {
            return true;
        }
        self.regroup(state, class, id);
        false
    }

    /// Puts a span on the list its fullness calls for (none when full).
    fn regroup(&self, state: &mut ClassState, class: &SizeClass, id: u32) {
        let objs = class.info.objs_per_span;
        // SAFETY: class lock held.
        let (inuse, group) = {
            let meta = unsafe { self.spans.get(id).meta() };
            (meta.inuse, meta.group)
        };
        let want = if inuse == objs {
            UNLISTED
        } else {
            (inuse as usize * GROUPS / objs as usize) as u8
        };
        if want != group {
            self.unlist(state, id);
            if want != UNLISTED {
                self.list(state, want, id);
            }
        }
    }

    fn list(&self, state: &mut ClassState, group: u8, id: u32) {
        let head = state.partial[group as usize];
        {
            // SAFETY: class lock held; no other reference to this span's meta is alive.
            let meta = unsafe { self.spans.get(id).meta() };
            meta.group = group;
            meta.prev = NO_SPAN;
            meta.next = head;
        }
        if head != NO_SPAN {
            // SAFETY: as above, for the old head (a different span).
            unsafe { self.spans.get(head).meta() }.prev = id;
        }
        state.partial[group as usize] = id;
    }

    fn unlist(&self, state: &mut ClassState, id: u32) {
        let (group, prev, next) = {
            // SAFETY: class lock held.
            let meta = unsafe { self.spans.get(id).meta() };
            let links = (meta.group, meta.prev, meta.next);
            meta.group = UNLISTED;
            links
        };
        if group == UNLISTED {
            return;
        }
        if prev != NO_SPAN {
            // SAFETY: class lock held; a neighbour, not `id`.
            unsafe { self.spans.get(prev).meta() }.next = next;
        } else {
            state.partial[group as usize] = next;
        }
        if next != NO_SPAN {
            // SAFETY: as above.
            unsafe { self.spans.get(next).meta() }.prev = prev;
        }
    }

    fn fullest_partial(&self, state: &ClassState, except: u32) -> Option<u32> {
        for &head in state.partial.iter().rev() {
            let mut id = head;
            while id != NO_SPAN {
                if id != except {
                    return Some(id);
                }
                // SAFETY: class lock held.
                id = unsafe { self.spans.get(id).meta() }.next;
            }
        }
        None
    }

    fn emptiest_partial(&self, state: &ClassState) -> Option<u32> {
        state.partial.iter().copied().find(|&head| head != NO_SPAN)
    }

    // ---- compaction ----

    fn compact_class(&self, class: &SizeClass, stats: &mut CompactStats) {
        // Empty the emptiest spans into the fullest while two or more are partial.
        loop {
            let mut state = class.state.lock();
            let Some(source) = self.emptiest_partial(&state) else {
                return;
            };
            if self.fullest_partial(&state, source).is_none() {
                break;
            }
            self.drain_span(&mut state, class, source, stats);
        }
        let mut state = class.state.lock();
        if let Some(last) = self.emptiest_partial(&state) {
            self.pack_span(&mut state, class, last, stats);
        }
    }

    /// Moves the objects of `source` into the fullest other partial spans, from its
    /// last position down, until it is empty (then it is unmapped) or nothing else has
    /// room.
    fn drain_span(
        &self,
        state: &mut ClassState,
        class: &SizeClass,
        source: u32,
        stats: &mut CompactStats,
    ) {
        let source_slot = self.spans.get(source);
        let held = source_slot.lock.exclusive();
        let objs = class.info.objs_per_span;
        for pos in (0..objs).rev() {
            // SAFETY: class lock held; the reference is dropped before the move.
            let index = unsafe { source_slot.meta() }.rmap[pos as usize];
            if index & FREE_POS != 0 {
                continue;
            }
            let Some(target) = self.fullest_partial(state, source) else {
                break;
            };
            let (target_pos, touched) = self.alloc_position_in(state, class, target, index);
            // Moving into a fresh page of the target costs memory: count it against
            // what compaction frees, so `freed_bytes` is the net change. (Wrapping:
            // the span's release below adds more than moves into it ever touch.)
            stats.freed_bytes = stats.freed_bytes.wrapping_sub(touched);
            self.move_object(class, &held, index, source, pos, target, target_pos);
            stats.moved_objects += 1;
            if self.free_position(state, class, source, pos) {
                break;
            }
        }
        drop(held);
        // SAFETY: class lock held.
        if unsafe { source_slot.meta() }.inuse == 0 {
            stats.freed_bytes = stats.freed_bytes.wrapping_add(self.release_span(state, class, source));
        }
    }

    /// Packs the objects of span `id` into its first positions and gives back the
    /// pages behind the last one.
    fn pack_span(
        &self,
        _locked: &mut ClassState,
        class: &SizeClass,
        id: u32,
        stats: &mut CompactStats,
    ) {
        let slot = self.spans.get(id);
        let held = slot.lock.exclusive();
        let objs = class.info.objs_per_span;
        let is_free = |pos: u32| {
            // SAFETY: class lock held; the reference does not outlive the expression.
            unsafe { slot.meta() }.rmap[pos as usize] & FREE_POS != 0
        };
        let (mut low, mut high) = (0, objs - 1);
        while low < high {
            if !is_free(low) {
                low += 1;
            } else if is_free(high) {
                high -= 1;
            } else {
                // SAFETY: class lock held.
                let index = unsafe { slot.meta() }.rmap[high as usize];
                self.move_object(class, &held, index, id, high, id, low);
                // SAFETY: class lock held.
                let meta = unsafe { slot.meta() };
                meta.rmap[low as usize] = index;
                meta.rmap[high as usize] = FREE_POS;
                stats.moved_objects += 1;
            }
        }
        drop(held);
        // SAFETY: class lock held.
        let meta = unsafe { slot.meta() };
        let inuse = meta.inuse;
        for pos in inuse..objs {
            meta.rmap[pos as usize] = FREE_POS | if pos + 1 < objs { pos + 1 } else { NO_POS };
        }
        meta.free_pos = if inuse < objs { inuse } else { NO_POS };
        let page = sys::page_size();
        let keep = (inuse as usize * class.info.size as usize).div_ceil(page) as u32;
        if keep < meta.touched_pages {
            let bytes = (meta.touched_pages - keep) as usize * page;
            // SAFETY: page-aligned, inside the span, and past its last object; new
            // objects land there only under the class lock, which we hold.
            unsafe { sys::discard(slot.base().add(keep as usize * page), bytes) };
            meta.touched_pages = keep;
            self.held.fetch_sub(bytes as u64, Ordering::Relaxed);
            stats.freed_bytes = stats.freed_bytes.wrapping_add(bytes as u64);
        }
    }

    /// Copies object `index` from (source, pos) to the free (target, target_pos) and
    /// points its word there. The caller holds the class lock and `source`'s span lock
    /// exclusively, and fixes both spans' bookkeeping.
    #[allow(clippy::too_many_arguments)]
    fn move_object(
        &self,
        class: &SizeClass,
        source_held: &<RwSpanLock as SpanLock>::Exclusive<'_>,
        index: u32,
        source: u32,
        pos: u32,
        target: u32,
        target_pos: u32,
    ) {
        let word = self.word(index);
        let old = Location::decode(word.load(Ordering::Acquire)).expect("rmap names a live handle");
        debug_assert_eq!((old.span, old.pos), (source, pos));
        let slot_size = class.info.size as usize;
        // SAFETY: both positions are inside their spans and distinct; the source is
        // pinned exclusively by us, and the target position is named by no word yet.
        unsafe {
            let from = self.spans.get(source).base().add(pos as usize * slot_size);
            let to = self
                .spans
                .get(target)
                .base()
                .add(target_pos as usize * slot_size);
            std::ptr::copy_nonoverlapping(from, to, old.size);
        }
        relocate::<RwSpanLock, _>(
            source_held,
            word,
            Location {
                span: target,
                pos: target_pos,
                ..old
            }
            .encode(),
        );
    }
}

impl Default for Pool {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for id in 0..self.spans.issued() {
            let slot = self.spans.get(id);
            if let Some(base) = std::ptr::NonNull::new(slot.base()) {
                // SAFETY: `&mut self`: no reader or other owner is left.
                let len = unsafe { slot.meta() }.map_len;
                // SAFETY: a live span or large object mapped with this length.
                unsafe { sys::unmap(base, len) };
            }
        }
    }
}

#[cfg(test)]
mod tests;
