//! `uzswap bench kernel`: the same workloads under the kernel's swap (a swap file,
//! zswap, zram), each in a memory cgroup with a limit, and under uzswap with the
//! same budget, in one run on one machine.
//!
//! # Workloads
//! 1. `usemem` (vm-scalability, as used for zswap's mTHP swap-out): write SIZE
//!    bytes, then read them back and check them, sequentially or 4 KiB pages in
//!    random order, with 4 KiB pages or 64 KiB mTHP folios.
//! 2. `incompressible` (masim, as used for zswap storing incompressible pages
//!    raw): three regions, one from /dev/urandom, random one-byte
//!    read-modify-writes for a fixed time: operations per second.
//! 3. `multipage` (zram's multi-page compression): realistic data swapped out and
//!    in repeatedly, zstd (and lz4) at 4K, 16K and 64K granularity in our store,
//!    against zram (4 KiB only) through its block device: swap-out and swap-in
//!    MB/s, memory per byte.
//! 4. `tree` (zswap's rbtree under a spinlock against its xarray): threads
//!    swapping slots out and in at once through our index and through one lock
//!    around a BTreeMap (the rbtree-and-spinlock baseline).
//! 5. `seqswap` (THP swap-out that keeps a huge page whole): write-only usemem,
//!    2 MiB THP against 4 KiB pages: swap-out MB/s.
//! 6. `usemem-procs` (vm-scalability's usemem with N processes): N = 1, 2, 4, 8
//!    processes, forked before any memory is touched, each writing and re-reading
//!    SIZE/N bytes sequentially (4 KiB pages), all under one limit or budget;
//!    throughput summed over the processes as vm-scalability sums it (the sum of
//!    each process's bytes per second, per phase).
//! 7. `usemem-threads`: the same with N = 1, 4, 16 threads of one process, each on
//!    its own SIZE/N bytes of one shared mapping, phases started together: faults
//!    at once in one address space, where the far-memory literature finds TLB
//!    shootdowns and accounting, not compression, break down; throughput is the
//!    total over the phase's wall time.
//! 8. `fork`: one process writes SIZE bytes under a limit, then forks short-lived
//!    children one after another (each writes one page and exits; the parent
//!    waits): the mean fork-and-wait time per child, against the same program
//!    with no limit and no uzswap (the `plain` row; `vs_plain` is the ratio).
//! 9. `build`: `make -j2` over generated C files compiled with `cc -O2`, under a
//!    limit of three quarters of the peak the build's tree had in its `plain` run
//!    (which runs first; at half, the kernel systems OOM-killed cc1): wall time,
//!    and builds per minute as the figure. `uzswap-tuned` runs it on the default
//!    (thread) fault path ([`system::UZSWAP_BUILD_SETTINGS`]).
//!
//! Workloads 1, 2 and 5-8 are small C programs ([`programs`]) compiled at start-up
//! and run unmodified under every system, as is 9's make; 3 and 4 run in this
//! process. Workloads 6, 8 and 9 run a process tree: on the kernel side it is all in the
//! one memory cgroup the program enters before exec (children stay in the cgroup
//! they are forked in), under `uzswap run` all under its one budget.
//!
//! # Systems
//! `disk`, `zswap-<compressor>`, `zram-<algorithm>`, `zram-<algorithm>-charged`,
//! `uzswap` and `uzswap-tuned` ([`system`]). The incompressible workload runs each
//! zram named also charged (its memory taken off the cgroup's limit as it grows,
//! as zswap's pool and uzswap's are charged). `uzswap` runs with its defaults, as the kernel systems run with
//! theirs: `vs best` is its figure; `uzswap-tuned` is an extra column with the
//! bench's tuned settings ([`system::UZSWAP_SETTINGS`]), labelled so. The
//! kernel systems need root; without it only the uzswap side runs, and the bench
//! says so. Each kernel run sets up its system, runs, and takes it down again;
//! [`machine`] records the settings first and puts them back after every run,
//! and on error, panic or Ctrl-C. uzswap runs `uzswap run --budget B --folio F
//! --writeback-dir D [tuned settings] -- CMD` (fork and build, which have no folio
//! size under test: its default folio size); while that command does not work, its
//! rows say "unavailable" and why.
//!
//! # Output
//! One [`KernelRow`] per run: a table (JSON Lines with `--json`), and a PNG bar
//! chart per workload in `out_dir`. Every figure comes from the run itself.
//!
//! Peak memory is the whole process tree's, on every side the same measure: the
//! sum of Pss_Anon over the program and its descendants (for uzswap: `uzswap run`
//! and its descendants), sampled every 20 ms (`peak_rss_mib`). Kernel rows also
//! give the cgroup's own peak charge (`cgroup_peak_mib`: v2 memory.peak, v1
//! memory.max_usage_in_bytes, page cache included), and every row the largest one
//! process's peak resident set, VmHWM sampled (`proc_peak_rss_mib`). zram rows add the device's own peak
//! (`uncharged_mib`): zram keeps its compressed pages, and the pages it could not
//! compress, in memory no cgroup is charged for, which zswap's pool and uzswap's
//! are; add it to `cgroup_peak_mib` to compare the memory used on equal terms.

pub mod chart;
pub mod inproc;
pub mod machine;
pub mod programs;
pub mod system;

use crate::report::Report;
use machine::Machine;
use programs::Programs;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use system::{Job, Outcome, RunError, System, UzswapStats};
use uzswap_index::Index;
use uzswap_store::Algorithm;

