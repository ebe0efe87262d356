//! mmap, munmap, mremap and madvise on managed ranges.

use crate::alloc::managed_alloc;
use crate::table::{self, Entry, Kind, TABLE};
use crate::{cover, inside, own, real, wants, Inside};
use std::ffi::{c_int, c_void};

const PAGE: usize = 4096;

/// Private anonymous memory.
fn private_anon(flags: c_int) -> bool {
    // The low bits are the mapping type (MAP_SHARED_VALIDATE = SHARED | PRIVATE).
    flags & 0x0f == libc::MAP_PRIVATE && flags & libc::MAP_ANONYMOUS != 0
}

/// Only plain private anonymous read-write memory is ours.
fn manageable(addr: *mut c_void, prot: c_int, flags: c_int) -> bool {
    let not_ours =
        libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE | libc::MAP_HUGETLB | libc::MAP_GROWSDOWN | libc::MAP_LOCKED | libc::MAP_STACK;
    let _ = addr; // a hint without MAP_FIXED may be ignored, as the kernel may
    private_anon(flags) && flags & not_ours == 0 && prot == libc::PROT_READ | libc::PROT_WRITE
}

/// # Safety
/// The C mmap contract: with MAP_FIXED, `addr` names memory the caller may replace.
#[no_mangle]
pub unsafe extern "C" fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: libc::off_t) -> *mut c_void {
    if wants(len) && manageable(addr, prot, flags) {
        if let Some(p) = managed_alloc(len, 0, Kind::Mmap) {
            return p as *mut c_void;
        }
    }
    if inside() {
        // uzswap's own mapping (a region, its shadow, the pool...): never adopted.
        let _making = own::start_making();
        let p = real::mmap()(addr, len, prot, flags, fd, off);
        if p != libc::MAP_FAILED {
            own::note(p as usize, len);
        }
        return p;
    }
    cover::program_mapped();
    let p = real::mmap()(addr, len, prot, flags, fd, off);
    if p != libc::MAP_FAILED && prot == libc::PROT_NONE && private_anon(flags) && flags & libc::MAP_FIXED == 0 {
        cover::program_reserved(p as usize, len);
    }
    p
}

/// mprotect: passed through. Making memory writable is how the JVM and V8 commit
/// what they reserved (V8 maps each large object's page PROT_NONE, then opens it): the
/// scan is told, as for a mapping made through libc, so it adopts the memory soon.
/// Async-signal-safe (a runtime may call it in a signal handler): one atomic store.
///
/// # Safety
/// The C mprotect contract.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    let rc = real::mprotect()(addr, len, prot);
    if rc == 0 && prot & libc::PROT_WRITE != 0 && !inside() {
        cover::program_committed(len);
    }
    if rc == 0 && prot != libc::PROT_READ | libc::PROT_WRITE && !inside() && table::maybe_managed(addr as usize, len) {
        table::REPROTECTED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    rc
}

/// # Safety
/// The C mmap64 contract (the same as mmap on 64-bit).
#[no_mangle]
pub unsafe extern "C" fn mmap64(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: libc::off_t) -> *mut c_void {
    mmap(addr, len, prot, flags, fd, off)
}

/// Drops `[lo, hi)` (offsets) of a range that stays: frees it in every tier and makes it
/// inaccessible, as unmapped memory is.
///
/// # Safety
/// `[base+lo, base+hi)` is inside a managed range the program itself gave up (munmap or
/// a shrinking mremap), so no live reference points into it.
unsafe fn punch_out(base: usize, lo: usize, hi: usize) {
    real::madvise()((base + lo) as *mut c_void, hi - lo, libc::MADV_DONTNEED);
    libc::mprotect((base + lo) as *mut c_void, hi - lo, libc::PROT_NONE);
}

