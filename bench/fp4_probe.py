"""Studies of the FP4 grouped GEMM at V4-Flash decode sizes: what bounds it below the copy
bandwidth (results: kernels-fp4-probe*-gpu.md; the story: docs/performance-log.md).

    python bench/fp4_probe.py --study options        # k_chains, scales_in_pipeline; ptxas report
    python bench/fp4_probe.py --study tile-major     # codes laid out one step's bytes contiguous
    python bench/fp4_probe.py --study wgmma-twice    # every wgmma issued twice (same traffic)
    python bench/fp4_probe.py --study swizzle        # the codes' shared-memory tile swizzled
    python bench/fp4_probe.py --study occupancy      # smaller steps: more programs an SM
    python bench/fp4_probe.py --study no-code-loads  # codes never read from shared memory
    python bench/fp4_probe.py --study step-wgmma     # one wgmma call a half and pipeline step
    python bench/fp4_probe.py --study words          # codes as 32-bit words: 8- or 16-byte loads
    python bench/fp4_probe.py --study engine-tiles   # one stored tiling for decode and 8k prefill
    python bench/fp4_probe.py --study persistent     # programs over the used tiles only

Each row: the median of 5 repeats of 10 calls (min-max beside it); `tbps` the hit experts'
stored bytes (codes + scales) / time. Rows are printed and written as they come (to
$BENCH_RESULTS_DIR under bench/gpu_suite.py, else $OUT, else /tmp).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kernels_moe import LIMIT, Shapes, fp4_blocks, row_problem  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.timing import timing  # noqa: E402
from pallas_kernels.grouped_gemm import api, fp4_path  # noqa: E402
from pallas_kernels.grouped_gemm import mosaic_gpu_fp4 as fp4_kernel  # noqa: E402
from pallas_kernels.grouped_gemm.fp4_dequant import word_major  # noqa: E402

rep = dataclasses.replace
OPTIONS = {"default": {}, "chains2": {"k_chains": 2}, "chains4": {"k_chains": 4},
           "pipelined": {"scales_in_pipeline": 1},
           "chains4 pipelined": {"k_chains": 4, "scales_in_pipeline": 1}}


def candidates(study: str, base: fp4_kernel.Fp4Config, op: str) -> dict:
    if study == "options":
        out = {name: rep(base, **fields) for name, fields in OPTIONS.items()}
        wide = {"block_n": 128} if op == "gate_up" else {"block_n": 64}
        out[f"n{wide['block_n']} chains4 pipelined"] = rep(base, **wide, k_chains=4,
                                                            scales_in_pipeline=True)
        return out
    if study == "tile-major":
        tiled = rep(base, tile_major=True)
        wide = {"block_n": 128 if op == "gate_up" else 64}
        return {"default": base, "tile_major": tiled,
                "tile_major k256": rep(tiled, block_k=256, max_concurrent_steps=3),
                "tile_major chains4": rep(tiled, k_chains=4),
                f"tile_major n{wide['block_n']}": rep(tiled, **wide)}
    if study == "swizzle":
        sw = rep(base, codes_swizzle=base.block_k // 2)
        other_n = {"block_n": 128 if base.block_n == 64 else 64}
        return {"default": base, "swizzle": sw, "swizzle tile_major": rep(sw, tile_major=True),
                f"swizzle n{other_n['block_n']}": rep(sw, **other_n),
                "swizzle k256": rep(sw, block_k=256, codes_swizzle=128),
                "swizzle k256 (3 deep)": rep(sw, block_k=256, codes_swizzle=128,
                                             max_concurrent_steps=3),
                "swizzle chains2": rep(sw, k_chains=2)}
    if study == "step-wgmma":
        st = rep(base, wgmma_per_step=True)
        tm = rep(st, tile_major=True)
        other_n = {"block_n": 128 if base.block_n == 64 else 64}
        return {"default": base, "tile_major": rep(base, tile_major=True), "step": st,
                "step tile_major": tm, "step tile_major 2 deep": rep(tm, max_concurrent_steps=2),
                f"step tile_major n{other_n['block_n']}": rep(tm, **other_n),
                "step tile_major k256": rep(tm, block_k=256),
                "step tile_major k64": rep(tm, block_k=64)}
    if study == "words":
        other_n = {"block_n": 128 if base.block_n == 64 else 64}
        out = {"default": base,
               "step tile_major": rep(base, wgmma_per_step=True, tile_major=True)}
        for v in (2, 4):
            words = rep(base, word_codes=v)
            out |= {f"words{v}": words, f"words{v} step": rep(words, wgmma_per_step=True),
                    f"words{v} tile_major": rep(words, tile_major=True),
                    f"words{v} step tile_major": rep(words, wgmma_per_step=True, tile_major=True),
                    f"words{v} n{other_n['block_n']}": rep(words, **other_n),
                    f"words{v} k256": rep(words, block_k=256)}
        return out
    if study == "engine-tiles":
        # one tile-major, word-major layout per weight stack that decode (16-token tiles) and
        # prefill (64-token tiles) both read: the stack's (block_n, block_k) fixed at load
        best = rep(base, tile_major=True, word_codes=4, wgmma_per_step=True, block_k=128,
                   scales_in_pipeline=True)
        n = 64 if op == "gate_up" else 128
        other = 128 if op == "gate_up" else 64
        return {"default": base, f"tiles n{n} k128": rep(best, block_n=n),
                f"tiles n{other} k128": rep(best, block_n=other),
                f"tiles n{n} k128 3 deep": rep(best, block_n=n, max_concurrent_steps=3),
                f"tiles n{n} k256": rep(best, block_n=n, block_k=256)}
    if study == "persistent":
        # the engine's stored tiles (fp4_path.tiled_config), one program a pair vs persistent
        n = fp4_path.STORED_TILES[op][0]
        tiles = rep(base, tile_major=True, word_codes=4, wgmma_per_step=True, block_k=128,
                    scales_in_pipeline=True, block_n=n)
        return {"stored tiles": tiles} | {f"persistent {p}/SM": rep(tiles, programs_per_sm=p)
                                          for p in (1, 2, 4, 8)}
    if study == "no-code-loads":
        tm = rep(base, tile_major=True)
        return {"default": base, "tile_major": tm,
                "tile_major 2 deep": rep(tm, max_concurrent_steps=2)}
    if study == "occupancy":
        tm = rep(base, tile_major=True)
        return {"default": base, "tile_major": tm,
                "tile_major 3 deep": rep(tm, max_concurrent_steps=3),
                "tile_major 2 deep": rep(tm, max_concurrent_steps=2),
                "tile_major k64": rep(tm, block_k=64),
                "tile_major k64 6 deep": rep(tm, block_k=64, max_concurrent_steps=6),
                "tile_major k64 3 deep": rep(tm, block_k=64, max_concurrent_steps=3),
                "tile_major k64 n128": rep(tm, block_k=64, block_n=128),
                "tile_major k256 2 deep": rep(tm, block_k=256, max_concurrent_steps=2)}
    return {"default": base, "chains4": rep(base, k_chains=4)}


class NoCodeLoads:
    """plgpu whose loads of packed codes (uint8 tiles) give constant registers instead: the
    same TMA traffic, scales and wgmmas without the shared-memory reads of codes. With constant
    inputs the compiler may hoist the dequantization's integer steps out of the loop too, so
    this times the kernel without its codes' register path (wrong values by design)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, ref, *args, layout=None, **kwargs):
        if ref.dtype == jnp.uint8 and len(ref.shape) == 2 and ref.shape[1] >= 16 and not args:
            return self._real.layout_cast(jnp.full(ref.shape, 0x35, jnp.uint8), layout)
        return self._real.load(ref, *args, layout=layout, **kwargs)


