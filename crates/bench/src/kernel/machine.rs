//! The machine's swap settings: what they were before the bench, what the bench
//! changed, and putting them back.
//!
//! [`Snapshot`] records everything a kernel system touches: zswap's module
//! parameters, the active swap areas, the zram devices, the mTHP `enabled` files,
//! the memory cgroups under the root and, on cgroup v2, the root's
//! `cgroup.subtree_control`. [`Machine`] takes the snapshot before changing
//! anything and keeps a stack of undo steps for what it creates (swap areas, files,
//! zram devices, cgroups, a loaded module); [`Machine::unwind_to`] runs them back to
//! a mark after each run and puts every setting back as the snapshot has it, and
//! dropping the machine does the same for everything, on success, error or panic.
//! Ctrl-C, SIGTERM and SIGHUP only raise [`interrupted`] while a machine lives, so
//! the bench stops at the next step and unwinds instead of dying half-configured.
//! A file lock keeps two benches (or two tests) from configuring the machine at once.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub const ZSWAP_PARAMS: &str = "/sys/module/zswap/parameters";
pub const THP: &str = "/sys/kernel/mm/transparent_hugepage";
pub const ZRAM_CONTROL: &str = "/sys/class/zram-control";
pub const CGROUP_V1_MEMORY: &str = "/sys/fs/cgroup/memory";
pub const CGROUP_V2: &str = "/sys/fs/cgroup";
const LOCK_PATH: &str = "/tmp/uzswap-bench-kernel.lock";
/// The snapshot of a bench in progress; found at start-up it means the last bench
/// was killed (SIGKILL, power) before it could put the settings back.
const STATE_PATH: &str = "/var/tmp/uzswap-bench-kernel.state.json";
/// The name of every swap file and cgroup the bench makes starts with this.
const PREFIX: &str = "uzswap-bench-";

/// Highest swap priority: our swap area is used before any the machine already has.
pub const SWAP_PRIORITY: i32 = 32767;
const SWAP_FLAG_PREFER: i32 = 0x8000;

/// Reads a sysfs or procfs file, trimmed.
pub fn read(path: impl AsRef<Path>) -> Result<String, String> {
    let path = path.as_ref();
    fs::read_to_string(path).map(|s| s.trim().to_string()).map_err(|e| format!("read {}: {e}", path.display()))
}

/// Writes a sysfs or cgroup file in one write, as `echo value > path` does.
pub fn write(path: impl AsRef<Path>, value: &str) -> Result<(), String> {
    let path = path.as_ref();
    fs::write(path, value).map_err(|e| format!("write {value:?} to {}: {e}", path.display()))
}

/// The selected word of a sysfs choice file: "always [madvise] never" -> "madvise".
pub fn selected(choices: &str) -> Option<&str> {
    let start = choices.find('[')?;
    let end = choices[start..].find(']')? + start;
    Some(&choices[start + 1..end])
}

/// The words of a sysfs choice file, without brackets.
pub fn choices(line: &str) -> Vec<String> {
    line.split_whitespace().map(|w| w.trim_matches(|c| c == '[' || c == ']').to_string()).collect()
}

/// Which memory cgroup interface the machine has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupVersion {
    V1,
    V2,
}

pub fn cgroup_version() -> Option<CgroupVersion> {
    if Path::new(CGROUP_V1_MEMORY).join("memory.limit_in_bytes").exists() {
        return Some(CgroupVersion::V1);
    }
    let controllers = read(Path::new(CGROUP_V2).join("cgroup.controllers")).ok()?;
    controllers.split_whitespace().any(|c| c == "memory").then_some(CgroupVersion::V2)
}

/// One line of /proc/swaps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapArea {
    pub path: String,
    pub priority: i32,
}

pub fn swap_areas() -> Result<Vec<SwapArea>, String> {
    Ok(read("/proc/swaps")?
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(SwapArea { path: f.first()?.to_string(), priority: f.get(4)?.parse().ok()? })
        })
        .collect())
}

