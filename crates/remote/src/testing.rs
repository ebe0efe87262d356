//! Real servers for tests (this crate's and the CLI's): a redis-server started on a
//! free port, killed on drop. No mock stands in for one.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A redis-server of our own, killed on drop.
pub struct Server {
    child: Child,
    pub port: u16,
}

impl Server {
    /// None (after printing SKIP) where redis-server is not installed.
    pub fn start(extra: &[&str]) -> Option<Server> {
        if Command::new("redis-server").arg("--version").stdout(Stdio::null()).status().is_err() {
            println!("SKIP: redis-server is not installed");
            return None;
        }
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            // With no saving and no append-only file, the server writes nothing there.
            .arg("--dir")
            .arg(std::env::temp_dir())
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        let s = Server { child, port };
        s.wait_ready();
        Some(s)
    }

    fn wait_ready(&self) {
        // Readiness is polled (connect until it answers), bounded: a server that never
        // comes up fails the test instead of hanging it.
        for _ in 0..500 {
            if let Ok(mut c) = redis::Client::open(self.url().as_str()).unwrap().get_connection() {
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
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn con(&self) -> redis::Connection {
        redis::Client::open(self.url().as_str()).unwrap().get_connection().unwrap()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