class WgmmaTwice:
    """plgpu with every wgmma issued twice: the same loads, dequantization and waits."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def wgmma(self, acc, a, b):
        self._real.wgmma(acc, a, b)
        self._real.wgmma(acc, a, b)


def ptxas_report(out_dir: Path) -> None:
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1")
    with open(out_dir / "ptxas.txt", "w") as f:
        subprocess.run([sys.executable, __file__, "--compile-one"], env=env, stdout=f,
                       stderr=subprocess.STDOUT, check=False)


def compile_one() -> None:
    shapes = Shapes()
    w13 = fp4_blocks(jax.random.key(1), shapes.experts, 2 * shapes.inter, shapes.hidden,
                     shapes.hidden)
    sizes, x, _ = row_problem(16, shapes, 16)
    cfg = fp4_path.default_config(x.shape[0], False, "gate_up")
    jax.block_until_ready(jax.jit(lambda a, w, s: api.grouped_matmul(
        a, w, s, swiglu_limit=LIMIT, implementation="mosaic_gpu", config=cfg))(x, w13, sizes))


def problems(study: str) -> tuple[tuple[int, int], ...]:
    """(tokens, the decode bucket their rows are padded to) of each problem a study times."""
    if study == "persistent":
        return ((1, 16), (4, 16), (16, 16), (64, 64))
    prefill = ((Shapes().prefill_tokens,) * 2,) if study == "engine-tiles" else ()
    return ((16, 16), (64, 64)) + prefill


def main() -> None:
    if sys.argv[1:] == ["--compile-one"]:
        return compile_one()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", choices=("options", "tile-major", "wgmma-twice", "swizzle", "occupancy",
                                        "no-code-loads", "step-wgmma", "words", "engine-tiles",
                                        "persistent"),
                    default="options")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("BENCH_RESULTS_DIR") or os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"fp4_probe_{args.study}.json"
    if args.study == "options":
        ptxas_report(out_dir)
    ceilings = measure_ceilings()
    print(json.dumps({"ceilings": ceilings}), flush=True)
    shapes = Shapes()
    w13 = fp4_blocks(jax.random.key(1), shapes.experts, 2 * shapes.inter, shapes.hidden,
                     shapes.hidden)
    w2 = fp4_blocks(jax.random.key(2), shapes.experts, shapes.hidden, shapes.inter, shapes.inter)
    real = fp4_kernel.plgpu
    results = []
    variants = {"wgmma-twice": ("once", "twice"), "no-code-loads": ("once", "no code loads")}
    for variant in variants.get(args.study, ("once",)):
        fp4_kernel.plgpu = {"twice": WgmmaTwice, "no code loads": NoCodeLoads}.get(
            variant, lambda real: real)(real)
        jax.clear_caches()
        for tokens, bucket in problems(args.study):
            sizes, x, h = row_problem(tokens, shapes, tokens)
            # the bucket's padding rows, in no group (as the engine's step pads them)
            pad = ((0, (bucket - tokens) * shapes.top_k), (0, 0))
            x, h = jnp.pad(x, pad), jnp.pad(h, pad)
            hit = int((sizes > 0).sum())
            for op, w, a, n_out, swiglu in (("gate_up", w13, x, shapes.inter, LIMIT),
                                            ("down", w2, h, shapes.hidden, None)):
                k = a.shape[1]
                nbytes = hit * (n_out * (2 if swiglu else 1)) * (k // 2 + k // 32)
                base = fp4_path.default_config(a.shape[0], False, op, n_out)
                x_t, tiles = fp4_path.kernel_input(a, sizes, base.block_m)
                used = (tiles.tile_group >= 0).repeat(base.block_m)[None, :]
                reference = None
                for name, cfg in candidates(args.study, base, op).items():
                    row = {"study": args.study, "wgmma": variant, "tokens": tokens,
                           "bucket": bucket, "op": op,
                           "config": name, "hit": hit}
                    try:
                        packed = (word_major(w.packed, cfg.word_codes) if cfg.word_codes
                                  else w.packed)
                        if cfg.tile_major:
                            packed = fp4_kernel.tile_major(packed, cfg.block_n, cfg.block_k)
                        fn = jax.jit(lambda xt, p, s, tg, cfg=cfg, swiglu=swiglu:
                                     fp4_kernel.tiled_fp4_matmul_t(xt, p, s, tg,
                                                                   swiglu_limit=swiglu,
                                                                   config=cfg))
                        got = fn(x_t, packed, w.scale, tiles.tile_group).astype(jnp.float32)
                        reference = got if reference is None else reference
                        if variant == "once":     # the others: wrong values by design
                            row["max_diff_vs_default"] = float(
                                jnp.where(used, jnp.abs(got - reference), 0).max())
                        row |= timing(fn, x_t, packed, w.scale, tiles.tile_group).row()
                        row["tbps"] = nbytes / row["ms"] / 1e9
                        row["pct_copy"] = 100 * row["tbps"] / ceilings["copy_tbps"]
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(json.dumps(row), flush=True)
                    results.append(row)
                    out_file.write_text(json.dumps({"ceilings": ceilings, "rows": results},
                                                   indent=1))
    fp4_kernel.plgpu = real


if __name__ == "__main__":
    main()
