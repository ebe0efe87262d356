//! `uzswap run` of C programs written for these tests (examples/mapper.c, signals.c, ...),
//! with budgets far below their footprint, on both fault paths.

mod run_support;
use run_support::*;

fn run_checked(s: &Scratch, fault_path: &str, budget: &str, prog: &std::path::Path, arg: &str, expect: &str) {
    let stats = s.0.join(format!("{fault_path}.jsonl"));
    let o = uzswap(
        s,
        &["run", "--budget", budget, "--fault-path", fault_path, "--stats", stats.to_str().unwrap(), "--", prog.to_str().unwrap(), arg],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(expect), "{}", text(&o));
    assert_swapped(&stats_lines(&stats), &format!("{} ({fault_path})", prog.display()));
}

/// mmap, madvise, read/write/pread/pwrite/pipe, threads, fork, mremap, munmap, malloc
/// family: 256 MiB under 64 MiB.
#[test]
fn mapper_thread_path() {
    let s = Scratch::new("mapper-thread");
    let prog = build_c("mapper", &s.0);
    run_checked(&s, "thread", "64M", &prog, "256", "mapper: ok");
}

/// The same on the SIGBUS path, where the shim makes system calls on swapped-out
/// memory work (touch and retry on EFAULT).
#[test]
fn mapper_sigbus_path() {
    let s = Scratch::new("mapper-sigbus");
    let prog = build_c("mapper", &s.0);
    run_checked(&s, "sigbus", "64M", &prog, "256", "mapper: ok");
}

/// The program's own SIGSEGV (sigaction) and SIGBUS (signal) handlers see their signals.
#[test]
fn own_signal_handlers_thread_path() {
    let s = Scratch::new("signals-thread");
    let prog = build_c("signals", &s.0);
    run_checked(&s, "thread", "32M", &prog, "128", "signals: ok");
}

/// On the SIGBUS path uzswap owns SIGBUS; the program's handler is chained.
#[test]
fn own_signal_handlers_sigbus_path() {
    let s = Scratch::new("signals-sigbus");
    let prog = build_c("signals", &s.0);
    run_checked(&s, "sigbus", "32M", &prog, "128", "signals: ok");
}

/// A program that a shell forks and execs still gets the shim and the settings.
#[test]
fn exec_keeps_the_shim_and_its_settings() {
    let s = Scratch::new("exec");
    let prog = build_c("mapper", &s.0);
    let stats = s.0.join("exec.jsonl");
    let script = format!("{} 96; echo shell-done", prog.display());
    let o = uzswap(&s, &["run", "--budget", "32M", "--folio-size", "128k", "--stats", stats.to_str().unwrap(), "--", "sh", "-c", &script]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("mapper: ok") && out.contains("shell-done"), "{}", text(&o));
    let lines = stats_lines(&stats);
    assert_swapped(&lines, "mapper under sh");
    let v = lines.iter().find(|v| v["command"] == "mapper").expect("a line from mapper");
    // The shell and mapper share one budget (the group's): mapper's is its share.
    assert_eq!(v["group_budget_bytes"], 32u64 << 20, "{v}");
    assert!(v["budget_bytes"].as_u64().unwrap() <= 32 << 20, "{v}");
    assert!(v["sizes"]["hugepages-128kB"].is_object(), "folio size not passed on: {v}");
}

/// examples/fdclose.c: the program closes (close_range, closefrom, a /proc/self/fd
/// loop, close of every number up to the hard limit, the raw close_range system call)
/// or dup2s over every descriptor from 3 up,
/// after most of its memory was swapped out, then checks every byte; uzswap's own
/// descriptors never take the lowest free number, not even for a moment (`watch`: 2.5 s of
/// opens while uzswap faults, reclaims and publishes its stats file). With writeback, so that the
/// backing file is among them.
fn fd_tidying(fault_path: &str) {
    let s = Scratch::new(&format!("fdclose-{fault_path}"));
    let prog = build_c("fdclose", &s.0);
    let wb = s.0.join("wb");
    std::fs::create_dir_all(&wb).unwrap();
    for way in ["close_range", "closefrom", "procfd", "dup2", "every", "raw", "watch"] {
        let stats = s.0.join(format!("{way}.jsonl"));
        let o = uzswap(
            &s,
            &[
                "run", "--budget", "32M", "--fault-path", fault_path, "--writeback-dir", wb.to_str().unwrap(),
                "--max-pool-percent", "25", "--stats", stats.to_str().unwrap(), "--", prog.to_str().unwrap(), way, "128",
            ],
        );
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("fdclose: ok"), "{way}: {}", text(&o));
        let lines = stats_lines(&stats);
        let v = assert_swapped(&lines, &format!("fdclose {way} ({fault_path})"));
        assert!(v["store"]["zswpwb"].as_u64() > Some(0), "{way}: nothing written back: {v}");
    }
}

