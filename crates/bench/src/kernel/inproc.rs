//! The workloads that run in this process: multi-page compression (as zram's
//! multi-page compression) and tree contention (zswap's tree, xarray or rbtree).
//!
//! Multi-page: the same realistic data is swapped out and in `reps` times.
//! - uzswap: through a [`Store`] with 64 KiB folios compressed at 4K, 16K or 64K
//!   granularity; store = swap-out, load = swap-in.
//! - kernel: through a fresh zram device, written and read with O_DIRECT in 64 KiB
//!   requests. zram compresses every 4 KiB page on its own (no multi-page mode in
//!   mainline) and keeps it in zsmalloc, so this is the kernel's compressor and
//!   allocator path, and only that, as the store is uzswap's: neither side pays for
//!   reclaim or page faults here (the usemem workload measures those).
//!
//! Ratio, on both sides: memory held per original byte (zram's mem_used_total,
//! the store's pool and metadata), lower is better.
//!
//! One core's lz4: [`lz4_core_mbps`] compresses usemem's data (every 8-byte word its
//! own index) folio by folio on this thread, the reference `out_vs_lz4_core` divides
//! swap-out speeds by.
//!
//! Tree: threads each swap their own slots out and in, as zswap's tree sees
//! concurrent swap-out and exclusive swap-in: insert, then look up and erase, and
//! check that the value found is the one stored. Our [`Index`] against one
//! `Mutex<BTreeMap>`, the rbtree under a spinlock zswap had before it moved to an xarray.

use super::machine::{self, Machine};
use super::system::{self, RunError};
use rand::{Rng, SeedableRng};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};
use uzswap_index::Index;
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig};

/// Folio size of the multi-page workload: a 64 KiB mTHP.
pub const MULTIPAGE_FOLIO: usize = 64 << 10;

#[derive(Clone, Debug, PartialEq)]
pub struct Multipage {
    pub out_mbps: f64,
    pub in_mbps: f64,
    /// Swap-out plus swap-in time over all repetitions.
    pub secs: f64,
    pub ratio: f64,
}

fn figures(bytes: usize, reps: usize, out: Duration, inn: Duration, ratio: f64) -> Multipage {
    let moved = (bytes * reps) as f64;
    Multipage {
        out_mbps: moved / 1e6 / out.as_secs_f64(),
        in_mbps: moved / 1e6 / inn.as_secs_f64(),
        secs: (out + inn).as_secs_f64(),
        ratio,
    }
}

/// uzswap's side: `data` through a store at `granularity`, `reps` times.
/// One core's lz4 compression speed (MB/s, of input) on usemem's data, `folio` bytes
/// at a time, each folio compressed whole as a swap system compresses it: the best
/// of three passes over 32 MiB, on this thread. No verify, no copy to a pool: the
/// compressor alone.
pub fn lz4_core_mbps(folio: usize) -> Result<f64, String> {
    const BYTES: usize = 32 << 20;
    let words: Vec<u64> = (0..(BYTES / 8) as u64).collect();
    // SAFETY: the vector's initialized u64s, viewed as bytes, for as long as it lives.
    let data = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), BYTES) };
    let cfg = CodecConfig {
        algorithm: Algorithm::Lz4,
        level: 0,
        granularity: Granularity::Folio,
        raw_threshold_percent: CodecConfig::DEFAULT_RAW_THRESHOLD_PERCENT,
        verify: false,
    };
    let mut codec = uzswap_compress::FolioCodec::new(&cfg).map_err(|e| format!("lz4: {e}"))?;
    let mut out = vec![0u8; codec.max_encoded_len(folio)];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        for f in data.chunks_exact(folio) {
            codec.encode(f, &mut out).map_err(|e| format!("lz4: {e}"))?;
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(BYTES as f64 / best / 1e6)
}

pub fn multipage_store(
    algorithm: Algorithm,
    level: i32,
    granularity: usize,
    data: &[u8],
    reps: usize,
) -> Result<Multipage, String> {
    let cfg = StoreConfig {
        codec: CodecConfig {
            algorithm,
            level,
            granularity: Granularity::Bytes(granularity),
            raw_threshold_percent: CodecConfig::DEFAULT_RAW_THRESHOLD_PERCENT,
            verify: false,
        },
        ..StoreConfig::default()
    };
    let store = Store::new(cfg).map_err(|e| e.to_string())?;
    let folios = data.len() / MULTIPAGE_FOLIO;
    let bytes = folios * MULTIPAGE_FOLIO;
    let mut buf = vec![0u8; MULTIPAGE_FOLIO];
    let (mut out, mut inn, mut ratio) = (Duration::ZERO, Duration::ZERO, 0.0);
    for _ in 0..reps {
        if machine::interrupted() {
            return Err("interrupted".into());
        }
        let t = Instant::now();
        for (i, folio) in data.chunks_exact(MULTIPAGE_FOLIO).enumerate() {
            store.store(i as u64, folio).map_err(|e| e.to_string())?;
        }
        out += t.elapsed();
        ratio = (store.pool_bytes() + store.metadata_bytes()) as f64 / bytes as f64;
        for (i, folio) in data.chunks_exact(MULTIPAGE_FOLIO).enumerate() {
            let t = Instant::now();
            let found = store.load(i as u64, &mut buf).map_err(|e| e.to_string())?;
            inn += t.elapsed();
            if !found || buf[..] != folio[..] {
                return Err(format!("folio {i} came back {}", if found { "different" } else { "missing" }));
            }
        }
    }
    Ok(figures(bytes, reps, out, inn, ratio))
}

