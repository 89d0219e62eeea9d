//! `taskgate dump`: a stopped server's data directory, readable.
//!
//! The store keeps records in a compact binary form (`store/record.rs`);
//! this prints each allocation as the API shows it, one JSON object per
//! line in ID order, then each semaphore as `{"semaphore": {...}}` (its
//! stored fields), one per line in name order, from the snapshot and the
//! log exactly as a start would load them, without changing a byte of the
//! directory.

use std::{io::Write, path::PathBuf};

use clap::Args;

use crate::{http::views::AllocationView, store};

#[derive(Args, Clone, Debug)]
pub struct DumpConfig {
    /// The data directory, as given to `serve`.
    #[arg(long, env = "TASKGATE_DATA_DIR", default_value = "./taskgate-data")]
    pub data_dir: PathBuf,

    /// Only allocations whose ID, and semaphores whose name, starts with
    /// this.
    #[arg(long, default_value = "")]
    pub prefix: String,

    /// Instead of printing, copy everything that can still be read from a
    /// damaged data directory into this new one (absent or empty), the
    /// newest version of each allocation and semaphore, and say exactly
    /// what could not be read and which ones' last changes may be lost. The
    /// damaged directory is never changed. Exits 0 if everything was read,
    /// 3 if something was lost.
    #[arg(long, value_name = "NEW_DIR")]
    pub salvage: Option<PathBuf>,
}

/// `taskgate dump --salvage`: copies what can be read into `to`, and
/// writes the report to `out`. Returns whether everything was read and
/// every allocation's last index proven.
pub fn salvage(
    config: &DumpConfig,
    to: &std::path::Path,
    out: &mut impl Write,
) -> Result<bool, String> {
    let report = store::salvage(&config.data_dir, to).map_err(|e| e.to_string())?;
    let write = |out: &mut dyn Write| -> std::io::Result<()> {
        for line in &report.lost {
            writeln!(out, "lost: {line}")?;
        }
        for line in &report.unproven {
            writeln!(out, "unproven: {line}")?;
        }
        writeln!(
            out,
            "salvaged {} allocations and {} semaphores (last index {}) from {} into {}; {}",
            report.allocations,
            report.semaphores,
            report.last_index,
            config.data_dir.display(),
            to.display(),
            if report.whole() {
                "everything was read".to_owned()
            } else {
                format!(
                    "{} things could not be read and the last index of {} could not be \
                     proven (listed above)",
                    report.lost.len(),
                    report.unproven.len()
                )
            }
        )
    };
    write(out).map_err(|e| format!("cannot write: {e}"))?;
    Ok(report.whole())
}

/// A semaphore as `dump` prints it: what its record holds.
#[derive(serde::Serialize)]
struct SemaphoreLine<'a> {
    semaphore: SemaphoreFields<'a>,
}

#[derive(serde::Serialize)]
struct SemaphoreFields<'a> {
    name: &'a str,
    limit: u32,
    /// As the API writes durations (`units::format_duration`).
    grant_timeout: String,
    create_index: u64,
    modify_index: u64,
}

/// Writes the allocations, then the semaphores, to `out`; returns how
/// many lines. A reader that goes away (`taskgate dump | head`) ends it
/// quietly.
pub fn run(config: &DumpConfig, out: &mut impl Write) -> Result<usize, String> {
    let loaded = store::read_only(&config.data_dir).map_err(|e| e.to_string())?;
    let mut out = std::io::BufWriter::new(out);
    let mut written = 0;
    let result = write_lines(&loaded, &config.prefix, &mut out, &mut written);
    match result {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("cannot write: {e}")),
        _ => Ok(written),
    }
}

