"""Load a DeepSeek-V4.1 checkpoint (either tensor naming, weights/v41_names.py) into a
V41ModelParams pytree (model/v41/params.py), checking every tensor's shape against the config.

Plain float tensors only, plus FP8 engram tables with their per-32-channel scales (dequantized
on load); the release's other quantized formats (FP8 projections, FP4 routed experts) are
refused by name: loading them is later work. Every problem is collected and raised together,
as `CheckpointError`, like the V4 loader does.
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
from deepinfer_jax.weights.safetensors_io import Checkpoint
from deepinfer_jax.weights.sources import CheckpointError
from deepinfer_jax.weights.v41_names import reference_name

_FLOAT_KINDS = frozenset({"F16", "BF16", "F32", "F64"})
_TABLE_SCALE_BLOCK = 32          # engram tables: one scale per row per 32 channels


def load_v41_params(path: str | Path, cfg: V41Config, dtype=np.float32) -> V41ModelParams:
    """A checkpoint directory -> V41ModelParams on the default device. Norms, mHC
    parameters, sinks, router biases and engram gate weights are float32; the rest `dtype`."""
    reader = _Reader(Checkpoint(path), np.dtype(dtype))
    params = _build(cfg, reader)
    reader.finish()
    return jax.device_put(params)


def v41_weight_elements(path: str | Path) -> int:
    """The elements of the text model's tensors in a checkpoint (block scales and ignored
    tensors left out), read from the files' headers: what `load_v41_params` will hold."""
    ckpt = Checkpoint(path)
    total = 0
    for key in ckpt.keys():
        name = reference_name(key)
        if name is not None and not name.endswith("_scale_inv"):
            total += int(np.prod(ckpt.shape(key)))
    return total


class _Reader:
    def __init__(self, ckpt: Checkpoint, dtype: np.dtype):
        self.ckpt, self.dtype = ckpt, dtype
        self.by_name: dict[str, str] = {}
        for key in ckpt.keys():
            name = reference_name(key)
            if name is None:
                continue
            if name in self.by_name:
                raise CheckpointError(f"{key} and {self.by_name[name]} name the same tensor {name}")
            self.by_name[name] = key
        self.used: set[str] = set()
        self.problems: dict[str, list[str]] = {"missing": [], "mis-shaped": [], "invalid": []}

    def has(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str, shape: tuple[int, ...], f32: bool = False) -> np.ndarray:
        """Tensor `name` checked to be `shape` (the checkpoint's layout), as float32 or dtype."""
        out_dtype = np.float32 if f32 else self.dtype
        key = self.by_name.get(name)
        if key is None:
            self.problems["missing"].append(name)
            return np.zeros(shape, out_dtype)
        self.used.add(name)
        kind = self.ckpt.dtype_name(key)
        scale = name.removesuffix("weight") + "weight_scale_inv"
        if scale in self.by_name or kind not in _FLOAT_KINDS:
            self.problems["invalid"].append(
                f"{name}: stored as {kind}{' with a scale' if scale in self.by_name else ''}; "
                f"quantized V4.1 tensors other than the engram tables are not supported yet")
            self.used.add(scale)
            return np.zeros(shape, out_dtype)
        return self._checked(name, self.ckpt.get(key), shape, out_dtype)

    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """An engram table: float, or FP8 E4M3 rows with one scale per 32 channels."""
        key, scale_name = self.by_name.get(name), name + "_scale_inv"
        if key is None:
            return self.get(name, shape)      # noted as missing
        if self.ckpt.dtype_name(key) in _FLOAT_KINDS:
            self.used.update({name, scale_name} & set(self.by_name))  # the scale: FP8 only
            return self._checked(name, self.ckpt.get(key), shape, self.dtype)
        self.used.update({name, scale_name})
        kind = self.ckpt.dtype_name(key)
        if kind != "F8_E4M3" or scale_name not in self.by_name:
            self.problems["invalid"].append(f"{name}: stored as {kind}, expected a float table "
                                            f"or F8_E4M3 with a weight_scale_inv")
            return np.zeros(shape, self.dtype)
        codes = self._checked(name, self.ckpt.get(key), shape, np.float32)
        blocks = (shape[0], -(-shape[1] // _TABLE_SCALE_BLOCK))
        scale = self._checked(scale_name, self.ckpt.get(self.by_name[scale_name]), blocks,
                              np.float32)
        scale = np.repeat(scale, _TABLE_SCALE_BLOCK, axis=1)[:, : shape[1]]
        return (codes * scale).astype(self.dtype)

    def _checked(self, name, array, shape, out_dtype) -> np.ndarray:
        if array.shape != tuple(shape):
            self.problems["mis-shaped"].append(f"{name}: found shape {array.shape}, "
                                               f"expected {tuple(shape)}")
            return np.zeros(shape, out_dtype)
        array = np.asarray(array, np.float32)
        if not np.isfinite(array).all():
            self.problems["invalid"].append(f"{name}: NaN or inf values")
        return array.astype(out_dtype)

    def finish(self) -> None:
        lists = {**self.problems, "unexpected": sorted(set(self.by_name) - self.used)}
        text = [f"{len(v)} {k} tensor(s):\n  " + "\n  ".join(v[:40])
                + (f"\n  ... and {len(v) - 40} more" if len(v) > 40 else "")
                for k, v in lists.items() if v]
        if text:
            raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(text))


def _build(c: V41Config, r: _Reader) -> V41ModelParams:
    d = c.hidden_size
    embed = r.get("model.embed_tokens.weight", (c.vocab_size, d))
    head = embed.T if c.tie_word_embeddings else r.get("lm_head.weight", (c.vocab_size, d)).T
    tables = ()
    if c.engram is not None:
        tables = tuple(r.table(f"model.engram_tables.{i}.weight", (rows, c.engram.head_dim))
                       for i, rows in zip(c.engram.layer_ids, c.engram.num_embeddings,
                                          strict=True))
    layers = tuple(_layer(c, r, i) for i in range(c.num_layers))
    return V41ModelParams(embed=embed, layers=layers, norm=r.get("model.norm.weight", (d,), True),
                          head=head, engram_tables=tables)


def _linear(r: _Reader, name: str, out_dim: int, in_dim: int) -> np.ndarray:
    """A reference `[out, in]` weight as the model's `[in, out]`."""
    return r.get(name + ".weight", (out_dim, in_dim)).T


def _layer(c: V41Config, r: _Reader, i: int) -> V41LayerParams:
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
        moe=_moe(c, r, p + "mlp."),
        bias_vl=r.get(p + "mlp.gate.e_score_correction_bias_vl", (c.n_routed_experts,), True),
        engram=engram)


