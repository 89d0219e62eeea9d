//! The real `taskgate` binary as a child process.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

/// The service's binary: cargo names it to the service's own tests; the
/// bench crate's tests (which include this file) find it where cargo built
/// it, next to their own `deps` directory.
pub fn taskgate_bin() -> std::path::PathBuf {
    if let Some(bin) = option_env!("CARGO_BIN_EXE_taskgate") {
        return bin.into();
    }
    let me = std::env::current_exe().expect("the test knows its path");
    let bin = me
        .parent()
        .and_then(|deps| deps.parent())
        .expect("a test runs from target/<profile>/deps")
        .join("taskgate");
    assert!(
        bin.exists(),
        "no taskgate binary at {}: run the workspace's tests (cargo test), which build it",
        bin.display()
    );
    bin
}

/// A running `taskgate serve`, killed on drop so a failing test leaves
/// nothing behind.
pub struct Server {
    pub child: Child,
    pub base: String,
    /// Every line the server logged so far (its stdout).
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `taskgate serve ARGS` (on `127.0.0.1:0` unless `ARGS` has a
    /// `--listen`) and reads the
    /// address from its log. Its output is drained for the life of the
    /// process.
    pub fn start(args: &[&str]) -> Server {
        Self::start_env(args, &[])
    }

    /// `start` with variables added to the server's environment. The
    /// test's own `OTEL_*` variables are not passed on: traces are on only
    /// where a test turns them on.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(taskgate_bin());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OTEL_") {
                command.env_remove(name);
            }
        }
        command
            .args(["serve", "--log", "info"])
            .envs(env.iter().copied());
        Self::spawn(command, args)
    }

    /// `start` with the process's open-files limit set to `nofile` (by
    /// `sh`'s `ulimit`, which then execs the server).
    pub fn start_with_open_files(nofile: u64, args: &[&str]) -> Server {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
            .arg(taskgate_bin())
            .args(["serve", "--log", "info"]);
        Self::spawn(command, args)
    }

    fn spawn(mut command: Command, args: &[&str]) -> Server {
        if !args.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("taskgate starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = lines.clone();
        let reader = std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("addr=").nth(1)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr.trim().to_owned());
                }
                kept.lock().unwrap().push(line);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the server logs its address");
        Server {
            child,
            base: format!("http://{addr}"),
            lines,
            reader: Some(reader),
        }
    }

    /// Stops the server with SIGTERM and returns its exit status and every
    /// line it logged, up to its last.
    pub fn stop(self) -> (std::process::ExitStatus, Vec<String>) {
        self.terminate();
        self.wait_logs()
    }

    /// Waits for the server to exit (after a `terminate`); its exit status
    /// and every line it logged.
    pub fn wait_logs(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let status = self.child.wait().unwrap();
        // The server's stdout is closed once it has exited: the reader
        // ends at its last line.
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
        let lines = self.lines.lock().unwrap().clone();
        (status, lines)
    }

    /// Every line the server logged so far.
    pub fn log(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The address the server listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.base
            .trim_start_matches("http://")
            .parse()
            .expect("the server logged a socket address")
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Runs `taskgate health --server BASE`; true on exit 0.
pub fn health(base: &str) -> bool {
    Command::new(taskgate_bin())
        .args(["health", "--server", base, "--timeout", "5s"])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}
