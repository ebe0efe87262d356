//! The settings of a runtime run by the shim, defined once: the `settings!` table
//! below gives each one its name, type, default, help text, and how it is read from
//! and written as text. Everything else is derived from that table: the [`Settings`]
//! struct and its `Default`, the config-file key (the name), the environment variable
//! (`UZSWAP_` and the name upper-cased), `uzswap run`'s option (`--` and the name with
//! `-` for `_`, built from [`SETTINGS`] by the CLI), and the text the shim parses back.
//! Adding a setting is one entry in the table.
//!
//! One [`Settings`] value is filled, lowest priority first, from a config file of
//! `key = value` lines, then `UZSWAP_<KEY>` environment variables, then (in the CLI)
//! command-line options. `uzswap run` validates it and hands it to the shim as
//! environment variables ([`Settings::to_env`]), which the shim parses again: so an
//! exec'd program, which keeps the environment, starts a fresh runtime with the same
//! settings.

use crate::{Algorithm, FaultPath, Granularity, ReclaimPolicy, RuntimeConfig, MAX_FOLIO, MIN_FOLIO};
use std::path::PathBuf;

/// One setting as the table defines it.
#[derive(Clone, Copy, Debug)]
pub struct SettingDef {
    /// The config-file key, `snake_case`.
    pub name: &'static str,
    /// One line for `--help` and the struct field's doc.
    pub help: &'static str,
    /// A valid value other than the default (for the help text and the tests).
    pub example: &'static str,
}

impl SettingDef {
    /// `UZSWAP_FOLIO_SIZE` for `folio_size`.
    pub fn env_var(&self) -> String {
        format!("UZSWAP_{}", self.name.to_ascii_uppercase())
    }

    /// `folio-size` for `folio_size`: the long option, without the dashes.
    pub fn option(&self) -> String {
        self.name.replace('_', "-")
    }

    /// The default as text, or None where there is none (the budget).
    pub fn default_text(&self) -> Option<String> {
        Settings::default().get(self.name)
    }
}

/// Defines [`Settings`], its `Default`, [`SETTINGS`], and the by-name `set` and `get`.
/// Each entry: `name: Type = default, "help", e.g. "example", parse, show;` where
/// `parse: fn(&str) -> Result<Type, String>` (the error says why, without the key) and
/// `show: fn(&Type) -> Option<String>` gives text `parse` reads back (None: unset).
macro_rules! settings {
    ($($name:ident: $ty:ty = $default:expr, $help:literal, e.g. $example:literal, $parse:expr, $show:expr;)*) => {
        /// Settings for one runtime run by the shim. See the module comment.
        #[derive(Clone, Debug, PartialEq)]
        pub struct Settings {
            $(#[doc = $help] pub $name: $ty,)*
        }

        impl Default for Settings {
            fn default() -> Self {
                Settings { $($name: $default,)* }
            }
        }

        /// Every setting, in the order [`Settings::to_env`] writes them.
        pub const SETTINGS: &[SettingDef] = &[$(SettingDef { name: stringify!($name), help: $help, example: $example },)*];

        impl Settings {
            /// Sets one key (`-` and `_` are the same, case is ignored) from its text
            /// form; the error names the key and the value.
            pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
                let key = key.trim().to_ascii_lowercase().replace('-', "_");
                let v = value.trim();
                let bad = |why: String| format!("{key} = {v:?}: {why}");
                match key.as_str() {
                    $(stringify!($name) => {
                        let parse: fn(&str) -> Result<$ty, String> = $parse;
                        self.$name = parse(v).map_err(bad)?;
                    })*
                    _ => {
                        let known: Vec<&str> = SETTINGS.iter().map(|d| d.name).collect();
                        return Err(format!("unknown setting {key:?} (known: {})", known.join(", ")));
                    }
                }
                Ok(())
            }

            /// One key's value as text that [`Settings::set`] reads back; None if it
            /// is unset or not a key.
            pub fn get(&self, key: &str) -> Option<String> {
                match key {
                    $(stringify!($name) => {
                        let show: fn(&$ty) -> Option<String> = $show;
                        show(&self.$name)
                    })*
                    _ => None,
                }
            }
        }
    };
}

