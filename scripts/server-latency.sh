#!/usr/bin/env bash
# How long state reports take inside the server at one scale size, from
# the server's own histograms, to tell server time from the load
# generator's and the network's.
#
# Runs `taskgate-bench --scenarios scale` at SIZE allocations with a
# 60-second window, waits until registration and warm-up are over (the
# store's last index reaches 3 × SIZE), then reads /metrics at the start
# and the end of SECS seconds and prints, for the window: the share of
# `PUT .../tasks/{task}/state` requests at or under each bucket of
# taskgate_http_request_duration_seconds, and the store's commits (mean
# duration, changes per commit, share at or under each bucket) and the
# checkpoints that finished in it.
#
# Compare two sizes: scripts/server-latency.sh 1000; scripts/server-latency.sh 1000000
# usage: scripts/server-latency.sh SIZE [SECS=20] [OUT=/tmp/latency-SIZE]
# needs: curl, ss (iproute2), python3, a release build
set -euo pipefail
size=${1:?usage: $0 SIZE [SECS] [OUT]}
secs=${2:-20}
out=${3:-/tmp/latency-$size}
. "$(dirname "$0")/scale-window.sh"
start_scale_window "$size" "$out"

curl -sf "http://$addr/metrics" >"$out.m0"
sleep "$secs"
curl -sf "http://$addr/metrics" >"$out.m1"

python3 - "$out" "$size" <<'PY'
import re, sys
out, size = sys.argv[1], sys.argv[2]
def read(path):
    d = {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        k, v = line.rsplit(" ", 1)
        d[k] = float(v)
    return d
a, b = read(out + ".m0"), read(out + ".m1")
def window(family, match):
    rows = {}
    for k, v in b.items():
        if k.startswith(family) and match in k:
            rows[k] = v - a.get(k, 0.0)
    return rows
def count_sum(rows, family):
    # A histogram's observations and their total over the window.
    count = sum(v for k, v in rows.items() if k.startswith(family + "_count"))
    total = sum(v for k, v in rows.items() if k.startswith(family + "_sum"))
    return count, total
def le(k):
    m = re.search(r'le="([^"]+)"', k).group(1)
    return float("inf") if m == "+Inf" else float(m)
def report(title, family, match):
    rows = window(family, match)
    buckets = {}
    for k, v in rows.items():
        if "_bucket" in k:
            buckets[le(k)] = buckets.get(le(k), 0.0) + v
    count, total = count_sum(rows, family)
    if not count:
        print(f"{title}: none in the window")
        return
    print(f"{title}: {count:.0f} in the window, mean {1e3 * total / count:.3f} ms")
    top = buckets[float("inf")]
    for bound in sorted(buckets):
        if bound != float("inf") and bound <= 0.1:
            print(f"  <= {bound * 1e3:g} ms: {100 * buckets[bound] / top:.2f}%")
print(f"{size} allocations")
report("state reports (server side)", "taskgate_http_request_duration_seconds",
       'route="/v1/allocations/{alloc_id}/tasks/{task}/state"')
report("store commits", "taskgate_store_commit_duration_seconds", "")
family = "taskgate_store_commit_batch_size"
n, s = count_sum(window(family, ""), family)
if n:
    print(f"  {s / n:.1f} changes per commit")
family = "taskgate_store_checkpoint_duration_seconds"
done, took = count_sum(window(family, ""), family)
print(f"checkpoints finished in the window: {done:.0f}, {took:.2f} s in all")
PY
