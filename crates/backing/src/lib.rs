//! uzswap-backing: uzswap's swap device. When the compressed pool is full, the
//! store writes its coldest entries here, and a later fault reads them back.
//!
//! # What it is
//!
//! One private file per [`BackingFile`]: made with O_TMPFILE in the configured
//! directory (or, where that is unsupported, created O_EXCL with mode 0600 under a
//! random name and unlinked at once), so it has no name and nothing survives the
//! process. It is opened with O_DIRECT when the file system allows it, so that
//! what the store pushed out of memory does not come straight back as page cache.
//!
//! # Layout and allocation
//!
//! The file is an array of 4 KiB blocks grouped into clusters (default 2 MiB, the
//! kernel's swap cluster), handed out by a cluster allocator modelled on
//! mm/swapfile.c since 6.12: a cluster belongs to one size order, extents of that
//! order fill it front to back, and when neither a cluster of the right order nor
//! a free cluster can take an extent, it borrows a hole elsewhere — a counted
//! *cluster fallback* (the analogue of `swpout_fallback`). A record larger than a
//! cluster takes consecutive free clusters. As THP swap-out keeps a huge page whole, a 2 MiB folio
//! therefore lands in one cluster and goes out as one 2 MiB sequential write, and
//! a batch of records that got adjacent extents goes out as one `pwritev`.
//!
//! A record is stored as its bytes, padded to a block; nothing else is on disk.
//! Its checksum (crc32c over key, length and data) lives in the [`Slot`] handle
//! the caller keeps, as btrfs keeps checksums apart from data: this keeps a 2 MiB
//! folio exactly one cluster and every record block-aligned on disk (no header to
//! push it over), and catches the same faults a header would — a flipped bit, a
//! torn or lost write, a read of the wrong place or of stale data — because the
//! key and length are in the sum. A mismatch is [`BackingError::Corrupt`] naming
//! the slot, never wrong bytes (the output buffer is zeroed).
//!
//! Freed space is reused at once. A cluster left empty is punched whole
//! (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE) before it becomes allocatable
//! again; a freed record of 64 KiB or more in a cluster that stays in use is
//! punched before its blocks are released. Either way no punch can hit data that
//! someone else has written since.
//!
//! # Life cycle and locking
//!
//! `write_batch` validates the records, allocates an extent for each under the
//! allocator mutex, drops the lock, and writes. Any failure — no space, ENOSPC,
//! EIO, a short write that makes no progress — releases every extent of the batch
//! and returns an error saying which, so the caller keeps its entries (the store
//! counts a reject). A short write that does progress is retried to completion.
//! `read` takes no lock at all (the slot says where to read); `free` takes the
//! allocator mutex only to check and release the extent. The caller must not free
//! a slot while a read of it is in flight (the store's entry ownership does that).
//! Freeing a slot that is not live (never written, already freed, wrong length)
//! is a `BadSlot` error; the one case not caught is freeing a stale copy of a slot
//! whose exact extent has since been handed to a new record: once that space is
//! written again, reading the new record fails its checksum (loudly, no wrong bytes).
//!
//! With [`BackingConfig::encrypt`], records are sealed with AES-256-GCM under
//! a key made per file and held only in memory (module `seal`): the file then shows
//! nothing of what it holds, and a tampered record is `Corrupt`.
//!
//! Under O_DIRECT, records whose memory is not block-aligned are copied into
//! aligned bounce buffers; up to 24 MiB of them are kept for reuse.
//!
//! # On a signal handler's path
//!
//! The store reads records back, and frees their slots, inside the runtime's SIGBUS
//! handler, on a thread that may have been interrupted in its own malloc. Two calls
//! are made for that, and only they may be used there:
//! - [`BackingFile::read_in_place`] reads into the caller's buffer, which must be
//!   block-aligned and hold whole blocks ([`AlignedBuf`]): `pread` straight into it,
//!   so no bounce buffer is taken or made; the checksum (and, encrypted, the cipher)
//!   work in place; the only lock is the seal table's mutex when encrypted (a futex,
//!   `uzswap-sync`: nothing allocated to wait); errors carry no heap memory.
//! - [`BackingFile::free_deferred`] checks the slot's bounds and pushes it on a
//!   queue under a std mutex. The queue's capacity is kept at least the number of
//!   live records (grown by `write_batch`, which allocates anyway), and a slot stays
//!   live until reaped, so the push never allocates; a push that would grow it is a
//!   double free and is refused. [`BackingFile::reap`] does the real frees (the
//!   allocator's sets and lists allocate and free).
//!
//! `read` (bounce buffers) and `free` are not for that path.
//!
//! All file I/O goes through the [`FileIo`] trait: [`PrivateFile`] is the real
//! file and [`fault::FaultyIo`] wraps one to inject ENOSPC, EIO and short writes;
//! [`BackingFile::with_io`] takes either.
//!
//! # What it is not
//!
//! Not persistent (no superblock, no recovery: the file dies with the process),
//! not a cache (it keeps no data in memory but a few windows read ahead of a
//! sequential pass, module `around`), and it does not pack records
//! smaller than a block together: the store decides what goes into a record.
//!
//! ```
//! use uzswap_backing::{BackingConfig, BackingFile, Record};
//! let dir = tempfile::tempdir().unwrap();
//! let backing = BackingFile::create(BackingConfig::new(dir.path(), 64 << 20)).unwrap();
//! let slots = backing.write_batch(&[Record { key: 7, data: b"cold folio" }]).unwrap();
//! let mut out = vec![0; slots[0].data_len()];
//! backing.read(&slots[0], &mut out).unwrap();
//! assert_eq!(out, b"cold folio");
//! backing.free(slots[0]).unwrap();
//! ```

