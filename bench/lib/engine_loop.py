"""Steady-state decode in the engine, timed two ways: the loop's wall time per step (host
planning, launch and bookkeeping included) and the same compiled step launched back to back
on one plan (the device's share). Their difference is the time the device waits on the
host."""

from __future__ import annotations

import time

import jax
import numpy as np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.host.buckets import token_bucket
from deepinfer_jax.host.plan_builder import build_plan


def prefill_seconds(llm: LLM, length: int, repeats: int, rng) -> list[float]:
    """Seconds to first token of `repeats` fresh `length`-token prompts (no prefix hit), one
    at a time, after a warm-up prefill of the same length."""
    vocab = llm.model.config.vocab_size
    llm.generate([rng.integers(2, vocab, length).tolist()], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    samples = []
    for _ in range(repeats):
        prompt = rng.integers(2, vocab, length).tolist()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        samples.append(time.perf_counter() - start)
    return samples


def step_until_decoding(engine, batch: int, settle: int = 3) -> None:
    """Steps `engine` until its `batch` requests all run and have 2 tokens each, then `settle`
    steps more. Raises where one finished first: the later ones' prefills took more steps than
    its max_tokens (a token budget too small for the prompts, or no prefix hit), and the batch
    would never be whole."""
    sched = engine.scheduler
    while not (len(sched.running) == batch and all(len(r.generated) >= 2 for r in sched.running)):
        # (a constrained request joins the scheduler once its grammar has compiled)
        if len(sched.running) + len(sched.waiting) + engine.num_awaiting_grammar() < batch:
            raise RuntimeError(f"a request finished before all {batch} were decoding: "
                               "raise max_model_len or the token budget")
        engine.step()
    for _ in range(settle):
        engine.step()


def abort_all(engine) -> None:
    """Ends every request the engine holds (running and waiting) and steps until the launched
    steps are read back, so the next case starts from an idle engine."""
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()


def steady_decode(llm: LLM, batch: int, steps: int) -> dict:
    """`batch` requests of 16 prompt tokens decoding: ms per step of wall, device, host."""
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(2, vocab, 16).tolist(),
                           SamplingParams(max_tokens=engine.step_cfg.max_model_len - 16,
                                          ignore_eos=True))
    step_until_decoding(engine, batch)
    engine.stats.host_seconds = engine.stats.wait_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    host = engine.stats.host_seconds / steps
    device = compiled_step_seconds(engine, steps)
    abort_all(engine)
    return {"wall_ms": wall * 1e3, "device_ms": device * 1e3, "host_ms": host * 1e3,
            "idle_share": max(0.0, 1 - device / wall)}


def compiled_step_seconds(engine, steps: int) -> float:
    """The compiled decode step alone, launched back to back on one plan (the state is
    donated and handed back to the engine). schedule() books the step as launched
    (placeholders) though nothing postprocesses it: the caller aborts the requests after."""
    decision = engine.scheduler.schedule()
    bucket = token_bucket(engine.step_cfg.token_buckets, decision.num_tokens)
    plan = build_plan(decision, bucket, engine.step_cfg)
    compiled, state = engine.steps.select(bucket, decision.truncating_sampler), engine.state
    state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(steps):
        state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    engine.state = state
    return (time.perf_counter() - start) / steps