pub struct KernelBenchOpts {
    /// Every workload at a small scale (under 10 minutes on a 2-CPU machine).
    pub quick: bool,
    pub json: bool,
    /// Where the PNG charts go; None for no charts.
    pub out_dir: Option<PathBuf>,
    /// Workloads to run (names from [`WORKLOADS`]); empty for all.
    pub workloads: Vec<String>,
    /// Systems to run (`disk`, `zswap-<c>`, `zram-<a>`, `uzswap`); empty for
    /// [`system::DEFAULT_SYSTEMS`].
    pub systems: Vec<String>,
    /// The uzswap binary for the uzswap side; None for this executable.
    pub uzswap: Option<PathBuf>,
}

/// The default system a quick run leaves out, for time.
pub const QUICK_LEAVES_OUT: &str = "zswap-deflate";

pub const WORKLOADS: [&str; 9] =
    ["usemem", "incompressible", "multipage", "tree", "seqswap", "usemem-procs", "usemem-threads", "fork", "build"];

/// The process counts of `usemem-procs`.
pub const USEMEM_PROCS: [usize; 4] = [1, 2, 4, 8];
/// The thread counts of `usemem-threads`.
pub const USEMEM_THREADS: [usize; 3] = [1, 4, 16];

/// make's parallelism in `build` (this machine's CPUs).
pub const BUILD_JOBS: usize = 2;

/// The folio size of a workload that has none under test (fork, build): the kernel
/// runs it on 4 KiB pages (no mTHP, its default), uzswap with its default folio size.
const NO_FOLIO_SIZE: usize = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// The system cannot run here; `reason` says why.
    Unavailable,
    /// Not run: the system needs root.
    Skipped,
    /// It ran and failed (exit status, OOM kill, wrong data, timeout).
    Failed,
}

/// One run. Figures are None when the run did not produce them.
#[derive(Clone, Debug, Serialize)]
pub struct KernelRow {
    pub workload: String,
    pub system: String,
    pub config: String,
    pub status: Status,
    /// Bytes the workload touches, and the cgroup limit / uzswap budget, MiB.
    pub size_mib: Option<u64>,
    pub limit_mib: Option<u64>,
    /// Write (swap-out) throughput, MB/s: usemem's and seqswap's write phase
    /// (usemem-procs: summed over the processes; usemem-threads: all over the wall time), masim's fill phase, forker's
    /// write phase, the store (or zram writes) for multipage.
    pub out_mbps: Option<f64>,
    /// Read-back (swap-in) throughput, MB/s: usemem's read phase (usemem-procs:
    /// summed over the processes), the loads (or zram reads) for multipage.
    pub in_mbps: Option<f64>,
    /// masim's read-modify-writes, the tree's stores and loads, or fork's
    /// children forked and waited for, per second.
    pub ops_per_sec: Option<f64>,
    /// fork: mean fork-and-wait time per child, microseconds.
    pub fork_usecs: Option<f64>,
    /// `out_mbps` over one core's lz4 compression speed on the same data, folio by
    /// folio of the row's size (usemem, seqswap, usemem-procs): how many cores' worth
    /// of compression the swap-out ran at (zswap with lzo and disk swap too, for scale).
    pub out_vs_lz4_core: Option<f64>,
    /// Memory held by the compressed tier per original byte (lower is better).
    pub ratio: Option<f64>,
    /// Wall time of the run.
    pub secs: Option<f64>,
    /// The process tree's peak anonymous memory: Pss_Anon summed over the program
    /// and its descendants (uzswap: `uzswap run` and its descendants), sampled
    /// every 20 ms, MiB.
    pub peak_rss_mib: Option<f64>,
    /// Kernel systems: the memory cgroup's peak charge (the whole tree's anonymous
    /// memory, page cache and kernel memory), MiB.
    pub cgroup_peak_mib: Option<f64>,
    /// The largest peak resident set of any one process (VmHWM, sampled; file pages
    /// included), MiB.
    pub proc_peak_rss_mib: Option<f64>,
    /// zram: the most memory the device used, outside the cgroup's charge (zswap's
    /// pool is charged, uzswap's pool is in `peak_rss_mib`), MiB; with
    /// `cgroup_peak_mib` it is what the limit would have had to hold.
    pub uncharged_mib: Option<f64>,
    /// Kernel counter deltas over the run (/proc/vmstat), 4 KiB pages.
    pub pswpout: Option<u64>,
    pub pswpin: Option<u64>,
    pub zswpout: Option<u64>,
    pub zswpin: Option<u64>,
    /// Large folios of the run's size swapped out whole, and split instead.
    pub folio_swpout: Option<u64>,
    pub folio_fallback: Option<u64>,
    /// This row's main figure over the best kernel system's in the same config.
    pub vs_best_kernel: Option<f64>,
    /// fork and build: this row's time over the `plain` row's (fork: mean
    /// fork-and-wait per child; build: wall time); above 1 is slower.
    pub vs_plain: Option<f64>,
    pub reason: String,
}

impl KernelRow {
    /// A row with no figures yet.
    pub fn new(workload: &str, system: &str, config: &str, status: Status) -> KernelRow {
        KernelRow {
            workload: workload.into(),
            system: system.into(),
            config: config.into(),
            status,
            size_mib: None,
            limit_mib: None,
            out_mbps: None,
            in_mbps: None,
            ops_per_sec: None,
            fork_usecs: None,
            out_vs_lz4_core: None,
            ratio: None,
            secs: None,
            peak_rss_mib: None,
            cgroup_peak_mib: None,
            proc_peak_rss_mib: None,
            uncharged_mib: None,
            pswpout: None,
            pswpin: None,
            zswpout: None,
            zswpin: None,
            folio_swpout: None,
            folio_fallback: None,
            vs_best_kernel: None,
            vs_plain: None,
            reason: String::new(),
        }
    }

