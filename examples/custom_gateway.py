"""A minimal custom gateway on kvpush's client library: plan, send both legs at once, cancel on failure.

    python examples/custom_gateway.py --directory 127.0.0.1:50051 --port 8090
    curl -s localhost:8090/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'

The directory's token and TLS files come from the client library's usual variables (KVPUSH_DIRECTORY_TOKEN,
KVPUSH_DIRECTORY_TLS_ROOT_CERT, KVPUSH_DIRECTORY_TLS_CLIENT_CERT, KVPUSH_DIRECTORY_TLS_CLIENT_KEY).

What every kvpush gateway does (the reference one, `kvpush.gateway`, adds streaming, chat,
SageMaker routes, validation, metrics and tracing):
  1. `PlanTransfer` at the directory: it picks a prefill and a decode engine and mints a transfer id.
  2. Send the prefill leg (max_tokens=1) and the decode leg (the client's request) AT THE SAME TIME, each
     with `kv_transfer_params` naming the transfer (`kvpush.api.params.TransferParams` builds both): prefill
     pushes KV into the blocks decode allocates.
  3. Return decode's answer. If either leg fails, cancel the other and `CancelTransfer` so both engines
     free their blocks now rather than when the transfer's deadline passes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid

import aiohttp
from aiohttp import web

from kvpush.api.params import TransferParams
from kvpush.client import ChannelConfig, DirectoryCallError, DirectoryClient

LEG_TIMEOUT = aiohttp.ClientTimeout(total=120, connect=5)


async def post(session: aiohttp.ClientSession, url: str, body: dict, request_id: str) -> dict:
    """One leg: POST and return the JSON answer; raise on any non-200."""
    async with session.post(url, json=body, headers={"X-Request-Id": request_id}, timeout=LEG_TIMEOUT) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            raise web.HTTPBadGateway(text=f"{url} answered {response.status}: {answer}")
        return answer


async def completions(request: web.Request) -> web.Response:
    """POST /v1/completions, disaggregated (non-streaming)."""
    body = await request.json()
    prompt = body.get("prompt")
    request_id = request.headers.get("X-Request-Id") or f"custom-{uuid.uuid4().hex}"
    try:
        plan = await request.app["directory"].plan_transfer(
            request_id=request_id, prompt_token_count=len(prompt) if isinstance(prompt, list) else 0)
    except DirectoryCallError as error:  # e.g. RESOURCE_EXHAUSTED: no decode engine with free blocks
        raise web.HTTPServiceUnavailable(text=f"no engines: {error.code.name}: {error.details}") from error
    transfer_id = plan.transfer.transfer_id
    prefill = {**body, "max_tokens": 1, "stream": False,
               "kv_transfer_params": TransferParams.prefill(transfer_id).to_dict()}
    decode = {**body, "kv_transfer_params": TransferParams.decode(transfer_id).to_dict()}
    session = request.app["session"]
    legs = [asyncio.create_task(post(session, plan.prefill_endpoint + "/v1/completions", prefill, request_id)),
            asyncio.create_task(post(session, plan.decode_endpoint + "/v1/completions", decode, request_id))]
    try:
        _, answer = await asyncio.gather(*legs)
    except BaseException as error:  # a leg failed, or the client went away (this handler is cancelled)
        for leg in legs:
            leg.cancel()  # closing a leg's connection makes vLLM abort that request
        with contextlib.suppress(DirectoryCallError):  # if even this fails, the transfer's deadline ends it
            await asyncio.shield(request.app["directory"].cancel_transfer(transfer_id, f"gateway: {error!r}"[:200]))
        raise
    return web.json_response(answer, headers={"X-KVPush-Transfer-Id": transfer_id, "X-Request-Id": request_id})


def make_app(directory_address: str) -> web.Application:
    """The application: one directory client and one HTTP session, opened and closed with it."""
    app = web.Application()

    async def lifecycle(app: web.Application):
        app["directory"] = DirectoryClient(ChannelConfig.from_env(address=directory_address))
        app["session"] = aiohttp.ClientSession()
        yield
        await app["session"].close()
        await app["directory"].close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    """Serve until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", required=True, help="KV directory HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    web.run_app(make_app(args.directory), host=args.host, port=args.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
