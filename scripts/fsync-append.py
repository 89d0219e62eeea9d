#!/usr/bin/env python3
"""What one durable commit costs on this disk, by how the log file is laid out.

Writes N commits of SIZE bytes, each followed by fdatasync, to a file in
DIR (default: the current directory), three ways:

- append:    the file grows with every commit (what taskgate's log does);
             fdatasync must also commit the file-system journal (new size).
- prezero:   the file was filled with zeros and synced beforehand, so a
             commit overwrites blocks already there; no journal commit.
- fallocate: the blocks were reserved (posix_fallocate) but not written.

Prints wall time, voluntary context switches and CPU time (this process
only: the journal thread's CPU is not in it) per commit.

    python3 scripts/fsync-append.py [DIR] [N] [SIZE]
"""

import os
import resource
import sys
import time


def run(path, mode, n, size):
    if os.path.exists(path):
        os.remove(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if mode == "prezero":
            os.write(fd, b"\0" * (n * size))
            os.fsync(fd)
            os.lseek(fd, 0, os.SEEK_SET)
        elif mode == "fallocate":
            os.posix_fallocate(fd, 0, n * size)
            os.fsync(fd)
        buf = b"x" * size
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        for _ in range(n):
            os.write(fd, buf)
            os.fdatasync(fd)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        os.close(fd)
        os.remove(path)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    switches = after.ru_nvcsw - before.ru_nvcsw
    print(
        f"{mode:10} {wall / n * 1e3:.3f} ms per commit, "
        f"{switches / n:.2f} voluntary switches, {cpu / n * 1e6:.1f} µs CPU"
    )


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "."
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
    path = os.path.join(directory, "fsync-append.tmp")
    for mode in ("append", "prezero", "fallocate", "append", "prezero"):
        run(path, mode, n, size)


if __name__ == "__main__":
    main()
