//! uzswap's own heap: every Rust allocation in the preloaded library (the shim's tables,
//! the runtime's structures, std's buffers) comes from here, never from the program's
//! malloc. A program may bring its own allocator (jemalloc, tcmalloc, mimalloc, linked
//! in or preloaded) and call mmap while holding its own lock; if our code then called
//! the program's malloc, it would take that lock again and hang (a jemalloc-linked
//! server did, at startup). So the heap is dlmalloc over raw mmap system calls, which
//! no preload and no allocator sees, under one lock of its own. The C libraries
//! uzswap links (zstd, libdeflate) and glibc's allocations for uzswap's threads use it
//! too: the shim's malloc sends calls made inside uzswap here (alloc.rs).
//!
//! glibc allocates too, through the program's malloc, on behalf of the code that
//! calls it: thread creation (TLS), and the registration of a thread-local's
//! destructor, which std makes on the first use of a thread-local that has one (uzswap's
//! own have none; a crate's may). So the runtime makes all its threads
//! while it starts, before main, and [`__cxa_thread_atexit_impl`] registers nothing for
//! uzswap's own code.
//!
//! Not for the fault path: the SIGBUS handler and the reader never allocate at all
//! (runtime `signal_safety` tests). fork: [`follow_forks`] holds the lock across the
//! fork so the child never inherits it held by a thread that does not exist there.

use dlmalloc::{Allocator, Dlmalloc};
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::ptr::null_mut;

/// Pages from the kernel, by raw system call, carved from one reservation of address
/// space made on first use: so that "is this pointer ours" is one range check (the
/// shim's free asks it for every pointer the program frees), and so that the whole
/// heap is one record of ours for adoption to leave alone. Pages given back are
/// dropped (MADV_DONTNEED) and made inaccessible; their addresses are not reused
/// (a terabyte of address space lasts).
struct Pages;

const RESERVE: usize = 1 << 40;
static BASE: AtomicUsize = AtomicUsize::new(0);
/// Bytes of the reservation handed out (only grows; under the heap's lock).
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn syscall_ok(r: libc::c_long) -> bool {
    r >= 0
}

/// The reservation's start, made now if need be (under the heap's lock).
fn reservation() -> Option<usize> {
    let base = BASE.load(Acquire);
    if base != 0 {
        return Some(base);
    }
    let _making = start_making();
    // SAFETY: a new inaccessible mapping at an address of the kernel's choosing.
    let p = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            0usize,
            RESERVE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1i32,
            0usize,
        )
    };
    if p < 0 {
        return None;
    }
    note(p as usize, RESERVE);
    BASE.store(p as usize, Release);
    Some(p as usize)
}

/// Whether `p` points into uzswap's heap.
pub(crate) fn is_heap(p: *const c_void) -> bool {
    let base = BASE.load(Relaxed);
    base != 0 && (base..base + RESERVE).contains(&(p as usize))
}

/// Drops `[p, p + len)` of the reservation and makes it inaccessible again.
fn give_back(p: usize, len: usize) -> bool {
    // SAFETY: `[p, p + len)` is part of the reservation that dlmalloc gives back.
    unsafe {
        syscall_ok(libc::syscall(libc::SYS_madvise, p, len, libc::MADV_DONTNEED))
            && syscall_ok(libc::syscall(libc::SYS_mprotect, p, len, libc::PROT_NONE))
    }
}

// SAFETY: every method hands dlmalloc memory it alone owns (a fresh part of the
// reservation) or gives back exactly what it was handed, as the trait asks.
unsafe impl Allocator for Pages {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        let Some(base) = reservation() else { return (null_mut(), 0, 0) };
        let size = size.next_multiple_of(4096);
        let off = NEXT.load(Relaxed);
        if off + size > RESERVE {
            return (null_mut(), 0, 0);
        }
        // SAFETY: a part of the reservation no one has been handed yet.
        if !syscall_ok(unsafe { libc::syscall(libc::SYS_mprotect, base + off, size, libc::PROT_READ | libc::PROT_WRITE) }) {
            return (null_mut(), 0, 0);
        }
        NEXT.store(off + size, Relaxed);
        ((base + off) as *mut u8, size, 0)
    }

    fn remap(&self, _ptr: *mut u8, _oldsize: usize, _newsize: usize, _can_move: bool) -> *mut u8 {
        null_mut() // dlmalloc then allocates anew and copies
    }

    fn free_part(&self, ptr: *mut u8, oldsize: usize, newsize: usize) -> bool {
        give_back(ptr as usize + newsize, oldsize - newsize)
    }

    fn free(&self, ptr: *mut u8, size: usize) -> bool {
        give_back(ptr as usize, size)
    }

    fn can_release_part(&self, _flags: u32) -> bool {
        true
    }

    fn allocates_zeros(&self) -> bool {
        true
    }

    fn page_size(&self) -> usize {
        4096
    }
}

