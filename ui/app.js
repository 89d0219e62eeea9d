// taskgate web view: the allocation list (/ui), one allocation
// (/ui/allocations/{id}), the semaphores (/ui/semaphores), one semaphore
// (/ui/semaphores/{name}) and one barrier (/ui/barriers/{name}), over the
// same HTTP API as curl and the CLI. Pages update live: the list follows
// the event stream (GET /v1/events), an allocation's page its blocking
// query (and those of the semaphores its tasks are in line for and of the
// barriers they gather at), a semaphore's or a barrier's page its blocking
// query; nothing polls on a timer. The semaphore list is read once (no
// stream carries semaphores). The token lives in this tab's session
// storage only.

const TOKEN_KEY = "taskgate-token";
const PER_PAGE = 50;
const WAIT = "300s";
/** Semaphores and barriers an allocation's page follows at most, besides
 * the allocation: each is a blocking query held open, and a browser keeps
 * only six connections to a server. */
const MAX_FOLLOWED = 3;
/** Queue entries a semaphore's page shows at most. */
const QUEUE_SHOWN = 200;
/** The six stages, in lifecycle order, with the names operators use. */
const STAGES = [
  ["prestart_ephemeral", "Prestart"],
  ["prestart_sidecar", "Prestart sidecars"],
  ["main", "Main"],
  ["poststart_ephemeral", "Poststart"],
  ["poststart_sidecar", "Poststart sidecars"],
  ["poststop", "Poststop"],
];

const $ = (id) => document.getElementById(id);

/** An element with attributes (on* are listeners) and children. */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(extra = {}) {
  const t = token();
  return t ? { ...extra, Authorization: `Bearer ${t}` } : extra;
}

class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.code = problem.code || "";
  }
}

/** One API call: `{data, index, next}`, or an ApiError with the problem. */
async function api(path, { method = "GET", body, signal } = {}) {
  const res = await fetch(path, {
    method,
    signal,
    headers: headers(body ? { "Content-Type": "application/json" } : {}),
    body: body ? JSON.stringify(body) : undefined,
  });
  if (!res.ok) {
    let problem = {};
    try {
      problem = await res.json();
    } catch {
      // not a problem document
    }
    throw new ApiError(res.status, problem);
  }
  const index = res.headers.get("X-Taskgate-Index");
  return {
    data: res.status === 204 ? null : await res.json(),
    index: index === null ? null : Number(index),
    next: res.headers.get("X-Taskgate-NextToken"),
  };
}

/** Reads the event stream from `index`, calling `onLine` per line, until
 *  it ends (the server stopped) or `signal` aborts. */
async function follow(index, prefix, signal, onLine) {
  const q = new URLSearchParams({ index: String(index) });
  if (prefix) q.set("prefix", prefix);
  const res = await fetch(`/v1/events?${q}`, { headers: headers(), signal });
  if (!res.ok) throw new ApiError(res.status, await res.json().catch(() => ({})));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (line) onLine(JSON.parse(line));
      }
    }
  } finally {
    // `onLine` may stop the reading (a resync): close the connection.
    reader.cancel().catch(() => {});
  }
}

function say(text) {
  $("status").textContent = text;
}

function fail(e) {
  if (e.name === "AbortError") return;
  let text = e.message;
  if (e.status === 401) text = `${text}. Enter a token above (a reader token to look, an operator token to act).`;
  if (e.status === 403) text = `${text}. This needs another token (restarting and deleting need an operator token).`;
  $("error").textContent = text;
}

function clearError() {
  $("error").textContent = "";
}

/** Resolves true if the operator confirms `text` in the dialog. */
function confirmed(title, text) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
  });
}

const when = (t) => (t ? new Date(t).toLocaleString() : "—");

function byState(tasks) {
  const counts = {};
  for (const t of tasks) counts[t.state] = (counts[t.state] || 0) + 1;
  return ["running", "pending", "dead"]
    .filter((s) => counts[s])
    .map((s) => `${counts[s]} ${s}`)
    .join(" · ");
}

/** What the coordinator waits for, as words ("web to be running"), not as
 * states: tasks waited on for the same thing together, in order. */
const AWAITED = {
  pending: "to report pending",
  success: "to succeed",
  running: "to be running",
  ready: "to be ready",
  dead: "to end",
};

function waitingText(a) {
  if (!a.waiting_on.length) return "nothing";
  const groups = new Map();
  a.waiting_on.forEach((name, i) => {
    const what = AWAITED[a.waiting[i]] || a.waiting[i];
    if (!groups.has(what)) groups.set(what, []);
    groups.get(what).push(name);
  });
  return [...groups]
    .map(([what, names]) => (what === "dependency" ? `the dependencies of ${names.join(", ")}` : `${names.join(", ")} ${what}`))
    .join("; ");
}

// ---------------------------------------------------------------- the list

/** The trouble kinds each list filter selects (the server's `state=`). */
const TROUBLE_OF = { failed: ["lost", "failed", "past_deadline"], lost: ["lost"], blocked: ["stuck", "blocked"] };
const LIST_STATES = ["running", "finished", "failed", "lost", "blocked"];
const finishedAll = (a) => a.tasks.every((t) => t.state === "dead");
/** Whether the allocation's stop order is in force: its tasks but the
 * poststop ones are told to stop (a lost task's own "Agent Lost" aside). */
