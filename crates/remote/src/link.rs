//! One connection to the remote store, a single server or a cluster, through the
//! `redis` crate: commands in pipelines, WAIT for replicas, and the descriptors the
//! connection holds found and handed to the caller (the runtime keeps them out of
//! the program's reach, as it does its file's).

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{AggregateOp, MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{Client, Cmd, Connection, RedisResult, Value};
use std::os::fd::RawFd;
use std::time::Duration;

/// Where the remote store is, parsed from `redis://[user:pass@]host:port[,host:port...]`
/// (`rediss://` for TLS).
#[derive(Clone, PartialEq, Eq)]
pub struct Target {
    /// One URL per node, credentials and scheme repeated on each.
    pub urls: Vec<String>,
    /// Several nodes were named: the caller asked for a cluster.
    pub cluster_asked: bool,
    /// As given (credentials included: for passing on, never for showing).
    pub text: String,
}

/// Without the credentials.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Target({})", self.shown())
    }
}

impl Target {
    pub fn parse(text: &str) -> Result<Target, String> {
        let (scheme, rest) = text
            .split_once("://")
            .filter(|(s, _)| *s == "redis" || *s == "rediss")
            .ok_or_else(|| format!("{text:?}: expected redis://[user:pass@]host:port[,host:port...] or rediss://..."))?;
        let (auth, hosts) = match rest.rsplit_once('@') {
            Some((a, h)) => (format!("{a}@"), h),
            None => (String::new(), rest),
        };
        // A database number or the crate's `#insecure` after the hosts goes on every URL.
        let (hosts, suffix) = hosts.split_at(hosts.find('/').unwrap_or(hosts.len()));
        let suffix = if suffix == "/" { "" } else { suffix };
        let hosts: Vec<&str> = hosts.split(',').collect();
        let mut urls = Vec::with_capacity(hosts.len());
        for host in &hosts {
            let (name, port) = host.rsplit_once(':').ok_or_else(|| format!("{host:?}: expected host:port"))?;
            if name.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("{host:?}: expected host:port with a port from 1 to 65535"));
            }
            let url = format!("{scheme}://{auth}{host}{suffix}");
            // The crate's own parser has the last word (escapes, credentials).
            redis::Client::open(url.as_str()).map_err(|e| format!("{host:?}: {e}"))?;
            urls.push(url);
        }
        Ok(Target { cluster_asked: urls.len() > 1, urls, text: text.to_string() })
    }

    /// The URLs without credentials, for messages.
    pub fn shown(&self) -> String {
        self.urls
            .iter()
            .map(|u| match (u.split_once("://"), u.rsplit_once('@')) {
                (Some((s, _)), Some((_, h))) => format!("{s}://{h}"),
                _ => u.clone(),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

pub(crate) enum Link {
    Single(Box<Connection>),
    Cluster(Box<ClusterConnection>),
}

impl Link {
    /// Connects, within `timeout` per step. One node that says it is in a cluster
    /// is reached as a cluster; several nodes must be one.
    /// `ca`: the PEM certificate(s) a TLS server's must chain to (None: the system's roots).
    pub(crate) fn open(target: &Target, timeout: Duration, ca: Option<&[u8]>) -> Result<Link, String> {
        let certs = || redis::TlsCertificates { client_tls: None, root_cert: ca.map(<[u8]>::to_vec) };
        // The first node that answers says what it is (a cluster's other nodes may be down).
        let mut errors = Vec::new();
        let mut reached = None;
        for (i, url) in target.urls.iter().enumerate() {
            let client = match ca {
                Some(_) => Client::build_with_tls(url.as_str(), certs()),
                None => Client::open(url.as_str()),
            }
            .map_err(|e| e.to_string())?;
            match client.get_connection_with_timeout(timeout) {
                Ok(c) => {
                    reached = Some((i, c));
                    break;
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        let Some((node, mut probe)) = reached else {
            return Err(format!("{}: {}", target.shown(), errors.join("; ")));
        };
        set_timeouts_single(&probe, timeout)?;
        let info: String = redis::cmd("INFO").arg("cluster").query(&mut probe).map_err(|e| format!("INFO: {e}"))?;
        let clustered = info.lines().any(|l| l.trim() == "cluster_enabled:1");
        if !clustered {
            if target.cluster_asked {
                return Err(format!(
                    "{} names several nodes, but {} is not in a cluster (cluster_enabled is not 1)",
                    target.shown(),
                    target.urls[node].rsplit_once('@').map_or(target.urls[node].as_str(), |(_, h)| h)
                ));
            }
            return Ok(Link::Single(Box::new(probe)));
        }
        drop(probe);
        let mut builder = ClusterClient::builder(target.urls.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout);
        if ca.is_some() {
            builder = builder.certs(certs());
        }
        let client = builder.build().map_err(|e| e.to_string())?;
        let con = client.get_connection().map_err(|e| format!("cluster {}: {e}", target.shown()))?;
        Ok(Link::Cluster(Box::new(con)))
    }

    /// Runs `cmds` as one pipeline (one round trip per node) and returns their replies.
    pub(crate) fn run(&mut self, cmds: Vec<Cmd>) -> RedisResult<Vec<Value>> {
        match self {
            Link::Single(con) => {
                let mut p = redis::pipe();
                for c in cmds {
                    p.add_command(c);
                }
                p.query(con)
            }
            Link::Cluster(con) => {
                let mut p = redis::cluster::cluster_pipe();
                for c in cmds {
                    p.add_command(c);
                }
                p.query(con)
            }
        }
    }

    /// As `run`, sending each command as soon as the iterator makes it (a single
    /// server; a cluster's pipeline is sent whole), so making the next overlaps the
    /// server's work on this one.
    pub(crate) fn run_streamed(&mut self, cmds: impl Iterator<Item = Cmd>) -> RedisResult<Vec<Value>> {
        match self {
            Link::Single(con) => {
                let mut packed = Vec::new();
                let mut sent = 0;
                for c in cmds {
                    packed.clear();
                    c.write_packed_command(&mut packed);
                    con.send_packed_command(&packed)?;
                    sent += 1;
                }
                // An error reply ends it: the caller drops the connection, with the
                // replies it did not read.
                (0..sent).map(|_| con.recv_response()).collect()
            }
            Link::Cluster(_) => self.run(cmds.collect()),
        }
    }

    /// WAIT: how many replicas (at least, over every master) have this
    /// connection's writes, after at most `timeout`.
    pub(crate) fn wait(&mut self, replicas: u32, timeout: Duration) -> RedisResult<i64> {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas).arg(timeout.as_millis() as u64);
        match self {
            Link::Single(con) => cmd.query(con),
            Link::Cluster(con) => {
                let route = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::Aggregate(AggregateOp::Min)),
                ));
                match con.route_command(&cmd, route)? {
                    Value::Int(n) => Ok(n),
                    other => Err(redis::RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "WAIT",
                        format!("{other:?}"),
                    ))),
                }
            }
        }
    }

    pub(crate) fn set_timeouts(&self, timeout: Duration) -> Result<(), String> {
        match self {
            Link::Single(c) => set_timeouts_single(c, timeout),
            Link::Cluster(c) => {
                c.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
                c.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())
            }
        }
    }

    /// Each of this link's connections as (our `ip:port`, the server's), as the
    /// servers see them (CLIENT INFO's addr and laddr), to find their descriptors by.
    pub(crate) fn endpoints(&mut self) -> Vec<(String, String)> {
        let cmd = redis::cmd("CLIENT").arg("INFO").to_owned();
        let infos: Vec<String> = match self {
            Link::Single(c) => cmd.query::<String>(c).into_iter().collect(),
            Link::Cluster(c) => {
                match c.route_command(&cmd, RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None))) {
                    Ok(Value::Map(m)) => m.into_iter().filter_map(|(_, v)| redis::from_redis_value(v).ok()).collect(),
                    Ok(v) => redis::from_redis_value::<String>(v).into_iter().collect(),
                    Err(_) => Vec::new(),
                }
            }
        };
        infos
            .iter()
            .filter_map(|i| {
                let field = |name: &str| i.split_whitespace().find_map(|f| f.strip_prefix(name)).map(str::to_string);
                Some((field("addr=")?, field("laddr=")?))
            })
            .collect()
    }
}

