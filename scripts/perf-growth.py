#!/usr/bin/env python3
"""What grows per state report between two scale sizes.

Reads two outputs of scripts/profile-scale.sh (OUT.data and OUT.changes
for each), turns each (thread, symbol) pair's samples into CPU µs per
committed change (samples / 999 Hz / changes), and prints the totals by
thread and the pairs that grew most.

usage: scripts/perf-growth.py OUT_SMALL OUT_LARGE [ROWS=40]
"""

import re
import subprocess
import sys

HZ = 999
LINE = re.compile(r"\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)")


def load(base):
    changes = float(open(base + ".changes").read())
    report = subprocess.run(
        ["perf", "report", "-i", base + ".data", "--stdio", "--no-children",
         "-g", "none", "--sort", "comm,sym", "-n", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout
    per = {}
    for line in report.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        _, samples, comm, _, sym = m.groups()
        key = (comm, sym.strip()[:90])
        per[key] = per.get(key, 0) + int(samples) / HZ / changes * 1e6
    return per


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    small, large = load(sys.argv[1]), load(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    for name, per in ((sys.argv[1], small), (sys.argv[2], large)):
        by = {}
        for (comm, _), us in per.items():
            by[comm] = by.get(comm, 0) + us
        top = sorted(by.items(), key=lambda t: -t[1])[:6]
        print(name, ", ".join(f"{c} {us:.2f}" for c, us in top), "µs/change")
    print(f"\n{'growth':>7} {'small':>7} {'large':>7}  thread          symbol")
    keys = sorted(set(small) | set(large),
                  key=lambda k: -(large.get(k, 0) - small.get(k, 0)))
    for k in keys[:rows]:
        a, b = small.get(k, 0), large.get(k, 0)
        print(f"{b - a:7.2f} {a:7.2f} {b:7.2f}  {k[0][:15]:15} {k[1]}")


if __name__ == "__main__":
    main()
