//! uzswap-runtime: managed memory regions on userfaultfd, with a budget, a reclaimer
//! (our kswapd) and fault handling that brings whole folios back from the store.
//!
//! # What it is for
//! A program creates regions (anonymous memory of any size, with a folio size from 4 KiB
//! to 2 MiB) from a [`Runtime`]. All regions of a runtime share one budget in bytes that
//! counts their resident pages plus the store's pool (`pool_total_size`), as a memory
//! cgroup charges zswap's pool. Beyond it, cold folios are compressed whole into the
//! store (uzswap-store) and come back, whole, on the next touch. It is not a general
//! allocator, and not transparent for memory it did not map (the preload shim is).
//!
//! # Structures
//! - [`Runtime`] (`Shared` inside): two userfaultfd contexts, the store, the budget
//!   counters (`resident`, `probation`), the stats, a pool of folio buffers for the
//!   SIGBUS path, the fault queue (queue.rs: each folio a fault brings in, in order, for
//!   the reclaimer's lists), and two threads: the *reader* and the *reclaimer* (with a
//!   compression helper beside it on machines with a second CPU).
//!   - the region context: every region registered MISSING, with EVENT_REMOVE, UNMAP and
//!     REMAP (and SIGBUS on the SIGBUS path). Its reader thread resolves faults (thread
//!     path) and handles events (both paths).
//!   - the staging context: each region's *shadow* (a mapping of the same length)
//!     registered WP-only, no events. UFFDIO_MOVE needs its destination registered with
//!     the context it is issued on, so a folio reaches the shadow by a MOVE issued on
//!     the staging context; and since that context has no REMOVE events, the reclaimer
//!     can MADV_DONTNEED the shadow without a round trip to the reader. It leaves the
//!     region first by a MOVE on the region context, into the *pivot* (an empty mapping
//!     registered there): only that one fails while a munmap of the program's is unread,
//!     so nothing the program maps at the unmapped addresses meanwhile is ever taken
//!     (reclaim.rs `take_out`).
//! - A region (`RegionInner`): base, length, folio size, shadow, and per folio one state
//!   byte, one `kept` flag (the store holds an entry under the folio's key) and one
//!   fault-in stamp (LRU order). The store key is `region id << 40 | folio index`. With
//!   `keep_clean` (default) the region is registered MISSING|WP.
//! - A global table of regions (fixed array of atomic pointers) for lookups by address
//!   from the reader and from the SIGBUS handler, with a reader count that a region
//!   removal waits out (RCU in small).
//!
//! # Life cycle of a folio
//! folio.rs owns it: the states (EMPTY, RESIDENT, CLEAN, PROBATION, SWAPPED, POISONED,
//! UNMAPPED, and BUSY = the folio lock), the transitions, and the budget charges and
//! kept copies each moves, in one table. In short: a fault brings an EMPTY folio in as
//! zeros and a SWAPPED one back from the store (RESIDENT, or CLEAN with its entry kept
//! when read); the reclaimer takes RESIDENT/CLEAN folios out to the shadow (PROBATION
//! with the `Probation` policy) and stores them (SWAPPED; a CLEAN one needs no
//! compression); MADV_DONTNEED, munmap and region drop take folios to EMPTY/UNMAPPED
//! and free their store entries; a fork hold brings every folio in.
//!
//! The invariant "every page in exactly one place", in the form clean retention needs
//! (the kernel's swap cache): a page is mapped, in flight, in the store, in the backing
//! file, or same-filled; *and* a CLEAN folio (or a PROBATION one with `kept`) may also
//! have a store entry, which is then byte for byte its content. That holds because
//! (1) a CLEAN folio's pages are all write-protected (COPY with UFFDIO_COPY_MODE_WP,
//! synchronous WP: no write completes without a fault), (2) the write fault frees the
//! entry under the folio lock before the protection is lifted, and the entry is only
//! ever reused under that lock in state CLEAN or PROBATION+kept; (3) pages that come
//! back writable (a MOVE back, a failed take-out) drop the entry first; (4) a bring-in
//! that stops half-way (EAGAIN: a drop queued meanwhile) leaves nothing writable: its
//! copies go in write-protected and are opened only once all are in, and a MOVE back
//! (only of a folio with no kept copy) stays where it got to, the folio locked, until
//! the rest follows (fault.rs `bring_back`, `move_back`). And it is checked, as the
//! price of a hole in it is a lost write (writes were lost so, and pages seen open with
//! no ioctl of ours on them): a CLEAN folio taken out for a clean eviction has its
//! bytes compared with the checksum of its copy noted when it was stored (reclaim.rs
//! `changed_since_stored`, `clean_changed`), so a write that got in however it did is
//! stored anew, never replaced by the old copy; a PARTIAL run's pages are read in the
//! pagemap before it goes out, and a folio with one not write-protected is brought in
//! whole instead (`still_protected`, `clean_unprotected`). Pages of a
//! RESIDENT folio may still be write-protected (a copy dropped by a partial DONTNEED):
//! their first write faults as RESIDENT and only unprotects. Synchronous WP rather than
//! WP-async + PAGEMAP_SCAN: with async the kernel resolves a write itself, and no
//! ordering of scan and MOVE closes the window between "not written" and "taken out".
//! The fault kind comes from the page-fault error code in the SIGBUS signal context
//! (x86-64) or the message flags (thread path); a write to a swapped-out folio takes
//! the entry (exclusive load), as the kernel's do_swap_page does for a write fault.
//!
//! # Locking
//! Whoever changes where a folio's data lives holds its lock (state BUSY), as the
//! kernel holds the folio lock; so the store sees store/load/invalidate of one key in
//! sequence. A fault on a BUSY folio waits (SIGBUS path: spins in the handler) or is
//! deferred (reader thread): it is never served twice or lost. The one rule that keeps
//! this deadlock-free: the reader thread never waits for anything (it defers and
//! retries), because a thread blocked in madvise/munmap on our region, and an ioctl
//! returning EAGAIN while such an event is unread, both wait for the reader. Everybody
//! else may wait for the reader while holding a folio lock.
//!
//! # Fault paths (chosen per runtime)
//! - [`FaultPath::Thread`]: the kernel queues the fault, the reader thread resolves it
//!   and wakes the faulting thread. Works for every access, including system calls
//!   (read(2) into a region, O_DIRECT) that touch a swapped-out page. Costs a thread
//!   round trip: about 35-70 us per fault here.
//! - [`FaultPath::Sigbus`] (UFFD_FEATURE_SIGBUS): the faulting thread gets SIGBUS and
//!   resolves the fault in its own handler: several times faster (5-15 us per fault
//!   here). The catch: a system call that touches a missing page fails with EFAULT
//!   instead of waiting, so a program must not hand swapped-out region memory to the
//!   kernel. With `keep_clean` a system call that writes into a CLEAN folio also gets
//!   EFAULT (a write-protect fault is a SIGBUS too).
//!
//! Both paths are async-signal-safe by construction, the handler and the reader alike
//! (the reader serves threads that may be stopped inside their malloc, holding its
//! lock). What they use, and why each is safe:
//! - no allocation and no free: folio buffers from a fixed pool (`BufferPool`), the
//!   reader's buffers made before it serves, store contexts reserved at start
//!   (`reserve_contexts`); the store defers its frees to `Store::reap`, which the
//!   reclaimer calls (uzswap-store's design comment);
//! - the folio lock (an atomic state byte; spinning, then sched_yield): never held by
//!   code a fault can interrupt on the same thread, since uzswap's own code does not
//!   touch managed memory while holding it;
//! - store locks (std futex mutexes, no allocation under them): held only for short
//!   sections by threads that never wait for a fault;
//! - waits on other threads are bounded: a busy folio's holder never waits for us; a
//!   fault past the budget sleeps for room on a futex word (`Charges::sleep_for_room`,
//!   woken as folios are freed) at most `THROTTLE_MAX`, and `ROOM_NAP` while the
//!   reclaimer is declared starved;
//! - system calls (ioctl, madvise, write, sched_yield, futex), all
//!   async-signal-safe.
//!
//! `tests/signal_safety.rs` checks the first with an allocator that aborts when called
//! on either path, also when the fault happens inside the program's own allocator.
//!
//! # Budget
//! Usage = resident folios + the store's pool (kept copies of clean folios included).
//! The reclaimer starts at the high watermark and works down to the low one (see
//! reclaim.rs: clean folios first, runs of contiguous folios in one MOVE/DONTNEED).
//! A fault that brings a folio in past `Shared::throttle_limit` (budget + 1/16) waits
//! for the reclaimer, asleep until a folio is freed (one fault woken per folio), for at
//! most 100 ms, and not at all when waiting cannot help: the pool alone is past the
//! limit, or the reclaimer has nothing left to evict. While faults wait, the reclaimer
//! takes clean folios first (no compression).
//!
//! In a group (`RuntimeConfig::group`, group.rs: `uzswap run`'s process tree) the
//! budget is this process's share of the group's, read from the group's ledger, which
//! the reclaimer also tells, every few ms, what this process holds and how cold its
//! coldest memory is; fault-in stamps come from the group's clock.
//!
//! # When something fails
//! The store may refuse a folio (compression failed, the pool is full and there is
//! nowhere to write back, the backing file is full or failing): the folio stays
//! resident, moved back untouched, counted `reject_reclaim_fail`; after a few refusals
//! in a row the reclaimer rests briefly (reclaim.rs), and marks itself stuck: faults
//! then run over the budget without waiting (`over_budget`) until it evicts again. A
//! fault that waited the whole throttle time while the reclaimer evicted nothing marks
//! it starved (of CPU, as under load): faults then wait 1 ms at most, not 100, until
//! it evicts again; they still give it the CPU, where running on left it none. A folio
//! the store cannot give back (an I/O error or a corrupt record in the backing file)
//! is never mapped with wrong bytes: it is poisoned (UFFDIO_POISON, state POISONED,
//! counted `poisoned`, said on stderr), so the program gets SIGBUS on access, as for
//! a hardware memory error. [`Runtime::set_budget`] changes the budget while running;
//! [`Runtime::pause_reclaimer`] is the test hook for a stalled reclaimer, and
//! `StoreConfig::faults` injects store failures (tests/faults.rs).
//!
//! # Changes to the mapping
//! MADV_DONTNEED/FREE (EVENT_REMOVE) and munmap (EVENT_UNMAP) free what the range held
//! in every tier: store entries are invalidated, probation pages discarded; a partly
//! dropped compressed folio keeps its entry, the dropped pages marked, and they come
//! in as zeros with it (folio.rs: the reader never fills a folio for a drop). A folio
//! the program unmapped part of is torn: its unmapped pages' addresses are no longer
//! ours (the program may map anything there again), so it is never taken out, and
//! whatever brings it in acts on its other pages only (region.rs). The
//! kernel zaps a mapped folio's pages only after the reader has read the event, on the
//! thread that called madvise, whenever that thread next runs; so the reader marks the
//! dropped pages *pending*, and a folio with pending pages is not taken out until
//! they are seen gone (pagemap, under the folio lock) or refilled by a fault of ours:
//! ordering, not a grace time (region.rs). MADV_FREE'd pages, which the kernel
//! may leave mapped, keep their content (as MADV_FREE allows) but lose any
//! clean copy. Holes left in a resident folio fault in as zeros. The thread blocked
//! in madvise is released by the read, before the event is processed: a SIGBUS fault
//! waits while the reader holds unprocessed range events (`events_busy`), and the
//! reader serves faults in arrival order behind pending ranges. mremap of a whole
//! region is followed (EVENT_REMAP). Of part of one, the kernel moves the pages in
//! place and the moved part becomes plain memory; if any of it was swapped out or on
//! probation (which the kernel cannot move), the program is stopped with a message
//! rather than read zeros there (fault.rs `remap`). fork: regions are
//! MADV_DONTFORK, so a child forked behind our back does not see them at all
//! (without that, it would silently read zeros for swapped-out pages); around a
//! fork, `fork.rs` hands them over, swapped-out folios carried encoded.

