//! `uzswap soak`: a bounded run of many threads on many regions that checks every
//! byte, and that memory and file descriptors do not grow.
//!
//! The run is a sequence of *rounds* until the time is up. A round makes one or two
//! runtimes with random settings — fault path, writeback (encrypted or not), folio
//! size 4 KiB to 2 MiB, a budget well below the footprint — and one to three regions
//! in each, of 4 to 48 MiB. Every worker thread then works on all of them at once:
//! folio `f` of a region belongs to thread `f % threads`, which writes it (a new
//! version), checks it, or drops it (MADV_DONTNEED: it must then read zeros), at
//! random, while one thread moves the budgets up and down. A round ends with a check
//! of every page, and its regions and runtimes are dropped.
//!
//! A page's content is computed from (region seed, page, version), so nothing is kept
//! but a version per folio: some pages compress well, some not at all, some are one
//! repeated word. Between rounds, and once a second in a monitor thread, the resident
//! set (/proc/self/statm) and the open descriptors (/proc/self/fd) are sampled: after
//! the first rounds they must stay within a bound of what those rounds reached, and
//! at the end the descriptors must be back where they started.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uzswap_runtime::{Error, FaultPath, ReclaimPolicy, Region, Runtime, RuntimeConfig};

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

pub struct SoakOpts {
    pub seconds: u64,
    pub threads: usize,
    pub seed: u64,
    pub json: bool,
    /// Drop folios with MADV_DONTNEED among the operations.
    pub dontneed: bool,
}

impl Default for SoakOpts {
    fn default() -> Self {
        SoakOpts { seconds: 60, threads: 4, seed: 1, json: false, dontneed: true }
    }
}

/// What the run did and saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakSummary {
    pub seconds: f64,
    pub threads: usize,
    pub rounds: u64,
    pub runtimes: u64,
    pub regions_made: u64,
    pub regions_dropped: u64,
    pub pages_written: u64,
    pub pages_verified: u64,
    pub folios_dropped: u64,
    pub budget_changes: u64,
    pub faults: u64,
    pub zswpout: u64,
    pub zswpin: u64,
    pub written_back_pages: u64,
    pub pswpin: u64,
    pub reject_reclaim_fail: u64,
    pub over_budget: u64,
    pub poisoned: u64,
    pub thread_path_rounds: u64,
    pub sigbus_path_rounds: u64,
    pub encrypted_runtimes: u64,
    pub rss_start_bytes: u64,
    pub rss_after_warmup_bytes: u64,
    pub rss_max_bytes: u64,
    pub rss_end_bytes: u64,
    pub fds_start: u64,
    pub fds_max: u64,
    pub fds_end: u64,
    pub mismatches: u64,
    /// Folios the last round's final check had no time left for (a loaded machine).
    pub folios_unchecked: u64,
    /// The first few problems (wrong bytes, growth), empty when all is well.
    pub errors: Vec<String>,
}

impl SoakSummary {
    pub fn ok(&self) -> bool {
        self.errors.is_empty() && self.mismatches == 0
    }

    /// A few lines for people.
    pub fn print(&self) {
        let mb = |b: u64| b as f64 / MIB as f64;
        println!("soak: {:.0} s, {} threads, {} rounds, {} runtimes ({} thread-path / {} sigbus-path rounds, {} encrypted)",
            self.seconds, self.threads, self.rounds, self.runtimes, self.thread_path_rounds, self.sigbus_path_rounds, self.encrypted_runtimes);
        println!("  regions made {} dropped {}; pages written {} verified {}; folios dropped {}; budget changes {}",
            self.regions_made, self.regions_dropped, self.pages_written, self.pages_verified, self.folios_dropped, self.budget_changes);
        println!("  faults {}; zswpout {} zswpin {} (folios); written back {} read back {} (pages); refused {} over budget {} poisoned {}",
            self.faults, self.zswpout, self.zswpin, self.written_back_pages, self.pswpin, self.reject_reclaim_fail, self.over_budget, self.poisoned);
        println!("  RSS start {:.1} MiB, after warm-up {:.1} MiB, max {:.1} MiB, end {:.1} MiB; fds start {} max {} end {}",
            mb(self.rss_start_bytes), mb(self.rss_after_warmup_bytes), mb(self.rss_max_bytes), mb(self.rss_end_bytes),
            self.fds_start, self.fds_max, self.fds_end);
        if self.folios_unchecked > 0 {
            println!("  note: {} folios of the last round left unchecked at the hard stop (machine too loaded)", self.folios_unchecked);
        }
        if self.ok() {
            println!("  every byte checked matched; no growth: OK");
        } else {
            println!("  FAILED: {} mismatched pages", self.mismatches);
            for e in &self.errors {
                println!("  {e}");
            }
        }
    }
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * PAGE as u64
}