/// `run`'s lines: the allocations, then the semaphores, under `prefix`,
/// each counted in `written` once written.
fn write_lines(
    loaded: &store::Loaded,
    prefix: &str,
    out: &mut impl Write,
    written: &mut usize,
) -> std::io::Result<()> {
    fn line(out: &mut impl Write, value: &impl serde::Serialize) -> std::io::Result<()> {
        serde_json::to_writer(&mut *out, value)?;
        out.write_all(b"\n")
    }
    for a in &loaded.allocations {
        if a.id.as_str().starts_with(prefix) {
            line(
                out,
                &AllocationView::new(a, &crate::http::views::RecordOnly),
            )?;
            *written += 1;
        }
    }
    for s in &loaded.semaphores {
        if s.name.as_str().starts_with(prefix) {
            let fields = SemaphoreFields {
                name: s.name.as_str(),
                limit: s.limit,
                grant_timeout: crate::units::format_duration(s.grant_timeout),
                create_index: s.create_index,
                modify_index: s.modify_index,
            };
            line(out, &SemaphoreLine { semaphore: fields })?;
            *written += 1;
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        lifecycle::AllocId,
        registry::{Registry, RegistryConfig},
        store::{DiskStore, DiskStoreConfig, Store},
    };

    #[tokio::test]
    async fn prints_each_allocation_as_the_api_shows_it_in_id_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            DiskStore::open(DiskStoreConfig {
                max_batch: 1,
                log_limit: 1 << 20,
                ..DiskStoreConfig::new(dir.path().to_owned())
            })
            .unwrap(),
        );
        let r = Registry::open(store.clone(), RegistryConfig::default()).unwrap();
        for id in ["web-2", "web-1", "db-1"] {
            let body: crate::http::dto::RegisterBody =
                serde_json::from_str(taskgate_testkit::FIVE_TASKS).unwrap();
            let spec = body
                .into_spec(&r.config().limits, &AllocId::parse(id).unwrap())
                .unwrap();
            r.register(AllocId::parse(id).unwrap(), spec).await.unwrap();
        }
        let expected: Vec<String> = ["web-1", "web-2"]
            .iter()
            .map(|id| {
                serde_json::to_string(&AllocationView::new(
                    &r.get(id).unwrap(),
                    &crate::http::views::RecordOnly,
                ))
                .unwrap()
            })
            .collect();
        drop(r);
        store.close().unwrap();
        drop(store);

        let config = |prefix: &str| DumpConfig {
            data_dir: dir.path().to_owned(),
            prefix: prefix.to_owned(),
            salvage: None,
        };
        let mut out = Vec::new();
        assert_eq!(run(&config("web-"), &mut out), Ok(2));
        let lines: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().collect();
        assert_eq!(lines, expected);
        let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(first["coordinator_state"], "prestart");
        assert_eq!(first["tasks"][0]["name"], "init");

        let mut all = Vec::new();
        assert_eq!(run(&config(""), &mut all), Ok(3));
        assert!(
            std::str::from_utf8(&all)
                .unwrap()
                .starts_with("{\"id\":\"db-1\"")
        );

        // An intact directory salvages whole, and says so.
        let to = tempfile::tempdir().unwrap();
        let to = to.path().join("copy");
        let mut report = Vec::new();
        assert_eq!(salvage(&config(""), &to, &mut report), Ok(true));
        let report = String::from_utf8(report).unwrap();
        assert!(
            report.starts_with("salvaged 3 allocations and 0 semaphores"),
            "{report}"
        );
        assert!(report.contains("everything was read"), "{report}");
        let copy = DumpConfig {
            data_dir: to,
            ..config("")
        };
        let mut again = Vec::new();
        assert_eq!(run(&copy, &mut again), Ok(3));
        assert_eq!(again, all);
    }

    /// Semaphores come after the allocations, in name order, each as its
    /// stored fields; the prefix picks them by name; salvage counts them.
    #[tokio::test]
    async fn prints_semaphores_after_the_allocations_and_salvages_them() {
        use crate::lifecycle::{SemName, Semaphore};
        use crate::store::{Op, commit};

        let dir = tempfile::tempdir().unwrap();
        let store = DiskStore::open(DiskStoreConfig::new(dir.path().to_owned())).unwrap();
        let spec: crate::http::dto::RegisterBody =
            serde_json::from_str(taskgate_testkit::FIVE_TASKS).unwrap();
        let id = AllocId::parse("web-1").unwrap();
        let spec = spec
            .into_spec(&crate::lifecycle::Limits::default(), &id)
            .unwrap();
        let a = crate::lifecycle::Allocation::register(
            id,
            Arc::new(spec),
            u64::MAX,
            time::OffsetDateTime::UNIX_EPOCH,
        );
        commit(&store, Op::Put(Arc::new(a))).await.unwrap();
        for (name, limit, ms) in [("web-db", 3, 90_500), ("gpu", 1, 1_000)] {
            let s = Semaphore {
                name: SemName::parse(name).unwrap(),
                limit,
                grant_timeout: std::time::Duration::from_millis(ms),
                create_index: u64::MAX,
                modify_index: u64::MAX,
            };
            commit(&store, Op::PutSemaphore(Arc::new(s))).await.unwrap();
        }
        store.close().unwrap();
        drop(store);

        let config = |prefix: &str| DumpConfig {
            data_dir: dir.path().to_owned(),
            prefix: prefix.to_owned(),
            salvage: None,
        };
        let mut out = Vec::new();
        assert_eq!(run(&config(""), &mut out), Ok(3));
        let lines: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().collect();
        assert!(lines[0].starts_with("{\"id\":\"web-1\""), "{lines:?}");
        assert_eq!(
            lines[1..],
            [
                r#"{"semaphore":{"name":"gpu","limit":1,"grant_timeout":"1s","create_index":3,"modify_index":3}}"#,
                r#"{"semaphore":{"name":"web-db","limit":3,"grant_timeout":"1m30.5s","create_index":2,"modify_index":2}}"#,
            ]
        );
        let mut out = Vec::new();
        assert_eq!(run(&config("web-"), &mut out), Ok(2));
        let lines: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().collect();
        assert!(lines[1].contains(r#""name":"web-db""#), "{lines:?}");

        let to = tempfile::tempdir().unwrap();
        let mut report = Vec::new();
        assert_eq!(
            salvage(&config(""), &to.path().join("copy"), &mut report),
            Ok(true)
        );
        let report = String::from_utf8(report).unwrap();
        assert!(
            report.starts_with("salvaged 1 allocations and 2 semaphores (last index 3)"),
            "{report}"
        );
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let config = DumpConfig {
            data_dir: "/nonexistent/taskgate-data".into(),
            prefix: String::new(),
            salvage: None,
        };
        let err = run(&config, &mut Vec::new()).unwrap_err();
        assert!(err.contains("/nonexistent/taskgate-data"), "{err}");
    }
}