// Every unsafe block says why it is sound, every unsafe fn what it asks of callers.
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc, unsafe_op_in_unsafe_fn)]

mod fault;
pub mod fds;
pub mod fork;
mod folio;
pub mod gate;
mod moves;
pub mod own_maps;
mod pattern;
pub mod group;
mod policy;
mod queue;
pub mod ranges;
mod reclaim;
mod region;
mod registered;
mod stats;
mod settings;
pub mod shim_support;
pub mod trace;
pub(crate) mod uffd;

pub use uffd::Access as UffdAccess;
pub use stats::{group_stats_path, read_group_stats, read_stats, stats_dirs, stats_path, write_group_stats, GroupMemberStats, GroupStats, RuntimeStats, SizeStats};
#[doc(hidden)]
pub use fault::in_fault_handler;
/// For tests of what a fatal error does.
#[doc(hidden)]
pub use fault::fatal;
pub use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig};

use uzswap_sync::Mutex;
use region::*;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::Arc;
use std::thread::JoinHandle;

pub const MIN_FOLIO: usize = 4096;
pub const MAX_FOLIO: usize = 2 << 20;
/// Buffers for SIGBUS handlers: at most this many threads decompress at once.
const SIGBUS_BUFFERS: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPath {
    /// A handler thread reads the userfaultfd: slower, works for system calls too.
    Thread,
    /// The faulting thread resolves its own fault in a SIGBUS handler: faster, but a
    /// system call touching a swapped-out page gets EFAULT.
    Sigbus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Oldest fault-in first, compressed at once (the baseline).
    Fifo,
    /// Oldest fault-in first, through a probation step that catches hot folios.
    Probation,
}

/// A runtime's reclaimer starts evicting once its usage passes this share of its
/// budget (`RuntimeConfig::high_watermark_percent`'s default). The group's shares
/// (group.rs) leave every member at least the room to hold what it has below it.
pub const HIGH_WATERMARK_PERCENT: u8 = 90;

#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Resident pages of all regions plus the store's pool stay under this.
    pub budget_bytes: u64,
    pub fault_path: FaultPath,
    pub policy: ReclaimPolicy,
    /// Reclaim starts above this share of the budget...
    pub high_watermark_percent: u8,
    /// ...and stops below this one.
    pub low_watermark_percent: u8,
    /// Share of the budget kept on probation (Probation policy).
    pub probation_percent: u8,
    pub store: StoreConfig,
    /// Where the backing file goes; `None` for no writeback (the pool then grows
    /// until the budget stops it).
    pub writeback_dir: Option<std::path::PathBuf>,
    /// With a backing file, the pool's share of the budget (zswap's
    /// `max_pool_percent`); past it the coldest entries are written back.
    pub max_pool_percent: u8,
    /// Largest size the backing file may grow to.
    pub backing_max_bytes: u64,
    /// Publish live stats to [`stats_path`] (about once a second).
    pub publish_stats: bool,
    /// Keep a folio's store entry when a read fault brings it back, and map it
    /// write-protected (the kernel's swap cache, zswap's non-exclusive load): evicting
    /// it again while it is clean costs no compression. The price: its first write
    /// takes one more fault, and the pool holds copies of clean resident folios. On the
    /// SIGBUS path a system call that *writes* into a clean folio gets EFAULT, as one
    /// touching a swapped-out folio does; turn this off if that matters.
    pub keep_clean: bool,
    /// Partial swap-in (folio.rs): a read at random in a swapped-out folio maps only
    /// the compression unit around it; needs `keep_clean`.
    pub partial_swapin: bool,
    /// The adaptive cut (pattern.rs): folios of a region whose swap-ins run
    /// sequentially are stored as one unit, others cut into `store.codec.granularity`'s.
    /// Off: every folio is cut as `granularity` says.
    pub adaptive_cut: bool,
    /// Fork without swap-in (fork.rs): a child takes over the folios swapped out.
    pub fork_carry: bool,
    /// Encrypt what goes to the backing file (AES-256-GCM, a key made per run
    /// and held only in memory; see uzswap-backing).
    pub encrypt_backing: bool,
    /// Write back to a remote store (uzswap-remote) first, with the backing file (if
    /// `writeback_dir`) behind it for what the remote one refuses.
    pub remote: Option<uzswap_remote::RemoteConfig>,
    /// A group ledger to join (group.rs): the budget is then the group's, shared with
    /// the other processes of the tree, and `budget_bytes` applies only if joining fails.
    pub group: Option<std::path::PathBuf>,
}

/// See [`Shared::begin_fill`]; ends the move on drop.
pub(crate) struct Filling<'a>(&'a Shared);

impl Drop for Filling<'_> {
    fn drop(&mut self) {
        self.0.end_move();
    }
}

impl RuntimeConfig {
    pub fn new(budget_bytes: u64) -> Self {
        RuntimeConfig {
            budget_bytes,
            fault_path: FaultPath::Thread,
            policy: ReclaimPolicy::Probation,
            high_watermark_percent: HIGH_WATERMARK_PERCENT,
            low_watermark_percent: 80,
            probation_percent: 10,
            store: StoreConfig::default(),
            writeback_dir: None,
            max_pool_percent: 20,
            backing_max_bytes: 64 << 30,
            publish_stats: true,
            keep_clean: true,
            partial_swapin: true,
            adaptive_cut: false,
            fork_carry: false,
            encrypt_backing: false,
            remote: None,
            group: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Unavailable(String),
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("folio size {0}: must be a power of two from 4 KiB to 2 MiB")]
    FolioSize(usize),
    #[error("region length {0}: must be more than zero")]
    Length(usize),
    #[error("budget of {budget} bytes is smaller than one folio of {folio} bytes")]
    BudgetTooSmall { budget: u64, folio: usize },
    #[error("{what} failed: {err}")]
    Os { what: &'static str, err: std::io::Error },
    #[error("too many regions (at most {0} in a process)")]
    TooManyRegions(usize),
    #[error("the range changed before it could be adopted")]
    Changed,
    #[error("the range overlaps memory uzswap manages already")]
    Managed,
    #[error(transparent)]
    Store(#[from] uzswap_store::StoreError),
}

fn os(what: &'static str) -> Error {
    Error::Os { what, err: std::io::Error::last_os_error() }
}

/// Pre-allocated folio buffers for signal handlers: no allocation in a handler.
/// Per SIGBUS handler at work: a folio buffer, and a stack to run on (fault.rs
/// `on_stack`), with a guard page below it.
pub(crate) struct BufferPool {
    slots: Box<[(AtomicBool, usize, usize)]>,
}

/// A handler's stack: the store's decoders and the fault path with room to spare.
const HANDLER_STACK: usize = 256 << 10;

pub(crate) struct Slot<'a> {
    pool: &'a BufferPool,
    i: usize,
}

impl BufferPool {
    fn new(n: usize) -> Result<Self, Error> {
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            let stack = map_anon(HANDLER_STACK + fault::PAGE, 0)?;
            // SAFETY: the lowest page of the mapping just made for this slot alone.
            if unsafe { libc::mprotect(stack as *mut _, fault::PAGE, libc::PROT_NONE) } != 0 {
                return Err(os("mprotect (handler stack guard)"));
            }
            slots.push((AtomicBool::new(false), map_anon(MAX_FOLIO, 0)?, stack));
        }
        Ok(BufferPool { slots: slots.into() })
    }

    /// A free buffer; spins while all are taken. Async-signal-safe.
    pub fn take(&self) -> Slot<'_> {
        loop {
            for (i, (taken, _, _)) in self.slots.iter().enumerate() {
                if !taken.load(Relaxed) && taken.compare_exchange(false, true, Acquire, Relaxed).is_ok() {
                    return Slot { pool: self, i };
                }
            }
            // SAFETY: sched_yield takes no arguments and touches no memory (and is
            // async-signal-safe, as take() must be).
            unsafe { libc::sched_yield() };
        }
    }
}

