//! Adopted memory (`Runtime::adopt_region`): a mapping the program made and filled
//! before uzswap took it over keeps every byte through eviction, faults, the program's
//! own MADV_DONTNEED and munmap, a fork, and the release that gives it back in place.

mod common;
use uzswap_runtime::*;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;
const FOLIO: usize = 64 << 10;

fn word(page: usize, version: u64) -> u64 {
    (page as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version
}

/// Writes a page: a word naming it, then a repeated word (compresses well).
fn fill(base: usize, page: usize, version: u64) {
    let p = (base + page * PAGE) as *mut u64;
    for w in 0..PAGE / 8 {
        let v = if w == 0 { word(page, version) } else { version };
        // SAFETY: the page lies inside the test's live mapping.
        unsafe { p.add(w).write_volatile(v) };
    }
}

/// Whether a page holds what `fill` wrote (version 0: zeros).
fn holds(base: usize, page: usize, version: u64) -> bool {
    let p = (base + page * PAGE) as *const u64;
    (0..PAGE / 8).all(|w| {
        let want = if version == 0 { 0 } else if w == 0 { word(page, version) } else { version };
        // SAFETY: as in `fill`.
        unsafe { p.add(w).read_volatile() == want }
    })
}

fn runtime(path: FaultPath, budget: usize) -> Option<Runtime> {
    let mut cfg = RuntimeConfig::new(budget as u64);
    cfg.fault_path = path;
    cfg.publish_stats = false;
    common::or_skip(Runtime::new(cfg))
}

/// A plain private anonymous mapping, aligned to FOLIO, as a program's allocator makes.
fn program_mapping(len: usize) -> usize {
    // SAFETY: a fresh anonymous mapping; the head and tail trimmed are inside it.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len + FOLIO, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(p, libc::MAP_FAILED);
        let p = p as usize;
        let a = (p + FOLIO - 1) & !(FOLIO - 1);
        if a > p {
            libc::munmap(p as *mut _, a - p);
        }
        libc::munmap((a + len) as *mut _, p + FOLIO - a);
        a
    }
}

