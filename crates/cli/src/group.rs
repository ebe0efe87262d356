//! `uzswap run`'s side of a group: the coordinator of one budget for the whole process
//! tree (the ledger and the rule that splits the budget are the runtime's group.rs).
//!
//! `uzswap run` makes the ledger, names it to the program in `UZSWAP_GROUP`, becomes
//! the tree's subreaper (daemonized grandchildren stay in the tree, and their exit is
//! ours to see), and runs [`coordinate`] on a thread of its own until the program
//! exits. Every `TICK` it:
//! - takes back the share of members that died without leaving (SIGKILL, `_exit`, a
//!   crash): a member whose pid and start time no longer name a live process;
//! - every `TREE_EVERY` ticks walks the tree (/proc) and counts the processes that
//!   have no runtime (a static binary, a setuid program, a forked child) by their
//!   anonymous PSS: they are not managed, but they hold memory and push the others;
//!   one that joins or ends meanwhile stops counting there at once;
//! - sets every member's limit from `shares` (runtime group.rs);
//! - records the group's peak, and about once a second publishes [`GroupStats`]
//!   (`uzswap stat` and `top` show it).
//!
//! Members read their limit from shared memory: nothing here is on their fault path,
//! and a coordinator that is slow (a busy machine) only leaves the shares as they were.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_runtime::group::{self, Demand, Ledger, MemberView};
use std::path::{Path, PathBuf};
use uzswap_runtime::{GroupMemberStats, GroupStats, RuntimeStats};

const TICK: Duration = Duration::from_millis(10);
const TREE_EVERY: u32 = 20;
const PUBLISH_EVERY: Duration = Duration::from_secs(1);

pub struct Group {
    fd: OwnedFd,
    /// The abstract socket that hands the ledger to descendants that cannot open `fd`'s path.
    socket: Option<String>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<GroupStats>>,
}

impl Group {
    /// Makes the ledger and starts coordinating this process's descendants. A member
    /// that dies without leaving gets its last live stats appended to `stats_file` as
    /// its line (it could not write one).
    pub fn start(budget: u64, stats_file: Option<PathBuf>) -> std::io::Result<Group> {
        let (ledger, fd) = Ledger::create(budget)?;
        // SAFETY: prctl with integer arguments, about this process only.
        if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Where a process of the tree that changed its user asks for the ledger
        // (runtime group.rs `GROUP_SOCKET_VAR`): served to descendants only, for as long
        // as this process lives. The name is random, so that no one can take it first;
        // without it (bind failed), such processes hold their budget alone, and say so.
        use std::hash::{BuildHasher, Hasher};
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        let me = std::process::id();
        let socket = format!("uzswap-group-{me}-{:016x}", std::collections::hash_map::RandomState::new().build_hasher().finish());
        let socket = match SocketAddr::from_abstract_name(socket.as_bytes()).and_then(|a| UnixListener::bind_addr(&a)) {
            Ok(listener) => {
                let served = fd.try_clone()?;
                std::thread::Builder::new()
                    .name("uzswap-ledger".into())
                    .spawn(move || Ledger::serve(served, listener, |pid| descendants(me).contains(&pid)))?;
                Some(socket)
            }
            Err(e) => {
                eprintln!("uzswap run: no socket for the group's ledger ({e}): processes that change their user will hold their budgets alone");
                None
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new().name("uzswap-group".into()).spawn(move || coordinate(&ledger, &s, stats_file.as_deref()))?;
        Ok(Group { fd, socket, stop, thread: Some(thread) })
    }

    /// The variables that name the ledger to the program's processes.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let path = (group::GROUP_VAR, format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd()));
        std::iter::once(path).chain(self.socket.clone().map(|s| (group::GROUP_SOCKET_VAR, s))).collect()
    }

    /// Stops coordinating; the group's final stats.
    pub fn finish(mut self) -> GroupStats {
        self.stop.store(true, Relaxed);
        let st = self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default();
        let _ = std::fs::remove_file(uzswap_runtime::group_stats_path(std::process::id()));
        st
    }
}

/// Whether `pid` is a live process (not a zombie) that started at `start`.
fn live(pid: u32, start: u64) -> bool {
    group::proc_stat(pid).is_some_and(|s| s.alive() && s.start == start)
}

/// The descendants of `root` (not itself): from each process's threads' `children`
/// lists, so only the tree is read; on a kernel without them (CONFIG_PROC_CHILDREN),
/// from every process's parent.
fn descendants(root: u32) -> Vec<u32> {
    if !std::path::Path::new("/proc/thread-self/children").exists() {
        return descendants_by_parent(root);
    }
    // A thread or process that ends mid-walk is skipped: its children are reparented
    // to us (the subreaper) and found next time.
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        for c in group::children(p) {
            out.push(c);
            todo.push(c);
        }
    }
    out
}

fn descendants_by_parent(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for pid in dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
        if let Some(s) = group::proc_stat(pid).filter(|s| s.state != 'Z') {
            children.entry(s.ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).into_iter().flatten() {
            out.push(c);
            todo.push(c);
        }
    }
    out
}

