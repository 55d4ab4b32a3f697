"""V4.1's MoE sublayer on V4's kernels, for the paged step outside batch-invariant mode.

V4.1's routing stays its own (`blocks.route`: sqrt-softplus scores over gate_temp, the
selection bias, float32); the routed experts then run through V4's grouped path
(`moe.routed_experts`: pairs sorted by expert, the grouped GEMM over the stacked weights as
stored, FP4 `Fp4Blocks` / FP8 `Fp8Blocks` read by the kernels on a GPU) and the shared expert
through `moe.shared_expert` (`invariant.linear`: FP8 of 128 x 128 blocks by the GEMM kernel,
other grids dequantized per call). No [N, K, D, 2I] gather of each token's experts, no float32
copy of the expert stacks per step (on the CPU the grouped GEMM's jnp form still decodes the
stack inside the op: that is its meaning, not the step's).

Numerics against `blocks.moe` (the reference's order): the routing weight multiplies each
expert's output after the down projection rather than its hidden activation before it (equal
in exact arithmetic), and the experts see the activations in the compute dtype (the weights'
float type: bf16 on a GPU as V4, float32 in the CPU tests, where it matches `blocks.moe` to
float32 rounding). The batch-invariant step keeps `blocks.moe` in row tiles (tested bitwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model import moe as v4_moe
from deepinfer_jax.model.params import MoEParams
from deepinfer_jax.model.v41 import blocks


def moe(x: jax.Array, p: MoEParams, cfg: V41Config, compute: ComputeConfig, dtype,
        valid: jax.Array | None = None) -> jax.Array:
    """x f32[t, D] (valid bool[t]: False for the bucket's padding rows, routed to no expert,
    as in V4's step) -> f32[t, D], the routed and shared experts' sum, computed in `dtype`."""
    experts, weights = blocks.route(x, p, cfg)                                # [t, K] each
    if valid is not None:
        keep = valid[:, None]
        experts = jnp.where(keep, experts, v4_moe.NO_EXPERT)
        weights = jnp.where(keep, weights, 0.0)
    if p.placement is not None:
        experts = v4_moe.physical_slots(experts, p.placement)
    h = x.astype(dtype)
    out = v4_moe.routed_experts(h, experts.astype(jnp.int32), weights, p.experts,
                                cfg.swiglu_limit, compute).astype(jnp.float32)
    if p.shared is not None:
        out = out + v4_moe.shared_expert(h, p.shared, cfg.swiglu_limit, compute).astype(
            jnp.float32)
    return out
