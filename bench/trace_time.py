"""How long tracing and lowering one step takes, for CUDA, on this machine (no GPU needed).

    python bench/trace_time.py [--layers 2 8] [--bucket T] [--profile]

Lowers the engine's step at V4-Flash dimensions with abstract weights and state (shapes only,
nothing allocated) through jax.export for CUDA, with the Mosaic GPU kernels on, in the default
and the batch-invariant mode: the Python half of a GPU engine's start-up, per step variant
(XLA's compile comes after it). --profile prints where the time went.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.lib.models import V4_FLASH, slice_config  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax.config.compute import KERNEL_OPS  # noqa: E402
from deepinfer_jax.config.engine import EngineConfig  # noqa: E402
from deepinfer_jax.config.options import DeviceFacts, default_kernels  # noqa: E402
from deepinfer_jax.device.step import step  # noqa: E402
from deepinfer_jax.engine.transfer import Wire  # noqa: E402
from deepinfer_jax.host.decision import ScheduleDecision  # noqa: E402
from deepinfer_jax.host.plan_builder import build_plan  # noqa: E402
from deepinfer_jax.model.state import init_state  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from pallas_kernels.common import abstract_gpu  # noqa: E402

H200 = DeviceFacts("gpu", "9.0")


def trace_seconds(layers: int, bucket: int, invariant: bool, profile: bool) -> float:
    cfg = slice_config(V4_FLASH, layers)
    # the H200's step (kernels first, the GPU formulation), whatever this machine is
    step_cfg = EngineConfig(max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=bucket,
                            token_buckets=(bucket,), batch_invariant=invariant).resolve(cfg, H200)
    params = jax.eval_shape(lambda: random_params(cfg, 0, jnp.bfloat16))
    state = jax.eval_shape(lambda: init_state(cfg, step_cfg, jnp.bfloat16))
    wire = Wire.of(build_plan(ScheduleDecision(()), bucket, step_cfg))
    traced = jax.jit(lambda p, s, b: step(p, s, wire.unpack_device(b), cfg=cfg, step_cfg=step_cfg,
                                          truncation=False))
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    with abstract_gpu():
        if profiler:
            profiler.enable()
        jax.export.export(traced, platforms=["cuda"])(params, state, wire.spec())
        if profiler:
            profiler.disable()
    seconds = time.perf_counter() - start
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rows = []
    for layers in args.layers:
        for invariant in (False, True):
            seconds = trace_seconds(layers, args.bucket, invariant, args.profile)
            rows.append({"layers": layers, "batch_invariant": invariant, "seconds": seconds})
            print(rows[-1], flush=True)
    kernels = {op: list(getattr(default_kernels(H200), op)) for op in KERNEL_OPS}
    table = "| layers | mode | trace + lower s |\n|---:|---|---:|\n" + "".join(
        f"| {r['layers']} | {'batch-invariant' if r['batch_invariant'] else 'default'} | "
        f"{r['seconds']:.1f} |\n" for r in rows)
    table += (f"\nOne step variant (bucket {args.bucket}) at V4-Flash dimensions, lowered for "
              f"CUDA on this machine with the Mosaic GPU kernels {kernels}.")
    write_results(f"trace-time-{jax.devices()[0].platform}",
                  {"bucket": args.bucket, "kernels": kernels, "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
