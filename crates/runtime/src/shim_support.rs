//! What the preload shim (crates/shim) and `uzswap run` need from the runtime beyond
//! regions: the settings shared by the command line, the environment and a config file;
//! the exit summary; and fork support.
//!
//! # Settings
//! One [`Settings`] value is filled, lowest priority first, from a config file of
//! `key = value` lines, then `UZSWAP_<KEY>` environment variables, then (in the CLI)
//! command-line options. `uzswap run` validates it and hands it to the shim as
//! environment variables ([`Settings::to_env`]), which the shim parses again: so an
//! exec'd program, which keeps the environment, starts a fresh runtime with the same
//! settings.
//!
//! # Fork
//! Regions are MADV_DONTFORK, so a child would not see them at all. Before fork the shim
//! calls [`Runtime::hold_for_fork`]: every folio of every region is locked (the reclaimer
//! skips locked folios, faults wait), its data brought back into place (from the store
//! or the shadow), and the regions marked MADV_DOFORK. The child gets a plain copy of
//! the memory (its mappings lose the userfaultfd registration, as the kernel drops it
//! without EVENT_FORK); the parent calls [`ForkHold::resume`], which marks the regions
//! DONTFORK again and unlocks the folios. The child must never use the parent's runtime
//! (its threads do not exist there): it forgets the hold.

use crate::fault::{bring_back, Why};
use crate::region::*;
use crate::{Algorithm, FaultPath, Granularity, ReclaimPolicy, Runtime, RuntimeConfig, MAX_FOLIO, MIN_FOLIO};
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;

/// Settings for one runtime run by the shim. See the module comment for where they come from.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub budget: Option<u64>,
    pub folio_size: usize,
    pub granularity: Granularity,
    pub compressor: Algorithm,
    pub level: i32,
    pub writeback_dir: Option<PathBuf>,
    /// Most bytes the backing file may hold.
    pub writeback_max: u64,
    /// The pool's limit as a share of the budget (zswap's max_pool_percent); None = only the budget.
    pub max_pool_percent: Option<u8>,
    pub fault_path: FaultPath,
    /// What the reclaimer evicts first (see uzswap-runtime's reclaim module).
    pub policy: ReclaimPolicy,
    /// Where the exit summary goes: "none", "stderr", or a file (one JSON object per line
    /// and process is appended).
    pub stats: String,
    /// Mappings and allocations of at least this many bytes are managed.
    pub threshold: usize,
}

/// The keys, in the order `to_env` writes them; a config file and the environment use
/// these names (the environment upper-cased with `UZSWAP_` in front; `-` and `_` are the same).
pub const KEYS: &[&str] = &[
    "budget",
    "folio_size",
    "granularity",
    "compressor",
    "level",
    "writeback_dir",
    "writeback_max",
    "max_pool_percent",
    "fault_path",
    "policy",
    "stats",
    "threshold",
];

impl Default for Settings {
    fn default() -> Self {
        Settings {
            budget: None,
            folio_size: 64 << 10,
            granularity: Granularity::Folio,
            compressor: Algorithm::Lz4,
            level: 0,
            writeback_dir: None,
            writeback_max: 16 << 30,
            max_pool_percent: None,
            fault_path: FaultPath::Thread,
            policy: ReclaimPolicy::Probation,
            stats: "stderr".into(),
            threshold: 1 << 20,
        }
    }
}

/// "1G", "512MiB", "64k", "4096": bytes (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 1G, 512M, 64k, 4096)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{s:?} is not a size (e.g. 1G, 512M, 64k, 4096)")),
    };
    n.checked_mul(1 << shift).ok_or_else(|| format!("{s:?} is too large"))
}

/// Bytes in the largest binary unit that keeps them above 1: "1.5 GiB".
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn canonical_key(key: &str) -> String {
    key.trim().to_ascii_lowercase().replace('-', "_")
}

