//! `uzswap bench store`: every compressor x granularity x kind of data through the
//! store, measuring what matters for swap: compression ratio with the pool's own
//! overhead included, store and load throughput, and pool overhead per 4 KiB page.
//!
//! Each row stores folios of the granularity's size (the whole folio is one unit; a
//! 4k row is the kernel's zswap case, one object per page) until the data set is in
//! the store, then loads them all back and checks them.

use crate::report::Report;
use serde::Serialize;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::time::Instant;
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig};

pub struct StoreBenchOpts {
    pub quick: bool,
    pub json: bool,
    /// Only these compressors ("lz4", "zstd", "deflate"); all if empty.
    pub compressors: Vec<String>,
    /// Only these granularities ("4k" .. "folio"); all if empty.
    pub granularities: Vec<String>,
    /// Only these data sets ("realistic", "random", "zero"); all if empty.
    pub data: Vec<String>,
}

fn wanted(filter: &[String], name: &str) -> bool {
    filter.is_empty() || filter.iter().any(|f| f.eq_ignore_ascii_case(name))
}

#[derive(Serialize)]
pub struct StoreRow {
    pub compressor: String,
    pub level: i32,
    pub granularity: String,
    pub data: &'static str,
    /// Store memory (pool + metadata) per original byte.
    pub ratio: f64,
    pub store_mbps: f64,
    pub load_mbps: f64,
    /// Pool memory beyond the encoded bytes, per stored 4 KiB page.
    pub pool_overhead_bytes_per_page: f64,
    /// Index and LRU memory per stored 4 KiB page.
    pub metadata_bytes_per_page: f64,
    /// Encoded bytes per original byte, before any pool overhead.
    pub encoded_ratio: f64,
    /// After loading a random half and compacting: pool memory per live encoded
    /// byte (1.0 is perfect packing; 0 when nothing is left in the pool).
    pub pool_per_live_byte_after_compaction: f64,
}

/// The configurations benchmarked: (algorithm, level).
pub const CODECS: [(Algorithm, i32); 5] =
    [(Algorithm::Lz4, 0), (Algorithm::Zstd, -1), (Algorithm::Zstd, 1), (Algorithm::Zstd, 3), (Algorithm::Deflate, 1)];

pub const GRANULARITIES: [(Granularity, usize); 5] = [
    (Granularity::Bytes(4 << 10), 4 << 10),
    (Granularity::Bytes(16 << 10), 16 << 10),
    (Granularity::Bytes(64 << 10), 64 << 10),
    (Granularity::Bytes(256 << 10), 256 << 10),
    (Granularity::Folio, 2 << 20),
];

/// The data sets: realistic (from real files), random and zero. The realistic set
/// is the larger one: the pool's per-class partial spans are a fixed cost that only
/// a data set of real size amortizes as a real swap load would.
pub fn data_sets(realistic_len: usize, other_len: usize) -> Vec<(&'static str, Vec<u8>)> {
    use rand::RngCore;
    let mut random = vec![0u8; other_len];
    rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut random);
    vec![
        ("realistic", uzswap_corpus::realistic(realistic_len, 42)),
        ("random", random),
        ("zero", vec![0u8; other_len]),
    ]
}

pub fn run(opts: &StoreBenchOpts) -> Result<Report, String> {
    let (realistic, other) = if opts.quick { (96 << 20, 16 << 20) } else { (512 << 20, 128 << 20) };
    let sets: Vec<_> = data_sets(realistic, other).into_iter().filter(|(n, _)| wanted(&opts.data, n)).collect();
    let codecs: Vec<_> = CODECS
        .into_iter()
        .filter(|(a, l)| wanted(&opts.compressors, &a.to_string()) && !(opts.quick && *l == 3))
        .collect();
    let granularities: Vec<_> =
        GRANULARITIES.into_iter().filter(|(g, _)| wanted(&opts.granularities, &g.to_string())).collect();
    let mut report = Report::new(opts.json);
    let progress = crate::progress(opts.json, (codecs.len() * granularities.len() * sets.len()) as u64);
    for &(algorithm, level) in &codecs {
        for &(granularity, folio) in &granularities {
            for (data_name, data) in &sets {
                let cfg = StoreConfig {
                    codec: CodecConfig { algorithm, level, granularity, raw_threshold_percent: 90, verify: false },
                    ..StoreConfig::default()
                };
                let row = measure(cfg, folio, data_name, data)?;
                progress.inc(1);
                report.row(&row);
            }
        }
    }
    progress.finish_and_clear();
    Ok(report)
}

fn measure(cfg: StoreConfig, folio: usize, data_name: &'static str, data: &[u8]) -> Result<StoreRow, String> {
    let store = Store::new(cfg.clone()).map_err(|e| e.to_string())?;
    let folios = data.len() / folio;
    let bytes = (folios * folio) as f64;
    let t = Instant::now();
    for i in 0..folios {
        store.store(i as u64, &data[i * folio..(i + 1) * folio]).map_err(|e| e.to_string())?;
    }
    let store_secs = t.elapsed().as_secs_f64();
    let stats = store.stats();
    let pages = bytes / 4096.0;
    let pool = store.pool_bytes() as f64;
    let metadata = store.metadata_bytes() as f64;
    // Load into a buffer already faulted in, and compare after the clock stops, so
    // the figure is the store's and not the page allocator's or memcmp's.
    let mut out = vec![1u8; folios * folio];
    // Load a random half, compact, see how close the pool comes to the live bytes
    // (zsmalloc's fragmentation question), then load the rest.
    let mut order: Vec<usize> = (0..folios).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(7));
    let mut load_secs = 0.0;
    let mut after_compaction = 0.0;
    for (half, keys) in order.chunks(folios.div_ceil(2)).enumerate() {
        let t = Instant::now();
        for &i in keys {
            if !store.load(i as u64, &mut out[i * folio..(i + 1) * folio]).map_err(|e| e.to_string())? {
                return Err(format!("folio {i} missing from the store"));
            }
        }
        load_secs += t.elapsed().as_secs_f64();
        if half == 0 {
            store.compact();
            let live = store.stats().compressed_bytes as f64;
            after_compaction = if live > 0.0 { store.pool_bytes() as f64 / live } else { 0.0 };
        }
    }
    if let Some(i) = (0..folios).find(|&i| out[i * folio..(i + 1) * folio] != data[i * folio..(i + 1) * folio]) {
        return Err(format!("folio {i} came back different ({:?})", cfg.codec));
    }
    Ok(StoreRow {
        compressor: cfg.codec.algorithm.to_string(),
        level: cfg.codec.level,
        granularity: cfg.codec.granularity.to_string(),
        data: data_name,
        ratio: (pool + metadata) / bytes,
        store_mbps: bytes / 1e6 / store_secs,
        load_mbps: bytes / 1e6 / load_secs,
        pool_overhead_bytes_per_page: (pool - stats.compressed_bytes as f64) / pages,
        metadata_bytes_per_page: metadata / pages,
        encoded_ratio: stats.compressed_bytes as f64 / bytes,
        pool_per_live_byte_after_compaction: after_compaction,
    })
}
