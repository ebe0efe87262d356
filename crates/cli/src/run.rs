//! `uzswap run`: runs an unmodified program with a memory budget, through the preload
//! shim (crates/shim, `libuzswap_shim.so`).
//!
//! Settings come from, lowest priority first: a config file (`--config` or
//! `UZSWAP_CONFIG`, `key = value` lines), `UZSWAP_<KEY>` variables, the options below.
//! They are checked here, before the program starts (bad values: one line, exit 2), and
//! handed to the shim as `UZSWAP_<KEY>` variables, which an exec'd program inherits.
//!
//! The shim is `$UZSWAP_SHIM`, or `libuzswap_shim.so` next to this executable (what
//! `cargo build` of the workspace puts in target/<profile>/).
//!
//! After the program exits, the summary of every process that managed memory is
//! printed to stderr (unless `--stats none`); with `--stats FILE` the shim also leaves
//! one JSON object per process in FILE. The exit status is the program's (128+N when it
//! died of signal N).

use std::ffi::OsString;
use std::io::{BufRead, Seek};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use uzswap_runtime::shim_support::{format_summary, Settings};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Memory budget: managed resident memory plus the compressed pool (e.g. 1G, 512M).
    #[arg(long)]
    budget: Option<String>,
    /// uzswap's unit of compression and fault: a power of two from 4k to 2M (default 64k).
    #[arg(long)]
    folio_size: Option<String>,
    /// Compression unit within a folio: 4k, 16k, 64k, 256k or folio (default folio).
    #[arg(long)]
    granularity: Option<String>,
    /// lz4, zstd or deflate (default lz4).
    #[arg(long)]
    compressor: Option<String>,
    /// Compressor level (lz4: acceleration; zstd: level; deflate: 1-12).
    #[arg(long, allow_hyphen_values = true)]
    level: Option<String>,
    /// Write the coldest compressed folios to a file in this directory when the pool is full.
    #[arg(long)]
    writeback_dir: Option<String>,
    /// Most bytes the writeback file may hold (default 16G).
    #[arg(long)]
    writeback_max: Option<String>,
    /// The pool's limit as a percentage of the budget (zswap's max_pool_percent; default: none).
    #[arg(long)]
    max_pool_percent: Option<String>,
    /// thread (system calls on swapped-out memory just work) or sigbus (faster faults).
    #[arg(long)]
    fault_path: Option<String>,
    /// probation (default: a cold folio waits, uncompressed, out of view, before it is
    /// compressed; good with a hot set) or fifo (straight out: better for uniform access).
    #[arg(long)]
    policy: Option<String>,
    /// Where the exit summary goes: stderr (default), none, or a file (JSON, one object per process).
    #[arg(long)]
    stats: Option<String>,
    /// Manage mappings and allocations of at least this size (default 1M).
    #[arg(long)]
    threshold: Option<String>,
    /// A file of `key = value` lines with the same names (e.g. `budget = 1G`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

impl RunArgs {
    fn options(&self) -> [(&'static str, &Option<String>); 12] {
        [
            ("budget", &self.budget),
            ("folio_size", &self.folio_size),
            ("granularity", &self.granularity),
            ("compressor", &self.compressor),
            ("level", &self.level),
            ("writeback_dir", &self.writeback_dir),
            ("writeback_max", &self.writeback_max),
            ("max_pool_percent", &self.max_pool_percent),
            ("fault_path", &self.fault_path),
            ("policy", &self.policy),
            ("stats", &self.stats),
            ("threshold", &self.threshold),
        ]
    }
}

/// Config file, then environment, then options; validated, including what only trying
/// can tell (userfaultfd available, the writeback directory usable).
fn settings(args: &RunArgs) -> Result<Settings, String> {
    let mut s = Settings::default();
    let file = args.config.clone().or_else(|| std::env::var_os("UZSWAP_CONFIG").map(PathBuf::from));
    if let Some(f) = file {
        s.apply_config_file(&f)?;
    }
    s.apply_env_vars()?;
    for (key, value) in args.options() {
        if let Some(v) = value {
            s.set(key, v).map_err(|e| format!("--{}: {e}", key.replace('_', "-")))?;
        }
    }
    s.validate()?;
    let mut probe = s.runtime_config();
    probe.publish_stats = false;
    uzswap_runtime::Runtime::new(probe).map_err(|e| format!("cannot start the runtime: {e}"))?;
    if let Some(dir) = &s.writeback_dir {
        uzswap_backing::BackingFile::create(uzswap_backing::BackingConfig::new(dir, s.writeback_max))
            .map_err(|e| format!("writeback directory {}: {e}", dir.display()))?;
    }
    Ok(s)
}

fn find_shim() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("UZSWAP_SHIM") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("UZSWAP_SHIM={}: no such file", p.display())) };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let p = dir.join("libuzswap_shim.so");
    if p.is_file() {
        return Ok(p);
    }
    Err(format!(
        "cannot find the shim: no {} (build the workspace with `cargo build`, or set UZSWAP_SHIM)",
        p.display()
    ))
}

pub fn run(args: RunArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("uzswap run: {msg}");
        ExitCode::from(2)
    };
    let mut s = match settings(&args) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let shim = match find_shim() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    // Where the shim leaves its JSON lines: the user's file, or ours to print and remove.
    let (stats_file, ours) = match s.stats.as_str() {
        "none" => (None, false),
        "stderr" | "-" => (Some(std::env::temp_dir().join(format!("uzswap-run-{}.jsonl", std::process::id()))), true),
        path => (Some(PathBuf::from(path)), false),
    };
    let start_offset = stats_file.as_ref().and_then(|f| std::fs::metadata(f).ok()).map_or(0, |m| m.len());
    if let Some(f) = &stats_file {
        s.stats = f.display().to_string();
    }
    let mut preload = shim.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]).env("LD_PRELOAD", preload).env_remove("UZSWAP_CONFIG").envs(s.to_env());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("uzswap run: cannot run {}: {e}", args.command[0].to_string_lossy());
            return ExitCode::from(127);
        }
    };
    // Like time(1): ^C goes to the program; we stay to report.
    // SAFETY: setting dispositions of our own process.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    let status = match child.wait() {
        Ok(s) => s,
        Err(e) => return fail(format!("waiting for the program: {e}")),
    };
    if let Some(f) = &stats_file {
        print_summaries(f, start_offset);
        if ours {
            let _ = std::fs::remove_file(f);
        }
    }
    use std::os::unix::process::ExitStatusExt;
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// The summary of each process that wrote a line to `file` after `offset`.
fn print_summaries(file: &Path, offset: u64) {
    let Ok(mut f) = std::fs::File::open(file) else {
        eprintln!("uzswap: no memory was managed (nothing reached the threshold)");
        return;
    };
    let _ = f.seek(std::io::SeekFrom::Start(offset));
    let mut any = false;
    for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
        match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(v) => {
                if let Some(c) = v["command"].as_str() {
                    eprintln!("uzswap: {c}:");
                }
                eprint!("{}", format_summary(&v));
                any = true;
            }
            Err(e) => eprintln!("uzswap: unreadable stats line in {}: {e}", file.display()),
        }
    }
    if !any {
        eprintln!("uzswap: no memory was managed (nothing reached the threshold)");
    }
}
