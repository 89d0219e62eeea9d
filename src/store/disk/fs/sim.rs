//! A simulated file system for power-loss and fault tests.
//!
//! It keeps, for every file, the bytes written and the bytes an `fsync`
//! made durable, and for every directory the names it holds and the names
//! a directory `fsync` made durable — the POSIX promise, nothing more: a
//! file's `fsync` does not make its name durable, a rename or unlink not
//! followed by one of its directory is not durable either.
//!
//! `crash_after(n)` crashes it at its `n`-th operation: from then on every
//! operation fails (as the dying process would see nothing more), and
//! `image()` is what a restart would find: durable names and durable
//! bytes, plus — for a file that was only appended to since its last sync —
//! any prefix of the unsynced appends (a torn write), whose end may read as
//! zeros from a sector boundary on, or any of whose sectors may read as
//! zeros, later ones kept while earlier ones are lost (sectors that never
//! reached the disk, written out of order); for a file written over since
//! its last sync (an append into zeros written ahead of it), each sector
//! from the first changed byte on, new or as it was at the sync.
//! `fail_with` makes chosen operations fail (ENOSPC, EIO, EROFS).

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    io::{self, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
};

use super::{DirLock, Fs, FsFile, LockError, Open};

/// An operation, for `fail_with`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Open(Open),
    Read,
    Write,
    SyncData,
    SyncAll,
    SetLen,
    Rename,
    Remove,
    Link,
    SyncDir,
    List,
}

/// The unit a disk writes whole or not at all.
const SECTOR: usize = 512;

type Faults = Box<dyn FnMut(Op, &Path) -> Option<io::Error> + Send>;

#[derive(Clone, Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Default)]
struct State {
    inodes: Vec<Inode>,
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    dirs: BTreeSet<PathBuf>,
    ops: u64,
    crash_at: Option<u64>,
    /// What a restart finds, once crashed.
    image: Option<Image>,
    faults: Option<Faults>,
    rng: Option<fastrand::Rng>,
}

/// A crashed file system's contents: every name and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub files: BTreeMap<PathBuf, Vec<u8>>,
    pub dirs: BTreeSet<PathBuf>,
}

/// The simulated file system; clones share it.
#[derive(Clone, Default)]
pub struct SimFs(Arc<Mutex<State>>);

fn gone() -> io::Error {
    io::Error::other("the simulated machine crashed")
}

impl State {
    /// Counts an operation: crashes at the chosen one, fails every one
    /// after, and asks the fault hook.
    fn step(&mut self, op: Op, path: &Path) -> io::Result<()> {
        if self.image.is_some() {
            return Err(gone());
        }
        self.ops += 1;
        if self.crash_at.is_some_and(|n| self.ops >= n) {
            self.image = Some(self.crash());
            return Err(gone());
        }
        if let Some(f) = &mut self.faults
            && let Some(e) = f(op, path)
        {
            return Err(e);
        }
        Ok(())
    }

