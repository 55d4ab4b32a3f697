"""Build a ModelParams pytree from any source of named tensors, in the checkpoint's layout.

The builder knows every tensor's official name and `[out, in]` shape and converts it to the
model's layout; a `TensorSource` supplies the tensors: `CheckpointSource` reads (and checks)
a safetensors checkpoint, `RandomSource` draws them on the device for benchmarks. One
description of the model's tensors therefore serves both.

Projections come from the source already in the model's `[in, out]` layout, as plain arrays
or, where the release stores them quantized and the source keeps them so, as `Fp8Blocks`
(dense projections) and `Fp4Blocks` (routed experts); the few re-layouts below (grouping
wo_a, joining gate and up) keep the quantized forms where the 128 x 128 scale blocks allow
and dequantize otherwise (only tiny test models, whose widths are not multiples of 128).
The source places each finished layer on the device (`place`), so a checkpoint is never
held whole on the host.
"""

from __future__ import annotations

import enum
from typing import Protocol

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.model.params import (
    AttentionParams,
    CompressorParams,
    ExpertParams,
    HyperConnectionParams,
    HyperHeadParams,
    IndexerParams,
    LayerParams,
    ModelParams,
    MoEParams,
    MTPParams,
    SharedExpertParams,
)
from pallas_kernels.quantized import FP8_BLOCK, Fp8Blocks, dequantize


class Role(enum.Enum):
    """What a tensor is: decides its dtype and how a random source initialises it."""

    LINEAR = "linear"     # [out, in] projection, compute dtype
    EMBED = "embed"       # [V, D], compute dtype
    NORM = "norm"         # RMSNorm weight, f32, ones
    MIX = "mix"           # mHC mixing matrix, f32, small normal
    ZEROS = "zeros"       # f32 biases, sinks, position biases
    ONES = "ones"         # f32 scales
    TABLE = "table"       # i32 token -> experts table


class TensorSource(Protocol):
    dtype: object       # the compute dtype of plain projections

    def tensor(self, name: str, shape: tuple[int, ...], role: Role): ...

    def projection(self, name: str, shape: tuple[int, int], released_fp8: bool):
        """The `[out, in]` tensor `name` as [in, out]: an array, or Fp8Blocks where the source
        keeps FP8 (released_fp8: whether the release stores this projection in FP8)."""

    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        """Per expert e the tensors names[j][e] (each [out, in]) joined along out, stacked:
        [E, in, J*out], or Fp4Blocks [E, J*out, in/2] (or Fp8Blocks) where kept quantized."""

    def has_prefix(self, prefix: str) -> bool: ...

    def place(self, tree): ...


def _xp(array):
    return np if isinstance(array, np.ndarray) else jnp


def _concat(arrays, axis):
    return _xp(arrays[0]).concatenate(arrays, axis=axis)


def _whole_blocks(block: int, *sizes: int) -> bool:
    return all(size % block == 0 for size in sizes)


def join_columns(ws: list, dtype, block: int = FP8_BLOCK):
    """[K, N_j] projections side by side -> [K, sum N_j]; FP8 ones stay FP8 when each part
    is whole `block`-column blocks (the scale blocks then do not straddle two parts)."""
    if all(isinstance(w, Fp8Blocks) for w in ws) and _whole_blocks(block, *(w.shape[1] for w in ws)):
        return Fp8Blocks(_concat([w.codes for w in ws], 1), _concat([w.scale for w in ws], 1))
    return _concat([dequantize(w, dtype) for w in ws], 1)


def split_groups(w, groups: int, dtype, block: int = FP8_BLOCK):
    """[K, G*L] -> [G, K, L] (columns g*L ... g*L + L - 1 to group g). An FP8 weight (scale
    blocks `block` columns wide) stays FP8 where each group's columns share whole scale
    blocks or lie inside one."""
    k, n = w.shape
    width = n // groups
    if not isinstance(w, Fp8Blocks):
        return w.reshape(k, groups, width).transpose(1, 0, 2)
    codes = w.codes.reshape(k, groups, width).transpose(1, 0, 2)
    if width % block == 0:
        blocks = w.scale.shape[0]
        return Fp8Blocks(codes, w.scale.reshape(blocks, groups, -1).transpose(1, 0, 2))
    if block % width == 0:
        block_of_group = np.arange(groups) * width // block
        return Fp8Blocks(codes, w.scale[:, block_of_group].T[:, :, None])
    return split_groups(dequantize(w, dtype), groups, dtype, block)


