"""What DeepSeek-V4.1's paged state costs (model/v41/state.py), as V4's `memory.py` counts
V4's: per page across the layers, and per slot. Pure Python: no jax. The formats are the
reference's quantized ones, so the byte counts do not depend on the compute dtype:

* per page: each KV source's `page_size // ratio` compressed entries (FP4 codes, one byte per
  channel while unpacked, plus one e4m3 scale per 16 channels) and, at an index source, as
  many indexer keys (one byte per channel plus one ue8m0 scale per 32); consumer layers
  share their source's pages and add nothing;
* per slot: every layer's window ring (`sliding_window + spare` rows of e4m3 codes plus one
  ue8m0 scale per 32 channels), each ratio > 1 source's two open-group rings (float32 kv and
  gate logits, `ratio + spare` rows), the sampler's vocabulary rows and last token.

tests/model/test_v41_state.py checks these against `init_v41_state`'s real pytree. The Engram
tables are weights, not state: `v41_weight_bytes` counts them with the other weights, in the
formats the loader keeps (weights/v41.py), which tests/weights/test_v41_quantized.py checks
against a loaded pytree's bytes; with the tables in host memory (engram_tables="host") they
are counted apart (`engram_table_bytes`, host memory) and the device holds instead each
step's gathered rows, an input of the step (`engram_rows_bytes`, with the activations).
"""

from __future__ import annotations

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config

WINDOW_BLOCK = 32      # FP8 window K=V: channels per ue8m0 scale
ENTRY_BLOCK = 16       # FP4 compressed entries: channels per e4m3 scale
KEY_BLOCK = 32         # FP4 indexer keys: channels per ue8m0 scale
_CODE, _F32, _I32 = 1, 4, 4


def entry_bytes(cfg: V41Config) -> int:
    """One compressed entry: FP4 codes (a byte each) and its e4m3 block scales."""
    return cfg.head_dim * _CODE + cfg.head_dim // ENTRY_BLOCK


def index_key_bytes(cfg: V41Config) -> int:
    return cfg.index_head_dim * _CODE + cfg.index_head_dim // KEY_BLOCK


def window_row_bytes(cfg: V41Config) -> int:
    return cfg.head_dim * _CODE + cfg.head_dim // WINDOW_BLOCK


def v41_page_bytes(cfg: V41Config, page_size: int) -> int:
    """Bytes one page holds across all layers (only KV sources own pages)."""
    total = 0
    for i in cfg.kv_source_layer_ids:
        rows = page_size // cfg.compress_ratios[i]
        total += rows * entry_bytes(cfg)
        if cfg.is_index_source(i):
            total += rows * index_key_bytes(cfg)
    return total


def v41_snapshot_bytes(cfg: V41Config, spec_tokens: int = 0, tail_bytes: int = _F32) -> int:
    """One slot's rings, what a prefix-cache snapshot holds: every layer's window ring and each
    ratio > 1 source's open-group tails."""
    total = cfg.num_layers * (cfg.sliding_window + spec_tokens) * window_row_bytes(cfg)
    for i in cfg.kv_source_layer_ids:
        ratio = cfg.compress_ratios[i]
        if ratio > 1:
            total += 2 * (ratio + spec_tokens) * cfg.head_dim * tail_bytes
    return total


def v41_slot_bytes(cfg: V41Config, spec_tokens: int = 0, tail_bytes: int = _F32) -> int:
    """One slot's state: its rings (v41_snapshot_bytes), last token, prompt mask, counts."""
    return (v41_snapshot_bytes(cfg, spec_tokens, tail_bytes) + _I32
            + cfg.vocab_size * (1 + _I32))


def v41_cache_bytes(cfg: V41Config, step_cfg: StepConfig, tail_bytes: int = _F32) -> int:
    """The whole paged state for `step_cfg`'s shapes (the prefix cache's snapshots, which are
    not in the state's pytree, are counted by config/family.py)."""
    return (step_cfg.num_pages * v41_page_bytes(cfg, step_cfg.page_size)
            + step_cfg.max_num_seqs * v41_slot_bytes(cfg, step_cfg.spec_tokens, tail_bytes))


def engram_table_bytes(cfg: V41Config, dtype_bytes: int = 2) -> int:
    """The Engram tables as the loader holds them (FP8 in the release, dequantized on load)."""
    return 0 if cfg.engram is None else (sum(cfg.engram.num_embeddings) * cfg.engram.head_dim
                                         * dtype_bytes)


def engram_product_bytes(cfg: V41Config) -> int:
    """The step's hash products with device tables (engram_hash.product_words):
    u32[V, L_e, max_ngram, 2]."""
    e = cfg.engram
    return 0 if e is None else cfg.vocab_size * len(e.layer_ids) * e.max_ngram_size * 2 * 4