#[test]
fn fd_tidying_thread_path() {
    fd_tidying("thread");
}

#[test]
fn fd_tidying_sigbus_path() {
    fd_tidying("sigbus");
}

/// examples/procs.c: fork, vfork, forkpty, posix_spawn (file actions; fd 0 closed),
/// daemon, system, popen and clone(CLONE_VM) with most of the memory swapped out; the
/// children that see the memory check it, the parent checks every byte after each.
/// forkpty and daemon fork inside libc, where no preload sees the call.
#[test]
fn processes_thread_path() {
    let s = Scratch::new("procs-thread");
    let prog = build_c("procs", &s.0);
    run_checked(&s, "thread", "32M", &prog, "128", "procs: ok");
}

#[test]
fn processes_sigbus_path() {
    let s = Scratch::new("procs-sigbus");
    let prog = build_c("procs", &s.0);
    run_checked(&s, "sigbus", "32M", &prog, "128", "procs: ok");
}

/// examples/sigs.c, run with SIGHUP ignored and SIGUSR2 blocked as nohup and shells
/// leave them: a blocked signal stays pending for the program (no uzswap thread takes
/// it), inherited dispositions and mask pass through `uzswap run`, a SIGBUS handler is
/// reported and run as installed (mask, SA_RESETHAND), a default SIGBUS kills, and
/// SA_ONSTACK handlers run on their stack.
fn signals_as_without(fault_path: &str) {
    use std::os::unix::process::CommandExt;
    let s = Scratch::new(&format!("sigs-{fault_path}"));
    let prog = build_c("sigs", &s.0);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_uzswap"));
    cmd.args(["run", "--budget", "32M", "--fault-path", fault_path, "--stats", "none", "--"])
        .arg(&prog)
        .args(["96", "inherited"])
        .env("UZSWAP_SHIM", shim());
    // SAFETY: runs in the forked child before exec; signal and sigprocmask are
    // async-signal-safe and change only the child.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGWINCH);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("sigs: ok"), "{}", text(&o));
}

#[test]
fn signals_as_without_uzswap_thread_path() {
    signals_as_without("thread");
}

#[test]
fn signals_as_without_uzswap_sigbus_path() {
    signals_as_without("sigbus");
}

/// examples/access.c: mprotect to every protection and back (whole range and W^X
/// flips of pieces), mlock, MADV_DONTFORK/WIPEONFORK across a fork, system calls into
/// and out of the buffer, /proc/self/mem, process_vm_readv/writev of our own pid, each
/// after the buffer was pushed out, every byte checked.
#[test]
fn access_thread_path() {
    let s = Scratch::new("access-thread");
    let prog = build_c("access", &s.0);
    run_checked(&s, "thread", "32M", &prog, "64", "access: ok");
}

#[test]
fn access_sigbus_path() {
    let s = Scratch::new("access-sigbus");
    let prog = build_c("access", &s.0);
    run_checked(&s, "sigbus", "32M", &prog, "64", "access: ok");
}

/// examples/ownmalloc.c brings its own malloc (as a jemalloc-linked program does) and
/// calls mmap and munmap while holding its allocator's lock: nothing uzswap does
/// inside them may call that malloc (an error-checking mutex turns the hang a real
/// jemalloc program got into an abort), after main starts no thread of uzswap's
/// calls it at all, and no code of uzswap's library ever does (rustc hung on a thread
/// handle std had made with it: the shim's build.rs).
fn own_allocator(fault_path: &str) {
    let s = Scratch::new(&format!("ownmalloc-{fault_path}"));
    let prog = build_c("ownmalloc", &s.0);
    run_checked(&s, fault_path, "32M", &prog, "128", "ownmalloc: ok");
}

#[test]
fn own_allocator_thread_path() {
    own_allocator("thread");
}

#[test]
fn own_allocator_sigbus_path() {
    own_allocator("sigbus");
}

