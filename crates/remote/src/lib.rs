//! uzswap-remote: the far-memory tier. When the compressed pool is full, the store's
//! coldest records go to a Redis or Valkey server, or a cluster of them, instead of
//! (or before) the local backing file; a fault brings them back.
//!
//! # What it is
//! [`RemoteTier`] implements the backing crate's [`Tier`]: `write_batch`, a
//! signal-safe `read_in_place` and `free_deferred`, `reap`. The client is the
//! `redis` crate (cluster routing, TLS with `rediss://`); nothing here speaks the
//! protocol by hand.
//!
//! - **Objects.** A record becomes object number `id` (a counter), stored as field
//!   `id` of one of [`BUCKETS`] hashes named `uzswap:<namespace>:<pid>:<random>:<id %
//!   BUCKETS>`. The random part is made per tier, so processes never share or see each
//!   other's objects; the hashes spread over a cluster's slots. Each hash carries an
//!   expiry ([`RemoteConfig::ttl`]), renewed by the reader thread every quarter of
//!   it, so a process killed with SIGKILL leaves nothing behind for longer than that.
//!   A tier that is dropped deletes its hashes; in a run's namespace ([`NAMESPACE_VAR`])
//!   it also lists its prefix in the run's index (`uzswap:<namespace>:tiers`) before
//!   it writes, so [`sweep`] deletes what the run's exited processes left, with no
//!   key scan (`uzswap run` does, every 10 s and at the end).
//! - **Sealed.** With [`RemoteConfig::encrypt`] (the default: the store is shared)
//!   an object is `nonce || AES-256-GCM(data) || tag` under a key made per tier
//!   and held only in memory, with the record's key, length and object number as
//!   associated data: a changed, moved or replayed object fails to open. Either way
//!   the slot's crc32c proves the plaintext, as for the file.
//! - **Nothing lost.** A batch counts as written when the server has acknowledged
//!   every object, and, with [`RemoteConfig::replicas`], when WAIT says that many
//!   replicas have them; until then the store keeps the records in its pool. A batch
//!   the remote store refuses (unreachable, too slow, out of memory, too few
//!   replicas) goes to the local file instead, when there is one ([`RemoteTier::new`]'s
//!   `fallback`): a counted *fallback*. With no file, the error goes back to the
//!   store, which keeps the records (the pool grows past its share; the runtime warns).
//! - **Reads.** A fault's read goes through the reader thread (module `reads`): the
//!   fault allocates nothing and waits at most [`RemoteConfig::read_deadline`]. An
//!   object that is missing (expired, or lost with a node that had no replica) or
//!   fails to open is an error, never wrong bytes: the runtime then fails that
//!   folio loudly (SIGBUS), as the kernel does on a swap read error. A read of the
//!   object after the last one read fetches the next few in the same round trip
//!   (module `ahead`), which the faults of a sequential pass then copy.
//! - **Connections.** The writer's (writes, frees, deletes) and the reader thread's,
//!   both made at the first write with [`RemoteConfig::lazy`]. Their sockets are told
//!   to [`RemoteConfig::on_socket`] (found by the addresses CLIENT INFO gives), so the
//!   runtime keeps the program from closing them; a cluster client's connections made
//!   after a topology change are told at the next reconnect only.
//!
//! Slots: a remote record's [`Slot`] offset is [`REMOTE`] | its object number; a
//! record in the fallback file has the file's offset (always below 2^63).
//!
//! # What it is not
//! Not a cache and not persistent: objects die with the process (or at their expiry).
//! Memory on a server that dies with no replica is gone; reading it raises SIGBUS.

mod ahead;
mod link;
mod reads;
#[doc(hidden)]
pub mod testing;

pub use link::Target;

use link::Link;
use reads::{Outcome, Reads};
use std::borrow::Cow;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use uzswap_sync::Mutex;
use std::time::{Duration, Instant};
use uzswap_backing::{record_crc, Aead, BackingError, BackingFile, BackingStats, Record, Slot, Tier};

/// Hashes per tier: objects spread over this many keys (and cluster slots).
pub const BUCKETS: u64 = 16;
/// The top bit of a slot's offset: the record is remote.
pub const REMOTE: u64 = 1 << 63;
/// The environment variable naming the run's namespace (set by `uzswap run`).
pub const NAMESPACE_VAR: &str = "UZSWAP_REMOTE_NAMESPACE";
/// Nonce and tag around a sealed object.
const SEAL_BYTES: usize = 8 + 16;

