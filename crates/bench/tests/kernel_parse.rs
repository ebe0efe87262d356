//! `uzswap bench kernel` pieces that need no root: parsing the workload programs'
//! output, the uzswap side reported as unavailable (never faked), the in-process
//! workloads, and the charts.

use std::path::PathBuf;
use uzswap_bench::kernel::{self, programs, KernelBenchOpts, Status};

#[test]
fn usemem_output_parses() {
    let out = "noise before\nusemem phase=write bytes=536870912 usecs=700000\n\
               usemem phase=read order=seq passes=3 bytes=1610612736 usecs=14000000 mismatches=0\nusemem done\n";
    let u = programs::parse_usemem(out).unwrap();
    assert_eq!(u.write.bytes, 536870912);
    assert_eq!(u.write.usecs, 700000);
    let r = u.read.unwrap();
    assert_eq!(r.bytes, 1610612736);
    assert!((r.mbps().unwrap() - 1610612736.0 / 14e6).abs() < 1e-9);
    assert_eq!(u.mismatches, 0);

    let write_only = "usemem phase=write bytes=4096 usecs=10\nusemem done\n";
    let u = programs::parse_usemem(write_only).unwrap();
    assert!(u.read.is_none());
    assert_eq!(u.write.mbps(), Some(409.6));
}

#[test]
fn usemem_output_errors_are_clear() {
    let no_done = "usemem phase=write bytes=4096 usecs=10\n";
    assert!(programs::parse_usemem(no_done).unwrap_err().contains("did not finish"));
    let no_write = "usemem done\n";
    assert!(programs::parse_usemem(no_write).unwrap_err().contains("no write phase"));
    let bad_number = "usemem phase=write bytes=12x usecs=10\nusemem done\n";
    assert!(programs::parse_usemem(bad_number).unwrap_err().contains("not a number"));
    let missing = "usemem phase=read bytes=4096 usecs=5\nusemem phase=write bytes=1 usecs=1\nusemem done\n";
    assert!(programs::parse_usemem(missing).unwrap_err().contains("mismatches"));
    // A zero-length phase has no throughput rather than an infinite one.
    let zero = programs::parse_usemem("usemem phase=write bytes=4096 usecs=0\nusemem done").unwrap();
    assert_eq!(zero.write.mbps(), None);
    // Another program's lines are not ours.
    assert!(programs::parse_usemem("masim phase=write bytes=1 usecs=1\nmasim done").is_err());
}

#[test]
fn masim_output_parses() {
    let out = "masim phase=fill bytes=402653184 usecs=2000000\nmasim phase=rmw ops=1024000 usecs=8000000\n\
               masim phase=check mismatches=0\nmasim done\n";
    let m = programs::parse_masim(out).unwrap();
    assert_eq!(m.ops, 1024000);
    assert_eq!(m.ops_per_sec(), Some(128000.0));
    assert_eq!(m.mismatches, 0);
    assert!(programs::parse_masim("masim phase=fill bytes=1 usecs=1\nmasim done").unwrap_err().contains("rmw"));
}

