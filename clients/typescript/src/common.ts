// What both entry points export: events, the HTTP client, the generated types.
export * from "./events.js";
export {
  IngestClient,
  IngestError,
  IngestAuthError,
  SDK,
  SDK_HEADER,
  Status,
  parseRetryAfterMs,
  sdkHeaders,
} from "./client.js";
export { VERSION } from "./version.js";
export type { IngestClientOptions, PublishOptions } from "./client.js";
export {
  DEFAULT_SETTINGS,
  DeliveryStats,
  MemoryStore,
  SpoolFull,
  type EventStore,
  type Logger,
  type RejectedEvent,
  type StoredEvent,
  type TelemetryOptions,
  type TelemetrySettings,
} from "./telemetry.js";
export * from "./gen/rtrl/v1/telemetry_pb.js";
export * from "./gen/rtrl/v1/ingest_pb.js";
