//! The etcd store's tests run against a real cluster
//! (`taskgate::testing::cluster`). Without `etcd` on the PATH they say so and
//! pass, unless `TASKGATE_REQUIRE_ETCD` is set (as `.ci/run` does), which
//! makes a missing etcd a failure.

use std::process::{Command, Stdio};

#[allow(unused_imports)] // not every test binary starts a cluster
pub use taskgate::testing::cluster::Cluster;

/// Whether etcd is installed; when it is not and the run does not
/// require it, prints why the test does nothing.
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
        eprintln!("{test}: skipped, no etcd on the PATH (Debian: apt-get install etcd-server)");
    }
    found
}