impl Slot<'_> {
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: take() won this slot's flag, which only this Slot's drop clears, so no
        // other Slot reaches this buffer; it is a MAX_FOLIO read-write mapping that lives
        // until the pool drops, which the Slot's borrow outlasts; `&mut self` keeps the
        // result unique.
        unsafe { std::slice::from_raw_parts_mut(self.pool.slots[self.i].1 as *mut u8, MAX_FOLIO) }
    }

    /// The slot's stack (above its guard page) and its buffer.
    pub fn parts(&mut self) -> (&mut [u8], &mut [u8]) {
        let stack = self.pool.slots[self.i].2 + fault::PAGE;
        // SAFETY: as `buf`, for the stack mapping: this Slot alone reaches it, and it is
        // HANDLER_STACK read-write bytes above the guard page; the two never overlap.
        let stack = unsafe { std::slice::from_raw_parts_mut(stack as *mut u8, HANDLER_STACK) };
        (stack, self.buf())
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.pool.slots[self.i].0.store(false, Release);
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        for (_, p, stack) in self.slots.iter() {
            // SAFETY: each slot's buffer and stack are mappings map_anon made for this
            // pool alone; `&mut self` means no Slot (which borrows the pool) is alive.
            unsafe {
                libc::munmap(*p as *mut _, MAX_FOLIO);
                libc::munmap(*stack as *mut _, HANDLER_STACK + fault::PAGE);
            }
        }
    }
}

/// The pivot's length: the longest take-out (a run of folios) moves through it in one go.
pub(crate) const PIVOT: usize = 2 << 20;

/// Maps the pivot (`Shared::pivot`), aligned so that a huge page can pass through it
/// whole, kept out of forked children, and registered with the region context.
fn map_pivot(region_ctx: &uffd::Uffd) -> Result<usize, Error> {
    let pivot = map_anon(PIVOT, PIVOT)?;
    // SAFETY: madvise and munmap of the mapping just made, which nobody else knows yet.
    let unmap = || unsafe { libc::munmap(pivot as *mut _, PIVOT) };
    // SAFETY: as above.
    if unsafe { libc::madvise(pivot as *mut _, PIVOT, libc::MADV_DONTFORK) } != 0 {
        let e = os("madvise(MADV_DONTFORK) of the pivot");
        unmap();
        return Err(e);
    }
    if let Err(err) = region_ctx.register(pivot, PIVOT, uffd::REGISTER_MODE_MISSING) {
        unmap();
        return Err(Error::Os { what: "UFFDIO_REGISTER (pivot)", err });
    }
    Ok(pivot)
}

/// Maps anonymous memory of `len` bytes aligned to `align` (a power of two, or 0).
fn map_anon(len: usize, align: usize) -> Result<usize, Error> {
    let extra = if align > 4096 { align } else { 0 };
    // SAFETY: mmap with no MAP_FIXED makes a new mapping and never replaces one; the two
    // munmaps cut only its unaligned head and tail, inside [p, p + len + extra), before
    // anyone else has seen it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len + extra,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        let p = p as usize;
        if extra == 0 {
            return Ok(p);
        }
        let aligned = (p + align - 1) & !(align - 1);
        if aligned > p {
            libc::munmap(p as *mut _, aligned - p);
        }
        let end = p + len + extra;
        if end > aligned + len {
            libc::munmap((aligned + len) as *mut _, end - aligned - len);
        }
        Ok(aligned)
    }
}

pub(crate) struct Shared {
    pub id: u64,
    pub cfg: RuntimeConfig,
    /// The budget in force (`cfg.budget_bytes` until [`Runtime::set_budget`]).
    pub budget: AtomicU64,
    pub store: Arc<Store>,
    pub uffd: uffd::Uffd,
    /// How `uffd` was opened: whether the kernel waits for its own faults on it.
    pub access: uffd::Access,
    pub staging: uffd::Uffd,
    /// Bytes of resident folios, probation included (holes counted as resident), and
    /// of probation folios: folio.rs moves them with each folio's state.
    pub charges: folio::Charges,
    /// The store's pool_total_size, sampled by the reclaimer and the reader.
    pub pool_cached: AtomicU64,
    /// The program's resident anonymous memory that is not managed (not adopted, or
    /// not adoptable: stacks, small mappings), as its owner last measured it
    /// ([`Runtime::set_unmanaged`]): it counts against the budget, as in a memory
    /// cgroup, so the managed part is held to what is left.
    pub unmanaged: AtomicU64,
    /// Why the program's other memory is not adopted, as its owner says
    /// ([`Runtime::set_not_adopted`]); published with the live stats, so that a
    /// program that ends without exit handlers (Go) still has it said.
    pub not_adopted: Mutex<Option<&'static str>>,
    /// Bytes of adopted regions, by [`MemoryKind`].
    pub adopted: [AtomicU64; 2],
    pub stamp: AtomicU64,
    /// Folios in fault-in order, for the reclaimer (queue.rs).
    pub fault_queue: queue::FaultQueue,
    pub stats: stats::Counters,
    pub buffers: BufferPool,
    /// MAX_FOLIO bytes of never-written memory: the source of zero fills.
    pub zeros: usize,
    /// PIVOT bytes registered with the region context, always empty: every take-out
    /// passes through it (reclaim.rs `take_out`), so that its first move is made on the
    /// region context and fails while a change of the program's mappings is unread.
    pub pivot: usize,
    pub regions: Mutex<Vec<Arc<RegionInner>>>,
    pub reclaim_fd: i32,
    /// The reclaimer is in (or about to enter) its wait: `kick_reclaimer` must write.
    pub reclaimer_asleep: AtomicBool,
    pub stop_fd: i32,
    pub stop: AtomicBool,
    /// The reader holds range events it has read but not finished (see fault.rs).
    pub events_busy: AtomicBool,
    /// Reads of the region context by the reader so far: a take-out that met a change
    /// of the mapping pending waits for the next (reclaim.rs `take_out_run`).
    pub reads: AtomicU64,
    /// No move in or out of a region off the reader while it reads events (moves.rs).
    pub moves: moves::MoveGate,
    /// Test hook: the reclaimer does nothing while set ([`Runtime::pause_reclaimer`]).
    pub reclaim_paused: AtomicBool,
    /// Set by the reclaimer when it cannot bring usage down (nothing left to evict, the
    /// store refuses everything), and at exit: faults then run over the budget without
    /// waiting, counted as `over_budget`, until it evicts something again and clears it.
    pub reclaim_stuck: AtomicBool,
    /// Set by a fault that waited the whole throttle time while the reclaimer evicted
    /// nothing (starved of CPU, most likely, not stuck): faults past the throttle limit
    /// then wait `ROOM_NAP` at most, not the throttle time, until the reclaimer evicts
    /// again and clears it. Kept apart from `reclaim_stuck`, which a fault used to set:
    /// every fault then ran over the budget at once, and the reclaimer itself rested.
    pub reclaim_starved: AtomicBool,
    /// The reclaimer is inside while it takes folios out; exit closes it for good
    /// ([`Runtime::hold_reclaim_for_exit`]).
    pub reclaim_gate: gate::Gate,
    /// Which second it is for folios passed over because another process maps their
    /// pages too (reclaim.rs `pass_over`). The reclaimer's alone.
    pub shared_epoch: AtomicU8,
    /// /proc/self/pagemap, read to see whether dropped pages are gone (region.rs).
    pub pagemap_fd: i32,
    /// This process, for process_madvise (reclaim.rs), or -1 where there is none.
    pub pidfd: i32,
    pub publish_lock: Mutex<()>,
    pub stats_path: std::path::PathBuf,
    /// When this process started (`RuntimeStats::started`), read once.
    pub started: Option<u64>,
    /// This process's slot in its group's ledger: the budget is the limit there.
    pub group: Option<group::Member>,
    /// The highest usage the reclaimer saw (sampled at each of its wakes).
    pub peak_usage: AtomicU64,
}

