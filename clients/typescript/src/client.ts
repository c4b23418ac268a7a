// One request's worth of delivery: POST /v1/events with retries, as the Python SDK's rtrl_client/client.py.
//
// publish() resends only what the gateway could not take (RETRY results, 429/5xx answers,
// network errors and timeouts) with exponential backoff and jitter, waiting at least the
// Retry-After of a 429, and always with the same event ids: the gateway deduplicates by
// event_id, so a resend is answered DUPLICATE, never written twice. A refused key (401/403)
// throws IngestAuthError at once; a request refused whole (malformed, too large) IngestError.
import { create, fromJson, toJsonString } from "@bufbuild/protobuf";
import {
  type EventResult,
  EventResult_Status,
  EventResultSchema,
  PublishEventsRequestSchema,
  PublishEventsResponseSchema,
} from "./gen/rtrl/v1/ingest_pb.js";
import type { TelemetryEvent } from "./gen/rtrl/v1/telemetry_pb.js";
import { VERSION } from "./version.js";

export { EventResult_Status as Status };

/** This SDK's name and version, as every request names it. */
export const SDK = `rtrl-client-ts/${VERSION}`;
/** The header naming the SDK, the Python SDK's too; the gateway counts events by it. */
export const SDK_HEADER = "X-Rtrl-Sdk";

/** The SDK's name on every request: X-Rtrl-Sdk everywhere, and a User-Agent on Node. A
 * browser's fetch keeps its own User-Agent, and one set by a page would be one more header
 * for the CORS preflight to allow. */
export function sdkHeaders(): Record<string, string> {
  const node = (globalThis as { process?: { versions?: { node?: string } } }).process?.versions?.node;
  return node ? { [SDK_HEADER]: SDK, "User-Agent": `${SDK} node/${node}` } : { [SDK_HEADER]: SDK };
}

/** The gateway refused a whole request (malformed or oversized): resending will not help. */
export class IngestError extends Error {
  override name = "IngestError";
}

/** The gateway refused the API key: missing, unknown or revoked (401), or not allowed to send
 * these events (403). Resending with the same key will not help. */
export class IngestAuthError extends IngestError {
  override name = "IngestAuthError";
  constructor(
    readonly status: number,
    readonly detail: string,
  ) {
    super(`HTTP ${status}: ${detail}`);
  }
}

export interface IngestClientOptions {
  apiKey?: string;
  /** Requests per batch before giving up on what is still RETRY (default 8). */
  maxAttempts?: number;
  baseDelayMs?: number;
  maxDelayMs?: number;
  /** Total time of one HTTP request (default 10 s). */
  timeoutMs?: number;
  /** Most events per request; at most the gateway's max_batch (default 500). */
  maxBatch?: number;
  /** Uniform [0, 1): the backoff's jitter. */
  random?: () => number;
  fetch?: typeof fetch;
}

export interface PublishOptions {
  /** W3C traceparent of the completion the events are about. */
  traceparent?: string;
  /** Aborts the request in flight and the backoff (the promise rejects with the reason). */
  signal?: AbortSignal;
}

class Retryable extends Error {
  constructor(
    message: string,
    readonly retryAfterMs = 0,
  ) {
    super(message);
  }
}

export class IngestClient {
  private readonly url: string;
  private readonly headers: Record<string, string>;
  private readonly maxAttempts: number;
  private readonly baseDelayMs: number;
  private readonly maxDelayMs: number;
  private readonly timeoutMs: number;
  private readonly maxBatch: number;
  private readonly random: () => number;
  private readonly fetch: typeof fetch;

