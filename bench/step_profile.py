"""Where a step's time goes: host loop vs device, and the device time by kernel.

    python bench/step_profile.py [--model PATH | --v4-flash-layers N] [--batch B] [--out DIR]
    python bench/step_profile.py --v4-flash-layers 2 --prefill 8192 --out DIR
    python bench/step_profile.py --v4-flash-layers 2 --batch 64 --batch-invariant --out DIR
    python bench/step_profile.py --v4-flash-layers 4 --batch 16 --context 4096 --quantized --out DIR

Runs steady decode at one batch size and reports (1) the engine loop's split between host
work and waiting for the device, (2) the compiled step's device time alone (same inputs,
called back to back), (2b) the host's launch time alone (each call waited for: what an
overlapped loop cannot go below) and, with --out, the runtime's host events of that launch
by name, (3) with --out, a profiler trace and the device kernels ranked by total time (from
the trace's Perfetto JSON), each with the model line it came from (the optimised HLO's
source metadata, bench/lib/hlo_sources.py). With --prefill N: (2) and (3) for one
N-token prompt in one step instead. With --name, the figures and every kernel (not only the
top ones printed) also go to bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import pstats
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.device_time import (  # noqa: E402
    host_totals,
    kernel_totals,
    launching_thread,
    runtime_trace_options,
    trace_events,
)
from bench.lib.hlo_sources import describe  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.host.buckets import token_bucket  # noqa: E402
from deepinfer_jax.host.plan_builder import build_plan  # noqa: E402


def build(args) -> LLM:
    # Room to decode while the other prompts prefill (batch x context / budget steps) and
    # through the measured steps: a request that reached max_model_len during the warm-up
    # would finish and the batch would never be full (the warm-up loop would not end).
    growth = args.batch * args.context // args.budget + 4 * args.steps + 256
    common = dict(max_num_seqs=max(args.batch, 16), max_model_len=args.context + growth,
                  max_num_batched_tokens=args.budget, token_buckets=tuple(sorted({16, args.budget})),
                  enable_prefix_caching=False, batch_invariant=args.batch_invariant,
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    if args.v4_flash_layers:
        from bench.lib.models import V4_FLASH, engine_params, slice_config
        from deepinfer_jax.weights import random_params
        cfg = slice_config(V4_FLASH, args.v4_flash_layers)
        params = engine_params(random_params(cfg, 0, jnp.bfloat16,
                                             release_formats=args.quantized))
        return LLM(Model(cfg, params), **common)
    return LLM(args.model, **common)


def kernel_table(trace_dir: Path, steps: int, record: dict) -> list[tuple[str, float, int]]:
    """Every kernel of the traced steps, (name, ms a step, calls a step), longest first."""
    totals = kernel_totals(trace_events(trace_dir), steps)
    record["device_busy_ms"] = sum(ms for ms, _ in totals.values())
    record["kernels_per_step"] = sum(c for _, c in totals.values())
    print(f"device: {record['device_busy_ms']:.2f} ms busy, "
          f"{record['kernels_per_step']:.0f} events per step")
    return sorted(((n, ms, c) for n, (ms, c) in totals.items()), key=lambda r: -r[1])


def steady_decode(llm: LLM, args, record: dict) -> None:
    """Reach steady decode at args.batch requests, then split the loop's time (with
    --launch-ab, again with the step launched from the loop's own thread)."""
    engine, vocab = llm.engine, llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(2, vocab, args.context).tolist(),
                           SamplingParams(max_tokens=engine.step_cfg.max_model_len - args.context,
                                          ignore_eos=True))
    while not all(len(r.generated) >= 2 for r in engine.scheduler.running) or \
            len(engine.scheduler.running) < args.batch:
        engine.step()
    for _ in range(5):
        engine.step()
    label = "launch thread" if engine.host.launch_thread else "no launch thread"
    record["loop"] = {label: loop_split(engine, args.steps, label)}
    if args.launch_ab:
        engine.set_launch_thread(False)       # the same engine, no worker thread
        for _ in range(5):
            engine.step()
        record["loop"]["no launch thread"] = loop_split(engine, args.steps, "no launch thread")