settings! {
    budget: Option<u64> = None,
        "Memory budget: managed resident memory plus the compressed pool.", e.g. "1G",
        |v| match parse_size(v)? { 0 => Err("the budget must be more than zero".to_string()), b => Ok(Some(b)) },
        |b: &Option<u64>| b.map(format_size);
    folio_size: usize = 64 << 10,
        "uzswap's unit of compression and fault: a power of two from 4k to 2M.", e.g. "2M",
        |v| {
            let f = parse_size(v)? as usize;
            if f.is_power_of_two() && (MIN_FOLIO..=MAX_FOLIO).contains(&f) { Ok(f) } else { Err("a folio size is a power of two from 4k to 2M".to_string()) }
        },
        |f: &usize| Some(format_size(*f as u64));
    granularity: Option<Granularity> = Some(Granularity::Folio),
        "Compression unit within a folio, the least a swap-in decodes: folio (one unit: the best ratio and speed), 4k, 16k, 64k or 256k, or auto (4k units, whole folios in regions read back sequentially: for memory read at random, a page at a time).", e.g. "auto",
        |v: &str| match v {
            "auto" => Ok(None),
            v => v.parse::<Granularity>().map(Some).map_err(|e| e.to_string()),
        },
        |g: &Option<Granularity>| Some(g.map_or("auto".into(), |g| g.to_string()));
    compressor: Algorithm = Algorithm::Lz4,
        "lz4, zstd or deflate.", e.g. "zstd",
        |v: &str| v.parse::<Algorithm>().map_err(|e| e.to_string()),
        |a: &Algorithm| Some(a.to_string());
    level: i32 = 0,
        "Compressor level (lz4: acceleration; zstd: level, negative too; deflate: 1-12).", e.g. "-3",
        |v: &str| v.parse::<i32>().map_err(|_| "not an integer".to_string()),
        |l: &i32| Some(l.to_string());
    writeback_dir: Writeback = Writeback::Auto,
        "Where the coldest compressed folios go when the pool is full: a private file in this directory; auto (the first of $XDG_RUNTIME_DIR, /var/tmp and /tmp on a disk, not in RAM); or none (no file: memory that does not compress then stays in the pool, over the budget, with a warning).", e.g. "/tmp",
        |v: &str| Ok(match v {
            "auto" => Writeback::Auto,
            "" | "none" | "off" => Writeback::Off,
            d => Writeback::Dir(PathBuf::from(d)),
        }),
        |w: &Writeback| Some(match w {
            Writeback::Auto => "auto".into(),
            Writeback::Off => "none".into(),
            Writeback::Dir(d) => d.display().to_string(),
        });
    writeback: Option<uzswap_remote::Target> = None,
        "Where written-back folios go: file (the private file, see writeback_dir), or a Redis/Valkey store: redis://[user:pass@]host:port, several host:port for a cluster, rediss:// for TLS; sealed, with the file (unless writeback_dir is none) taking what the store refuses.", e.g. "redis://127.0.0.1:6379",
        |v: &str| match v {
            "file" | "" => Ok(None),
            url => uzswap_remote::Target::parse(url).map(Some),
        },
        |t: &Option<uzswap_remote::Target>| Some(t.as_ref().map_or("file".into(), |t| t.text.clone()));
    writeback_replicas: u32 = 0,
        "With a remote writeback store: replicas that must have each batch (Redis WAIT) before it leaves memory.", e.g. "1",
        |v: &str| v.parse::<u32>().map_err(|_| "a number of replicas, e.g. 1".to_string()),
        |n: &u32| Some(n.to_string());
    writeback_ca: Option<PathBuf> = None,
        "With a rediss:// writeback store: the PEM file of the CA its certificate must chain to (default: the system's roots).", e.g. "/etc/ssl/redis-ca.pem",
        |v: &str| Ok(match v { "" | "system" => None, f => Some(PathBuf::from(f)) }),
        |c: &Option<PathBuf>| Some(c.as_ref().map_or("system".into(), |c| c.display().to_string()));
    writeback_max: u64 = 16 << 30,
        "Most bytes the writeback file may hold (and never more than half the free space of its file system, as it was at start).", e.g. "1G",
        parse_size,
        |m: &u64| Some(format_size(*m));
    max_pool_percent: Option<u8> = None,
        "The pool's limit as a percentage of the budget (zswap's max_pool_percent), or none: 50 with a backing file, else only the budget.", e.g. "40",
        |v: &str| match v {
            "none" => Ok(None),
            _ => v.parse::<u8>().ok().filter(|p| (1..=100).contains(p)).map(Some).ok_or_else(|| "a percentage from 1 to 100, or none".to_string()),
        },
        |p: &Option<u8>| Some(p.map_or("none".into(), |p| p.to_string()));
    fault_path: FaultPath = FaultPath::Thread,
        "thread (system calls on swapped-out memory just work) or sigbus (faster faults).", e.g. "sigbus",
        |v| one_of(FAULT_PATHS, v),
        |p| name_of(FAULT_PATHS, p);
    policy: ReclaimPolicy = ReclaimPolicy::Probation,
        "probation (a cold folio waits, uncompressed, out of view, before it is compressed; good with a hot set) or fifo (straight out: better for uniform access).", e.g. "fifo",
        |v| one_of(POLICIES, v),
        |p| name_of(POLICIES, p);
    stats: String = "stderr".into(),
        "Where the exit summary goes: stderr, none, or a file (one JSON object per line and process is appended).", e.g. "/tmp/uzswap-stats.jsonl",
        |v: &str| if v.is_empty() { Err("expected none, stderr or a file name".to_string()) } else { Ok(v.to_string()) },
        |s: &String| Some(s.clone());
    threshold: usize = 1 << 20,
        "Manage mappings and allocations of at least this size.", e.g. "8M",
        |v| match parse_size(v)? {
            t if t < MIN_FOLIO as u64 => Err("the threshold must be at least 4k".to_string()),
            t => Ok(t as usize),
        },
        |t: &usize| Some(format_size(*t as u64));
    adopt: bool = true,
        "Also manage the program's memory that does not come through malloc or mmap requests (heaps, arenas, allocators' and runtimes' own mappings), found where it is; needs the thread fault path and a userfaultfd that serves system calls (not UFFD_USER_MODE_ONLY).", e.g. "no",
        parse_bool,
        |a: &bool| Some(if *a { "yes" } else { "no" }.to_string());
    partial_swapin: bool = true,
        "On a read at random in a swapped-out folio, bring in only the compression unit around it, the only part decoded (so only with a granularity below the folio size, e.g. 4k); a sequential pass still brings whole folios.", e.g. "no",
        parse_bool,
        |a: &bool| Some(if *a { "yes" } else { "no" }.to_string());
    fork_carry: bool = true,
        "At fork, the child takes over the program's swapped-out folios still compressed (borrowing their records; what was resident stays shared with the parent, copy-on-write, until either writes it) instead of the parent bringing every folio back first, which holds all of it at once, over the budget. Turn it off for fast forks at the price of the budget, e.g. for a server whose forked child reads all its data at random under a tight budget (redis' BGSAVE: seconds instead of minutes, the tree at twice the budget).", e.g. "no",
        parse_bool,
        |a: &bool| Some(if *a { "yes" } else { "no" }.to_string());
    budget_per_process: bool = false,
        "Give every process of the tree a budget of its own (as before groups), instead of one budget that the whole tree shares, as a memory cgroup does.", e.g. "yes",
        parse_bool,
        |a: &bool| Some(if *a { "yes" } else { "no" }.to_string());
}

