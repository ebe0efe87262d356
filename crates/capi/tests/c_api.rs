//! Compiles tests/c/test_uzswap.c against include/uzswap.h and the staticlib with the
//! system C compiler (`cc`), runs it, and checks it passed; then again under
//! AddressSanitizer with LeakSanitizer (the C side's memory errors and leaks, and the
//! Rust side's leaks through malloc). Static, because cargo's LD_LIBRARY_PATH could
//! hand the program a stale cdylib from target/<profile>.

use std::path::PathBuf;
use std::process::Command;

/// Builds and runs the C test with `flags`; None if there is no C compiler (or, for
/// sanitizer flags, no sanitizer runtime), else the run's output.
fn build_and_run(name: &str, flags: &[&str], env: &[(&str, &str)]) -> Option<std::process::Output> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let include = manifest.join("../../include");
    let source = manifest.join("tests/c/test_uzswap.c");
    // `cargo test` leaves the fresh staticlib next to this test binary, in target/<profile>/deps.
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libuzswap_capi.a");
    assert!(lib.exists(), "{} not built", lib.display());
    let out = std::env::temp_dir().join(format!("uzswap-c-test-{name}-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .args(flags)
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&out)
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-lgcc_s", "-lutil", "-lrt"])
        .status();
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            eprintln!("SKIP: no C compiler ({cc}): {e}");
            return None;
        }
    };
    if !status.success() && !flags.is_empty() {
        eprintln!("SKIP: {cc} cannot build with {flags:?} here");
        return None;
    }
    assert!(status.success(), "compiling the C test failed");
    let run = Command::new(&out).envs(env.iter().copied()).output().expect("run the C test");
    let _ = std::fs::remove_file(&out);
    Some(run)
}

fn check(run: std::process::Output) {
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    eprintln!("{stdout}{stderr}");
    match run.status.code() {
        Some(0) => assert!(stdout.contains("fault path 1: ok"), "{stdout}"),
        Some(77) => eprintln!("SKIP: {stdout}"),
        other => panic!("C test failed ({other:?}): {stdout}{stderr}"),
    }
}

/// The URL of a redis-server started for the test (kept alive by the returned
/// value), for the C program's remote runs; none (they are skipped) without one.
fn redis() -> (Option<uzswap_remote::testing::Server>, Vec<(&'static str, String)>) {
    let server = uzswap_remote::testing::Server::start(&[]);
    let env = server.iter().map(|s| ("UZSWAP_TEST_REDIS", s.url())).collect();
    (server, env)
}

#[test]
fn c_program_uses_the_api() {
    let (_server, env) = redis();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Some(run) = build_and_run("plain", &[], &env) {
        let remote = !env.is_empty();
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        check(run);
        assert!(!remote || stdout.contains("fault path 1 (remote): ok"), "{stdout}");
    }
}

#[test]
fn c_program_under_address_sanitizer() {
    let flags = ["-g", "-fsanitize=address", "-fno-omit-frame-pointer"];
    // Leaks are errors; SIGBUS is left to the runtime's handler (ASan would claim it).
    let (_server, redis) = redis();
    let mut env = vec![("ASAN_OPTIONS", "detect_leaks=1:handle_sigbus=0:abort_on_error=0:exitcode=23")];
    env.extend(redis.iter().map(|(k, v)| (*k, v.as_str())));
    if let Some(run) = build_and_run("asan", &flags, &env) {
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!stderr.contains("ERROR: AddressSanitizer") && !stderr.contains("ERROR: LeakSanitizer"), "{stderr}");
        check(run);
    }
}
