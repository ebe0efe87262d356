//! Shared by the run_* tests: the `uzswap` binary, the shim, and C programs built from examples/.
//!
//! The shim comes from `cargo test -p uzswap` itself: the CLI lists uzswap-shim as a
//! dev-dependency, so cargo builds libuzswap_shim.so (same profile) into
//! target/<profile>/deps/ before these tests run; it is passed with UZSWAP_SHIM.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_uzswap")).parent().expect("bin dir").to_path_buf()
}

pub fn shim() -> PathBuf {
    let dir = target_dir();
    [dir.join("deps/libuzswap_shim.so"), dir.join("libuzswap_shim.so")]
        .into_iter()
        .find(|p| p.is_file())
        .expect("libuzswap_shim.so is built by `cargo test -p uzswap` (dev-dependency)")
}

pub fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// A scratch directory for one test (removed when dropped).
pub struct Scratch(pub PathBuf);
impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("uzswap-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles examples/<name>.c into `dir`.
pub fn build_c(name: &str, dir: &Path) -> PathBuf {
    cc(&examples(), name, dir)
}

/// One of `uzswap bench`'s C workloads (crates/bench/workloads), built into `dir`.
pub fn build_workload(name: &str, dir: &Path) -> PathBuf {
    cc(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/workloads"), name, dir)
}

/// An example that comes with a shared library of its own (examples/NAME.c built
/// twice: with -DNAME_LIB as `dir/libNAME.so`, then as the program `dir/NAME`, linked
/// with it and finding it beside itself).
pub fn build_c_with_lib(name: &str, dir: &Path) -> PathBuf {
    let define = format!("-D{}_LIB", name.to_uppercase());
    cc_with(&examples(), name, &format!("lib{name}.so"), dir, &["-shared", "-fPIC", &define]);
    let lib = format!("-l{name}");
    cc_with(&examples(), name, name, dir, &["-L", dir.to_str().unwrap(), &lib, "-Wl,-rpath,$ORIGIN"])
}

/// Builds `src/NAME.c` (its headers beside it) into `dir/NAME`.
fn cc(src: &Path, name: &str, dir: &Path) -> PathBuf {
    cc_with(src, name, name, dir, &[])
}

/// Builds `src/NAME.c` into `dir/OUT` with `extra` arguments.
fn cc_with(src: &Path, name: &str, out: &str, dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join(out);
    let st = Command::new("cc")
        .args(["-O2", "-pthread", "-I"])
        .arg(src)
        .arg("-o")
        .arg(&out)
        .arg(src.join(format!("{name}.c")))
        .args(extra)
        .arg("-lutil")
        .status()
        .expect("a C compiler (cc)");
    assert!(st.success(), "cc {name}.c {extra:?} failed");
    out
}

/// `uzswap run ARGS...` with the test's shim and a private stats directory; no
/// UZSWAP_* variables from the caller's environment leak in.
pub fn uzswap(scratch: &Scratch, args: &[&str]) -> Output {
    uzswap_command(scratch, args).output().expect("run uzswap")
}

/// The command [`uzswap`] runs, to spawn it instead.
pub fn uzswap_command(scratch: &Scratch, args: &[&str]) -> Command {
    uzswap_command_via(scratch, &[], args)
}

/// [`uzswap_command`] started through `wrapper`, a program and its arguments (such
/// as `timeout -s KILL 300`, or [`AS_NOBODY`] after [`give_to_nobody`]); empty for none.
pub fn uzswap_command_via(scratch: &Scratch, wrapper: &[&str], args: &[&str]) -> Command {
    let mut cmd = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(env!("CARGO_BIN_EXE_uzswap"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_uzswap")),
    };
    for (k, _) in std::env::vars() {
        if k.starts_with("UZSWAP_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args).env("UZSWAP_SHIM", shim()).env("UZSWAP_STATS_DIR", scratch.0.join("live"));
    cmd
}

/// Runs what follows as uid and gid 65534, an ordinary user with no groups (see
/// [`can_become_nobody`]).
pub const AS_NOBODY: [&str; 5] = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"];

/// Gives the scratch directory and its live stats directory to uid 65534, so that a
/// run through [`AS_NOBODY`] can write there.
pub fn give_to_nobody(scratch: &Scratch) {
    let live = scratch.0.join("live");
    std::fs::create_dir_all(&live).unwrap();
    for d in [&scratch.0, &live] {
        std::os::unix::fs::chown(d, Some(65534), Some(65534)).unwrap();
    }
}

/// The JSON objects the shim appended to a stats file.
pub fn stats_lines(file: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Checks the run swapped out and back in: the counters of the process that swapped
/// the most, which it returns. A program may start others that manage little and
/// leave their lines first (a shell such as pyenv's `python3` whose heap was adopted),
/// so a test reads the program's line from here, never by position.
pub fn assert_swapped<'a>(stats: &'a [serde_json::Value], what: &str) -> &'a serde_json::Value {
    let v = stats
        .iter()
        .filter(|v| v["sizes"].as_object().is_some_and(|m| !m.is_empty()))
        .max_by_key(|v| v["store"]["zswpout"].as_u64().unwrap_or(0))
        .unwrap_or_else(|| panic!("{what}: no stats line with activity: {stats:?}"));
    let sum = |k: &str| v["sizes"].as_object().unwrap().values().map(|s| s[k].as_u64().unwrap()).sum::<u64>();
    assert!(sum("zswpout") > 0, "{what}: nothing swapped out: {v}");
    assert!(sum("zswpin") > 0, "{what}: nothing swapped in: {v}");
    assert!(v["store"]["zswpout"].as_u64().unwrap() > 0, "{what}: store zswpout 0: {v}");
    v
}

/// Whether a test may run a program as uid 65534 (`setpriv`): only as root, with
/// setpriv installed; otherwise it prints why it skips.
pub fn can_become_nobody() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: not root: the other tests already run as this ordinary user");
        return false;
    }
    if std::process::Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("SKIP: setpriv (util-linux) is not installed");
        return false;
    }
    true
}

/// The group's peak, MiB, from `uzswap run`'s exit summary ("budget B, peak P MiB"),
/// where the budget reads `budget` as the summary prints it ("64.0 MiB").
pub fn group_peak_mib(o: &Output, budget: &str) -> f64 {
    String::from_utf8_lossy(&o.stderr)
        .split(&format!("budget {budget}, peak "))
        .nth(1)
        .and_then(|t| t.split(" MiB").next())
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no group peak in the summary: {}", text(o)))
}

/// Checks a run of a program whose runtime reserves and commits its own heap (the JVM,
/// V8), under `budget_mib`: it succeeded and printed `ok`, the group stayed within the
/// bound of the process-tree issue (budget x 1.15 + 32 MiB), something was swapped
/// out and in, at least `adopted_mib` of mappings were adopted, and with
/// UFFD_USER_MODE_ONLY the summary says only the runtime's reservations were.
pub fn assert_heap_managed(o: &Output, stats: &Path, budget_mib: u64, ok: &str, adopted_mib: u64) {
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains(ok), "{}", text(o));
    let peak = group_peak_mib(o, &format!("{budget_mib}.0 MiB"));
    let bound = budget_mib as f64 * 1.15 + 32.0;
    assert!(peak <= bound, "the heap was not managed (or a fork brought it back): peak {peak} MiB over {bound}: {}", text(o));
    let lines = stats_lines(stats);
    let v = assert_swapped(&lines, ok);
    let adopted = v["adopted_bytes"]["mapping"].as_u64().unwrap_or(0);
    assert!(adopted >= adopted_mib << 20, "the heap was not adopted: {v}");
    let err = String::from_utf8_lossy(&o.stderr);
    if err.contains("userfaultfd access: UFFD_USER_MODE_ONLY") {
        assert!(err.contains("only the runtime's reservations"), "{}", text(o));
    }
}
