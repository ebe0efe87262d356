//! What the preload shim (crates/shim) and `uzswap run` need from the runtime beyond
//! regions: the settings shared by the command line, the environment and a config file
//! (defined in settings.rs, re-exported here); the exit summary; and fork support.
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

use crate::fault::{fill, move_back};
use crate::region::*;
use crate::stats::bump;
pub use crate::settings::{format_bytes, format_size, parse_size, SettingDef, Settings, SETTINGS};
use crate::{Runtime, MAX_FOLIO};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

// ---- The summary. ----

fn field(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_u64().unwrap_or(0)
}

/// The folio size named by a "hugepages-<N>kB" key.
fn folio_bytes_of(name: &str) -> u64 {
    name.trim_start_matches("hugepages-").trim_end_matches("kB").parse::<u64>().map_or(0, |kb| kb * 1024)
}

/// The kernel-style summary of a stats object (as published by the runtime, see
/// `stats.rs`): totals in 4 KiB pages as vmstat counts them, then one line per folio size.
pub fn format_summary(v: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let pool = field(v, &["pool_total_size"]);
    let stored = field(v, &["store", "stored_pages"]) * 4096;
    // Swap-ins are the runtime's, per folio size: a clean folio read back keeps its
    // store entry, so the store's own zswpin counts only entries freed by a load.
    let swapped_in: u64 = v["sizes"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, c)| field(c, &["zswpin"]) * folio_bytes_of(name))
        .sum();
    let ratio = if pool == 0 { 1.0 } else { stored as f64 / pool as f64 };
    let _ = writeln!(
        s,
        "uzswap: pid {} budget {} ({} fault path): swapped out {}, swapped in {}; now resident {}, pool {} holding {} (ratio {:.2}, {} saved)",
        field(v, &["pid"]),
        format_bytes(field(v, &["budget_bytes"])),
        v["fault_path"].as_str().unwrap_or("?"),
        format_bytes(field(v, &["store", "zswpout"]) * 4096),
        format_bytes(swapped_in),
        format_bytes(field(v, &["resident_bytes"])),
        format_bytes(pool),
        format_bytes(stored),
        ratio,
        format_bytes(stored.saturating_sub(pool)),
    );
    let _ = writeln!(
        s,
        "  zswpout {} zswpin {} zswpwb {} pswpout {} pswpin {} stored_pages {} stored_incompressible_pages {} same_filled_pages {} written_back_pages {} reject_compress_fail {} reject_reclaim_fail {}",
        field(v, &["store", "zswpout"]),
        field(v, &["store", "zswpin"]),
        field(v, &["store", "zswpwb"]),
        field(v, &["store", "pswpout"]),
        field(v, &["store", "pswpin"]),
        field(v, &["store", "stored_pages"]),
        field(v, &["store", "stored_incompressible_pages"]),
        field(v, &["store", "same_filled_pages"]),
        field(v, &["store", "written_back_pages"]),
        field(v, &["store", "reject_compress_fail"]),
        field(v, &["store", "reject_reclaim_fail"]),
    );
    if let Some(peak) = v["managed_peak_bytes"].as_u64() {
        let _ = writeln!(s, "  managed memory: peak {} under the budget of {}", format_bytes(peak), format_bytes(field(v, &["budget_bytes"])));
    }
    if let Some(sizes) = v["sizes"].as_object() {
        for (name, c) in sizes {
            let _ = writeln!(
                s,
                "  {name}: zswpout {} zswpin {} stored {} faults {} zero_fill {} probation_out {} probation_refault {} invalidated {}",
                field(c, &["zswpout"]),
                field(c, &["zswpin"]),
                field(c, &["stored_folios"]),
                field(c, &["faults"]),
                field(c, &["zero_fill"]),
                field(c, &["probation_out"]),
                field(c, &["probation_refault"]),
                field(c, &["invalidated"]),
            );
        }
    }
    s
}

impl Runtime {
    /// The live stats as a JSON value (what the stats file holds).
    pub fn stats_json(&self) -> serde_json::Value {
        serde_json::to_value(self.stats()).unwrap_or(serde_json::Value::Null)
    }
}

// ---- Fork. ----

/// Every folio of every region of a runtime locked and in place, regions MADV_DOFORK.
pub struct ForkHold {
    runtime: Runtime,
    /// Per region, its folios' states to restore (EMPTY or RESIDENT).
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
            let fs = r.folio_size;
            let st = &sh.stats.sizes[r.order()];
            let mut states = Vec::with_capacity(r.folios());
            for idx in 0..r.folios() {
                let prev = r.lock(idx);
                let folio = r.folio_addr(idx);
                let now = match prev {
                    SWAPPED => {
                        let buf = &mut buf[..fs];
                        match sh.store.load(r.key(idx), buf) {
                            Ok(true) => {}
                            _ => crate::fault::fatal(b"uzswap: store load failed before fork\n"),
                        }
                        sh.resident.fetch_add(fs as u64, Relaxed);
                        let _ = fill(sh, folio, buf.as_ptr(), fs, true);
                        bump(&st.zswpin);
                        st.stored.fetch_sub(1, Relaxed);
                        RESIDENT
                    }
                    PROBATION => {
                        let _ = move_back(sh, folio, r.shadow_addr(idx), fs, true);
                        sh.probation.fetch_sub(fs as u64, Relaxed);
                        RESIDENT
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
