// The durable spool of the Node SDK: events stay on disk until the gateway answered them.
// The layout is the Python SDK's (clients/python/src/rtrl_client/spool.py), big-endian:
//   <n>.seg     records `MARK | u32 length | u32 crc32(payload) | payload` (a serialized
//               TelemetryEvent), appended only; <n> is 16 decimal digits
//   <n>.acks    u64 offsets of that segment's records that got a final answer
//   spool.lock  the owner, as {"pid", "host", "started"} (rtrl_client/spool_lock.py)
// A segment is deleted once every record in it is answered. A damaged record costs that record
// only: the reader resynchronizes on the next MARK whose record passes its CRC; a record torn by
// a crash mid-append (its append never returned) is cut off the end. Only regular files named
// as above are read, written or deleted; no symbolic link is followed (O_NOFOLLOW everywhere,
// the directory's mode set through its own descriptor).
// One process per directory, this SDK's or Python's: `spool.lock` is written whole under a
// temporary name and hard-linked into place (which fails if a lock exists); a lock whose owner
// is gone (a dead pid, a pid that started at another moment, no owner at all) is moved aside
// and taken over. A lock from another host is never judged: a person removes it.
import {
  closeSync,
  constants,
  fchmodSync,
  fstatSync,
  fsyncSync,
  ftruncateSync,
  mkdirSync,
  openSync,
  readdirSync,
  readFileSync,
  unlinkSync,
  writeSync,
} from "node:fs";
import { join } from "node:path";
import { acquireLock, releaseLock, SpoolLocked } from "./spool_lock.js";
import { type EventStore, SpoolFull, type StoredEvent, takeOldest } from "./telemetry.js";

export { SpoolLocked };

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

