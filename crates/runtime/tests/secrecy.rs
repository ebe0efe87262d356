//! What leaves the program's memory shows nothing of it: a marker written into a
//! region and pushed through the store into the backing file is in the file only
//! when encryption is off (the control), never when it is on, and never in the stats
//! (what `uzswap stat` and the stats file show).

mod common;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_backing::{BackingConfig, BackingFile, DirectIo, PrivateFile};
use uzswap_runtime::*;

const PAGE: usize = 4096;
const MARKER: &[u8; 32] = b"uzswap-secret-marker-7f3a9c5e21d";

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Returns (marker in the backing file, stats JSON), or None if userfaultfd is missing.
fn run(encrypt: bool, path: FaultPath) -> Option<(bool, String)> {
    let dir = tempfile::tempdir().unwrap();
    let bcfg = BackingConfig { direct_io: DirectIo::Off, encrypt, ..BackingConfig::new(dir.path(), 64 << 20) };
    let file = PrivateFile::open(&bcfg).unwrap();
    let fd = file.as_raw_fd();
    let backing = BackingFile::with_io(bcfg, Box::new(file)).unwrap();
    let mut cfg = RuntimeConfig::new(1 << 20);
    cfg.fault_path = path;
    cfg.publish_stats = false;
    let scfg = StoreConfig { max_pool_bytes: Some(64 << 10), ..cfg.store.clone() };
    let store = Arc::new(Store::with_backing(scfg, Some(backing)).unwrap());
    let rt = common::or_skip(Runtime::with_store(cfg, store))?;
    let region = rt.create_region(8 << 20, 16384).unwrap();
    let base = region.as_ptr();
    for p in 0..(8 << 20) / PAGE {
        // SAFETY: inside the region.
        let page = unsafe { std::slice::from_raw_parts_mut(base.add(p * PAGE), PAGE) };
        page[..32].copy_from_slice(MARKER);
        for (i, b) in page[32..].iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(p as u32).to_le_bytes()[3];
        }
    }
    let start = Instant::now();
    while rt.store().stats().totals.backing_pages < 512 {
        assert!(start.elapsed() < Duration::from_secs(10), "nothing reached the backing file");
        std::thread::sleep(Duration::from_millis(5));
    }
    let other = std::fs::File::open(format!("/proc/self/fd/{fd}")).unwrap();
    let mut disk = vec![0u8; 64 << 20];
    let n = other.read_at(&mut disk, 0).unwrap();
    let in_file = contains(&disk[..n], MARKER);
    let stats = serde_json::to_string(&rt.stats()).unwrap();
    // The pages still read back.
    // SAFETY: as above.
    assert_eq!(unsafe { std::slice::from_raw_parts(base, 32) }, MARKER);
    drop(region);
    Some((in_file, stats))
}

#[test]
fn the_backing_file_shows_memory_only_unencrypted_and_the_stats_never() {
    for path in [FaultPath::Thread, FaultPath::Sigbus] {
        let Some((plain_has_it, plain_stats)) = run(false, path) else { return };
        assert!(plain_has_it, "control: the marker must be findable in an unencrypted file");
        let (sealed_has_it, sealed_stats) = run(true, path).unwrap();
        assert!(!sealed_has_it, "{path:?}: the marker is in the encrypted backing file");
        for s in [plain_stats, sealed_stats] {
            assert!(!s.contains("uzswap-secret"), "memory contents in the stats: {s}");
        }
    }
}