fn coordinate(ledger: &Ledger, stop: &AtomicBool, stats_file: Option<&Path>) -> GroupStats {
    let me = std::process::id();
    let mut st = GroupStats { pid: me, budget_bytes: ledger.budget(), ..Default::default() };
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let mut last_publish = Instant::now();
    let mut tick = 0u32;
    // The processes outside at the last walk, with their anonymous PSS. Counted every
    // tick but those that have joined since: a forked child is outside until its
    // runtime is up, and counted both ways until the next walk it made a fork-heavy
    // program's group peak read over its budget while its tree was not.
    let mut outsiders: HashMap<u32, u64> = HashMap::new();
    while !stop.load(Relaxed) {
        let members = live_members(ledger, &mut st, stats_file);
        for m in &members {
            if seen.insert((m.pid, m.start)) {
                st.members_seen += 1;
            }
        }
        let ours: HashSet<u32> = members.iter().map(|m| m.pid).collect();
        if tick.is_multiple_of(TREE_EVERY) {
            let charge = |p: u32| match group::proc_stat(p) {
                Some(st) if ours.contains(&st.ppid) => group::anon_private(p),
                _ => group::anon_pss(p),
            };
            outsiders = descendants(me).into_iter().filter(|p| !ours.contains(p)).map(|p| (p, charge(p))).collect();
        }
        outsiders.retain(|&p, _| !ours.contains(&p) && group::proc_stat(p).is_some_and(|s| s.alive()));
        ledger.set_outside(outsiders.values().sum());
        tick = tick.wrapping_add(1);
        let avail = ledger.budget().saturating_sub(ledger.outside());
        let demands: Vec<Demand> = members.iter().map(Demand::of).collect();
        for (m, limit) in members.iter().zip(group::shares(avail, &demands)) {
            ledger.slot(m.slot).set_limit(limit);
        }
        let usage = members.iter().map(|m| m.usage).sum::<u64>() + ledger.outside();
        st.peak_bytes = st.peak_bytes.max(usage);
        if last_publish.elapsed() >= PUBLISH_EVERY {
            fill(&mut st, ledger, &members, usage);
            if let Err(e) = uzswap_runtime::write_group_stats(&st) {
                eprintln!("uzswap run: cannot publish the group's stats: {e}");
            }
            last_publish = Instant::now();
        }
        std::thread::sleep(TICK);
    }
    // The program has exited: whoever died since the last look is reaped now, so the
    // report does not depend on when that look was.
    let members = live_members(ledger, &mut st, stats_file);
    let usage = members.iter().map(|m| m.usage).sum::<u64>() + ledger.outside();
    fill(&mut st, ledger, &members, usage);
    st
}

/// The members still alive; those that died without leaving have their share taken
/// back (and their stats file removed).
fn live_members(ledger: &Ledger, st: &mut GroupStats, stats_file: Option<&Path>) -> Vec<MemberView> {
    let mut members = ledger.members();
    members.retain(|m| {
        if live(m.pid, m.start) {
            return true;
        }
        if ledger.reap(m.slot, m.pid, m.start) {
            st.reaped += 1;
            if let (Some(file), Ok(mut last)) = (stats_file, uzswap_runtime::read_stats(m.pid)) {
                // As at exit: a process that managed nothing (a shell) leaves no line.
                if last.worth_a_line() {
                    last.ended_without_exit_handlers = true;
                    append_line(file, &last);
                }
            }
            let _ = std::fs::remove_file(uzswap_runtime::stats_path(m.pid));
        }
        false
    });
    members
}

/// Appends `st` to the stats file as one line, in one write (O_APPEND), as the shim
/// writes its own: lines of processes ending at once do not interleave.
fn append_line(file: &Path, st: &RuntimeStats) {
    use std::io::Write;
    let line = serde_json::to_string(st).unwrap_or_default() + "\n";
    let written = std::fs::OpenOptions::new().append(true).create(true).open(file).and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("uzswap run: cannot write the stats of pid {} to {}: {e}", st.pid, file.display());
    }
}

fn fill(st: &mut GroupStats, ledger: &Ledger, members: &[MemberView], usage: u64) {
    st.budget_bytes = ledger.budget();
    st.usage_bytes = usage;
    st.outside_bytes = ledger.outside();
    st.members = members
        .iter()
        .map(|m| GroupMemberStats {
            pid: m.pid,
            usage_bytes: m.usage,
            limit_bytes: m.limit,
            resident_bytes: m.resident,
            pool_bytes: m.pool,
            written_back_bytes: m.written_back,
        })
        .collect();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of walking the tree find the same processes: a shell's two children.
    #[test]
    fn descendants_are_found_either_way() {
        let mut sh = std::process::Command::new("sh").args(["-c", "sleep 5 & sleep 5; wait"]).spawn().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut found = descendants(sh.id());
        while found.len() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            found = descendants(sh.id());
        }
        let mut by_parent = descendants_by_parent(sh.id());
        let mine = descendants(std::process::id());
        let _ = sh.kill();
        let _ = sh.wait();
        found.sort_unstable();
        by_parent.sort_unstable();
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found, by_parent);
        assert!(mine.contains(&sh.id()) && found.iter().all(|p| mine.contains(p)), "{mine:?}");
    }
}