/// A zram device as the snapshot sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZramDevice {
    pub name: String,
    pub disksize: String,
    pub comp_algorithm: String,
}

/// Everything the bench may change, as it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// zswap module parameters by name (empty without zswap).
    pub zswap: BTreeMap<String, String>,
    pub swaps: Vec<SwapArea>,
    pub zram_control: bool,
    pub zram: Vec<ZramDevice>,
    /// Selected value of THP's `enabled` and of each `hugepages-*kB/enabled`, by path.
    pub mthp: BTreeMap<String, String>,
    pub cgroup: Option<CgroupVersion>,
    /// Names of the memory cgroups directly under the root.
    pub cgroups: Vec<String>,
    /// cgroup v2 only: the root's subtree_control.
    pub subtree_control: Option<String>,
}

impl Snapshot {
    pub fn take() -> Result<Snapshot, String> {
        let mut zswap = BTreeMap::new();
        if let Ok(dir) = fs::read_dir(ZSWAP_PARAMS) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                zswap.insert(name, read(e.path())?);
            }
        }
        let mut zram = Vec::new();
        if let Ok(dir) = fs::read_dir("/sys/block") {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("zram") {
                    let p = e.path();
                    zram.push(ZramDevice {
                        disksize: read(p.join("disksize")).unwrap_or_default(),
                        comp_algorithm: read(p.join("comp_algorithm"))
                            .ok()
                            .and_then(|c| selected(&c).map(str::to_string))
                            .unwrap_or_default(),
                        name,
                    });
                }
            }
        }
        zram.sort_by(|a, b| a.name.cmp(&b.name));
        let mut mthp = BTreeMap::new();
        for path in mthp_enabled_files() {
            let v = read(&path)?;
            if let Some(s) = selected(&v) {
                mthp.insert(path.to_string_lossy().into_owned(), s.to_string());
            }
        }
        let cgroup = cgroup_version();
        let (cgroups, subtree_control) = match cgroup {
            Some(v) => {
                let root = cgroup_root(v);
                let mut names: Vec<String> = fs::read_dir(&root)
                    .map_err(|e| format!("read {}: {e}", root.display()))?
                    .flatten()
                    .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect();
                names.sort();
                let sc = (v == CgroupVersion::V2).then(|| read(root.join("cgroup.subtree_control")).ok()).flatten();
                (names, sc)
            }
            None => (Vec::new(), None),
        };
        Ok(Snapshot {
            zswap,
            swaps: swap_areas()?,
            zram_control: Path::new(ZRAM_CONTROL).exists(),
            zram,
            mthp,
            cgroup,
            cgroups,
            subtree_control,
        })
    }

    /// Puts zswap's parameters and the mTHP settings back as recorded. zswap is
    /// switched off first (or on last) so it never runs with a half-set pool.
    pub fn restore_settings(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let param = |name: &str| Path::new(ZSWAP_PARAMS).join(name);
        let set = |path: PathBuf, want: &str, errors: &mut Vec<String>| {
            match read(&path) {
                Ok(now) if now == want => {}
                _ => {
                    if let Err(e) = write(&path, want) {
                        errors.push(e)
                    }
                }
            }
        };
        let enabled = self.zswap.get("enabled");
        if enabled.map(|e| e == "N").unwrap_or(false) {
            set(param("enabled"), "N", &mut errors);
        }
        for (name, value) in &self.zswap {
            if name != "enabled" {
                set(param(name), value, &mut errors);
            }
        }
        if let Some(e) = enabled {
            set(param("enabled"), e, &mut errors);
        }
        for (path, value) in &self.mthp {
            set(PathBuf::from(path), value, &mut errors);
        }
        errors
    }
}