    fn with_reason(mut self, status: Status, reason: impl Into<String>) -> KernelRow {
        self.status = status;
        self.reason = reason.into();
        self
    }

    /// Drops the throughput figures of a run whose numbers must not be compared.
    fn without_figures(self) -> KernelRow {
        KernelRow { out_mbps: None, in_mbps: None, ops_per_sec: None, fork_usecs: None, ..self }
    }

    /// The figure a workload is judged by (higher is better), if it has one.
    pub fn main_figure(&self) -> Option<f64> {
        match self.workload.as_str() {
            "usemem" | "usemem-procs" | "usemem-threads" => self.in_mbps,
            "seqswap" => self.out_mbps,
            "incompressible" | "tree" | "fork" => self.ops_per_sec,
            "build" => self.secs.filter(|s| *s > 0.0).map(|s| 60.0 / s),
            _ => None,
        }
    }

    /// The time `vs_plain` compares (fork: mean fork-and-wait; build: wall time).
    fn plain_time(&self) -> Option<f64> {
        match self.workload.as_str() {
            "fork" => self.fork_usecs,
            "build" => self.secs,
            _ => None,
        }
    }
}

const MIB: u64 = 1 << 20;

/// Sizes and times of one scale.
struct Scale {
    usemem: u64,
    usemem_limit: u64,
    seq_passes: u32,
    masim_region: u64,
    masim_limit: u64,
    masim_secs: f64,
    multipage: usize,
    multipage_reps: usize,
    tree_secs: f64,
    seqswap: u64,
    seqswap_limit: u64,
    fork: u64,
    fork_limit: u64,
    forks: u32,
    build_files: usize,
    timeout: Duration,
}

impl Scale {
    fn new(quick: bool) -> Scale {
        if quick {
            Scale {
                usemem: 384 * MIB,
                usemem_limit: 192 * MIB,
                seq_passes: 2,
                masim_region: 96 * MIB,
                masim_limit: 232 * MIB,
                masim_secs: 6.0,
                multipage: 32 << 20,
                multipage_reps: 3,
                tree_secs: 0.25,
                seqswap: 384 * MIB,
                seqswap_limit: 192 * MIB,
                fork: 384 * MIB,
                fork_limit: 128 * MIB,
                forks: 16,
                build_files: 12,
                timeout: Duration::from_secs(180),
            }
        } else {
            // usemem: 1.5 GiB under 1 GiB, 3 sequential passes; masim as zswap's
            // incompressible-page work ran it: 3 x 500 MiB under 1200 MiB (80%);
            // multi-page as zram's multi-page compression was measured: 100 MiB.
            Scale {
                usemem: 1536 * MIB,
                usemem_limit: 1024 * MIB,
                seq_passes: 3,
                masim_region: 500 * MIB,
                masim_limit: 1200 * MIB,
                masim_secs: 60.0,
                multipage: 100 << 20,
                multipage_reps: 10,
                tree_secs: 2.0,
                seqswap: 2048 * MIB,
                seqswap_limit: 1024 * MIB,
                fork: 1024 * MIB,
                fork_limit: 256 * MIB,
                forks: 32,
                build_files: 48,
                timeout: Duration::from_secs(1800),
            }
        }
    }

