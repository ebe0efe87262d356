//! Live counters, named as the kernel names them, one set per folio size, and the
//! stats file that lets another process (`uzswap stat PID`) read them.
//!
//! The file is `$UZSWAP_STATS_DIR/<pid>.json` (default `/tmp/uzswap-<uid>/<pid>.json`,
//! directory mode 0700, file mode 0600, so only the same user reads it; a directory
//! that is not ours, not private, or a symlink is refused, see [`private_dir`]). The reclaimer
//! rewrites it about once a second by write-then-rename, so a reader always sees a
//! whole JSON object; it is removed when the runtime stops. With several runtimes in
//! one process, the first to publish gets `<pid>.json`, the others `<pid>.<runtime id>.json`.

use crate::settings::format_bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

/// Folio sizes 4 KiB (order 0) to 2 MiB (order 9).
pub(crate) const ORDERS: usize = 10;

/// Defines, from one list of per-size counters, the live atomics ([`SizeCounters`],
/// bumped by field name from fault.rs and reclaim.rs), their published form
/// ([`SizeStats`]), the snapshot of one size and the sum of two. `stored` is apart:
/// it is published twice, as folios and as 4 KiB pages.
macro_rules! size_counters {
    ($($(#[doc = $doc:literal])+ $field:ident,)*) => {
        #[derive(Default)]
        pub(crate) struct SizeCounters {
            pub stored: AtomicU64,
            $(pub $field: AtomicU64,)*
        }

        /// Counters of one folio size. Folio counts, except `stored_pages` (4 KiB pages).
        /// A field missing from a stats file (an older writer) reads as 0.
        #[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
        #[serde(default)]
        pub struct SizeStats {
            /// Folios in the store now.
            pub stored_folios: u64,
            /// 4 KiB pages in the store now.
            pub stored_pages: u64,
            $($(#[doc = $doc])+ pub $field: u64,)*
        }

        impl SizeCounters {
            /// The counters of folios of `4 KiB << order`.
            fn snapshot(&self, order: usize) -> SizeStats {
                let stored = self.stored.load(Relaxed);
                SizeStats { stored_folios: stored, stored_pages: stored << order, $($field: self.$field.load(Relaxed),)* }
            }
        }

        impl std::ops::AddAssign<&SizeStats> for SizeStats {
            fn add_assign(&mut self, o: &SizeStats) {
                self.stored_folios += o.stored_folios;
                self.stored_pages += o.stored_pages;
                $(self.$field += o.$field;)*
            }
        }
    };
}

size_counters! {
    /// Folios compressed into the store.
    zswpout,
    /// Folios brought back from the store by a fault.
    zswpin,
    /// Faults resolved (every path).
    faults,
    /// Faults on never-touched (or dropped) folios, filled with zeros.
    zero_fill,
    /// Folios filled with zeros with no fault, ahead of a program writing fresh
    /// memory in order (each one fault fewer).
    zero_ahead,
    /// Of `zswpin`, folios brought back with no fault, ahead of a sequential pass
    /// (write-protected, their entry kept, as a read brings them).
    swapin_ahead,
    /// Folios the program already had in place when uzswap took its mapping over.
    adopted,
    /// Folios this process took over from its parent at fork still swapped out, their
    /// records copied encoded (fork without swap-in).
    fork_carried,
    /// Folios this process took over from its parent at fork with their pages in
    /// place, shared copy-on-write and charged to the parent (SHARED: fork without
    /// compression, fork.rs).
    fork_shared,
    /// Of `fork_shared`, folios made this process's own: touched, released for the
    /// group's room, or held for a fork of its own.
    fork_unshared,
    /// Pages shared with another process (a parent, since a fork) that the reclaimer
    /// copied to take a folio out (each a write fault, as a process writing there would
    /// take): then the other process's page is its alone.
    unshared_pages,
    /// Folios moved out of view on probation (the inactive list).
    probation_out,
    /// Folios touched while on probation, moved back without compression.
    probation_refault,
    /// Store entries freed by munmap, MADV_DONTNEED/FREE or region drop.
    invalidated,
    /// Folios the reclaimer failed to store (store error or pinned pages).
    reject_reclaim_fail,
    /// Of `reject_reclaim_fail`, folios left resident because another process (a
    /// child since a fork) maps their pages too: passed over for a second at a time.
    reject_shared,
    /// Of `zswpin`, loads by a read fault that kept the store entry as the folio's
    /// clean copy (the folio comes back write-protected).
    zswpin_kept,
    /// Read faults at random in a swapped-out folio that mapped only the compression
    /// unit around them (partial swap-in), the store keeping the folio.
    partial_in,
    /// Folios evicted with no compression: still clean, their kept copy was reused.
    clean_evict,
    /// Kept copies freed because the folio was written (or is being stored anew).
    kept_freed,
    /// Faults that had to wait for the reclaimer (usage past the budget).
    throttled,
    /// Faults that went past the throttle limit without waiting, because the
    /// reclaimer could not bring usage down (stalled, nothing left to evict, the store
    /// refused) or the pool alone is past the limit (no backing file to write to).
    over_budget,
    /// Evictions put off because a MADV_DONTNEED/FREE of the program was being taken in.
    reclaim_deferred,
    /// Folios the store could not give back (a read error or a corrupt record in the
    /// backing file): poisoned, so any access raises SIGBUS, never wrong bytes.
    poisoned,
    /// userfaultfd ioctls that failed with an errno not expected there: the folio
    /// they were placing is poisoned (said once on stderr).
    ioctl_errors,
    /// Evictions put off because pages the program dropped (MADV_DONTNEED/FREE) were
    /// still mapped: the kernel had not zapped them yet, or MADV_FREE left them.
    drop_pinned,
    /// Partly swapped-in folios found, before a clean eviction, with a page no longer
    /// write-protected (reclaim.rs `still_protected`): brought in whole, so that a
    /// write that got in is not lost.
    clean_unprotected,
    /// Clean folios whose bytes, taken out for a clean eviction, were not those of
    /// their kept copy (checksums: a write got in with no fault): stored anew.
    clean_changed,
    /// Folios a forked child took over swapped out that it had touched before its
    /// runtime started (fork.rs): the child's writes laid over the parent's data.
    fork_touched,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub sizes: [SizeCounters; ORDERS],
}

/// What a runtime publishes (the stats file, `uzswap stat --json`, the shim's exit
/// line) and every reader parses back. A field missing from a file written by an
/// older binary reads as its default.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RuntimeStats {
    pub pid: u32,
    /// When the process started (`group::start_time`): with `pid`, it names the
    /// process for good, so that a reader tells it from a later process (or thread)
    /// given the same number once it is gone ([`RuntimeStats::is_running`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<u64>,
    pub fault_path: String,
    /// Which userfaultfd access the runtime got (`uffd::Access::describe`).
    #[serde(default)]
    pub uffd_access: String,
    pub policy: String,
    pub budget_bytes: u64,
    /// resident_bytes + pool_total_size: what counts against the budget.
    pub usage_bytes: u64,
    pub resident_bytes: u64,
    pub probation_bytes: u64,
    pub pool_total_size: u64,
    pub regions: usize,
    /// Keyed `hugepages-<size>kB`, as /sys/kernel/mm/transparent_hugepage names them;
    /// only sizes with some activity are listed.
    pub sizes: BTreeMap<String, SizeStats>,
    /// The store's own counters (pool, compression, writeback).
    pub store: uzswap_store::Stats,
    /// The program's resident anonymous memory not managed, as last measured (it
    /// counts against the budget).
    #[serde(default)]
    pub unmanaged_bytes: u64,
    /// Bytes of the program's memory taken over in place, by kind ("heap", "mapping").
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub adopted_bytes: BTreeMap<String, u64>,
    /// Most bytes of managed ranges at once (the shim adds it at exit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub managed_peak_bytes: Option<u64>,
    /// Why the program's other memory was not adopted, if it was not (the shim adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_adopted: Option<String>,
    /// The program's name (the shim adds it at exit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// The highest usage seen (resident + pool + unmanaged counted), sampled by the
    /// reclaimer every few milliseconds.
    #[serde(default)]
    pub peak_usage_bytes: u64,
    /// In a group (`uzswap run`'s process tree): the group's budget, of which
    /// `budget_bytes` is this process's share now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_budget_bytes: Option<u64>,
    /// Whether a backing file takes what does not fit the pool. Without one, memory
    /// that does not compress stays in the pool, over the budget.
    #[serde(default)]
    pub writeback: bool,
    /// What the tier written back to is (a file, a remote store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// A remote tier's counters (uzswap-remote: objects, bytes, round trips, read
    /// latency, fallbacks, errors).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub remote: BTreeMap<String, u64>,
    /// This is the last live stats of a process that ended without running its exit
    /// handlers (`_exit`, a signal, Go's runtime), written for it by `uzswap run`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ended_without_exit_handlers: bool,
}

impl RuntimeStats {
    /// Whether the process that published these is still running: a process (not a
    /// zombie) with its pid that started when it did. A pid alone may name a process
    /// or a thread started since (the published file of one killed outright stays).
    /// Stats without a start time (an older runtime's) go by the pid alone.
    pub fn is_running(&self) -> bool {
        let Some(now) = crate::group::proc_stat(self.pid) else { return false };
        now.alive() && self.started.is_none_or(|t| t == now.start)
    }

    /// A loud line when usage ran well past the budget (now or at its peak) with no
    /// backing file to take what does not compress: the budget did not hold.
    pub fn over_budget_warning(&self) -> Option<String> {
        let budget = self.group_budget_bytes.unwrap_or(self.budget_bytes).max(1);
        let worst = self.usage_bytes.max(self.peak_usage_bytes);
        (!self.writeback && worst > budget + budget / 8).then(|| {
            format!(
                "WARNING: over the budget: usage reached {} against {}; there is no backing file (writeback_dir none), so what does not compress stays in memory",
                format_bytes(worst),
                format_bytes(budget)
            )
        })
    }

    /// Whether this process's summary is worth a line of its own: it managed something,
    /// or it managed nothing while what it could not (`not_adopted` says why) was a
    /// quarter of its budget or more (a Go program as an ordinary user). A shell or a
    /// helper leaves none.
    pub fn worth_a_line(&self) -> bool {
        let t = self.total();
        let budget = self.group_budget_bytes.unwrap_or(self.budget_bytes);
        t.adopted > 0 || t.faults > 0 || (self.not_adopted.is_some() && self.unmanaged_bytes >= budget / 4)
    }

    /// The sum over folio sizes.
    pub fn total(&self) -> SizeStats {
        let mut t = SizeStats::default();
        for s in self.sizes.values() {
            t += s;
        }
        t
    }

    /// Original bytes held in memory now (in the pool or as same-filled markers).
    pub fn stored_bytes(&self) -> u64 {
        self.store.totals.stored_pages * 4096
    }

    /// Original bytes per byte of pool (1.0 while the pool is empty).
    pub fn ratio(&self) -> f64 {
        if self.pool_total_size == 0 { 1.0 } else { self.stored_bytes() as f64 / self.pool_total_size as f64 }
    }

    /// The kernel-style text summary (the exit summary and `uzswap stat`): totals in
    /// 4 KiB pages as vmstat counts them, then one line per folio size.
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let (pool, stored, t) = (self.pool_total_size, self.stored_bytes(), &self.store.totals);
        // Swap-ins are the runtime's, per folio size: a clean folio read back keeps its
        // store entry, so the store's own zswpin counts only entries freed by a load.
        let swapped_in: u64 = self.sizes.iter().map(|(name, c)| c.zswpin * folio_bytes_of(name)).sum();
        if self.ended_without_exit_handlers {
            let _ = writeln!(s, "uzswap: pid {} exited without running its exit handlers; its last live stats (at most a second old):", self.pid);
        }
        let _ = writeln!(
            s,
            "uzswap: pid {} budget {} ({} fault path): swapped out {}, swapped in {}; now resident {}, pool {} holding {} (ratio {:.2}, {} saved)",
            self.pid,
            format_bytes(self.budget_bytes),
            if self.fault_path.is_empty() { "?" } else { &self.fault_path },
            format_bytes(t.zswpout * 4096),
            format_bytes(swapped_in),
            format_bytes(self.resident_bytes),
            format_bytes(pool),
            format_bytes(stored),
            self.ratio(),
            format_bytes(stored.saturating_sub(pool)),
        );
        let _ = writeln!(
            s,
            "  zswpout {} zswpin {} zswpwb {} pswpout {} pswpin {} stored_pages {} stored_incompressible_pages {} same_filled_pages {} written_back_pages {} reject_compress_fail {} reject_reclaim_fail {}",
            t.zswpout,
            t.zswpin,
            t.zswpwb,
            t.pswpout,
            t.pswpin,
            t.stored_pages,
            t.stored_incompressible_pages,
            t.same_filled_pages,
            t.written_back_pages,
            t.reject_compress_fail,
            t.reject_reclaim_fail,
        );
        if !self.remote.is_empty() {
            let line: Vec<String> = self.remote.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(s, "  written back to {}: {}", self.tier.as_deref().unwrap_or("a remote store"), line.join(" "));
        }
        let shared = self.total().reject_shared;
        if shared > 0 {
            let _ = writeln!(
                s,
                "  {shared} evictions met pages another process maps too (a child since a fork): left resident while it does (reject_shared)"
            );
        }
        if let Some(g) = self.group_budget_bytes {
            let _ = writeln!(s, "  its share of the group's budget of {} (the process tree shares one budget)", format_bytes(g));
        }
        if let Some(over) = self.over_budget_warning() {
            let _ = writeln!(s, "  {over}");
        }
        // Mapped memory may exceed the budget (that is what swapping is for); what the
        // budget bounds is usage, and faults that ran past it are counted.
        if let Some(peak) = self.managed_peak_bytes.filter(|&p| p > 0) {
            let budget = self.budget_bytes.max(1);
            let fit = if peak > budget {
                format!("{:.1}x the budget of {}: the rest lived swapped out", peak as f64 / budget as f64, format_bytes(budget))
            } else {
                format!("within the budget of {}", format_bytes(budget))
            };
            let over = self.total().over_budget;
            let ran_over = if over > 0 { format!("; faults ran past the budget {over} times (over_budget)") } else { String::new() };
            let _ = writeln!(s, "  managed memory: peak {} mapped, {fit}{ran_over}", format_bytes(peak));
        }
        if !self.adopted_bytes.is_empty() {
            let kinds: Vec<String> = self.adopted_bytes.iter().map(|(k, b)| format!("{k} {}", format_bytes(*b))).collect();
            let _ = writeln!(s, "  adopted in place: {}", kinds.join(", "));
        }
        if self.unmanaged_bytes > 0 {
            let _ = writeln!(s, "  not managed: {} resident (counted against the budget, up to half of it)", format_bytes(self.unmanaged_bytes));
        }
        if let Some(why) = &self.not_adopted {
            let _ = writeln!(s, "  not adopted: {why}");
        }
        if !self.uffd_access.is_empty() {
            let _ = writeln!(s, "  userfaultfd access: {}", self.uffd_access);
        }
        for (name, c) in &self.sizes {
            let _ = writeln!(
                s,
                "  {name}: zswpout {} zswpin {} (ahead {}) partial_in {} stored {} faults {} zero_fill {} (ahead {}) probation_out {} probation_refault {} invalidated {}",
                c.zswpout, c.zswpin, c.swapin_ahead, c.partial_in, c.stored_folios, c.faults, c.zero_fill, c.zero_ahead, c.probation_out, c.probation_refault, c.invalidated,
            );
        }
        s
    }
}

/// `hugepages-64kB` for 64 KiB folios.
pub fn size_name(folio_size: usize) -> String {
    format!("hugepages-{}kB", folio_size / 1024)
}

/// The folio size a [`size_name`] names (0 if it names none).
fn folio_bytes_of(name: &str) -> u64 {
    name.trim_start_matches("hugepages-").trim_end_matches("kB").parse::<u64>().map_or(0, |kb| kb * 1024)
}

impl Counters {
    pub fn snapshot(&self) -> BTreeMap<String, SizeStats> {
        let mut out = BTreeMap::new();
        for (order, c) in self.sizes.iter().enumerate() {
            let s = c.snapshot(order);
            if s != SizeStats::default() {
                out.insert(size_name(4096 << order), s);
            }
        }
        out
    }
}

/// Where the stats of process `pid` live (`uzswap stat PID` reads this): the directory
/// of the user it runs as, so that root sees a program that dropped its privileges.
pub fn stats_path(pid: u32) -> PathBuf {
    stats_dir_of(pid).join(format!("{pid}.json"))
}

/// This process's stats directory: `$UZSWAP_STATS_DIR`, or one per user in /tmp.
pub(crate) fn stats_dir() -> PathBuf {
    // SAFETY: getuid takes no arguments, touches no memory and cannot fail.
    user_stats_dir(unsafe { libc::getuid() })
}

fn user_stats_dir(uid: u32) -> PathBuf {
    match std::env::var_os("UZSWAP_STATS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(format!("/tmp/uzswap-{uid}")),
    }
}

/// The stats directory of process `pid`: that of its real user (the uid its runtime
/// names its directory by), or ours if it cannot be read (gone, or hidden from us).
fn stats_dir_of(pid: u32) -> PathBuf {
    let uid = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok()));
    match uid {
        Some(uid) => user_stats_dir(uid),
        None => stats_dir(),
    }
}

