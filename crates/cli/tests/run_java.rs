//! `uzswap run` of a Java program (examples/JavaHold.java: 384 MiB of byte[] and a map
//! of small objects, moved through the kernel every common way, then checked) under a
//! 256 MiB budget, as root and as an ordinary user. The JVM's heap is memory it reserves
//! and commits itself: adopted in place (crates/shim cover.rs). With UFFD_USER_MODE_ONLY,
//! an ordinary user's access on a default kernel, nothing but big malloc requests used
//! to be managed, and the same run held 597 MiB; there only what the JVM reserved is
//! adopted. About 10 s. SKIPs without java and javac.
//!
//! As root two such runs at once used to hang about once in 20-60 runs: the scan had
//! adopted a pool span of uzswap's own, whose record a late forget had erased
//! (uzswap-runtime own_maps.rs), and the reader faulted on it. Each run is killed after
//! 5 minutes (a hang fails the test instead of holding CI).

mod run_support;
use run_support::*;
use std::process::Command;

/// One JVM at a time: each run's bound assumes the machine is not busy with the other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn java_holds(as_nobody: bool) {
    if Command::new("javac").arg("-version").output().is_err() || Command::new("java").arg("-version").output().is_err() {
        eprintln!("SKIP: java or javac is not installed");
        return;
    }
    if as_nobody && !can_become_nobody() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = Scratch::new(if as_nobody { "java-nobody" } else { "java" });
    let o = Command::new("javac").arg("-d").arg(&s.0).arg(examples().join("JavaHold.java")).output().expect("javac");
    assert!(o.status.success(), "javac: {}", text(&o));
    give_to_nobody(&s);
    let stats = s.0.join("stats.jsonl");
    // timeout kills the whole process group: uzswap run and the JVM.
    let mut wrapper = vec!["timeout", "-s", "KILL", "300"];
    if as_nobody {
        wrapper.extend(AS_NOBODY);
    }
    let o = uzswap_command_via(&s, &wrapper, &["run", "--budget", "256M", "--stats"])
        .arg(&stats)
        .args(["--", "java", "-Xmx1g", "-cp"])
        .arg(&s.0)
        .arg("JavaHold")
        .arg("384")
        .arg(&s.0)
        .output()
        .expect("uzswap run java");
    assert_heap_managed(&o, &stats, 256, "java: ok 384", 256);
}

#[test]
fn java_heap_managed_as_an_ordinary_user() {
    java_holds(true);
}

/// Everything adopted: glibc's heap and arenas too, and the JVM's heap whatever made it.
#[test]
fn java_heap_managed_as_root() {
    java_holds(false);
}