fn wait_for_eviction(rt: &Runtime, below: u64) {
    // Progress, not correctness: the checks below hold however far eviction got.
    for _ in 0..500 {
        if rt.stats().resident_bytes <= below {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

fn adopted_memory_keeps_every_byte(path: FaultPath) {
    let Some(rt) = runtime(path, 8 * MIB) else { return };
    let len = 64 * MIB;
    let pages = len / PAGE;
    let base = program_mapping(len);
    // The program's data: the first 48 MiB, less a 1 MiB hole it gave back.
    let written = 48 * MIB / PAGE;
    for page in 0..written {
        fill(base, page, 1);
    }
    let hole = (16 * MIB / PAGE)..(17 * MIB / PAGE);
    // SAFETY: the test's own mapping.
    unsafe { libc::madvise((base + hole.start * PAGE) as *mut _, MIB, libc::MADV_DONTNEED) };
    let version = |page: usize| if page < written && !hole.contains(&page) { 1 } else { 0 };

    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    let st = rt.stats();
    let adopted: u64 = st.sizes.values().map(|s| s.adopted).sum();
    assert_eq!(adopted as usize, (written * PAGE - MIB) / FOLIO, "folios with data taken over");
    wait_for_eviction(&rt, 8 * MIB as u64);
    assert!(rt.stats().store.totals.zswpout > 0, "nothing was swapped out");
    for page in 0..pages {
        assert!(holds(base, page, version(page)), "page {page} after adoption and eviction");
    }

    // The program writes some pages anew, drops some and unmaps 1 MiB.
    for page in (0..pages).step_by(7) {
        fill(base, page, 2);
    }
    let version = |page: usize| if page.is_multiple_of(7) { 2 } else { version(page) };
    let dropped = (30 * MIB / PAGE)..(31 * MIB / PAGE);
    let gone = (40 * MIB / PAGE)..(41 * MIB / PAGE);
    // SAFETY: the test's own mapping.
    unsafe {
        libc::madvise((base + dropped.start * PAGE) as *mut _, MIB, libc::MADV_DONTNEED);
        libc::munmap((base + gone.start * PAGE) as *mut _, MIB);
    }
    let version = |page: usize| if dropped.contains(&page) { 0 } else { version(page) };
    wait_for_eviction(&rt, 8 * MIB as u64);

    // A fork sees all of it (adopted memory is inherited, as it was).
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // SAFETY: the child only reads memory and exits with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = (0..pages).filter(|p| !gone.contains(p)).all(|p| holds(base, p, version(p)));
        // SAFETY: _exit in the child of fork.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    hold.resume();
    let mut status = 0;
    // SAFETY: waitpid on our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the forked child saw wrong bytes");

    wait_for_eviction(&rt, 8 * MIB as u64);
    // Released: every byte back in place, the mapping still the program's.
    drop(region);
    for page in (0..pages).filter(|p| !gone.contains(p)) {
        assert!(holds(base, page, version(page)), "page {page} after release");
    }
    let st = rt.stats();
    assert_eq!(st.resident_bytes, 0, "charges left after release");
    assert_eq!(st.store.totals.stored_pages, 0, "store entries left after release");
    // SAFETY: the test's own mapping, no longer managed.
    unsafe {
        libc::munmap(base as *mut _, gone.start * PAGE);
        libc::munmap((base + gone.end * PAGE) as *mut _, len - gone.end * PAGE);
    }
}

#[test]
fn adopted_memory_keeps_every_byte_thread_path() {
    adopted_memory_keeps_every_byte(FaultPath::Thread);
}

#[test]
fn adopted_memory_keeps_every_byte_sigbus_path() {
    adopted_memory_keeps_every_byte(FaultPath::Sigbus);
}

/// The program moves part of an adopted mapping with mremap (the kernel moves the
/// pages in place; what was swapped out cannot follow). With that part resident, the
/// moved bytes are intact at their new place. With it swapped out, the program is
/// stopped with a message, never left to read zeros. Run in a child process (this
/// test binary again), which the second case kills.
#[test]
fn partial_mremap_of_adopted_memory() {
    if let Ok(case) = std::env::var("UZSWAP_TEST_REMAP_CASE") {
        return remap_case(&case);
    }
    for (case, dies) in [("resident", false), ("swapped", true)] {
        let o = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "partial_mremap_of_adopted_memory", "--nocapture", "--test-threads=1"])
            .env("UZSWAP_TEST_REMAP_CASE", case)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("SKIP:") {
            eprintln!("{err}");
            return;
        }
        if dies {
            assert!(!o.status.success() && err.contains("cannot follow a partial move"), "{case}: {o:?}");
        } else {
            assert!(o.status.success(), "{case}: {o:?}");
        }
    }
}

fn remap_case(case: &str) {
    // Resident: a budget the mapping fits in, so nothing is ever evicted. (Reading the
    // part back in after raising a small budget left a race: a reclaim step begun
    // before the raise could still take out folios just read, and the move then found
    // them swapped out; seen under load in CI.)
    let budget = if case == "swapped" { 4 * MIB } else { 64 * MIB };
    let Some(rt) = runtime(FaultPath::Thread, budget) else { return };
    let len = 16 * MIB;
    let base = program_mapping(len);
    for page in 0..len / PAGE {
        fill(base, page, 3);
    }
    let _region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    let part = 4 * MIB; // the first 4 MiB, moved elsewhere
    if case == "swapped" {
        wait_for_eviction(&rt, 4 * MIB as u64);
        // Read the end of the mapping so that its start is what stays swapped out.
        for page in (len - 3 * MIB) / PAGE..len / PAGE {
            assert!(holds(base, page, 3));
        }
        assert!(rt.stats().store.totals.zswpout > 0);
    } else {
        assert_eq!(rt.stats().store.totals.zswpout, 0, "nothing was swapped out");
    }
    let to = program_mapping(part);
    // SAFETY: moves the test's own pages over the test's own fresh mapping.
    let moved = unsafe { libc::mremap(base as *mut _, part, part, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to as *mut libc::c_void) };
    assert_eq!(moved as usize, to);
    for page in 0..part / PAGE {
        let from = page;
        let p = (to + page * PAGE) as *const u64;
        // SAFETY: the moved mapping is the test's.
        let ok = unsafe { p.read_volatile() == word(from, 3) && p.add(1).read_volatile() == 3 };
        assert!(ok, "moved page {page}");
        // Writable as before.
        // SAFETY: as above.
        unsafe { (p as *mut u64).add(2).write_volatile(3) };
    }
    for page in part / PAGE..len / PAGE {
        assert!(holds(base, page, 3), "page {page} that stayed");
    }
    // The program maps fresh memory where the moved part was: its own, which the
    // region, under a budget it no longer fits, never takes out (it did, as the
    // folios it still thought it had there, and the fresh bytes read as zeros).
    // SAFETY: the range the move left empty.
    let p = unsafe {
        libc::mmap(base as *mut _, part, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0)
    };
    assert_eq!(p as usize, base, "mapped again in place");
    for page in 0..part / PAGE {
        fill(base, page, 5);
    }
    rt.set_budget(2 * MIB as u64).expect("a smaller budget");
    for pass in 0..2 {
        wait_for_eviction(&rt, 2 * MIB as u64);
        for page in 0..len / PAGE {
            assert!(holds(base, page, if page < part / PAGE { 5 } else { 3 }), "pass {pass}: page {page} (fresh below {})", part / PAGE);
        }
    }
}

/// A range already managed is refused, whole or in part: the scan once read a mapping
/// twice from /proc/self/maps while it grew (first its old extent, then the grown one
/// from the same start) and adopted both; the two regions each took the folios for
/// theirs, one evicted them and the other filled the holes with zeros (a Go program
/// read zeros where it had written). Once the first region is gone, the range may be
/// adopted again, and every byte is still there.
#[test]
fn a_managed_range_is_not_adopted_twice() {
    let Some(rt) = runtime(FaultPath::Thread, 2 * MIB) else { return };
    let len = 8 * MIB;
    let base = program_mapping(len);
    for page in 0..len / PAGE {
        fill(base, page, 1);
    }
    let first = rt.adopt_region(base, len / 2, FOLIO, MemoryKind::Mapping).expect("adopt the first half");
    wait_for_eviction(&rt, 2 * MIB as u64);
    for (at, n) in [(base, len), (base, len / 2), (base + len / 4, len / 2), (base + len / 2 - FOLIO, 2 * FOLIO)] {
        match rt.adopt_region(at, n, FOLIO, MemoryKind::Mapping) {
            Err(Error::Managed) => {}
            other => panic!("{:#x}+{n:#x} over a managed range: {:?}", at - base, other.map(|_| ())),
        }
    }
    for page in 0..len / PAGE {
        assert!(holds(base, page, 1), "page {page} with the first region managing half");
    }
    // Beside it is fine.
    let second = rt.adopt_region(base + len / 2, len / 2, FOLIO, MemoryKind::Mapping).expect("adopt the other half");
    drop(first);
    drop(second);
    let whole = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt again once released");
    wait_for_eviction(&rt, 2 * MIB as u64);
    for page in 0..len / PAGE {
        assert!(holds(base, page, 1), "page {page} adopted again");
    }
    drop(whole);
    // SAFETY: the test's own mapping, no longer managed.
    unsafe { libc::munmap(base as *mut _, len) };
}

/// The program unmaps the top of an adopted mapping a page at a time, as glibc trims
/// its brk heap, and maps fresh memory there again, as the heap regrows: the fresh
/// memory is the program's alone. A folio unmapped in pieces is gone as if unmapped
/// whole, and one unmapped in part keeps only its other pages: taking either out of
/// what is now the new mapping moved the program's fresh bytes into uzswap's store
/// (examples/brktrim.c read zeros at the top of its regrown heap; gcc's cc1 died of a
/// corrupted heap).
fn unmapped_in_pieces_then_mapped_again(path: FaultPath) {
    let Some(rt) = runtime(path, 2 * MIB) else { return };
    let len = 4 * MIB;
    let pages = len / PAGE;
    let base = program_mapping(len);
    for page in 0..pages {
        fill(base, page, 1);
    }
    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Heap).expect("adopt");
    for round in 0..2 {
        // Half the time with the top folios swapped out first.
        if round == 1 {
            wait_for_eviction(&rt, 2 * MIB as u64);
        }
        // The top two and a half folios, a page at a time from the top down.
        let cut = pages - (5 * FOLIO / 2) / PAGE;
        for page in (cut..pages).rev() {
            // SAFETY: the test's own mapping, unmapped by "the program".
            assert_eq!(unsafe { libc::munmap((base + page * PAGE) as *mut _, PAGE) }, 0);
        }
        // Mapped again: a new mapping, which uzswap never took over.
        let at = base + cut * PAGE;
        // SAFETY: the range the program just unmapped.
        let p = unsafe {
            libc::mmap(at as *mut _, len - cut * PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0)
        };
        assert_eq!(p as usize, at, "mapped again in place");
        let version = |page: usize| if page >= cut { 3 + round as u64 } else { 1 };
        for page in cut..pages {
            fill(base, page, version(page));
        }
        // The reclaimer works the region over while the program reads all of it.
        for _ in 0..3 {
            wait_for_eviction(&rt, MIB as u64);
            for page in 0..pages {
                assert!(holds(base, page, version(page)), "round {round}: page {page} of {pages} (fresh from {cut})");
            }
        }
        // The fresh pages are written once more, to be given back as the old ones.
        for page in cut..pages {
            fill(base, page, 1);
        }
    }
    let st = rt.stats();
    let errors: u64 = st.sizes.values().map(|s| s.ioctl_errors).sum();
    assert_eq!(errors, 0, "{:?}", st.total());
    drop(region);
    for page in 0..pages {
        assert!(holds(base, page, 1), "page {page} after release");
    }
    assert_eq!(rt.stats().store.totals.stored_pages, 0, "store entries left after release");
    // SAFETY: the test's own mappings, no longer managed.
    unsafe { libc::munmap(base as *mut _, len) };
}

