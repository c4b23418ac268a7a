// Telemetry: report events and move on; a background loop delivers them in batches, as
// rtrl_client/sdk.py + sender.py. Browser-safe: the store is given (a MemoryStore here,
// the durable Spool in the Node entry point).
//
// An event leaves the store only once the gateway gave a final answer: ACCEPTED, DUPLICATE
// (it already had the event: delivered), or REJECTED (reported to onRejected and dropped,
// never resent). RETRY answers, 5xx and network errors keep it stored and it is sent again
// with the same event_id; rounds without progress back off exponentially, with jitter.
import { EventResult_Status } from "./gen/rtrl/v1/ingest_pb.js";
import type { TelemetryEvent } from "./gen/rtrl/v1/telemetry_pb.js";
import { IngestClient, IngestError } from "./client.js";
import {
  decodeEvent,
  editOutcome,
  editShown,
  encodeEvent,
  type Envelope,
  followup,
  type OutcomeInput,
  persistenceSnapshot,
} from "./events.js";

/** The store holds its maximum of undelivered events: the event was not recorded. */
export class SpoolFull extends Error {
  override name = "SpoolFull";
}

export interface StoredEvent {
  seq: number;
  /** A serialized TelemetryEvent. */
  payload: Uint8Array;
  /** performance.now() of the append (of the start, for events found on disk). */
  storedAt: number;
}

/** Where reported events wait for a final answer. Synchronous: an append is done (and, for
 * the Spool, durable) when it returns. */
export interface EventStore {
  append(payloads: Uint8Array[]): number[];
  oldest(limit: number, maxBytes?: number): StoredEvent[];
  oldestStoredAt(): number | undefined;
  ack(seqs: Iterable<number>): void;
  unansweredThrough(seq: number): boolean;
  readonly size: number;
  readonly lastSeq: number;
  close(): void;
}

/** Events in memory, bounded: lost with the page or process. The browser's store. */
export class MemoryStore implements EventStore {
  private readonly events = new Map<number, StoredEvent>();
  private nextSeq = 0;
  private bytes = 0;
  constructor(
    private readonly maxEvents = 100_000,
    private readonly maxBytes = 64 * 1024 * 1024,
  ) {}
  append(payloads: Uint8Array[]): number[] {
    const size = payloads.reduce((n, p) => n + p.length, 0);
    if (this.events.size + payloads.length > this.maxEvents || this.bytes + size > this.maxBytes) {
      throw new SpoolFull(
        `${this.events.size} undelivered events (${this.bytes} bytes) in memory; ` +
          `${payloads.length} more would pass maxEvents=${this.maxEvents} or maxBytes=${this.maxBytes}`,
      );
    }
    const now = performance.now();
    this.bytes += size;
    return payloads.map((payload) => {
      const seq = this.nextSeq++;
      this.events.set(seq, { seq, payload, storedAt: now });
      return seq;
    });
  }
  oldest(limit: number, maxBytes?: number): StoredEvent[] {
    return takeOldest(this.events.values(), limit, maxBytes);
  }
  oldestStoredAt(): number | undefined {
    return this.events.values().next().value?.storedAt;
  }
  ack(seqs: Iterable<number>): void {
    for (const seq of seqs) {
      const event = this.events.get(seq);
      if (event) this.bytes -= event.payload.length;
      this.events.delete(seq);
    }
  }
  unansweredThrough(seq: number): boolean {
    const first = this.events.keys().next();
    return !first.done && first.value <= seq;
  }
  get size(): number {
    return this.events.size;
  }
  get lastSeq(): number {
    return this.nextSeq - 1;
  }
  close(): void {}
}

/** Up to limit events, oldest first, of at most maxBytes together (but always at least one). */
export function takeOldest(events: Iterable<StoredEvent>, limit: number, maxBytes?: number): StoredEvent[] {
  const out: StoredEvent[] = [];
  let size = 0;
  for (const event of events) {
    size += event.payload.length;
    if (out.length === limit || (out.length && maxBytes !== undefined && size > maxBytes)) break;
    out.push(event);
  }
  return out;
}