def loop_split(engine, steps: int, label: str) -> dict:
    """The loop's wall time per step and its split, ms."""
    stats = engine.stats
    before = (stats.steps, stats.host_seconds, stats.wait_seconds)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    wall = (time.perf_counter() - start) / steps
    n = stats.steps - before[0]
    host = (stats.host_seconds - before[1]) / n
    wait = (stats.wait_seconds - before[2]) / n
    print(f"loop ({label}): {1e3 * wall:.2f} ms/step = host {1e3 * host:.2f} + waiting "
          f"{1e3 * wait:.2f}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return {"ms": 1e3 * wall, "host_ms": 1e3 * host, "waiting_ms": 1e3 * wait}


def dispatch_cost(compiled, params, state, plan, buffer, args, record: dict):
    """How long the host takes to launch the step, with the device idle at each call (each
    call waited for before the next): a loop that overlaps launching with running can only
    be as fast as this. Both with a fresh plan per call (the engine's case: XLA's CUDA
    graphs see new input addresses) and with one plan buffer reused; then what the host
    spent its launch in, by the runtime's own trace events."""
    for label, call, inputs in (("fresh plan", compiled, plan),
                                ("plan buffer reused", compiled.executable, buffer)):
        launch, whole = [], []
        for i in range(args.steps + 3):
            start = time.perf_counter()
            state, out = call(params, state, inputs)
            launched = time.perf_counter()
            jax.block_until_ready(out)
            if i >= 3:
                launch.append(launched - start)
                whole.append(time.perf_counter() - start)
        print(f"dispatch ({label}, each call waited for): launch {1e3 * np.median(launch):.2f} "
              f"ms (min {1e3 * min(launch):.2f}), launch + run {1e3 * np.median(whole):.2f} ms")
        record.setdefault("dispatch", {})[label] = {
            "launch_ms": 1e3 * float(np.median(launch)), "launch_min_ms": 1e3 * min(launch),
            "launch_and_run_ms": 1e3 * float(np.median(whole))}
    if args.out:
        trace_dir = args.out / "dispatch-trace"
        with jax.profiler.trace(str(trace_dir), profiler_options=runtime_trace_options()):
            for _ in range(10):
                state, out = compiled(params, state, plan)
                jax.block_until_ready(out)
        events = trace_events(trace_dir)
        print("the launching thread's host events per call, nested events counted in each:")
        record["launch_host_events"] = host_totals(events, 10, launching_thread(events), top=40)
        for e in record["launch_host_events"]:
            print(f"{e['ms_per_call']:8.3f} ms  x{e['count_per_call']:<6.1f} {e['name']}")
    return state


def main() -> None:
    faulthandler.register(signal.SIGTERM, chain=True)   # where a run cut by `timeout` was
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "deepinfer-tiny-v4"))
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--budget", type=int, default=256, help="max tokens per step")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--top", type=int, default=0, help="kernels listed (default 25, 40 with --prefill)")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of N tokens")
    ap.add_argument("--chunk", type=int, default=0,
                    help="with --prefill: tokens per step (default: the whole prompt)")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--quantized", action="store_true",
                    help="with --v4-flash-layers: weights in the release's formats (FP8, FP4)")
    ap.add_argument("--launch-ab", action="store_true",
                    help="then the same loop with the step launched from the loop's thread")
    ap.add_argument("--name", default=None,
                    help="also write bench/results/NAME.{json,md} (every kernel, with --out)")
    args = ap.parse_args()
    record: dict = {"case": {k: getattr(args, k) for k in (
        "v4_flash_layers", "batch", "context", "budget", "prefill", "chunk", "batch_invariant",
        "quantized")}}
    if args.prefill:
        args.budget, args.batch, args.context = args.chunk or args.prefill, 1, args.prefill
    llm = build(args)
    print(f"engine built (traced and compiled) in {time.perf_counter() - t0:.0f} s", flush=True)
    engine = llm.engine
    if args.prefill:
        request = engine.add_request("prompt", np.random.default_rng(0).integers(
            2, llm.model.config.vocab_size, args.prefill).tolist(), SamplingParams(max_tokens=1))
        while request.num_tokens - request.num_computed > args.budget:
            engine.step()       # chunked: profile the last chunk, the one that sees the most
    else:
        steady_decode(llm, args, record)
    engine.set_launch_thread(False)     # waits for the launched steps: the state is settled
    # The compiled step alone: the same plan, called back to back (the state is donated).
    # (schedule() books it as launched; the engine is not stepped again after this)
    decision = engine.scheduler.schedule()
    bucket = token_bucket(engine.step_cfg.token_buckets, decision.num_tokens)
    plan = build_plan(decision, bucket, engine.step_cfg)
    compiled = engine.steps.select(bucket, decision.truncating_sampler)
    state = engine.state
    for _ in range(3):
        state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    device = (time.perf_counter() - start) / args.steps
    print(f"compiled step alone (bucket {bucket}): {1e3 * device:.2f} ms")
    record["bucket"], record["step_alone_ms"] = bucket, 1e3 * device
    # The same with one plan buffer on the device, passed every call: if XLA's CUDA graphs are
    # re-recorded when an input's address changes, this call skips that (an A/B, issue 11).
    buffer = jax.device_put(compiled.plan_wire.pack_host(plan))
    for _ in range(3):
        state, out = compiled.executable(engine.params, state, buffer)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, out = compiled.executable(engine.params, state, buffer)
    jax.block_until_ready(out)
    record["step_alone_plan_reused_ms"] = 1e3 * (time.perf_counter() - start) / args.steps
    print(f"compiled step alone, one plan buffer on the device reused: "
          f"{record['step_alone_plan_reused_ms']:.2f} ms")
    state = dispatch_cost(compiled, engine.params, state, plan, buffer, args, record)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with jax.profiler.trace(str(args.out / "trace"), create_perfetto_trace=True):
            for _ in range(10):
                state, out = compiled(engine.params, state, plan)
            jax.block_until_ready(out)
        table = kernel_table(args.out / "trace", 10, record)
        sources = describe(compiled.executable.as_text(), [name for name, _, _ in table])
        record["kernels"] = [{"name": name, "ms": ms, "calls": count,
                              "source": sources.get(name, "")} for name, ms, count in table]
        for name, ms, count in table[:args.top or (40 if args.prefill else 25)]:
            print(f"{ms:8.3f} ms  x{count:<4} {name}  {sources.get(name, '')}")
    engine.state = state
    if args.name:
        write_results(args.name, record, summary(record))


