"""The device's idle share in the engine loop, with and without speculation.

    python bench/overlap.py                                              # CPU: small config
    python bench/overlap.py --v4-flash-layers 4 --context 4096 --spec-k 0 3   # GPU

For each loop (asynchronous by default), draft count k (0: plain decoding) and batch: the
loop's wall time per step, untimed by any profiler, as the median and spread of `--repeats`
windows of `--steps` steps; then as many steps more under the profiler, whose kernels give the
device's busy time per step (the union of their intervals). Device idle = 1 - busy / wall.

Requests share a `--context`-token prefix (served from the prefix cache) and decode from it.
With k > 0 the model has one MTP layer and every request drafts exactly k tokens each step
(bench/spec_verify.py's `forced`). The weights are random, so almost no draft is accepted:
the asynchronous loop's guess that none of the last step's drafts were accepted
(host/spec_booking.py) then always holds, and the table counts the steps the loop had to
plan only after reading the last one (`read first`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.decode import start_shared_prefix_batch, traced_decode  # noqa: E402
from bench.lib.engine_loop import abort_all  # noqa: E402
from bench.lib.models import SMALL_CPU, model_config, model_label  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.timing import MIN_REPEATS  # noqa: E402
from bench.spec_verify import forced  # noqa: E402
from deepinfer_jax import LLM, Model  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def count_reads_first(llm: LLM) -> list[int]:
    """[steps planned only after reading the last one]: SpecBooking.must_read_first's True
    answers, counted from now (plain engines have no booking: none)."""
    booking = getattr(llm.engine.scheduler, "spec_booking", None)
    counter = [0]
    if booking is not None:
        ask = booking.must_read_first

        def counted(sched) -> bool:
            answer = ask(sched)
            counter[0] += answer
            return answer
        booking.must_read_first = counted
    return counter


def idle_row(llm: LLM, k: int, batch: int, context: int, steps: int, repeats: int,
             trace_dir: Path, rng) -> dict:
    engine = llm.engine
    start_shared_prefix_batch(llm, batch, context, rng, "o")
    reads_first = count_reads_first(llm)
    windows, emitted = [], sum(len(r.generated) for r in engine.scheduler.running)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        windows.append((time.perf_counter() - start) * 1e3 / steps)
    emitted = sum(len(r.generated) for r in engine.scheduler.running) - emitted
    timed_reads_first = reads_first[0]
    start = time.perf_counter()
    traced = traced_decode(engine, steps, trace_dir, runtime_events=False)
    trace_s = time.perf_counter() - start
    abort_all(engine)
    # a CPU backend's trace has no device timeline (device_events then takes every thread's)
    busy = traced["device_busy_union_ms_per_step"] if jax.default_backend() == "gpu" else None
    idle = ({"idle_share": None, "idle_share_min": None, "idle_share_max": None} if busy is None
            else {"idle_share": statistics.median(1 - busy / w for w in windows),
                  "idle_share_min": 1 - busy / min(windows),
                  "idle_share_max": 1 - busy / max(windows)})
    return {"batch": batch, "wall_ms": statistics.median(windows), "wall_ms_min": min(windows),
            "wall_ms_max": max(windows), "busy_ms": busy,
            **idle, "tokens_per_step": emitted / (repeats * steps) / batch,
            "steps_read_first": timed_reads_first if k else None, "steps_timed": repeats * steps,
            "kernels_per_step": traced["kernels_per_step"], "trace_s": trace_s,
            "idle_gaps": traced["idle"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--spec-k", type=int, nargs="+", default=[0, 3],
                    help="drafts per request and step; 0: plain decoding")
    ap.add_argument("--loops", nargs="+", choices=("async", "sync"), default=["async"])
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--trace", type=Path, default=REPO / ".cache" / "overlap-trace")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    base = model_config(args)
    cfg = dataclasses.replace(base, num_mtp_layers=1) if max(args.spec_k) else base
    t0 = time.perf_counter()
    weights = jax.block_until_ready(random_params(cfg, 0, jnp.bfloat16))
    init_s = time.perf_counter() - t0
    batch_max = max(args.batches)
    rows = []
    for loop in args.loops:
        for k in args.spec_k:
            budget = max(1024, batch_max * (k + 1))
            need = {16, budget} | {max(16, 1 << (b * (k + 1) - 1).bit_length())
                                   for b in args.batches}
            t0 = time.perf_counter()
            llm = LLM(Model(cfg, weights), async_scheduling=loop == "async",
                      speculative_config=forced(k, batch_max) if k else None,
                      max_num_seqs=batch_max, max_model_len=args.context + 128,
                      max_num_batched_tokens=budget, token_buckets=tuple(sorted(need)),
                      enable_prefix_caching=True,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
            startup = time.perf_counter() - t0
            rng = np.random.default_rng(0)
            for batch in args.batches:
                t0 = time.perf_counter()
                r = {"loop": loop, "k": k, "startup_s": startup,
                     **idle_row(llm, k, batch, args.context, args.steps, args.repeats,
                                args.trace / f"{loop}-k{k}-b{batch}", rng)}
                r["row_s"] = time.perf_counter() - t0
                rows.append(r)
                print({key: v for key, v in r.items() if key != "idle_gaps"}, flush=True)
            del llm
            gc.collect()
    label = model_label(args, base) + (" + 1 MTP layer" if max(args.spec_k) else "")
    lines = [
        f"Model: {label}, random bf16 weights; decode at a {args.context}-token context "
        "(shared prefix). Wall: the loop's ms per step, median (min-max) of "
        f"{args.repeats} windows of {args.steps} steps, no profiler. Busy: the device's kernels "
        "per step over as many more steps under the profiler. Idle = 1 - busy / wall.", "",
        "| loop | drafts k | batch | wall ms/step | device busy ms/step | device idle | "
        "tokens/request/step | read first | kernels/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        busy, idle = "-", "- (no device timeline)"
        if r["busy_ms"] is not None:
            busy = f"{r['busy_ms']:.2f}"
            idle = (f"{r['idle_share']:.1%} ({r['idle_share_min']:.1%}-"
                    f"{r['idle_share_max']:.1%})")
        read_first = ("-" if r["steps_read_first"] is None
                      else f"{r['steps_read_first']}/{r['steps_timed']}")
        lines.append(
            f"| {r['loop']} | {r['k']} | {r['batch']} | {r['wall_ms']:.2f} ({r['wall_ms_min']:.2f}"
            f"-{r['wall_ms_max']:.2f}) | {busy} | {idle} | {r['tokens_per_step']:.2f} "
            f"| {read_first} | {r['kernels_per_step']} |")
    payload = {"environment": environment(), "model": label, "context": args.context,
               "random_init_s": init_s, "rows": rows}
    name = args.name or f"overlap-{jax.devices()[0].platform}"
    write_results(name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
