//! What the preload shim (crates/shim) and `uzswap run` need from the runtime beyond
//! regions: the settings shared by the command line, the environment and a config file
//! (defined in settings.rs, re-exported here), and fork support. The exit summary is
//! [`crate::RuntimeStats::summary`].
//!
//! # Fork
//! Regions are MADV_DONTFORK, so a child would not see them at all. Before fork the shim
//! calls [`Runtime::hold_for_fork`]: every folio of every region is locked (the reclaimer
//! skips locked folios, faults wait), its data brought back into place (from the store
//! or the shadow), and the regions marked MADV_DOFORK. The child gets a plain copy of
//! the memory (its mappings lose the userfaultfd registration, as the kernel drops it
//! without EVENT_FORK); the parent calls [`ForkHold::resume`], which marks the regions
//! DONTFORK again and unlocks the folios. The child must never use the parent's runtime
//! (its threads do not exist there): it forgets the hold and the parent's runtime
//! ([`forget_parent_in_child`]), and may start one of its own.
//!
//! # Kernel access userfaultfd cannot serve
//! The kernel reads or writes a process's memory for /proc/<pid>/mem and ptrace without
//! waiting for a userfaultfd handler (the fault would have to be retried, which those
//! paths do not allow), and on the SIGBUS path process_vm_readv/writev get no handler
//! either: a page not in place fails them (EIO, EFAULT). [`Runtime::hold_in_place`]
//! puts a range in place first, as read faults would, without touching it (it may be
//! PROT_NONE, which those paths read anyway), and keeps the reclaimer off it until the
//! access is done.

use crate::fault::{resolve, Access, Caller, Resolve, TableGuard, PAGE};
use crate::region::*;
pub use crate::settings::{auto_writeback_dir, format_bytes, format_size, parse_size, SettingDef, Settings, Writeback, SETTINGS};
use crate::{Runtime, Shared, MAX_FOLIO};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

// ---- Fork. ----

/// Every folio of every region of a runtime locked and in place, regions MADV_DOFORK.
pub struct ForkHold {
    runtime: Runtime,
    /// Per region, its folios' states to unlock with.
    held: Vec<(Arc<RegionInner>, Vec<u8>)>,
}

impl Runtime {
    /// Prepares the regions for fork(2) (see the module comment). Takes as long as
    /// bringing every swapped-out folio back: the child gets all of the memory.
    pub fn hold_for_fork(&self) -> ForkHold {
        let sh = &self.inner.shared;
        let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
        let mut buf = vec![0u8; MAX_FOLIO];
        let mut held = Vec::with_capacity(regions.len());
        for r in regions {
            let mut states = Vec::with_capacity(r.folios());
            for idx in 0..r.folios() {
                states.push(crate::fault::lock_in_place(&r, idx, &mut buf));
            }
            set_inherited(sh, &r, true);
            held.push((r, states));
        }
        ForkHold { runtime: self.clone(), held }
    }
}

impl ForkHold {
    /// In the parent after fork: regions DONTFORK again, folios unlocked, reclaim kicked.
    pub fn resume(self) {
        let sh = &self.runtime.inner.shared;
        for (r, states) in &self.held {
            set_inherited(sh, r, false);
            for (idx, &s) in states.iter().enumerate() {
                unlock_held(r, idx, s);
            }
        }
        sh.kick_reclaimer();
    }

    /// In the child: the memory is plain now and the parent's runtime is not ours to
    /// touch (its threads are not here), so nothing is released.
    pub fn forget_in_child(self) {
        std::mem::forget(self);
    }
}

/// Whether a child forked now gets a copy of region `r` (MADV_DOFORK for a fork
/// hold, MADV_DONTFORK again after it). Adopted regions are the program's own
/// mappings and keep whatever the program chose. A failure is counted and said once:
/// nothing is lost, but a child then misses the memory, or later children copy it.
fn set_inherited(sh: &Shared, r: &RegionInner, inherit: bool) {
    if r.adopted.is_some() {
        return;
    }
    let advice = if inherit { libc::MADV_DOFORK } else { libc::MADV_DONTFORK };
    // SAFETY: madvise on the region's own mapping changes only what fork copies.
    if unsafe { libc::madvise(r.base.load(Acquire) as *mut _, r.len, advice) } != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if inherit {
            let then = b": a child forked now does not get that memory (said once; see ioctl_errors)\n";
            crate::fault::unexpected_once!(sh, r.order(), b"MADV_DOFORK (a region held for fork)", errno, then);
        } else {
            let then = b": later children get a copy of that region (said once; see ioctl_errors)\n";
            crate::fault::unexpected_once!(sh, r.order(), b"MADV_DONTFORK (a region after fork)", errno, then);
        }
    }
}

/// In a forked child, before it starts a runtime of its own: forgets every trace of
/// the parent's runtime in the process-wide state (the region table, which the new
/// runtime's lookups and the SIGBUS handler read; the table's reader count, which a
/// thread of the parent may have held at fork; the stats file name; the descriptor
/// limit lowered below the parent's descriptors, which the new ones take). Nothing of
/// the parent's is freed or dropped: its threads are not here, and its memory is the
/// child's now. Call once, on the child's only thread, after
/// [`crate::fds::drop_in_child`].
pub fn forget_parent_in_child() {
    crate::fault::forget_regions_in_child();
    crate::forget_stats_file_in_child();
    crate::fds::unseal_in_child();
}

// ---- Kernel access. ----

