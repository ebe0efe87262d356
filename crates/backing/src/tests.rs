use crate::fault::{Fault, FaultPlan, FaultyIo};
use crate::io::AlignedBuf;
use crate::*;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};

const MODES: [DirectIo; 2] = [DirectIo::Off, DirectIo::Prefer];

fn config(dir: &Path, max: u64, mode: DirectIo) -> BackingConfig {
    BackingConfig {
        direct_io: mode,
        ..BackingConfig::new(dir, max)
    }
}

/// One record per buffer, keyed `first_key` plus its position.
fn records_of<D: AsRef<[u8]>>(first_key: u64, data: &[D]) -> Vec<Record<'_>> {
    data.iter().enumerate().map(|(i, d)| Record { key: first_key + i as u64, data: d.as_ref() }).collect()
}

fn random_bytes(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    rng.fill_bytes(&mut v);
    v
}

/// A backing file with a fault plan, and the raw fd of the real file under it.
fn faulty(cfg: BackingConfig) -> (BackingFile, FaultPlan, i32) {
    let file = PrivateFile::open(&cfg).unwrap();
    let fd = file.as_raw_fd();
    let plan = FaultPlan::new();
    let backing = BackingFile::with_io(cfg, Box::new(FaultyIo::new(file, plan.clone()))).unwrap();
    (backing, plan, fd)
}

fn check_all(b: &BackingFile, live: &[(Slot, Vec<u8>)]) {
    for (slot, data) in live {
        assert_eq!(&b.read_vec(slot).unwrap(), data, "{slot}");
    }
}

#[test]
fn round_trips_from_one_byte_to_past_a_cluster() {
    let mut rng = SmallRng::seed_from_u64(1);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let b = BackingFile::create(config(dir.path(), 64 << 20, mode)).unwrap();
        let mut sizes = vec![
            1,
            7,
            4095,
            4096,
            4097,
            65536,
            100_000,
            2 << 20,
            (2 << 20) + 1,
            (3 << 20) + 5,
        ];
        sizes.extend((0..20).map(|_| rng.gen_range(1..(2 << 20) + 4096)));
        let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_bytes(&mut rng, n)).collect();
        // Half one record per batch, half in one batch.
        let (singles, batch) = datas.split_at(datas.len() / 2);
        let mut live = Vec::new();
        for (i, d) in singles.iter().enumerate() {
            let slots = b
                .write_batch(&[Record {
                    key: i as u64,
                    data: d,
                }])
                .unwrap();
            live.push((slots[0], d.clone()));
        }
        let records = records_of(1000, batch);
        let slots = b.write_batch(&records).unwrap();
        for (s, r) in slots.iter().zip(&records) {
            assert_eq!((s.key(), s.data_len()), (r.key, r.data.len()));
            live.push((*s, r.data.to_vec()));
        }
        check_all(&b, &live);
        let st = b.stats();
        let total: u64 = sizes.iter().map(|&n| n as u64).sum();
        assert_eq!(
            (st.bytes_written, st.stored_bytes, st.bytes_read),
            (total, total, total)
        );
        assert_eq!(st.records_written, sizes.len() as u64);
        assert_eq!(
            st.allocated_bytes,
            live.iter().map(|(s, _)| s.disk_len()).sum::<u64>()
        );
        for (s, _) in &live {
            b.free(*s).unwrap();
        }
        let st = b.stats();
        assert_eq!(
            (st.allocated_bytes, st.stored_bytes, st.stored_records),
            (0, 0, 0)
        );
        assert_eq!(st.clusters.free, 32);
        b.assert_consistent();
    }
}

#[test]
fn adjacent_records_go_out_in_one_write() {
    let mut rng = SmallRng::seed_from_u64(2);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let b = BackingFile::create(config(dir.path(), 64 << 20, mode)).unwrap();
        let folios: Vec<Vec<u8>> = (0..4).map(|_| random_bytes(&mut rng, 2 << 20)).collect();
        let records = records_of(0, &folios);
        let slots = b.write_batch(&records).unwrap();
        assert_eq!(b.stats().write_calls, 1, "four 2 MiB folios, one pwritev");
        for w in slots.windows(2) {
            assert_eq!(
                w[0].offset() + (2 << 20),
                w[1].offset(),
                "contiguous clusters"
            );
        }
        // Compressed 64 KiB folios of uneven sizes share a cluster, still one write.
        let small: Vec<Vec<u8>> = (0..8)
            .map(|_| {
                let n = 40_000 + rng.gen_range(0..20_000);
                random_bytes(&mut rng, n)
            })
            .collect();
        let records = records_of(10, &small);
        let small_slots = b.write_batch(&records).unwrap();
        assert_eq!(b.stats().write_calls, 2);
        // Block-aligned caller memory takes the zero-copy path under O_DIRECT.
        let mut aligned = AlignedBuf::zeroed(64 << 10);
        rng.fill_bytes(&mut aligned);
        let s = b
            .write_batch(&[Record {
                key: 99,
                data: &aligned,
            }])
            .unwrap()[0];
        let mut out = AlignedBuf::zeroed(64 << 10);
        b.read(&s, &mut out).unwrap();
        assert_eq!(&out[..], &aligned[..]);
        let live: Vec<_> = slots
            .iter()
            .zip(&folios)
            .chain(small_slots.iter().zip(&small))
            .map(|(s, d)| (*s, d.clone()))
            .collect();
        check_all(&b, &live);
    }
}

