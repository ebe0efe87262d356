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
/// The helpers both programs include.
pub const COMMON_H: &str = include_str!("../../workloads/common.h");

/// The compiled programs, in a temporary directory removed on drop.
pub struct Programs {
    _dir: tempfile::TempDir,
    pub usemem: PathBuf,
    pub masim: PathBuf,
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
        Ok(Programs { _dir: dir, usemem, masim })
    }
}

fn compile(dir: &Path, name: &str, source: &str) -> Result<PathBuf, String> {
    let src = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&src, source).map_err(|e| format!("write {}: {e}", src.display()))?;
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let out = Command::new(&cc)
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run the C compiler {cc:?} (needed to build the workload programs): {e}"))?;
    if !out.status.success() {
        return Err(format!("cc -O2 {name}.c failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
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