impl Shared {
    /// Resident bytes plus the pool as last sampled: no lock, so signal handlers may ask.
    pub fn usage(&self) -> u64 {
        self.charges.resident.load(Relaxed) + self.pool_cached.load(Relaxed) + self.unmanaged_charge()
    }
    /// What of the unmanaged memory counts: up to half the budget. The managed part
    /// always keeps the other half: held below that it would only thrash, since
    /// nothing here can shrink the rest (the summary shows it).
    pub fn unmanaged_charge(&self) -> u64 {
        self.unmanaged.load(Relaxed).min(self.budget() / 2)
    }
    /// Folios evicted so far: compressed out, or dropped with their copy kept (the
    /// reclaimer's progress). Atomics only: async-signal-safe.
    pub fn evicted(&self) -> u64 {
        self.stats.sizes.iter().map(|s| s.zswpout.load(Relaxed) + s.clean_evict.load(Relaxed)).sum()
    }
    /// The reclaimer cannot bring usage down (or exit holds it): faults past the
    /// throttle limit stop waiting for room, and those asleep for it wake.
    pub fn declare_reclaim_stuck(&self) {
        self.reclaim_stuck.store(true, Relaxed);
        self.charges.wake_all();
    }
    /// The reclaimer made progress, or has nothing to do: faults wait for room again.
    pub fn clear_reclaim_trouble(&self) {
        self.reclaim_stuck.store(false, Relaxed);
        self.reclaim_starved.store(false, Relaxed);
    }
    /// Samples the pool's size (takes the store's locks: not for signal handlers).
    pub fn refresh_usage(&self) -> u64 {
        let pool = self.store.pool_total_size();
        if self.pool_cached.swap(pool, Relaxed) > pool {
            // Writeback (or freed copies) made room: faults sleeping for it look again.
            self.charges.wake_all();
        }
        self.usage()
    }
    /// The budget in force: in a group, this process's share of the group's (a load
    /// of shared memory; async-signal-safe either way).
    pub fn budget(&self) -> u64 {
        match &self.group {
            Some(m) => m.limit(),
            None => self.budget.load(Relaxed),
        }
    }
    /// Sets the pool's limit from the budget in force, where `Runtime::new` derived it
    /// from the budget (a tier to write back to): after `set_budget`, and as a group's
    /// share moves.
    pub(crate) fn pool_follows_budget(&self) {
        if self.store.tier().is_none() {
            return;
        }
        if let Some(max) = self.store.max_pool_bytes() {
            let want = self.budget() / 100 * self.cfg.max_pool_percent as u64;
            if max != want {
                self.store.set_max_pool_bytes(Some(want));
            }
        }
    }
    /// A fault-in stamp: from the group clock in a group, so that stamps compare
    /// across its processes (group.rs). Async-signal-safe.
    pub fn next_stamp(&self) -> u64 {
        match &self.group {
            Some(m) => m.clock().fetch_add(1, Relaxed),
            None => self.stamp.fetch_add(1, Relaxed),
        }
    }
    fn pct(&self, p: u8) -> u64 {
        self.budget() / 100 * p as u64
    }
    pub fn high_watermark(&self) -> u64 {
        self.pct(self.cfg.high_watermark_percent)
    }
    pub fn low_watermark(&self) -> u64 {
        self.pct(self.cfg.low_watermark_percent)
    }
    /// Faults wait for the reclaimer past this: the budget plus a sixteenth, so that a
    /// burst of faults while the reclaimer is busy compressing is absorbed instead of
    /// stalling every fault (the reclaimer brings usage back under the watermarks).
    pub fn throttle_limit(&self) -> u64 {
        self.budget() + self.budget() / 16
    }
    pub fn probation_target(&self) -> u64 {
        self.pct(self.cfg.probation_percent)
    }
    /// Reads the pagemap entries of the pages from `addr` (one u64 each: bit 63
    /// present, bit 62 swapped). False if it cannot (then nothing is known).
    pub fn pagemap(&self, addr: usize, entries: &mut [u64]) -> bool {
        let bytes = std::mem::size_of_val(entries);
        // SAFETY: pread(2) into a buffer of `bytes` bytes we own.
        let mut read = || unsafe { libc::pread(self.pagemap_fd, entries.as_mut_ptr().cast(), bytes, (addr / fault::PAGE * 8) as libc::off_t) };
        let mut n = read();
        if n < 0 && fds::was_ebadf() {
            fds::restore_or_stop();
            n = read();
        }
        n == bytes as isize
    }
    /// Calls `each(start, bytes)` for every run of pages of `[addr, addr+len)` whose
    /// pagemap entries satisfy `pick`, in address order, until it returns false. False
    /// if one did, or pagemap could not be read. Allocation-free.
    pub fn page_runs(&self, addr: usize, len: usize, pick: impl Fn(u64) -> bool, mut each: impl FnMut(usize, usize) -> bool) -> bool {
        let mut entries = [0u64; 512];
        let mut at = addr;
        while at < addr + len {
            let n = ((addr + len - at) / fault::PAGE).min(entries.len());
            if !self.pagemap(at, &mut entries[..n]) {
                return false;
            }
            let mut i = 0;
            while i < n {
                if !pick(entries[i]) {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < n && pick(entries[i]) {
                    i += 1;
                }
                if !each(at + start * fault::PAGE, (i - start) * fault::PAGE) {
                    return false;
                }
            }
            at += n * fault::PAGE;
        }
        true
    }

    /// Whether some page of `[addr, addr+len)` has a pagemap entry that satisfies
    /// `pick` (false where pagemap could not be read). Allocation-free.
    pub fn any_page(&self, addr: usize, len: usize, pick: impl Fn(u64) -> bool) -> bool {
        let mut found = false;
        self.page_runs(addr, len, pick, |_, _| {
            found = true;
            false
        });
        found
    }

    /// Whether the reclaimer may move pages out of a region now; if so it must call
    /// `end_move` after (moves.rs).
    pub fn begin_move(&self) -> bool {
        self.moves.begin()
    }
    pub fn end_move(&self) {
        self.moves.end()
    }

    /// For bringing a folio's data into its region anywhere but on the reader (a
    /// SIGBUS handler, a fork hold, a kernel-access hold): while the result lives, the
    /// reader reads no event (the move gate, moves.rs, as for the reclaimer's
    /// moves). Without it, a MADV_DONTNEED of the folio by another thread could be read
    /// after the filler looked for pending drops and zapped before its copy: the old
    /// bytes would then be mapped after the program's madvise returned. With it, the
    /// drop is either read before (its pages are marked when the filler looks) or
    /// after (the filler's UFFDIO_COPY fails with EAGAIN from the moment the kernel
    /// queues the event, so a filler holding this must never wait for EAGAIN: it leaves
    /// the gate, lets the reader read, enters again and goes on, the folio still
    /// locked: `bring_back`). None while a drop is being taken in: retry later. The reader
    /// itself needs nothing: it reads no event while it fills. The gate opens again
    /// for fills as soon as the reader has marked the drops it read, so a fork hold
    /// that keeps other folios locked may wait for it.
    pub(crate) fn begin_fill(&self) -> Option<Filling<'_>> {
        // Lazily: a Filling made and dropped would end a move never begun.
        self.moves.begin_fill().then(|| Filling(self))
    }
    pub fn stopping(&self) -> bool {
        self.stop.load(Acquire)
    }
    /// Wakes the reclaimer if it sleeps: a write(2) per fault would cost a system call
    /// and a cross-CPU wakeup each time. Pairs with the fence in `reclaim_loop`: either
    /// it sees our charge before it sleeps, or we see it asleep. Async-signal-safe.
    pub fn kick_reclaimer(&self) {
        std::sync::atomic::fence(SeqCst);
        if self.reclaimer_asleep.swap(false, SeqCst) {
            let one = 1u64;
            // SAFETY: write(2) reads 8 bytes of `one`, a live u64; reclaim_fd is Shared's
            // eventfd, closed only by Shared's drop, which cannot run while `&self` lives.
            // (async-signal-safe, as this function must be.)
            unsafe { libc::write(self.reclaim_fd, (&one as *const u64).cast(), 8) };
        }
    }
    pub fn snapshot(&self) -> RuntimeStats {
        RuntimeStats {
            pid: std::process::id(),
            started: self.started,
            fault_path: format!("{:?}", self.cfg.fault_path).to_lowercase(),
            uffd_access: self.access.describe().into(),
            policy: format!("{:?}", self.cfg.policy).to_lowercase(),
            budget_bytes: self.budget(),
            usage_bytes: self.refresh_usage(),
            resident_bytes: self.charges.resident.load(Relaxed),
            probation_bytes: self.charges.probation.load(Relaxed),
            pool_total_size: self.store.pool_total_size(),
            regions: self.regions.lock().len(),
            sizes: self.stats.snapshot(),
            store: self.store.stats(),
            managed_peak_bytes: None,
            not_adopted: self.not_adopted.lock().map(String::from),
            unmanaged_bytes: self.unmanaged.load(Relaxed),
            adopted_bytes: MemoryKind::ALL
                .iter()
                .map(|k| (k.name().to_string(), self.adopted[*k as usize].load(Relaxed)))
                .filter(|(_, b)| *b > 0)
                .collect(),
            command: None,
            peak_usage_bytes: self.peak_usage.load(Relaxed),
            group_budget_bytes: self.group.as_ref().map(|m| m.group_budget()),
            writeback: self.store.tier().is_some(),
            tier: self.store.tier().map(|t| t.describe()),
            remote: self.store.tier().map(|t| t.extra_stats().into_iter().map(|(k, v)| (k.to_string(), v)).collect()).unwrap_or_default(),
            ended_without_exit_handlers: false,
        }
    }
    pub fn publish_stats(&self) {
        if self.cfg.publish_stats {
            let _serial = self.publish_lock.lock();
            if let Err(e) = stats::write_stats_file(&self.stats_path, &self.snapshot()) {
                eprintln!("uzswap: cannot write {}: {e}", self.stats_path.display());
            }
        }
    }
}

/// Starts one of the runtime's threads, with every signal blocked from its first
/// instruction (it inherits the mask set around its creation): signals sent to the
/// process then reach the program's threads only, as without uzswap. A program's
/// handler run on a thread it never made misbehaves (Go's kills the process for a
/// signal it was not asked to catch yet), and a signal left pending for the program's
/// sigwait would be taken by us. Faults of our own (SIGSEGV, SIGBUS) cannot be blocked
/// and still kill the process, as they should.
///
/// Returns once the thread runs `f`: glibc's start of a thread reads the program's
/// memory (its locale data, which setlocale malloc'd), and a forked child takes its
/// parent's memory over (registers it, drops its view of what is resident) only once
/// its runtime's threads are past that: the reader itself faulting there, before it
/// ever read a fault, left bash's children hung.
pub fn spawn_thread<F: FnOnce() + Send + 'static>(name: &str, stack: Option<usize>, f: F) -> std::io::Result<JoinHandle<()>> {
    let mut b = std::thread::Builder::new().name(name.into());
    if let Some(s) = stack {
        b = b.stack_size(s);
    }
    let started = Arc::new(std::sync::Barrier::new(2));
    let f = {
        let started = started.clone();
        move || {
            started.wait();
            f()
        }
    };
    // SAFETY: sigfillset and pthread_sigmask write the sigset_t values we own; the
    // caller's mask is put back right after the thread is made.
    unsafe {
        let (mut all, mut old): (libc::sigset_t, libc::sigset_t) = (std::mem::zeroed(), std::mem::zeroed());
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let t = b.spawn(f);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if t.is_ok() {
            started.wait();
        }
        t
    }
}