#[test]
fn many_batches_reuse_freed_space() {
    let mut rng = SmallRng::seed_from_u64(3);
    let dir = tempfile::tempdir().unwrap();
    // 16 MiB of file for far more than 16 MiB written: only reuse makes it fit.
    let b = BackingFile::create(config(dir.path(), 16 << 20, DirectIo::Prefer)).unwrap();
    let mut live: Vec<(Slot, Vec<u8>)> = Vec::new();
    let mut key = 0;
    for _ in 0..150 {
        let n = rng.gen_range(1..6);
        let datas: Vec<Vec<u8>> = (0..n)
            .map(|_| {
                let n = rng.gen_range(1..300_000);
                random_bytes(&mut rng, n)
            })
            .collect();
        let records: Vec<Record> = datas
            .iter()
            .map(|d| {
                key += 1;
                Record { key, data: d }
            })
            .collect();
        match b.write_batch(&records) {
            Ok(slots) => live.extend(slots.into_iter().zip(datas)),
            Err(BackingError::NoSpace { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        while live.len() > 20 {
            let (s, d) = live.swap_remove(rng.gen_range(0..live.len()));
            assert_eq!(b.read_vec(&s).unwrap(), d);
            b.free(s).unwrap();
        }
    }
    check_all(&b, &live);
    assert!(b.stats().bytes_written > 3 * (16 << 20));
    b.assert_consistent();
}

#[derive(Debug, Clone)]
enum Op {
    Write(Vec<usize>),
    Read(usize),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prop::collection::vec(prop_oneof![1usize..5000, 5000usize..200_000, 200_000usize..600_000], 1..5).prop_map(Op::Write),
        2 => any::<usize>().prop_map(Op::Read),
        2 => any::<usize>().prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Random writes, reads and frees against a model map; small clusters so that
    /// orders mix, fragment and fall back.
    #[test]
    fn matches_a_model(ops in prop::collection::vec(op(), 1..60), seed in any::<u64>()) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let cfg = BackingConfig { cluster_size: 256 << 10, ..config(dir.path(), 4 << 20, DirectIo::Off) };
        let b = BackingFile::create(cfg).unwrap();
        let mut model: Vec<(Slot, Vec<u8>)> = Vec::new();
        let mut key = 0u64;
        for op in ops {
            match op {
                Op::Write(sizes) => {
                    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_bytes(&mut rng, n)).collect();
                    let records: Vec<Record> = datas.iter().map(|d| { key += 1; Record { key, data: d } }).collect();
                    let before = b.stats().allocated_bytes;
                    match b.write_batch(&records) {
                        Ok(slots) => model.extend(slots.into_iter().zip(datas)),
                        Err(BackingError::NoSpace { .. }) => prop_assert_eq!(b.stats().allocated_bytes, before),
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Read(i) if !model.is_empty() => {
                    let (s, d) = &model[i % model.len()];
                    prop_assert_eq!(&b.read_vec(s).unwrap(), d);
                }
                Op::Free(i) if !model.is_empty() => {
                    let (s, _) = model.swap_remove(i % model.len());
                    b.free(s).unwrap();
                    prop_assert!(matches!(b.free(s), Err(BackingError::BadSlot { .. })), "double free");
                }
                _ => {}
            }
            prop_assert_eq!(b.stats().allocated_bytes, model.iter().map(|(s, _)| s.disk_len()).sum::<u64>());
        }
        b.assert_consistent();
        check_all(&b, &model);
    }
}

#[test]
fn failed_writes_keep_everything_consistent() {
    let mut rng = SmallRng::seed_from_u64(4);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let (b, plan, _) = faulty(config(dir.path(), 32 << 20, mode));
        let early: Vec<Vec<u8>> = (0..6)
            .map(|i| random_bytes(&mut rng, 10_000 * (i + 1)))
            .collect();
        let records = records_of(0, &early);
        let live: Vec<_> = b
            .write_batch(&records)
            .unwrap()
            .into_iter()
            .zip(early.clone())
            .collect();
        let fresh: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, 300_000)).collect();
        let fresh_records = records_of(100, &fresh);

        for fault in [Fault::NoSpace, Fault::Eio, Fault::NoProgress] {
            let before = b.stats();
            // A failure on the second call of a multi-call write leaves part of the
            // batch on disk: it must still all be released.
            plan.fail_next_write(Fault::Short(200_000));
            // No progress must repeat to become an error; the others fail at once.
            for _ in 0..if fault == Fault::NoProgress { 3 } else { 1 } {
                plan.fail_next_write(fault);
            }
            let err = b.write_batch(&fresh_records).unwrap_err();
            match fault {
                Fault::NoSpace => assert!(matches!(err, BackingError::DeviceFull { .. }), "{err}"),
                Fault::Eio => assert!(matches!(err, BackingError::Io { op: "write", .. }), "{err}"),
                _ => assert!(matches!(err, BackingError::ShortWrite { .. }), "{err}"),
            }
            let after = b.stats();
            assert_eq!(
                after.allocated_bytes, before.allocated_bytes,
                "{fault:?}: nothing stays allocated"
            );
            assert_eq!(after.records_written, before.records_written);
            assert_eq!(
                after.write_errors_nospace + after.write_errors_io + after.write_errors_short,
                before.write_errors_nospace
                    + before.write_errors_io
                    + before.write_errors_short
                    + 1
            );
            check_all(&b, &live);
            b.assert_consistent();
        }
        let st = b.stats();
        assert_eq!(
            (
                st.write_errors_nospace,
                st.write_errors_io,
                st.write_errors_short
            ),
            (1, 1, 1)
        );
        // The device recovers: the same batch now goes through.
        let slots = b.write_batch(&fresh_records).unwrap();
        for (s, d) in slots.iter().zip(&fresh) {
            assert_eq!(&b.read_vec(s).unwrap(), d);
        }
        check_all(&b, &live);
    }
}

#[test]
fn short_writes_are_completed() {
    let mut rng = SmallRng::seed_from_u64(5);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let (b, plan, _) = faulty(config(dir.path(), 32 << 20, mode));
        let datas: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, 70_001)).collect();
        let records = records_of(0, &datas);
        plan.fail_next_write(Fault::Short(5000));
        plan.fail_next_write(Fault::NoProgress);
        plan.fail_next_write(Fault::Short(100_000));
        let slots = b.write_batch(&records).unwrap();
        let st = b.stats();
        assert_eq!(st.write_calls, 4, "three faulty calls and the rest");
        assert!(st.short_write_retries >= 2);
        for (s, d) in slots.iter().zip(&datas) {
            assert_eq!(&b.read_vec(s).unwrap(), d);
        }
    }
}

