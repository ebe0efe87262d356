//! The kernel side of `uzswap bench kernel` leaves the machine as it found it:
//! swap areas, zswap parameters, zram devices, mTHP settings and memory cgroups.
//! Needs root, a memory cgroup controller and a C compiler; skipped (with the
//! reason printed) without them.

use std::path::Path;
use std::time::Duration;
use uzswap_bench::kernel::machine::{self, Machine, Snapshot};
use uzswap_bench::kernel::programs::{self, Programs};
use uzswap_bench::kernel::system::{self, Job, RunError, System};

const MIB: u64 = 1 << 20;

/// The tests compare whole-machine snapshots, so they take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn ready() -> Option<Programs> {
    if !machine::is_root() {
        println!("skipped: needs root");
        return None;
    }
    if machine::cgroup_version().is_none() {
        println!("skipped: no memory cgroup controller");
        return None;
    }
    match Programs::build() {
        Ok(p) => Some(p),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn usemem_job(p: &Programs, folio: usize) -> Job<'_> {
    Job {
        program: &p.usemem,
        args: vec![(48 * MIB).to_string(), "--random".into()],
        limit: 24 * MIB,
        folio,
        folio_under_test: true,
        swap_bytes: 96 * MIB,
        timeout: Duration::from_secs(60),
    }
}

/// One small usemem run under each kernel system, then everything is as before;
/// the runs themselves swap (the counters move) and read their data back intact.
#[test]
fn settings_are_restored_after_each_kernel_system() {
    let _turn = serial();
    let Some(p) = ready() else { return };
    let before = Snapshot::take().unwrap();
    {
        let mut m = Machine::new().unwrap();
        assert_eq!(*m.snapshot(), before);
        let swapfile = m.create_swapfile(128 * MIB).unwrap();
        let mut ran = 0;
        for (i, name) in ["disk", "zswap-lzo", "zswap-lzo-rle", "zswap-deflate", "zram-lz4", "zswap-nosuch"].iter().enumerate() {
            let sys = System::parse(name).unwrap();
            let folio = if i % 2 == 0 { 4096 } else { 64 << 10 };
            let job = usemem_job(&p, folio);
            let cgroup = format!("uzswap-bench-test-{}-{i}", std::process::id());
            match system::run_kernel(&mut m, &sys, &job, Some(&swapfile), &cgroup) {
                Ok(o) => {
                    assert_eq!(o.failure(), None, "{name}: {}", o.stderr);
                    let u = programs::parse_usemem(&o.stdout).unwrap();
                    assert_eq!(u.mismatches, 0);
                    assert!(o.counters.pswpout + o.counters.zswpout > 0, "{name} did not swap: {o:?}");
                    // The resident set also counts shared library pages charged elsewhere.
                    // The cgroup's own peak and the tree's sampled PSS say whether the limit
                    // failed or the resident set counted something else (a flaky failure here
                    // read 120 MiB for a 48 MiB program).
                    assert!(o.peak_rss <= 28 * MIB, "{name}: the limit held ({}; cgroup peak {:?}, tree peak {})", o.peak_rss, o.cgroup_peak, o.tree_peak);
                    if name.starts_with("zswap") || name.starts_with("zram") {
                        let r = o.ratio.expect("compressed tier sampled");
                        assert!(r > 0.0 && r < 1.0, "{name}: {r}");
                    }
                    ran += 1;
                }
                Err(RunError::Unavailable(why)) => {
                    println!("{name}: unavailable: {why}");
                    if *name == "zswap-nosuch" {
                        assert!(why.contains("nosuch"), "{why}");
                    }
                }
                Err(e) => panic!("{name}: {e:?}"),
            }
            // Between runs the settings are already back.
            let now = Snapshot::take().unwrap();
            assert_eq!(now.zswap, before.zswap, "after {name}");
            assert_eq!(now.mthp, before.mthp, "after {name}");
            assert_eq!(now.zram, before.zram, "after {name}");
            assert_eq!(now.cgroups, before.cgroups, "after {name}");
            assert_eq!(now.swaps, before.swaps, "after {name}");
        }
        assert!(ran >= 2, "at least disk and one compressed system ran");
        assert!(swapfile.exists());
        drop(m);
        assert!(!swapfile.exists(), "the swap file is removed");
    }
    assert_eq!(Snapshot::take().unwrap(), before);
}

