"""The server's side of its engine, wherever the engine runs: the jobs of open HTTP requests by
id, commands sent to the engine loop, and each step's message delivered on the event loop:
its events to their jobs' queues (in order), its observations to the metrics.

A transport (engine_thread.py, engine_process.py) supplies `_send` (a command to the loop),
calls `deliver` on the event loop's thread for each StepMessage, and says whether the engine
is `alive`. The HTTP side (app.py, streams.py) sees only this class."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from deepinfer_jax.api.server.messages import Abort, StepMessage, Submit
from deepinfer_jax.api.server.metrics import ServerMetrics
from deepinfer_jax.host.request import SamplingParams

_job_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request: its prompts as token ids, and the queue of its events (without the
    job id: messages.py lists them)."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    id: int = dataclasses.field(default_factory=lambda: next(_job_ids))


class EngineClient:
    def __init__(self, tokenizer, chat_template, max_model_len: int, num_pages: int):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.max_model_len, self.num_pages = max_model_len, num_pages
        self.metrics = ServerMetrics()
        self.error: BaseException | None = None       # why the engine stopped serving
        self._jobs: dict[int, Job] = {}

    # ---- what a transport provides --------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin delivering to `loop` (the server's, at start-up)."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, command) -> None:
        raise NotImplementedError

    # ---- the HTTP side (on the event loop) ------------------------------------------------
    def submit(self, job: Job) -> None:
        self._jobs[job.id] = job
        self._send(Submit(job.id, job.prompts, job.params, job.stream, job.arrival))

    def abort(self, job: Job) -> None:
        """The job's client went away: its requests stop and free their pages; its later
        events are dropped."""
        if self._jobs.pop(job.id, None) is not None:
            self._send(Abort(job.id))

    def deliver(self, message: StepMessage) -> None:
        for event in message.events:
            job = self._jobs.get(event[0])
            if job is None:             # aborted: the engine will hear it, or has
                continue
            job.events.put_nowait(event[1:])
            if event[1] in ("done", "error"):
                del self._jobs[event[0]]
        m, o = self.metrics, message.observed
        # the snapshot first: a scrape that sees an abort's count sees its freed pages
        m.engine.snapshot = message.snapshot
        if message.kv_tiers is not None:
            m.engine.kv_tiers = _constant(message.kv_tiers)
        if o.empty():
            return
        m.prompt_tokens.inc(o.prompt_tokens)
        m.generation_tokens.inc(o.generation_tokens)
        for seconds in o.ttft:
            m.ttft.observe(seconds)
        for seconds in o.itl:
            m.itl.observe(seconds)
        for seconds in o.e2e:
            m.e2e.observe(seconds)
        for reason in o.finished:
            m.finished.labels(reason).inc()
        if o.aborted:
            m.aborted.inc(o.aborted)

    def fail_all(self, error: BaseException) -> None:
        """The engine is gone: every open job ends with `error`."""
        self.error = self.error or error
        for job in self._jobs.values():
            job.events.put_nowait(("error", error))
        self._jobs.clear()


def _constant(value):
    return lambda: value
