#!/usr/bin/env python3
"""The smallest complete taskgate agent (docs/agent-protocol.md): one task,
standard library only. Usage: minimal_agent.py SERVER ALLOC TASK -- CMD...
(TASKGATE_TOKEN in the environment if the server needs one)."""
import json, os, subprocess, sys, time, urllib.error, urllib.request, uuid

server, alloc, task, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5:]
alloc_url = f"{server}/v1/allocations/{alloc}"
base = f"{alloc_url}/tasks/{task}"
token = os.environ.pop("TASKGATE_TOKEN", None)  # never passed to the workload
run = proc = created = None  # our run once claimed; the workload; the first create_index


def call(method, url, body=None, key=None):
    """Sends until the server answers; returns (status, JSON or None)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token: headers["Authorization"] = f"Bearer {token}"
    if run: headers["Taskgate-Run"] = run  # on every request while our run lasts
    if key: headers["Idempotency-Key"] = key  # the same on every retry
    data = json.dumps(body).encode() if body is not None else None
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=90) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            problem = json.loads(e.read() or b"{}")
            if e.code < 500 and e.code != 429:
                return e.code, problem  # final: 404/410 gone, 409 see the table, 4xx a bug
        except OSError:
            pass  # unreachable: retry
        time.sleep(1)

def end(why, code=1):
    """Kills the workload if it still runs, says why and exits: nothing more is reported."""
    if proc and proc.poll() is None: proc.kill(); proc.wait()
    print(f"{task}: {why}", file=sys.stderr); sys.exit(code)

def get(url):
    status, view = call("GET", url)
    if status != 200: end(f"{status} {view.get('code')}")  # 404/410: the allocation is gone
    return view

def report(state, failed=False, event=None, allow=()):
    """Returns the answer (the allocation view), or the problem of a 409 whose code is in allow."""
    body = {"state": state, "failed": failed, **({"event": event} if event else {})}
    status, answer = call("PUT", f"{base}/state", body, str(uuid.uuid4()))
    if status != 200 and answer.get("code") not in allow:
        end(f"report refused: {status} {answer.get('code')}")  # task_lost, run_superseded, ...
    return answer

def mine(a): return next(t for t in a["tasks"] if t["name"] == task)


pending = False  # True after a restart order: reported pending already, back to step 2
while True:
    if not pending:  # 1. report pending, once no other agent's run holds the task
        a = get(alloc_url)
        while mine(a)["state"] == "running":  # on the allocation: no sign of life for that run
            a = get(f"{alloc_url}?index={a['modify_index']}&wait=60s")
        if report("pending", allow=["task_dead"]).get("code") == "task_dead":
            end("the task is dead and no order reopened it: running nothing", 0)
    while True:  # 2. the long-poll: may I start?
        sc = get(f"{base}/start-condition?wait=60s")
        created = created or sc["create_index"]
        if sc["create_index"] != created: end("the allocation was deleted and registered again")
        if sc["desired"] == "stop": report("dead"); end("told to stop before starting", 0)
        if sc["allowed"]: break
    answer = report("running", allow=["task_claimed"])  # 3. claim the run, then start
    if answer.get("code") == "task_claimed": pending = False; continue  # start nothing
    me = mine(answer)
    run, gen, index = me["run"], me["restart_generation"], me["modify_index"]
    ttl = me["liveness"] and float(me["liveness"]["ttl"].rstrip("s"))  # "30s" in this sketch
    proc = subprocess.Popen(cmd)
    report("running", event={"type": "Started", "details": {"pid": str(proc.pid)}})  # a retry
    order, beat = None, time.monotonic()
    while order is None and proc.poll() is None:  # 4. watch for orders; heartbeat within the TTL
        view = get(f"{base}?index={index}&wait=1s")
        index = view["modify_index"]
        if view["run"] != run: end("our run ended (superseded, lost or deleted)")
        if view["desired"] == "stop": order = "dead"  # told to: not failed
        elif view["restart_generation"] > gen: order = "pending"
        if ttl and time.monotonic() - beat > ttl / 3:
            status, problem = call("PUT", f"{base}/heartbeat")
            if status == 409: end(problem.get("code"))  # task_lost, run_superseded
            beat = time.monotonic()
    if order: proc.terminate(); proc.wait()
    report(order or "dead", failed=order is None and proc.returncode != 0)  # 5. failed unless 0
    if order != "pending": sys.exit(0)
    run, pending = None, True  # a restart order: a new run later, from step 2
