//! Against real servers: redis-server started in a temporary directory on a free
//! port (skipped, saying so, where redis-server is not installed). No mock.

use super::*;
use crate::testing::{free_port, Server};
use uzswap_backing::{AlignedBuf, BackingConfig};

fn config(url: &str) -> RemoteConfig {
    let mut cfg = RemoteConfig::new(Target::parse(url).unwrap());
    // WAIT gets half: a replica on a loaded machine (CI) may lag that long.
    cfg.timeout = Duration::from_secs(2);
    cfg.read_deadline = Duration::from_secs(2);
    cfg
}

/// Records of varied sizes and contents: key i, a few KiB to 200 KiB.
fn records(n: u64, seed: u64) -> Vec<(u64, Vec<u8>)> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|k| {
            let len = rng.gen_range(1..200_000);
            (k, (0..len).map(|_| rng.gen::<u8>() % 7).collect())
        })
        .collect()
}

fn write(tier: &dyn Tier, recs: &[(u64, Vec<u8>)]) -> Result<Vec<Slot>, BackingError> {
    let rs: Vec<Record<'_>> = recs.iter().map(|(k, d)| Record { key: *k, data: d }).collect();
    tier.write_batch(&rs)
}

fn read(tier: &dyn Tier, slot: &Slot) -> Result<Vec<u8>, BackingError> {
    let mut buf = AlignedBuf::zeroed(slot.disk_len() as usize);
    tier.read_in_place(slot, &mut buf[..])?;
    Ok(buf[..slot.data_len()].to_vec())
}

fn hlen_total(server: &Server, tier: &RemoteTier) -> i64 {
    let mut c = server.con();
    tier.keys().iter().map(|k| redis::cmd("HLEN").arg(k).query::<i64>(&mut c).unwrap()).sum()
}

#[test]
fn records_come_back_sealed_on_the_server_and_are_deleted_at_exit() {
    let Some(server) = Server::start(&[]) else { return };
    let tier = RemoteTier::new(config(&server.url()), None).unwrap();
    let recs = records(40, 1);
    let slots = write(&tier, &recs).unwrap();
    assert!(slots.iter().all(|s| s.offset() & REMOTE != 0));
    assert_eq!(hlen_total(&server, &tier), 40);
    for ((_, data), slot) in recs.iter().zip(&slots) {
        assert_eq!(&read(&tier, slot).unwrap(), data);
    }
    // Sealed: no object holds its plaintext, and every bucket has an expiry.
    let mut c = server.con();
    for key in tier.keys() {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut c).unwrap();
        assert!(ttl == -2 || (0..=600_000).contains(&ttl), "{key}: pttl {ttl}");
        let values: Vec<Vec<u8>> = redis::cmd("HVALS").arg(&key).query(&mut c).unwrap();
        for v in values {
            assert!(!recs.iter().any(|(_, d)| d.len() > 64 && v.windows(64).any(|w| w == &d[..64])));
        }
    }
    // Freed objects leave the server; the rest go when the tier does.
    for s in &slots[..10] {
        tier.free_deferred(*s).unwrap();
    }
    assert_eq!(tier.reap().unwrap(), 10);
    assert_eq!(hlen_total(&server, &tier), 30);
    let keys = tier.keys();
    drop(tier);
    let exists: i64 = redis::cmd("EXISTS").arg(&keys).query(&mut c).unwrap();
    assert_eq!(exists, 0);
}