fn set_timeouts_single(c: &Connection, timeout: Duration) -> Result<(), String> {
    c.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    c.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())
}

/// The socket descriptors of this process whose (local, peer) addresses are one of
/// `endpoints` ("ip:port" each): a TCP connection's pair is unique on the machine,
/// so this finds exactly the link's descriptors, whatever else the program has open.
pub(crate) fn sockets_of(endpoints: &[(String, String)]) -> Vec<RawFd> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) else { continue };
        if let (Some(local), Some(peer)) = (sock_addr(fd, libc::getsockname), sock_addr(fd, libc::getpeername)) {
            if endpoints.iter().any(|(l, p)| *l == local && *p == peer) {
                out.push(fd);
            }
        }
    }
    out
}

type GetName = unsafe extern "C" fn(libc::c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> libc::c_int;

/// getsockname or getpeername of `fd` as "ip:port".
fn sock_addr(fd: RawFd, get: GetName) -> Option<String> {
    // SAFETY: an all-zero sockaddr_storage is valid; getsockname writes at most `len` bytes.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: as above; a descriptor that is not a socket is an error, nothing more.
    if unsafe { get(fd, &mut ss as *mut _ as *mut libc::sockaddr, &mut len) } != 0 {
        return None;
    }
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: &libc::sockaddr_in = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(format!("{ip}:{}", u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: &libc::sockaddr_in6 = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(match ip.to_ipv4_mapped() {
                Some(v4) => format!("{v4}:{}", u16::from_be(a.sin6_port)),
                None => format!("[{ip}]:{}", u16::from_be(a.sin6_port)),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let t = Target::parse("redis://u:p@127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert_eq!(t.urls, ["redis://u:p@127.0.0.1:7000", "redis://u:p@127.0.0.1:7001"]);
        assert!(t.cluster_asked);
        assert_eq!(t.shown(), "redis://127.0.0.1:7000,redis://127.0.0.1:7001");
        assert!(!Target::parse("rediss://h:6379").unwrap().cluster_asked);
        // A database number goes on every node's URL.
        assert_eq!(Target::parse("redis://a:1,b:2/3").unwrap().urls, ["redis://a:1/3", "redis://b:2/3"]);
        for bad in ["http://h:1", "redis://h", "redis://h:99999", "redis://:1", "h:1"] {
            let e = Target::parse(bad).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }
}