#[test]
fn read_errors_zero_the_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let (b, plan, _) = faulty(config(dir.path(), 8 << 20, DirectIo::Off));
    let s = b
        .write_batch(&[Record {
            key: 1,
            data: &[0xab; 9000],
        }])
        .unwrap()[0];
    plan.fail_next_read(Fault::Eio);
    let mut out = vec![0; 9000];
    let err = b.read(&s, &mut out).unwrap_err();
    assert!(matches!(err, BackingError::Io { op: "read", .. }), "{err}");
    assert!(out.iter().all(|&x| x == 0));
    // A short read is continued.
    plan.fail_next_read(Fault::Short(100));
    b.read(&s, &mut out).unwrap();
    assert_eq!(out, vec![0xab; 9000]);
    assert_eq!(b.stats().read_errors, 1);
}

#[test]
fn corruption_is_detected_and_names_the_slot() {
    let mut rng = SmallRng::seed_from_u64(6);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let (b, _, fd) = faulty(config(dir.path(), 16 << 20, mode));
        let datas: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, 50_000)).collect();
        let records = records_of(0x100, &datas);
        let slots = b.write_batch(&records).unwrap();
        b.flush().unwrap();
        // A second, buffered descriptor on the same nameless file.
        let other = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .unwrap();
        let at = slots[1].offset() + 12_345;
        let mut byte = [0u8];
        b.read_vec(&slots[1]).unwrap();
        byte[0] = datas[1][12_345] ^ 0x01;
        other.write_at(&byte, at).unwrap();
        other.sync_data().unwrap();
        let mut out = vec![0xff; 50_000];
        match b.read(&slots[1], &mut out) {
            Err(BackingError::Corrupt { slot, .. }) => assert_eq!(slot, slots[1]),
            other => panic!("{mode:?}: expected Corrupt, got {other:?}"),
        }
        assert!(out.iter().all(|&x| x == 0), "no wrong bytes handed out");
        let msg = b.read_vec(&slots[1]).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("{:#x}", slots[1].offset())) && msg.contains("0x101"),
            "{msg}"
        );
        check_all(
            &b,
            &[(slots[0], datas[0].clone()), (slots[2], datas[2].clone())],
        );
        assert_eq!(b.stats().corrupt_records, 2);
    }
}

#[test]
fn stale_and_forged_slots_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 8 << 20, DirectIo::Prefer)).unwrap();
    let old = b
        .write_batch(&[Record {
            key: 1,
            data: &[1; 5000],
        }])
        .unwrap()[0];
    b.free(old).unwrap();
    let new = b
        .write_batch(&[Record {
            key: 2,
            data: &[2; 5000],
        }])
        .unwrap()[0];
    assert_eq!(old.offset(), new.offset(), "space is reused");
    assert!(
        matches!(b.read_vec(&old), Err(BackingError::Corrupt { .. })),
        "a stale slot never reads the new data"
    );
    // Wrong length: the allocator sees the extent does not match.
    let forged = Slot { len: 9000, ..new };
    assert!(matches!(b.free(forged), Err(BackingError::BadSlot { .. })));
    let outside = Slot {
        offset: 8 << 20,
        ..new
    };
    assert!(matches!(b.free(outside), Err(BackingError::BadSlot { .. })));
    assert!(matches!(
        b.read_vec(&outside),
        Err(BackingError::BadSlot { .. })
    ));
    let unaligned = Slot { offset: 100, ..new };
    assert!(matches!(
        b.read_vec(&unaligned),
        Err(BackingError::BadSlot { .. })
    ));
    assert!(matches!(
        b.read(&new, &mut [0; 10]),
        Err(BackingError::BufferSize {
            expected: 5000,
            got: 10
        })
    ));
    b.free(new).unwrap();
    assert!(
        matches!(b.free(new), Err(BackingError::BadSlot { .. })),
        "double free"
    );
    b.assert_consistent();
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = |cfg: BackingConfig| match BackingFile::create(cfg) {
        Err(BackingError::InvalidConfig(msg)) => msg,
        other => panic!("expected InvalidConfig, got {:?}", other.map(|_| ())),
    };
    assert!(bad(BackingConfig {
        cluster_size: 3 << 20,
        ..BackingConfig::new(dir.path(), 64 << 20)
    })
    .contains("power of two"));
    assert!(bad(BackingConfig {
        cluster_size: 512,
        ..BackingConfig::new(dir.path(), 64 << 20)
    })
    .contains("power of two"));
    assert!(bad(BackingConfig::new(dir.path(), 1 << 20)).contains("smaller than one cluster"));
    let b = BackingFile::create(BackingConfig::new(dir.path(), 4 << 20)).unwrap();
    assert!(matches!(
        b.write_batch(&[Record { key: 5, data: &[] }]),
        Err(BackingError::EmptyRecord { key: 5 })
    ));
    let big = vec![0; (4 << 20) + 1];
    assert!(matches!(
        b.write_batch(&[Record { key: 6, data: &big }]),
        Err(BackingError::RecordTooLarge { .. })
    ));
    assert!(b.write_batch(&[]).unwrap().is_empty());
    // Full: a clear NoSpace, and the batch leaves nothing behind.
    let two = vec![7; 2 << 20];
    b.write_batch(&[Record { key: 7, data: &two }]).unwrap();
    let err = b
        .write_batch(&[
            Record {
                key: 8,
                data: &[1; 100],
            },
            Record { key: 9, data: &two },
        ])
        .unwrap_err();
    assert!(
        matches!(
            err,
            BackingError::NoSpace {
                key: 9,
                fragmented: false,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(b.stats().allocated_bytes, 2 << 20);
    assert_eq!(b.stats().alloc_failures, 1);
}

#[test]
fn the_file_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8 << 20, DirectIo::Prefer);
    let file = PrivateFile::open(&cfg).unwrap();
    let fd = file.as_raw_fd();
    let b = BackingFile::with_io(cfg, Box::new(file)).unwrap();
    b.write_batch(&[Record {
        key: 1,
        data: &[9; 10_000],
    }])
    .unwrap();
    b.flush().unwrap();
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "no name in the directory"
    );
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    assert_eq!(st.st_mode & 0o777, 0o600);
    assert_eq!(st.st_nlink, 0, "unlinked");
}

