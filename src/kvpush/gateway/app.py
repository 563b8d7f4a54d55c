"""The gateway's aiohttp application: routes, error middleware, start-up and shutdown.

Routes:
  POST /v1/completions, /v1/chat/completions  disaggregated (see `dispatch`)
  GET  /v1/models                             passed through from a decode engine
  GET  /health                                200 while the gateway runs and its directory answers
  GET  /ping                                  SageMaker: 200 when requests can be routed now
  POST /invocations                           SageMaker: a completions request (chat if it has messages)
  GET  /metrics                               Prometheus metrics (`metrics`)
Every error leaves as JSON `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hmac

import aiohttp
import orjson
from aiohttp import web

from kvpush.gateway import legs
from kvpush.gateway.config import GatewayConfig
from kvpush.gateway.dispatch import Dispatcher
from kvpush.gateway.errors import GatewayError, bad_request, unavailable
from kvpush.gateway.in_process import InProcessSession
from kvpush.gateway.metrics import GatewayMetrics
from kvpush.gateway.routing import DirectoryRouter, Router, make_router
from kvpush.gateway.validation import CHAT_COMPLETIONS, COMPLETIONS, request_id_from, validate
from kvpush.observability import get_logger

_log = get_logger("gateway.app")

ROUTER_KEY = web.AppKey("router", Router)
DISPATCHER_KEY = web.AppKey("dispatcher", Dispatcher)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)


def _error_response(error: GatewayError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn GatewayErrors and aiohttp's own HTTP errors (404, 405, 413) into JSON error bodies."""
    try:
        return await handler(request)
    except GatewayError as error:
        return _error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error_response(GatewayError(error.status, error.reason or "error", "invalid_request_error"))
    except Exception as error:  # a bug: report it without leaking internals, log it whole
        _log.exception("unhandled error", path=request.path)
        return _error_response(GatewayError(500, f"internal gateway error: {type(error).__name__}", "internal_error"))


async def _read_json(request: web.Request):
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    try:
        return orjson.loads(raw)  # on the time to first token: the standard library's decoder is 2-3x slower
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"request body is not valid JSON: {error}") from error


async def _completion(request: web.Request, path: str) -> web.StreamResponse:
    request_id = request_id_from(request.headers.get("X-Request-Id"))
    client_request = validate(path, await _read_json(request))
    return await request.app[DISPATCHER_KEY].handle(request, client_request, request_id)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _completion(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _completion(request, CHAT_COMPLETIONS)


async def invocations(request: web.Request) -> web.StreamResponse:
    """POST /invocations (SageMaker): chat when the body has messages, else completions."""
    body = await _read_json(request)
    path = CHAT_COMPLETIONS if isinstance(body, dict) and "messages" in body else COMPLETIONS
    request_id = request_id_from(request.headers.get("X-Amzn-SageMaker-Inference-Id") or
                                 request.headers.get("X-Request-Id"))
    return await request.app[DISPATCHER_KEY].handle(request, validate(path, body), request_id)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models from a decode engine."""
    router: Router = request.app[ROUTER_KEY]
    url = await router.model_source_url()
    if not url:
        raise unavailable("no decode engine is registered")
    status, body = await legs.get_json(request.app[SESSION_KEY], url + "/v1/models",
                                       request.app[CONFIG_KEY].connect_timeout_s)
    return web.json_response(body, status=status)


async def health(request: web.Request) -> web.Response:
    """GET /health: liveness (the directory answers, in kvpush mode)."""
    router = request.app[ROUTER_KEY]
    if isinstance(router, DirectoryRouter):
        ok, why = await router.directory_reachable()
        if not ok:
            raise unavailable(why)
    return web.json_response({"status": "ok"})


async def ping(request: web.Request) -> web.Response:
    """GET /ping (SageMaker): 200 when prefill and decode engines are available."""
    ok, why = await request.app[ROUTER_KEY].healthy()
    if not ok:
        raise unavailable(why)
    return web.json_response({"status": "ok", "detail": why})


def api_key_middleware(api_key: str):
    """Require `Authorization: Bearer <api_key>` on the OpenAI routes (/v1/*), as OpenAI's API does.

    /health and /ping stay open for probes; /invocations is SageMaker's, which authenticates callers itself.
    """
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1/") and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected):
            error = GatewayError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 "invalid_request_error")
            error.headers["WWW-Authenticate"] = "Bearer"
            return _error_response(error)
        return await handler(request)

    return check


def create_app(config: GatewayConfig, local_legs: InProcessSession | None = None) -> web.Application:
    """Build the application; the router and the HTTP session start with it and close with it. `local_legs`
    (hosted): prefill legs to `config.local_prefill_engine_id` go through it instead of HTTP."""
    config.validate()
    metrics = GatewayMetrics()
    # Metrics outermost: errors and refused keys are counted too; /metrics is not under /v1/, so open to scrapers.
    middlewares = [metrics.middleware(), error_middleware] + ([api_key_middleware(config.api_key)]
                                                              if config.api_key else [])
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = metrics

    async def lifecycle(app: web.Application):
        router = make_router(config)
        connector = aiohttp.TCPConnector(limit=1000, ttl_dns_cache=60, keepalive_timeout=config.upstream_keepalive_s)
        # No cookie jar: the session is shared by every client's legs, so a cookie an engine (or a proxy before it)
        # set must not travel with other clients' requests; it also spares each leg the jar's filtering.
        session = aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())
        app[ROUTER_KEY] = router
        app[SESSION_KEY] = session
        app[DISPATCHER_KEY] = Dispatcher(config, router, session, metrics, local_legs)
        yield
        if local_legs is not None:
            await local_legs.close_calls()
        await session.close()
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(CHAT_COMPLETIONS, chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/metrics", metrics.handle)
    return app
