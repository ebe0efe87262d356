//! One budget for a whole process tree, as a memory cgroup gives one: the *ledger*
//! every process of the tree maps, and the rule ([`shares`]) that splits the budget
//! among them.
//!
//! # What it is for
//! `uzswap run --budget B -- CMD` makes a ledger (a memfd) and stays the group's
//! coordinator (crates/cli group.rs). Every process of the tree whose runtime starts
//! (exec'd programs, and forked ones once they have a runtime) joins it: it claims a
//! slot, publishes there what it charges (resident folios + its pool + its unmanaged
//! memory, `Shared::usage`) and how cold its coldest memory is, and holds itself to
//! the *limit* the coordinator writes in its slot, which is its runtime's budget from
//! then on (`Shared::budget`). The coordinator sets the limits so that they add up to
//! B less what the tree's unmanaged processes hold (`outside`, measured from their
//! RSS). So the fault path reads one word of shared memory and never waits for another
//! process; a process over its limit evicts its own memory, since no process can
//! compress another's.
//!
//! Not here: the mechanism each member evicts with (reclaim.rs, unchanged: a limit is
//! a budget), nor the tree walk and the timing of the coordinator (the CLI's).
//!
//! # The ledger
//! A header (magic, budget, `outside`, the group clock) and [`SLOTS`] slots, a cache
//! line each. Who writes what:
//! - a member: claims a free slot by CAS on `pid` (or takes back its own after exec),
//!   then writes `start`, `usage`, `tail`, `resident`, `pool` and `written_back`;
//!   leaving, it zeroes
//!   `usage` and frees the slot;
//! - the coordinator: `limit` of every member, `outside`; and it frees the slot of a
//!   member that died without leaving (SIGKILL, `_exit`), once that process is gone
//!   (its pid and start time no longer name a live process).
//!
//! The group's charge is the sum of the live slots' `usage` plus `outside`. Each slot's
//! usage is one word its member overwrites, not a delta added to a shared total, so a
//! member that joins, leaves or dies mid-update changes the sum by exactly what it had.
//!
//! # Pool and backing file: per process
//! Each member keeps its own store (pool, index) and its own backing file; only the
//! ledger is shared. Why: a member's fault path reads its pool with no lock another
//! process could hold, and a process killed mid-writeback (SIGKILL) leaves nothing
//! half-done behind for the others: its pool goes with its memory and its unnamed
//! backing file with its last descriptor, so the kernel reclaims both and the
//! coordinator only takes back its share of the ledger. The price is uzswap's own
//! memory in every process, which counts against the group (measured: 1.6 MiB for a
//! process that manages nothing, about 5 MiB for one that writes back), and no
//! sharing of compressed data between processes (a forked child brings its own).
//!
//! # The group clock
//! Members stamp their fault-ins from the ledger's `clock` instead of a counter of
//! their own, so stamps compare across processes: a member's `tail` (the stamp of the
//! oldest folio it would evict next) says whose memory is coldest, as the kernel's one
//! LRU per memory cgroup does.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// Members a group can have. A process past that runs on a budget of its own.
pub const SLOTS: usize = 256;
/// No member is held below this (it must fit its largest folio, 2 MiB, and make
/// progress).
pub const MIN_LIMIT: u64 = 4 << 20;
/// The environment variable `uzswap run` names the ledger in: a path any process of
/// the tree can open (`/proc/<pid of uzswap run>/fd/<n>`).
pub const GROUP_VAR: &str = "UZSWAP_GROUP";
/// The abstract unix socket (its name) where a process of the tree that cannot open
/// that path asks for the ledger instead: one that changed its user since (root's
/// `uzswap run` of `setpriv --reuid=...`, a daemon dropping root), to which
/// /proc/<pid>/fd of root's process is closed. `uzswap run` hands the ledger's
/// descriptor (SCM_RIGHTS) to its own descendants only.
pub const GROUP_SOCKET_VAR: &str = "UZSWAP_GROUP_SOCKET";
/// The ledger's descriptor, asked of `uzswap run` at its abstract socket `name`.
fn ledger_from_socket(name: &str) -> std::io::Result<std::fs::File> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut byte = [0u8; 1];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    rustix::net::recvmsg(&s, &mut [std::io::IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = m {
            if let Some(fd) = fds.next() {
                return Ok(fd.into());
            }
        }
    }
    Err(std::io::Error::other("refused (not a process of the tree?)"))
}

/// `tail` of a member with nothing to evict.
pub const TAIL_NONE: u64 = u64::MAX;

