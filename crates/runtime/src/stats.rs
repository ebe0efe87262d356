//! Live counters, named as the kernel names them, one set per folio size, and the
//! stats file that lets another process (`uzswap stat PID`) read them.
//!
//! The file is `$UZSWAP_STATS_DIR/<pid>.json` (default `/tmp/uzswap-<uid>/<pid>.json`,
//! directory mode 0700, file mode 0600, so only the same user reads it; a directory
//! that is not ours, not private, or a symlink is refused, see [`private_dir`]). The reclaimer
//! rewrites it about once a second by write-then-rename, so a reader always sees a
//! whole JSON object; it is removed when the runtime stops. With several runtimes in
//! one process, the first to publish gets `<pid>.json`, the others `<pid>.<runtime id>.json`.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

/// Folio sizes 4 KiB (order 0) to 2 MiB (order 9).
pub(crate) const ORDERS: usize = 10;

#[derive(Default)]
pub(crate) struct SizeCounters {
    pub zswpout: AtomicU64,
    pub zswpin: AtomicU64,
    pub stored: AtomicU64,
    pub faults: AtomicU64,
    pub zero_fill: AtomicU64,
    pub probation_out: AtomicU64,
    pub probation_refault: AtomicU64,
    pub invalidated: AtomicU64,
    pub reject_reclaim_fail: AtomicU64,
    pub zswpin_kept: AtomicU64,
    pub clean_evict: AtomicU64,
    pub kept_freed: AtomicU64,
    pub throttled: AtomicU64,
    pub over_budget: AtomicU64,
    pub reclaim_deferred: AtomicU64,
    pub poisoned: AtomicU64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub sizes: [SizeCounters; ORDERS],
}

/// Counters of one folio size. Folio counts, except `stored_pages` (4 KiB pages).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SizeStats {
    /// Folios compressed into the store.
    pub zswpout: u64,
    /// Folios brought back from the store by a fault.
    pub zswpin: u64,
    /// Folios in the store now.
    pub stored_folios: u64,
    /// 4 KiB pages in the store now.
    pub stored_pages: u64,
    /// Faults resolved (every path).
    pub faults: u64,
    /// Faults on never-touched (or dropped) folios, filled with zeros.
    pub zero_fill: u64,
    /// Folios moved out of view on probation (the inactive list).
    pub probation_out: u64,
    /// Folios touched while on probation, moved back without compression.
    pub probation_refault: u64,
    /// Store entries freed by munmap, MADV_DONTNEED/FREE or region drop.
    pub invalidated: u64,
    /// Folios the reclaimer failed to store (store error or pinned pages).
    pub reject_reclaim_fail: u64,
    /// Of `zswpin`, loads by a read fault that kept the store entry as the folio's
    /// clean copy (the folio comes back write-protected).
    pub zswpin_kept: u64,
    /// Folios evicted with no compression: still clean, their kept copy was reused.
    pub clean_evict: u64,
    /// Kept copies freed because the folio was written (or is being stored anew).
    pub kept_freed: u64,
    /// Faults that had to wait for the reclaimer (usage past the budget).
    pub throttled: u64,
    /// Faults that went past the throttle limit without waiting, because the
    /// reclaimer could not bring usage down (stalled, nothing left to evict, the store
    /// refused) or the pool alone is past the limit (no backing file to write to).
    pub over_budget: u64,
    /// Evictions put off because a MADV_DONTNEED/FREE of the program was being taken in.
    pub reclaim_deferred: u64,
    /// Folios the store could not give back (a read error or a corrupt record in the
    /// backing file): poisoned, so any access raises SIGBUS, never wrong bytes.
    pub poisoned: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RuntimeStats {
    pub pid: u32,
    pub fault_path: String,
    pub policy: String,
    pub budget_bytes: u64,
    /// resident_bytes + pool_total_size: what counts against the budget.
    pub usage_bytes: u64,
    pub resident_bytes: u64,
    pub probation_bytes: u64,
    pub pool_total_size: u64,
    pub regions: usize,
    /// Keyed `hugepages-<size>kB`, as /sys/kernel/mm/transparent_hugepage names them;
    /// only sizes with some activity are listed.
    pub sizes: BTreeMap<String, SizeStats>,
    /// The store's own counters (pool, compression, writeback).
    pub store: uzswap_store::Stats,
}

impl RuntimeStats {
    /// The sum over folio sizes.
    pub fn total(&self) -> SizeStats {
        let mut t = SizeStats::default();
        for s in self.sizes.values() {
            t.zswpout += s.zswpout;
            t.zswpin += s.zswpin;
            t.stored_folios += s.stored_folios;
            t.stored_pages += s.stored_pages;
            t.faults += s.faults;
            t.zero_fill += s.zero_fill;
            t.probation_out += s.probation_out;
            t.probation_refault += s.probation_refault;
            t.invalidated += s.invalidated;
            t.reject_reclaim_fail += s.reject_reclaim_fail;
            t.zswpin_kept += s.zswpin_kept;
            t.clean_evict += s.clean_evict;
            t.kept_freed += s.kept_freed;
            t.throttled += s.throttled;
            t.over_budget += s.over_budget;
            t.reclaim_deferred += s.reclaim_deferred;
            t.poisoned += s.poisoned;
        }
        t
    }
}

