"""Load a DeepSeek-V4.1 checkpoint (either tensor naming, weights/v41_names.py) into a
V41ModelParams pytree (model/v41/params.py), checking every tensor's shape against the config.

Float tensors, and the release's quantized formats (weights/v41_reader.py): FP8 dense
projections kept as `Fp8Blocks`, FP4 routed experts as `Fp4Blocks` (V4's types,
pallas_kernels/quantized.py; the forward dequantizes a layer's weights as it reaches it), FP8
engram tables dequantized on load. Every problem is collected and raised together, as
`CheckpointError`, like the V4 loader does.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.params import (
    ExpertParams,
    HyperConnectionParams,
    MoEParams,
    SharedExpertParams,
)
from deepinfer_jax.model.v41.params import (
    EngramParams,
    V41AttentionParams,
    V41CompressorParams,
    V41IndexerParams,
    V41LayerParams,
    V41ModelParams,
)
from deepinfer_jax.weights.builder import join_columns, split_groups
from deepinfer_jax.weights.fp4_pad import pad_fp4_experts
from deepinfer_jax.weights.safetensors_io import Checkpoint
from deepinfer_jax.weights.v41_reader import V41Reader
from pallas_kernels import quantized as q


def load_v41_params(path: str | Path, cfg: V41Config, dtype=np.float32,
                    keep_quantized: bool = True, engram_on_host: bool = False,
                    fp4_k_granule: int = 1) -> V41ModelParams:
    """A checkpoint directory -> V41ModelParams on the default device. Norms, mHC
    parameters, sinks, router biases and engram gate weights are float32; the rest `dtype`.

    keep_quantized: FP8 projections and FP4 routed experts stay in their formats
    (`Fp8Blocks` / `Fp4Blocks`); False dequantizes them to `dtype` here (the float twin).
    engram_on_host: the Engram tables stay numpy arrays in host memory, never placed on the
    device (the engine's engram_tables="host", engine/engram_rows.py).
    fp4_k_granule: kept FP4 routed-expert stacks zero-padded, on the host, to an intermediate
    size that is a multiple of it (the engine's ComputeConfig.fp4_expert_granule; 1: as
    stored; weights/fp4_pad.py)."""
    reader = V41Reader(Checkpoint(path), np.dtype(dtype), keep_quantized, cfg.fp8_block)
    params = _build(cfg, reader, fp4_k_granule)
    reader.finish()
    tables = params.engram_tables
    params = jax.device_put(params.replace(engram_tables=()))
    return params.replace(engram_tables=tables if engram_on_host else jax.device_put(tables))


def _build(c: V41Config, r: V41Reader, fp4_k_granule: int = 1) -> V41ModelParams:
    d = c.hidden_size
    embed = r.get("model.embed_tokens.weight", (c.vocab_size, d))
    head = embed.T if c.tie_word_embeddings else r.get("lm_head.weight", (c.vocab_size, d)).T
    tables = ()
    if c.engram is not None:
        tables = tuple(r.table(f"model.engram_tables.{i}.weight", (rows, c.engram.head_dim))
                       for i, rows in zip(c.engram.layer_ids, c.engram.num_embeddings,
                                          strict=True))
    layers = tuple(_layer(c, r, i, fp4_k_granule) for i in range(c.num_layers))
    return V41ModelParams(embed=embed, layers=layers, norm=r.get("model.norm.weight", (d,), True),
                          head=head, engram_tables=tables)


def _linear(r: V41Reader, name: str, out_dim: int, in_dim: int):
    """A reference `[out, in]` weight as the model's `[in, out]` (an array, or Fp8Blocks)."""
    return r.projection(name + ".weight", (out_dim, in_dim))


def _layer(c: V41Config, r: V41Reader, i: int, fp4_k_granule: int) -> V41LayerParams:
    p, d, hc = f"model.layers.{i}.", c.hidden_size, c.hc_mult
    n_mix = (2 + hc) * hc

    def site(name):
        return HyperConnectionParams(fn=r.get(p + name + ".fn", (n_mix, hc * d), True).T,
                                     base=r.get(p + name + ".base", (n_mix,), True),
                                     scale=r.get(p + name + ".scale", (3,), True))
    engram = None
    if c.has_engram(i):
        e = c.engram
        engram = EngramParams(
            wkv=_linear(r, p + "engram.wkv", (hc + 1) * d, e.n_columns * e.head_dim),
            q_weight=r.get(p + "engram.q_weight", (hc, d), True),
            k_weight=r.get(p + "engram.k_weight", (hc, d), True))
    return V41LayerParams(
        attn_norm=r.get(p + "input_layernorm.weight", (d,), True),
        ffn_norm=r.get(p + "post_attention_layernorm.weight", (d,), True),
        attn_hc=site("attn_hc"), ffn_hc=site("ffn_hc"),
        attn=_attention(c, r, i, p + "self_attn."),
        moe=_moe(c, r, p + "mlp.", fp4_k_granule),
        bias_vl=r.get(p + "mlp.gate.e_score_correction_bias_vl", (c.n_routed_experts,), True),
        engram=engram)


def _attention(c: V41Config, r: V41Reader, i: int, p: str) -> V41AttentionParams:
    d, h, hd, rank, g = c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups
    compressor = indexer = None
    if c.is_kv_source(i):
        compressor = V41CompressorParams(
            wkv=_linear(r, p + "compressor.kv_proj", hd, d),
            wgate=(_linear(r, p + "compressor.gate_proj", hd, d)
                   if c.compress_ratios[i] > 1 else None),
            norm=r.get(p + "compressor.kv_norm.weight", (hd,), True))
    if c.is_index_source(i):
        ih, idim = c.index_n_heads, c.index_head_dim
        owns_k = c.is_kv_source(i)
        indexer = V41IndexerParams(
            wq_b=_linear(r, p + "indexer.q_b_proj", ih * idim, rank),
            weights_proj=_linear(r, p + "indexer.weights_proj", ih, d),
            wk=_linear(r, p + "indexer.k_proj", idim, hd) if owns_k else None,
            k_norm=r.get(p + "indexer.k_norm.weight", (idim,), True) if owns_k else None)
    group_in = h * hd // g
    # o_a_proj [G*L, H*hd/G] is group-major: group j's block is rows [j*L, (j+1)*L), so
    # columns [j*L, (j+1)*L) of its [in, out] form.
    wo_a = split_groups(_linear(r, p + "o_a_proj", g * c.o_lora_rank, group_in), g, r.dtype,
                        r.block[0])
    return V41AttentionParams(
        wq_a=_linear(r, p + "q_a_proj", rank, d),
        q_norm=r.get(p + "q_a_norm.weight", (rank,), True),
        wq_b=_linear(r, p + "q_b_proj", h * hd, rank),
        wkv=_linear(r, p + "kv_proj", hd, d),
        kv_norm=r.get(p + "kv_norm.weight", (hd,), True),
        wo_a=wo_a,
        wo_b=_linear(r, p + "o_b_proj", d, g * c.o_lora_rank),
        sinks=r.get(p + "sinks", (h,), True),
        compressor=compressor, indexer=indexer)


def _moe(c: V41Config, r: V41Reader, p: str, fp4_k_granule: int) -> MoEParams:
    d, e, inter = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj") or not r.has(p + "experts.0.w1.weight"):
        experts = ExpertParams(w13=_stacked(r, p + "experts.gate_up_proj", (e, 2 * inter, d)),
                               w2=_stacked(r, p + "experts.down_proj", (e, d, inter)))
    else:        # native names: one tensor per expert and projection, stacked here
        def names(w):
            return [f"{p}experts.{x}.{w}.weight" for x in range(e)]
        experts = ExpertParams(w13=r.experts([names("w1"), names("w3")], (inter, d)),
                               w2=r.experts([names("w2")], (d, inter)))
    # FP4 stacks at I' = a multiple of the chosen kernel's K granule (exact zeros; fp4_pad.py)
    experts = pad_fp4_experts(experts, fp4_k_granule)
    shared = None
    if c.n_shared_experts:
        si = c.shared_intermediate_size
        w1 = _linear(r, p + "shared_experts.gate_proj", si, d)
        w3 = _linear(r, p + "shared_experts.up_proj", si, d)
        shared = SharedExpertParams(w13=join_columns([w1, w3], r.dtype, r.block[0]),
                                    w2=_linear(r, p + "shared_experts.down_proj", d, si))
    return MoEParams(
        gate=_linear(r, p + "gate", e, d),
        bias=r.get(p + "gate.e_score_correction_bias", (e,), True),
        tid2eid=None,
        experts=experts,
        shared=shared)


def _stacked(r: V41Reader, name: str, shape: tuple[int, int, int]):
    """The reference's stacked experts [E, out, in] as [E, in, out]; stored FP4 (packed
    [E, out, in/2], `name`_scale_inv [E, out, in/32]): Fp4Blocks, or dequantized."""
    scale = r.scale_name(name)
    if not (r.has(name) and r.has(scale)):
        return r.get(name, shape).transpose(0, 2, 1)
    e, out_dim, in_dim = shape
    packed = np.zeros((e, out_dim, in_dim // 2), np.uint8)
    scales = np.zeros((e, out_dim, in_dim // q.FP4_GROUP), np.uint8)
    r.fp4_into(name, packed, scales)
    blocks = q.fp4_from_checkpoint(packed, scales)
    return blocks if r.keep_quantized else np.asarray(q.dequantize(blocks, r.dtype))
