// Regenerates src/gen into a temporary directory and fails if it differs from the committed
// src/gen: generated code is never edited by hand, and a changed .proto must be regenerated.
// Independent of git state, so it works before and after the generated files are committed.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";

const here = new URL("..", import.meta.url).pathname;
const out = mkdtempSync(join(tmpdir(), "rtrl-gen-"));

function files(dir) {
  const found = [];
  for (const name of readdirSync(dir)) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) found.push(...files(path));
    else found.push(path);
  }
  return found;
}

try {
  execFileSync(
    "buf",
    ["generate", "../../proto", "--path", "../../proto/rtrl/v1/telemetry.proto",
      "--path", "../../proto/rtrl/v1/ingest.proto", "--output", out],
    { cwd: here, stdio: "inherit" },
  );
  const committed = join(here, "src/gen");
  const fresh = join(out, "src/gen");
  const names = (dir) => files(dir).map((f) => relative(dir, f)).sort();
  const want = names(fresh);
  const have = names(committed);
  const problems = [];
  for (const name of new Set([...want, ...have])) {
    if (!want.includes(name)) problems.push(`${name}: not generated any more (delete it)`);
    else if (!have.includes(name)) problems.push(`${name}: generated but missing`);
    else if (!readFileSync(join(fresh, name)).equals(readFileSync(join(committed, name)))) {
      problems.push(`${name}: differs from what the generator writes`);
    }
  }
  if (problems.length) {
    console.error("src/gen is stale; run `npm run generate`:\n  " + problems.join("\n  "));
    process.exit(1);
  }
  console.log(`src/gen matches the generator (${want.length} files)`);
} finally {
  rmSync(out, { recursive: true, force: true });
}