const stopOrdered = (a) => a.tasks.some((t) => t.stage !== "poststop" && !t.lost && t.desired === "stop");

/** Whether `a` is in the list filter `state` (empty: every allocation),
 * as the server decides it: so a change joins a filtered page live. */
function inState(a, state) {
  if (!state) return true;
  return state.split(",").some((s) =>
    s === "running" ? !finishedAll(a) : s === "finished" ? finishedAll(a) : a.trouble.some((t) => (TROUBLE_OF[s] || []).includes(t.kind)),
  );
}

function listRow(a) {
  const trouble = a.trouble.map((t) => t.kind);
  return h(
    "tr",
    { "data-id": a.id, "data-trouble": trouble[0] },
    h("td", {}, h("a", { href: `/ui/allocations/${encodeURIComponent(a.id)}` }, a.id)),
    h("td", { class: "state" }, finishedAll(a) ? "finished" : a.coordinator_state),
    h("td", { class: "trouble" }, trouble.length ? trouble.join(", ") : "—"),
    h("td", { class: "tasks" }, byState(a.tasks)),
    h("td", { class: "waiting" }, waitingText(a)),
    h("td", { class: "num" }, `${when(a.modified_at)} (index ${a.modify_index})`),
  );
}

async function listPage(page, signal) {
  const params = new URLSearchParams(location.search);
  const prefix = params.get("prefix") || "";
  const state = params.get("state") || "";
  const from = params.get("next_token") || "";
  const q = new URLSearchParams({ per_page: String(PER_PAGE) });
  if (prefix) q.set("prefix", prefix);
  if (state) q.set("state", state);
  if (from) q.set("next_token", from);
  /** The list's address with these parameters (empty ones left out). */
  const listUrl = (more = {}) => {
    const n = new URLSearchParams();
    for (const [k, v] of Object.entries({ prefix, state, ...more })) if (v) n.set(k, v);
    return `/ui${n.size ? `?${n}` : ""}`;
  };

  const filter = h(
    "form",
    { role: "search", onsubmit: (e) => {
      e.preventDefault();
      const f = new FormData(e.target);
      navigate(listUrl({ prefix: f.get("prefix"), state: f.get("state") }));
    } },
    h("label", { for: "prefix" }, "ID prefix"),
    h("input", { id: "prefix", name: "prefix", value: prefix, spellcheck: "false" }),
    h("label", { for: "state-filter" }, "State"),
    h(
      "select",
      { id: "state-filter", name: "state" },
      h("option", { value: "" }, "any"),
      LIST_STATES.map((s) => h("option", { value: s, selected: s === state }, s)),
    ),
    h("button", { type: "submit" }, "Filter"),
  );
  const body = h("tbody");
  const table = h(
    "div",
    // Scrolls sideways on a phone: focusable, so keys scroll it too.
    { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Allocations, scrollable" },
    h(
      "table",
      { "aria-label": "Allocations" },
      h("thead", {}, h("tr", {}, ["ID", "Coordinator", "Trouble", "Tasks", "Waiting on", "Last change"].map((c) => h("th", { scope: "col" }, c)))),
      body,
    ),
  );
  page.replaceChildren(h("h1", {}, "Allocations"), filter, table);

  const listed = await api(`/v1/allocations?${q}`, { signal });
  const views = new Map();
  await Promise.all(
    listed.data.map(async (item) => {
      try {
        views.set(item.id, (await api(`/v1/allocations/${encodeURIComponent(item.id)}`, { signal })).data);
      } catch (e) {
        if (e.status !== 404) throw e; // deleted since it was listed
      }
    }),
  );
  const next = listed.next;
  // The page shows the IDs from where the server started it (`from`, or
  // the prefix on the first page) up to the next page's first: a new
  // allocation in that range, or one there that comes to match the
  // filter, joins it live.
  const first = from || prefix;
  const inPage = (id) => id >= first && (!next || id < next) && id.startsWith(prefix);
  // A filtered page keeps what it shows, and takes in what comes to match.
  const joins = (a) => views.has(a.id) || (inPage(a.id) && inState(a, state));
  const render = () => {
    const ids = [...views.keys()].sort();
    body.replaceChildren(...ids.map((id) => listRow(views.get(id))));
    if (!ids.length) body.append(h("tr", {}, h("td", { colspan: 6 }, next ? "None on this page: see the next." : "No allocations.")));
  };
  render();
  const pager = h("nav", { class: "pager", "aria-label": "Pages" });
  if (from) pager.append(h("a", { href: listUrl() }, "First page"));
  if (next) pager.append(h("a", { href: listUrl({ next_token: next }) }, "Next page"));
  page.append(pager);
  say(`${views.size} shown; following changes live.`);

  let index = listed.index ?? 0;
  for (;;) {
    try {
      await follow(index, prefix, signal, (line) => {
        if (line.type === "Resync") {
          // Too far behind (or the server restarted): list again.
          throw new Resync();
        }
        if (line.index) index = line.index;
        if (line.type === "Allocation" && joins(line.allocation)) {
          views.set(line.alloc_id, line.allocation);
          render();
          say(`Updated ${line.alloc_id} (index ${line.index}).`);
        } else if (line.type === "AllocationDeleted" && views.delete(line.alloc_id)) {
          render();
          say(`${line.alloc_id} was deleted (index ${line.index}).`);
        }
      });
    } catch (e) {
      if (e instanceof Resync) return listPage(page, signal);
      throw e;
    }
    // The stream ended: the server is stopping or restarting.
    say("The server closed the stream; reconnecting…");
    await reconnectDelay(signal);
  }
}

class Resync extends Error {}

/** A second before reconnecting a stream the server ended. */
function reconnectDelay(signal) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, 1000);
    signal.addEventListener("abort", () => {
      clearTimeout(t);
      reject(new DOMException("aborted", "AbortError"));
    });
  });
}

