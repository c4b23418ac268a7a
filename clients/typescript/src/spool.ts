// The durable spool of the Node SDK: events stay on disk until the gateway answered them.
// Same record layout as the Python SDK's spool (clients/python/src/rtrl_client/spool.py):
//   <n>.seg   records `u32 length | u32 crc32 | serialized TelemetryEvent` (big-endian), appended
//   <n>.acks  u64 offsets of that segment's records that got a final answer
// A segment is deleted once every record in it is answered. A record torn by a crash mid-append
// fails its length or CRC check and is cut off at the next start: its append never returned.
// One process per directory: `node.lock` holds the owner's pid (taken over once that process
// is gone). Node has no flock, so this lock is advisory between SDK processes only.
import {
  chmodSync,
  closeSync,
  existsSync,
  fsyncSync,
  ftruncateSync,
  linkSync,
  mkdirSync,
  openSync,
  readdirSync,
  readFileSync,
  truncateSync,
  unlinkSync,
  writeSync,
} from "node:fs";
import { join } from "node:path";
import { type EventStore, SpoolFull, type StoredEvent, takeOldest } from "./telemetry.js";

/** Another live process uses this spool directory; two senders would resend each other's events. */
export class SpoolLocked extends Error {
  override name = "SpoolLocked";
}

export interface SpoolOptions {
  /** Disk the spool may use; an append beyond it throws SpoolFull (default 256 MiB). */
  maxBytes?: number;
  /** Most undelivered events; an append beyond it throws SpoolFull (default 1,000,000). */
  maxEvents?: number;
  /** Size at which a new segment file starts (default 4 MiB). */
  segmentBytes?: number;
  /** fsync every append and ack before returning (default true). */
  fsync?: boolean;
}

const HEADER = 8;
const ACK = 8;
const LOCK = "node.lock";

interface Segment {
  number: number;
  size: number;
  acksSize: number;
  unanswered: number;
}

interface Slot extends StoredEvent {
  segment: Segment;
  offset: number;
}

export class Spool implements EventStore {
  readonly directory: string;
  private readonly maxBytes: number;
  private readonly maxEvents: number;
  private readonly segmentBytes: number;
  private readonly fsync: boolean;
  private readonly slots = new Map<number, Slot>();
  private nextSeq = 0;
  private bytesUsed = 0;
  private active: Segment | undefined;
  private activeFd: number | undefined;
  private nextSegment = 1;
  private closed = false;

  constructor(directory: string, options: SpoolOptions = {}) {
    this.directory = directory;
    this.maxBytes = options.maxBytes ?? 256 * 1024 * 1024;
    this.maxEvents = options.maxEvents ?? 1_000_000;
    this.segmentBytes = options.segmentBytes ?? 4 * 1024 * 1024;
    this.fsync = options.fsync ?? true;
    if (!(this.segmentBytes > 0 && this.segmentBytes <= this.maxBytes) || this.maxEvents < 1) {
      throw new RangeError("segmentBytes must be in 1..maxBytes and maxEvents >= 1");
    }
    // Events hold users' code and messages: the spool is its owner's alone.
    mkdirSync(directory, { recursive: true, mode: 0o700 });
    chmodSync(directory, 0o700);
    acquireLock(directory);
    try {
      this.load();
    } catch (error) {
      releaseLock(directory);
      throw error;
    }
  }

  /** Record payloads durably (one write, one fsync); their sequence numbers, in order. */
  append(payloads: Uint8Array[]): number[] {
    if (!payloads.length) return [];
    if (this.closed) throw new Error(`spool ${this.directory} is closed`);
    const frames = payloads.map((p) => {
      const frame = Buffer.allocUnsafe(HEADER + p.length);
      frame.writeUInt32BE(p.length, 0);
      frame.writeUInt32BE(crc32(p), 4);
      frame.set(p, HEADER);
      return frame;
    });
    const data = Buffer.concat(frames);
    if (this.bytesUsed + data.length > this.maxBytes || this.slots.size + payloads.length > this.maxEvents) {
      throw new SpoolFull(
        `spool ${this.directory} holds ${this.slots.size} undelivered events (${this.bytesUsed} bytes); ` +
          `${payloads.length} more (${data.length} bytes) would pass maxEvents=${this.maxEvents} or maxBytes=${this.maxBytes}`,
      );
    }
    const [segment, fd] = this.segmentFor(data.length);
    try {
      for (let written = 0; written < data.length; ) written += writeSync(fd, data, written);
      if (this.fsync) fsyncSync(fd);
    } catch (error) {
      // A partial record would hide every record appended after it at the next start.
      ftruncateSync(fd, segment.size);
      throw error;
    }
    const now = performance.now();
    let offset = segment.size;
    const seqs = payloads.map((payload, i) => {
      const seq = this.nextSeq++;
      this.slots.set(seq, { seq, payload, storedAt: now, segment, offset });
      offset += frames[i]!.length;
      return seq;
    });
    segment.size += data.length;
    segment.unanswered += payloads.length;
    this.bytesUsed += data.length;
    return seqs;
  }

