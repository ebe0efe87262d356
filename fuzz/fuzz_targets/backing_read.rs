//! `backing_read`: records written to a backing file are damaged behind its back,
//! and `read` must return the original bytes or `Err(Corrupt)` with a zeroed
//! buffer — never other bytes, never a panic.
//!
//! The harness opens the private file itself (`PrivateFile::open`), keeps a second
//! descriptor to it (reopened through /proc/self/fd, the way anything else in the
//! process could reach it) and hands the first to `BackingFile::with_io`. It writes
//! a batch of records, frees some, writes a second batch into the space they left,
//! then damages the file through the second descriptor: bytes xor-ed or overwritten
//! at chosen places, one record's blocks copied over another's (a misdirected
//! write), a hole punched (a lost write reads as zeros), the file cut short.
//!
//! What the harness knows, it asserts: a record whose data bytes on disk are the
//! ones written (damage to its padding or to other records only) must read back
//! whole; one whose data differs in a single burst of at most 32 bits must be
//! reported corrupt (crc32c catches every such burst); any other damage may be
//! either, but `Ok` must come with the original bytes. Every error is `Corrupt`,
//! counted in `stats().corrupt_records`. Slots of one file never overlap, and a
//! freed slot cannot be freed again (unless a new record got exactly its extent,
//! which the backing file cannot tell apart).
//!
//! The file lives in /dev/shm when there is one (tmpfs: no disk I/O per run);
//! half the inputs ask for O_DIRECT, which tmpfs takes or refuses depending on
//! the kernel, so both paths of `read` (bounce buffer or straight in) get run.

#![no_main]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use uzswap_backing::{
    BackingConfig, BackingError, BackingFile, DirectIo, PrivateFile, Record, Slot, BLOCK_SIZE,
};

const MAX_BYTES: u64 = 16 << 20;
/// Records per batch (the rest of a longer list is ignored).
const MAX_BATCH: usize = 8;

#[derive(Arbitrary, Debug)]
struct RecordSpec {
    key: u64,
    /// Mostly up to 16 KiB, 1 in 16 up to 2.5 MiB (more than a 2 MiB cluster).
    len: u32,
    seed: u8,
}

