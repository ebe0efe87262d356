//! `uzswap bench region`: managed regions twice the size of their budget, filled with
//! realistic data, then re-read sequentially and at random, for each fault path and
//! folio size; and a hot-set workload comparing the reclaim policies (probation
//! against plain FIFO) in the same run.
//!
//! Every page read is checked bit for bit against what was written (`bad_pages`).
//! Fault latency is measured from the program's side: the time of the access that
//! took a fault (the runtime's fault counter moved), wakeups included. Between the fill
//! and the reads the reclaimer gets up to 5 s to work off the fill's backlog (`settle`).

use crate::report::Report;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;
use uzswap_runtime::{FaultPath, ReclaimPolicy, Region, Runtime, RuntimeConfig};

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

pub struct RegionBenchOpts {
    pub quick: bool,
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    workload: &'static str,
    fault_path: &'static str,
    policy: &'static str,
    folio: String,
    pattern: &'static str,
    region_mb: usize,
    budget_mb: usize,
    mbps: f64,
    faults: u64,
    fault_us_p50: f64,
    fault_us_p99: f64,
    /// Folios decompressed (zswpin) during the measured pass.
    zswpin: u64,
    /// Stored bytes / pool bytes after the fill.
    ratio: f64,
    bad_pages: u64,
    /// Peak usage seen, as a share of the budget.
    peak_usage_pct: f64,
}

/// The content: one block of realistic data, tiled with a per-tile variation so no two
/// tiles are identical (yet compress alike).
struct Content {
    block: Vec<u8>,
}

impl Content {
    fn new(block_len: usize) -> Content {
        Content { block: uzswap_corpus::realistic(block_len, 42) }
    }
    /// Page `p` of the region's content, written into `out`.
    fn page(&self, p: usize, out: &mut [u8; PAGE]) {
        let pages = self.block.len() / PAGE;
        let (tile, q) = (p / pages, p % pages);
        out.copy_from_slice(&self.block[q * PAGE..(q + 1) * PAGE]);
        let v = u64::from_le_bytes(out[..8].try_into().unwrap()) ^ (tile as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        out[..8].copy_from_slice(&v.to_le_bytes());
    }
}

fn fill(region: &Region, content: &Content) {
    let mut page = [0u8; PAGE];
    for p in 0..region.len() / PAGE {
        content.page(p, &mut page);
        // SAFETY: p is a page of the live region.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), region.as_ptr().add(p * PAGE), PAGE) };
    }
}

/// Reads page `p`, timing the first access; returns (page good, fault latency if it faulted).
fn read_page(rt: &Runtime, region: &Region, content: &Content, p: usize, expect: &mut [u8; PAGE]) -> (bool, Option<f64>) {
    let addr = unsafe { region.as_ptr().add(p * PAGE) };
    let before = rt.fault_count();
    let t = Instant::now();
    // SAFETY: inside the live region.
    let first = unsafe { std::ptr::read_volatile(addr as *const u64) };
    let dt = t.elapsed().as_secs_f64() * 1e6;
    let faulted = rt.fault_count() != before;
    content.page(p, expect);
    // SAFETY: as above.
    let got = unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) };
    let good = got == &expect[..] && first == u64::from_le_bytes(expect[..8].try_into().unwrap());
    (good, faulted.then_some(dt))
}

