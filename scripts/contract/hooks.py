"""Schemathesis hooks for taskgate's contract run.

JSON Schema cannot say that the task names of a registration are unique,
so positive test cases that repeat a name would be rejected (400, as
API.md requires) and counted as "schema-valid request rejected". This hook
keeps such bodies out of generation; tests/hostile.rs covers duplicate names.
"""

import schemathesis


@schemathesis.hook
def filter_body(ctx, body):
    if isinstance(body, dict) and isinstance(body.get("tasks"), list):
        names = [t.get("name") for t in body["tasks"] if isinstance(t, dict)]
        names = [n for n in names if isinstance(n, str)]
        return len(names) == len(set(names))
    return True