    fn crash(&mut self) -> Image {
        let mut rng = self
            .rng
            .take()
            .unwrap_or_else(|| fastrand::Rng::with_seed(0));
        let mut files = BTreeMap::new();
        for (name, &ino) in &self.durable_names {
            let inode = &self.inodes[ino];
            let mut bytes = inode.durable.clone();
            if inode.data.len() > bytes.len() && inode.data.starts_with(&bytes) {
                // Only appended to since the last sync: any prefix of the
                // appends may have reached the disk (the file's length is
                // metadata of its own), and of that prefix, any of its
                // sectors: the disk writes a sector whole or not at all,
                // in no promised order, so a later sector may be there
                // while an earlier one reads as zeros (as etcd's WAL
                // assumes). Either the end from a sector boundary on is
                // lost (the common case), or each sector is kept or lost
                // on its own.
                let extra = inode.data.len() - bytes.len();
                let kept = rng.usize(0..=extra);
                let from = bytes.len();
                bytes.extend_from_slice(&inode.data[from..from + kept]);
                if kept > 0 {
                    match rng.u8(0..3) {
                        0 => {}
                        1 => {
                            let zero_from = rng.usize(from..bytes.len()).next_multiple_of(SECTOR);
                            if zero_from < bytes.len() {
                                bytes[zero_from..].fill(0);
                            }
                        }
                        _ => {
                            // The sector holding `from` also holds synced
                            // bytes: lost, it reads as it was at the sync.
                            let mut at = from;
                            while at < bytes.len() {
                                let end = (at + 1).next_multiple_of(SECTOR).min(bytes.len());
                                if rng.bool() {
                                    bytes[at..end].fill(0);
                                }
                                at = end;
                            }
                        }
                    }
                }
            } else if inode.data.len() >= bytes.len() && inode.data != bytes {
                // Written over since the last sync (an append into zeros
                // written ahead of it), perhaps past the end too: from
                // the first changed byte on, each sector reached the disk
                // whole or not at all, in no promised order; a longer
                // length, any part of it.
                let from = inode
                    .data
                    .iter()
                    .zip(&bytes)
                    .position(|(a, b)| a != b)
                    .unwrap_or(bytes.len());
                let old = bytes.clone();
                let len = rng.usize(bytes.len()..=inode.data.len());
                bytes.resize(len, 0);
                let cut = match rng.u8(0..3) {
                    0 => len,
                    1 => rng.usize(from..=len),
                    _ => usize::MAX,
                };
                let mut at = from - from % SECTOR;
                while at < len {
                    let end = (at + SECTOR).min(len);
                    let new = if cut == usize::MAX {
                        rng.bool()
                    } else {
                        end <= cut
                    };
                    if new {
                        bytes[at..end].copy_from_slice(&inode.data[at..end]);
                    } else {
                        let kept = old.len().clamp(at, end);
                        if kept > at {
                            bytes[at..kept].copy_from_slice(&old[at..kept]);
                        }
                        bytes[kept..end].fill(0);
                    }
                    at = end;
                }
            }
            files.insert(name.clone(), bytes);
        }
        Image {
            files,
            dirs: self.dirs.clone(),
        }
    }

    fn inode_of(&self, path: &Path) -> io::Result<usize> {
        self.names
            .get(path)
            .copied()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{}", path.display())))
    }

    fn parent_exists(&self, path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(p) if self.dirs.contains(p) => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no directory for {}", path.display()),
            )),
        }
    }
}

impl SimFs {
    pub fn new() -> Self {
        Self::default()
    }

    /// A file system holding `image`, all of it durable.
    pub fn from_image(image: &Image) -> Self {
        let fs = Self::new();
        {
            let mut s = fs.state();
            s.dirs = image.dirs.clone();
            for (name, bytes) in &image.files {
                let ino = s.inodes.len();
                s.inodes.push(Inode {
                    data: bytes.clone(),
                    durable: bytes.clone(),
                });
                s.names.insert(name.clone(), ino);
                s.durable_names.insert(name.clone(), ino);
            }
        }
        fs
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Crashes at the `n`-th operation from now; torn writes are drawn
    /// from `seed`.
    pub fn crash_after(&self, n: u64, seed: u64) {
        let mut s = self.state();
        s.crash_at = Some(s.ops + n.max(1));
        s.rng = Some(fastrand::Rng::with_seed(seed));
    }

    /// Crashes now (if it has not yet).
    pub fn crash_now(&self, seed: u64) {
        let mut s = self.state();
        if s.image.is_none() {
            s.rng = Some(fastrand::Rng::with_seed(seed));
            s.image = Some(s.crash());
        }
    }

    /// What a restart finds, once crashed.
    pub fn image(&self) -> Option<Image> {
        self.state().image.clone()
    }

    /// Fails an operation whenever `fault` says so.
    pub fn fail_with(&self, fault: impl FnMut(Op, &Path) -> Option<io::Error> + Send + 'static) {
        self.state().faults = Some(Box::new(fault));
    }

    /// Makes every name durable now: what a directory sync that failed
    /// may have done all the same.
    pub fn persist_names(&self) {
        let mut s = self.state();
        s.durable_names = s.names.clone();
    }

    /// Stops failing operations.
    pub fn heal(&self) {
        self.state().faults = None;
    }

    /// A file's bytes as written (durable or not), for a test to look at.
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let s = self.state();
        s.names.get(path).map(|&i| s.inodes[i].data.clone())
    }

