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
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import environment, write_results  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig  # noqa: E402
from deepinfer_jax.host.buckets import token_bucket  # noqa: E402
from deepinfer_jax.host.plan_builder import build_plan  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def model_config(args) -> ModelConfig:
    if not args.v4_flash_layers:
        return ModelConfig.from_json_file(args.config)
    cfg = ModelConfig.from_json_file(REPO / "configs" / "deepseek-v4-flash.json")
    n = args.v4_flash_layers
    kinds = [AttentionKind.CSA, AttentionKind.HCA] * n
    return cfg.replace(num_layers=n, layer_types=tuple(kinds[:n]), mlp_types=(MlpKind.MOE,) * n,
                       num_mtp_layers=0, quantization=None)


def steady_decode(llm: LLM, batch: int, steps: int) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(2, vocab, 16).tolist(),
                           SamplingParams(max_tokens=10_000, ignore_eos=True))
    while not (len(engine.scheduler.running) == batch
               and all(len(r.generated) >= 2 for r in engine.scheduler.running)):
        engine.step()
    for _ in range(3):
        engine.step()
    engine.stats.host_seconds = engine.stats.wait_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    host = engine.stats.host_seconds / steps
    device = device_time(engine, steps)
    for req in list(engine.scheduler.running):
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    return {"wall_ms": wall * 1e3, "device_ms": device * 1e3, "host_ms": host * 1e3,
            "idle_share": max(0.0, 1 - device / wall)}


def device_time(engine, steps: int) -> float:
    """The compiled decode step alone, launched back to back on one plan."""
    # schedule() books the step as launched (placeholders) though nothing postprocesses it:
    # the requests are aborted afterwards, which drops them
    decision = engine.scheduler.schedule()
    bucket = token_bucket(engine.ecfg.token_buckets, decision.num_tokens)
    plan = build_plan(decision, bucket, engine.ecfg)
    compiled, state = engine.steps.select(bucket, decision.truncating_sampler), engine.state
    state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(steps):
        state, out = compiled(engine.params, state, plan)
    jax.block_until_ready(out)
    engine.state = state
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs/bench/small-cpu.json")
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
    device = jax.devices()[0]
    name = f"overlap-{device.platform}"
    label = (f"V4-Flash dimensions, {cfg.num_layers} layers" if args.v4_flash_layers
             else str(args.config.relative_to(REPO)))
    payload = {"environment": environment(), "model": label, "random_init_s": init_s,
               "decode_steps_timed": args.steps, "results": rows,
               "command": "python bench/overlap.py " + " ".join(sys.argv[1:])}
    table = ("| mode | batch | wall ms/step | device ms/step | host ms/step | device idle |\n"
             "|---|---:|---:|---:|---:|---:|\n")
    for r in rows:
        table += (f"| {r['mode']} | {r['batch']} | {r['wall_ms']:.2f} | {r['device_ms']:.2f} | "
                  f"{r['host_ms']:.2f} | {r['idle_share']:.1%} |\n")
    table += (f"\nModel: {label}, random bf16 weights; steady-state decode, {args.steps} steps "
              "per cell. Device idle = 1 - device/wall, where device is the same compiled step "
              f"launched back to back. Command: `{payload['command']}`.")
    write_results(name, payload, table)
    print(table)


if __name__ == "__main__":
    main()
