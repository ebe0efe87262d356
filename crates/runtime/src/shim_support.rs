//! What the preload shim (crates/shim) and `uzswap run` need from the runtime beyond
//! regions: the settings shared by the command line, the environment and a config file
//! (defined in settings.rs, re-exported here), and kernel access. The exit summary is
//! [`crate::RuntimeStats::summary`].
//!
//! # Fork
//! In [`crate::fork`]: the hold around a libc fork, and what a child takes over.
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
use crate::fork::unlock_held;
use crate::region::*;
pub use crate::settings::{auto_writeback_dir, format_bytes, format_size, parse_size, SettingDef, Settings, Writeback, SETTINGS};
use crate::{Runtime, MAX_FOLIO};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

// ---- Kernel access. ----

/// Folios held in place (locked: the reclaimer skips them) for the kernel to access;
/// unlocked, as they were, on drop.
pub struct InPlace {
    held: Vec<(Arc<RegionInner>, usize, u8)>,
    complete: bool,
}

impl InPlace {
    /// Whether every page named was in place when its folio was held. Not when the
    /// reclaimer won the race each time: the held folio lacks a page, and a fault on
    /// it would wait for the hold, so a holder that touches the memory itself (not
    /// only the kernel) must let go.
    pub fn complete(&self) -> bool {
        self.complete
    }
}

impl Drop for InPlace {
    fn drop(&mut self) {
        for (r, idx, state) in self.held.drain(..) {
            unlock_held(&r, idx, state);
        }
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
        // A folio's buffer, made only if a page must be brought in: holds are taken
        // around every flush of a stream (the shim), mostly on memory in place.
        let mut buf = Vec::new();
        let mut hold = InPlace { held: Vec::new(), complete: true };
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
                    let present = self.all_present(a, z - a, write);
                    if present || attempt == 7 {
                        hold.complete &= present;
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
    fn fault_in(&self, addr: usize, len: usize, buf: &mut Vec<u8>, write: bool) {
        let access = if write { Access::Write } else { Access::Read };
        self.not_in_place(addr, len, write, |r, page| {
            // Waits as a SIGBUS handler does (busy folio, budget); defers only when a
            // change of the mapping is pending, which the reader settles.
            if buf.is_empty() {
                buf.resize(MAX_FOLIO, 0);
            }
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
                if e & crate::PM_PRESENT != 0 && !(write && e & crate::PM_UFFD_WP != 0) {
                    continue;
                }
                let page = a + i * PAGE;
                let guard = TableGuard::enter();
                if let Some(r) = guard.find(page, |r| r.shared.id == sh.id) {
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
