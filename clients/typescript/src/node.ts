// The Node entry point: Telemetry over a durable Spool, closed (flushed) at beforeExit.
import { Spool, type SpoolOptions } from "./spool.js";
import { TelemetryCore, type TelemetryOptions } from "./telemetry.js";

export * from "./common.js";
export { Spool, SpoolLocked, crc32, type SpoolOptions } from "./spool.js";

export interface NodeTelemetryOptions extends TelemetryOptions {
  /** Where events wait for the gateway's answer; survives a restart. One process at a time. */
  spoolDir: string;
  spool?: SpoolOptions;
}

const open = new Set<Telemetry>();
let hooked = false;

function closeAtExit(): void {
  // beforeExit runs when the event loop is empty (not on process.exit() or a signal): close
  // every client never closed, within its closeTimeoutMs; undelivered events stay spooled.
  for (const telemetry of open) {
    open.delete(telemetry);
    telemetry.close().catch((error: unknown) => {
      console.error("telemetry: flush at exit failed; undelivered events stay in the spool", error);
    });
  }
}

/** Reports events to an fsynced on-disk spool (durable when the call returns) and delivers
 * them in the background. */
export class Telemetry extends TelemetryCore {
  readonly spool: Spool;

  constructor(url: string, options: NodeTelemetryOptions) {
    const spool = new Spool(options.spoolDir, options.spool);
    try {
      super(url, spool, options);
    } catch (error) {
      spool.close();
      throw error;
    }
    this.spool = spool;
    open.add(this);
    if (!hooked) {
      hooked = true;
      process.on("beforeExit", closeAtExit);
    }
  }

  protected override onClosed(): void {
    open.delete(this);
  }
}
