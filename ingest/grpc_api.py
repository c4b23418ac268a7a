"""The gRPC front end of ingest: ``rtrl.v1.Ingest/PublishEvents``.

Its status codes are listed in ingest/server.py. A request is admitted from its metadata
before it is parsed (rtrl/admission.py); a refusal, which carries an HTTP status, is
answered with the gRPC code of the same meaning.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf.message import DecodeError

from rtrl.admission import Admission, Refusal
from rtrl.ingest import sdk_counts
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.gateway import REJECTED, RETRY, Gateway, batch_refusal
from rtrl_client.v1 import ingest_pb2

GRPC_CODE = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""A refusal's HTTP status -> the gRPC code it is answered with."""


class IngestServicer:
    """``rtrl.v1.Ingest/PublishEvents`` over raw bytes: a request that does not parse is
    answered INVALID_ARGUMENT with the parser's reason (a generated servicer would
    fail it as INTERNAL before any code of ours ran)."""

    def __init__(self, gateway: Gateway, settings: IngestSettings, admission: Admission) -> None:
        self._gateway = gateway
        self._settings = settings
        self._admission = admission

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_unary_rpc_method_handler(
            self.publish_events,
            request_deserializer=None,
            response_serializer=ingest_pb2.PublishEventsResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler("rtrl.v1.Ingest", {"PublishEvents": method})

    async def publish_events(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> ingest_pb2.PublishEventsResponse:
        metadata = dict(context.invocation_metadata() or ())
        # Who is asking, from the metadata alone, before the request is parsed.
        key, refusal = await self._admission.authenticate(metadata.get("authorization", ""))
        if refusal is not None:
            await _abort(context, refusal)
        try:
            request = ingest_pb2.PublishEventsRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request is not a serialized rtrl.v1.PublishEventsRequest: {exc}",
            )
        events = request.events
        if len(events) > self._settings.max_batch:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch has {len(events)} events, at most {self._settings.max_batch} allowed",
            )
        refusal = await batch_refusal(self._admission, key, events)
        if refusal is not None:
            await _abort(context, refusal)
        # gRPC's own user-agent names grpc-python or grpc-node: the SDK names itself apart.
        results = await self._gateway.publish(
            events,
            key=key,
            traceparent=metadata.get("traceparent", ""),
            sdk=metadata.get(sdk_counts.HEADER.lower(), ""),
        )
        await self._abort_if_none_taken(results, context)
        return ingest_pb2.PublishEventsResponse(results=results)

    async def _abort_if_none_taken(
        self, results: list[ingest_pb2.EventResult], context: grpc.aio.ServicerContext
    ) -> None:
        """A batch whose every event is invalid, or whose every event must be retried, is
        answered with an error code; otherwise OK with the per-event results."""
        statuses = {r.status for r in results}
        if results and statuses == {REJECTED}:
            problems = "; ".join(
                f"event {i} ({r.event_id[:40]!r}): {r.field}: {r.error}"
                for i, r in enumerate(results[:20])
            )
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"every event is invalid: {problems}"
            )
        if results and statuses == {RETRY}:
            context.set_trailing_metadata((("retry-after", str(self._settings.retry_after_s)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"no event admitted: {results[0].error}"
            )


async def _abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    """Answers the refusal with its gRPC code, and its Retry-After as trailing metadata
    (``context.abort`` raises: the handler ends here)."""
    if refusal.retry_after_s:
        context.set_trailing_metadata((("retry-after", str(math.ceil(refusal.retry_after_s))),))
    await context.abort(GRPC_CODE[refusal.status], refusal.message)