/// The directories `uzswap stat` and `top` list: ours, and as root every user's.
pub fn stats_dirs() -> Vec<PathBuf> {
    // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
    if std::env::var_os("UZSWAP_STATS_DIR").is_some() || unsafe { libc::geteuid() } != 0 {
        return vec![stats_dir()];
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/tmp")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("uzswap-")).is_some_and(|uid| uid.parse::<u32>().is_ok()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// Reads the stats another process published.
pub fn read_stats(pid: u32) -> std::io::Result<RuntimeStats> {
    let text = std::fs::read_to_string(stats_path(pid))?;
    serde_json::from_str(&text).map_err(std::io::Error::other)
}

/// What `uzswap run` publishes about its group (the process tree sharing one budget):
/// `uzswap stat` and `top` show it, and the exit summary ends with it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupStats {
    /// `uzswap run`'s pid (the group's parent).
    pub pid: u32,
    pub budget_bytes: u64,
    /// What the group charges now: its members' usage plus `outside_bytes`.
    pub usage_bytes: u64,
    /// The highest `usage_bytes` seen (sampled every few milliseconds).
    pub peak_bytes: u64,
    /// Resident anonymous memory (PSS) of the tree's processes that have no runtime
    /// (a static binary, a setuid program, a forked child): counted, not managed.
    pub outside_bytes: u64,
    pub members: Vec<GroupMemberStats>,
    /// Processes that were members at some point.
    pub members_seen: u64,
    /// Members that died without leaving (SIGKILL, _exit) whose share was taken back.
    pub reaped: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupMemberStats {
    pub pid: u32,
    /// What it charges: resident + pool + its unmanaged memory.
    pub usage_bytes: u64,
    /// Its share of the budget now.
    pub limit_bytes: u64,
    pub resident_bytes: u64,
    pub pool_bytes: u64,
    /// What it holds in its backing file (as memory).
    #[serde(default)]
    pub written_back_bytes: u64,
}

impl GroupStats {
    /// The group's lines of the exit summary and `uzswap stat`.
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let budget = self.budget_bytes.max(1);
        let over = (self.peak_bytes as f64 / budget as f64 - 1.0) * 100.0;
        let verdict = if self.peak_bytes <= budget {
            "within it".to_string()
        } else if self.peak_bytes <= budget + budget / 8 {
            format!("{over:.0}% over it")
        } else {
            // Said, never a silent fact: most often memory uzswap could not manage
            // (each process's "not managed" line), which it counts but cannot swap out.
            format!("WARNING: {over:.0}% over it; what uzswap does not manage counts but cannot be swapped out")
        };
        let _ = writeln!(
            s,
            "uzswap: group of uzswap run {}: budget {}, peak {} ({verdict}); now {} in {} processes{}",
            self.pid,
            format_bytes(self.budget_bytes),
            format_bytes(self.peak_bytes),
            format_bytes(self.usage_bytes),
            self.members.len(),
            if self.outside_bytes > 0 { format!(" and {} outside (processes uzswap cannot manage)", format_bytes(self.outside_bytes)) } else { String::new() },
        );
        if self.members_seen > 0 || self.reaped > 0 {
            let _ = writeln!(s, "  processes that joined: {}; died without leaving (share taken back): {}", self.members_seen, self.reaped);
        }
        for m in &self.members {
            let _ = writeln!(
                s,
                "  pid {:>8}: usage {:>10} share {:>10} resident {:>10} pool {:>10} written back {:>10}",
                m.pid,
                format_bytes(m.usage_bytes),
                format_bytes(m.limit_bytes),
                format_bytes(m.resident_bytes),
                format_bytes(m.pool_bytes),
                format_bytes(m.written_back_bytes)
            );
        }
        s
    }
}

/// Where `uzswap run` (pid) publishes its group's stats.
pub fn group_stats_path(pid: u32) -> PathBuf {
    stats_dir_of(pid).join(format!("group-{pid}.json"))
}

pub fn read_group_stats(pid: u32) -> std::io::Result<GroupStats> {
    let text = std::fs::read_to_string(group_stats_path(pid))?;
    serde_json::from_str(&text).map_err(std::io::Error::other)
}

pub fn write_group_stats(stats: &GroupStats) -> std::io::Result<()> {
    write_stats_file(&group_stats_path(stats.pid), stats)
}

pub(crate) fn write_stats_file(path: &std::path::Path, stats: &impl Serialize) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    private_dir(dir)?;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(serde_json::to_string_pretty(stats).map_err(std::io::Error::other)?.as_bytes())?;
    std::fs::rename(&tmp, path)
}

