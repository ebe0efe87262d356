//! The file underneath: the `FileIo` trait every read, write and punch goes
//! through, the real private file behind it, and aligned buffers for O_DIRECT.

use crate::alloc::BLOCK;
use crate::{BackingConfig, BackingError, DirectIo};
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::path::Path;

/// The operations the backing file needs from the file system. The real one is
/// [`PrivateFile`]; [`crate::fault::FaultyIo`] wraps one to inject failures.
///
/// Methods have the semantics of the system calls they are named after: a write
/// or read may be short, and the caller retries.
pub trait FileIo: Send + Sync {
    fn pwritev(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize>;
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE).
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()>;
    /// fdatasync, then (buffered files) drop the file's clean pages from the page
    /// cache: a swap device must not keep in memory what it was given to hold.
    fn flush(&self) -> io::Result<()>;
    /// Whether the file is open with O_DIRECT (buffers and offsets 4 KiB aligned).
    fn direct_io(&self) -> bool;
    /// Disk space actually allocated to the file (st_blocks * 512).
    fn allocated_bytes(&self) -> io::Result<u64>;
    /// The descriptor, where there is one (the runtime keeps it out of the program's reach).
    fn raw_fd(&self) -> Option<RawFd>;
}

/// A file with no name: O_TMPFILE in the configured directory, or where that is not
/// supported, a randomly named file (O_EXCL, mode 0600) unlinked at once. Either
/// way nothing is left behind when the process dies.
#[derive(Debug)]
pub struct PrivateFile {
    file: File,
    direct: bool,
    /// False when the O_TMPFILE fallback was taken (for tests and diagnostics).
    anonymous_at_birth: bool,
}

/// The file system (its st_dev, plus one) where an O_DIRECT write of this process, or of
/// the process it was forked from, went through. A forked child opens a file of its
/// own at once: the probe below cost every fork a disk write and a hole punched (a
/// discard where the file system is mounted with it), for an answer its parent had.
static DIRECT_WORKS_ON: AtomicU64 = AtomicU64::new(0);

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

impl PrivateFile {
    /// Creates the file as `cfg` asks, probing O_DIRECT with one aligned write: if the
    /// file system refuses it, `DirectIo::Prefer` falls back to buffered I/O (see
    /// [`FileIo::direct_io`]) and `DirectIo::Require` fails with
    /// `BackingError::DirectIoUnsupported`.
    pub fn open(cfg: &BackingConfig) -> Result<PrivateFile, BackingError> {
        Self::open_with(cfg, true)
    }

