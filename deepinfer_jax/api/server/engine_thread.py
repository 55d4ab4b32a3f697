"""The engine loop on its own thread, and the bridge between it and the server's event loop.

Every engine call (adding a request, aborting one, a step) happens on this thread, in the
order the commands arrive; HTTP handlers only put commands on its queue and read their job's
asyncio queue, which the thread feeds with `loop.call_soon_threadsafe`. New requests join the
running batch at the next step. While the engine has work the thread steps without pause,
taking the commands that arrived in between; idle, it sleeps on the command queue.

A job is one HTTP request: its prompts (a group of `n` engine requests each, api/llm.py's
`_submit`) and the queue of its events:
    ("error", exc)                   the engine refused it (nothing runs)
    ("delta", prompt i, completion j, Increment, finish_reason)   streaming jobs only
    ("final", prompt i, RequestOutput)   a prompt's completions are all done (LLM.generate's)
    ("done",)
Aborting a job (its client went away) aborts its unfinished requests at once, which frees
their pages (host/scheduler.py), and its later events are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from deepinfer_jax.api.deltas import RequestDeltas
from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server.metrics import EngineSnapshot, ServerMetrics
from deepinfer_jax.host.request import Request, SamplingParams

log = logging.getLogger("deepinfer.server")


@dataclasses.dataclass(eq=False)
class Job:
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    groups: list = dataclasses.field(default_factory=list)   # set by the engine thread
    open_groups: int = 0
    aborted: bool = False

    def push(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the server's loop is gone (shutting down)
            pass


class Outbox:
    """A step's events for many jobs, handed to their event loop in one thread-safe call.

    Each `call_soon_threadsafe` takes the loop's lock and writes to its wake-up pipe: once per
    request and step that is 64 system calls a step at batch 64, on the engine thread, in a
    decode step of a few milliseconds on a GPU. Queued in order, delivered in order: a job's
    events keep their order, and a job's events of one step arrive together."""

    def __init__(self):
        self._events: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}

    def push(self, job: Job, *event) -> None:
        self._events.setdefault(job.loop, []).append((job.events, event))

    def flush(self) -> None:
        for loop, events in self._events.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:        # the server's loop is gone (shutting down)
                pass
        self._events = {}


