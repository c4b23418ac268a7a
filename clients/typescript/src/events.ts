// Typed TelemetryEvents: one helper per payload, named and shaped as in the Python SDK (rtrl_client/sdk.py)
// (edit_shown, edit_outcome, persistence_snapshot, followup), camelCase as in the generated types.
import { create, fromBinary, toBinary, toJson, type JsonValue } from "@bufbuild/protobuf";
import {
  EditOutcome_Outcome,
  EditOutcomeSchema,
  EditShownSchema,
  FollowUpSchema,
  PersistenceSnapshotSchema,
  type TelemetryEvent,
  TelemetryEventSchema,
} from "./gen/rtrl/v1/telemetry_pb.js";

/** The only schema_version the gateway accepts (ingest/validation.py). */
export const SCHEMA_VERSION = 1;

/** What every event carries besides its payload. */
export interface Envelope {
  rolloutId: string;
  sessionId: string;
  userId: string;
  /** The user is in privacy mode: the gateway answers but the event never reaches a topic. */
  privacyMode?: boolean;
  /** Milliseconds since the epoch; now by default. */
  clientTsMs?: number | bigint;
  /** The dedup key; a fresh UUIDv4 by default. Give one only to re-create the same event. */
  eventId?: string;
}

export type Payload = TelemetryEvent["payload"];

export type OutcomeInput = EditOutcome_Outcome | "accepted" | "rejected";

/** A lowercase hyphenated UUIDv4, the only spelling of event_id the gateway accepts. */
export function uuid4(): string {
  const c = globalThis.crypto;
  if (typeof c?.randomUUID === "function") return c.randomUUID();
  // randomUUID is missing outside secure contexts (plain-http pages): build one from random bytes.
  const b = c.getRandomValues(new Uint8Array(16));
  b[6] = ((b[6] ?? 0) & 0x0f) | 0x40;
  b[8] = ((b[8] ?? 0) & 0x3f) | 0x80;
  const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

/** A TelemetryEvent with a fresh event_id (unless given) and exactly one payload. */
export function makeEvent(envelope: Envelope, payload: Exclude<Payload, { case: undefined }>): TelemetryEvent {
  const ts = envelope.clientTsMs ?? Date.now();
  return create(TelemetryEventSchema, {
    eventId: envelope.eventId ?? uuid4(),
    rolloutId: envelope.rolloutId,
    sessionId: envelope.sessionId,
    userId: envelope.userId,
    clientTsMs: typeof ts === "bigint" ? ts : BigInt(Math.trunc(ts)),
    schemaVersion: SCHEMA_VERSION,
    privacyMode: envelope.privacyMode ?? false,
    payload,
  });
}

/** The product showed the user an edit written by the policy. */
export function editShown(args: Envelope & { filePath: string; editText: string }): TelemetryEvent {
  const value = create(EditShownSchema, { filePath: args.filePath, editText: args.editText });
  return makeEvent(args, { case: "editShown", value });
}

/** What the user did with the edit right away: "accepted"/"rejected" or an EditOutcome_Outcome. */
export function editOutcome(args: Envelope & { outcome: OutcomeInput }): TelemetryEvent {
  const outcome =
    args.outcome === "accepted"
      ? EditOutcome_Outcome.ACCEPTED
      : args.outcome === "rejected"
        ? EditOutcome_Outcome.REJECTED
        : args.outcome;
  return makeEvent(args, { case: "editOutcome", value: create(EditOutcomeSchema, { outcome }) });
}

/** The edited region as it looked secondsAfterEdit after the edit was applied. */
export function persistenceSnapshot(
  args: Envelope & { secondsAfterEdit: number; regionText: string },
): TelemetryEvent {
  const value = create(PersistenceSnapshotSchema, {
    secondsAfterEdit: args.secondsAfterEdit,
    regionText: args.regionText,
  });
  return makeEvent(args, { case: "persistence", value });
}

/** A message the user sent after seeing the edit. */
export function followup(
  args: Envelope & { secondsAfterEdit: number; message: string },
): TelemetryEvent {
  const value = create(FollowUpSchema, {
    secondsAfterEdit: args.secondsAfterEdit,
    message: args.message,
  });
  return makeEvent(args, { case: "followup", value });
}

/** The protobuf wire bytes of an event (what the spool stores). */
export function encodeEvent(event: TelemetryEvent): Uint8Array {
  return toBinary(TelemetryEventSchema, event);
}

export function decodeEvent(bytes: Uint8Array): TelemetryEvent {
  return fromBinary(TelemetryEventSchema, bytes);
}

/** The protobuf JSON mapping of an event (what the gateway's HTTP API takes). */
export function eventToJson(event: TelemetryEvent): JsonValue {
  return toJson(TelemetryEventSchema, event);
}