/// A lock that never allocates (a spin on one atomic word that yields the CPU when
/// contended: std's Mutex cannot be let go by hand after fork).
type Lock<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;

/// The global allocator of the preloaded library.
pub(crate) struct OwnHeap(Lock<Dlmalloc<Pages>>);

/// Rust allocations this big (folio buffers, tables) get pages of their own from the
/// reservation, not dlmalloc chunks: dlmalloc zeroes every calloc'd chunk, so each
/// 2 MiB `vec![0; MAX_FOLIO]` cost 2 MiB of memory in every process at once, where
/// fresh pages are zeros already and cost nothing until written. (Only Rust's, whose
/// frees give the size back; C's malloc stays on dlmalloc.)
const OWN_PAGES: usize = 256 << 10;

fn own_pages(l: &Layout) -> bool {
    l.size() >= OWN_PAGES && l.align() <= 4096
}

// SAFETY: dlmalloc meets GlobalAlloc's contract (blocks of at least the layout's size
// and alignment, freed with the layout they were made with); the lock serializes it.
// Big blocks are whole fresh pages of the reservation (page-aligned), told apart on
// free by the same layout test.
unsafe impl GlobalAlloc for OwnHeap {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let mut heap = self.0.lock();
        if own_pages(&l) {
            // Under the heap's lock, which guards the reservation's bump pointer.
            return Pages.alloc(l.size()).0;
        }
        heap.malloc(l.size(), l.align())
    }
    // SAFETY (alloc_zeroed, dealloc, realloc): the impl's note above; each method
    // keeps GlobalAlloc's contract for its own arguments.
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if own_pages(&l) {
            // SAFETY: the same layout; fresh pages of the reservation are zeros.
            return unsafe { self.alloc(l) };
        }
        self.0.lock().calloc(l.size(), l.align())
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if own_pages(&l) {
            give_back(p as usize, l.size().next_multiple_of(4096));
            return;
        }
        self.0.lock().free(p, l.size(), l.align())
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let Ok(to) = Layout::from_size_align(new, l.align()) else { return null_mut() };
        if !own_pages(&l) && !own_pages(&to) {
            return self.0.lock().realloc(p, l.size(), l.align(), new);
        }
        // SAFETY: a layout of non-zero size (`new` >= OWN_PAGES or `l`'s was).
        let q = unsafe { self.alloc(to) };
        if !q.is_null() {
            // SAFETY: both blocks are live and distinct; the smaller size fits both.
            unsafe {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new));
                self.dealloc(p, l);
            }
        }
        q
    }
}

#[global_allocator]
static HEAP: OwnHeap = OwnHeap(Lock::new(Dlmalloc::new_with_allocator(Pages)));

/// The malloc family on uzswap's heap, for the C code that runs inside uzswap (zstd
/// and libdeflate allocate their contexts with malloc; glibc allocates a new thread's
/// DTV): alloc.rs routes calls made inside the shim here, and frees of pointers into
/// the heap.
pub(crate) fn c_malloc(size: usize) -> *mut c_void {
    // SAFETY: dlmalloc's C-style entry point, under the heap's lock.
    unsafe { HEAP.0.lock().c_malloc(size).cast() }
}

/// # Safety
/// `p` came from this heap's C-style functions and is not used after.
pub(crate) unsafe fn c_free(p: *mut c_void) {
    // SAFETY: as the caller promises, under the heap's lock.
    unsafe { HEAP.0.lock().c_free(p.cast()) }
}

/// # Safety
/// `p` is null or came from this heap's C-style functions; on success it is dead.
pub(crate) unsafe fn c_realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: as the caller promises, under the heap's lock.
    unsafe { HEAP.0.lock().c_realloc(p.cast(), size).cast() }
}

pub(crate) fn c_memalign(align: usize, size: usize) -> *mut c_void {
    // SAFETY: dlmalloc's C-style entry point, under the heap's lock.
    unsafe { HEAP.0.lock().c_memalign(align, size).cast() }
}