/// Makes `dir` (mode 0700) if it is missing, and refuses it unless it is a real
/// directory (not a symlink) owned by this user with no access for group or others.
/// The stats directory's default is in /tmp, where anyone may have made it first
/// (the classic /tmp attack: a directory or symlink planted to read or redirect
/// what we write); the modes are what keep `uzswap stat` to the same user.
pub(crate) fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let m = std::fs::symlink_metadata(dir)?;
    // SAFETY: getuid takes no arguments, touches no memory and cannot fail.
    let uid = unsafe { libc::getuid() };
    let why = if !m.file_type().is_dir() {
        Some("not a directory (a symlink?)".to_string())
    } else if m.uid() != uid {
        Some(format!("owned by uid {}, not {uid}", m.uid()))
    } else if m.mode() & 0o077 != 0 {
        Some(format!("mode {:o}: group or others have access (want 700)", m.mode() & 0o777))
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("refusing the stats directory {}: {why}", dir.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn sample() -> RuntimeStats {
        let store = uzswap_store::Store::new(uzswap_store::StoreConfig::default()).unwrap();
        RuntimeStats {
            pid: 1,
            started: None,
            fault_path: "thread".into(),
            uffd_access: String::new(),
            policy: "fifo".into(),
            budget_bytes: 1,
            usage_bytes: 0,
            unmanaged_bytes: 0,
            adopted_bytes: BTreeMap::new(),
            not_adopted: None,
            resident_bytes: 0,
            probation_bytes: 0,
            pool_total_size: 0,
            regions: 0,
            sizes: BTreeMap::new(),
            store: store.stats(),
            managed_peak_bytes: None,
            command: None,
            peak_usage_bytes: 0,
            group_budget_bytes: None,
            writeback: false,
            tier: None,
            remote: BTreeMap::new(),
            ended_without_exit_handlers: false,
        }
    }

    #[test]
    fn stats_round_trip_and_an_older_file_still_parses() {
        let mut st = sample();
        st.sizes.insert(size_name(64 << 10), SizeStats { zswpout: 3, zswpin: 2, stored_folios: 1, stored_pages: 16, ..Default::default() });
        st.managed_peak_bytes = Some(5 << 20);
        let back: RuntimeStats = serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        assert_eq!(back, st);
        assert_eq!(back.total().stored_pages, 16);
        // Written before some counters existed: what is missing reads as 0 / none.
        let old = r#"{"pid": 7, "fault_path": "thread", "policy": "fifo", "budget_bytes": 1048576,
            "usage_bytes": 0, "resident_bytes": 0, "probation_bytes": 0, "pool_total_size": 0,
            "regions": 1, "sizes": {"hugepages-64kB": {"zswpout": 4, "zswpin": 1, "stored_folios": 3,
            "stored_pages": 48, "faults": 9}}, "store": {"zswpout": 64, "stored_pages": 48}}"#;
        let st: RuntimeStats = serde_json::from_str(old).unwrap();
        assert_eq!((st.pid, st.sizes["hugepages-64kB"].faults, st.sizes["hugepages-64kB"].poisoned), (7, 9, 0));
        assert_eq!((st.store.totals.zswpout, st.managed_peak_bytes), (64, None));
        let text = st.summary();
        assert!(text.contains("swapped out 256.0 KiB, swapped in 64.0 KiB"), "{text}");
        assert!(text.contains("hugepages-64kB: zswpout 4 zswpin 1 (ahead 0) partial_in 0 stored 3 faults 9 "), "{text}");
    }

    #[test]
    fn the_summary_says_whether_the_peak_was_over_the_budget() {
        let mut st = sample();
        st.budget_bytes = 256 << 20;
        st.managed_peak_bytes = Some(1 << 30);
        assert!(
            st.summary().contains("managed memory: peak 1.0 GiB mapped, 4.0x the budget of 256.0 MiB: the rest lived swapped out\n"),
            "{}",
            st.summary()
        );
        st.managed_peak_bytes = Some(100 << 20);
        assert!(st.summary().contains("peak 100.0 MiB mapped, within the budget of 256.0 MiB"), "{}", st.summary());
    }

    #[test]
    fn the_group_summary_warns_when_the_budget_did_not_hold() {
        let mut g = GroupStats { pid: 7, budget_bytes: 128 << 20, peak_bytes: 100 << 20, ..Default::default() };
        assert!(g.summary().contains("(within it)"));
        g.peak_bytes = 140 << 20;
        assert!(g.summary().contains("(9% over it)") && !g.summary().contains("WARNING"));
        g.peak_bytes = 1600 << 20;
        assert!(g.summary().contains("WARNING: 1150% over it"), "{}", g.summary());
    }

    #[test]
    fn the_stats_file_is_private_and_planted_directories_are_refused() {
        let top = tempfile::tempdir().unwrap();
        // Made by us: 0700, the file 0600.
        let dir = top.path().join("mine");
        let file = dir.join("1.json");
        write_stats_file(&file, &sample()).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        // Someone left it open to others: refused, nothing written.
        let loose = top.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = write_stats_file(&loose.join("1.json"), &sample()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("755"), "{err}");
        assert!(std::fs::read_dir(&loose).unwrap().next().is_none());
        // A symlink to a private directory planted where ours should be: refused.
        let link = top.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(write_stats_file(&link.join("2.json"), &sample()).is_err());
        assert!(!dir.join("2.json").exists());
        // Owned by another user (only root can make one to test with).
        // SAFETY: geteuid takes no arguments and touches no memory.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = top.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
            let c = std::ffi::CString::new(theirs.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: `c` is a NUL-terminated path that lives across the call.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 4242, 4242) }, 0);
            let err = write_stats_file(&theirs.join("1.json"), &sample()).unwrap_err();
            assert!(err.to_string().contains("4242"), "{err}");
        } else {
            eprintln!("not root: the other-owner case is not tried");
        }
    }
}