    pub(crate) fn open_with(cfg: &BackingConfig, try_tmpfile: bool) -> Result<Self, BackingError> {
        let dir = &cfg.dir;
        let create_err = |source| BackingError::Create {
            dir: dir.clone(),
            source,
        };
        let unsupported = |source| BackingError::DirectIoUnsupported {
            dir: dir.clone(),
            source,
        };
        let want_direct = cfg.direct_io != DirectIo::Off;
        let (file, anonymous_at_birth) = match open_private(dir, want_direct, try_tmpfile) {
            Err(e) if want_direct && is_einval(&e) => {
                if cfg.direct_io == DirectIo::Require {
                    return Err(unsupported(e));
                }
                open_private(dir, false, try_tmpfile).map_err(create_err)?
            }
            other => other.map_err(create_err)?,
        };
        let file = match cfg.place_fd {
            Some(place) => File::from(place(OwnedFd::from(file))),
            None => file,
        };
        // umask may have narrowed the mode; nothing may widen it.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(create_err)?;
        let mut this = PrivateFile {
            file,
            direct: false,
            anonymous_at_birth,
        };
        if want_direct {
            this.direct = fcntl_flags(this.fd()).map_err(create_err)? & libc::O_DIRECT != 0;
        }
        let dev = this.file.metadata().map(|m| m.dev() + 1).unwrap_or(0);
        if this.direct && (dev == 0 || DIRECT_WORKS_ON.load(Relaxed) != dev) {
            // Some file systems accept O_DIRECT at open and refuse it on the first I/O.
            let probe = AlignedBuf::zeroed(BLOCK as usize);
            match this.file.write_at(&probe, 0) {
                Ok(_) => DIRECT_WORKS_ON.store(dev, Relaxed),
                Err(e) if is_einval(&e) => {
                    if cfg.direct_io == DirectIo::Require {
                        return Err(unsupported(e));
                    }
                    let flags = fcntl_flags(this.fd()).map_err(create_err)?;
                    // SAFETY: F_SETFL on a descriptor we own.
                    if unsafe { libc::fcntl(this.fd(), libc::F_SETFL, flags & !libc::O_DIRECT) } < 0
                    {
                        return Err(create_err(io::Error::last_os_error()));
                    }
                    this.direct = false;
                }
                Err(e) => return Err(create_err(e)),
            }
            let _ = this.punch_hole(0, BLOCK);
        }
        Ok(this)
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Whether O_TMPFILE made the file (false: the named-and-unlinked fallback).
    pub fn was_tmpfile(&self) -> bool {
        self.anonymous_at_birth
    }
}

impl AsRawFd for PrivateFile {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

fn fcntl_flags(fd: RawFd) -> io::Result<i32> {
    // SAFETY: F_GETFL has no memory arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(flags)
    }
}

/// Returns the file and whether O_TMPFILE made it.
fn open_private(dir: &Path, direct: bool, try_tmpfile: bool) -> io::Result<(File, bool)> {
    let direct_flag = if direct { libc::O_DIRECT } else { 0 };
    if try_tmpfile {
        let tmp = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE | direct_flag)
            .open(dir);
        match tmp {
            Ok(f) => return Ok((f, true)),
            // O_DIRECT refused: let the caller decide; anything else (EOPNOTSUPP,
            // EISDIR on old kernels, ...) tries the named fallback, which reports
            // the real problem if the directory itself is unusable.
            Err(e) if direct && is_einval(&e) => return Err(e),
            Err(_) => {}
        }
    }
    let pid = std::process::id();
    let mut last = io::Error::from_raw_os_error(libc::EEXIST);
    for _ in 0..16 {
        // RandomState is seeded from the OS's random source: an unguessable name.
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let path = dir.join(format!(".uzswap-backing-{pid}-{seed:016x}"));
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(direct_flag)
            .open(&path);
        match opened {
            Ok(f) => {
                std::fs::remove_file(&path)?;
                return Ok((f, false));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

fn cvt(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

impl FileIo for PrivateFile {
    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.fd())
    }
    fn pwritev(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        let count = bufs.len().min(libc::UIO_MAXIOV as usize) as libc::c_int;
        // SAFETY: IoSlice is ABI-compatible with struct iovec on Unix; the slices
        // outlive the call.
        cvt(unsafe {
            libc::pwritev(
                self.fd(),
                bufs.as_ptr() as *const libc::iovec,
                count,
                offset as libc::off_t,
            )
        })
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: no memory arguments.
        let ret =
            unsafe { libc::fallocate(self.fd(), mode, offset as libc::off_t, len as libc::off_t) };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()?;
        if !self.direct {
            // SAFETY: no memory arguments. Advisory: a failure only costs memory.
            unsafe { libc::posix_fadvise(self.fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        Ok(())
    }

    fn direct_io(&self) -> bool {
        self.direct
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.file.metadata()?.blocks() * 512)
    }
}

impl<T: FileIo + ?Sized> FileIo for Box<T> {
    fn pwritev(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        (**self).pwritev(bufs, offset)
    }
    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        (**self).pread(buf, offset)
    }
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        (**self).punch_hole(offset, len)
    }
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
    fn direct_io(&self) -> bool {
        (**self).direct_io()
    }
    fn allocated_bytes(&self) -> io::Result<u64> {
        (**self).allocated_bytes()
    }
    fn raw_fd(&self) -> Option<RawFd> {
        (**self).raw_fd()
    }
}

/// A zeroed, 4 KiB-aligned heap buffer (O_DIRECT wants aligned memory).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), BLOCK as usize).expect("aligned layout")
    }

    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialized bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we are borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_is_empty(dir: &Path) -> bool {
        std::fs::read_dir(dir).unwrap().next().is_none()
    }

    #[test]
    fn named_fallback_leaves_nothing_and_is_0600() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = BackingConfig::new(dir.path(), 4 << 20);
        let f = PrivateFile::open_with(&cfg, false).unwrap();
        assert!(!f.was_tmpfile());
        assert!(dir_is_empty(dir.path()));
        let mode = f.file.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let data = AlignedBuf::zeroed(8192);
        assert_eq!(f.pwritev(&[IoSlice::new(&data)], 0).unwrap(), 8192);
    }

    /// The O_DIRECT probe (a block written at offset 0, then punched: the file keeps
    /// its size) runs once per file system, not for every file (a forked child's).
    #[test]
    fn direct_io_is_probed_once_per_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = BackingConfig::new(dir.path(), 4 << 20);
        let first = PrivateFile::open(&cfg).unwrap();
        if !first.direct_io() {
            eprintln!("SKIP: no O_DIRECT on {}", dir.path().display());
            return;
        }
        let second = PrivateFile::open(&cfg).unwrap();
        assert!(second.direct_io());
        assert_eq!(second.file.metadata().unwrap().len(), 0, "probed again");
        let data = AlignedBuf::zeroed(8192);
        assert_eq!(second.pwritev(&[IoSlice::new(&data)], 0).unwrap(), 8192);
    }

    #[test]
    fn missing_dir_is_a_clear_error() {
        let cfg = BackingConfig::new("/nonexistent/uzswap-backing-test", 4 << 20);
        let err = PrivateFile::open(&cfg).unwrap_err();
        assert!(matches!(err, BackingError::Create { .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent/uzswap-backing-test"),
            "{err}"
        );
    }
}
