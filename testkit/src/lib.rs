//! Helpers for the people who build taskgate, shared by the tests, the
//! fuzz targets and `taskgate-bench`: a crate of its own, so the service's
//! library carries none of it.

pub mod cluster;
pub mod graph;

pub use tempfile_dir::TempDir;

/// The five-task example of the API documentation, as a registration body (also used by
/// the soak client and the fuzz targets).
pub const FIVE_TASKS: &str = r#"{"tasks": [
  {"name": "init", "lifecycle": {"hook": "prestart"}},
  {"name": "proxy", "lifecycle": {"hook": "prestart", "sidecar": true}},
  {"name": "web", "leader": true},
  {"name": "announce", "lifecycle": {"hook": "poststart"}},
  {"name": "cleanup", "lifecycle": {"hook": "poststop"}}]}"#;

/// A temporary directory removed on drop (the bench needs nothing more).
pub mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(name: &str) -> std::io::Result<Self> {
            let dir = std::env::temp_dir().join(format!(
                "taskgate-bench-{name}-{}-{}",
                std::process::id(),
                fastrand::u64(..)
            ));
            std::fs::create_dir_all(&dir)?;
            Ok(Self(dir))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