    /// The swap file holds everything any program writes, with room to spare.
    fn swapfile_bytes(&self) -> u64 {
        self.usemem.max(3 * self.masim_region).max(self.seqswap).max(self.fork) + 256 * MIB
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Prog {
    Usemem,
    Masim,
    Forker,
    /// make over the generated build tree; its size and limit come from the
    /// `plain` run, which goes first.
    Make,
}

/// One planned run.
enum Kind {
    Program { prog: Prog, args: Vec<String>, size: u64, limit: u64, folio: usize, system: System },
    Store { algorithm: Algorithm, level: i32, granularity: usize },
    Zram { algorithm: String },
    Tree { baseline: bool, threads: usize },
    /// Not run; the row says why.
    NotRun(Status, String),
}

struct Planned {
    workload: &'static str,
    config: String,
    system: String,
    kind: Kind,
}

pub fn run(opts: &KernelBenchOpts) -> Result<Report, String> {
    for w in &opts.workloads {
        if !WORKLOADS.contains(&w.as_str()) {
            return Err(format!("unknown workload {w:?}: expected one of {}", WORKLOADS.join(", ")));
        }
    }
    let names: Vec<String> = if opts.systems.is_empty() {
        let mut all: Vec<String> = system::DEFAULT_SYSTEMS.iter().map(|s| s.to_string()).collect();
        if opts.quick {
            // Software deflate swaps at about 25 MB/s here: minutes per run.
            all.retain(|s| s != QUICK_LEAVES_OUT);
            eprintln!("uzswap bench kernel: --quick leaves out {QUICK_LEAVES_OUT} (name it with the systems to include it)");
        }
        all
    } else {
        opts.systems.clone()
    };
    let systems = names.iter().map(|n| System::parse(n)).collect::<Result<Vec<_>, _>>()?;
    let scale = Scale::new(opts.quick);
    let root = machine::is_root();
    let wants = |w: &str| opts.workloads.is_empty() || opts.workloads.iter().any(|x| x == w);

    let uses_programs = ["usemem", "incompressible", "seqswap", "usemem-procs", "usemem-threads", "fork", "build"].iter().any(|w| wants(w));
    let uzswap_ready = if uses_programs && systems.iter().any(System::is_uzswap) {
        let exe = match &opts.uzswap {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(|e| format!("current executable: {e}"))?,
        };
        Some(system::probe_uzswap(&exe).map(|()| exe))
    } else {
        None
    };
    let kernel_wanted = systems.iter().any(System::is_kernel);
    if kernel_wanted && !root {
        eprintln!(
            "uzswap bench kernel: not root, so the kernel systems (swap file, zswap, zram, memory cgroups) \
             cannot be set up; running the uzswap side only"
        );
    }
    let plan = plan(&scale, &systems, root, &uzswap_ready, &wants);
    let mut bench = Bench {
        // Without a C compiler the program workloads cannot run; the rest still can.
        programs: plan.iter().any(|p| matches!(p.kind, Kind::Program { .. })).then(Programs::build),
        machine: if root && kernel_wanted { Some(Machine::new()?) } else { None },
        swapfile: None,
        uzswap: uzswap_ready.and_then(Result::ok),
        multipage_data: wants("multipage").then(|| uzswap_corpus::realistic(scale.multipage, 42)),
        build_tree: None,
        build_peak: None,
        lz4_core: std::collections::HashMap::new(),
        scale,
    };
    let mut report = Report::new(opts.json);
    let mut rows: Vec<KernelRow> = Vec::new();
    let progress = crate::progress(opts.json, plan.len() as u64);
    for (n, step) in plan.iter().enumerate() {
        if machine::interrupted() {
            return Err("interrupted; the machine's swap settings were put back".into());
        }
        let mut row = bench.run(n, step)?;
        if let Kind::Program { prog: Prog::Usemem, folio, .. } = &step.kind {
            row.out_vs_lz4_core = bench.out_vs_lz4_core(&row, *folio);
        }
        if row.system.starts_with("uzswap") && row.status == Status::Ok {
            row.vs_best_kernel = versus_best(&row, &rows);
        }
        if row.system != "plain" {
            row.vs_plain = versus_plain(&row, &rows);
        }
        report.row(&row);
        rows.push(row);
        progress.inc(1);
    }
    progress.finish_and_clear();
    drop(bench);
    if let Some(dir) = &opts.out_dir {
        for workload in WORKLOADS {
            let of: Vec<&KernelRow> = rows.iter().filter(|r| r.workload == workload).collect();
            if of.iter().any(|r| r.status == Status::Ok) {
                if let Err(e) = chart::draw(dir, workload, &of) {
                    eprintln!("uzswap bench kernel: no chart for {workload}: {e}");
                }
            }
        }
    }
    Ok(report)
}

/// What the runs share; dropping it takes everything down.
struct Bench {
    programs: Option<Result<Programs, String>>,
    machine: Option<Machine>,
    /// Made on first use by disk or zswap, kept (off) between runs.
    swapfile: Option<Result<PathBuf, String>>,
    /// The uzswap binary, when `uzswap run` works.
    uzswap: Option<PathBuf>,
    multipage_data: Option<Vec<u8>>,
    /// The `build` workload's sources, made on first use.
    build_tree: Option<Result<programs::BuildTree, String>>,
    /// The build's peaks in its `plain` run, or why there are none.
    build_peak: Option<Result<BuildPeak, String>>,
    /// One core's lz4 speed on usemem's data, by folio size, measured on first use.
    lz4_core: std::collections::HashMap<usize, Result<f64, String>>,
    scale: Scale,
}

/// The `plain` build's peaks, bytes: its tree's anonymous memory, and (as root,
/// where it runs in a memory cgroup without a limit) what the cgroup was charged.
#[derive(Clone, Copy, Debug)]
pub struct BuildPeak {
    pub anon: u64,
    pub charged: Option<u64>,
}

impl BuildPeak {
    /// The limit for a system: each gets [`build_limit`] of what it would hold.
    /// uzswap's budget is of anonymous memory, so of the anonymous peak; a memory
    /// cgroup's limit charges page cache too (the compiler's own text, the sources,
    /// the objects), so of the cgroup's peak where it was measured.
    pub fn limit(&self, system: &System) -> u64 {
        match (system.is_kernel(), self.charged) {
            (true, Some(charged)) => build_limit(charged),
            _ => build_limit(self.anon),
        }
    }
}

impl Bench {
    /// make's arguments, the build's size (its plain anonymous peak, 0 before the
    /// plain run) and its limit ([`BuildPeak::limit`]), or why the build cannot run.
    fn build_job(&mut self, system: &System) -> Result<(Vec<String>, u64, u64), (Status, String)> {
        let files = self.scale.build_files;
        let tree = match self.build_tree.get_or_insert_with(|| programs::BuildTree::generate(files)) {
            Ok(t) => t,
            Err(e) => return Err((Status::Unavailable, e.clone())),
        };
        let args = tree.make_args(BUILD_JOBS);
        if *system == System::Plain {
            return Ok((args, 0, 0));
        }
        match &self.build_peak {
            Some(Ok(peak)) => Ok((args, peak.anon.max(peak.charged.unwrap_or(0)), peak.limit(system))),
            Some(Err(why)) => Err((Status::Failed, why.clone())),
            None => Err((Status::Failed, "the plain build did not run, so there is no limit to set".into())),
        }
    }

    /// The row of one planned run; Err only when the bench must stop.
    /// `row`'s swap-out speed over one core's lz4 on the same data (`out_vs_lz4_core`).
    fn out_vs_lz4_core(&mut self, row: &KernelRow, folio: usize) -> Option<f64> {
        let out = row.out_mbps?;
        let core = self.lz4_core.entry(folio).or_insert_with(|| inproc::lz4_core_mbps(folio));
        core.as_ref().ok().map(|core| out / core)
    }

    fn run(&mut self, n: usize, step: &Planned) -> Result<KernelRow, String> {
        let base = KernelRow::new(step.workload, &step.system, &step.config, Status::Ok);
        Ok(match &step.kind {
            Kind::NotRun(status, reason) => base.with_reason(*status, reason.clone()),
            Kind::Program { prog, args, size, limit, folio, system } => {
                let plain = *system == System::Plain;
                let (args, size, limit) = if *prog == Prog::Make {
                    match self.build_job(system) {
                        Ok(sized) => sized,
                        Err((status, why)) => return Ok(base.with_reason(status, why)),
                    }
                } else {
                    (args.clone(), *size, *limit)
                };
                let base = KernelRow {
                    size_mib: (size > 0).then_some(size / MIB),
                    limit_mib: (!plain).then_some(limit / MIB),
                    ..base
                };
                let make;
                let program = match self.programs.as_ref().expect("built when planned") {
                    Ok(p) => match prog {
                        Prog::Usemem => &p.usemem,
                        Prog::Masim => &p.masim,
                        Prog::Forker => &p.forker,
                        Prog::Make => match programs::on_path("make") {
                            Some(m) => {
                                make = m;
                                &make
                            }
                            None => return Ok(base.with_reason(Status::Unavailable, "no make on PATH")),
                        },
                    },
                    Err(e) => return Ok(base.with_reason(Status::Unavailable, e.clone())),
                };
                let job = Job {
                    program,
                    args,
                    limit,
                    folio: (*folio).max(4096),
                    folio_under_test: *folio != NO_FOLIO_SIZE,
                    swap_bytes: size + 64 * MIB,
                    timeout: self.scale.timeout,
                };
                if plain {
                    // As root, in a memory cgroup without a limit, for its peak charge.
                    let outcome = match self.machine.as_mut() {
                        Some(machine) => {
                            let cgroup = format!("uzswap-bench-{}-{n}", std::process::id());
                            system::run_kernel(machine, system, &job, None, &cgroup)
                        }
                        None => system::run_plain(&job),
                    };
                    let row = match outcome {
                        Ok(outcome) => program_row(base, *prog, &outcome),
                        Err(e) => error_row(base, e)?,
                    };
                    if *prog == Prog::Make {
                        let mib = |v: f64| (v * MIB as f64) as u64;
                        self.build_peak = Some(match (row.status, row.peak_rss_mib) {
                            (Status::Ok, Some(peak)) if peak >= 2.0 => {
                                Ok(BuildPeak { anon: mib(peak), charged: row.cgroup_peak_mib.map(mib) })
                            }
                            (Status::Ok, _) => Err("the plain build's peak memory was not measured".into()),
                            _ => Err(format!("the plain build failed ({}), so there is no limit to set", row.reason)),
                        });
                        return Ok(KernelRow { size_mib: row.peak_rss_mib.map(|p| p as u64), ..row });
                    }
                    return Ok(row);
                }
                if system.is_uzswap() {
                    let exe = self.uzswap.as_ref().expect("planned only when `uzswap run` works");
                    return match system::run_uzswap_with(exe, &job, system.uzswap_settings(*prog == Prog::Make)) {
                        Ok((outcome, stats)) => Ok(uzswap_row(program_row(base, *prog, &outcome), &job, &outcome, stats)),
                        Err(e) => error_row(base, e),
                    };
                }
                let machine = self.machine.as_mut().expect("root runs have a machine");
                let file = if matches!(system, System::Disk | System::Zswap(_)) {
                    let bytes = self.scale.swapfile_bytes();
                    match self.swapfile.get_or_insert_with(|| machine.create_swapfile(bytes)) {
                        Ok(p) => Some(p.clone()),
                        Err(e) => return Ok(base.with_reason(Status::Unavailable, e.clone())),
                    }
                } else {
                    None
                };
                let cgroup = format!("uzswap-bench-{}-{n}", std::process::id());
                match system::run_kernel(machine, system, &job, file.as_deref(), &cgroup) {
                    Ok(outcome) => program_row(base, *prog, &outcome),
                    Err(e) => error_row(base, e)?,
                }
            }
            Kind::Store { algorithm, level, granularity } => {
                let data = self.multipage_data.as_deref().expect("made when planned");
                match inproc::multipage_store(*algorithm, *level, *granularity, data, self.scale.multipage_reps) {
                    Ok(m) => multipage_row(base, &m, data.len()),
                    Err(e) => base.with_reason(Status::Failed, e),
                }
            }
            Kind::Zram { algorithm } => {
                let data = self.multipage_data.as_deref().expect("made when planned");
                let machine = self.machine.as_mut().expect("root runs have a machine");
                match inproc::multipage_zram(machine, algorithm, data, self.scale.multipage_reps) {
                    Ok(m) => multipage_row(base, &m, data.len()),
                    Err(e) => error_row(base, e)?,
                }
            }
            Kind::Tree { baseline, threads } => {
                let secs = self.scale.tree_secs;
                let result = if *baseline {
                    inproc::tree(&std::sync::Mutex::new(std::collections::BTreeMap::new()), *threads, secs)
                } else {
                    inproc::tree(&Index::<u64>::new(), *threads, secs)
                };
                match result {
                    Ok(ops) => KernelRow { ops_per_sec: Some(ops), secs: Some(secs), ..base },
                    Err(e) => base.with_reason(Status::Failed, e),
                }
            }
        })
    }
}

/// The `build` limit for a plain peak: three quarters of it, in whole MiB. At
/// half, every kernel system (disk, zswap-lzo-rle, zram-lz4; cgroup v1, kernel
/// 6.18) had cc1 OOM-killed in the cgroup, swap free or not, and at two thirds
/// zswap-lzo-rle did in one quick run of two: no figure to compare.
pub fn build_limit(peak: u64) -> u64 {
    (peak * 3 / 4 / MIB).max(1) * MIB
}

/// A row that is not the kernel's: its main figure over the best kernel system's
/// in the same workload and config (for `tree`, over the lock baseline; never
/// over `plain`, which has no limit, nor over another uzswap column).
pub fn versus_best(row: &KernelRow, done: &[KernelRow]) -> Option<f64> {
    let ours = row.main_figure()?;
    let best = done
        .iter()
        .filter(|r| r.workload == row.workload && r.config == row.config && r.status == Status::Ok)
        .filter(|r| r.system != "plain" && !r.system.starts_with("uzswap"))
        .filter_map(KernelRow::main_figure)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))?;
    (best > 0.0).then(|| ours / best)
}