    /// Writes a file's bytes directly, durably (a test's damage).
    pub fn put(&self, path: &Path, bytes: Vec<u8>) {
        let mut s = self.state();
        let ino = match s.names.get(path) {
            Some(&i) => i,
            None => {
                s.inodes.push(Inode::default());
                let i = s.inodes.len() - 1;
                s.names.insert(path.to_owned(), i);
                s.durable_names.insert(path.to_owned(), i);
                i
            }
        };
        s.inodes[ino] = Inode {
            data: bytes.clone(),
            durable: bytes,
        };
    }
}

/// An open file of the simulation.
struct SimFile {
    fs: SimFs,
    path: PathBuf,
    ino: usize,
    pos: u64,
    append: bool,
}

impl SimFile {
    fn step(&self, op: Op) -> io::Result<std::sync::MutexGuard<'_, State>> {
        let mut s = self.fs.state();
        s.step(op, &self.path)?;
        Ok(s)
    }

    /// Makes the file's bytes durable (its name is the directory's).
    fn sync(&self, op: Op) -> io::Result<()> {
        let mut s = self.step(op)?;
        let inode = &mut s.inodes[self.ino];
        inode.durable = inode.data.clone();
        Ok(())
    }
}

impl Read for SimFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let s = self.step(Op::Read)?;
        let data = &s.inodes[self.ino].data;
        let at = (self.pos as usize).min(data.len());
        let n = buf.len().min(data.len() - at);
        buf[..n].copy_from_slice(&data[at..at + n]);
        drop(s);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Write for SimFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self.step(Op::Write)?;
        let data = &mut s.inodes[self.ino].data;
        let at = if self.append {
            data.len()
        } else {
            self.pos as usize
        };
        if data.len() < at + buf.len() {
            data.resize(at + buf.len(), 0);
        }
        data[at..at + buf.len()].copy_from_slice(buf);
        drop(s);
        self.pos = (at + buf.len()) as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for SimFile {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let len = self.step(Op::Read)?.inodes[self.ino].data.len() as u64;
        self.pos = match to {
            SeekFrom::Start(n) => n,
            SeekFrom::End(d) => len
                .checked_add_signed(d)
                .ok_or_else(|| io::Error::other("seek"))?,
            SeekFrom::Current(d) => self
                .pos
                .checked_add_signed(d)
                .ok_or_else(|| io::Error::other("seek"))?,
        };
        Ok(self.pos)
    }
}

impl FsFile for SimFile {
    fn sync_data(&mut self) -> io::Result<()> {
        self.sync(Op::SyncData)
    }
    fn sync_all(&mut self) -> io::Result<()> {
        self.sync(Op::SyncAll)
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let mut s = self.step(Op::SetLen)?;
        s.inodes[self.ino].data.resize(len as usize, 0);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.step(Op::Read)?.inodes[self.ino].data.len() as u64)
    }
    fn links(&self) -> io::Result<u64> {
        let s = self.step(Op::Read)?;
        Ok(s.names.values().filter(|&&i| i == self.ino).count() as u64)
    }
}

struct NoLock;
impl DirLock for NoLock {}

