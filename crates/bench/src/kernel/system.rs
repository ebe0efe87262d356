//! The swap systems a workload runs under, and running one program under one.
//!
//! A kernel system is set up for each run and taken down after it, through the
//! [`Machine`]'s undo stack:
//! - zswap off (or on, with its compressor and `max_pool_percent`),
//! - the mTHP size under test set to `always`, every other size to `never` (so a
//!   4K run really gets 4 KiB pages),
//! - a swap area at the highest priority (the bench's swap file, or a fresh zram
//!   device), so the machine's own swap areas, if any, are only used after ours
//!   is full; they are not switched off,
//! - a memory cgroup with the limit, which the program enters before exec.
//!
//! uzswap runs the same program with `uzswap run --budget B --folio F -- CMD` (no
//! `--folio` where the workload has no folio size under test: fork, build) and
//! no cgroup; the kernel's swap is as the machine had it. `plain` runs it as it
//! is: no limit, no uzswap (the baseline of `fork` and `build`).
//!
//! The whole process tree is measured, not just its top process: the program
//! enters the cgroup before it execs, so everything it forks is in the cgroup and
//! under its limit (cgroups v1 and v2 alike); and every run samples the tree's
//! anonymous memory ([`TreeSampler`]).

use super::machine::{self, CgroupVersion, Machine, ZSWAP_PARAMS};
use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// zswap's pool limit during a zswap run: the kernel's default.
const ZSWAP_MAX_POOL_PERCENT: &str = "20";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum System {
    /// A swap file, zswap off.
    Disk,
    /// zswap with this compressor in front of the swap file.
    Zswap(String),
    /// A zram device with this algorithm as the only swap.
    Zram(String),
    /// The same, with the device's memory charged to the program as zswap's pool
    /// is: the cgroup's limit is lowered by what the device holds, as it grows
    /// (`zram-<algorithm>-charged`). zram keeps what it cannot compress, and all it
    /// stores, in memory no cgroup is charged for; this row runs it on equal terms.
    ZramCharged(String),
    /// `uzswap run` with its defaults (the budget, the folio size under test and the
    /// writeback directory aside), as the kernel systems run with theirs.
    Uzswap,
    /// `uzswap run` with the bench's tuned settings ([`UZSWAP_SETTINGS`]): an extra,
    /// labelled column, never the one `vs best` is for.
    UzswapTuned,
    /// The program as it is: no limit, no uzswap.
    Plain,
}

/// The systems `uzswap bench kernel` runs when none are named.
pub const DEFAULT_SYSTEMS: [&str; 7] =
    ["disk", "zswap-lzo", "zswap-lzo-rle", "zswap-deflate", "zram-lz4", "uzswap", "uzswap-tuned"];

impl System {
    pub fn parse(name: &str) -> Result<System, String> {
        match name {
            "disk" => Ok(System::Disk),
            "uzswap" => Ok(System::Uzswap),
            "uzswap-tuned" => Ok(System::UzswapTuned),
            "plain" => Ok(System::Plain),
            _ => {
                if let Some(c) = name.strip_prefix("zswap-").filter(|c| !c.is_empty()) {
                    Ok(System::Zswap(c.to_string()))
                } else if let Some(c) = name.strip_prefix("zram-").and_then(|c| c.strip_suffix("-charged")).filter(|c| !c.is_empty()) {
                    Ok(System::ZramCharged(c.to_string()))
                } else if let Some(c) = name.strip_prefix("zram-").filter(|c| !c.is_empty()) {
                    Ok(System::Zram(c.to_string()))
                } else {
                    Err(format!("unknown system {name:?}: expected disk, zswap-<compressor>, zram-<algorithm>, zram-<algorithm>-charged, uzswap, uzswap-tuned or plain"))
                }
            }
        }
    }

    pub fn name(&self) -> String {
        match self {
            System::Disk => "disk".into(),
            System::Zswap(c) => format!("zswap-{c}"),
            System::Zram(c) => format!("zram-{c}"),
            System::ZramCharged(c) => format!("zram-{c}-charged"),
            System::Uzswap => "uzswap".into(),
            System::UzswapTuned => "uzswap-tuned".into(),
            System::Plain => "plain".into(),
        }
    }

