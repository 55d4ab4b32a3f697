"""Decode/verify and prefill sink attention on DeepSeek-V4-Flash shapes: the Mosaic GPU kernels
(the warp-specialised one, the default, and the one-warpgroup one) and their configs against
the XLA (jnp) path, in one run with the ceilings.

    python bench/kernels_attention.py                 # H200
    python bench/kernels_attention.py --quick         # H200: batch 64 at 4k and the prefill
    python bench/kernels_attention.py --smoke         # CPU: tiny shapes, kernel interpreted

Each query token attends (64 heads of 512, one shared K=V head) to its own gathered rows: the
128-row window plus, in a CSA layer, the indexer's top-512 compressed rows (context / 4
before that), or in an HCA layer all context / 128 compressed rows. Decode: batch 1, 16, 64
at 4k and 32k context, one token per request; achieved bandwidth = the rows' bytes / time
(the floor is reading each row once per token), against the measured copy ceiling. Prefill:
an 8k-token chunk at 4k context; achieved TFLOP/s (QK and PV) against XLA's dense bf16
matmul rate. tokamax's attention expects per-head K/V with a causal or dense mask, not
per-token gathered rows, so it has no row here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.ceilings import beside_the_dot, beside_the_dot_table  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.device_time import device_kernels, device_timing  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from bench.lib.timing import rel_err, spread, timed_ms, timing  # noqa: E402
from pallas_kernels.sink_attention import api, reference  # noqa: E402
from pallas_kernels.sink_attention.mosaic_gpu import AttentionConfig  # noqa: E402
from pallas_kernels.sink_attention.mosaic_gpu_ws import WarpSpecializedConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
    heads: int = 64
    head_dim: int = 512
    window: int = 128
    index_topk: int = 512
    decode_batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (4096, 32768)
    prefill_tokens: int = 8192
    prefill_context: int = 4096


SMOKE = Shapes(heads=64, head_dim=128, window=32, index_topk=32, decode_batches=(2,),
               contexts=(256,), prefill_tokens=8, prefill_context=256)


def rows_per_token(layer: str, context: int, shapes: Shapes) -> int:
    if layer == "CSA":
        return shapes.window + min(shapes.index_topk, context // 4)
    return shapes.window + context // 128


def case(name: str, tokens: int, rows: int, shapes: Shapes, impl: str) -> list[dict]:
    keys = jax.random.split(jax.random.key(tokens * 7919 + rows), 4)
    q = jax.random.normal(keys[0], (tokens, shapes.heads, shapes.head_dim), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (tokens, rows, shapes.head_dim), jnp.bfloat16)
    visible = jax.random.uniform(keys[2], (tokens, rows)) < 0.95
    sinks = jax.random.normal(keys[3], (shapes.heads,), jnp.float32)
    row_bytes = tokens * rows * shapes.head_dim * 2
    # What any kernel taking these operands moves through HBM at least: the rows, q, the
    # output (bf16) and the mask's bias (float32 a row).
    hbm_bytes = row_bytes + 2 * tokens * shapes.heads * shapes.head_dim * 2 + tokens * rows * 4
    flops = 2 * 2 * tokens * shapes.heads * rows * shapes.head_dim
    out, results = {}, []
    variants = [("xla (jnp)", reference.sink_attention),
                ("ours", functools.partial(api.sink_attention, implementation=impl))]
    variants += [("ours 1 wg, 128 dims/program", functools.partial(
        api.sink_attention, implementation=impl, config=AttentionConfig(block_d=128)))]
    splits = (1, 2, 5) if tokens <= 64 else (1,)   # decode: rows split over programs too
    variants += [(f"ours ws x {n} row splits{', scores split' * scored}", functools.partial(
        api.sink_attention, implementation=impl,
        config=WarpSpecializedConfig(num_splits=n, split_scores=scored)))
        for n in splits for scored in (False, True)]
    n = splits[min(1, len(splits) - 1)]
    # Ping-pong (the warpgroups taking turns on the tensor cores) is opt-in: timed here until
    # it is clearly ahead (other variants tried: docs/performance-log.md, sink attention).
    variants += [(f"ours ws x {n} row splits, ping-pong", functools.partial(
        api.sink_attention, implementation=impl,
        config=WarpSpecializedConfig(num_splits=n, ping_pong=True, split_scores=False)))]
    operands = {label: (q, kv, visible, sinks) for label, _ in variants}
    if tokens <= 64:
        # decode: the same rows with each token's block of them 64 rows (one pipeline step)
        # apart more, the extra rows invisible. Whether concurrent programs reading blocks a
        # power-of-two-heavy stride apart (640 rows x 1 KiB) share DRAM channels: the kernel
        # at batch 64 gained nothing from twice the programs (session 53). Its rates count
        # the real rows only.
        label = "ours, each token's rows 64 rows further apart"
        variants += [(label, functools.partial(api.sink_attention, implementation=impl))]
        operands[label] = (q, jnp.pad(kv, ((0, 0), (0, 64), (0, 0))),
                           jnp.pad(visible, ((0, 0), (0, 64))), sinks)
    for label, fn in variants:
        row = {"case": name, "tokens": tokens, "rows_per_token": rows, "impl": label}
        args = operands[label]
        try:
            jitted = jax.jit(fn)
            out[label] = jitted(*args)
            row["call_ms"] = timed_ms(jitted, *args)
            timed = device_timing if jax.default_backend() == "gpu" else timing
            row |= timed(jitted, *args).row()
        except Exception as error:  # noqa: BLE001 - report and go on
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            results.append(row)
            continue
        if tokens <= 64 and label.startswith("ours") and jax.default_backend() == "gpu":
            # decode: the attention kernel's own time apart from what the call adds around
            # it (the mask's bias, the split ranges' combine): the kernel's rate is the
            # kernel time's, the row's the whole call's
            row["kernels"] = {name: ms for name, (ms, _) in
                              device_kernels(jitted, *args).items()}
        row["rows_tbps"] = row_bytes / row["ms"] / 1e9
        row["hbm_tbps"] = hbm_bytes / row["ms"] / 1e9
        row["tflops"] = flops / row["ms"] / 1e9
        timed_beside = label in ("xla (jnp)", "ours") or "scores split" in label
        if tokens > 64 and timed_beside and jax.default_backend() == "gpu":
            beside = beside_the_dot(jitted, *args)
            row["beside_dot"] = beside | {"tflops": flops / beside["ms"] / 1e9}
        if label.startswith("ours") and "xla (jnp)" in out:
            row["rel_err_vs_xla"] = rel_err(out[label], out["xla (jnp)"])
        results.append(row)
    return results


def table(results: list[dict], ceilings: dict) -> str:
    lines = [f"Ceilings measured in this run: XLA bf16 matmul {ceilings['matmul_tflops']:.0f} "
             f"TFLOP/s; copy {ceilings['copy_tbps']:.2f} TB/s ({ceilings['copy_source']}).", "",
             "| case | impl | tokens | rows/token | device ms | min-max (calls) | call ms | "
             "rows TB/s | % copy | all bytes: % copy | TFLOP/s | % matmul | rel err |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['tokens']} | {r['rows_per_token']} | "
                         f"failed: {r['error']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['tokens']} | {r['rows_per_token']} | "
            f"{r['ms']:.3f} | {spread(r)} | {r['call_ms']:.3f} | {r['rows_tbps']:.2f} | "
            f"{100 * r['rows_tbps'] / ceilings['copy_tbps']:.0f}% | "
            f"{100 * r['hbm_tbps'] / ceilings['copy_tbps']:.0f}% | {r['tflops']:.1f} | "
            f"{100 * r['tflops'] / ceilings['matmul_tflops']:.0f}% | "
            f"{r.get('rel_err_vs_xla', float('nan')):.1e} |")
    lines += beside_the_dot_table(results)
    lines += kernels_table(results, ceilings)
    return "\n".join(lines)


def kernels_table(results: list[dict], ceilings: dict) -> list[str]:
    """Each decode row's device time by kernel, and the attention kernel's own rate."""
    rows = [r for r in results if r.get("kernels")]
    if not rows:
        return []
    lines = ["", "Decode rows by kernel (ms per call; the attention kernel's rows rate against "
             "the copy ceiling, on its own time):", "",
             "| case | impl | tokens | attention kernel ms | its % copy | other kernels |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        attention = {n: ms for n, ms in r["kernels"].items() if "sink_attention" in n}
        others = "; ".join(f"{n[:40]} {ms:.4f}" for n, ms in r["kernels"].items()
                           if n not in attention)
        ms = sum(attention.values())
        rate = (r["rows_tbps"] * r["ms"] / ms) if ms else float("nan")
        lines.append(f"| {r['case']} | {r['impl']} | {r['tokens']} | {ms:.4f} | "
                     f"{100 * rate / ceilings['copy_tbps']:.0f}% | {others} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernel interpreted on CPU")
    ap.add_argument("--name", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="batch 64 at 4k context and the prefill only (comparing variants)")
    args = ap.parse_args()
    shapes = SMOKE if args.smoke else Shapes()
    if args.quick:
        shapes = dataclasses.replace(shapes, decode_batches=(64,), contexts=(4096,))
    impl = "interpret" if args.smoke else "mosaic_gpu"
    ceilings = measure_ceilings(small=args.smoke)
    results = []
    for context in shapes.contexts:
        for layer in ("CSA", "HCA"):
            rows = rows_per_token(layer, context, shapes)
            for batch in shapes.decode_batches:
                results += case(f"decode {layer} {context // 1024}k ctx", batch, rows, shapes, impl)
        print(table(results, ceilings), flush=True)
    rows = rows_per_token("CSA", shapes.prefill_context, shapes)
    results += case(f"prefill CSA {shapes.prefill_context // 1024}k ctx", shapes.prefill_tokens,
                    rows, shapes, impl)
    text = table(results, ceilings)
    print(text)
    note = (f"\n\nShapes: {dataclasses.asdict(shapes)}; bf16; 95% of rows visible. Rows are "
            "gathered per token before the kernel (as the engine does); the gather is not timed. "
            "All bytes: the rows, q, the output and the mask's float32 bias, the least a kernel "
            "taking these operands moves through HBM. "
            "Device ms: the median over 20 traced calls of each call's kernel time (the rates "
            "use it); call ms: back-to-back jitted calls, which the host's ~40 us launch cost "
            "floors.")
    name = args.name or ("kernels-attention-cpu-smoke" if args.smoke else
                         "kernels-attention-gpu-quick" if args.quick else "kernels-attention-gpu")
    write_results(name, {"ceilings": ceilings, "results": results},
                  text + note)


if __name__ == "__main__":
    main()