def _attention(c: V41Config, r: _Reader, i: int, p: str) -> V41AttentionParams:
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
    # o_a_proj [G*L, H*hd/G] is group-major: group j's block is rows [j*L, (j+1)*L).
    wo_a = r.get(p + "o_a_proj.weight", (g * c.o_lora_rank, group_in))
    return V41AttentionParams(
        wq_a=_linear(r, p + "q_a_proj", rank, d),
        q_norm=r.get(p + "q_a_norm.weight", (rank,), True),
        wq_b=_linear(r, p + "q_b_proj", h * hd, rank),
        wkv=_linear(r, p + "kv_proj", hd, d),
        kv_norm=r.get(p + "kv_norm.weight", (hd,), True),
        wo_a=wo_a.reshape(g, c.o_lora_rank, group_in).transpose(0, 2, 1),
        wo_b=_linear(r, p + "o_b_proj", d, g * c.o_lora_rank),
        sinks=r.get(p + "sinks", (h,), True),
        compressor=compressor, indexer=indexer)


def _moe(c: V41Config, r: _Reader, p: str) -> MoEParams:
    d, e, inter = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj") or not r.has(p + "experts.0.w1.weight"):
        w13 = r.get(p + "experts.gate_up_proj", (e, 2 * inter, d))
        w2 = r.get(p + "experts.down_proj", (e, d, inter))
    else:        # native names: one tensor per expert and projection, stacked here
        def stack(w, shape):
            return np.stack([r.get(f"{p}experts.{x}.{w}.weight", shape) for x in range(e)])
        w13 = np.concatenate([stack("w1", (inter, d)), stack("w3", (inter, d))], axis=1)
        w2 = stack("w2", (d, inter))
    shared = None
    if c.n_shared_experts:
        si = c.shared_intermediate_size
        w1 = _linear(r, p + "shared_experts.gate_proj", si, d)
        w3 = _linear(r, p + "shared_experts.up_proj", si, d)
        shared = SharedExpertParams(w13=np.concatenate([w1, w3], axis=1),
                                    w2=_linear(r, p + "shared_experts.down_proj", d, si))
    return MoEParams(
        gate=_linear(r, p + "gate", e, d),
        bias=r.get(p + "gate.e_score_correction_bias", (e,), True),
        tid2eid=None,
        experts=ExpertParams(w13=w13.transpose(0, 2, 1), w2=w2.transpose(0, 2, 1)),
        shared=shared)
