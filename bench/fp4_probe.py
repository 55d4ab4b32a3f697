"""A one-off study of the FP4 grouped GEMM at decode (not committed): ptxas's report for the
default kernel, and the kernel's time with the step overlap and with its dequantization
replaced by register moves (the loads and wgmmas alone)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kernels_moe import LIMIT, Shapes, fp4_blocks, row_problem  # noqa: E402
from bench.lib.timing import timing  # noqa: E402
from pallas_kernels.grouped_gemm import api, fp4_dequant, fp4_path  # noqa: E402

MOV = """{
mov.b32 $0, $2;
mov.b32 $1, $3;
}"""


CANDIDATES = {"default": {}, "chains2": {"k_chains": 2}, "chains4": {"k_chains": 4},
              "pipelined": {"scales_in_pipeline": 1},
              "chains4 pipelined": {"k_chains": 4, "scales_in_pipeline": 1}}


def configs(rows, op, n_out):
    base = fp4_path.default_config(rows, False, op, n_out)
    rep = dataclasses.replace
    out = {name: rep(base, **fields) for name, fields in CANDIDATES.items()}
    if op == "gate_up":
        out["n128 chains4 pipelined"] = rep(base, block_n=128, k_chains=4, scales_in_pipeline=True)
    else:
        out["n64 chains4 pipelined"] = rep(base, block_n=64, k_chains=4, scales_in_pipeline=True)
    return out


def main():
    if sys.argv[1:] == ["--compile-one"]:
        shapes = Shapes()
        w13 = fp4_blocks(jax.random.key(1), shapes.experts, 2 * shapes.inter, shapes.hidden,
                         shapes.hidden)
        sizes, x, _ = row_problem(16, shapes, 16)
        cfg = fp4_path.default_config(x.shape[0], False, "gate_up")
        out = jax.jit(lambda a, w, s: api.grouped_matmul(a, w, s, swiglu_limit=LIMIT,
                                                         implementation="mosaic_gpu",
                                                         config=cfg))(x, w13, sizes)
        jax.block_until_ready(out)
        return
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1",
               MOSAIC_GPU_DUMP_RESOURCES="1")
    with open(out_dir / "ptxas.txt", "w") as f:
        subprocess.run([sys.executable, __file__, "--compile-one"], env=env, stdout=f,
                       stderr=subprocess.STDOUT, check=False)
    shapes = Shapes()
    w13 = fp4_blocks(jax.random.key(1), shapes.experts, 2 * shapes.inter, shapes.hidden,
                     shapes.hidden)
    w2 = fp4_blocks(jax.random.key(2), shapes.experts, shapes.hidden, shapes.inter, shapes.inter)
    results = []
    for variant in ("ptx",):
        if variant == "mov":
            fp4_dequant._PTX = MOV
            jax.clear_caches()
        for tokens in (16, 64):
            sizes, x, h = row_problem(tokens, shapes, tokens)
            rows, hit = x.shape[0], int((sizes > 0).sum())
            for op, w, a, n_out, swiglu in (("gate_up", w13, x, shapes.inter, LIMIT),
                                            ("down", w2, h, shapes.hidden, None)):
                k = a.shape[1]
                nbytes = hit * (n_out * (2 if swiglu else 1)) * (k // 2 + k // 32)
                for name, cfg in configs(rows, op, n_out).items():
                    if variant == "mov" and name not in ("default", "overlap"):
                        continue
                    row = {"variant": variant, "tokens": tokens, "op": op, "config": name,
                           "hit": hit}
                    try:
                        fn = jax.jit(lambda a, w, s, cfg=cfg, swiglu=swiglu: api.grouped_matmul(
                            a, w, s, swiglu_limit=swiglu, implementation="mosaic_gpu",
                            config=cfg))
                        if variant == "ptx":
                            ref = api.grouped_matmul(a, w, sizes, swiglu_limit=swiglu,
                                                     implementation="mosaic_gpu")
                            got = fn(a, w, sizes)
                            row["max_diff_vs_default"] = float(abs(got.astype("float32")
                                                                   - ref.astype("float32")).max())
                        row |= timing(fn, a, w, sizes).row()
                        row["tbps"] = nbytes / row["ms"] / 1e9
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(json.dumps(row), flush=True)
                    results.append(row)
    (out_dir / "fp4_probe.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(r["variant"], r["tokens"], r["op"], r["config"], f"{r.get('ms', 0):.3f}",
              r.get("ms_min"), r.get("ms_max"), f"{r.get('tbps', 0):.2f}",
              r.get("max_diff_vs_default"), r.get("error", "")[:200])

    def total(config):
        rows = [r for r in results if r["tokens"] == 16 and r["config"] == config]
        return sum(r["ms"] for r in rows) if len(rows) == 2 and all("ms" in r for r in rows) else None

    times = {c: total(c) for c in CANDIDATES}
    print("decode 16 gate_up + down ms:", times)
    ok = [c for c, t in times.items() if t is not None]
    best = min(ok, key=times.get) if ok else "default"
    flag = ("" if best == "default" or times[best] > 0.97 * (times["default"] or 1e9) else
            " ".join(f"{k}={v}" for k, v in CANDIDATES[best].items()))
    print("chosen:", best, flag)
    (out_dir / "fp4_flag").write_text(flag)

if __name__ == "__main__":
    main()
