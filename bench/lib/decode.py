"""Steady decode through the engine loop, as bench/e2e.py and bench/depth_slope.py time it:
requests sharing a long prefix (in the prefix cache), each with a short tail of its own."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
import numpy as np

from bench.lib.device_time import (
    busy_and_span_of,
    device_events,
    host_totals,
    idle_gaps,
    kernel_totals,
    launching_thread,
    runtime_trace_options,
    trace_events,
)
from bench.lib.engine_loop import abort_all, step_until_decoding
from deepinfer_jax import LLM, SamplingParams

TAIL = 64            # tokens of each decode request after the shared prefix


def start_shared_prefix_batch(llm: LLM, batch: int, context: int, rng, tag: str,
                              first: int = 1) -> None:
    """`batch` requests (ids tag0, tag1, ...) of `context` tokens, a shared prefix and TAIL
    tokens each, all decoding (step_until_decoding); the `first` (one per data-parallel
    rank, where each rank has its own prefix cache) prefill the prefix before the rest join,
    so that those find it in the prefix cache (where the engine has one)."""
    engine, vocab = llm.engine, llm.model.config.vocab_size
    shared = rng.integers(2, vocab, context - TAIL).tolist()
    params = SamplingParams(max_tokens=engine.step_cfg.max_model_len - context, ignore_eos=True)

    def add(i: int) -> None:
        engine.add_request(f"{tag}{i}", shared + rng.integers(2, vocab, TAIL).tolist(), params)
    for i in range(first):
        add(i)
    while sum(bool(r.generated) for r in engine.scheduler.running) < first:
        engine.step()
    for i in range(first, batch):
        add(i)
    step_until_decoding(engine, batch)


def decode(llm: LLM, batch: int, context: int, steps: int, rng, trace_dir: Path | None = None) -> dict:
    """Steady decode at `batch` requests sharing a (context - TAIL)-token prefix: the loop's
    time per step, its split into host work and waiting for the device, and with trace_dir
    the device's kernels over as many more steps (busy ms per step and the kernels by time) and
    the launcher thread's host events (what launching a step cost the host)."""
    start_shared_prefix_batch(llm, batch, context, rng, "d")
    return decode_timed(llm, batch, steps, trace_dir)


def decode_timed(llm: LLM, batch: int, steps: int, trace_dir: Path | None = None) -> dict:
    """decode()'s timing of `batch` requests already decoding; aborts them after."""
    engine = llm.engine
    times = []
    stats = engine.stats
    before = (stats.steps, stats.host_seconds, stats.wait_seconds)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    counted = max(stats.steps - before[0], 1)
    split = {"host_ms_per_step": 1e3 * (stats.host_seconds - before[1]) / counted,
             "wait_ms_per_step": 1e3 * (stats.wait_seconds - before[2]) / counted}
    if trace_dir is not None:
        split |= traced_decode(engine, steps, trace_dir)
    abort_all(engine)
    p50, p90, p99 = np.percentile(times, [50, 90, 99])
    return {"tokens_per_s": batch / statistics.mean(times), "itl_p50_s": p50, "itl_p90_s": p90,
            "itl_p99_s": p99, **split}


def traced_decode(engine, steps: int, trace_dir: Path, top: int = 40,
                  runtime_events: bool = True) -> dict:
    """The device's kernels over `steps` more loop steps: busy ms per step and the `top`
    kernels by ms per step (a busy time well under the loop's step time: the host bounds it).
    runtime_events: also XLA's runtime events on the host (the launching thread's totals), a
    trace many times larger to write and read."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    options = runtime_trace_options() if runtime_events else jax.profiler.ProfileOptions()
    with jax.profiler.trace(str(trace_dir), profiler_options=options):
        for _ in range(steps):
            engine.step()
        # the launched steps' kernels end inside the trace: their calls made (the same
        # launcher again), then the state they leave is ready
        engine.set_launch_thread(engine.host.launch_thread)
        jax.block_until_ready(engine.state)
    events = trace_events(trace_dir)
    totals = kernel_totals(events, steps)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {"device_busy_ms_per_step": sum(ms for ms, _ in totals.values()),
            # the union of the kernels' intervals: kernels on several streams overlap
            "device_busy_union_ms_per_step": busy_and_span_of(device_events(events), steps)[0],
            "kernels_per_step": sum(c for _, c in totals.values()),
            "top_kernels": [{"name": n, "ms_per_step": ms, "launches": c} for n, (ms, c) in ranked],
            "idle": idle_gaps(device_events(events), steps),
            "launch_thread": (host_totals(events, steps, launching_thread(events))
                              if runtime_events else None)}