mod alloc;
mod around;
pub mod fault;
mod io;
mod seal;
mod tier;
#[cfg(test)]
mod tests;

pub use alloc::ClusterCounts;
pub use io::{AlignedBuf, FileIo, PrivateFile};
pub use seal::Aead;
pub use tier::Tier;

use alloc::{ClusterAllocator, Extent, BLOCK};
use around::ReadAround;
use seal::Sealer;
use uzswap_sync::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::io::IoSlice;
use std::os::fd::{OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::{Relaxed, SeqCst}};

/// The block size: the allocation unit and the O_DIRECT alignment.
pub const BLOCK_SIZE: usize = BLOCK as usize;
/// The default cluster: a PMD-sized folio, as in the kernel's swap clusters.
pub const DEFAULT_CLUSTER_SIZE: u64 = 2 << 20;
/// Freed runs at least this long are punched even if their cluster stays in use.
pub const PUNCH_MIN_BYTES: u64 = 64 << 10;
/// A run of adjacent records is split into system calls of at most this size
/// (larger gains nothing on a device, and bounds the O_DIRECT staging copy).
const MAX_WRITE_BYTES: u64 = 8 << 20;
/// ... and of at most this many records (each may take two iovecs).
const MAX_WRITE_RECORDS: usize = 256;
/// A write that makes no progress this many times in a row is an error.
const MAX_STALLS: u32 = 3;
/// O_DIRECT bounce buffers kept for reuse (allocating and faulting in a fresh
/// 8 MiB buffer per batch halves 2 MiB writeback): at most this many, this much.
const BOUNCE_KEEP: usize = 4;
const BOUNCE_KEEP_BYTES: usize = 24 << 20;

static ZEROS: [u8; BLOCK_SIZE] = [0; BLOCK_SIZE];

/// Whether to bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIo {
    /// Buffered I/O; [`BackingFile::flush`] syncs and drops the cached pages.
    Off,
    /// O_DIRECT if the file system takes it, else buffered
    /// ([`BackingFile::direct_io`] tells which).
    Prefer,
    /// O_DIRECT or [`BackingError::DirectIoUnsupported`].
    Require,
}

/// How to make a backing file.
#[derive(Clone, Debug)]
pub struct BackingConfig {
    /// Directory the nameless file lives in (its file system holds the data).
    pub dir: PathBuf,
    /// Most bytes the file may hold, rounded down to whole clusters.
    pub max_bytes: u64,
    pub direct_io: DirectIo,
    /// Allocation cluster: a power of two, at least 4 KiB (default 2 MiB).
    pub cluster_size: u64,
    /// Encrypt every record with AES-256-GCM under a key made for this file
    /// and kept only in memory (see the `seal` module). Costs a copy and the cipher
    /// per record, and about 40 bytes of memory per live record.
    pub encrypt: bool,
    /// Called with the file's descriptor once it is open; returns the descriptor to
    /// use instead (the runtime moves its descriptors out of the program's way).
    pub place_fd: Option<fn(OwnedFd) -> OwnedFd>,
}

impl BackingConfig {
    /// `max_bytes` in `dir`, O_DIRECT if possible, 2 MiB clusters.
    pub fn new(dir: impl AsRef<Path>, max_bytes: u64) -> Self {
        BackingConfig {
            dir: dir.as_ref().to_path_buf(),
            max_bytes,
            direct_io: DirectIo::Prefer,
            cluster_size: DEFAULT_CLUSTER_SIZE,
            encrypt: false,
            place_fd: None,
        }
    }

    fn clusters(&self) -> Result<u32, BackingError> {
        let bad = |why: String| Err(BackingError::InvalidConfig(why));
        if !self.cluster_size.is_power_of_two() || !(BLOCK..=1 << 30).contains(&self.cluster_size) {
            return bad(format!(
                "cluster_size {} must be a power of two from 4 KiB to 1 GiB",
                self.cluster_size
            ));
        }
        let clusters = self.max_bytes / self.cluster_size;
        if clusters == 0 {
            return bad(format!(
                "max_bytes {} is smaller than one cluster ({} bytes)",
                self.max_bytes, self.cluster_size
            ));
        }
        u32::try_from(clusters).or_else(|_| {
            bad(format!(
                "max_bytes {} is more than 2^32 clusters",
                self.max_bytes
            ))
        })
    }
}

/// One record to write: the caller's key (e.g. the swap entry) and its bytes.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    pub key: u64,
    pub data: &'a [u8],
}

/// Where a record lives, and the checksum that proves it on the way back.
/// Small and `Copy`: the store keeps it in its entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    offset: u64,
    key: u64,
    len: u32,
    crc: u32,
}

impl Slot {
    /// A slot rebuilt from its parts, for a caller that keeps it smaller (without the
    /// key it already knows). Nothing is trusted: a read checks the checksum, which
    /// covers key and length, and a free checks that the record is live.
    pub fn from_parts(offset: u64, key: u64, len: u32, crc: u32) -> Slot {
        Slot { offset, key, len, crc }
    }

    /// Byte offset of the record in the file (block-aligned).
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn key(&self) -> u64 {
        self.key
    }
    /// Length of the record's data.
    pub fn data_len(&self) -> usize {
        self.len as usize
    }
    /// Bytes the record takes in the file (whole blocks).
    pub fn disk_len(&self) -> u64 {
        (self.len as u64).div_ceil(BLOCK) * BLOCK
    }
    pub fn checksum(&self) -> u32 {
        self.crc
    }
    fn extent(&self) -> Extent {
        Extent {
            start: self.offset / BLOCK,
            blocks: self.disk_len() / BLOCK,
        }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "slot at offset {:#x}, {} bytes, key {:#x}",
            self.offset, self.len, self.key
        )
    }
}