/// As an ordinary user on a default kernel (no /dev/userfaultfd access, sysctl 0, no
/// CAP_SYS_PTRACE) uzswap uses a userfaultfd for user-mode faults only, says so, and
/// the shim helps the system calls examples/mapper.c makes on swapped-out memory
/// (read, write, pread, pwrite, pipes). Run as root, it drops to uid 65534 for this.
fn ordinary_user(fault_path: &str) {
    if !can_become_nobody() {
        return;
    }
    let s = Scratch::new(&format!("nobody-{fault_path}"));
    let prog = build_c("mapper", &s.0);
    give_to_nobody(&s);
    let o = uzswap_command_via(&s, &AS_NOBODY, &["run", "--budget", "32M", "--fault-path", fault_path, "--"])
        .arg(&prog)
        .arg("128")
        .output()
        .unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("mapper: ok"), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let expect = if sysctl.trim() == "1" { "vm.unprivileged_userfaultfd=1" } else { "UFFD_USER_MODE_ONLY" };
    assert!(err.contains(&format!("userfaultfd access: {expect}")), "{}", text(&o));
    assert!(err.contains("swapped out") && !err.contains("swapped out 0 B"), "nothing swapped: {}", text(&o));
    // examples/access.c too: every system call the shim helps (vectored ones
    // included), /proc/self/mem, process_vm_readv/writev, with most of it swapped out.
    let access = build_c("access", &s.0);
    let o = uzswap_command_via(&s, &AS_NOBODY, &["run", "--budget", "32M", "--fault-path", fault_path, "--"])
        .arg(&access)
        .arg("64")
        .output()
        .unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("access: ok"), "{}", text(&o));
    // examples/stdiobuf.c: streams whose FILEs its own allocator placed in managed
    // memory, flushed and filled from inside putc, fprintf, getc and fgets while their
    // buffers' folios are out (glibc's own write(2) failed with EFAULT there, "BAD
    // write", before such streams got buffers of uzswap's heap).
    let stdiobuf = build_c("stdiobuf", &s.0);
    let o = uzswap_command_via(&s, &AS_NOBODY, &["run", "--budget", "16M", "--fault-path", fault_path, "--"])
        .arg(&stdiobuf)
        .arg(&s.0)
        .output()
        .unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("stdiobuf: ok"), "{}", text(&o));
}

#[test]
fn ordinary_user_thread_path() {
    ordinary_user("thread");
}

#[test]
fn ordinary_user_sigbus_path() {
    ordinary_user("sigbus");
}

/// examples/rawmem.c: memory made by the mmap system call, sbrk, a second thread's
/// glibc arena, and a PROT_NONE reservation committed by mprotect and by MAP_FIXED
/// (none of it through a request the shim serves) is adopted in place and swapped
/// out; every byte survives rewrites, MADV_DONTNEED, munmap and a fork. Thread path
/// only: adoption needs the kernel to wait for faults in system calls.
#[test]
fn memory_made_without_libc_requests_is_adopted() {
    let s = Scratch::new("rawmem");
    let prog = build_c("rawmem", &s.0);
    let stats = s.0.join("rawmem.jsonl");
    let o = uzswap(&s, &["run", "--budget", "48M", "--stats", stats.to_str().unwrap(), "--", prog.to_str().unwrap(), "48"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("rawmem: ok"), "{}", text(&o));
    let lines = stats_lines(&stats);
    let v = assert_swapped(&lines, "rawmem");
    let adopted = |kind: &str| v["adopted_bytes"][kind].as_u64().unwrap_or(0);
    // The brk heap (48 MiB); raw, committed and arena memory (about 140 MiB).
    assert!(adopted("heap") >= 40 << 20, "heap not adopted: {v}");
    assert!(adopted("mapping") >= 120 << 20, "mappings not adopted: {v}");
}

/// examples/brktrim.c: glibc's brk heap (adopted) grown, trimmed from the top a page
/// at a time and regrown, round after round, every byte checked: the regrown top is a
/// new mapping, the program's alone, and reads what the program wrote there (it read
/// zeros in 2 to 4 of 6 runs when a folio unmapped in pieces was later taken out of
/// the new mapping; gcc's cc1 died of a corrupted heap so). Two budgets, two runs.
#[test]
fn brk_heap_trimmed_and_regrown_keeps_every_byte() {
    let s = Scratch::new("brktrim");
    let prog = build_c("brktrim", &s.0);
    for budget in ["20M", "32M"] {
        let stats = s.0.join(format!("brktrim-{budget}.jsonl"));
        let o = uzswap(&s, &["run", "--budget", budget, "--stats", stats.to_str().unwrap(), "--", prog.to_str().unwrap(), "8"]);
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("brktrim ok"), "{budget}: {}", text(&o));
        let lines = stats_lines(&stats);
        let v = assert_swapped(&lines, "brktrim");
        assert!(v["adopted_bytes"]["heap"].as_u64().unwrap_or(0) >= 32 << 20, "heap not adopted: {v}");
    }
}

