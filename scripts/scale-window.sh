# Sourced by profile-scale.sh and server-latency.sh: starts
# `taskgate-bench --scenarios scale` at one size with a 60-second window
# and returns once registration and warm-up are over (the store's last
# index reaches 3 × SIZE: one change to register each allocation, two to
# warm it up), with the server's `pid` and `addr` set.
#
# usage: start_scale_window SIZE OUT   (the bench's report goes to OUT.bench)
# needs: curl, ss (iproute2), python3, a release build

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=./target/release/taskgate-bench
[ -x "$bin" ] || { echo "build first: cargo build --release --locked" >&2; exit 2; }

last_index() {
    curl -sf "http://$addr/metrics" | awk '$1 == "taskgate_last_index" {print $2}'
}

start_scale_window() {
    local size=$1 out=$2
    "$bin" --scenarios scale --scale-sizes "$size" --duration 60s >"$out.bench" 2>&1 &
    bench=$!
    # The bench stops its server when it ends on its own, not when killed:
    # stop both when the caller exits early.
    pid= addr=
    trap 'kill ${pid:-} $bench 2>/dev/null || true' EXIT
    # The server is the bench's child; its address is the port it listens on.
    for _ in $(seq 1 100); do
        pid=$(pgrep -P "$bench" -f "taskgate serve" | head -1 || true)
        if [ -n "$pid" ]; then
            addr=$(ss -ltnpH | grep "pid=$pid," | awk '{print $4}' | head -1 || true)
            [ -n "$addr" ] && break
        fi
        sleep 0.1
    done
    [ -n "$addr" ] || { echo "the server did not start; see $out.bench" >&2; exit 1; }
    # Registration and warm-up: up to 10 minutes, then the window starts.
    local n
    for _ in $(seq 1 6000); do
        n=$(last_index || echo 0)
        python3 -c "import sys; sys.exit(0 if float('$n' or 0) >= 3 * $size else 1)" && break
        sleep 0.1
    done
    sleep 2
}