/// Starts the runtime's keeper (fds.rs): a thread whose private descriptor table holds
/// the runtime's descriptors, so that the program closing them behind the shim
/// releases nothing; returns once it has its table. Where it cannot have one (a
/// seccomp filter refusing unshare), the runtime runs without it: descriptors closed
/// by a raw system call then stop the program (fds::lost).
///
/// It also publishes the stats file (every second, every 250 ms while faults come):
/// writing it opens a file, which in the keeper's private table takes no number from
/// the program's (from any other thread, the program's next open would get a higher
/// descriptor than it should for that moment, which programs that count on the lowest
/// free one see).
fn keeper(shared: &Arc<Shared>) -> Result<JoinHandle<()>, Error> {
    let sh = shared.clone();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let t = spawn_thread("uzswap-keeper", Some(256 << 10), move || {
        let own = sh.own_fds();
        let kept = fds::keep(&own).is_ok();
        let _ = tx.send(());
        let mut pfd = libc::pollfd { fd: sh.stop_fd, events: libc::POLLIN, revents: 0 };
        let timeout = if sh.cfg.publish_stats { 250 } else { -1 };
        // Published every second, and every quarter of one while faults come: a short
        // life (a worker that ends with _exit, whose last published line `uzswap run`
        // keeps for it) still leaves a line with what it did.
        let (mut last, mut seen) = (std::time::Instant::now(), u64::MAX);
        while !sh.stopping() {
            let faults: u64 = sh.stats.sizes.iter().map(|c| c.faults.load(Relaxed) + c.zswpout.load(Relaxed)).sum();
            if faults != seen || last.elapsed() >= std::time::Duration::from_secs(1) {
                sh.publish_stats();
                (last, seen) = (std::time::Instant::now(), faults);
            }
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, timeout) };
        }
        if kept {
            fds::unkeep(&own);
        }
    })
    .map_err(|err| Error::Os { what: "spawn", err })?;
    let _ = rx.recv();
    Ok(t)
}

impl Shared {
    /// The descriptors this runtime keeps open (fds.rs).
    fn own_fds(&self) -> Vec<i32> {
        let mut v = vec![self.uffd.raw(), self.staging.raw(), self.reclaim_fd, self.stop_fd, self.pagemap_fd];
        v.extend((self.pidfd >= 0).then_some(self.pidfd));
        v.extend(self.store.backing_fd());
        // A forked child's loans from its parent (fork.rs): kept until it exits or execs.
        v.extend(fork::borrowed_fds());
        v
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for fd in [self.reclaim_fd, self.stop_fd, self.pagemap_fd, self.pidfd].into_iter().chain(self.store.backing_fd()) {
            fds::unregister(fd);
        }
        // SAFETY: the eventfds and the zeros mapping were made in Runtime::new for this
        // Shared alone and are released only here, once; every thread that used them held
        // an Arc<Shared>, so none is left.
        unsafe {
            libc::close(self.reclaim_fd);
            libc::close(self.stop_fd);
            libc::close(self.pagemap_fd);
            if self.pidfd >= 0 {
                libc::close(self.pidfd);
            }
            libc::munmap(self.zeros as *mut _, MAX_FOLIO);
            // Unregistered first: the unmap of a registered range is an event that only
            // the reader, gone by now, would read.
            if self.uffd.unregister(self.pivot, PIVOT).is_ok() {
                libc::munmap(self.pivot as *mut _, PIVOT);
            }
        }
    }
}

struct RuntimeInner {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for RuntimeInner {
    fn drop(&mut self) {
        let sh = &self.shared;
        if let Some(m) = &sh.group {
            m.leave();
        }
        sh.stop.store(true, Release);
        let one = 1u64;
        // SAFETY: write(2) reads 8 bytes of `one`, a live u64; stop_fd stays open while
        // `sh` (an Arc<Shared>) is held.
        unsafe { libc::write(sh.stop_fd, (&one as *const u64).cast(), 8) };
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        if sh.cfg.publish_stats {
            let _ = std::fs::remove_file(&sh.stats_path);
            let _ = PID_FILE_OWNER.compare_exchange(sh.id, 0, AcqRel, Relaxed);
        }
    }
}

/// A set of regions sharing one budget, one store and one reclaimer. Cheap to clone;
/// the threads stop when the last clone and the last region are dropped.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

static NEXT_RUNTIME: AtomicU64 = AtomicU64::new(1);
static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

/// A new region's id, which names its folios in the store (`RegionInner::key`).
pub(crate) fn next_region_id() -> u64 {
    NEXT_REGION.fetch_add(1, Relaxed)
}
static PID_FILE_OWNER: AtomicU64 = AtomicU64::new(0);

/// A forked child's runtime publishes to its own `<pid>.json`.
pub(crate) fn forget_stats_file_in_child() {
    PID_FILE_OWNER.store(0, SeqCst);
}

impl Runtime {
    /// Checks that userfaultfd with the needed features is available, and starts the threads.
    pub fn new(cfg: RuntimeConfig) -> Result<Runtime, Error> {
        let mut store_cfg = cfg.store.clone();
        let file = match &cfg.writeback_dir {
            None => None,
            Some(dir) => {
                let backing_cfg = uzswap_backing::BackingConfig {
                    encrypt: cfg.encrypt_backing,
                    place_fd: Some(fds::place),
                    ..uzswap_backing::BackingConfig::new(dir, cfg.backing_max_bytes)
                };
                Some(uzswap_backing::BackingFile::create(backing_cfg).map_err(uzswap_store::StoreError::from)?)
            }
        };
        let tier: Option<Box<dyn uzswap_backing::Tier>> = match &cfg.remote {
            Some(remote) => {
                let remote = uzswap_remote::RemoteConfig { on_socket: Some((fds::register_socket, fds::unregister)), ..remote.clone() };
                let tier = uzswap_remote::RemoteTier::new(remote, file).map_err(uzswap_store::StoreError::from)?;
                Some(Box::new(tier))
            }
            None => file.map(|f| Box::new(f) as Box<dyn uzswap_backing::Tier>),
        };
        if tier.is_some() {
            if !(1..=100).contains(&cfg.max_pool_percent) {
                return Err(Error::Config(format!("max_pool_percent {} must be from 1 to 100", cfg.max_pool_percent)));
            }
            store_cfg.max_pool_bytes = Some(cfg.budget_bytes / 100 * cfg.max_pool_percent as u64);
        }
        let store = Arc::new(Store::with_tier(store_cfg, tier)?);
        Runtime::with_store(cfg, store)
    }