/// Called with each socket the tier opens, and with each before it closes.
pub type SocketHooks = (fn(RawFd), fn(RawFd));

/// How to reach and use the remote store.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub target: Target,
    /// Replicas that must have a batch before it counts as written (WAIT); 0: the master's word.
    pub replicas: u32,
    /// Seal objects (on by default).
    pub encrypt: bool,
    /// Expiry of this process's objects, renewed every quarter of it while it lives.
    pub ttl: Duration,
    /// Connecting, one round trip, and WAIT: each at most this long.
    pub timeout: Duration,
    /// A fault waits at most this long for its object (reconnecting meanwhile).
    pub read_deadline: Duration,
    /// For `rediss://`: the PEM file of the CA the server's certificate must chain to
    /// (None: the system's roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// Most bytes of objects this process keeps on the remote store.
    pub max_bytes: u64,
    /// Told every socket descriptor the tier opens (the runtime keeps them out of
    /// the program's reach), and each one before it is closed.
    pub on_socket: Option<SocketHooks>,
    /// Connect (and start the reader thread) at the first write instead of at once:
    /// a process that never writes back (a shell in a build) costs the server nothing.
    /// Off, `new` checks the target now.
    pub lazy: bool,
    /// Keys are `uzswap:<namespace>:<pid>:<random>:<bucket>`: `uzswap run` names one
    /// namespace per run ([`NAMESPACE_VAR`]) and [`sweep`]s it at the end.
    pub namespace: String,
}

impl RemoteConfig {
    /// A connection to the store, its sockets told to `on_socket`.
    fn connect(&self) -> Result<Conn, String> {
        let ca = match &self.ca_file {
            Some(f) => Some(std::fs::read(f).map_err(|e| format!("CA file {}: {e}", f.display()))?),
            None => None,
        };
        let mut link = Link::open(&self.target, self.timeout, ca.as_deref())?;
        link.set_timeouts(self.timeout)?;
        let mut fds = Vec::new();
        if let Some((on_socket, _)) = self.on_socket {
            fds = link::sockets_of(&link.endpoints());
            for &fd in &fds {
                on_socket(fd);
            }
        }
        Ok(Conn { link, fds, on_close: self.on_socket.map(|h| h.1) })
    }

    pub fn new(target: Target) -> RemoteConfig {
        RemoteConfig {
            target,
            replicas: 0,
            encrypt: true,
            ttl: Duration::from_secs(600),
            // WAIT gets half of it: a replica on a loaded machine may take a second.
            timeout: Duration::from_secs(5),
            read_deadline: Duration::from_secs(30),
            max_bytes: 64 << 30,
            ca_file: None,
            on_socket: None,
            lazy: false,
            namespace: std::env::var(NAMESPACE_VAR).ok().filter(|n| valid_namespace(n)).unwrap_or_else(|| "-".into()),
        }
    }
}

#[derive(Default)]
struct Counters {
    bytes_written: AtomicU64,
    records_written: AtomicU64,
    bytes_read: AtomicU64,
    records_read: AtomicU64,
    records_freed: AtomicU64,
    stored_bytes: AtomicU64,
    round_trips: AtomicU64,
    write_errors: AtomicU64,
    read_errors: AtomicU64,
    missing: AtomicU64,
    corrupt: AtomicU64,
    fallbacks: AtomicU64,
    reconnects: AtomicU64,
    /// Read latency, log2 buckets of microseconds (bucket i: [2^i, 2^(i+1)) µs).
    read_us: [AtomicU64; 24],
}

fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Relaxed);
}

/// State the tier and its reader thread share.
struct Shared {
    cfg: RemoteConfig,
    prefix: String,
    reads: Reads,
    ahead: ahead::Ahead,
    c: Counters,
}

impl Shared {
    fn bucket(&self, id: u64) -> String {
        format!("{}:{}", self.prefix, id % BUCKETS)
    }

    /// The set of the run's tiers' prefixes, where there is a run (`uzswap run`'s namespace).
    fn index(&self) -> Option<String> {
        (self.cfg.namespace != "-").then(|| index_key(&self.cfg.namespace))
    }

