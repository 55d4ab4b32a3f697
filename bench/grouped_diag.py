"""Where the grouped GEMM loses rate against the dense one: the kernels alone (rows already laid
out in tiles) over group-size patterns that isolate one cost each.

    python bench/grouped_diag.py            # H200
    python bench/grouped_diag.py --smoke    # CPU: tiny shapes, kernels interpreted

Patterns (rows per group; V4-Flash expert shapes, gate/up with the SwiGLU epilogue and down):
  one group        all tiles on one expert's weight: the dense GEMM in the grouped kernel
  256-row groups   two full tiles per expert: the cost of switching weights every 2 tiles
  192-row groups   a full tile and a half one per expert (the prefill's ~192 rows each): the
                   cost of the half tiles' idle consumer
  routed           the prefill's own routing (8k tokens x top-6 over 256 experts)
Rates: TFLOP/s on the groups' rows (what kernels_moe.py reports) and on the rows the kernels
compute (64-row halves holding any group row), against XLA's dense matmul in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.ceilings import measure as measure_ceilings  # noqa: E402
from bench.ceilings import timed_ms  # noqa: E402
from bench.common import environment, write_results  # noqa: E402
from bench.device_time import busy_and_span, device_kernels  # noqa: E402
from bench.kernels_moe import LIMIT, SMOKE, Shapes, label, routing  # noqa: E402
from pallas_kernels.common import gpu_interpret  # noqa: E402
from pallas_kernels.grouped_gemm import api, layout  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu_persistent import PersistentConfig  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig  # noqa: E402

# The persistent kernel's programs take work items in a fixed order (item i on program
# i mod 132): with bands of 4 row tiles, 132 programs and groups of a full and a half tile,
# each program always gets the same kind of tile. Odd band widths alternate them.
SNAKES = (4, 1, 3, 5)


def impl_label(config) -> str:
    snake = getattr(config, "snake_width", None)
    return label(config) + (f" snake {snake}" if snake is not None else "")


def patterns(shapes: Shapes) -> dict[str, jax.Array]:
    rows = shapes.prefill_tokens * shapes.top_k
    e = shapes.experts

    def even(per_group: int) -> jax.Array:
        groups = min(e, rows // per_group)
        return jnp.zeros((e,), jnp.int32).at[:groups].set(per_group)

    return {"one group": jnp.zeros((e,), jnp.int32).at[0].set(rows),
            "256-row groups": even(2 * 128),
            "192-row groups": even(128 + 64),
            "routed": routing(shapes.prefill_tokens, shapes, seed=shapes.prefill_tokens)}


def computed_rows(tiles: layout.TileLayout) -> int:
    """Rows in 64-row halves that hold any group row (the kernels skip all-padding halves)."""
    halves = -(-tiles.tile_rows // 64)
    return int(jnp.sum(halves)) * 64


def case(op: str, pattern: str, sizes: jax.Array, shapes: Shapes, config, interpret: bool):
    d, i = shapes.hidden, shapes.inter
    k, n = (d, 2 * i) if op == "gate_up" else (i, d)
    rows = int(jnp.sum(sizes))
    tiles = layout.tile_layout(sizes, rows, config.block_m)
    lhs = jax.random.normal(jax.random.key(0), (tiles.tile_group.shape[0] * config.block_m, k),
                            jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (shapes.experts, k, n), jnp.bfloat16) * k**-0.5
    limit = LIMIT if op == "gate_up" else None
    fn = jax.jit(functools.partial(api._tiled, tiles=tiles, rhs_scale=None, swiglu_limit=limit,
                                   config=config))
    flops_per_row = 2 * k * n
    row = {"op": op, "pattern": pattern, "impl": impl_label(config), "rows": rows,
           "computed_rows": computed_rows(tiles)}
    try:
        with gpu_interpret() if interpret else contextlib.nullcontext():
            row["ms"] = timed_ms(fn, lhs, rhs)
    except Exception as error:  # noqa: BLE001 - a config that cannot compile here
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        return row
    row["tflops"] = flops_per_row * rows / row["ms"] / 1e9
    row["computed_tflops"] = flops_per_row * row["computed_rows"] / row["ms"] / 1e9
    return row


def mlp_kernels(shapes: Shapes, calls: int = 10) -> list[tuple[str, float, int]]:
    """The routed prefill's whole expert MLP (api.expert_mlp, default configs, sorted rows in
    and out, as kernels_moe.py times it), its device time by kernel: what the layout around
    the two GEMMs costs."""
    sizes = patterns(shapes)["routed"]
    rows = int(jnp.sum(sizes))
    x = jax.random.normal(jax.random.key(0), (rows, shapes.hidden), jnp.bfloat16)
    w13 = jax.random.normal(jax.random.key(1), (shapes.experts, shapes.hidden, 2 * shapes.inter),
                            jnp.bfloat16) * shapes.hidden**-0.5
    w2 = jax.random.normal(jax.random.key(2), (shapes.experts, shapes.inter, shapes.hidden),
                           jnp.bfloat16) * shapes.inter**-0.5
    fn = jax.jit(functools.partial(api.expert_mlp, swiglu_limit=LIMIT))
    totals = device_kernels(fn, x, w13, w2, sizes, calls=calls)
    busy, span = busy_and_span(fn, x, w13, w2, sizes, calls=calls)
    timing = {"wall_ms": timed_ms(fn, x, w13, w2, sizes), "busy_ms": busy, "span_ms": span}
    a = jax.random.normal(jax.random.key(3), (8192, 8192), jnp.bfloat16)   # the ceiling's dot
    dot = jax.jit(jnp.dot)
    timing["dot_wall_ms"] = timed_ms(dot, a, a)
    timing["dot_busy_ms"], timing["dot_span_ms"] = busy_and_span(dot, a, a, calls=calls)
    return sorted(((name, ms, n) for name, (ms, n) in totals.items()), key=lambda r: -r[1]), timing


def table(results: list[dict], ceilings: dict) -> str:
    peak = ceilings["matmul_tflops"]
    lines = [f"Ceiling measured in this run: XLA bf16 matmul {peak:.0f} TFLOP/s.", "",
             "| op | pattern | impl | rows | computed rows | ms | TFLOP/s | % matmul | "
             "computed TFLOP/s | % matmul |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['pattern']} | {r['impl']} | {r['rows']} | | "
                         f"failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['op']} | {r['pattern']} | {r['impl']} | {r['rows']} | "
                     f"{r['computed_rows']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                     f"{100 * r['tflops'] / peak:.0f}% | {r['computed_tflops']:.1f} | "
                     f"{100 * r['computed_tflops'] / peak:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernels interpreted")
    args = ap.parse_args()
    shapes = dataclasses.replace(SMOKE, prefill_tokens=384) if args.smoke else Shapes()
    ceilings = measure_ceilings(small=args.smoke)
    print(ceilings, flush=True)
    small = 64 if args.smoke else None
    configs = {   # the defaults at 8k tokens (api.default_config), then the persistent kernel's
        "gate_up": [api.default_config(49152, shapes.inter, swiglu=True),
                    WarpSpecializedConfig(block_n=small or 128, block_k=128, max_concurrent_steps=2),
                    *[PersistentConfig(block_n=small or 128, snake_width=w) for w in SNAKES]],
        "down": [api.default_config(49152, shapes.hidden),
                 *[PersistentConfig(block_n=small or 256, snake_width=w) for w in SNAKES]]}
    cases = patterns(shapes)
    if args.smoke:     # (interpreted kernels take minutes: one pattern, one config each)
        configs = {"gate_up": [PersistentConfig(block_n=64)],
                   "down": [WarpSpecializedConfig(block_n=64, block_k=64, max_concurrent_steps=2)]}
        cases = {"192-row groups": cases["192-row groups"]}
    results = []
    for pattern, sizes in cases.items():
        for op, op_configs in configs.items():
            for config in op_configs:
                results.append(case(op, pattern, sizes, shapes, config, args.smoke))
                print(results[-1], flush=True)
    text = table(results, ceilings)
    if not args.smoke:
        kernels, timing = mlp_kernels(shapes)
        text += (f"\n\nThe routed expert MLP (`api.expert_mlp`, sorted rows in and out), device "
                 f"time by kernel: {sum(ms for _, ms, _ in kernels):.3f} ms in all. Per call of "
                 f"back-to-back calls: {timing['wall_ms']:.3f} ms timed on the host, the GPU busy "
                 f"{timing['busy_ms']:.3f} ms of a {timing['span_ms']:.3f} ms span (profiled); "
                 f"the ceiling's 8192^3 dot the same way: {timing['dot_wall_ms']:.3f} ms timed, "
                 f"busy {timing['dot_busy_ms']:.3f} of {timing['dot_span_ms']:.3f} ms\n\n"
                 "| kernel | ms | launches |\n|---|---:|---:|\n"
                 + "\n".join(f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in kernels[:12]))
    print(text)
    name = "grouped-diag-cpu-smoke" if args.smoke else "grouped-diag-gpu"
    write_results(name, {"environment": environment(), "ceilings": ceilings,
                         "results": results},
                  text + f"\n\nShapes: {shapes}. Kernels alone on rows already in tiles. "
                  f"Command: `python bench/grouped_diag.py{' --smoke' if args.smoke else ''}`.")


if __name__ == "__main__":
    main()
