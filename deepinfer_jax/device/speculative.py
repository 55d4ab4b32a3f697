"""MTP speculative decoding inside the jitted step: verify drafts, then draft the next ones.

A decoding row feeds its last token x_t and c drafts d_1..d_c (positions t..t+c). The target
model runs over all of them at once; draft d_{j+1} is accepted while the target agrees:
* greedy rows: argmax of the target's logits at t+j equals d_{j+1};
* sampled rows: rejection sampling against a point-mass draft (drafts are the MTP block's
  argmax): accept with probability p(d_{j+1}) under the target's processed distribution, else
  sample from that distribution with d_{j+1} removed. The output follows the target's
  distribution exactly; random draws come from the request's (seed, position) stream.
The a accepted drafts and one target token (the "bonus") are the row's new tokens; positions
t..t+a are committed. Rejected drafts' rows land in spare ring slots (state.py) and in pages
where they stay invisible until an accepted token overwrites them, so nothing needs undoing.

Then the MTP block catches up over the committed positions (pairing each position's final
residual streams with the next token, the bonus at the last one), and drafts up to `cap`
tokens per row by applying itself recursively. With varlen, drafting stops once the drafts'
cumulative probability under the MTP block falls below the confidence threshold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import SpecStepOutput
from deepinfer_jax.device.branch import skip_unless
from deepinfer_jax.device.sampling import (
    SamplingRows,
    process_logits,
    row_keys,
    sampling_logits,
    token_logprobs,
)
from deepinfer_jax.device.spec_carry import carry_in, carry_out
from deepinfer_jax.device.step import record_fed_tokens, resolve_placeholders
from deepinfer_jax.model.invariant import per_sequence, whole_batch
from deepinfer_jax.model.mtp import mtp_input
from deepinfer_jax.model.paged_forward import forward_step, layer_step
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.ragged import TokenContext, token_context
from deepinfer_jax.model.reference_forward import project_logits
from deepinfer_jax.model.state import StateCache

Array = jax.Array


def _repeat_rows(plan, positions: Array) -> SamplingRows:
    """Sampling controls for every verify position: row fields repeated S times."""
    s = positions.shape[1]
    rep = lambda a: jnp.repeat(a, s, axis=0)  # noqa: E731
    return SamplingRows(temperature=rep(plan.temperature), top_k=rep(plan.top_k),
                        top_p=rep(plan.top_p), min_p=rep(plan.min_p),
                        repetition_penalty=rep(plan.repetition_penalty),
                        presence_penalty=rep(plan.presence_penalty),
                        frequency_penalty=rep(plan.frequency_penalty), seed=rep(plan.seed),
                        position=positions.reshape(-1), allowed=rep(plan.allowed))


def verify(logits: Array, drafted: Array, num_drafts: Array, rows: SamplingRows,
           prompt_mask: Array, output_counts: Array, num_logprobs: int,
           truncation: bool | None = None, tiled: Callable = whole_batch):
    """logits f32[N, S, V] at positions t..t+k, drafted i32[N, S] (d_{j+1} at column j) ->
    (new tokens i32[N, S], accepted i32[N], SampleOutput of the new tokens, flattened).
    tiled(fn, *args): how the per-position work runs (batch-invariant mode: in fixed row
    tiles, as step.sample_rows samples)."""
    n, s, vocab = logits.shape
    flat = logits.reshape(n * s, vocab)
    d = drafted.reshape(-1)
    target, p_draft, uniform, resampled = tiled(
        functools.partial(_position_draws, truncation=truncation), flat, d, rows, prompt_mask,
        output_counts)
    target, resampled = target.reshape(n, s), resampled.reshape(n, s)
    sampled = rows.temperature > 0
    agree = jnp.where(sampled, uniform < p_draft, target.reshape(-1) == d).reshape(n, s)
    in_range = jnp.arange(s)[None] < num_drafts[:, None]
    accepted = jnp.sum(jnp.cumprod(agree & in_range, axis=1), axis=1)            # a
    at = lambda a, j: jnp.take_along_axis(a, j[:, None], axis=1)[:, 0]  # noqa: E731
    rejected = accepted < num_drafts
    bonus = jnp.where(sampled.reshape(n, s)[:, 0] & rejected, at(resampled, accepted),
                      at(target, accepted))
    j = jnp.arange(s)[None]
    new = jnp.where(j < accepted[:, None], drafted, jnp.where(j == accepted[:, None],
                                                              bonus[:, None], 0))
    new = new.astype(jnp.int32)
    logprobs = tiled(functools.partial(token_logprobs, num_logprobs=num_logprobs), flat,
                     new.reshape(-1))
    return new, accepted, logprobs


def _position_draws(flat: Array, d: Array, rows: SamplingRows, prompt_mask: Array,
                    output_counts: Array, truncation: bool | None):
    """Per verified position (row of flat f32[M, V], its draft d i32[M]): the target's token,
    the draft's probability under it, the acceptance draw, and the token a sampled row takes
    after a rejection (from the target with the draft removed)."""
    processed = process_logits(flat, rows, prompt_mask, output_counts)
    filtered = sampling_logits(processed, rows, truncation)
    drawn = jax.vmap(jax.random.categorical)(row_keys(rows), filtered)
    target = jnp.where(rows.temperature > 0, drawn, jnp.argmax(processed, axis=-1))
    p_draft = jnp.take_along_axis(jax.nn.softmax(filtered, axis=-1), d[:, None], axis=-1)[:, 0]
    uniform = jax.vmap(jax.random.uniform)(row_keys(rows, 1))
    without = jnp.where(jnp.arange(flat.shape[-1])[None] == d[:, None], -jnp.inf, filtered)
    resampled = jax.vmap(jax.random.categorical)(row_keys(rows, 2), without)
    return target, p_draft, uniform, resampled


def draft(params: ModelParams, state: StateCache, plan, streams: Array, next_tokens: Array,
          committed: Array, last: Array, cap: Array, cfg: ModelConfig,
          step_cfg: StepConfig) -> tuple[StateCache, Array, Array]:
    """MTP catch-up over the committed flat tokens, then recursive drafting.

    streams [T, hc, D] final streams of the target step; next_tokens i32[T] the token after
    each one; committed bool[T]; last i32[N] flat index of each row's last committed token;
    cap i32[N] drafts wanted. Returns (state, drafts i32[N, k], draft probabilities f32[N, k])."""
    mp = params.mtp[0]
    ctx = token_context(plan, step_cfg.compute.launch_bound)
    ctx = dataclasses.replace(ctx, valid=committed)
    z = mtp_input(mp, params.embed, streams, jnp.maximum(next_tokens, 0), cfg, step_cfg.compute)
    z, mtp_state, _ = layer_step(mp.layer, z, next_tokens, ctx, AttentionKind.SLIDING,
                                 MlpKind.MOE, state.mtp, cfg, step_cfg)
    z_row, token = z[last], None
    position = plan.positions[last]                        # the MTP block's position for draft 1
    drafts, probs = [], []
    n = plan.seq_slot.shape[0]
    # From here the rows are the step's sequences, min(bucket, slots) of them: in batch-
    # invariant mode their work runs in row tiles on every device (model/invariant.py), so
    # that a sampled row's drafts, and with them its accepted tokens, follow the row alone.
    per_row = per_sequence(step_cfg.compute)
    for j in range(step_cfg.spec_tokens):
        if j > 0:      # the block again, on its own output and the draft it just made
            ctx1 = TokenContext(positions=position, valid=plan.seq_samples & (cap > j),
                                seq=jnp.arange(n), slot=plan.seq_slot, start=position,
                                end=position + 1, block_table=plan.block_table)

            def again(z_row, token, mtp_state, ctx1=ctx1):
                z1 = per_row(lambda z, t: mtp_input(mp, params.embed, z, t, cfg,
                                                    step_cfg.compute), z_row, token)
                return layer_step(mp.layer, z1, token, ctx1, AttentionKind.SLIDING, MlpKind.MOE,
                                  mtp_state, cfg, step_cfg, segment=per_row)[:2]

            # skipped once no row wants this many drafts (large batches draft little), where
            # skipping does not stall the host; rows past their cap write nothing and their
            # drafts are ignored
            z_row, mtp_state = skip_unless(step_cfg.compute.launch_bound,
                                           any_rank(jnp.any(ctx1.valid), step_cfg), again,
                                           lambda z, t, st: (z, st), z_row, token, mtp_state)
        # [N, V], or [N, V'] over a draft token map's columns (engine/draft_vocab.py)
        head = params.head if mp.draft_head is None else mp.draft_head
        logits = project_logits(z_row, mp.hc_head, mp.norm, head, cfg, step_cfg.compute,
                                rows=per_row)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if mp.draft_ids is not None:
            token = mp.draft_ids[token]
        drafts.append(token)
        probs.append(per_row(lambda x: jnp.max(jax.nn.softmax(x, axis=-1), axis=-1), logits))
        position = position + 1
    return dataclasses.replace(state, mtp=mtp_state), jnp.stack(drafts, 1), jnp.stack(probs, 1)


def spec_step(params: ModelParams, state: StateCache, plan, *, cfg: ModelConfig,
              step_cfg: StepConfig, truncation: bool | None = None
              ) -> tuple[StateCache, SpecStepOutput]:
    k, s = step_cfg.spec_tokens, step_cfg.spec_tokens + 1
    n, num_tokens = plan.seq_slot.shape[0], plan.token_ids.shape[0]
    # rows continued from an unread speculative step, then tokens an unread plain step sampled
    # (the asynchronous loop: device/spec_carry.py, device/step.py)
    plan, verified = carry_in(plan, state.spec_carry, state.last_tokens)
    token_ids = resolve_placeholders(plan.token_ids, plan, state.last_tokens)
    state = record_fed_tokens(state, plan, token_ids)
    state, streams = forward_step(params, state, plan, token_ids, cfg, step_cfg)

    first = plan.seq_offset + plan.seq_len - 1 - plan.num_drafts          # x_t (or last token)
    columns = first[:, None] + jnp.arange(s)[None]                         # [N, S]
    verify_at = jnp.clip(columns, 0, num_tokens - 1)
    positions = plan.positions[verify_at]
    per_row = per_sequence(step_cfg.compute)     # (N x S rows: model/invariant.py)
    logits = project_logits(streams[verify_at], params.hc_head, params.norm, params.head, cfg,
                            step_cfg.compute, rows=per_row)
    rows = _repeat_rows(plan, positions)
    slot = jnp.minimum(plan.seq_slot, state.last_tokens.shape[0] - 1)
    drafted = token_ids[jnp.clip(columns + 1, 0, num_tokens - 1)]
    new, accepted, lp = verify(logits, drafted, verified, rows,
                               jnp.repeat(state.prompt_mask[slot], s, axis=0),
                               jnp.repeat(state.output_counts[slot], s, axis=0), step_cfg.max_logprobs,
                               truncation, tiled=per_row)
    bonus = jnp.take_along_axis(new, accepted[:, None], axis=1)[:, 0]
    sink = state.last_tokens.shape[0]
    state = dataclasses.replace(state, last_tokens=state.last_tokens.at[
        jnp.where(plan.seq_samples, plan.seq_slot, sink)].set(bonus, mode="drop",
                                                              unique_indices=True))

    # MTP: committed tokens are a prefix of each row's span; the last one pairs with the bonus
    last = first + accepted                                                # [N]
    row = jnp.minimum(plan.token_seq, n - 1)
    token = jnp.arange(num_tokens)
    committed = (plan.token_seq < n) & (token <= last[row])
    next_tokens = jnp.where((token == last[row]) & plan.seq_samples[row], bonus[row],
                            plan.next_token_ids)
    state, drafts, probs = draft(params, state, plan, streams, next_tokens,
                                 committed & (next_tokens >= 0), last, plan.draft_cap, cfg, step_cfg)
    wanted = jnp.arange(k)[None] < plan.draft_cap[:, None]
    if step_cfg.speculative.varlen:
        wanted &= jnp.cumprod(probs, axis=1) >= step_cfg.speculative.confidence_threshold
    num_drafts = jnp.where(plan.seq_samples, jnp.sum(jnp.cumprod(wanted, axis=1), axis=1), 0)
    state = dataclasses.replace(state, spec_carry=carry_out(state.spec_carry, plan, accepted,
                                                            drafts, num_drafts))
    l_ = lp.top_ids.shape[-1]
    return state, SpecStepOutput(
        new_tokens=new, num_new=jnp.where(plan.seq_samples, accepted + 1, 0), drafts=drafts,
        num_drafts=num_drafts.astype(jnp.int32), logprob=lp.logprob.reshape(n, s),
        top_ids=lp.top_ids.reshape(n, s, l_), top_logprobs=lp.top_logprobs.reshape(n, s, l_))


def any_rank(needed: jax.Array, step_cfg: StepConfig) -> jax.Array:
    """`needed` of one data-parallel rank -> whether any rank needs the work. Inside the
    step's per-rank map (parallel/mesh.py over_ranks) a branch must go the same way on every
    rank: the work holds collectives (the MoE's exchange over "dp"), which would wait forever
    for a rank that skipped them."""
    if step_cfg.compute.parallel.dp == 1:
        return needed
    return jax.lax.psum(needed.astype(jnp.int32), "dp") > 0
