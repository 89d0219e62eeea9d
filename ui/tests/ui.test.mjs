// The web view in a real browser: Debian's chromium, driven by
// playwright-core, against a real `taskgate serve` with tokens.
//
//   cd ui/tests && npm ci && npm test
//
// TASKGATE_BIN: the server binary (default ../../target/debug/taskgate).
// CHROMIUM: the browser (default /usr/bin/chromium).
// TASKGATE_SCREENSHOTS: where the screenshots go (default
// ../../target/ui-screenshots).

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFile } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const BIN = process.env.TASKGATE_BIN || resolve(here, "../../target/debug/taskgate");
const SHOTS = process.env.TASKGATE_SCREENSHOTS || resolve(here, "../../target/ui-screenshots");
const TOKENS = { reader: "reader-secret", agent: "agent-secret", operator: "operator-secret" };
const AXE = readFileSync(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");
const FIVE = {
  tasks: [
    { name: "init", lifecycle: { hook: "prestart" } },
    { name: "proxy", lifecycle: { hook: "prestart", sidecar: true } },
    { name: "web", leader: true },
    { name: "announce", lifecycle: { hook: "poststart" } },
    { name: "cleanup", lifecycle: { hook: "poststop" } },
  ],
};

let server;
let base;
let browser;

const sha256 = (s) => createHash("sha256").update(s).digest("hex");

/** The names of the semaphores and barriers the tests make. */
const SEMAPHORES = ["ax-", "sp-", "ap-", "ls-", "bp-", "ab-"];

before(async () => {
  mkdirSync(SHOTS, { recursive: true });
  const dir = mkdtempSync(join(tmpdir(), "taskgate-ui-"));
  const file = join(dir, "tokens.json");
  writeFileSync(
    file,
    JSON.stringify({
      tokens: [
        // The semaphores and barriers the tests make (a token reads,
        // acquires and joins only those within its semaphore_prefixes).
        { name: "reader", role: "reader", sha256: sha256(TOKENS.reader), semaphore_prefixes: SEMAPHORES },
        { name: "agent", role: "agent", sha256: sha256(TOKENS.agent), semaphore_prefixes: SEMAPHORES },
      ],
    }),
  );
  server = spawn(BIN, ["serve", "--in-memory", "--listen", "127.0.0.1:0", "--log", "info", "--token-file", file], {
    env: { ...process.env, TASKGATE_OPERATOR_TOKEN: TOKENS.operator },
    stdio: ["ignore", "pipe", "inherit"],
  });
  base = await new Promise((ok, fail) => {
    let out = "";
    const timer = setTimeout(() => fail(new Error(`no address logged: ${out}`)), 30_000);
    server.stdout.on("data", (chunk) => {
      out += chunk;
      const m = out.match(/addr=(\S+)/);
      if (m) {
        clearTimeout(timer);
        ok(`http://${m[1]}`);
      }
    });
    server.on("exit", (code) => fail(new Error(`the server exited with ${code}: ${out}`)));
  });
  server.stdout.resume();
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
});

after(async () => {
  await browser?.close();
  server?.kill();
});

/** An API call with a token (and any other headers); the parsed body. */
async function call(method, path, body, token = TOKENS.operator, extra = {}) {
  const res = await fetch(base + path, {
    method,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json", ...extra },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, body: text ? JSON.parse(text) : null };
}

const report = (id, tasks) => call("POST", `/v1/allocations/${id}/task-states`, { tasks }, TOKENS.agent);

/** An allocation whose prestart task `migrate` acquires `names`. */
const acquiring = (names) => ({
  tasks: [{ name: "migrate", lifecycle: { hook: "prestart" }, acquire: names }, { name: "web" }],
});

/** Waits (bounded; each wait a long-poll) until `id`'s `migrate` holds
 *  `semaphore`; its grant's fence. */
async function grantedFence(id, semaphore) {
  for (let i = 0; i < 10; i++) {
    const r = await call("GET", `/v1/allocations/${id}/tasks/migrate/start-condition?wait=10s`, undefined, TOKENS.agent);
    const grant = (r.body.grants || []).find((g) => g.semaphore === semaphore);
    if (r.body.allowed && grant) return grant.fence;
  }
  assert.fail(`${id} was never granted ${semaphore}`);
}

/** `id`'s `migrate` runs, then ends: its slot goes to the next in line. */
async function runAndEnd(id) {
  const r = await call("PUT", `/v1/allocations/${id}/tasks/migrate/state`, { state: "running" }, TOKENS.agent);
  assert.equal(r.status, 200);
  const run = r.body.tasks.find((t) => t.name === "migrate").run;
  const d = await call("PUT", `/v1/allocations/${id}/tasks/migrate/state`, { state: "dead" }, TOKENS.agent, { "Taskgate-Run": run });
  assert.equal(d.status, 200);
}

/** An allocation whose main task `worker` is at barrier `name`; it
 *  arrives once its prestart sidecar `side` runs. */
const gatheringAt = (name, size, timeout = "10m") => ({
  tasks: [
    { name: "side", lifecycle: { hook: "prestart", sidecar: true } },
    { name: "worker", barrier: { name, size, timeout } },
  ],
});

/** `id`'s sidecar runs: its worker arrives at its barrier. */
const arrive = async (id, token = TOKENS.agent) =>
  assert.equal((await call("PUT", `/v1/allocations/${id}/tasks/side/state`, { state: "running" }, token)).status, 200);

/** What a page's status line says once it has loaded: it follows changes
 * (the semaphore list, read once, says how many it shows). */
const LIVE = /following changes live/i;
const SEMAPHORES_SHOWN = /shown, as of/;

/** A page with `token` entered in its token form, at `path`. */
async function open(path, token, viewport = { width: 1366, height: 900 }, ready = LIVE) {
  const page = await browser.newPage({ viewport });
  page.on("pageerror", (e) => assert.fail(`a script error in the page: ${e.message}`));
  await page.goto(base + path);
  await useToken(page, token, ready);
  return page;
}

/** Enters `token` and waits until the page has loaded again with it (its
 *  status line is cleared, then says `ready`). */
async function useToken(page, token, ready = LIVE) {
  await page.getByLabel("Token", { exact: true }).fill(token);
  await page.getByRole("button", { name: "Use" }).click();
  await page.getByRole("status").getByText(ready).waitFor();
}

async function shot(page, name) {
  await page.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });
}

/** The gate and tasks of each stage lane, as the page shows them. */
async function lanes(page) {
  return page.$$eval(".lane", (lanes) =>
    Object.fromEntries(
      lanes.map((l) => [
        l.dataset.stage,
        {
          gate: l.querySelector(".gate").textContent,
          tasks: [...l.querySelectorAll(".task")].map((t) => ({
            name: t.dataset.task,
            state: t.querySelector(".state").textContent,
            desired: t.querySelector(".desired").textContent,
          })),
        },
      ]),
    ),
  );
}

/** Waits until the page's coordinator line reads `state`. */
async function coordinator(page, state) {
  await page.locator("#coordinator", { hasText: new RegExp(`^${state}$`) }).waitFor({ timeout: 5000 });
}

/** Waits until the page shows the allocation at `index`. */
async function shows(page, index) {
  await page.locator("#index", { hasText: new RegExp(`^${index}$`) }).waitFor({ timeout: 5000 });
}

test("the list shows registered allocations and follows new ones live", async () => {
  for (const id of ["list-1", "list-2"]) {
    assert.equal((await call("PUT", `/v1/allocations/${id}`, FIVE, TOKENS.agent)).status, 201);
  }
  const page = await open("/ui?prefix=list-", TOKENS.reader);
  await page.locator('tr[data-id="list-2"]').waitFor();
  const ids = await page.$$eval("tbody tr", (rows) => rows.map((r) => r.dataset.id));
  assert.deepEqual(ids, ["list-1", "list-2"]);
  assert.equal(await page.locator('tr[data-id="list-1"] .state').textContent(), "prestart");
  assert.equal(await page.locator('tr[data-id="list-1"] .waiting').textContent(), "init to succeed; proxy to be running");
  // A new one and a change, made elsewhere, appear without a reload.
  await call("PUT", "/v1/allocations/list-3", FIVE, TOKENS.agent);
  await report("list-1", { init: { state: "dead" }, proxy: { state: "running" } });
  await page.locator('tr[data-id="list-3"]').waitFor({ timeout: 1000 });
  await page.locator('tr[data-id="list-1"] .state', { hasText: "main" }).waitFor({ timeout: 1000 });
  await shot(page, "list");
  await page.setViewportSize({ width: 390, height: 844 });
  await shot(page, "list-phone");
  await page.close();
});

test("the detail page shows the gates and lanes at each stage of the walkthrough", async () => {
  let index = (await call("PUT", "/v1/allocations/a1", FIVE, TOKENS.agent)).body.modify_index;
  const page = await open("/ui/allocations/a1", TOKENS.reader);
  // The list beside it, filtered to this allocation, follows the same steps.
  const list = await open("/ui?prefix=a1", TOKENS.reader);
  const steps = [
    ["registered", null, "prestart", { prestart_ephemeral: "● gate open", prestart_sidecar: "● gate open", main: "○ gate closed", poststop: "○ gate closed" }],
    ["prestart-running", { init: { state: "running" }, proxy: { state: "running" } }, "prestart", { main: "○ gate closed" }],
    ["main", { init: { state: "dead" } }, "main", { main: "● gate open", poststart_ephemeral: "○ gate closed" }],
    ["poststart", { web: { state: "running" } }, "poststart", { poststart_ephemeral: "● gate open" }],
    ["wait-alloc", { announce: { state: "dead" } }, "wait_alloc", { poststop: "○ gate closed" }],
    ["leader-dead", { web: { state: "dead" } }, "wait_alloc", {}],
    ["poststop", { proxy: { state: "dead" } }, "poststop", { poststop: "● gate open" }],
  ];
  for (const [name, tasks, state, gates] of steps) {
    if (tasks) {
      const r = await report("a1", tasks);
      assert.equal(r.status, 200);
      index = r.body.modify_index;
    }
    await shows(page, index);
    await coordinator(page, state);
    const seen = await lanes(page);
    for (const [stage, gate] of Object.entries(gates)) assert.equal(seen[stage].gate, gate, `${name}: ${stage}`);
    // Every task is in its stage's lane, with its state.
    const view = (await call("GET", "/v1/allocations/a1")).body;
    for (const t of view.tasks) {
      const shown = seen[t.stage].tasks.find((s) => s.name === t.name);
      assert.ok(shown, `${name}: ${t.name} in the ${t.stage} lane`);
      assert.equal(shown.state, t.state + (t.failed ? " (failed)" : ""), `${name}: ${t.name}`);
    }
    assert.equal(seen.poststart_sidecar.gate, "no tasks");
    const step = steps.findIndex((s) => s[0] === name) + 1;
    await shot(page, `detail-${step}-${name}`);
    const row = list.locator('tr[data-id="a1"]');
    await row.locator(".num", { hasText: `(index ${index})` }).waitFor({ timeout: 5000 });
    assert.equal(await row.locator(".state").textContent(), state, `${name}: the list's row`);
    await shot(list, `list-${step}-${name}`);
  }
  await list.close();
  // The leader's death told the others to stop, with its reason.
  const proxy = (await lanes(page)).prestart_sidecar.tasks[0];
  assert.equal(proxy.desired, "stop: Leader Task Dead");
  // The timeline holds the server's decisions.
  const types = await page.$$eval("table[aria-label^='Timeline'] tbody td:nth-child(3)", (c) => c.map((x) => x.textContent));
  for (const t of ["Registered", "Coordinator", "Task State", "Stop Order"]) assert.ok(types.includes(t), `${t} in ${types}`);
  await page.setViewportSize({ width: 390, height: 844 });
  await shot(page, "detail-phone");
  await page.close();
});

test("a report made with curl appears in an open page within a second", async () => {
  await call("PUT", "/v1/allocations/live-1", FIVE, TOKENS.agent);
  const page = await open("/ui/allocations/live-1", TOKENS.reader);
  await coordinator(page, "prestart");
  const state = page.locator('.task[data-task="init"] .state');
  assert.equal(await state.textContent(), "pending");
  const sent = Date.now();
  await promisify(execFile)("curl", [
    "-sf", "-X", "PUT", `${base}/v1/allocations/live-1/tasks/init/state`,
    "-H", `Authorization: Bearer ${TOKENS.agent}`, "-H", "Content-Type: application/json",
    "-d", '{"state": "running"}',
  ]);
  await page.locator('.task[data-task="init"] .state', { hasText: "running" }).waitFor({ timeout: 1000 });
  const took = Date.now() - sent;
  assert.ok(took < 1000, `shown after ${took} ms`);
  // The run the report began is shown with it.
  const run = (await call("GET", "/v1/allocations/live-1/tasks/init")).body.run;
  assert.ok(run, "the task runs under a run");
  assert.equal(await page.locator('.task[data-task="init"] .run').textContent(), run);
  await page.close();
});

test("restarting needs an operator token: refused with a reader's, done with an operator's", async () => {
  await call("PUT", "/v1/allocations/op-1", FIVE, TOKENS.agent);
  await report("op-1", { init: { state: "dead" }, proxy: { state: "running" }, web: { state: "running" } });
  const generation = async () =>
    (await call("GET", "/v1/allocations/op-1/tasks/web")).body.restart_generation;
  assert.equal(await generation(), 0);

  const page = await open("/ui/allocations/op-1", TOKENS.reader);
  await coordinator(page, "poststart");
  await page.getByLabel("Reason").fill("new config");
  await page.getByRole("button", { name: "Restart web" }).click();
  // Behind a confirmation; cancelling does nothing.
  await page.getByRole("dialog").getByRole("button", { name: "Cancel" }).click();
  await page.getByRole("button", { name: "Restart web" }).click();
  await page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
  await page.getByRole("alert").getByText("may not POST").waitFor();
  assert.match(await page.getByRole("alert").textContent(), /operator token/);
  assert.equal(await generation(), 0, "refused: nothing restarted");

  // The agent token cannot act as an operator either.
  await useToken(page, TOKENS.agent);
  await page.getByRole("button", { name: "Restart web" }).click();
  await page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
  await page.getByRole("alert").getByText("may not POST").waitFor();
  assert.equal(await generation(), 0);

  await useToken(page, TOKENS.operator);
  await page.getByLabel("Reason").fill("new config");
  await page.getByRole("button", { name: "Restart web" }).click();
  await page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
  // The page follows: the timeline shows the order and its reason.
  await page.locator("table[aria-label^='Timeline'] tbody tr", { hasText: "Restart Order" }).first().waitFor();
  assert.equal(await page.locator("#error").textContent(), "");
  assert.equal(await generation(), 1);
  const order = await page.locator("table[aria-label^='Timeline'] tbody tr", { hasText: "Restart Order" }).first().textContent();
  assert.match(order, /reason=new config/);
  await shot(page, "detail-restarted");

  // Keyboard only: the actions are reachable and the dialog answers Escape.
  await page.getByRole("button", { name: "Delete allocation" }).focus();
  await page.keyboard.press("Enter");
  await page.getByRole("dialog").waitFor();
  await page.keyboard.press("Escape");
  assert.equal((await call("GET", "/v1/allocations/op-1")).status, 200, "escape deleted nothing");
  await page.getByRole("button", { name: "Delete allocation" }).click();
  await page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
  await page.getByRole("status").getByText("op-1 was deleted").waitFor();
  assert.equal((await call("GET", "/v1/allocations/op-1")).status, 404);
  await page.close();
});

test("a finished allocation offers no restart, and a task that is not running none of its own", async () => {
  await call("PUT", "/v1/allocations/fin-1", FIVE, TOKENS.agent);
  await report("fin-1", { init: { state: "dead" }, proxy: { state: "running" } });
  const page = await open("/ui/allocations/fin-1", TOKENS.operator);
  await coordinator(page, "main");
  // web is pending: it cannot be restarted alone; proxy runs: it can.
  assert.equal(await page.getByRole("button", { name: "Restart web" }).count(), 0);
  assert.equal(await page.getByRole("button", { name: "Restart proxy" }).count(), 1);
  await report("fin-1", { proxy: { state: "dead" }, web: { state: "dead" }, announce: { state: "dead" } });
  await coordinator(page, "poststop");
  assert.equal(await page.getByRole("button", { name: /^Restart/ }).count(), 0, "the server would refuse");
  assert.equal(await page.getByRole("button", { name: "Delete allocation" }).count(), 1);
  await page.close();
});

test("a task's dependencies link to the other allocation and say whether they hold", async () => {
  await call("PUT", "/v1/allocations/dep-app", {
    tasks: [{ name: "web", depends_on: [{ task: "db", allocation: "dep-db", condition: "running" }] }],
  }, TOKENS.agent);
  const page = await open("/ui/allocations/dep-app", TOKENS.reader);
  const deps = page.locator('.task[data-task="web"] .depends');
  await deps.getByText("not yet: not registered").waitFor();
  assert.equal(await deps.getByRole("link", { name: "dep-db/db" }).getAttribute("href"), "/ui/allocations/dep-db");
  assert.match(await page.locator("#waiting").textContent(), /the dependencies of web/);
  await call("PUT", "/v1/allocations/dep-db", { tasks: [{ name: "db" }] }, TOKENS.agent);
  await report("dep-db", { db: { state: "running" } });
  await deps.getByText("holds").waitFor();
  await shot(page, "detail-dependency");
  await page.close();
});

test("a failed allocation is shown failed: in the list, its filter and a banner saying what to do", async () => {
  await call("PUT", "/v1/allocations/tr-ok", FIVE, TOKENS.agent);
  await call("PUT", "/v1/allocations/tr-bad", FIVE, TOKENS.agent);
  const list = await open("/ui?prefix=tr-", TOKENS.reader);
  await list.locator('tr[data-id="tr-bad"]').waitFor();
  assert.equal(await list.locator('tr[data-id="tr-bad"] .trouble').textContent(), "—");
  // init fails: the row turns to failed live, marked, and the healthy one does not.
  await report("tr-bad", { init: { state: "dead", failed: true } });
  const bad = list.locator('tr[data-id="tr-bad"]');
  await bad.locator(".trouble", { hasText: "failed" }).waitFor({ timeout: 2000 });
  assert.equal(await bad.getAttribute("data-trouble"), "failed");
  assert.equal(await list.locator('tr[data-id="tr-ok"] .trouble').textContent(), "—");
  await shot(list, "list-trouble");
  // The filter asks the server for failed ones only.
  await list.getByLabel("State").selectOption("failed");
  await list.getByRole("button", { name: "Filter" }).click();
  await list.getByRole("status").getByText(/following changes live/i).waitFor();
  await list.locator('tr[data-id="tr-bad"]').waitFor();
  assert.deepEqual(await list.$$eval("tbody tr", (rows) => rows.map((r) => r.dataset.id)), ["tr-bad"]);
  assert.match(list.url(), /state=failed/);
  await list.close();
  // The page says what is wrong and what to do, above everything else.
  const page = await open("/ui/allocations/tr-bad", TOKENS.operator);
  const banner = page.getByRole("region", { name: "Trouble" });
  await banner.getByText("init ended failed").waitFor();
  assert.match(await banner.textContent(), /What to do: Read the task's events/);
  await shot(page, "detail-trouble");
  await page.close();
  // A healthy one has no banner; stopped, its poststop runs and it ends
  // stopped, which is no trouble.
  const ok = await open("/ui/allocations/tr-ok", TOKENS.operator);
  await coordinator(ok, "prestart");
  assert.equal(await ok.getByRole("region", { name: "Trouble" }).count(), 0);
  await ok.getByRole("button", { name: "Stop allocation" }).click();
  await ok.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
  await ok.locator('.task[data-task="web"] .desired', { hasText: "stop: Stopped By Operator" }).waitFor({ timeout: 2000 });
  await report("tr-ok", { init: { state: "dead" }, proxy: { state: "dead" }, web: { state: "dead" }, announce: { state: "dead" } });
  await report("tr-ok", { cleanup: { state: "dead" } });
  await ok.locator('.task[data-task="cleanup"] .state', { hasText: "dead" }).waitFor({ timeout: 2000 });
  await ok.locator("dd", { hasText: /^stopped$/ }).waitFor({ timeout: 2000 });
  assert.equal(await ok.getByRole("button", { name: "Stop allocation" }).count(), 0, "nothing left to stop");
  assert.equal(await ok.getByRole("region", { name: "Trouble" }).count(), 0);
  await ok.close();
});

test("a filtered first page takes in, live, an allocation before its first row that comes to match", async () => {
  // Both in the first page's range; only tf-b is failed when it is listed.
  await call("PUT", "/v1/allocations/tf-a", FIVE, TOKENS.agent);
  await call("PUT", "/v1/allocations/tf-b", FIVE, TOKENS.agent);
  await report("tf-b", { init: { state: "dead", failed: true } });
  const list = await open("/ui?prefix=tf-&state=failed", TOKENS.reader);
  await list.locator('tr[data-id="tf-b"]').waitFor();
  assert.deepEqual(await list.$$eval("tbody tr", (rows) => rows.map((r) => r.dataset.id)), ["tf-b"]);
  // tf-a fails: the server would list it on this page now, so it joins.
  await report("tf-a", { init: { state: "dead", failed: true } });
  await list.locator('tr[data-id="tf-a"]').waitFor({ timeout: 2000 });
  assert.deepEqual(await list.$$eval("tbody tr", (rows) => rows.map((r) => r.dataset.id)), ["tf-a", "tf-b"]);
  await list.close();
});

test("Stop is offered only where it does something: not in poststop, not under a stop order", async () => {
  await call("PUT", "/v1/allocations/st-1", FIVE, TOKENS.agent);
  const page = await open("/ui/allocations/st-1", TOKENS.operator);
  await coordinator(page, "prestart");
  const stop = page.getByRole("button", { name: "Stop allocation" });
  assert.equal(await stop.count(), 1, "a running allocation can be stopped");
  // init fails: every other task is told to stop already, and a stop
  // would change nothing.
  await report("st-1", { init: { state: "dead", failed: true } });
  await page.locator('.task[data-task="web"] .desired', { hasText: "stop" }).waitFor({ timeout: 2000 });
  assert.equal(await stop.count(), 0, "no Stop under a stop order");
  // In poststop with its cleanup still to run, the server refuses a stop.
  await report("st-1", { proxy: { state: "dead" }, web: { state: "dead" }, announce: { state: "dead" } });
  await coordinator(page, "poststop");
  assert.equal((await call("POST", "/v1/allocations/st-1/stop")).body.code, "allocation_finished");
  assert.equal(await stop.count(), 0, "no Stop in poststop");
  await page.close();
});

test("every page passes axe's accessibility rules (WCAG 2.1 A and AA)", async () => {
  await call("PUT", "/v1/allocations/ax-1", FIVE, TOKENS.agent);
  await report("ax-1", { init: { state: "dead" }, proxy: { state: "running" }, web: { state: "running" } });
  // One in trouble, for the list's marks and the page's banner.
  await call("PUT", "/v1/allocations/ax-2", FIVE, TOKENS.agent);
  await report("ax-2", { init: { state: "dead", failed: true } });
  // A semaphore with a holder and one in line, and a task waiting for one
  // not created.
  await call("PUT", "/v1/semaphores/ax-sem", { limit: 1 });
  await call("PUT", "/v1/allocations/ax-3", acquiring(["ax-sem"]), TOKENS.agent);
  await call("PUT", "/v1/allocations/ax-4", acquiring(["ax-sem", "ax-none"]), TOKENS.agent);
  await grantedFence("ax-3", "ax-sem");
  // A barrier gathering: one member arrived, one not.
  for (const id of ["ax-5", "ax-6"]) await call("PUT", `/v1/allocations/${id}`, gatheringAt("ax-train", 3), TOKENS.agent);
  await arrive("ax-5");
  const paths = [
    ["/ui?prefix=ax-", LIVE],
    ["/ui/allocations/ax-1", LIVE],
    ["/ui/allocations/ax-2", LIVE],
    ["/ui/allocations/ax-4", LIVE],
    ["/ui/semaphores?prefix=ax-", SEMAPHORES_SHOWN],
    ["/ui/semaphores/ax-sem", LIVE],
    ["/ui/allocations/ax-5", LIVE],
    ["/ui/barriers/ax-train", LIVE],
  ];
  for (const [path, ready] of paths) {
    for (const viewport of [{ width: 1366, height: 900 }, { width: 390, height: 844 }]) {
      const page = await open(path, TOKENS.reader, viewport, ready);
      // Run through the browser's debugging protocol: the page's own
      // policy admits its own scripts only.
      await page.evaluate(AXE);
      const result = await page.evaluate(() =>
        globalThis.axe.run(document, { runOnly: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"] }),
      );
      const found = result.violations.map((v) => `${v.id}: ${v.help} (${v.nodes.map((n) => n.target).join(", ")})`);
      assert.deepEqual(found, [], `${path} at ${viewport.width}px`);
      await page.close();
    }
  }
});

/** The rows of a holders or queue table: [allocation, ...the other cells]. */
async function rows(page, table) {
  return page.$$eval(`${table} tbody tr`, (trs) => trs.map((tr) => [...tr.querySelectorAll("td")].map((td) => td.textContent)));
}

test("a semaphore's page shows its holder and its queue, and moves the next one to holders live", async () => {
  assert.equal((await call("PUT", "/v1/semaphores/sp-db", { limit: 1, grant_timeout: "5m" })).status, 201);
  assert.equal((await call("PUT", "/v1/allocations/sp-1", acquiring(["sp-db"]), TOKENS.agent)).status, 201);
  assert.equal((await call("PUT", "/v1/allocations/sp-2", acquiring(["sp-db"]), TOKENS.agent)).status, 201);
  const first = await grantedFence("sp-1", "sp-db");
  const page = await open("/ui/semaphores/sp-db", TOKENS.reader);
  assert.equal(await page.locator("#limit").textContent(), "1");
  assert.equal(await page.locator("#held").textContent(), "1 of 1");
  assert.match(await page.locator("#grant-timeout").textContent(), /^5m /);
  assert.match(await page.locator("#next-fence").textContent(), /^at least \d+$/);
  let holders = await rows(page, "#holders");
  assert.deepEqual(holders.map((r) => r.slice(0, 4)), [["sp-1", "migrate", "not started", String(first)]]);
  assert.equal(await page.locator("#holders").getByRole("link", { name: "sp-1" }).getAttribute("href"), "/ui/allocations/sp-1");
  assert.deepEqual((await rows(page, "#queue")).map((r) => r.slice(0, 3)), [["1", "sp-2", "migrate"]]);
  await shot(page, "semaphore");

  // The holder runs and ends: the page moves sp-2 to the holders, with a
  // higher fence, without a reload.
  await page.evaluate(() => (globalThis.notReloaded = true));
  await runAndEnd("sp-1");
  await page.locator('#holders tr[data-allocation="sp-2"]').waitFor({ timeout: 2000 });
  holders = await rows(page, "#holders");
  assert.equal(holders.length, 1);
  assert.equal(holders[0][0], "sp-2");
  assert.ok(Number(holders[0][3]) > first, `fence ${holders[0][3]} above ${first}`);
  assert.equal(await page.locator("#queue").textContent(), "No task waits for it.");
  assert.equal(await page.evaluate(() => globalThis.notReloaded), true, "the same page, not a reload");
  await shot(page, "semaphore-moved");

  // Deleted: said, and the page stops following.
  await call("DELETE", "/v1/semaphores/sp-db");
  await page.getByRole("status").getByText("sp-db was deleted").waitFor({ timeout: 2000 });
  await page.close();
});

test("an allocation's page shows each acquired semaphore held with its fence, queued with its place, or not registered", async () => {
  await call("PUT", "/v1/semaphores/ap-db", { limit: 1 });
  for (const id of ["ap-1", "ap-2", "ap-3"]) await call("PUT", `/v1/allocations/${id}`, acquiring(["ap-db"]), TOKENS.agent);
  await call("PUT", "/v1/allocations/ap-4", acquiring(["ap-missing"]), TOKENS.agent);
  const fence = await grantedFence("ap-1", "ap-db");
  const standing = (page, name) => page.locator(`.task[data-task="migrate"] .semaphores li[data-semaphore="${name}"]`);

  const holder = await open("/ui/allocations/ap-1", TOKENS.reader);
  assert.equal(await standing(holder, "ap-db").textContent(), `ap-db — held, fence ${fence}`);
  assert.equal(await standing(holder, "ap-db").getByRole("link").getAttribute("href"), "/ui/semaphores/ap-db");
  // Nothing wrong: no banner, and nothing in its place (it once read "null").
  assert.equal(await holder.getByRole("region", { name: "Trouble" }).count(), 0);
  assert.doesNotMatch(await holder.locator("#page").innerText(), /null/);
  await shot(holder, "detail-semaphore-held");
  await holder.close();

  const missing = await open("/ui/allocations/ap-4", TOKENS.reader);
  assert.equal(await standing(missing, "ap-missing").textContent(), "ap-missing — not registered (an operator creates it)");
  await missing.close();

  // The second and third in line; the holder ends: the second is granted
  // (a new version of its allocation), and the third's place moves up,
  // which is no new version of its own: both pages follow, live.
  const second = await open("/ui/allocations/ap-2", TOKENS.reader);
  const third = await open("/ui/allocations/ap-3", TOKENS.reader);
  assert.equal(await standing(second, "ap-db").textContent(), "ap-db — queued, position 1");
  assert.equal(await standing(third, "ap-db").textContent(), "ap-db — queued, position 2");
  await shot(third, "detail-semaphore-queued");
  const index = await third.locator("#index").textContent();
  await runAndEnd("ap-1");
  const next = await grantedFence("ap-2", "ap-db");
  assert.ok(next > fence);
  await standing(second, "ap-db").getByText(`held, fence ${next}`).waitFor({ timeout: 2000 });
  await standing(third, "ap-db").getByText("queued, position 1").waitFor({ timeout: 2000 });
  assert.equal(await third.locator("#index").textContent(), index, "the third allocation did not change");
  await second.close();

  // Its link leads to the semaphore's page, where it is first in line.
  await standing(third, "ap-db").getByRole("link", { name: "ap-db" }).click();
  await third.getByRole("heading", { name: "Semaphore ap-db" }).waitFor();
  await third.locator('#queue tr[data-allocation="ap-3"] .position', { hasText: /^1$/ }).waitFor();
  assert.match(third.url(), /\/ui\/semaphores\/ap-db$/);
  await third.close();
});

test("the semaphore list is reachable from the main page and shows name, limit, held and queued", async () => {
  await call("PUT", "/v1/semaphores/ls-a", { limit: 2, grant_timeout: "30s" });
  await call("PUT", "/v1/semaphores/ls-b", { limit: 1 });
  await call("PUT", "/v1/allocations/ls-1", acquiring(["ls-b"]), TOKENS.agent);
  await call("PUT", "/v1/allocations/ls-2", acquiring(["ls-b"]), TOKENS.agent);
  await grantedFence("ls-1", "ls-b");
  // The whole list is the operator's: other tokens list semaphores only
  // with a prefix within their semaphore_prefixes.
  const page = await open("/ui", TOKENS.operator);
  await page.getByRole("navigation", { name: "Site" }).getByRole("link", { name: "Semaphores" }).click();
  await page.getByRole("heading", { name: "Semaphores" }).waitFor();
  await page.getByRole("status").getByText(SEMAPHORES_SHOWN).waitFor();
  await page.getByLabel("Name prefix").fill("ls-");
  await page.getByRole("button", { name: "Filter" }).click();
  await page.locator('tr[data-name="ls-b"]').waitFor();
  await page.getByRole("status").getByText(SEMAPHORES_SHOWN).waitFor();
  assert.deepEqual(await rows(page, "table[aria-label='Semaphores']"), [
    ["ls-a", "2", "0", "0", "30s"],
    ["ls-b", "1", "1", "1", "1m"],
  ]);
  assert.match(page.url(), /\/ui\/semaphores\?prefix=ls-$/);
  await shot(page, "semaphores");
  await page.getByRole("link", { name: "ls-b" }).click();
  await page.getByRole("heading", { name: "Semaphore ls-b" }).waitFor();
  await page.close();
});

test("a barrier's page shows its members and where each stands, and follows them live until it opens", async () => {
  for (const id of ["bp-1", "bp-2", "bp-3"]) {
    assert.equal((await call("PUT", `/v1/allocations/${id}`, gatheringAt("bp-train", 3), TOKENS.agent)).status, 201);
  }
  await arrive("bp-1");
  const page = await open("/ui/barriers/bp-train", TOKENS.reader);
  await page.getByRole("heading", { name: "Barrier bp-train" }).waitFor();
  assert.match(await page.locator("#state").textContent(), /^gathering: 1 of 3 arrived; times out at .+ unless 3 arrive by then$/);
  assert.equal(await page.locator("#size").textContent(), "3 (3 registered)");
  assert.equal(await page.locator("#timeout").textContent(), "10m from the first arrival");
  assert.equal(await page.locator("#opened").textContent(), "—");
  let members = await rows(page, "#members");
  assert.deepEqual(members.map((r) => r.slice(0, 3)), [
    ["bp-1", "worker", "arrived"],
    ["bp-2", "worker", "not arrived"],
    ["bp-3", "worker", "not arrived"],
  ]);
  assert.notEqual(members[0][3], "—", "when it arrived");
  assert.equal(members[1][3], "—");
  assert.equal(await page.locator("#members").getByRole("link", { name: "bp-2" }).getAttribute("href"), "/ui/allocations/bp-2");
  await shot(page, "barrier-gathering");

  // The others arrive: the page follows, without a reload, until all
  // three are released together.
  await page.evaluate(() => (globalThis.notReloaded = true));
  await arrive("bp-2");
  await page.locator("#state", { hasText: /^gathering: 2 of 3 arrived/ }).waitFor({ timeout: 2000 });
  await arrive("bp-3");
  await page.locator("#state", { hasText: "open: its members were released together" }).waitFor({ timeout: 2000 });
  members = await rows(page, "#members");
  assert.deepEqual(members.map((r) => r.slice(2)), [["passed", "—"], ["passed", "—"], ["passed", "—"]]);
  assert.notEqual(await page.locator("#opened").textContent(), "—");
  assert.equal(await page.evaluate(() => globalThis.notReloaded), true, "the same page, not a reload");
  await shot(page, "barrier-open");

  // Its members' allocations deleted: it is forgotten, and the page says so.
  for (const id of ["bp-1", "bp-2", "bp-3"]) await call("DELETE", `/v1/allocations/${id}`);
  await page.getByRole("status").getByText("bp-train is forgotten").waitFor({ timeout: 2000 });
  await page.close();
});

test("a task card shows its barrier gathering k of n live, then passed, or timed out, with a link to the barrier", async () => {
  for (const id of ["ab-1", "ab-2"]) await call("PUT", `/v1/allocations/${id}`, gatheringAt("ab-train", 3), TOKENS.agent);
  await arrive("ab-1");
  const standing = (page) => page.locator('.task[data-task="worker"] .barrier');
  const first = await open("/ui/allocations/ab-1", TOKENS.reader);
  const second = await open("/ui/allocations/ab-2", TOKENS.reader);
  assert.equal(await standing(first).textContent(), "ab-train — gathering: 1 of 3 arrived");
  // ab-2's worker waits for its gate: the barrier says it has not
  // arrived (its own view alone could not tell that from having passed).
  assert.equal(await standing(second).textContent(), "ab-train — not arrived yet: 1 of 3 have");
  assert.equal(await standing(first).getByRole("link").getAttribute("href"), "/ui/barriers/ab-train");
  await shot(first, "detail-barrier-gathering");

  // ab-2 arrives: the count moves on ab-1's page too, which is no new
  // version of ab-1.
  const index = await first.locator("#index").textContent();
  await arrive("ab-2");
  await standing(first).getByText("gathering: 2 of 3 arrived").waitFor({ timeout: 2000 });
  assert.equal(await first.locator("#index").textContent(), index, "ab-1 did not change");
  await standing(second).getByText("gathering: 2 of 3 arrived").waitFor({ timeout: 2000 });

  // The third arrives: released together.
  await call("PUT", "/v1/allocations/ab-3", gatheringAt("ab-train", 3), TOKENS.agent);
  await arrive("ab-3");
  for (const page of [first, second]) {
    await standing(page).getByText("passed: all 3 released together").waitFor({ timeout: 2000 });
    await page.locator('.lane[data-stage="main"] .gate', { hasText: "gate open" }).waitFor({ timeout: 2000 });
  }
  await shot(first, "detail-barrier-passed");
  await second.close();

  // Its link leads to the barrier's page.
  await standing(first).getByRole("link", { name: "ab-train" }).click();
  await first.getByRole("heading", { name: "Barrier ab-train" }).waitFor();
  assert.match(first.url(), /\/ui\/barriers\/ab-train$/);
  await first.close();

  // A barrier that times out: its member will not start, and its
  // allocation is told to stop, naming the barrier.
  await call("PUT", "/v1/allocations/ab-t", gatheringAt("ab-short", 2, "1s"), TOKENS.agent);
  const late = await open("/ui/allocations/ab-t", TOKENS.reader);
  await arrive("ab-t");
  await standing(late).getByText("timed out before 2 arrived: it will not start").waitFor({ timeout: 5000 });
  await late.locator('.task[data-task="worker"] .desired', { hasText: "stop: Barrier Timeout (ab-short)" }).waitFor({ timeout: 2000 });
  await shot(late, "detail-barrier-timed-out");
  await late.close();
});

test("a task card whose barrier the token may not read tells what the task's view says", async () => {
  // zz-locked is outside the reader's semaphore_prefixes.
  await call("PUT", "/v1/allocations/ab-lock", gatheringAt("zz-locked", 2));
  await arrive("ab-lock", TOKENS.operator);
  const page = await open("/ui/allocations/ab-lock", TOKENS.reader);
  const standing = page.locator('.task[data-task="worker"] .barrier');
  assert.equal(await standing.textContent(), "zz-locked — gathering: 1 of 2 arrived");
  assert.equal(await page.locator("#error").textContent(), "");
  await page.close();
});