/// fork and build: this row's time over the `plain` row's in the same config.
pub fn versus_plain(row: &KernelRow, done: &[KernelRow]) -> Option<f64> {
    let ours = row.plain_time()?;
    let plain = done
        .iter()
        .find(|r| r.workload == row.workload && r.config == row.config && r.system == "plain" && r.status == Status::Ok)?
        .plain_time()?;
    (plain > 0.0).then(|| ours / plain)
}

/// One planned run, described: (workload, config, system, what runs: the
/// program's arguments joined by spaces, or the status and reason of a run that
/// will not happen). The plan of `workloads` (all if empty) on `systems`, as a
/// bench with `uzswap run` available would make it, root or not; nothing runs.
pub fn describe_plan(
    quick: bool,
    workloads: &[&str],
    systems: &[&str],
    root: bool,
) -> Result<Vec<(String, String, String, String)>, String> {
    let systems = systems.iter().map(|n| System::parse(n)).collect::<Result<Vec<_>, _>>()?;
    let wants = |w: &str| workloads.is_empty() || workloads.contains(&w);
    let ready = Some(Ok(PathBuf::from("uzswap")));
    Ok(plan(&Scale::new(quick), &systems, root, &ready, &wants)
        .into_iter()
        .map(|p| {
            let what = match &p.kind {
                Kind::Program { prog, args, size, limit, .. } => {
                    format!("{prog:?} {} (size {} MiB, limit {} MiB)", args.join(" "), size / MIB, limit / MIB)
                }
                Kind::NotRun(status, why) => format!("{status:?}: {why}"),
                Kind::Store { granularity, .. } => format!("store {granularity}"),
                Kind::Zram { algorithm } => format!("zram {algorithm}"),
                Kind::Tree { threads, .. } => format!("tree {threads}"),
            };
            (p.workload.to_string(), p.config, p.system, what)
        })
        .collect())
}

