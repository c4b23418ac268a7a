// The shared conformance vectors (clients/conformance/) against this SDK; the Python SDK reads
// the same files in tests/clients/test_conformance.py.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { equals, fromBinary, fromJson, toJson } from "@bufbuild/protobuf";
import {
  IngestAuthError,
  IngestClient,
  TelemetryEventSchema,
  encodeEvent,
  eventToJson,
} from "@rtrl/client";
import { startRig } from "./support/rig.mjs";
import { EVENTS, STATUSES, build, hex, statusName } from "./support/vectors.mjs";

describe("events.json: helpers encode to the shared wire bytes and JSON", () => {
  for (const testCase of EVENTS) {
    test(testCase.name, () => {
      const event = build(testCase);
      assert.equal(hex(encodeEvent(event)), testCase.wire_hex);
      assert.deepEqual(eventToJson(event), testCase.json);
      const fromWire = fromBinary(TelemetryEventSchema, Buffer.from(testCase.wire_hex, "hex"));
      assert.ok(equals(TelemetryEventSchema, fromWire, event));
      assert.ok(equals(TelemetryEventSchema, fromJson(TelemetryEventSchema, testCase.json), event));
    });
  }
});

describe("statuses.json: the real gateway answers as the vectors say", () => {
  let rig;
  const sent = [];
  before(async () => {
    rig = await startRig();
  });
  after(async () => {
    await rig?.quit();
  });

  test("every case's status and rejected field", async () => {
    const client = new IngestClient(rig.url, { apiKey: rig.apiKey, maxAttempts: 3 });
    for (const testCase of STATUSES.cases) {
      const event = build(testCase);
      const got = [];
      for (let i = 0; i < (testCase.sends ?? 1); i++) {
        const [result] = await client.publish([event]);
        got.push({ status: statusName(result.status), ...(result.field ? { field: result.field } : {}) });
        if (result.status !== 1 && result.status !== 2) assert.ok(result.error, `${testCase.name}: no reason`);
      }
      assert.deepEqual(got, testCase.expect, testCase.name);
      sent.push([testCase, event]);
    }
  });

  test("accepted events land exactly once, rejected and private ones never", async () => {
    assert.equal(sent.length, STATUSES.cases.length);
    const counts = await rig.count();
    for (const [testCase, event] of sent) {
      assert.equal(counts[event.eventId] ?? 0, testCase.lands ? 1 : 0, testCase.name);
    }
  });

  for (const authCase of STATUSES.auth_cases) {
    test(`auth: ${authCase.name}`, async () => {
      const client = new IngestClient(rig.url, authCase.api_key === null ? {} : { apiKey: authCase.api_key });
      await assert.rejects(client.publish([build(STATUSES.cases[0])]), (error) => {
        assert.ok(error instanceof IngestAuthError, String(error));
        assert.equal(error.status, authCase.http_status);
        return true;
      });
    });
  }
});