/// crc32c over the key, the length and the data: the checksum a [`Slot`] keeps
/// (every tier uses it, so a slot proves its record wherever it went).
pub fn record_crc(key: u64, data: &[u8]) -> u32 {
    let mut head = [0u8; 12];
    head[..8].copy_from_slice(&key.to_le_bytes());
    head[8..].copy_from_slice(&(data.len() as u32).to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), data)
}

#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    #[error("invalid backing file configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot create a private backing file in {dir}: {source}")]
    Create {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the file system of {dir} refuses O_DIRECT: {source}")]
    DirectIoUnsupported {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("record with key {key:#x} is empty")]
    EmptyRecord { key: u64 },
    #[error(
        "record with key {key:#x} has {len} bytes, more than the backing file can take ({max})"
    )]
    RecordTooLarge { key: u64, len: usize, max: u64 },
    #[error("no contiguous {needed} bytes for record {key:#x} in the backing file ({free} bytes free{})",
        if *fragmented { ", but fragmented" } else { "" })]
    NoSpace {
        key: u64,
        needed: u64,
        free: u64,
        fragmented: bool,
    },
    #[error("the file system is full: writing {len} bytes at offset {offset:#x}: {source}")]
    DeviceFull {
        offset: u64,
        len: usize,
        source: std::io::Error,
    },
    #[error("I/O error on {op} of {len} bytes at offset {offset:#x}: {source}")]
    Io {
        op: &'static str,
        offset: u64,
        len: usize,
        source: std::io::Error,
    },
    #[error(
        "short write at offset {offset:#x}: {written} of {len} bytes written, then no progress"
    )]
    ShortWrite {
        offset: u64,
        len: usize,
        written: usize,
    },
    #[error("corrupt record in {slot}: {reason}")]
    Corrupt { slot: Slot, reason: &'static str },
    #[error("bad {slot}: {reason}")]
    BadSlot { slot: Slot, reason: &'static str },
    #[error("a buffer of {got} bytes for a record of {expected} bytes")]
    BufferSize { expected: usize, got: usize },
    /// A remote tier's failure. On a signal handler's path `detail` is borrowed
    /// (no heap memory); elsewhere it may say more.
    #[error("remote tier: {op}: {detail}")]
    Remote { op: &'static str, detail: std::borrow::Cow<'static, str> },
}

#[derive(Default)]
struct Counters {
    bytes_written: AtomicU64,
    records_written: AtomicU64,
    write_batches: AtomicU64,
    write_calls: AtomicU64,
    short_write_retries: AtomicU64,
    bytes_read: AtomicU64,
    records_read: AtomicU64,
    read_calls: AtomicU64,
    records_freed: AtomicU64,
    stored_bytes: AtomicU64,
    cluster_fallbacks: AtomicU64,
    alloc_failures: AtomicU64,
    punch_calls: AtomicU64,
    punched_bytes: AtomicU64,
    punch_errors: AtomicU64,
    write_errors_nospace: AtomicU64,
    write_errors_io: AtomicU64,
    write_errors_short: AtomicU64,
    read_errors: AtomicU64,
    corrupt_records: AtomicU64,
}

/// A snapshot of the counters; byte counts are record data unless named otherwise.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackingStats {
    pub direct_io: bool,
    pub capacity_bytes: u64,
    /// Blocks allocated to live records, in bytes.
    pub allocated_bytes: u64,
    /// Data of live records.
    pub stored_bytes: u64,
    pub stored_records: u64,
    pub bytes_written: u64,
    pub records_written: u64,
    pub write_batches: u64,
    /// pwritev calls issued (including failed ones and retries).
    pub write_calls: u64,
    /// Short writes that were continued.
    pub short_write_retries: u64,
    pub bytes_read: u64,
    pub records_read: u64,
    pub read_calls: u64,
    pub records_freed: u64,
    /// Extents placed in a cluster of another order because space was fragmented.
    pub cluster_fallbacks: u64,
    /// Records for which no contiguous space existed (the batch failed).
    pub alloc_failures: u64,
    pub punch_calls: u64,
    /// Bytes handed to FALLOC_FL_PUNCH_HOLE.
    pub punched_bytes: u64,
    pub punch_errors: u64,
    pub write_errors_nospace: u64,
    pub write_errors_io: u64,
    pub write_errors_short: u64,
    pub read_errors: u64,
    pub corrupt_records: u64,
    /// Windows read ahead of a sequential pass (module `around`), records read from
    /// one instead of the file, and records a window gave that failed their check
    /// (read again from the file).
    pub readahead_windows: u64,
    pub readahead_hits: u64,
    pub readahead_refetched: u64,
    pub clusters: ClusterCounts,
}

/// The backing file. All methods take `&self`; share it between threads.
pub struct BackingFile {
    io: Box<dyn FileIo>,
    direct: bool,
    cluster_blocks: u64,
    capacity: u64,
    alloc: Mutex<ClusterAllocator>,
    /// The checksum of each live record by offset, so that freeing a stale copy of
    /// a slot whose extent now holds another record is refused, not obeyed; and the
    /// loan mark it was written under (`mark_lend`).
    live: Mutex<HashMap<u64, (u32, u32)>>,
    /// Loans marked so far (`mark_lend`): a record written now is no child's to read
    /// but one's forked after the next mark.
    marks: AtomicU32,
    /// Queued frees kept for children that may read them (`reap_keeping`), with the
    /// highest mark any was kept for (0: none kept).
    kept: Mutex<(u32, Vec<Slot>)>,
    /// Slots given to `free_deferred`, freed by the next `reap`. Its capacity is kept
    /// at least the number of live records, so a push never allocates (a slot can be
    /// pending once, and stays live until reaped).
    pending: Mutex<Vec<Slot>>,
    bounce: Mutex<Vec<AlignedBuf>>,
    /// With `encrypt`: the cipher, its key, and the seal of each live record.
    sealer: Option<Sealer>,
    /// Under O_DIRECT: windows read ahead of a sequential pass (module `around`).
    around: Option<ReadAround>,
    c: Counters,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Relaxed);
}

