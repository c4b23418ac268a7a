// The shared conformance vectors (clients/conformance/), turned into this SDK's calls.
import { readFileSync } from "node:fs";
import { fromJson, toJson } from "@bufbuild/protobuf";
import * as sdk from "@rtrl/client";

const dir = new URL("../../../conformance/", import.meta.url);
export const EVENTS = JSON.parse(readFileSync(new URL("events.json", dir), "utf8")).cases;
export const STATUSES = JSON.parse(readFileSync(new URL("statuses.json", dir), "utf8"));

const camel = (name) => name.replace(/_([a-z])/g, (_, c) => c.toUpperCase());
const HELPERS = {
  edit_shown: sdk.editShown,
  edit_outcome: sdk.editOutcome,
  persistence_snapshot: sdk.persistenceSnapshot,
  followup: sdk.followup,
};

/** The case's event: its helper with its args (camelCased), its event_id, its overrides. */
export function build(testCase) {
  const args = Object.fromEntries(Object.entries(testCase.args).map(([k, v]) => [camel(k), v]));
  if (testCase.event_id) args.eventId = testCase.event_id;
  const event = HELPERS[testCase.helper](args);
  if (!testCase.override) return event;
  const json = { ...toJson(sdk.TelemetryEventSchema, event), ...testCase.override };
  for (const key of Object.keys(json)) if (json[key] === null) delete json[key];
  return fromJson(sdk.TelemetryEventSchema, json);
}

export const statusName = (status) => sdk.Status[status];
export const hex = (bytes) => Buffer.from(bytes).toString("hex");
