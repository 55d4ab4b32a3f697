"""The parameter pytree of a DeepSeek-V4 model.

Layout conventions (why they differ from the checkpoint):
* Every projection is stored `[in, out]` so the model reads `x @ w` (checkpoints store
  `[out, in]`; the loader transposes once).
* Routed experts are stacked per layer: `w13 [E, D, 2I]` holds the gate (w1) and up (w3)
  projections side by side, `w2 [E, I, D]`: the shape a grouped matmul wants.
* `wo_a` is stored per output group `[G, H*hd/G, o_lora]`.
* Projections the release stores quantized may be kept so (pallas_kernels/quantized.py):
  `Fp8Blocks` in the same [in, out] layout (attention, indexer wq_b, shared experts, MTP
  e_proj/h_proj), `Fp4Blocks` for the routed experts (codes as stored: w13 [E, 2I, D/2]
  packed with scales [E, D/32, 2I], w2 [E, D, I/2] with [E, I/32, D]). The shapes below are the
  dequantized ones (`.shape` of either form gives them).
* Norm weights, mHC parameters, sinks, compressor position biases (`ape`) and the router
  selection bias stay float32 whatever the compute dtype, as in the reference.

Shapes use: D hidden, H heads, hd head_dim, R q_lora_rank, G o_groups, L o_lora_rank,
E routed experts, I expert width, K experts per token, hc streams, V vocab,
IH/Id indexer heads/head_dim, m compress rate, c = 2 for overlapped (CSA) compressors else 1.
"""

from __future__ import annotations

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class HyperConnectionParams:
    fn: Array      # f32[hc*D, (2+hc)*hc]  pre | post | comb mixing logits
    base: Array    # f32[(2+hc)*hc]
    scale: Array   # f32[3]                 pre, post, comb
    # fn's three bf16 parts side by side, bf16[hc*D, 3*(2+hc)*hc], made once by the engine
    # for bf16 streams (model/mhc.py with_mix_parts); None: made from fn at each call
    fn_parts: Array | None = None


@struct.dataclass
class HyperHeadParams:
    fn: Array      # f32[hc*D, hc]
    base: Array    # f32[hc]
    scale: Array   # f32[1]
    fn_parts: Array | None = None      # bf16[hc*D, 3*hc], as HyperConnectionParams'


@struct.dataclass
class CompressorParams:
    wkv: Array     # [D, c*d]   projected rows (c halves: previous-block | current-block)
    wgate: Array   # [D, c*d]   per-channel pooling logits
    ape: Array     # f32[m, c*d] learned position bias inside a block
    norm: Array    # f32[d]


@struct.dataclass
class IndexerParams:
    wq_b: Array             # [R, IH*Id]
    weights_proj: Array     # [D, IH]
    compressor: CompressorParams   # overlapped, d = Id


@struct.dataclass
class AttentionParams:
    wq_a: Array        # [D, R]
    q_norm: Array      # f32[R]
    wq_b: Array        # [R, H*hd]
    wkv: Array         # [D, hd]
    kv_norm: Array     # f32[hd]
    wo_a: Array        # [G, H*hd/G, L]
    wo_b: Array        # [G*L, D]
    sinks: Array       # f32[H]
    compressor: CompressorParams | None   # CSA and HCA layers
    indexer: IndexerParams | None         # CSA layers


@struct.dataclass
class ExpertParams:
    w13: Array         # [E, D, 2I]  gate | up
    w2: Array          # [E, I, D]


@struct.dataclass
class SharedExpertParams:
    w13: Array         # [D, 2I']  gate | up   (I' = n_shared * I)
    w2: Array          # [I', D]


@struct.dataclass
class ExpertPlacement:
    """Where each routed (logical) expert lives among the physical expert slots, with the
    load balancer (parallel/eplb.py): data, so a new placement needs no recompile."""

    slots: Array       # i32[E, R]  the physical slots holding each expert (first `count` used)
    count: Array       # i32[E]     its replicas, >= 1


@struct.dataclass
class MoEParams:
    gate: Array                 # [D, E]        router logits
    bias: Array | None          # f32[E]        selection-only bias (routed layers)
    tid2eid: Array | None       # i32[V, K]     token id -> experts (hash layers)
    # [E, ...] stacks; with a placement, [P, ...] physical slots (P = E + redundant replicas)
    experts: ExpertParams
    shared: SharedExpertParams | None
    placement: ExpertPlacement | None = None   # the load balancer's map; None: slot e = expert e


@struct.dataclass
class LayerParams:
    attn_norm: Array            # f32[D]
    ffn_norm: Array             # f32[D]
    attn_hc: HyperConnectionParams
    ffn_hc: HyperConnectionParams
    attn: AttentionParams
    moe: MoEParams


@struct.dataclass
class MTPParams:
    """The next-n block: a window-only layer fed with (token embedding, main hidden streams)."""

    e_proj: Array               # [D, D]
    h_proj: Array               # [D, D]
    enorm: Array                # f32[D]
    hnorm: Array                # f32[D]
    norm: Array                 # f32[D]
    hc_head: HyperHeadParams
    layer: LayerParams
    # With speculative_config.draft_token_map (engine/draft_vocab.py): the drafts come from
    # these V' token ids only, scored by their columns of the LM head.
    draft_ids: Array | None = None      # i32[V']
    draft_head: Array | None = None     # [D, V']  = head[:, draft_ids]


@struct.dataclass
class ModelParams:
    embed: Array                        # [V, D]
    layers: tuple[LayerParams, ...]
    hc_head: HyperHeadParams
    norm: Array                         # f32[D]
    head: Array                         # [D, V]
    mtp: tuple[MTPParams, ...]          # empty when the checkpoint carries no MTP weights