/// Where a record's bytes come from in one write: the caller's buffer, or a
/// range of the staging buffer (O_DIRECT wants aligned memory).
enum Segment<'a> {
    Caller(&'a [u8]),
    Staged(std::ops::Range<usize>),
}

impl BackingFile {
    /// The file's descriptor, where it is a real file (not a test double).
    pub fn raw_fd(&self) -> Option<RawFd> {
        self.io.raw_fd()
    }

    /// Creates the private file described by `cfg`.
    pub fn create(cfg: BackingConfig) -> Result<Self, BackingError> {
        cfg.clusters()?;
        let file = PrivateFile::open(&cfg)?;
        Self::with_io(cfg, Box::new(file))
    }

    /// A backing file over any [`FileIo`], e.g. a [`fault::FaultyIo`] wrapping a
    /// [`PrivateFile`] opened with the same `cfg`.
    pub fn with_io(cfg: BackingConfig, io: Box<dyn FileIo>) -> Result<Self, BackingError> {
        let clusters = cfg.clusters()?;
        let cluster_blocks = cfg.cluster_size / BLOCK;
        let direct = io.direct_io();
        Ok(BackingFile {
            direct,
            io,
            cluster_blocks,
            capacity: clusters as u64 * cfg.cluster_size,
            alloc: Mutex::new(ClusterAllocator::new(clusters, cluster_blocks)),
            live: Mutex::new(HashMap::new()),
            marks: AtomicU32::new(0),
            kept: Mutex::new((0, Vec::new())),
            pending: Mutex::new(Vec::new()),
            bounce: Mutex::new(Vec::new()),
            sealer: match cfg.encrypt {
                true => Some(Sealer::new().map_err(|source| BackingError::Io { op: "make a sealing key", offset: 0, len: 0, source })?),
                false => None,
            },
            around: direct.then(|| ReadAround::new(cfg.cluster_size)),
            c: Counters::default(),
        })
    }

