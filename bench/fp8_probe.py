"""What bounds the FP8 projections' kernel at decode sizes (results: kernels-fp8-probe-gpu.md;
the story: docs/performance-log.md).

    python bench/fp8_probe.py              # H200: V4-Flash's projections at M = 16
    python bench/fp8_probe.py --smoke      # CPU: tiny shapes, interpreted

Rows per projection, each LAYERS distinct weights in one jitted call (kernels_fp8.py's
timing): the engine's config; the same with the scale grid in shared memory
(`TileConfig.scales_in_smem`); that with 128-input K steps (one scale block a step). Then two
ablations of the engine's config whose results are wrong on purpose (not checked): the
step's scale never read (`stage_fp8` ignores it, so its load is dead code), and no
dequantization at all (the wgmma reads the staging slot as it is): what is left is the
pipeline and the wgmmas.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import kernels_fp8  # noqa: E402
from bench.kernels_fp8 import (  # noqa: E402
    LAYERS,
    V4_FLASH,
    Projection,
    bytes_read,
    run_layers,
    timed_row,
    weights,
)
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from bench.lib.timing import rel_err  # noqa: E402
from pallas_kernels.grouped_gemm import api, mosaic_gpu, reference  # noqa: E402


def _unscaled(w_smem, scale, staging):
    del scale
    staging[...] = w_smem[...].astype(jnp.float32).astype(staging.dtype)
    plgpu.commit_smem()


def _untouched(w_smem, scale, staging):
    del w_smem, scale, staging
    plgpu.commit_smem()


SMOKE = (Projection("a", 256, 512),)    # N = 512: the smallest scale row TMA copies
ABLATIONS = {"no scale read (wrong)": _unscaled, "no dequantization (wrong)": _untouched}


@contextlib.contextmanager
def staged_by(fn):
    """The kernel traced with `fn` as its FP8 staging (jit caches cleared on both sides)."""
    real = mosaic_gpu.stage_fp8
    mosaic_gpu.stage_fp8 = fn
    jax.clear_caches()
    try:
        yield
    finally:
        mosaic_gpu.stage_fp8 = real
        jax.clear_caches()


def variants(p, rows: int) -> list[tuple[str, object, object]]:
    """(label, config, staging function or None)."""
    base = api.batched_config(p.groups, rows, p.k, p.n, fp8=True)
    out = [(f"engine (k{base.block_k}x{base.max_concurrent_steps} split{base.split_k})", base,
            None)]
    if mosaic_gpu.scale_grid_fits(p.k, p.n):
        out.append(("smem scales", dataclasses.replace(base, scales_in_smem=True), None))
        wide = dataclasses.replace(base, block_k=128, split_k=1, scales_in_smem=True)
        tiles = p.groups * -(-rows // wide.block_m)
        wide = api.split_for_small_batches(wide, tiles, p.k, p.n)
        out.append((f"smem scales k128 split{wide.split_k}", wide, None))
    out += [(label, base, fn) for label, fn in ABLATIONS.items()]
    return out


def case(p, rows: int, impl: str, copy_tbps: float) -> list[dict]:
    codes, scale = weights(p, LAYERS, seed=rows)
    x = jax.random.normal(jax.random.key(1), (p.groups, rows, p.k), jnp.bfloat16)
    want = np.stack([np.einsum("gmk,gkn->gmn", np.asarray(x, np.float32), np.asarray(
        reference.dequantize(codes[i], scale[i], jnp.float32))) for i in range(LAYERS)])
    out = []
    for label, config, staging in variants(p, rows):
        with staged_by(staging) if staging else contextlib.nullcontext():
            fn = run_layers(config, impl)
            got = np.asarray(fn(x, codes, scale), np.float32)
            err = rel_err(got, want)
            if staging is None and err > 2e-2:
                raise AssertionError(f"{p.name} M={rows} {label}: relative error {err:.3g}")
            out.append(timed_row(p, rows, label, fn, (x, codes, scale), bytes_read(p, rows),
                                 None if staging else err, copy_tbps))
    return out


def table(rows: list[dict], ceilings: dict) -> str:
    return kernels_fp8.table(rows, ceilings).replace(
        "(spread: the whole call).", "(spread: the whole call). Rows marked (wrong) are "
        "ablations: their results are not the product.", 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernel interpreted on CPU")
    ap.add_argument("--rows", type=int, nargs="+", default=[16])
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    impl = "interpret" if args.smoke else "mosaic_gpu"
    ceilings = measure_ceilings(small=args.smoke)
    name = args.name or ("kernels-fp8-probe-smoke" if args.smoke else "kernels-fp8-probe-gpu")
    results = []
    for rows in args.rows:
        for p in SMOKE if args.smoke else V4_FLASH:
            results.extend(case(p, rows, impl, ceilings["copy_tbps"]))
            path = write_results(name, {"ceilings": ceilings, "layers": LAYERS,
                                        "results": results}, table(results, ceilings))
    print(path)


if __name__ == "__main__":
    main()
