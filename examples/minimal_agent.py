#!/usr/bin/env python3
"""The smallest complete taskgate agent (docs/agent-protocol.md): one task,
standard library only. Usage: minimal_agent.py SERVER ALLOC TASK -- CMD...
(TASKGATE_TOKEN in the environment if the server needs one)."""
import json, os, subprocess, sys, time, urllib.error, urllib.request, uuid

server, alloc, task, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5:]
base = f"{server}/v1/allocations/{alloc}/tasks/{task}"
token = os.environ.pop("TASKGATE_TOKEN", None)  # never passed to the workload


def call(method, url, body=None, key=None):
    """Sends until the server answers; returns (status, JSON or None)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token: headers["Authorization"] = f"Bearer {token}"
    if key: headers["Idempotency-Key"] = key  # the same on every retry
    data = json.dumps(body).encode() if body is not None else None
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=90) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            problem = json.loads(e.read() or b"{}")
            if e.code < 500 and e.code != 429:
                return e.code, problem  # final: 404/410 gone, 409 task_lost, 4xx a bug
        except OSError:
            pass  # unreachable: retry
        time.sleep(1)


def report(state, failed=False):
    status, body = call("PUT", f"{base}/state", {"state": state, "failed": failed}, str(uuid.uuid4()))
    if status != 200: sys.exit(f"{task}: report refused: {status} {body.get('code')}")


report("pending")
while True:  # the long-poll: may I start?
    status, sc = call("GET", f"{base}/start-condition?wait=60s")
    if status != 200: sys.exit(f"{task}: {status} {sc.get('code')}")
    if sc["desired"] == "stop": report("dead"); sys.exit(0)
    if sc["allowed"]: break
proc = subprocess.Popen(cmd)
report("running")
_, view = call("GET", base)
ttl = view["liveness"] and float(view["liveness"]["ttl"].rstrip("s"))  # "30s" in this sketch
index, beat = view["modify_index"], time.monotonic()
while proc.poll() is None:  # watch for stop orders; heartbeat within the TTL
    status, view = call("GET", f"{base}?index={index}&wait=1s")
    if status != 200: proc.kill(); sys.exit(f"{task}: {status} {view.get('code')}")
    index = view["modify_index"]
    if view["desired"] == "stop": proc.terminate(); proc.wait(); break
    if ttl and time.monotonic() - beat > ttl / 3:
        status, _ = call("PUT", f"{base}/heartbeat")
        if status == 409: proc.kill(); sys.exit(f"{task}: declared lost")
        beat = time.monotonic()
report("dead", failed=proc.wait() not in (0, -15))