    /// Whether the file really is O_DIRECT (`DirectIo::Prefer` may have fallen back).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    pub fn cluster_size(&self) -> u64 {
        self.cluster_blocks * BLOCK
    }

    /// Disk space the file occupies now (st_blocks), holes excluded.
    pub fn file_allocated_bytes(&self) -> std::io::Result<u64> {
        self.io.allocated_bytes()
    }

    /// Writes `records` and returns their slots, in the same order. Adjacent
    /// records go out in one `pwritev`. On error nothing stays allocated.
    pub fn write_batch(&self, records: &[Record<'_>]) -> Result<Vec<Slot>, BackingError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let max = self.capacity.min(u32::MAX as u64);
        for r in records {
            if r.data.is_empty() {
                return Err(BackingError::EmptyRecord { key: r.key });
            }
            if r.data.len() as u64 > max {
                return Err(BackingError::RecordTooLarge {
                    key: r.key,
                    len: r.data.len(),
                    max,
                });
            }
        }
        // Encrypted, the file gets sealed copies; the crc stays the plaintext's.
        let mut seals = Vec::new();
        let sealed: Vec<Vec<u8>>;
        let sealed_records: Vec<Record<'_>>;
        let to_write = match &self.sealer {
            None => records,
            Some(sealer) => {
                sealed = records
                    .iter()
                    .map(|r| {
                        let mut copy = r.data.to_vec();
                        seals.push(sealer.seal(r.key, &mut copy));
                        copy
                    })
                    .collect();
                sealed_records = records
                    .iter()
                    .zip(&sealed)
                    .map(|(r, d)| Record { key: r.key, data: d })
                    .collect();
                &sealed_records[..]
            }
        };
        let extents = self.allocate(to_write)?;
        if let Err(e) = self.write_records(to_write, &extents) {
            self.release_unwritten(&extents);
            let counter = match e {
                BackingError::DeviceFull { .. } => &self.c.write_errors_nospace,
                BackingError::ShortWrite { .. } => &self.c.write_errors_short,
                _ => &self.c.write_errors_io,
            };
            bump(counter, 1);
            return Err(e);
        }
        let bytes: u64 = records.iter().map(|r| r.data.len() as u64).sum();
        bump(&self.c.write_batches, 1);
        bump(&self.c.records_written, records.len() as u64);
        bump(&self.c.bytes_written, bytes);
        bump(&self.c.stored_bytes, bytes);
        let slots: Vec<Slot> = records
            .iter()
            .zip(&extents)
            .map(|(r, e)| Slot {
                offset: e.start * BLOCK,
                key: r.key,
                len: r.data.len() as u32,
                crc: record_crc(r.key, r.data),
            })
            .collect();
        if let Some(sealer) = &self.sealer {
            sealer.remember(slots.iter().map(|s| s.offset).zip(seals));
        }
        let live = {
            let mut live = self.live.lock();
            let mark = self.marks.load(SeqCst);
            live.extend(slots.iter().map(|s| (s.offset, (s.crc, mark))));
            live.len()
        };
        self.make_pending_room(live);
        Ok(slots)
    }

    fn allocate(&self, records: &[Record<'_>]) -> Result<Vec<Extent>, BackingError> {
        let mut a = self.alloc.lock();
        let mut extents = Vec::with_capacity(records.len());
        let mut fallbacks = 0;
        for r in records {
            let blocks = (r.data.len() as u64).div_ceil(BLOCK);
            match a.alloc(blocks) {
                Some((e, fallback)) => {
                    extents.push(e);
                    fallbacks += fallback as u64;
                }
                None => {
                    let free = (a.total_blocks() - a.used_blocks()) * BLOCK;
                    // Nothing was written, and every cluster this batch emptied was
                    // Free (punched) before it: hand them straight back.
                    for e in extents {
                        for c in a.release(e).unwrap_or_default() {
                            a.discarded(c);
                        }
                    }
                    drop(a);
                    bump(&self.c.alloc_failures, 1);
                    let needed = blocks * BLOCK;
                    return Err(BackingError::NoSpace {
                        key: r.key,
                        needed,
                        free,
                        fragmented: free >= needed,
                    });
                }
            }
        }
        drop(a);
        bump(&self.c.cluster_fallbacks, fallbacks);
        Ok(extents)
    }

    /// Writes the records, coalescing runs of adjacent extents into one call.
    fn write_records(
        &self,
        records: &[Record<'_>],
        extents: &[Extent],
    ) -> Result<(), BackingError> {
        let mut by_offset: Vec<usize> = (0..records.len()).collect();
        by_offset.sort_unstable_by_key(|&i| extents[i].start);
        let mut first = 0;
        while first < by_offset.len() {
            let mut end = first + 1;
            let mut bytes = extents[by_offset[first]].blocks * BLOCK;
            while end < by_offset.len() && end - first < MAX_WRITE_RECORDS {
                let (prev, next) = (extents[by_offset[end - 1]], extents[by_offset[end]]);
                if next.start != prev.end() || bytes + next.blocks * BLOCK > MAX_WRITE_BYTES {
                    break;
                }
                bytes += next.blocks * BLOCK;
                end += 1;
            }
            let run: Vec<&[u8]> = by_offset[first..end]
                .iter()
                .map(|&i| records[i].data)
                .collect();
            self.write_run(&run, extents[by_offset[first]].start * BLOCK)?;
            first = end;
        }
        Ok(())
    }

    /// One run of records on consecutive blocks starting at `offset`.
    fn write_run(&self, run: &[&[u8]], offset: u64) -> Result<(), BackingError> {
        let padded = |d: &[u8]| (d.len() as u64).div_ceil(BLOCK) as usize * BLOCK_SIZE;
        let total: usize = run.iter().map(|d| padded(d)).sum();
        let mut iovs: Vec<IoSlice<'_>> = Vec::with_capacity(run.len() * 2);
        let staging;
        if self.direct {
            let aligned = |d: &[u8]| {
                (d.as_ptr() as usize).is_multiple_of(BLOCK_SIZE)
                    && d.len().is_multiple_of(BLOCK_SIZE)
            };
            let staged: usize = run.iter().filter(|d| !aligned(d)).map(|d| padded(d)).sum();
            let mut buf = self.take_bounce(staged);
            let mut segments: Vec<Segment<'_>> = Vec::with_capacity(run.len());
            let mut pos = 0;
            for d in run {
                if aligned(d) {
                    segments.push(Segment::Caller(d));
                    continue;
                }
                let end = pos + padded(d);
                buf[pos..pos + d.len()].copy_from_slice(d);
                buf[pos + d.len()..end].fill(0);
                match segments.last_mut() {
                    Some(Segment::Staged(r)) if r.end == pos => r.end = end,
                    _ => segments.push(Segment::Staged(pos..end)),
                }
                pos = end;
            }
            staging = buf;
            for s in &segments {
                iovs.push(IoSlice::new(match s {
                    Segment::Caller(d) => d,
                    Segment::Staged(r) => &staging[r.clone()],
                }));
            }
            let result = self.write_all(&mut iovs, offset, total);
            drop(iovs);
            self.give_bounce(staging);
            result
        } else {
            for d in run {
                iovs.push(IoSlice::new(d));
                let pad = padded(d) - d.len();
                if pad > 0 {
                    iovs.push(IoSlice::new(&ZEROS[..pad]));
                }
            }
            self.write_all(&mut iovs, offset, total)
        }
    }

    /// pwritev until all `total` bytes are down; a short write is continued. Read-
    /// around windows over those bytes are stale from its start (module `around`).
    fn write_all(
        &self,
        iovs: &mut [IoSlice<'_>],
        offset: u64,
        total: usize,
    ) -> Result<(), BackingError> {
        let Some(around) = &self.around else { return self.write_all_now(iovs, offset, total) };
        around.writing(offset, total as u64);
        let result = self.write_all_now(iovs, offset, total);
        around.written(offset, total as u64);
        result
    }

    fn write_all_now(
        &self,
        iovs: &mut [IoSlice<'_>],
        offset: u64,
        total: usize,
    ) -> Result<(), BackingError> {
        let mut bufs = iovs;
        let (mut done, mut stalls) = (0usize, 0);
        while done < total {
            let at = offset + done as u64;
            bump(&self.c.write_calls, 1);
            match self.io.pwritev(bufs, at) {
                Ok(n) => {
                    // Under O_DIRECT the next offset must stay aligned: redo the
                    // partial block (same bytes) rather than continue inside it.
                    let n = if self.direct { n - n % BLOCK_SIZE } else { n }.min(total - done);
                    if n == 0 {
                        stalls += 1;
                        if stalls >= MAX_STALLS {
                            return Err(BackingError::ShortWrite {
                                offset,
                                len: total,
                                written: done,
                            });
                        }
                        continue;
                    }
                    stalls = 0;
                    done += n;
                    if done < total {
                        bump(&self.c.short_write_retries, 1);
                    }
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    let len = total - done;
                    return Err(match source.raw_os_error() {
                        Some(libc::ENOSPC) | Some(libc::EDQUOT) => BackingError::DeviceFull {
                            offset: at,
                            len,
                            source,
                        },
                        _ => BackingError::Io {
                            op: "write",
                            offset: at,
                            len,
                            source,
                        },
                    });
                }
            }
        }
        Ok(())
    }

    /// Reads the record of `slot` into `out` (exactly `slot.data_len()` bytes) and
    /// verifies it. On any error `out` is zeroed, never left with wrong bytes.
    pub fn read(&self, slot: &Slot, out: &mut [u8]) -> Result<(), BackingError> {
        if out.len() != slot.data_len() {
            return Err(BackingError::BufferSize {
                expected: slot.data_len(),
                got: out.len(),
            });
        }
        self.check_bounds(slot)?;
        let result = self.read_verified(slot, out);
        self.count_read(&result, out);
        result
    }

    /// Reads the record of `slot` into the front of `buf` and verifies it; the rest
    /// of `buf` is scratch. For a caller that may not allocate (a signal handler):
    /// with `buf` block-aligned and at least [`Slot::disk_len`] long this reads
    /// straight into it, O_DIRECT or not, and allocates nothing (no bounce buffer),
    /// takes no lock of its own (with `encrypt`, the seal table's std mutex), and its
    /// errors hold no heap memory. Any other `buf` is a `BufferSize` error.
    pub fn read_in_place(&self, slot: &Slot, buf: &mut [u8]) -> Result<(), BackingError> {
        let disk = slot.disk_len() as usize;
        if buf.len() < disk || !(buf.as_ptr() as usize).is_multiple_of(BLOCK_SIZE) {
            return Err(BackingError::BufferSize { expected: disk, got: buf.len() });
        }
        self.check_bounds(slot)?;
        let out_len = slot.data_len();
        let result = self.read_checked(slot, &mut buf[..if self.direct { disk } else { out_len }], None);
        self.count_read(&result, &mut buf[..out_len]);
        result
    }

    /// Reads `slot` into `buf` (its disk bytes under O_DIRECT, else its data) and
    /// checks it, into `out` when given (else in place). A record that fails its check
    /// after it came from a read-around window is read again from the file: the
    /// window may be what went wrong, and is dropped.
    fn read_checked(&self, slot: &Slot, buf: &mut [u8], mut out: Option<&mut [u8]>) -> Result<(), BackingError> {
        let out_len = slot.data_len();
        let mut check = |buf: &mut [u8]| match out.as_deref_mut() {
            Some(out) => {
                out.copy_from_slice(&buf[..out_len]);
                self.verify(slot, out)
            }
            None => self.verify(slot, &mut buf[..out_len]),
        };
        let windowed = self.read_exact(slot, buf, true)?;
        match check(buf) {
            Err(BackingError::Corrupt { .. }) if windowed => {
                if let Some(around) = &self.around {
                    bump(&around.refetched, 1);
                    around.forget(slot.offset, buf.len() as u64);
                }
                self.read_exact(slot, buf, false)?;
                check(buf)
            }
            result => result,
        }
    }

    fn count_read(&self, result: &Result<(), BackingError>, out: &mut [u8]) {
        match result {
            Ok(()) => {
                bump(&self.c.records_read, 1);
                bump(&self.c.bytes_read, out.len() as u64);
            }
            Err(e) => {
                out.fill(0);
                let counter = match e {
                    BackingError::Corrupt { .. } => &self.c.corrupt_records,
                    _ => &self.c.read_errors,
                };
                bump(counter, 1);
            }
        }
    }

    /// `read` into a new vector.
    pub fn read_vec(&self, slot: &Slot) -> Result<Vec<u8>, BackingError> {
        let mut out = vec![0; slot.data_len()];
        self.read(slot, &mut out)?;
        Ok(out)
    }

    fn read_verified(&self, slot: &Slot, out: &mut [u8]) -> Result<(), BackingError> {
        let direct_ok = (out.as_ptr() as usize).is_multiple_of(BLOCK_SIZE)
            && out.len().is_multiple_of(BLOCK_SIZE);
        if self.direct && !direct_ok {
            let mut bounce = self.take_bounce(slot.disk_len() as usize);
            let result = self.read_checked(slot, &mut bounce[..slot.disk_len() as usize], Some(out));
            self.give_bounce(bounce);
            result
        } else {
            self.read_checked(slot, out, None)
        }
    }

    /// Opens (if sealed) and checks the record just read into `out`.
    fn verify(&self, slot: &Slot, out: &mut [u8]) -> Result<(), BackingError> {
        if let Some(sealer) = &self.sealer {
            if !sealer.open(slot.offset, slot.key, out) {
                return Err(BackingError::Corrupt {
                    slot: *slot,
                    reason: "authentication failed (tampered, misplaced or not live)",
                });
            }
        }
        if record_crc(slot.key, out) != slot.crc {
            return Err(BackingError::Corrupt {
                slot: *slot,
                reason: "checksum mismatch",
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at the slot's offset; through a read-around window if
    /// `windows` allows (module `around`), which the answer says.
    fn read_exact(&self, slot: &Slot, buf: &mut [u8], windows: bool) -> Result<bool, BackingError> {
        if let Some(around) = self.around.as_ref().filter(|_| windows) {
            let pread = |b: &mut [u8], at: u64| {
                bump(&self.c.read_calls, 1);
                self.io.pread(b, at)
            };
            if around.read(slot.offset, buf, pread).is_some() {
                return Ok(true);
            }
        }
        let mut done = 0;
        while done < buf.len() {
            let at = slot.offset + done as u64;
            bump(&self.c.read_calls, 1);
            match self.io.pread(&mut buf[done..], at) {
                Ok(n) => {
                    let n = if self.direct { n - n % BLOCK_SIZE } else { n };
                    if n == 0 {
                        let reason = "the record lies past the end of the file";
                        return Err(BackingError::Corrupt {
                            slot: *slot,
                            reason,
                        });
                    }
                    done += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    let len = buf.len() - done;
                    return Err(BackingError::Io {
                        op: "read",
                        offset: at,
                        len,
                        source,
                    });
                }
            }
        }
        Ok(false)
    }

    fn check_bounds(&self, slot: &Slot) -> Result<(), BackingError> {
        let bad = |reason| {
            Err(BackingError::BadSlot {
                slot: *slot,
                reason,
            })
        };
        if slot.len == 0 || !slot.offset.is_multiple_of(BLOCK) {
            return bad("not a slot this file handed out");
        }
        if slot
            .offset
            .checked_add(slot.disk_len())
            .is_none_or(|end| end > self.capacity)
        {
            return bad("outside the backing file");
        }
        Ok(())
    }

    /// Frees a slot's space for reuse; large or cluster-emptying frees give the
    /// disk space back with a hole punch.
    pub fn free(&self, slot: Slot) -> Result<(), BackingError> {
        self.free_now(slot)
    }

    fn free_now(&self, slot: Slot) -> Result<(), BackingError> {
        self.check_bounds(&slot)?;
        let ext = slot.extent();
        let bad = |reason| BackingError::BadSlot { slot, reason };
        let mark = {
            // Out of `live` before the extent is released (a new record may take it
            // at once), back in if the allocator refuses the slot after all.
            let mut live = self.live.lock();
            if live.get(&slot.offset).map(|l| l.0) != Some(slot.crc) {
                return Err(bad("not a live record (freed already, or its space was reused)"));
            }
            live.remove(&slot.offset).map_or(0, |l| l.1)
        };
        // The seal goes with the live entry, before the extent can be handed out again.
        let seal = self.sealer.as_ref().and_then(|s| s.forget(slot.offset));
        let restore = |e| {
            self.live.lock().insert(slot.offset, (slot.crc, mark));
            if let (Some(sealer), Some(seal)) = (&self.sealer, seal) {
                sealer.remember([(slot.offset, seal)].into_iter());
            }
            e
        };
        if ext.blocks * BLOCK >= PUNCH_MIN_BYTES {
            // Punch while we still own the blocks, skipping clusters this free will
            // empty: those are punched whole below.
            let emptied = {
                let mut a = self.alloc.lock();
                a.check(ext).map_err(bad).map_err(restore)?;
                a.clusters_emptied_by(ext)
            };
            let mut b = ext.start;
            while b < ext.end() {
                let c = b / self.cluster_blocks;
                let end = ((c + 1) * self.cluster_blocks).min(ext.end());
                if !emptied.contains(&(c as u32)) && (end - b) * BLOCK >= PUNCH_MIN_BYTES {
                    self.punch(b * BLOCK, (end - b) * BLOCK);
                }
                b = end;
            }
        }
        let emptied = self.alloc.lock().release(ext).map_err(bad).map_err(restore)?;
        self.discard(emptied);
        bump(&self.c.records_freed, 1);
        self.c.stored_bytes.fetch_sub(slot.len as u64, Relaxed);
        Ok(())
    }

    /// Makes the deferred-free queue's capacity at least `live`, allocating outside its
    /// lock (a handler may wait for that lock on a thread that holds the malloc lock).
    fn make_pending_room(&self, live: usize) {
        if self.pending.lock().capacity() >= live {
            return;
        }
        let mut bigger = Vec::with_capacity(live.max(64).next_power_of_two());
        let old = {
            let mut pending = self.pending.lock();
            if pending.capacity() >= live || bigger.capacity() < pending.len() {
                return;
            }
            bigger.append(&mut pending);
            std::mem::replace(&mut *pending, bigger)
        };
        drop(old);
    }

    /// Frees `slot` later, at the next [`BackingFile::reap`]: for a caller that may not allocate or wait (a signal
    /// handler). It checks the slot's bounds and queues it under a short std mutex,
    /// allocating nothing: the queue always has room for every live record. The
    /// slot's space is not reused before the reap. A slot that is not live is
    /// reported by the reap (as `free` would report it), not here.
    pub fn free_deferred(&self, slot: Slot) -> Result<(), BackingError> {
        self.check_bounds(&slot)?;
        let mut pending = self.pending.lock();
        if pending.len() == pending.capacity() {
            // More frees than live records: a slot was freed twice. Never grow here.
            return Err(BackingError::BadSlot { slot, reason: "freed twice (more frees queued than live records)" });
        }
        pending.push(slot);
        Ok(())
    }

    /// Frees the slots queued by `free_deferred`. Returns how many; the first slot
    /// that `free` refuses is the error, after the others were freed.
    pub fn reap(&self) -> Result<usize, BackingError> {
        self.reap_keeping(0)
    }

    /// Marks a loan: a forked child may read every record live now, none written
    /// from now on. Returns the loan's mark, for [`BackingFile::reap_keeping`].
    pub fn mark_lend(&self) -> u32 {
        // Under the lock that `write_batch` reads the mark under: a record is live
        // before the mark moves or written under the new one.
        let _live = self.live.lock();
        self.marks.fetch_add(1, SeqCst) + 1
    }

    /// As [`BackingFile::reap`], but keeps (queued, its space unused) every slot
    /// written before loan mark `before` (0: none): a child holding that loan, or an
    /// earlier one, may read it. The others are freed: a parent whose children live
    /// long writes back and frees anew meanwhile without its file growing. Slots kept
    /// are looked at again once `before` falls. The caller orders its reaps against
    /// its loans: no loan may be marked between its reading `before` and this
    /// returning (the store's reap and its freeze for a fork exclude each other).
    pub fn reap_keeping(&self, before: u32) -> Result<usize, BackingError> {
        let mut again = {
            let mut kept = self.kept.lock();
            if before < kept.0 {
                kept.0 = 0;
                std::mem::take(&mut kept.1)
            } else {
                Vec::new()
            }
        };
        let mut first_error = None;
        let mut n = 0;
        // One at a time: `free` may punch holes, not to be done under the lock (the
        // closure's guard goes at its end).
        while let Some(slot) = again.pop().or_else(|| self.pending.lock().pop()) {
            let written_under = self.live.lock().get(&slot.offset).filter(|l| l.0 == slot.crc).map(|l| l.1);
            if written_under.is_some_and(|m| m < before) {
                let mut kept = self.kept.lock();
                kept.0 = kept.0.max(before);
                kept.1.push(slot);
                continue;
            }
            n += 1;
            if let Err(e) = self.free_now(slot) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(n), Err)
    }

    /// Queued frees kept for loans (`reap_keeping`).
    pub fn kept_for_loans(&self) -> usize {
        self.kept.lock().1.len()
    }

    /// Releases the extents of a batch whose write failed.
    fn release_unwritten(&self, extents: &[Extent]) {
        let emptied: Vec<u32> = {
            let mut a = self.alloc.lock();
            extents
                .iter()
                .flat_map(|&e| a.release(e).unwrap_or_default())
                .collect()
        };
        self.discard(emptied);
    }

    /// Punches emptied (Discarding) clusters and makes them Free again.
    fn discard(&self, clusters: Vec<u32>) {
        let size = self.cluster_blocks * BLOCK;
        for c in clusters {
            self.punch(c as u64 * size, size);
            self.alloc.lock().discarded(c);
        }
    }

    fn punch(&self, offset: u64, len: u64) {
        match self.io.punch_hole(offset, len) {
            Ok(()) => {
                bump(&self.c.punch_calls, 1);
                bump(&self.c.punched_bytes, len);
            }
            // Only disk space is at stake: the blocks are still reused.
            Err(_) => bump(&self.c.punch_errors, 1),
        }
    }

    /// Makes written records durable and, for a buffered file, drops them from the
    /// page cache.
    pub fn flush(&self) -> Result<(), BackingError> {
        self.io.flush().map_err(|source| BackingError::Io {
            op: "fdatasync",
            offset: 0,
            len: 0,
            source,
        })
    }

    fn take_bounce(&self, len: usize) -> AlignedBuf {
        let mut pool = self.bounce.lock();
        match pool.iter().position(|b| b.len() >= len) {
            Some(i) => pool.swap_remove(i),
            None => {
                drop(pool);
                AlignedBuf::zeroed(len.div_ceil(BLOCK_SIZE).max(1) * BLOCK_SIZE)
            }
        }
    }

    fn give_bounce(&self, buf: AlignedBuf) {
        let mut pool = self.bounce.lock();
        let kept: usize = pool.iter().map(|b| b.len()).sum();
        if pool.len() < BOUNCE_KEEP && kept + buf.len() <= BOUNCE_KEEP_BYTES {
            pool.push(buf);
        }
    }

    pub fn stats(&self) -> BackingStats {
        let (allocated, clusters) = {
            let a = self.alloc.lock();
            (a.used_blocks() * BLOCK, a.counts())
        };
        let get = |c: &AtomicU64| c.load(Relaxed);
        let c = &self.c;
        BackingStats {
            direct_io: self.direct,
            capacity_bytes: self.capacity,
            allocated_bytes: allocated,
            stored_bytes: get(&c.stored_bytes),
            stored_records: get(&c.records_written) - get(&c.records_freed),
            bytes_written: get(&c.bytes_written),
            records_written: get(&c.records_written),
            write_batches: get(&c.write_batches),
            write_calls: get(&c.write_calls),
            short_write_retries: get(&c.short_write_retries),
            bytes_read: get(&c.bytes_read),
            records_read: get(&c.records_read),
            read_calls: get(&c.read_calls),
            records_freed: get(&c.records_freed),
            cluster_fallbacks: get(&c.cluster_fallbacks),
            alloc_failures: get(&c.alloc_failures),
            punch_calls: get(&c.punch_calls),
            punched_bytes: get(&c.punched_bytes),
            punch_errors: get(&c.punch_errors),
            write_errors_nospace: get(&c.write_errors_nospace),
            write_errors_io: get(&c.write_errors_io),
            write_errors_short: get(&c.write_errors_short),
            read_errors: get(&c.read_errors),
            corrupt_records: get(&c.corrupt_records),
            readahead_windows: self.around.as_ref().map_or(0, |a| get(&a.fills)),
            readahead_hits: self.around.as_ref().map_or(0, |a| get(&a.hits)),
            readahead_refetched: self.around.as_ref().map_or(0, |a| get(&a.refetched)),
            clusters,
        }
    }

    /// Drops every read-around window (tests that change the file behind its back).
    #[cfg(test)]
    fn forget_read_around(&self) {
        if let Some(around) = &self.around {
            around.forget(0, u64::MAX / 2);
        }
    }

    #[cfg(test)]
    fn assert_consistent(&self) {
        self.alloc.lock().assert_consistent();
    }
}