impl RecordSpec {
    fn len(&self) -> usize {
        let len = self.len as usize;
        1 + if len & 0xf0 == 0xf0 {
            len % (5 << 19)
        } else {
            len % (16 << 10)
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Damage {
    /// Xor one byte of a record's blocks (its data or its padding).
    Xor { record: u8, at: u32, xor: u8 },
    /// Overwrite a run of bytes of a record's blocks.
    Write { record: u8, at: u32, bytes: Vec<u8> },
    /// Copy one record's blocks over another's start (a misdirected write).
    Copy { from: u8, to: u8 },
    /// Punch a hole in a record's blocks (what a lost write reads as).
    Punch { record: u8, at: u32, len: u32 },
    /// Cut the file inside a record's blocks.
    Truncate { record: u8, at: u32 },
}

#[derive(Arbitrary, Debug)]
struct Input {
    direct: bool,
    cluster_shift: u8,
    /// Bit i: free record i of the first batch before the second is written.
    free_mask: u64,
    first: Vec<RecordSpec>,
    damage: Vec<Damage>,
    second: Vec<RecordSpec>,
}

fn data_of(spec: &RecordSpec) -> Vec<u8> {
    let mut x = (spec.key ^ u64::from(spec.seed) << 56) | 1;
    // Half the records are mostly zeros with a few set bits: a hole punched in
    // one must still be seen.
    let mask = if spec.seed & 1 == 0 {
        u64::MAX
    } else {
        0x0100_0000_8000_0001
    };
    let mut data = Vec::with_capacity(spec.len() + 8);
    while data.len() < spec.len() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&(x & mask).to_le_bytes());
    }
    data.truncate(spec.len());
    data
}

fn scratch_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// A live record: where it is and what was written.
struct Written {
    slot: Slot,
    data: Vec<u8>,
}

fn write(backing: &BackingFile, specs: &[RecordSpec]) -> Vec<Written> {
    // Write what fits; a batch that does not fit must fail whole with NoSpace.
    let datas: Vec<Vec<u8>> = specs.iter().take(MAX_BATCH).map(data_of).collect();
    let records: Vec<Record> = specs
        .iter()
        .zip(&datas)
        .map(|(s, d)| Record {
            key: s.key,
            data: d,
        })
        .collect();
    match backing.write_batch(&records) {
        Ok(slots) => {
            assert_eq!(slots.len(), records.len());
            slots
                .into_iter()
                .zip(datas)
                .map(|(slot, data)| {
                    assert_eq!(slot.data_len(), data.len());
                    assert_eq!(slot.offset() % BLOCK_SIZE as u64, 0);
                    Written { slot, data }
                })
                .collect()
        }
        Err(BackingError::NoSpace { .. }) => Vec::new(),
        Err(e) => panic!("write_batch: {e}"),
    }
}

fn extent(slot: &Slot) -> std::ops::Range<u64> {
    slot.offset()..slot.offset() + slot.disk_len()
}

/// The span of bytes in which `now` differs from `was` (`now` shorter: the rest differs).
/// Compares in blocks first: a byte loop would spend the run in coverage hooks.
fn differing_span(was: &[u8], now: &[u8]) -> Option<std::ops::Range<usize>> {
    const STEP: usize = 256;
    let same = |range: std::ops::Range<usize>| now.get(range.clone()) == Some(&was[range]);
    let blocks = was.len().div_ceil(STEP);
    let block = |i: usize| i * STEP..((i + 1) * STEP).min(was.len());
    let first_block = (0..blocks).find(|&i| !same(block(i)))?;
    let last_block = (0..blocks).rev().find(|&i| !same(block(i)))?;
    let first = block(first_block).find(|&i| !same(i..i + 1))?;
    let last = block(last_block).rev().find(|&i| !same(i..i + 1))?;
    Some(first..last + 1)
}

fn apply(damage: &Damage, records: &[Written], file: &File) {
    let pick = |i: u8| &records[i as usize % records.len()].slot;
    match damage {
        Damage::Xor { record, at, xor } => {
            let slot = pick(*record);
            let at = slot.offset() + u64::from(*at) % slot.disk_len();
            let mut byte = [0u8];
            let _ = file.read_at(&mut byte, at);
            byte[0] ^= (*xor).max(1);
            file.write_all_at(&byte, at).expect("damage write");
        }
        Damage::Write { record, at, bytes } => {
            let slot = pick(*record);
            let at = u64::from(*at) % slot.disk_len();
            let len = bytes.len().min((slot.disk_len() - at) as usize);
            file.write_all_at(&bytes[..len], slot.offset() + at)
                .expect("damage write");
        }
        Damage::Copy { from, to } => {
            let (from, to) = (pick(*from), pick(*to));
            let mut blocks = vec![0u8; from.disk_len().min(to.disk_len()) as usize];
            let n = file
                .read_at(&mut blocks, from.offset())
                .expect("damage read");
            file.write_all_at(&blocks[..n], to.offset())
                .expect("damage write");
        }
        Damage::Punch { record, at, len } => {
            let slot = pick(*record);
            let at = u64::from(*at) % slot.disk_len();
            let len = 1 + u64::from(*len) % (slot.disk_len() - at);
            let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            // SAFETY: no memory arguments.
            let ret = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    mode,
                    (slot.offset() + at) as i64,
                    len as i64,
                )
            };
            assert_eq!(ret, 0, "punch: {}", std::io::Error::last_os_error());
        }
        Damage::Truncate { record, at } => {
            let slot = pick(*record);
            file.set_len(slot.offset() + u64::from(*at) % slot.disk_len())
                .expect("truncate");
        }
    }
}