/// The plain baseline of `fork` and `build`.
static PLAIN: System = System::Plain;

fn plan(
    scale: &Scale,
    systems: &[System],
    root: bool,
    uzswap_ready: &Option<Result<PathBuf, String>>,
    wants: &dyn Fn(&str) -> bool,
) -> Vec<Planned> {
    let mut plan = Vec::new();
    // Kernel systems first in every config, so the uzswap row can be compared.
    // fork and build run `plain` first, named or not: the baseline (and build's limit).
    let mut ordered: Vec<&System> = systems.iter().filter(|s| s.is_kernel()).collect();
    ordered.extend(systems.iter().filter(|s| !s.is_kernel()));
    let mut with_plain: Vec<&System> = vec![&PLAIN];
    with_plain.extend(ordered.iter().copied().filter(|s| **s != System::Plain));
    #[allow(clippy::too_many_arguments)]
    fn program_rows(
        plan: &mut Vec<Planned>,
        systems: &[&System],
        root: bool,
        uzswap_ready: &Option<Result<PathBuf, String>>,
        workload: &'static str,
        config: String,
        prog: Prog,
        args: Vec<String>,
        size: u64,
        limit: u64,
        folio: usize,
    ) {
        for s in systems {
            let kind = match (*s, uzswap_ready) {
                (s, _) if s.is_kernel() && !root => Kind::NotRun(Status::Skipped, "needs root".into()),
                (s, Some(Err(why))) if s.is_uzswap() => Kind::NotRun(Status::Unavailable, why.clone()),
                _ => Kind::Program { prog, args: args.clone(), size, limit, folio, system: (*s).clone() },
            };
            plan.push(Planned { workload, config: config.clone(), system: s.name(), kind });
        }
    }
    let program = |plan: &mut Vec<Planned>, workload, config: String, prog, args: Vec<String>, size, limit, folio| {
        program_rows(plan, &ordered, root, uzswap_ready, workload, config, prog, args, size, limit, folio)
    };
    if wants("usemem") {
        for (order, random) in [("seq", false), ("rand", true)] {
            for folio in [4096usize, 64 << 10] {
                let mut args = vec![scale.usemem.to_string()];
                if random {
                    args.push("--random".into());
                } else {
                    args.extend(["--passes".into(), scale.seq_passes.to_string()]);
                }
                let config = format!("{order}-{}k", folio >> 10);
                program(&mut plan, "usemem", config, Prog::Usemem, args, scale.usemem, scale.usemem_limit, folio);
            }
        }
    }
    if wants("incompressible") {
        let args = vec![scale.masim_region.to_string(), "--seconds".into(), scale.masim_secs.to_string()];
        let config = format!("3x{}M", scale.masim_region / MIB);
        // Beside each zram, the same with its memory charged: zram keeps what it
        // cannot compress in memory no cgroup is charged for, and this workload is a
        // third incompressible.
        let mut with_charged: Vec<System> = Vec::new();
        for s in &ordered {
            with_charged.push((*s).clone());
            if let System::Zram(a) = s {
                let charged = System::ZramCharged(a.clone());
                if !ordered.contains(&&charged) {
                    with_charged.push(charged);
                }
            }
        }
        let with_charged: Vec<&System> = with_charged.iter().collect();
        program_rows(&mut plan, &with_charged, root, uzswap_ready, "incompressible", config, Prog::Masim, args, 3 * scale.masim_region, scale.masim_limit, 4096);
    }
    if wants("multipage") {
        let mut zram: Vec<String> =
            systems.iter().filter_map(|s| if let System::Zram(a) = s { Some(a.clone()) } else { None }).collect();
        if !zram.is_empty() && !zram.iter().any(|a| a == "zstd") {
            // zram's multi-page compression was measured with zstd: first, if this zram has it.
            zram.insert(0, "zstd".into());
        }
        for algorithm in zram {
            let kind = if root { Kind::Zram { algorithm: algorithm.clone() } } else { Kind::NotRun(Status::Skipped, "needs root".into()) };
            plan.push(Planned { workload: "multipage", config: format!("{algorithm}-4k"), system: format!("zram-{algorithm}"), kind });
        }
        if systems.contains(&System::Uzswap) {
            for (algorithm, level, name) in [(Algorithm::Zstd, 3, "zstd"), (Algorithm::Lz4, 0, "lz4")] {
                for granularity in [4usize << 10, 16 << 10, 64 << 10] {
                    plan.push(Planned {
                        workload: "multipage",
                        config: format!("{name}-{}k", granularity >> 10),
                        system: "uzswap".into(),
                        kind: Kind::Store { algorithm, level, granularity },
                    });
                }
            }
        }
    }
    if wants("tree") {
        for threads in [1, 2, 4, 8] {
            for (system, baseline) in [("rbtree-lock", true), ("uzswap", false)] {
                plan.push(Planned {
                    workload: "tree",
                    config: format!("{threads}-threads"),
                    system: system.into(),
                    kind: Kind::Tree { baseline, threads },
                });
            }
        }
    }
    if wants("seqswap") {
        for folio in [4096usize, 2 << 20] {
            let mut args = vec![scale.seqswap.to_string(), "--write-only".into()];
            if folio == 2 << 20 {
                args.push("--hugepage".into());
            }
            let config = if folio == 4096 { "4k".to_string() } else { "2m".to_string() };
            program(&mut plan, "seqswap", config, Prog::Usemem, args, scale.seqswap, scale.seqswap_limit, folio);
        }
    }
    // usemem's work split over N processes, or N threads of one.
    for (workload, flag, counts) in [("usemem-procs", "procs", &USEMEM_PROCS[..]), ("usemem-threads", "threads", &USEMEM_THREADS[..])] {
        if !wants(workload) {
            continue;
        }
        for &n in counts {
            let args = vec![
                scale.usemem.to_string(),
                "--passes".into(),
                scale.seq_passes.to_string(),
                format!("--{flag}"),
                n.to_string(),
            ];
            program(&mut plan, workload, format!("{n}-{flag}"), Prog::Usemem, args, scale.usemem, scale.usemem_limit, 4096);
        }
    }
    if wants("fork") {
        let args = vec![scale.fork.to_string(), "--forks".into(), scale.forks.to_string()];
        let config = format!("{}M-x{}", scale.fork / MIB, scale.forks);
        program_rows(&mut plan, &with_plain, root, uzswap_ready, "fork", config, Prog::Forker, args, scale.fork, scale.fork_limit, NO_FOLIO_SIZE);
    }
    if wants("build") {
        // Size and limit come from the plain run.
        let config = format!("{}-files-j{BUILD_JOBS}", scale.build_files);
        program_rows(&mut plan, &with_plain, root, uzswap_ready, "build", config, Prog::Make, Vec::new(), 0, 0, NO_FOLIO_SIZE);
    }
    plan
}

