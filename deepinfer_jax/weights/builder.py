"""Build a ModelParams pytree from any source of named tensors, in the checkpoint's layout.

The builder knows every tensor's official name and `[out, in]` shape and converts it to the
model's layout; a `TensorSource` supplies the tensors: `CheckpointSource` reads (and checks)
a safetensors checkpoint, `RandomSource` draws them on the device for benchmarks. One
description of the model's tensors therefore serves both.
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
    def tensor(self, name: str, shape: tuple[int, ...], role: Role): ...

    def stacked(self, names: list[str], shape: tuple[int, ...], role: Role): ...

    def has_prefix(self, prefix: str) -> bool: ...


def _xp(array):
    return np if isinstance(array, np.ndarray) else jnp


def _concat(arrays, axis):
    return _xp(arrays[0]).concatenate(arrays, axis=axis)


class _Builder:
    def __init__(self, cfg: ModelConfig, src: TensorSource):
        self.cfg, self.src = cfg, src

    def linear(self, name: str, out_dim: int, in_dim: int):
        """A projection stored [in, out] for `x @ w`."""
        return self.src.tensor(name + ".weight", (out_dim, in_dim), Role.LINEAR).T

    def norm(self, name: str, dim: int):
        return self.src.tensor(name + ".weight", (dim,), Role.NORM)

    def model(self) -> ModelParams:
        c, src = self.cfg, self.src
        embed = src.tensor("embed.weight", (c.vocab_size, c.hidden_size), Role.EMBED)
        head = embed.T if c.tie_word_embeddings else self.linear("head", c.vocab_size, c.hidden_size)
        layers = tuple(self.layer(f"layers.{i}.", c.layer_types[i], c.mlp_types[i])
                       for i in range(c.num_layers))
        mtp = tuple(self.mtp(f"mtp.{j}.") for j in range(c.num_mtp_layers)
                    if src.has_prefix(f"mtp.{j}."))
        return ModelParams(embed=embed, layers=layers, hc_head=self.hc_head(""),
                           norm=self.norm("norm", c.hidden_size), head=head, mtp=mtp)

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
        wo_a = self.src.tensor(prefix + "wo_a.weight", (c.o_groups * c.o_lora_rank, group_in),
                               Role.LINEAR)
        compressor = indexer = None
        if kind is not AttentionKind.SLIDING:
            compressor = self.compressor(prefix + "compressor.", c.compress_rate(kind),
                                         kind is AttentionKind.CSA, hd)
        if kind is AttentionKind.CSA:
            ih, idim = c.index_n_heads, c.index_head_dim
            indexer = IndexerParams(
                wq_b=self.linear(prefix + "indexer.wq_b", ih * idim, r),
                weights_proj=self.linear(prefix + "indexer.weights_proj", ih, d),
                compressor=self.compressor(prefix + "indexer.compressor.", c.compress_rate_csa,
                                           True, idim))
        return AttentionParams(
            wq_a=self.linear(prefix + "wq_a", r, d),
            q_norm=self.norm(prefix + "q_norm", r),
            wq_b=self.linear(prefix + "wq_b", h * hd, r),
            wkv=self.linear(prefix + "wkv", hd, d),
            kv_norm=self.norm(prefix + "kv_norm", hd),
            wo_a=wo_a.reshape(c.o_groups, c.o_lora_rank, group_in).transpose(0, 2, 1),
            wo_b=self.linear(prefix + "wo_b", d, c.o_groups * c.o_lora_rank),
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
        w1 = self.src.stacked(names("w1"), (i, d), Role.LINEAR)               # [E, I, D]
        w3 = self.src.stacked(names("w3"), (i, d), Role.LINEAR)
        w2 = self.src.stacked(names("w2"), (d, i), Role.LINEAR)               # [E, D, I]
        experts = ExpertParams(w13=_concat([w1, w3], 1).transpose(0, 2, 1), w2=w2.transpose(0, 2, 1))
        shared = None
        if c.n_shared_experts:
            si = c.shared_intermediate_size
            s1 = self.src.tensor(prefix + "shared_experts.w1.weight", (si, d), Role.LINEAR)
            s3 = self.src.tensor(prefix + "shared_experts.w3.weight", (si, d), Role.LINEAR)
            shared = SharedExpertParams(w13=_concat([s1, s3], 0).T,
                                        w2=self.linear(prefix + "shared_experts.w2", d, si))
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
            e_proj=self.linear(prefix + "e_proj", d, d),
            h_proj=self.linear(prefix + "h_proj", d, d),
            enorm=self.norm(prefix + "enorm", d),
            hnorm=self.norm(prefix + "hnorm", d),
            norm=self.norm(prefix + "norm", d),
            hc_head=self.hc_head(prefix),
            layer=self.layer(prefix, AttentionKind.SLIDING, MlpKind.MOE))


def build_params(cfg: ModelConfig, src: TensorSource) -> ModelParams:
    return _Builder(cfg, src).model()
