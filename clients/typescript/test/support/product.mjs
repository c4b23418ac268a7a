// A product process using the SDK, for the tests that kill or end it:
//   node product.mjs URL KEY SPOOL_DIR serve   stdin lines "report N" / "flush" -> one JSON line each
//   node product.mjs URL KEY SPOOL_DIR exit N  report N events and end without close()
//   node product.mjs URL KEY SPOOL_DIR drain   deliver what the spool holds, close, print stats
import { createInterface } from "node:readline";
import { Telemetry } from "@rtrl/client";

const [url, apiKey, spoolDir, mode, n] = process.argv.slice(2);
const settings = { maxBatch: 50, lingerMs: 5, baseDelayMs: 20, maxDelayMs: 500, closeTimeoutMs: 30_000 };
const logger = { warn() {}, error() {} };
const telemetry = new Telemetry(url, { apiKey, spoolDir, settings, logger });
const say = (document) => process.stdout.write(JSON.stringify(document) + "\n");

function report(count, tag) {
  const ids = [];
  for (let i = 0; i < count; i++) {
    // Durable when editShown returns: only then is the id promised to the parent.
    ids.push(
      telemetry.editShown({ rolloutId: `${tag}-${i}`, sessionId: "s", userId: "u", filePath: "a.py", editText: `x = ${i}\n` })
        .eventId,
    );
  }
  return ids;
}

if (mode === "serve") {
  for await (const line of createInterface({ input: process.stdin })) {
    const [cmd, arg] = line.split(" ");
    if (cmd === "report") say({ reported: report(Number(arg), "served") });
    else if (cmd === "flush") say({ flushed: await telemetry.flush(30_000) });
  }
} else if (mode === "exit") {
  say({ reported: report(Number(n), "exit") });
  // No close(): the beforeExit hook delivers before the process ends.
} else if (mode === "drain") {
  const pending = telemetry.pending;
  const delivered = await telemetry.close();
  const { accepted, duplicate, rejected } = telemetry.stats;
  say({ pending, delivered, accepted, duplicate, rejected, left: telemetry.pending });
}
