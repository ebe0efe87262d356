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
    Store(Common),
    /// The index against a Mutex<BTreeMap> at 1, 2, 4 and 8 threads.
    Index(Common),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench { which } => match which {
            Bench::Store(c) => {
                uzswap_bench::store::run(&uzswap_bench::store::StoreBenchOpts { quick: c.quick, json: c.json })
            }
            Bench::Index(c) => {
                uzswap_bench::index::run(&uzswap_bench::index::IndexBenchOpts { quick: c.quick, json: c.json })
            }
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