    pub fn is_kernel(&self) -> bool {
        matches!(self, System::Disk | System::Zswap(_) | System::Zram(_) | System::ZramCharged(_))
    }

    /// Whether it runs under `uzswap run` (defaults or tuned).
    pub fn is_uzswap(&self) -> bool {
        matches!(self, System::Uzswap | System::UzswapTuned)
    }

    /// The `uzswap run` settings it adds to the budget, folio size and writeback
    /// directory, for `prog` (`build`: the tuned ones on the thread fault path).
    pub fn uzswap_settings(&self, build: bool) -> &'static [&'static str] {
        match (self, build) {
            (System::UzswapTuned, false) => &UZSWAP_SETTINGS,
            (System::UzswapTuned, true) => &UZSWAP_BUILD_SETTINGS,
            _ => &[],
        }
    }

    fn needs_swapfile(&self) -> bool {
        matches!(self, System::Disk | System::Zswap(_))
    }
}

/// One run of a workload program.
pub struct Job<'a> {
    pub program: &'a Path,
    pub args: Vec<String>,
    /// The memory cgroup limit, and uzswap's budget.
    pub limit: u64,
    /// Folio size: 4096 for small pages, else the mTHP size the kernel should use.
    pub folio: usize,
    /// Whether `folio` is the size under test, which uzswap is given too; if not (a
    /// workload of no folio size: fork, build), uzswap runs with its default, as the
    /// kernel with its 4 KiB pages.
    pub folio_under_test: bool,
    /// Size of a zram swap device (at least what the program writes beyond the limit).
    pub swap_bytes: u64,
    pub timeout: Duration,
}

