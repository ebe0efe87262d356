//! Failure injection: a [`FileIo`] that wraps another and fails the writes and
//! reads it is told to, so this crate's tests and the store's can see what a full
//! disk, an I/O error or a short write does to them.
//!
//! ```
//! # use uzswap_backing::{*, fault::*};
//! # let dir = tempfile::tempdir().unwrap();
//! let cfg = BackingConfig::new(dir.path(), 8 << 20);
//! let plan = FaultPlan::new();
//! let io = FaultyIo::new(PrivateFile::open(&cfg).unwrap(), plan.clone());
//! let backing = BackingFile::with_io(cfg, Box::new(io)).unwrap();
//! plan.fail_next_write(Fault::NoSpace);
//! let err = backing.write_batch(&[Record { key: 1, data: b"x" }]).unwrap_err();
//! assert!(matches!(err, BackingError::DeviceFull { .. }));
//! ```

use crate::io::FileIo;
use uzswap_sync::Mutex;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

/// What an injected failure does to one system call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Fail with ENOSPC, writing nothing.
    NoSpace,
    /// Fail with EIO, writing (or reading) nothing.
    Eio,
    /// Write (or read) only the first this-many bytes, and say so (rounded down
    /// to whole 4 KiB blocks for an O_DIRECT write).
    Short(usize),
    /// Return 0 bytes done: a short write that makes no progress.
    NoProgress,
    /// Succeed, but with one byte in the middle flipped: silent corruption on the
    /// device, which only a checksum can catch.
    Flip,
}

#[derive(Default)]
struct PlanState {
    writes: VecDeque<Fault>,
    reads: VecDeque<Fault>,
    every_write: Option<Fault>,
    injected: u64,
}

/// The faults still to inject; cloned handles share one plan.
#[derive(Clone, Default)]
pub struct FaultPlan(Arc<Mutex<PlanState>>);

impl FaultPlan {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next write call (after any already queued) fails this way.
    pub fn fail_next_write(&self, fault: Fault) {
        self.0.lock().writes.push_back(fault);
    }

    /// The next read call (after any already queued) fails this way.
    pub fn fail_next_read(&self, fault: Fault) {
        self.0.lock().reads.push_back(fault);
    }

    /// Every write fails this way until called again with `None` (queued faults
    /// still come first).
    pub fn fail_every_write(&self, fault: Option<Fault>) {
        self.0.lock().every_write = fault;
    }

    /// How many faults have been injected so far.
    pub fn injected(&self) -> u64 {
        self.0.lock().injected
    }

    fn next_write(&self) -> Option<Fault> {
        let mut s = self.0.lock();
        let f = s.writes.pop_front().or(s.every_write);
        s.injected += f.is_some() as u64;
        f
    }

    fn next_read(&self) -> Option<Fault> {
        let mut s = self.0.lock();
        let f = s.reads.pop_front();
        s.injected += f.is_some() as u64;
        f
    }
}

/// Wraps a real [`FileIo`] and injects the faults of a [`FaultPlan`].
pub struct FaultyIo<I> {
    inner: I,
    plan: FaultPlan,
}

impl<I: FileIo> FaultyIo<I> {
    pub fn new(inner: I, plan: FaultPlan) -> Self {
        FaultyIo { inner, plan }
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl<I: FileIo> FileIo for FaultyIo<I> {
    fn pwritev(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        match self.plan.next_write() {
            None => self.inner.pwritev(bufs, offset),
            Some(Fault::NoSpace) => Err(errno(libc::ENOSPC)),
            Some(Fault::Eio) => Err(errno(libc::EIO)),
            Some(Fault::NoProgress) => Ok(0),
            Some(Fault::Flip) => {
                let mut data: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
                let mid = data.len() / 2;
                if let Some(b) = data.get_mut(mid) {
                    *b ^= 0x10;
                }
                if self.inner.direct_io() {
                    // O_DIRECT wants an aligned buffer: write the flipped copy through one.
                    let mut aligned = crate::io::AlignedBuf::zeroed(data.len());
                    aligned.copy_from_slice(&data);
                    return self.inner.pwritev(&[IoSlice::new(&aligned)], offset);
                }
                self.inner.pwritev(&[IoSlice::new(&data)], offset)
            }
            Some(Fault::Short(limit)) => {
                // A real partial write: the first `limit` bytes reach the file (whole
                // blocks under O_DIRECT, as a partial direct write would be).
                let mut left = if self.inner.direct_io() {
                    limit - limit % crate::alloc::BLOCK as usize
                } else {
                    limit
                };
                let mut cut = Vec::new();
                for b in bufs {
                    if left == 0 {
                        break;
                    }
                    let take = b.len().min(left);
                    cut.push(IoSlice::new(&b[..take]));
                    left -= take;
                }
                if cut.is_empty() {
                    return Ok(0);
                }
                self.inner.pwritev(&cut, offset)
            }
        }
    }

    fn pread(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        match self.plan.next_read() {
            None => self.inner.pread(buf, offset),
            Some(Fault::NoSpace) => Err(errno(libc::ENOSPC)),
            Some(Fault::Eio) => Err(errno(libc::EIO)),
            Some(Fault::NoProgress) => Ok(0),
            Some(Fault::Flip) => {
                let n = self.inner.pread(buf, offset)?;
                if n > 0 {
                    buf[n / 2] ^= 0x10;
                }
                Ok(n)
            }
            Some(Fault::Short(limit)) => {
                let take = buf.len().min(limit);
                self.inner.pread(&mut buf[..take], offset)
            }
        }
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.punch_hole(offset, len)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn direct_io(&self) -> bool {
        self.inner.direct_io()
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        self.inner.allocated_bytes()
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        self.inner.raw_fd()
    }
}