/// munmap of memory recorded as uzswap's (`[start, end)`, `addr, len` rounded out to
/// pages): its record goes first (uzswap-runtime own_maps).
///
/// # Safety
/// The C munmap contract.
unsafe fn unmap_own(addr: *mut c_void, len: usize, start: usize, end: usize) -> c_int {
    let mut rc = -1;
    own::unmap(start, end - start, || {
        rc = real::munmap()(addr, len);
        rc == 0
    });
    rc
}

/// # Safety
/// The C munmap contract: nothing still in use lies in `[addr, addr+len)`.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    let (start, end) = (addr as usize, (addr as usize).saturating_add(len.div_ceil(PAGE) * PAGE));
    if inside() {
        return unmap_own(addr, len, start, end);
    }
    if start.is_multiple_of(PAGE) {
        cover::program_unmapped(start, end);
        // A mapping made inside, not a managed range, that the program unmaps: a
        // thread's stack, which glibc maps inside pthread_create and frees, when its
        // cache is full, on a thread of the program's.
        if own::any_within(start, end) && !table::maybe_managed(start, end - start) {
            return unmap_own(addr, len, start, end);
        }
    }
    if start % PAGE != 0 || len == 0 || !table::maybe_managed(start, end - start) {
        return real::munmap()(addr, len);
    }
    let _inside = Inside::enter();
    let mut released: Vec<Entry> = Vec::new();
    // Pieces of the range outside every managed entry, for libc.
    let mut gaps: Vec<(usize, usize)> = Vec::new();
    {
        let mut t = TABLE.write();
        let mut at = start;
        while at < end {
            let hit = table::containing(&t, at);
            let next_base = t.range(at + 1..end).next().map(|(&b, _)| b);
            match hit {
                None => {
                    let stop = next_base.unwrap_or(end);
                    gaps.push((at, stop));
                    at = stop;
                }
                Some(base) => {
                    let e = t.get_mut(&base).expect("entry just found");
                    let piece_end = end.min(base + e.cap());
                    let (lo, hi) = (at - base, piece_end - base);
                    let all_gone = (lo == 0 && hi >= e.user_len) || e.punch(lo, hi);
                    if all_gone {
                        released.push(t.remove(&base).expect("entry just found"));
                    } else if !e.orphan {
                        punch_out(base, lo, hi);
                    } else {
                        real::munmap()((base + lo) as *mut c_void, hi - lo);
                    }
                    at = piece_end;
                }
            }
        }
    }
    for e in released {
        e.release();
    }
    let mut rc = 0;
    for (a, b) in gaps {
        rc |= real::munmap()(a as *mut c_void, b - a);
    }
    rc
}

