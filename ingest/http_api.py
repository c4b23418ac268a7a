"""The HTTP front end of ingest: ``POST /v1/events`` (JSON) and ``GET /healthz``.

Its status codes are listed in ingest/server.py. The request is admitted from its headers
before a byte of the body is read (rtrl/admission.py), the body is read to a bound that
a compressed body cannot inflate past, parsed strictly, then handed to ``Gateway.publish``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web
from google.protobuf import json_format

from rtrl import bounded_json
from rtrl.admission import Admission, Refusal
from rtrl.ingest import sdk_counts
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.gateway import REJECTED, RETRY, Gateway, batch_refusal
from rtrl_client.v1 import ingest_pb2

_GATEWAY = web.AppKey("gateway", Gateway)
_SETTINGS = web.AppKey("settings", IngestSettings)
_ADMISSION = web.AppKey("admission", Admission)

ACCEPTED_ENCODINGS = ("identity", "gzip", "deflate")
CORS_REQUEST_HEADERS = (
    "authorization",
    "content-type",
    "content-encoding",
    "traceparent",
    sdk_counts.HEADER.lower(),
)
"""What a browser page of an allowed origin may send with its events (the preflight's
Access-Control-Request-Headers must be among them): the TypeScript SDK's browser build sends
X-Rtrl-Sdk, as a browser's fetch may not set User-Agent."""


def http_status(results: list[ingest_pb2.EventResult]) -> int:
    statuses = {r.status for r in results}
    if RETRY in statuses:
        return 429
    if REJECTED in statuses:
        return 400 if statuses == {REJECTED} else 207
    return 200


