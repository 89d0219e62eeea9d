//! The etcd store's tests run against a real cluster
//! (`taskgate_testkit::cluster`). Without `etcd` on the PATH they pass
//! without running, and the run says so on its terminal in one line that
//! `cargo test` does not swallow; with `TASKGATE_REQUIRE_ETCD` set (as
//! `.ci/run` does) a missing etcd is a failure instead.

use std::{
    io::Write,
    process::{Command, Stdio},
};

#[allow(unused_imports)] // not every test binary starts a cluster
pub use taskgate_testkit::cluster::Cluster;

/// What a run without etcd says, once.
pub const SKIPPED: &str = "SKIPPED: the etcd tests (tests/etcd.rs) did not run: no `etcd` on \
the PATH. Install it (Debian: apt-get install etcd-server etcd-client) to run them; \
TASKGATE_REQUIRE_ETCD=1 makes a missing etcd a failure";

/// Whether etcd is installed; when it is not and the run does not
/// require it, says so (once per run) where a reader of `cargo test`'s
/// output sees it.
pub fn available(test: &str) -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("TASKGATE_REQUIRE_ETCD").is_none(),
            "TASKGATE_REQUIRE_ETCD is set, but there is no etcd on the PATH"
        );
        // `eprintln!` in a passing test is captured and never shown; a
        // write to the stderr handle itself is not.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            let _ = writeln!(std::io::stderr().lock(), "\n{SKIPPED}\n");
        });
        eprintln!("{test}: skipped, no etcd on the PATH");
    }
    found
}
