"""Schemathesis hooks for taskgate's contract run.

Two things JSON Schema cannot say, so positive test cases that break them
would be rightly rejected (400) and counted as "schema-valid request
rejected"; this hook keeps such bodies out of generation:

- the task names of a registration are unique (tests/hostile.rs covers
  duplicate names);
- `readiness` only on a prestart sidecar or a main task, and `ready: true`
  only with `state: running` for a task that declares readiness
  (docs/lifecycle.md, Readiness and Runs; tests/api.rs and tests/runs.rs
  cover the 400s): a generated report never says `ready: true`, since
  whether the task it lands on declares readiness is not in the report;
- a duration (a stage deadline, a liveness TTL, a barrier's timeout) is a number with a unit
  within its range, which the schema's `string` cannot say
  (tests/api.rs covers the 400s);
- a dependency on a task of the same allocation (no `allocation`) must
  name another task of it, of an earlier stage, with a condition that can
  hold (docs/lifecycle.md, Dependencies; tests/api.rs covers each 400):
  generated bodies keep only dependencies on other allocations;
- an event's size limits count UTF-8 bytes (the fields' descriptions say
  so: message 4 KiB, detail keys 128 bytes, values 1 KiB, the whole event
  8 KiB), while `maxLength` counts characters, so a string of multibyte
  characters within `maxLength` can be over them (tests/api.rs covers the
  limits).

And one thing no schema can say: an `Idempotency-Key` names one request,
so a key generated again for another request is rightly 422
`idempotency_key_reused` (tests/api.rs covers it); every generated key is
made unique here.
"""

import re
import uuid

import schemathesis

MAX_MESSAGE = 4096
MAX_KEY = 128
MAX_VALUE = 1024
MAX_EVENT = 8192


def utf8(s):
    # Generated strings may hold lone surrogates: counted as the 3 bytes
    # each takes in JSON's escape, which the server never accepts anyway.
    return len(s.encode("utf-8", "surrogatepass"))


def event_fits(event):
    if not isinstance(event, dict):
        return True
    total = 0
    for field in ("type", "message"):
        value = event.get(field)
        if isinstance(value, str):
            total += utf8(value)
    message = event.get("message")
    if isinstance(message, str) and utf8(message) > MAX_MESSAGE:
        return False
    details = event.get("details")
    if isinstance(details, dict):
        for key, value in details.items():
            if utf8(key) > MAX_KEY:
                return False
            if isinstance(value, str):
                if utf8(value) > MAX_VALUE:
                    return False
                total += utf8(value)
            total += utf8(key)
    return total <= MAX_EVENT


def events_fit(body):
    """Every event of a report, a batch report or a restore."""
    if not isinstance(body, dict):
        return True
    if not event_fits(body.get("event")):
        return False
    tasks = body.get("tasks")
    if isinstance(tasks, dict):
        return all(
            event_fits(report.get("event"))
            for report in tasks.values()
            if isinstance(report, dict)
        )
    return True


def readiness_fits(task):
    """A registered task declares readiness only where it means something."""
    if not isinstance(task, dict) or task.get("readiness") is not True:
        return True
    lifecycle = task.get("lifecycle")
    if lifecycle is None:
        return True
    return (
        isinstance(lifecycle, dict)
        and lifecycle.get("hook") == "prestart"
        and lifecycle.get("sidecar") is True
    )


def ready_fits(report):
    """`ready: true` is refused for a task without readiness, which a
    generated report cannot know: none is generated."""
    return not isinstance(report, dict) or report.get("ready") is not True


def readiness_rules_hold(body):
    if not isinstance(body, dict):
        return True
    tasks = body.get("tasks")
    if isinstance(tasks, list) and not all(readiness_fits(t) for t in tasks):
        return False
    if isinstance(tasks, dict) and not all(ready_fits(r) for r in tasks.values()):
        return False
    return ready_fits(body)


UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def seconds(text):
    """A duration's seconds, or None if it is not one."""
    if not isinstance(text, str) or not text:
        return None
    total, at = 0.0, 0
    for m in DURATION.finditer(text):
        if m.start() != at:
            return None
        total += float(m.group(1)) * UNITS[m.group(2)]
        at = m.end()
    return total if at == len(text) else None


def within(text, low, high):
    s = seconds(text)
    return s is not None and low <= s <= high


def durations_fit(body):
    """Stage deadlines and barrier timeouts within 1 s to 7 days, liveness
    TTLs and a semaphore's grant timeout within 1 s to 24 h."""
    if not isinstance(body, dict):
        return True
    if body.get("grant_timeout") is not None and not within(body["grant_timeout"], 1, 86400):
        return False
    deadlines = body.get("deadlines")
    if isinstance(deadlines, dict):
        for value in deadlines.values():
            if value is not None and not within(value, 1, 7 * 86400):
                return False
    tasks = body.get("tasks")
    if isinstance(tasks, list):
        for t in tasks:
            liveness = t.get("liveness") if isinstance(t, dict) else None
            if isinstance(liveness, dict) and not within(liveness.get("ttl"), 1, 86400):
                return False
            barrier = t.get("barrier") if isinstance(t, dict) else None
            if (
                isinstance(barrier, dict)
                and barrier.get("timeout") is not None
                and not within(barrier["timeout"], 1, 7 * 86400)
            ):
                return False
    return True


def dependencies_fit(body):
    """Only dependencies on other allocations (see the module's doc)."""
    if not isinstance(body, dict) or not isinstance(body.get("tasks"), list):
        return True
    for t in body["tasks"]:
        deps = t.get("depends_on") if isinstance(t, dict) else None
        if isinstance(deps, list):
            for d in deps:
                if isinstance(d, dict) and d.get("allocation") is None:
                    return False
    return True


def body_fits(body):
    if isinstance(body, dict) and isinstance(body.get("tasks"), list):
        names = [t.get("name") for t in body["tasks"] if isinstance(t, dict)]
        names = [n for n in names if isinstance(n, str)]
        if len(names) != len(set(names)):
            return False
        # A task names each semaphore it acquires once.
        for t in body["tasks"]:
            acquire = t.get("acquire") if isinstance(t, dict) else None
            if isinstance(acquire, list) and len(acquire) != len(set(map(str, acquire))):
                return False
    return (
        readiness_rules_hold(body)
        and events_fit(body)
        and durations_fit(body)
        and dependencies_fit(body)
    )


@schemathesis.hook
def filter_body(ctx, body):
    return body_fits(body)


def names_itself(case):
    """A dependency naming the allocation being registered is one on its own
    task, which must then exist: a generated one does not."""
    own = (case.path_parameters or {}).get("alloc_id")
    body = case.body
    if own is None or not isinstance(body, dict) or not isinstance(body.get("tasks"), list):
        return False
    for t in body["tasks"]:
        deps = t.get("depends_on") if isinstance(t, dict) else None
        if isinstance(deps, list) and any(
            isinstance(d, dict) and d.get("allocation") == own for d in deps
        ):
            return True
    return False


# The coverage phase applies case hooks, not body hooks.
@schemathesis.hook
def filter_case(ctx, case):
    return body_fits(case.body) and not names_itself(case)


def unique_key(headers):
    """A generated Idempotency-Key, replaced by one no other case has."""
    if isinstance(headers, dict):
        for name in list(headers):
            if name.lower() == "idempotency-key":
                headers[name] = uuid.uuid4().hex
    return headers


@schemathesis.hook
def map_headers(ctx, headers):
    return unique_key(headers)


@schemathesis.hook
def map_case(ctx, case):
    unique_key(case.headers)
    return case
