"""Grouped MoE GEMM: our Mosaic GPU kernel against XLA's `ragged_dot` and tokamax's
`ragged_dot`, on DeepSeek-V4-Flash expert shapes, one run (the batch-invariant dense GEMM:
bench/kernels_dense.py).

    python bench/kernels_moe.py                      # H200: the issue's shapes
    python bench/kernels_moe.py --smoke              # CPU: tiny shapes, kernel interpreted
    (FP4 weights against their bf16 twin alone: bench/kernels_moe_fp4.py)

Cases: routed experts (256 experts, hidden 4096, expert width 2048, top-6) for a prefill batch
(8192 tokens) and decode batches (16, 64 tokens); tokens pick 6 distinct experts uniformly.
Per case: the gate/up GEMM (ours fuses the clamped SwiGLU into it), the down GEMM, and the
whole expert MLP, each as time (median of 5 repeats, with their spread), TFLOP/s and the
rate at which the hit experts' weights were read (FP4: packed codes plus scale bytes, % of the
run's copy ceiling and of the H200's 4.8 TB/s datasheet); the prefill's MLP also timed alternately
with the ceiling's dot (the two rates in one thermal state). Ceilings measured in the same
run: XLA's dense bf16 matmul (8192^3) and device copy bandwidth (torch's copy when torch is
there, as the issue's reference, and XLA's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.ceilings import DATASHEET_TBPS, beside_the_dot, beside_the_dot_table  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.timing import rel_err, spread, timing  # noqa: E402
from pallas_kernels import quantized  # noqa: E402
from pallas_kernels.grouped_gemm import api, fp4_path, mosaic_gpu_persistent, reference  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu_fp4 import Fp4Config  # noqa: E402
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
    experts: int = 256
    hidden: int = 4096
    inter: int = 2048
    top_k: int = 6
    prefill_tokens: int = 8192
    decode_tokens: tuple[int, ...] = (16, 64)


SMOKE = Shapes(experts=8, hidden=128, inter=128, top_k=2, prefill_tokens=64,
               decode_tokens=(4,))


# --- problem --------------------------------------------------------------------------------

def routing(tokens: int, shapes: Shapes, seed: int) -> jax.Array:
    """Rows per expert when each token picks top_k distinct experts uniformly."""
    keys = jax.random.uniform(jax.random.key(seed), (tokens, shapes.experts))
    picks = jnp.argsort(keys, axis=1)[:, : shapes.top_k]
    return jnp.bincount(picks.reshape(-1), length=shapes.experts).astype(jnp.int32)


def fp8_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bf16 [G, K, N] -> E4M3 codes and f32 scales per 128 x 128 block (amax / 448)."""
    g, k, n = w.shape
    blocks = w.astype(jnp.float32).reshape(g, k // 128, 128, n // 128, 128)
    scale = jnp.max(jnp.abs(blocks), axis=(2, 4)) / 448.0 + 1e-12
    codes = (blocks / scale[:, :, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(g, k, n), scale


def fp4_blocks(key, experts: int, n: int, k: int, fan_in: int) -> quantized.Fp4Blocks:
    """Random FP4 expert weights as the release stores them: uniform codes, E8M0 scales near
    what a fan_in-wide layer's weights get (so the dequantized weights are ~N(0, 1/fan_in))."""
    codes, scales = jax.random.split(key)
    center = 127 - 2 - int(round(0.5 * (fan_in.bit_length() - 1)))
    return quantized.Fp4Blocks(
        jax.random.randint(codes, (experts, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8),
        jax.random.randint(scales, (experts, k // 32, n), center - 1, center + 2,
                           jnp.int32).astype(jnp.uint8))


@dataclasses.dataclass
class Experts:
    w13: jax.Array          # [E, D, 2I] bf16: the FP4 weights dequantized
    w2: jax.Array           # [E, I, D]  bf16
    w13_fp8: tuple          # (codes, scales)
    w2_fp8: tuple
    w13_fp4: quantized.Fp4Blocks   # [E, 2I, D/2] (+ scales): the released experts' format
    w2_fp4: quantized.Fp4Blocks


def as_engine_holds(w: quantized.Fp4Blocks, op: str) -> quantized.Fp4Blocks:
    """FP4 codes in the order the engine holds them where the kernel reads them
    (deepinfer_jax/weights/fp4_tiles.py: the kernel's stored tiles, as words when compiled)."""
    tile = fp4_path.stored_tile(w, op, interpret=jax.default_backend() == "cpu")
    return w if tile is None else quantized.fp4_tiled(w, tile)


def make_experts(shapes: Shapes) -> Experts:
    """FP4 weights first; the bf16 ones are their dequantized values (so every impl computes
    the same function and the FP4 rows' error against the peers is the kernel's alone), the
    FP8 ones quantized from those."""
    e, d, i = shapes.experts, shapes.hidden, shapes.inter
    w13_fp4 = as_engine_holds(fp4_blocks(jax.random.key(1), e, 2 * i, d, d), "gate_up")
    w2_fp4 = as_engine_holds(fp4_blocks(jax.random.key(2), e, d, i, i), "down")
    w13 = jax.jit(quantized.dequantize)(w13_fp4)
    w2 = jax.jit(quantized.dequantize)(w2_fp4)
    return Experts(w13, w2, jax.jit(fp8_blocks)(w13), jax.jit(fp8_blocks)(w2), w13_fp4, w2_fp4)


# --- implementations ------------------------------------------------------------------------

def tokamax_ragged_dot():
    """tokamax's ragged_dot, or None where it cannot be imported. It imports a profiling
    module of xprof at start-up that timing does not need: an empty stand-in serves."""
    stub = Path(tempfile.mkdtemp()) / "xprof" / "cli" / "tools"
    stub.mkdir(parents=True)
    for folder in (stub.parents[1], stub.parent, stub):
        (folder / "__init__.py").write_text("")
    (stub / "get_kernel_stats_tool.py").write_text("")
    sys.path.append(str(stub.parents[2]))
    try:
        import tokamax
    except Exception as error:  # noqa: BLE001
        print(f"tokamax unavailable: {error}", file=sys.stderr)
        return None, None
    return functools.partial(tokamax.ragged_dot, implementation="mosaic"), tokamax.__version__


def swiglu(gate_up, limit):
    return reference.swiglu(gate_up.astype(jnp.float32), limit)


def row_problem(tokens: int, shapes: Shapes, seed: int):
    sizes = routing(tokens, shapes, seed)
    rows = tokens * shapes.top_k
    x = jax.random.normal(jax.random.key(seed + 10), (rows, shapes.hidden), jnp.bfloat16)
    h = jax.random.normal(jax.random.key(seed + 20), (rows, shapes.inter), jnp.bfloat16)
    return sizes, x, h


LIMIT = 10.0   # V4-Flash's swiglu_limit


def moe_case(name: str, tokens: int, shapes: Shapes, experts: Experts, impl: str,
             tokamax_dot, sweep: dict[str, list], fp4_sweep: dict[str, list] | None = None,
             only_ours: bool = False) -> list[dict]:
    sizes, x, h = row_problem(tokens, shapes, seed=tokens)
    rows, d, i = x.shape[0], shapes.hidden, shapes.inter
    hit = int(jnp.count_nonzero(sizes))
    flops = {"gate_up": 2 * rows * d * 2 * i, "down": 2 * rows * i * d,
             "mlp": 2 * rows * d * 3 * i}
    weight_bytes = {"gate_up": hit * d * 2 * i * 2, "down": hit * i * d * 2,
                    "mlp": hit * d * 3 * i * 2}
    fp4_bytes = {op: n // 4 + n // 64 for op, n in weight_bytes.items()}   # codes + scales

    # Weights are jit arguments (closed over, jit would embed gigabytes of constants).
    bf16 = {"gate_up": (experts.w13, None), "down": (experts.w2, None)}
    fp8 = {"gate_up": experts.w13_fp8, "down": experts.w2_fp8}
    fp4 = {"gate_up": (experts.w13_fp4, None), "down": (experts.w2_fp4, None)}

    def ours(weights):
        def op(name, a, s, w13, s13, w2, s2, cfg=None):
            k, n_out = (d, i) if name == "gate_up" else (i, d)
            if name != "mlp" and isinstance(cfg, TileConfig | WarpSpecializedConfig) and \
                    not api.kernel_fits(k, n_out, cfg, s13 is not None):
                raise ValueError(f"{cfg} does not fit K={k}, N={n_out} (it would time the "
                                 "reference path)")
            if name == "gate_up":
                return api.grouped_matmul(a, w13, s, rhs_scale=s13, swiglu_limit=LIMIT,
                                          implementation=impl, config=cfg)
            if name == "down":
                return api.grouped_matmul(a, w2, s, rhs_scale=s2, implementation=impl, config=cfg)
            return api.expert_mlp(a, w13, w2, s, LIMIT, w13_scale=s13, w2_scale=s2, implementation=impl,
                                  configs=cfg)   # (gate/up, down) or None: the defaults
        return op, weights

    def via(dot):
        def op(name, a, s, w13, _s13, w2, _s2):
            if name == "gate_up":
                return swiglu(dot(a, w13, s), LIMIT).astype(a.dtype)
            if name == "down":
                return dot(a, w2, s)
            return dot(swiglu(dot(a, w13, s), LIMIT).astype(a.dtype), w2, s)
        return op, bf16

    peers = {}
    if only_ours:
        peers_ours = {"ours bf16": ours(bf16), "ours fp4": ours(fp4)}
        return _time_peers(name, tokens, rows, hit, flops, weight_bytes, fp4_bytes, x, h, sizes,
                           peers_ours, impl, fp4_sweep)
    # XLA lowers ragged_dot densely on GPU: a [rows, experts, N] intermediate.
    dense_bytes = rows * shapes.experts * 2 * i * 2
    if dense_bytes < 32 * 2**30:
        peers["xla ragged_dot"] = via(jax.lax.ragged_dot)
    else:
        results_skipped = {"case": name, "rows": rows, "op": "all", "impl": "xla ragged_dot",
                           "error": f"not run: its dense lowering needs {dense_bytes / 2**30:.0f} "
                                    "GiB (rows x experts x N), more than the GPU has"}
    if tokamax_dot is not None:                           # the peers first: ours are
        peers["tokamax ragged_dot"] = via(tokamax_dot)    # checked against their outputs
    peers |= {"ours bf16": ours(bf16), "ours fp8": ours(fp8), "ours fp4": ours(fp4)}
    results = [] if "xla ragged_dot" in peers else [results_skipped]
    results += _time_peers(name, tokens, rows, hit, flops, weight_bytes, fp4_bytes, x, h, sizes,
                           peers, impl, fp4_sweep, sweep)
    return results


def _time_peers(name, tokens, rows, hit, flops, weight_bytes, fp4_bytes, x, h, sizes, peers, impl,
                fp4_sweep, sweep=None) -> list[dict]:
    results, outputs = [], {}
    sweep = sweep or {}
    for op in ("gate_up", "down", "mlp"):
        arg = h if op == "down" else x
        for peer, (fn, weights) in peers.items():
            row = {"case": name, "tokens": tokens, "rows": rows, "hit_experts": hit, "op": op,
                   "impl": peer}
            args = (arg, sizes, *weights["gate_up"], *weights["down"])
            try:
                fn = jax.jit(functools.partial(fn, op))
                outputs[peer, op] = fn(*args)
                row |= timing(fn, *args).row()
            except Exception as error:  # noqa: BLE001 - a peer that cannot run this shape
                row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"
                results.append(row)
                continue
            read = (fp4_bytes[op] if peer == "ours fp4" else
                    weight_bytes[op] // (2 if peer == "ours fp8" else 1))
            row["tflops"] = flops[op] / row["ms"] / 1e9
            if op == "mlp" and name == "prefill" and peer in ("ours bf16", "tokamax ragged_dot") \
                    and impl != "interpret":
                beside = beside_the_dot(fn, *args)
                row["beside_dot"] = beside | {"tflops": flops[op] / beside["ms"] / 1e9}
            row["weight_tbps"] = read / row["ms"] / 1e9
            ref = outputs.get(("xla ragged_dot", op), outputs.get(("tokamax ragged_dot", op)))
            if ref is None and peer == "ours fp4":   # the bf16 kernel on the dequantized weights
                ref = outputs.get(("ours bf16", op))
            if ref is not None and peer.startswith("ours"):
                row["rel_err_vs_peer"] = rel_err(outputs[peer, op], ref)
            results.append(row)
        if op in sweep and impl != "interpret":
            fn, weights = peers["ours bf16"]
            args = (arg, sizes, *weights["gate_up"], *weights["down"])
            results += tile_sweep(name, op, tokens, rows, hit, flops[op], weight_bytes[op],
                                  functools.partial(fn, op), args, sweep[op])
        if fp4_sweep and op in fp4_sweep and impl != "interpret" and "ours fp4" in peers:
            fn, weights = peers["ours fp4"]
            args = (arg, sizes, *weights["gate_up"], *weights["down"])
            ref = outputs.get(("xla ragged_dot", op), outputs.get(("tokamax ragged_dot", op),
                                                                  outputs.get(("ours bf16", op))))
            results += tile_sweep(name, op, tokens, rows, hit, flops[op], fp4_bytes[op],
                                  functools.partial(fn, op), args, fp4_sweep[op], ref)
    return results


def label(cfg) -> str:
    if isinstance(cfg, Fp4Config):
        where = "" if cfg.a_in_registers else " A via smem"
        return (f"ours fp4 {cfg.block_n}x{cfg.block_m}x{cfg.block_k}/"
                f"{cfg.max_concurrent_steps}{where} {cfg.dequant}"
                f"{' tiles' * cfg.tile_major}{f' words{cfg.word_codes}' * (cfg.word_codes > 0)}")
    if isinstance(cfg, tuple):
        return " + ".join(label(c) for c in cfg).replace(" + ours bf16", " +")
    kind = ("ws " if isinstance(cfg, WarpSpecializedConfig) else
            "persistent " if isinstance(cfg, mosaic_gpu_persistent.PersistentConfig) else "")
    grouped = f" by {cfg.group_tiles} tiles" if getattr(cfg, "group_tiles", 0) else ""
    return (f"ours bf16 {kind}{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/"
            f"{cfg.max_concurrent_steps}{grouped}")


def tile_sweep(name, op, tokens, rows, hit, flops, weight_bytes, fn, args, sweep,
               ref=None) -> list[dict]:
    """Each config timed; with `ref`, its output's relative error against it."""
    out = []
    for cfg in sweep:
        row = {"case": name, "tokens": tokens, "rows": rows, "hit_experts": hit,
               "op": op, "impl": label(cfg)}
        try:
            run = jax.jit(functools.partial(fn, cfg=cfg))
            if ref is not None:
                row["rel_err_vs_peer"] = rel_err(run(*args), ref)
            row |= timing(run, *args).row()
            row["tflops"] = flops / row["ms"] / 1e9
            row["weight_tbps"] = weight_bytes / row["ms"] / 1e9
        except Exception as error:  # noqa: BLE001 - e.g. a tile that overflows shared memory
            row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"
        out.append(row)
    return out


def sweeps() -> tuple[dict, dict]:
    """Tile configs timed beside the engine's defaults, per op, for the prefill and the decode
    cases: the alternatives measured closest to the defaults (docs/performance-log.md, grouped
    GEMM), so that a GPU or compiler change that reorders them shows here."""
    ws, persistent = WarpSpecializedConfig, mosaic_gpu_persistent.PersistentConfig
    prefill = {"gate_up": [TileConfig(128, 64, 64, 6), ws(64, 64, 4), ws(128, 64, 3),
                           persistent(64), persistent(128)],
               "down": [TileConfig(128, 128, 64, 6), ws(128, 64, 4), persistent(128),
                        persistent(256)],
               "mlp": [(persistent(128), persistent(256)), (persistent(64), persistent(128))]}
    decode = {"gate_up": [TileConfig(64, 128, 64, 4), TileConfig(64, 64, 64, 8), ws(128, 64, 4)],
              "down": [TileConfig(64, 128, 64, 4), TileConfig(64, 256, 64, 3), ws(256, 64, 3)]}
    return prefill, decode


def table(results: list[dict], ceilings: dict) -> str:
    lines = [
        f"Ceilings measured in this run: XLA bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s; "
        f"copy {ceilings['copy_tbps']:.2f} TB/s ({ceilings['copy_source']}).", "",
        "| case | op | impl | rows | hit experts | ms | min-max (repeats) | TFLOP/s | "
        "weights TB/s | % matmul | % copy | % 4.8 TB/s | rel err |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['op']} | {r['impl']} | {r.get('rows', '')} | | "
                         f"failed: {r['error']} | | | | | | | |")
            continue
        tbps = r.get("weight_tbps")
        lines.append(
            f"| {r['case']} | {r['op']} | {r['impl']} | {r['rows']} | "
            f"{r.get('hit_experts', '')} | "
            f"{r['ms']:.3f} | {spread(r)} | {r['tflops']:.1f} | "
            f"{'' if tbps is None else f'{tbps:.2f}'} | "
            f"{100 * r['tflops'] / ceilings['matmul_tflops']:.0f}% | "
            f"{'' if tbps is None else f'{100 * tbps / ceilings["copy_tbps"]:.0f}%'} | "
            f"{'' if tbps is None else f'{100 * tbps / DATASHEET_TBPS:.0f}%'} | "
            f"{r.get('rel_err_vs_peer', float('nan')):.1e} |")
    lines += beside_the_dot_table(results)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernel interpreted on CPU")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    shapes = SMOKE if args.smoke else Shapes()
    impl = "interpret" if args.smoke else "mosaic_gpu"

    ceilings = measure_ceilings(small=args.smoke)
    print(ceilings, flush=True)

    tokamax_dot, tokamax_version = (None, None) if args.smoke else tokamax_ragged_dot()
    experts = make_experts(shapes)
    prefill_sweep, decode_sweep = sweeps()
    results = moe_case("prefill", shapes.prefill_tokens, shapes, experts, impl, tokamax_dot,
                       prefill_sweep)
    print(table(results, ceilings), flush=True)
    for tokens in shapes.decode_tokens:
        results += moe_case(f"decode {tokens}", tokens, shapes, experts, impl, tokamax_dot,
                            decode_sweep)
    text = table(results, ceilings)
    print(text)
    env = environment() | {"tokamax": tokamax_version}
    note = (f"\n\nShapes: {dataclasses.asdict(shapes)}; bf16 activations; FP8 = E4M3 weights with "
            "128x128 block scales. `weights TB/s` = bytes of the hit experts' weights / time. "
            "Ours includes laying rows out in whole tiles per expert and back; the peers' "
            "gate_up includes a separate jnp SwiGLU.")
    name = args.name or ("kernels-moe-cpu-smoke" if args.smoke else "kernels-moe-gpu")
    write_results(name, {"environment": env, "ceilings": ceilings, "results": results},
                  text + note)


if __name__ == "__main__":
    main()
