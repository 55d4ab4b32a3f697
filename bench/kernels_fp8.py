"""V4-Flash's FP8 dense projections at decode sizes: the GEMM kernel on equal groups
(`api.batched_matmul`; `model/invariant.py fp8_linear` and `grouped_linear`, the engine's path
for every FP8 projection outside batch-invariant mode) against the copy bandwidth on the bytes it must read.

    python bench/kernels_fp8.py                  # H200
    python bench/kernels_fp8.py --smoke          # CPU: tiny shapes, kernel interpreted

Each projection is timed as a step meets it: LAYERS distinct weights (as many layers, more
bytes than the L2 cache holds) in one jitted call, so a launch's host cost is not the figure.
At --sweep-rows the tile shape, pipeline depth and K split are swept, the engine's choice
(api.batched_config) marked. Every result is checked against the dequantized
weight's float32 product.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.ceilings import DATASHEET_TBPS  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from bench.lib.timing import rel_err, spread, timing  # noqa: E402
from pallas_kernels.grouped_gemm import api, reference  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig  # noqa: E402

LAYERS = 8


@dataclasses.dataclass(frozen=True)
class Projection:
    name: str
    k: int
    n: int
    groups: int = 1      # wo_a: 8 groups, each token's rows in every group


# A V4-Flash layer's FP8 projections (configs/deepseek-v4-flash.json); the indexer's only in
# its CSA layers.
V4_FLASH = (Projection("wq_a", 4096, 1024), Projection("wq_b", 1024, 32768),
            Projection("wkv", 4096, 512), Projection("wo_a", 4096, 1024, groups=8),
            Projection("wo_b", 8192, 4096), Projection("shared gate|up", 4096, 4096),
            Projection("shared down", 2048, 4096), Projection("indexer wq_b", 1024, 8192))
SMOKE = (Projection("a", 512, 128), Projection("b", 256, 256, groups=2))


def weights(p: Projection, layers: int, seed: int):
    """E4M3 codes [L, G, K, N] (normals, so no NaN codes) and scales [L, G, K/128, N/128]."""
    kc, ks = jax.random.split(jax.random.key(seed))
    codes = jax.random.normal(kc, (layers, p.groups, p.k, p.n), jnp.float32) * 64
    codes = codes.astype(ml_dtypes.float8_e4m3fn)
    scale = jax.random.uniform(ks, (layers, p.groups, p.k // 128, p.n // 128), jnp.float32,
                               1e-3, 4e-3)
    return codes, scale


def run_layers(config, impl: str):
    """x [G, M, K], codes, scales -> every layer's result [L, G, M, N]."""
    def call(x, codes, scale):
        return jnp.stack([api.batched_matmul(x, codes[i], rhs_scale=scale[i],
                                             implementation=impl, config=config)
                          for i in range(codes.shape[0])])
    return jax.jit(call)


