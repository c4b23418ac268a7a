// IngestClient's retry rules, against a scripted HTTP server (the real gateway does not
// answer 429 or 5xx on demand): only RETRY results, 429s, 5xx and network errors are resent,
// always with the same event ids, and never sooner than a 429's Retry-After.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { IngestClient, IngestError, SDK, Status, VERSION, followup } from "@rtrl/client";

/** A server answering each POST with the next scripted (requestBody) => [status, body, headers]. */
async function scripted(...answers) {
  const requests = [];
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (chunk) => (body += chunk));
    req.on("end", () => {
      const request = { at: performance.now(), auth: req.headers.authorization, headers: req.headers, body: JSON.parse(body) };
      requests.push(request);
      const [status, document, headers = {}] = answers.shift()(request.body);
      res.writeHead(status, { "Content-Type": "application/json", ...headers });
      res.end(JSON.stringify(document));
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return { url: `http://127.0.0.1:${server.address().port}`, requests, close: () => server.close() };
}

const events = (n) =>
  Array.from({ length: n }, (_, i) => followup({ rolloutId: `r${i}`, sessionId: "s", userId: "u", secondsAfterEdit: 1, message: "m" }));
const result = (eventId, status, extra = {}) => ({ eventId, status, ...extra });
const ids = (body) => body.events.map((e) => e.eventId);

test("only RETRY results are resent, with the same ids, after at least Retry-After", async () => {
  const sent = events(3);
  const server = await scripted(
    (body) => [429, { results: [result(body.events[0].eventId, "STATUS_ACCEPTED"), result(body.events[1].eventId, "STATUS_RETRY", { error: "busy" }), result(body.events[2].eventId, "STATUS_REJECTED", { field: "followup.message", error: "too long" })] }, { "Retry-After": "1" }],
    (body) => [200, { results: [result(body.events[0].eventId, "STATUS_DUPLICATE")] }],
  );
  try {
    const client = new IngestClient(server.url, { apiKey: "k", baseDelayMs: 10 });
    const results = await client.publish(sent);
    assert.deepEqual(results.map((r) => Status[r.status]), ["ACCEPTED", "DUPLICATE", "REJECTED"]);
    assert.equal(results[2].field, "followup.message");
    assert.deepEqual(ids(server.requests[1].body), [sent[1].eventId]);
    assert.ok(server.requests[1].at - server.requests[0].at >= 990, "Retry-After: 1 not honoured");
    assert.equal(server.requests[0].auth, "Bearer k");
  } finally {
    server.close();
  }
});

test("5xx and a whole-request 429 are resent with the same ids; backoff grows", async () => {
  const sent = events(2);
  const server = await scripted(
    () => [503, { error: "broker down" }],
    () => [500, { error: "oops" }],
    () => [429, { error: "rate limit" }, { "Retry-After": "0" }],
    (body) => [200, { results: body.events.map((e) => result(e.eventId, "STATUS_ACCEPTED")) }],
  );
  try {
    const client = new IngestClient(server.url, { baseDelayMs: 40, maxDelayMs: 1000, random: () => 0 });
    const results = await client.publish(sent);
    assert.deepEqual(results.map((r) => Status[r.status]), ["ACCEPTED", "ACCEPTED"]);
    assert.equal(server.requests.length, 4);
    for (const request of server.requests) assert.deepEqual(ids(request.body), sent.map((e) => e.eventId));
    const gaps = server.requests.slice(1).map((r, i) => r.at - server.requests[i].at);
    // random() = 0: half the ceiling, 20, 40, 80 ms.
    assert.ok(gaps[0] >= 19 && gaps[1] >= 39 && gaps[2] >= 79, JSON.stringify(gaps));
  } finally {
    server.close();
  }
});

test("network errors are retried, then reported as RETRY with the last error", async () => {
  const server = await scripted();
  server.close(); // nothing listens on the port any more
  const client = new IngestClient(server.url, { maxAttempts: 3, baseDelayMs: 1 });
  const [only] = await client.publish(events(1));
  assert.equal(only.status, Status.RETRY);
  assert.match(only.error, /gave up after 3 attempts: .*(ECONNREFUSED|fetch failed)/);
});

test("a request refused whole (400 with an error) throws IngestError, not retried", async () => {
  const server = await scripted(() => [400, { error: "body is not the JSON form" }]);
  try {
    await assert.rejects(new IngestClient(server.url).publish(events(1)), IngestError);
    assert.equal(server.requests.length, 1);
  } finally {
    server.close();
  }
});

test("every request names the SDK and its version: X-Rtrl-Sdk, and User-Agent on Node", async () => {
  const server = await scripted(
    (body) => [200, { results: body.events.map((e) => result(e.eventId, "STATUS_ACCEPTED")) }],
    (body) => [200, { results: body.events.map((e) => result(e.eventId, "STATUS_ACCEPTED")) }],
  );
  try {
    const client = new IngestClient(server.url, { apiKey: "k" });
    await client.publish(events(1));
    await client.publish(events(1), { traceparent: `00-${"1".repeat(32)}-${"2".repeat(16)}-01` });
    const { version } = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
    for (const { headers } of server.requests) {
      assert.equal(headers["x-rtrl-sdk"], `rtrl-client-ts/${version}`);
      assert.equal(headers["user-agent"], `rtrl-client-ts/${version} node/${process.versions.node}`);
    }
  } finally {
    server.close();
  }
});

test("the version is package.json's, in the ESM and the CommonJS build alike", () => {
  const pkg = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
  const generated = readFileSync(new URL("../src/version.ts", import.meta.url), "utf8");
  assert.match(generated, new RegExp(`^export const VERSION = "${pkg.version}";$`, "m"), "run `node scripts/gen-version.mjs`");
  assert.equal(VERSION, pkg.version);
  assert.equal(SDK, `rtrl-client-ts/${pkg.version}`);
  const required = createRequire(import.meta.url)("@rtrl/client");
  assert.equal(required.VERSION, pkg.version);
  assert.equal(typeof required.IngestClient, "function");
  assert.notEqual(required.IngestClient, IngestClient, "require() loads the CommonJS build");
});