/// Where the backing file goes (the `writeback_dir` setting).
#[derive(Clone, Debug, PartialEq)]
pub enum Writeback {
    /// A directory on a disk found at start ([`auto_writeback_dir`]).
    Auto,
    /// No backing file.
    Off,
    Dir(PathBuf),
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "yes" | "true" | "on" | "1" => Ok(true),
        "no" | "false" | "off" | "0" => Ok(false),
        _ => Err("expected yes or no".to_string()),
    }
}

/// The directory the default backing file goes in: the first of $XDG_RUNTIME_DIR,
/// /var/tmp and /tmp that is a writable directory on a file system kept on a disk,
/// with at least 64 MiB free. Not tmpfs or ramfs: a file there lives in RAM (as
/// shared memory, outside the budget), which is what writeback is for avoiding; and
/// $XDG_RUNTIME_DIR is tmpfs on most systems, so /var/tmp usually wins. None if no
/// candidate fits.
pub fn auto_writeback_dir() -> Option<PathBuf> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let candidates = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).into_iter().chain(["/var/tmp".into(), "/tmp".into()]);
    candidates.into_iter().find(|d| {
        let Ok(c) = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()) else { return false };
        // SAFETY: statfs writes the zeroed struct we own (plain integers); both calls
        // read the C string.
        let (ok, st) = unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            (libc::statfs(c.as_ptr(), &mut st) == 0 && libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0, st)
        };
        if !ok {
            return false;
        }
        #[allow(clippy::unnecessary_cast)] // i64 on x86-64, narrower elsewhere
        let in_ram = matches!(st.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC);
        !in_ram && d.is_dir() && free_bytes(d).unwrap_or(0) >= 64 << 20
    })
}