    fn expire_all(&self, link: &mut Conn) -> redis::RedisResult<Vec<redis::Value>> {
        let ms = self.cfg.ttl.as_millis() as u64;
        let keys = (0..BUCKETS).map(|b| self.bucket(b)).chain(self.index());
        let cmds = keys.map(|k| redis::cmd("PEXPIRE").arg(k).arg(ms).to_owned()).collect();
        bump(&self.c.round_trips, 1);
        link.run(cmds)
    }
}

/// A connection and the descriptors it holds, told to the caller's hook before
/// they close (so no registration outlives its descriptor).
struct Conn {
    link: Link,
    fds: Vec<RawFd>,
    on_close: Option<fn(RawFd)>,
}

impl std::ops::Deref for Conn {
    type Target = Link;
    fn deref(&self) -> &Link {
        &self.link
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(on_close) = self.on_close {
            for &fd in &self.fds {
                on_close(fd);
            }
        }
    }
}

#[derive(Default)]
struct BackOff {
    failures: u32,
    until: Option<Instant>,
}

/// The remote tier, with an optional local file behind it.
pub struct RemoteTier {
    shared: Arc<Shared>,
    /// The writer's connection (writes, frees, deletes); None after a failure, until
    /// the next write reconnects.
    writer: Mutex<Option<Conn>>,
    /// Started with the first connection (see [`RemoteConfig::lazy`]).
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
    fallback: Option<BackingFile>,
    cipher: Option<Aead>,
    next_id: AtomicU64,
    /// Remote slots given to `free_deferred`; capacity kept at least the number of
    /// live remote objects, so a push never allocates (as the backing file's queue).
    pending: Mutex<Vec<Slot>>,
    live: AtomicU64,
    /// With a fallback file: how long to leave the remote store alone after failures.
    back_off: Mutex<BackOff>,
    /// The process that made the tier: only it deletes the objects (a forked child
    /// inherits the value, not the objects).
    owner: u32,
}