/** Starts every record: where a reader resynchronizes after a damaged one. */
const MARK = Buffer.from([0xf0, 0x53, 0x50, 0x32]);
const HEADER = 12;
const LEGACY_HEADER = 8;
const ACK = 8;
/** The only names the spool reads, writes or deletes. */
const OWN_NAME = /^([0-9]{16})\.(seg|acks)$/;
const NOFOLLOW = constants.O_NOFOLLOW;

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
  private readonly owner: string;

  constructor(directory: string, options: SpoolOptions = {}) {
    this.directory = directory;
    this.maxBytes = options.maxBytes ?? 256 * 1024 * 1024;
    this.maxEvents = options.maxEvents ?? 1_000_000;
    this.segmentBytes = options.segmentBytes ?? 4 * 1024 * 1024;
    this.fsync = options.fsync ?? true;
    if (!(this.segmentBytes > 0 && this.segmentBytes <= this.maxBytes) || this.maxEvents < 1) {
      throw new RangeError("segmentBytes must be in 1..maxBytes and maxEvents >= 1");
    }
    ownDirectory(directory);
    this.owner = acquireLock(directory);
    try {
      this.load();
    } catch (error) {
      releaseLock(directory, this.owner);
      throw error;
    }
  }

  /** Record payloads durably (one write, one fsync); their sequence numbers, in order. */
  append(payloads: Uint8Array[]): number[] {
    if (!payloads.length) return [];
    if (this.closed) throw new Error(`spool ${this.directory} is closed`);
    const frames = payloads.map((p) => {
      const frame = Buffer.allocUnsafe(HEADER + p.length);
      frame.set(MARK, 0);
      frame.writeUInt32BE(p.length, 4);
      frame.writeUInt32BE(crc32(p), 8);
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
      const flags = constants.O_WRONLY | constants.O_CREAT | constants.O_APPEND | NOFOLLOW;
      const fd = openSync(this.path(segment, "acks"), flags, 0o600);
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
    releaseLock(this.directory, this.owner);
  }

  private path(segment: Segment, kind: "seg" | "acks"): string {
    return join(this.directory, `${String(segment.number).padStart(16, "0")}.${kind}`);
  }

  private segmentFor(size: number): [Segment, number] {
    if (this.active && this.active.size > 0 && this.active.size + size > this.segmentBytes) this.closeActive();
    if (!this.active || this.activeFd === undefined) {
      const segment: Segment = { number: this.nextSegment++, size: 0, acksSize: 0, unanswered: 0 };
      const flags = constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_APPEND | NOFOLLOW;
      this.activeFd = openSync(this.path(segment, "seg"), flags, 0o600);
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
    unlinkIfThere(this.path(segment, "acks"));
    this.bytesUsed -= segment.size + segment.acksSize;
  }

  private load(): void {
    const started = performance.now();
    const found = ownFiles(this.directory);
    const numbers = [...found.keys()].filter((n) => found.get(n)!.has("seg")).sort((a, b) => a - b);
    for (const number of numbers) this.loadSegment({ number, size: 0, acksSize: 0, unanswered: 0 }, started);
    for (const [number, kinds] of found) {
      // An ack file outlives its segment when a crash falls between the two unlinks; a later
      // segment of that number must not inherit its acks.
      if (kinds.has("acks") && !kinds.has("seg")) unlinkIfThere(this.path({ number } as Segment, "acks"));
    }
    this.nextSegment = Math.max(0, ...found.keys()) + 1;
  }

  private loadSegment(segment: Segment, started: number): void {
    const path = this.path(segment, "seg");
    const data = readOwn(path);
    const [records, end] = scan(data);
    if (end < data.length) {
      const fd = openSync(path, constants.O_WRONLY | NOFOLLOW);
      try {
        ftruncateSync(fd, end);
        if (this.fsync) fsyncSync(fd);
      } finally {
        closeSync(fd);
      }
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
}

/** The intact records of a segment as [offset, payload], and where the last one ends. */
function scan(data: Buffer): [[number, Uint8Array][], number] {
  if (legacyRecord(data, 0)) return scanLegacy(data);
  const records: [number, Uint8Array][] = [];
  let offset = 0;
  let end = 0;
  while (offset >= 0 && offset < data.length) {
    const payload = record(data, offset);
    if (payload) {
      records.push([offset, payload]);
      offset = end = offset + HEADER + payload.length;
    } else {
      offset = data.indexOf(MARK, offset + 1); // damaged or torn: the next mark may start an intact one
    }
  }
  return [records, end];
}

/** The payload of the intact record at `offset`, if there is one. */
function record(data: Buffer, offset: number): Uint8Array | undefined {
  if (offset + HEADER > data.length || !data.subarray(offset, offset + 4).equals(MARK)) return undefined;
  const length = data.readUInt32BE(offset + 4);
  const start = offset + HEADER;
  // length 0 never is a record: it also rejects a zero-filled tail a crash may leave.
  if (length === 0 || start + length > data.length) return undefined;
  const payload = data.subarray(start, start + length);
  return crc32(payload) === data.readUInt32BE(offset + 8) ? new Uint8Array(payload) : undefined;
}

/** The payload of the intact record without MARK (the format before it) at `offset`. */
function legacyRecord(data: Buffer, offset: number): Uint8Array | undefined {
  if (offset + LEGACY_HEADER > data.length) return undefined;
  const length = data.readUInt32BE(offset);
  const start = offset + LEGACY_HEADER;
  if (length === 0 || start + length > data.length) return undefined;
  const payload = data.subarray(start, start + length);
  return crc32(payload) === data.readUInt32BE(offset + 4) ? new Uint8Array(payload) : undefined;
}

/** A segment written before MARK: its records up to the first damaged one. */
function scanLegacy(data: Buffer): [[number, Uint8Array][], number] {
  const records: [number, Uint8Array][] = [];
  let offset = 0;
  for (let payload = legacyRecord(data, 0); payload; payload = legacyRecord(data, offset)) {
    records.push([offset, payload]);
    offset += LEGACY_HEADER + payload.length;
  }
  return [records, offset];
}

/** Create the directory (0700) if need be and make it its owner's alone, through its own
 * descriptor: a directory that is a symbolic link is refused, never followed. */
function ownDirectory(directory: string): void {
  // Events hold users' code and messages: the spool is its owner's alone.
  mkdirSync(directory, { recursive: true, mode: 0o700 });
  let fd: number;
  try {
    fd = openSync(directory, constants.O_RDONLY | constants.O_DIRECTORY | NOFOLLOW);
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    if (code === "ELOOP" || code === "ENOTDIR") {
      throw new Error(`spool ${directory} is not a directory of its own (a symbolic link?)`);
    }
    throw error;
  }
  try {
    fchmodSync(fd, 0o700);
  } finally {
    closeSync(fd);
  }
}

/** The spool's own files by segment number: regular files named as the spool names them.
 * Anything else in the directory is somebody else's. */
function ownFiles(directory: string): Map<number, Set<string>> {
  const found = new Map<number, Set<string>>();
  for (const entry of readdirSync(directory, { withFileTypes: true })) {
    const name = OWN_NAME.exec(entry.name);
    if (!name || !entry.isFile()) continue;
    const number = Number(name[1]);
    if (!found.has(number)) found.set(number, new Set());
    found.get(number)!.add(name[2]!);
  }
  return found;
}

/** A file of the spool's, read whole, without following a symbolic link. */
function readOwn(path: string): Buffer {
  const fd = openSync(path, constants.O_RDONLY | NOFOLLOW);
  try {
    if (!fstatSync(fd).isFile()) throw new Error(`${path} is not a regular file`);
    return readFileSync(fd);
  } finally {
    closeSync(fd);
  }
}

function unlinkIfThere(path: string): void {
  try {
    unlinkSync(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== "ENOENT") throw error;
  }
}

function readAcks(path: string): Set<number> {
  let data: Buffer;
  try {
    data = readOwn(path);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return new Set();
    throw error;
  }
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
