//! `uzswap bench writeback`: the backing file's device path, by folio size.
//! The same amount of data (512 MiB with `--quick`, 1 GiB without) is
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
//!
//! Remote rows (uzswap-remote): the same records written back to a redis-server
//! started on this machine (sealed, as by default, and not), and to a Redis Cluster of three masters with a replica
//! each (every batch WAITs for one replica), over loopback.
//! `write_vs_file` and `read_vs_file` compare each with the file's row of the same
//! folio size in the same run; `read_p50_us`/`read_p99_us` are one record's read.
//! Skipped, saying why, where redis-server or redis-cli is not installed.

use crate::report::Report;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use uzswap_backing::{AlignedBuf, BackingConfig, BackingFile, Record, Slot, Tier};
use uzswap_remote::testing::{Cluster, Server};
use uzswap_remote::{RemoteConfig, RemoteTier, Target};

pub struct WritebackOpts {
    pub quick: bool,
    pub json: bool,
    /// Where the backing file goes (default: the system's temp directory).
    pub dir: Option<PathBuf>,
    /// Also (or only, with no redis-server here) bench this remote store.
    pub remote: Option<String>,
}

#[derive(Serialize)]
pub struct WritebackRow {
    /// file, redis, redis-unsealed, redis-cluster (WAIT 1), cluster-no-wait, or the --remote URL's hosts.
    pub tier: String,
    /// Record (folio) size in bytes.
    pub folio: u64,
    pub records: u64,
    /// Records per write_batch call.
    pub batch: usize,
    pub mib: u64,
    pub write_mbps: f64,
    pub read_mbps: f64,
    /// One record's read, median and 99th percentile, in microseconds.
    pub read_p50_us: f64,
    pub read_p99_us: f64,
    /// pwritev calls (file) or round trips (remote) for the whole run.
    pub writes: u64,
    /// MB/s relative to the 4 KiB row of the same tier.
    pub write_vs_4k: f64,
    pub read_vs_4k: f64,
    /// MB/s relative to the file's row of the same folio size.
    pub write_vs_file: f64,
    pub read_vs_file: f64,
    pub direct_io: bool,
}

/// Source bytes the records are cut from; one extra folio so any cut fits.
const SOURCE_BYTES: usize = 64 << 20;
/// Records start this far past a page boundary: not aligned, like pool memory.
const MISALIGN: usize = 64;
/// Buffered fallback: sync and drop the cache after this much data.
const SYNC_EVERY: u64 = 2 << 20;

/// Makes a fresh tier of (at least) so many bytes.
type Make<'a> = Box<dyn Fn(u64) -> Result<Box<dyn Tier>, String> + 'a>;
/// One tier to bench: its name, and how to make a fresh one.
type MakeTier<'a> = (String, Make<'a>);

pub fn run(opts: &WritebackOpts) -> Result<Report, String> {
    let total: u64 = if opts.quick { 512 << 20 } else { 1 << 30 };
    let dir = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed_0003);
    let mut source = vec![0u8; SOURCE_BYTES + (2 << 20) + MISALIGN];
    rng.fill_bytes(&mut source);

    // Servers of our own, alive for the whole run.
    let server = Server::start(&[]);
    let cluster = Cluster::start(3, 1);
    let remote = |url: String, replicas: u32, encrypt: bool| -> Make<'static> {
        Box::new(move |_| {
            let target = Target::parse(&url)?;
            let cfg = RemoteConfig { replicas, encrypt, max_bytes: u64::MAX, ..RemoteConfig::new(target) };
            Ok(Box::new(RemoteTier::new(cfg, None).map_err(|e| e.to_string())?) as Box<dyn Tier>)
        })
    };
    let dir_ref = &dir;
    let mut tiers: Vec<MakeTier<'_>> = vec![(
        "file".into(),
        Box::new(move |bytes| {
            let file = BackingFile::create(BackingConfig::new(dir_ref, bytes)).map_err(|e| e.to_string())?;
            Ok(Box::new(file) as Box<dyn Tier>)
        }),
    )];
    if let Some(s) = &server {
        tiers.push(("redis".into(), remote(s.url(), 0, true)));
        // What sealing costs (a setting a user may turn off for a private store).
        tiers.push(("redis-unsealed".into(), remote(s.url(), 0, false)));
    }
    if let Some(c) = &cluster {
        tiers.push(("redis-cluster".into(), remote(c.url(), 1, true)));
        // What waiting for a replica costs (every batch, a round trip to each master
        // that waits for its replica).
        tiers.push(("cluster-no-wait".into(), remote(c.url(), 0, true)));
    }
    if let Some(url) = &opts.remote {
        let shown = Target::parse(url)?.shown();
        tiers.push((shown, remote(url.clone(), 0, true)));
    }

    let mut report = Report::new(opts.json);
    for (name, make) in &tiers {
        let mut base: Option<(f64, f64)> = None;
        for (folio, batch) in [(4096usize, 1usize), (64 << 10, 32), (2 << 20, 4)] {
            let tier = make(total + (64 << 20))?;
            let row = bench_one(&*tier, &source, &mut rng, total, folio, batch)?;
            let (w4k, r4k) = *base.get_or_insert((row.write_mbps, row.read_mbps));
            let file = report.rows().iter().find(|r| r["tier"] == "file" && r["folio"] == folio as u64);
            let vs = |key: &str, mine: f64| file.as_ref().and_then(|f| f[key].as_f64()).map_or(1.0, |f| mine / f);
            report.row(&WritebackRow {
                tier: name.clone(),
                write_vs_4k: row.write_mbps / w4k,
                read_vs_4k: row.read_mbps / r4k,
                write_vs_file: vs("write_mbps", row.write_mbps),
                read_vs_file: vs("read_mbps", row.read_mbps),
                ..row
            });
        }
    }
    if server.is_none() || cluster.is_none() {
        eprintln!("bench writeback: no remote rows of our own (SKIP above says why); --remote URL benches a store of yours");
    }
    Ok(report)
}