impl Fs for SimFs {
    fn open(&self, path: &Path, how: Open) -> io::Result<Box<dyn FsFile>> {
        let mut s = self.state();
        s.step(Op::Open(how), path)?;
        let ino = match (how, s.names.get(path).copied()) {
            (Open::Read | Open::Append, Some(i)) => i,
            (Open::Read | Open::Append, None) => return Err(s.inode_of(path).unwrap_err()),
            (Open::CreateNew, Some(_)) => {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists"));
            }
            (Open::Truncate, Some(i)) => {
                s.inodes[i].data.clear();
                i
            }
            (Open::Truncate | Open::CreateNew, None) => {
                s.parent_exists(path)?;
                s.inodes.push(Inode::default());
                let i = s.inodes.len() - 1;
                s.names.insert(path.to_owned(), i);
                i
            }
        };
        drop(s);
        Ok(Box::new(SimFile {
            fs: self.clone(),
            path: path.to_owned(),
            ino,
            pos: 0,
            append: how == Open::Append,
        }))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let mut s = self.state();
        s.step(Op::Read, path)?;
        let ino = s.inode_of(path)?;
        Ok(s.inodes[ino].data.clone())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.state();
        s.step(Op::Rename, from)?;
        let ino = s.inode_of(from)?;
        s.parent_exists(to)?;
        s.names.remove(from);
        s.names.insert(to.to_owned(), ino);
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut s = self.state();
        s.step(Op::Remove, path)?;
        s.inode_of(path)?;
        s.names.remove(path);
        Ok(())
    }

    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.state();
        s.step(Op::Link, from)?;
        let ino = s.inode_of(from)?;
        if s.names.contains_key(to) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists"));
        }
        s.names.insert(to.to_owned(), ino);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.state();
        s.step(Op::SyncDir, dir)?;
        let in_dir = |p: &PathBuf| p.parent() == Some(dir);
        s.durable_names.retain(|p, _| !in_dir(p));
        let now: Vec<_> = s
            .names
            .iter()
            .filter(|(p, _)| in_dir(p))
            .map(|(p, &i)| (p.clone(), i))
            .collect();
        s.durable_names.extend(now);
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        let mut s = self.state();
        s.step(Op::List, dir)?;
        if !s.dirs.contains(dir) {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"));
        }
        Ok(s.names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(ToOwned::to_owned))
            .collect())
    }

    fn exists(&self, path: &Path) -> bool {
        let s = self.state();
        s.names.contains_key(path) || s.dirs.contains(path)
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.state();
        for d in dir.ancestors() {
            s.dirs.insert(d.to_owned());
        }
        Ok(())
    }

    fn lock(&self, _: &Path) -> Result<Box<dyn DirLock>, LockError> {
        Ok(Box::new(NoLock))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(fs: &SimFs, path: &Path, bytes: &[u8]) -> Box<dyn FsFile> {
        let mut f = fs.open(path, Open::Truncate).unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    /// Only what an fsync made durable survives a crash: file data, and
    /// names only once their directory is synced.
    #[test]
    fn a_crash_keeps_only_what_was_made_durable() {
        let fs = SimFs::new();
        let dir = Path::new("/d");
        fs.create_dir_all(dir).unwrap();
        let mut a = write(&fs, &dir.join("a"), b"synced");
        a.sync_all().unwrap();
        fs.sync_dir(dir).unwrap();
        a.write_all(b" and not").unwrap();
        let mut b = write(&fs, &dir.join("b"), b"data synced, name not");
        b.sync_all().unwrap();
        fs.rename(&dir.join("a"), &dir.join("c")).unwrap();
        fs.crash_now(7);
        assert!(fs.read(&dir.join("a")).is_err(), "nothing works after");
        let image = fs.image().unwrap();
        let names: Vec<_> = image.files.keys().cloned().collect();
        assert_eq!(
            names,
            [dir.join("a")],
            "the rename and b's name were not durable"
        );
        let got = &image.files[&dir.join("a")];
        assert!(got.starts_with(b"synced"));
        // The unsynced append: a prefix of it, its end perhaps zeros.
        let tail = &got[6..];
        let zeros = tail.iter().rev().take_while(|&&x| x == 0).count();
        assert!(
            b" and not".starts_with(&tail[..tail.len() - zeros]),
            "{got:?}"
        );
    }

    /// Over many seeds, a torn append leaves every prefix length, and
    /// never anything but a prefix of what was written with some of its
    /// sectors zeroed: at its end, and also out of order (a sector kept
    /// after one lost).
    #[test]
    fn torn_appends_are_prefixes_with_sectors_lost_even_out_of_order() {
        let appended: Vec<u8> = (1..=255u8).cycle().take(3000).collect();
        let mut lengths = BTreeSet::new();
        let mut out_of_order = 0;
        for seed in 0..300 {
            let fs = SimFs::new();
            let dir = Path::new("/d");
            fs.create_dir_all(dir).unwrap();
            let mut f = write(&fs, &dir.join("log"), b"head");
            f.sync_all().unwrap();
            fs.sync_dir(dir).unwrap();
            let mut f = fs.open(&dir.join("log"), Open::Append).unwrap();
            f.write_all(&appended).unwrap();
            fs.crash_now(seed);
            let got = fs.image().unwrap().files[&dir.join("log")].clone();
            assert_eq!(&got[..4], b"head");
            let tail = &got[4..];
            assert!(tail.len() <= appended.len(), "seed {seed}");
            // Sector by sector (of the file): as written, or zeros.
            let mut lost = Vec::new();
            let mut at = 4;
            while at < got.len() {
                let end = (at + 1).next_multiple_of(SECTOR).min(got.len());
                let chunk = &got[at..end];
                if chunk != &appended[at - 4..end - 4] {
                    assert!(chunk.iter().all(|&b| b == 0), "seed {seed}: byte {at}");
                    lost.push(true);
                } else {
                    lost.push(false);
                }
                at = end;
            }
            if lost.windows(2).any(|w| w[0] && !w[1]) {
                out_of_order += 1;
            }
            lengths.insert(tail.len());
        }
        assert!(lengths.len() > 50, "{lengths:?}");
        assert!(out_of_order > 20, "{out_of_order}");
    }

    /// Over many seeds, bytes written over synced zeros (an append into
    /// space written ahead) come back sector by sector new or as synced,
    /// never anything else: all of them, none, and some sectors kept after
    /// one lost; past the synced end, a longer file to any length.
    #[test]
    fn writes_over_synced_bytes_come_back_sector_by_sector() {
        let written: Vec<u8> = (1..=255u8).cycle().take(3000).collect();
        let (mut all, mut none, mut out_of_order, mut lengths) = (0, 0, 0, BTreeSet::new());
        for seed in 0..300 {
            let fs = SimFs::new();
            let dir = Path::new("/d");
            fs.create_dir_all(dir).unwrap();
            let mut f = write(&fs, &dir.join("log"), &[0u8; 2048]);
            f.sync_all().unwrap();
            fs.sync_dir(dir).unwrap();
            // Over the zeros from byte 100, and 1,148 bytes past them.
            f.seek(SeekFrom::Start(100)).unwrap();
            f.write_all(&written).unwrap();
            fs.crash_now(seed);
            let got = fs.image().unwrap().files[&dir.join("log")].clone();
            assert!((2048..=3100).contains(&got.len()), "seed {seed}");
            assert!(got[..100].iter().all(|&b| b == 0));
            let mut kept = Vec::new();
            let mut at = 100;
            while at < got.len() {
                let end = (at + 1).next_multiple_of(SECTOR).min(got.len());
                let chunk = &got[at..end];
                if chunk == &written[at - 100..end - 100] {
                    kept.push(true);
                } else {
                    assert!(chunk.iter().all(|&b| b == 0), "seed {seed}: byte {at}");
                    kept.push(false);
                }
                at = end;
            }
            all += usize::from(kept.iter().all(|&k| k));
            none += usize::from(kept.iter().all(|&k| !k));
            out_of_order += usize::from(kept.windows(2).any(|w| !w[0] && w[1]));
            lengths.insert(got.len());
        }
        assert!(
            all > 10 && none > 10 && out_of_order > 10,
            "{all} {none} {out_of_order}"
        );
        assert!(lengths.len() > 50, "{lengths:?}");
    }

    #[test]
    fn chosen_operations_fail_until_healed() {
        let fs = SimFs::new();
        let dir = Path::new("/d");
        fs.create_dir_all(dir).unwrap();
        fs.fail_with(|op, _| (op == Op::SyncData).then(|| io::Error::from_raw_os_error(28)));
        let mut f = write(&fs, &dir.join("a"), b"x");
        let e = f.sync_data().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(28));
        fs.heal();
        f.sync_data().unwrap();
    }
}