// ---------------------------------------------------------- one allocation

/** Text whose `quoted` parts are commands, with those parts as code. */
const withCode = (s) => s.split("`").map((part, i) => (i % 2 ? h("code", {}, part) : part));

/** What is wrong and what to do, above everything else; nothing when
 * nothing is. */
function banner(a) {
  if (!a.trouble.length) return null;
  return h(
    "section",
    { id: "trouble", class: "banner", "data-kind": a.trouble[0].kind, "aria-label": "Trouble" },
    a.trouble.map((t) =>
      h(
        "div",
        { "data-kind": t.kind },
        h("p", {}, h("strong", {}, t.kind.replace("_", " ")), `: ${t.message}.`),
        h("p", { class: "next" }, "What to do: ", withCode(t.next_step), "."),
      ),
    ),
  );
}

function taskCard(a, t, act, barriers) {
  const r = t.stop_reason;
  const named = r && (r.task || r.stage || r.barrier);
  const desired =
    t.desired === "stop"
      ? h("span", { class: "stop" }, `stop: ${r ? r.type : ""}${named ? ` (${named})` : ""}`)
      : "run";
  const finished = a.coordinator_state === "poststop";
  return h(
    "article",
    { class: "task", "data-task": t.name, "aria-label": `Task ${t.name}` },
    h("h4", {}, t.name, t.leader ? h("span", { class: "badge" }, "leader") : null),
    h(
      "dl",
      {},
      h("dt", {}, "State"),
      h(
        "dd",
        { class: `state${t.failed ? " failed" : ""}` },
        t.lost ? "lost (no sign of life within its TTL)" : t.state + (t.failed ? " (failed)" : ""),
      ),
      t.run ? [h("dt", {}, "Run"), h("dd", { class: "run" }, t.run)] : null,
      t.readiness ? [h("dt", {}, "Ready"), h("dd", { class: "ready" }, t.ready ? "ready" : "not ready")] : null,
      t.depends_on && t.depends_on.length
        ? [h("dt", {}, "Depends on"), h("dd", { class: "depends" }, dependencyList(a, t))]
        : null,
      t.acquire && t.acquire.length
        ? [h("dt", {}, "Semaphores"), h("dd", { class: "semaphores" }, semaphoreList(t))]
        : null,
      t.barrier ? [h("dt", {}, "Barrier"), h("dd", { class: "barrier" }, barrierStanding(a, t, barriers.get(t.barrier.name)))] : null,
      t.liveness
        ? [
            h("dt", {}, "Liveness"),
            h("dd", { class: "liveness" }, `TTL ${t.liveness.ttl}${t.last_seen ? `, last seen ${when(t.last_seen)}` : ""}`),
          ]
        : null,
      h("dt", {}, "Desired"),
      h("dd", { class: "desired" }, desired),
      h("dt", {}, "Restarts"),
      h("dd", { class: "restarts" }, String(t.restarts)),
    ),
    // Only a running task restarts alone, and nothing restarts once the
    // allocation has finished: the server would refuse.
    t.state === "running" && !finished
      ? h(
          "button",
          { type: "button", class: "restart-task", onclick: () => act("task", t.name) },
          `Restart ${t.name}`,
        )
      : null,
  );
}

/** A task's dependencies: each target (a link to its allocation when it is
 * another one), the condition, and whether it holds now. */
function dependencyList(a, t) {
  return h(
    "ul",
    {},
    t.depends_on.map((d) => {
      const alloc = d.allocation || a.id;
      const blocked = (t.blocked_by || []).find(
        (b) => b.allocation === alloc && b.task === d.task && b.condition === d.condition,
      );
      const target = d.allocation
        ? h("a", { href: `/ui/allocations/${encodeURIComponent(d.allocation)}` }, `${d.allocation}/${d.task}`)
        : d.task;
      const how = blocked
        ? h(
            "span",
            { class: "blocked" },
            ` — not yet: ${blocked.why.replaceAll("_", " ")}${blocked.path ? ` (${blocked.path.join(" → ")})` : ""}`,
          )
        : h("span", { class: "holds" }, " — holds");
      return h("li", {}, target, ` ${d.condition}`, how);
    }),
  );
}

const semaphorePath = (name) => `/v1/semaphores/${encodeURIComponent(name)}`;
const semaphoreHref = (name) => `/ui/semaphores/${encodeURIComponent(name)}`;

