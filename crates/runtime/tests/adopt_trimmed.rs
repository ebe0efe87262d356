//! Adoption of a mapping whose top the program unmapped between the scan's read of
//! /proc/self/maps and the registration (glibc trimming its brk heap between the
//! two). The kernel registers what is still mapped and says nothing of the rest:
//! those addresses are not the region's. A folio there is gone as if unmapped, and
//! what the program maps there next (the heap regrown) is its own, free to be adopted
//! again. Taken for the region's, the regrown heap could never be adopted (gcc's cc1
//! ran with 40 MiB of its heap unmanaged, its tree 50% over the budget), and a page of
//! it found present when the region was set up could have been taken out of a mapping
//! that sends no faults.
//!
//! A test binary of its own, one test: a mapping another test made meanwhile could
//! land in the hole.

mod common;
use uzswap_runtime::*;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;
const FOLIO: usize = 64 << 10;

/// Writes a page: its number and `version` in every word.
fn fill(base: usize, page: usize, version: u64) {
    let p = (base + page * PAGE) as *mut u64;
    for w in 0..PAGE / 8 {
        // SAFETY: the page lies inside the test's live mapping.
        unsafe { p.add(w).write_volatile((page as u64) << 8 | version) };
    }
}

fn holds(base: usize, page: usize, version: u64) -> bool {
    let p = (base + page * PAGE) as *const u64;
    // SAFETY: as in `fill`.
    (0..PAGE / 8).all(|w| unsafe { p.add(w).read_volatile() } == (page as u64) << 8 | version)
}

/// A private anonymous mapping of `len` bytes at a FOLIO boundary.
fn program_mapping(len: usize) -> usize {
    // SAFETY: a fresh anonymous mapping; the head and tail trimmed are inside it.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len + FOLIO, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert_ne!(p, libc::MAP_FAILED);
        let p = p as usize;
        let a = p.next_multiple_of(FOLIO);
        if a > p {
            libc::munmap(p as *mut _, a - p);
        }
        libc::munmap((a + len) as *mut _, p + FOLIO - a);
        a
    }
}

fn trimmed_before_registration(path: FaultPath) {
    let mut cfg = RuntimeConfig::new(MIB as u64);
    cfg.fault_path = path;
    cfg.publish_stats = false;
    let Some(rt) = common::or_skip(Runtime::new(cfg)) else { return };
    let len = 4 * MIB;
    let kept = 2 * MIB + 5 * PAGE; // the top 3 folios less 5 pages: one torn
    let torn = kept / PAGE..kept.next_multiple_of(FOLIO) / PAGE;
    // A mapping of the runtime's may take the hole before the heap regrows: tried again.
    let (base, region) = (0..8)
        .find_map(|_| {
            let base = program_mapping(len);
            for page in 0..len / PAGE {
                fill(base, page, 1);
            }
            // SAFETY: the test's own mapping: its top, as a heap trim.
            assert_eq!(unsafe { libc::munmap((base + kept) as *mut _, len - kept) }, 0);
            let region = rt.adopt_region(base, len, FOLIO, MemoryKind::Heap).expect("adopt");
            let top = base + torn.end * PAGE;
            assert!(!region.manages(top, base + len), "the unmapped top is not the region's");
            assert!(region.manages(base, top), "what is mapped is");
            // The heap regrows.
            // SAFETY: a fresh mapping where the test's own was unmapped, if still free.
            let p = unsafe { libc::mmap((base + kept) as *mut _, len - kept, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0) };
            if p as usize == base + kept {
                return Some((base, region));
            }
            drop(region);
            // SAFETY: the test's own mapping, no longer managed.
            unsafe { libc::munmap(base as *mut _, kept) };
            None
        })
        .expect("the hole stayed free in one of 8 tries");
    for page in kept / PAGE..len / PAGE {
        fill(base, page, 2);
    }
    let top = base + torn.end * PAGE;
    let again = rt.adopt_region(top, base + len - top, FOLIO, MemoryKind::Heap).expect("the regrown heap may be adopted");
    // Pressure on the budget: both regions go out and come back.
    for _ in 0..500 {
        if rt.stats().resident_bytes <= MIB as u64 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    for page in 0..len / PAGE {
        let version = if page < kept / PAGE { 1 } else { 2 };
        assert!(holds(base, page, version), "page {page} (torn folio: pages {torn:?})");
    }
    drop(again);
    drop(region);
    let errors: u64 = rt.stats().sizes.values().map(|s| s.ioctl_errors).sum();
    assert_eq!(errors, 0, "{:?}", rt.stats().total());
    // SAFETY: the test's own mapping, no longer managed.
    unsafe { libc::munmap(base as *mut _, len) };
}

#[test]
fn adopted_with_its_top_already_unmapped() {
    trimmed_before_registration(FaultPath::Thread);
    trimmed_before_registration(FaultPath::Sigbus);
}
