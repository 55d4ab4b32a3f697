"""The parameter pytree of a DeepSeek-V4.1 model (config/v41.py).

Same layout conventions as V4's (model/params.py): projections `[in, out]` so the model reads
`x @ w`; routed experts stacked `w13 [E, D, 2I]` (gate | up) and `w2 [E, I, D]`; `wo_a` per
output group `[G, H*hd/G, L]`; norms, mHC parameters, sinks and router biases float32. The mHC
sites, experts and router reuse V4's pytrees; what is V4.1's own is below.

Shapes use: D hidden, H heads, hd head_dim, R q_lora_rank, G o_groups, L o_lora_rank, E routed
experts, IH/Id indexer heads/head_dim, hc streams, V vocab, C engram columns
((max_ngram - 1) * engram heads), ed engram head_dim, N_l engram table rows of layer l.
"""

from __future__ import annotations

import jax
from flax import struct

from deepinfer_jax.model.params import HyperConnectionParams, MoEParams

Array = jax.Array


@struct.dataclass
class V41CompressorParams:
    """KV sources only: one latent per group of `ratio` live tokens (per token at ratio 1)."""

    wkv: Array                  # [D, hd]
    wgate: Array | None         # [D, hd]   per-channel pooling logits (ratio > 1 only)
    norm: Array                 # f32[hd]


@struct.dataclass
class V41IndexerParams:
    """Index sources only; the keys (`wk`, `k_norm`) only where the layer is also a KV source."""

    wq_b: Array                 # [R, IH*Id]
    weights_proj: Array         # [D, IH]
    wk: Array | None            # [hd, Id]
    k_norm: Array | None        # f32[Id]


@struct.dataclass
class V41AttentionParams:
    wq_a: Array                 # [D, R]
    q_norm: Array               # f32[R]
    wq_b: Array                 # [R, H*hd]
    wkv: Array                  # [D, hd]
    kv_norm: Array              # f32[hd]
    wo_a: Array                 # [G, H*hd/G, L]
    wo_b: Array                 # [G*L, D]
    sinks: Array                # f32[H]
    compressor: V41CompressorParams | None
    indexer: V41IndexerParams | None


@struct.dataclass
class EngramParams:
    wkv: Array                  # [C*ed, (hc+1)*D]   hc keys, then one value
    q_weight: Array             # f32[hc, D]          only q_weight * k_weight is ever used
    k_weight: Array             # f32[hc, D]


@struct.dataclass
class V41LayerParams:
    attn_norm: Array            # f32[D]
    ffn_norm: Array             # f32[D]
    attn_hc: HyperConnectionParams
    ffn_hc: HyperConnectionParams
    attn: V41AttentionParams
    moe: MoEParams              # routed (bias = the selection bias), tid2eid None
    bias_vl: Array              # f32[E]   selection bias on image-span tokens (unused by text)
    engram: EngramParams | None


@struct.dataclass
class V41ModelParams:
    embed: Array                        # [V, D]
    layers: tuple[V41LayerParams, ...]
    norm: Array                         # f32[D]
    head: Array                         # [D, V]
    engram_tables: tuple[Array, ...]    # [N_l, ed] per engram layer, in engram.layer_ids order
    # where the step hashes (StepConfig.engram_lookback): every token's hash products as
    # 32-bit words (engram_hash.product_words), set by the engine at start-up
    engram_products: Array | None = None    # u32[V, L_e, max_ngram, 2]