/// Holds the heap's lock across every fork: registered first of all (proc.rs
/// `register_ours_first`), so its prepare handler runs after every other (which may
/// allocate) and its parent and child handlers before them. The child's heap is
/// consistent and its lock free, whichever thread was allocating when the program forked.
pub(crate) fn follow_forks() {
    extern "C" fn lock() {
        std::mem::forget(HEAP.0.lock());
    }
    extern "C" fn unlock() {
        // SAFETY: `lock` took the lock on this thread (the one that forks) and forgot
        // its guard; no other thread can take it meanwhile.
        unsafe { HEAP.0.force_unlock() };
    }
    crate::proc::register_atfork(lock, unlock, unlock);
}

/// glibc's registration of a thread-local's destructor, which allocates its list entry
/// with the program's calloc: std calls it on the first use of a thread-local that
/// needs one. For uzswap's own code (`inside`) nothing is registered and the destructor
/// never runs: uzswap's threads live as long as the process, and on a program's thread
/// uzswap's code keeps no thread-local that has one (its own are const-initialised, and
/// its locks, futexes from uzswap-sync, keep no per-thread data). Everyone else's
/// registrations go to glibc.
///
/// # Safety
/// The C++ ABI's contract: `dtor(obj)` may be called at this thread's exit; `dso` is
/// the registering object's `__dso_handle`.
#[no_mangle]
pub unsafe extern "C" fn __cxa_thread_atexit_impl(dtor: unsafe extern "C" fn(*mut c_void), obj: *mut c_void, dso: *mut c_void) -> c_int {
    if crate::inside() {
        return 0;
    }
    crate::real::__cxa_thread_atexit_impl()(dtor, obj, dso)
}

// ---- What is uzswap's, for the scan that adopts the program's memory (cover.rs). ----
//
// The runtime's `own_maps` keeps the records and their rules (recorded after the
// mapping is made, forgotten before it is unmapped, both inside the gate the scan
// closes while it registers). A full table only makes the scan stop adopting; it is
// sized far beyond what the runtime maps (a few mappings per region and per pool
// class, a few dozen heap segments, a stack per thread).

const RANGES: usize = 8192;
static OWN: uzswap_runtime::own_maps::OwnMaps<RANGES> = uzswap_runtime::own_maps::OwnMaps::new();

/// Marks a mapping of ours as being made until dropped (after `note`). Waits while
/// the scan registers a range it adopts (a few microseconds).
pub(crate) type Making = uzswap_runtime::own_maps::Making<'static, RANGES>;

pub(crate) fn start_making() -> Making {
    OWN.making()
}

/// Ends a mark handed over with `Making::hand_over`.
pub(crate) fn made() {
    OWN.made();
}

/// Whether a mapping of ours is being made or unmapped now.
pub(crate) fn being_made() -> bool {
    OWN.busy()
}

/// Waits out the mappings of ours being made, and keeps new ones from starting until
/// the result drops: a range found not to be ours meanwhile stays not ours. Only the
/// scan takes it, on its own thread, from its last look at a range to the range's
/// registration, and makes or unmaps no mapping meanwhile (its allocations come from
/// the heap's reservation, which needs none).
pub(crate) fn exclude_makers() -> uzswap_runtime::gate::Closed<'static> {
    OWN.exclude()
}

/// After fork, in the child: a mapping the parent's threads were making, or a scan
/// that was registering, will not finish here (those threads are not here).
pub(crate) fn forget_in_child() {
    OWN.reset_in_child();
}

/// Records `[start, start + len)` as uzswap's (the heap's pages, a mapping made by
/// uzswap's code), under a [`Making`].
pub(crate) fn note(start: usize, len: usize) {
    OWN.note(start, len);
}

/// Whether a record of ours was lost (a full table): nothing more is adopted.
pub(crate) fn records_lost() -> bool {
    OWN.lost()
}

/// Unmaps `[start, start + len)` with `unmap` (true if it did), its record forgotten
/// first: see the runtime's `own_maps`.
pub(crate) fn unmap(start: usize, len: usize, unmap: impl FnOnce() -> bool) -> bool {
    OWN.unmap(start, len, unmap)
}

/// Moves a mapping of ours with `remap` (mremap), its records following.
pub(crate) fn remap(old: usize, old_len: usize, new_len: usize, remap: impl FnOnce() -> Option<usize>) -> Option<usize> {
    OWN.remap(old, old_len, new_len, remap)
}

/// Whether any of `[start, end)` is recorded as uzswap's (allocates nothing).
pub(crate) fn any_within(start: usize, end: usize) -> bool {
    OWN.any_within(start, end)
}

/// The parts of `[start, end)` recorded as uzswap's, in address order.
pub(crate) fn within(start: usize, end: usize) -> Vec<(usize, usize)> {
    OWN.within(start, end)
}

