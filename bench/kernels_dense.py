"""The batch-invariant dense GEMM's case of bench/kernels_moe.py (its --dense-only runs only
this): the engine's kernels at M = 4096 / 8192 against XLA's dot and jax's own Hopper matmul
example, each row's bits checked against what the engine computes at small M."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import rel_err, timed_ms
from pallas_kernels.grouped_gemm import api, invariant, mosaic_gpu_persistent


def dense_case(m: int, shapes, impl: str) -> list[dict]:
    """The batch-invariant dense GEMM against XLA's dot: the engine's default (at M >= 4096
    the persistent kernel chaining the weight's K ranges), the per-tile kernels with K whole,
    the persistent kernel with K whole (the issue's form) and in other tiles. For each of
    ours, which row prefixes (M = 1, 3, 64, 1000) give bitwise the rows of the whole batch
    when computed as the engine computes them at that M."""
    k = n = shapes.hidden
    x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (k, n), jnp.bfloat16) * k**-0.5
    whole_k = api.default_config(invariant.LARGE_BATCH, n)      # the config before split K
    splits = invariant.invariant_split_k(k, n)

    def ours(config=None):
        return jax.jit(functools.partial(invariant.matmul, impl=impl, config=config))

    def persistent(splits, **kw):
        def run(x, w):
            with api.kernel_mode(impl):
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
            row["ms"] = timed_ms(fn, x, w)
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
