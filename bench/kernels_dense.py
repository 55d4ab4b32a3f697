"""The batch-invariant dense GEMM (`pallas_kernels.grouped_gemm.invariant.matmul`) against
XLA's dot and jax's own Hopper matmul example, on a V4-Flash 4096 x 4096 weight at
M = 4096 / 8192, each of our rows' bits checked against what the engine computes at small M.

    python bench/kernels_dense.py                    # H200
    python bench/kernels_dense.py --smoke            # CPU: tiny shapes, kernel interpreted

Batch-invariant mode runs every bf16 projection on this kernel, so its rate at prefill-sized
M is what the mode costs there. Ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from bench.lib.timing import rel_err, spread, timing  # noqa: E402
from pallas_kernels.common import kernel_mode  # noqa: E402
from pallas_kernels.grouped_gemm import api, invariant, mosaic_gpu_persistent  # noqa: E402


def dense_case(m: int, hidden: int, impl: str) -> list[dict]:
    """The batch-invariant dense GEMM against XLA's dot: the engine's default (at M >= 4096
    the persistent kernel chaining the weight's K ranges), the per-tile kernels with K whole,
    the persistent kernel with K whole (the issue's form) and in other tiles. For each of
    ours, which row prefixes (M = 1, 3, 64, 1000) give bitwise the rows of the whole batch
    when computed as the engine computes them at that M."""
    k = n = hidden
    x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (k, n), jnp.bfloat16) * k**-0.5
    whole_k = api.default_config(invariant.LARGE_BATCH, n)      # the config before split K
    splits = invariant.invariant_split_k(k, n)

    def ours(config=None):
        return jax.jit(functools.partial(invariant.matmul, implementation=impl, config=config))

    def persistent(splits, **kw):
        def run(x, w):
            with kernel_mode(impl == "interpret"):
                return mosaic_gpu_persistent.chained_matmul(
                    x, w, splits=splits, config=mosaic_gpu_persistent.PersistentConfig(**kw))
        return jax.jit(run)

    engine = ours()                       # whatever config the engine takes at each M
    variants = [("xla dot", jax.jit(jnp.dot), None),
                (f"ours invariant (engine: {type(invariant.dense_invariant_config(m, n, k)).__name__}, "
                 f"K in {splits} ranges)", engine, engine),
                ("ours invariant per-tile, K whole", ours(whole_k), ours(whole_k)),
                ("ours persistent 128x256x64/4, K whole", persistent(1), ours(whole_k)),
                ("ours persistent 128x128x64/4, K whole", persistent(1, block_n=128), ours(whole_k)),
                ("ours persistent 128x256x64/4, K whole, snake 8", persistent(1, snake_width=8),
                 ours(whole_k))]
    if splits > 1:
        split_tiles = api.TileConfig(block_m=64, block_n=128, split_k=splits)
        variants += [(f"ours persistent 128x256x64/3 store 32, K in {splits} ranges, a call each",
                      persistent(splits, max_concurrent_steps=3, store_n=32), ours(split_tiles))]
        if splits == 2:
            variants += [(f"ours persistent 128x128x64/{steps}, both K ranges in one call",
                          persistent(2, block_n=128, ranges=2, max_concurrent_steps=steps),
                          ours(split_tiles)) for steps in (4, 6)]
        variants += [(f"ours per-tile 128x128 split K {splits} (partials summed after)",
                      ours(api.TileConfig(block_m=128, block_n=128, max_concurrent_steps=6,
                                          split_k=splits, group_tiles=8)), ours(split_tiles))]
    variants += [(name, fn, None) for name, fn in stock_hopper_matmuls(m, n)]
    rows, reference = [], None
    for name, fn, small in variants:
        row = {"case": f"dense M={m}", "op": "matmul", "impl": name, "rows": m}
        try:
            row |= timing(fn, x, w).row()
            full = np.asarray(fn(x, w), np.float32)
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(row | {"error": f"{type(error).__name__}: "
                                        f"{str(error).splitlines()[0][:120]}"})
            continue
        row["tflops"] = 2 * m * k * n / row["ms"] / 1e9
        if reference is None:
            reference = full
        else:
            row["rel_err_vs_peer"] = rel_err(full, reference)
        if small is not None:
            row["rows_bitwise_equal_for_m"] = [
                sub for sub in (1, 3, 64, min(1000, m)) if sub <= m
                and np.array_equal(np.asarray(small(x[:sub], w), np.float32), full[:sub])]
        rows.append(row)
    return rows


def stock_hopper_matmuls(m: int, n: int) -> list[tuple[str, object]]:
    """jax's own Mosaic GPU Hopper matmul (jax.experimental.pallas.ops.gpu, an example op
    beside the Pallas sources: persistent programs, warp-specialised, a snake over tiles), its
    two best configs of the first run (kernels-dense-gpu.md): what Pallas reaches on these
    shapes, a bound for ours. Only called, never copied. Empty off the GPU."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper
    except ImportError as error:
        print(f"jax's hopper_matmul_mgpu unavailable: {error}", file=sys.stderr)
        return []
    if jax.default_backend() != "gpu":
        return []
    dim = hopper.MatmulDimension
    configs = {   # per compute warpgroup tile_m x tile_n; the CTA doubles it along wg_dimension
        "wg 64x256, CTA 128x256, snake 4": dict(tile_m=64, tile_n=256, wg_dimension=dim.M,
                                                grid_tile_width=4),
        "wg 128x128, CTA 128x256, cluster M, snake 8": dict(
            tile_m=128, tile_n=128, wg_dimension=dim.N, cluster_dimension=dim.M,
            grid_tile_width=8),
    }
    return [(f"jax example hopper_matmul {label}",
             jax.jit(functools.partial(hopper.matmul, c=None, config=hopper.TuningConfig(
                 tile_k=64, max_concurrent_steps=4, grid_minor_dim=dim.M, **kw))))
            for label, kw in configs.items()]


def table(rows: list[dict], ceilings: dict) -> str:
    lines = [f"Ceilings measured in this run: XLA bf16 matmul {ceilings['matmul_tflops']:.0f} "
             f"TFLOP/s; copy {ceilings['copy_tbps']:.2f} TB/s ({ceilings['copy_source']}).", "",
             "| case | impl | rows bitwise equal for M | ms | min-max (repeats) | TFLOP/s | "
             "% matmul | rel err |", "|---|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | | failed: {r['error']} | | | | |")
            continue
        equal = ", ".join(map(str, r.get("rows_bitwise_equal_for_m", [])))
        lines.append(f"| {r['case']} | {r['impl']} | {equal} | {r['ms']:.3f} | {spread(r)} | "
                     f"{r['tflops']:.1f} | {100 * r['tflops'] / ceilings['matmul_tflops']:.0f}% | "
                     f"{r.get('rel_err_vs_peer', float('nan')):.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernel interpreted on CPU")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="M (default 4096 8192)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    hidden, impl = (128, "interpret") if args.smoke else (4096, "mosaic_gpu")
    ceilings = measure_ceilings(small=args.smoke)
    rows = []
    for m in args.rows or ([64] if args.smoke else [4096, 8192]):
        rows += dense_case(m, hidden, impl)
    text = table(rows, ceilings)
    print(text)
    note = (f"\n\nWeight {hidden} x {hidden} bf16 (V4-Flash's shared expert and output "
            "projection width); ms: the median of 5 repeats of 10 back-to-back calls. `rows "
            "bitwise equal for M`: the row prefixes whose rows, computed as the engine computes "
            "them at that M, equal the whole batch's bitwise.")
    name = args.name or ("kernels-dense-cpu-smoke" if args.smoke else "kernels-dense-gpu")
    write_results(name, {"ceilings": ceilings, "results": rows}, text + note)


if __name__ == "__main__":
    main()