/// examples/brkregrow.c: the brk heap grown, trimmed to a page inside a folio and
/// regrown: the regrown part is adopted anew (the trim left the folio torn and the
/// rest of the old region's range gone, which a new region may take), and every byte
/// is right.
#[test]
fn regrown_brk_heap_is_adopted_anew() {
    let s = Scratch::new("brkregrow");
    let prog = build_c("brkregrow", &s.0);
    let o = uzswap(&s, &["run", "--budget", "64M", "--stats", "none", "--", prog.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("brkregrow: ok"), "{}", text(&o));
    assert!(out.contains("regrown: adopted"), "{}", text(&o));
}

/// examples/dtv.c: once the brk heap is adopted, a new thread's DTV (which every access
/// to one of uzswap's thread-locals reads, holding whatever lock uzswap's code holds)
/// is not in adopted memory, where it would be swapped out; glibc used to put it in the
/// free space of that heap, and a JVM hung when one of its threads faulted on its DTV
/// holding the store's LRU lock, which the fault's reader then waited for.
#[test]
fn new_threads_dtv_is_never_adopted() {
    let s = Scratch::new("dtv");
    let prog = build_c("dtv", &s.0);
    let o = uzswap(&s, &["run", "--budget", "16M", "--stats", "none", "--", prog.to_str().unwrap(), "32"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("dtv: ok"), "{}", text(&o));
}

/// examples/forkloop.c: fork in a loop while three threads fault and rewrite memory
/// that is mostly swapped out and the reclaimer evicts: every child gets whole pages
/// at the versions the parent had, and manages memory of its own (its runtime starts
/// inside fork); the parent's bytes are all right after.
fn fork_loop(fault_path: &str) {
    let s = Scratch::new(&format!("forkloop-{fault_path}"));
    let prog = build_c("forkloop", &s.0);
    let stats = s.0.join("forkloop.jsonl");
    let o = uzswap(&s, &["run", "--budget", "32M", "--fault-path", fault_path, "--stats", stats.to_str().unwrap(), "--", prog.to_str().unwrap(), "64", "12"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("forkloop: ok"), "{}", text(&o));
    assert_swapped(&stats_lines(&stats), &format!("forkloop ({fault_path})"));
}

#[test]
fn fork_loop_thread_path() {
    fork_loop("thread");
}

#[test]
fn fork_loop_sigbus_path() {
    fork_loop("sigbus");
}

/// setgroups() with its list swapped out (examples/setgroups.c): glibc runs it on
/// every thread, uzswap's fault thread too, and without the shim's copy of the list
/// that thread faulted on it inside the kernel (a hang on the thread path, EFAULT on
/// the SIGBUS path). Needs CAP_SETGID; the program prints SKIP without it.
fn setgroups_list_swapped_out(fault_path: &str) {
    let s = Scratch::new(&format!("setgroups-{fault_path}"));
    let prog = build_c("setgroups", &s.0);
    let o = uzswap_command_via(&s, &["timeout", "-s", "KILL", "120"], &["run", "--budget", "16M", "--fault-path", fault_path, "--", prog.to_str().unwrap(), "64"])
        .output()
        .expect("run uzswap");
    let out = String::from_utf8_lossy(&o.stdout);
    if let Some(skip) = out.lines().find(|l| l.starts_with("SKIP:")) {
        eprintln!("{skip}");
        return;
    }
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.contains("setgroups: ok"), "{}", text(&o));
    // The lists were out when setgroups ran, or the test proves nothing.
    assert!(out.contains("short list of") && out.contains("long list of 4096: swapped out"), "{}", text(&o));
    assert!(!out.contains("resident"), "a list was resident when setgroups ran:\n{}", text(&o));
}

#[test]
fn setgroups_list_swapped_out_thread_path() {
    setgroups_list_swapped_out("thread");
}

#[test]
fn setgroups_list_swapped_out_sigbus_path() {
    setgroups_list_swapped_out("sigbus");
}

/// setpriv under `uzswap run`: it keeps its capabilities across its change of user
/// (PR_SET_KEEPCAPS, capset on its own thread) and changes its group after, which
/// glibc makes every thread do; uzswap's threads, without the capability by then, were
/// refused and glibc aborted the process (SIGABRT, for any program run so). The shim
/// makes that change on the program's only thread (crates/shim creds.rs). The
/// program, now uid 65534, joins root's group through `uzswap run`'s socket.
#[test]
fn setpriv_drops_privileges_under_uzswap() {
    if !can_become_nobody() {
        return;
    }
    let s = Scratch::new("setpriv");
    let mut args = vec!["run", "--budget", "32M", "--"];
    args.extend(AS_NOBODY);
    let script = "import os; b = bytearray(64 << 20); b[:] = b'x' * len(b); print(os.getuid(), b.count(b'x'))";
    args.extend(["/usr/bin/python3", "-c", script]);
    let o = uzswap_command_via(&s, &["timeout", "-s", "KILL", "60"], &args).current_dir("/").output().expect("run uzswap");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), format!("65534 {}", 64 << 20), "{}", text(&o));
    // It joined the group, though it cannot open root's /proc/<pid>/fd: it asked
    // `uzswap run`'s socket for the ledger (runtime group.rs `GROUP_SOCKET_VAR`).
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("cannot join the group"), "{}", text(&o));
    assert!(group_peak_mib(&o, "32.0 MiB") > 8.0, "the group did not see its memory:\n{}", text(&o));
}