/// Counters from /proc/vmstat and the folio size's mTHP stats, as deltas over a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub pswpout: u64,
    pub pswpin: u64,
    pub zswpout: u64,
    pub zswpin: u64,
    /// Folios of the run's size swapped out whole (to disk or zswap); None at 4K.
    pub folio_swpout: Option<u64>,
    /// Folios of the run's size split before swap-out.
    pub folio_fallback: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct RawCounters(BTreeMap<&'static str, u64>);

const VMSTAT: [&str; 4] = ["pswpout", "pswpin", "zswpout", "zswpin"];

fn read_counters(folio: usize) -> RawCounters {
    let mut c = BTreeMap::new();
    if let Ok(vmstat) = machine::read("/proc/vmstat") {
        for line in vmstat.lines() {
            let mut it = line.split_whitespace();
            if let (Some(k), Some(v)) = (it.next(), it.next()) {
                if let Some(name) = VMSTAT.iter().find(|n| **n == k) {
                    c.insert(*name, v.parse().unwrap_or(0));
                }
            }
        }
    }
    if folio > 4096 {
        let stats = machine::mthp_dir(folio).join("stats");
        for (file, key) in [("swpout", "size_swpout"), ("zswpout", "size_zswpout"), ("swpout_fallback", "size_fallback")] {
            if let Ok(v) = machine::read(stats.join(file)).and_then(|v| v.parse().map_err(|e| format!("{e}"))) {
                c.insert(key, v);
            }
        }
    }
    RawCounters(c)
}

impl RawCounters {
    fn delta(&self, before: &RawCounters, folio: usize) -> Counters {
        let d = |k: &str| -> Option<u64> { Some(self.0.get(k)?.saturating_sub(*before.0.get(k)?)) };
        let large = folio > 4096;
        Counters {
            pswpout: d("pswpout").unwrap_or(0),
            pswpin: d("pswpin").unwrap_or(0),
            zswpout: d("zswpout").unwrap_or(0),
            zswpin: d("zswpin").unwrap_or(0),
            folio_swpout: large.then(|| d("size_swpout").unwrap_or(0) + d("size_zswpout").unwrap_or(0)),
            folio_fallback: if large { d("size_fallback") } else { None },
        }
    }
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
    /// Exit code, or None when killed by a signal.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub wall_secs: f64,
    /// The largest resident set one process of the tree had (VmHWM, file pages
    /// included), sampled with [`tree_peak`](Self::tree_peak), bytes; ru_maxrss
    /// when that is higher than the bench's own high-water mark. Not ru_maxrss
    /// alone: exec records the high-water mark of the forked copy of the bench
    /// (its resident set at fork), so a 48 MiB program once read 120 MiB.
    pub peak_rss: u64,
    /// The whole tree's peak anonymous memory: the sum of Pss_Anon over the
    /// program and its descendants, sampled every 20 ms ([`TreeSampler`]), bytes.
    pub tree_peak: u64,
    /// Kernel systems: the cgroup's peak charge (v2 memory.peak, v1
    /// memory.max_usage_in_bytes: anonymous memory, page cache and kernel memory
    /// of the whole tree), bytes.
    pub cgroup_peak: Option<u64>,
    pub counters: Counters,
    /// Memory held by the compressed tier per original byte, at the moment it held
    /// the most (zswap: Zswap/Zswapped of /proc/meminfo; zram: mm_stat).
    pub ratio: Option<f64>,
    /// zram: the most memory the device used (mm_stat's mem_used_total, sampled),
    /// bytes. It is not charged to the cgroup (zswap's pool is), so the limit does not
    /// hold it.
    pub uncharged_peak: Option<u64>,
    pub oom_kills: Option<u64>,
    pub timed_out: bool,
}

impl Outcome {
    /// Why the run did not succeed, if it did not.
    pub fn failure(&self) -> Option<String> {
        if self.timed_out {
            return Some("timed out".into());
        }
        if self.code == Some(0) {
            return None;
        }
        let how = match (self.code, self.signal) {
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            _ => "ended abnormally".into(),
        };
        let oom = match self.oom_kills {
            Some(n) if n > 0 => format!(" (memory cgroup OOM kills: {n})"),
            _ => String::new(),
        };
        let tail: String = self.stderr.lines().rev().take(2).collect::<Vec<_>>().join(" | ");
        Some(format!("{how}{oom}{}", if tail.is_empty() { String::new() } else { format!(": {tail}") }))
    }
}

/// Runs `job` under a kernel system (or `plain`, in a memory cgroup without a
/// limit); everything set up is undone before returning.
/// `swapfile` is the bench's swap file for disk and zswap. Errors mean the system
/// could not be set up (unavailable) or not be taken down (fatal: see `Teardown`).
pub fn run_kernel(
    machine: &mut Machine,
    system: &System,
    job: &Job,
    swapfile: Option<&Path>,
    cgroup_name: &str,
) -> Result<Outcome, RunError> {
    let mark = machine.mark();
    let result = setup_and_run(machine, system, job, swapfile, cgroup_name);
    let errors = machine.unwind_to(mark);
    if !errors.is_empty() {
        return Err(RunError::Teardown(errors.join("; ")));
    }
    result
}

#[derive(Debug)]
pub enum RunError {
    /// The system cannot run here (a missing compressor, no cgroup...).
    Unavailable(String),
    /// Setting up or running failed for another reason.
    Failed(String),
    /// Something could not be put back: the bench must stop.
    Teardown(String),
    Interrupted,
}

fn setup_and_run(
    machine: &mut Machine,
    system: &System,
    job: &Job,
    swapfile: Option<&Path>,
    cgroup_name: &str,
) -> Result<Outcome, RunError> {
    use RunError::{Failed, Unavailable};
    let version = machine::cgroup_version().ok_or_else(|| Unavailable("no memory cgroup controller".into()))?;
    let zswap = Path::new(ZSWAP_PARAMS);
    // plain runs in a cgroup without a limit (for its peak charge), the machine's
    // swap settings as they are.
    if *system != System::Plain {
        if zswap.exists() {
            machine::write(zswap.join("enabled"), "N").map_err(Failed)?;
        }
        set_mthp(job.folio)?;
    }
    let mut zram_id = None;
    match system {
        System::Plain => {}
        System::Uzswap | System::UzswapTuned => return Err(Failed("uzswap is not a kernel system".into())),
        System::Disk | System::Zswap(_) => {
            let path = swapfile.ok_or_else(|| Failed("no swap file".into()))?;
            if let System::Zswap(compressor) = system {
                if !zswap.exists() {
                    return Err(Unavailable("this kernel has no zswap".into()));
                }
                machine::write(zswap.join("compressor"), compressor)
                    .map_err(|e| Unavailable(format!("zswap has no {compressor} compressor here ({e})")))?;
                machine::write(zswap.join("max_pool_percent"), ZSWAP_MAX_POOL_PERCENT).map_err(Failed)?;
                machine::write(zswap.join("enabled"), "Y").map_err(Failed)?;
                // A compressor the kernel lacks is accepted while zswap is off and
                // silently replaced when it comes on: read it back.
                let got = machine::read(zswap.join("compressor")).map_err(Failed)?;
                if got != *compressor {
                    return Err(Unavailable(format!("zswap has no {compressor} compressor here (it fell back to {got})")));
                }
            }
            debug_assert!(system.needs_swapfile());
            machine.swapon(path).map_err(Failed)?;
        }
        System::Zram(algorithm) | System::ZramCharged(algorithm) => {
            let id = machine.zram_add().map_err(Unavailable)?;
            let dev = zram_block(id);
            zram_algorithm(&dev, algorithm)?;
            machine::write(dev.join("disksize"), &job.swap_bytes.to_string()).map_err(Failed)?;
            let node = zram_node(id).map_err(Failed)?;
            machine::mkswap(&node).map_err(Failed)?;
            machine.swapon(&node).map_err(Failed)?;
            zram_id = Some(id);
        }
    }
    let cgroup = machine.cgroup_create(version, cgroup_name).map_err(Failed)?;
    let limit_file = match version {
        CgroupVersion::V1 => "memory.limit_in_bytes",
        CgroupVersion::V2 => "memory.max",
    };
    if *system != System::Plain {
        machine::write(cgroup.join(limit_file), &job.limit.to_string()).map_err(Failed)?;
    }
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(cgroup.join("cgroup.procs"))
        .map_err(|e| Failed(format!("open {}/cgroup.procs: {e}", cgroup.display())))?;
    let mut cmd = Command::new(job.program);
    cmd.args(&job.args);
    let procs_fd = procs.as_raw_fd();
    // SAFETY: the hook only calls write(2), which is async-signal-safe; "0" moves
    // the writing task, the child itself, into the cgroup before it execs.
    unsafe {
        cmd.pre_exec(move || {
            if libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let sampler = match system {
        System::Zram(_) => Sampler::Zram(zram_block(zram_id.expect("zram set up"))),
        System::ZramCharged(_) => Sampler::ZramCharged { dev: zram_block(zram_id.expect("zram set up")), limit_file: cgroup.join(limit_file), limit: job.limit },
        System::Zswap(_) => Sampler::Zswap,
        _ => Sampler::None,
    };
    let mut outcome = spawn_and_wait(cmd, job, sampler)?;
    drop(procs);
    outcome.oom_kills = oom_kills(version, &cgroup);
    let peak_file = match version {
        CgroupVersion::V1 => "memory.max_usage_in_bytes",
        CgroupVersion::V2 => "memory.peak",
    };
    outcome.cgroup_peak = machine::read(cgroup.join(peak_file)).ok().and_then(|v| v.trim().parse().ok());
    Ok(outcome)
}

/// What `uzswap run --stats FILE` reported, summed over the processes that
/// managed memory (one JSON object per process in FILE).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UzswapStats {
    pub processes: u64,
    pub zswpout: u64,
    pub zswpin: u64,
    pub pswpout: u64,
    pub pswpin: u64,
    pub stored_pages: u64,
    pub pool_total_size: u64,
}

/// Parses the stats file of `uzswap run`; unreadable lines are errors.
pub fn parse_uzswap_stats(text: &str) -> Result<UzswapStats, String> {
    let mut s = UzswapStats::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("unreadable uzswap stats line: {e}"))?;
        let n = |path: &[&str]| path.iter().fold(&v, |v, p| &v[*p]).as_u64().unwrap_or(0);
        s.processes += 1;
        s.zswpout += n(&["store", "zswpout"]);
        // The runtime's swap-ins, per folio size: the store's zswpin leaves out the
        // folios read back with their entry kept as a clean copy.
        s.zswpin += v["sizes"].as_object().map_or(0, |sizes| {
            sizes
                .iter()
                .map(|(name, c)| {
                    let kb = name.strip_prefix("hugepages-").and_then(|r| r.strip_suffix("kB")).and_then(|k| k.parse::<u64>().ok());
                    c["zswpin"].as_u64().unwrap_or(0) * kb.map_or(1, |k| k / 4)
                })
                .sum::<u64>()
        });
        s.pswpout += n(&["store", "pswpout"]);
        s.pswpin += n(&["store", "pswpin"]);
        s.stored_pages += n(&["store", "stored_pages"]);
        s.pool_total_size += n(&["pool_total_size"]);
    }
    Ok(s)
}

/// The `uzswap-tuned` column: how uzswap was set up against the kernel before it ran
/// with its defaults (the `uzswap` column). Its fast fault path (the workloads hand
/// no managed memory to system calls but read(2), which the shim retries), its best
/// ratio-for-speed compressor on this data, and, like zswap with its swap file, a
/// backing file in the same directory the kernel's swap file goes, taking the pool
/// past 90% of the budget. zswap's own pool may use 20% of the machine's memory
/// (~4.8 GiB here), charged to the cgroup: it is not limited below the budget either.
/// The FIFO reclaim policy: the seed experiments pass over their memory uniformly, so
/// probation (a hot-set catcher, `uzswap bench region`'s hotset rows) only keeps a
/// tenth of the budget out of use; FIFO re-read usemem's random 4K pages 15-20% faster.
pub const UZSWAP_SETTINGS: [&str; 10] = [
    "--fault-path",
    "sigbus",
    "--compressor",
    "zstd",
    "--level",
    "-1",
    "--max-pool-percent",
    "90",
    "--policy",
    "fifo",
];

/// uzswap's settings for `build`: [`UZSWAP_SETTINGS`] but the fault path, left at
/// its default (thread). cc1 and make are real programs: they hand heap memory to
/// system calls, and on the SIGBUS path the heap is not adopted, so most of a
/// compiler's memory would not be uzswap's to manage (a quick build under the
/// SIGBUS path swapped out almost nothing and went far over its budget).
pub const UZSWAP_BUILD_SETTINGS: [&str; 8] =
    ["--compressor", "zstd", "--level", "-1", "--max-pool-percent", "90", "--policy", "fifo"];

/// Runs `job` as `uzswap run --budget B [--folio-size F] SETTINGS --writeback-dir D
/// --stats FILE -- program args` (`settings`: [`System::uzswap_settings`]).
pub fn run_uzswap_with(
    uzswap: &Path,
    job: &Job,
    settings: &[&str],
) -> Result<(Outcome, Result<UzswapStats, String>), RunError> {
    let dir = tempfile::Builder::new()
        .prefix("uzswap-bench-stats-")
        .tempdir()
        .map_err(|e| RunError::Failed(format!("temporary directory: {e}")))?;
    let stats = dir.path().join("stats.jsonl");
    let mut cmd = Command::new(uzswap);
    cmd.args(["run", "--budget", &job.limit.to_string()]);
    if job.folio_under_test {
        cmd.args(["--folio-size", &job.folio.to_string()]);
    }
    cmd.args(settings);
    if let Some(dir) = super::machine::swapfile_dirs().first() {
        cmd.arg("--writeback-dir").arg(dir);
    }
    cmd.arg("--stats").arg(&stats).arg("--").arg(job.program).args(&job.args);
    let outcome = spawn_and_wait(cmd, job, Sampler::None)?;
    let parsed = match std::fs::read_to_string(&stats) {
        Ok(text) => parse_uzswap_stats(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(UzswapStats::default()),
        Err(e) => Err(format!("read {}: {e}", stats.display())),
    };
    Ok((outcome, parsed))
}

/// Whether `uzswap run` works: a tiny run of /bin/true under a 16 MiB budget.
/// Returns why not, from its own words, when it does not.
pub fn probe_uzswap(uzswap: &Path) -> Result<(), String> {
    if !uzswap.exists() {
        return Err(format!("no uzswap binary at {}", uzswap.display()));
    }
    let truth = ["/bin/true", "/usr/bin/true"].into_iter().find(|p| Path::new(p).exists()).unwrap_or("true");
    let out = Command::new(uzswap)
        .args(["run", "--budget", &(16u64 << 20).to_string(), "--folio-size", "65536", "--stats", "none", "--", truth])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", uzswap.display()))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    Err(format!("`uzswap run` is not available ({}): {first}", out.status))
}

fn set_mthp(folio: usize) -> Result<(), RunError> {
    let want_dir = machine::mthp_dir(folio);
    if folio > 4096 && !want_dir.join("enabled").exists() {
        return Err(RunError::Unavailable(format!("no {} kB mTHP size in this kernel", folio >> 10)));
    }
    for path in machine::mthp_enabled_files() {
        let Some(dir) = path.parent().filter(|d| d.file_name().is_some_and(|n| n.to_string_lossy().starts_with("hugepages-")))
        else {
            continue; // THP's top-level `enabled` matters only to sizes set to inherit
        };
        let value = if folio > 4096 && dir == want_dir { "always" } else { "never" };
        let now = machine::read(&path).map_err(RunError::Failed)?;
        if machine::selected(&now) != Some(value) {
            machine::write(&path, value).map_err(RunError::Failed)?;
        }
    }
    Ok(())
}

pub fn zram_block(id: u32) -> PathBuf {
    Path::new("/sys/block").join(format!("zram{id}"))
}

/// Selects a zram algorithm, or says which ones the kernel has.
pub fn zram_algorithm(dev: &Path, algorithm: &str) -> Result<(), RunError> {
    let have = machine::read(dev.join("comp_algorithm")).map_err(RunError::Failed)?;
    if !machine::choices(&have).iter().any(|c| c == algorithm) {
        return Err(RunError::Unavailable(format!("zram has no {algorithm} here (it has: {})", machine::choices(&have).join(" "))));
    }
    machine::write(dev.join("comp_algorithm"), algorithm).map_err(RunError::Failed)
}

/// The /dev node of a zram device, waiting briefly for devtmpfs/udev to make it.
pub fn zram_node(id: u32) -> Result<PathBuf, String> {
    let node = PathBuf::from(format!("/dev/zram{id}"));
    let t = Instant::now();
    while !node.exists() {
        if t.elapsed() > Duration::from_secs(3) {
            return Err(format!("{} did not appear (no devtmpfs or udev?)", node.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(node)
}

/// zram's mm_stat: (orig_data_size, mem_used_total).
pub fn zram_mm_stat(dev: &Path) -> Option<(u64, u64)> {
    let s = machine::read(dev.join("mm_stat")).ok()?;
    let f: Vec<u64> = s.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    Some((*f.first()?, *f.get(2)?))
}

/// Samples the compressed tier while a program runs.
enum Sampler {
    None,
    Zswap,
    Zram(PathBuf),
    /// zram whose memory lowers the cgroup's limit (`System::ZramCharged`).
    ZramCharged { dev: PathBuf, limit_file: PathBuf, limit: u64 },
}

impl Sampler {
    /// (original bytes held, memory used), if any.
    fn sample(&self) -> Option<(u64, u64)> {
        match self {
            Sampler::None => None,
            Sampler::Zram(dev) | Sampler::ZramCharged { dev, .. } => zram_mm_stat(dev),
            Sampler::Zswap => {
                let meminfo = machine::read("/proc/meminfo").ok()?;
                let kb = |key: &str| -> Option<u64> {
                    let line = meminfo.lines().find(|l| l.split(':').next() == Some(key))?;
                    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
                };
                Some((kb("Zswapped")?, kb("Zswap")?))
            }
        }
    }
}

/// The least a charged zram's limit is lowered to: below it nothing runs at all.
const CHARGED_FLOOR: u64 = 4 << 20;

/// Runs `cmd` (built from `job` or not) as it is, with the job's timeout: the plain
/// side of a comparison, or uzswap with settings of the caller's choosing.
pub fn run_command(cmd: Command, job: &Job) -> Result<Outcome, RunError> {
    spawn_and_wait(cmd, job, Sampler::None)
}

/// Runs `job`'s program as it is: no limit, no uzswap.
pub fn run_plain(job: &Job) -> Result<Outcome, RunError> {
    let mut cmd = Command::new(job.program);
    cmd.args(&job.args);
    spawn_and_wait(cmd, job, Sampler::None)
}

/// Samples, in a thread, the anonymous memory of a process tree every 20 ms until
/// finished, and keeps the peak (and the largest VmHWM of one process, which
/// misses only growth after a process's last sample): the sum of Pss_Anon (/proc/PID/smaps_rollup) over
/// the root and its descendants (found through /proc/PID/task/*/children). Pss,
/// so pages a forked child shares with its parent count once, as a memory cgroup
/// charges them. A descendant orphaned to init leaves the tree, a peak shorter
/// than 20 ms can be missed, and the processes are read one after another, not at
/// once: a fork between reading a parent and its child counts what they share one
/// and a half times (`fork`'s plain row read 576 MiB for 384 once), and a walk of
/// one big process sees pages come in ahead of it while others go behind it.
pub struct TreeSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(u64, u64)>,
}

/// How often [`TreeSampler`] looks.
pub const TREE_SAMPLE_EVERY: Duration = Duration::from_millis(20);

impl TreeSampler {
    pub fn start(root: libc::pid_t) -> TreeSampler {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut peak, mut hwm) = (0, 0);
            while !flag.load(Ordering::Relaxed) {
                let (anon, one) = tree_sample(root);
                peak = peak.max(anon);
                hwm = hwm.max(one);
                std::thread::sleep(TREE_SAMPLE_EVERY);
            }
            (peak, hwm)
        });
        TreeSampler { stop, thread }
    }

    /// Stops sampling; the tree's peak anonymous memory and the largest VmHWM
    /// of one process, bytes.
    pub fn finish(self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or((0, 0))
    }
}

/// Pss_Anon summed over `root` and its descendants now, bytes.
pub fn tree_anon(root: libc::pid_t) -> u64 {
    tree_sample(root).0
}

/// Pss_Anon summed over `root` and its descendants now, and the largest VmHWM
/// (peak resident set) of one of them, bytes.
pub fn tree_sample(root: libc::pid_t) -> (u64, u64) {
    use uzswap_runtime::group;
    let (mut total, mut hwm) = (0, 0);
    let mut todo = vec![root as u32];
    let mut seen = std::collections::HashSet::new();
    while let Some(pid) = todo.pop() {
        if !seen.insert(pid) {
            continue;
        }
        total += group::anon_pss(pid);
        hwm = hwm.max(vm_hwm(pid));
        todo.extend(group::children(pid));
    }
    (total, hwm)
}

/// VmHWM of /proc/PID/status, bytes; 0 for a process gone (or a zombie).
fn vm_hwm(pid: u32) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return 0 };
    text.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn spawn_and_wait(mut cmd: Command, job: &Job, sampler: Sampler) -> Result<Outcome, RunError> {
    if machine::interrupted() {
        return Err(RunError::Interrupted);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // A process group of its own, so that a run killed (a timeout) takes its whole tree
    // with it: killing `uzswap run` alone left make and cc1 running, orphaned, through
    // the rows after it.
    cmd.process_group(0);
    // SAFETY: prctl(2) only. If the bench is killed outright, its program goes
    // too, so the next bench can take down what this one left.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let before = read_counters(job.folio);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| RunError::Failed(format!("spawn {}: {e}", job.program.display())))?;
    // The most the forked copy of the bench can have left in the child's ru_maxrss
    // (read after the fork: a high-water mark only grows).
    let bench_hwm = vm_hwm(std::process::id());
    let pid = child.id() as libc::pid_t;
    let tree = TreeSampler::start(pid);
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("piped")));
    let err = reader(Box::new(child.stderr.take().expect("piped")));
    let mut outcome = Outcome::default();
    let mut best: Option<(u64, u64)> = None;
    let mut last_sample = Instant::now() - Duration::from_secs(1);
    let mut killed = false;
    let mut charge_error = None;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: rusage is plain data, filled by the kernel.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage);
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(RunError::Failed(format!("wait4: {e}")));
            }
        }
        let over = start.elapsed() > job.timeout;
        if (over || machine::interrupted()) && !killed {
            outcome.timed_out = over;
            // SAFETY: signalling our own child's process group (the child not yet reaped).
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            killed = true;
        }
        // One read of the compressed tier per look: every 100 ms, and every 10 ms for
        // a charged zram.
        let charged = matches!(sampler, Sampler::ZramCharged { .. });
        let due = last_sample.elapsed() >= Duration::from_millis(100);
        let sample = if due || charged { sampler.sample() } else { None };
        if let (Sampler::ZramCharged { limit_file, limit, .. }, Some((_, used))) = (&sampler, sample) {
            // The device's memory is taken off the limit as it grows. A write the
            // kernel refuses with EBUSY (it could not reclaim down to it yet) is tried
            // again at the next look; a program that cannot fit is killed. Any other
            // error ends the run: the row would not be charged.
            let want = limit.saturating_sub(used).max(CHARGED_FLOOR).to_string();
            if let Err(e) = std::fs::write(limit_file, &want) {
                if e.raw_os_error() != Some(libc::EBUSY) && charge_error.is_none() {
                    charge_error = Some(format!("lowering {} to {want} for zram's memory: {e}", limit_file.display()));
                    // SAFETY: signalling our own child's process group (the child not yet reaped).
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                    killed = true;
                }
            }
        }
        if due {
            last_sample = Instant::now();
            if let Some((orig, used)) = sample {
                if orig > best.map_or(0, |b| b.0) {
                    best = Some((orig, used));
                }
                if matches!(sampler, Sampler::Zram(_)) {
                    outcome.uncharged_peak = outcome.uncharged_peak.max(Some(used));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    outcome.wall_secs = start.elapsed().as_secs_f64();
    // spawn() returned after the exec (Command waits for it), so every sample is
    // of the program, not of the forked copy of the bench.
    (outcome.tree_peak, outcome.peak_rss) = tree.finish();
    let after = read_counters(job.folio);
    outcome.counters = after.delta(&before, job.folio);
    outcome.stdout = out.join().unwrap_or_default();
    outcome.stderr = err.join().unwrap_or_default();
    if libc::WIFEXITED(status) {
        outcome.code = Some(libc::WEXITSTATUS(status));
    } else if libc::WIFSIGNALED(status) {
        outcome.signal = Some(libc::WTERMSIG(status));
    }
    // A program that ends between two samples takes its peak with it (a 384 MiB
    // fill done in 40 ms read 176 MiB, under its budget). ru_maxrss has it, when it
    // is above what the forked copy of the bench could have put there (see peak_rss).
    let waited = usage.ru_maxrss as u64 * 1024;
    if waited > bench_hwm || outcome.peak_rss == 0 {
        // (Gone before the first sample: ru_maxrss, an upper bound.)
        outcome.peak_rss = outcome.peak_rss.max(waited);
    }
    outcome.ratio = best.filter(|b| b.0 > 0).map(|(orig, used)| used as f64 / orig as f64);
    if machine::interrupted() {
        return Err(RunError::Interrupted);
    }
    if let Some(e) = charge_error {
        return Err(RunError::Failed(e));
    }
    Ok(outcome)
}

fn oom_kills(version: CgroupVersion, cgroup: &Path) -> Option<u64> {
    let file = match version {
        CgroupVersion::V1 => "memory.oom_control",
        CgroupVersion::V2 => "memory.events",
    };
    let text = machine::read(cgroup.join(file)).ok()?;
    text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|v| v.trim().parse().ok())
}
