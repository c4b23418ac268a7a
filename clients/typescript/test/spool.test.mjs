// The Node spool on its own: order, acks across a restart, torn and damaged records, bounds,
// files it did not write, symbolic links, the lock; and with the Python SDK on one directory
// (the same records, the same lock).
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import {
  appendFileSync,
  chmodSync,
  lstatSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { hostname } from "node:os";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { Spool, SpoolFull, SpoolLocked, crc32 } from "@rtrl/client";
import { PYTHON, REPO } from "./support/rig.mjs";

const dir = () => mkdtempSync(join(tmpdir(), "rtrl-spool-"));
const bytes = (s) => new TextEncoder().encode(s);
const text = (spool) => spool.oldest(1 << 30).map((e) => new TextDecoder().decode(e.payload));
const files = (d) => readdirSync(d).filter((n) => n.endsWith(".seg") || n.endsWith(".acks")).sort();

test("crc32 is zlib's", () => {
  assert.equal(crc32(bytes("123456789")), 0xcbf43926);
});

test("keeps order and after a restart resends only the unanswered", () => {
  const d = dir();
  let spool = new Spool(d, { segmentBytes: 80 }); // records of 20 bytes: four per segment
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

  spool = new Spool(d, { segmentBytes: 80 });
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
  assert.throws(() => spool.append([new Uint8Array(1016)]), SpoolFull); // 1028 bytes with its header
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
  writeFileSync(join(d, "spool.lock"), lockLine(2147483646, "")); // no such pid
  const spool = new Spool(d);
  spool.append([bytes("x")]);
  spool.close();
});

const lockLine = (pid, started, host = hostname()) => `${JSON.stringify({ pid, host, started })}\n`;
const EVENTS = Array.from({ length: 8 }, (_, i) => `event-${String(i).padStart(2, "0")}`);
const RECORD = 12 + 8; // MARK, length, crc32, then an 8-byte payload

function spooled(d) {
  const spool = new Spool(d);
  spool.append(EVENTS.map(bytes));
  spool.close();
  return join(d, "0000000000000001.seg");
}

for (const [name, where] of [["a payload byte", 15], ["a length byte", 5], ["the mark", 0]]) {
  test(`L7: a flipped byte (${name}) costs its record and no other`, () => {
    const d = dir();
    const segment = spooled(d);
    const data = readFileSync(segment);
    data[2 * RECORD + where] ^= 0x40;
    writeFileSync(segment, data);
    let spool = new Spool(d);
    const kept = [...EVENTS.slice(0, 2), ...EVENTS.slice(3)];
    assert.deepEqual(text(spool), kept);
    spool.append([bytes("after")]);
    spool.close();
    spool = new Spool(d);
    assert.deepEqual(text(spool), [...kept, "after"]);
    spool.close();
  });
}

test("L7: files the spool did not write are ignored and kept", () => {
  const d = dir();
  spooled(d);
  const foreign = ["9".repeat(25) + ".seg", "١.seg", "notes.seg", "mine.acks", "5.acks", "node.lock"];
  for (const name of foreign) writeFileSync(join(d, name), "not the spool's");
  mkdirSync(join(d, "0000000000000042.seg"));
  const spool = new Spool(d);
  assert.deepEqual(text(spool), EVENTS);
  spool.ack(spool.oldest(100).map((e) => e.seq));
  spool.close();
  for (const name of foreign) assert.equal(readFileSync(join(d, name), "utf8"), "not the spool's", name);
  assert.ok(statSync(join(d, "0000000000000042.seg")).isDirectory());
});

test("L7: a symlinked spool is refused and its target keeps its mode; a linked segment is not read", () => {
  const d = dir();
  const shared = join(d, "shared");
  mkdirSync(shared);
  chmodSync(shared, 0o755);
  symlinkSync(shared, join(d, "spool"));
  assert.throws(() => new Spool(join(d, "spool")), /not a directory of its own/);
  assert.equal(statSync(shared).mode & 0o777, 0o755);
  const segment = spooled(join(d, "elsewhere"));
  mkdirSync(join(d, "own"));
  symlinkSync(segment, join(d, "own", "0000000000000001.seg"));
  const spool = new Spool(join(d, "own"));
  assert.deepEqual(text(spool), []);
  spool.close();
  assert.ok(lstatSync(join(d, "own", "0000000000000001.seg")).isSymbolicLink());
});

test("L7: a lock whose owner is gone, or whose pid was reused, is taken over", () => {
  const d = dir();
  const dead = spawnSync(process.execPath, ["-e", ""]).pid;
  // process.ppid runs, but did not start at "another-boot/1": its pid was reused.
  for (const line of [lockLine(dead, ""), lockLine(process.ppid, "another-boot/1"), "garbage"]) {
    writeFileSync(join(d, "spool.lock"), line);
    const spool = new Spool(d);
    assert.equal(JSON.parse(readFileSync(join(d, "spool.lock"), "utf8")).pid, process.pid);
    spool.close();
  }
});

test("L7: a live owner's lock, or another host's, is kept", () => {
  const d = dir();
  const started = python(`from rtrl_client.spool_lock import process_started; print(process_started(${process.ppid}))`);
  writeFileSync(join(d, "spool.lock"), lockLine(process.ppid, started.trim()));
  assert.throws(() => new Spool(d), new RegExp(`process ${process.ppid}`));
  writeFileSync(join(d, "spool.lock"), lockLine(2147483646, "", "elsewhere"));
  assert.throws(() => new Spool(d), /elsewhere/);
});

function python(code) {
  const run = spawnSync(PYTHON, ["-c", code], { cwd: REPO, encoding: "utf8" });
  assert.equal(run.status, 0, run.stderr);
  return run.stdout;
}

const PY_SPOOL = "from rtrl_client.spool import Spool; import sys; ";

test("L7: Node and Python read each other's records, damaged ones too", () => {
  const d = dir();
  python(`${PY_SPOOL}s = Spool(${JSON.stringify(d)}, max_bytes=1<<20, segment_bytes=1<<16)
s.append([b"from-python-%d" % i for i in range(3)]); s.close()`);
  const segment = join(d, "0000000000000001.seg");
  const data = readFileSync(segment);
  data[25 + 12 + 3] ^= 0x40; // the second record's payload (records of 12 + 13 bytes)
  writeFileSync(segment, data);
  let spool = new Spool(d);
  assert.deepEqual(text(spool), ["from-python-0", "from-python-2"]);
  spool.append([bytes("from-node")]);
  spool.close();
  const read = python(`${PY_SPOOL}s = Spool(${JSON.stringify(d)}, max_bytes=1<<20, segment_bytes=1<<16)
print([e.payload.decode() for e in s.oldest(100)]); s.close()`);
  assert.equal(read.trim(), "['from-python-0', 'from-python-2', 'from-node']");
});

test("L7: Node and Python never hold one directory at once; a killed holder's lock is taken over", async () => {
  const d = dir();
  const node = new Spool(d);
  const refused = python(`${PY_SPOOL}
try:
    Spool(${JSON.stringify(d)}, max_bytes=1<<20, segment_bytes=1<<16); print("opened")
except Exception as e:
    print(type(e).__name__)`);
  assert.equal(refused.trim(), "SpoolLocked");
  node.close();
  // Python holds it (until killed): Node is refused, then takes the dead holder's lock over.
  const holder = spawn(PYTHON, ["-c", `${PY_SPOOL}s = Spool(${JSON.stringify(d)}, max_bytes=1<<20, segment_bytes=1<<16)
print("held", flush=True); sys.stdin.read()`], { cwd: REPO, stdio: ["pipe", "pipe", "inherit"] });
  await new Promise((resolve) => holder.stdout.once("data", resolve));
  assert.throws(() => new Spool(d), SpoolLocked);
  holder.kill("SIGKILL");
  await new Promise((resolve) => holder.once("exit", resolve));
  new Spool(d).close();
});