export interface TelemetrySettings {
  /** Most events per request; at most the gateway's RTRL_INGEST_MAX_BATCH (1,000). */
  maxBatch: number;
  /** Most serialized event bytes per request. */
  maxBatchBytes: number;
  /** How long to wait for a batch to fill before sending a partial one; flush() does not wait. */
  lingerMs: number;
  requestTimeoutMs: number;
  /** IngestClient attempts per batch before the batch is put back and the loop backs off. */
  attemptsPerRound: number;
  baseDelayMs: number;
  /** Longest backoff between rounds without progress (gateway down, key refused). */
  maxDelayMs: number;
  /** How long close(), and the exit hook for clients never closed, wait for delivery. */
  closeTimeoutMs: number;
  /** Most recent REJECTED events kept in Telemetry.rejected. */
  maxRejectedKept: number;
}

export const DEFAULT_SETTINGS: TelemetrySettings = {
  maxBatch: 500,
  maxBatchBytes: 4 * 1024 * 1024,
  lingerMs: 50,
  requestTimeoutMs: 10_000,
  attemptsPerRound: 4,
  baseDelayMs: 50,
  maxDelayMs: 5_000,
  closeTimeoutMs: 10_000,
  maxRejectedKept: 1000,
};

/** An event the gateway REJECTED: final, not resent. */
export interface RejectedEvent {
  event: TelemetryEvent;
  field: string;
  error: string;
}

/** The gateway's answers per event since this Telemetry started. */
export class DeliveryStats {
  accepted = 0;
  /** Events the gateway already had: resends after a lost answer, a cut or a restart. */
  duplicate = 0;
  rejected = 0;
  /** RETRY answers and events given up on after a round of errors; all are sent again. */
  retry = 0;
  /** Requests refused whole (IngestError: a refused key, a malformed batch). */
  refusedRequests = 0;
  get answered(): number {
    return this.accepted + this.duplicate + this.rejected;
  }
}

export interface Logger {
  warn(...args: unknown[]): void;
  error(...args: unknown[]): void;
}

export interface TelemetryOptions {
  apiKey?: string;
  settings?: Partial<TelemetrySettings>;
  /** Called once per REJECTED event; a throwing callback does not stop delivery. */
  onRejected?: (rejection: RejectedEvent) => void;
  logger?: Logger;
  fetch?: typeof fetch;
}

type ReportArgs<T> = Envelope & T;

export class TelemetryCore {
  readonly settings: TelemetrySettings;
  readonly stats = new DeliveryStats();
  /** The most recent REJECTED events (settings.maxRejectedKept of them). */
  readonly rejected: RejectedEvent[] = [];
  /** Why the latest round delivered nothing; undefined after a round with answers. */
  lastError: Error | undefined;
  protected closed = false;
  private stopping = false;
  private hurry = 0;
  private waiters: (() => void)[] = [];
  private readonly abort = new AbortController();
  private readonly client: IngestClient;
  private readonly loop: Promise<void>;
  private fatal: unknown;
  private readonly onRejected: ((rejection: RejectedEvent) => void) | undefined;
  private readonly logger: Logger;

  constructor(
    url: string,
    protected readonly store: EventStore,
    options: TelemetryOptions = {},
  ) {
    const s = (this.settings = { ...DEFAULT_SETTINGS, ...options.settings });
    if (Math.min(s.maxBatch, s.maxBatchBytes, s.attemptsPerRound) < 1 || s.maxDelayMs < s.baseDelayMs) {
      throw new RangeError("maxBatch, maxBatchBytes, attemptsPerRound must be >= 1, maxDelayMs >= baseDelayMs");
    }
    this.client = new IngestClient(url, {
      apiKey: options.apiKey,
      maxAttempts: s.attemptsPerRound,
      baseDelayMs: s.baseDelayMs,
      maxDelayMs: s.maxDelayMs,
      timeoutMs: s.requestTimeoutMs,
      maxBatch: s.maxBatch,
      fetch: options.fetch,
    });
    this.onRejected = options.onRejected;
    this.logger = options.logger ?? console;
    this.loop = this.run().catch((error: unknown) => {
      this.fatal = error;
      this.logger.error("telemetry: the sender failed; events stay stored", error);
      this.wake();
    });
  }

