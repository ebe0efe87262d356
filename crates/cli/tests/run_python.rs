//! `uzswap run` of a Python program that fills 512 MiB in 32 MiB buffers under a 128 MiB
//! budget and checks every byte (examples/fill.py). About 10 s.

mod run_support;
use run_support::*;

#[test]
fn python_fills_and_verifies_512m_under_a_128m_budget() {
    let s = Scratch::new("python");
    let stats = s.0.join("stats.jsonl");
    let fill = examples().join("fill.py");
    let o = uzswap(
        &s,
        &["run", "--budget", "128M", "--stats", stats.to_str().unwrap(), "--", "python3", fill.to_str().unwrap(), "512", "32", "1"],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("all bytes correct"), "{}", text(&o));
    let lines = stats_lines(&stats);
    let v = assert_swapped(&lines, "fill.py");
    let peak = v["managed_peak_bytes"].as_u64().unwrap();
    assert!(peak >= 512 << 20, "only {peak} bytes were managed");
    // The summary is printed after the program, kernel names and all.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("zswpout") && err.contains("hugepages-64kB"), "{}", text(&o));
}