/** How a task stands with each semaphore it acquires: held (with its
 * grant's fence), in line (its place), or waiting for it to be created. */
function semaphoreList(t) {
  return h(
    "ul",
    {},
    t.acquire.map((name) => {
      const grant = (t.grants || []).find((g) => g.semaphore === name);
      const waits = (t.blocked_by || []).find((b) => b.semaphore === name);
      const how = grant
        ? h("span", { class: "holds" }, ` — held, fence ${grant.fence}`)
        : waits && waits.why === "queued"
          ? h("span", { class: "blocked" }, ` — queued, position ${waits.position}`)
          : waits && waits.why === "not_registered"
            ? h("span", { class: "blocked" }, " — not registered (an operator creates it)")
            : waits
              ? h("span", { class: "blocked" }, ` — ${waits.why.replaceAll("_", " ")}`)
              : h("span", {}, " — not held");
      return h("li", { "data-semaphore": name }, h("a", { href: semaphoreHref(name) }, name), how);
    }),
  );
}

const barrierPath = (name) => `/v1/barriers/${encodeURIComponent(name)}`;
const barrierHref = (name) => `/ui/barriers/${encodeURIComponent(name)}`;

/** How task `t` of `a` stands at its barrier. From the barrier as read
 * (`b`): an open or timed-out barrier decided for every member, a
 * gathering one says whether this one arrived. Without it (a token that
 * may not read it), from the task's view alone: its `blocked_by` while it
 * gathers or timed out, its gate once it passed; otherwise the view
 * cannot tell a member that passed from one that has not arrived. */
function barrierStanding(a, t, b) {
  const { name, size } = t.barrier;
  const member = b && b.members.find((m) => m.allocation === a.id && m.task === t.name);
  const blocked = (t.blocked_by || []).find((e) => e.barrier === name);
  // Its standing in the barrier's words; null when the view cannot tell.
  let word = null;
  if (b && b.state !== "gathering") word = b.state === "open" ? "passed" : "timed_out";
  else if (member) word = member.standing;
  else if (blocked) word = blocked.why === "gathering" ? "arrived" : blocked.why;
  else if (t.allowed) word = "passed";
  const arrived = member ? b.arrived : blocked && blocked.arrived;
  const how = {
    passed: ["holds", `passed: all ${size} released together`],
    arrived: ["blocked", `gathering: ${arrived} of ${size} arrived`],
    absent: ["blocked", `not arrived yet: ${arrived} of ${size} have`],
    timed_out: ["stop", `timed out before ${size} arrived: it will not start`],
  }[word] || ["", `not waiting at it now (size ${size})`];
  return h("span", { "data-barrier": name }, h("a", { href: barrierHref(name) }, name), h("span", { class: how[0] || null }, ` — ${how[1]}`));
}

/** The barriers some task of `a` names, each once. */
const barrierNames = (a) => [...new Set(a.tasks.filter((t) => t.barrier).map((t) => t.barrier.name))];

/** The semaphores some task of `a` is in line for: their queues move
 * without a new version of the allocation. */
function queuedFor(a) {
  const names = a.tasks.flatMap((t) => (t.blocked_by || []).filter((b) => b.semaphore && b.why === "queued").map((b) => b.semaphore));
  return [...new Set(names)];
}

function lanes(a, act, barriers) {
  return h(
    "section",
    { class: "lanes", "aria-label": "Stages" },
    STAGES.map(([stage, title]) => {
      const tasks = a.tasks.filter((t) => t.stage === stage);
      // A stage's tasks share its gate.
      const open = tasks.some((t) => t.allowed);
      const gate = !tasks.length
        ? h("span", { class: "gate none" }, "no tasks")
        : open
          ? h("span", { class: "gate open" }, "● gate open")
          : h("span", { class: "gate closed" }, "○ gate closed");
      return h(
        "section",
        { class: "lane", "data-stage": stage, "aria-label": `${title} stage` },
        h("h3", {}, title),
        gate,
        tasks.map((t) => taskCard(a, t, act, barriers)),
      );
    }),
  );
}