#[test]
fn unmapped_in_pieces_then_mapped_again_thread_path() {
    unmapped_in_pieces_then_mapped_again(FaultPath::Thread);
}

#[test]
fn unmapped_in_pieces_then_mapped_again_sigbus_path() {
    unmapped_in_pieces_then_mapped_again(FaultPath::Sigbus);
}

/// The program unmaps part of an adopted mapping and maps memory there again, which
/// is adopted too: the second region has those addresses, and its bytes survive
/// eviction and faults (a fault there once went to the first region, whose folio was
/// gone, and was served a page of zeros).
fn a_region_in_the_hole_of_another(path: FaultPath) {
    let Some(rt) = runtime(path, 2 * MIB) else { return };
    let len = 8 * MIB;
    let pages = len / PAGE;
    let base = program_mapping(len);
    for page in 0..pages {
        fill(base, page, 1);
    }
    let first = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    let hole = (2 * MIB / PAGE)..(4 * MIB / PAGE);
    let at = base + hole.start * PAGE;
    // SAFETY: the test's own mapping, part of it unmapped and mapped again by "the program".
    unsafe {
        assert_eq!(libc::munmap(at as *mut _, 2 * MIB), 0);
        let p = libc::mmap(at as *mut _, 2 * MIB, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0);
        assert_eq!(p as usize, at, "mapped again in place");
    }
    for page in hole.clone() {
        fill(base, page, 2);
    }
    let version = |page: usize| if hole.contains(&page) { 2 } else { 1 };
    // Adopted once the first region has taken the UNMAP in (until then the range is
    // still the first's).
    let mut second = None;
    for _ in 0..500 {
        match rt.adopt_region(at, 2 * MIB, FOLIO, MemoryKind::Mapping) {
            Ok(r) => {
                second = Some(r);
                break;
            }
            Err(Error::Managed) => std::thread::sleep(std::time::Duration::from_millis(10)),
            Err(e) => panic!("adopting the hole's new mapping: {e:?}"),
        }
    }
    let second = second.expect("the hole adopted");
    for pass in 0..3 {
        wait_for_eviction(&rt, MIB as u64);
        for page in 0..pages {
            assert!(holds(base, page, version(page)), "pass {pass}: page {page} (the hole: {hole:?})");
        }
    }
    // The first region let go: the second keeps its range (the first's release
    // unregistered all of its own, the second's included, whose swapped-out pages then
    // read as zeros).
    drop(first);
    for page in (0..pages).filter(|p| !hole.contains(p)) {
        assert!(holds(base, page, 1), "page {page} after the first region's release");
    }
    for pass in 0..2 {
        wait_for_eviction(&rt, MIB as u64);
        for page in hole.clone() {
            assert!(holds(base, page, 2), "pass {pass}: page {page} of the second region, the first released");
        }
    }
    // The hole's new mapping unmapped in turn: the drop is the second region's (it
    // went to the first, whose folios there were gone, and the second kept them).
    // SAFETY: the test's own mapping.
    assert_eq!(unsafe { libc::munmap(at as *mut _, 2 * MIB) }, 0);
    for _ in 0..500 {
        if second.all_unmapped() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(second.all_unmapped(), "the second region took its UNMAP in");
    drop(second);
    assert_eq!(rt.stats().store.totals.stored_pages, 0, "store entries left after release");
    // SAFETY: the test's own mappings, no longer managed.
    unsafe {
        libc::munmap(base as *mut _, hole.start * PAGE);
        libc::munmap((base + hole.end * PAGE) as *mut _, len - hole.end * PAGE);
    }
}

#[test]
fn a_region_in_the_hole_of_another_thread_path() {
    a_region_in_the_hole_of_another(FaultPath::Thread);
}

#[test]
fn a_region_in_the_hole_of_another_sigbus_path() {
    a_region_in_the_hole_of_another(FaultPath::Sigbus);
}

/// A region the program unmapped whole is let go without an error: the kernel refuses
/// to unregister a range with no mapping left (EINVAL on 6.18), which is expected
/// there, not counted (node, whose V8 unmaps its pages, counted over a thousand
/// ioctl_errors a run so).
#[test]
fn a_region_unmapped_whole_is_let_go_quietly() {
    let Some(rt) = runtime(FaultPath::Thread, 2 * MIB) else { return };
    let len = 4 * MIB;
    let base = program_mapping(len);
    for page in 0..len / PAGE {
        fill(base, page, 1);
    }
    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    wait_for_eviction(&rt, 2 * MIB as u64);
    // SAFETY: the test's own mapping, unmapped by "the program".
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
    for _ in 0..500 {
        if region.all_unmapped() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(region.all_unmapped(), "the UNMAP event was taken in");
    drop(region);
    let errors: u64 = rt.stats().sizes.values().map(|s| s.ioctl_errors).sum();
    assert_eq!(errors, 0, "{:?}", rt.stats().total());
    assert_eq!(rt.stats().store.totals.stored_pages, 0);
}

/// What the scan measured as not managed and then adopts is charged once: as
/// resident, no longer as unmanaged (counted twice until the next measure, a Go heap
/// adopted 100 MiB at a time read 32 MiB over its real peak).
#[test]
fn adopted_memory_leaves_the_unmanaged_count() {
    let Some(rt) = runtime(FaultPath::Thread, 64 * MIB) else { return };
    let len = 4 * MIB;
    let base = program_mapping(len);
    for page in 0..len / PAGE {
        fill(base, page, 1);
    }
    rt.set_unmanaged(len as u64 + MIB as u64);
    let resident = rt.stats().resident_bytes;
    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    let st = rt.stats();
    assert_eq!(st.resident_bytes, resident + len as u64);
    assert_eq!(st.unmanaged_bytes, MIB as u64, "the adopted 4 MiB left the unmanaged count");
    drop(region);
    // SAFETY: the test's own mapping.
    unsafe { libc::munmap(base as *mut _, len) };
}

/// One thread of the program unmaps adopted memory while another maps fresh memory at
/// the same addresses and writes it, with the reclaimer taking the region out all the
/// while: the fresh memory keeps every byte. UFFDIO_MOVE checks only that its
/// destination is registered; a take-out moved straight to the shadow saw nothing of a
/// munmap the reader had yet to read, and took the other thread's fresh pages with it
/// (reclaim.rs `take_out`: it now moves through the pivot, on the region's context).
/// A race: many rounds, each a chance.
fn unmapped_and_mapped_anew_by_another_thread(path: FaultPath) {
    let Some(rt) = runtime(path, 256 << 10) else { return };
    let len = MIB;
    let pages = len / PAGE;
    let (mut landed, mut rounds) = (0, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while rounds < 600 && std::time::Instant::now() < deadline {
        rounds += 1;
        let base = program_mapping(len);
        for page in 0..pages {
            fill(base, page, 1);
        }
        let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let (go, unmapped) = (std::sync::Arc::new(AtomicBool::new(false)), std::sync::Arc::new(AtomicBool::new(false)));
        let other = {
            let (go, unmapped) = (go.clone(), unmapped.clone());
            std::thread::spawn(move || {
                while !go.load(SeqCst) {
                    std::hint::spin_loop();
                }
                // In place as soon as the munmap has taken the old mapping away (its
                // event perhaps still unread); elsewhere if something else of the
                // process's (a pool span of the store) took the addresses first.
                let (p, in_place) = loop {
                    let gone = unmapped.load(SeqCst);
                    // SAFETY: a new mapping where none may be (NOREPLACE).
                    let p = unsafe {
                        libc::mmap(base as *mut _, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0)
                    };
                    if p != libc::MAP_FAILED {
                        break (p as usize, true);
                    }
                    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EEXIST));
                    if gone {
                        break (program_mapping(len), false);
                    }
                    std::hint::spin_loop();
                };
                for page in 0..pages {
                    fill(p, page, 7);
                }
                for _ in 0..3 {
                    for page in 0..pages {
                        assert!(holds(p, page, 7), "page {page} of the fresh mapping lost what was written to it");
                    }
                }
                (p, in_place)
            })
        };
        // The region is over the budget: the reclaimer takes it out while this thread
        // reads it back in, up to the munmap.
        for page in (0..pages).step_by(3) {
            assert!(holds(base, page, 1), "page {page} before the unmap");
        }
        go.store(true, SeqCst);
        // SAFETY: the test's own mapping, unmapped by "the program".
        assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
        unmapped.store(true, SeqCst);
        let (fresh, in_place) = other.join().expect("the fresh mapping kept every byte");
        landed += in_place as usize;
        for _ in 0..500 {
            if region.all_unmapped() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(region);
        for page in 0..pages {
            assert!(holds(fresh, page, 7), "page {page} of the fresh mapping after the region was let go");
        }
        // SAFETY: the fresh mapping, the test's own.
        unsafe { libc::munmap(fresh as *mut _, len) };
    }
    assert!(landed > rounds / 2, "only {landed} of {rounds} fresh mappings in place");
    let st = rt.stats();
    let errors: u64 = st.sizes.values().map(|s| s.ioctl_errors).sum();
    assert_eq!(errors, 0, "{:?}", st.total());
    assert!(st.total().zswpout > 0, "nothing was taken out: {:?}", st.total());
    eprintln!("{rounds} rounds, {landed} mapped anew in place; {:?}", st.total());
}

#[test]
fn unmapped_and_mapped_anew_by_another_thread_thread_path() {
    unmapped_and_mapped_anew_by_another_thread(FaultPath::Thread);
}

#[test]
fn unmapped_and_mapped_anew_by_another_thread_sigbus_path() {
    unmapped_and_mapped_anew_by_another_thread(FaultPath::Sigbus);
}

/// A fork carries an adopted mapping's swapped-out folios to a child that takes it
/// over (as the shim's child does): nothing is brought back in the parent but what
/// `touched_first` names (put in place, not carried: libc's own resets in the child),
/// and a carried folio the child touches before its runtime is up keeps the child's
/// bytes over the parent's data (said, counted `fork_touched`). The child adopts the
/// range in turn; every byte is right in both.
fn adopted_memory_is_carried_across_fork(path: FaultPath) {
    let cfg = || {
        let mut c = RuntimeConfig::new(8 * MIB as u64);
        c.fault_path = path;
        c.publish_stats = false;
        c.fork_carry = true;
        // Straight out: a folio on probation is out of view (mincore says so) but
        // not in the store, and is put back in place rather than carried (8 of 423
        // once were, under load, and the count below failed).
        c.policy = ReclaimPolicy::Fifo;
        c
    };
    let Some(rt) = common::or_skip(Runtime::new(cfg())) else { return };
    let len = 32 * MIB;
    let pages = len / PAGE;
    let base = program_mapping(len);
    for page in 0..pages {
        fill(base, page, 1);
    }
    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    wait_for_eviction(&rt, 8 * MIB as u64);
    // A folio out: the one to pin, and another for the child to touch first.
    let out: Vec<usize> = (0..len / FOLIO).filter(|&f| !resident(base + f * FOLIO)).collect();
    assert!(out.len() > 100, "only {} folios out", out.len());
    let (pinned, touched) = (out[0], out[out.len() / 2]);
    let before = rt.stats().total().zswpin;
    let hold = rt.hold_for_fork(|_, _| true, |pin| pin(base + pinned * FOLIO + 100, 8));
    let after = rt.stats().total().zswpin;
    assert_eq!(after, before + 1, "only the pinned folio comes back in the parent");
    assert!(resident(base + pinned * FOLIO), "the pinned folio is in place");
    assert!(hold.carried() >= out.len() - 1, "{} of {} folios carried", hold.carried(), out.len());
    // SAFETY: the child runs only this test's code and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            let at = base + touched * FOLIO + 8;
            // The child writes into a carried folio before its runtime is up: a hole
            // here, plain memory (zeros) until taken over.
            // SAFETY: inside the child's copy of the mapping.
            unsafe { (at as *mut u8).write_volatile(0xAB) };
            let inherited = hold.into_child();
            let Ok(own) = Runtime::new(cfg()) else { return 3 };
            let regions = inherited.take_over(Some(&own));
            if regions.len() != 1 || regions[0].1.adopted() != Some(MemoryKind::Mapping) {
                return 4;
            }
            if own.stats().total().fork_touched != 1 {
                return 5;
            }
            // SAFETY: as above.
            if unsafe { (at as *const u8).read_volatile() } != 0xAB {
                return 6;
            }
            // Back to what `fill` wrote there (the page's second word: the version, 1).
            // SAFETY: as above.
            unsafe { (at as *mut u8).write_volatile(1) };
            if !(0..pages).all(|p| holds(base, p, 1)) {
                return 1;
            }
            for p in (0..pages).step_by(3) {
                fill(base, p, 3);
            }
            if !(0..pages).all(|p| holds(base, p, if p % 3 == 0 { 3 } else { 1 })) {
                return 2;
            }
            drop(regions);
            0
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    let mut status = 0;
    // SAFETY: waitpid on our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child: 1 wrong bytes, 2 wrong after rewriting, 3 no runtime, 4 not adopted, 5 touch not counted, 6 touch lost"
    );
    assert_eq!(rt.stats().total().zswpin, after, "the fork brought folios back in the parent");
    for page in 0..pages {
        assert!(holds(base, page, 1), "page {page} in the parent after fork");
    }
    drop(region);
    // SAFETY: the test's own mapping, no longer managed.
    unsafe { libc::munmap(base as *mut _, len) };
}

/// Whether the page at `addr` is present (mincore).
fn resident(addr: usize) -> bool {
    let mut v = 0u8;
    // SAFETY: mincore of one page of the test's mapping into a byte we own.
    unsafe { libc::mincore(addr as *mut _, PAGE, &mut v) == 0 && v & 1 != 0 }
}

#[test]
fn adopted_memory_is_carried_across_fork_thread_path() {
    adopted_memory_is_carried_across_fork(FaultPath::Thread);
}

#[test]
fn adopted_memory_is_carried_across_fork_sigbus_path() {
    adopted_memory_is_carried_across_fork(FaultPath::Sigbus);
}

/// The program unmaps an adopted mapping and at once maps and adopts the same
/// addresses again. munmap returns as soon as the reader has *read* the unmap's event,
/// before it marked the first region's pages gone: were the second region put in the
/// table in between, the stale unmap was taken for its own (its folios dropped,
/// managed no more), or the first region's claim, not yet marked, refused the
/// adoption. A race: many rounds, each a chance.
fn adopted_again_where_just_unmapped(path: FaultPath) {
    let Some(rt) = runtime(path, 64 * MIB) else { return };
    let len = 4 * FOLIO;
    let (mut rounds, mut in_place) = (0, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rounds < 3000 && std::time::Instant::now() < deadline {
        rounds += 1;
        let base = program_mapping(len);
        let first = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
        // SAFETY: the test's own mapping, unmapped then mapped anew by "the program".
        let p = unsafe {
            assert_eq!(libc::munmap(base as *mut _, len), 0);
            libc::mmap(base as *mut _, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0)
        };
        if p == libc::MAP_FAILED {
            // Another test's mapping took the addresses first.
            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EEXIST));
            continue;
        }
        in_place += 1;
        let second = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).unwrap_or_else(|e| panic!("round {rounds}: adopted again: {e}"));
        // A later read: munmap of a region returns once the reader has read its
        // event, which it does only after marking what it read before.
        let w = program_mapping(FOLIO);
        let witness = rt.adopt_region(w, FOLIO, FOLIO, MemoryKind::Mapping).expect("adopt the witness");
        // SAFETY: the witness mapping, the test's own.
        assert_eq!(unsafe { libc::munmap(w as *mut _, FOLIO) }, 0);
        assert!(second.manages(base, base + len), "round {rounds}: the first region's unmap was taken for the second's");
        drop((witness, first, second));
        // SAFETY: the test's own mapping.
        assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
    }
    assert!(in_place > rounds / 2, "only {in_place} of {rounds} mapped again in place");
    eprintln!("{rounds} rounds, {in_place} adopted again in place");
}

