//! A real etcd cluster on loopback, for the etcd scenario of `taskgate
//! bench` and the etcd store's tests: one to five members of etcd 3.4+
//! (Debian's `etcd-server`; `etcdctl` from `etcd-client` finds the leader
//! and compacts).

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// One member: its name, client and peer URLs, and its process while it
/// runs.
pub struct Member {
    pub name: String,
    pub client: String,
    peer: String,
    child: Option<Child>,
}

/// A cluster of etcd members on loopback, each a child process killed on
/// drop, with data in a temporary directory.
pub struct Cluster {
    pub members: Vec<Member>,
    dir: super::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// A port the OS picks, free when this returns (the member binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How long a cluster may take to start: elections take a second or two,
/// a loaded machine many times that.
const START_WITHIN: Duration = Duration::from_secs(90);

/// Why a cluster is not healthy: a message naming the members at fault,
/// with their logs' last lines.
struct Unhealthy {
    message: String,
    /// A member exited because another process took one of its ports
    /// between their pick and its bind.
    port_taken: bool,
}

impl Cluster {
    /// Starts `n` members and waits until every one is healthy (it has a
    /// leader and a quorum). A cluster whose member found a port taken is
    /// started again on other ports, a few times at most.
    pub fn start(n: usize) -> Cluster {
        const TRIES: usize = 3;
        let mut taken = Vec::new();
        for _ in 0..TRIES {
            let mut cluster = Self::launch(n);
            match cluster.until_healthy(START_WITHIN) {
                Ok(()) => return cluster,
                Err(e) if e.port_taken => taken.push(e.message),
                Err(e) => panic!("{}", e.message),
            }
        }
        panic!(
            "the etcd cluster found a port taken in each of {TRIES} starts:\n{}",
            taken.join("\n")
        );
    }

    /// Spawns `n` members on ports picked now, in a new data directory.
    fn launch(n: usize) -> Cluster {
        let dir = super::TempDir::new("etcd").unwrap();
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: format!("http://127.0.0.1:{}", free_port()),
                peer: format!("http://127.0.0.1:{}", free_port()),
                child: None,
            })
            .collect();
        let mut cluster = Cluster { members, dir };
        for i in 0..n {
            cluster.spawn(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect();
        let log = std::fs::File::create(self.log_path(i)).unwrap();
        let m = &self.members[i];
        let child = Command::new("etcd")
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(self.dir.path().join(&m.name))
            .args(["--listen-client-urls", &m.client])
            .args(["--advertise-client-urls", &m.client])
            .args(["--listen-peer-urls", &m.peer])
            .args(["--initial-advertise-peer-urls", &m.peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "taskgate-test"])
            // Elections in a test's time: 50 ms heartbeats, 500 ms
            // election timeout, and pre-vote so a member that comes back
            // does not depose a working leader.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .arg("--pre-vote=true")
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.members[i].child = Some(child);
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client.clone()).collect()
    }

    /// Whether member `i` says it is healthy (it has a leader and a
    /// quorum).
    pub fn healthy(&self, i: usize) -> bool {
        self.health(i).is_ok()
    }

    /// `healthy`, or what member `i`'s `/health` answered, or why it did
    /// not.
    fn health(&self, i: usize) -> Result<(), String> {
        let addr: std::net::SocketAddr = self.members[i]
            .client
            .trim_start_matches("http://")
            .parse()
            .unwrap();
        let get = || -> std::io::Result<String> {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n")?;
            let mut answer = String::new();
            s.read_to_string(&mut answer)?;
            Ok(answer)
        };
        match get() {
            Ok(a) if a.contains("\"health\":\"true\"") => Ok(()),
            Ok(a) => Err(format!("GET /health answered {:?}", a.lines().last())),
            Err(e) => Err(format!("GET /health failed: {e}")),
        }
    }

    /// Waits until every running member is healthy; panics past `within`
    /// or as soon as a member exits, naming it, with its log's last lines.
    pub fn wait_healthy(&mut self, within: Duration) {
        if let Err(e) = self.until_healthy(within) {
            panic!("{}", e.message);
        }
    }