#[test]
fn direct_io_can_be_required() {
    let dir = tempfile::tempdir().unwrap();
    let preferred = BackingFile::create(config(dir.path(), 8 << 20, DirectIo::Prefer)).unwrap();
    let required = BackingFile::create(config(dir.path(), 8 << 20, DirectIo::Require));
    if preferred.direct_io() {
        assert!(required.unwrap().direct_io());
    } else {
        assert!(matches!(
            required,
            Err(BackingError::DirectIoUnsupported { .. })
        ));
    }
    let off = BackingFile::create(config(dir.path(), 8 << 20, DirectIo::Off)).unwrap();
    assert!(!off.direct_io() && !off.stats().direct_io);
}

#[test]
fn fragmentation_leads_to_counted_fallbacks() {
    let dir = tempfile::tempdir().unwrap();
    // Four 64 KiB clusters of 16 blocks.
    let cfg = BackingConfig {
        cluster_size: 64 << 10,
        ..config(dir.path(), 256 << 10, DirectIo::Off)
    };
    let b = BackingFile::create(cfg).unwrap();
    let page = |k: u64| vec![k as u8; 4096];
    let singles: Vec<Slot> = (0..32)
        .map(|k| {
            b.write_batch(&[Record {
                key: k,
                data: &page(k),
            }])
            .unwrap()[0]
        })
        .collect();
    let quads: Vec<Slot> = (0..8)
        .map(|k| {
            b.write_batch(&[Record {
                key: 100 + k,
                data: &[k as u8; 16384],
            }])
            .unwrap()[0]
        })
        .collect();
    assert_eq!(b.stats().clusters.full, 4);
    assert_eq!(b.stats().cluster_fallbacks, 0);
    for s in singles.iter().step_by(2) {
        b.free(*s).unwrap();
    }
    b.free(quads[5]).unwrap();
    // An 8 KiB record has no cluster of its order and no free cluster: it borrows
    // the hole a 16 KiB record left.
    let s = b
        .write_batch(&[Record {
            key: 500,
            data: &[5; 8192],
        }])
        .unwrap()[0];
    assert_eq!(s.offset(), quads[5].offset());
    assert_eq!(b.stats().cluster_fallbacks, 1);
    assert_eq!(b.read_vec(&s).unwrap(), vec![5; 8192]);
    // 64 KiB are free in all, but no 16 KiB run: a fragmented NoSpace.
    let err = b
        .write_batch(&[Record {
            key: 501,
            data: &[6; 16384],
        }])
        .unwrap_err();
    assert!(
        matches!(
            err,
            BackingError::NoSpace {
                fragmented: true,
                ..
            }
        ),
        "{err}"
    );
    for s in singles.iter().skip(1).step_by(2) {
        assert_eq!(b.read_vec(s).unwrap(), page(s.key()));
    }
    b.assert_consistent();
}

#[test]
fn punching_gives_disk_space_back() {
    let mut rng = SmallRng::seed_from_u64(7);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let b = BackingFile::create(config(dir.path(), 64 << 20, mode)).unwrap();
        let folios: Vec<Vec<u8>> = (0..8).map(|_| random_bytes(&mut rng, 2 << 20)).collect();
        let records = records_of(0, &folios);
        let big = b.write_batch(&records).unwrap();
        // Two 128 KiB records sharing a cluster: freeing one punches just it.
        let halves: Vec<Vec<u8>> = (0..2).map(|_| random_bytes(&mut rng, 128 << 10)).collect();
        let records = records_of(50, &halves);
        let pair = b.write_batch(&records).unwrap();
        b.flush().unwrap();
        let full = b.file_allocated_bytes().unwrap();
        assert!(full >= (16 << 20) + (256 << 10), "{mode:?}: {full}");
        b.free(pair[0]).unwrap();
        assert_eq!(b.stats().punched_bytes, 128 << 10);
        let after_one = b.file_allocated_bytes().unwrap();
        // Less a block the file system may take for its extent tree when the hole
        // splits an extent (ext4, a file written in pieces under parallel load: 124 KiB
        // came back of 128).
        assert!(
            after_one <= full - (128 << 10) + (4 << 10),
            "{mode:?}: {full} -> {after_one}"
        );
        assert_eq!(b.read_vec(&pair[1]).unwrap(), halves[1]);
        for s in &big {
            b.free(*s).unwrap();
        }
        assert_eq!(b.stats().punched_bytes, (128 << 10) + (16 << 20));
        let after_all = b.file_allocated_bytes().unwrap();
        assert!(
            after_all < (1 << 20),
            "{mode:?}: {after_all} bytes still allocated"
        );
        b.free(pair[1]).unwrap();
        assert_eq!(b.stats().clusters.free, 32);
    }
}

/// Deterministic record contents, so any thread can check what it reads.
fn contents(seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let len = match seed % 4 {
        0 => rng.gen_range(1..4096),
        1 => rng.gen_range(4096..70_000),
        2 => rng.gen_range(70_000..300_000),
        _ => 2 << 20,
    };
    random_bytes(&mut rng, len)
}