    /// As `new`, with a store the caller made (and may inspect).
    pub fn with_store(cfg: RuntimeConfig, store: Arc<Store>) -> Result<Runtime, Error> {
        if !(cfg.low_watermark_percent < cfg.high_watermark_percent && cfg.high_watermark_percent <= 100) {
            return Err(Error::Config(format!(
                "watermarks: need low < high <= 100, got low {} high {}",
                cfg.low_watermark_percent, cfg.high_watermark_percent
            )));
        }
        if cfg.probation_percent > 50 {
            return Err(Error::Config(format!("probation_percent {} is over 50", cfg.probation_percent)));
        }
        if cfg.budget_bytes < MIN_FOLIO as u64 {
            return Err(Error::BudgetTooSmall { budget: cfg.budget_bytes, folio: MIN_FOLIO });
        }
        let mut features = uffd::FEATURE_EVENT_REMOVE | uffd::FEATURE_EVENT_UNMAP | uffd::FEATURE_EVENT_REMAP;
        if cfg.fault_path == FaultPath::Sigbus {
            features |= uffd::FEATURE_SIGBUS;
        }
        let (region_ctx, access) = uffd::Uffd::open(features | uffd::FEATURE_MOVE).map_err(Error::Unavailable)?;
        // Only uzswap's threads touch the shadow, in user mode: any access will do.
        let (staging_ctx, _) = uffd::Uffd::open(uffd::FEATURE_MOVE).map_err(Error::Unavailable)?;
        // Handlers and the reader load from the store: it must never allocate for them
        // (a context each, made now; the reader and a fork hold need one apiece).
        store.reserve_contexts(if cfg.fault_path == FaultPath::Sigbus { SIGBUS_BUFFERS + 2 } else { 2 })?;
        if cfg.fault_path == FaultPath::Sigbus {
            fault::install_sigbus_handler().map_err(Error::Unavailable)?;
        }
        let group = cfg.group.as_deref().and_then(|path| {
            group::Member::join(path)
                .inspect_err(|e| {
                    eprintln!(
                        "uzswap: cannot join the group's budget ({e}): this process holds itself to {} alone",
                        settings::format_bytes(cfg.budget_bytes)
                    )
                })
                .ok()
        });
        let id = NEXT_RUNTIME.fetch_add(1, Relaxed);
        // SAFETY: eventfd takes two integers and touches no memory; its results are
        // checked below and then owned by Shared.
        let (reclaim_fd, stop_fd) = unsafe {
            (libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK), libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK))
        };
        if reclaim_fd < 0 || stop_fd < 0 {
            return Err(os("eventfd"));
        }
        let (reclaim_fd, stop_fd) = (fds::place_raw(reclaim_fd), fds::place_raw(stop_fd));
        let zeros = map_anon(MAX_FOLIO, 0)?;
        let pivot = map_pivot(&region_ctx)?;
        // SAFETY: open(2) of a path we name, close-on-exec.
        let pagemap_fd = unsafe { libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if pagemap_fd < 0 {
            return Err(os("open(/proc/self/pagemap)"));
        }
        let pagemap_fd = fds::place_raw(pagemap_fd);
        // SAFETY: pidfd_open takes integers; the result is checked, then owned by Shared.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) } as i32;
        let pidfd = if pidfd >= 0 { fds::place_raw(pidfd) } else { -1 };
        let pid = std::process::id();
        // The first publishing runtime of a process gets <pid>.json; any other <pid>.<id>.json.
        let stats_path = if cfg.publish_stats && PID_FILE_OWNER.compare_exchange(0, id, AcqRel, Relaxed).is_ok() {
            stats::stats_path(pid)
        } else {
            stats::stats_dir().join(format!("{pid}.{id}.json"))
        };
        let shared = Arc::new(Shared {
            id,
            buffers: BufferPool::new(if cfg.fault_path == FaultPath::Sigbus { SIGBUS_BUFFERS } else { 0 })?,
            budget: AtomicU64::new(cfg.budget_bytes),
            cfg,
            store,
            uffd: region_ctx,
            access,
            staging: staging_ctx,
            charges: Default::default(),
            pool_cached: AtomicU64::new(0),
            unmanaged: AtomicU64::new(0),
            not_adopted: Mutex::new(None),
            adopted: Default::default(),
            stamp: AtomicU64::new(1),
            fault_queue: queue::FaultQueue::new(),
            stats: Default::default(),
            zeros,
            pivot,
            regions: Mutex::new(Vec::new()),
            reclaim_fd,
            reclaimer_asleep: AtomicBool::new(false),
            stop_fd,
            stop: AtomicBool::new(false),
            events_busy: AtomicBool::new(false),
            reads: AtomicU64::new(0),
            moves: moves::MoveGate::default(),
            reclaim_paused: AtomicBool::new(false),
            reclaim_stuck: AtomicBool::new(false),
            reclaim_starved: AtomicBool::new(false),
            reclaim_gate: gate::Gate::new(),
            shared_epoch: AtomicU8::new(0),
            pagemap_fd,
            pidfd,
            publish_lock: Mutex::new(()),
            stats_path,
            started: group::start_time(pid),
            group,
            peak_usage: AtomicU64::new(0),
        });
        let spawn = |name: &str, f: fn(Arc<Shared>)| {
            let sh = shared.clone();
            spawn_thread(name, None, move || f(sh)).map_err(|err| Error::Os { what: "spawn", err })
        };
        let threads = vec![keeper(&shared)?, spawn("uzswap-uffd", fault::reader_loop)?, reclaim::start(&shared).map_err(|err| Error::Os { what: "spawn", err })?];
        Ok(Runtime { inner: Arc::new(RuntimeInner { shared, threads: Mutex::new(threads) }) })
    }

    /// Maps a managed anonymous region of `len` bytes (rounded up to whole folios),
    /// aligned to `folio_size`. Reads of never-written memory return zeros.
    pub fn create_region(&self, len: usize, folio_size: usize) -> Result<Region, Error> {
        let len = self.check_region(len, folio_size)?.div_ceil(folio_size) * folio_size;
        let base = map_anon(len, folio_size)?;
        // SAFETY: MADV_DONTFORK on this call's fresh mapping only changes what fork
        // copies; no memory contents change.
        if unsafe { libc::madvise(base as *mut _, len, libc::MADV_DONTFORK) } != 0 {
            let e = os("madvise(MADV_DONTFORK)");
            // SAFETY: `base` is the mapping map_anon just made here, known to no one else.
            unsafe { libc::munmap(base as *mut _, len) };
            return Err(e);
        }
        self.install(base, len, folio_size, None::<(MemoryKind, fn() -> Option<()>)>, None).inspect_err(|_| {
            // SAFETY: as above: install failed, so the region was never published.
            unsafe { libc::munmap(base as *mut _, len) };
        })
    }

    /// Takes over, in place, memory the program already has: `[base, base + len)`, whole
    /// folios of a private anonymous read-write mapping uzswap did not make. Pages
    /// present (or in the kernel's swap) are the program's data: their folios start
    /// RESIDENT, charged to the budget (`adopted`); the rest read as zeros, as before.
    /// The mapping stays the program's: dropping the region gives every folio back in
    /// place (swapped-out ones are brought in) and unmaps nothing, and the program may
    /// unmap or remap it as it likes (UNMAP and REMAP events follow it). Fork copies it,
    /// as it did (no MADV_DONTFORK).
    pub fn adopt_region(&self, base: usize, len: usize, folio_size: usize, kind: MemoryKind) -> Result<Region, Error> {
        self.adopt_region_gated(base, len, folio_size, kind, || Some(()))
    }

    /// [`Runtime::adopt_region`], where `gate`, called just before the range is
    /// registered, says whether it still is the program's memory (None: it may not be,
    /// `Error::Changed`), and its guard is held until the registration is done: the
    /// shim's way to keep uzswap's own new mappings out of what it adopts (own_maps.rs).
    /// Nothing is unmapped while the guard is held.
    pub fn adopt_region_gated<G>(
        &self,
        base: usize,
        len: usize,
        folio_size: usize,
        kind: MemoryKind,
        gate: impl FnOnce() -> Option<G>,
    ) -> Result<Region, Error> {
        self.check_region(len, folio_size)?;
        if !base.is_multiple_of(folio_size) || !len.is_multiple_of(folio_size) {
            return Err(Error::Length(len));
        }
        self.install(base, len, folio_size, Some((kind, gate)), None)
    }

    /// What is charged to the budget but the unmanaged part: resident (and probation)
    /// folios and the pool.
    pub fn charged_bytes(&self) -> u64 {
        let sh = &self.inner.shared;
        sh.refresh_usage().saturating_sub(sh.unmanaged_charge())
    }

    /// Bytes of folios this process shares with its parent since a fork (SHARED),
    /// charged to the parent, not here (folio.rs).
    pub fn shared_bytes(&self) -> u64 {
        self.inner.shared.charges.shared.load(Relaxed)
    }

    /// Bytes of the parent's pool this process maps since a fork, its records
    /// borrowed (store carry.rs, "Loans"): charged to the parent, as its pool.
    pub fn borrowed_pool_bytes(&self) -> u64 {
        self.inner.shared.store.lent_mapped_bytes()
    }

    /// Says why the program's other memory is not adopted (None: it all may be).
    pub fn set_not_adopted(&self, why: Option<&'static str>) {
        *self.inner.shared.not_adopted.lock() = why;
    }

    /// Sets the program's resident anonymous memory that is not managed (see
    /// `Shared::unmanaged`); the reclaimer is woken if that puts usage past the high
    /// watermark.
    pub fn set_unmanaged(&self, bytes: u64) {
        let sh = &self.inner.shared;
        sh.unmanaged.store(bytes, Relaxed);
        if sh.usage() > sh.high_watermark() {
            sh.kick_reclaimer();
        }
    }

    fn check_region(&self, len: usize, folio_size: usize) -> Result<usize, Error> {
        let sh = &self.inner.shared;
        if !folio_size.is_power_of_two() || !(MIN_FOLIO..=MAX_FOLIO).contains(&folio_size) {
            return Err(Error::FolioSize(folio_size));
        }
        if len == 0 || len > (1 << 46) {
            return Err(Error::Length(len));
        }
        if sh.budget() < folio_size as u64 {
            return Err(Error::BudgetTooSmall { budget: sh.budget(), folio: folio_size });
        }
        Ok(len)
    }

