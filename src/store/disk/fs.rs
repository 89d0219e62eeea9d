//! The disk store's file operations, behind one seam.
//!
//! Everything the store does to its data directory goes through `Fs`: the
//! real one (`RealFs`, std's files) in the server, and in tests a simulated
//! one (`sim::SimFs`) that knows which writes, creates, renames and
//! unlinks an `fsync` has made durable, and can crash — drop everything
//! that was not, and tear the last unsynced append at any byte, losing
//! any of its sectors, in any order — or fail
//! an operation (ENOSPC, EIO, a read-only directory) on purpose. SIGKILL
//! keeps the page cache, so only the simulated crash can catch a write
//! whose durability the store takes for granted.

use std::{
    ffi::OsString,
    fs::{File, OpenOptions},
    io::{self, Read, Seek, Write},
    os::unix::fs::MetadataExt,
    path::Path,
};

/// How a file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Open {
    /// Reading.
    Read,
    /// Writing an existing file (appends go at its end).
    Append,
    /// Writing from its start: created, or emptied if it exists.
    Truncate,
    /// Writing a new file; an existing one is `AlreadyExists`.
    CreateNew,
}

/// An open file.
#[allow(clippy::len_without_is_empty)] // a file's length is an I/O result
pub trait FsFile: Read + Write + Seek + Send {
    /// Makes the file's data durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
    /// Makes the file's data and metadata durable (`fsync`).
    fn sync_all(&mut self) -> io::Result<()>;
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    /// How many names the file has.
    fn links(&self) -> io::Result<u64>;
}

/// A held lock on a data directory; released on drop.
pub trait DirLock: Send + Sync {}

impl DirLock for File {}

/// Why a lock was not taken.
pub enum LockError {
    /// Another holder has it.
    Held,
    Io(io::Error),
}

/// The file operations of the store.
pub trait Fs: Send + Sync + 'static {
    fn open(&self, path: &Path, how: Open) -> io::Result<Box<dyn FsFile>>;
    /// A whole file's bytes.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes creations, renames and removals in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// The names in `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>>;
    fn exists(&self, path: &Path) -> bool;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// An exclusive lock on `path` (created if absent), held while the
    /// returned value lives.
    fn lock(&self, path: &Path) -> Result<Box<dyn DirLock>, LockError>;
}

/// The real file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealFs;

impl FsFile for File {
    fn sync_data(&mut self) -> io::Result<()> {
        File::sync_data(self)
    }
    fn sync_all(&mut self) -> io::Result<()> {
        File::sync_all(self)
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn links(&self) -> io::Result<u64> {
        Ok(self.metadata()?.nlink())
    }
}

impl Fs for RealFs {
    fn open(&self, path: &Path, how: Open) -> io::Result<Box<dyn FsFile>> {
        let file = match how {
            Open::Read => File::open(path)?,
            Open::Append => OpenOptions::new().append(true).open(path)?,
            Open::Truncate => OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)?,
            Open::CreateNew => OpenOptions::new().write(true).create_new(true).open(path)?,
        };
        Ok(Box::new(file))
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::hard_link(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<OsString>> {
        std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn lock(&self, path: &Path) -> Result<Box<dyn DirLock>, LockError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(LockError::Io)?;
        match file.try_lock() {
            Ok(()) => Ok(Box::new(file)),
            Err(std::fs::TryLockError::WouldBlock) => Err(LockError::Held),
            Err(std::fs::TryLockError::Error(e)) => Err(LockError::Io(e)),
        }
    }
}

#[cfg(test)]
pub mod sim;