#[test]
fn a_changed_moved_or_missing_object_is_an_error_never_wrong_bytes() {
    let Some(server) = Server::start(&[]) else { return };
    for encrypt in [true, false] {
        let tier = RemoteTier::new(RemoteConfig { encrypt, ..config(&server.url()) }, None).unwrap();
        let recs = records(3, 2);
        let slots = write(&tier, &recs).unwrap();
        let mut c = server.con();
        let field = |s: &Slot| (tier.shared.bucket(s.offset() & !REMOTE), s.offset() & !REMOTE);
        // All changed before any read (a read fetches the next objects ahead):
        // one bit flipped in 0, 2's object put in 1's place (same length), 2 gone.
        let (k0, f0) = field(&slots[0]);
        let (k1, f1) = field(&slots[1]);
        let (k2, f2) = field(&slots[2]);
        let mut v: Vec<u8> = redis::cmd("HGET").arg(&k0).arg(f0).query(&mut c).unwrap();
        v[10] ^= 1;
        let _: () = redis::cmd("HSET").arg(&k0).arg(f0).arg(&v).query(&mut c).unwrap();
        let v2: Vec<u8> = redis::cmd("HGET").arg(&k2).arg(f2).query(&mut c).unwrap();
        let _: () = redis::cmd("HSET").arg(&k1).arg(f1).arg(&v2).query(&mut c).unwrap();
        let _: () = redis::cmd("HDEL").arg(&k2).arg(f2).query(&mut c).unwrap();
        assert!(matches!(read(&tier, &slots[0]), Err(BackingError::Corrupt { .. })), "encrypt {encrypt}");
        assert!(read(&tier, &slots[1]).is_err(), "encrypt {encrypt}");
        let e = read(&tier, &slots[2]).unwrap_err();
        assert!(e.to_string().contains("gone"), "{e}");
        assert_eq!(tier.extra_stats().iter().find(|s| s.0 == "remote_missing").unwrap().1, 1);
    }
}

