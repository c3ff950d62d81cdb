"""`eectl serve`'s ASGI app: the OpenAI routes over one `Model` (eectl/api), and the server that runs it.

FastAPI on uvicorn: the request bodies are pydantic models (as eectl's contracts are), streaming is Starlette's
`StreamingResponse`, which cancels the response when its client disconnects, and uvicorn's graceful shutdown on
SIGTERM stops accepting, waits for the requests in flight (up to `grace_s`), then cancels what is left.

Each request is a job of the model's engine (run/engine.py): it joins the running batch at the next step and
leaves when done; its text comes back from the engine's thread through the event loop
(`call_soon_threadsafe`). A request whose client goes away (a closed stream, a dropped connection) is cancelled at
once: its slot is free at the engine's next step. A full queue is 429, a server shutting down 503, a bad request
400 naming its field, each with the OpenAI error body.

What this module does not do: batch or generate (eectl/api), or parse options (cli/cmd_serve.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from eectl.api.model import Completion, Model
from eectl.errors import EectlError, UsageError
from eectl.run.engine import QueueFull, Stopped
from eectl.serve.protocol import Asked, BadRequest, Reply, chat_request, completion_request, error_body

DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there


class Counts:
    """What /health reports beside the engine's own counts."""

    def __init__(self) -> None:
        self.served = 0  # requests answered in full
        self.cancelled = 0  # requests whose client went away before their answer ended
        self.refused = 0  # 429s


def create_app(model: Model, name: str | None = None) -> FastAPI:
    """The app serving `model` under the id `name` (default: the artifact's folder name)."""
    model_id = name or model.name
    counts = Counts()
    app = FastAPI(title="eectl", version="1", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        e = model.engine
        return {
            "status": "ok",
            "model": model_id,
            "running": e.running,
            "waiting": e.waiting,
            "max_batch": e.slots,
            "steps": e.steps,
            "served": counts.served,
            "cancelled": counts.cancelled,
            "refused": counts.refused,
            "config": model.config,
            # where the plan's default switches with the batch: its prices per batch size, the steps each ran
            "batching": e.batching(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "eectl"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _answer(model, model_id, counts, request, chat_request(await _json(request)), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _answer(model, model_id, counts, request, completion_request(await _json(request)), chat=False)

    return app


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not JSON: {exc}") from None


def _ids(model: Model, asked: Asked, chat: bool) -> list[int]:
    try:  # chat: the messages through the chat template; completions: the prompt as is
        return model.tokenize(asked.prompt, raw=not chat)
    except EectlError as exc:
        raise BadRequest(exc.message, "messages" if chat else "prompt") from None


async def _answer(model: Model, model_id: str, counts: Counts, request: Request, asked: Asked, chat: bool) -> Any:
    ids = _ids(model, asked, chat)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(kind: str, value: Any) -> None:  # from the engine's thread
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    started = _start(model, counts, asked, ids, lambda c, e: put("end", (c, e)), lambda t: put("text", t))
    reply = Reply(model_id, chat)
    if asked.stream:
        opened = [False]  # whether the stream began: a client gone before it did never runs _stream's clean-up

        async def unopened() -> None:  # Starlette runs the background after the response, cancelled or not
            if not opened[0]:
                started.cancel()
                counts.cancelled += 1

        return StreamingResponse(
            _stream(reply, asked, events, started.cancel, counts, opened),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(unopened),
        )
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    started.cancel()
                    counts.cancelled += 1
                    return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
                continue
            if kind == "end":
                done = _ended(*value)
                counts.served += 1
                return reply.full(done)
    except asyncio.CancelledError:
        started.cancel()
        counts.cancelled += 1
        raise


def _start(
    model: Model,
    counts: Counts,
    asked: Asked,
    ids: list[int],
    on_end: Callable[[Completion | None, BaseException | None], None],
    on_text: Callable[[str], None],
) -> Any:
    """The request queued on the model's engine, or its refusal as an HTTP error. Without max_tokens, the server's
    --max-new-tokens, cut to what the context leaves after the prompt (as OpenAI's API: up to the context's end)."""
    budget = asked.max_tokens
    if budget is None:
        budget = min(model.options.max_new_tokens, model.engine.context - len(ids) - 1)
        if budget < 1:
            where = "messages" if isinstance(asked.prompt, list) else "prompt"
            raise BadRequest(f"{where}: {len(ids)} tokens fill the context of {model.engine.context}", where)
    try:
        return model.start(
            ids,
            on_end,
            on_text,
            max_new_tokens=budget,
            temperature=asked.temperature,
            top_p=asked.top_p,
            stop=asked.stop,
            seed=asked.seed,
        )
    except QueueFull as exc:
        counts.refused += 1
        raise BadRequest(exc.message, None, 429, "rate_limit_error") from None
    except Stopped as exc:
        raise BadRequest(exc.message, None, 503, "server_error") from None
    except UsageError as exc:
        raise BadRequest(exc.message, _param(exc.message)) from None


def _param(message: str) -> str | None:
    """The request field an engine's refusal is about."""
    if "max_new_tokens" in message or "new tokens" in message:
        return "max_tokens"
    for field in ("temperature", "top_p", "prompt"):
        if field.replace("_", "-") in message or field in message:
            return field
    return None


def _ended(done: Completion | None, error: BaseException | None) -> Completion:
    if error is not None:
        if isinstance(error, Stopped):
            raise BadRequest(str(error), None, 503, "server_error")
        raise error
    assert done is not None
    return done


async def _stream(
    reply: Reply,
    asked: Asked,
    events: asyncio.Queue[tuple[str, Any]],
    cancel: Callable[[], None],
    counts: Counts,
    opened: list[bool],
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per settled piece of text, the last with its finish reason (and the usage where
    stream_options asked), then [DONE]. Cancelled by Starlette when the client disconnects: the job leaves the batch."""
    ended = False
    opened[0] = True
    try:
        yield _sse(reply.chunk(first=True) if reply.chat else reply.chunk(""))
        while True:
            kind, value = await events.get()
            if kind == "text":
                yield _sse(reply.chunk(value))
                continue
            ended = True
            done, error = value
            if error is not None:
                kind = "server_error" if isinstance(error, Stopped) else "internal_error"
                yield _sse(error_body(str(error), kind))
                break
            yield _sse(reply.chunk(reason="length" if done.finish_reason == "length" else "stop"))
            if asked.usage_in_stream:
                yield _sse(reply.usage_chunk(done))
            counts.served += 1
            break
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away (or the server gave up on it): free its slot now
            cancel()
            counts.cancelled += 1


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


def run_server(
    model: Model,
    host: str,
    port: int,
    name: str | None = None,
    grace_s: float = 30.0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `model` until SIGTERM or SIGINT: then stop accepting, let the requests in flight finish for up to
    `grace_s` seconds, cancel the rest, stop the engine and return (no exit code of a signal: a clean stop)."""
    import uvicorn

    config = uvicorn.Config(
        create_app(model, name),
        host=host,
        port=port,
        log_level="warning",  # uvicorn's own lines on stderr; no access log (its handler writes to stdout)
        access_log=False,
        timeout_graceful_shutdown=int(grace_s),
        lifespan="off",
    )

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if on_ready is not None and self.started:
                on_ready(f"http://{host}:{port}/v1")

    server = _Server(config)
    main = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal that stopped it to the handler it found: a no-op one, so a drained stop returns
    quiet = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        server.run()
    finally:
        for s, handler in quiet.items():
            signal.signal(s, handler)
        model.close()