/// THP's `enabled` and every mTHP size's `enabled`.
pub fn mthp_enabled_files() -> Vec<PathBuf> {
    let mut files = vec![Path::new(THP).join("enabled")];
    if let Ok(dir) = fs::read_dir(THP) {
        let mut sizes: Vec<PathBuf> = dir
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("hugepages-"))
            .map(|e| e.path().join("enabled"))
            .filter(|p| p.exists())
            .collect();
        sizes.sort();
        files.extend(sizes);
    }
    files.retain(|p| p.exists());
    files
}

/// The mTHP directory for a folio size, e.g. 65536 -> .../hugepages-64kB.
pub fn mthp_dir(folio: usize) -> PathBuf {
    Path::new(THP).join(format!("hugepages-{}kB", folio >> 10))
}

pub fn cgroup_root(v: CgroupVersion) -> PathBuf {
    match v {
        CgroupVersion::V1 => PathBuf::from(CGROUP_V1_MEMORY),
        CgroupVersion::V2 => PathBuf::from(CGROUP_V2),
    }
}

/// Something the bench created, and how to take it away.
#[derive(Debug)]
enum Undo {
    SwapOff(PathBuf),
    RemoveFile(PathBuf),
    ZramRemove(u32),
    Rmdir(PathBuf),
    SubtreeControl(String),
    UnloadZram,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True once Ctrl-C, SIGTERM or SIGHUP arrived while a [`Machine`] was alive.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The machine while the bench configures it; see the module documentation.
pub struct Machine {
    snapshot: Snapshot,
    undo: Vec<Undo>,
    old_actions: Vec<(libc::c_int, libc::sigaction)>,
    _lock: File,
}

/// A position in the undo stack, from [`Machine::mark`].
#[derive(Clone, Copy)]
pub struct Mark(usize);

impl Machine {
    /// Locks out other benches, records the snapshot and catches the stop signals.
    pub fn new() -> Result<Machine, String> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(LOCK_PATH)
            .map_err(|e| format!("open {LOCK_PATH}: {e}"))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(format!("lock {LOCK_PATH}: {}", std::io::Error::last_os_error()));
        }
        recover_from_killed_bench();
        let snapshot = Snapshot::take()?;
        if let Ok(json) = serde_json::to_string_pretty(&snapshot) {
            let _ = fs::write(STATE_PATH, json);
        }
        INTERRUPTED.store(false, Ordering::Relaxed);
        let mut old_actions = Vec::new();
        for sig in SIGNALS {
            // SAFETY: installing a handler that only stores to an atomic; the old
            // action is kept and put back on drop. No SA_RESTART, so a blocking
            // wait returns EINTR and the bench can react.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as usize;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) == 0 {
                    old_actions.push((sig, old));
                }
            }
        }
        Ok(Machine { snapshot, undo: Vec::new(), old_actions, _lock: lock })
    }

    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    pub fn mark(&self) -> Mark {
        Mark(self.undo.len())
    }

    /// Undoes everything created since `mark`, newest first, and puts every
    /// setting back as it was. Returns what could not be undone.
    pub fn unwind_to(&mut self, mark: Mark) -> Vec<String> {
        let mut errors = Vec::new();
        while self.undo.len() > mark.0 {
            let step = self.undo.pop().expect("non-empty");
            if let Err(e) = undo(&step) {
                errors.push(e);
            }
        }
        errors.extend(self.snapshot.restore_settings());
        errors
    }

    /// Creates a swap file of `bytes` in the first directory where swapon accepts
    /// one; it stays (off) until the machine is dropped.
    pub fn create_swapfile(&mut self, bytes: u64) -> Result<PathBuf, String> {
        let mut errors = Vec::new();
        for dir in swapfile_dirs() {
            let path = dir.join(format!("uzswap-bench-{}.swap", std::process::id()));
            self.undo.push(Undo::RemoveFile(path.clone()));
            match write_zeros(&path, bytes).and_then(|()| mkswap(&path)).and_then(|()| {
                swapon(&path, SWAP_PRIORITY)?;
                swapoff(&path)
            }) {
                Ok(()) => return Ok(path),
                Err(e) => {
                    errors.push(e);
                    self.undo.pop();
                    let _ = fs::remove_file(&path);
                }
            }
        }
        Err(format!("no directory takes a swap file: {}", errors.join("; ")))
    }

    pub fn swapon(&mut self, path: &Path) -> Result<(), String> {
        swapon(path, SWAP_PRIORITY)?;
        self.undo.push(Undo::SwapOff(path.to_path_buf()));
        Ok(())
    }

    /// A fresh zram device (hot_add; the zram module is loaded first if needed).
    pub fn zram_add(&mut self) -> Result<u32, String> {
        if !Path::new(ZRAM_CONTROL).exists() {
            run_tool("modprobe", &["zram", "num_devices=0"])?;
            self.undo.push(Undo::UnloadZram);
            let t = Instant::now();
            while !Path::new(ZRAM_CONTROL).exists() {
                if t.elapsed() > Duration::from_secs(2) {
                    return Err("modprobe zram: no /sys/class/zram-control appeared".into());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let id: u32 = read(Path::new(ZRAM_CONTROL).join("hot_add"))?
            .parse()
            .map_err(|e| format!("zram hot_add gave no device number: {e}"))?;
        self.undo.push(Undo::ZramRemove(id));
        Ok(id)
    }

    /// Makes a memory cgroup `name` under the root (enabling the memory controller
    /// for children on cgroup v2 if it was off).
    pub fn cgroup_create(&mut self, version: CgroupVersion, name: &str) -> Result<PathBuf, String> {
        let root = cgroup_root(version);
        if version == CgroupVersion::V2 {
            let sc = read(root.join("cgroup.subtree_control"))?;
            if !sc.split_whitespace().any(|c| c == "memory") {
                write(root.join("cgroup.subtree_control"), "+memory")?;
                self.undo.push(Undo::SubtreeControl("-memory".into()));
            }
        }
        let dir = root.join(name);
        fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        self.undo.push(Undo::Rmdir(dir.clone()));
        Ok(dir)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let errors = self.unwind_to(Mark(0));
        for e in &errors {
            eprintln!("uzswap bench kernel: could not restore: {e}");
        }
        if errors.is_empty() {
            let _ = fs::remove_file(STATE_PATH);
        }
        for (sig, old) in &self.old_actions {
            // SAFETY: putting back the action that was there before.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
    }
}

/// Holding the lock, anything named like ours is left over from a bench that was
/// killed: swap areas, swap files and cgroups go, and the settings it recorded
/// before it started are put back. (A zram device it added cannot be told apart
/// from the machine's own and stays.)
fn recover_from_killed_bench() {
    let ours = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(PREFIX));
    for area in swap_areas().unwrap_or_default() {
        let path = PathBuf::from(&area.path);
        if ours(&path) && area.path.ends_with(".swap") {
            report_recovery(swapoff(&path), &area.path);
        }
    }
    for dir in swapfile_dirs() {
        for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            if ours(&p) && p.extension().is_some_and(|x| x == "swap") {
                report_recovery(fs::remove_file(&p).map_err(|e| e.to_string()), &p.to_string_lossy());
            }
        }
    }
    if let Some(v) = cgroup_version() {
        for e in fs::read_dir(cgroup_root(v)).into_iter().flatten().flatten() {
            if ours(&e.path()) && e.path().is_dir() {
                report_recovery(rmdir_retrying(&e.path()), &e.path().to_string_lossy());
            }
        }
    }
    if let Ok(json) = fs::read_to_string(STATE_PATH) {
        match serde_json::from_str::<Snapshot>(&json) {
            Ok(old) => {
                for e in old.restore_settings() {
                    eprintln!("uzswap bench kernel: could not restore a killed bench's settings: {e}");
                }
                eprintln!("uzswap bench kernel: put back the settings a killed bench left changed");
            }
            Err(e) => eprintln!("uzswap bench kernel: ignoring {STATE_PATH}: {e}"),
        }
        let _ = fs::remove_file(STATE_PATH);
    }
}

fn report_recovery(result: Result<(), String>, what: &str) {
    match result {
        Ok(()) => eprintln!("uzswap bench kernel: removed {what}, left by a killed bench"),
        Err(e) => eprintln!("uzswap bench kernel: could not remove {what}, left by a killed bench: {e}"),
    }
}

fn undo(step: &Undo) -> Result<(), String> {
    match step {
        Undo::SwapOff(path) => swapoff(path),
        Undo::RemoveFile(path) => match fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("rm {}: {e}", path.display())),
            _ => Ok(()),
        },
        Undo::ZramRemove(id) => {
            let dev = Path::new("/sys/block").join(format!("zram{id}"));
            if dev.exists() {
                write(dev.join("reset"), "1")?;
                write(Path::new(ZRAM_CONTROL).join("hot_remove"), &id.to_string())?;
            }
            Ok(())
        }
        Undo::Rmdir(dir) => rmdir_retrying(dir),
        Undo::SubtreeControl(v) => write(Path::new(CGROUP_V2).join("cgroup.subtree_control"), v),
        Undo::UnloadZram => run_tool("modprobe", &["-r", "zram"]),
    }
}

