//! The `uzswap` command: a thin front over the library crates.

mod group;
mod run;
mod stat;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "uzswap", version, about = "Compressed swap for large folios, in user space")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a program with a memory budget; memory beyond it is compressed by uzswap.
    Run(Box<run::RunArgs>),
    /// Show the live uzswap counters of a process.
    Stat(stat::StatArgs),
    /// Show the live uzswap counters of every process under uzswap, refreshed.
    Top(stat::TopArgs),
    /// A bounded soak: many threads on many regions, every byte checked, memory and
    /// descriptors watched; exits non-zero on any mismatch or growth.
    Soak {
        /// How long to run, in seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Worker threads.
        #[arg(long, default_value_t = 4)]
        threads: usize,
        /// Seed of the random choices (a failing run can be repeated).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The summary as one JSON object.
        #[arg(long)]
        json: bool,
        /// Leave MADV_DONTNEED out of the operations.
        #[arg(long)]
        no_dontneed: bool,
    },
    /// Run a benchmark program.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

#[derive(clap::Args, Clone, Copy)]
struct Common {
    /// A small run: under a minute (`bench kernel`: under ten).
    #[arg(long)]
    quick: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Bench {
    /// Compressors x granularities x data through the store: ratio, MB/s, pool overhead.
    Store {
        #[command(flatten)]
        common: Common,
        /// Only these compressors (lz4, zstd, deflate).
        #[arg(long, value_delimiter = ',')]
        compressor: Vec<String>,
        /// Only these granularities (4k, 16k, 64k, 256k, folio).
        #[arg(long, value_delimiter = ',')]
        granularity: Vec<String>,
        /// Only these data sets (realistic, random, zero).
        #[arg(long, value_delimiter = ',')]
        data: Vec<String>,
    },
    /// The index against a Mutex<BTreeMap> at 1, 2, 4 and 8 threads.
    Index(Common),
    /// A 1 GiB region under a 512 MiB budget: re-read speed, fault latency, both fault paths.
    Region(Common),
    /// The experiments of the kernel's zswap and zram work under disk swap, zswap,
    /// zram and uzswap, side by side (the kernel side needs root).
    Kernel {
        #[command(flatten)]
        common: Common,
        /// Only these workloads (usemem, incompressible, multipage, tree, seqswap,
        /// usemem-procs, usemem-threads, fork, build).
        #[arg(long, value_delimiter = ',')]
        workload: Vec<String>,
        /// Only these systems (disk, zswap-lzo, zswap-lzo-rle, zswap-deflate, zram-lz4,
        /// uzswap: its defaults; uzswap-tuned: the bench's tuned settings, an extra column;
        /// plain: no limit, no uzswap, which fork and build run first anyway).
        #[arg(long, value_delimiter = ',')]
        system: Vec<String>,
        /// Where the PNG charts go (default: target/bench-kernel).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Real programs (Python, Node, Java, Go, sqlite3, redis-server) plain, under the
    /// kernel's zswap in a memory cgroup (root) and under uzswap with its defaults.
    Programs {
        #[command(flatten)]
        common: Common,
        /// Only these programs (python-buffers, python-objects, node, java, go, sqlite3, redis, redis-bgsave, xz).
        #[arg(long, value_delimiter = ',')]
        program: Vec<String>,
    },
    /// Backing-file writeback: 4K entries one at a time against 2M folios in clusters.
    Writeback {
        #[command(flatten)]
        common: Common,
        /// Directory for the backing file (default: the system's temp directory).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// Also bench this remote store (redis://host:port[,host:port...]); a redis-server
        /// and a cluster of our own are benched when redis-server is installed.
        #[arg(long)]
        remote: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => return run::run(*args),
        Command::Stat(args) => return stat::stat(args),
        Command::Top(args) => return stat::top(args),
        Command::Soak { seconds, threads, seed, json, no_dontneed } => {
            let opts = uzswap_bench::soak::SoakOpts { seconds, threads, seed, json, dontneed: !no_dontneed };
            return match uzswap_bench::soak::run(&opts) {
                Ok(s) => {
                    if json {
                        println!("{}", serde_json::to_string(&s).expect("summary serializes"));
                    } else {
                        s.print();
                    }
                    if s.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
                }
                Err(e) => {
                    eprintln!("uzswap soak: {e}");
                    ExitCode::from(2)
                }
            };
        }
        Command::Bench { which } => match which {
            Bench::Store { common: c, compressor, granularity, data } => {
                uzswap_bench::store::run(&uzswap_bench::store::StoreBenchOpts {
                    quick: c.quick,
                    json: c.json,
                    compressors: compressor,
                    granularities: granularity,
                    data,
                })
            }
            Bench::Index(c) => {
                uzswap_bench::index::run(&uzswap_bench::index::IndexBenchOpts { quick: c.quick, json: c.json })
            }
            Bench::Region(c) => {
                uzswap_bench::region::run(&uzswap_bench::region::RegionBenchOpts { quick: c.quick, json: c.json })
            }
            Bench::Kernel { common: c, workload, system, out } => {
                uzswap_bench::kernel::run(&uzswap_bench::kernel::KernelBenchOpts {
                    quick: c.quick,
                    json: c.json,
                    out_dir: Some(out.unwrap_or_else(uzswap_bench::kernel::default_out_dir)),
                    workloads: workload,
                    systems: system,
                    uzswap: None,
                })
            }
            Bench::Programs { common: c, program } => uzswap_bench::programs::run(&uzswap_bench::programs::ProgramsOpts {
                quick: c.quick,
                json: c.json,
                programs: program,
                uzswap: None,
            }),
            Bench::Writeback { common: c, dir, remote } => uzswap_bench::writeback::run(
                &uzswap_bench::writeback::WritebackOpts { quick: c.quick, json: c.json, dir, remote },
            ),
        },
    };
    match result {
        Ok(report) => {
            report.finish();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("uzswap: {e}");
            ExitCode::FAILURE
        }
    }
}
