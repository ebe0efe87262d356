//! Which parts of a range a userfaultfd registration covers, as /proc/self/smaps says
//! (`VmFlags: um`): what adoption checks right after it registers a range the program
//! mapped.
//!
//! Adoption registers what the scan read in /proc/self/maps, and the program may have
//! unmapped part of it since (glibc trims its brk heap from the top). UFFDIO_REGISTER
//! takes a range with holes: it registers the mappings it finds and says nothing of
//! the rest. No UNMAP event ever comes for a hole, and what the program maps there
//! next (the heap regrown) is not registered: it sends no faults, and is the
//! program's alone. So every page of the range that is not in a registered mapping
//! once the region is in the fault table is gone (region.rs, "Pages unmapped"); from
//! then on, the events say what the program unmaps.
//!
//! Not a parser of everything smaps holds: only the mappings' extents and flags, read
//! no further than the range (the file is made as it is read, a mapping at a time),
//! and smaps only where /proc/self/maps, which costs far less, cannot tell.

use std::io;

/// Calls `op(start, end)` for each part of `[lo, hi)` (page aligned), which the
/// caller has registered, in no mapping registered for missing faults with a
/// userfaultfd: holes, and mappings made since.
pub(crate) fn unregistered(lo: usize, hi: usize, mut op: impl FnMut(usize, usize)) -> io::Result<()> {
    // One mapping over the whole range is the one registered: the kernel merges
    // mappings only with the same userfaultfd context, so one made since in a hole
    // would show apart (the whole range unmapped since comes as an event). Asked of
    // the kernel for that one address (PROCMAP_QUERY, 6.11), else read from
    // /proc/self/maps: a text of every mapping, which for node (2,000 of them, a region
    // adopted for each V8 page) took the scan so long that V8's heap outgrew the budget
    // twice over before it was adopted. smaps, which walks the page tables (15 ms for a
    // process with 1 GiB resident), only when neither can tell.
    let whole = match covering(lo) {
        Some(vma) => vma.0 <= lo && vma.1 >= hi,
        None => {
            let mut whole = false;
            each_line(c"/proc/self/maps", hi, |line| {
                whole |= extent(line).is_some_and(|(s, e)| s <= lo && e >= hi);
            })?;
            whole
        }
    };
    if whole {
        return Ok(());
    }
    let mut at = lo;
    let mut flags_of: Option<(usize, usize)> = None;
    each_line(c"/proc/self/smaps", hi, |line| {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some((s, e)) = flags_of.take() {
                if flags.split_ascii_whitespace().any(|f| f == "um") {
                    if s > at {
                        op(at, s);
                    }
                    at = at.max(e);
                }
            }
            return;
        }
        if let Some((s, e)) = extent(line) {
            // Only mappings that meet the range matter.
            flags_of = (s < hi && e > at).then_some((s.max(lo), e.min(hi)));
        }
    })?;
    if at < hi {
        op(at, hi);
    }
    Ok(())
}

/// The kernel's `struct procmap_query` (include/uapi/linux/fs.h), as far as asked.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// _IOWR('f', 17, struct procmap_query).
const PROCMAP_QUERY: libc::c_ulong = (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16) | ((b'f' as libc::c_ulong) << 8) | 17;