def summary(record: dict) -> str:
    """The result file's Markdown: the figures, then every kernel."""
    lines = ["| what | ms a step |", "|---|---:|"]
    for label, loop in record.get("loop", {}).items():
        lines.append(f"| engine loop ({label}) | {loop['ms']:.2f} (host {loop['host_ms']:.2f} + "
                     f"waiting {loop['waiting_ms']:.2f}) |")
    lines.append(f"| compiled step alone, back to back (bucket {record['bucket']}), a fresh plan "
                 f"each call / one plan buffer reused | {record['step_alone_ms']:.2f} / "
                 f"{record['step_alone_plan_reused_ms']:.2f} |")
    for label, d in record["dispatch"].items():
        lines.append(f"| launch alone, each call waited for ({label}) | {d['launch_ms']:.2f} "
                     f"(min {d['launch_min_ms']:.2f}) |")
    if "kernels" in record:
        lines.append(f"| device busy (profiler, 10 steps) | {record['device_busy_ms']:.2f} in "
                     f"{record['kernels_per_step']:.0f} kernels |")
        lines += ["", "Every kernel, by total time a step:", "",
                  "| kernel | ms | calls | source |", "|---|---:|---:|---|"]
        lines += [f"| `{k['name']}` | {k['ms']:.3f} | {k['calls']:g} | {k['source']} |"
                  for k in record["kernels"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
