//! Compiles tests/c/test_uzswap.c against include/uzswap.h and the staticlib with the
//! system C compiler (`cc`), runs it, and checks it passed. (Static, because cargo's
//! LD_LIBRARY_PATH could hand the program a stale cdylib from target/<profile>.)

use std::path::PathBuf;
use std::process::Command;

#[test]
fn c_program_uses_the_api() {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let include = manifest.join("../../include");
    let source = manifest.join("tests/c/test_uzswap.c");
    // `cargo test` leaves the fresh staticlib next to this test binary, in target/<profile>/deps.
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libuzswap_capi.a");
    assert!(lib.exists(), "{} not built", lib.display());
    let out = std::env::temp_dir().join(format!("uzswap-c-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
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
        Err(e) => return eprintln!("SKIP: no C compiler ({cc}): {e}"),
    };
    assert!(status.success(), "compiling the C test failed");
    let run = Command::new(&out).output().expect("run the C test");
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    eprintln!("{stdout}{stderr}");
    match run.status.code() {
        Some(0) => assert!(stdout.contains("fault path 1: ok")),
        Some(77) => eprintln!("SKIP: {stdout}"),
        other => panic!("C test failed ({other:?}): {stdout}{stderr}"),
    }
}