    /// Gives `[base, base + len)` a shadow, registers both and publishes the region.
    /// An adopted or inherited region's folios stay locked until the pagemap says
    /// which hold data (and, inherited, which a fork carried out: fork.rs), so no
    /// fault sees them EMPTY meanwhile (after registration no missing page is filled
    /// but by us). On error nothing is left registered or published; the caller's
    /// mapping is the caller's to undo.
    fn install<G>(
        &self,
        base: usize,
        len: usize,
        folio_size: usize,
        adopt: Option<(MemoryKind, impl FnOnce() -> Option<G>)>,
        inherit: Option<&fork::Inheriting>,
    ) -> Result<Region, Error> {
        let sh = &self.inner.shared;
        let (adopted, gate) = match adopt {
            Some((kind, gate)) => (Some(kind), Some(gate)),
            None => (None, None),
        };
        let folios = len / folio_size;
        let shadow = map_anon(len, folio_size)?;
        // SAFETY: used only on the error paths below, before the region is published:
        // `shadow` is this call's own fresh mapping, known to no one else.
        let unmap_shadow = || unsafe {
            libc::munmap(shadow as *mut _, len);
        };
        // SAFETY: MADV_DONTFORK on this call's fresh mapping only changes what fork copies.
        if unsafe { libc::madvise(shadow as *mut _, len, libc::MADV_DONTFORK) } != 0 {
            let e = os("madvise(MADV_DONTFORK)");
            unmap_shadow();
            return Err(e);
        }
        let mode = if sh.cfg.keep_clean { uffd::REGISTER_MODE_MISSING | uffd::REGISTER_MODE_WP } else { uffd::REGISTER_MODE_MISSING };
        let guard = match gate.map(|g| g()) {
            Some(None) => {
                unmap_shadow();
                return Err(Error::Changed);
            }
            Some(Some(g)) => Some(g),
            None => None,
        };
        let inner = Arc::new(RegionInner {
            id: inherit.map_or_else(next_region_id, |i| i.id),
            base: AtomicUsize::new(base),
            len,
            folio_size,
            folio_shift: folio_size.trailing_zeros(),
            shadow,
            folios: folio::Folios::new(folios),
            stamps: (0..folios).map(|_| AtomicU64::new(0)).collect(),
            passed_over: (0..folios).map(|_| AtomicU8::new(0)).collect(),
            drop_pending: region::PageBits::new(len / fault::PAGE),
            gone: region::PageBits::new(len / fault::PAGE),
            pattern: Default::default(),
            slot: AtomicUsize::new(usize::MAX),
            adopted,
            inherited: inherit.is_some(),
            born: AtomicU64::new(0),
            shared: sh.clone(),
        });
        // From here on the shadow is unmapped when `inner` drops (region.rs).
        let scan = adopted.is_some() || inherit.is_some();
        if scan {
            for idx in 0..folios {
                inner.lock(idx);
            }
        }
        // In the fault table before it is registered: an event for the range (the
        // program unmapping part of it) is applied to the region from the first one
        // on. Nothing faults on it before the registration, and an adopted or
        // inherited region's folios stay locked until the walk below.
        // Put in between two of the reader's reads, never between a read and its
        // marks (the move gate's fill side, moves.rs): a munmap returns as soon as the
        // reader has *read* its event, and the program may map and we adopt the same
        // addresses before it marks them; that stale unmap then took the new region's
        // pages for gone (or the old region's claim, not yet marked, refused it). Nor
        // is an event read before, and still held, applied to it when processed
        // (`born`): it once turned the new region's folios UNMAPPED.
        let inserted = loop {
            if let Some(_between_reads) = sh.begin_fill() {
                // No read can begin before the fill ends (moves.rs): the count is final.
                inner.born.store(sh.reads.load(SeqCst), Relaxed);
                break fault::table_insert(&inner);
            }
            std::thread::yield_now();
        };
        if !inserted {
            drop(guard);
            return Err(Error::TooManyRegions(4096));
        }
        // One region per folio: two would each take it for theirs (one evicts it, the
        // other fills the hole it left with zeros), and undoing this registration would
        // unregister the other's range. Only adoption can ask for memory that is
        // managed (its /proc/self/maps text may be stale, or show a mapping twice when
        // it grew while being read): checked before registering, and only then (a
        // child taking over 1,024 regions checked each against all the others). A new
        // mapping of ours is where no mapping was: what another region claims there
        // is stale. Both looked at with the region in the table, so that of an
        // adoption and a new mapping installed at once one sees the other.
        // The gate's guard goes before the shadow is unmapped (when `inner` drops):
        // the shim unmaps its own mappings inside that gate.
        if adopted.is_some() && fault::claimed_by_another(sh.id, &inner, base, base + len) {
            fault::table_remove(&inner);
            drop(guard);
            return Err(Error::Managed);
        }
        if adopted.is_none() && inherit.is_none() {
            fault::mark_stale_claims(sh.id, &inner);
        }
        if let Err(err) = sh.uffd.register(base, len, mode) {
            fault::table_remove(&inner);
            drop(guard);
            return Err(Error::Os { what: "UFFDIO_REGISTER (region, missing)", err });
        }
        drop(guard);
        if let Err(err) = sh.staging.register(shadow, len, uffd::REGISTER_MODE_WP) {
            let _ = sh.uffd.unregister(base, len);
            fault::table_remove(&inner);
            return Err(Error::Os { what: "UFFDIO_REGISTER (shadow, write-protect)", err });
        }
        sh.regions.lock().push(inner.clone());
        // What the program unmapped before the registration is not the region's
        // (registered.rs). Looked at with the region in the fault table: what the
        // program unmaps from now on comes as events, applied to it. Not for a forked
        // child's take-over: its regions are as its parent had them, registered there
        // (one read of smaps per region would be most of a fork's cost).
        let mut unchecked = None;
        if adopted.is_some() && inherit.is_none() {
            if let Err(err) = registered::unregistered(base, base + len, |s, e| inner.mark_gone_range(s, e)) {
                // Not known: none of it is taken (the region is let go below).
                let _ = sh.uffd.unregister(base, len);
                inner.mark_gone_range(base, base + len);
                unchecked = Some(Error::Os { what: "reading /proc/self/smaps (what the registration covers)", err });
            }
        }
        if scan {
            // Pagemap read 2 MiB at a time (at least a folio): one read per folio
            // made a child's take-over of 384 MiB in 64 KiB folios 6144 system calls.
            let per = folio_size / fault::PAGE;
            let chunk = (512 / per).max(1);
            let mut entries = vec![0u64; per * chunk];
            let mut known = false;
            let mut taken = 0u64;
            // Inherited folios with data are the parent's pages, shared copy-on-write:
            // SHARED, write-protected (folio.rs), a run of them at a time; where they
            // cannot be (no write-protect mode: keep_clean off; an ioctl refused),
            // RESIDENT, charged here too.
            let share = inherit.is_some() && sh.cfg.keep_clean;
            let mut run: Option<(usize, usize)> = None;
            let end_run = |run: &mut Option<(usize, usize)>| {
                let Some((from, to)) = run.take() else { return };
                let (at, len) = (inner.folio_addr(from), (to - from) << inner.folio_shift);
                let t = if sh.uffd.write_protect(at, len, true).is_ok() { folio::Transition::Shared } else { folio::Transition::Adopted };
                for idx in from..to {
                    inner.finish(idx, folio::EMPTY, t, None);
                }
            };
            for idx in 0..folios {
                if idx % chunk == 0 {
                    let n = (folios - idx).min(chunk) * per;
                    known = sh.pagemap(inner.folio_addr(idx), &mut entries[..n]);
                }
                if let Some(i) = inherit {
                    if i.first_state(&inner, idx) {
                        end_run(&mut run);
                        continue;
                    }
                }
                if inner.all_gone(idx) {
                    end_run(&mut run);
                    inner.finish(idx, folio::EMPTY, folio::Transition::Dropped { unmap: true }, None);
                    continue;
                }
                let mine = &entries[(idx % chunk) * per..][..per];
                let at = inner.folio_addr(idx);
                // Unknown (pagemap unreadable): taken as data, never as zeros. Not the
                // pages of a torn folio that are gone: they may be another mapping's.
                if !known || mine.iter().enumerate().any(|(i, &e)| holds_data(e) && !inner.gone_at(at + i * fault::PAGE)) {
                    if share {
                        run = Some(run.map_or((idx, idx + 1), |(from, _)| (from, idx + 1)));
                        continue;
                    }
                    inner.finish(idx, folio::EMPTY, folio::Transition::Adopted, None);
                    taken += folio_size as u64;
                } else {
                    end_run(&mut run);
                    inner.unlock(idx, folio::EMPTY);
                }
            }
            end_run(&mut run);
            // Adopted memory was measured as not managed: it is charged as resident
            // now, and counted once (the next measure is exact again). Counted twice,
            // a Go heap adopted 100 MiB at a time read up to 32 MiB over its peak.
            if adopted.is_some() {
                let _ = sh.unmanaged.fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(taken)));
            }
            if sh.usage() > sh.high_watermark() {
                sh.kick_reclaimer();
            }
        }
        if let Some(kind) = adopted {
            sh.adopted[kind as usize].fetch_add(len as u64, Relaxed);
        }
        let region = Region { inner: Some(inner), runtime: self.clone() };
        match unchecked {
            None => Ok(region),
            Some(err) => Err(err), // `region` goes, holding nothing
        }
    }

    /// Live counters (also published to [`stats_path`]).
    /// How the runtime's userfaultfd was opened.
    pub fn access(&self) -> uffd::Access {
        self.inner.shared.access
    }

    pub fn stats(&self) -> RuntimeStats {
        self.inner.shared.snapshot()
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.inner.shared.store
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.shared.cfg
    }

    /// Changes the budget while regions are in use. Lower, the reclaimer is woken and
    /// brings usage down (faults wait for it past the new throttle limit, as usual);
    /// higher, nothing moves until it is needed. If `Runtime::new` derived the pool's
    /// limit from the budget (a `writeback_dir`), the limit follows. A budget smaller
    /// than the largest folio of a live region is refused.
    pub fn set_budget(&self, bytes: u64) -> Result<(), Error> {
        let sh = &self.inner.shared;
        let largest = sh.regions.lock().iter().map(|r| r.folio_size).max().unwrap_or(MIN_FOLIO);
        if bytes < largest as u64 {
            return Err(Error::BudgetTooSmall { budget: bytes, folio: largest });
        }
        sh.budget.store(bytes, Relaxed);
        sh.pool_follows_budget();
        sh.kick_reclaimer();
        sh.charges.wake_all();
        Ok(())
    }

    /// The budget in force (in a group: this process's share now).
    pub fn budget(&self) -> u64 {
        self.inner.shared.budget()
    }

    /// Leaves the group, if in one (the process is exiting): the coordinator no longer
    /// counts it, and the last share it had stays its budget.
    pub fn leave_group(&self) {
        if let Some(m) = &self.inner.shared.group {
            m.leave();
        }
    }

    /// Whether this runtime shares a group's budget.
    pub fn in_group(&self) -> bool {
        self.inner.shared.group.is_some()
    }

    /// The process is exiting (the shim's exit handler): from now on the reclaimer
    /// takes nothing out, and this returns once it is not taking anything out. What is
    /// resident then stays so, and what a fault brings back stays too: exit's last
    /// accesses that the kernel makes itself (stdio's flush, from inside libc, where
    /// a userfaultfd that does not serve the kernel's faults gives EFAULT) find their
    /// pages once they were touched. Faults no longer wait for room. It waits for the
    /// reclaimer's current step at most (a bounded batch), never for a fault.
    pub fn hold_reclaim_for_exit(&self) {
        let sh = &self.inner.shared;
        sh.reclaim_gate.close_for_good();
        // After it left: it may have cleared it on its way out.
        sh.declare_reclaim_stuck();
    }

    /// Test hook (fault injection): while `paused`, the reclaimer does nothing, as if
    /// it were starved of CPU. Faults still complete: past the throttle limit they
    /// wait for it once, then run over the budget, counted as `over_budget`. A pause
    /// waits for a bout of eviction in progress to end (it looks at the flag between
    /// steps): once it returns, nothing is taken out until resumed.
    #[doc(hidden)]
    pub fn pause_reclaimer(&self, paused: bool) {
        let sh = &self.inner.shared;
        sh.reclaim_paused.store(paused, SeqCst);
        if paused && !sh.reclaim_gate.closing() {
            drop(sh.reclaim_gate.close());
        }
        sh.kick_reclaimer();
    }

    /// Test hook (fault injection): the next `n` fills or moves of more than a page
    /// into a region stop half-way with EAGAIN, as when another thread's drop is
    /// queued meanwhile (`Uffd::inject_again`).
    #[doc(hidden)]
    pub fn inject_fill_again(&self, n: u32) {
        self.inner.shared.uffd.inject_again(n);
    }

    /// Test hook: whether the reader holds drops or unmaps it has read but not yet
    /// applied (a folio they cover was busy). Seen false after a munmap of a
    /// registered range returned, every event read before it is applied.
    #[doc(hidden)]
    pub fn range_events_pending(&self) -> bool {
        self.inner.shared.events_busy.load(SeqCst)
    }

    /// Bytes counted against the budget now: resident pages plus the pool.
    pub fn usage(&self) -> u64 {
        self.inner.shared.refresh_usage()
    }

    /// Faults resolved so far (all sizes); cheap.
    pub fn fault_count(&self) -> u64 {
        self.inner.shared.stats.sizes.iter().map(|s| s.faults.load(Relaxed)).sum()
    }

    /// Writes the stats file now (it is otherwise refreshed about once a second).
    pub fn publish_stats(&self) {
        self.inner.shared.publish_stats();
    }
}

