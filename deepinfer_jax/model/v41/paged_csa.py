"""CSA2 inside the paged, ragged step of V4.1: the KV source closes the groups this step
completes and pages their entries (and indexer keys); index sources score each token against
its sequence's keys and choose; attention reads the window ring and the chosen entries.

A group is `ratio` consecutive positions; the token at position p closes group
g = (p + 1) / ratio - 1 when (p + 1) % ratio == 0. Its tokens live in this step's flat batch
or in the slot's tail ring (`ragged.ring_or_flat_index`). New entries are written to the
source's pages *before* any layer reads them: an entry is visible only to positions at or after
its closing token, which (prefill chunks) may come later in the same step.

Shapes: T flat tokens, N batch rows, hd head_dim, Id/IH indexer dim/heads, R = max_rows(ratio)
entries a sequence can reach, k = min(index_topk, R).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.invariant import per_closed_row
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.ragged import (
    TokenContext,
    ring_or_flat_index,
    row_index,
    settled,
    write_ring,
)
from deepinfer_jax.model.rope import apply_rope, cos_sin
from deepinfer_jax.model.v41 import segments
from deepinfer_jax.model.v41.kv_format import (
    Fp4Rows,
    decode_fp4,
    encode_fp4,
    gather,
    scatter,
)
from deepinfer_jax.model.v41.params import V41AttentionParams
from deepinfer_jax.model.v41.state import ENTRY_BLOCK, KEY_BLOCK, GroupTail, V41LayerState
from pallas_kernels.indexer import api as indexer_op

Array = jax.Array


def _closing_tokens(ctx: TokenContext, ratio: int, max_new: int) -> tuple[Array, Array]:
    """The tokens that close a group this step: (flat index i32[n], real bool[n]), padded to
    n = max_new with the last token (real False)."""
    num_tokens = ctx.positions.shape[0]
    closing = ctx.valid & ((ctx.positions + 1) % ratio == 0)
    (closer,) = jnp.nonzero(closing, size=max_new, fill_value=num_tokens)
    return jnp.minimum(closer, num_tokens - 1), closer < num_tokens


def close_groups(kv: Array, gate: Array | None, tail: GroupTail | None, ctx: TokenContext,
                 ratio: int, order_free: bool
                 ) -> tuple[Array, Array | None, Array, Array, Array, GroupTail | None]:
    """The compressor's projections of this step's tokens, kv and gate f32[T, hd] (gate None
    at ratio 1) -> (each closing group's tokens f32[n, ratio, hd] and their pooling logits,
    its entry index i32[n], closing token i32[n], real bool[n], the tail with this step's
    tokens). The grouping is the cache-free `csa.compress`'s (order_free: the ring writes'
    indices declared unique, as `ragged.write_ring` says)."""
    num_tokens = kv.shape[0]
    if ratio == 1:   # every token is its own group: no gate, no tail
        return kv[:, None], None, ctx.positions, jnp.arange(num_tokens), ctx.valid, None
    max_new = num_tokens // ratio + ctx.block_table.shape[0]   # + one split group per row
    closer, real = _closing_tokens(ctx, ratio, max_new)
    closer_pos = ctx.positions[closer]
    row = (closer_pos + 1) // ratio - 1                                      # [n]
    positions = row[:, None] * ratio + jnp.arange(ratio)                     # [n, ratio]
    ring = tail.kv.shape[1]
    flat_index = closer[:, None] - (closer_pos[:, None] - positions)
    index = settled(ctx.launch_bound, ring_or_flat_index(ctx, flat_index, positions, ring,
                                                         num_tokens, closer))
    grouped = jnp.concatenate([kv, tail.kv.reshape(-1, kv.shape[-1])])[index]   # [n, ratio, hd]
    logits = jnp.concatenate([gate, tail.gate.reshape(-1, gate.shape[-1])])[index]
    tail = GroupTail(kv=write_ring(tail.kv, kv.astype(tail.kv.dtype), ctx, order_free),
                     gate=write_ring(tail.gate, gate.astype(tail.gate.dtype), ctx, order_free))
    return grouped, logits, row, closer, real, tail


def _new_entries(p: V41AttentionParams, ratio: int, compress_freqs: np.ndarray, keys: bool,
                 cfg: V41Config, grouped: Array, logits: Array | None, row: Array
                 ) -> tuple[Fp4Rows, Fp4Rows | None]:
    """Rows of closing groups -> their entries (and indexer keys), as the pages store them."""
    latent = rms_norm(segments.pooled(grouped, logits), p.compressor.norm, cfg.rms_norm_eps)
    rope = cos_sin(row * ratio, compress_freqs)          # a group sits at its first position
    entries = encode_fp4(apply_rope(latent, *rope), ENTRY_BLOCK, e4m3_scales=True)
    if not keys:
        return entries, None
    ip = p.indexer
    k = apply_rope(rms_norm(latent @ ip.wk, ip.k_norm, cfg.rms_norm_eps), *rope)
    return entries, encode_fp4(k, KEY_BLOCK, e4m3_scales=False)


def _writing(ctx: TokenContext) -> TokenContext:
    """The tokens that close groups and fill the tail: not those of a bounded prefix replay
    (below ctx.rows_from, a block end), whose entries and keys are cached in pages the prefix
    cache shares; the groups after it hold only positions >= rows_from (ratio divides the
    block), so none reads a replayed token from the tail."""
    if ctx.rows_from is None:
        return ctx
    return dataclasses.replace(ctx, valid=ctx.valid & (ctx.positions >= ctx.rows_from),
                               start=jnp.maximum(ctx.start, ctx.rows_from))


def publish(kv: Array, gate: Array | None, p: V41AttentionParams, ls: V41LayerState,
            ctx: TokenContext, ratio: int, compress_freqs: np.ndarray, cfg: V41Config,
            step_cfg: StepConfig) -> V41LayerState:
    """A KV source: close this step's groups, write their entries (and, at an index source,
    their indexer keys) into the sequence's pages. The closing groups are pooled and coded in
    row tiles in batch-invariant mode: their number follows the batch, and V4's compressor
    rows' rule keeps a GPU compiler from fusing them by it (`invariant.per_closed_row`)."""
    order_free = step_cfg.batch_invariant     # each closed entry has its own page row
    ctx = _writing(ctx)
    grouped, logits, row, closer, real, tail = close_groups(kv, gate, ls.tail, ctx, ratio,
                                                            order_free)
    entries, keys = per_closed_row(step_cfg.compute)(
        lambda g, lg, r: _new_entries(p, ratio, compress_freqs, ls.index_keys is not None, cfg,
                                      g, lg, r), grouped, logits, row)
    dest = row_index(ctx.block_table, ctx.seq[closer], row, ratio, step_cfg.page_size)
    dest = settled(ctx.launch_bound, jnp.where(real, dest, ls.entries.codes.shape[0]))
    ls = ls.replace(entries=scatter(ls.entries, dest, entries, order_free), tail=tail)
    if keys is not None:
        ls = ls.replace(index_keys=scatter(ls.index_keys, dest, keys, order_free))
    return ls