class _Builder:
    def __init__(self, cfg: ModelConfig, src: TensorSource):
        self.cfg, self.src = cfg, src

    def linear(self, name: str, out_dim: int, in_dim: int, released_fp8: bool = False):
        """A projection stored [in, out] for `x @ w`."""
        return self.src.projection(name + ".weight", (out_dim, in_dim), released_fp8)

    def norm(self, name: str, dim: int):
        return self.src.tensor(name + ".weight", (dim,), Role.NORM)

    def model(self) -> ModelParams:
        c, src = self.cfg, self.src
        embed = src.place(src.tensor("embed.weight", (c.vocab_size, c.hidden_size), Role.EMBED))
        head = embed.T if c.tie_word_embeddings else self.linear("head", c.vocab_size, c.hidden_size)
        head = src.place(head)
        layers = tuple(src.place(self.layer(f"layers.{i}.", c.layer_types[i], c.mlp_types[i]))
                       for i in range(c.num_layers))
        mtp = tuple(src.place(self.mtp(f"mtp.{j}.")) for j in range(c.num_mtp_layers)
                    if src.has_prefix(f"mtp.{j}."))
        return ModelParams(embed=embed, layers=layers, hc_head=src.place(self.hc_head("")),
                           norm=src.place(self.norm("norm", c.hidden_size)), head=head, mtp=mtp)

    def hc_head(self, prefix: str) -> HyperHeadParams:
        hc, d = self.cfg.hc_mult, self.cfg.hidden_size
        return HyperHeadParams(
            fn=self.src.tensor(prefix + "hc_head_fn", (hc, hc * d), Role.MIX).T,
            base=self.src.tensor(prefix + "hc_head_base", (hc,), Role.ZEROS),
            scale=self.src.tensor(prefix + "hc_head_scale", (1,), Role.ONES))

    def hyper_connection(self, prefix: str) -> HyperConnectionParams:
        hc, d = self.cfg.hc_mult, self.cfg.hidden_size
        n_mix = (2 + hc) * hc
        return HyperConnectionParams(
            fn=self.src.tensor(prefix + "_fn", (n_mix, hc * d), Role.MIX).T,
            base=self.src.tensor(prefix + "_base", (n_mix,), Role.ZEROS),
            scale=self.src.tensor(prefix + "_scale", (3,), Role.ONES))

    def layer(self, prefix: str, kind: AttentionKind, mlp_kind: MlpKind) -> LayerParams:
        d = self.cfg.hidden_size
        return LayerParams(
            attn_norm=self.norm(prefix + "attn_norm", d),
            ffn_norm=self.norm(prefix + "ffn_norm", d),
            attn_hc=self.hyper_connection(prefix + "hc_attn"),
            ffn_hc=self.hyper_connection(prefix + "hc_ffn"),
            attn=self.attention(prefix + "attn.", kind),
            moe=self.moe(prefix + "ffn.", mlp_kind))

    def attention(self, prefix: str, kind: AttentionKind) -> AttentionParams:
        c = self.cfg
        d, h, hd, r = c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank
        group_in = h * hd // c.o_groups
        wo_a = self.linear(prefix + "wo_a", c.o_groups * c.o_lora_rank, group_in, True)
        compressor = indexer = None
        if kind is not AttentionKind.SLIDING:
            compressor = self.compressor(prefix + "compressor.", c.compress_rate(kind),
                                         kind is AttentionKind.CSA, hd)
        if kind is AttentionKind.CSA:
            ih, idim = c.index_n_heads, c.index_head_dim
            indexer = IndexerParams(
                wq_b=self.linear(prefix + "indexer.wq_b", ih * idim, r, True),
                weights_proj=self.linear(prefix + "indexer.weights_proj", ih, d),
                compressor=self.compressor(prefix + "indexer.compressor.", c.compress_rate_csa,
                                           True, idim))
        return AttentionParams(
            wq_a=self.linear(prefix + "wq_a", r, d, True),
            q_norm=self.norm(prefix + "q_norm", r),
            wq_b=self.linear(prefix + "wq_b", h * hd, r, True),
            wkv=self.linear(prefix + "wkv", hd, d, True),
            kv_norm=self.norm(prefix + "kv_norm", hd),
            wo_a=split_groups(wo_a, c.o_groups, self.src.dtype),
            wo_b=self.linear(prefix + "wo_b", d, c.o_groups * c.o_lora_rank, True),
            sinks=self.src.tensor(prefix + "attn_sink", (h,), Role.ZEROS),
            compressor=compressor, indexer=indexer)

    def compressor(self, prefix: str, rate: int, overlap: bool, dim: int) -> CompressorParams:
        width = (2 if overlap else 1) * dim
        d = self.cfg.hidden_size
        return CompressorParams(
            wkv=self.linear(prefix + "wkv", width, d),
            wgate=self.linear(prefix + "wgate", width, d),
            ape=self.src.tensor(prefix + "ape", (rate, width), Role.ZEROS),
            norm=self.norm(prefix + "norm", dim))

    def moe(self, prefix: str, kind: MlpKind) -> MoEParams:
        c = self.cfg
        d, e, i = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
        names = lambda w: [f"{prefix}experts.{x}.{w}.weight" for x in range(e)]  # noqa: E731
        experts = ExpertParams(w13=self.src.experts([names("w1"), names("w3")], (i, d)),
                               w2=self.src.experts([names("w2")], (d, i)))
        shared = None
        if c.n_shared_experts:
            si = c.shared_intermediate_size
            s1 = self.linear(prefix + "shared_experts.w1", si, d, True)
            s3 = self.linear(prefix + "shared_experts.w3", si, d, True)
            shared = SharedExpertParams(w13=join_columns([s1, s3], self.src.dtype),
                                        w2=self.linear(prefix + "shared_experts.w2", d, si, True))
        routed = kind is MlpKind.MOE
        return MoEParams(
            gate=self.linear(prefix + "gate", e, d),
            bias=self.src.tensor(prefix + "gate.bias", (e,), Role.ZEROS) if routed else None,
            tid2eid=None if routed else self.src.tensor(prefix + "gate.tid2eid",
                                                        (c.vocab_size, c.num_experts_per_tok),
                                                        Role.TABLE),
            experts=experts, shared=shared)

    def mtp(self, prefix: str) -> MTPParams:
        d = self.cfg.hidden_size
        return MTPParams(
            e_proj=self.linear(prefix + "e_proj", d, d, True),
            h_proj=self.linear(prefix + "h_proj", d, d, True),
            enorm=self.norm(prefix + "enorm", d),
            hnorm=self.norm(prefix + "hnorm", d),
            norm=self.norm(prefix + "norm", d),
            hc_head=self.hc_head(prefix),
            layer=self.layer(prefix, AttentionKind.SLIDING, MlpKind.MOE))


def build_params(cfg: ModelConfig, src: TensorSource) -> ModelParams:
    return _Builder(cfg, src).model()
