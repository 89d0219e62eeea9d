#!/usr/bin/env bash
# Where the server's time goes at one scale size, per state report.
#
# Runs `taskgate-bench --scenarios scale` at SIZE allocations with a
# 60-second window, waits until registration and warm-up are over (the
# store's last index reaches 3 × SIZE: one change to register each
# allocation, two to warm it up), then for SECS seconds records the server
# with `perf record -F 999 -g` and counts every thread's context switches.
# Writes OUT.data (the profile), OUT.changes (changes committed in the
# window), OUT.switches (voluntary and involuntary switches per change, by
# thread name) and OUT.bench (the benchmark's own report).
#
# Compare two sizes with scripts/perf-growth.py OUT_SMALL OUT_LARGE.
# Environment passes through to the server, e.g.
# TASKGATE_STORE_LOG_LIMIT=8GiB to keep checkpoints out of the window.
#
# usage: scripts/profile-scale.sh SIZE [SECS=20] [OUT=/tmp/profile-SIZE]
# needs: perf (Debian: linux-perf), curl, ss (iproute2), python3, a release build
set -euo pipefail
size=${1:?usage: $0 SIZE [SECS] [OUT]}
secs=${2:-20}
out=${3:-/tmp/profile-$size}
. "$(dirname "$0")/scale-window.sh"
start_scale_window "$size" "$out"

switches() {
    for t in /proc/"$pid"/task/*; do
        printf '%s %s %s\n' "$(tr ' ' _ <"$t/comm")" \
            "$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")" \
            "$(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$t/status")"
    done
}
c0=$(last_index)
switches >"$out.s0"
perf record -F 999 -g -p "$pid" -o "$out.data" -- sleep "$secs" >/dev/null 2>&1
switches >"$out.s1"
c1=$(last_index)
python3 - "$out" "$c0" "$c1" <<'PY'
import sys
out, c0, c1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
changes = c1 - c0
open(out + ".changes", "w").write(f"{changes:.0f}\n")
def read(path):
    by = {}
    for line in open(path):
        name, v, nv = line.split()
        a = by.setdefault(name, [0, 0])
        a[0] += int(v)
        a[1] += int(nv)
    return by
before, after = read(out + ".s0"), read(out + ".s1")
with open(out + ".switches", "w") as f:
    f.write(f"changes {changes:.0f}\nthread voluntary/change involuntary/change\n")
    for name, (v, nv) in sorted(after.items()):
        v0, nv0 = before.get(name, (0, 0))
        f.write(f"{name} {(v - v0) / changes:.3f} {(nv - nv0) / changes:.3f}\n")
PY
wait "$bench" || true
trap - EXIT
echo "$out: $(cat "$out.changes") changes in ${secs}s"
cat "$out.switches"
