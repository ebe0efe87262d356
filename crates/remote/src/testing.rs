//! Real servers for tests (this crate's and the CLI's): a redis-server started on a
//! free port, killed on drop. No mock stands in for one.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A redis-server of our own, killed on drop.
pub struct Server {
    child: Child,
    pub port: u16,
    /// A cluster node's directory (its nodes.conf), removed on drop.
    dir: Option<std::path::PathBuf>,
    /// A TLS server's CA certificate (PEM): clients must use `rediss://` and trust it.
    pub ca: Option<Vec<u8>>,
}

impl Server {
    /// None (after printing SKIP) where redis-server is not installed.
    pub fn start(extra: &[&str]) -> Option<Server> {
        Self::start_in(None, extra)
    }

    /// A server that speaks only TLS, with a certificate for 127.0.0.1 signed by a CA
    /// made for it, written to `dir/ca.pem` (None, after SKIP, without openssl).
    pub fn start_tls(dir: &std::path::Path) -> Option<Server> {
        let ssl = |args: &[&str]| Command::new("openssl").args(args).current_dir(dir).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        let made = ssl(&["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=uzswap test CA"])
            && ssl(&["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"])
            && std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").is_ok()
            && ssl(&["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf"]);
        if !made {
            println!("SKIP: openssl could not make a test certificate");
            return None;
        }
        let path = |f: &str| dir.join(f).display().to_string();
        let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
        let tls_port = free_port().to_string();
        let args = ["--port", "0", "--tls-port", &tls_port, "--tls-cert-file", &cert, "--tls-key-file", &key, "--tls-ca-cert-file", &ca, "--tls-auth-clients", "no"];
        let s = Self::start_on(tls_port.parse().unwrap(), None, &args, Some(std::fs::read(dir.join("ca.pem")).unwrap()))?;
        s.wait_ready();
        Some(s)
    }

    fn start_in(dir: Option<std::path::PathBuf>, extra: &[&str]) -> Option<Server> {
        let s = Self::start_on(free_port(), dir, extra, None)?;
        s.wait_ready();
        Some(s)
    }

    /// Starts redis-server listening on `port` (for a TLS server, `extra` moves the
    /// plain port to 0 and `port` is its TLS port).
    fn start_on(port: u16, dir: Option<std::path::PathBuf>, extra: &[&str], ca: Option<Vec<u8>>) -> Option<Server> {
        if Command::new("redis-server").arg("--version").stdout(Stdio::null()).status().is_err() {
            println!("SKIP: redis-server is not installed");
            return None;
        }
        let dir = dir.map(|d| d.join(port.to_string()));
        if let Some(d) = &dir {
            std::fs::create_dir_all(d).unwrap();
        }
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            // With no saving and no append-only file, a plain server writes nothing there.
            .arg("--dir")
            .arg(dir.clone().unwrap_or_else(std::env::temp_dir))
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        Some(Server { child, port, dir, ca })
    }

    fn wait_ready(&self) {
        // Readiness is polled (connect until it answers), bounded: a server that never
        // comes up fails the test instead of hanging it.
        for _ in 0..500 {
            if let Ok(mut c) = self.client().get_connection() {
                let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut c);
                if pong.is_ok() || pong.as_ref().is_err_and(|e| e.to_string().contains("NOAUTH")) {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server on port {} did not come up", self.port);
    }

    pub fn url(&self) -> String {
        let scheme = if self.ca.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    fn client(&self) -> redis::Client {
        match &self.ca {
            Some(ca) => redis::Client::build_with_tls(self.url(), redis::TlsCertificates { client_tls: None, root_cert: Some(ca.clone()) }),
            None => redis::Client::open(self.url()),
        }
        .unwrap()
    }

    pub fn con(&self) -> redis::Connection {
        self.client().get_connection().unwrap()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A Redis Cluster on this machine: `masters` masters with `replicas` replicas each,
/// made with `redis-cli --cluster create`.
pub struct Cluster {
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// None (after printing SKIP) where redis-server or redis-cli is missing.
    pub fn start(masters: usize, replicas: usize) -> Option<Cluster> {
        if Command::new("redis-cli").arg("--version").stdout(Stdio::null()).status().is_err() {
            println!("SKIP: redis-cli is not installed");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("uzswap-cluster-{}-{}", std::process::id(), free_port()));
        let args = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf"];
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            nodes.push(Server::start_in(Some(dir.clone()), &args)?);
        }
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let c = Cluster { nodes };
        // Bounded poll until every node sees the whole cluster (and every replica is attached).
        for _ in 0..1000 {
            if c.nodes.iter().all(|n| {
                let mut con = n.con();
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut con).unwrap_or_default();
                let repl: String = redis::cmd("INFO").arg("replication").query(&mut con).unwrap_or_default();
                info.contains("cluster_state:ok")
                    && (repl.contains("role:slave") && repl.contains("master_link_status:up")
                        || repl.contains("role:master") && repl.contains(&format!("connected_slaves:{replicas}")))
            }) {
                return Some(c);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the cluster did not come up");
    }

    /// The cluster's URL, naming every node.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis://{}", hosts.join(","))
    }

    /// The index of every node that is a master now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                let info: String = redis::cmd("INFO").arg("replication").query(&mut self.nodes[i].con()).unwrap_or_default();
                info.contains("role:master")
            })
            .collect()
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