fn program_row(base: KernelRow, prog: Prog, o: &Outcome) -> KernelRow {
    let mib = |b: u64| b as f64 / MIB as f64;
    let mut row = KernelRow {
        secs: Some(o.wall_secs),
        peak_rss_mib: Some(mib(o.tree_peak)),
        cgroup_peak_mib: o.cgroup_peak.map(mib),
        proc_peak_rss_mib: Some(mib(o.peak_rss)),
        uncharged_mib: o.uncharged_peak.map(mib),
        ratio: o.ratio,
        ..base
    };
    if System::parse(&row.system).map(|s| s.is_kernel()).unwrap_or(false) {
        let c = &o.counters;
        row.pswpout = Some(c.pswpout);
        row.pswpin = Some(c.pswpin);
        row.zswpout = Some(c.zswpout);
        row.zswpin = Some(c.zswpin);
        row.folio_swpout = c.folio_swpout;
        row.folio_fallback = c.folio_fallback;
    }
    if let Some(why) = o.failure() {
        return row.with_reason(Status::Failed, why);
    }
    match prog {
        Prog::Usemem => match programs::parse_usemem(&o.stdout) {
            Ok(u) if u.mismatches > 0 => row.with_reason(Status::Failed, format!("{} words read back wrong", u.mismatches)),
            Ok(u) => KernelRow { out_mbps: u.write.mbps(), in_mbps: u.read.and_then(|r| r.mbps()), ..row },
            Err(e) => row.with_reason(Status::Failed, e),
        },
        Prog::Masim => match programs::parse_masim(&o.stdout) {
            Ok(m) if m.mismatches > 0 => row.with_reason(Status::Failed, "the byte-sum check failed: data changed"),
            Ok(m) => KernelRow { ops_per_sec: m.ops_per_sec(), out_mbps: m.fill.mbps(), ..row },
            Err(e) => row.with_reason(Status::Failed, e),
        },
        Prog::Forker => match programs::parse_forker(&o.stdout) {
            Ok(f) if f.mismatches > 0 => row.with_reason(Status::Failed, format!("{} pages read back wrong after the forks", f.mismatches)),
            Ok(f) => KernelRow { out_mbps: f.write.mbps(), ops_per_sec: f.forks_per_sec(), fork_usecs: f.mean_usecs(), ..row },
            Err(e) => row.with_reason(Status::Failed, e),
        },
        // The build's figure is its wall time; its exit status is its check.
        Prog::Make => row,
    }
}