/// Bytes an unprivileged user may still write on `dir`'s file system.
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs writes the zeroed struct we own (plain integers); it reads the C string.
    let (ok, st) = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut st) == 0, st)
    };
    ok.then(|| st.f_bavail * st.f_frsize)
}

/// The pool's share of the budget with a backing file when `max_pool_percent` is unset.
const DEFAULT_POOL_PERCENT: u8 = 50;

const FAULT_PATHS: &[(&str, FaultPath)] = &[("thread", FaultPath::Thread), ("sigbus", FaultPath::Sigbus)];
const POLICIES: &[(&str, ReclaimPolicy)] = &[("probation", ReclaimPolicy::Probation), ("fifo", ReclaimPolicy::Fifo)];

/// The value named `v` (case ignored) among `choices`; the error lists the names.
fn one_of<T: Copy>(choices: &[(&str, T)], v: &str) -> Result<T, String> {
    let v = v.to_ascii_lowercase();
    choices.iter().find(|(name, _)| *name == v).map(|&(_, x)| x).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
        format!("expected {}", names.join(" or "))
    })
}

/// The name of `x` among `choices`.
fn name_of<T: PartialEq>(choices: &[(&str, T)], x: &T) -> Option<String> {
    choices.iter().find(|(_, y)| y == x).map(|(name, _)| name.to_string())
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

/// Bytes exactly, in the largest unit that divides them ("64K", "16G", "4097"), as
/// [`parse_size`] reads them.
pub fn format_size(n: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n != 0 && n.is_multiple_of(1 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
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

impl Settings {
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
        self.apply_vars(|var| std::env::var_os(var))
    }

    /// Applies `UZSWAP_<KEY>` variables as `lookup` finds them (the environment, or a test's).
    pub fn apply_vars(&mut self, lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<(), String> {
        for def in SETTINGS {
            let var = def.env_var();
            if let Some(v) = lookup(&var) {
                let v = v.into_string().map_err(|_| format!("{var} is not valid UTF-8"))?;
                self.set(def.name, &v).map_err(|e| format!("{var}: {e}"))?;
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
        if self.writeback.is_none() && (self.writeback_replicas > 0 || self.writeback_ca.is_some()) {
            return Err("writeback_replicas and writeback_ca are for a remote store: give writeback = redis://...".into());
        }
        if let Some(ca) = &self.writeback_ca {
            std::fs::File::open(ca).map_err(|e| format!("writeback_ca {}: {e}", ca.display()))?;
        }
        if let Writeback::Dir(dir) = &self.writeback_dir {
            if !dir.is_dir() {
                return Err(format!("writeback_dir {}: not a directory", dir.display()));
            }
        }
        Ok(())
    }

    /// The backing file's directory, `auto` resolved (None: no backing file).
    pub fn writeback_path(&self) -> Option<PathBuf> {
        match &self.writeback_dir {
            Writeback::Auto => auto_writeback_dir(),
            Writeback::Off => None,
            Writeback::Dir(d) => Some(d.clone()),
        }
    }

    /// The settings as `UZSWAP_<KEY>` variables, every set key given explicitly.
    pub fn to_env(&self) -> Vec<(String, String)> {
        SETTINGS.iter().filter_map(|d| Some((d.env_var(), self.get(d.name)?))).collect()
    }

    /// The runtime configuration, backing file included ([`crate::Runtime::new`] opens it).
    pub fn runtime_config(&self) -> RuntimeConfig {
        let budget = self.budget.unwrap_or(0);
        let mut cfg = RuntimeConfig::new(budget);
        cfg.fault_path = self.fault_path;
        cfg.policy = self.policy;
        cfg.store.codec.algorithm = self.compressor;
        cfg.store.codec.level = self.level;
        // auto: page-sized units, whole folios where the region is read sequentially.
        cfg.store.codec.granularity = self.granularity.unwrap_or(uzswap_store::SMALLEST_CUT);
        cfg.adaptive_cut = self.granularity.is_none();
        cfg.partial_swapin = self.partial_swapin;
        cfg.fork_carry = self.fork_carry;
        cfg.writeback_dir = self.writeback_path();
        cfg.remote = self.writeback.clone().map(|target| uzswap_remote::RemoteConfig {
            replicas: self.writeback_replicas,
            ca_file: self.writeback_ca.clone(),
            // Every process of the tree: only one that writes back connects (`uzswap
            // run` checks the store before the program starts).
            lazy: true,
            ..uzswap_remote::RemoteConfig::new(target)
        });
        cfg.backing_max_bytes = self.writeback_max;
        if let Some(free) = cfg.writeback_dir.as_deref().and_then(free_bytes) {
            cfg.backing_max_bytes = cfg.backing_max_bytes.min(free / 2);
        }
        // A remote store takes the file's place in what follows.
        let tier = cfg.writeback_dir.is_some() || cfg.remote.is_some();
        match (self.max_pool_percent, tier) {
            (Some(p), true) => cfg.max_pool_percent = p,
            // Without a backing file, a pool limit means stores are refused past it
            // (the folios stay resident, over the budget, and are counted).
            (Some(p), false) => cfg.store.max_pool_bytes = Some(budget / 100 * p as u64),
            // With the default backing file, half the budget. zswap's 20 wrote back
            // what a re-read needed again soon: Python holding 600k objects under
            // 128M took 19.5 s at 20%, 12.7 s at 50%, 12.1 s with no file at all.
            (None, true) => cfg.max_pool_percent = DEFAULT_POOL_PERCENT,
            (None, false) => {}
        }
        cfg
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
        for n in [0, 1, 4097, 64 << 10, 3 << 30, (1 << 40) + (1 << 20)] {
            assert_eq!(parse_size(&format_size(n)), Ok(n), "{}", format_size(n));
        }
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
        // With the default backing file (where there is a disk), the pool's limit is
        // zswap's max_pool_percent, past which folios are written back...
        let cfg = s.runtime_config();
        assert_eq!(cfg.writeback_dir, auto_writeback_dir());
        if cfg.writeback_dir.is_some() {
            assert_eq!((cfg.max_pool_percent, cfg.store.max_pool_bytes), (40, None));
        }
        // ...without one, a hard limit on the pool.
        s.set("writeback_dir", "none").unwrap();
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
