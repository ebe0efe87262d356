//! `uzswap run` of a Node program (examples/node_hold.js: 1,000 arrays of 16k integers
//! and 1,000 strings of 64 KiB on V8's heap, moved through the kernel every common way,
//! 16 child processes spawned, then checked) under a 128 MiB budget, as root and as an
//! ordinary user. V8's heap is memory it reserves and commits itself, each page marked
//! MADV_DONTFORK: adopted in place (crates/shim cover.rs). With UFFD_USER_MODE_ONLY
//! nothing of it used to be adopted (the group peaked at 275 MiB), and every child
//! spawned (libuv forks) brought the whole heap back first: 1.2 s a fork, the group at
//! 321 MiB. About 15 s each. SKIPs without node.

mod run_support;
use run_support::*;
use std::process::Command;

/// One at a time: each run's bound assumes the machine is not busy with the other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn node_holds(as_nobody: bool) {
    if Command::new("node").arg("--version").output().is_err() {
        eprintln!("SKIP: node is not installed");
        return;
    }
    if as_nobody && !can_become_nobody() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = Scratch::new(if as_nobody { "node-nobody" } else { "node" });
    give_to_nobody(&s);
    let stats = s.0.join("stats.jsonl");
    // timeout kills the whole process group: uzswap run, node and its children.
    let mut wrapper = vec!["timeout", "-s", "KILL", "300"];
    if as_nobody {
        wrapper.extend(AS_NOBODY);
    }
    let o = uzswap_command_via(&s, &wrapper, &["run", "--budget", "128M", "--stats"])
        .arg(&stats)
        .args(["--", "node"])
        .arg(examples().join("node_hold.js"))
        .arg("1000")
        .arg(&s.0)
        .output()
        .expect("uzswap run node");
    // What is adopted at exit varies (57 to 125 MiB seen as uid 65534): the bound on
    // the group's peak is what fails when the heap is not managed.
    assert_heap_managed(&o, &stats, 128, "node: ok 1000", 32);
}

#[test]
fn node_heap_managed_as_an_ordinary_user() {
    node_holds(true);
}

/// Everything adopted: glibc's heap and arenas too, and V8's heap whatever made it.
#[test]
fn node_heap_managed_as_root() {
    node_holds(false);
}