  oldest(limit: number, maxBytes?: number): StoredEvent[] {
    return takeOldest(this.slots.values(), limit, maxBytes).map(({ seq, payload, storedAt }) => ({
      seq,
      payload,
      storedAt,
    }));
  }

  oldestStoredAt(): number | undefined {
    return this.slots.values().next().value?.storedAt;
  }

  /** These events got a final answer: forget them, durably, and free whole segments. */
  ack(seqs: Iterable<number>): void {
    const answered = new Map<Segment, number[]>();
    for (const seq of seqs) {
      const slot = this.slots.get(seq);
      if (!slot) continue;
      this.slots.delete(seq);
      const offsets = answered.get(slot.segment) ?? [];
      offsets.push(slot.offset);
      answered.set(slot.segment, offsets);
    }
    for (const [segment, offsets] of answered) {
      segment.unanswered -= offsets.length;
      if (segment.unanswered === 0) {
        this.drop(segment);
        continue;
      }
      // Without this a restart would resend the answered part of the segment (harmless,
      // DUPLICATE) but only while the gateway still remembers the ids.
      const record = Buffer.alloc(ACK * offsets.length);
      offsets.forEach((o, i) => record.writeBigUInt64BE(BigInt(o), i * ACK));
      const fd = openSync(this.path(segment, "acks"), "a", 0o600);
      try {
        for (let written = 0; written < record.length; ) written += writeSync(fd, record, written);
        if (this.fsync) fsyncSync(fd);
      } finally {
        closeSync(fd);
      }
      segment.acksSize += record.length;
      this.bytesUsed += record.length;
    }
  }

  unansweredThrough(seq: number): boolean {
    const first = this.slots.keys().next();
    return !first.done && first.value <= seq;
  }

  get size(): number {
    return this.slots.size;
  }

  /** Bytes on disk, counted against maxBytes. */
  get bytes(): number {
    return this.bytesUsed;
  }

  get lastSeq(): number {
    return this.nextSeq - 1;
  }