/// Adds what `uzswap run` reported to its row, and fails a row whose numbers
/// would not be uzswap's: no memory managed although the program needs more than
/// the budget, or a peak resident set well over the budget (one process's, or the
/// tree's; `fork` keeps its figures then, see below).
fn uzswap_row(mut row: KernelRow, job: &Job, o: &Outcome, stats: Result<UzswapStats, String>) -> KernelRow {
    let stats = match stats {
        Ok(s) => s,
        Err(e) => return row.with_reason(Status::Failed, e),
    };
    if stats.processes > 0 {
        row.zswpout = Some(stats.zswpout);
        row.zswpin = Some(stats.zswpin);
        row.pswpout = Some(stats.pswpout);
        row.pswpin = Some(stats.pswpin);
        if stats.stored_pages > 0 {
            row.ratio = Some(stats.pool_total_size as f64 / (stats.stored_pages * 4096) as f64);
        }
    }
    if row.status != Status::Ok {
        return row;
    }
    let needs = row.size_mib.unwrap_or(0) * MIB > job.limit;
    if needs && stats.processes == 0 {
        return row.without_figures().with_reason(
            Status::Failed,
            "uzswap managed no memory (empty --stats file): these would be the program's numbers without a budget",
        );
    }
    // The tree's sum gets more room: a smaps_rollup walk is not a snapshot (pages
    // come in ahead of it while others go behind it), and on the kernel side the
    // same sum overshot the cgroup's own limit (memory.max_usage_in_bytes at the
    // limit) by up to 17% under usemem-procs.
    let allowed = job.limit + job.limit / 10 + 16 * MIB;
    let tree_allowed = job.limit + job.limit / 4 + 16 * MIB;
    // One process's peak resident set counts its file pages: a compiler's text is most of
    // it, and not what a budget of anonymous memory holds.
    let one_over = o.peak_rss > allowed && row.workload != "build";
    if one_over || o.tree_peak > tree_allowed {
        // fork keeps its figures: the time is uzswap's own, and bringing memory back
        // before a fork (over the budget) is what it costs today.
        let row = if row.workload == "fork" { row } else { row.without_figures() };
        return row.with_reason(
            Status::Failed,
            format!(
                "the budget was not held: peak RSS {} MiB (one process), {} MiB (the tree's anonymous memory) for a budget of {} MiB",
                o.peak_rss / MIB,
                o.tree_peak / MIB,
                job.limit / MIB
            ),
        );
    }
    row
}

fn multipage_row(base: KernelRow, m: &inproc::Multipage, len: usize) -> KernelRow {
    KernelRow {
        size_mib: Some(len as u64 / MIB),
        out_mbps: Some(m.out_mbps),
        in_mbps: Some(m.in_mbps),
        ratio: Some(m.ratio),
        secs: Some(m.secs),
        ..base
    }
}

/// The row for a run that did not complete; a failed teardown or an interrupt
/// stops the bench (the machine is put back as it is dropped).
fn error_row(base: KernelRow, e: RunError) -> Result<KernelRow, String> {
    match e {
        RunError::Unavailable(why) => Ok(base.with_reason(Status::Unavailable, why)),
        RunError::Failed(why) => Ok(base.with_reason(Status::Failed, why)),
        RunError::Teardown(why) => Err(format!("could not take down {}: {why}", base.system)),
        RunError::Interrupted => Err("interrupted; the machine's swap settings were put back".into()),
    }
}

/// Where `uzswap bench kernel` writes its charts by default.
pub fn default_out_dir() -> PathBuf {
    Path::new("target").join("bench-kernel")
}