/// # Safety
/// The C mremap contract (the fifth argument is read only with MREMAP_FIXED, as libc does).
#[no_mangle]
pub unsafe extern "C" fn mremap(old: *mut c_void, old_len: usize, new_len: usize, flags: c_int, new_addr: *mut c_void) -> *mut c_void {
    let base = old as usize;
    let moving_fixed = flags & (libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP) != 0;
    if inside() {
        let mut p = libc::MAP_FAILED;
        own::remap(base, old_len, new_len, || {
            p = real::mremap()(old, old_len, new_len, flags, new_addr);
            if p != libc::MAP_FAILED && flags & libc::MREMAP_DONTUNMAP != 0 {
                own::note(base, old_len); // the old range stays mapped
            }
            (p != libc::MAP_FAILED).then_some(p as usize)
        });
        return p;
    }
    // Adopted memory the program moves goes back to plain memory first: a region
    // cannot follow a move of part of it (the runtime's notes on mremap).
    cover::release_overlapping(base, old_len);
    // A reservation moved or resized is no longer one whose bounds we know: not adopted.
    if base.is_multiple_of(PAGE) {
        cover::program_unmapped(base, base.saturating_add(old_len.next_multiple_of(PAGE)));
    }
    if moving_fixed || new_len == 0 || old_len == 0 || !table::maybe_managed(base, 1) {
        return real::mremap()(old, old_len, new_len, flags, new_addr);
    }
    let new_user = new_len.div_ceil(PAGE) * PAGE;
    let found = {
        let _inside = Inside::enter();
        let mut t = TABLE.write();
        match t.get_mut(&base) {
            Some(e) if !e.orphan && e.holes.is_empty() && old_len.div_ceil(PAGE) * PAGE == e.user_len.div_ceil(PAGE) * PAGE => {
                let cur = e.user_len.div_ceil(PAGE) * PAGE;
                if new_user <= e.cap() {
                    if new_user < cur {
                        punch_out(base, new_user, cur);
                    } else if new_user > cur {
                        libc::mprotect((base + cur) as *mut c_void, new_user - cur, libc::PROT_READ | libc::PROT_WRITE);
                    }
                    e.user_len = new_user;
                    return old;
                }
                Some(e.user_len)
            }
            _ => None,
        }
    };
    let Some(user_len) = found else {
        // Part of a managed range, or one we do not know: libc (and the runtime follows
        // what it can, see the runtime's notes on mremap).
        return real::mremap()(old, old_len, new_len, flags, new_addr);
    };
    if flags & libc::MREMAP_MAYMOVE == 0 {
        // Cannot grow in place: what the kernel says when the next range is taken.
        *libc::__errno_location() = libc::ENOMEM;
        return libc::MAP_FAILED;
    }
    let Some(n) = managed_alloc(new_user, 0, Kind::Mmap) else {
        *libc::__errno_location() = libc::ENOMEM;
        return libc::MAP_FAILED;
    };
    std::ptr::copy_nonoverlapping(old as *const u8, n as *mut u8, user_len.min(new_user));
    let _inside = Inside::enter();
    let e = TABLE.write().remove(&base);
    if let Some(e) = e {
        e.release();
    }
    n as *mut c_void
}

/// # Safety
/// The C madvise contract: destructive advice (DONTNEED, FREE) only on memory the
/// caller no longer needs.
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    // Adopted regions: what a child will get of them (cover.rs `ForkCopy`).
    if matches!(advice, libc::MADV_DONTFORK | libc::MADV_DOFORK | libc::MADV_WIPEONFORK | libc::MADV_KEEPONFORK) && !inside() {
        let _inside = Inside::enter();
        crate::cover::fork_advice(addr as usize, addr as usize + len, advice);
    }
    // Managed regions stay MADV_DONTFORK (fork, proc.rs, makes them inheritable for
    // its duration): the program's wish is recorded for fork to obey, and the rest of
    // its range gets the real call (and its errors).
    if (advice == libc::MADV_DOFORK || advice == libc::MADV_DONTFORK) && !inside() && table::maybe_managed(addr as usize, len) {
        let _inside = Inside::enter();
        let (lo, hi) = (addr as usize, addr as usize + len);
        let mut t = TABLE.write();
        let overlapping: Vec<usize> = t.range(..hi).filter(|(&b, e)| b + e.cap() > lo).map(|(&b, _)| b).collect();
        if !overlapping.is_empty() {
            for &b in &overlapping {
                let e = t.get_mut(&b).expect("just found");
                let (a, z) = (lo.max(b) - b, hi.min(b + e.cap()) - b);
                e.set_dontfork(a, z, advice == libc::MADV_DONTFORK);
            }
            let rc = real::madvise()(addr, len, advice);
            for &b in &overlapping {
                real::madvise()(b as *mut c_void, t[&b].cap(), libc::MADV_DONTFORK);
            }
            return rc;
        }
    }
    if advice == libc::MADV_WIPEONFORK && !inside() && table::maybe_managed(addr as usize, len) {
        let _inside = Inside::enter();
        let (lo, hi) = (addr as usize, addr as usize + len);
        for (_, e) in TABLE.write().range_mut(..hi).filter(|(&b, e)| b + e.cap() > lo) {
            e.wiped_on_fork = true;
        }
    }
    real::madvise()(addr, len, advice)
}