/// Stack pointers of live threads, as each saw it when it started (ours and the
/// program's): a mapping that holds one is a stack, never adopted.
static STACKS: [AtomicUsize; RANGES] = [const { AtomicUsize::new(0) }; RANGES];

/// Records this thread's stack (by an address on it); returns its slot for `unnote_stack`.
pub(crate) fn note_stack() -> Option<usize> {
    let here = 0u8;
    let sp = std::ptr::addr_of!(here) as usize;
    STACKS.iter().position(|s| s.compare_exchange(0, sp, Relaxed, Relaxed).is_ok())
}

pub(crate) fn unnote_stack(slot: Option<usize>) {
    if let Some(i) = slot {
        STACKS[i].store(0, Relaxed);
    }
}

/// Records this thread's dynamic thread vector (DTV) as uzswap's: glibc allocates it
/// with malloc when it makes the thread, and every access to a thread-local of this
/// library goes through it (`__tls_get_addr`). No thread may
/// fault on it while running uzswap's code: a thread of ours (the reader would wait
/// for itself), nor a program thread inside an interposed call or a hold, which may
/// hold a lock the reader needs (a JVM thread freeing a kept copy held the store's LRU
/// lock when its next thread-local access faulted on its DTV in the adopted brk heap,
/// and the reader, serving that fault, waited for the lock: the JVM hung). So the
/// mapping that holds it is never adopted. The threads made after our constructor
/// get theirs from uzswap's heap (proc.rs `pthread_create`), as does a DTV glibc
/// grows later (`realloc` of a pointer into our heap stays there), unless the program
/// defines calloc itself (rustc, with jemalloc): glibc's own calls then go to the
/// program's allocator, whatever the shim binds for its own code (build.rs). So every
/// thread records its DTV when it starts (one inside our heap is covered already):
/// the main thread's (our constructor calls it), ours, and the program's. Not
/// covered: a program thread's DTV that its allocator placed in memory already
/// adopted (it is not taken back), nor one glibc grows later in such a program.
/// x86-64: the TCB's second word (`%fs:8`) points into it.
pub(crate) fn note_dtv() {
    let dtv: usize;
    // SAFETY: reads one word of this thread's TCB, which glibc sets up for every thread
    // (tcbhead_t: tcb, dtv, self, ...); no memory is written.
    unsafe { std::arch::asm!("mov {}, qword ptr fs:[8]", out(reg) dtv, options(nostack, readonly, preserves_flags)) };
    if dtv != 0 {
        // The vector is a few words before and after the pointer; a page either side.
        let (start, len) = ((dtv & !4095).saturating_sub(4096), 3 * 4096);
        // Threads come and go, their DTVs in the same few chunks: one record each.
        if !OWN.covers(start, start + len) {
            note(start, len);
        }
    }
}

/// Records this library's own writable segments (its .data and .bss: the tables here,
/// the table of managed ranges, the bootstrap buffer) as uzswap's. The part of a .bss
/// past the file's last page is an anonymous mapping like any other in
/// /proc/self/maps; adopted, uzswap's threads would fault on their own statics.
pub(crate) fn note_image() {
    // SAFETY (of calling it): dl_iterate_phdr's callback contract, which the loader
    // keeps: `info` is valid for the call.
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, _data: *mut c_void) -> c_int {
        // SAFETY: the loader hands a valid dl_phdr_info for the duration of the call.
        let info = unsafe { &*info };
        // SAFETY: ... whose dlpi_phdr has dlpi_phnum entries.
        let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        let here = note_image as *const () as usize;
        let load = |p: &&libc::Elf64_Phdr| p.p_type == libc::PT_LOAD;
        let ours = phdrs.iter().filter(load).any(|p| {
            let start = info.dlpi_addr as usize + p.p_vaddr as usize;
            (start..start + p.p_memsz as usize).contains(&here)
        });
        if !ours {
            return 0;
        }
        for p in phdrs.iter().filter(load).filter(|p| p.p_flags & libc::PF_W != 0) {
            let start = (info.dlpi_addr as usize + p.p_vaddr as usize) & !4095;
            let end = (info.dlpi_addr as usize + p.p_vaddr as usize + p.p_memsz as usize).next_multiple_of(4096);
            note(start, end - start);
        }
        1
    }
    // SAFETY: dl_iterate_phdr calls `each` with valid arguments, on this thread.
    unsafe { libc::dl_iterate_phdr(Some(each), std::ptr::null_mut()) };
}

/// Whether `[start, end)` holds a recorded thread stack.
pub(crate) fn holds_stack(start: usize, end: usize) -> bool {
    STACKS.iter().any(|s| (start..end).contains(&s.load(Relaxed)))
}
