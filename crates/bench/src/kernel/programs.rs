//! The workload programs: small C files under `crates/bench/workloads/`, built into
//! the binary as source and compiled with `cc -O2` (found on PATH) when the bench
//! starts, so every system runs the very same unmodified executable; and parsing
//! of what they print.
//!
//! Each program prints one line per phase: its name, then `key=value` fields, and
//! a final `<name> done`. Anything else on stdout is ignored; a missing phase, a
//! missing field, a malformed number or a missing `done` is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const USEMEM_C: &str = include_str!("../../workloads/usemem.c");
pub const MASIM_C: &str = include_str!("../../workloads/masim.c");
pub const FORKER_C: &str = include_str!("../../workloads/forker.c");
/// The helpers the programs include.
pub const COMMON_H: &str = include_str!("../../workloads/common.h");

/// The compiled programs, in a temporary directory removed on drop.
pub struct Programs {
    _dir: tempfile::TempDir,
    pub usemem: PathBuf,
    pub masim: PathBuf,
    pub forker: PathBuf,
}

impl Programs {
    pub fn build() -> Result<Programs, String> {
        let dir = tempfile::Builder::new()
            .prefix("uzswap-bench-kernel-")
            .tempdir()
            .map_err(|e| format!("temporary directory: {e}"))?;
        let header = dir.path().join("common.h");
        std::fs::write(&header, COMMON_H).map_err(|e| format!("write {}: {e}", header.display()))?;
        let usemem = compile(dir.path(), "usemem", USEMEM_C)?;
        let masim = compile(dir.path(), "masim", MASIM_C)?;
        let forker = compile(dir.path(), "forker", FORKER_C)?;
        Ok(Programs { _dir: dir, usemem, masim, forker })
    }
}