    fn until_healthy(&mut self, within: Duration) -> Result<(), Unhealthy> {
        let until = Instant::now() + within;
        let running: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .collect();
        loop {
            for &i in &running {
                let child = self.members[i].child.as_mut().expect("running");
                if let Ok(Some(status)) = child.try_wait() {
                    self.members[i].child = None;
                    let tail = self.log_tail(i);
                    return Err(Unhealthy {
                        message: format!(
                            "etcd member {} exited ({status}) before the cluster was healthy; \
                             its log ends:\n{tail}",
                            self.members[i].name
                        ),
                        port_taken: tail.contains("address already in use"),
                    });
                }
            }
            let unhealthy: Vec<(usize, String)> = running
                .iter()
                .filter_map(|&i| self.health(i).err().map(|why| (i, why)))
                .collect();
            if unhealthy.is_empty() {
                return Ok(());
            }
            if Instant::now() >= until {
                let named: Vec<String> = unhealthy
                    .iter()
                    .map(|(i, why)| {
                        let m = &self.members[*i];
                        format!(
                            "etcd member {} ({}): {why}; its log ends:\n{}",
                            m.name,
                            m.client,
                            self.log_tail(*i)
                        )
                    })
                    .collect();
                return Err(Unhealthy {
                    message: format!(
                        "the etcd cluster was not healthy within {within:?}:\n{}",
                        named.join("\n")
                    ),
                    port_taken: false,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last lines member `i` logged.
    fn log_tail(&self, i: usize) -> String {
        const LINES: usize = 20;
        let log = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(LINES)..].join("\n")
    }

    fn log_path(&self, i: usize) -> std::path::PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    fn pid(&self, i: usize) -> String {
        self.members[i]
            .child
            .as_ref()
            .expect("the member runs")
            .id()
            .to_string()
    }

    fn signal(&self, i: usize, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.pid(i)])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {signal} member {i}");
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        let mut c = self.members[i].child.take().expect("the member runs");
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Starts member `i` again on its data directory.
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "killed first");
        // A member rejoining keeps its data: `new` is ignored then.
        self.spawn(i);
    }

    /// SIGSTOPs member `i` (it holds its connections but answers nothing).
    pub fn pause(&self, i: usize) {
        self.signal(i, "-STOP");
    }

    pub fn resume(&self, i: usize) {
        self.signal(i, "-CONT");
    }

    /// The member that leads now.
    pub fn leader(&self) -> usize {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            for (i, m) in self.members.iter().enumerate() {
                if m.child.is_none() {
                    continue;
                }
                let out = Command::new("etcdctl")
                    .args(["--endpoints", &m.client, "endpoint", "status", "-w", "json"])
                    .env("ETCDCTL_API", "3")
                    .output();
                let Ok(out) = out else { continue };
                let v: serde_json::Value = match serde_json::from_slice(&out.stdout) {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                let s = &v[0]["Status"];
                if s["header"]["member_id"].as_u64().is_some()
                    && s["header"]["member_id"] == s["leader"]
                {
                    return i;
                }
            }
            assert!(
                Instant::now() < until,
                "no etcd member leads; the members logged:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Compacts the key space up to its current revision, through the
    /// first running member that answers.
    pub fn compact(&self) -> u64 {
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let etcdctl = |args: &[&str]| {
                Command::new("etcdctl")
                    .args(["--endpoints", &m.client, "--command-timeout=2s"])
                    .args(args)
                    .env("ETCDCTL_API", "3")
                    .stderr(Stdio::null())
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
            };
            let Some(out) = etcdctl(&["endpoint", "status", "-w", "json"]) else {
                continue;
            };
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let rev = v[0]["Status"]["header"]["revision"].as_u64().unwrap();
            if etcdctl(&["compaction", &rev.to_string()]).is_some() {
                return rev;
            }
        }
        panic!("no etcd member compacted");
    }

    /// What the members logged (for a failure's message).
    pub fn logs(&self) -> String {
        (0..self.members.len())
            .map(|i| {
                let log = std::fs::read_to_string(self.log_path(i)).unwrap_or_default();
                format!("--- {} ---\n{log}", self.members[i].name)
            })
            .collect()
    }
}