#[test]
fn hammered_from_many_threads() {
    const ENTRIES: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 48 << 20, DirectIo::Prefer)).unwrap();
    // A store's entry table in miniature: each entry's mutex orders the backing
    // operations on it, as the store's entry ownership does.
    let entries: Vec<Mutex<Option<(Slot, u64)>>> = (0..ENTRIES)
        .map(|_| Mutex::new(None))
        .collect();
    let stop = AtomicBool::new(false);
    // The freer stops with the writers, so that readers still find entries to check.
    let writing = AtomicBool::new(true);
    let next_seed = std::sync::atomic::AtomicU64::new(1);
    let verified = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2)
            .map(|w| {
                let (b, entries, next_seed) = (&b, &entries, &next_seed);
                s.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(w);
                    for _ in 0..120 {
                        let mut guards = Vec::new();
                        let start = rng.gen_range(0..ENTRIES);
                        for i in (start..start + 8).map(|i| i % ENTRIES) {
                            if let Some(g) = entries[i].try_lock() {
                                if g.is_none() && guards.len() < 4 {
                                    guards.push(g);
                                }
                            }
                        }
                        let seeds: Vec<u64> = guards
                            .iter()
                            .map(|_| next_seed.fetch_add(1, Ordering::Relaxed))
                            .collect();
                        let datas: Vec<Vec<u8>> = seeds.iter().map(|&s| contents(s)).collect();
                        let records: Vec<Record> = seeds
                            .iter()
                            .zip(&datas)
                            .map(|(&key, data)| Record { key, data })
                            .collect();
                        match b.write_batch(&records) {
                            Ok(slots) => {
                                for ((g, slot), seed) in guards.iter_mut().zip(slots).zip(seeds) {
                                    **g = Some((slot, seed));
                                }
                            }
                            Err(BackingError::NoSpace { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                })
            })
            .collect();
        for r in 0..3u64 {
            let (b, entries, stop, verified) = (&b, &entries, &stop, &verified);
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + r);
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let e = entries[rng.gen_range(0..ENTRIES)].lock();
                    if let Some((slot, seed)) = *e {
                        out.resize(slot.data_len(), 0);
                        b.read(&slot, &mut out).unwrap();
                        assert_eq!(out, contents(seed));
                        verified.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        {
            let (b, entries, writing) = (&b, &entries, &writing);
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(200);
                while writing.load(Ordering::Relaxed) {
                    let mut e = entries[rng.gen_range(0..ENTRIES)].lock();
                    if rng.gen_bool(0.5) {
                        if let Some((slot, _)) = e.take() {
                            b.free(slot).unwrap();
                        }
                    }
                }
            });
        }
        for w in writers {
            w.join().unwrap();
        }
        writing.store(false, Ordering::Relaxed);
        // On a loaded machine the readers may not have had their turn yet: they get
        // it now (while entries are left), rather than the test counting on timing.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while verified.load(Ordering::Relaxed) <= 50
            && entries.iter().any(|e| e.lock().is_some())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(verified.load(Ordering::Relaxed) > 50, "readers did work");
    let live: Vec<(Slot, Vec<u8>)> = entries
        .iter()
        .filter_map(|e| e.lock().map(|(s, seed)| (s, contents(seed))))
        .collect();
    check_all(&b, &live);
    b.assert_consistent();
    for (s, _) in &live {
        b.free(*s).unwrap();
    }
    let st = b.stats();
    assert_eq!(
        (
            st.allocated_bytes,
            st.stored_bytes,
            st.corrupt_records,
            st.read_errors
        ),
        (0, 0, 0, 0)
    );
    assert!(st.punched_bytes > 0);
}

#[test]
fn zero_copy_write_is_correct_after_staging_neighbours() {
    // Aligned and unaligned records mixed in one O_DIRECT run.
    let mut rng = SmallRng::seed_from_u64(8);
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 16 << 20, DirectIo::Prefer)).unwrap();
    let mut aligned = AlignedBuf::zeroed(16384);
    rng.fill_bytes(&mut aligned);
    let odd = random_bytes(&mut rng, 10_000);
    let odd2 = random_bytes(&mut rng, 9_000);
    let recs = [
        Record { key: 1, data: &odd },
        Record {
            key: 2,
            data: &aligned,
        },
        Record {
            key: 3,
            data: &odd2,
        },
        Record {
            key: 4,
            data: &aligned,
        },
    ];
    let slots = b.write_batch(&recs).unwrap();
    for (s, r) in slots.iter().zip(&recs) {
        assert_eq!(b.read_vec(s).unwrap(), r.data);
    }
}

#[test]
fn freeing_a_stale_slot_whose_space_was_reused_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 8 << 20, DirectIo::Prefer)).unwrap();
    let old = b.write_batch(&[Record { key: 1, data: &[7u8; 8192] }]).unwrap()[0];
    b.free(old).unwrap();
    let new = b.write_batch(&[Record { key: 2, data: &[9u8; 8192] }]).unwrap()[0];
    assert_eq!(new.offset(), old.offset(), "the freed extent is reused");
    assert!(matches!(b.free(old), Err(BackingError::BadSlot { .. })));
    assert_eq!(b.read_vec(&new).unwrap(), vec![9u8; 8192], "the new record is intact");
    b.free(new).unwrap();
    b.assert_consistent();
}

/// Encrypted files: round trips, nothing of the plaintext on disk, a flipped bit
/// or a record moved to another slot is Corrupt, and equal records differ on disk.
#[test]
fn encrypted_records_round_trip_hide_their_bytes_and_detect_tampering() {
    let marker: Vec<u8> = b"UZSWAP-SECRET-MARKER-0123456789"
        .iter()
        .copied()
        .cycle()
        .take(20_000)
        .collect();
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let cfg = BackingConfig {
            encrypt: true,
            ..config(dir.path(), 16 << 20, mode)
        };
        let (b, _, fd) = faulty(cfg);
        let mut rng = SmallRng::seed_from_u64(17);
        let mut datas = vec![marker.clone(), marker.clone()];
        datas.extend((0..4).map(|i| random_bytes(&mut rng, [1, 4096, 65536, 2 << 20][i])));
        let records = records_of(0x40, &datas);
        let slots = b.write_batch(&records).unwrap();
        b.flush().unwrap();
        let live: Vec<(Slot, Vec<u8>)> = slots.iter().copied().zip(datas.clone()).collect();
        check_all(&b, &live);
        // The whole file, read through another descriptor: no trace of the marker.
        let other = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .unwrap();
        let mut disk = vec![0u8; b.capacity_bytes() as usize];
        let n = other.read_at(&mut disk, 0).unwrap();
        let disk = &disk[..n];
        assert!(
            !disk.windows(16).any(|w| w == &marker[..16]),
            "{mode:?}: plaintext in the file"
        );
        let at = |s: &Slot| s.offset() as usize;
        assert_ne!(
            disk[at(&slots[0])..at(&slots[0]) + 1000],
            disk[at(&slots[1])..at(&slots[1]) + 1000],
            "equal records must not look equal on disk (nonce reuse)"
        );
        // A flipped bit: Corrupt, zeros handed out, the others still read.
        let mut byte = [disk[at(&slots[2]) + 100 % slots[2].data_len()]];
        byte[0] ^= 0x80;
        other.write_at(&byte, slots[2].offset()).unwrap();
        other.sync_data().unwrap();
        let mut out = vec![0xffu8; slots[2].data_len()];
        assert!(matches!(
            b.read(&slots[2], &mut out),
            Err(BackingError::Corrupt { .. })
        ));
        assert!(out.iter().all(|&x| x == 0));
        // Record 0's ciphertext copied over record 1 (same key schedule, same length):
        // the seal of slot 1 does not open it.
        other
            .write_at(&disk[at(&slots[0])..at(&slots[0]) + 20_480], slots[1].offset())
            .unwrap();
        other.sync_data().unwrap();
        // Written behind the file's back: a read-around window may still hold it as it was.
        b.forget_read_around();
        assert!(matches!(
            b.read_vec(&slots[1]),
            Err(BackingError::Corrupt { .. })
        ));
        check_all(&b, &[live[0].clone(), live[3].clone(), live[4].clone(), live[5].clone()]);
        assert_eq!(b.stats().corrupt_records, 2);
        // Freed and rewritten: the new record has its own seal; the stale slot is refused.
        b.free(slots[3]).unwrap();
        let again = b
            .write_batch(&[Record {
                key: 0x99,
                data: &datas[3],
            }])
            .unwrap();
        assert_eq!(b.read_vec(&again[0]).unwrap(), datas[3]);
        assert!(b.read_vec(&slots[3]).is_err() || again[0].offset() != slots[3].offset());
        assert!(b.free(slots[3]).is_err());
    }
}