#[test]
fn bad_targets_are_clear_errors_before_anything_is_stored() {
    let Some(server) = Server::start(&["--requirepass", "sesame"]) else { return };
    let closed = format!("redis://127.0.0.1:{}", free_port());
    let e = RemoteTier::new(config(&closed), None).err().unwrap().to_string();
    assert!(e.contains("connect"), "{e}");
    let e = RemoteTier::new(config(&format!("redis://:wrong@127.0.0.1:{}", server.port)), None).err().unwrap().to_string();
    assert!(e.to_lowercase().contains("pass") || e.contains("WRONGPASS") || e.contains("auth"), "{e}");
    let e = RemoteTier::new(config(&format!("redis://127.0.0.1:{}", server.port)), None).err().unwrap().to_string();
    assert!(e.contains("NOAUTH") || e.to_lowercase().contains("auth"), "{e}");
    let tier = RemoteTier::new(config(&format!("redis://:sesame@127.0.0.1:{}", server.port)), None).unwrap();
    let recs = records(2, 3);
    let slots = write(&tier, &recs).unwrap();
    assert_eq!(read(&tier, &slots[1]).unwrap(), recs[1].1);
    // Two nodes name a cluster; a server that is not in one says so.
    let e = RemoteTier::new(config(&format!("redis://:sesame@127.0.0.1:{},127.0.0.1:{}", server.port, server.port)), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not in a cluster"), "{e}");
}

#[test]
fn a_server_that_dies_loses_nothing_the_file_or_the_caller_still_holds() {
    let Some(mut server) = Server::start(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = BackingFile::create(BackingConfig::new(dir.path(), 64 << 20)).unwrap();
    let with_file = RemoteTier::new(config(&server.url()), Some(file)).unwrap();
    let alone = RemoteTier::new(config(&server.url()), None).unwrap();
    let before = records(5, 4);
    let remote_slots = write(&with_file, &before).unwrap();
    server.kill();
    // With a file: the batch goes there, counted, and reads back; the next one goes
    // there at once, without waiting on the dead server again.
    let after = records(5, 5);
    let slots = write(&with_file, &after).unwrap();
    assert!(slots.iter().all(|s| s.offset() & REMOTE == 0));
    let errors = |t: &RemoteTier| t.extra_stats().iter().find(|s| s.0 == "remote_write_errors").unwrap().1;
    let before = errors(&with_file);
    let again = write(&with_file, &records(5, 55)).unwrap();
    assert!(again.iter().all(|s| s.offset() & REMOTE == 0));
    assert_eq!(errors(&with_file), before, "the dead server was tried again at once");
    for ((_, d), s) in after.iter().zip(&slots) {
        assert_eq!(&read(&with_file, s).unwrap(), d);
    }
    assert_eq!(with_file.extra_stats().iter().find(|s| s.0 == "remote_fallbacks").unwrap().1, 2);
    // Alone: an error, so the caller keeps its records.
    assert!(write(&alone, &after).is_err());
    // What was on the dead server is an error, after the deadline, not zeros.
    let t = Instant::now();
    let e = read(&with_file, &remote_slots[0]).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(matches!(e, BackingError::Remote { .. }), "{e}");
}

#[test]
fn replicas_are_waited_for_and_too_few_is_a_failed_write() {
    let Some(master) = Server::start(&[]) else { return };
    let port = master.port.to_string();
    let Some(replica) = Server::start(&["--replicaof", "127.0.0.1", &port]) else { return };
    // The replica must be attached before WAIT can count it.
    let mut c = master.con();
    for _ in 0..500 {
        let info: String = redis::cmd("INFO").arg("replication").query(&mut c).unwrap();
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let one = RemoteTier::new(RemoteConfig { replicas: 1, ..config(&master.url()) }, None).unwrap();
    let recs = records(8, 6);
    let slots = write(&one, &recs).unwrap();
    // The replica has them (read there directly).
    let mut rc = replica.con();
    let n: i64 = one.keys().iter().map(|k| redis::cmd("HLEN").arg(k).query::<i64>(&mut rc).unwrap()).sum();
    assert_eq!(n, 8);
    assert_eq!(read(&one, &slots[7]).unwrap(), recs[7].1);
    let two = RemoteTier::new(RemoteConfig { replicas: 2, ..config(&master.url()) }, None).unwrap();
    let e = write(&two, &recs).unwrap_err().to_string();
    assert!(e.contains("1 of 2 replicas"), "{e}");
    // Nothing of the refused batch stays on the master.
    assert_eq!(hlen_total(&master, &two), 0);
}

#[test]
fn many_threads_read_at_once_while_batches_are_written_and_freed() {
    let Some(server) = Server::start(&[]) else { return };
    let tier = Arc::new(RemoteTier::new(config(&server.url()), None).unwrap());
    let recs = Arc::new(records(64, 7));
    let slots = Arc::new(write(&*tier, &recs).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..8)
        .map(|t| {
            let (tier, recs, slots) = (Arc::clone(&tier), Arc::clone(&recs), Arc::clone(&slots));
            std::thread::spawn(move || {
                for i in 0..200 {
                    let j = (i * 7 + t * 13) % slots.len();
                    assert_eq!(read(&*tier, &slots[j]).unwrap(), recs[j].1, "thread {t} read {i}");
                }
            })
        })
        .collect();
    let writer = {
        let (tier, stop) = (Arc::clone(&tier), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut round = 0;
            while !stop.load(Relaxed) {
                let more = records(8, 100 + round);
                let s = write(&*tier, &more).unwrap();
                for (slot, (_, d)) in s.iter().zip(&more) {
                    assert_eq!(&read(&*tier, slot).unwrap(), d);
                    tier.free_deferred(*slot).unwrap();
                }
                tier.reap().unwrap();
                round += 1;
            }
        })
    };
    for r in readers {
        r.join().unwrap();
    }
    stop.store(true, Relaxed);
    writer.join().unwrap();
    assert_eq!(hlen_total(&server, &tier), 64);
    let stats = tier.extra_stats();
    let get = |n: &str| stats.iter().find(|s| s.0 == n).unwrap().1;
    assert!(get("remote_records_read") >= 1600);
    assert_eq!(get("remote_read_errors") + get("remote_corrupt_records") + get("remote_missing"), 0);
}

static OPENED: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());
static CLOSED: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());

