//! The malloc family: requests of at least `threshold` bytes get a region of their own
//! (so calloc's zeros come free: a new region reads as zeros); the rest, and every
//! pointer that is not ours, go to libc. Calls made inside uzswap (the C libraries it
//! links, glibc's work for its threads) are served from uzswap's own heap (own.rs),
//! never the program's allocator, and pointers into that heap go back to it.

use crate::table::{self, Entry, Kind, TABLE};
use crate::{inside, own, real, wants, Inside};
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use uzswap_runtime::MAX_FOLIO;

/// A fresh managed range of `size` bytes aligned to `align` (0: any), or None (then the
/// caller asks libc). Takes the Inside guard itself.
pub(crate) fn managed_alloc(size: usize, align: usize, kind: Kind) -> Option<usize> {
    let _inside = Inside::enter();
    let rt = crate::runtime()?;
    let fit = size.checked_next_power_of_two()?.max(4096);
    let folio = crate::settings().folio_size.min(fit).max(align);
    if folio > MAX_FOLIO {
        return None;
    }
    let region = match rt.create_region(size, folio) {
        Ok(r) => r,
        Err(e) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Relaxed) {
                eprintln!("uzswap: leaving some memory unmanaged: {e}");
            }
            return None;
        }
    };
    let user_len = if kind == Kind::Mmap { size.div_ceil(4096) * 4096 } else { size };
    let e = Entry { region, kind, user_len, holes: Vec::new(), orphan: false, dontfork: Vec::new(), wiped_on_fork: false };
    let base = e.base();
    table::insert(e);
    Some(base)
}

/// (user_len, cap, orphan) of the malloc'd range starting at `p`. Call inside.
fn lookup_malloc(p: usize) -> Option<(usize, usize, bool)> {
    let t = TABLE.read();
    t.get(&p).filter(|e| e.kind == Kind::Malloc).map(|e| (e.user_len, e.cap(), e.orphan))
}

fn take_malloc(p: usize) -> Option<Entry> {
    let mut t = TABLE.write();
    match t.get(&p) {
        Some(e) if e.kind == Kind::Malloc => t.remove(&p),
        _ => None,
    }
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life
    // and written by no one else while we run.
    unsafe { *libc::__errno_location() = e };
}

/// # Safety
/// The C malloc contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if real::resolving() {
        return real::boot_alloc(size);
    }
    if inside() {
        return own::c_malloc(size);
    }
    if wants(size) {
        if let Some(p) = managed_alloc(size, 0, Kind::Malloc) {
            return p as *mut c_void;
        }
    }
    real::malloc()(size)
}

/// # Safety
/// The C calloc contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return null_mut();
    };
    if real::resolving() {
        return real::boot_alloc(total);
    }
    if inside() {
        let p = own::c_malloc(total);
        if !p.is_null() {
            std::ptr::write_bytes(p.cast::<u8>(), 0, total);
        }
        return p;
    }
    if wants(total) {
        if let Some(p) = managed_alloc(total, 0, Kind::Malloc) {
            return p as *mut c_void;
        }
    }
    real::calloc()(n, size)
}

/// # Safety
/// The C free contract: `p` is null or a live pointer from this malloc family.
#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() || real::is_boot(p) {
        return;
    }
    if own::is_heap(p) {
        return own::c_free(p);
    }
    if table::maybe_managed(p as usize, 1) && !inside() {
        let _inside = Inside::enter();
        if let Some(e) = take_malloc(p as usize) {
            e.release();
            return;
        }
    }
    real::free()(p)
}

/// # Safety
/// The C realloc contract: `p` is null or a live pointer from this malloc family;
/// on success it is dead and the result takes its place.
#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    if real::resolving() {
        let n = real::boot_alloc(size);
        if !p.is_null() && !n.is_null() {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), n.cast::<u8>(), size.min(real::boot_room(p)));
        }
        return n;
    }
    if p.is_null() {
        return malloc(size);
    }
    if own::is_heap(p) {
        return own::c_realloc(p, size);
    }
    if real::is_boot(p) {
        let n = malloc(size);
        if !n.is_null() {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), n.cast::<u8>(), size.min(real::boot_room(p)));
        }
        return n;
    }
    if table::maybe_managed(p as usize, 1) && !inside() {
        let info = {
            let _inside = Inside::enter();
            lookup_malloc(p as usize)
        };
        if let Some((user_len, cap, orphan)) = info {
            if size == 0 {
                free(p);
                return null_mut();
            }
            if size <= cap && !orphan {
                let _inside = Inside::enter();
                if let Some(e) = TABLE.write().get_mut(&(p as usize)) {
                    e.user_len = size;
                }
                return p;
            }
            let n = malloc(size);
            if n.is_null() {
                return null_mut();
            }
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), n.cast::<u8>(), user_len.min(size));
            free(p);
            return n;
        }
    }
    if wants(size) {
        let old = real::malloc_usable_size()(p);
        if let Some(n) = managed_alloc(size, 0, Kind::Malloc) {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), n as *mut u8, old.min(size));
            real::free()(p);
            return n as *mut c_void;
        }
    }
    real::realloc()(p, size)
}

/// # Safety
/// As [`realloc`].
#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        Some(total) => realloc(p, total),
        None => {
            set_errno(libc::ENOMEM);
            null_mut()
        }
    }
}

/// A managed allocation of `size` bytes aligned to `align` (or one from uzswap's own
/// heap, inside uzswap), or None (libc's turn).
fn aligned(align: usize, size: usize) -> Option<*mut c_void> {
    if inside() && !real::resolving() {
        return Some(own::c_memalign(align, size));
    }
    if wants(size) && align.is_power_of_two() && align <= MAX_FOLIO {
        return managed_alloc(size, align, Kind::Malloc).map(|p| p as *mut c_void);
    }
    None
}

/// # Safety
/// The C posix_memalign contract: `out` is valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    if let Some(p) = aligned(align, size) {
        if p.is_null() {
            return libc::ENOMEM;
        }
        *out = p;
        return 0;
    }
    real::posix_memalign()(out, align, size)
}

/// # Safety
/// The C aligned_alloc contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    aligned(align, size).unwrap_or_else(|| real::aligned_alloc()(align, size))
}

/// # Safety
/// The C memalign contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    aligned(align, size).unwrap_or_else(|| real::memalign()(align, size))
}

/// # Safety
/// The C valloc contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    aligned(4096, size).unwrap_or_else(|| real::valloc()(size))
}

/// # Safety
/// The C pvalloc contract: none beyond it being called as C calls it.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    aligned(4096, size.div_ceil(4096) * 4096).unwrap_or_else(|| real::pvalloc()(size))
}

/// # Safety
/// The C malloc_usable_size contract: `p` is null or a live pointer from this malloc family.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    if p.is_null() {
        return 0;
    }
    if real::is_boot(p) {
        return real::boot_room(p);
    }
    if own::is_heap(p) {
        // Only uzswap's own C code holds such pointers, and none of it asks.
        return 0;
    }
    if table::maybe_managed(p as usize, 1) && !inside() {
        let _inside = Inside::enter();
        if let Some((_, cap, _)) = lookup_malloc(p as usize) {
            return cap;
        }
    }
    real::malloc_usable_size()(p)
}