/// The extent of the mapping that holds `addr`, asked with PROCMAP_QUERY: Some((0, 0))
/// if none does; None where the kernel cannot be asked so (before 6.11) or /proc is
/// out of reach.
fn covering(addr: usize) -> Option<(usize, usize)> {
    // SAFETY: a path with its NUL; the descriptor is closed below.
    let fd = unsafe { libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let mut q = ProcmapQuery { size: std::mem::size_of::<ProcmapQuery>() as u64, query_addr: addr as u64, ..Default::default() };
    // SAFETY: PROCMAP_QUERY reads and writes `q`, a whole procmap_query of ours whose
    // name and build-id buffers are null with sizes 0 (not asked for).
    let rc = unsafe { libc::ioctl(fd, PROCMAP_QUERY as _, &mut q as *mut ProcmapQuery) };
    let errno = std::io::Error::last_os_error().raw_os_error();
    // SAFETY: our own descriptor, opened above.
    unsafe { libc::close(fd) };
    match rc {
        0 => Some((q.vma_start as usize, q.vma_end as usize)),
        _ if errno == Some(libc::ENOENT) => Some((0, 0)),
        _ => None,
    }
}

/// A mapping's first line in smaps starts with its extent, `start-end` in hex; the
/// others with `Key:`.
fn extent(line: &str) -> Option<(usize, usize)> {
    let first = line.split_ascii_whitespace().next()?;
    let (a, b) = first.split_once('-')?;
    Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
}

/// Hands `op` each line of `path` (/proc/self/maps or smaps), up to the first mapping
/// that starts at or past `stop`.
fn each_line(path: &std::ffi::CStr, stop: usize, mut op: impl FnMut(&str)) -> io::Result<()> {
    // SAFETY: a path with its NUL; the descriptor is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = Vec::with_capacity(64 << 10);
    let result = (|| loop {
        let len = buf.len();
        buf.resize(len + (32 << 10), 0);
        // SAFETY: read(2) into the part of `buf` just grown, which we own.
        let n = unsafe { libc::read(fd, buf[len..].as_mut_ptr().cast(), 32 << 10) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(len + n as usize);
        let done = n == 0;
        // Whole lines only; a partial one waits for the next read.
        let upto = if done { buf.len() } else { buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) };
        let text = std::str::from_utf8(&buf[..upto]).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        for line in text.lines() {
            if extent(line).is_some_and(|(s, _)| s >= stop) {
                return Ok(());
            }
            op(line);
        }
        if done {
            return Ok(());
        }
        buf.drain(..upto);
    })();
    // SAFETY: our own descriptor, opened above.
    unsafe { libc::close(fd) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_and_key_lines() {
        assert_eq!(extent("7e7dd4c00000-7e7dd6418000 rw-p 00000000 00:00 0 "), Some((0x7e7dd4c00000, 0x7e7dd6418000)));
        assert_eq!(extent("39d1f000-3b586000 rw-p 00000000 00:00 0                          [heap]"), Some((0x39d1f000, 0x3b586000)));
        assert_eq!(extent("Size:                  24988 kB"), None);
        assert_eq!(extent("VmFlags: rd wr mr mw me um uw ac"), None);
    }

    /// A mapping of the test's own, registered in part with a userfaultfd of its own,
    /// with a hole: the parts reported are the hole and the unregistered part.
    #[test]
    fn holes_and_unregistered_parts() {
        const PAGE: usize = 4096;
        let uffd = match crate::uffd::Uffd::open(0) {
            Ok((uffd, _)) => uffd,
            Err(why) => return println!("SKIP: {why}"),
        };
        // SAFETY: a fresh anonymous mapping of the test's own.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), 16 * PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) } as usize;
        assert_ne!(base, libc::MAP_FAILED as usize);
        // SAFETY: pages 12..14 of the test's own mapping.
        assert_eq!(unsafe { libc::munmap((base + 12 * PAGE) as *mut _, 2 * PAGE) }, 0);
        uffd.register(base + 4 * PAGE, 12 * PAGE, crate::uffd::REGISTER_MODE_MISSING).expect("register 4..16 (a hole at 12..14)");
        let mut parts = Vec::new();
        unregistered(base, base + 16 * PAGE, |s, e| parts.push(((s - base) / PAGE, (e - base) / PAGE))).expect("smaps");
        assert_eq!(parts, [(0, 4), (12, 14)]);
        parts.clear();
        unregistered(base + 5 * PAGE, base + 11 * PAGE, |s, e| parts.push(((s - base) / PAGE, (e - base) / PAGE))).expect("maps");
        assert!(parts.is_empty(), "{parts:?}");
        match covering(base + 5 * PAGE) {
            Some(at) => {
                assert_eq!(at, (base + 4 * PAGE, base + 12 * PAGE), "the registered part is a mapping of its own");
                assert_eq!(covering(base + 12 * PAGE), Some((0, 0)), "the hole");
            }
            None => println!("SKIP: no PROCMAP_QUERY here (kernel before 6.11): /proc/self/maps is read instead"),
        }
        // Registered in two pieces that do not merge (a page between them is
        // read-only): smaps says both are.
        // SAFETY: a page of the test's own mapping.
        assert_eq!(unsafe { libc::mprotect((base + 8 * PAGE) as *mut _, PAGE, libc::PROT_READ) }, 0);
        unregistered(base + 4 * PAGE, base + 12 * PAGE, |s, e| parts.push(((s - base) / PAGE, (e - base) / PAGE))).expect("smaps");
        assert!(parts.is_empty(), "{parts:?}");
        let _ = uffd.unregister(base, 16 * PAGE);
        // SAFETY: the test's own mapping.
        unsafe { libc::munmap(base as *mut _, 16 * PAGE) };
    }
}
