#!/usr/bin/env python3
"""How long removing a large file holds up small durable appends nearby.

A checkpoint at a million allocations replaces a ~780 MB snapshot and ~200
MB of log segments while the store's writer appends and fdatasyncs. This
writes a file of SIZE MiB (synced), then, while a thread appends 2,000
bytes and fdatasyncs in a loop on another file in the same directory,
removes the big file either at once (`unlink`) or cut back STEP MiB at a
time with PAUSE ms between slices before the unlink (`slices`, what
`wal::remove_gently` does). Prints the removal's wall time and the
appends' p50, p99 and max latency around it, for each mode in turn.

usage: scripts/remove-stall.py [DIR=.] [SIZE=780] [STEP=16] [PAUSE=5] [ROUNDS=2]
"""

import os
import sys
import threading
import time


def run(directory, mode, size_mib, step_mib, pause_ms):
    big = os.path.join(directory, "remove-stall.big")
    with open(big, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size_mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    log_path = os.path.join(directory, "remove-stall.log")
    latencies = []
    stop = threading.Event()

    def appender():
        with open(log_path, "ab") as log:
            while not stop.is_set():
                t = time.perf_counter()
                log.write(b"x" * 2000)
                log.flush()
                os.fdatasync(log.fileno())
                latencies.append(time.perf_counter() - t)

    thread = threading.Thread(target=appender)
    thread.start()
    time.sleep(1.0)  # appends before the removal, for the baseline
    started = time.perf_counter()
    if mode == "slices":
        fd = os.open(big, os.O_RDWR)
        length = os.fstat(fd).st_size
        while length > step_mib << 20:
            length -= step_mib << 20
            os.ftruncate(fd, length)
            time.sleep(pause_ms / 1000)
        os.close(fd)
    os.unlink(big)
    took = time.perf_counter() - started
    time.sleep(1.5)  # and after, while the file system catches up
    stop.set()
    thread.join()
    os.unlink(log_path)
    latencies.sort()
    n = len(latencies)
    ms = lambda q: latencies[min(n - 1, int(n * q))] * 1e3
    print(f"{mode:7} removal {took * 1e3:7.1f} ms; {n} appends: "
          f"p50 {ms(0.5):.2f} ms, p99 {ms(0.99):.2f} ms, max {latencies[-1] * 1e3:.2f} ms")


def main():
    args = sys.argv[1:]
    if args and args[0] in ("-h", "--help"):
        sys.exit(__doc__)
    directory = args[0] if len(args) > 0 else "."
    size, step, pause, rounds = (int(a) for a in (args[1:] + ["780", "16", "5", "2"][len(args[1:]):]))
    for _ in range(rounds):
        for mode in ("unlink", "slices"):
            run(directory, mode, size, step, pause)


if __name__ == "__main__":
    main()