impl Settings {
    /// Sets one key from its text form; the error names the key and the value.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let key = canonical_key(key);
        let v = value.trim();
        let bad = |why: String| format!("{key} = {v:?}: {why}");
        match key.as_str() {
            "budget" => {
                let b = parse_size(v).map_err(bad)?;
                if b == 0 {
                    return Err(bad("the budget must be more than zero".into()));
                }
                self.budget = Some(b);
            }
            "folio_size" => {
                let f = parse_size(v).map_err(bad)? as usize;
                if !f.is_power_of_two() || !(MIN_FOLIO..=MAX_FOLIO).contains(&f) {
                    return Err(bad("a folio size is a power of two from 4k to 2M".into()));
                }
                self.folio_size = f;
            }
            "granularity" => self.granularity = v.parse::<Granularity>().map_err(|e| bad(e.to_string()))?,
            "compressor" => self.compressor = v.parse::<Algorithm>().map_err(|e| bad(e.to_string()))?,
            "level" => self.level = v.parse().map_err(|_| bad("not an integer".into()))?,
            "writeback_dir" => self.writeback_dir = (!v.is_empty() && v != "none").then(|| PathBuf::from(v)),
            "writeback_max" => self.writeback_max = parse_size(v).map_err(bad)?,
            "max_pool_percent" => {
                if v == "none" {
                    self.max_pool_percent = None;
                } else {
                    match v.parse::<u8>() {
                        Ok(p) if (1..=100).contains(&p) => self.max_pool_percent = Some(p),
                        _ => return Err(bad("a percentage from 1 to 100, or none".into())),
                    }
                }
            }
            "fault_path" => {
                self.fault_path = match v.to_ascii_lowercase().as_str() {
                    "thread" => FaultPath::Thread,
                    "sigbus" => FaultPath::Sigbus,
                    _ => return Err(bad("expected thread or sigbus".into())),
                }
            }
            "policy" => {
                self.policy = match v.to_ascii_lowercase().as_str() {
                    "probation" => ReclaimPolicy::Probation,
                    "fifo" => ReclaimPolicy::Fifo,
                    _ => return Err(bad("expected probation or fifo".into())),
                }
            }
            "stats" => {
                if v.is_empty() {
                    return Err(bad("expected none, stderr or a file name".into()));
                }
                self.stats = v.into();
            }
            "threshold" => {
                let t = parse_size(v).map_err(bad)?;
                if t < MIN_FOLIO as u64 {
                    return Err(bad("the threshold must be at least 4k".into()));
                }
                self.threshold = t as usize;
            }
            _ => return Err(format!("unknown setting {key:?} (known: {})", KEYS.join(", "))),
        }
        Ok(())
    }

    /// Applies a config file's `key = value` lines (`#` starts a comment).
    pub fn apply_config(&mut self, text: &str, origin: &str) -> Result<(), String> {
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (k, v) =
                line.split_once('=').ok_or_else(|| format!("{origin}:{}: expected `key = value`, got {line:?}", n + 1))?;
            self.set(k, v).map_err(|e| format!("{origin}:{}: {e}", n + 1))?;
        }
        Ok(())
    }

    /// Applies a config file.
    pub fn apply_config_file(&mut self, path: &std::path::Path) -> Result<(), String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("config file {}: {e}", path.display()))?;
        self.apply_config(&text, &path.display().to_string())
    }

    /// Applies the `UZSWAP_<KEY>` environment variables.
    pub fn apply_env_vars(&mut self) -> Result<(), String> {
        for key in KEYS {
            let var = format!("UZSWAP_{}", key.to_ascii_uppercase());
            if let Some(v) = std::env::var_os(&var) {
                let v = v.into_string().map_err(|_| format!("{var} is not valid UTF-8"))?;
                self.set(key, &v).map_err(|e| format!("{var}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Applies the config file named by `UZSWAP_CONFIG` (if any), then `UZSWAP_<KEY>` variables.
    pub fn apply_env(&mut self) -> Result<(), String> {
        if let Some(path) = std::env::var_os("UZSWAP_CONFIG") {
            self.apply_config_file(std::path::Path::new(&path))?;
        }
        self.apply_env_vars()
    }

    /// Checks what single keys cannot: a budget is given and holds at least one folio,
    /// and the codec accepts the compressor, level and granularity together.
    pub fn validate(&self) -> Result<(), String> {
        let Some(budget) = self.budget else { return Err("no budget given (e.g. --budget 1G)".into()) };
        if budget < self.folio_size as u64 {
            return Err(format!(
                "budget of {} is smaller than one folio of {}",
                format_bytes(budget),
                format_bytes(self.folio_size as u64)
            ));
        }
        self.runtime_config().store.codec.validate().map_err(|e| e.to_string())?;
        if let Some(dir) = &self.writeback_dir {
            if !dir.is_dir() {
                return Err(format!("writeback_dir {}: not a directory", dir.display()));
            }
        }
        Ok(())
    }

    /// The settings as `UZSWAP_<KEY>` variables, every key given explicitly.
    pub fn to_env(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for key in KEYS {
            let v = match *key {
                "budget" => match self.budget {
                    Some(b) => b.to_string(),
                    None => continue,
                },
                "folio_size" => self.folio_size.to_string(),
                "granularity" => match self.granularity {
                    Granularity::Folio => "folio".into(),
                    Granularity::Bytes(b) => b.to_string(),
                },
                "compressor" => format!("{:?}", self.compressor).to_ascii_lowercase(),
                "level" => self.level.to_string(),
                "writeback_dir" => match &self.writeback_dir {
                    Some(d) => d.display().to_string(),
                    None => "none".into(),
                },
                "writeback_max" => self.writeback_max.to_string(),
                "max_pool_percent" => match self.max_pool_percent {
                    Some(p) => p.to_string(),
                    None => "none".into(),
                },
                "fault_path" => format!("{:?}", self.fault_path).to_ascii_lowercase(),
                "policy" => format!("{:?}", self.policy).to_ascii_lowercase(),
                "stats" => self.stats.clone(),
                "threshold" => self.threshold.to_string(),
                _ => unreachable!("every key is listed"),
            };
            out.push((format!("UZSWAP_{}", key.to_ascii_uppercase()), v));
        }
        out
    }

    /// The runtime configuration, backing file included ([`Runtime::new`] opens it).
    pub fn runtime_config(&self) -> RuntimeConfig {
        let budget = self.budget.unwrap_or(0);
        let mut cfg = RuntimeConfig::new(budget);
        cfg.fault_path = self.fault_path;
        cfg.policy = self.policy;
        cfg.store.codec.algorithm = self.compressor;
        cfg.store.codec.level = self.level;
        cfg.store.codec.granularity = self.granularity;
        cfg.writeback_dir = self.writeback_dir.clone();
        cfg.backing_max_bytes = self.writeback_max;
        match (self.max_pool_percent, &self.writeback_dir) {
            (Some(p), Some(_)) => cfg.max_pool_percent = p,
            // Without a backing file, a pool limit means stores are refused past it
            // (the folios stay resident, over the budget, and are counted).
            (Some(p), None) => cfg.store.max_pool_bytes = Some(budget / 100 * p as u64),
            (None, _) => {}
        }
        cfg
    }
}

// ---- The summary. ----

fn field(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_u64().unwrap_or(0)
}

/// The folio size named by a "hugepages-<N>kB" key.
fn folio_bytes_of(name: &str) -> u64 {
    name.trim_start_matches("hugepages-").trim_end_matches("kB").parse::<u64>().map_or(0, |kb| kb * 1024)
}

/// The kernel-style summary of a stats object (as published by the runtime, see
/// `stats.rs`): totals in 4 KiB pages as vmstat counts them, then one line per folio size.
pub fn format_summary(v: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let pool = field(v, &["pool_total_size"]);
    let stored = field(v, &["store", "stored_pages"]) * 4096;
    // Swap-ins are the runtime's, per folio size: a clean folio read back keeps its
    // store entry, so the store's own zswpin counts only entries freed by a load.
    let swapped_in: u64 = v["sizes"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, c)| field(c, &["zswpin"]) * folio_bytes_of(name))
        .sum();
    let ratio = if pool == 0 { 1.0 } else { stored as f64 / pool as f64 };
    let _ = writeln!(
        s,
        "uzswap: pid {} budget {} ({} fault path): swapped out {}, swapped in {}; now resident {}, pool {} holding {} (ratio {:.2}, {} saved)",
        field(v, &["pid"]),
        format_bytes(field(v, &["budget_bytes"])),
        v["fault_path"].as_str().unwrap_or("?"),
        format_bytes(field(v, &["store", "zswpout"]) * 4096),
        format_bytes(swapped_in),
        format_bytes(field(v, &["resident_bytes"])),
        format_bytes(pool),
        format_bytes(stored),
        ratio,
        format_bytes(stored.saturating_sub(pool)),
    );
    let _ = writeln!(
        s,
        "  zswpout {} zswpin {} zswpwb {} pswpout {} pswpin {} stored_pages {} stored_incompressible_pages {} same_filled_pages {} written_back_pages {} reject_compress_fail {} reject_reclaim_fail {}",
        field(v, &["store", "zswpout"]),
        field(v, &["store", "zswpin"]),
        field(v, &["store", "zswpwb"]),
        field(v, &["store", "pswpout"]),
        field(v, &["store", "pswpin"]),
        field(v, &["store", "stored_pages"]),
        field(v, &["store", "stored_incompressible_pages"]),
        field(v, &["store", "same_filled_pages"]),
        field(v, &["store", "written_back_pages"]),
        field(v, &["store", "reject_compress_fail"]),
        field(v, &["store", "reject_reclaim_fail"]),
    );
    if let Some(peak) = v["managed_peak_bytes"].as_u64() {
        let _ = writeln!(s, "  managed memory: peak {} under the budget of {}", format_bytes(peak), format_bytes(field(v, &["budget_bytes"])));
    }
    if let Some(sizes) = v["sizes"].as_object() {
        for (name, c) in sizes {
            let _ = writeln!(
                s,
                "  {name}: zswpout {} zswpin {} stored {} faults {} zero_fill {} probation_out {} probation_refault {} invalidated {}",
                field(c, &["zswpout"]),
                field(c, &["zswpin"]),
                field(c, &["stored_folios"]),
                field(c, &["faults"]),
                field(c, &["zero_fill"]),
                field(c, &["probation_out"]),
                field(c, &["probation_refault"]),
                field(c, &["invalidated"]),
            );
        }
    }
    s
}

impl Runtime {
    /// The live stats as a JSON value (what the stats file holds).
    pub fn stats_json(&self) -> serde_json::Value {
        serde_json::to_value(self.stats()).unwrap_or(serde_json::Value::Null)
    }
}

// ---- Fork. ----

/// Every folio of every region of a runtime locked and in place, regions MADV_DOFORK.
pub struct ForkHold {
    runtime: Runtime,
    /// Per region, its folios' states to unlock with.
    held: Vec<(Arc<RegionInner>, Vec<u8>)>,
}

impl Runtime {
    /// Prepares the regions for fork(2) (see the module comment). Takes as long as
    /// bringing every swapped-out folio back: the child gets all of the memory.
    pub fn hold_for_fork(&self) -> ForkHold {
        let sh = &self.inner.shared;
        let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
        let mut buf = vec![0u8; MAX_FOLIO];
        let mut held = Vec::with_capacity(regions.len());
        for r in regions {
            let mut states = Vec::with_capacity(r.folios());
            for idx in 0..r.folios() {
                let prev = r.lock(idx);
                let now = match prev {
                    SWAPPED | PROBATION => {
                        let res = (prev == SWAPPED).then(|| r.book().reserve(prev));
                        // Waits as a SIGBUS handler does (we are not the reader); an
                        // unreadable folio is poisoned, as a fault would find it.
                        match bring_back(&r, idx, prev, &mut buf, Why::Fork, true, res) {
                            Some(now) => now,
                            // The range went away under us: the UNMAP event frees it.
                            None => r.lock(idx),
                        }
                    }
                    s => s,
                };
                states.push(now);
            }
            // SAFETY: madvise on the region's own mapping.
            unsafe { libc::madvise(r.base.load(Acquire) as *mut _, r.len, libc::MADV_DOFORK) };
            held.push((r, states));
        }
        ForkHold { runtime: self.clone(), held }
    }
}

impl ForkHold {
    /// In the parent after fork: regions DONTFORK again, folios unlocked, reclaim kicked.
    pub fn resume(self) {
        let sh = &self.runtime.inner.shared;
        for (r, states) in &self.held {
            // SAFETY: as in hold_for_fork.
            unsafe { libc::madvise(r.base.load(Acquire) as *mut _, r.len, libc::MADV_DONTFORK) };
            for (idx, &s) in states.iter().enumerate() {
                if s == RESIDENT {
                    r.unlock_faulted_in(idx, s);
                } else {
                    r.unlock(idx, s);
                }
            }
        }
        sh.kick_reclaimer();
    }

    /// In the child: the memory is plain now and the parent's runtime is not ours to
    /// touch (its threads are not here), so nothing is released.
    pub fn forget_in_child(self) {
        std::mem::forget(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_bad_ones_say_why() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size(" 64k "), Ok(64 << 10));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1.5G").unwrap_err().contains("not a size"));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("99999999999T").unwrap_err().contains("too large"));
    }

    #[test]
    fn settings_round_trip_through_the_environment_form() {
        let mut s = Settings::default();
        for (k, v) in [
            ("budget", "256M"),
            ("folio-size", "2M"),
            ("granularity", "16k"),
            ("compressor", "zstd"),
            ("level", "3"),
            ("max_pool_percent", "40"),
            ("fault_path", "sigbus"),
            ("policy", "fifo"),
            ("stats", "/tmp/x.jsonl"),
            ("threshold", "8M"),
            ("writeback_max", "1G"),
        ] {
            s.set(k, v).unwrap();
        }
        let mut back = Settings::default();
        for (k, v) in s.to_env() {
            back.set(k.trim_start_matches("UZSWAP_"), &v).unwrap();
        }
        assert_eq!(back, s);
        assert_eq!(s.runtime_config().store.max_pool_bytes, Some((256u64 << 20) / 100 * 40));
    }

    #[test]
    fn bad_settings_get_one_clear_line() {
        let mut s = Settings::default();
        assert!(s.set("budget", "lots").unwrap_err().starts_with("budget"));
        assert!(s.set("folio_size", "48k").unwrap_err().contains("power of two"));
        assert!(s.set("fault_path", "magic").unwrap_err().contains("thread or sigbus"));
        assert!(s.set("policy", "lru").unwrap_err().contains("probation or fifo"));
        assert!(s.set("compressor", "brotli").is_err());
        assert!(s.set("max_pool_percent", "0").is_err());
        assert!(s.set("colour", "red").unwrap_err().contains("unknown setting"));
        assert!(Settings::default().validate().unwrap_err().contains("no budget"));
        s.set("budget", "32k").unwrap();
        s.set("folio_size", "64k").unwrap();
        assert!(s.validate().unwrap_err().contains("smaller than one folio"));
        let err = s.apply_config("# comment\nbudget = 1G\nfolio_size 2M\n", "cfg").unwrap_err();
        assert!(err.starts_with("cfg:3:"), "{err}");
        s.apply_config("budget = 1G # one gig\n\nthreshold=2M", "cfg").unwrap();
        assert_eq!((s.budget, s.threshold), (Some(1 << 30), 2 << 20));
        s.validate().unwrap();
    }
}
