//! `uzswap run --writeback redis://...`: a Python program's memory written back to a
//! real redis-server (started here; SKIP where it is not installed) and read back,
//! on both fault paths, as root and as an ordinary user; a store that refuses
//! writes sends them to the local file; nothing is left on the server after the run.

mod run_support;
use run_support::*;
use uzswap_remote::testing::Server;

/// One test of this file at a time: each runs a program and servers, and two cores
/// shared by several would starve a replica's WAIT (a failed batch is then a fallback).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn remote_counter(v: &serde_json::Value, name: &str) -> u64 {
    v["remote"][name].as_u64().unwrap_or_else(|| panic!("no remote.{name} in {v}"))
}

fn dbsize(server: &Server) -> i64 {
    redis::cmd("DBSIZE").query(&mut server.con()).unwrap()
}

/// fill.py's 384 MiB (about 48 MiB compressed) under a 48 MiB budget: the pool's
/// half of it cannot hold the lot, so most goes to the server and comes back.
fn fill_through(server: &Server, s: &Scratch, fault_path: &str, extra: &[&str], as_nobody: bool) -> serde_json::Value {
    let stats = s.0.join(format!("stats-{fault_path}.jsonl"));
    let url = server.url();
    let fill = examples().join("fill.py");
    let mut args = vec!["run", "--budget", "48M", "--fault-path", fault_path, "--writeback", &url, "--stats", stats.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "python3", fill.to_str().unwrap(), "384", "16", "2"]);
    let o = if as_nobody {
        give_to_nobody(s);
        uzswap_command_via(s, &AS_NOBODY, &args).output().unwrap()
    } else {
        uzswap(s, &args)
    };
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all bytes correct"), "{}", text(&o));
    let lines = stats_lines(&stats);
    let v = assert_swapped(&lines, "fill.py").clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("written back to redis://127.0.0.1:"), "{}", text(&o));
    // What the run left on the server was swept (or deleted) by its end.
    assert_eq!(dbsize(server), 0, "{}", text(&o));
    v
}

#[test]
fn python_memory_goes_to_redis_and_comes_back_on_both_fault_paths() {
    let _serial = serial();
    let Some(server) = Server::start(&[]) else { return };
    let s = Scratch::new("remote");
    for fault_path in ["thread", "sigbus"] {
        let v = fill_through(&server, &s, fault_path, &["--writeback-dir", "none"], false);
        assert!(remote_counter(&v, "remote_records_written") > 0, "{fault_path}: {v}");
        assert!(remote_counter(&v, "remote_records_read") > 0, "{fault_path}: {v}");
        for bad in ["remote_read_errors", "remote_corrupt_records", "remote_missing", "remote_write_errors", "remote_fallbacks"] {
            assert_eq!(remote_counter(&v, bad), 0, "{fault_path} {bad}: {v}");
        }
        assert_eq!(v["store"]["reject_reclaim_fail"].as_u64(), Some(0), "{v}");
    }
}

#[test]
fn an_ordinary_user_writes_back_to_redis() {
    let _serial = serial();
    if !can_become_nobody() {
        return;
    }
    let Some(server) = Server::start(&[]) else { return };
    let s = Scratch::new("remote-nobody");
    let v = fill_through(&server, &s, "thread", &["--writeback-dir", "none"], true);
    assert!(remote_counter(&v, "remote_records_read") > 0, "{v}");
}

#[test]
fn a_store_that_refuses_writes_sends_them_to_the_file() {
    let _serial = serial();
    // 1 MiB of room and no eviction: most writes fail with OOM.
    let Some(server) = Server::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) else { return };
    let s = Scratch::new("remote-full");
    let dir = s.0.join("wb");
    std::fs::create_dir_all(&dir).unwrap();
    let v = fill_through(&server, &s, "thread", &["--writeback-dir", dir.to_str().unwrap()], false);
    assert!(remote_counter(&v, "remote_fallbacks") > 0, "{v}");
    assert!(v["store"]["pswpin"].as_u64().unwrap() > 0, "{v}");
}