const MAGIC: u64 = u64::from_le_bytes(*b"uzswapG1");

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    budget: AtomicU64,
    outside: AtomicU64,
    clock: AtomicU64,
}

/// One member's slot. Written by the member, but `limit` (the coordinator's).
#[repr(C, align(64))]
pub struct Slot {
    pid: AtomicU32,
    start: AtomicU64,
    /// What the member charges: resident + pool + unmanaged counted.
    usage: AtomicU64,
    /// Its share of the budget, set by the coordinator (0: not yet).
    limit: AtomicU64,
    /// Group-clock stamp of the oldest folio it would evict next; 0 when it does not
    /// know (it has not looked yet), TAIL_NONE when it has nothing to evict.
    tail: AtomicU64,
    resident: AtomicU64,
    pool: AtomicU64,
    /// What it holds in its backing file (as memory: pages).
    written_back: AtomicU64,
}

#[repr(C)]
struct Page {
    header: Header,
    slots: [Slot; SLOTS],
}

/// Bytes of the ledger file.
pub const LEDGER_BYTES: usize = std::mem::size_of::<Page>();

/// A mapped ledger (the coordinator's, or a member's).
pub struct Ledger {
    page: *const Page,
}

// SAFETY: the page is shared memory of atomics only, mapped for the Ledger's lifetime.
unsafe impl Send for Ledger {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for Ledger {}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` for this Ledger alone.
        unsafe { libc::munmap(self.page as *mut _, LEDGER_BYTES) };
    }
}

/// What the coordinator reads of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberView {
    pub slot: usize,
    pub pid: u32,
    pub start: u64,
    pub usage: u64,
    pub limit: u64,
    pub tail: u64,
    pub resident: u64,
    pub pool: u64,
    pub written_back: u64,
}

impl Ledger {
    /// A new ledger for a group with `budget`, in a memfd (close-on-exec: members open
    /// it by path). Returns it and the descriptor.
    pub fn create(budget: u64) -> std::io::Result<(Ledger, std::os::fd::OwnedFd)> {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create reads the NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"uzswap-group".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just gave us, owned from here on.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let file = std::fs::File::from(fd);
        file.set_len(LEDGER_BYTES as u64)?;
        let ledger = Self::map(&file)?;
        ledger.header().budget.store(budget, Relaxed);
        ledger.header().magic.store(MAGIC, Release);
        Ok((ledger, file.into()))
    }

    /// Maps the ledger at `path` (a member's side). The descriptor is closed at once:
    /// the mapping is all a member keeps, so a program that closes descriptors cannot
    /// take it away.
    pub fn open(path: &Path) -> std::io::Result<Ledger> {
        let file = match std::fs::OpenOptions::new().read(true).write(true).open(path) {
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => match std::env::var(GROUP_SOCKET_VAR) {
                Ok(name) => ledger_from_socket(&name).map_err(|s| std::io::Error::other(format!("{e}; from {GROUP_SOCKET_VAR}: {s}")))?,
                Err(_) => return Err(e),
            },
            r => r?,
        };
        if file.metadata()?.len() != LEDGER_BYTES as u64 {
            return Err(std::io::Error::other(format!("{} is not a uzswap group ledger (size)", path.display())));
        }
        let ledger = Self::map(&file)?;
        if ledger.header().magic.load(Acquire) != MAGIC {
            return Err(std::io::Error::other(format!("{} is not a uzswap group ledger", path.display())));
        }
        Ok(ledger)
    }

    /// Hands the ledger's descriptor to every process that connects to `listener` and
    /// `may_have(pid)` allows (its peer credentials' pid), until the process exits.
    pub fn serve(fd: OwnedFd, listener: std::os::unix::net::UnixListener, may_have: impl Fn(u32) -> bool) {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        for conn in listener.incoming() {
            let Ok(c) = conn else { continue };
            let Ok(cred) = rustix::net::sockopt::socket_peercred(&c) else { continue };
            if !may_have(cred.pid.as_raw_pid() as u32) {
                continue; // closed: the asker says it was refused
            }
            let fds = [fd.as_fd()];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            control.push(SendAncillaryMessage::ScmRights(&fds));
            let _ = rustix::net::sendmsg(&c, &[std::io::IoSlice::new(&[0])], &mut control, SendFlags::empty());
        }
    }

    fn map(file: &std::fs::File) -> std::io::Result<Ledger> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of the file, which is LEDGER_BYTES long; the
        // result is checked. MAP_SHARED: every process of the group sees one ledger.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), LEDGER_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Ledger { page: p as *const Page })
    }

    fn header(&self) -> &Header {
        // SAFETY: `page` is a live mapping of a whole Page for our lifetime.
        unsafe { &(*self.page).header }
    }

    pub fn slot(&self, i: usize) -> &Slot {
        // SAFETY: as in `header`; the index is bounds-checked by the array.
        unsafe { &(*self.page).slots[i] }
    }

    pub fn budget(&self) -> u64 {
        self.header().budget.load(Relaxed)
    }

    pub fn set_budget(&self, bytes: u64) {
        self.header().budget.store(bytes, Relaxed);
    }

    /// The group clock (fault-in stamps of every member).
    pub fn clock(&self) -> &AtomicU64 {
        &self.header().clock
    }

    /// What the tree's processes without a runtime hold (the coordinator measures it).
    pub fn outside(&self) -> u64 {
        self.header().outside.load(Relaxed)
    }

    pub fn set_outside(&self, bytes: u64) {
        self.header().outside.store(bytes, Relaxed);
    }

    /// Claims a slot for process `pid` (started at `start`, /proc's clock ticks): the
    /// one it already has (it exec'd: what the old program charged is gone with its
    /// memory), else a free one. None when the group is full. The first limit, until
    /// the coordinator sets one: the room left, at most an even share of the budget,
    /// at least [`MIN_LIMIT`].
    pub fn join(&self, pid: u32, start: u64) -> Option<usize> {
        let mine = (0..SLOTS).find(|&i| self.slot(i).pid.load(Acquire) == pid);
        let i = mine.or_else(|| (0..SLOTS).find(|&i| self.slot(i).pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok()))?;
        let s = self.slot(i);
        s.usage.store(0, Relaxed);
        s.resident.store(0, Relaxed);
        s.pool.store(0, Relaxed);
        s.written_back.store(0, Relaxed);
        s.tail.store(0, Relaxed);
        s.start.store(start, Relaxed);
        // Not all the room: processes often start together (a shell's `&`, a pool of
        // workers), each would take it all before the coordinator's next look.
        let room = self.budget().saturating_sub(self.total());
        let even = self.budget() / self.members().len().max(1) as u64;
        s.limit.store(room.min(even).max(MIN_LIMIT), Release);
        Some(i)
    }

    /// Gives slot `i` back (its member leaves: exit, or the runtime is dropped).
    pub fn leave(&self, i: usize) {
        let s = self.slot(i);
        s.usage.store(0, Relaxed);
        s.resident.store(0, Relaxed);
        s.pool.store(0, Relaxed);
        s.written_back.store(0, Relaxed);
        s.limit.store(0, Relaxed);
        s.pid.store(0, Release);
    }

    /// The coordinator frees the slot of a member that died without leaving: if slot
    /// `i` still names `pid` started at `start` (the caller saw that process gone).
    pub fn reap(&self, i: usize, pid: u32, start: u64) -> bool {
        let s = self.slot(i);
        if s.start.load(Relaxed) != start {
            return false;
        }
        let had = s.usage.load(Relaxed);
        s.usage.store(0, Relaxed);
        if s.pid.compare_exchange(pid, 0, AcqRel, Relaxed).is_err() {
            // Taken over meanwhile (a pid reused at once): not ours to clear.
            let _ = s.usage.compare_exchange(0, had, Relaxed, Relaxed);
            return false;
        }
        true
    }

    /// The live members.
    pub fn members(&self) -> Vec<MemberView> {
        (0..SLOTS)
            .filter_map(|i| {
                let s = self.slot(i);
                let pid = s.pid.load(Acquire);
                (pid != 0).then(|| MemberView {
                    slot: i,
                    pid,
                    start: s.start.load(Relaxed),
                    usage: s.usage.load(Relaxed),
                    limit: s.limit.load(Relaxed),
                    tail: s.tail.load(Relaxed),
                    resident: s.resident.load(Relaxed),
                    pool: s.pool.load(Relaxed),
                    written_back: s.written_back.load(Relaxed),
                })
            })
            .collect()
    }

    /// The group's charge: every member's usage plus `outside`.
    pub fn total(&self) -> u64 {
        (0..SLOTS).map(|i| self.slot(i)).filter(|s| s.pid.load(Acquire) != 0).map(|s| s.usage.load(Relaxed)).sum::<u64>()
            + self.outside()
    }
}

impl Slot {
    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Relaxed);
    }
}

/// A runtime's membership: its slot in a ledger.
pub(crate) struct Member {
    ledger: Ledger,
    slot: usize,
    /// Set once it left: the slot may be someone else's now.
    left: std::sync::atomic::AtomicBool,
    /// The last limit seen, for after leaving (exit handlers still fault).
    last_limit: AtomicU64,
}

impl Member {
    /// Joins the group whose ledger is at `path`.
    pub fn join(path: &Path) -> Result<Member, String> {
        let ledger = Ledger::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let pid = std::process::id();
        let start = start_time(pid).ok_or("cannot read /proc/self/stat")?;
        let slot = ledger.join(pid, start).ok_or_else(|| format!("the group is full ({SLOTS} processes)"))?;
        let last_limit = AtomicU64::new(ledger.slot(slot).limit.load(Relaxed));
        Ok(Member { ledger, slot, left: Default::default(), last_limit })
    }

    fn slot(&self) -> Option<&Slot> {
        (!self.left.load(Acquire)).then(|| self.ledger.slot(self.slot))
    }

    /// This process's budget: its share of the group's. Async-signal-safe (two loads).
    pub fn limit(&self) -> u64 {
        match self.slot() {
            Some(s) => s.limit.load(Relaxed).max(MIN_LIMIT),
            None => self.last_limit.load(Relaxed).max(MIN_LIMIT),
        }
    }

    pub fn group_budget(&self) -> u64 {
        self.ledger.budget()
    }

    /// The group's charge now (every member's last published usage, and `outside`).
    pub fn group_usage(&self) -> u64 {
        self.ledger.total()
    }

    pub fn clock(&self) -> &AtomicU64 {
        self.ledger.clock()
    }

    /// Publishes what this process charges (the reclaimer does, every few ms); true if
    /// its share grew since the last time (faults sleeping for room may go on).
    pub fn publish(&self, usage: u64, resident: u64, pool: u64, written_back: u64, tail: u64) -> bool {
        let Some(s) = self.slot() else { return false };
        s.usage.store(usage, Relaxed);
        s.resident.store(resident, Relaxed);
        s.pool.store(pool, Relaxed);
        s.written_back.store(written_back, Relaxed);
        s.tail.store(tail, Relaxed);
        let limit = s.limit.load(Relaxed);
        limit > self.last_limit.swap(limit, Relaxed)
    }

    pub fn leave(&self) {
        if let Some(s) = self.slot() {
            self.last_limit.store(s.limit.load(Relaxed), Relaxed);
            self.left.store(true, Release);
            self.ledger.leave(self.slot);
        }
    }
}

/// When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22):
/// with the pid, it names one process for good.
pub fn start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|s| s.start)
}

/// What the coordinator reads of a process in /proc/PID/stat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: R, S, D, Z (zombie), X (dead)...
    pub state: char,
    /// Field 4.
    pub ppid: u32,
    /// Field 22, clock ticks since boot.
    pub start: u64,
}

impl ProcStat {
    /// Whether the process is still running (or may run): neither a zombie nor dead.
    pub fn alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// `None` when `pid` names no process, also when it names a thread that is not its
/// process's first: /proc/TID answers for threads too (unlisted), with their own start.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let tgid = status.lines().find_map(|l| l.strip_prefix("Tgid:"))?.trim().parse::<u32>().ok()?;
    if tgid != pid {
        return None;
    }
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn parse_stat(stat: &str) -> Option<ProcStat> {
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let mut f = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let start = f.nth(17)?.parse().ok()?;
    Some(ProcStat { state, ppid, start })
}

/// Anonymous memory of `pid` as a memory cgroup would charge it: its proportional
/// share (PSS) of the anonymous pages it maps, so that pages a forked child shares
/// with its parent are not counted twice. 0 for a process that is gone.
pub fn anon_pss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok().and_then(|t| parse_pss_anon(&t)).unwrap_or(0)
}

/// [`anon_pss`] of a process a member forked that has not joined yet (its runtime is
/// taking over): it shares most of its pages with that member, which is charged for
/// them in full (as a memory cgroup charges a shared page to whoever touched it
/// first), so only what it has of its own counts: its private dirty pages, at most its
/// anonymous memory. By PSS, a Python child forked from 192 MiB under 48M counted
/// half its parent's pool and heap again until it joined, and the group read 16-40%
/// over a budget its tree held.
pub fn anon_private(pid: u32) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else { return 0 };
    match (rollup_field(&text, "Anonymous:"), rollup_field(&text, "Private_Dirty:")) {
        (Some(anon), Some(private)) => anon.min(private),
        _ => parse_pss_anon(&text).unwrap_or(0),
    }
}

/// Pss_Anon of a smaps_rollup text, bytes; None without one.
pub fn parse_pss_anon(text: &str) -> Option<u64> {
    rollup_field(text, "Pss_Anon:")
}

/// A `Name: N kB` field of a smaps_rollup text, bytes.
pub fn rollup_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find_map(|l| l.strip_prefix(name))?;
    let kb: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// The children of every thread of `pid` (/proc/PID/task/*/children; a thread that
/// ends meanwhile is skipped). Empty on a kernel without those lists
/// (CONFIG_PROC_CHILDREN: see whether /proc/thread-self/children exists).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks.flatten().filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok()).flat_map(|l| parse_children(&l)).collect()
}

/// The pids of a /proc/PID/task/TID/children file.
pub fn parse_children(text: &str) -> Vec<u32> {
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// What [`shares`] needs of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// What it charges now.
    pub usage: u64,
    /// Group-clock stamp of its coldest memory (0 unknown, TAIL_NONE nothing to evict).
    pub tail: u64,
    /// What of `usage` it cannot give back: memory its runtime does not manage.
    pub fixed: u64,
    /// It uses most of its limit (its reclaimer works to stay under it): it would grow
    /// into more room, where an idle member leaves room unused.
    pub pressed: bool,
}

impl Demand {
    pub fn of(m: &MemberView) -> Demand {
        Demand {
            usage: m.usage,
            tail: m.tail,
            fixed: m.usage.saturating_sub(m.resident + m.pool),
            // A member's reclaimer keeps it between 80% and 90% of its limit (its
            // watermarks): at 3/4 or more, it is at the limit's edge, not idle.
            pressed: m.limit > 0 && m.usage >= m.limit / 4 * 3,
        }
    }

    /// The limit at which what it holds sits at its high watermark: below that, its
    /// reclaimer evicts.
    fn keep(&self) -> u64 {
        (self.usage as u128 * 100).div_ceil(u128::from(crate::HIGH_WATERMARK_PERCENT)) as u64
    }

    /// How far the rule may cut it before it cuts everyone: what it cannot give back,
    /// plus a quarter of an even share of `avail` among `n`, so that none is starved
    /// (never above what it holds).
    fn floor(&self, avail: u64, n: u64) -> u64 {
        self.usage.min(self.fixed + (avail / n / 4).max(MIN_LIMIT))
    }
}

/// Splits `avail` bytes (the group's budget less what processes without a runtime
/// hold) into limits, one per member, adding up to `avail` (but for the floor of
/// [`MIN_LIMIT`] each: a group of more members than `avail` has room for runs over).
///
/// - While the members fit, each keeps what it has, with the room to hold it below
///   its high watermark, and the room left is shared out: members that press on their
///   limits share it, and idle ones get a quarter of an even share each, enough to
///   grow until the next call (evenly, when none presses). An even split would leave
///   an idle member's part unused while a busy one thrashes under its own (a server
///   beside the shell that started it). Given only what it holds plus that quarter,
///   an idle member sat past its high watermark and evicted a tenth of what it held
///   at every call that found it idle: two compilers of a `make -j2` under 116 MiB,
///   the group at 70-90 MiB, swapped in 4-9 GiB each, the build 5x slower than with
///   per-process budgets. When keeping that room for everyone does not fit (the group
///   within a tenth of its budget), limits are in proportion to what each holds.
/// - When they do not, the excess comes from the coldest memory first: members in
///   order of their `tail` (oldest first; unknown counts as oldest, so an idle member
///   that never evicted is asked first and then says), each down to a floor: what it
///   cannot give back (its unmanaged memory: cutting that only starves it) plus a
///   quarter of an even share. What is still over after that is taken from every
///   member in proportion to what it holds.
///
/// Called every few milliseconds by the coordinator; a member whose limit falls below
/// its usage evicts (its reclaimer), its tail moves on, and the next call may pick
/// another member: over many calls the coldest memory of the group goes first.
pub fn shares(avail: u64, members: &[Demand]) -> Vec<u64> {
    let n = members.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let total: u64 = members.iter().map(|m| m.usage).sum();
    if total <= avail {
        let kept: u64 = members.iter().map(Demand::keep).sum();
        if kept > avail {
            // Within a tenth of the budget: every member at the same fraction of its
            // limit, past its high watermark as the group is past its own, so that all
            // evict a little rather than one a lot.
            let mut limits: Vec<u64> = members.iter().map(|m| (m.usage as u128 * avail as u128 / total as u128) as u64).collect();
            let short = avail - limits.iter().sum::<u64>(); // less than n, from rounding down
            for l in limits.iter_mut().take(short as usize) {
                *l += 1;
            }
            return limits.into_iter().map(|l| l.max(MIN_LIMIT)).collect();
        }
        let room = avail - kept;
        let pressed = members.iter().filter(|m| m.pressed).count() as u64;
        let (idle_each, busy) = match pressed {
            0 => (0, n),
            p => (room / n / 4, p),
        };
        let rest = room - idle_each * (n - pressed);
        let (each, extra) = (rest / busy, rest % busy);
        let mut k = 0;
        return members
            .iter()
            .map(|m| {
                let part = if pressed == 0 || m.pressed {
                    k += 1;
                    each + u64::from(k <= extra)
                } else {
                    idle_each
                };
                (m.keep() + part).max(MIN_LIMIT)
            })
            .collect();
    }
    let mut limits: Vec<u64> = members.iter().map(|m| m.usage).collect();
    let mut excess = total - avail;
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by_key(|&i| (members[i].tail, i));
    for &i in &order {
        if excess == 0 {
            break;
        }
        let cut = (limits[i] - members[i].floor(avail, n)).min(excess);
        limits[i] -= cut;
        excess -= cut;
    }
    if excess > 0 {
        // Everyone is at its floor (only possible when avail is tiny): share the rest
        // of the cut in proportion to what each holds.
        let held: u64 = limits.iter().sum();
        for l in limits.iter_mut() {
            let cut = ((*l as u128 * excess as u128).div_ceil(held.max(1) as u128)) as u64;
            *l -= cut.min(*l);
        }
    }
    limits.into_iter().map(|l| l.max(MIN_LIMIT)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const M: u64 = 1 << 20;

    fn d(usage: u64, tail: u64) -> Demand {
        Demand { usage: usage * M, tail, fixed: 0, pressed: false }
    }

    #[test]
    fn room_is_shared_evenly_and_limits_add_up() {
        // Each keeps what it holds below its high watermark (100/0.9, 300/0.9), and
        // the rest is split evenly: none presses.
        let l = shares(1024 * M, &[d(100, 5), d(300, 1)]);
        let keep = [d(100, 5).keep(), d(300, 1).keep()];
        let each = (1024 * M - keep[0] - keep[1]) / 2;
        assert_eq!(l, vec![keep[0] + each + 1, keep[1] + each]);
        assert_eq!(shares(512 * M, &[d(0, TAIL_NONE)]), vec![512 * M]);
        assert!(shares(512 * M, &[]).is_empty());
    }

    #[test]
    fn the_coldest_member_gives_first_but_is_not_starved() {
        // 1000M over a budget of 800M: the coldest (tail 1) gives all 200M.
        let l = shares(800 * M, &[d(500, 9), d(500, 1)]);
        assert_eq!(l, vec![500 * M, 300 * M]);
        // Down to its floor (a quarter of an even share, 100M)...
        let l = shares(800 * M, &[d(700, 9), d(300, 1)]);
        assert_eq!(l, vec![700 * M, 100 * M]);
        // ...and no further: the next coldest gives the rest.
        let l = shares(800 * M, &[d(900, 9), d(200, 1)]);
        assert_eq!(l, vec![700 * M, 100 * M]);
        // Unknown (0) counts as coldest; nothing to evict (TAIL_NONE) as the hottest.
        let l = shares(100 * M, &[d(100, TAIL_NONE), d(100, 0)]);
        assert_eq!(l[1], 12 * M + M / 2);
    }

    #[test]
    fn stat_lines_parse_whatever_the_command_is_called() {
        let line = "42 (a (b) c) S 7 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 1000 100 18446744073709551615";
        assert_eq!(parse_stat(line), Some(ProcStat { state: 'S', ppid: 7, start: 123456 }));
        assert_eq!(parse_stat("42 (x) Z 1"), None);
        let me = proc_stat(std::process::id()).unwrap();
        assert!(me.alive() && me.ppid > 0 && me.start > 0);
        // SAFETY: gettid takes nothing.
        let tid = unsafe { libc::gettid() } as u32;
        if tid != std::process::id() {
            assert_eq!(proc_stat(tid), None, "a thread is not a process");
        }
        assert!(anon_pss(std::process::id()) > 0);
    }

    #[test]
    fn what_a_member_cannot_give_back_is_not_asked_of_it() {
        // 200M over. The coldest holds 300M of which 150M unmanaged: it goes down to
        // that plus a quarter share (100M), giving 50M; the warmer one gives the rest.
        let cold = Demand { fixed: 150 * M, ..d(300, 1) };
        assert_eq!(shares(800 * M, &[d(700, 9), cold]), vec![550 * M, 250 * M]);
        // All of it unmanaged: nothing is asked of it.
        let cold = Demand { fixed: 300 * M, ..d(300, 1) };
        assert_eq!(shares(800 * M, &[d(700, 9), cold]), vec![500 * M, 300 * M]);
        // Demand::of: unmanaged is what usage holds beyond resident and pool.
        let v = MemberView { slot: 0, pid: 1, start: 0, usage: 100 * M, limit: 0, tail: 3, resident: 60 * M, pool: 10 * M, written_back: 0 };
        assert_eq!(Demand::of(&v), Demand { usage: 100 * M, tail: 3, fixed: 30 * M, pressed: false });
        // At 3/4 of its limit or more, it presses.
        assert!(Demand::of(&MemberView { limit: 130 * M, ..v }).pressed);
        assert!(!Demand::of(&MemberView { limit: 140 * M, ..v }).pressed);
    }

    #[test]
    fn room_goes_to_members_that_press_on_their_limits() {
        // A server at its limit beside an idle shell and client: 48M of room. Each idle
        // one gets a quarter of an even share (4M), the server the rest.
        // (Each first keeps what it holds below its high watermark: 6.7M, 44.4M, 6.7M.)
        let busy = Demand { pressed: true, ..d(40, 5) };
        let (idle, keep) = (d(6, 1), |m: Demand| m.keep());
        let room = 100 * M - 2 * keep(idle) - keep(busy);
        let l = shares(100 * M, &[idle, busy, d(6, 2)]);
        assert_eq!(l, vec![keep(idle) + room / 12, 100 * M - 2 * (keep(idle) + room / 12), keep(idle) + room / 12]);
        // Two press: they split what the idle one leaves.
        let l = shares(100 * M, &[idle, busy, Demand { pressed: true, ..d(6, 2) }]);
        let rest = room - room / 12;
        assert_eq!(l, vec![keep(idle) + room / 12, keep(busy) + rest / 2 + rest % 2, keep(idle) + rest / 2]);
    }

    proptest! {
        /// Limits add up to what is available whenever the floors allow it, nobody is
        /// cut below its floor while someone warmer holds more, and a group that fits
        /// is not squeezed.
        #[test]
        fn shares_add_up(avail in 64u64..4096, usages in prop::collection::vec((0u64..2048, 0u64..8, 0u64..=100, any::<bool>()), 1..12)) {
            let avail = avail * M;
            let members: Vec<Demand> =
                usages.iter().map(|&(u, t, fixed_pct, pressed)| Demand { fixed: u * M / 100 * fixed_pct, pressed, ..d(u, t) }).collect();
            let limits = shares(avail, &members);
            prop_assert_eq!(limits.len(), members.len());
            let total: u64 = members.iter().map(|m| m.usage).sum();
            let sum: u64 = limits.iter().sum();
            let floors: u64 = members.iter().map(|m| m.floor(avail, members.len() as u64)).sum();
            let kept: u64 = members.iter().map(Demand::keep).sum();
            if total <= avail {
                prop_assert!(sum >= avail && members.iter().zip(&limits).all(|(m, l)| *l >= m.usage));
                if kept <= avail {
                    // None is left past its high watermark: none is made to evict.
                    prop_assert!(members.iter().zip(&limits).all(|(m, l)| *l >= m.keep()));
                    // While someone presses, an idle member gets no more than a quarter share.
                    if members.iter().any(|m| m.pressed) {
                        let quarter = (avail - kept) / members.len() as u64 / 4;
                        for (m, l) in members.iter().zip(&limits) {
                            prop_assert!(m.pressed || *l <= (m.keep() + quarter).max(MIN_LIMIT));
                        }
                    }
                }
            } else if floors <= avail {
                // At the floor of MIN_LIMIT each at most over.
                prop_assert!(sum <= avail + MIN_LIMIT * members.len() as u64, "{sum} > {avail}");
                prop_assert!(sum >= avail.min(total));
                for (i, m) in members.iter().enumerate() {
                    prop_assert!(limits[i] <= m.usage.max(MIN_LIMIT));
                    prop_assert!(limits[i] >= m.floor(avail, members.len() as u64), "cut below its floor");
                }
            }
            prop_assert!(limits.iter().all(|&l| l >= MIN_LIMIT));
        }
    }

    fn ledger() -> (Ledger, std::os::fd::OwnedFd) {
        Ledger::create(1 << 30).unwrap()
    }

    /// The socket hands the ledger to whom `may_have` allows, and nothing to others.
    #[test]
    fn the_ledger_is_handed_over_its_socket_to_allowed_processes_only() {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        let (ledger, fd) = ledger();
        let me = std::process::id();
        for (allowed, name) in [(true, format!("uzswap-test-{me}-yes")), (false, format!("uzswap-test-{me}-no"))] {
            let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
            let served = fd.try_clone().unwrap();
            std::thread::spawn(move || Ledger::serve(served, listener, |pid| allowed && pid == me));
            match ledger_from_socket(&name) {
                Ok(file) => {
                    assert!(allowed, "a process not allowed got the ledger");
                    let other = Ledger::map(&file).unwrap();
                    assert_eq!(other.budget(), ledger.budget());
                }
                Err(e) => assert!(!allowed, "refused: {e}"),
            }
        }
    }

    #[test]
    fn members_open_the_ledger_by_path_and_join_leave_and_rejoin_after_exec() {
        use std::os::fd::AsRawFd;
        let (l, fd) = ledger();
        let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let m = Member::join(&path).unwrap();
        assert_eq!(m.limit(), 1 << 30, "the first limit is the room left");
        m.publish(100 * M, 80 * M, 20 * M, 0, 7);
        assert_eq!(l.total(), 100 * M);
        let v = l.members();
        assert_eq!((v.len(), v[0].pid, v[0].tail), (1, std::process::id(), 7));
        // After exec the same pid takes its slot back, with nothing charged.
        let again = Member::join(&path).unwrap();
        assert_eq!((again.slot, l.total()), (m.slot, 0));
        l.slot(m.slot).set_limit(64 * M);
        assert_eq!(again.limit(), 64 * M);
        again.leave();
        assert!(l.members().is_empty());
        assert_eq!(again.limit(), 64 * M, "after leaving, the last limit holds");
        assert!(Ledger::open(Path::new("/proc/self/stat")).is_err());
    }

    /// Several threads join, publish and leave under made-up pids while another reaps
    /// and sums: the total is always the sum of what live members last published.
    #[test]
    fn join_publish_leave_and_reap_from_many_threads() {
        let (l, _fd) = ledger();
        let l = &l;
        std::thread::scope(|s| {
            for t in 0..4u32 {
                s.spawn(move || {
                    for k in 0..2000u32 {
                        let pid = 1_000_000 + t * 100_000 + k;
                        let i = l.join(pid, k as u64).expect("a free slot");
                        l.slot(i).usage.store(M, Relaxed);
                        if k % 3 == 0 {
                            // Dies without leaving: the reaper's.
                            while l.slot(i).pid.load(Acquire) == pid {
                                l.reap(i, pid, k as u64);
                            }
                        } else {
                            l.leave(i);
                        }
                    }
                });
            }
            s.spawn(move || {
                for _ in 0..2000 {
                    // Never more than 4 members of 1 MiB each.
                    assert!(l.total() <= 4 * M);
                }
            });
        });
        assert_eq!(l.total(), 0);
        assert!(l.members().is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Join(u32),
        Charge(u32, u64),
        Leave(u32),
        Die(u32),
    }

    proptest! {
        /// The ledger against a model (a map pid -> usage) over random joins, charges,
        /// leaves and deaths: the total and the members are the model's after each step.
        #[test]
        fn ledger_matches_a_model(ops in prop::collection::vec(prop_oneof![
            (1u32..20).prop_map(Op::Join),
            (1u32..20, 0u64..1000).prop_map(|(p, b)| Op::Charge(p, b)),
            (1u32..20).prop_map(Op::Leave),
            (1u32..20).prop_map(Op::Die),
        ], 1..200)) {
            let (l, _fd) = ledger();
            let mut model: std::collections::BTreeMap<u32, (usize, u64)> = Default::default();
            for op in ops {
                match op {
                    Op::Join(p) => {
                        let i = l.join(p, p as u64).unwrap();
                        if let Some((j, _)) = model.get(&p) { prop_assert_eq!(*j, i); }
                        model.insert(p, (i, 0));
                    }
                    Op::Charge(p, b) => if let Some((i, u)) = model.get_mut(&p) {
                        l.slot(*i).usage.store(b, Relaxed);
                        *u = b;
                    },
                    Op::Leave(p) => if let Some((i, _)) = model.remove(&p) { l.leave(i) },
                    Op::Die(p) => if let Some((i, _)) = model.remove(&p) { prop_assert!(l.reap(i, p, p as u64)) },
                }
                prop_assert_eq!(l.total(), model.values().map(|(_, u)| u).sum::<u64>());
                let mut pids: Vec<u32> = l.members().iter().map(|m| m.pid).collect();
                pids.sort();
                prop_assert_eq!(pids, model.keys().copied().collect::<Vec<_>>());
            }
        }
    }
}
