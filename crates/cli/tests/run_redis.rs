//! `uzswap run` of a real jemalloc-linked server: redis-server (skipped, with the
//! reason, where it is not installed; .ci/run installs it). jemalloc maps its extents
//! while holding its own locks, where uzswap once started its runtime and hung.

mod run_support;
use run_support::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// redis-cli, given two minutes (coreutils' timeout): a hang fails the test, never CI.
fn cli(port: u16, args: &[&str]) -> Option<String> {
    let o = Command::new("timeout").args(["120", "redis-cli", "-p", &port.to_string()]).args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn redis_installed() -> bool {
    for tool in ["redis-server", "redis-cli"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("SKIP: {tool} is not installed (apt-get install redis-server)");
            return false;
        }
    }
    true
}

#[test]
fn redis_server_under_a_budget() {
    if redis_installed() {
        redis_under_a_budget(&Scratch::new("redis"), &[], 0);
    }
}

/// The same as uid 65534, whose userfaultfd serves faults taken in user mode only:
/// the BGSAVE child's stdio stream keeps its buffer in jemalloc's memory, which
/// uzswap manages, and glibc flushes it with its own write(2). A buffer whose folio
/// had gone out failed that write with EFAULT, and the save with "Bad address"
/// (the shim's stdio calls now hold it in place).
#[test]
fn redis_server_as_an_ordinary_user() {
    if redis_installed() && can_become_nobody() {
        let s = Scratch::new("redis-nobody");
        give_to_nobody(&s);
        redis_under_a_budget(&s, &AS_NOBODY, 1);
    }
}

/// redis-server under `uzswap run --budget 32M` started through `wrapper`: populated,
/// read, saved in the background (a fork) and checked. `port_shift` keeps two runs apart.
fn redis_under_a_budget(s: &Scratch, wrapper: &[&str], port_shift: u16) {
    let port = 20000 + (std::process::id() % 20000) as u16 + port_shift * 20000;
    let stats = s.0.join("redis.jsonl");
    let server = uzswap_command_via(
        s,
        wrapper,
        &[
            "run", "--budget", "32M", "--stats", stats.to_str().unwrap(), "--", "redis-server", "--port", &port.to_string(),
            "--save", "", "--appendonly", "no", "--enable-debug-command", "yes", "--dir", s.0.to_str().unwrap(),
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("uzswap run redis-server");
    let start = Instant::now();
    while cli(port, &["ping"]).as_deref() != Some("PONG") {
        assert!(start.elapsed() < Duration::from_secs(30), "redis-server did not answer within 30 s under uzswap");
        std::thread::sleep(Duration::from_millis(50));
    }
    // About 50 MB of keys and values, half as much again as the budget.
    assert_eq!(cli(port, &["debug", "populate", "150000", "key", "200"]).as_deref(), Some("OK"), "populate failed or took over 2 minutes");
    assert_eq!(cli(port, &["dbsize"]).as_deref(), Some("150000"));
    for k in [0, 4242, 75_000, 149_999] {
        let v = cli(port, &["get", &format!("key:{k}")]).expect("get");
        assert!(v.starts_with(&format!("value:{k}")) && v.len() == 200, "key:{k} holds {v:?}");
    }
    // A background save forks: the child writes every key (redis' own fork handlers
    // and jemalloc's run around uzswap's; a write of theirs into a folio the fork hold
    // kept write-protected once hung the server inside fork()). The child takes over
    // the swapped-out folios (jemalloc's mmap'd extents) and reads them at random: it
    // takes about 30 s here, where bringing them back in the parent first took about
    // one, and broke the budget (checked below).
    assert_eq!(cli(port, &["bgsave"]).as_deref(), Some("Background saving started"));
    let start = Instant::now();
    loop {
        let info = cli(port, &["info", "persistence"]).expect("info persistence (the server hung in fork?)");
        if info.contains("rdb_bgsave_in_progress:0") {
            assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "BGSAVE did not finish within 300 s: {info}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its keys are alike: redis compresses the file to about 35 bytes a key.
    let rdb = std::fs::metadata(s.0.join("dump.rdb")).map(|m| m.len()).unwrap_or(0);
    assert!(rdb > 2 << 20, "dump.rdb is {rdb} bytes for 150000 keys");
    eprintln!("BGSAVE of 150000 keys under 32M: {:.1} s", start.elapsed().as_secs_f64());
    // Every key is in the dump (redis-check-rdb comes with redis-server's tools).
    if let Ok(o) = Command::new("redis-check-rdb").arg(s.0.join("dump.rdb")).output() {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("] 150000 keys read"), "redis-check-rdb: {out}");
    }
    // The server closes the connection as it goes: redis-cli's status says nothing.
    let _ = cli(port, &["shutdown", "nosave"]);
    let o = server.wait_with_output().expect("wait for uzswap run");
    assert!(o.status.success(), "uzswap run redis-server: {}\n{}", o.status, text(&o));
    assert_swapped(&stats_lines(&stats), "redis-server");
    // The tree held its budget through the fork (the process-tree issue's bound,
    // budget x 1.15 + 32 MiB): with the folios brought back in the parent first, a
    // BGSAVE of 100 MiB under 64M took the tree to 145 MiB.
    let peak = group_peak_mib(&o, "32.0 MiB");
    assert!(peak <= 32.0 * 1.15 + 32.0, "the tree peaked at {peak} MiB over a budget of 32 MiB\n{}", text(&o));
}