#[test]
fn adopted_again_where_just_unmapped_thread_path() {
    adopted_again_where_just_unmapped(FaultPath::Thread);
}

#[test]
fn adopted_again_where_just_unmapped_sigbus_path() {
    adopted_again_where_just_unmapped(FaultPath::Sigbus);
}

/// An unmap the reader has read but cannot apply yet (a kernel-access hold keeps a
/// folio of the region locked) is still held when the program maps the same
/// addresses again and they are adopted. Once the hold goes, it is applied to the
/// region that was there when it was read, never to the new one: it once turned the
/// new region's folios UNMAPPED, managed no more.
fn an_unmap_held_back_spares_the_region_adopted_after_it(path: FaultPath) {
    let Some(rt) = runtime(path, MIB) else { return };
    let len = 4 * MIB;
    let pages = len / PAGE;
    let (base, first, second, hold) = (0..100)
        .find_map(|_| {
            let base = program_mapping(len);
            let first = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
            let hold = rt.hold_in_place(&[(base, PAGE, false)]);
            // SAFETY: the test's own mapping, unmapped then mapped anew by "the program".
            let p = unsafe {
                assert_eq!(libc::munmap(base as *mut _, len), 0);
                libc::mmap(base as *mut _, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0)
            };
            if p == libc::MAP_FAILED {
                // Another test's mapping took the addresses first.
                assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EEXIST));
                return None;
            }
            assert!(rt.range_events_pending(), "the unmap was applied through the hold");
            // The program's data, written before the adoption: a fault on the new
            // region would wait for the unmap held back.
            for page in 0..pages {
                fill(base, page, 2);
            }
            let second = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopted again");
            Some((base, first, second, hold))
        })
        .expect("never mapped again in place in 100 tries");
    drop(hold);
    // Each munmap of a registered range returns once the reader has read it, after
    // it applied what it could of the events held before.
    let mut tries = 0;
    while rt.range_events_pending() {
        let w = program_mapping(FOLIO);
        let witness = rt.adopt_region(w, FOLIO, FOLIO, MemoryKind::Mapping).expect("adopt the witness");
        // SAFETY: the witness mapping, the test's own.
        assert_eq!(unsafe { libc::munmap(w as *mut _, FOLIO) }, 0);
        drop(witness);
        tries += 1;
        assert!(tries < 10_000, "the unmap is still held after the hold went");
    }
    assert!(second.manages(base, base + len), "the first region's unmap was applied to the second");
    wait_for_eviction(&rt, MIB as u64);
    assert!(rt.stats().store.totals.zswpout > 0, "nothing was evicted");
    for page in 0..pages {
        assert!(holds(base, page, 2), "page {page} of the second region");
    }
    drop((first, second));
    // SAFETY: the test's own mapping.
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
}