#[test]
fn sockets_are_told_to_the_caller_and_a_sweep_takes_only_what_dead_processes_left() {
    let Some(server) = Server::start(&[]) else { return };
    let cfg = RemoteConfig {
        on_socket: Some((|fd| OPENED.lock().push(fd), |fd| CLOSED.lock().push(fd))),
        namespace: "t1".into(),
        ..config(&server.url())
    };
    let tier = RemoteTier::new(cfg, None).unwrap();
    let opened = OPENED.lock().clone();
    // The writer's and the reader's connections, each to our server.
    assert_eq!(opened.len(), 2, "{opened:?}");
    for &fd in &opened {
        let mut ss: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: getpeername writes at most `len` bytes into `ss`.
        assert_eq!(unsafe { libc::getpeername(fd, &mut ss as *mut _ as *mut libc::sockaddr, &mut len) }, 0);
        assert_eq!(u16::from_be(ss.sin_port), server.port);
    }
    write(&tier, &records(4, 9)).unwrap();
    let mut c = server.con();
    // A tier of a process that is gone (no pid is that large), in t1's index and in t2's.
    for ns in ["t1", "t2"] {
        let _: () = redis::cmd("SADD").arg(format!("uzswap:{ns}:tiers")).arg(format!("uzswap:{ns}:4000000000:00")).query(&mut c).unwrap();
        let _: () = redis::cmd("HSET").arg(format!("uzswap:{ns}:4000000000:00:0")).arg(1).arg("x").query(&mut c).unwrap();
    }
    let alive = |pid: u32| std::path::Path::new(&format!("/proc/{pid}")).exists();
    let ns = |n: &str| RemoteConfig { namespace: n.into(), ..config(&server.url()) };
    assert_eq!(sweep(&ns("t1"), alive).unwrap(), 1);
    // Ours (a live process) and another namespace's stay.
    let live: i64 = redis::cmd("EXISTS").arg(tier.keys()).query(&mut c).unwrap();
    assert!(live > 0);
    let gone: i64 = redis::cmd("EXISTS").arg("uzswap:t1:4000000000:00:0").query(&mut c).unwrap();
    assert_eq!(gone, 0);
    let listed: Vec<String> = redis::cmd("SMEMBERS").arg("uzswap:t1:tiers").query(&mut c).unwrap();
    assert_eq!(listed, std::slice::from_ref(&tier.shared.prefix));
    let other: i64 = redis::cmd("EXISTS").arg("uzswap:t2:4000000000:00:0").query(&mut c).unwrap();
    assert_eq!(other, 1);
    assert!(sweep(&ns("a:b"), alive).is_err());
    drop(tier);
    // A tier that ends deletes its objects and leaves the index.
    let left: i64 = redis::cmd("SCARD").arg("uzswap:t1:tiers").query(&mut c).unwrap();
    assert_eq!(left, 0);
    let mut closed = CLOSED.lock().clone();
    closed.sort();
    let mut opened = opened;
    opened.sort();
    assert_eq!(closed, opened);
}