fuzz_target!(|input: Input| {
    let mut cfg = BackingConfig::new(scratch_dir(), MAX_BYTES);
    cfg.direct_io = if input.direct {
        DirectIo::Prefer
    } else {
        DirectIo::Off
    };
    cfg.cluster_size = (BLOCK_SIZE as u64) << (input.cluster_shift % 10);
    let private = PrivateFile::open(&cfg).unwrap_or_else(|e| panic!("open: {e}"));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", private.as_raw_fd()))
        .expect("reopen the backing file through /proc/self/fd");
    let backing = BackingFile::with_io(cfg, Box::new(private)).unwrap_or_else(|e| panic!("{e}"));

    let (mut records, mut freed) = (Vec::new(), Vec::new());
    for (i, r) in write(&backing, &input.first).into_iter().enumerate() {
        if input.free_mask >> (i % 64) & 1 == 1 {
            backing
                .free(r.slot)
                .unwrap_or_else(|e| panic!("free {}: {e}", r.slot));
            freed.push(r);
        } else {
            records.push(r);
        }
    }
    records.extend(write(&backing, &input.second));
    if records.is_empty() {
        return;
    }
    let mut extents: Vec<_> = records.iter().map(|r| extent(&r.slot)).collect();
    extents.sort_by_key(|e| e.start);
    for pair in extents.windows(2) {
        assert!(pair[0].end <= pair[1].start, "slots overlap: {pair:?}");
    }
    assert!(extents.last().unwrap().end <= backing.capacity_bytes());

    for damage in input.damage.iter().take(16) {
        apply(damage, &records, &file);
    }

    let file_len = file.metadata().expect("stat").len();
    let mut corrupt = 0;
    for r in &records {
        let mut on_disk = vec![0u8; r.data.len()];
        let n = file.read_at(&mut on_disk, r.slot.offset()).unwrap_or(0);
        on_disk.truncate(n);
        let span = differing_span(&r.data, &on_disk);
        let whole = extent(&r.slot).end <= file_len;

        let mut out = vec![0xa5u8; r.data.len()];
        match backing.read(&r.slot, &mut out) {
            Ok(()) => assert!(
                out == r.data,
                "{}: read returned bytes that were not written",
                r.slot
            ),
            Err(BackingError::Corrupt { slot, .. }) => {
                assert_eq!(slot, r.slot);
                assert!(
                    out.iter().all(|&b| b == 0),
                    "{}: buffer not zeroed on error",
                    r.slot
                );
                assert!(
                    span.is_some() || !whole,
                    "{}: intact record reported corrupt",
                    r.slot
                );
                corrupt += 1;
                continue;
            }
            Err(e) => panic!("{}: unexpected error {e}", r.slot),
        }
        if let Some(span) = span {
            assert!(
                span.len() > 4 || !whole,
                "{}: damage at {span:?} went undetected",
                r.slot
            );
        }
    }
    assert_eq!(backing.stats().corrupt_records, corrupt);

    // Freed slots read back whole or not at all, and cannot be freed twice.
    for r in &freed {
        let mut out = vec![0u8; r.data.len()];
        match backing.read(&r.slot, &mut out) {
            Ok(()) => assert!(out == r.data, "{}: freed slot read other bytes", r.slot),
            Err(BackingError::Corrupt { .. }) => {}
            Err(e) => panic!("{}: unexpected error {e}", r.slot),
        }
        // A stale slot whose exact extent went to a new record is told apart by its
        // checksum (over key, length and data); only an identical record's cannot be.
        if !records
            .iter()
            .any(|live| extent(&live.slot) == extent(&r.slot) && live.slot.checksum() == r.slot.checksum())
        {
            assert!(backing.free(r.slot).is_err(), "{} freed twice", r.slot);
        }
    }
    for r in &records {
        backing
            .free(r.slot)
            .unwrap_or_else(|e| panic!("free {}: {e}", r.slot));
    }
    let stats = backing.stats();
    assert_eq!((stats.stored_records, stats.allocated_bytes), (0, 0));
});