/// Open file descriptors of this process.
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0)
}

/// The content of word `w` of page `page` at `version` in a region seeded `seed`.
/// Version 0 is the zero page (never written, or dropped).
fn word(seed: u64, page: usize, version: u32, w: usize) -> u64 {
    if version == 0 {
        return 0;
    }
    let id = seed ^ (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (version as u64).rotate_left(40);
    match (page + version as usize) % 4 {
        // Incompressible: a hash of everything.
        0 => mix(id ^ w as u64),
        // One repeated word: a same-filled page.
        1 => id,
        // Compressible: a few distinct words, then a pattern.
        _ => {
            if w < 16 {
                mix(id ^ w as u64)
            } else {
                id ^ (w as u64 % 7)
            }
        }
    }
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

struct SoakRegion {
    region: Region,
    seed: u64,
    /// The version of each folio (all its pages share it); owned by thread f % threads.
    versions: Vec<AtomicU64>,
}

impl SoakRegion {
    fn base(&self) -> usize {
        self.region.as_ptr() as usize
    }
    fn pages_per_folio(&self) -> usize {
        self.region.folio_size() / PAGE
    }
    fn write_folio(&self, f: usize, version: u32) {
        let ppf = self.pages_per_folio();
        for page in f * ppf..(f + 1) * ppf {
            let p = (self.base() + page * PAGE) as *mut u64;
            for w in 0..PAGE / 8 {
                // SAFETY: inside the live region.
                unsafe { p.add(w).write_volatile(word(self.seed, page, version, w)) };
            }
        }
        self.versions[f].store(version as u64, Relaxed);
    }
    /// Checks folio `f`; returns the pages checked and the first wrong page, if any.
    fn check_folio(&self, f: usize) -> (u64, Option<String>) {
        let ppf = self.pages_per_folio();
        let version = self.versions[f].load(Relaxed) as u32;
        for page in f * ppf..(f + 1) * ppf {
            let p = (self.base() + page * PAGE) as *const u64;
            for w in 0..PAGE / 8 {
                // SAFETY: as above.
                let got = unsafe { p.add(w).read_volatile() };
                let want = word(self.seed, page, version, w);
                if got != want {
                    return (
                        (page - f * ppf) as u64,
                        Some(format!(
                            "page {page} word {w} of a region of {} MiB, folio {} KiB: {got:#x}, want {want:#x} (version {version})",
                            self.region.len() / MIB,
                            self.region.folio_size() / 1024
                        )),
                    );
                }
            }
        }
        (ppf as u64, None)
    }
    fn drop_folio(&self, f: usize) {
        let fs = self.region.folio_size();
        // SAFETY: a folio of the live region.
        unsafe { libc::madvise((self.base() + f * fs) as *mut _, fs, libc::MADV_DONTNEED) };
        self.versions[f].store(0, Relaxed);
    }
    fn folios(&self) -> usize {
        self.versions.len()
    }
}

#[derive(Default)]
struct Totals {
    pages_written: AtomicU64,
    pages_verified: AtomicU64,
    folios_dropped: AtomicU64,
    budget_changes: AtomicU64,
    mismatches: AtomicU64,
    folios_unchecked: AtomicU64,
}

struct Round {
    runtimes: Vec<Runtime>,
    regions: Vec<SoakRegion>,
    paths: Vec<FaultPath>,
    encrypted: u64,
    _dirs: Vec<tempfile::TempDir>,
}

fn make_round(rng: &mut SmallRng) -> Result<Round, String> {
    let mut round = Round { runtimes: Vec::new(), regions: Vec::new(), paths: Vec::new(), encrypted: 0, _dirs: Vec::new() };
    for _ in 0..rng.gen_range(1..=2) {
        let folio = PAGE << rng.gen_range(0..=9);
        let sizes: Vec<usize> = (0..rng.gen_range(1..=3)).map(|_| rng.gen_range(4..=48) * MIB).collect();
        let footprint: usize = sizes.iter().sum();
        // Well below the footprint, and room for a few folios per thread in flight.
        let budget = (footprint / rng.gen_range(3..=6)).max(8 * folio).max(2 * MIB);
        let mut cfg = RuntimeConfig::new(budget as u64);
        cfg.publish_stats = false;
        cfg.fault_path = if rng.gen_bool(0.5) { FaultPath::Thread } else { FaultPath::Sigbus };
        cfg.policy = if rng.gen_bool(0.7) { ReclaimPolicy::Probation } else { ReclaimPolicy::Fifo };
        cfg.keep_clean = rng.gen_bool(0.7);
        // Units below the folio half the time: reads at random then swap in part of it.
        if rng.gen_bool(0.5) {
            cfg.store.codec.granularity = uzswap_runtime::Granularity::Bytes(PAGE << rng.gen_range(0..=2));
        }
        if rng.gen_bool(0.5) {
            let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
            cfg.writeback_dir = Some(dir.path().to_path_buf());
            cfg.backing_max_bytes = (footprint as u64 + (64 << 20)).next_multiple_of(2 << 20);
            cfg.max_pool_percent = rng.gen_range(5..=30);
            cfg.encrypt_backing = rng.gen_bool(0.5);
            round.encrypted += cfg.encrypt_backing as u64;
            round._dirs.push(dir);
        }
        round.paths.push(cfg.fault_path);
        let rt = match Runtime::new(cfg) {
            Ok(rt) => rt,
            Err(Error::Unavailable(why)) => return Err(format!("userfaultfd unavailable, nothing soaked: {why}")),
            Err(e) => return Err(format!("runtime: {e}")),
        };
        for len in sizes {
            let region = rt.create_region(len, folio).map_err(|e| format!("region: {e}"))?;
            let folios = region.len() / folio;
            round.regions.push(SoakRegion { region, seed: rng.gen(), versions: (0..folios).map(|_| AtomicU64::new(0)).collect() });
        }
        round.runtimes.push(rt);
    }
    Ok(round)
}

/// One worker's share of a round: random operations on its folios until `until`,
/// then a check of all of them. Returns the first mismatch.
/// The final check stops at `hard_stop` (a machine so loaded that it cannot swap the
/// round's footprint back in time): what it left is counted, not silently skipped.
#[allow(clippy::too_many_arguments)]
fn work(round: &Round, me: usize, threads: usize, until: Instant, hard_stop: Instant, dontneed: bool, seed: u64, totals: &Totals) -> Option<String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut ops = 0u64;
    while !ops.is_multiple_of(64) || Instant::now() < until {
        ops += 1;
        let r = &round.regions[rng.gen_range(0..round.regions.len())];
        let owned = r.folios().saturating_sub(me).div_ceil(threads);
        if owned == 0 {
            continue;
        }
        let f = me + threads * rng.gen_range(0..owned);
        match rng.gen_range(0..100) {
            0..45 => {
                let v = r.versions[f].load(Relaxed) as u32 + 1;
                r.write_folio(f, v);
                totals.pages_written.fetch_add(r.pages_per_folio() as u64, Relaxed);
            }
            45..97 => {
                let (n, bad) = r.check_folio(f);
                totals.pages_verified.fetch_add(n, Relaxed);
                if bad.is_some() {
                    totals.mismatches.fetch_add(1, Relaxed);
                    return bad;
                }
            }
            _ if !dontneed => {}
            _ => {
                r.drop_folio(f);
                totals.folios_dropped.fetch_add(1, Relaxed);
            }
        }
        if me == 0 && ops.is_multiple_of(2048) {
            let rt = &round.runtimes[rng.gen_range(0..round.runtimes.len())];
            let budget = rt.config().budget_bytes;
            let new = budget / 2 + rng.gen_range(0..=budget);
            if rt.set_budget(new).is_ok() {
                totals.budget_changes.fetch_add(1, Relaxed);
            }
        }
    }
    for r in &round.regions {
        for f in (me..r.folios()).step_by(threads) {
            if Instant::now() >= hard_stop {
                totals.folios_unchecked.fetch_add(1, Relaxed);
                continue;
            }
            let (n, bad) = r.check_folio(f);
            totals.pages_verified.fetch_add(n, Relaxed);
            if bad.is_some() {
                totals.mismatches.fetch_add(1, Relaxed);
                return bad;
            }
        }
    }
    None
}

/// Runs the soak. `Err` only when it could not run at all; a run that found problems
/// returns a summary whose `ok()` is false.
pub fn run(opts: &SoakOpts) -> Result<SoakSummary, String> {
    let threads = opts.threads.max(1);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(opts.seconds.max(1));
    let warmup_end = start + Duration::from_secs(opts.seconds.max(1)) / 4;
    let hard_stop = deadline + Duration::from_secs((opts.seconds / 2).max(30));
    let mut s = SoakSummary { threads, rss_start_bytes: rss_bytes(), fds_start: open_fds(), ..Default::default() };
    let totals = Totals::default();
    let mut rng = SmallRng::seed_from_u64(opts.seed);
    // The monitor: RSS and fds once a second, split at the end of the warm-up.
    let samples = Arc::new(Mutex::new(Vec::<(Instant, u64, u64)>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    // A hang must fail the run, not hold it forever: past the hard stop and a minute
    // of grace, say what each thread is doing and exit.
    let give_up = Duration::from_secs(opts.seconds.max(1)) + Duration::from_secs((opts.seconds / 2).max(30) + 60);
    let monitor = {
        let (samples, stop) = (samples.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                if start.elapsed() > give_up {
                    eprintln!("uzswap soak: HUNG: no progress {give_up:?} after the start; threads:");
                    for t in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
                        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                        let stat = read("stat");
                        let fields: Vec<&str> = stat.rsplit(") ").next().unwrap_or("").split(' ').collect();
                        eprintln!("  {:?} {} state {} utime {} stime {} wchan {} syscall {}", t.file_name(), read("comm").trim(),
                            fields.first().unwrap_or(&"?"), fields.get(11).unwrap_or(&"?"), fields.get(12).unwrap_or(&"?"),
                            read("wchan"), read("syscall").split(' ').next().unwrap_or("?").trim());
                    }
                    std::process::exit(3);
                }
                samples.lock().unwrap().push((Instant::now(), rss_bytes(), open_fds()));
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    while Instant::now() < deadline && s.errors.is_empty() {
        let round = make_round(&mut rng)?;
        s.rounds += 1;
        s.runtimes += round.runtimes.len() as u64;
        s.regions_made += round.regions.len() as u64;
        s.encrypted_runtimes += round.encrypted;
        for p in &round.paths {
            match p {
                FaultPath::Thread => s.thread_path_rounds += 1,
                FaultPath::Sigbus => s.sigbus_path_rounds += 1,
            }
        }
        if !opts.json {
            let what: Vec<String> = round
                .regions
                .iter()
                .map(|r| {
                    let rt = r.region.runtime();
                    format!("{} MiB/{} KiB folios ({:?}, budget {} MiB)", r.region.len() >> 20, r.region.folio_size() >> 10,
                        rt.config().fault_path, rt.budget() >> 20)
                })
                .collect();
            eprintln!("round {}: {}", s.rounds, what.join(", "));
        }
        let until = (Instant::now() + Duration::from_millis(rng.gen_range(2000..6000))).min(deadline);
        let hard_stop = hard_stop.max(until);
        let seeds: Vec<u64> = (0..threads).map(|_| rng.gen()).collect();
        let bad: Vec<String> = std::thread::scope(|sc| {
            let handles: Vec<_> =
                (0..threads).map(|me| { let (round, totals, seed) = (&round, &totals, seeds[me]); sc.spawn(move || work(round, me, threads, until, hard_stop, opts.dontneed, seed, totals)) }).collect();
            handles.into_iter().filter_map(|h| h.join().unwrap_or_else(|_| Some("a worker panicked".into()))).collect()
        });
        s.errors.extend(bad);
        for rt in &round.runtimes {
            let st = rt.stats();
            let t = st.total();
            s.faults += t.faults;
            s.zswpout += t.zswpout;
            s.zswpin += t.zswpin;
            s.reject_reclaim_fail += t.reject_reclaim_fail;
            s.over_budget += t.over_budget;
            s.poisoned += t.poisoned;
            s.written_back_pages += st.store.totals.written_back_pages;
            s.pswpin += st.store.totals.pswpin;
        }
        s.regions_dropped += round.regions.len() as u64;
        let Round { runtimes, regions, .. } = round;
        drop(regions);
        for rt in &runtimes {
            let st = rt.store().stats();
            if st.totals.stored_pages + st.totals.backing_pages != 0 {
                s.errors.push(format!("store entries left after every region was dropped: {:?}", st.totals));
            }
        }
        drop(runtimes);
    }
    stop.store(true, Relaxed);
    let _ = monitor.join();
    s.seconds = start.elapsed().as_secs_f64();
    s.pages_written = totals.pages_written.load(Relaxed);
    s.pages_verified = totals.pages_verified.load(Relaxed);
    s.folios_dropped = totals.folios_dropped.load(Relaxed);
    s.budget_changes = totals.budget_changes.load(Relaxed);
    s.mismatches = totals.mismatches.load(Relaxed);
    s.folios_unchecked = totals.folios_unchecked.load(Relaxed);
    s.rss_end_bytes = rss_bytes();
    s.fds_end = open_fds();
    let samples = samples.lock().unwrap();
    s.rss_max_bytes = samples.iter().map(|x| x.1).max().unwrap_or(0).max(s.rss_end_bytes);
    s.fds_max = samples.iter().map(|x| x.2).max().unwrap_or(0);
    let (warm, after): (Vec<&(Instant, u64, u64)>, Vec<_>) = samples.iter().partition(|x| x.0 < warmup_end);
    s.rss_after_warmup_bytes = warm.iter().map(|x| x.1).max().unwrap_or(s.rss_start_bytes);
    let warm_fds = warm.iter().map(|x| x.2).max().unwrap_or(s.fds_start);
    // The bound: what the warm-up reached, plus the largest round it may not have
    // drawn (two runtimes of three 64 MiB regions under a budget of a third, with a
    // pool and a writeback batch each), plus a quarter for the allocator.
    let rss_bound = s.rss_after_warmup_bytes + s.rss_after_warmup_bytes / 4 + 2 * (64 + 24) as u64 * MIB as u64;
    if let Some(max) = after.iter().map(|x| x.1).max().filter(|&m| m > rss_bound) {
        s.errors.push(format!("RSS grew after the warm-up: {max} bytes, bound {rss_bound}"));
    }
    // A runtime holds seven descriptors (two userfaultfds, two eventfds, a backing
    // file, /proc/self/pagemap, a pidfd for process_madvise), and a round has two.
    let fd_bound = warm_fds.max(s.fds_start + 2 * 7);
    if let Some(max) = after.iter().map(|x| x.2).max().filter(|&m| m > fd_bound) {
        s.errors.push(format!("open descriptors grew after the warm-up: {max}, bound {fd_bound}"));
    }
    if s.fds_end > s.fds_start {
        s.errors.push(format!("{} descriptors open at the end, {} at the start", s.fds_end, s.fds_start));
    }
    s.errors.truncate(8);
    Ok(s)
}
