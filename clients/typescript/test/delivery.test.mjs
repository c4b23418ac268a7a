// Delivery against the real gateway (scripts/ingest_rig.py): exactly once through a gateway
// killed mid-batch and restarted, through a product process killed with events in its spool,
// per-field rejections reported to the caller, a refused key raised.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import {
  IngestAuthError,
  IngestClient,
  Status,
  Telemetry,
  editShown,
  followup,
} from "@rtrl/client";
import { quietLogger, startRig, until } from "./support/rig.mjs";

const PRODUCT = fileURLToPath(new URL("./support/product.mjs", import.meta.url));
const spoolDir = () => mkdtempSync(join(tmpdir(), "rtrl-delivery-"));
const segments = (d) => readdirSync(d).filter((n) => n.endsWith(".seg"));
const FAST = { maxBatch: 100, lingerMs: 5, baseDelayMs: 20, maxDelayMs: 500, requestTimeoutMs: 5_000 };

function exactlyOnce(counts, ids) {
  const wrong = ids.filter((id) => counts[id] !== 1).map((id) => `${id}: ${counts[id] ?? 0}`);
  assert.deepEqual(wrong, [], `${wrong.length} of ${ids.length} events not on the topics exactly once`);
}

/** A product process: its stdout's JSON lines, its stdin, its exit. */
function product(rig, apiKey, dir, ...args) {
  const child = spawn(process.execPath, [PRODUCT, rig.url, apiKey, dir, ...args], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  const exited = new Promise((resolve) => child.once("exit", (code, signal) => resolve(signal ?? code)));
  return {
    child,
    exited,
    async next() {
      const line = await lines.next();
      assert.ok(!line.done, "the product process ended without answering");
      return JSON.parse(line.value);
    },
    async ask(command) {
      child.stdin.write(command + "\n");
      return this.next();
    },
  };
}

describe("delivery through the real gateway", () => {
  let rig;
  before(async () => {
    rig = await startRig();
  });
  after(async () => {
    await rig?.quit();
  });

  test("exactly once through a gateway SIGKILLed mid-batch and restarted, twice", async (t) => {
    const dir = spoolDir();
    const ids = [];
    const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
    // Kill the gateway while a request is in flight (sent, not answered; a request takes
    // ~60 ms here): the first request sent once 600 events are accepted, after 30 ms, and the
    // first once 1,800 are, after 15 ms; restart 300 ms after each kill.
    const plan = [
      { after: 600, delayMs: 30 },
      { after: 1800, delayMs: 15 },
    ];
    const cycles = [];
    let busy = false;
    const fetchThenKill = (url, init) => {
      const answer = fetch(url, init);
      const next = plan[cycles.length];
      if (!busy && next && telemetry.stats.accepted >= next.after) {
        busy = true;
        cycles.push(
          sleep(next.delayMs).then(async () => {
            await rig.kill();
            const counts = await rig.count();
            const at = { accepted: telemetry.stats.accepted, landed: ids.filter((id) => counts[id]).length };
            await sleep(300); // rounds fail against the dead port meanwhile
            await rig.start();
            busy = false;
            return at;
          }),
        );
      }
      return answer;
    };
    const telemetry = new Telemetry(rig.url, {
      apiKey: rig.apiKey, spoolDir: dir, settings: FAST, logger: quietLogger, fetch: fetchThenKill,
    });
    for (let chunk = 0; chunk < 30; chunk++) {
      const events = Array.from({ length: 100 }, (_, i) =>
        editShown({ rolloutId: `kill-${chunk}-${i}`, sessionId: "s", userId: "u", filePath: "a.py", editText: "x\n".repeat(50) }),
      );
      telemetry.send(events);
      ids.push(...events.map((e) => e.eventId));
    }
    await until(() => cycles.length === 2, 30_000, "two kills");
    const atKills = await Promise.all(cycles);
    for (const at of atKills) assert.ok(at.accepted < ids.length, JSON.stringify(at));
    assert.equal(await telemetry.flush(60_000), true);
    assert.equal(await telemetry.close(), true);
    const counts = await rig.count();
    exactlyOnce(counts, ids);
    assert.equal(telemetry.stats.accepted + telemetry.stats.duplicate, ids.length);
    assert.equal(telemetry.stats.rejected, 0);
    const { accepted, duplicate, retry } = telemetry.stats;
    // landed > accepted at a kill: the gateway wrote a batch whose answer never arrived.
    t.diagnostic(`at the kills: ${JSON.stringify(atKills)}; in the end: ${JSON.stringify({ accepted, duplicate, retry })}`);
    assert.deepEqual(segments(dir), []); // every event acked: the spool is empty on disk
  });

  test("a product process SIGKILLed with events in its spool: the next one delivers them once", async () => {
    const dir = spoolDir();
    const first = product(rig, rig.apiKey, dir, "serve");
    const delivered = (await first.ask("report 200")).reported;
    assert.deepEqual(await first.ask("flush"), { flushed: true });
    await rig.kill(); // what is reported now can only wait in the spool
    const spooled = (await first.ask("report 300")).reported;
    first.child.kill("SIGKILL");
    assert.equal(await first.exited, "SIGKILL");
    assert.equal((await rig.count())[spooled[0]], undefined);
    await rig.start();

    const second = product(rig, rig.apiKey, dir, "drain");
    const stats = await second.next();
    assert.equal(await second.exited, 0);
    // The acked 200 are not resent (no DUPLICATE): only the 300 promised while the gateway was down.
    assert.deepEqual(stats, { pending: 300, delivered: true, accepted: 300, duplicate: 0, rejected: 0, left: 0 });
    exactlyOnce(await rig.count(), [...delivered, ...spooled]);
  });

  test("a process that ends without close() is flushed at beforeExit", async () => {
    const dir = spoolDir();
    const proc = product(rig, rig.apiKey, dir, "exit", "120");
    const { reported } = await proc.next();
    assert.equal(await proc.exited, 0);
    exactlyOnce(await rig.count(), reported);
    assert.deepEqual(segments(dir), []);
  });

  test("rejected events reach onRejected with the gateway's field and error, and are dropped", async () => {
    const dir = spoolDir();
    const rejections = [];
    const telemetry = new Telemetry(rig.url, {
      apiKey: rig.apiKey,
      spoolDir: dir,
      settings: FAST,
      logger: quietLogger,
      onRejected: (r) => rejections.push(r),
    });
    const good = telemetry.followup({ rolloutId: "rej-0", sessionId: "s", userId: "u", secondsAfterEdit: 3, message: "ok" });
    const badId = followup({ rolloutId: "rej-1", sessionId: "s", userId: "u", secondsAfterEdit: 3, message: "x", eventId: "NOT-A-UUID" });
    const badDelay = followup({ rolloutId: "rej-2", sessionId: "s", userId: "u", secondsAfterEdit: -5, message: "x" });
    telemetry.send([badId, badDelay]);
    assert.equal(await telemetry.flush(20_000), true);
    assert.deepEqual(
      rejections.map((r) => [r.event.eventId, r.field]),
      [[badId.eventId, "event_id"], [badDelay.eventId, "followup.seconds_after_edit"]],
    );
    assert.match(rejections[0].error, /UUID/);
    assert.match(rejections[1].error, />= 0/);
    assert.equal(telemetry.rejected.length, 2);
    assert.equal(telemetry.stats.rejected, 2);
    assert.equal(telemetry.stats.accepted, 1);
    assert.equal(telemetry.pending, 0); // not resent
    assert.equal(await telemetry.close(), true);
    const counts = await rig.count();
    assert.equal(counts[good.eventId], 1);
    assert.equal(counts[badDelay.eventId], undefined);

    // The bare client answers the same per event.
    const client = new IngestClient(rig.url, { apiKey: rig.apiKey });
    const [result] = await client.publish([followup({ rolloutId: "rej-3", sessionId: "s", userId: "u", secondsAfterEdit: NaN, message: "x" })]);
    assert.equal(result.status, Status.REJECTED);
    assert.equal(result.field, "followup.seconds_after_edit");
  });

  test("the gateway counts this SDK's events under its name and version (X-Rtrl-Sdk)", async () => {
    const { version } = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
    const before = await rig.sdkEvents();
    const telemetry = new Telemetry(rig.url, { apiKey: rig.apiKey, spoolDir: spoolDir(), settings: FAST, logger: quietLogger });
    telemetry.editShown({ rolloutId: "sdk-0", sessionId: "s", userId: "u", filePath: "a.ts", editText: "x" });
    telemetry.editOutcome({ rolloutId: "sdk-0", sessionId: "s", userId: "u", outcome: "accepted" });
    telemetry.send([followup({ rolloutId: "sdk-1", sessionId: "s", userId: "u", secondsAfterEdit: -1, message: "x" })]);
    assert.equal(await telemetry.close(), true);
    const after = await rig.sdkEvents();
    const delta = (key) => (after[key] ?? 0) - (before[key] ?? 0);
    assert.equal(delta(`rtrl-client-ts ${version} accepted`), 2, JSON.stringify(after));
    assert.equal(delta(`rtrl-client-ts ${version} rejected`), 1, JSON.stringify(after));
    // Every request this suite sent named this SDK and version.
    assert.deepEqual([...new Set(Object.keys(after).map((k) => k.split(" ").slice(0, 2).join(" ")))], [`rtrl-client-ts ${version}`]);
  });

  test("a refused key: the client throws IngestAuthError, Telemetry keeps the events for a good key", async () => {
    const wrong = "rtrl_not-a-key-at-all";
    await assert.rejects(
      new IngestClient(rig.url, { apiKey: wrong }).publish([followup({ rolloutId: "auth", sessionId: "s", userId: "u", secondsAfterEdit: 1, message: "x" })]),
      (error) => error instanceof IngestAuthError && error.status === 401 && /unknown API key/.test(error.message),
    );
    const dir = spoolDir();
    let telemetry = new Telemetry(rig.url, { apiKey: wrong, spoolDir: dir, settings: FAST, logger: quietLogger });
    const event = telemetry.followup({ rolloutId: "auth-1", sessionId: "s", userId: "u", secondsAfterEdit: 1, message: "x" });
    await assert.rejects(telemetry.flush(10_000), (error) => error instanceof IngestAuthError && error.status === 401);
    assert.equal(telemetry.pending, 1);
    assert.equal(await telemetry.close(), false); // logged, not thrown; the event stays spooled
    telemetry = new Telemetry(rig.url, { apiKey: await rig.key("auth-test"), spoolDir: dir, settings: FAST, logger: quietLogger });
    assert.equal(await telemetry.close(), true);
    assert.equal((await rig.count())[event.eventId], 1);
  });
});