#[test]
fn a_byte_flipped_on_the_way_to_or_from_the_device_is_caught() {
    for mode in [DirectIo::Off, DirectIo::Prefer] {
        let dir = tempfile::tempdir().unwrap();
        let (b, plan, _) = faulty(config(dir.path(), 8 << 20, mode));
        let data = vec![0x5au8; 3 * BLOCK_SIZE + 17];
        // The first read of the file: not part of a pass, so no read-around window.
        let good = b.write_batch(&[Record { key: 5, data: &data }]).unwrap()[0];
        plan.fail_next_read(Fault::Flip);
        assert!(matches!(b.read_vec(&good), Err(BackingError::Corrupt { .. })), "{mode:?}: flipped read");
        assert_eq!(b.read_vec(&good).unwrap(), data);
        // Right after `good`: under O_DIRECT read through a window, and read again
        // from the file when it fails its check: bad on disk, so an error both ways.
        plan.fail_next_write(Fault::Flip);
        let slot = b.write_batch(&[Record { key: 4, data: &data }]).unwrap()[0];
        assert!(matches!(b.read_vec(&slot), Err(BackingError::Corrupt { .. })), "{mode:?}: flipped write");
    }
}

/// `read_in_place` reads into an aligned buffer with room for whole blocks (no
/// bounce buffer), in both I/O modes and encrypted; other buffers are refused.
#[test]
fn read_in_place_round_trips_and_refuses_bad_buffers() {
    let mut rng = SmallRng::seed_from_u64(11);
    for mode in MODES {
        for encrypt in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = BackingConfig { encrypt, ..config(dir.path(), 16 << 20, mode) };
            let b = BackingFile::create(cfg).unwrap();
            let datas: Vec<Vec<u8>> = [1, 4095, 4096, 5000, 70_000].iter().map(|&n| random_bytes(&mut rng, n)).collect();
            let slots = b.write_batch(&records_of(0, &datas)).unwrap();
            let mut buf = AlignedBuf::zeroed(128 << 10);
            for (slot, data) in slots.iter().zip(&datas) {
                b.read_in_place(slot, &mut buf).unwrap();
                assert_eq!(&buf[..data.len()], &data[..], "{slot} mode {mode:?} encrypt {encrypt}");
                let short = slot.disk_len() as usize - 1;
                assert!(matches!(b.read_in_place(slot, &mut buf[..short]), Err(BackingError::BufferSize { .. })));
                assert!(matches!(b.read_in_place(slot, &mut buf[1..]), Err(BackingError::BufferSize { .. })));
            }
        }
    }
}

/// Deferred frees from several threads while another writes batches and reaps:
/// every slot is freed exactly once, no queue push ever needs to grow the queue,
/// and a slot queued twice is refused, never allocated for.
#[test]
fn deferred_frees_from_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 64 << 20, DirectIo::Prefer)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Slot>();
    let rx = Mutex::new(rx);
    let written = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let b = &b;
        for _ in 0..3 {
            let (rx, written) = (&rx, &written);
            s.spawn(move || loop {
                let next = rx.lock().recv();
                let Ok(slot) = next else { break };
                b.free_deferred(slot).unwrap();
                written.fetch_add(1, Ordering::Relaxed);
            });
        }
        let mut rng = SmallRng::seed_from_u64(5);
        for round in 0..300u64 {
            let n = rng.gen_range(1..8);
            let datas: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    let len = rng.gen_range(1..20_000);
                    random_bytes(&mut rng, len)
                })
                .collect();
            for slot in b.write_batch(&records_of(round * 8, &datas)).unwrap() {
                tx.send(slot).unwrap();
            }
            if round % 7 == 0 {
                b.reap().unwrap();
            }
        }
        drop(tx);
    });
    b.reap().unwrap();
    let st = b.stats();
    assert_eq!(st.stored_records, 0, "{st:?}");
    assert_eq!(st.allocated_bytes, 0, "{st:?}");
    // Queued twice: refused by the reap as a slot no longer live.
    let slot = b.write_batch(&[Record { key: 1, data: b"x" }]).unwrap()[0];
    b.free_deferred(slot).unwrap();
    b.reap().unwrap();
    b.free_deferred(slot).unwrap();
    assert!(matches!(b.reap(), Err(BackingError::BadSlot { .. })));
    b.assert_consistent();
}