/// What kind of the program's memory an adopted region is (stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// The brk heap (glibc's main arena).
    Heap = 0,
    /// Any other anonymous mapping: other arenas, allocators' and runtimes' own.
    Mapping = 1,
}

impl MemoryKind {
    pub const ALL: [MemoryKind; 2] = [MemoryKind::Heap, MemoryKind::Mapping];
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Heap => "heap",
            MemoryKind::Mapping => "mapping",
        }
    }
}

/// A managed region. Dropping it unmaps it and frees what it held in every tier.
pub struct Region {
    inner: Option<Arc<RegionInner>>,
    runtime: Runtime,
}

impl Region {
    fn r(&self) -> &RegionInner {
        self.inner.as_ref().expect("region alive until drop")
    }

    /// Start of the region (changes if the program mremaps the whole region).
    pub fn as_ptr(&self) -> *mut u8 {
        self.r().base.load(Acquire) as *mut u8
    }

    pub fn len(&self) -> usize {
        self.r().len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// What kind of the program's memory it is, if adopted (`Runtime::adopt_region`).
    pub fn adopted(&self) -> Option<MemoryKind> {
        self.r().adopted
    }

    /// What the flight recorder (trace.rs, once enabled) holds of the folio at `addr`:
    /// for a test to explain a page read back wrong.
    pub fn folio_history(&self, addr: usize) -> Vec<String> {
        let r = self.r();
        let idx = (addr - r.base.load(Acquire)) >> r.folio_shift;
        let now = format!("now {} (kept: {})", folio::state_name(r.folios.peek(idx)), r.folios.kept(idx));
        let mut lines = trace::history(r.key(idx));
        lines.push(now);
        lines
    }

    /// Whether the program has unmapped all of it (munmap, MAP_FIXED over it): an
    /// adopted region is then only waiting to be dropped.
    pub fn all_unmapped(&self) -> bool {
        let r = self.r();
        (0..r.folios()).all(|idx| r.folios.peek(idx) == UNMAPPED)
    }

    /// Whether part of `[start, end)` is still this region's: a folio there the program
    /// has not unmapped whole. The rest of its range may be adopted again (a brk heap
    /// trimmed and regrown: the runtime refuses only what a region still has).
    pub fn manages(&self, start: usize, end: usize) -> bool {
        self.r().live_within(start, end)
    }

    pub fn folio_size(&self) -> usize {
        self.r().folio_size
    }

    /// Test hook: the start of the region's shadow, where evicted pages wait (as long
    /// as the region), for tests of a program that writes over it.
    #[doc(hidden)]
    pub fn shadow_ptr(&self) -> *mut u8 {
        self.r().shadow as *mut u8
    }

    /// Test hook: lifts the write protection of `[addr, addr + len)` behind the
    /// runtime's back, as a bug would, for the test of the check that keeps a clean
    /// folio's write from being lost (reclaim.rs `changed_since_stored`,
    /// `still_protected`).
    #[doc(hidden)]
    pub fn open_for_writing(&self, addr: usize, len: usize) {
        self.r().shared.uffd.write_protect(addr, len, false).expect("UFFDIO_WRITEPROTECT");
    }

    /// Test hook: protects `[addr, addr + len)` again behind the runtime's back, so a
    /// write let in by [`Region::open_for_writing`] leaves no trace in the page tables
    /// (as one through a stale TLB entry would), for the test of the checksum a clean
    /// eviction compares (reclaim.rs `changed_since_stored`).
    #[doc(hidden)]
    pub fn close_for_writing(&self, addr: usize, len: usize) {
        self.r().shared.uffd.write_protect(addr, len, true).expect("UFFDIO_WRITEPROTECT");
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let Some(r) = self.inner.take() else { return };
        let sh = &self.runtime.inner.shared;
        if r.adopted.is_some() {
            return release_adopted(sh, &r);
        }
        // No more faults or events for it, then no more lookups of it.
        unregister(sh, &r);
        fault::table_remove(&r);
        for idx in 0..r.folios() {
            let prev = r.lock(idx);
            if prev != UNMAPPED {
                r.book().record(idx, prev, folio::Transition::Dropped { unmap: true }, None);
            }
            r.unlock(idx, UNMAPPED);
        }
        // Unmapped: what the program did not unmap itself. Pages it did (whole folios,
        // or parts of torn ones: region.rs) may be another mapping's by now.
        r.live_spans(|start, len| {
            // SAFETY: [start, start + len) is in this region's mapping, every folio of
            // it locked and marked UNMAPPED above with the region out of the fault
            // table, so no fault or reclaim touches it.
            unsafe { libc::munmap(start as *mut _, len) };
        });
        // The shadow goes with the last reference (region.rs): the reclaimer may still
        // hold one, with a batch of shadow pages to free.
        sh.regions.lock().retain(|x| !Arc::ptr_eq(x, &r));
    }
}

/// Unregisters a region being released: the pages the program has not unmapped
/// (region.rs `live_spans`; the others may be another region's by now, registered
/// too). The kernel takes a range partly unmapped, and refuses one with no mapping
/// left at all (EINVAL, on 6.18), which then is expected: nothing is registered there
/// (an unmap whose event is not read yet). Any other errno is counted and said, and
/// nothing is lost: the region's folios are dropped or left in place next.
fn unregister(sh: &Shared, r: &RegionInner) {
    r.live_spans(|start, len| {
        if let Err(e) = sh.uffd.unregister(start, len) {
            let errno = e.raw_os_error().unwrap_or(0);
            if errno == libc::EINVAL && !fault::still_mapped(start) {
                return;
            }
            let then = b": the range may still send faults (said once; see ioctl_errors)\n";
            fault::unexpected_once!(sh, r.order(), b"UFFDIO_UNREGISTER", errno, then);
        }
    });
}

/// Lets go of an adopted region: every folio is brought back in place (as for a fork),
/// the range unregistered (faults waiting on a hole retry as plain anonymous memory,
/// zeros) and the region retired; the mapping stays the program's.
fn release_adopted(sh: &Arc<Shared>, r: &Arc<RegionInner>) {
    let mut buf = vec![0u8; r.folio_size];
    let states: Vec<u8> = (0..r.folios()).map(|idx| fault::lock_in_place(r, idx, &mut buf)).collect();
    unregister(sh, r);
    fault::table_remove(r);
    if let Some(kind) = r.adopted {
        sh.adopted[kind as usize].fetch_sub(r.len as u64, Relaxed);
    }
    for (idx, prev) in states.into_iter().enumerate() {
        if prev != UNMAPPED {
            r.book().record(idx, prev, folio::Transition::Dropped { unmap: true }, None);
        }
        r.unlock(idx, UNMAPPED);
    }
    sh.regions.lock().retain(|x| !Arc::ptr_eq(x, r));
}

/// pagemap entry bits: the page is present; swapped out by the kernel; write-protected
/// by a userfaultfd (PM_UFFD_WP); mapped by this process alone (PM_MMAP_EXCLUSIVE).
pub(crate) const PM_PRESENT: u64 = 1 << 63;
pub(crate) const PM_SWAP: u64 = 1 << 62;
pub(crate) const PM_UFFD_WP: u64 = 1 << 57;
pub(crate) const PM_EXCLUSIVE: u64 = 1 << 56;

/// Whether a pagemap entry names a page that holds data: present, or swapped out by
/// the kernel.
pub(crate) fn holds_data(entry: u64) -> bool {
    entry & (PM_PRESENT | PM_SWAP) != 0
}
