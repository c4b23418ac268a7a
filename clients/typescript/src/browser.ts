// The browser entry point: no spool (events wait in memory) and no node: imports.
// flush() before the page goes away; nothing survives a closed tab.
import { MemoryStore, TelemetryCore, type TelemetryOptions } from "./telemetry.js";

export * from "./common.js";

export interface BrowserTelemetryOptions extends TelemetryOptions {
  /** Most undelivered events kept in memory (default 10,000). */
  maxEvents?: number;
  /** Most undelivered serialized bytes kept in memory (default 16 MiB). */
  maxBytes?: number;
}

/** Reports events to memory and delivers them in the background. */
export class Telemetry extends TelemetryCore {
  constructor(url: string, options: BrowserTelemetryOptions = {}) {
    super(url, new MemoryStore(options.maxEvents ?? 10_000, options.maxBytes ?? 16 * 1024 * 1024), options);
  }
}
