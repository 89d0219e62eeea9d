//! The task's cgroup, where the agent may create one (cgroup v2: as root,
//! or in a subtree delegated to its user), as Nomad's exec drivers do:
//! each run of the task starts in a cgroup of its own below the agent's,
//! so everything it starts is in it, whatever its process group, session
//! or parent, and is ended at once with `cgroup.kill` (Linux 5.14), which
//! no fork can outrun. Elsewhere the agent falls back to process groups and
//! its child subreaper (`process.rs`), and says so once at start.
//!
//! The cgroup v2 hierarchy is found in `/proc/self/mountinfo` (the
//! `cgroup2` mount: `/sys/fs/cgroup` on a unified host,
//! `/sys/fs/cgroup/unified` on a hybrid one), the agent's own cgroup in
//! `/proc/self/cgroup` (its `0::` line). Plain files, no `unsafe`.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

/// The prefix of every cgroup an agent creates.
const PREFIX: &str = "taskgate-";

/// Where new cgroups for the task go, and what they are called.
#[derive(Debug, Clone)]
pub struct Place {
    /// The agent's own cgroup, in the mounted hierarchy.
    parent: PathBuf,
    /// `taskgate-<alloc>-<task>-<agent's pid>`, so an operator can tell
    /// whose it is, and no two agents share one.
    name: String,
}

/// A cgroup that holds one run of the task; removed once it is empty and
/// the run has been stopped.
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
}

impl Place {
    /// Where this agent may create cgroups, or why it may not. Creates
    /// one and removes it again, to find out; removes the empty ones that
    /// agents killed before could not remove.
    pub fn find(alloc: &str, task: &str) -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let (root, mount) =
            cgroup2_mount(&mountinfo).ok_or_else(|| "no cgroup v2 is mounted".to_owned())?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let path = unified_path(&own)
            .ok_or_else(|| "the agent is in no cgroup v2 (/proc/self/cgroup)".to_owned())?;
        let inside = Path::new(path)
            .strip_prefix(&root)
            .map_err(|_| format!("the agent's cgroup {path} is outside the mount of {root}"))?;
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let place = Place {
            parent: mount.join(inside),
            name: format!("{PREFIX}{}-{}-{me}", clean(alloc), clean(task)),
        };
        place.remove_abandoned();
        let probe = place.create()?;
        probe.remove();
        Ok(place)
    }

    /// The agent's own cgroup, where the task's are made.
    pub fn parent(&self) -> &Path {
        &self.parent
    }

    /// The cgroup of the task's run, whether it exists or not: for what
    /// must reach it without the run (a second signal, the last sweep).
    pub fn current(&self) -> Cgroup {
        Cgroup {
            dir: self.parent.join(&self.name),
        }
    }

    /// A new cgroup for a run of the task.
    pub fn create(&self) -> Result<Cgroup, String> {
        let dir = self.parent.join(&self.name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            // This agent's, left by a run whose stop could not empty it.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
        }
        let cgroup = Cgroup { dir };
        if !cgroup.dir.join("cgroup.kill").exists() {
            cgroup.remove();
            return Err("the kernel has no cgroup.kill (Linux 5.14 and later have it)".to_owned());
        }
        Ok(cgroup)
    }

    /// Removes the empty cgroups of agents that are gone (killed with
    /// SIGKILL, they could not remove their own). A cgroup that still
    /// holds processes is left alone: they are what such an agent left
    /// running, for its supervisor or an operator to end.
    fn remove_abandoned(&self) {
        let Ok(entries) = std::fs::read_dir(&self.parent) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.starts_with(PREFIX))
                .and_then(|n| n.rsplit('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            // Fails (EBUSY) while it holds a process.
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

impl Cgroup {
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The processes in it.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Whether a process (not a zombie) is in it, or below it.
    pub fn populated(&self) -> bool {
        match std::fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(events) => events.lines().any(|l| l == "populated 1"),
            // Gone: nothing in it.
            Err(_) => false,
        }
    }

    /// SIGKILL to every process in it and below, at once (`cgroup.kill`):
    /// a process that forks meanwhile has its child killed too.
    pub fn kill(&self) {
        if let Err(e) = std::fs::write(self.dir.join("cgroup.kill"), "1") {
            tracing::debug!(cgroup = %self.dir.display(), error = %e, "cgroup.kill failed");
        }
    }

    /// Removes it; the kernel refuses while a process is in it, so it is
    /// tried again for a while after a kill.
    pub fn remove(&self) {
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Kills what is left in it and removes it, trying for at most
    /// `within`; says so if it cannot.
    pub async fn kill_and_remove(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.populated() {
                self.kill();
            }
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    tracing::warn!(
                        cgroup = %self.dir.display(),
                        pids = ?self.pids(),
                        error = %e,
                        "cannot remove the task's cgroup"
                    );
                    return;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
}

/// The root and mount point of the cgroup v2 hierarchy, from mountinfo
/// lines: `ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [TAGS...] - TYPE
/// SOURCE SUPER_OPTIONS`, with a space, tab, newline or backslash in a
/// path written as an octal escape (`\040`).
fn cgroup2_mount(mountinfo: &str) -> Option<(String, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (mount, filesystem) = line.split_once(" - ")?;
        if filesystem.split(' ').next()? != "cgroup2" {
            return None;
        }
        let mut fields = mount.split(' ');
        let root = unescape(fields.nth(3)?);
        let point = unescape(fields.next()?);
        Some((root, PathBuf::from(point)))
    })
}

/// mountinfo's octal escapes undone.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The cgroup v2 path in a `/proc/<pid>/cgroup` text (its `0::` line).
fn unified_path(cgroup: &str) -> Option<&str> {
    cgroup.lines().find_map(|l| l.strip_prefix("0::"))
}

/// `s` with every character a cgroup's name should not hold replaced.
fn clean(s: &str) -> String {
    s.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_on_hybrid_and_unified_hosts() {
        let hybrid = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(("/".to_owned(), "/sys/fs/cgroup/unified".into()))
        );
        let unified = "\
25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev shared:8 - cgroup2 cgroup2 rw,nsdelegate
";
        assert_eq!(
            cgroup2_mount(unified),
            Some(("/".to_owned(), "/sys/fs/cgroup".into()))
        );
        // A container sees its own part of the hierarchy, under a root.
        let container = "1 0 0:9 /kube/pod\\0401 /sys/fs/cgroup ro - cgroup2 cgroup rw\n";
        assert_eq!(
            cgroup2_mount(container),
            Some(("/kube/pod 1".to_owned(), "/sys/fs/cgroup".into()))
        );
        assert_eq!(cgroup2_mount(&hybrid.replace("cgroup2", "cgroup")), None);
    }

    #[test]
    fn the_agents_own_cgroup_is_its_unified_line() {
        let hybrid = "9:name=systemd:/\n4:memory:/a/b\n0::/user.slice/x.scope\n";
        assert_eq!(unified_path(hybrid), Some("/user.slice/x.scope"));
        assert_eq!(unified_path("4:memory:/a\n"), None);
    }

    #[test]
    fn names_keep_to_safe_characters() {
        assert_eq!(clean("web-42/../x y"), "web_42_.._x_y");
        assert_eq!(clean(&"a".repeat(100)).len(), 64);
    }
}