function timeline(tl) {
  const rows = [...tl.events].reverse().map((e) =>
    h(
      "tr",
      {},
      h("td", { class: "num" }, when(e.time)),
      h("td", { class: "num" }, String(e.index)),
      h("td", {}, e.type),
      h("td", {}, e.task || "—"),
      h("td", {}, e.message, Object.keys(e.details).length
        ? h("div", { class: "details" }, Object.entries(e.details).map(([k, v]) => `${k}=${v}`).join(" "))
        : null),
    ),
  );
  return h(
    "div",
    { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Timeline, scrollable" },
    h(
      "table",
      { "aria-label": "Timeline, newest first", class: "stack" },
      h("thead", {}, h("tr", {}, ["Time", "Index", "Type", "Task", "Message"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows),
    ),
  );
}

async function allocationPage(page, id, signal) {
  const path = `/v1/allocations/${encodeURIComponent(id)}`;
  let a = (await api(path, { signal })).data;
  let tl = (await api(`${path}/events`, { signal })).data;
  // The semaphores and barriers followed: the last index seen of each
  // (by its path), and those that could not be read (a token without the
  // right), not asked again.
  const seen = new Map();
  const unfollowed = new Set();
  const pathOf = { semaphore: semaphorePath, barrier: barrierPath };
  // The barriers its tasks name, as last read; one that cannot be read is
  // left out, and its tasks' standing is told from their own view.
  const readBarriers = async () => {
    const read = new Map();
    for (const name of barrierNames(a)) {
      const p = barrierPath(name);
      if (unfollowed.has(p)) continue;
      try {
        const b = (await api(p, { signal })).data;
        read.set(name, b);
        seen.set(p, b.modify_index);
      } catch (e) {
        if (!(e instanceof ApiError)) throw e;
        if (e.status === 401 || e.status === 403) unfollowed.add(p);
      }
    }
    return read;
  };
  let barriers = await readBarriers();
  const reason = h("input", { id: "reason", name: "reason", placeholder: "why (recorded with the order)" });

  const act = async (what, task) => {
    clearError();
    const why = reason.value.trim();
    const body = what === "task" ? { task } : what === "all" ? { all_tasks: true } : {};
    if (why) body.reason = why;
    const label = {
      task: `Restart task ${task}?`,
      all: "Restart all tasks?",
      running: "Restart the running tasks?",
      stop: `Stop allocation ${id}?`,
      delete: `Delete allocation ${id}?`,
    }[what];
    const text = {
      delete: "Its agents are told it is gone and every wait on it ends.",
      stop: "Every task not yet dead is told to stop; the poststop tasks run as the cleanup, and it ends stopped.",
    }[what] || "The tasks are told to stop and start again; the coordinator follows.";
    if (!(await confirmed(label, text))) return;
    try {
      if (what === "delete") {
        await api(path, { method: "DELETE", signal });
        say(`${id} was deleted.`);
      } else if (what === "stop") {
        await api(`${path}/stop`, { method: "POST", signal });
        say(`${id} was told to stop.`);
      } else {
        const r = await api(`${path}/restart`, { method: "POST", body, signal });
        say(`Told to restart: ${r.data.restarted.join(", ") || "no task"}.`);
      }
    } catch (e) {
      fail(e);
    }
  };

  const render = () => {
    const summary = h(
      "dl",
      { class: "summary" },
      h("dt", {}, "Coordinator"),
      h("dd", { id: "coordinator" }, a.coordinator_state),
      h("dt", {}, "Waiting on"),
      h("dd", { id: "waiting" }, waitingText(a)),
      a.deadline_at ? [h("dt", {}, "Deadline"), h("dd", { id: "deadline" }, `${a.coordinator_state} must end by ${when(a.deadline_at)}`)] : null,
      h("dt", {}, "Outcome"),
      h("dd", {}, a.outcome ? `${a.outcome}${a.failed_tasks.length ? ` (${a.failed_tasks.join(", ")})` : ""}` : "—"),
      h("dt", {}, "Index"),
      h("dd", { id: "index" }, String(a.modify_index)),
      h("dt", {}, "Last change"),
      h("dd", {}, when(a.modified_at)),
    );
    const actions = h(
      "fieldset",
      { class: "actions" },
      h("legend", {}, "Operator actions"),
      h(
        "form",
        { onsubmit: (e) => e.preventDefault() },
        h("label", { for: "reason" }, "Reason"),
        reason,
        // A finished allocation (poststop) restarts no task: the server
        // refuses, so the buttons are not offered.
        a.coordinator_state === "poststop"
          ? null
          : [
              h("button", { type: "button", id: "restart-running", onclick: () => act("running") }, "Restart running tasks"),
              h("button", { type: "button", id: "restart-all", onclick: () => act("all") }, "Restart all tasks"),
            ],
        // Stopping, while it would change something: the server refuses
        // it in poststop, and a stop order in force (its non-poststop
        // tasks told to stop) stays as it is.
        a.coordinator_state === "poststop" || stopOrdered(a)
          ? null
          : h("button", { type: "button", id: "stop", class: "danger", onclick: () => act("stop") }, "Stop allocation"),
        h("button", { type: "button", id: "delete", class: "danger", onclick: () => act("delete") }, "Delete allocation"),
      ),
    );
    page.replaceChildren(
      h("h1", {}, `Allocation ${a.id}`),
      banner(a) || "",
      summary,
      h("h2", {}, "Stages"),
      lanes(a, act, barriers),
      actions,
      h("h2", {}, "Timeline"),
      timeline(tl),
    );
  };
  render();
  say("Following changes live.");
  // A place in a semaphore's queue, and the count of a barrier's arrived,
  // move without a new version of the allocation: the page also waits on
  // the semaphores its tasks are in line for and the barriers they gather
  // at (their last index seen here). A semaphore that moves has the
  // allocation read again (the place is in its view); a barrier that
  // moves is shown as it is now.
  const moved = async (kind, name, round) => {
    const p = pathOf[kind](name);
    try {
      for (;;) {
        const known = seen.get(p) ?? 0;
        // With index 0 it answers at once: the queue may have moved since
        // the allocation was read, so that counts as a move.
        const v = (await api(`${p}?index=${known}&wait=${WAIT}`, { signal: round })).data;
        if (v.modify_index !== known) {
          seen.set(p, v.modify_index);
          return { kind, name, view: v, first: known === 0 };
        }
      }
    } catch (e) {
      if (e.name === "AbortError") throw e;
      if (e.status === 404) {
        // A semaphore deleted: its waiters now wait for it to be created.
        // A barrier forgotten: its last member's allocation is gone.
        seen.delete(p);
        return { kind, name };
      }
      // Refused (a token without the right): not asked again. Unreachable:
      // the allocation's wait fails too, and the next round asks again.
      if (e instanceof ApiError && e.status < 500) unfollowed.add(p);
      return new Promise(() => {}); // the allocation's wait ends the round
    }
  };
  for (;;) {
    let got;
    const round = new AbortController();
    const end = () => round.abort();
    signal.addEventListener("abort", end, { once: true });
    try {
      const waits = [api(`${path}?index=${a.modify_index}&wait=${WAIT}`, { signal: round.signal }).then((r) => ({ allocation: r.data }))];
      const gathering = [...barriers.values()].filter((b) => b.state === "gathering").map((b) => ["barrier", b.name]);
      const followed = [...queuedFor(a).map((n) => ["semaphore", n]), ...gathering].filter(([k, n]) => !unfollowed.has(pathOf[k](n)));
      for (const [kind, name] of followed.slice(0, MAX_FOLLOWED)) waits.push(moved(kind, name, round.signal));
      got = await Promise.race(waits);
      if (got.kind === "semaphore") got.allocation = (await api(path, { signal })).data;
    } catch (e) {
      if (e.status === 410 || e.status === 404) {
        say(`${id} was deleted.`);
        page.querySelectorAll("button").forEach((b) => (b.disabled = true));
        return;
      }
      if (e instanceof ApiError && e.status < 500) throw e;
      // Unreachable or stopping: try again shortly.
      say("The server is not answering; reconnecting…");
      await reconnectDelay(signal);
      continue;
    } finally {
      round.abort();
      signal.removeEventListener("abort", end);
    }
    const next = got.allocation || a;
    const changed = next.modify_index !== a.modify_index;
    if (!changed && !got.kind) continue;
    a = next;
    if (changed) {
      tl = (await api(`${path}/events`, { signal })).data;
      barriers = await readBarriers();
    } else if (got.kind === "barrier") {
      if (got.view) barriers.set(got.name, got.view);
      else barriers.delete(got.name);
    }
    const focused = document.activeElement && document.activeElement.id;
    render();
    if (focused) document.getElementById(focused)?.focus();
    // The first answer of a semaphore only starts following it.
    const what = got.kind === "barrier" ? `barrier ${got.name} changed` : `the queue of ${got.name} moved`;
    if (changed || !got.first) say(changed ? `Updated (index ${a.modify_index}).` : `Updated (${what}).`);
  }
}

// ------------------------------------------------------------ semaphores

function semaphoreRow(s) {
  return h(
    "tr",
    { "data-name": s.name },
    h("td", {}, h("a", { href: semaphoreHref(s.name) }, s.name)),
    h("td", { class: "num limit" }, String(s.limit)),
    h("td", { class: "num held" }, String(s.holders.length)),
    h("td", { class: "num queued" }, String(s.queue.length)),
    h("td", { class: "timeout" }, s.grant_timeout),
  );
}

/** The semaphores, paged by name. Read once: no stream carries them, and
 * each semaphore's own page follows it live. */
async function semaphoreListPage(page, signal) {
  const params = new URLSearchParams(location.search);
  const prefix = params.get("prefix") || "";
  const from = params.get("next_token") || "";
  const q = new URLSearchParams({ per_page: String(PER_PAGE) });
  if (prefix) q.set("prefix", prefix);
  if (from) q.set("next_token", from);
  const listUrl = (more = {}) => {
    const n = new URLSearchParams();
    for (const [k, v] of Object.entries({ prefix, ...more })) if (v) n.set(k, v);
    return `/ui/semaphores${n.size ? `?${n}` : ""}`;
  };
  const filter = h(
    "form",
    { role: "search", onsubmit: (e) => {
      e.preventDefault();
      navigate(listUrl({ prefix: new FormData(e.target).get("prefix") }));
    } },
    h("label", { for: "prefix" }, "Name prefix"),
    h("input", { id: "prefix", name: "prefix", value: prefix, spellcheck: "false" }),
    h("button", { type: "submit" }, "Filter"),
  );
  const body = h("tbody");
  page.replaceChildren(
    h("h1", {}, "Semaphores"),
    h("p", {}, "At most ", h("em", {}, "limit"), " tasks hold each one at once, across allocations; the others wait in line."),
    filter,
    h(
      "div",
      { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Semaphores, scrollable" },
      h(
        "table",
        { "aria-label": "Semaphores" },
        h("thead", {}, h("tr", {}, ["Name", "Limit", "Held", "Queued", "Grant timeout"].map((c) => h("th", { scope: "col" }, c)))),
        body,
      ),
    ),
  );
  const listed = await api(`/v1/semaphores?${q}`, { signal });
  body.replaceChildren(...listed.data.map(semaphoreRow));
  if (!listed.data.length) body.append(h("tr", {}, h("td", { colspan: 5 }, "No semaphores.")));
  const pager = h("nav", { class: "pager", "aria-label": "Pages" });
  if (from) pager.append(h("a", { href: listUrl() }, "First page"));
  if (listed.next) pager.append(h("a", { href: listUrl({ next_token: listed.next }) }, "Next page"));
  page.append(pager);
  say(`${listed.data.length} shown, as of ${new Date().toLocaleTimeString()}; each semaphore's page follows it live.`);
}

function holdersTable(s) {
  if (!s.holders.length) return h("p", { id: "holders" }, "No task holds it.");
  return h(
    "div",
    { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Holders, scrollable" },
    h(
      "table",
      { id: "holders", "aria-label": "Holders" },
      h("thead", {}, h("tr", {}, ["Allocation", "Task", "Run", "Fence", "Since"].map((c) => h("th", { scope: "col" }, c)))),
      h(
        "tbody",
        {},
        s.holders.map((x) =>
          h(
            "tr",
            { "data-allocation": x.allocation, "data-task": x.task },
            h("td", {}, h("a", { href: `/ui/allocations/${encodeURIComponent(x.allocation)}` }, x.allocation)),
            h("td", {}, x.task),
            h("td", { class: "run" }, x.run || "not started"),
            h("td", { class: "num fence" }, String(x.fence)),
            h("td", { class: "num" }, when(x.since)),
          ),
        ),
      ),
    ),
  );
}

function queueTable(s) {
  if (!s.queue.length) return h("p", { id: "queue" }, "No task waits for it.");
  const more = s.queue.length - QUEUE_SHOWN;
  return h(
    "div",
    {},
    h(
      "div",
      { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Queue, scrollable" },
      h(
        "table",
        { id: "queue", "aria-label": "Queue, first in line first" },
        h("thead", {}, h("tr", {}, ["Position", "Allocation", "Task", "In line since"].map((c) => h("th", { scope: "col" }, c)))),
        h(
          "tbody",
          {},
          s.queue.slice(0, QUEUE_SHOWN).map((x, i) =>
            h(
              "tr",
              { "data-allocation": x.allocation, "data-task": x.task },
              h("td", { class: "num position" }, String(i + 1)),
              h("td", {}, h("a", { href: `/ui/allocations/${encodeURIComponent(x.allocation)}` }, x.allocation)),
              h("td", {}, x.task),
              h("td", { class: "num" }, when(x.since)),
            ),
          ),
        ),
      ),
    ),
    more > 0 ? h("p", {}, `… and ${more} more in line (GET /v1/semaphores/${s.name} lists every one).`) : null,
  );
}

async function semaphorePage(page, name, signal) {
  const path = `/v1/semaphores/${encodeURIComponent(name)}`;
  let s = (await api(path, { signal })).data;
  const render = () => {
    const over = s.holders.length > s.limit;
    page.replaceChildren(
      h("h1", {}, `Semaphore ${s.name}`),
      h(
        "dl",
        { class: "summary" },
        h("dt", {}, "Limit"),
        h("dd", { id: "limit" }, String(s.limit)),
        h("dt", {}, "Held"),
        h(
          "dd",
          { id: "held" },
          `${s.holders.length} of ${s.limit}`,
          over ? h("span", { class: "stop" }, " — over the limit: no grant until fewer hold it") : null,
        ),
        h("dt", {}, "Queued"),
        h("dd", { id: "queued" }, String(s.queue.length)),
        h("dt", {}, "Grant timeout"),
        h("dd", { id: "grant-timeout" }, `${s.grant_timeout} (a granted task not running by then goes to the back of the line)`),
        h("dt", {}, "Next fence"),
        h("dd", { id: "next-fence" }, `at least ${s.next_fence}`),
        h("dt", {}, "Index"),
        h("dd", { id: "index" }, String(s.modify_index)),
      ),
      h("h2", {}, "Holders"),
      holdersTable(s),
      h("h2", {}, "Queue"),
      queueTable(s),
    );
  };
  render();
  say("Following changes live.");
  for (;;) {
    let next;
    try {
      next = (await api(`${path}?index=${s.modify_index}&wait=${WAIT}`, { signal })).data;
    } catch (e) {
      if (e.status === 404) {
        say(`${name} was deleted: its holders keep their slots until they end; its waiters wait until it is created again.`);
        return;
      }
      if (e instanceof ApiError && e.status < 500) throw e;
      say("The server is not answering; reconnecting…");
      await reconnectDelay(signal);
      continue;
    }
    if (next.modify_index === s.modify_index) continue;
    s = next;
    render();
    say(`Updated (index ${s.modify_index}).`);
  }
}

// -------------------------------------------------------------- barriers

/** Where a member stands, in words, and how it is marked. */
const MEMBER_STANDING = {
  absent: ["blocked", "not arrived"],
  arrived: ["blocked", "arrived"],
  passed: ["holds", "passed"],
  timed_out: ["stop", "timed out"],
};

/** Milliseconds in a duration as the server writes it (`10m`, `1h30m`,
 * `1.5s`, `500ms`). */
function durationMs(d) {
  const unit = { h: 3_600_000, m: 60_000, s: 1000, ms: 1 };
  return [...d.matchAll(/([\d.]+)(ms|h|m|s)/g)].reduce((ms, [, n, u]) => ms + Number(n) * unit[u], 0);
}

/** What a barrier has come to, in words; while it gathers with a
 * timeout, when it times out (`timeout` after the earliest arrival of
 * those that count now, unless it opens first). */
function barrierState(b) {
  if (b.state === "open") return "open: its members were released together";
  if (b.state === "timed_out") return "timed out: its members' allocations were told to stop";
  const first = b.members.map((m) => m.arrived_at).filter(Boolean).map((t) => new Date(t).getTime());
  const due = b.timeout && first.length ? `; times out at ${when(new Date(Math.min(...first) + durationMs(b.timeout)))} unless ${b.size} arrive by then` : "";
  return `gathering: ${b.arrived} of ${b.size} arrived${due}`;
}

function membersTable(b) {
  return h(
    "div",
    { class: "table-wrap", tabindex: 0, role: "region", "aria-label": "Members, scrollable" },
    h(
      "table",
      { id: "members", "aria-label": "Members, in registration order" },
      h("thead", {}, h("tr", {}, ["Allocation", "Task", "Standing", "Arrived"].map((c) => h("th", { scope: "col" }, c)))),
      h(
        "tbody",
        {},
        b.members.map((m) => {
          const [mark, words] = MEMBER_STANDING[m.standing] || ["", m.standing];
          return h(
            "tr",
            { "data-allocation": m.allocation, "data-task": m.task },
            h("td", {}, h("a", { href: `/ui/allocations/${encodeURIComponent(m.allocation)}` }, m.allocation)),
            h("td", {}, m.task),
            h("td", { class: `standing ${mark}` }, words),
            h("td", { class: "num" }, when(m.arrived_at)),
          );
        }),
      ),
    ),
  );
}

/** One barrier: what it has come to, then its members (at most 1,000,
 * its largest size), live through its blocking query. */
async function barrierPage(page, name, signal) {
  const path = barrierPath(name);
  let b = (await api(path, { signal })).data;
  const render = () => {
    page.replaceChildren(
      h("h1", {}, `Barrier ${b.name}`),
      h("p", {}, "Its members, tasks of any allocations, start together once ", h("em", {}, "size"), " of them may start at the same time; or not at all, if its timeout passes first."),
      h(
        "dl",
        { class: "summary" },
        h("dt", {}, "State"),
        h("dd", { id: "state" }, barrierState(b)),
        h("dt", {}, "Size"),
        h("dd", { id: "size" }, `${b.size} (${b.members.length} registered)`),
        h("dt", {}, "Timeout"),
        h("dd", { id: "timeout" }, b.timeout ? `${b.timeout} from the first arrival` : "none: it may gather for ever"),
        h("dt", {}, "Opened"),
        h("dd", { id: "opened" }, when(b.opened_at)),
        h("dt", {}, "Index"),
        h("dd", { id: "index" }, String(b.modify_index)),
      ),
      h("h2", {}, "Members"),
      membersTable(b),
    );
  };
  render();
  say("Following changes live.");
  for (;;) {
    let next;
    try {
      next = (await api(`${path}?index=${b.modify_index}&wait=${WAIT}`, { signal })).data;
    } catch (e) {
      if (e.status === 404) {
        say(`${name} is forgotten: no registered task names it any more.`);
        return;
      }
      if (e instanceof ApiError && e.status < 500) throw e;
      say("The server is not answering; reconnecting…");
      await reconnectDelay(signal);
      continue;
    }
    if (next.modify_index === b.modify_index) continue;
    b = next;
    render();
    say(`Updated (index ${b.modify_index}).`);
  }
}

// ------------------------------------------------------------------ routing

let running = null;

function navigate(url) {
  history.pushState(null, "", url);
  route();
}

function route() {
  if (running) running.abort();
  running = new AbortController();
  const signal = running.signal;
  clearError();
  say("");
  const page = $("page");
  const path = location.pathname;
  const alloc = path.match(/^\/ui\/allocations\/([^/]+)$/);
  const sem = path.match(/^\/ui\/semaphores\/([^/]+)$/);
  const barrier = path.match(/^\/ui\/barriers\/([^/]+)$/);
  let work;
  if (alloc) {
    work = allocationPage(page, decodeURIComponent(alloc[1]), signal);
    document.title = `${decodeURIComponent(alloc[1])} · taskgate`;
  } else if (sem) {
    work = semaphorePage(page, decodeURIComponent(sem[1]), signal);
    document.title = `Semaphore ${decodeURIComponent(sem[1])} · taskgate`;
  } else if (barrier) {
    work = barrierPage(page, decodeURIComponent(barrier[1]), signal);
    document.title = `Barrier ${decodeURIComponent(barrier[1])} · taskgate`;
  } else if (/^\/ui\/semaphores\/?$/.test(path)) {
    work = semaphoreListPage(page, signal);
    document.title = "Semaphores · taskgate";
  } else {
    work = listPage(page, signal);
    document.title = "Allocations · taskgate";
  }
  work.catch(fail);
}

document.addEventListener("click", (e) => {
  const a = e.target.closest && e.target.closest("a[href^='/ui']");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  e.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", route);

$("token").value = token();
$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  route();
});
$("token-clear").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  $("token").value = "";
  route();
});
route();
