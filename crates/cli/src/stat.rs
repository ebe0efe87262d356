//! `uzswap stat PID` and `uzswap top`: the live counters that a running runtime
//! publishes about once a second (runtime stats.rs: `$UZSWAP_STATS_DIR/<pid>.json`, by
//! default /tmp/uzswap-<uid>/; root sees every user's).

use std::process::ExitCode;
use std::time::Duration;
use uzswap_runtime::shim_support::format_bytes;
use uzswap_runtime::{GroupStats, RuntimeStats};

#[derive(clap::Args, Debug)]
pub struct StatArgs {
    /// The process (running under `uzswap run`, or using the runtime itself), or an
    /// `uzswap run` itself: then its group (the budget the tree shares).
    pid: u32,
    /// The stats object as JSON instead of the summary.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct TopArgs {
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Stop after this many refreshes (default: until interrupted).
    #[arg(long)]
    iterations: Option<u64>,
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}

pub fn stat(args: StatArgs) -> ExitCode {
    // An `uzswap run` whose tree shares one budget: the group.
    if let Some(g) = uzswap_runtime::read_group_stats(args.pid).ok().filter(|_| alive(args.pid)) {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&g).unwrap_or_default());
        } else {
            print!("{}", g.summary());
        }
        return ExitCode::SUCCESS;
    }
    match uzswap_runtime::read_stats(args.pid) {
        Ok(st) if st.is_running() => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&st).unwrap_or_default());
            } else {
                print!("{}", st.summary());
            }
            ExitCode::SUCCESS
        }
        Ok(_) => {
            eprintln!("uzswap stat: process {} is not running (its last stats are stale)", args.pid);
            ExitCode::FAILURE
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let why = if alive(args.pid) {
                "it is not under uzswap, or has not managed any memory yet"
            } else {
                "no such process"
            };
            eprintln!("uzswap stat: no stats for process {}: {why}", args.pid);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("uzswap stat: {}: {e}", uzswap_runtime::stats_path(args.pid).display());
            ExitCode::FAILURE
        }
    }
}

/// The pids named by the stats files of every user's directory this process may read:
/// `prefix<pid>.json`, sorted, each once (a pid listed in two users' directories, a
/// stale file of one and the live process of the other, is read from its owner's
/// either way).
fn pids_with_files(prefix: &str) -> Vec<u32> {
    let mut out: Vec<u32> = uzswap_runtime::stats_dirs()
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix(prefix)?.strip_suffix(".json")?.parse::<u32>().ok())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The groups of every live `uzswap run` that publishes one.
fn live_groups() -> Vec<GroupStats> {
    pids_with_files("group-").into_iter().filter(|&pid| alive(pid)).filter_map(|pid| uzswap_runtime::read_group_stats(pid).ok()).collect()
}

/// The stats of every live process that publishes them, by pid.
fn live_stats() -> Vec<(u32, RuntimeStats)> {
    pids_with_files("")
        .into_iter()
        .filter_map(|pid| Some((pid, uzswap_runtime::read_stats(pid).ok()?)))
        // Not the file of a process killed outright whose pid now names another.
        .filter(|(_, st)| st.is_running())
        .collect()
}

fn top_table(groups: &[GroupStats], rows: &[(u32, RuntimeStats)]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for g in groups {
        let _ = writeln!(
            s,
            "group of uzswap run {}: budget {}, now {} ({} outside), peak {}, {} processes: resident {}, pool {}, written back {}",
            g.pid,
            format_bytes(g.budget_bytes),
            format_bytes(g.usage_bytes),
            format_bytes(g.outside_bytes),
            format_bytes(g.peak_bytes),
            g.members.len(),
            format_bytes(g.members.iter().map(|m| m.resident_bytes).sum()),
            format_bytes(g.members.iter().map(|m| m.pool_bytes).sum()),
            format_bytes(g.members.iter().map(|m| m.written_back_bytes).sum()),
        );
    }
    let _ = writeln!(
        s,
        "{:>8} {:<16} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "PID", "COMMAND", "BUDGET", "USAGE", "RESIDENT", "POOL", "STORED", "RATIO", "ZSWPOUT", "ZSWPIN", "ZSWPWB", "REMOTE"
    );
    for (pid, st) in rows {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let t = &st.store.totals;
        let _ = writeln!(
            s,
            "{:>8} {:<16} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6.2} {:>10} {:>10} {:>10} {:>10}",
            pid,
            comm.trim(),
            format_bytes(st.budget_bytes),
            format_bytes(st.usage_bytes) + if st.over_budget_warning().is_some() { "!" } else { "" },
            format_bytes(st.resident_bytes),
            format_bytes(st.pool_total_size),
            format_bytes(st.stored_bytes()),
            st.ratio(),
            t.zswpout,
            t.zswpin,
            t.zswpwb,
            // Bytes on a remote tier now (uzswap-remote), "-" without one.
            st.remote.get("remote_stored_bytes").map_or("-".to_string(), |b| format_bytes(*b)),
        );
    }
    if rows.is_empty() {
        s.push_str("(no process is running under uzswap)\n");
    }
    s
}

pub fn top(args: TopArgs) -> ExitCode {
    if !(args.interval.is_finite() && args.interval > 0.0) {
        eprintln!("uzswap top: --interval must be a positive number of seconds");
        return ExitCode::from(2);
    }
    let mut round = 0u64;
    loop {
        let table = top_table(&live_groups(), &live_stats());
        // Clear and home the terminal, then the table (counters in 4 KiB pages).
        print!("\x1b[H\x1b[2Juzswap top (every {}s; zswp* in 4 KiB pages)\n{table}", args.interval);
        round += 1;
        if args.iterations.is_some_and(|n| round >= n) {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_secs_f64(args.interval));
    }
}