/// A page-aligned buffer, as O_DIRECT needs.
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = Layout::from_size_align(len.max(4096), 4096).expect("valid layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Aligned { ptr, layout }
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: we own `layout.size()` initialised bytes at `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The kernel's side: `data` written to and read from a fresh zram device with
/// `algorithm`, `reps` times; the device is gone when this returns.
pub fn multipage_zram(machine: &mut Machine, algorithm: &str, data: &[u8], reps: usize) -> Result<Multipage, RunError> {
    let mark = machine.mark();
    let result = zram_rounds(machine, algorithm, data, reps);
    let errors = machine.unwind_to(mark);
    if !errors.is_empty() {
        return Err(RunError::Teardown(errors.join("; ")));
    }
    result
}

fn zram_rounds(machine: &mut Machine, algorithm: &str, data: &[u8], reps: usize) -> Result<Multipage, RunError> {
    let failed = |e: String| RunError::Failed(e);
    let bytes = data.len() / MULTIPAGE_FOLIO * MULTIPAGE_FOLIO;
    let id = machine.zram_add().map_err(RunError::Unavailable)?;
    let dev = system::zram_block(id);
    system::zram_algorithm(&dev, algorithm)?;
    machine::write(dev.join("disksize"), &(bytes as u64 + (16 << 20)).to_string()).map_err(failed)?;
    let node = system::zram_node(id).map_err(failed)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&node)
        .map_err(|e| failed(format!("open {} O_DIRECT: {e}", node.display())))?;
    let mut src = Aligned::new(bytes);
    src.as_mut_slice()[..bytes].copy_from_slice(&data[..bytes]);
    let mut back = Aligned::new(bytes);
    let (mut out, mut inn, mut ratio) = (Duration::ZERO, Duration::ZERO, 0.0);
    for _ in 0..reps {
        if machine::interrupted() {
            return Err(RunError::Interrupted);
        }
        let t = Instant::now();
        for (i, folio) in src.as_slice()[..bytes].chunks_exact(MULTIPAGE_FOLIO).enumerate() {
            file.write_all_at(folio, (i * MULTIPAGE_FOLIO) as u64)
                .map_err(|e| failed(format!("write {}: {e}", node.display())))?;
        }
        out += t.elapsed();
        let (_, used) = system::zram_mm_stat(&dev).ok_or_else(|| failed("no zram mm_stat".into()))?;
        ratio = used as f64 / bytes as f64;
        let t = Instant::now();
        for (i, folio) in back.as_mut_slice()[..bytes].chunks_exact_mut(MULTIPAGE_FOLIO).enumerate() {
            file.read_exact_at(folio, (i * MULTIPAGE_FOLIO) as u64)
                .map_err(|e| failed(format!("read {}: {e}", node.display())))?;
        }
        inn += t.elapsed();
        if back.as_slice()[..bytes] != src.as_slice()[..bytes] {
            return Err(failed("zram gave back different data".into()));
        }
        back.as_mut_slice().fill(0);
    }
    drop(file);
    Ok(figures(bytes, reps, out, inn, ratio))
}

/// What the tree workload's threads do to the map.
pub trait SwapTree: Sync {
    /// Swap-out: publish `slot -> value`.
    fn store(&self, slot: u64, value: u64);
    /// Exclusive swap-in: find and erase.
    fn load(&self, slot: u64) -> Option<u64>;
}

impl SwapTree for Index<u64> {
    fn store(&self, slot: u64, value: u64) {
        self.insert(slot, value);
    }
    fn load(&self, slot: u64) -> Option<u64> {
        self.remove(slot)
    }
}

impl SwapTree for Mutex<BTreeMap<u64, u64>> {
    fn store(&self, slot: u64, value: u64) {
        self.lock().unwrap_or_else(|p| p.into_inner()).insert(slot, value);
    }
    fn load(&self, slot: u64) -> Option<u64> {
        self.lock().unwrap_or_else(|p| p.into_inner()).remove(&slot)
    }
}

/// Slots each thread owns: 1 GiB of 4 KiB pages.
const SLOTS_PER_THREAD: u64 = 1 << 18;

/// Runs `threads` threads for `secs`: each swaps out a random slot of its own
/// range if it is in memory, or swaps it in (checking the value) if it is swapped
/// out. Returns operations per second over all threads.
pub fn tree(map: &dyn SwapTree, threads: usize, secs: f64) -> Result<f64, String> {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    let value = |slot: u64| slot.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads as u64)
            .map(|t| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || -> Result<u64, String> {
                    let base = t * SLOTS_PER_THREAD;
                    let mut out = vec![false; SLOTS_PER_THREAD as usize];
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t);
                    let mut ops = 0u64;
                    start.wait();
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..256 {
                            let i = rng.gen_range(0..SLOTS_PER_THREAD);
                            let slot = base + i;
                            if out[i as usize] {
                                match map.load(slot) {
                                    Some(v) if v == value(slot) => {}
                                    other => return Err(format!("slot {slot}: expected {}, found {other:?}", value(slot))),
                                }
                            } else {
                                map.store(slot, value(slot));
                            }
                            out[i as usize] = !out[i as usize];
                        }
                        ops += 256;
                    }
                    Ok(ops)
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for w in workers {
            total += w.join().map_err(|_| "a tree thread panicked".to_string())??;
        }
        Ok(total as f64 / t.elapsed().as_secs_f64())
    })
}
