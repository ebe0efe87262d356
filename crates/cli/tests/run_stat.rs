//! `uzswap stat PID` and `uzswap top` show the live counters of a program under `uzswap run`.

mod run_support;
use run_support::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` (an `uzswap run` of a program that prints its pid, then waits for a
/// line on stdin) with the test's shim; the child and the program's pid.
fn started(cmd: &mut Command) -> (std::process::Child, u32) {
    let mut child =
        cmd.env("UZSWAP_SHIM", shim()).env_remove("UZSWAP_CONFIG").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    (child, line.trim().parse().expect("the program prints its pid"))
}

#[test]
fn stat_and_top_show_a_running_program() {
    let s = Scratch::new("stat");
    let live = s.0.join("live");
    let script = "import os, sys\n\
                  bufs = [bytearray(16 << 20) for _ in range(8)]\n\
                  for i, b in enumerate(bufs): b[:] = bytes([i]) * 4096 * 4096\n\
                  print(os.getpid(), flush=True)\n\
                  sys.stdin.readline()\n\
                  assert all(b == bytes([i]) * 4096 * 4096 for i, b in enumerate(bufs))\n";
    let (mut child, pid) = started(
        Command::new(env!("CARGO_BIN_EXE_uzswap"))
            .args(["run", "--budget", "32M", "--stats", "none", "--", "python3", "-c", script])
            .env("UZSWAP_STATS_DIR", &live),
    );
    let stat = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_uzswap")).args(args).env("UZSWAP_STATS_DIR", &live).output().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let summary = loop {
        let o = stat(&["stat", &pid.to_string()]);
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        if o.status.success() && out.contains("hugepages-64kB: zswpout") && !out.contains("hugepages-64kB: zswpout 0 ") {
            break out;
        }
        assert!(Instant::now() < deadline, "no live stats for {pid}: {}", text(&o));
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(summary.contains("budget 32.0 MiB"), "{summary}");
    let o = stat(&["stat", &pid.to_string(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["pid"], pid);
    assert!(v["started"].as_u64().is_some(), "the stats name their process by its start time too: {v}");
    // Files left by processes killed outright, whose pids now name a thread of another
    // process (this test's) and another process (this test itself): stale, not shown.
    // SAFETY: gettid takes nothing.
    let (tid, me) = (unsafe { libc::gettid() } as u32, std::process::id());
    assert_ne!(tid, me, "the test runs on a thread of its own");
    for (ghost, started) in [(tid, v["started"].clone()), (me, serde_json::json!(1))] {
        let mut g = v.clone();
        g["pid"] = ghost.into();
        g["started"] = started;
        std::fs::write(live.join(format!("{ghost}.json")), g.to_string()).unwrap();
        let o = stat(&["stat", &ghost.to_string()]);
        assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not running"), "{ghost}: {}", text(&o));
    }
    let o = stat(&["top", "--iterations", "1"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().any(|l| l.trim_start().starts_with(&pid.to_string()) && l.contains("python3")), "{out}");
    for ghost in [tid, me] {
        assert!(!out.lines().any(|l| l.trim_start().starts_with(&format!("{ghost} "))), "top shows {ghost}, long gone: {out}");
    }
    // The group's line (published once a second): its budget, and where its memory is.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let o = stat(&["top", "--iterations", "1"]);
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        if out.lines().any(|l| l.starts_with("group of uzswap run") && l.contains("budget 32.0 MiB") && l.contains("written back")) {
            break;
        }
        assert!(Instant::now() < deadline, "no group line in top: {out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    assert!(child.wait().unwrap().success());
    // Gone: a clear error, not stale numbers.
    let o = stat(&["stat", &pid.to_string()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains(&pid.to_string()), "{}", text(&o));
}

/// Root sees a program that runs as another user: its stats are in that user's
/// directory (/tmp/uzswap-<uid>), where `stat` and `top` run as root look too.
#[test]
fn root_sees_another_users_program() {
    if !can_become_nobody() {
        return;
    }
    let script = "import os, sys\n\
                  b = bytearray(64 << 20)\n\
                  b[:] = b'x' * len(b)\n\
                  print(os.getpid(), flush=True)\n\
                  sys.stdin.readline()\n";
    let (mut child, pid) = started(
        Command::new(AS_NOBODY[0])
            .args(&AS_NOBODY[1..])
            .args([env!("CARGO_BIN_EXE_uzswap"), "run", "--budget", "32M", "--stats", "none", "--", "/usr/bin/python3", "-c", script])
            .env_remove("UZSWAP_STATS_DIR")
            .current_dir("/"),
    );
    let stat = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_uzswap")).args(args).env_remove("UZSWAP_STATS_DIR").output().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (o, top) = (stat(&["stat", &pid.to_string()]), stat(&["top", "--iterations", "1"]));
        let (out, top) = (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&top.stdout).to_string());
        let listed = top.lines().any(|l| l.trim_start().starts_with(&format!("{pid} ")) && l.contains("python3"));
        if o.status.success() && out.contains("budget 32.0 MiB") && listed {
            break;
        }
        assert!(Instant::now() < deadline, "root does not see {pid}, run as uid 65534: {}\n--- top\n{top}", text(&o));
        std::thread::sleep(Duration::from_millis(200));
    }
    // A stale file of root's under the same pid (a process killed outright long ago):
    // the pid is read from its owner's directory, and listed once.
    let root_dir = std::path::Path::new("/tmp/uzswap-0");
    let made_dir = !root_dir.exists();
    std::fs::create_dir_all(root_dir).unwrap();
    let stale = root_dir.join(format!("{pid}.json"));
    std::fs::write(&stale, "{}").unwrap();
    let top = String::from_utf8_lossy(&stat(&["top", "--iterations", "1"]).stdout).to_string();
    let _ = std::fs::remove_file(&stale);
    if made_dir {
        let _ = std::fs::remove_dir(root_dir);
    }
    let lines = top.lines().filter(|l| l.trim_start().starts_with(&format!("{pid} "))).count();
    assert_eq!(lines, 1, "top lists {pid} {lines} times:\n{top}");
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    assert!(child.wait().unwrap().success());
}
