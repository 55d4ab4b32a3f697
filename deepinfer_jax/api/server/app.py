"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    app = build_app(EngineProcess(partial(LLM, "path/to/model")), "my-model")
    uvicorn.run(app, host="127.0.0.1", port=8000)

A request is tokenized and checked here, then runs in the engine loop (engine_loop.py: in
its own process, engine_process.py, or given an `LLM`, on a thread of this one,
engine_thread.py) with every other connection's; its first event decides between a 400 (the
engine refused it: the message names the parameter) and a 200, whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server import responses
from deepinfer_jax.api.server.engine_client import EngineClient, Job
from deepinfer_jax.api.server.engine_thread import EngineThread
from deepinfer_jax.api.server.errors import APIError, engine_error
from deepinfer_jax.api.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer_jax.api.server.sampling import RequestBuilder, generation_defaults
from deepinfer_jax.api.server.streams import ClientGone, collect, created_now, next_event, stream_events
from deepinfer_jax.host.chat import ChatTemplateError
from deepinfer_jax.host.request import RequestError


def build_app(engine: EngineClient | LLM, model_name: str, model_dir=None) -> FastAPI:
    """engine: an engine process (engine_process.py) or another EngineClient, or an LLM to
    run on a thread of this process."""
    if isinstance(engine, LLM):
        engine = EngineThread(engine)
    metrics = engine.metrics
    builder = RequestBuilder(engine.tokenizer, engine.chat_template, engine.max_model_len,
                             generation_defaults(model_dir))
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="deepinfer-jax", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        metrics.errors.labels(e.kind).inc()
        return e.response()

    @app.exception_handler(404)
    @app.exception_handler(405)
    async def no_route(http: HTTPRequest, e):
        return APIError(f"{http.method} {http.url.path}: {getattr(e, 'detail', e)}",
                        status=e.status_code, kind="no_route").response()

    @app.exception_handler(ClientGone)
    async def client_gone(_, e: ClientGone):
        return Response(status_code=499)       # nobody reads it (nginx's code for this)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        return await api_error(None, APIError(f"internal error: {type(e).__name__}: {e}",
                                              status=500, type="internal_server_error",
                                              kind="internal"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: "
                            f"{err.get('msg')}" for err in e.errors())
        return await api_error(None, APIError(message or "invalid request",
                                              loc[0] if loc else None, kind="validation"))

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(f"the model {name!r} is not served here (this server serves "
                           f"{model_name!r})", "model", code="model_not_found",
                           kind="model_not_found")

    def stream_error(error: BaseException, endpoint: str, names: dict) -> dict:
        """The SSE error event of a stream that the engine ended with an error."""
        e = _as_api_error(error, endpoint, names)
        metrics.errors.labels(e.kind).inc()
        return e.body()

    async def start(job: Job, http: HTTPRequest, endpoint: str, names: dict) -> tuple:
        engine.submit(job)
        first = await next_event(job, engine, http)
        if first[0] == "error":
            raise _as_api_error(first[1], endpoint, names)
        return first

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped", "error": repr(engine.error)}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "deepinfer",
            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        names: dict[str, str] = {}
        prompts = builder.completion_prompts(body)
        params = builder.completion_params(body, names)
        job = Job(prompts, params, body.stream)
        first = await start(job, http, "completion", names)
        rid = responses.new_id("cmpl")
        if body.stream:
            made = created_now()
            usage = (lambda u: responses.usage_chunk(rid, model_name, made, "text_completion", u)
                     ) if body.stream_options and body.stream_options.include_usage else None

            def chunk(index, text, entries, reason):
                lps = responses.completion_logprobs(entries) if entries is not None else None
                return responses.completion_chunk(rid, model_name, made, index, text, lps, reason,
                                                  usage is not None)
            return _sse(stream_events(job, engine, first, params.n, chunk, usage,
                                      lambda e: stream_error(e, "completion", names)))
        result = await collect(job, engine, http, first)
        if isinstance(result, tuple):
            raise _as_api_error(result[1], "completion", names)
        return responses.completion_response(rid, model_name, result, params.n,
                                             params.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        check_model(body.model)
        names: dict[str, str] = {}
        try:
            prompt = builder.chat_prompt(body)
        except (ValueError, ChatTemplateError) as e:
            raise APIError(str(e), "messages") from None
        params = builder.chat_params(body, len(prompt), names)
        job = Job([prompt], params, body.stream)
        first = await start(job, http, "chat", names)
        rid = responses.new_id("chatcmpl")
        top = params.logprobs
        if body.stream:
            made = created_now()
            usage = (lambda u: responses.usage_chunk(rid, model_name, made,
                                                     "chat.completion.chunk", u)
                     ) if body.stream_options and body.stream_options.include_usage else None
            started: set[int] = set()

            def chunk(index, text, entries, reason):
                delta = {"content": text}
                if index not in started:
                    started.add(index)
                    delta = {"role": "assistant", "content": text}
                lps = responses.chat_logprobs(entries, top) if entries is not None else None
                return responses.chat_chunk(rid, model_name, made, index, delta, lps, reason,
                                            usage is not None)
            return _sse(stream_events(job, engine, first, params.n, chunk, usage,
                                      lambda e: stream_error(e, "chat", names)))
        result = await collect(job, engine, http, first)
        if isinstance(result, tuple):
            raise _as_api_error(result[1], "chat", names)
        return responses.chat_response(rid, model_name, result[0], top)

    return app


def _as_api_error(error: BaseException, endpoint: str, names: dict) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, (RequestError, TypeError)):
        return engine_error(error, endpoint, names)
    return APIError(f"the engine failed: {type(error).__name__}: {error}", None, status=500,
                    type="internal_server_error", kind="internal")


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
