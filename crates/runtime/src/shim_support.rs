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
//! (its threads do not exist there): it forgets the hold.

use crate::fault::{bring_back, Why};
use crate::region::*;
pub use crate::settings::{format_bytes, format_size, parse_size, SettingDef, Settings, SETTINGS};
use crate::{Runtime, MAX_FOLIO};
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
                let prev = r.lock(idx);
                let now = match prev {
                    SWAPPED | PROBATION => {
                        let res = (prev == SWAPPED).then(|| r.book().reserve(prev));
                        // Waits as a SIGBUS handler does (we are not the reader); an
                        // unreadable folio is poisoned, as a fault would find it.
                        match bring_back(&r, idx, prev, &mut buf, Why::Fork, true, res) {
                            Some(now) => now,
                            // The range went away under us: the UNMAP event frees it.
                            None => r.lock(idx),
                        }
                    }
                    s => s,
                };
                states.push(now);
            }
            // SAFETY: madvise on the region's own mapping.
            unsafe { libc::madvise(r.base.load(Acquire) as *mut _, r.len, libc::MADV_DOFORK) };
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
            // SAFETY: as in hold_for_fork.
            unsafe { libc::madvise(r.base.load(Acquire) as *mut _, r.len, libc::MADV_DONTFORK) };
            for (idx, &s) in states.iter().enumerate() {
                if s == RESIDENT {
                    r.unlock_faulted_in(idx, s);
                } else {
                    r.unlock(idx, s);
                }
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