pub fn size_name(folio_size: usize) -> String {
    format!("hugepages-{}kB", folio_size / 1024)
}

impl Counters {
    pub fn snapshot(&self) -> BTreeMap<String, SizeStats> {
        let mut out = BTreeMap::new();
        for (order, c) in self.sizes.iter().enumerate() {
            let s = SizeStats {
                zswpout: c.zswpout.load(Relaxed),
                zswpin: c.zswpin.load(Relaxed),
                stored_folios: c.stored.load(Relaxed),
                stored_pages: c.stored.load(Relaxed) << order,
                faults: c.faults.load(Relaxed),
                zero_fill: c.zero_fill.load(Relaxed),
                probation_out: c.probation_out.load(Relaxed),
                probation_refault: c.probation_refault.load(Relaxed),
                invalidated: c.invalidated.load(Relaxed),
                reject_reclaim_fail: c.reject_reclaim_fail.load(Relaxed),
                zswpin_kept: c.zswpin_kept.load(Relaxed),
                clean_evict: c.clean_evict.load(Relaxed),
                kept_freed: c.kept_freed.load(Relaxed),
                throttled: c.throttled.load(Relaxed),
                over_budget: c.over_budget.load(Relaxed),
                reclaim_deferred: c.reclaim_deferred.load(Relaxed),
                poisoned: c.poisoned.load(Relaxed),
            };
            if s != SizeStats::default() {
                out.insert(size_name(4096 << order), s);
            }
        }
        out
    }
}

/// Where the stats of process `pid` live (`uzswap stat PID` reads this).
pub fn stats_path(pid: u32) -> PathBuf {
    stats_dir().join(format!("{pid}.json"))
}

pub(crate) fn stats_dir() -> PathBuf {
    match std::env::var_os("UZSWAP_STATS_DIR") {
        Some(d) => PathBuf::from(d),
        // SAFETY: getuid takes no arguments, touches no memory and cannot fail.
        None => PathBuf::from(format!("/tmp/uzswap-{}", unsafe { libc::getuid() })),
    }
}

/// Reads the stats another process published.
pub fn read_stats(pid: u32) -> std::io::Result<serde_json::Value> {
    let text = std::fs::read_to_string(stats_path(pid))?;
    serde_json::from_str(&text).map_err(std::io::Error::other)
}

pub(crate) fn write_stats_file(path: &std::path::Path, stats: &RuntimeStats) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    private_dir(dir)?;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(serde_json::to_string_pretty(stats).map_err(std::io::Error::other)?.as_bytes())?;
    std::fs::rename(&tmp, path)
}

/// Makes `dir` (mode 0700) if it is missing, and refuses it unless it is a real
/// directory (not a symlink) owned by this user with no access for group or others.
/// The stats directory's default is in /tmp, where anyone may have made it first
/// (the classic /tmp attack: a directory or symlink planted to read or redirect
/// what we write); the modes are what keep `uzswap stat` to the same user.
pub(crate) fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let m = std::fs::symlink_metadata(dir)?;
    // SAFETY: getuid takes no arguments, touches no memory and cannot fail.
    let uid = unsafe { libc::getuid() };
    let why = if !m.file_type().is_dir() {
        Some("not a directory (a symlink?)".to_string())
    } else if m.uid() != uid {
        Some(format!("owned by uid {}, not {uid}", m.uid()))
    } else if m.mode() & 0o077 != 0 {
        Some(format!("mode {:o}: group or others have access (want 700)", m.mode() & 0o777))
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("refusing the stats directory {}: {why}", dir.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn sample() -> RuntimeStats {
        let store = uzswap_store::Store::new(uzswap_store::StoreConfig::default()).unwrap();
        RuntimeStats {
            pid: 1,
            fault_path: "thread".into(),
            policy: "fifo".into(),
            budget_bytes: 1,
            usage_bytes: 0,
            resident_bytes: 0,
            probation_bytes: 0,
            pool_total_size: 0,
            regions: 0,
            sizes: BTreeMap::new(),
            store: store.stats(),
        }
    }

    #[test]
    fn the_stats_file_is_private_and_planted_directories_are_refused() {
        let top = tempfile::tempdir().unwrap();
        // Made by us: 0700, the file 0600.
        let dir = top.path().join("mine");
        let file = dir.join("1.json");
        write_stats_file(&file, &sample()).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        // Someone left it open to others: refused, nothing written.
        let loose = top.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = write_stats_file(&loose.join("1.json"), &sample()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("755"), "{err}");
        assert!(std::fs::read_dir(&loose).unwrap().next().is_none());
        // A symlink to a private directory planted where ours should be: refused.
        let link = top.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(write_stats_file(&link.join("2.json"), &sample()).is_err());
        assert!(!dir.join("2.json").exists());
        // Owned by another user (only root can make one to test with).
        // SAFETY: geteuid takes no arguments and touches no memory.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = top.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
            let c = std::ffi::CString::new(theirs.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is a NUL-terminated path that lives across the call.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 4242, 4242) }, 0);
            let err = write_stats_file(&theirs.join("1.json"), &sample()).unwrap_err();
            assert!(err.to_string().contains("4242"), "{err}");
        } else {
            eprintln!("not root: the other-owner case is not tried");
        }
    }
}
