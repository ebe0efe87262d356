//! `uzswap bench store`: every compressor x granularity x kind of data through the
//! store, measuring what matters for swap: compression ratio with the pool's own
//! overhead included, store and load throughput, and pool overhead per 4 KiB page.
//!
//! Each row stores folios of the granularity's size (the whole folio is one unit; a
//! 4k row is the kernel's zswap case, one object per page) until the data set is in
//! the store, then loads them all back and checks them.

use crate::report::Report;
use serde::Serialize;
use std::time::Instant;
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig};

pub struct StoreBenchOpts {
    pub quick: bool,
    pub json: bool,
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

/// The data sets: realistic (from real files), random and zero.
pub fn data_sets(len: usize) -> Vec<(&'static str, Vec<u8>)> {
    use rand::{RngCore, SeedableRng};
    let mut random = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut random);
    vec![("realistic", uzswap_corpus::realistic(len, 42)), ("random", random), ("zero", vec![0u8; len])]
}

pub fn run(opts: &StoreBenchOpts) -> Result<Report, String> {
    let len = if opts.quick { 24 << 20 } else { 256 << 20 };
    let sets = data_sets(len);
    let mut report = Report::new(opts.json);
    let progress = crate::progress(opts.json, (CODECS.len() * GRANULARITIES.len() * sets.len()) as u64);
    for (algorithm, level) in CODECS {
        for (granularity, folio) in GRANULARITIES {
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
    let mut out = vec![0u8; folio];
    let t = Instant::now();
    for i in 0..folios {
        if !store.load(i as u64, &mut out).map_err(|e| e.to_string())? {
            return Err(format!("folio {i} missing from the store"));
        }
        if out[..] != data[i * folio..(i + 1) * folio] {
            return Err(format!("folio {i} came back different ({:?})", cfg.codec));
        }
    }
    let load_secs = t.elapsed().as_secs_f64();
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
    })
}