fn compile(dir: &Path, name: &str, source: &str) -> Result<PathBuf, String> {
    let src = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&src, source).map_err(|e| format!("write {}: {e}", src.display()))?;
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let out = Command::new(&cc)
        .args(["-O2", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run the C compiler {cc:?} (needed to build the workload programs): {e}"))?;
    if !out.status.success() {
        return Err(format!("cc -O2 -pthread {name}.c failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(exe)
}

/// The `key=value` fields of each line that starts with `program`, in order.
pub fn phases(program: &str, stdout: &str) -> Vec<BTreeMap<String, String>> {
    stdout
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            if words.next() != Some(program) {
                return None;
            }
            Some(
                words
                    .filter_map(|w| w.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        })
        .collect()
}

fn done(program: &str, stdout: &str) -> bool {
    stdout.lines().any(|l| {
        let mut w = l.split_whitespace();
        w.next() == Some(program) && w.next() == Some("done") && w.next().is_none()
    })
}

fn phase<'a>(all: &'a [BTreeMap<String, String>], name: &str) -> Option<&'a BTreeMap<String, String>> {
    all.iter().find(|p| p.get("phase").map(String::as_str) == Some(name))
}

fn field(p: &BTreeMap<String, String>, phase: &str, key: &str) -> Result<u64, String> {
    let v = p.get(key).ok_or_else(|| format!("phase {phase} has no {key}="))?;
    v.parse().map_err(|_| format!("phase {phase}: {key}={v} is not a number"))
}

/// A timed phase: bytes moved and microseconds taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    pub bytes: u64,
    pub usecs: u64,
}

impl Timed {
    /// Throughput in MB/s (10^6 bytes per second), None for a zero-length phase.
    pub fn mbps(&self) -> Option<f64> {
        (self.usecs > 0).then(|| self.bytes as f64 / self.usecs as f64)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Usemem {
    pub write: Timed,
    /// None for a --write-only run.
    pub read: Option<Timed>,
    pub mismatches: u64,
}

pub fn parse_usemem(stdout: &str) -> Result<Usemem, String> {
    let all = phases("usemem", stdout);
    let w = phase(&all, "write").ok_or("usemem printed no write phase")?;
    let write = Timed { bytes: field(w, "write", "bytes")?, usecs: field(w, "write", "usecs")? };
    let (read, mismatches) = match phase(&all, "read") {
        Some(r) => (
            Some(Timed { bytes: field(r, "read", "bytes")?, usecs: field(r, "read", "usecs")? }),
            field(r, "read", "mismatches")?,
        ),
        None => (None, 0),
    };
    if !done("usemem", stdout) {
        return Err("usemem did not finish (no `usemem done`)".into());
    }
    Ok(Usemem { write, read, mismatches })
}

#[derive(Clone, Debug, PartialEq)]
pub struct Masim {
    pub fill: Timed,
    pub ops: u64,
    pub usecs: u64,
    pub mismatches: u64,
}

impl Masim {
    pub fn ops_per_sec(&self) -> Option<f64> {
        (self.usecs > 0).then(|| self.ops as f64 * 1e6 / self.usecs as f64)
    }
}

pub fn parse_masim(stdout: &str) -> Result<Masim, String> {
    let all = phases("masim", stdout);
    let f = phase(&all, "fill").ok_or("masim printed no fill phase")?;
    let fill = Timed { bytes: field(f, "fill", "bytes")?, usecs: field(f, "fill", "usecs")? };
    let r = phase(&all, "rmw").ok_or("masim printed no rmw phase")?;
    let c = phase(&all, "check").ok_or("masim printed no check phase")?;
    if !done("masim", stdout) {
        return Err("masim did not finish (no `masim done`)".into());
    }
    Ok(Masim {
        fill,
        ops: field(r, "rmw", "ops")?,
        usecs: field(r, "rmw", "usecs")?,
        mismatches: field(c, "check", "mismatches")?,
    })
}

/// What forker printed: its write phase, its forks and the check of its data.
#[derive(Clone, Debug, PartialEq)]
pub struct Forker {
    pub write: Timed,
    pub forks: u64,
    /// All forks and waits together, and the longest one, microseconds.
    pub usecs: u64,
    pub max_usecs: u64,
    pub mismatches: u64,
}

impl Forker {
    /// Mean fork-and-wait time per child, microseconds.
    pub fn mean_usecs(&self) -> Option<f64> {
        (self.forks > 0).then(|| self.usecs as f64 / self.forks as f64)
    }

    /// Children forked and waited for per second.
    pub fn forks_per_sec(&self) -> Option<f64> {
        (self.usecs > 0).then(|| self.forks as f64 * 1e6 / self.usecs as f64)
    }
}

pub fn parse_forker(stdout: &str) -> Result<Forker, String> {
    let all = phases("forker", stdout);
    let w = phase(&all, "write").ok_or("forker printed no write phase")?;
    let write = Timed { bytes: field(w, "write", "bytes")?, usecs: field(w, "write", "usecs")? };
    let f = phase(&all, "fork").ok_or("forker printed no fork phase")?;
    let c = phase(&all, "check").ok_or("forker printed no check phase")?;
    if !done("forker", stdout) {
        return Err("forker did not finish (no `forker done`)".into());
    }
    Ok(Forker {
        write,
        forks: field(f, "fork", "forks")?,
        usecs: field(f, "fork", "usecs")?,
        max_usecs: field(f, "fork", "max_usecs")?,
        mismatches: field(c, "check", "mismatches")?,
    })
}

/// The `build` workload's source tree: `files` generated C files and a Makefile
/// that compiles each with `$(CC) -O2 -c` (no link), in a temporary directory
/// removed on drop. `make -B -j2 -C dir` rebuilds all of it every time.
pub struct BuildTree {
    pub dir: tempfile::TempDir,
    pub files: usize,
}

/// Functions per generated file and statements per function: one long function,
/// which is what makes cc1 big; at `cc -O2` (gcc 12) a file takes about 2 s of one
/// CPU and cc1 peaks at about 110 MiB resident (1000 statements: 1.8 s, 90 MiB;
/// 1500: 2.8 s, 130 MiB).
pub const BUILD_FUNCS: usize = 1;
pub const BUILD_STMTS: usize = 1200;

impl BuildTree {
    pub fn generate(files: usize) -> Result<BuildTree, String> {
        let dir = tempfile::Builder::new()
            .prefix("uzswap-bench-build-")
            .tempdir()
            .map_err(|e| format!("temporary directory: {e}"))?;
        for i in 0..files {
            let path = dir.path().join(format!("unit{i}.c"));
            std::fs::write(&path, build_source(i as u64, BUILD_FUNCS, BUILD_STMTS))
                .map_err(|e| format!("write {}: {e}", path.display()))?;
        }
        let path = dir.path().join("Makefile");
        std::fs::write(&path, makefile(files)).map_err(|e| format!("write {}: {e}", path.display()))?;
        Ok(BuildTree { dir, files })
    }

    /// make's arguments: a parallel build of everything, whatever is there.
    pub fn make_args(&self, jobs: usize) -> Vec<String> {
        vec!["-s".into(), "-B".into(), format!("-j{jobs}"), "-C".into(), self.dir.path().display().to_string()]
    }
}

/// The Makefile of a generated tree of `files` units.
pub fn makefile(files: usize) -> String {
    let objs: Vec<String> = (0..files).map(|i| format!("unit{i}.o")).collect();
    format!(
        "CC ?= cc\nOBJS = {}\n\nall: $(OBJS)\n\n%.o: %.c\n\t$(CC) -O2 -c -o $@ $<\n\n.PHONY: all\n",
        objs.join(" ")
    )
}

/// One generated C file: `funcs` functions of a loop over `stmts` mixing
/// statements with branches, the same text for the same `seed`.
pub fn build_source(seed: u64, funcs: usize, stmts: usize) -> String {
    use std::fmt::Write;
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |n: u64| -> u64 {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    };
    let vars = ["a", "b", "c", "d"];
    let mut s = String::from("#include <stdint.h>\n#include <string.h>\n");
    s.push_str(
        "static inline uint64_t mix(uint64_t a, uint64_t b) { a ^= b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2); \
         return a * 0xff51afd7ed558ccdULL; }\n",
    );
    for f in 0..funcs {
        let _ = writeln!(s, "uint64_t unit{seed}_f{f}(uint64_t *v, int n) {{");
        s.push_str("  uint64_t a = n, b = 1, c = 2, d = 3; uint64_t t[64]; memset(t, 0, sizeof t);\n");
        s.push_str("  for (int i = 0; i < n; i++) {\n");
        for st in 0..stmts {
            let x = vars[next(4) as usize];
            let y = vars[next(4) as usize];
            let k = next(64);
            let op = match next(3) {
                0 => format!("mix({y}, v[i] + {k})"),
                1 => format!("{y} * {} + t[{k}]", 3 + next(96)),
                _ => format!("({y} >> {}) ^ t[{}]", 1 + next(59), (k + 7) % 64),
            };
            let _ = writeln!(s, "    {x} += {op}; t[{k}] ^= {x};");
            if st % 10 == 0 {
                let _ = writeln!(
                    s,
                    "    if ({x} & {}) {{ switch ({y} & 7) {{ case 0: {x}++; break; case 1: {x} ^= {k}; break; \
                     case 3: {x} = mix({x}, {k}); break; default: {x} -= {y}; }} }}",
                    1u64 << next(20)
                );
            }
        }
        s.push_str("  }\n  return a ^ b ^ c ^ d ^ t[3];\n}\n");
    }
    s
}

/// `name`'s path on PATH, if it is there.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}
