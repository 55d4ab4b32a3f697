"""Host/device overlap of the step loop: synchronous vs asynchronous scheduling.

    python bench/overlap.py                                   # CPU: configs/bench/small-cpu.json
    python bench/overlap.py --v4-flash-layers 2               # GPU: V4-Flash dimensions, 2 layers

For each mode and decode batch size: the wall time per step in steady-state decode, the
device time per step (the same compiled step launched back to back, nothing else), the host
time per step (planning, dispatch, bookkeeping; waiting for tokens excluded), and the device's
idle share of wall time, 1 - device / wall. Random weights, bf16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.engine_loop import steady_decode  # noqa: E402
from bench.lib.models import SMALL_CPU, model_config, model_label  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax import LLM, Model  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "xla-bench"))
    args = ap.parse_args()

    cfg = model_config(args)
    t0 = time.perf_counter()
    params = random_params(cfg, 0, jnp.bfloat16)
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    model = Model(cfg, params)
    engine_options = dict(max_num_seqs=max(args.batches), max_model_len=512,
                          max_num_batched_tokens=max(64, max(args.batches)), token_buckets=None,
                          compilation_cache_dir=args.cache_dir, show_progress=True)
    rows = []
    for mode in ("sync", "async"):
        t0 = time.perf_counter()
        llm = LLM(model, async_scheduling=mode == "async", **engine_options)
        startup = time.perf_counter() - t0
        for batch in args.batches:
            r = {"mode": mode, "batch": batch, **steady_decode(llm, batch, args.steps)}
            rows.append(r)
            print(r, flush=True)
        print(f"{mode} engine start-up (compile) {startup:.1f}s", flush=True)
        del llm
    name = f"overlap-{jax.devices()[0].platform}"
    label = model_label(args, cfg)
    payload = {"model": label, "random_init_s": init_s, "decode_steps_timed": args.steps,
               "results": rows}
    table = ("| mode | batch | wall ms/step | device ms/step | host ms/step | device idle |\n"
             "|---|---:|---:|---:|---:|---:|\n")
    for r in rows:
        table += (f"| {r['mode']} | {r['batch']} | {r['wall_ms']:.2f} | {r['device_ms']:.2f} | "
                  f"{r['host_ms']:.2f} | {r['idle_share']:.1%} |\n")
    table += (f"\nModel: {label}, random bf16 weights; steady-state decode, {args.steps} steps "
              "per cell. Device idle = 1 - device/wall, where device is the same compiled step "
              "launched back to back.")
    write_results(name, payload, table)
    print(table)


if __name__ == "__main__":
    main()