/// A cgroup can stay busy for a moment after its last task exits.
fn rmdir_retrying(dir: &Path) -> Result<(), String> {
    let t = Instant::now();
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if t.elapsed() > Duration::from_secs(5) => {
                return Err(format!("rmdir {}: {e}", dir.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Where a swap file may go: $UZSWAP_BENCH_SWAPDIR, then disk-backed defaults
/// (swapon refuses tmpfs, so /tmp comes last).
pub(crate) fn swapfile_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("UZSWAP_BENCH_SWAPDIR") {
        dirs.push(PathBuf::from(d));
    }
    dirs.extend(["/var/tmp", "/root", "/tmp"].map(PathBuf::from));
    dirs.retain(|d| d.is_dir());
    dirs
}

/// A swap file must have every block allocated: written zeros, not fallocate,
/// which some file systems refuse for swap. The page cache it leaves is dropped.
fn write_zeros(path: &Path, bytes: u64) -> Result<(), String> {
    use std::io::Write;
    let mut f = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("create {}: {e}", path.display()))?;
    let chunk = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).map_err(|e| format!("write {}: {e}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| format!("fsync {}: {e}", path.display()))?;
    // SAFETY: advice on a descriptor we own.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

pub fn mkswap(path: &Path) -> Result<(), String> {
    run_tool("mkswap", &[path.to_str().ok_or("swap path is not UTF-8")?])
}

fn c_path(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("{} has a NUL byte", path.display()))
}

fn swapon(path: &Path, priority: i32) -> Result<(), String> {
    let c = c_path(path)?;
    // SAFETY: a valid C string; the flags ask for a fixed priority.
    if unsafe { libc::swapon(c.as_ptr(), SWAP_FLAG_PREFER | (priority & 0x7fff)) } != 0 {
        return Err(format!("swapon {}: {}", path.display(), std::io::Error::last_os_error()));
    }
    Ok(())
}

fn swapoff(path: &Path) -> Result<(), String> {
    let c = c_path(path)?;
    // SAFETY: a valid C string.
    if unsafe { libc::swapoff(c.as_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(format!("swapoff {}: {e}", path.display()));
        }
    }
    Ok(())
}

/// Runs a system tool (mkswap, modprobe) found on PATH or in the sbin directories.
fn run_tool(tool: &str, args: &[&str]) -> Result<(), String> {
    let exe = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(tool));
    let out = std::process::Command::new(&exe)
        .args(args)
        .output()
        .map_err(|e| format!("{tool}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{tool} {}: {} {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
