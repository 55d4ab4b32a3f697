"""FP4 routed-expert codes laid out once in the FP4 kernel's tile order.

Where the engine runs the FP4 grouped GEMM (ComputeConfig.fp4_expert_order), each FP4 stack's
codes are permuted on the device, once at start-up, into the tiles the kernel reads a step at
a time (pallas_kernels/fp4_layout.py; the tile of each stack is the kernel's
`fp4_path.STORED_TILES`): the same bytes, one contiguous TMA copy a step instead of a strided
one, and compiled, the word order whose one 16-byte load gives a thread four scale groups.
The scales and every other weight stay as loaded; `quantized.dequantize` reads either order,
so the jnp references and a model's own forward still work on the result.

A stack the kernel cannot read (a tiny test model's, K not a multiple of its granule) stays
in the checkpoint's rows.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer_jax.model.params import ExpertParams
from pallas_kernels import quantized
from pallas_kernels.grouped_gemm import fp4_path
from pallas_kernels.quantized import Fp4Blocks, Fp4Tile


@functools.partial(jax.jit, static_argnames=("tile", "out_sharding"))
def _tiled_codes(packed, scale, *, tile: Fp4Tile, out_sharding):
    out = quantized.fp4_tiled(Fp4Blocks(packed, scale), tile).packed
    return out if out_sharding is None else jax.lax.with_sharding_constraint(out, out_sharding)


def _tiled_stack(w, op: str, interpret: bool, owned: bool):
    if not isinstance(w, Fp4Blocks) or quantized.fp4_tile(w) is not None:
        return w
    tile = fp4_path.stored_tile(w, op, interpret)
    if tile is None:
        return w
    sharding = getattr(w.packed, "sharding", None)
    out_sharding = (NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
                    if isinstance(sharding, NamedSharding) else None)
    packed = _tiled_codes(w.packed, w.scale, tile=tile, out_sharding=out_sharding)
    if owned:      # one stack's codes twice at a time, not every layer's
        w.packed.delete()
    return Fp4Blocks(packed, w.scale)


def tile_fp4_experts(params, order: str | None, *, owned: bool):
    """params (any model's tree) with every FP4 routed-expert stack's codes in the kernel's
    tile order for `order` (ComputeConfig.fp4_expert_order: "words", "bytes" or None, as
    loaded). owned: nothing else holds params, so each stack's old codes are freed as soon as
    its new ones exist (else they are left to their holder: a copy). `params` itself where
    no stack changes."""
    if order is None:
        return params

    def tiled(experts):
        if not isinstance(experts, ExpertParams):
            return experts
        interpret = order == "bytes"
        w13 = _tiled_stack(experts.w13, "gate_up", interpret, owned)
        w2 = _tiled_stack(experts.w2, "down", interpret, owned)
        if w13 is experts.w13 and w2 is experts.w2:
            return experts
        return experts.replace(w13=w13, w2=w2)

    is_experts = lambda x: isinstance(x, ExpertParams)     # noqa: E731
    before = jax.tree.leaves(params, is_leaf=is_experts)
    out = jax.tree.map(tiled, params, is_leaf=is_experts)
    after = jax.tree.leaves(out, is_leaf=is_experts)
    return params if all(a is b for a, b in zip(before, after, strict=True)) else out