  // -- reporting: stored (durably, with the Spool) when the call returns --

  editShown(args: ReportArgs<{ filePath: string; editText: string }>): TelemetryEvent {
    return this.report(editShown(args));
  }
  editOutcome(args: ReportArgs<{ outcome: OutcomeInput }>): TelemetryEvent {
    return this.report(editOutcome(args));
  }
  persistenceSnapshot(args: ReportArgs<{ secondsAfterEdit: number; regionText: string }>): TelemetryEvent {
    return this.report(persistenceSnapshot(args));
  }
  followup(args: ReportArgs<{ secondsAfterEdit: number; message: string }>): TelemetryEvent {
    return this.report(followup(args));
  }

  /** Report ready-made events with one store write: all stored when this returns, or SpoolFull
   * and none is. */
  send(events: readonly TelemetryEvent[]): void {
    if (this.closed) throw new Error("Telemetry is closed");
    this.store.append(events.map(encodeEvent));
    this.wake();
  }

  private report(event: TelemetryEvent): TelemetryEvent {
    this.send([event]);
    return event;
  }

  /** Events stored and not answered yet. */
  get pending(): number {
    return this.store.size;
  }

  /** Wait until every event reported before this call is answered; false on timeout. Rejects
   * with the gateway's IngestError (IngestAuthError for a refused key) when waiting longer
   * cannot help; the events stay stored either way. */
  async flush(timeoutMs?: number): Promise<boolean> {
    const target = this.store.lastSeq;
    const deadline = timeoutMs === undefined ? Infinity : performance.now() + timeoutMs;
    this.hurry++;
    this.wake();
    try {
      while (this.store.unansweredThrough(target)) {
        if (this.fatal !== undefined) throw new Error("the telemetry sender failed", { cause: this.fatal });
        if (this.lastError instanceof IngestError) throw this.lastError;
        if (this.stopping) return false;
        const remaining = deadline - performance.now();
        if (remaining <= 0) return false;
        await this.waitWake(remaining === Infinity ? undefined : remaining, true);
      }
      return true;
    } finally {
      this.hurry--;
    }
  }

  /** Flush for up to timeoutMs (settings.closeTimeoutMs), stop sending and release the store.
   * True if everything was delivered; the rest stays in the Spool for the next Telemetry on the
   * same directory. A refused key is logged here, not thrown (lastError has it). */
  async close(timeoutMs?: number): Promise<boolean> {
    if (this.closed) return this.store.size === 0;
    this.closed = true;
    let delivered = false;
    try {
      delivered = await this.flush(timeoutMs ?? this.settings.closeTimeoutMs);
    } catch (error) {
      if (!(error instanceof IngestError)) throw error;
      this.logger.error("telemetry: closing while the gateway refuses the request:", error.message);
    } finally {
      this.stopping = true;
      this.abort.abort(new Error("Telemetry closed")); // an answer lost here means a DUPLICATE later
      this.wake();
      await this.loop;
      this.store.close();
      this.onClosed();
    }
    if (!delivered && this.store.size) {
      this.logger.warn(`telemetry: ${this.store.size} events not delivered yet; they stay stored`);
    }
    return delivered;
  }

  protected onClosed(): void {}

  // -- the sender --

  private wake(): void {
    const waiters = this.waiters;
    this.waiters = [];
    for (const resolve of waiters) resolve();
  }