impl RemoteTier {
    /// Connects (an unreachable server, a wrong password, a cluster asked of a
    /// server without one: an error now, before any data is at stake), and starts
    /// the reader thread.
    pub fn new(cfg: RemoteConfig, fallback: Option<BackingFile>) -> Result<RemoteTier, BackingError> {
        let err = |op, e: String| BackingError::Remote { op, detail: Cow::Owned(e) };
        if cfg.ttl < Duration::from_secs(4) {
            return Err(err("config", format!("ttl {:?} is under 4 s", cfg.ttl)));
        }
        let mut prefix = [0u8; 8];
        getrandom(&mut prefix).map_err(|e| err("getrandom", e))?;
        if !valid_namespace(&cfg.namespace) {
            return Err(err("config", format!("namespace {:?}: letters, digits, '-' and '_' only", cfg.namespace)));
        }
        let prefix = format!(
            "uzswap:{}:{}:{}",
            cfg.namespace,
            std::process::id(),
            prefix.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let shared = Arc::new(Shared { reads: Reads::new(cfg.encrypt), ahead: ahead::Ahead::new(), prefix, cfg, c: Counters::default() });
        let cipher = match shared.cfg.encrypt {
            true => Some(Aead::new().map_err(|e| err("seal", e.to_string()))?),
            false => None,
        };
        let tier = RemoteTier {
            shared,
            writer: Mutex::new(None),
            reader: Mutex::new(None),
            fallback,
            cipher,
            next_id: AtomicU64::new(1),
            pending: Mutex::new(Vec::new()),
            live: AtomicU64::new(0),
            back_off: Mutex::new(BackOff::default()),
            owner: std::process::id(),
        };
        if !tier.shared.cfg.lazy {
            tier.start().map_err(|e| err("connect", e))?;
        }
        Ok(tier)
    }

    /// Connects the writer and starts the reader thread with a connection of its own,
    /// if not done yet.
    fn start(&self) -> Result<(), String> {
        let mut reader = self.reader.lock();
        if reader.is_some() {
            return Ok(());
        }
        let mut w = self.writer.lock();
        if w.is_none() {
            *w = Some(self.shared.cfg.connect()?);
        }
        // In a run's namespace, the prefix goes in the run's index before any object
        // is written, so that a sweep finds every process's objects (see `sweep`).
        if let Some(index) = self.shared.index() {
            let ms = self.shared.cfg.ttl.as_millis() as u64;
            let cmds = vec![
                redis::cmd("SADD").arg(&index).arg(&self.shared.prefix).to_owned(),
                redis::cmd("PEXPIRE").arg(&index).arg(ms).to_owned(),
            ];
            let con = w.as_mut().expect("connected above");
            if let Err(e) = con.run(cmds) {
                *w = None;
                return Err(format!("SADD: {e}"));
            }
        }
        drop(w);
        let link = self.shared.cfg.connect()?;
        let s = Arc::clone(&self.shared);
        let t = std::thread::Builder::new()
            .name("uzswap-remote".into())
            .spawn(move || reader_loop(&s, link))
            .map_err(|e| format!("reader thread: {e}"))?;
        *reader = Some(t);
        Ok(())
    }

    /// The hash keys this tier's objects live under (for tests and `stat`).
    pub fn keys(&self) -> Vec<String> {
        (0..BUCKETS).map(|b| self.shared.bucket(b)).collect()
    }

    /// Runs `op` on the writer's connection, reconnecting first if the last one
    /// failed; a failure drops the connection.
    fn with_writer<T>(&self, op: impl FnOnce(&mut Conn) -> Result<T, String>) -> Result<T, String> {
        let mut w = self.writer.lock();
        if w.is_none() {
            bump(&self.shared.c.reconnects, 1);
            *w = Some(self.shared.cfg.connect()?);
        }
        let result = op(w.as_mut().expect("connected above"));
        if result.is_err() {
            *w = None;
        }
        result
    }

    fn write_remote(&self, records: &[Record<'_>]) -> Result<Vec<Slot>, BackingError> {
        let c = &self.shared.c;
        let total: u64 = records.iter().map(|r| r.data.len() as u64).sum();
        let stored = c.stored_bytes.load(Relaxed);
        if stored + total > self.shared.cfg.max_bytes {
            return Err(BackingError::Remote {
                op: "write",
                detail: Cow::Owned(format!("{} bytes stored, {total} more would pass the limit of {}", stored, self.shared.cfg.max_bytes)),
            });
        }
        self.start().map_err(|e| BackingError::Remote { op: "connect", detail: Cow::Owned(e) })?;
        self.reserve_pending(records.len());
        let mut slots = Vec::with_capacity(records.len());
        let mut touched = [false; BUCKETS as usize];
        for r in records {
            if r.data.is_empty() {
                return Err(BackingError::EmptyRecord { key: r.key });
            }
            let id = self.next_id.fetch_add(1, Relaxed);
            touched[(id % BUCKETS) as usize] = true;
            slots.push(Slot::from_parts(REMOTE | id, r.key, r.data.len() as u32, record_crc(r.key, r.data)));
        }
        // Sealed as they are sent: the server takes one record while the next is sealed.
        let ms = self.shared.cfg.ttl.as_millis() as u64;
        let cmds = records
            .iter()
            .zip(&slots)
            .map(|(r, s)| {
                let id = s.offset() & !REMOTE;
                redis::cmd("HSET").arg(self.shared.bucket(id)).arg(id).arg(&*self.seal(r.key, id, r.data)).to_owned()
            })
            .chain((0..BUCKETS).filter(|&b| touched[b as usize]).map(|b| redis::cmd("PEXPIRE").arg(self.shared.bucket(b)).arg(ms).to_owned()));
        let replicas = self.shared.cfg.replicas;
        let timeout = self.shared.cfg.timeout;
        let written = self.with_writer(|link| {
            bump(&c.round_trips, 1);
            let replies = link.run_streamed(cmds).map_err(|e| e.to_string())?;
            if let Some(bad) = replies.iter().find(|v| matches!(v, redis::Value::ServerError(_))) {
                return Err(format!("{bad:?}"));
            }
            if replicas > 0 {
                bump(&c.round_trips, 1);
                // Half the round trip's timeout, so the server answers before the socket gives up.
                let acked = link.wait(replicas, timeout / 2).map_err(|e| format!("WAIT: {e}"))?;
                if acked < replicas as i64 {
                    return Err(format!("WAIT: {acked} of {replicas} replicas acknowledged within {:?}", timeout / 2));
                }
            }
            Ok(())
        });
        if let Err(e) = written {
            bump(&c.write_errors, 1);
            // What did land is garbage now: delete it, or leave it to the exit's DEL.
            let _ = self.with_writer(|link| {
                let cmds = slots.iter().map(|s| redis::cmd("HDEL").arg(self.shared.bucket(s.offset() & !REMOTE)).arg(s.offset() & !REMOTE).to_owned()).collect();
                link.run(cmds).map(drop).map_err(|e| e.to_string())
            });
            return Err(BackingError::Remote { op: "write", detail: Cow::Owned(e) });
        }
        self.live.fetch_add(records.len() as u64, Relaxed);
        bump(&c.records_written, records.len() as u64);
        bump(&c.bytes_written, total);
        bump(&c.stored_bytes, total);
        Ok(slots)
    }

    /// The object for a record: sealed, or (unsealed) its bytes as they are.
    fn seal<'a>(&self, key: u64, id: u64, data: &'a [u8]) -> Cow<'a, [u8]> {
        let Some(cipher) = &self.cipher else { return Cow::Borrowed(data) };
        let mut v = Vec::with_capacity(data.len() + SEAL_BYTES);
        v.extend_from_slice(&[0; 8]);
        v.extend_from_slice(data);
        let (n, tag) = cipher.seal(&aad(key, data.len(), id), &mut v[8..]);
        v[..8].copy_from_slice(&n.to_le_bytes());
        v.extend_from_slice(&tag);
        Cow::Owned(v)
    }