def visible_counts(ctx: TokenContext, ratio: int) -> Array:
    """i32[T]: entries of its sequence each token may see (0 for padding)."""
    return jnp.where(ctx.valid, (ctx.positions + 1) // ratio, 0)


def index_scores(q: Array, weights: Array, keys: Fp4Rows, ctx: TokenContext, ratio: int,
                 step_cfg: StepConfig) -> Array:
    """f32[T, R]: each token's scores (queries f32[T, IH, Id], head weights f32[T, IH]) over
    its sequence's entries, -inf past what it sees.

    V4's indexer op scores the same sum_h w_h * relu(q_h . k) / sqrt(Id) against keys
    gathered once per sequence, not per token (in row tiles in batch-invariant mode). The FP4
    keys and queries are exact in bf16 (2-bit mantissas times powers of two), so its bf16
    kernel would see the same values."""
    compute = step_cfg.compute
    max_rows = step_cfg.max_rows(ratio)
    rows = jnp.arange(max_rows)
    n = ctx.block_table.shape[0]
    index = settled(ctx.launch_bound, row_index(ctx.block_table, jnp.arange(n)[:, None], rows,
                                                ratio, step_cfg.page_size))
    seq_keys = decode_fp4(gather(keys, index))                               # [N, R, Id]
    scores = indexer_op.indexer_scores(
        q, seq_keys, weights, jnp.where(ctx.valid, ctx.seq, -1),
        implementation=compute.kernels.indexer,
        row_tile=compute.invariant_tile if compute.batch_invariant else None)
    return jnp.where(rows[None, :] < visible_counts(ctx, ratio)[:, None], scores, -jnp.inf)


def selected_entries(entries: Fp4Rows, selected: Array, ctx: TokenContext, ratio: int,
                     step_cfg: StepConfig) -> tuple[Array, Array]:
    """selected i32[T, k] (-1: none) -> (entries f32[T, k, hd], usable bool[T, k])."""
    index = row_index(ctx.block_table, ctx.seq[:, None], jnp.maximum(selected, 0), ratio,
                      step_cfg.page_size)
    picked = decode_fp4(gather(entries, settled(ctx.launch_bound, index)))
    return picked, (selected >= 0) & ctx.valid[:, None]
