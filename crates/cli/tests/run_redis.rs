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

#[test]
fn redis_server_under_a_budget() {
    for tool in ["redis-server", "redis-cli"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("SKIP: {tool} is not installed (apt-get install redis-server)");
            return;
        }
    }
    let s = Scratch::new("redis");
    let port = 20000 + (std::process::id() % 20000) as u16;
    let stats = s.0.join("redis.jsonl");
    let mut server = uzswap_command(
        &s,
        &[
            "run", "--budget", "32M", "--stats", stats.to_str().unwrap(), "--", "redis-server", "--port", &port.to_string(),
            "--save", "", "--appendonly", "no", "--enable-debug-command", "yes", "--dir", s.0.to_str().unwrap(),
        ],
    )
    .stdout(Stdio::null())
    .spawn()
    .expect("uzswap run redis-server");
    let start = Instant::now();
    while cli(port, &["ping"]).as_deref() != Some("PONG") {
        assert!(start.elapsed() < Duration::from_secs(30), "redis-server did not answer within 30 s under uzswap");
        std::thread::sleep(Duration::from_millis(50));
    }
    // About 90 MB of keys and values, three times the budget.
    assert_eq!(cli(port, &["debug", "populate", "300000", "key", "200"]).as_deref(), Some("OK"), "populate failed or took over 2 minutes");
    assert_eq!(cli(port, &["dbsize"]).as_deref(), Some("300000"));
    for k in [0, 4242, 150_000, 299_999] {
        let v = cli(port, &["get", &format!("key:{k}")]).expect("get");
        assert!(v.starts_with(&format!("value:{k}")) && v.len() == 200, "key:{k} holds {v:?}");
    }
    // A background save forks: the child writes every key (redis' own fork handlers
    // and jemalloc's run around uzswap's; a write of theirs into a folio the fork hold
    // kept write-protected once hung the server inside fork()).
    assert_eq!(cli(port, &["bgsave"]).as_deref(), Some("Background saving started"));
    let start = Instant::now();
    loop {
        let info = cli(port, &["info", "persistence"]).expect("info persistence (the server hung in fork?)");
        if info.contains("rdb_bgsave_in_progress:0") {
            assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "BGSAVE did not finish within 60 s: {info}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its keys are alike: redis compresses the file to about 35 bytes a key.
    let rdb = std::fs::metadata(s.0.join("dump.rdb")).map(|m| m.len()).unwrap_or(0);
    assert!(rdb > 4 << 20, "dump.rdb is {rdb} bytes for 300000 keys");
    // The server closes the connection as it goes: redis-cli's status says nothing.
    let _ = cli(port, &["shutdown", "nosave"]);
    let st = server.wait().expect("wait for uzswap run");
    assert!(st.success(), "uzswap run redis-server: {st}");
    assert_swapped(&stats_lines(&stats), "redis-server");
}