/// The programs compile and print what the parser reads, checking their data.
#[test]
fn workload_programs_run_and_parse() {
    let p = match programs::Programs::build() {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    for args in [&["8m", "--passes", "2"][..], &["8m", "--random"], &["8m", "--write-only", "--hugepage"]] {
        let out = std::process::Command::new(&p.usemem).args(args).output().unwrap();
        assert!(out.status.success(), "usemem {args:?}: {out:?}");
        let u = programs::parse_usemem(&String::from_utf8_lossy(&out.stdout)).unwrap();
        assert_eq!(u.write.bytes, 8 << 20);
        assert_eq!(u.mismatches, 0);
        if args.contains(&"--passes") {
            assert_eq!(u.read.unwrap().bytes, 16 << 20);
        }
    }
    let out = std::process::Command::new(&p.masim).args(["2m", "--seconds", "0.2"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let m = programs::parse_masim(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert!(m.ops > 0);
    assert_eq!(m.fill.bytes, 6 << 20);
    // Bad arguments are a usage error, not a crash.
    let out = std::process::Command::new(&p.usemem).arg("lots").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

fn script(dir: &tempfile::TempDir, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path().join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Without `uzswap run`, the uzswap rows say so, in the binary's own words, and
/// carry no figures.
#[test]
fn uzswap_without_run_is_unavailable_not_faked() {
    let dir = tempfile::tempdir().unwrap();
    let fake = script(&dir, "uzswap", "echo \"error: unrecognized subcommand 'run'\" >&2\nexit 2");
    let opts = KernelBenchOpts {
        quick: true,
        json: false,
        out_dir: None,
        workloads: vec!["usemem".into(), "incompressible".into(), "seqswap".into()],
        systems: vec!["uzswap".into()],
        uzswap: Some(fake),
    };
    let report = kernel::run(&opts).unwrap();
    let rows = report.rows();
    assert_eq!(rows.len(), 4 + 1 + 2);
    for r in rows {
        assert_eq!(r["system"], "uzswap");
        assert_eq!(r["status"], "unavailable");
        assert!(r["reason"].as_str().unwrap().contains("unrecognized subcommand 'run'"), "{r:?}");
        for figure in ["out_mbps", "in_mbps", "ops_per_sec", "ratio", "secs", "vs_best_kernel"] {
            assert!(r[figure].is_null(), "{figure} in {r:?}");
        }
    }
    let missing = KernelBenchOpts { uzswap: Some(dir.path().join("nothing-here")), ..opts };
    let report = kernel::run(&missing).unwrap();
    assert!(report.rows().iter().all(|r| r["status"] == "unavailable"
        && r["reason"].as_str().unwrap().contains("no uzswap binary")));
}

/// A `uzswap run` that runs the program but manages nothing, or does not hold
/// the budget, gives failed rows without throughput: those numbers are not uzswap's.
#[test]
fn uzswap_rows_that_are_not_uzswaps_fail() {
    let dir = tempfile::tempdir().unwrap();
    let skip_to_command = "while [ \"$1\" != -- ]; do shift; done; shift; exec \"$@\"";
    let silent = script(&dir, "silent", skip_to_command);
    let stats_line = r#"{"pid":1,"budget_bytes":1,"pool_total_size":4096,"store":{"zswpout":5,"zswpin":3,"stored_pages":2}}"#;
    let greedy = script(
        &dir,
        "greedy",
        &format!(
            "for a; do [ \"$prev\" = --stats ] && [ \"$a\" != none ] && echo '{stats_line}' > \"$a\"; prev=$a; done\n{skip_to_command}"
        ),
    );
    for (shim, why) in [(silent, "managed no memory"), (greedy, "budget was not held")] {
        let opts = KernelBenchOpts {
            quick: true,
            json: false,
            out_dir: None,
            workloads: vec!["seqswap".into()],
            systems: vec!["uzswap".into()],
            uzswap: Some(shim),
        };
        let report = kernel::run(&opts).unwrap();
        assert_eq!(report.rows().len(), 2);
        for r in report.rows() {
            if r["reason"].as_str().unwrap().contains("C compiler") {
                println!("skipped: no C compiler");
                return;
            }
            assert_eq!(r["status"], "failed", "{r:?}");
            assert!(r["reason"].as_str().unwrap().contains(why), "{r:?}");
            assert!(r["out_mbps"].is_null() && r["vs_best_kernel"].is_null(), "{r:?}");
            assert!(r["peak_rss_mib"].as_f64().unwrap() > 0.0);
        }
        if why == "budget was not held" {
            // What uzswap reported is kept, under the kernel's names.
            assert_eq!(report.rows()[0]["zswpout"], 5);
            assert_eq!(report.rows()[0]["ratio"], 0.5);
        }
    }
}

#[test]
fn uzswap_stats_parse() {
    let text = "{\"pool_total_size\":8192,\"store\":{\"zswpout\":10,\"zswpin\":4,\"stored_pages\":6}}\n\n\
                {\"pool_total_size\":0,\"store\":{\"zswpout\":1,\"pswpout\":2}}\n";
    let s = kernel::system::parse_uzswap_stats(text).unwrap();
    assert_eq!((s.processes, s.zswpout, s.zswpin, s.pswpout, s.stored_pages, s.pool_total_size), (2, 11, 4, 2, 6, 8192));
    assert_eq!(kernel::system::parse_uzswap_stats("").unwrap().processes, 0);
    assert!(kernel::system::parse_uzswap_stats("{not json").is_err());
}

#[test]
fn bad_filters_are_errors() {
    let opts = |w: &str, s: &str| KernelBenchOpts {
        quick: true,
        json: false,
        out_dir: None,
        workloads: vec![w.into()],
        systems: vec![s.into()],
        uzswap: None,
    };
    let err = |o: KernelBenchOpts| kernel::run(&o).err().expect("an error");
    assert!(err(opts("nope", "uzswap")).contains("unknown workload"));
    assert!(err(opts("tree", "floppy")).contains("unknown system"));
}

#[test]
fn multipage_store_round_trips_and_measures() {
    let data = uzswap_corpus::realistic(2 << 20, 7);
    let mut ratios = Vec::new();
    for g in [4 << 10, 16 << 10, 64 << 10] {
        let m = kernel::inproc::multipage_store(uzswap_store::Algorithm::Zstd, 3, g, &data, 2).unwrap();
        assert!(m.out_mbps > 0.0 && m.in_mbps > 0.0 && m.secs > 0.0);
        assert!(m.ratio > 0.0 && m.ratio < 1.0, "realistic data compresses: {m:?}");
        ratios.push(m.ratio);
    }
    // As with zram's multi-page compression: larger blocks compress better.
    assert!(ratios[2] < ratios[0], "{ratios:?}");
}

#[test]
fn tree_workload_checks_and_counts() {
    let index = uzswap_index::Index::<u64>::new();
    let ops = kernel::inproc::tree(&index, 3, 0.05).unwrap();
    assert!(ops > 0.0);
    let locked = std::sync::Mutex::new(std::collections::BTreeMap::new());
    assert!(kernel::inproc::tree(&locked, 2, 0.05).unwrap() > 0.0);

    /// A tree that loses what it is given must be caught.
    struct Forgetful;
    impl kernel::inproc::SwapTree for Forgetful {
        fn store(&self, _: u64, _: u64) {}
        fn load(&self, _: u64) -> Option<u64> {
            None
        }
    }
    assert!(kernel::inproc::tree(&Forgetful, 2, 0.05).is_err());
}

#[test]
fn chart_is_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let row = |system: &str, config: &str, mbps: f64| kernel::KernelRow {
        workload: "usemem".into(),
        system: system.into(),
        config: config.into(),
        status: Status::Ok,
        size_mib: Some(512),
        limit_mib: Some(256),
        out_mbps: Some(mbps * 2.0),
        in_mbps: Some(mbps),
        ops_per_sec: None,
        fork_usecs: None,
        ratio: None,
        secs: Some(1.0),
        peak_rss_mib: Some(256.0),
        cgroup_peak_mib: None,
        proc_peak_rss_mib: Some(256.0),
        pswpout: Some(1),
        pswpin: Some(1),
        zswpout: Some(0),
        zswpin: Some(0),
        folio_swpout: None,
        folio_fallback: None,
        vs_best_kernel: None,
        vs_plain: None,
        reason: String::new(),
    };
    let rows = [row("disk", "seq-4k", 100.0), row("zram-lz4", "seq-4k", 150.0), row("disk", "rand-4k", 40.0)];
    let refs: Vec<&kernel::KernelRow> = rows.iter().collect();
    match kernel::chart::draw(dir.path(), "usemem", &refs) {
        Ok(path) => {
            let bytes = std::fs::read(path).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        }
        Err(e) if e.contains("font") => println!("skipped: {e}"),
        Err(e) => panic!("{e}"),
    }
}
