"""HTTP API: the FastAPI app and its routes (request path stage 1; the readiness gate's outside view).

Owns: the routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/startup`,
`/metrics`, `/admin/stats`), reading the body with a size cap (413 before it is all read), JSON and
schema errors as OpenAI error objects (400, never FastAPI's 422), the optional Bearer API key (compared
in constant time; `/health` and `/metrics` stay open for probes and scrapers), and the readiness gate:
generation and `/v1/models` answer 503 unless the server is Up, `/health` is 503 while Starting and
afterwards 200 only when a real 1-token request comes back through the whole loop in time (probes are
coalesced in the TokenizerManager, so the open route cannot queue engine work past the bound; a failed
probe names its reason), and bodies that are not JSON (including JSON nested past the decoder's
recursion limit), not strict UTF-8, or holding a lone surrogate escape (named by its field) as 400.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dsaserve.server.chat_features import ChatSettings
from dsaserve.server.openai_serving import OpenAIServing
from dsaserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    internal,
    unavailable,
    validation_error,
)

OPEN_PATHS = ("/health", "/health_generate", "/metrics")  # no API key: load balancers and scrapers


class ApiKeyMiddleware:
    """Pure ASGI (works with streaming): `Authorization: Bearer <key>` on every route but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: Any) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                self.on_error(401)
                err = APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                               "authentication_error", None, "invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes (checked while reading), 400 if not JSON, not
    strict UTF-8 (raw surrogate bytes included), or holding a lone UTF-16 surrogate escape (`"\\ud800"`:
    valid JSON, but no Unicode text; the tokenizer and msgpack would fail on it later)."""
    body = await _read_body(request, limit)
    try:
        obj = json.loads(body.decode(json.detect_encoding(body)))
    except json.JSONDecodeError as e:
        raise bad_request(f"invalid JSON body: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise bad_request("invalid JSON body: not UTF-8") from None
    except RecursionError:  # '[' * 200000 fits the size cap; the C decoder stops at the recursion limit
        raise bad_request("invalid JSON body: nested too deeply") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}")
    if SURROGATE_ESCAPE.search(body):  # rare: only then walk the object to find (and name) the field
        param = _lone_surrogate(obj)
        if param is not None:
            raise bad_request(f"{param or 'body'}: invalid Unicode: a lone surrogate escape (\\ud800-\\udfff)",
                              param or None, "invalid_unicode")
    return obj


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       "invalid_request_error", None, "request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                           None, "request_too_large")
    return bytes(body)


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(obj: Any) -> str | None:
    """The dotted path of the first key or string holding a lone surrogate ("" for the top level)."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if SURROGATE.search(x):
                return path
        elif isinstance(x, dict):
            for k, v in x.items():
                sub = f"{path}.{k}" if path else str(k)
                if SURROGATE.search(k):
                    return path
                stack.append((sub, v))
        elif isinstance(x, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(x))
    return None


def disconnect_waiter(request: Request):
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def build_app(args: Any, tm: Any, readiness: Any, metrics: Any) -> FastAPI:
    app = FastAPI(title="dsaserve", docs_url=None, redoc_url=None, openapi_url=None)
    chat = ChatSettings.build(args.model_dir, tm.tok, getattr(args, "tool_call_parser", "auto"),
                              getattr(args, "reasoning_parser", None))
    serving = OpenAIServing(tm, args.served_model_name, aliases=(args.model_dir,), chat=chat)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, on_error=metrics.http_error)
    _add_error_handlers(app, metrics)
    _add_generation_routes(app, args, serving, readiness)
    _add_status_routes(app, args, tm, readiness, metrics)
    return app


def _error_response(metrics: Any, err: APIError) -> JSONResponse:
    metrics.http_error(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def _add_error_handlers(app: FastAPI, metrics: Any) -> None:
    """Every error leaves as an OpenAI error object, counted by status."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(metrics, e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else "method_not_allowed" if e.status_code == 405 else None
        err = APIError(e.status_code, str(e.detail), "invalid_request_error", None, code,
                       headers=getattr(e, "headers", None))
        return _error_response(metrics, err)

    @app.exception_handler(RequestValidationError)
    async def on_param_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(metrics, validation_error(e))

    @app.exception_handler(Exception)
    async def on_crash(_: Request, e: Exception) -> JSONResponse:
        return _error_response(metrics, internal(f"internal error: {type(e).__name__}: {e}"))


def _require_up(readiness: Any) -> None:
    if not readiness.is_up:
        raise unavailable(f"server is {readiness.describe()}")


def _add_generation_routes(app: FastAPI, args: Any, serving: OpenAIServing, readiness: Any) -> None:
    async def generation(request: Request, model: Any, handler: Any) -> Response:
        _require_up(readiness)
        raw = await read_json(request, args.max_request_bytes)
        try:
            req = model.model_validate(raw)
        except ValidationError as e:
            raise validation_error(e) from None
        return await handler(req, disconnect_waiter(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatCompletionRequest, serving.chat)

    def model_card() -> ModelCard:
        info = readiness.info.get("scheduler", {})
        return ModelCard(id=args.served_model_name, root=args.model_dir, max_model_len=info.get("max_model_len"))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        _require_up(readiness)
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        _require_up(readiness)
        serving.check_model(model)
        return JSONResponse(model_card().model_dump())


def _add_status_routes(app: FastAPI, args: Any, tm: Any, readiness: Any, metrics: Any) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> JSONResponse:
        if not readiness.is_up:
            return JSONResponse({"status": readiness.describe()}, status_code=503)
        failure = await tm.health(args.health_timeout_s)  # coalesced: one probe in flight, cached ~1 s
        if failure is None:
            readiness.mark_healthy()  # the first 200 ends startup (normally the launcher's own probe did)
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": failure}, status_code=503)

    @app.get("/startup")
    async def startup() -> JSONResponse:
        return JSONResponse(readiness.manifest(args))

    @app.get("/metrics")
    async def metrics_route() -> Response:
        snapshot = await tm.get_stats(timeout=1.0)
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/stats")
    async def admin_stats(check_leak: bool = False) -> JSONResponse:
        """Fresh scheduler stats and engine counters (under DP-attention summed, and each rank's as `ranks`);
        `?check_leak=true` also runs the KV leak check."""
        _require_up(readiness)
        snap = await tm.get_stats(timeout=5.0, check_leak=check_leak)
        return JSONResponse({"stats": snap.get("stats"), "counters": snap.get("counters"), "leak": snap.get("leak"),
                             "inflight_samples": tm.inflight_samples(),
                             **({"ranks": snap["ranks"]} if "ranks" in snap else {})})
