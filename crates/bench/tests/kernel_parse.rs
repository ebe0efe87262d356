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

/// A program's peak resident set is its own, not the bench's: exec records the
/// forked copy's high-water mark in ru_maxrss, so a bench holding 192 MiB would
/// read 192 MiB for a 6 MiB program.
#[test]
fn peak_rss_is_the_programs_not_the_benchs() {
    let p = match programs::Programs::build() {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let held = vec![1u8; 192 << 20];
    let job = kernel::system::Job {
        program: &p.masim,
        args: vec!["2m".into(), "--seconds".into(), "0.3".into()],
        limit: 0,
        folio: 4096,
        folio_under_test: true,
        swap_bytes: 0,
        timeout: std::time::Duration::from_secs(30),
    };
    let o = kernel::system::run_plain(&job).unwrap();
    assert_eq!(o.failure(), None, "{o:?}");
    assert!(o.peak_rss >= 6 << 20 && o.peak_rss < 64 << 20, "{}", o.peak_rss);
    assert!(held.iter().step_by(4096).all(|&b| b == 1));
}

/// Written by a shell of its own, not by this process: a descriptor open for writing
/// here would be inherited by whatever another test thread forks meanwhile, and an exec
/// of the script while that child still holds it fails (ETXTBSY: seen in CI).
fn script(dir: &tempfile::TempDir, name: &str, body: &str) -> PathBuf {
    use std::io::Write;
    let path = dir.path().join(name);
    let mut sh = std::process::Command::new("/bin/sh")
        .args(["-c", "cat > \"$1\" && chmod 755 \"$1\"", "sh"])
        .arg(&path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    sh.stdin.take().unwrap().write_all(format!("#!/bin/sh\n{body}\n").as_bytes()).unwrap();
    assert!(sh.wait().unwrap().success(), "writing {}", path.display());
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
            // The whole fill, though it may end between two samples (once read 176
            // MiB, under the budget): ru_maxrss is taken when above the bench's own.
            for r in report.rows() {
                assert!(r["proc_peak_rss_mib"].as_f64().unwrap() >= 384.0, "{r:?}");
            }
        }
    }
}

