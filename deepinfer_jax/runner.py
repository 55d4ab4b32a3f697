"""The engine core: the only module that joins the host (scheduler, plans) and the device
(compiled steps, params, state). Synchronous for now: each step's sampled tokens are read
before the next step is planned.
"""

from __future__ import annotations

import itertools
import time

import jax
import numpy as np

from deepinfer_jax.buckets import token_bucket
from deepinfer_jax.compile import compile_steps
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine_config import ResolvedEngineConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.pages import pages_needed
from deepinfer_jax.plan import build_plan
from deepinfer_jax.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from deepinfer_jax.scheduler import Scheduler
from deepinfer_jax.state import init_state


class EngineCore:
    def __init__(self, cfg: ModelConfig, params: ModelParams, ecfg: ResolvedEngineConfig):
        self.cfg, self.params, self.ecfg = cfg, params, ecfg
        self.state = init_state(cfg, ecfg, params.embed.dtype)
        self.steps = compile_steps(params, self.state, cfg, ecfg)
        self.scheduler = Scheduler(ecfg, cfg.eos_token_ids)
        self._arrivals = itertools.count()
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot run."""
        problems = self._problems(prompt, params)
        if problems:
            raise InvalidRequestError("; ".join(problems))
        request = Request(request_id, list(prompt), params, next(self._arrivals))
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _problems(self, prompt: list[int], params: SamplingParams) -> list[str]:
        problems = list(params.problems(self.cfg.vocab_size))
        if not prompt:
            problems.append("empty prompt")
        elif len(prompt) >= self.ecfg.max_model_len:
            problems.append(f"prompt of {len(prompt)} tokens leaves no room under "
                            f"max_model_len={self.ecfg.max_model_len}")
        else:
            bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
            if bad:
                problems.append(f"token ids outside the vocabulary [0, {self.cfg.vocab_size}): "
                                f"{bad[:8]}")
            longest = min(len(prompt) + max(params.max_tokens, 0), self.ecfg.max_model_len)
            if pages_needed(longest, self.ecfg.page_size) > self.ecfg.num_pages:
                problems.append(f"a sequence of {longest} tokens needs more pages than the "
                                f"pool holds ({self.ecfg.num_pages})")
        return problems

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run one device step, apply its tokens. Returns the requests that received
        a token or finished (aborted requests are reported by `abort`)."""
        decision = self.scheduler.schedule()
        if not decision.seqs:
            return []
        now = time.time()
        for seq in decision.seqs:
            seq.request.metrics.first_scheduled_time = (seq.request.metrics.first_scheduled_time
                                                        or now)
        bucket = token_bucket(self.ecfg.token_buckets, decision.num_tokens)
        plan = jax.device_put(build_plan(decision, bucket, self.ecfg))
        self.state, out = self.steps[bucket](self.params, self.state, plan)
        next_tokens = np.asarray(out.next_tokens)
        self.num_steps += 1
        touched = self.scheduler.update(decision, next_tokens)
        now = time.time()
        for req in touched:
            req.metrics.first_token_time = req.metrics.first_token_time or now
            if req.status is RequestStatus.FINISHED:
                req.metrics.finished_time = now
        return touched


def failed_output(request_id: str, prompt, error: Exception,
                  metrics: RequestMetrics | None = None) -> RequestOutput:
    metrics = metrics or RequestMetrics(time.time())
    metrics.finished_time = time.time()
    return RequestOutput(request_id, list(prompt) if _is_token_list(prompt) else [], [], None,
                         True, FinishReason.ERROR, error, metrics)


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer))
                                                     for t in prompt)
