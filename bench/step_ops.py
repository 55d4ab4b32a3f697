"""The GPU step's operations by kind and source line, lowered for CUDA on a CPU-only machine.

    python bench/step_ops.py                                   # 2 V4-Flash layers, bucket 16
    python bench/step_ops.py --layers 4 --bucket 8192 --bf16 --kinds sort top_k scatter

The engine's step for a V4-Flash slice (abstract weights: nothing is allocated), the H200's
kernel table and formulation, lowered to StableHLO under `abstract_gpu` as the GPU would
compile it, before XLA's optimisations. Each operation of the asked kinds is counted with the
number of times its function is called (layers unrolled, helpers shared), under the model
lines it came from. What it cannot say: how XLA fuses them (a reduction or a scatter is
usually a kernel of its own, elementwise code joins its neighbours) or what anything costs;
`step_profile.py` on a GPU says that. What it found first: the logprobs' top 20 sorting the
whole vocabulary every step (docs/performance-log.md, 2026-12-05).
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.models import V4_FLASH, slice_config  # noqa: E402
from deepinfer_jax.config.engine import EngineConfig  # noqa: E402
from deepinfer_jax.config.options import DeviceFacts  # noqa: E402
from deepinfer_jax.device.step import step  # noqa: E402
from deepinfer_jax.engine.step_weights import with_step_weights  # noqa: E402
from deepinfer_jax.engine.transfer import Wire  # noqa: E402
from deepinfer_jax.host.decision import ScheduleDecision  # noqa: E402
from deepinfer_jax.host.plan_builder import build_plan  # noqa: E402
from deepinfer_jax.model.state import init_state  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts  # noqa: E402
from pallas_kernels.common import abstract_gpu  # noqa: E402

H200 = DeviceFacts("gpu", "9.0")
# the kinds a GPU usually runs as kernels of their own (elementwise ops fuse into them)
KINDS = ("custom_call", "dot_general", "reduce", "scatter", "gather", "sort", "top_k", "scan",
         "concatenate", "pad", "while", "case")
_FUNC = re.compile(r"\s*func\.func (?:public |private )?@([\w.]+)\(")
_CALL = re.compile(r"call @([\w.]+)\(")
_OP = re.compile(r'(?:= |^\s*)"?(?:stablehlo|chlo)\.(\w+)')
_LOC = re.compile(r"loc\((#loc\d+)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d+) = (loc\(.*\))$", re.M)
_FRAME = re.compile(r'"[^"]*?/((?:deepinfer_jax|pallas_kernels)/[^"]+)":(\d+)')


def lower(layers: int, bucket: int, quantized: bool, batch_invariant: bool) -> str:
    """The step's StableHLO with debug locations."""
    cfg = slice_config(V4_FLASH, layers).replace(num_mtp_layers=0)
    step_cfg = EngineConfig(max_num_seqs=min(bucket, 64), max_model_len=4096 + bucket,
                            max_num_batched_tokens=bucket, token_buckets=(bucket,),
                            batch_invariant=batch_invariant).resolve(cfg, H200, environ={})
    # the weights as the engine holds them on the H200: FP4 experts in the kernel's tiles
    # (weights/fp4_tiles.py), the mHC mixes' parts made (engine/step_weights.py)
    params = jax.eval_shape(lambda key: with_step_weights(tile_fp4_experts(
        random_params(cfg, key, release_formats=quantized), step_cfg.compute.fp4_expert_order,
        owned=False)), jax.random.key(0))
    state = jax.eval_shape(lambda: init_state(cfg, step_cfg, jnp.bfloat16))
    wire = Wire.of(build_plan(ScheduleDecision(()), bucket, step_cfg))
    traced = jax.jit(lambda p, s, b: step(p, s, wire.unpack_device(b), cfg=cfg,
                                          step_cfg=step_cfg, truncation=False))
    with abstract_gpu():
        lowered = traced.trace(params, state, wire.spec()).lower(lowering_platforms=("cuda",))
        return lowered.compiler_ir("stablehlo").operation.get_asm(enable_debug_info=True)


def census(text: str, kinds: set[str], frames: int) -> collections.Counter:
    """(kind, source lines) -> count in `main`, each function's ops times its calls."""
    loc_defs = dict(_LOC_DEF.findall(text))

    @functools.cache
    def where(loc: str) -> str:
        def expand(ref: str, depth: int = 0) -> str:
            body = loc_defs.get(ref, ref)
            return body if depth > 16 else re.sub(
                r"#loc\d+", lambda m: expand(m.group(0), depth + 1), body)
        found = _FRAME.findall(expand(loc))
        return " < ".join(f"{Path(f).name}:{n}" for f, n in found[:frames]) or "?"

    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            current = bodies.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)

    @functools.cache
    def total(name: str) -> collections.Counter:
        counts: collections.Counter = collections.Counter()
        lines = bodies.get(name, [])
        for i, line in enumerate(lines):
            if (call := _CALL.search(line)) and call.group(1) in bodies:
                # a shared helper's ops (jnp internals: no model line of their own) take the
                # line that called it
                site = (m := _LOC.search(line)) and where(m.group(1))
                for (kind, source), n in total(call.group(1)).items():
                    counts[(kind, site if source == "?" and site else source)] += n
                continue
            op = _OP.search(line)
            if not op or op.group(1) not in kinds:
                continue
            # an op with a region carries its location on the line that closes the region
            loc = next((m.group(1) for later in lines[i:]
                        if (m := _LOC.search(later)) and (later is line or later.lstrip()
                                                          .startswith("}"))), None)
            counts[(op.group(1), where(loc) if loc else "?")] += 1
        return counts

    return total("main")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bucket", type=int, default=16, help="the step's token bucket")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (default: the release's "
                                                         "FP8/FP4 formats)")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--frames", type=int, default=3, help="source lines shown per op")
    args = ap.parse_args()
    counts = census(lower(args.layers, args.bucket, not args.bf16, args.batch_invariant),
                    set(args.kinds), args.frames)
    by_kind = collections.Counter()
    for (kind, _), n in counts.items():
        by_kind[kind] += n
    print(f"V4-Flash, {args.layers} layers, bucket {args.bucket}, "
          f"{'bf16' if args.bf16 else 'release formats'}"
          f"{', batch-invariant' if args.batch_invariant else ''}: "
          + ", ".join(f"{kind} {n}" for kind, n in by_kind.most_common()))
    for (kind, source), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"{n:5d}  {kind:12s} {source}")


if __name__ == "__main__":
    main()