/// Folios held in place (locked: the reclaimer skips them) for the kernel to access;
/// unlocked, as they were, on drop.
pub struct InPlace {
    held: Vec<(Arc<RegionInner>, usize, u8)>,
}

impl Drop for InPlace {
    fn drop(&mut self) {
        for (r, idx, state) in self.held.drain(..) {
            unlock_held(&r, idx, state);
        }
    }
}

/// Unlocks a folio a hold kept locked. A resident one goes back on the reclaimer's
/// lists: the reclaimer drops what it finds locked, and the access just used it.
fn unlock_held(r: &RegionInner, idx: usize, state: u8) {
    if mapped(state) {
        r.unlock_faulted_in(idx, state);
    } else {
        r.unlock(idx, state);
    }
}

impl Runtime {
    /// Puts every page of each `(addr, len, write)` range that lies in one of this
    /// runtime's regions in place (swapped out, on probation, never touched or dropped: as a read fault
    /// would, or a write fault with `write`, which also lifts clean folios' write
    /// protection), and holds their folios there until the result drops. Nothing may
    /// then fault on them (a fault on a held folio would wait for the hold): only the
    /// access the hold was made for, which finds them in place. `len` should be well
    /// under the budget. Where the reclaimer keeps winning the race, the hold is given
    /// with what is in place, and the kernel's access fails on the rest.
    pub fn hold_in_place(&self, ranges: &[(usize, usize, bool)]) -> InPlace {
        let sh = &self.inner.shared;
        let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
        let mut buf = vec![0u8; MAX_FOLIO];
        let mut hold = InPlace { held: Vec::new() };
        // Folio by folio, in the order a fork hold takes them (regions in list order,
        // folios ascending), so two holders never wait for each other: each is put in
        // place, then locked, then seen in place, before the next (the reclaimer takes
        // freshly read, clean folios first).
        for r in &regions {
            let base = r.base.load(Acquire);
            let end = base + r.len;
            let overlaps = ranges.iter().filter(|&&(a, l, _)| a < end && a.saturating_add(l) > base);
            let Some(lo) = overlaps.clone().map(|&(a, _, _)| a.max(base)).min() else { continue };
            let hi = overlaps.map(|&(a, l, _)| a.saturating_add(l).min(end)).max().unwrap_or(lo);
            for idx in (lo - base) >> r.folio_shift..(hi - base).div_ceil(r.folio_size) {
                let (fa, fz) = (r.folio_addr(idx), r.folio_addr(idx) + r.folio_size);
                // The part of this folio the ranges name, and whether any writes it.
                let mut part: Option<(usize, usize, bool)> = None;
                for &(addr, len, write) in ranges {
                    let (a, z) = (addr.max(fa).max(base), addr.saturating_add(len).min(fz));
                    if a < z {
                        part = Some(match part {
                            None => (a, z, write),
                            Some((pa, pz, pw)) => (pa.min(a), pz.max(z), pw || write),
                        });
                    }
                }
                let Some((a, z, write)) = part else { continue };
                for attempt in 0..8 {
                    self.fault_in(a, z - a, &mut buf, write);
                    let state = r.lock(idx);
                    if self.all_present(a, z - a, write) || attempt == 7 {
                        hold.held.push((r.clone(), idx, state));
                        break;
                    }
                    r.unlock(idx, state);
                }
            }
        }
        hold
    }

    /// Whether every page of ours in the range is present (and not write-protected,
    /// with `write`).
    fn all_present(&self, addr: usize, len: usize, write: bool) -> bool {
        self.not_in_place(addr, len, write, |_, _| false)
    }

    /// Resolves, as read (or write) faults, the pages of `[addr, addr+len)` in this
    /// runtime's regions that are not in place (or write-protected).
    fn fault_in(&self, addr: usize, len: usize, buf: &mut [u8], write: bool) {
        let access = if write { Access::Write } else { Access::Read };
        self.not_in_place(addr, len, write, |r, page| {
            // Waits as a SIGBUS handler does (busy folio, budget); defers only when a
            // change of the mapping is pending, which the reader settles.
            for _ in 0..1000 {
                if resolve(r, page, buf, Caller::Holder, std::time::Instant::now(), access) != Resolve::Defer {
                    break;
                }
                std::thread::yield_now();
            }
            true
        });
    }

    /// Calls `each(region, page)` for every page of `[addr, addr+len)` in this
    /// runtime's regions that is not present (or, with `write`, write-protected), as
    /// /proc/self/pagemap tells (where it cannot be read, every page counts); `each`
    /// returns false to stop. True if none stopped it.
    fn not_in_place(&self, addr: usize, len: usize, write: bool, mut each: impl FnMut(&RegionInner, usize) -> bool) -> bool {
        let sh = &self.inner.shared;
        let mut entries = [0u64; 256];
        let end = addr.saturating_add(len);
        let mut a = addr & !(PAGE - 1);
        while a < end {
            let n = (end - a).div_ceil(PAGE).min(entries.len());
            if !sh.pagemap(a, &mut entries[..n]) {
                entries[..n].fill(0);
            }
            for (i, &e) in entries[..n].iter().enumerate() {
                if e & (1 << 63) != 0 && !(write && e & (1 << 57) != 0) {
                    continue;
                }
                let page = a + i * PAGE;
                let guard = TableGuard::enter();
                if let Some(r) = guard.find(page, Some(sh.id)) {
                    if !each(r, page) {
                        return false;
                    }
                }
            }
            a += n * PAGE;
        }
        true
    }
}