#[test]
fn an_unmap_held_back_spares_the_region_adopted_after_it_thread_path() {
    an_unmap_held_back_spares_the_region_adopted_after_it(FaultPath::Thread);
}

#[test]
fn an_unmap_held_back_spares_the_region_adopted_after_it_sigbus_path() {
    an_unmap_held_back_spares_the_region_adopted_after_it(FaultPath::Sigbus);
}

/// The fork tests' runtime: a 2 MiB budget, carrying swapped-out folios to children.
fn carry_config() -> RuntimeConfig {
    let mut c = RuntimeConfig::new(2 * MIB as u64);
    c.publish_stats = false;
    c.fork_carry = true;
    c
}

/// A program mapping of `len` written once (version 1), adopted, evicted down to the
/// budget, and held for fork. `None`: no userfaultfd here.
fn held_for_fork(len: usize) -> Option<(Runtime, Region, usize, fork::ForkHold)> {
    let rt = common::or_skip(Runtime::new(carry_config()))?;
    let base = program_mapping(len);
    for page in 0..len / PAGE {
        fill(base, page, 1);
    }
    let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Mapping).expect("adopt");
    wait_for_eviction(&rt, 2 * MIB as u64);
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    Some((rt, region, base, hold))
}

/// Returns once the reader has marked every unmap or move it read before: a region
/// goes into the table only between a read and the next (moves.rs), so one adopted
/// and let go waits for them.
fn reader_caught_up(rt: &Runtime) {
    let w = program_mapping(FOLIO);
    drop(rt.adopt_region(w, FOLIO, FOLIO, MemoryKind::Mapping).expect("adopt the witness"));
    // SAFETY: the witness mapping, the test's own, no longer managed.
    unsafe { libc::munmap(w as *mut _, FOLIO) };
}

