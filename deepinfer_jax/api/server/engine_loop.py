"""The engine's side of the server: commands applied to `LLM`'s engine, steps run, and each
step's events and metrics gathered into one `StepMessage` (messages.py). It knows nothing of
HTTP or of where its messages go: the engine thread hands them to the event loop
(engine_thread.py), the engine process writes them to a pipe (engine_process.py).

Every engine call (adding a request, aborting one, a step) happens on the loop's thread, in
the order the commands arrive. A job is one HTTP request: its prompts, each a group of `n`
engine requests (api/llm.py's `_submit`). Aborting a job aborts its unfinished requests at
once, which frees their pages (host/scheduler.py); its later events are never made.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from deepinfer_jax.api.deltas import RequestDeltas
from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server.messages import (
    Abort,
    EngineSnapshot,
    Observations,
    StepMessage,
    Stop,
    Submit,
)
from deepinfer_jax.host.request import Request

log = logging.getLogger("deepinfer.server")

_IDLE_WAIT_S = 0.5          # how long an idle loop waits for a command before it looks again


@dataclasses.dataclass(eq=False)
class _Job:
    submit: Submit
    groups: list                          # api/llm.py's _Group per prompt
    open_in_group: list[int]              # completions not yet finished, per prompt
    open_groups: int


@dataclasses.dataclass(eq=False)
class _Live:
    """A running engine request of a job."""

    job: _Job
    group: int
    index: int                        # its completion's index within the prompt
    deltas: RequestDeltas | None      # streaming jobs
    seen: int = 0                     # tokens counted in the metrics
    last_token: float = 0.0


class EngineLoop:
    def __init__(self, llm: LLM, tier_reports_every_s: float | None = None):
        """tier_reports_every_s: ship the KV tiers' reports with a message at most this
        often (a process of its own; None: the server reads them itself)."""
        self.llm, self.engine = llm, llm.engine
        self._jobs: dict[int, _Job] = {}
        self._live: dict[str, _Live] = {}
        self._spec = [0, 0]               # drafted, accepted (finished requests)
        self._events: list[tuple] = []
        self._observed = Observations()
        self._published: EngineSnapshot | None = None
        self._tier_every = tier_reports_every_s if llm.engine.tiers is not None else None
        self._tiers_at = float("-inf")

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def apply(self, command) -> None:
        if isinstance(command, Submit):
            try:
                self._submit(command)
            except Exception as e:     # one request's unforeseen failure: its own 500
                log.exception("submitting a request failed")
                self._abort(command.job_id, count=False)
                self._events.append((command.job_id, "error", e))
        elif isinstance(command, Abort):
            self._abort(command.job_id)
        else:
            raise TypeError(f"not an engine command: {command!r}")

    def step(self) -> None:
        self._handle(self.engine.step())

    def take_message(self, force: bool = False) -> StepMessage | None:
        """What happened since the last message, or None if nothing did."""
        snapshot = self.snapshot()
        tiers = None
        now = time.monotonic()
        if self._tier_every is not None and now - self._tiers_at >= self._tier_every:
            tiers, self._tiers_at = self.engine.tiers.stats(), now
        if not (force or self._events or not self._observed.empty()
                or snapshot != self._published or tiers is not None):
            return None
        message = StepMessage(self._events, self._observed, snapshot, tiers)
        self._events, self._observed, self._published = [], Observations(), snapshot
        return message

    def fail(self, error: BaseException) -> StepMessage:
        """The engine is broken: every job ends with `error` (the last message)."""
        for job_id in self._jobs:
            self._events.append((job_id, "error", error))
        self._jobs.clear()
        self._live.clear()
        return self.take_message(force=True)

    def snapshot(self) -> EngineSnapshot:
        scheduler = self.engine.scheduler
        total, free = scheduler.page_counts()
        prefix = scheduler.prefix_stats()
        return EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + self.engine.num_awaiting_grammar(),
            pages_total=total, pages_free=free,
            prefix_queries=prefix.queries if prefix else 0,
            prefix_hits=prefix.hits if prefix else 0,
            prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
            spec_drafted=self._spec[0], spec_accepted=self._spec[1],
            steps=self.engine.num_steps)

    # ---- commands -------------------------------------------------------------------------
    def _submit(self, command: Submit) -> None:
        groups = self.llm._submit(command.prompts, command.params, streaming=command.stream)
        failed = next((g.failed for g in groups if g.failed is not None), None)
        if failed is not None:         # the whole call is refused, as OpenAI's server does
            for g in groups:
                for req in g.requests:
                    self.engine.abort(req.request_id)
            self._events.append((command.job_id, "error", failed.error))
            return
        job = _Job(command, groups, [len(g.requests) for g in groups], len(groups))
        self._jobs[command.job_id] = job
        for i, g in enumerate(groups):
            self._observed.prompt_tokens += len(command.prompts[i])
            for j, req in enumerate(g.requests):
                deltas = RequestDeltas(req, self.llm.tokenizer) if command.stream else None
                self._live[req.request_id] = _Live(job, i, j, deltas)

    def _abort(self, job_id: int, count: bool = True) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:                 # finished, failed or never admitted
            return
        aborted = 0
        for g in job.groups:
            for req in g.requests:
                if self._live.pop(req.request_id, None) is not None:
                    self.engine.abort(req.request_id)
                    aborted += 1
        if count:
            self._observed.aborted += aborted

    # ---- a step's outputs -----------------------------------------------------------------
    def _handle(self, touched: list[Request]) -> None:
        now = time.monotonic()
        for req in touched:
            live = self._live.get(req.request_id)
            if live is None:            # aborted
                continue
            job_id = live.job.submit.job_id
            if req.is_complete and req.error is not None and not req.resolved_tokens:
                # refused before any token (its grammar did not compile): the whole job is
                self._events.append((job_id, "error", req.error))
                self._abort(job_id, count=False)
                continue
            try:
                self._count_tokens(live, req, now)
                if live.deltas is not None:
                    inc = live.deltas.advance()
                    if inc.token_ids or inc.text or inc.done:
                        self._events.append((job_id, "delta", live.group, live.index, inc,
                                             req.finish_reason))
                if req.is_complete:
                    self._complete(live, req, now)
            except Exception as e:     # this request's output failed: it alone ends, with a 500
                log.exception("reading request %s's output failed", req.request_id)
                self._abort(job_id, count=False)
                self._events.append((job_id, "error", e))

    def _count_tokens(self, live: _Live, req: Request, now: float) -> None:
        known = len(req.resolved_tokens)
        new = known - live.seen
        if new <= 0:
            return
        self._observed.generation_tokens += new
        if live.seen == 0:              # (tokens that come with the first have no gap)
            self._observed.ttft.append(now - live.job.submit.arrival)
        else:                           # several at once (speculation): spread evenly
            self._observed.itl.extend([(now - live.last_token) / new] * new)
        live.seen, live.last_token = known, now

    def _complete(self, live: _Live, req: Request, now: float) -> None:
        del self._live[req.request_id]
        job = live.job
        self._observed.e2e.append(now - job.submit.arrival)
        self._observed.finished.append(req.finish_reason.value)
        self._spec[0] += req.spec.drafted
        self._spec[1] += req.spec.accepted
        job.open_in_group[live.group] -= 1
        if job.open_in_group[live.group]:
            return
        job_id = job.submit.job_id
        self._events.append((job_id, "final", live.group,
                             self.llm._group_output(job.groups[live.group])))
        job.open_groups -= 1
        if job.open_groups == 0:
            self._events.append((job_id, "done"))
            del self._jobs[job_id]


def drive(loop: EngineLoop, receive: Callable[[bool], list], publish: Callable[[StepMessage], None]
          ) -> None:
    """Run `loop` until a Stop command: take the commands that arrived (`receive(block)`
    waits up to _IDLE_WAIT_S for one when the engine is idle), step while there is work, and
    publish each step's message. A failure publishes the message that fails every job, then
    raises."""
    try:
        while True:
            for command in receive(not loop.has_work()):
                if isinstance(command, Stop):
                    return
                loop.apply(command)
            if loop.has_work():
                loop.step()
            message = loop.take_message()
            if message is not None:
                publish(message)
    except BaseException as e:      # the engine is broken: fail everyone, stop serving
        log.exception("the engine loop failed")
        publish(loop.fail(e))
        raise
