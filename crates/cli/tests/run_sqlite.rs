//! `uzswap run` of sqlite3 building a 600k-row table in memory (about 150 MiB in its
//! brk heap, which glibc grows by a brk of its own that no preload sees) under a
//! 64 MiB budget: the heap is adopted by the scan as it grows, and the group stays
//! within the bench's bound, budget x 1.15 + 32 MiB. With scans only every 200 ms the
//! heap grew unmanaged between them: peaks of 137, 146 and 157 MiB in 3 runs of 5;
//! scanning once it has grown by a sixteenth of the budget, 76-86 MiB in 5 of 5.

mod run_support;
use run_support::*;
use std::process::Command;

#[test]
fn sqlite3_builds_a_table_within_its_budget() {
    if Command::new("sqlite3").arg("-version").output().is_err() {
        eprintln!("SKIP: sqlite3 is not installed");
        return;
    }
    let s = Scratch::new("sqlite");
    let sql = s.0.join("table.sql");
    std::fs::write(
        &sql,
        "CREATE TABLE t(a INTEGER, b TEXT);\n\
         WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 600000)\n\
         INSERT INTO t SELECT x, printf('%.200c', 'a') || x FROM c;\n\
         SELECT 'sum', sum(a), count(*) FROM t;\n",
    )
    .unwrap();
    let read = format!(".read {}", sql.display());
    for run in 0..3 {
        let o = uzswap(&s, &["run", "--budget", "64M", "--", "sqlite3", ":memory:", &read]);
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("sum|180000300000|600000"), "run {run}: {}", text(&o));
        let peak = group_peak_mib(&o, "64.0 MiB");
        assert!(peak <= 64.0 * 1.15 + 32.0, "run {run}: the group peaked at {peak} MiB under 64: {}", text(&o));
    }
}