/// A backing file under O_DIRECT for the read-around tests, or `None` (said) where the
/// file system has no O_DIRECT: then nothing is read ahead.
fn direct_file(dir: &Path, max: u64) -> Option<BackingFile> {
    let b = BackingFile::create(config(dir, max, DirectIo::Prefer)).unwrap();
    if !b.direct_io() {
        eprintln!("SKIP: no O_DIRECT under {}: no read-around", dir.display());
        return None;
    }
    Some(b)
}

/// A pass over records written in order reads windows, not record after record; a
/// read at random reads its record alone.
#[test]
fn read_around_serves_a_sequential_pass() {
    let dir = tempfile::tempdir().unwrap();
    let Some(b) = direct_file(dir.path(), 64 << 20) else { return };
    let mut rng = SmallRng::seed_from_u64(21);
    let datas: Vec<Vec<u8>> = (0..400).map(|_| {
        let n = rng.gen_range(2000..9000);
        random_bytes(&mut rng, n)
    }).collect();
    let mut slots = Vec::new();
    for (i, batch) in datas.chunks(25).enumerate() {
        slots.extend(b.write_batch(&records_of(i as u64 * 25, batch)).unwrap());
    }
    let mut buf = AlignedBuf::zeroed(16 << 10);
    let calls = b.stats().read_calls;
    for (slot, data) in slots.iter().zip(&datas) {
        b.read_in_place(slot, &mut buf).unwrap();
        assert_eq!(&buf[..data.len()], &data[..], "{slot}");
    }
    let st = b.stats();
    assert!(st.readahead_hits > 300 && st.readahead_windows > 0, "{st:?}");
    assert!(st.read_calls - calls < 100, "{} read calls for 400 records: {st:?}", st.read_calls - calls);
    assert_eq!(st.readahead_refetched, 0);
    // At random: every record right, from whatever holds it.
    let mut order: Vec<usize> = (0..slots.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    for &i in &order {
        assert_eq!(b.read_vec(&slots[i]).unwrap(), datas[i]);
    }
    assert_eq!(b.stats().readahead_refetched, 0);
}

/// A window never gives bytes the file no longer has: records freed and written
/// again where a window was read are read as they are now, and not by a second read
/// after a failed check (`readahead_refetched` stays 0: the write made the window stale).
#[test]
fn read_around_never_serves_rewritten_space() {
    let dir = tempfile::tempdir().unwrap();
    let Some(b) = direct_file(dir.path(), 64 << 20) else { return };
    let mut rng = SmallRng::seed_from_u64(22);
    for round in 0..20u64 {
        let datas: Vec<Vec<u8>> = (0..48).map(|_| random_bytes(&mut rng, 4096)).collect();
        let slots = b.write_batch(&records_of(round * 1000, &datas)).unwrap();
        // A pass over the first few: a window now holds the rest.
        for i in 0..4 {
            assert_eq!(b.read_vec(&slots[i]).unwrap(), datas[i]);
        }
        // Some of the rest freed and their space written again, with other bytes
        // under the same keys and lengths (only the checksum's data part differs).
        for slot in &slots[10..30] {
            b.free(*slot).unwrap();
        }
        let again: Vec<Vec<u8>> = (10..30).map(|_| random_bytes(&mut rng, 4096)).collect();
        let new_slots = b.write_batch(&records_of(round * 1000 + 10, &again)).unwrap();
        for (slot, data) in new_slots.iter().zip(&again) {
            assert_eq!(&b.read_vec(slot).unwrap(), data, "round {round}: {slot}");
        }
        for i in (4..10).chain(30..48) {
            assert_eq!(b.read_vec(&slots[i]).unwrap(), datas[i], "round {round}");
        }
        for (i, slot) in slots.iter().enumerate().filter(|(i, _)| !(10..30).contains(i)) {
            b.free(*slot).unwrap_or_else(|e| panic!("{i}: {e}"));
        }
        for slot in new_slots {
            b.free(slot).unwrap();
        }
    }
    let st = b.stats();
    assert!(st.readahead_windows > 0, "{st:?}");
    assert_eq!(st.readahead_refetched, 0, "a window gave stale bytes: {st:?}");
}

/// Readers making passes over their own records, through the fault path's call,
/// while another thread frees and writes records in the same clusters and reads them
/// back: every byte right, nothing read twice after a failed check.
#[test]
fn read_around_from_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let Some(b) = direct_file(dir.path(), 128 << 20) else { return };
    let b = &b;
    let stop = AtomicBool::new(false);
    let per = 300;
    // Interleaved in the file: each batch has records of every reader and of the writer.
    let mut rng = SmallRng::seed_from_u64(23);
    let mut owned: Vec<Vec<(Slot, Vec<u8>)>> = vec![Vec::new(); 4];
    for _ in 0..per / 10 {
        let datas: Vec<Vec<u8>> = (0..40).map(|_| {
            let n = rng.gen_range(100..12_000);
            random_bytes(&mut rng, n)
        }).collect();
        let slots = b.write_batch(&records_of(rng.gen(), &datas)).unwrap();
        for (i, (s, d)) in slots.into_iter().zip(datas).enumerate() {
            owned[i % 4].push((s, d));
        }
    }
    let mut writer_own = owned.pop().unwrap();
    std::thread::scope(|sc| {
        for (t, mine) in owned.into_iter().enumerate() {
            let stop = &stop;
            sc.spawn(move || {
                let mut buf = AlignedBuf::zeroed(16 << 10);
                let mut passes = 0;
                while !stop.load(Ordering::Relaxed) || passes < 3 {
                    for (slot, data) in &mine {
                        b.read_in_place(slot, &mut buf).unwrap_or_else(|e| panic!("reader {t}: {e}"));
                        assert_eq!(&buf[..data.len()], &data[..], "reader {t}: {slot}");
                    }
                    passes += 1;
                }
            });
        }
        let mut rng = SmallRng::seed_from_u64(24);
        for _ in 0..300 {
            let i = rng.gen_range(0..writer_own.len());
            let (slot, data) = writer_own.swap_remove(i);
            assert_eq!(b.read_vec(&slot).unwrap(), data);
            b.free(slot).unwrap();
            let n = rng.gen_range(100..12_000);
            let d = random_bytes(&mut rng, n);
            let s = b.write_batch(&[Record { key: rng.gen(), data: &d }]).unwrap()[0];
            assert_eq!(b.read_vec(&s).unwrap(), d);
            writer_own.push((s, d));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let st = b.stats();
    assert!(st.readahead_hits > 0, "{st:?}");
    assert_eq!(st.readahead_refetched, 0, "{st:?}");
}

/// Loan marks: a queued free is kept while a loan marked after its record was
/// written is out, freed once no such loan is (`reap_keeping`), whatever order the
/// loans end in; the space of what is kept is not reused meanwhile.
#[test]
fn frees_are_kept_for_the_loans_that_may_read_them() {
    let mut rng = SmallRng::seed_from_u64(9);
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 64 << 20, DirectIo::Off)).unwrap();
    let data: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, 20_000)).collect();
    let a = b.write_batch(&records_of(1, &data[..1])).unwrap()[0];
    let first = b.mark_lend();
    let m = b.write_batch(&records_of(2, &data[1..2])).unwrap()[0];
    let second = b.mark_lend();
    assert!(second > first);
    let c = b.write_batch(&records_of(3, &data[2..])).unwrap()[0];
    for s in [a, m, c] {
        b.free_deferred(s).unwrap();
    }
    // Both loans out: only the record written after both is freed.
    assert_eq!(b.reap_keeping(second).unwrap(), 1);
    assert_eq!(b.kept_for_loans(), 2);
    // What is kept is still there, and new records do not take its space.
    let more: Vec<Vec<u8>> = (0..8).map(|_| random_bytes(&mut rng, 20_000)).collect();
    let new = b.write_batch(&records_of(10, &more)).unwrap();
    assert!(new.iter().all(|s| s.offset() != a.offset() && s.offset() != m.offset()));
    check_all(&b, &[(a, data[0].clone()), (m, data[1].clone())]);
    // The second loan ends first: the record only it could read goes.
    assert_eq!(b.reap_keeping(first).unwrap(), 1);
    assert_eq!(b.kept_for_loans(), 1);
    check_all(&b, &[(a, data[0].clone())]);
    assert_eq!(b.reap_keeping(first).unwrap(), 0, "nothing new to free");
    assert_eq!(b.reap_keeping(0).unwrap(), 1);
    assert_eq!(b.kept_for_loans(), 0);
    for s in new {
        b.free(s).unwrap();
    }
    assert_eq!(b.stats().stored_records, 0);
}

