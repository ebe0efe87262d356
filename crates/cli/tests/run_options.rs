//! `uzswap run` options: bad values give one clear line and exit 2 before the program
//! starts; the same names work from the environment and a config file.

mod run_support;
use run_support::*;

fn fails_with(s: &Scratch, args: &[&str], env: &[(&str, &str)], needle: &str) {
    let marker = s.0.join("started");
    let touch = format!("touch {}", marker.display());
    let mut all: Vec<&str> = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", &touch]);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_uzswap"));
    for (k, _) in std::env::vars() {
        if k.starts_with("UZSWAP_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(&all).env("UZSWAP_SHIM", shim()).envs(env.iter().copied());
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{args:?}: more than one line: {err}");
    assert!(err.contains(needle), "{args:?}: {err:?} does not say {needle:?}");
    assert!(!marker.exists(), "{args:?}: the program started");
}

#[test]
fn bad_values_stop_before_the_program_starts() {
    let s = Scratch::new("options");
    fails_with(&s, &[], &[], "no budget");
    fails_with(&s, &["--budget", "lots"], &[], "--budget");
    fails_with(&s, &["--budget", "0"], &[], "more than zero");
    fails_with(&s, &["--budget", "1G", "--folio-size", "48k"], &[], "power of two");
    fails_with(&s, &["--budget", "1G", "--compressor", "brotli"], &[], "brotli");
    fails_with(&s, &["--budget", "1G", "--granularity", "3k"], &[], "granularity");
    fails_with(&s, &["--budget", "1G", "--fault-path", "fast"], &[], "thread or sigbus");
    fails_with(&s, &["--budget", "1G", "--max-pool-percent", "150"], &[], "max_pool_percent");
    fails_with(&s, &["--budget", "1G", "--writeback-dir", "/nonexistent/dir"], &[], "not a directory");
    fails_with(&s, &["--budget", "1G", "--threshold", "12"], &[], "threshold");
    // A budget too small for one folio.
    fails_with(&s, &["--budget", "64k", "--folio-size", "2M"], &[], "smaller than one folio");
    // The same names from the environment and a config file.
    fails_with(&s, &[], &[("UZSWAP_BUDGET", "1G"), ("UZSWAP_FOLIO_SIZE", "3M")], "UZSWAP_FOLIO_SIZE");
    let cfg = s.0.join("bad.conf");
    std::fs::write(&cfg, "budget = 1G\ncompressor: lz4\n").unwrap();
    fails_with(&s, &["--config", cfg.to_str().unwrap()], &[], "bad.conf:2");
    fails_with(&s, &[], &[("UZSWAP_CONFIG", cfg.to_str().unwrap())], "bad.conf:2");
    fails_with(&s, &["--config", "/nonexistent.conf"], &[], "nonexistent.conf");
}

/// Config file < environment < options; what wins reaches the program's runtime.
#[test]
fn settings_layer_and_reach_the_shim() {
    let s = Scratch::new("layers");
    let prog = build_c("mapper", &s.0);
    let cfg = s.0.join("good.conf");
    let stats = s.0.join("stats.jsonl");
    std::fs::write(&cfg, format!("# uzswap settings\nbudget = 16M\nfolio_size = 32k\ncompressor = zstd\nstats = {}\n", stats.display()))
        .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_uzswap"));
    for (k, _) in std::env::vars() {
        if k.starts_with("UZSWAP_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(["run", "--config", cfg.to_str().unwrap(), "--budget", "24M", "--", prog.to_str().unwrap(), "64"])
        .env("UZSWAP_SHIM", shim())
        .env("UZSWAP_FOLIO_SIZE", "16k");
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let lines = stats_lines(&stats);
    let v = assert_swapped(&lines, "mapper");
    assert_eq!(v["budget_bytes"], 24u64 << 20, "the option wins over the file");
    assert!(v["sizes"]["hugepages-16kB"].is_object(), "the environment wins over the file: {v}");
}

/// The program's exit status comes through; a missing program is 127.
#[test]
fn exit_status_is_the_programs() {
    let s = Scratch::new("status");
    let o = uzswap(&s, &["run", "--budget", "64M", "--", "sh", "-c", "exit 7"]);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    let o = uzswap(&s, &["run", "--budget", "64M", "--", "/nonexistent/program"]);
    assert_eq!(o.status.code(), Some(127), "{}", text(&o));
    let o = uzswap(&s, &["run", "--budget", "64M", "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(o.status.code(), Some(128 + 15), "{}", text(&o));
}

/// An unknown or abbreviated option is an error (exit 2), never run as the program.
#[test]
fn unknown_options_are_not_the_program() {
    let s = Scratch::new("unknown");
    let marker = s.0.join("started");
    let touch = format!("touch {}", marker.display());
    for args in [&["--folio", "64K", "--"][..], &["--budget", "64M", "--folio", "64K"]] {
        let mut all = vec!["run"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["sh", "-c", &touch]);
        let o = uzswap(&s, &all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains("'--folio'"), "{args:?}: {}", text(&o));
        assert!(!marker.exists(), "{args:?}: the program started");
    }
}

/// SIGTERM sent to `uzswap run` reaches the program, and `uzswap run` stays to give its
/// exit status: killed alone, it left the program running without its group's
/// coordinator.
#[test]
fn sigterm_goes_on_to_the_program() {
    let s = Scratch::new("sigterm");
    let (ready, got) = (s.0.join("ready"), s.0.join("got"));
    let script = format!(
        // Ends by itself after about 30 s: a regression fails instead of leaving it
        // behind, holding the test's output open.
        "trap 'echo term > {}; exit 7' TERM; echo > {}; i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done",
        got.display(),
        ready.display()
    );
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_uzswap"));
    cmd.args(["run", "--budget", "64M", "--stats", "none", "--", "sh", "-c", &script]).env("UZSWAP_SHIM", shim());
    // Its own process group, as under a service manager: a signal from inside its group
    // reaches the program directly and is not sent again.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().unwrap();
    let start = std::time::Instant::now();
    while !ready.exists() {
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "the program never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: signalling our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert!(got.exists(), "the program did not get SIGTERM ({status:?})");
    assert_eq!(status.code(), Some(7), "uzswap run did not give the program's exit status");
}