/// With UZSWAP_BENCH_DEBUG set, the runtime's counters after a pass, on stderr.
fn debug_stats(rt: &Runtime, what: &str) {
    if std::env::var_os("UZSWAP_BENCH_DEBUG").is_some() {
        eprintln!("{what}: {:?}", rt.stats().total());
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

impl Row {
    /// The row of one measured pass over a region of `sizes.0` bytes under a budget of `sizes.1`.
    fn of_pass(
        workload: &'static str,
        (fault_path, policy): (&'static str, &'static str),
        folio: usize,
        pattern: &'static str,
        (region_len, budget): (usize, usize),
        ratio: f64,
        p: &Pass,
    ) -> Row {
        Row {
            workload,
            fault_path,
            policy,
            folio: folio_name(folio),
            pattern,
            region_mb: region_len / MIB,
            budget_mb: budget / MIB,
            mbps: p.mbps,
            faults: p.lat.len() as u64,
            fault_us_p50: percentile(&p.lat, 0.5),
            fault_us_p99: percentile(&p.lat, 0.99),
            zswpin: p.zswpin,
            ratio,
            bad_pages: p.bad,
            peak_usage_pct: p.peak as f64 * 100.0 / budget as f64,
        }
    }
}

struct Pass {
    mbps: f64,
    lat: Vec<f64>,
    zswpin: u64,
    bad: u64,
    peak: u64,
}

fn zswpin(rt: &Runtime) -> u64 {
    rt.stats().total().zswpin
}

/// Reads the pages `order` yields, checking each.
fn pass(rt: &Runtime, region: &Region, content: &Content, order: impl Iterator<Item = usize>) -> Pass {
    let mut expect = [0u8; PAGE];
    let (mut lat, mut bad, mut n, mut peak) = (Vec::new(), 0, 0usize, 0);
    let z0 = zswpin(rt);
    let t = Instant::now();
    for p in order {
        let (good, fault) = read_page(rt, region, content, p, &mut expect);
        bad += !good as u64;
        lat.extend(fault);
        n += 1;
        if n % 4096 == 0 {
            peak = peak.max(rt.usage());
        }
    }
    let secs = t.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    Pass { mbps: (n * PAGE) as f64 / secs / 1e6, lat, zswpin: zswpin(rt) - z0, bad, peak }
}

/// Lets the reclaimer work off the fill's backlog (usage back under the high watermark,
/// at most 5 s) so that a re-read measures re-reading, not the end of the fill.
fn settle(rt: &Runtime, budget: usize) {
    let high = budget as u64 / 100 * RuntimeConfig::new(0).high_watermark_percent as u64;
    let t = Instant::now();
    while rt.usage() > high && t.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn runtime(path: FaultPath, policy: ReclaimPolicy, budget: usize) -> Result<Runtime, String> {
    let mut cfg = RuntimeConfig::new(budget as u64);
    cfg.fault_path = path;
    cfg.policy = policy;
    cfg.publish_stats = false;
    Runtime::new(cfg).map_err(|e| e.to_string())
}

fn names(path: FaultPath, policy: ReclaimPolicy) -> (&'static str, &'static str) {
    (
        if path == FaultPath::Thread { "thread" } else { "sigbus" },
        if policy == ReclaimPolicy::Fifo { "fifo" } else { "probation" },
    )
}

fn folio_name(f: usize) -> String {
    if f >= MIB { format!("{}M", f / MIB) } else { format!("{}K", f / 1024) }
}

pub fn run(opts: &RegionBenchOpts) -> Result<Report, String> {
    let mut report = Report::new(opts.json);
    let region_len = 1024 * MIB;
    let budget = 512 * MIB;
    let content = Content::new(64 * MIB);
    // Quick runs keep the rows the targets are judged on: every SIGBUS size, and the
    // thread path at 64K only.
    let combos: Vec<(FaultPath, usize)> = if opts.quick {
        vec![(FaultPath::Sigbus, 4096), (FaultPath::Sigbus, 65536), (FaultPath::Thread, 65536)]
    } else {
        [FaultPath::Sigbus, FaultPath::Thread]
            .into_iter()
            .flat_map(|path| [4096, 16384, 65536, 2 * MIB].map(|f| (path, f)))
            .collect()
    };
    // UZSWAP_BENCH_ONLY=sigbus-4K (or thread-64K, hotset, ...) runs one part, for profiling.
    let only = std::env::var("UZSWAP_BENCH_ONLY").ok();
    let combos: Vec<(FaultPath, usize)> = combos
        .into_iter()
        .filter(|&(p, f)| only.as_deref().is_none_or(|o| o == format!("{}-{}", names(p, ReclaimPolicy::Fifo).0, folio_name(f))))
        .collect();
    let random_reads = if opts.quick { 128 * 1024 } else { 256 * 1024 };
    let pages = region_len / PAGE;
    {
        for (path, folio) in combos {
            let policy = ReclaimPolicy::Probation;
            let rt = runtime(path, policy, budget)?;
            let region = rt.create_region(region_len, folio).map_err(|e| e.to_string())?;
            fill(&region, &content);
            let ratio = rt.store().stats().compression_ratio();
            let (fp, pol) = names(path, policy);
            let mut rng = SmallRng::seed_from_u64(7);
            debug_stats(&rt, "fill");
            settle(&rt, budget);
            let seq = pass(&rt, &region, &content, 0..pages);
            debug_stats(&rt, "seq");
            let rand = pass(&rt, &region, &content, (0..random_reads).map(|_| rng.gen_range(0..pages)));
            debug_stats(&rt, "rand");
            for (pattern, p) in [("seq", seq), ("rand", rand)] {
                report.row(&Row::of_pass("reread", (fp, pol), folio, pattern, (region_len, budget), ratio, &p));
            }
        }
    }
    if only.as_deref().is_none_or(|o| o == "hotset") {
        hot_set(opts, &content, &mut report)?;
    }
    Ok(report)
}

/// 90% of reads go to a hot eighth of the region (scattered folios), 10% anywhere: a
/// policy that sees the hot set keeps it resident and decompresses less than FIFO.
fn hot_set(opts: &RegionBenchOpts, content: &Content, report: &mut Report) -> Result<(), String> {
    let region_len = if opts.quick { 512 * MIB } else { 1024 * MIB };
    let budget = region_len / 2;
    let folio = 65536;
    let reads = if opts.quick { 200_000 } else { 800_000 };
    let folios = region_len / folio;
    let ppf = folio / PAGE;
    let mut pick = SmallRng::seed_from_u64(11);
    let hot: Vec<usize> = (0..folios / 8).map(|_| pick.gen_range(0..folios)).collect();
    for policy in [ReclaimPolicy::Fifo, ReclaimPolicy::Probation] {
        let path = FaultPath::Sigbus;
        let rt = runtime(path, policy, budget)?;
        let region = rt.create_region(region_len, folio).map_err(|e| e.to_string())?;
        fill(&region, content);
        settle(&rt, budget);
        let ratio = rt.store().stats().compression_ratio();
        let mut rng = SmallRng::seed_from_u64(5);
        let order = (0..reads).map(|_| {
            let f = if rng.gen_bool(0.9) { hot[rng.gen_range(0..hot.len())] } else { rng.gen_range(0..folios) };
            f * ppf + rng.gen_range(0..ppf)
        });
        let p = pass(&rt, &region, content, order);
        debug_stats(&rt, "hotset");
        let (fp, pol) = names(path, policy);
        report.row(&Row::of_pass("hotset", (fp, pol), folio, "hot90", (region_len, budget), ratio, &p));
    }
    Ok(())
}