#[test]
fn uzswap_stats_parse() {
    // zswpin in pages from the runtime's per-size folio counts (the store's own counts
    // only the loads that freed their entry).
    let text = "{\"pool_total_size\":8192,\"store\":{\"zswpout\":10,\"zswpin\":4,\"stored_pages\":6},\
                \"sizes\":{\"hugepages-64kB\":{\"zswpin\":3},\"hugepages-4kB\":{\"zswpin\":5}}}\n\n\
                {\"pool_total_size\":0,\"store\":{\"zswpout\":1,\"pswpout\":2}}\n";
    let s = kernel::system::parse_uzswap_stats(text).unwrap();
    assert_eq!((s.processes, s.zswpout, s.zswpin, s.pswpout, s.stored_pages, s.pool_total_size), (2, 11, 3 * 16 + 5, 2, 6, 8192));
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
        out_vs_lz4_core: None,
        ratio: None,
        secs: Some(1.0),
        peak_rss_mib: Some(256.0),
        cgroup_peak_mib: None,
        proc_peak_rss_mib: Some(256.0),
        uncharged_mib: None,
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

#[test]
fn forker_output_parses() {
    let out = "forker phase=write bytes=402653184 usecs=800000\nforker phase=fork forks=16 usecs=640000 max_usecs=63000\n\
               forker phase=check pages=98304 mismatches=0\nforker done\n";
    let f = programs::parse_forker(out).unwrap();
    assert_eq!((f.forks, f.usecs, f.max_usecs, f.mismatches), (16, 640000, 63000, 0));
    assert_eq!(f.mean_usecs(), Some(40000.0));
    assert_eq!(f.forks_per_sec(), Some(25.0));
    assert_eq!(f.write.bytes, 402653184);
    assert!(programs::parse_forker("forker phase=write bytes=1 usecs=1\nforker done").unwrap_err().contains("fork phase"));
    let no_done = "forker phase=write bytes=1 usecs=1\nforker phase=fork forks=1 usecs=1 max_usecs=1\nforker phase=check pages=1 mismatches=0\n";
    assert!(programs::parse_forker(no_done).unwrap_err().contains("did not finish"));
}

/// usemem --procs: the per-process lines are not the parser's; its summed lines
/// are, and their throughput is the sum of the processes' own.
#[test]
fn usemem_procs_output_sums() {
    let out = "usemem.proc proc=1 phase=write bytes=100 usecs=10\nusemem.proc proc=1 phase=read order=seq passes=1 bytes=100 usecs=5 mismatches=0\n\
               usemem.proc proc=0 phase=write bytes=100 usecs=20\nusemem.proc proc=0 phase=read order=seq passes=1 bytes=100 usecs=20 mismatches=0\n\
               usemem phase=write bytes=200 usecs=13 span_usecs=21\nusemem phase=read order=seq passes=1 bytes=200 usecs=8 mismatches=0 span_usecs=22\nusemem done\n";
    let u = programs::parse_usemem(out).unwrap();
    assert_eq!(u.write, programs::Timed { bytes: 200, usecs: 13 });
    assert_eq!(u.read.unwrap().bytes, 200);
}

/// The programs of usemem-procs and fork: every child's bytes are counted, the
/// summed throughput is the sum of each process's, the data comes back intact.
#[test]
fn procs_and_forker_programs_run_and_parse() {
    let p = match programs::Programs::build() {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let out = std::process::Command::new(&p.usemem).args(["12m", "--passes", "2", "--procs", "3"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let u = programs::parse_usemem(&text).unwrap();
    assert_eq!(u.write.bytes, 12 << 20);
    assert_eq!(u.read.unwrap().bytes, 24 << 20);
    assert_eq!(u.mismatches, 0);
    let each = programs::phases("usemem.proc", &text);
    assert_eq!(each.len(), 6, "{text}");
    let rate = |phase: &str| -> f64 {
        each.iter()
            .filter(|p| p["phase"] == phase)
            .map(|p| p["bytes"].parse::<f64>().unwrap() / p["usecs"].parse::<f64>().unwrap().max(1.0))
            .sum()
    };
    for (phase, summed) in [("write", u.write), ("read", u.read.unwrap())] {
        let (want, got) = (rate(phase), summed.mbps().unwrap());
        assert!((got - want).abs() <= want * 0.01 + 1.0, "{phase}: {got} against {want}: {text}");
    }
    let out = std::process::Command::new(&p.forker).args(["8m", "--forks", "3"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let f = programs::parse_forker(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!((f.forks, f.mismatches, f.write.bytes), (3, 0, 8 << 20));
    assert!(f.max_usecs <= f.usecs);
    // Bad arguments are usage errors.
    let out = std::process::Command::new(&p.usemem).args(["8m", "--procs", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = std::process::Command::new(&p.forker).args(["8m", "--forks", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn build_tree_is_generated_the_same_every_time() {
    let a = programs::build_source(3, 1, 40);
    assert_eq!(a, programs::build_source(3, 1, 40));
    assert_ne!(a, programs::build_source(4, 1, 40));
    assert!(a.contains("uint64_t unit3_f0(uint64_t *v, int n)"));
    assert_eq!(a.matches(" += ").count(), 40);
    let m = programs::makefile(3);
    assert!(m.contains("OBJS = unit0.o unit1.o unit2.o\n") && m.contains("$(CC) -O2 -c -o $@ $<"), "{m}");
    let tree = programs::BuildTree::generate(2).unwrap();
    for f in ["unit0.c", "unit1.c", "Makefile"] {
        assert!(tree.dir.path().join(f).is_file(), "{f}");
    }
    let args = tree.make_args(2);
    assert_eq!(&args[..3], ["-s", "-B", "-j2"]);
    assert_eq!(args[4], tree.dir.path().display().to_string());
}

#[test]
fn tree_memory_parses() {
    use uzswap_runtime::group::{parse_children, parse_pss_anon};
    assert_eq!(parse_children("12 345 6\n"), vec![12, 345, 6]);
    assert!(parse_children("").is_empty());
    let rollup = "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:  1000 kB\nPss:  900 kB\nPss_Anon:   512 kB\nPss_File:  388 kB\n";
    assert_eq!(parse_pss_anon(rollup), Some(512 * 1024));
    assert_eq!(parse_pss_anon("Rss: 4 kB\n"), None);
    // This process's tree: at least itself, which has touched some memory.
    assert!(kernel::system::tree_anon(std::process::id() as i32) > 0);
}

fn row(workload: &str, system: &str, status: Status) -> kernel::KernelRow {
    kernel::KernelRow::new(workload, system, "c", status)
}

/// fork and build compare with `plain` (time over plain time) and with the best
/// kernel system (figure over figure, never over plain, which has no limit).
#[test]
fn fork_and_build_ratios() {
    let fork = |system: &str, usecs: f64| kernel::KernelRow {
        fork_usecs: Some(usecs),
        ops_per_sec: Some(1e6 / usecs),
        ..row("fork", system, Status::Ok)
    };
    let done = [fork("plain", 100.0), fork("disk", 400.0), fork("zswap-lzo", 200.0)];
    let ours = fork("uzswap", 800.0);
    assert_eq!(kernel::versus_plain(&ours, &done), Some(8.0));
    assert_eq!(kernel::versus_best(&ours, &done), Some(0.25));
    assert_eq!(ours.main_figure(), Some(1250.0));

    let build = |system: &str, secs: f64| kernel::KernelRow { secs: Some(secs), ..row("build", system, Status::Ok) };
    let done = [build("plain", 10.0), kernel::KernelRow { status: Status::Failed, ..build("disk", 5.0) }, build("zram-lz4", 30.0)];
    let ours = build("uzswap", 15.0);
    assert_eq!(kernel::versus_plain(&ours, &done), Some(1.5));
    // A failed kernel run is no comparison; zram took twice as long.
    assert_eq!(kernel::versus_best(&ours, &done), Some(2.0));
    assert_eq!(ours.main_figure(), Some(4.0));
    // The tuned column is compared with the kernel's, never with the defaults' (nor
    // the defaults with it), whichever ran first.
    let with_ours = [&done[..], std::slice::from_ref(&ours)].concat();
    let tuned = build("uzswap-tuned", 60.0);
    assert_eq!(kernel::versus_best(&tuned, &with_ours), Some(0.5));
    assert_eq!(kernel::versus_best(&ours, &[&done[..], &[tuned]].concat()), Some(2.0));
    // Without a plain row there is no ratio to it; usemem has none at all.
    assert_eq!(kernel::versus_plain(&ours, &done[1..]), None);
    assert_eq!(kernel::versus_plain(&row("usemem", "uzswap", Status::Ok), &done), None);

    assert_eq!(kernel::build_limit(300 << 20), 225 << 20);
    assert_eq!(kernel::build_limit((301 << 20) + 5), 225 << 20);
    let peak = kernel::BuildPeak { anon: 200 << 20, charged: Some(260 << 20) };
    assert_eq!(peak.limit(&kernel::system::System::Uzswap), 150 << 20);
    assert_eq!(peak.limit(&kernel::system::System::Disk), 195 << 20);
    let unmeasured = kernel::BuildPeak { charged: None, ..peak };
    assert_eq!(unmeasured.limit(&kernel::system::System::Disk), 150 << 20);
}

/// `uzswap` runs with uzswap's defaults, as the kernel systems run with theirs; the
/// tuned settings are the `uzswap-tuned` column's alone.
#[test]
fn uzswap_columns() {
    use kernel::system::{System, UZSWAP_BUILD_SETTINGS, UZSWAP_SETTINGS};
    assert_eq!(System::parse("uzswap").unwrap().uzswap_settings(false), &[] as &[&str]);
    assert_eq!(System::parse("uzswap").unwrap().uzswap_settings(true), &[] as &[&str]);
    let tuned = System::parse("uzswap-tuned").unwrap();
    assert_eq!((tuned.name().as_str(), tuned.is_uzswap(), tuned.is_kernel()), ("uzswap-tuned", true, false));
    assert_eq!(tuned.uzswap_settings(false), &UZSWAP_SETTINGS);
    assert_eq!(tuned.uzswap_settings(true), &UZSWAP_BUILD_SETTINGS);
    let p = kernel::describe_plan(true, &["usemem"], &["uzswap-tuned", "zswap-lzo", "uzswap"], false).unwrap();
    let first: Vec<&str> = p.iter().take(3).map(|r| r.2.as_str()).collect();
    assert_eq!(first, ["zswap-lzo", "uzswap-tuned", "uzswap"], "kernel systems first, then uzswap's as named");
}

/// The new workloads' plan: usemem-procs at 1-8 processes on every system, fork
/// and build with `plain` first (and only once when named), kernel systems
/// skipped without root but plain and uzswap not.
#[test]
fn multi_process_plan() {
    let p = kernel::describe_plan(true, &["usemem-procs", "fork", "build"], &["zswap-lzo", "uzswap", "plain"], false).unwrap();
    let names: Vec<(&str, &str, &str)> = p.iter().map(|(w, c, s, _)| (w.as_str(), c.as_str(), s.as_str())).collect();
    assert_eq!(
        names,
        [
            ("usemem-procs", "1-procs", "zswap-lzo"),
            ("usemem-procs", "1-procs", "uzswap"),
            ("usemem-procs", "1-procs", "plain"),
            ("usemem-procs", "2-procs", "zswap-lzo"),
            ("usemem-procs", "2-procs", "uzswap"),
            ("usemem-procs", "2-procs", "plain"),
            ("usemem-procs", "4-procs", "zswap-lzo"),
            ("usemem-procs", "4-procs", "uzswap"),
            ("usemem-procs", "4-procs", "plain"),
            ("usemem-procs", "8-procs", "zswap-lzo"),
            ("usemem-procs", "8-procs", "uzswap"),
            ("usemem-procs", "8-procs", "plain"),
            ("fork", "384M-x16", "plain"),
            ("fork", "384M-x16", "zswap-lzo"),
            ("fork", "384M-x16", "uzswap"),
            ("build", "12-files-j2", "plain"),
            ("build", "12-files-j2", "zswap-lzo"),
            ("build", "12-files-j2", "uzswap"),
        ]
    );
    let what = |w: &str, c: &str, s: &str| p.iter().find(|r| r.0 == w && r.1 == c && r.2 == s).unwrap().3.clone();
    assert_eq!(what("usemem-procs", "4-procs", "uzswap"), "Usemem 402653184 --passes 2 --procs 4 (size 384 MiB, limit 192 MiB)");
    assert!(what("usemem-procs", "4-procs", "zswap-lzo").starts_with("Skipped: needs root"));
    assert_eq!(what("fork", "384M-x16", "plain"), "Forker 402653184 --forks 16 (size 384 MiB, limit 128 MiB)");
    assert!(what("build", "12-files-j2", "uzswap").starts_with("Make "), "the build's size comes from its plain run");
    let full = kernel::describe_plan(false, &["usemem-procs", "fork"], &["uzswap"], true).unwrap();
    assert!(full[0].3.ends_with("--procs 1 (size 1536 MiB, limit 1024 MiB)"), "{full:?}");
    assert_eq!(full.last().unwrap().3, "Forker 1073741824 --forks 32 (size 1024 MiB, limit 256 MiB)");
}

/// The reference of `out_vs_lz4_core`: one core's lz4 on usemem's data, at every folio
/// size the workloads use (4K, 64K, 2M: seqswap's THP). lz4 runs at GB/s here; a
/// figure far below that would be a broken measure, not a slow machine.
#[test]
fn lz4_core_reference() {
    for folio in [4096, 64 << 10, 2 << 20] {
        let mbps = kernel::inproc::lz4_core_mbps(folio).unwrap();
        assert!(mbps.is_finite() && mbps > 100.0, "{folio}: {mbps} MB/s");
    }
}

/// zram with its memory charged: named `zram-<algorithm>-charged`, a kernel system,
/// and run beside each zram of the incompressible workload without being named.
#[test]
fn zram_charged() {
    use kernel::system::System;
    let c = System::parse("zram-lz4-charged").unwrap();
    assert_eq!(c, System::ZramCharged("lz4".into()));
    assert_eq!((c.name().as_str(), c.is_kernel(), c.is_uzswap()), ("zram-lz4-charged", true, false));
    assert_eq!(System::parse("zram-lz4").unwrap(), System::Zram("lz4".into()));
    let p = kernel::describe_plan(true, &["incompressible"], &["disk", "zram-lz4", "uzswap"], false).unwrap();
    let systems: Vec<&str> = p.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(systems, ["disk", "zram-lz4", "zram-lz4-charged", "uzswap"]);
    let p = kernel::describe_plan(true, &["usemem"], &["zram-lz4"], false).unwrap();
    assert!(p.iter().all(|r| r.2 == "zram-lz4"), "only the incompressible workload adds it");
}