/// Another thread unmaps part of an adopted mapping between the fork hold and the
/// fork (here: the same thread, after the hold), half of a folio that is carried
/// swapped out, and maybe maps something else there (`mapped_again`). The child
/// finds the range not whole and takes nothing over: it places every carried folio
/// as plain memory, the torn one on the pages that are still the region's (they once
/// read as zeros: the folio was skipped whole), and leaves the hole as it is: free,
/// or the other mapping's bytes (mapped again, the range once looked whole to the
/// child, which took the region over across it). The parent keeps every byte.
fn unmapped_between_the_hold_and_the_fork(mapped_again: bool) {
    let len = 8 * MIB;
    let pages = len / PAGE;
    let Some((rt, region, base, hold)) = held_for_fork(len) else { return };
    // Carried: out still, the hold holding them (one in flight was put in place).
    let out: Vec<usize> = (0..len / FOLIO).filter(|&f| !resident(base + f * FOLIO)).collect();
    let carried = hold.carried();
    assert!(out.len() >= 20 && carried >= out.len(), "{} folios out, {carried} carried", out.len());
    // The second half of a carried folio goes.
    let torn = out[out.len() / 2];
    let (hole, hole_len) = (base + torn * FOLIO + FOLIO / 2, FOLIO / 2);
    // SAFETY: part of the test's own mapping.
    assert_eq!(unsafe { libc::munmap(hole as *mut _, hole_len) }, 0);
    let in_hole = |p: usize| (hole..hole + hole_len).contains(&(base + p * PAGE));
    if mapped_again {
        // So that the fork copies the unmap's marks (the gap before them is not
        // covered: see fork.rs `ours`).
        reader_caught_up(&rt);
        assert!(common::free_at(hole, hole_len), "the hole was mapped by another");
        for p in (0..pages).filter(|&p| in_hole(p)) {
            fill(base, p, 7);
        }
    }
    let hole_right = || if mapped_again { (0..pages).filter(|&p| in_hole(p)).all(|p| holds(base, p, 7)) } else { common::free_at(hole, hole_len) };
    common::fork_past_a_hole(hold, carry_config(), || (0..pages).filter(|&p| !in_hole(p)).all(|p| holds(base, p, 1)) && hole_right());
    for page in 0..pages {
        let want = if !in_hole(page) { 1 } else if mapped_again { 7 } else { continue };
        assert!(holds(base, page, want), "page {page} in the parent after fork");
    }
    drop(region);
    // SAFETY: the test's own mapping (the hole too, mapped again or not), no longer managed.
    unsafe { libc::munmap(base as *mut _, len) };
}