    /// Grows the deferred-free queue to hold every live object and `more`, allocating
    /// outside its lock (a fault may wait for that lock).
    fn reserve_pending(&self, more: usize) {
        let need = self.live.load(Relaxed) as usize + more;
        if self.pending.lock().capacity() >= need {
            return;
        }
        let mut bigger = Vec::with_capacity(need.max(64) * 2);
        let mut p = self.pending.lock();
        if p.capacity() < need {
            bigger.extend(p.drain(..));
            std::mem::swap(&mut *p, &mut bigger);
        }
        drop(p);
        // The old (or unneeded) vector is freed here, outside the lock.
        drop(bigger);
    }

    fn read_remote(&self, slot: &Slot, buf: &mut [u8]) -> Result<(), BackingError> {
        let c = &self.shared.c;
        let id = slot.offset() & !REMOTE;
        let len = slot.data_len();
        let start = Instant::now();
        let deadline = start + self.shared.cfg.read_deadline;
        let fail = |detail: &'static str| BackingError::Remote { op: "read", detail: Cow::Borrowed(detail) };
        let sealed = self.cipher.is_some();
        let fetched_ahead = self.shared.ahead.take(id, |v| match reads::unpack(v, len, sealed) {
            Some((data, nonce, tag)) => {
                buf[..len].copy_from_slice(data);
                reads::Got { outcome: Outcome::Ok, nonce, tag }
            }
            None => reads::Got { outcome: Outcome::Size, nonce: 0, tag: [0; 16] },
        });
        let got = match fetched_ahead {
            Some(g) => g,
            None => loop {
                match self.shared.reads.fetch(id, &mut buf[..len], deadline) {
                    None => {
                        bump(&c.read_errors, 1);
                        return Err(fail("no answer from the remote store before the read deadline"));
                    }
                    // The reader reconnects; post again while the deadline allows.
                    Some(g) if g.outcome == Outcome::Link => continue,
                    Some(g) => break g,
                }
            },
        };
        let result = match got.outcome {
            Outcome::Ok => self.open(slot, id, got.nonce, &got.tag, &mut buf[..len]),
            Outcome::Missing => {
                bump(&c.missing, 1);
                Err(fail("the object is gone from the remote store (expired, or lost with its node)"))
            }
            _ => {
                bump(&c.corrupt, 1);
                Err(BackingError::Corrupt { slot: *slot, reason: "the remote object has the wrong length" })
            }
        };
        match &result {
            Ok(()) => {
                bump(&c.records_read, 1);
                bump(&c.bytes_read, len as u64);
                let us = start.elapsed().as_micros().max(1) as u64;
                let b = (63 - us.leading_zeros() as usize).min(c.read_us.len() - 1);
                bump(&c.read_us[b], 1);
            }
            Err(_) => buf[..len].fill(0),
        }
        result
    }

    /// Opens (when sealed) and verifies a record read into `data`. Allocation-free.
    fn open(&self, slot: &Slot, id: u64, n: u64, tag: &[u8; 16], data: &mut [u8]) -> Result<(), BackingError> {
        if let Some(cipher) = &self.cipher {
            if !cipher.open(n, &aad(slot.key(), data.len(), id), tag, data) {
                bump(&self.shared.c.corrupt, 1);
                return Err(BackingError::Corrupt { slot: *slot, reason: "the remote object fails to open (changed, moved or replayed)" });
            }
        }
        if record_crc(slot.key(), data) != slot.checksum() {
            bump(&self.shared.c.corrupt, 1);
            return Err(BackingError::Corrupt { slot: *slot, reason: "checksum mismatch" });
        }
        Ok(())
    }