/// A run that cannot fit (a tiny zram swap) is reported as killed, not given numbers.
#[test]
fn oom_is_a_failure() {
    let _turn = serial();
    let Some(p) = ready() else { return };
    let before = Snapshot::take().unwrap();
    {
        let mut m = Machine::new().unwrap();
        let job = Job { swap_bytes: 4 * MIB, ..usemem_job(&p, 4096) };
        let cgroup = format!("uzswap-bench-test-oom-{}", std::process::id());
        match system::run_kernel(&mut m, &System::Zram("lz4".into()), &job, None, &cgroup) {
            Ok(o) => {
                let why = o.failure().expect("48 MiB cannot fit in 24 MiB + 4 MiB of zram");
                assert!(why.contains("signal 9"), "{why}");
            }
            Err(RunError::Unavailable(why)) => println!("skipped: {why}"),
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(Snapshot::take().unwrap(), before);
}

/// Ctrl-C in the middle of a run: the program is stopped and the machine put back.
#[test]
fn interrupt_restores() {
    let _turn = serial();
    let Some(p) = ready() else { return };
    let before = Snapshot::take().unwrap();
    {
        let mut m = Machine::new().unwrap();
        // Three regions of 4 MiB fit the limit: the run must last until the
        // interrupt, and a thrashing one was OOM-killed before it on one machine.
        let job = Job {
            program: &p.masim,
            args: vec![(4 * MIB).to_string(), "--seconds".into(), "30".into()],
            limit: 24 * MIB,
            folio: 4096,
            folio_under_test: true,
            swap_bytes: 64 * MIB,
            timeout: Duration::from_secs(60),
        };
        let cgroup = format!("uzswap-bench-test-int-{}", std::process::id());
        let signal = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(700));
            // SAFETY: signalling ourselves; the machine's handler is installed.
            unsafe { libc::kill(libc::getpid(), libc::SIGINT) };
        });
        let t = std::time::Instant::now();
        let r = system::run_kernel(&mut m, &System::Zram("lz4".into()), &job, None, &cgroup);
        signal.join().unwrap();
        match r {
            Err(RunError::Interrupted) => assert!(t.elapsed() < Duration::from_secs(20)),
            Err(RunError::Unavailable(why)) => println!("skipped: {why}"),
            other => panic!("expected an interrupt, got {other:?}"),
        }
        assert!(machine::interrupted());
    }
    assert_eq!(Snapshot::take().unwrap(), before);
    assert!(!Path::new(&format!("/sys/fs/cgroup/memory/uzswap-bench-test-int-{}", std::process::id())).exists());
}

/// zram through its block device (the kernel side of the multi-page workload).
#[test]
fn multipage_zram_measures_and_cleans_up() {
    if !machine::is_root() {
        println!("skipped: needs root");
        return;
    }
    let _turn = serial();
    let before = Snapshot::take().unwrap();
    {
        let mut m = Machine::new().unwrap();
        let data = uzswap_corpus::realistic(4 << 20, 3);
        match uzswap_bench::kernel::inproc::multipage_zram(&mut m, "lz4", &data, 2) {
            Ok(r) => {
                assert!(r.out_mbps > 0.0 && r.in_mbps > 0.0);
                assert!(r.ratio > 0.0 && r.ratio < 1.0, "{r:?}");
            }
            Err(RunError::Unavailable(why)) => println!("skipped: {why}"),
            Err(e) => panic!("{e:?}"),
        }
        match uzswap_bench::kernel::inproc::multipage_zram(&mut m, "no-such-algorithm", &data, 1) {
            Err(RunError::Unavailable(why)) => assert!(why.contains("no-such-algorithm"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(Snapshot::take().unwrap(), before);
}