def _deliver(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, event in events:              # on the event loop's thread
        q.put_nowait(event)


@dataclasses.dataclass(eq=False)
class _Live:
    """A running engine request of a job."""

    job: Job
    group: int
    index: int                        # its completion's index within the prompt
    deltas: RequestDeltas | None      # streaming jobs
    seen: int = 0                     # tokens counted in the metrics
    last_token: float = 0.0


class EngineThread:
    def __init__(self, llm: LLM, metrics: ServerMetrics):
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        if self.engine.tiers is not None:      # read at scrape time, under the tiers' locks
            metrics.engine.kv_tiers = self.engine.tiers.stats
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._open_in_group: dict[tuple[int, int], int] = {}
        self._spec = [0, 0]               # drafted, accepted (finished requests)
        self._outbox = Outbox()           # a step's events, delivered together (_handle)
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._snapshot()
        self._thread.start()

    # ---- the server's side ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self._commands.put(("abort", job))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished()
                self._take_commands(block=not busy)
                if self.engine.has_unfinished():
                    self._handle(self.engine.step())
                self._snapshot()
        except BaseException as e:      # the engine is broken: fail everyone, stop serving
            log.exception("the engine loop failed")
            self.error = e
            for live in list(self._live.values()):
                live.job.push("error", e)
            self._live.clear()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, job = command
            if kind == "submit":
                try:
                    self._submit(job)
                except Exception as e:     # one request's unforeseen failure: its own 500
                    log.exception("submitting a request failed")
                    self._abort(job, count=False)
                    job.push("error", e)
            elif kind == "abort":
                self._abort(job)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit(self, job: Job) -> None:
        if job.aborted:
            return
        groups = self.llm._submit(job.prompts, job.params, streaming=job.stream)
        failed = next((g.failed for g in groups if g.failed is not None), None)
        if failed is not None:         # the whole call is refused, as OpenAI's server does
            for g in groups:
                for req in g.requests:
                    self.engine.abort(req.request_id)
            job.push("error", failed.error)
            return
        job.groups, job.open_groups = groups, len(groups)
        for i, g in enumerate(groups):
            self._open_in_group[(id(job), i)] = len(g.requests)
            self.metrics.prompt_tokens.inc(len(job.prompts[i]))
            for j, req in enumerate(g.requests):
                deltas = RequestDeltas(req, self.llm.tokenizer) if job.stream else None
                self._live[req.request_id] = _Live(job, i, j, deltas)

    def _abort(self, job: Job, count: bool = True) -> None:
        job.aborted = True
        aborted = 0
        for g in job.groups:
            for req in g.requests:
                if self._live.pop(req.request_id, None) is not None:
                    self.engine.abort(req.request_id)
                    aborted += 1
        for i in range(len(job.groups)):
            self._open_in_group.pop((id(job), i), None)
        # the freed pages show before the count does: a scrape that sees the abort sees them
        self._snapshot()
        if count and aborted:
            self.metrics.aborted.inc(aborted)

    def _handle(self, touched: list[Request]) -> None:
        try:
            self._handle_each(touched)
        finally:
            self._outbox.flush()

    def _handle_each(self, touched: list[Request]) -> None:
        now = time.perf_counter()
        for req in touched:
            live = self._live.get(req.request_id)
            if live is None:            # aborted
                continue
            if req.is_complete and req.error is not None and not req.resolved_tokens:
                # refused before any token (its grammar did not compile): the whole job is
                self._outbox.push(live.job, "error", req.error)
                self._abort(live.job, count=False)
                continue
            try:
                self._count_tokens(live, req, now)
                if live.deltas is not None:
                    inc = live.deltas.advance()
                    if inc.token_ids or inc.text or inc.done:
                        self._outbox.push(live.job, "delta", live.group, live.index, inc,
                                          req.finish_reason)
                if req.is_complete:
                    self._complete(live, req, now)
            except Exception as e:     # this request's output failed: it alone ends, with a 500
                log.exception("reading request %s's output failed", req.request_id)
                self._abort(live.job, count=False)
                self._outbox.push(live.job, "error", e)

    def _count_tokens(self, live: _Live, req: Request, now: float) -> None:
        known = len(req.resolved_tokens)
        new = known - live.seen
        if new <= 0:
            return
        self.metrics.generation_tokens.inc(new)
        if live.seen == 0:              # (tokens that come with the first have no gap)
            self.metrics.ttft.observe(now - live.job.arrival)
        else:                           # several at once (speculation): spread evenly
            for _ in range(new):
                self.metrics.itl.observe((now - live.last_token) / new)
        live.seen, live.last_token = known, now

    def _complete(self, live: _Live, req: Request, now: float) -> None:
        del self._live[req.request_id]
        job = live.job
        self.metrics.e2e.observe(now - job.arrival)
        self.metrics.finished.labels(req.finish_reason.value).inc()
        self._spec[0] += req.spec.drafted
        self._spec[1] += req.spec.accepted
        key = (id(job), live.group)
        self._open_in_group[key] -= 1
        if self._open_in_group[key]:
            return
        del self._open_in_group[key]
        self._outbox.push(job, "final", live.group,
                          self.llm._group_output(job.groups[live.group]))
        job.open_groups -= 1
        if job.open_groups == 0:
            self._outbox.push(job, "done")

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        total, free = scheduler.page_counts()
        prefix = scheduler.prefix_stats()
        self.metrics.engine.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + self.engine.num_awaiting_grammar(),
            pages_total=total, pages_free=free,
            prefix_queries=prefix.queries if prefix else 0,
            prefix_hits=prefix.hits if prefix else 0,
            prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
            spec_drafted=self._spec[0], spec_accepted=self._spec[1],
            steps=self.engine.num_steps)
