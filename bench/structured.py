"""Structured output overhead: decode step time with 32 grammar-constrained rows vs 32 free rows.

    python bench/structured.py [--model models/deepinfer-tiny-v4] [--batch 32]

Both runs sample at temperature 1 from the same prompts; the constrained rows follow a JSON
schema (an array of short strings, long enough not to end during the measurement). The step
time is measured in steady-state decode with the synchronous loop (a constrained row then
samples every step, so every step pays for the masks: llguidance's fill on the host, the
bitmask's transfer and its application on the device). In the asynchronous loop a
constrained row runs every step too, its mask applied one step late by a second, small launch
on the step's kept logits (engine/deferred_masks.py); the async tokens/s are reported too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.engine_loop import abort_all, step_until_decoding  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from deepinfer_jax import LLM, SamplingParams  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40,
          "maxItems": 60}


def measure(llm: LLM, params: SamplingParams, batch: int, steps: int) -> dict:
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"r{i}", llm.tokenizer.encode(f"items {i}:"), params)
    step_until_decoding(engine, batch, settle=0)
    tokens_before = sum(len(r.resolved_tokens) for r in engine.scheduler.running)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.resolved_tokens) for r in engine.scheduler.running) - tokens_before
    finished = batch - len(engine.scheduler.running)
    abort_all(engine)
    return {"step_ms": elapsed / steps * 1e3, "tokens_per_s": tokens / elapsed,
            "finished_early": finished}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "models/deepinfer-tiny-v4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    free = SamplingParams(max_tokens=400, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=400, temperature=1.0, seed=1, json_schema=SCHEMA)
    results = {}
    for mode in ("sync", "async"):
        llm = LLM(args.model, max_num_seqs=args.batch, max_model_len=512,
                  max_num_batched_tokens=max(64, args.batch), async_scheduling=mode == "async",
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
        for params in (free, constrained):      # warm-up (the deferred first half compiles)
            measure(llm, params, args.batch, 5)
        for repeat in range(3):     # interleaved; the fastest of three counts (CPU noise)
            for name, params in (("unconstrained", free), ("json_schema", constrained)):
                r = measure(llm, params, args.batch, args.steps)
                best = results.get(f"{mode}/{name}")
                if best is None or r["step_ms"] < best["step_ms"]:
                    results[f"{mode}/{name}"] = r
                print(mode, name, repeat, r, flush=True)
    overhead = results["sync/json_schema"]["step_ms"] / results["sync/unconstrained"]["step_ms"] - 1
    device = jax.devices()[0].platform
    payload = {"environment": environment(), "model": str(args.model.relative_to(REPO)),
               "batch": args.batch, "steps": args.steps, "schema": SCHEMA, "results": results,
               "sync_step_overhead": overhead}
    table = "| loop | rows | step ms | tokens/s |\n|---|---|---:|---:|\n"
    for key, r in results.items():
        mode, name = key.split("/")
        table += f"| {mode} | {args.batch} {name} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} |\n"
    table += (f"\nStep-time overhead of {args.batch} constrained rows (synchronous loop, every row "
              f"samples every step): {overhead:+.1%}. Model `{payload['model']}`, temperature 1, "
              f"{args.steps} steady-state decode steps per cell, best of 3 interleaved runs.")
    write_results(f"structured-{device}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
