"""The per-layer cost of a decode step: the slope of ms per step over slices of several depths,
against the roofline's slope.

    python bench/depth_slope.py --quantized                     # GPU: V4-Flash slices 2, 4, 8
    python bench/depth_slope.py --layers 1 2 --context 256 --batches 1 --config configs/bench/small-cpu.json
    python bench/depth_slope.py --quantized --layers 4 --batches 1 4 8 --bucket-sets 16,1024 1,4,8,16,1024
    python bench/depth_slope.py --quantized --layers 4 --batches 1 16 64 --fp4-programs-per-sm 0 4

For each slice (random weights at the config's dimensions, the release's formats with
--quantized) and batch: the engine loop's median ms per decode step at a `--context`-token
context (bench/e2e.py's decode: a shared prefix, 5+ timed steps). The slope is the least-
squares fit of ms per step on the layer count; the roofline's slope the same fit of the
bandwidth roofline's step time (weights and cache bytes the step must read, at the same run's
copy ceiling and at the datasheet's 4.8 TB/s). A slope near the roofline's means depth costs
only the bytes each layer must read; a larger one, per-layer overhead (launches, small
kernels) that a deep model multiplies.

--bucket-sets builds one engine per set of token buckets at each depth: a decode step pads its
rows up to the smallest bucket that holds them, so a set without small buckets runs batch 1 as
16 rows (a row's attention, its 6 experts' tiles, the layout moves all scale with the bucket).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.ceilings import DATASHEET_TBPS  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.decode import decode  # noqa: E402
from bench.lib.models import V4_FLASH, engine_params, slice_config  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.rooflines import decode_roofline, weight_counts  # noqa: E402
from deepinfer_jax import LLM, Model  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from pallas_kernels.grouped_gemm import fp4_path  # noqa: E402


def slope(xs: list[int], ys: list[float]) -> float:
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=V4_FLASH)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--quantized", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--bucket-sets", nargs="+", default=["16,1024"], metavar="B,B,...",
                    help="token buckets of the engines compared (one engine per set and depth)")
    ap.add_argument("--fp4-programs-per-sm", type=int, nargs="+",
                    default=[fp4_path.DECODE_PROGRAMS_PER_SM],
                    help="the FP4 expert kernel's persistent programs an SM at decode sizes "
                         "(0: a program a tile and weight block), one engine per value")
    ap.add_argument("--name", default=None, help="the result files' name")
    ap.add_argument("--trace", type=Path, default=None,
                    help="profile as many more steps per row under DIR: device busy ms per step "
                         "and the kernels by time, beside the loop's host/wait split")
    args = ap.parse_args()
    ceilings = measure_ceilings(small=jax.default_backend() != "gpu")
    print(ceilings, flush=True)
    bucket_sets = [tuple(int(b) for b in text.split(",")) for text in args.bucket_sets]
    rows = []
    for layers in args.layers:
        cfg = slice_config(args.config, layers)
        params = engine_params(jax.block_until_ready(random_params(
            cfg, 0, jnp.bfloat16, release_formats=args.quantized)))
        counts = weight_counts(params, cfg)
        for buckets, programs in itertools.product(bucket_sets, args.fp4_programs_per_sm):
            fp4_path.DECODE_PROGRAMS_PER_SM = programs      # read when the engine's step traces
            rows += measure_depth(args, cfg, params, counts, ceilings, layers, buckets)
            rows[-len(args.batches):] = [r | {"fp4_programs_per_sm": programs}
                                         for r in rows[-len(args.batches):]]
        del params
        gc.collect()
    slopes = {}
    for buckets, programs in itertools.product(bucket_sets, args.fp4_programs_per_sm):
        for batch in args.batches:
            mine = [r for r in rows if r["batch"] == batch and tuple(r["buckets"]) == buckets
                    and r["fp4_programs_per_sm"] == programs]
            if len({r["layers"] for r in mine}) < 2:
                continue
            xs = [r["layers"] for r in mine]
            fit = {key: slope(xs, [r[key] for r in mine])
                   for key in ("ms_per_step", "roofline_ms", "datasheet_roofline_ms")}
            fit["ratio"] = fit["ms_per_step"] / fit["roofline_ms"]
            slopes[f"{batch}@{','.join(map(str, buckets))}/p{programs}"] = {
                "batch": batch, "buckets": buckets, "fp4_programs_per_sm": programs, **fit}
    label = f"{args.config.name} slices, {'release formats (FP8/FP4)' if args.quantized else 'bf16'}"
    lines = [f"Model: {label}, random weights; decode at a {args.context}-token context; mean ms "
             f"per step over {args.steps} loop steps (bench/e2e.py decode); copy ceiling "
             f"{ceilings['copy_tbps']:.2f} TB/s measured in this run.", "",
             "FP4 programs/SM: the expert kernel's persistent programs an SM at decode sizes "
             "(0: a program a tile and weight block).", "",
             "| layers | buckets | FP4 programs/SM | batch | ms/step | ITL p50 / p90 ms | "
             "host / waiting ms | device busy / idle ms (kernels) | roofline ms (measured copy) | "
             "roofline ms (4.8 TB/s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        busy = (f"{r['device_busy_ms_per_step']:.3f} / {r['idle']['idle_ms_per_call']:.3f} "
                f"({r['kernels_per_step']:.0f})" if "device_busy_ms_per_step" in r else "-")
        lines.append(f"| {r['layers']} | {','.join(map(str, r['buckets']))} | "
                     f"{r['fp4_programs_per_sm']} | {r['batch']} | "
                     f"{r['ms_per_step']:.3f} | "
                     f"{r['itl_p50_ms']:.3f} / {r['itl_p90_ms']:.3f} | "
                     f"{r['host_ms_per_step']:.3f} / {r['wait_ms_per_step']:.3f} | {busy} | "
                     f"{r['roofline_ms']:.3f} | {r['datasheet_roofline_ms']:.3f} |")
    lines += ["", "| batch | buckets | FP4 programs/SM | slope ms/layer | roofline slope "
              "(measured copy) | (4.8 TB/s) | slope / roofline slope |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for s in slopes.values():
        lines.append(f"| {s['batch']} | {','.join(map(str, s['buckets']))} | "
                     f"{s['fp4_programs_per_sm']} | "
                     f"{s['ms_per_step']:.3f} | {s['roofline_ms']:.3f} | "
                     f"{s['datasheet_roofline_ms']:.3f} | {s['ratio']:.2f}x |")
    name = args.name or (f"depth-slope-{'quantized-' if args.quantized else ''}"
                         f"{jax.devices()[0].platform}")
    write_results(name, {"environment": environment(), "model": label, "ceilings": ceilings,
                         "context": args.context, "rows": rows, "slopes": slopes},
                  "\n".join(lines))
    print("\n".join(lines))


def measure_depth(args, cfg, params, counts, ceilings, layers: int,
                  buckets: tuple[int, ...]) -> list[dict]:
    """One engine of `layers` layers and these token buckets: a row per batch."""
    start = time.perf_counter()
    llm = LLM(Model(cfg, params), max_num_seqs=max(args.batches),
              max_model_len=args.context + 64, max_num_batched_tokens=max(buckets),
              token_buckets=buckets, enable_prefix_caching=True,
              gpu_memory_utilization=args.gpu_memory_utilization,
              compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    engine_s = time.perf_counter() - start
    rng = np.random.default_rng(layers)
    rows = []
    for batch in args.batches:
        trace_dir = (args.trace / f"l{layers}-b{batch}-{'_'.join(map(str, buckets))}"
                     if args.trace else None)
        row = decode(llm, batch, args.context, args.steps, rng, trace_dir)
        roof = decode_roofline(counts, cfg, batch, args.context, ceilings["copy_tbps"])
        ms = 1e3 * batch / row["tokens_per_s"]
        rows.append({"layers": layers, "buckets": list(buckets), "batch": batch, "ms_per_step": ms,
                     "itl_p50_ms": 1e3 * row["itl_p50_s"], "itl_p90_ms": 1e3 * row["itl_p90_s"],
                     "roofline_ms": 1e3 * batch / roof["tokens_per_s"],
                     "datasheet_roofline_ms": 1e3 * batch / roof["tokens_per_s"]
                     * ceilings["copy_tbps"] / DATASHEET_TBPS,
                     "bytes_per_step": roof["bytes_per_step"], "engine_s": engine_s,
                     **{k: row[k] for k in ("host_ms_per_step", "wait_ms_per_step",
                                            "device_busy_ms_per_step", "kernels_per_step",
                                            "top_kernels", "idle", "launch_thread")
                        if k in row}})
        print({k: v for k, v in rows[-1].items()
               if k not in ("top_kernels", "idle", "launch_thread")}, flush=True)
        for e in rows[-1].get("launch_thread", []):
            print(f"  launch thread {e['ms_per_call']:8.3f} ms  x{e['count_per_call']:<6.1f} "
                  f"{e['name']}")
        if "idle" in rows[-1]:
            print({k: v for k, v in rows[-1]["idle"].items() if k != "longest"}, flush=True)
            for gap in rows[-1]["idle"]["longest"]:
                print(f"  gap {gap['us']:7.1f} us after {gap['after']} before {gap['before']}")
        for k in rows[-1].get("top_kernels", []):
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['launches']:<4} {k['name']}", flush=True)
    del llm
    gc.collect()
    return rows


if __name__ == "__main__":
    main()
