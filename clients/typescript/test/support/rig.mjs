// Starts scripts/ingest_rig.py (the real gateway on a Tansu broker and Redis, with API keys)
// and sends it commands: one JSON line each way.
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const REPO = fileURLToPath(new URL("../../../../", import.meta.url));
export const PYTHON = process.env.RTRL_PYTHON ?? `${REPO}.venv/bin/python`;

/** corsOrigins: origins whose pages may send from a browser (RTRL_INGEST_CORS_ORIGINS). */
export async function startRig({ corsOrigins = [] } = {}) {
  const origins = corsOrigins.flatMap((origin) => ["--cors-origin", origin]);
  const child = spawn(PYTHON, [`${REPO}scripts/ingest_rig.py`, ...origins], {
    cwd: REPO,
    stdio: ["pipe", "pipe", "inherit"],
  });
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  const exited = new Promise((resolve) => child.once("exit", resolve));
  async function read() {
    const next = await Promise.race([
      lines.next(),
      exited.then((code) => ({ done: true, code })),
    ]);
    if (next.done) throw new Error(`ingest rig exited (${next.code ?? "stdout closed"})`);
    return JSON.parse(next.value);
  }
  let queue = Promise.resolve();
  function command(cmd, extra = {}) {
    const answer = queue.then(async () => {
      child.stdin.write(JSON.stringify({ cmd, ...extra }) + "\n");
      const reply = await read();
      if (!reply.ok) throw new Error(`rig ${cmd}: ${reply.error}`);
      return reply;
    });
    queue = answer.catch(() => {});
    return answer;
  }
  const ready = await read();
  return {
    url: ready.url,
    /** The gateway's Prometheus page. */
    metricsUrl: ready.metrics_url,
    apiKey: ready.api_key,
    log: ready.log,
    kill: () => command("kill"),
    start: () => command("start"),
    /** {event_id: times on the telemetry topics} */
    count: async () => (await command("count")).counts,
    key: async (clientId) => (await command("key", { client_id: clientId })).key,
    /** rtrl_ingest_sdk_events_total by "sdk sdk_version outcome" (ingest/sdk_counts.py). */
    async sdkEvents() {
      const page = await (await fetch(ready.metrics_url)).text();
      const counts = {};
      for (const [, labels, value] of page.matchAll(/^rtrl_ingest_sdk_events_total\{([^}]*)\} (\S+)$/gm)) {
        const label = Object.fromEntries([...labels.matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
        counts[`${label.sdk} ${label.sdk_version} ${label.outcome}`] = Number(value);
      }
      return counts;
    },
    async quit() {
      child.stdin.end();
      const timer = setTimeout(() => child.kill("SIGTERM"), 15_000);
      await exited;
      clearTimeout(timer);
    },
  };
}

/** Polls until predicate() is truthy; throws after timeoutMs. */
export async function until(predicate, timeoutMs, what) {
  const deadline = Date.now() + timeoutMs;
  while (!(await predicate())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

export const quietLogger = { warn() {}, error() {} };