  /** Release the directory; what is unanswered stays on disk for the next Spool. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.closeActive();
    releaseLock(this.directory);
  }

  private path(segment: Segment, kind: "seg" | "acks"): string {
    return join(this.directory, `${String(segment.number).padStart(16, "0")}.${kind}`);
  }

  private segmentFor(size: number): [Segment, number] {
    if (this.active && this.active.size > 0 && this.active.size + size > this.segmentBytes) this.closeActive();
    if (!this.active || this.activeFd === undefined) {
      const segment: Segment = { number: this.nextSegment++, size: 0, acksSize: 0, unanswered: 0 };
      this.activeFd = openSync(this.path(segment, "seg"), "ax", 0o600);
      if (this.fsync) fsyncDirectory(this.directory); // the new name must survive a power cut too
      this.active = segment;
    }
    return [this.active, this.activeFd];
  }

  private closeActive(): void {
    if (this.activeFd !== undefined) closeSync(this.activeFd);
    this.active = this.activeFd = undefined;
  }

  private drop(segment: Segment): void {
    if (segment === this.active) this.closeActive();
    unlinkSync(this.path(segment, "seg")); // first: an .acks without its .seg is ignored at load
    if (existsSync(this.path(segment, "acks"))) unlinkSync(this.path(segment, "acks"));
    this.bytesUsed -= segment.size + segment.acksSize;
  }

  private load(): void {
    const started = performance.now();
    const names = readdirSync(this.directory);
    const numbers = names
      .filter((n) => /^\d+\.seg$/.test(n))
      .map((n) => Number.parseInt(n, 10))
      .sort((a, b) => a - b);
    for (const number of numbers) {
      const segment: Segment = { number, size: 0, acksSize: 0, unanswered: 0 };
      const data = readFileSync(this.path(segment, "seg"));
      const [records, end] = scan(data);
      if (end < data.length) {
        truncateSync(this.path(segment, "seg"), end);
        if (this.fsync) fsyncFile(this.path(segment, "seg"));
      }
      const answered = readAcks(this.path(segment, "acks"));
      segment.size = end;
      segment.acksSize = ACK * answered.size;
      for (const [offset, payload] of records) {
        if (answered.has(offset)) continue;
        const seq = this.nextSeq++;
        this.slots.set(seq, { seq, payload, storedAt: started, segment, offset });
        segment.unanswered++;
      }
      this.bytesUsed += segment.size + segment.acksSize;
      if (segment.unanswered === 0) this.drop(segment);
    }
    for (const name of names) {
      if (name.endsWith(".acks") && !existsSync(join(this.directory, name.replace(/\.acks$/, ".seg")))) {
        unlinkSync(join(this.directory, name));
      }
    }
    this.nextSegment = numbers.length ? numbers[numbers.length - 1]! + 1 : 1;
  }
}

/** The intact records of a segment as [offset, payload], and where the intact part ends. */
function scan(data: Buffer): [[number, Uint8Array][], number] {
  const records: [number, Uint8Array][] = [];
  let offset = 0;
  while (offset + HEADER <= data.length) {
    const length = data.readUInt32BE(offset);
    const crc = data.readUInt32BE(offset + 4);
    const start = offset + HEADER;
    const end = start + length;
    // length 0 also stops at a zero-filled tail, which a file system may leave after a crash.
    if (length === 0 || end > data.length || crc32(data.subarray(start, end)) !== crc) break;
    records.push([offset, new Uint8Array(data.subarray(start, end))]);
    offset = end;
  }
  return [records, offset];
}

function readAcks(path: string): Set<number> {
  if (!existsSync(path)) return new Set();
  const data = readFileSync(path);
  const offsets = new Set<number>();
  // A torn last ack only means one resend.
  for (let i = 0; i + ACK <= data.length; i += ACK) offsets.add(Number(data.readBigUInt64BE(i)));
  return offsets;
}

function fsyncDirectory(directory: string): void {
  const fd = openSync(directory, "r");
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

const fsyncFile = fsyncDirectory;

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** Take `node.lock`: written whole under a temporary name, then hard-linked into place, which
 * fails if the lock exists, so nobody ever reads a half-written lock. A lock whose process is
 * gone (killed, crashed) is taken over. */
function acquireLock(directory: string): void {
  const lock = join(directory, LOCK);
  const temporary = join(directory, `${LOCK}.${process.pid}.${Math.random().toString(36).slice(2)}`);
  const fd = openSync(temporary, "wx", 0o600);
  writeSync(fd, `${process.pid}\n`);
  fsyncSync(fd);
  closeSync(fd);
  try {
    for (let attempt = 0; attempt < 3; attempt++) {
      try {
        linkSync(temporary, lock);
        return;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== "EEXIST") throw error;
      }
      let holder = NaN;
      try {
        holder = Number.parseInt(readFileSync(lock, "utf8"), 10);
      } catch {
        continue; // released meanwhile
      }
      if (holder > 0 && alive(holder)) {
        throw new SpoolLocked(`spool ${directory} is in use by process ${holder}`);
      }
      try {
        unlinkSync(lock); // its process is gone
      } catch {
        // another process took it over first: look again
      }
    }
    throw new SpoolLocked(`spool ${directory}: could not take ${LOCK} (contended)`);
  } finally {
    unlinkSync(temporary);
  }
}

function releaseLock(directory: string): void {
  const lock = join(directory, LOCK);
  try {
    if (Number.parseInt(readFileSync(lock, "utf8"), 10) === process.pid) unlinkSync(lock);
  } catch {
    // already gone
  }
}

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** CRC-32 (IEEE, as zlib.crc32 in Python). */
export function crc32(data: Uint8Array): number {
  let c = 0xffffffff;
  for (let i = 0; i < data.length; i++) c = CRC_TABLE[(c ^ data[i]!) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}