def engram_rows_bytes(step_cfg: StepConfig) -> int:
    """The largest bucket's plan rows gathered by the host ([T, L_e, C, ed] in the tables'
    dtype; 0 with device tables): device memory the step's input takes besides its
    temporaries."""
    per_token = step_cfg.engram_row_np_dtype.itemsize
    for n in step_cfg.engram_row_shape:
        per_token *= n
    return max(step_cfg.token_buckets) * per_token


def _fp8_bytes(out_dim: int, in_dim: int, block: tuple[int, int]) -> int:
    """A kept FP8 weight: a byte a code and a float32 scale a tile (Fp8Blocks)."""
    return out_dim * in_dim + -(-out_dim // block[0]) * -(-in_dim // block[1]) * _F32


def v41_weight_bytes(cfg: V41Config, quantized: bool, dtype_bytes: int = 2,
                     engram_on_host: bool = False, fp4_k_granule: int = 1,
                     devices: int = 1) -> int:
    """The bytes of V4.1's weights as the loader holds them (weights/v41.py).

    quantized: as released (the architecture notes, section 8) and kept so: FP8 attention
    projections, shared experts and `engram.wkv` (Fp8Blocks: a byte a weight and a float32
    scale per `cfg.fp8_block` tile), FP4 routed experts (Fp4Blocks: half a byte a weight and a
    scale byte per 32 inputs, at the intermediate size padded to a multiple of
    `fp4_k_granule`: ComputeConfig.fp4_expert_granule, the loader's). The rest at
    `dtype_bytes`: compressor / indexer projections, router, embedding, head and the engram
    tables (FP8 in the release, dequantized on load);
    norms, mHC parameters, sinks, router biases and the engram gate weights in float32.
    quantized=False: every projection and expert at `dtype_bytes` (the float twin).
    engram_on_host: the device's share only, the Engram tables left out (engram_table_bytes).
    (With device tables the engine adds the step's hash products, engram_product_bytes.)
    devices: the bytes one of them holds in DeepSeek's serving layout, the routed experts split
    `devices` ways (each holds ceil(E / devices) of them), and so the device Engram tables'
    rows; everything else replicated."""
    c, b, dt = cfg, cfg.fp8_block, dtype_bytes
    d, inter = c.hidden_size, c.moe_intermediate_size
    hc, e = c.hc_mult, c.n_routed_experts
    held = -(-e // devices)                     # routed experts on one device
    g, low, rank = c.o_groups, c.o_lora_rank, c.q_lora_rank
    group_in = c.num_heads * c.head_dim // g

    def fp8(out_dim, in_dim, keeps=True):
        return _fp8_bytes(out_dim, in_dim, b) if quantized and keeps else out_dim * in_dim * dt

    n_mix = (2 + hc) * hc
    total = c.vocab_size * d * dt * (1 if c.tie_word_embeddings else 2) + d * _F32
    if not engram_on_host and c.engram is not None:   # rows split like the experts
        total += sum(-(-n // devices) for n in c.engram.num_embeddings) * c.engram.head_dim * dt
    for i in range(c.num_layers):
        small = 2 * d + 2 * (n_mix * hc * d + n_mix + 3) + rank + c.head_dim + c.num_heads + 2 * e
        plain = d * e                                                        # router
        if c.is_kv_source(i):
            small += c.head_dim
            plain += d * c.head_dim * (2 if c.compress_ratios[i] > 1 else 1)
        if c.is_index_source(i):
            plain += rank * c.index_n_heads * c.index_head_dim + d * c.index_n_heads
            if c.is_kv_source(i):
                small += c.index_head_dim
                plain += c.head_dim * c.index_head_dim
        if c.has_engram(i):
            small += 2 * hc * d
            total += fp8((hc + 1) * d, c.engram.n_columns * c.engram.head_dim)
        # o_a_proj stays FP8 split into its groups where their columns share whole tiles or
        # lie in one (weights/builder.py split_groups), and so do gate | up joined.
        split = low % b[0] == 0 or b[0] % low == 0
        total += (fp8(rank, d) + fp8(c.num_heads * c.head_dim, rank) + fp8(c.head_dim, d)
                  + (g * fp8(low, group_in) if split else g * low * group_in * dt)
                  + fp8(d, g * low))
        if c.n_shared_experts:
            si = c.shared_intermediate_size
            total += 2 * fp8(si, d, keeps=si % b[0] == 0) + fp8(d, si)
        if quantized:               # FP4 stacks zero-padded to I' (weights/fp4_pad.py)
            routed = held * 3 * d * (-(-inter // fp4_k_granule) * fp4_k_granule)
            total += routed // 2 + routed // 32
        else:
            total += held * 3 * d * inter * dt
        total += small * _F32 + plain * dt
    return total