  /** Until wake() or ms pass. Timers of the loop do not keep a Node process alive unless a flush
   * waits (an idle process still reaches beforeExit, whose hook closes the client). */
  private waitWake(ms: number | undefined, keepAlive = this.hurry > 0): Promise<void> {
    return new Promise((resolve) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const done = () => {
        if (timer !== undefined) clearTimeout(timer);
        resolve();
      };
      this.waiters.push(done);
      if (ms !== undefined) {
        timer = setTimeout(done, Math.max(0, ms));
        if (!keepAlive) (timer as { unref?: () => void }).unref?.();
      }
    });
  }

  private async run(): Promise<void> {
    const s = this.settings;
    let idleRounds = 0;
    while (!this.stopping) {
      let backoff = 0;
      if (idleRounds) {
        const ceiling = Math.min(s.maxDelayMs, s.baseDelayMs * 2 ** idleRounds);
        backoff = ceiling / 2 + Math.random() * (ceiling / 2);
      }
      const batch = await this.nextBatch(performance.now() + backoff);
      if (batch === undefined) return;
      const progressed = await this.deliver(batch);
      idleRounds = progressed ? 0 : idleRounds + 1;
    }
  }

  /** The next batch once there is one worth sending; undefined when stopping. */
  private async nextBatch(notBefore: number): Promise<StoredEvent[] | undefined> {
    const s = this.settings;
    while (!this.stopping) {
      const now = performance.now();
      const oldest = this.store.oldestStoredAt();
      if (oldest === undefined) {
        await this.waitWake(undefined);
        continue;
      }
      if (now < notBefore) {
        await this.waitWake(notBefore - now);
        continue;
      }
      const sendAt = oldest + s.lingerMs;
      if (this.store.size >= s.maxBatch || this.hurry || now >= sendAt) {
        return this.store.oldest(s.maxBatch, s.maxBatchBytes);
      }
      await this.waitWake(sendAt - now);
    }
    return undefined;
  }

  /** Send one batch; ack what got a final answer. Whether anything did. */
  private async deliver(batch: StoredEvent[]): Promise<boolean> {
    const events = batch.map((item) => decodeEvent(item.payload));
    let results;
    try {
      results = await this.client.publish(events, { signal: this.abort.signal });
    } catch (error) {
      if (this.abort.signal.aborted) return false;
      if (!(error instanceof IngestError)) throw error;
      this.stats.refusedRequests++;
      if (error.message !== this.lastError?.message) {
        this.logger.error("telemetry: the gateway refused the request, events stay stored:", error.message);
      }
      this.lastError = error;
      this.wake();
      return false;
    }
    const answered: number[] = [];
    const rejected: RejectedEvent[] = [];
    results.forEach((result, i) => {
      switch (result.status) {
        case EventResult_Status.ACCEPTED:
          this.stats.accepted++;
          break;
        case EventResult_Status.DUPLICATE:
          this.stats.duplicate++;
          break;
        case EventResult_Status.REJECTED:
          this.stats.rejected++;
          rejected.push({ event: events[i]!, field: result.field, error: result.error });
          break;
        default:
          this.stats.retry++;
          return;
      }
      answered.push(batch[i]!.seq);
    });
    this.store.ack(answered);
    for (const rejection of rejected) this.reportRejected(rejection);
    this.lastError = answered.length ? undefined : new Error(`every event got RETRY, the first: ${results[0]?.error}`);
    this.wake();
    return answered.length > 0;
  }

  private reportRejected(rejection: RejectedEvent): void {
    this.logger.warn(
      `telemetry event ${rejection.event.eventId} rejected by the gateway: ${rejection.field}: ${rejection.error}`,
    );
    if (this.settings.maxRejectedKept > 0) {
      this.rejected.push(rejection);
      if (this.rejected.length > this.settings.maxRejectedKept) this.rejected.shift();
    }
    try {
      this.onRejected?.(rejection);
    } catch (error) {
      // The product's callback must not stop delivery of everything else.
      this.logger.error(`telemetry: onRejected failed for event ${rejection.event.eventId}`, error);
    }
  }
}
