"""Reading a job's events (engine_client.py) for one HTTP request: wait for its first event
(an engine refusal is then still a 400), collect its outputs, or stream them as server-sent
events. A client that goes away aborts the job: a non-streaming one is watched with
`is_disconnected` while it waits; a stream's generator is closed by the server, and its
`finally` aborts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest

from deepinfer_jax.api.server.engine_client import EngineClient, Job
from deepinfer_jax.host.outputs import completion_logprobs, token_text
from deepinfer_jax.host.request import RequestOutput

_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client disconnected while its request waited (its job is aborted)."""


async def next_event(job: Job, engine: EngineClient, http: HTTPRequest | None) -> tuple:
    """The job's next event; aborts the job (and raises ClientGone) if the client goes away
    first."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), _DISCONNECT_POLL_S)
        except TimeoutError:
            if http is not None and await http.is_disconnected():
                engine.abort(job)
                raise ClientGone() from None
            if not engine.alive:
                return ("error", engine.error or RuntimeError("the engine stopped"))


async def collect(job: Job, engine: EngineClient, http: HTTPRequest, first: tuple
                  ) -> list[RequestOutput] | tuple:
    """Every prompt's output, in order, or the ("error", exc) event that ended the job."""
    outputs: dict[int, RequestOutput] = {}
    event = first
    try:
        while event[0] != "done":
            if event[0] == "error":
                return event
            if event[0] == "final":
                outputs[event[1]] = event[2]
            event = await next_event(job, engine, http)
    except asyncio.CancelledError:       # the server is stopping
        engine.abort(job)
        raise
    return [outputs[i] for i in range(len(outputs))]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream_events(job: Job, engine: EngineClient, first: tuple, n: int,
                        chunk: Callable[[int, str, list | None, str | None], dict],
                        usage_chunk: Callable[[dict], dict] | None,
                        error_body: Callable[[BaseException], dict]) -> AsyncIterator[str]:
    """The job's events as SSE lines: `chunk(choice index, text, logprob entries, finish
    reason)` per delta, then the usage chunk (with include_usage) and [DONE]. Events that
    queued up while the client was sent the last ones go out in one write."""
    text_of = token_text(engine.tokenizer)
    finished = False
    prompt_tokens = completion_tokens = 0
    lines: list[str] = []
    event = first
    try:
        while True:
            kind = event[0]
            if kind == "delta":
                _, i, j, inc, reason = event
                entries = (completion_logprobs(inc.logprobs, text_of)
                           if job.params.logprobs is not None else None)
                lines.append(sse(chunk(i * n + j, inc.text or "", entries,
                                       reason.value if inc.done and reason is not None else None)))
            elif kind == "final":
                out = event[2]
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            else:                         # error or done: the end
                finished = True
                if kind == "error":
                    lines.append(sse(error_body(event[1])))
                elif usage_chunk is not None:
                    lines.append(sse(usage_chunk({
                        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens})))
                yield "".join(lines) + "data: [DONE]\n\n"
                return
            if not job.events.empty():
                event = job.events.get_nowait()
                continue
            if lines:
                yield "".join(lines)
                lines = []
            event = await next_event(job, engine, None)
    finally:
        if not finished:        # the client went away (or the server is stopping)
            engine.abort(job)


def created_now() -> int:
    return int(time.time())
