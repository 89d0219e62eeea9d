#!/usr/bin/env bash
# A runnable demo: a taskgate server and one `taskgate agent` per task of the
# five-task example, each running a small shell command. Prints the order in
# which the tasks ran and each agent's exit code, then stops the server.
#
#   cargo build --release && examples/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/taskgate}
[ -x "$BIN" ] || { echo "build first: cargo build --release"; exit 1; }
PORT=${PORT:-18480}
SERVER=http://127.0.0.1:$PORT
DIR=$(mktemp -d)
trap 'kill "$SERVER_PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT

"$BIN" serve --in-memory --listen "127.0.0.1:$PORT" --log warn >"$DIR/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do "$BIN" health --server "$SERVER" 2>/dev/null && break; sleep 0.1; done

cat >"$DIR/spec.json" <<'JSON'
{"tasks": [
  {"name": "init",     "lifecycle": {"hook": "prestart"}},
  {"name": "proxy",    "lifecycle": {"hook": "prestart", "sidecar": true}},
  {"name": "web",      "leader": true},
  {"name": "announce", "lifecycle": {"hook": "poststart"}},
  {"name": "cleanup",  "lifecycle": {"hook": "poststop"}}
]}
JSON

log() { echo "echo \"\$(date +%T.%3N) $1\" >> $DIR/log"; }
run_agent() {
  local task=$1 cmd=$2
  "$BIN" agent --server "$SERVER" --alloc demo --task "$task" --register "$DIR/spec.json" \
    -- sh -c "$cmd" 2>>"$DIR/agents.log" &
  PIDS+=("$!"); TASKS+=("$task")
}
PIDS=(); TASKS=()
run_agent init     "$(log 'init: preparing config'); echo ready > $DIR/config; sleep 0.3; $(log 'init: done')"
run_agent proxy    "$(log 'proxy: sidecar up'); exec sleep 600"
run_agent web      "$(log "web: started, config says \$(cat $DIR/config)"); sleep 1; $(log 'web: finished')"
run_agent announce "$(log 'announce: web is running')"
run_agent cleanup  "$(log 'cleanup: everything else has stopped')"

for i in "${!PIDS[@]}"; do
  code=0; wait "${PIDS[$i]}" || code=$?
  echo "agent ${TASKS[$i]} exited with $code" >>"$DIR/exits"
done
echo "== what ran, in order"
sed 's/^/  /' "$DIR/log"
echo "== agents"
sed 's/^/  /' "$DIR/exits"
echo "== proxy's events (stopped by the server once web was done)"
curl -s "$SERVER/v1/allocations/demo/tasks/proxy" | python3 -c \
  'import json,sys; print("  " + ", ".join(e["type"] + (": " + e["message"] if e["message"] else "") for e in json.load(sys.stdin)["events"]))'