#[test]
fn a_cluster_takes_the_objects_and_loses_none_when_a_master_fails() {
    let Some(mut cluster) = crate::testing::Cluster::start(3, 1) else { return };
    let cfg = RemoteConfig { replicas: 1, read_deadline: Duration::from_secs(30), ..config(&cluster.url()) };
    let tier = Arc::new(RemoteTier::new(cfg, None).unwrap());
    assert!(matches!(*tier.writer.lock(), Some(Conn { link: Link::Cluster(_), .. })));
    let recs = Arc::new(records(96, 11));
    let slots = Arc::new(write(&*tier, &recs).unwrap());
    // The buckets spread over the masters.
    let holding = cluster
        .masters()
        .into_iter()
        .filter(|&i| {
            let mut c = cluster.nodes[i].con();
            tier.keys().iter().any(|k| redis::cmd("EXISTS").arg(k).query::<i64>(&mut c).is_ok_and(|n| n == 1))
        })
        .count();
    assert!(holding >= 2, "objects on {holding} master(s) only");
    for (s, (_, d)) in slots.iter().zip(recs.iter()) {
        assert_eq!(&read(&*tier, s).unwrap(), d);
    }
    // Readers under load while a master dies: its replica takes over (node timeout
    // 1 s), every read still comes back right, and writes go on after the failover.
    let readers: Vec<_> = (0..4)
        .map(|t| {
            let (tier, recs, slots) = (Arc::clone(&tier), Arc::clone(&recs), Arc::clone(&slots));
            std::thread::spawn(move || {
                for i in 0..300 {
                    let j = (i * 5 + t * 17) % slots.len();
                    assert_eq!(read(&*tier, &slots[j]).unwrap(), recs[j].1, "thread {t} read {i}");
                }
            })
        })
        .collect();
    let victim = cluster.masters()[0];
    cluster.nodes[victim].kill();
    for r in readers {
        r.join().unwrap();
    }
    let more = records(16, 12);
    // Without that demand, writes go on (once no slot is without a master: the
    // caller retries, as the store does, here for at most 30 s).
    let plain = RemoteTier::new(RemoteConfig { read_deadline: Duration::from_secs(30), ..config(&cluster.url()) }, None).unwrap();
    let mut written = None;
    for _ in 0..60 {
        match write(&plain, &more) {
            Ok(s) => {
                written = Some(s);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
    let written = written.expect("writes resume after the failover");
    // The promoted replica has no replica of its own: a batch that asks for one is
    // refused (the caller keeps it), and says why.
    let e = write(&*tier, &more).unwrap_err().to_string();
    let e = if e.contains("replicas acknowledged") { e } else { write(&*tier, &more).unwrap_err().to_string() };
    assert!(e.contains("replicas acknowledged"), "{e}");
    for (s, (_, d)) in written.iter().zip(&more) {
        assert_eq!(&read(&plain, s).unwrap(), d);
    }
    for (s, (_, d)) in slots.iter().zip(recs.iter()) {
        assert_eq!(&read(&*tier, s).unwrap(), d);
    }
}


#[test]
fn rediss_reaches_a_tls_server_whose_ca_is_given_and_refuses_one_it_does_not_trust() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = Server::start_tls(dir.path()) else { return };
    assert!(server.url().starts_with("rediss://"));
    let ca = dir.path().join("ca.pem");
    let tier = RemoteTier::new(RemoteConfig { ca_file: Some(ca), ..config(&server.url()) }, None).unwrap();
    let recs = records(6, 13);
    let slots = write(&tier, &recs).unwrap();
    for (s, (_, d)) in slots.iter().zip(&recs) {
        assert_eq!(&read(&tier, s).unwrap(), d);
    }
    // The system's roots do not include our test CA: the connection is refused.
    let e = RemoteTier::new(config(&server.url()), None).err().unwrap().to_string();
    assert!(e.to_lowercase().contains("certificate") || e.contains("UnknownIssuer"), "{e}");
    // Nor does a plain connection reach a TLS-only server.
    assert!(RemoteTier::new(config(&server.url().replace("rediss", "redis")), None).is_err());
}

#[test]
fn a_sequential_pass_is_read_ahead_and_a_random_one_is_not() {
    let Some(server) = Server::start(&[]) else { return };
    let tier = RemoteTier::new(config(&server.url()), None).unwrap();
    let recs = records(64, 14);
    let slots = write(&tier, &recs).unwrap();
    let stat = |n: &str| tier.extra_stats().iter().find(|s| s.0 == n).unwrap().1;
    // Random order first: nothing fetched ahead.
    let mut order: Vec<usize> = (0..32).collect();
    use rand::seq::SliceRandom;
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(3));
    use rand::SeedableRng;
    for &i in &order {
        assert_eq!(read(&tier, &slots[i]).unwrap(), recs[i].1);
    }
    let random_ahead = stat("remote_readahead_records");
    // Then in order: most reads are served from what was fetched ahead.
    for i in 32..64 {
        assert_eq!(read(&tier, &slots[i]).unwrap(), recs[i].1, "record {i}");
    }
    let hits = stat("remote_readahead_hits");
    assert!(random_ahead <= 8, "a random pass fetched {random_ahead} ahead");
    assert!(hits >= 20, "a sequential pass of 32 hit {hits} times");
    assert!(stat("remote_round_trips") < 64 - 20 + 8, "{:?}", tier.extra_stats());
}