/// Writes `total` bytes as `folio`-sized records, `batch` per call, then reads each
/// back once in random order and compares.
fn bench_one(
    tier: &dyn Tier,
    source: &[u8],
    rng: &mut rand::rngs::SmallRng,
    total: u64,
    folio: usize,
    batch: usize,
) -> Result<WritebackRow, String> {
    let records = (total / folio as u64) as usize;
    // Record i is cut at a position that walks through the source.
    let cut = |i: usize| {
        let at = (i * folio) % SOURCE_BYTES + MISALIGN;
        &source[at..at + folio]
    };
    let file = tier.raw_fd().is_some();
    let start = Instant::now();
    let mut slots: Vec<Slot> = Vec::with_capacity(records);
    let mut unsynced = 0u64;
    for first in (0..records).step_by(batch) {
        let batch_records: Vec<Record> = (first..(first + batch).min(records)).map(|i| Record { key: i as u64, data: cut(i) }).collect();
        slots.extend(tier.write_batch(&batch_records).map_err(|e| e.to_string())?);
        unsynced += (batch_records.len() * folio) as u64;
        if file && !tier.stats().direct_io && unsynced >= SYNC_EVERY {
            tier.flush().map_err(|e| e.to_string())?;
            unsynced = 0;
        }
    }
    tier.flush().map_err(|e| e.to_string())?;
    let write_secs = start.elapsed().as_secs_f64();

    let mut order: Vec<usize> = (0..records).collect();
    order.shuffle(rng);
    let mut buf = AlignedBuf::zeroed(folio);
    let mut lat: Vec<f64> = Vec::with_capacity(records);
    let start = Instant::now();
    for &i in &order {
        let t = Instant::now();
        tier.read_in_place(&slots[i], &mut buf[..]).map_err(|e| e.to_string())?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        if &buf[..folio] != cut(i) {
            return Err(format!("record {i} of {folio} bytes read back different"));
        }
    }
    let read_secs = start.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];

    let st = tier.stats();
    let extra = tier.extra_stats();
    let round_trips = extra.iter().find(|(k, _)| *k == "remote_round_trips").map(|e| e.1);
    let mb = total as f64 / 1e6;
    Ok(WritebackRow {
        tier: String::new(),
        folio: folio as u64,
        records: records as u64,
        batch,
        mib: total >> 20,
        write_mbps: mb / write_secs,
        read_mbps: mb / read_secs,
        read_p50_us: pct(50),
        read_p99_us: pct(99),
        writes: round_trips.unwrap_or(st.write_calls),
        write_vs_4k: 1.0,
        read_vs_4k: 1.0,
        write_vs_file: 1.0,
        read_vs_file: 1.0,
        direct_io: st.direct_io,
    })
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
            remote: None,
        })
        .unwrap();
        report.finish();
        let rows = report.rows();
        let speedup = rows[2]["write_vs_4k"].as_f64().unwrap();
        assert!(speedup >= 4.0, "2M writeback only {speedup:.1}x the 4K one");
    }
}