/// Loans under load: two threads write, free (deferred) and reap their own records
/// while a third, a child's stand-in, takes loans (what is live, then the mark,
/// with no free between) and reads every record of its loans back, though their
/// writers freed them since, until it returns them: reaps keep them for it. In the
/// end every free is done and nothing is left.
#[test]
fn loans_hammered_from_several_threads() {
    let dir = tempfile::tempdir().unwrap();
    let b = BackingFile::create(config(dir.path(), 256 << 20, DirectIo::Off)).unwrap();
    // Every record live (not yet given to free_deferred), by its writers.
    let live: Mutex<Vec<(Slot, Vec<u8>)>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let loans: Mutex<Vec<u32>> = Mutex::new(Vec::new());
    let before = || loans.lock().iter().copied().max().unwrap_or(0);
    // A reap and the loan marks it is given are one step against new loans, as the
    // store's reap and its freeze for a fork are.
    let order = std::sync::RwLock::new(());
    std::thread::scope(|sc| {
        for t in 0..2u64 {
            let (b, live, stop, before, order) = (&b, &live, &stop, &before, &order);
            sc.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                let mut mine: Vec<Slot> = Vec::new();
                let mut key = t << 40;
                while !stop.load(Ordering::Relaxed) {
                    let data: Vec<Vec<u8>> = (0..4)
                        .map(|_| {
                            let len = rng.gen_range(100..20_000);
                            random_bytes(&mut rng, len)
                        })
                        .collect();
                    let slots = b.write_batch(&records_of(key, &data)).unwrap();
                    key += 4;
                    mine.extend(&slots);
                    live.lock().extend(slots.into_iter().zip(data));
                    while mine.len() > 32 {
                        let s = mine.swap_remove(rng.gen_range(0..mine.len()));
                        let mut l = live.lock();
                        l.retain(|(x, _)| x.offset() != s.offset());
                        b.free_deferred(s).unwrap();
                    }
                    let _reap = order.read().unwrap();
                    b.reap_keeping(before()).unwrap();
                }
                let mut l = live.lock();
                for s in mine {
                    l.retain(|(x, _)| x.offset() != s.offset());
                    b.free_deferred(s).unwrap();
                }
            });
        }
        let (b, live, loans, stop, order) = (&b, &live, &loans, &stop, &order);
        sc.spawn(move || {
            // The writers stop however this ends (a failed check too).
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(stop);
            let mut rng = SmallRng::seed_from_u64(99);
            // Each loan's mark, and the records it may read.
            type Loan = (u32, Vec<(Slot, Vec<u8>)>);
            let mut held: Vec<Loan> = Vec::new();
            let mut checked = 0;
            for round in 0..400 {
                if held.len() < 3 && rng.gen_bool(0.5) {
                    let _fork = order.write().unwrap();
                    let l = live.lock();
                    let mark = b.mark_lend();
                    loans.lock().push(mark);
                    held.push((mark, l.clone()));
                } else if !held.is_empty() && rng.gen_bool(0.3) {
                    let (mark, _) = held.swap_remove(rng.gen_range(0..held.len()));
                    loans.lock().retain(|&m| m != mark);
                }
                for (mark, seen) in &held {
                    for (s, d) in seen.iter().step_by(5) {
                        assert_eq!(&b.read_vec(s).unwrap(), d, "round {round}: a record of loan {mark}");
                        checked += 1;
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            loans.lock().clear();
            assert!(checked > 1000, "only {checked} reads of lent records");
        });
    });
    b.reap_keeping(0).unwrap();
    assert_eq!(b.kept_for_loans(), 0);
    assert!(b.stats().records_freed > 1000);
    assert_eq!(b.stats().stored_records, 0, "every record freed, none twice");
}