  constructor(httpUrl: string, options: IngestClientOptions = {}) {
    this.maxAttempts = options.maxAttempts ?? 8;
    this.maxBatch = options.maxBatch ?? 500;
    if (this.maxAttempts < 1 || this.maxBatch < 1) {
      throw new RangeError("maxAttempts and maxBatch must be >= 1");
    }
    if (!/^https?:\/\//.test(httpUrl)) {
      throw new TypeError(`the gateway URL must be http(s)://host:port, got ${JSON.stringify(httpUrl)}`);
    }
    this.url = httpUrl.replace(/\/+$/, "") + "/v1/events";
    this.headers = { "Content-Type": "application/json", ...sdkHeaders() };
    if (options.apiKey !== undefined) this.headers["Authorization"] = `Bearer ${options.apiKey}`;
    this.baseDelayMs = options.baseDelayMs ?? 50;
    this.maxDelayMs = options.maxDelayMs ?? 2000;
    this.timeoutMs = options.timeoutMs ?? 10_000;
    this.random = options.random ?? Math.random;
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** One result per event, in order. Events still RETRY after the last attempt come back as
   * RETRY with the last error; every other result is final. */
  async publish(events: readonly TelemetryEvent[], options: PublishOptions = {}): Promise<EventResult[]> {
    const results: EventResult[] = [];
    for (let start = 0; start < events.length; start += this.maxBatch) {
      results.push(...(await this.publishBatch(events.slice(start, start + this.maxBatch), options)));
    }
    return results;
  }

  private async publishBatch(events: TelemetryEvent[], options: PublishOptions): Promise<EventResult[]> {
    const results: (EventResult | undefined)[] = new Array(events.length).fill(undefined);
    let pending = events.map((_, i) => i);
    let lastError = "";
    let retryAfterMs = 0;
    for (let attempt = 0; attempt < this.maxAttempts && pending.length; attempt++) {
      if (attempt) await sleep(Math.max(this.backoffMs(attempt), retryAfterMs), options.signal);
      let answer: EventResult[];
      try {
        [answer, retryAfterMs] = await this.post(pending.map((i) => events[i]!), options);
      } catch (error) {
        if (!(error instanceof Retryable)) throw error;
        [lastError, retryAfterMs] = [error.message, error.retryAfterMs];
        continue;
      }
      const stillPending: number[] = [];
      pending.forEach((i, k) => {
        const result = answer[k]!;
        results[i] = result;
        if (result.status === EventResult_Status.RETRY) {
          stillPending.push(i);
          lastError = result.error || lastError;
        }
      });
      pending = stillPending;
    }
    const gaveUp = `gave up after ${this.maxAttempts} attempts: ${lastError}`;
    return results.map(
      (result, i) =>
        result ??
        create(EventResultSchema, {
          eventId: events[i]!.eventId,
          status: EventResult_Status.RETRY,
          error: gaveUp,
        }),
    );
  }

  /** The gateway's answer and how long it asked us to wait before resending its RETRYs. */
  private async post(events: TelemetryEvent[], options: PublishOptions): Promise<[EventResult[], number]> {
    const body = toJsonString(PublishEventsRequestSchema, create(PublishEventsRequestSchema, { events }));
    const headers = options.traceparent ? { ...this.headers, traceparent: options.traceparent } : this.headers;
    const timeout = AbortSignal.timeout(this.timeoutMs);
    const signal = options.signal ? AbortSignal.any([options.signal, timeout]) : timeout;
    let status: number;
    let text: string;
    let retryAfterHeader: string | null;
    try {
      const response = await this.fetch(this.url, { method: "POST", body, headers, signal });
      status = response.status;
      retryAfterHeader = response.headers.get("Retry-After");
      text = await response.text();
    } catch (error) {
      if (options.signal?.aborted) throw options.signal.reason;
      // fetch's network errors are TypeErrors ("fetch failed"), a timeout a DOMException.
      const cause = (error as { cause?: { code?: string } }).cause?.code;
      throw new Retryable(`${(error as Error).name}: ${(error as Error).message}${cause ? ` (${cause})` : ""}`);
    }
    if (status >= 500) throw new Retryable(`HTTP ${status}: ${text.slice(0, 200)}`);
    let document: unknown;
    try {
      document = text ? JSON.parse(text) : {};
    } catch {
      document = { error: text.slice(0, 200) };
    }
    const refusal =
      document !== null && typeof document === "object" && "error" in document
        ? String((document as { error: unknown }).error)
        : undefined;
    const message = refusal ?? text.slice(0, 200);
    const retryAfterMs = status === 429 ? parseRetryAfterMs(retryAfterHeader) : 0;
    if (status === 401 || status === 403) throw new IngestAuthError(status, message);
    // A 429 refusing the whole request (a rate limit), not per event: nothing was looked at.
    if (status === 429 && refusal !== undefined) throw new Retryable(`HTTP 429: ${message}`, retryAfterMs);
    if (refusal !== undefined || ![200, 207, 400, 429].includes(status)) {
      throw new IngestError(`HTTP ${status}: ${message}`);
    }
    const answer = fromJson(PublishEventsResponseSchema, document as never, { ignoreUnknownFields: true });
    if (answer.results.length !== events.length) {
      throw new IngestError(`gateway answered ${answer.results.length} results for ${events.length} events`);
    }
    return [answer.results, retryAfterMs];
  }

  private backoffMs(attempt: number): number {
    // Half fixed, half random: spreads the retries of many clients.
    const ceiling = Math.min(this.maxDelayMs, this.baseDelayMs * 2 ** (attempt - 1));
    return ceiling / 2 + this.random() * (ceiling / 2);
  }
}

/** Milliseconds from a Retry-After header; the HTTP-date form is read as "soon". */
export function parseRetryAfterMs(header: string | null): number {
  const seconds = header ? Number(header) : 0;
  return Number.isFinite(seconds) && seconds > 0 ? seconds * 1000 : 0;
}

/** Resolves after ms, rejects with signal's reason once it aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const done = () => {
      signal?.removeEventListener("abort", aborted);
      resolve();
    };
    const timer = setTimeout(done, ms);
    const aborted = () => {
      clearTimeout(timer);
      reject(signal!.reason);
    };
    signal?.addEventListener("abort", aborted, { once: true });
  });
}