    fn file(&self, slot: &Slot) -> Result<&BackingFile, BackingError> {
        self.fallback.as_ref().ok_or(BackingError::BadSlot { slot: *slot, reason: "a file slot, but there is no fallback file" })
    }

    /// Deletes every object of this tier (at exit). Only the process that made it.
    pub fn close(&self) {
        if std::process::id() != self.owner || self.reader.lock().is_none() {
            return;
        }
        let _ = self.with_writer(|link| {
            bump(&self.shared.c.round_trips, 1);
            let unlink = self.keys().into_iter().map(|k| redis::cmd("UNLINK").arg(k).to_owned());
            let unindex = self.shared.index().map(|i| redis::cmd("SREM").arg(i).arg(&self.shared.prefix).to_owned());
            link.run(unlink.chain(unindex).collect()).map(drop).map_err(|e| e.to_string())
        });
    }

    /// Latency percentile `p` (0-100) of remote reads, in microseconds (the top of its log2 bucket).
    fn read_percentile_us(&self, p: u64) -> u64 {
        let counts: Vec<u64> = self.shared.c.read_us.iter().map(|c| c.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let want = (total * p).div_ceil(100);
        let mut seen = 0;
        for (i, n) in counts.iter().enumerate() {
            seen += n;
            if seen >= want {
                return (2u64 << i) - 1;
            }
        }
        u64::MAX
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.close();
        self.shared.reads.stop();
        if let Some(t) = self.reader.lock().take() {
            let _ = t.join();
        }
    }
}

impl Tier for RemoteTier {
    fn write_batch(&self, records: &[Record<'_>]) -> Result<Vec<Slot>, BackingError> {
        let Some(file) = &self.fallback else { return self.write_remote(records) };
        // After a failure the file takes the batches for a while (1 s, doubling to
        // 32 s while the store keeps failing), so writeback does not wait out a
        // timeout per batch on a store that is down.
        let mut back_off = self.back_off.lock();
        if back_off.until.is_some_and(|t| Instant::now() < t) {
            bump(&self.shared.c.fallbacks, 1);
            return file.write_batch(records);
        }
        match self.write_remote(records) {
            Ok(slots) => {
                *back_off = BackOff::default();
                Ok(slots)
            }
            Err(_) => {
                back_off.failures = (back_off.failures + 1).min(6);
                back_off.until = Some(Instant::now() + Duration::from_secs(1 << (back_off.failures - 1)));
                bump(&self.shared.c.fallbacks, 1);
                file.write_batch(records)
            }
        }
    }

    fn read_in_place(&self, slot: &Slot, buf: &mut [u8]) -> Result<(), BackingError> {
        if slot.offset() & REMOTE == 0 {
            return self.file(slot)?.read_in_place(slot, buf);
        }
        if buf.len() < slot.data_len() {
            return Err(BackingError::BufferSize { expected: slot.data_len(), got: buf.len() });
        }
        self.read_remote(slot, buf)
    }

    /// A fallback file record, yes; a remote object needs the reader thread, which a
    /// child does not have.
    fn survives_fork(&self, slot: &Slot) -> bool {
        slot.offset() & REMOTE == 0
    }

    fn free(&self, slot: Slot) -> Result<(), BackingError> {
        self.free_deferred(slot)?;
        self.reap().map(drop)
    }

    fn free_deferred(&self, slot: Slot) -> Result<(), BackingError> {
        if slot.offset() & REMOTE == 0 {
            return self.file(&slot)?.free_deferred(slot);
        }
        let mut p = self.pending.lock();
        if p.len() == p.capacity() {
            return Err(BackingError::BadSlot { slot, reason: "freed twice (more frees queued than live objects)" });
        }
        p.push(slot);
        Ok(())
    }

    fn reap(&self) -> Result<usize, BackingError> {
        let mut n = self.fallback.as_ref().map_or(Ok(0), |f| f.reap())?;
        let mut slots = Vec::new();
        loop {
            // One at a time, so nothing allocates under the lock.
            let Some(s) = self.pending.lock().pop() else { break };
            slots.push(s);
        }
        if slots.is_empty() {
            return Ok(n);
        }
        n += slots.len();
        let bytes: u64 = slots.iter().map(|s| s.data_len() as u64).sum();
        self.live.fetch_sub(slots.len() as u64, Relaxed);
        bump(&self.shared.c.records_freed, slots.len() as u64);
        self.shared.c.stored_bytes.fetch_sub(bytes, Relaxed);
        let cmds = slots
            .iter()
            .map(|s| redis::cmd("HDEL").arg(self.shared.bucket(s.offset() & !REMOTE)).arg(s.offset() & !REMOTE).to_owned())
            .collect();
        // A delete that fails leaves garbage until the exit's UNLINK (or the expiry):
        // no data is at stake, so it is counted, not returned.
        if self.with_writer(|link| {
            bump(&self.shared.c.round_trips, 1);
            link.run(cmds).map(drop).map_err(|e| e.to_string())
        })
        .is_err()
        {
            bump(&self.shared.c.write_errors, 1);
        }
        Ok(n)
    }

    fn flush(&self) -> Result<(), BackingError> {
        self.fallback.as_ref().map_or(Ok(()), |f| f.flush())
    }

    fn stats(&self) -> BackingStats {
        self.fallback.as_ref().map(|f| f.stats()).unwrap_or_default()
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let c = &self.shared.c;
        let g = |a: &AtomicU64| a.load(Relaxed);
        vec![
            ("remote_stored_bytes", g(&c.stored_bytes)),
            ("remote_stored_records", self.live.load(Relaxed)),
            ("remote_bytes_written", g(&c.bytes_written)),
            ("remote_records_written", g(&c.records_written)),
            ("remote_bytes_read", g(&c.bytes_read)),
            ("remote_records_read", g(&c.records_read)),
            ("remote_round_trips", g(&c.round_trips)),
            ("remote_read_p50_us", self.read_percentile_us(50)),
            ("remote_read_p99_us", self.read_percentile_us(99)),
            ("remote_fallbacks", g(&c.fallbacks)),
            ("remote_write_errors", g(&c.write_errors)),
            ("remote_read_errors", g(&c.read_errors)),
            ("remote_missing", g(&c.missing)),
            ("remote_corrupt_records", g(&c.corrupt)),
            ("remote_reconnects", g(&c.reconnects)),
            ("remote_readahead_records", g(&self.shared.ahead.fetched)),
            ("remote_readahead_hits", g(&self.shared.ahead.hits)),
        ]
    }

    fn raw_fd(&self) -> Option<RawFd> {
        self.fallback.as_ref().and_then(|f| f.raw_fd())
    }

    fn describe(&self) -> String {
        let sealed = if self.cipher.is_some() { "sealed" } else { "not sealed" };
        let file = if self.fallback.is_some() { ", the local file behind it" } else { "" };
        format!("{} ({sealed}, {} replicas{file})", self.shared.cfg.target.shown(), self.shared.cfg.replicas)
    }
}

/// The reader thread: serves posted reads in pipelines and renews the expiry.
fn reader_loop(s: &Shared, first: Conn) {
    let mut link = Some(first);
    let mut taken = Vec::with_capacity(reads::SLOTS);
    let refresh_every = s.cfg.ttl / 4;
    let mut last_refresh = Instant::now();
    // The last object asked for, and the last fetched ahead (module `ahead`).
    let (mut last, mut ahead_to) = (0u64, 0u64);
    let mut ahead_ids: Vec<u64> = Vec::with_capacity(ahead::AHEAD as usize * reads::SLOTS);
    loop {
        let seen = s.reads.posted.load(std::sync::atomic::Ordering::Acquire);
        if s.reads.stop.load(Relaxed) != 0 {
            return;
        }
        taken.clear();
        s.reads.take_posted(&mut taken);
        let due = last_refresh.elapsed() >= refresh_every;
        if taken.is_empty() && !due {
            s.reads.sleep(seen, refresh_every.saturating_sub(last_refresh.elapsed()).max(Duration::from_millis(1)));
            continue;
        }
        if link.is_none() {
            bump(&s.c.reconnects, 1);
            link = s.cfg.connect().ok();
        }
        let Some(l) = link.as_mut() else {
            // Unreachable: the faults post again until their deadline; do not spin.
            for &(slot, _) in &taken {
                s.reads.finish(slot, None);
            }
            s.reads.sleep(seen, Duration::from_millis(50));
            continue;
        };
        if due {
            if s.expire_all(l).is_err() {
                link = None;
                continue;
            }
            last_refresh = Instant::now();
        }
        if taken.is_empty() {
            continue;
        }
        // A request for the object after the last one asked for (or one already
        // fetched ahead) is a sequential pass: fetch the next AHEAD with it.
        ahead_ids.clear();
        for &(_, id) in &taken {
            if id == last + 1 || (id > last && id <= ahead_to) {
                for next in (id + 1).max(ahead_to + 1)..=id + ahead::AHEAD {
                    if !taken.iter().any(|t| t.1 == next) && !s.ahead.has(next) {
                        ahead_ids.push(next);
                    }
                }
                ahead_to = ahead_to.max(id + ahead::AHEAD);
            }
            last = last.max(id);
        }
        let cmds = taken.iter().map(|t| t.1).chain(ahead_ids.iter().copied()).map(|id| redis::cmd("HGET").arg(s.bucket(id)).arg(id).to_owned()).collect();
        bump(&s.c.round_trips, 1);
        match l.run(cmds) {
            Ok(replies) => {
                for (&(slot, _), v) in taken.iter().zip(replies.iter()) {
                    match v {
                        redis::Value::BulkString(b) => s.reads.finish(slot, Some(Some(b))),
                        redis::Value::Nil => s.reads.finish(slot, Some(None)),
                        _ => s.reads.finish(slot, None),
                    }
                }
                // Objects fetched ahead that exist (a number past the last written is nil).
                for (&id, v) in ahead_ids.iter().zip(&replies[taken.len()..]) {
                    if let redis::Value::BulkString(b) = v {
                        s.ahead.put(id, b);
                    }
                }
            }
            Err(_) => {
                link = None;
                for &(slot, _) in &taken {
                    s.reads.finish(slot, None);
                }
            }
        }
    }
}

fn valid_namespace(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn index_key(namespace: &str) -> String {
    format!("uzswap:{namespace}:tiers")
}

/// Deletes the objects of the run's tiers (`cfg.namespace`, listed in the run's
/// index as they start) whose process is gone (`alive(pid)` false): processes that
/// exited or were killed, while the run goes on and at its end. Returns the
/// processes swept. No key scan: the index names them.
pub fn sweep(cfg: &RemoteConfig, alive: impl Fn(u32) -> bool) -> Result<u64, String> {
    let namespace = &cfg.namespace;
    if !valid_namespace(namespace) || namespace == "-" {
        return Err(format!("namespace {namespace:?}: letters, digits, '-' and '_' only, and not '-'"));
    }
    let mut link = cfg.connect()?;
    let index = index_key(namespace);
    let prefixes: Vec<String> = link.run(vec![redis::cmd("SMEMBERS").arg(&index).to_owned()]).and_then(|mut v| Ok(redis::from_redis_value(v.remove(0))?)).map_err(|e| format!("SMEMBERS: {e}"))?;
    let dead: Vec<String> = prefixes
        .into_iter()
        .filter(|p| p.split(':').nth(2).and_then(|pid| pid.parse::<u32>().ok()).is_some_and(|pid| !alive(pid)))
        .collect();
    let mut cmds = Vec::new();
    for p in &dead {
        cmds.extend((0..BUCKETS).map(|b| redis::cmd("UNLINK").arg(format!("{p}:{b}")).to_owned()));
        cmds.push(redis::cmd("SREM").arg(&index).arg(p).to_owned());
    }
    if !cmds.is_empty() {
        link.run(cmds).map_err(|e| format!("UNLINK: {e}"))?;
    }
    Ok(dead.len() as u64)
}

fn aad(key: u64, len: usize, id: u64) -> [u8; 20] {
    let mut a = [0u8; 20];
    a[..8].copy_from_slice(&key.to_le_bytes());
    a[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    a[12..].copy_from_slice(&id.to_le_bytes());
    a
}

fn getrandom(out: &mut [u8]) -> Result<(), String> {
    // SAFETY: getrandom writes at most `out.len()` bytes into `out`.
    let n = unsafe { libc::getrandom(out.as_mut_ptr().cast(), out.len(), 0) };
    if n == out.len() as isize {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

#[cfg(test)]
mod tests;
