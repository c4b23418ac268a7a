// The Node spool on its own: order, acks across a restart, torn records, bounds, the lock.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { appendFileSync, mkdtempSync, readdirSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { Spool, SpoolFull, SpoolLocked, crc32 } from "@rtrl/client";

const dir = () => mkdtempSync(join(tmpdir(), "rtrl-spool-"));
const bytes = (s) => new TextEncoder().encode(s);
const text = (spool) => spool.oldest(1 << 30).map((e) => new TextDecoder().decode(e.payload));
const files = (d) => readdirSync(d).filter((n) => n.endsWith(".seg") || n.endsWith(".acks")).sort();

test("crc32 is zlib's", () => {
  assert.equal(crc32(bytes("123456789")), 0xcbf43926);
});

test("keeps order and after a restart resends only the unanswered", () => {
  const d = dir();
  let spool = new Spool(d, { segmentBytes: 64 }); // records of 16 bytes: four per segment
  const seqs = [];
  for (let i = 0; i < 10; i++) seqs.push(...spool.append([bytes(`event-${String(i).padStart(2, "0")}`)]));
  seqs.push(...spool.append([bytes("event-10"), bytes("event-11")]));
  assert.equal(spool.size, 12);
  spool.ack([0, 1, 2, 3, 5, 11].map((i) => seqs[i]));
  // The first segment is answered whole and deleted; the others remember their acks.
  assert.deepEqual(files(d), [
    "0000000000000002.acks", "0000000000000002.seg", "0000000000000003.acks", "0000000000000003.seg",
  ]);
  assert.equal(statSync(join(d, "0000000000000002.seg")).mode & 0o777, 0o600);
  assert.equal(statSync(d).mode & 0o777, 0o700);
  spool.close();

  spool = new Spool(d, { segmentBytes: 64 });
  assert.deepEqual(text(spool), ["event-04", "event-06", "event-07", "event-08", "event-09", "event-10"]);
  assert.ok(spool.unansweredThrough(0) && !spool.unansweredThrough(-1));
  spool.ack(spool.oldest(100).map((e) => e.seq));
  assert.equal(spool.size, 0);
  assert.deepEqual(files(d), []);
  spool.close();
});

test("a record torn by a crash is cut off at the next start; later appends survive", () => {
  const d = dir();
  let spool = new Spool(d);
  spool.append([bytes("whole")]);
  spool.close();
  appendFileSync(join(d, "0000000000000001.seg"), Buffer.from([0, 0, 0, 9, 1, 2])); // a torn header
  spool = new Spool(d);
  assert.deepEqual(text(spool), ["whole"]);
  spool.append([bytes("after")]);
  spool.close();
  spool = new Spool(d);
  assert.deepEqual(text(spool), ["whole", "after"]);
  spool.close();
});

test("bounded in events and in bytes: SpoolFull, nothing recorded", () => {
  const d = dir();
  const spool = new Spool(d, { maxEvents: 3, maxBytes: 1024, segmentBytes: 1024 });
  spool.append([bytes("a"), bytes("b")]);
  assert.throws(() => spool.append([bytes("c"), bytes("d")]), SpoolFull);
  spool.append([bytes("c")]);
  assert.throws(() => spool.append([bytes("e")]), SpoolFull);
  spool.ack([0, 1, 2]);
  assert.throws(() => spool.append([new Uint8Array(1020)]), SpoolFull); // 1028 bytes with its header
  spool.append([new Uint8Array(1000)]);
  assert.equal(spool.size, 1);
  spool.close();
});

test("one process per directory: a second Spool is refused until the first closes", async () => {
  const d = dir();
  const spool = new Spool(d);
  assert.throws(() => new Spool(d), SpoolLocked);
  // Another live process is refused too.
  const child = spawn(process.execPath, ["--input-type=module", "-e",
    `import { Spool } from "@rtrl/client";
     try { new Spool(${JSON.stringify(d)}); console.log("opened"); } catch (e) { console.log(e.name); }`],
    { cwd: process.cwd(), stdio: ["ignore", "pipe", "inherit"] });
  let out = "";
  child.stdout.on("data", (chunk) => (out += chunk));
  await new Promise((resolve) => child.on("exit", resolve));
  assert.equal(out.trim(), "SpoolLocked");
  spool.close();
  new Spool(d).close();
});

test("a lock left by a dead process is taken over", () => {
  const d = dir();
  writeFileSync(join(d, "node.lock"), "2147483646\n"); // no such pid
  const spool = new Spool(d);
  spool.append([bytes("x")]);
  spool.close();
});