def bytes_read(p: Projection, rows: int) -> int:
    """What one projection must read and write: its codes and scales, the rows in, out."""
    return (p.groups * p.k * p.n + 4 * p.groups * (p.k // 128) * (p.n // 128)
            + 2 * p.groups * rows * (p.k + p.n))


def variants(p: Projection, rows: int, sweep: bool) -> list[tuple[str, TileConfig | None]]:
    """The engine's config, and with `sweep` the K splits of 128- and 64-column tiles with
    64-row K steps, and of 128-column tiles with 128-row K steps (one scale block a step, half
    the steps) at 3 and 4 steps in flight."""
    chosen = [("engine", None)]
    if not sweep:
        return chosen
    for block_n, block_k, steps in ((128, 64, 4), (64, 64, 4), (128, 128, 3), (128, 128, 4)):
        splits = 1
        while p.k % (splits * block_k) == 0 and p.k // splits >= 2 * block_k \
                and p.n % block_n == 0:
            chosen.append((f"n{block_n} k{block_k}x{steps} split{splits}",
                           TileConfig(block_n=block_n, block_k=block_k,
                                      max_concurrent_steps=steps, split_k=splits)))
            splits *= 2
    return chosen


def engine_config(p: Projection, rows: int) -> str:
    config = api.batched_config(p.groups, rows, p.k, p.n, fp8=True)
    return f"n{config.block_n} k{config.block_k}x{config.max_concurrent_steps} split{config.split_k}"


def run_xla(dequantized: bool):
    """The same layers through XLA: the FP8 weights dequantized inside the jitted call (the
    engine's fallback, api.batched_matmul's "reference": whether XLA fuses the decode into its
    GEMM decides what it reads), or with `dequantized`, bf16 weights made beforehand (the bf16
    model's projection, twice the bytes)."""
    def call(x, codes, scale):
        return jnp.stack([api.batched_matmul(x, codes[i], rhs_scale=None if dequantized
                                             else scale[i], implementation="reference")
                          for i in range(codes.shape[0])])
    return jax.jit(call)


def case(p: Projection, rows: int, impl: str, sweep: bool, copy_tbps: float,
         xla: bool = False) -> list[dict]:
    codes, scale = weights(p, LAYERS, seed=rows)
    x = jax.random.normal(jax.random.key(1), (p.groups, rows, p.k), jnp.bfloat16)
    want = np.stack([np.einsum("gmk,gkn->gmn", np.asarray(x, np.float32), np.asarray(
        reference.dequantize(codes[i], scale[i], jnp.float32))) for i in range(LAYERS)])
    # (label, the jitted call, its weights' argument and scales, the bytes it must read)
    runs = [(label if config else f"engine ({engine_config(p, rows)})", run_layers(config, impl),
             codes, scale, bytes_read(p, rows)) for label, config in variants(p, rows, sweep)]
    if xla:
        bf16 = jnp.stack([reference.dequantize(codes[i], scale[i], jnp.bfloat16)
                          for i in range(LAYERS)])
        runs += [("xla: dequantize + dot", run_xla(False), codes, scale, bytes_read(p, rows)),
                 ("xla: bf16 weights (2 B each)", run_xla(True), bf16, scale,
                  bytes_read(p, rows) + p.groups * p.k * p.n)]
    out = []
    for label, fn, w, s, nbytes in runs:
        got = np.asarray(fn(x, w, s), np.float32)
        err = rel_err(got, want)
        if err > 2e-2:
            raise AssertionError(f"{p.name} M={rows} {label}: relative error {err:.3g}")
        out.append(timed_row(p, rows, label, fn, (x, w, s), nbytes, err, copy_tbps))
    return out


def timed_row(p: Projection, rows: int, label: str, fn, args: tuple, nbytes: int,
              err: float | None, copy_tbps: float) -> dict:
    """fn(*args) timed (5 repeats), as a result row (printed as it comes): per layer, and
    its rate on `nbytes` against the copy ceiling and the datasheet."""
    t = timing(fn, *args, calls=5)
    ms = t.ms / LAYERS
    tbps = nbytes / ms / 1e9
    row = {"projection": p.name, "k": p.k, "n": p.n, "groups": p.groups, "rows": rows,
           "config": label, **t.row(), "ms_per_layer": ms, "rel_err": err, "tbps": tbps,
           "pct_copy": 100 * tbps / copy_tbps, "pct_datasheet": 100 * tbps / DATASHEET_TBPS}
    print(f"{p.name:15s} M={rows:<4d} {label:30s} {1e3 * ms:8.1f} us "
          f"{tbps:6.2f} TB/s  {row['pct_copy']:5.1f}% of copy", flush=True)
    return row


def table(rows: list[dict], ceilings: dict) -> str:
    lines = [f"Copy ceiling (this run, {ceilings['copy_source']}): {ceilings['copy_tbps']:.2f} TB/s; "
             f"datasheet {DATASHEET_TBPS} TB/s. Bytes: the FP8 codes, their scales, the bf16 rows "
             f"in and out. Each row: {LAYERS} layers' distinct weights in one jitted call, "
             f"median per layer over the repeats (spread: the whole call).", "",
             "| projection | K x N (groups) | M | config | us | spread ms (repeats) | TB/s | "
             "% of copy | % of datasheet |", "|---|---|---:|---|---:|---|---:|---:|---:|"]
    lines[0] += (" The xla rows count the same bytes; its bf16-weights row counts 2 bytes a "
                 "weight." if any(r["config"].startswith("xla") for r in rows) else "")
    for r in rows:
        lines.append(f"| {r['projection']} | {r['k']} x {r['n']} ({r['groups']}) | {r['rows']} | "
                     f"{r['config']} | {1e3 * r['ms_per_layer']:.1f} | {spread(r)} | "
                     f"{r['tbps']:.2f} | {r['pct_copy']:.0f}% | {r['pct_datasheet']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernel interpreted on CPU")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--sweep-rows", type=int, default=16, help="M at which configs are swept")
    ap.add_argument("--xla", action="store_true",
                    help="also XLA's dot on the weights dequantized in the call, and on bf16 "
                         "weights (the bf16 model's projection)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    impl = "interpret" if args.smoke else "mosaic_gpu"
    ceilings = measure_ceilings(small=args.smoke)
    results = []
    name = args.name or ("kernels-fp8-smoke" if args.smoke else "kernels-fp8-gpu")
    for rows in args.rows:      # written after each M: a run cut short keeps what it measured
        for p in SMOKE if args.smoke else V4_FLASH:
            results.extend(case(p, rows, impl, rows == args.sweep_rows, ceilings["copy_tbps"],
                                args.xla))
        path = write_results(name, {"ceilings": ceilings, "layers": LAYERS, "results": results},
                             table(results, ceilings))
    print(path)


if __name__ == "__main__":
    main()
