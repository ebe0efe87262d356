//! The `uzswap` command: a thin front over the library crates.

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
    /// Run a benchmark program.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

#[derive(clap::Args, Clone, Copy)]
struct Common {
    /// A small run that finishes in under a minute.
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
    /// Backing-file writeback: 4K entries one at a time against 2M folios in clusters.
    Writeback {
        #[command(flatten)]
        common: Common,
        /// Directory for the backing file (default: the system's temp directory).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
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
            Bench::Writeback { common: c, dir } => uzswap_bench::writeback::run(
                &uzswap_bench::writeback::WritebackOpts { quick: c.quick, json: c.json, dir },
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
