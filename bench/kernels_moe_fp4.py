"""The routed-expert grouped GEMM on FP4 weights (the release's format) against our bf16
kernel on the same weights dequantized, with the FP4 kernel's config sweep, on
DeepSeek-V4-Flash expert shapes (cases, timing and columns: bench/kernels_moe.py).

    python bench/kernels_moe_fp4.py                  # H200
    python bench/kernels_moe_fp4.py --no-sweep       # the default configs only

The FP4 weights are held as the engine holds them: in the kernel's stored tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kernels_moe import Shapes, make_experts, moe_case, table  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from pallas_kernels.grouped_gemm import fp4_path  # noqa: E402


def fp4_sweeps(experts, prefill_too: bool = True) -> tuple[dict, dict]:
    """FP4 kernel configs timed beside its defaults: the engine holds each stack in one tile
    order (bench/kernels_moe.py `as_engine_holds`), so only what that leaves free varies:
    the pipeline's depth, and at prefill the tokens a tile."""
    def around(w, rows):
        base = fp4_path.tiled_config(w, rows, interpret=False)
        return [dataclasses.replace(base, max_concurrent_steps=s) for s in (3, 6)]
    stacks = {"gate_up": experts.w13_fp4, "down": experts.w2_fp4}
    decode = {op: around(w, 16) for op, w in stacks.items()}
    prefill = {op: around(w, 4096) + [dataclasses.replace(
        fp4_path.tiled_config(w, 4096, interpret=False), block_m=128)] for op, w in stacks.items()}
    return (prefill if prefill_too else {}), decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="the default configs only")
    ap.add_argument("--decode-sweep-only", action="store_true", help="no prefill sweep")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    shapes, impl = Shapes(), "mosaic_gpu"
    ceilings = measure_ceilings()
    print(ceilings, flush=True)
    experts = make_experts(shapes)
    prefill_sweep, decode_sweep = ({}, {}) if args.no_sweep else fp4_sweeps(
        experts, not args.decode_sweep_only)
    results = []
    for tokens in shapes.decode_tokens:
        results += moe_case(f"decode {tokens}", tokens, shapes, experts, impl, None, {},
                            decode_sweep, only_ours=True)
        print(table(results, ceilings), flush=True)
    results += moe_case("prefill", shapes.prefill_tokens, shapes, experts, impl, None, {},
                        prefill_sweep, only_ours=True)
    text = table(results, ceilings)
    print(text)
    note = (f"\n\nShapes: {dataclasses.asdict(shapes)}; bf16 activations; FP4 = E2M1 codes "
            "packed two a byte with an E8M0 scale per 32 inputs (quantized.Fp4Blocks); bf16 = the "
            "same weights dequantized. `weights TB/s` = bytes of the hit experts' weights as "
            "stored (FP4: codes + scales) / time. rel err: against ours bf16 on the dequantized "
            "weights.")
    write_results(args.name or "kernels-moe-fp4-gpu",
                  {"environment": environment(), "ceilings": ceilings, "results": results},
                  text + note)


if __name__ == "__main__":
    main()