#[test]
fn an_unreachable_store_or_a_wrong_password_stops_before_the_program() {
    let _serial = serial();
    let Some(server) = Server::start(&["--requirepass", "sesame"]) else { return };
    let s = Scratch::new("remote-bad");
    let closed = format!("redis://127.0.0.1:{}", uzswap_remote::testing::free_port());
    let wrong = format!("redis://:wrong@127.0.0.1:{}", server.port);
    for url in [closed.as_str(), wrong.as_str(), "redis://nowhere", "http://127.0.0.1:1"] {
        let marker = s.0.join("ran");
        let o = uzswap(&s, &["run", "--budget", "32M", "--writeback", url, "--", "touch", marker.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{url}: {}", text(&o));
        assert!(!marker.exists(), "{url}: the program ran");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("uzswap run:") && !err.contains("sesame"), "{url}: {}", text(&o));
    }
}

/// A cluster master is killed while the program runs with most of its memory on the
/// cluster (every batch on a replica): its replica takes over, every byte comes
/// back right, and writeback goes on to the file while the promoted master has no
/// replica of its own.
#[test]
fn a_cluster_master_killed_under_load_loses_no_byte() {
    let _serial = serial();
    let Some(mut cluster) = uzswap_remote::testing::Cluster::start(3, 1) else { return };
    let s = Scratch::new("remote-failover");
    let stats = s.0.join("stats.jsonl");
    let dir = s.0.join("wb");
    std::fs::create_dir_all(&dir).unwrap();
    let url = cluster.url();
    let fill = examples().join("fill.py");
    let args = [
        "run", "--budget", "48M", "--writeback", &url, "--writeback-replicas", "1", "--writeback-dir", dir.to_str().unwrap(),
        "--stats", stats.to_str().unwrap(), "--", "python3", fill.to_str().unwrap(), "384", "16", "3",
    ];
    let child = uzswap_command(&s, &args).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    // Once the program's memory is on the cluster (its live stats say records were
    // written: a refused batch's leftovers do not count), kill a master holding some.
    let live = s.0.join("live");
    let written = || {
        std::fs::read_dir(&live).into_iter().flatten().flatten().any(|f| {
            let v: serde_json::Value = std::fs::read_to_string(f.path()).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
            v["remote"]["remote_records_written"].as_u64().unwrap_or(0) >= 64
        })
    };
    let records_on = |i: usize| {
        let mut c = cluster.nodes[i].con();
        let keys: Vec<String> = redis::cmd("KEYS").arg("uzswap:*").query(&mut c).unwrap_or_default();
        keys.iter().map(|k| redis::cmd("HLEN").arg(k).query::<i64>(&mut c).unwrap_or(0)).sum::<i64>()
    };
    let mut victim = None;
    for _ in 0..3000 {
        if written() {
            victim = cluster.masters().into_iter().max_by_key(|&i| records_on(i)).filter(|&i| records_on(i) > 0);
            if victim.is_some() {
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let victim = victim.expect("nothing reached the cluster");
    cluster.nodes[victim].kill();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all bytes correct"), "{}", text(&o));
    let lines = stats_lines(&stats);
    let v = assert_swapped(&lines, "fill.py");
    assert!(remote_counter(v, "remote_records_read") > 0, "{v}");
    for bad in ["remote_corrupt_records", "remote_missing"] {
        assert_eq!(remote_counter(v, bad), 0, "{bad}: {v}");
    }
}

/// The remote objects of a process that exits go while the run goes on (the sweep
/// every 10 s), not only when `uzswap run` ends.
#[test]
fn an_exited_process_objects_are_swept_while_the_run_goes_on() {
    let _serial = serial();
    let Some(server) = Server::start(&[]) else { return };
    let s = Scratch::new("remote-sweep");
    let url = server.url();
    let fill = examples().join("fill.py");
    let script = format!("python3 {} 384 16 1 && sleep 60", fill.display());
    let args = ["run", "--budget", "48M", "--writeback", &url, "--writeback-dir", "none", "--stats", "none", "--", "sh", "-c", &script];
    let mut child = uzswap_command(&s, &args).stdout(std::process::Stdio::null()).spawn().unwrap();
    let (mut seen, mut swept) = (false, false);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none() {
        let n = dbsize(&server);
        seen |= n > 0;
        if seen && n == 0 {
            swept = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen, "nothing reached the server");
    assert!(swept && still_running, "the exited process's objects stayed while the run went on");
}
