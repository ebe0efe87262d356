//! `uzswap bench writeback`: the backing file's device path, by folio size (seed
//! 003). The same amount of data (512 MiB with `--quick`, 1 GiB without) is
//! written back as 4 KiB records one `write_batch` call each ("4K entries one at a
//! time", what a split folio costs), as 64 KiB records 32 to a batch, and as
//! 2 MiB records 4 to a batch, then read back one record at a time in random
//! order and compared with what was written.
//!
//! The file is O_DIRECT when the directory's file system allows it, so the page
//! cache cannot absorb the writes and the reads come from the device. Otherwise
//! it is buffered, and every 2 MiB written (whatever the record size, so both sides
//! sync equally often) it is fdatasync'ed and dropped from the page cache, as it
//! is once more before the reads; the `direct_io` column says which ran.
//!
//! Record data is random (compressibility does not matter here) and deliberately
//! not page-aligned, like the pool buffers the store writes from, so O_DIRECT pays
//! its staging copy on every side.

use crate::report::Report;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use uzswap_backing::{BackingConfig, BackingFile, Record, Slot};

pub struct WritebackOpts {
    pub quick: bool,
    pub json: bool,
    /// Where the backing file goes (default: the system's temp directory).
    pub dir: Option<PathBuf>,
}

#[derive(Serialize)]
pub struct WritebackRow {
    /// Record (folio) size in bytes.
    pub folio: u64,
    pub records: u64,
    /// Records per write_batch call.
    pub batch: usize,
    pub mib: u64,
    pub write_mbps: f64,
    pub read_mbps: f64,
    /// pwritev calls issued for the whole run.
    pub writes: u64,
    pub reads: u64,
    /// MB/s relative to the 4 KiB row of the same run.
    pub write_vs_4k: f64,
    pub read_vs_4k: f64,
    pub direct_io: bool,
}

/// Source bytes the records are cut from; one extra folio so any cut fits.
const SOURCE_BYTES: usize = 64 << 20;
/// Records start this far past a page boundary: not aligned, like pool memory.
const MISALIGN: usize = 64;
/// Buffered fallback: sync and drop the cache after this much data.
const SYNC_EVERY: u64 = 2 << 20;

pub fn run(opts: &WritebackOpts) -> Result<Report, String> {
    let total: u64 = if opts.quick { 512 << 20 } else { 1 << 30 };
    let dir = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed_0003);
    let mut source = vec![0u8; SOURCE_BYTES + (2 << 20) + MISALIGN];
    rng.fill_bytes(&mut source);

    let mut report = Report::new(opts.json);
    let mut base: Option<(f64, f64)> = None;
    for (folio, batch) in [(4096usize, 1usize), (64 << 10, 32), (2 << 20, 4)] {
        let cfg = BackingConfig::new(&dir, total + (64 << 20));
        let backing = BackingFile::create(cfg).map_err(|e| e.to_string())?;
        let records = (total / folio as u64) as usize;
        // Record i is cut at a position that walks through the source.
        let cut = |i: usize| {
            let at = (i * folio) % SOURCE_BYTES + MISALIGN;
            &source[at..at + folio]
        };

        let start = Instant::now();
        let mut slots: Vec<Slot> = Vec::with_capacity(records);
        let mut unsynced = 0u64;
        for first in (0..records).step_by(batch) {
            let batch_records: Vec<Record> = (first..(first + batch).min(records))
                .map(|i| Record {
                    key: i as u64,
                    data: cut(i),
                })
                .collect();
            let written = backing
                .write_batch(&batch_records)
                .map_err(|e| e.to_string())?;
            slots.extend(written);
            unsynced += (batch_records.len() * folio) as u64;
            if !backing.direct_io() && unsynced >= SYNC_EVERY {
                backing.flush().map_err(|e| e.to_string())?;
                unsynced = 0;
            }
        }
        backing.flush().map_err(|e| e.to_string())?;
        let write_secs = start.elapsed().as_secs_f64();

        let mut order: Vec<usize> = (0..records).collect();
        order.shuffle(&mut rng);
        let mut out = vec![0u8; folio];
        let start = Instant::now();
        for &i in &order {
            backing
                .read(&slots[i], &mut out)
                .map_err(|e| e.to_string())?;
            if out != cut(i) {
                return Err(format!("record {i} of {folio} bytes read back different"));
            }
        }
        let read_secs = start.elapsed().as_secs_f64();

        let st = backing.stats();
        let mb = total as f64 / 1e6;
        let (write_mbps, read_mbps) = (mb / write_secs, mb / read_secs);
        let (w4k, r4k) = *base.get_or_insert((write_mbps, read_mbps));
        report.row(&WritebackRow {
            folio: folio as u64,
            records: records as u64,
            batch,
            mib: total >> 20,
            write_mbps,
            read_mbps,
            writes: st.write_calls,
            reads: st.read_calls,
            write_vs_4k: write_mbps / w4k,
            read_vs_4k: read_mbps / r4k,
            direct_io: st.direct_io,
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real run, in release: `cargo test --release -p uzswap-bench writeback -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn writeback_quick() {
        let report = run(&WritebackOpts {
            quick: true,
            json: false,
            dir: None,
        })
        .unwrap();
        report.finish();
        let rows = report.rows();
        let speedup = rows[2]["write_vs_4k"].as_f64().unwrap();
        assert!(speedup >= 4.0, "2M writeback only {speedup:.1}x the 4K one");
    }
}
