"""Speculation in the asynchronous loop: a speculative step's row continued from the step
before it on the device.

The asynchronous loop plans step N+1 before the host has read step N. For a row that
sampled in a speculative step N the host then knows neither its tokens (the bonus token and
the next drafts) nor where it starts (after 1 + a tokens, a the accepted drafts). The host
plans such a row as the worst case for positions (a = 0: `positions` and `seq_start` are
lower bounds; the pages cover a = num_drafts of step N) and as the most drafts N could have
proposed (its draft cap), with every token CARRIED (contract.py). Step N left, per slot, its
bonus token (`last_tokens`) and its `SpecCarry` (model/state.py): here the row takes its
true positions (shifted by `accepted`), its tokens (the bonus, then the drafts) and the count
of drafts meant (`num_drafts`, at most the planned one). The planned drafts beyond that
count are fed but never verified (as rejected drafts, they land in the rings' spare rows and
in pages past the row's end, invisible until an accepted token overwrites them), so the row
computes what the synchronous loop's row of 1 + num_drafts tokens would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.contract import CARRIED, BatchPlan
from deepinfer_jax.model.state import SpecCarry

Array = jax.Array


def carry_in(plan: BatchPlan, carry: SpecCarry, last_tokens: Array) -> tuple[BatchPlan, Array]:
    """The plan with its CARRIED rows' tokens, positions and next tokens from the device ->
    (plan, i32[N] the drafts each row verifies). `plan.num_drafts` keeps the planned count:
    it places the row's first verified token (the span is laid out for it)."""
    n, t = plan.seq_slot.shape[0], plan.token_ids.shape[0]
    k = carry.drafts.shape[1]
    slot = jnp.minimum(plan.seq_slot, last_tokens.shape[0] - 1)                    # [N]
    carried = (plan.seq_len > 0) & (plan.token_ids[jnp.clip(plan.seq_offset, 0, t - 1)]
                                    == CARRIED)                                    # [N]
    shift = jnp.where(carried, carry.accepted[slot], 0)                           # [N]
    row = jnp.minimum(plan.token_seq, n - 1)                                       # [T]
    real = plan.token_seq < n
    fed_carried = real & carried[row]
    j = jnp.arange(t) - plan.seq_offset[row]          # the token's index in its row's span
    from_device = jnp.where(j == 0, last_tokens[slot[row]],
                            carry.drafts[slot[row], jnp.clip(j - 1, 0, k - 1)])
    token_ids = jnp.where(fed_carried, from_device, plan.token_ids)
    following = jnp.concatenate([token_ids[1:], jnp.full((1,), -1, token_ids.dtype)])
    next_ids = jnp.where(fed_carried, jnp.where(j < plan.seq_len[row] - 1, following, -1),
                         plan.next_token_ids)
    verified = jnp.where(carried, jnp.minimum(plan.num_drafts, carry.num_drafts[slot]),
                         plan.num_drafts)
    plan = dataclasses.replace(plan, token_ids=token_ids, next_token_ids=next_ids,
                               positions=plan.positions + jnp.where(real, shift[row], 0),
                               seq_start=plan.seq_start + shift)
    return plan, verified


def carry_out(carry: SpecCarry, plan: BatchPlan, accepted: Array, drafts: Array,
              num_drafts: Array) -> SpecCarry:
    """Each sampling row's accepted count i32[N], next drafts i32[N, k] and their count i32[N]
    kept in its slot for the next step."""
    sink = carry.accepted.shape[0]
    slots = jnp.where(plan.seq_samples, plan.seq_slot, sink)
    put = lambda a, v: a.at[slots].set(v.astype(a.dtype), mode="drop",  # noqa: E731
                                       unique_indices=True)
    return SpecCarry(put(carry.accepted, accepted), put(carry.drafts, drafts),
                     put(carry.num_drafts, num_drafts))
