"""Mixture of experts: a router (learned top-k or hash table), grouped routed experts, a shared expert.

Routing: scores = f(x W_g) with f in {sqrt(softplus), softmax, sigmoid} (float32). Routed
layers pick top-k of `scores + bias` (the bias steers selection only); hash layers take
`tid2eid[token]`. Weights are the chosen scores, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`. Each expert is a clamped SwiGLU: silu(min(a, L)) * clamp(b, -L, L).

Routed experts run grouped: the (token, expert) pairs are sorted by expert and pushed through
the grouped GEMM (pallas_kernels/grouped_gemm: the Mosaic GPU kernel on a GPU, jnp's
`ragged_dot` elsewhere) over the stacked weights; then each token's K outputs are summed in a
fixed order (slot 0..K-1), whatever the grouping. The kernel computes each row on its own, so
it also serves batch-invariant mode; without it that mode runs each pair on its own (the op's
jnp path, `invariant=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.model import MlpKind, ModelConfig, ScoringFunc
from deepinfer_jax.model.invariant import f32_linear, linear, ordered_sum
from deepinfer_jax.model.params import ExpertParams, ExpertPlacement, MoEParams, SharedExpertParams
from deepinfer_jax.model.ragged import settled
from pallas_kernels.grouped_gemm import api as gemm
from pallas_kernels.grouped_gemm.reference import swiglu  # the clamped SwiGLU, one definition
from pallas_kernels.quantized import Fp8Blocks

NO_EXPERT = -1      # a (token, slot) pair routed nowhere: a padding row's


def score(logits: jax.Array, func: ScoringFunc) -> jax.Array:
    match func:
        case ScoringFunc.SQRTSOFTPLUS:
            return jnp.sqrt(jax.nn.softplus(logits))
        case ScoringFunc.SOFTMAX:
            return jax.nn.softmax(logits, axis=-1)
        case ScoringFunc.SIGMOID:
            return jax.nn.sigmoid(logits)


def route(x: jax.Array, token_ids: jax.Array, p: MoEParams, kind: MlpKind,
          cfg: ModelConfig, compute: ComputeConfig) -> tuple[jax.Array, jax.Array]:
    """x [N, D], token_ids i32[N] -> (experts i32[N, K], weights f32[N, K])."""
    logits = f32_linear(x, p.gate, compute)
    scores = score(logits, cfg.scoring_func)
    if kind is MlpKind.HASH_MOE:
        experts = p.tid2eid[token_ids]
    else:
        _, experts = jax.lax.top_k(scores + p.bias, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def sort_by_expert(flat_expert: jax.Array, n_experts: int) -> jax.Array:
    """The stable argsort of pairs by expert, as one sort of unique int32 keys (expert * P +
    pair): a keys-only sort, the simplest for XLA's GPU backend to hand to a radix sort (a
    sort is among an 8k prefill step's larger kernels on the H200: docs/performance-log.md).
    Falls back to argsort where the keys would not fit in int32."""
    pairs = flat_expert.shape[0]
    if (n_experts + 1) * pairs >= 2**31:      # (+1: NO_EXPERT, the padding rows')
        return jnp.argsort(flat_expert, stable=True)
    keys = flat_expert.astype(jnp.int32) * pairs + jnp.arange(pairs, dtype=jnp.int32)
    return jnp.sort(keys) % pairs


def expert_implementations(compute: ComputeConfig) -> tuple[str, ...]:
    """The grouped GEMM's implementations: the configured kernels, then on launch-bound
    devices the dense jnp form for small products (XLA's GPU ragged_dot loops over the
    experts, a few launches each) before ragged_dot."""
    kernels = tuple(name for name in compute.kernels.grouped_gemm if name != "reference")
    return kernels + (("dense", "reference") if compute.launch_bound else ("reference",))


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, p: ExpertParams,
                   limit: float, compute: ComputeConfig) -> jax.Array:
    """x [N, D], experts i32[N, K] (NO_EXPERT: the pair is skipped), weights f32[N, K] ->
    [N, D]."""
    if compute.parallel.expert_ranks > 1:
        return expert_parallel(x, experts, weights, p, limit, compute)
    return _sum_slots(_slot_outputs(x, experts, weights, p, limit, compute), compute)


def expert_parallel(x: jax.Array, experts: jax.Array, weights: jax.Array, p: ExpertParams,
                    limit: float, compute: ComputeConfig) -> jax.Array:
    """routed_experts with the experts split over the mesh's "dp", "cp" and "ep" axes
    (parallel/mesh.py): each device holds E / (dp x cp x ep) experts and computes the pairs
    routed to them, the others skipped (0).

    Tokens are split over "dp" (inside the step's per-rank map, each rank on its own) and
    over "cp" (inside the layer's per-token map, context parallelism); over both they are
    all-gathered, and each device's slot outputs reduce-scattered back to the tokens' own
    devices. Across "ep" every device
    already has its tokens, and a sum brings the slot outputs together. In every [.., K, D]
    slot output a pair is non-zero on one device only, so these sums are exact, and the K
    slots are added afterwards as on one device: a token's result does not depend on which
    device holds which expert, nor on the mesh, nor on the other devices' tokens."""
    parallel = compute.parallel
    # the token-split axes, manual already here (the step's per-rank map; the layer's
    # per-token map, model/paged_forward.py token_shards)
    gathered = tuple(axis for axis, size in (("dp", parallel.dp), ("cp", parallel.cp))
                     if size > 1)

    def local(x, experts, weights, p):
        for axis in gathered:
            x, experts, weights = (jax.lax.all_gather(a, axis, tiled=True)
                                   for a in (x, experts, weights))
        count = jax.tree.leaves(p)[0].shape[0]            # this device's experts
        first = expert_device(parallel) * count
        mine = (experts >= first) & (experts < first + count)
        local_ids = jnp.where(mine, experts - first, NO_EXPERT)
        per_slot = _slot_outputs(x, local_ids, weights, p, limit, compute)
        if parallel.ep > 1:
            per_slot = exact_sum(jax.lax.psum, per_slot, "ep", compute)
        for axis in reversed(gathered):
            per_slot = exact_sum(functools.partial(jax.lax.psum_scatter, tiled=True),
                                  per_slot, axis, compute)
        return per_slot

    if parallel.ep > 1:
        spec = jax.sharding.PartitionSpec
        local = jax.shard_map(local, in_specs=(spec(), spec(), spec(),
                                               jax.tree.map(lambda _: spec("ep"), p)),
                              out_specs=spec(), axis_names={"ep"}, check_vma=False)
    return _sum_slots(local(x, experts, weights, p), compute)


def expert_device(parallel) -> jax.Array:
    """This device's place among the dp x cp x ep devices that split the routed experts (and
    V4.1's device Engram tables), dp the most significant, as PartitionSpec(("dp", "cp",
    "ep")) orders them; inside a map where those axes (of size > 1) are manual."""
    device = 0
    for axis, size in (("dp", parallel.dp), ("cp", parallel.cp), ("ep", parallel.ep)):
        if size > 1:
            device = device * size + jax.lax.axis_index(axis)
    return device


def exact_sum(collective, x: jax.Array, axis: str, compute: ComputeConfig) -> jax.Array:
    """A summing collective (psum, psum_scatter) of slot outputs that are non-zero on one
    device each: exact in any precision. The CPU formulation sums bf16 in float32 (the same
    bits back): XLA's CPU compiler widens a bf16 all-reduce itself (AllReducePromotion) and
    aborted on one inside a loop whose reduction had become add-then-copy (jax 0.11.2,
    "Invalid binary instruction opcode copy": ep 4 or cp 2 with prefix caching in
    batch-invariant mode)."""
    if compute.formulation == "cpu" and x.dtype == jnp.bfloat16:
        return collective(x.astype(jnp.float32), axis).astype(x.dtype)
    return collective(x, axis)


def _slot_outputs(x: jax.Array, experts: jax.Array, weights: jax.Array, p: ExpertParams,
                  limit: float, compute: ComputeConfig) -> jax.Array:
    """Each (token, slot) pair's weighted expert output, [N, K, D] (0 for skipped pairs)."""
    n_tokens, top_k = experts.shape
    n_experts = p.w13.shape[0]
    flat_expert = jnp.where(experts == NO_EXPERT, n_experts, experts).reshape(-1)   # [N*K]
    # Skipped pairs sort last, past every group (group_sizes does not count them): the grouped
    # GEMM gives them no tile, and their rows of its result are undefined (masked below).
    order = sort_by_expert(flat_expert, n_experts)                       # pairs sorted by expert
    # each pair's place in that order (a permutation's inverse: unique indices)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                 unique_indices=True)
    group_sizes = jnp.bincount(flat_expert, length=n_experts).astype(jnp.int32)
    source_rows, out_order = settled(compute.launch_bound, order // top_k, rank)
    w13, w2, scales = _as_gemm_operands(p, x.dtype)
    out = gemm.expert_mlp(x, w13, w2, group_sizes, limit, **scales,
                          implementation=expert_implementations(compute),
                          source_rows=source_rows, out_order=out_order,
                          invariant=compute.batch_invariant)
    routed = (flat_expert < n_experts)[:, None]
    out = jnp.where(routed, out * weights.reshape(-1)[:, None].astype(out.dtype), 0)  # [N*K, D]
    # Each weighted output rounded to the activations' type before the sum over the K slots,
    # whatever XLA fuses (it may otherwise keep the products in float32 inside the fused sum).
    finfo = jnp.finfo(out.dtype)
    out = jax.lax.reduce_precision(out, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
    return out.reshape(n_tokens, top_k, -1)


def _sum_slots(per_slot: jax.Array, compute: ComputeConfig) -> jax.Array:
    """[N, K, D] weighted slot outputs -> [N, D]."""
    return ordered_sum(per_slot, 1) if compute.batch_invariant else jnp.sum(per_slot, axis=1)


def _as_gemm_operands(p: ExpertParams, dtype):
    """The experts' weights as the grouped GEMM takes them: FP8 ones as codes and block
    scales, FP4 ones (Fp4Blocks) and plain ones as they are."""
    if isinstance(p.w13, Fp8Blocks):
        return p.w13.codes, p.w2.codes, {"w13_scale": p.w13.scale, "w2_scale": p.w2.scale}
    return p.w13, p.w2, {}


def shared_expert(x: jax.Array, p: SharedExpertParams, limit: float,
                  compute: ComputeConfig) -> jax.Array:
    hidden = swiglu(linear(x, p.w13, compute), limit).astype(x.dtype)
    return linear(hidden, p.w2, compute)


def physical_slots(experts: jax.Array, placement: ExpertPlacement) -> jax.Array:
    """Logical experts i32[N, K] -> the physical slots that compute them (NO_EXPERT stays).
    A pair takes replica (pair index mod the expert's replicas): replicas hold the same
    weights and a pair's result is computed on its own, so any choice gives the same numbers;
    spreading by pair index splits a busy expert's pairs evenly over its replicas."""
    n, k = experts.shape
    logical = jnp.maximum(experts, 0)
    pair = jnp.arange(n * k, dtype=jnp.int32).reshape(n, k)
    replica = pair % placement.count[logical]
    slots = jnp.take_along_axis(placement.slots[logical], replica[..., None], axis=-1)[..., 0]
    return jnp.where(experts == NO_EXPERT, NO_EXPERT, slots)


def moe(x: jax.Array, token_ids: jax.Array, p: MoEParams, kind: MlpKind, cfg: ModelConfig,
        compute: ComputeConfig, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., D], token_ids i32[...], valid bool[...] (False: a padding row of the step's
    bucket) -> (out [..., D] (the shared expert's output alone in padding rows), the routed
    experts i32[..., K] (NO_EXPERT in padding rows): the load balancer's counts).

    Padding rows are routed to no expert: they would read experts of their own otherwise (a
    decode step of one request in a 16-token bucket would read about twice the experts'
    weights a layer)."""
    flat = x.reshape(-1, x.shape[-1])
    experts, weights = route(flat, token_ids.reshape(-1), p, kind, cfg, compute)
    if valid is not None:
        keep = valid.reshape(-1, 1)
        experts, weights = jnp.where(keep, experts, NO_EXPERT), jnp.where(keep, weights, 0.0)
    slots = experts if p.placement is None else physical_slots(experts, p.placement)
    out = routed_experts(flat, slots, weights, p.experts, cfg.swiglu_limit, compute)
    if p.shared is not None:
        out = out + shared_expert(flat, p.shared, cfg.swiglu_limit, compute)
    return out.reshape(x.shape), experts.reshape(*x.shape[:-1], -1)