def build_http_app(
    gateway: Gateway, settings: IngestSettings, admission: Admission | None = None
) -> web.Application:
    """``admission`` None is an open door (no API keys)."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_cors])
    app[_GATEWAY] = gateway
    app[_SETTINGS] = settings
    app[_ADMISSION] = admission or Admission(None, None)
    app.router.add_post("/v1/events", _post_events)
    app.router.add_route("OPTIONS", "/v1/events", _preflight)
    app.router.add_get("/healthz", _healthz)
    return app


async def _post_events(request: web.Request) -> web.Response:
    gateway, settings = request.app[_GATEWAY], request.app[_SETTINGS]
    admission = request.app[_ADMISSION]
    # Cheap checks first: who is asking, from the headers alone, before a byte of the body
    # is read, decompressed or parsed.
    key, refusal = await admission.authenticate(request.headers.get("Authorization", ""))
    if refusal is not None:
        return _refused(refusal)
    raw = await _read_body(request, settings)
    if isinstance(raw, web.Response):
        return raw
    batch = _parse_batch(raw, settings)
    if isinstance(batch, web.Response):
        return batch
    refusal = await batch_refusal(admission, key, batch.events)
    if refusal is not None:
        return _refused(refusal)
    results = await gateway.publish(
        batch.events,
        key=key,
        traceparent=request.headers.get("traceparent", ""),
        sdk=request.headers.get(sdk_counts.HEADER, ""),
    )
    status = http_status(results)
    headers = {"Retry-After": str(settings.retry_after_s)} if status == 429 else None
    body = json_format.MessageToJson(ingest_pb2.PublishEventsResponse(results=results), indent=None)
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


@web.middleware
async def _cors(request: web.Request, handler) -> web.StreamResponse:
    """A page of an allowed origin (RTRL_INGEST_CORS_ORIGINS) may read every answer, the
    refusals and the Retry-After included; any other origin gets no CORS header at all."""
    response = await handler(request)
    if request.app[_SETTINGS].cors_origins:
        response.headers.add("Vary", "Origin")
        origin = request.headers.get("Origin", "")
        refused_preflight = request.method == "OPTIONS" and response.status != 204
        if origin in request.app[_SETTINGS].cors_origins and not refused_preflight:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
    return response


async def _preflight(request: web.Request) -> web.Response:
    """A browser asks whether a page may POST events: yes only for an allowed origin, the
    POST method and the headers an SDK sends. No key is asked for (a preflight carries none)."""
    origin = request.headers.get("Origin", "")
    if origin not in request.app[_SETTINGS].cors_origins:
        return _error(
            403, f"origin {origin!r} may not send events from a browser (RTRL_INGEST_CORS_ORIGINS)"
        )
    method = request.headers.get("Access-Control-Request-Method", "")
    asked = {
        name.strip().lower()
        for name in request.headers.get("Access-Control-Request-Headers", "").split(",")
        if name.strip()
    }
    if method != "POST" or not asked <= set(CORS_REQUEST_HEADERS):
        return _error(
            403,
            f"a page may POST events with the headers {', '.join(CORS_REQUEST_HEADERS)} only, "
            f"not {method} with {', '.join(sorted(asked)) or 'none'}",
        )
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": "POST",
            "Access-Control-Allow-Headers": ", ".join(CORS_REQUEST_HEADERS),
            "Access-Control-Max-Age": "600",
        },
    )


def _parse_batch(
    raw: bytes, settings: IngestSettings
) -> ingest_pb2.PublishEventsRequest | web.Response:
    """The batch, or the 400 that refuses it whole: not the JSON form of a
    PublishEventsRequest, or more events than max_batch."""
    try:
        text = raw.decode("utf-8")
        # Parsed within the nesting bound first, so no parser after it recurses past it.
        value = bounded_json.loads(text)
        batch = json_format.Parse(text, ingest_pb2.PublishEventsRequest())
        problem = _json_type_error(
            value, ingest_pb2.PublishEventsRequest.DESCRIPTOR, "PublishEventsRequest"
        )
        if problem:
            raise json_format.ParseError(problem)
    except (UnicodeDecodeError, json.JSONDecodeError, json_format.ParseError) as exc:
        return _error(400, f"body is not the JSON form of rtrl.v1.PublishEventsRequest: {exc}")
    if len(batch.events) > settings.max_batch:
        return _error(
            400,
            f"batch has {len(batch.events)} events, at most {settings.max_batch} allowed: split it",
        )
    return batch


async def _read_body(request: web.Request, settings: IngestSettings) -> bytes | web.Response:
    """The body, decompressed, or the refusal: at most max_body_bytes, and a compressed body
    at most max_inflation times its Content-Length (a 93 KB gzip that expands to 61 MB stops
    at the bound, read no further)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if encoding not in ACCEPTED_ENCODINGS:
        return _error(
            415,
            f"Content-Encoding {encoding!r} is not accepted: send {', '.join(ACCEPTED_ENCODINGS)}",
        )
    limit, why = (
        settings.max_body_bytes,
        f"body is larger than {settings.max_body_bytes} bytes: split the batch",
    )
    if encoding != "identity":
        if request.content_length is None:
            return _error(411, f"a {encoding} body needs a Content-Length")
        if settings.max_inflation * request.content_length < limit:
            limit = settings.max_inflation * request.content_length
            why = f"{encoding} body expands past {settings.max_inflation}x its {request.content_length} bytes"
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                return _error(413, why)
    except (
        web.RequestPayloadError,
        aiohttp.ClientPayloadError,
        aiohttp.http_exceptions.HttpProcessingError,
    ) as exc:
        return _error(400, f"body does not decode ({encoding}): {exc}")
    return bytes(body)


def _refused(refusal: Refusal) -> web.Response:
    headers = (
        {"Retry-After": str(math.ceil(refusal.retry_after_s))} if refusal.retry_after_s else None
    )
    return _error(refusal.status, refusal.message, headers)


def _json_type_error(value, descriptor, path: str) -> str | None:
    """Where the JSON has a type the proto3 JSON mapping does not allow but protobuf's
    Python parser takes: [] or "" for a message, a bool for a number, 1.5 for an enum."""
    if not isinstance(value, dict):
        return f"{path} must be a JSON object"
    for field in descriptor.fields:
        for key in {field.name, field.json_name}:
            item = value.get(key)
            if item is None:
                continue
            for i, element in enumerate(
                item if field.is_repeated and isinstance(item, list) else [item]
            ):
                where = f"{path}.{key}[{i}]" if field.is_repeated else f"{path}.{key}"
                if field.message_type is not None:
                    problem = _json_type_error(element, field.message_type, where)
                    if problem:
                        return problem
                elif isinstance(element, bool) and field.cpp_type != field.CPPTYPE_BOOL:
                    return f"{where} must not be a bool"
                elif isinstance(element, float) and field.enum_type is not None:
                    return f"{where} must be an enum name or number"
    return None


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **asdict(request.app[_GATEWAY].status())})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps({"error": message}),
        content_type="application/json",
        headers=headers,
    )
