"""The batch-invariant dense GEMM on each projection of a DeepSeek-V4-Flash layer, against
XLA's matmul, at the row counts of a decode batch and of a prefill chunk.

    python bench/invariant_linears.py            # H200
    python bench/invariant_linears.py --smoke    # CPU: two small shapes, kernel interpreted

Batch-invariant mode runs every bf16 projection through the invariant GEMM
(`pallas_kernels.grouped_gemm.invariant.matmul`); on the H200 a V4-Flash step in that mode spent
~2.7 ms more in Mosaic GPU kernels than the default mode's cuBLAS calls (bench/h200.sh
bi-profile, 2026-11-30). Per shape and M: XLA's dot, the invariant config the engine picks,
and split-K variants (K in S ranges summed by separate programs, f32 partials added after),
as device time from a profiler trace and the rate at which the weight was read. A split-K
variant is invariant when its rows for M = 64 equal its rows for M = 256 bitwise (checked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import environment, write_results  # noqa: E402
from bench.device_time import device_ms  # noqa: E402
from pallas_kernels.grouped_gemm import invariant  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig  # noqa: E402

# (name, K, N): V4-Flash's bf16 projections (configs/deepseek-v4-flash.json)
SHAPES = [("wq_a", 4096, 1024), ("wq_b", 1024, 32768), ("wkv", 4096, 512),
          ("wo_a (one of 8 groups)", 4096, 1024), ("wo_b", 8192, 4096),
          ("shared w13", 4096, 4096), ("shared w2", 2048, 4096),
          ("indexer wq_b", 1024, 8192), ("indexer weights", 4096, 64)]
SMOKE = [("small", 256, 256), ("narrow", 512, 64)]


def variants(m: int, k: int, n: int, smoke: bool) -> list[tuple[str, TileConfig]]:
    engine = invariant.dense_invariant_config(m, n, k)
    out = [("ours: engine's config", engine)]
    for splits in (2, 4, 8, 16):
        if n % 128 == 0 and k % (splits * 64) == 0 and k // splits >= (64 if smoke else 256):
            out.append((f"ours: split K {splits}", TileConfig(
                block_m=64, block_n=128, max_concurrent_steps=4, split_k=splits)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    impl = "interpret" if args.smoke else None
    rng = np.random.default_rng(0)
    results = []
    for name, k, n in SMOKE if args.smoke else SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        x_all = jnp.asarray(rng.standard_normal((max(args.rows), k)), jnp.bfloat16)
        for m in args.rows:
            x = x_all[:m]
            ref = np.asarray(jax.jit(jnp.dot)(x, w), np.float32)
            cases = [("xla dot", jax.jit(jnp.dot), None)]
            for label, config in variants(m, k, n, args.smoke):
                cases.append((f"{label} ({config.block_m}x{config.block_n}"
                              f"{f', S={config.split_k}' if config.split_k > 1 else ''})",
                              jax.jit(lambda a, b, c=config: invariant.matmul(a, b, impl=impl, config=c)),
                              config))
            for label, fn, config in cases:
                row = {"shape": name, "k": k, "n": n, "rows": m, "impl": label}
                try:
                    out = np.asarray(fn(x, w), np.float32)
                    ms = device_ms(fn, x, w) if not args.smoke else float("nan")
                    row |= {"us": 1e3 * ms, "weights_tbps": k * n * 2 / ms / 1e9,
                            "max_abs_diff_vs_xla": float(np.abs(out - ref).max())}
                    if config is not None and m != min(args.rows):   # rows of the smallest M
                        small = np.asarray(fn(x_all[:min(args.rows)], w), np.float32)
                        row["rows_invariant"] = bool((small == out[:min(args.rows)]).all())
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                print(row, flush=True)
                results.append(row)
    lines = ["| shape (K x N) | M | impl | us | weights TB/s | rows as at M=64 |",
             "|---|---:|---|---:|---:|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} ({r['k']}x{r['n']}) | {r['rows']} | {r['impl']} | "
                         f"failed: {r['error']} | | |")
            continue
        same = {True: "bitwise", False: "DIFFER"}.get(r.get("rows_invariant"), "")
        lines.append(f"| {r['shape']} ({r['k']}x{r['n']}) | {r['rows']} | {r['impl']} | "
                     f"{r['us']:.1f} | {r['weights_tbps']:.2f} | {same} |")
    text = "\n".join(lines) + ("\n\nDevice time per call (profiler). Command: "
                               "`python bench/invariant_linears.py`.")
    print(text)
    if not args.smoke:
        write_results("invariant-linears-gpu", {"environment": environment(),
                                                "results": results}, text)


if __name__ == "__main__":
    main()
