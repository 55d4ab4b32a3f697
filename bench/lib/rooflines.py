"""bench/e2e.py's yardsticks: the work a step must do (weights and cache rows read at decode,
FLOPs at prefill, the LM head once per sequence), and the FP4 kernel's candidate defaults."""

from __future__ import annotations

import dataclasses
import math

import jax

from deepinfer_jax.config.model import AttentionKind, ModelConfig
from pallas_kernels.quantized import is_quantized, nbytes


def weight_counts(params, cfg: ModelConfig) -> dict:
    """Parameters (dequantized elements, for FLOPs) and stored bytes, each for the dense
    weights (read every step; the embedding table excluded, it is gathered) and one routed
    expert of one layer."""
    def elements(w):
        return math.prod(w.shape)

    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    experts = [w for layer in params.layers for w in (layer.moe.experts.w13, layer.moe.experts.w2)]
    per_layer_experts = cfg.num_layers * cfg.n_routed_experts
    return {"dense": sum(map(elements, leaves)) - sum(map(elements, experts)) - params.embed.size,
            "head": elements(params.head),
            "per_expert": sum(map(elements, experts)) // per_layer_experts,
            "dense_bytes": sum(map(nbytes, leaves)) - sum(map(nbytes, experts))
            - nbytes(params.embed),
            "per_expert_bytes": sum(map(nbytes, experts)) // per_layer_experts}


def rows_read(cfg: ModelConfig, kind: AttentionKind, position: int) -> tuple[int, int]:
    """(attention rows of head_dim, indexer key rows of index_head_dim) a token reads."""
    window = min(cfg.sliding_window, position + 1)
    if kind is AttentionKind.CSA:
        compressed = position // cfg.compress_rate(kind)
        return window + min(cfg.index_topk, compressed), compressed
    if kind is AttentionKind.HCA:
        return window + position // cfg.compress_rate(kind), 0
    return window, 0


def decode_roofline(counts: dict, cfg: ModelConfig, batch: int, context: int,
                    copy_tbps: float) -> dict:
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = experts * (1 - (1 - k / experts) ** batch)
    weight_bytes = counts["dense_bytes"] + cfg.num_layers * hit * counts["per_expert_bytes"]
    cache_bytes = 0
    for kind in cfg.layer_types:
        attn, index = rows_read(cfg, kind, context)
        cache_bytes += batch * 2 * (attn * cfg.head_dim + index * cfg.index_head_dim)
    seconds = (weight_bytes + cache_bytes) / (copy_tbps * 1e12)
    return {"bytes_per_step": weight_bytes + cache_bytes, "tokens_per_s": batch / seconds}


def mesh_weight_counts(params, cfg: ModelConfig, expert_ranks: int) -> dict:
    """weight_counts of the model a plain step runs (the MTP block left out: only the
    speculative step reads it), and what one device of the mesh holds of it: its shard of
    every weight but the routed experts and the embedding (`device_dense_bytes`) and its
    share of each layer's experts (`local_experts`, the placement's split over dp x cp x ep)."""
    plain = params.replace(mtp=())
    counts = weight_counts(plain, cfg)
    experts = {id(leaf) for layer in plain.layers
               for w in (layer.moe.experts.w13, layer.moe.experts.w2) for leaf in jax.tree.leaves(w)}
    embed = {id(leaf) for leaf in jax.tree.leaves(plain.embed)}
    shard_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(plain)
                      if id(leaf) not in experts and id(leaf) not in embed)
    return counts | {"device_dense_bytes": shard_bytes,
                     "local_experts": cfg.n_routed_experts // expert_ranks}


def mesh_decode_roofline(counts: dict, cfg: ModelConfig, rank_batch: int, total_batch: int,
                         context: int, copy_tbps: float) -> dict:
    """One device's decode step (counts: mesh_weight_counts): its dense share, the experts of
    its share that the step's total_batch tokens hit (every rank's tokens reach every
    device's experts; uniform routing), and its rank's rank_batch requests' cache rows (every
    device of a rank reads them: tp splits heads, not the one shared K=V row)."""
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = counts["local_experts"] * (1 - (1 - k / experts) ** total_batch)
    weight_bytes = (counts["device_dense_bytes"]
                    + cfg.num_layers * hit * counts["per_expert_bytes"])
    cache_bytes = 0
    for kind in cfg.layer_types:
        attn, index = rows_read(cfg, kind, context)
        cache_bytes += rank_batch * 2 * (attn * cfg.head_dim + index * cfg.index_head_dim)
    total = weight_bytes + cache_bytes
    return {"bytes_per_step": total, "seconds": total / (copy_tbps * 1e12)}


def prefill_roofline(counts: dict, cfg: ModelConfig, length: int, matmul_tflops: float) -> dict:
    """The FLOPs a prefill must do: every layer for every token, the LM head once (the step
    projects only the row it samples)."""
    active = (counts["dense"] - counts["head"]
              + cfg.num_layers * cfg.num_experts_per_tok * counts["per_expert"])
    flops = 2 * active * length + 2 * counts["head"]
    for position in range(0, length, 64):            # attention, sampled every 64 positions
        for kind in cfg.layer_types:
            attn, index = rows_read(cfg, kind, position)
            flops += 64 * (4 * cfg.num_heads * cfg.head_dim * attn
                           + 2 * cfg.index_n_heads * cfg.index_head_dim * index)
    return {"flops": flops, "tokens_per_s": length / (flops / (matmul_tflops * 1e12))}



def override_fp4_defaults(fields: dict[str, str]) -> None:
    """The FP4 kernel's compiled default configs with `fields` set (before anything compiles)."""
    from pallas_kernels.grouped_gemm import fp4_path
    plain = fp4_path.default_config
    changes = {name: int(value) for name, value in fields.items()}

    def changed(*args, **kwargs):
        config = plain(*args, **kwargs)
        return dataclasses.replace(config, **changes) if config.a_in_registers else config
    fp4_path.default_config = changed
