// The browser build: the `browser` export condition resolves to an entry that imports no
// node: module (nor a Node builtin), and the built bundle runs in headless chromium, where it
// builds and encodes an event to the shared conformance bytes.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { createServer } from "node:http";
import { builtinModules } from "node:module";
import { dirname, join, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { build } from "esbuild";
import { startRig } from "./support/rig.mjs";
import { EVENTS } from "./support/vectors.mjs";

const PACKAGE = fileURLToPath(new URL("..", import.meta.url));
const BUNDLE = join(PACKAGE, "dist/rtrl-client.browser.js");
const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";
const NODE_ONLY = new Set([...builtinModules, ...builtinModules.map((m) => `node:${m}`)]);
const IMPORT = /(?:^|[\s;])(?:import|export)\s[^"'`]*?from\s*["']([^"']+)["']|import\(\s*["']([^"']+)["']\s*\)|require\(\s*["']([^"']+)["']\s*\)/g;

const specifiers = (source) => [...source.matchAll(IMPORT)].map((m) => m[1] ?? m[2] ?? m[3]);

/** Serves the bundle and whatever page() returns; resolves to the server and its origin. */
async function servePage(page) {
  const server = createServer((req, res) => {
    if (req.url === "/rtrl-client.browser.js") {
      res.writeHead(200, { "Content-Type": "text/javascript" });
      res.end(readFileSync(BUNDLE));
    } else {
      res.writeHead(200, { "Content-Type": "text/html" });
      res.end(page());
    }
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  return { server, origin: `http://127.0.0.1:${server.address().port}` };
}

/** Headless chromium loads origin/ and runs it for up to budgetMs of virtual time; the JSON
 * the page wrote into <pre id="out">, parsed. */
async function runPage(origin, budgetMs) {
  const { stdout } = await promisify(execFile)(
    CHROMIUM,
    ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
      `--virtual-time-budget=${budgetMs}`, "--dump-dom", `${origin}/`],
    { timeout: budgetMs + 30_000, maxBuffer: 1 << 24 },
  );
  const text = /<pre id="out">([\s\S]*?)<\/pre>/.exec(stdout)?.[1] ?? stdout;
  const decoded = text.replaceAll("&quot;", '"').replaceAll("&lt;", "<").replaceAll("&gt;", ">").replaceAll("&amp;", "&");
  assert.ok(decoded.startsWith("{"), decoded.slice(0, 500));
  return JSON.parse(decoded);
}

/** The files an entry reaches through relative imports and requires, and the Node-only
 * modules any of them names. */
function moduleGraph(entry) {
  const seen = new Set();
  const offenders = [];
  const walk = (file) => {
    if (seen.has(file)) return;
    seen.add(file);
    for (const spec of specifiers(readFileSync(file, "utf8"))) {
      if (NODE_ONLY.has(spec)) offenders.push(`${file}: ${spec}`);
      else if (spec.startsWith(".")) walk(resolve(dirname(file), spec));
    }
  };
  walk(entry);
  return { seen, offenders };
}

test("the browser entries' module graphs (import and require) name no node: module", () => {
  const pkg = JSON.parse(readFileSync(join(PACKAGE, "package.json"), "utf8"));
  const browser = pkg.exports["."].browser;
  const esm = moduleGraph(resolve(PACKAGE, browser.import.default));
  assert.ok(esm.seen.size >= 5, `walked only ${[...esm.seen]}`);
  assert.ok(![...esm.seen].some((f) => f.endsWith("spool.js")), "the browser entry reaches the spool");
  assert.deepEqual(esm.offenders, []);
  const cjs = moduleGraph(resolve(PACKAGE, browser.require.default)); // one bundled file
  assert.deepEqual(cjs.offenders, []);
  assert.doesNotMatch(readFileSync(resolve(PACKAGE, browser.require.default), "utf8"), /["']node:[a-z_]+["']/);
  // And the scan itself would see one: the node entries import node:fs through the spool.
  assert.ok(specifiers(readFileSync(join(PACKAGE, "dist/spool.js"), "utf8")).includes("node:fs"));
  assert.ok(moduleGraph(resolve(PACKAGE, pkg.exports["."].node.require.default)).offenders.length > 0);
});

test("bundling @rtrl/client for the browser picks the browser build, free of Node imports", async () => {
  // platform=browser resolves the `browser` condition and fails on any Node builtin.
  const result = await build({
    stdin: { contents: 'export * from "@rtrl/client";', resolveDir: PACKAGE },
    bundle: true,
    write: false,
    format: "esm",
    platform: "browser",
    logLevel: "silent",
    metafile: true,
  });
  const inputs = Object.keys(result.metafile.inputs);
  assert.ok(inputs.some((f) => f.endsWith("dist/browser.js")), inputs.join("\n"));
  assert.ok(!inputs.some((f) => /spool|node\.js$/.test(f)), inputs.join("\n"));
  const bundle = readFileSync(BUNDLE, "utf8");
  assert.deepEqual(specifiers(bundle).filter((s) => NODE_ONLY.has(s)), []);
  assert.doesNotMatch(bundle, /["']node:[a-z_]+["']/);
});

test("headless chromium loads the bundle, builds an event and encodes it to the shared bytes", async () => {
  assert.ok(existsSync(CHROMIUM), `no chromium at ${CHROMIUM} (set CHROMIUM)`);
  const vector = EVENTS.find((c) => c.helper === "edit_shown");
  const page = `<!doctype html><html><body><pre id="out">not run</pre><script type="module">
    import * as sdk from "/rtrl-client.browser.js";
    const out = document.getElementById("out");
    try {
      const a = ${JSON.stringify(vector.args)};
      const event = sdk.editShown({ rolloutId: a.rollout_id, sessionId: a.session_id, userId: a.user_id,
        filePath: a.file_path, editText: a.edit_text, clientTsMs: a.client_ts_ms, eventId: ${JSON.stringify(vector.event_id)} });
      const hex = Array.from(sdk.encodeEvent(event), (b) => b.toString(16).padStart(2, "0")).join("");
      const telemetry = new sdk.Telemetry("http://127.0.0.1:9", { settings: { lingerMs: 60000 } });
      const fresh = telemetry.editOutcome({ rolloutId: "r", sessionId: "s", userId: "u", outcome: "accepted" });
      out.textContent = JSON.stringify({ hex, pending: telemetry.pending, freshId: fresh.eventId,
        hasSpool: "Spool" in sdk, json: sdk.eventToJson(event) });
    } catch (error) {
      out.textContent = "error: " + error.stack;
    }
  </script></body></html>`;
  const { server, origin } = await servePage(() => page);
  try {
    const got = await runPage(origin, 5000);
    assert.equal(got.hex, vector.wire_hex);
    assert.deepEqual(got.json, vector.json);
    assert.equal(got.pending, 1);
    assert.match(got.freshId, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
    assert.equal(got.hasSpool, false);
  } finally {
    server.close();
  }
});

test("a page of an allowed origin sends events to the real gateway: each lands once", { timeout: 120_000 }, async () => {
  assert.ok(existsSync(CHROMIUM), `no chromium at ${CHROMIUM} (set CHROMIUM)`);
  let page = "";
  const { server, origin } = await servePage(() => page);
  // The gateway answers this page's preflight (RTRL_INGEST_CORS_ORIGINS) and no other's.
  const rig = await startRig({ corsOrigins: [origin] });
  try {
    page = `<!doctype html><html><body><pre id="out">not run</pre><script type="module">
      import * as sdk from "/rtrl-client.browser.js";
      const out = document.getElementById("out");
      try {
        const t = new sdk.Telemetry(${JSON.stringify(rig.url)}, { apiKey: ${JSON.stringify(rig.apiKey)} });
        const who = { rolloutId: "r-browser", sessionId: "s", userId: "u" };
        const ids = [
          t.editShown({ ...who, filePath: "app.ts", editText: "let x = 1;\\n" }).eventId,
          t.editOutcome({ ...who, outcome: "accepted" }).eventId,
          t.followup({ ...who, secondsAfterEdit: 5, message: "thanks" }).eventId,
        ];
        const delivered = await t.flush(20000);
        out.textContent = JSON.stringify({ ids, delivered, stats: t.stats });
      } catch (error) {
        out.textContent = "error: " + error.stack;
      }
    </script></body></html>`;
    const got = await runPage(origin, 30000);
    assert.equal(got.delivered, true, JSON.stringify(got));
    assert.equal(got.stats.accepted, 3, JSON.stringify(got));
    const counts = await rig.count();
    assert.deepEqual(got.ids.map((id) => counts[id]), [1, 1, 1]);
    // The page's requests named the SDK (X-Rtrl-Sdk, allowed by the preflight).
    const { version } = JSON.parse(readFileSync(join(PACKAGE, "package.json"), "utf8"));
    assert.deepEqual(await rig.sdkEvents(), { [`rtrl-client-ts ${version} accepted`]: 3 });
  } finally {
    await rig.quit();
    server.close();
  }
});
