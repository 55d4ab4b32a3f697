"""What passes between the server and its engine loop (engine_loop.py), whether the loop runs
on a thread of the server's process or in a process of its own (engine_process.py).

Commands go in (`Submit`, `Abort`, `Stop`); one `StepMessage` per engine step comes out,
carrying every job's events of that step, the metric observations the step made, and a
snapshot of the engine's state for /metrics. Everything here is ints, floats, strings, lists
and the host's own small dataclasses (Increment, RequestOutput, SamplingParams, errors):
cheap to pickle through a pipe, and nothing that holds the engine.

A job's events, in order (the job id first):
    (id, "error", exc)                      the engine refused the job or failed it
    (id, "delta", prompt i, completion j, Increment, FinishReason | None)   streaming only
    (id, "final", prompt i, RequestOutput)  a prompt's completions are all done
    (id, "done")
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.host.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class Submit:
    job_id: int
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    # time.monotonic() at the request's arrival: CLOCK_MONOTONIC is one clock for every
    # process of the machine, so the engine's process measures latencies from it too
    arrival: float


@dataclasses.dataclass(frozen=True)
class Abort:
    job_id: int                     # its client went away: free its pages now


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0                 # queued, or waiting for their grammar to compile
    pages_total: int = 0
    pages_free: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    spec_drafted: int = 0            # draft tokens verified (finished requests)
    spec_accepted: int = 0
    steps: int = 0


@dataclasses.dataclass
class Observations:
    """The metrics a step observed, applied to the server's registry where it lands."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: list[float] = dataclasses.field(default_factory=list)     # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: list[float] = dataclasses.field(default_factory=list)
    finished: list[str] = dataclasses.field(default_factory=list)   # finish reasons
    aborted: int = 0

    def empty(self) -> bool:
        return not (self.prompt_tokens or self.generation_tokens or self.ttft or self.itl
                    or self.e2e or self.finished or self.aborted)


@dataclasses.dataclass
class StepMessage:
    events: list[tuple]              # (job id, kind, ...) in the order they happened
    observed: Observations
    snapshot: EngineSnapshot
    kv_tiers: dict | None = None     # the KV tiers' reports by tier (engine process only)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """The engine process's first message: it is ready, and what the server needs of it."""

    max_model_len: int
    num_pages: int
    tokenizer: object | None         # TextTokenizer: the server tokenizes and formats
    chat_template: object | None     # ChatTemplate or DeepSeekV4Chat


@dataclasses.dataclass(frozen=True)
class EngineFailed:
    """The engine process could not start, or its loop failed: why, and where."""

    error: str                       # "TypeName: message"
    traceback: str