/// Another thread moves an adopted mapping whole (mremap) between the fork hold and
/// the fork; the reader follows the move. The child takes nothing over (nothing is
/// left where the region was carried from) and places every carried folio where the
/// mapping is now (they once went nowhere, and read as zeros there). The parent
/// keeps every byte, at the new place.
#[test]
fn moved_whole_between_the_hold_and_the_fork() {
    let len = 8 * MIB;
    let pages = len / PAGE;
    let Some((rt, region, base, hold)) = held_for_fork(len) else { return };
    assert!(hold.carried() >= 20, "{} folios carried", hold.carried());
    let to = program_mapping(len);
    // SAFETY: the test's own mapping moved over another of its own.
    let p = unsafe { libc::mremap(base as *mut _, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to as *mut libc::c_void) };
    assert_eq!(p as usize, to, "mremap: {}", std::io::Error::last_os_error());
    // So that the fork copies the region's new place (the reader follows a move as
    // it reads it).
    reader_caught_up(&rt);
    // (Where it was may hold the child's runtime's own mappings by then.)
    common::fork_past_a_hole(hold, carry_config(), || (0..pages).all(|p| holds(to, p, 1)));
    for page in 0..pages {
        assert!(holds(to, page, 1), "page {page} in the parent after fork, moved");
    }
    drop(region);
    // SAFETY: the test's own mapping, no longer managed.
    unsafe { libc::munmap(to as *mut _, len) };
}

#[test]
fn unmapped_in_part_between_the_hold_and_the_fork() {
    unmapped_between_the_hold_and_the_fork(false);
}

#[test]
fn unmapped_in_part_and_mapped_again_between_the_hold_and_the_fork() {
    unmapped_between_the_hold_and_the_fork(true);
}
