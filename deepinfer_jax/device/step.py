"""The jitted step: the one boundary between the host and the device.

step(params, state, plan) -> (state, StepOutput); the state is donated, every per-step
quantity is an array in the plan, so one compiled program per token bucket serves all traffic.
The model's family (DeepSeek-V4 or V4.1) supplies the forward and the sampled rows' logits
(model/family.py); the placeholders, penalty bookkeeping and sampling around them are shared
(both states keep `last_tokens`, `prompt_mask`, `output_counts` per slot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import BatchPlan, StepOutput
from deepinfer_jax.device.sampling import SamplingRows, sample
from deepinfer_jax.model.family import model_family
from deepinfer_jax.model.invariant import per_sequence
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.state import StateCache


def resolve_placeholders(token_ids: jax.Array, plan: BatchPlan, last_tokens: jax.Array) -> jax.Array:
    """Tokens the host does not know yet (-1) are the previous sample of their row's slot."""
    n = plan.seq_slot.shape[0]
    slot = plan.seq_slot[jnp.minimum(plan.token_seq, n - 1)]
    return jnp.where(token_ids < 0, last_tokens[slot], token_ids)


def record_fed_tokens(state: StateCache, plan: BatchPlan, token_ids: jax.Array) -> StateCache:
    """Penalty bookkeeping: rows starting at position 0 reset their slot; every fed token is
    marked as a prompt token or counted as a generated one (positions >= prompt_len)."""
    n, slots = plan.seq_slot.shape[0], state.last_tokens.shape[0]
    fresh = jnp.where((plan.seq_start == 0) & (plan.seq_len > 0), plan.seq_slot, slots)
    # Scatters whose result does not depend on the order of their updates (unique slots; an
    # `or` for marks a prompt may repeat): tests/engine/test_gpu_step_structure.py
    prompt_mask = state.prompt_mask.at[fresh].set(False, mode="drop", unique_indices=True)
    counts = state.output_counts.at[fresh].set(0, mode="drop", unique_indices=True)
    row = jnp.minimum(plan.token_seq, n - 1)
    real = plan.token_seq < n
    generated = plan.positions >= plan.prompt_len[row]
    slot = plan.seq_slot[row]
    prompt_mask = prompt_mask.at[jnp.where(real & ~generated, slot, slots), token_ids].max(
        True, mode="drop")
    counts = counts.at[jnp.where(real & generated, slot, slots), token_ids].add(1, mode="drop")
    return dataclasses.replace(state, prompt_mask=prompt_mask, output_counts=counts)


def forward_logits(params: ModelParams, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
                   step_cfg: StepConfig) -> tuple[StateCache, jax.Array]:
    """The step's first half: placeholders, penalty bookkeeping, the forward and the sampled
    rows' logits f32[N, V] (nothing sampled; `last_tokens` untouched)."""
    token_ids = resolve_placeholders(plan.token_ids, plan, state.last_tokens)
    state = record_fed_tokens(state, plan, token_ids)
    family = model_family(cfg)           # DeepSeek-V4 or V4.1 (model/family.py)
    state, final = family.forward(params, state, plan, token_ids, cfg, step_cfg)
    return state, family.sampled_logits(params, final, plan.sample_index, cfg, step_cfg)


def sample_rows(last_tokens: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array,
                logits: jax.Array, plan: BatchPlan, *, step_cfg: StepConfig,
                truncation: bool | None = None) -> tuple[jax.Array, StepOutput]:
    """The step's second half: sample the rows' logits with the plan's controls and masks,
    and keep each sampled token as its slot's `last_tokens` (i32[slots]). Also run alone on a
    step's kept logits (engine/deferred_masks.py)."""
    rows = SamplingRows(temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p,
                        min_p=plan.min_p, repetition_penalty=plan.repetition_penalty,
                        presence_penalty=plan.presence_penalty,
                        frequency_penalty=plan.frequency_penalty, seed=plan.seed,
                        position=plan.positions[plan.sample_index], allowed=plan.allowed)
    slot = jnp.minimum(plan.seq_slot, last_tokens.shape[0] - 1)
    # Batch-invariant mode samples in fixed row tiles on every device: XLA's CPU code for a
    # [rows, V] log-softmax rounds by the row count (seen at V = 512 with 1-7 rows against 8 or
    # more), and on an H100 an 8-slot engine's logprobs differed from a 32-slot one's, whose
    # steps differed only in the sampled rows' count (min(bucket, slots)).
    sampler = functools.partial(sample, num_logprobs=step_cfg.max_logprobs,
                                truncation=truncation)
    out = per_sequence(step_cfg.compute)(sampler, logits, rows, prompt_mask[slot],
                                         output_counts[slot])
    slots = jnp.where(plan.seq_samples, plan.seq_slot, last_tokens.shape[0])
    last_tokens = last_tokens.at[slots].set(out.tokens, mode="drop", unique_indices=True)
    return last_tokens, StepOutput(out.tokens, out.logprob, out.top_ids, out.top_logprobs)


def step(params: ModelParams, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
         step_cfg: StepConfig, truncation: bool | None = None
         ) -> tuple[StateCache, StepOutput]:
    """One engine step; `truncation` picks the sampler (sampling.sampling_logits)."""
    state, logits = forward_logits(params, state, plan, cfg=cfg, step_cfg=step_cfg)
    last_tokens, output = sample_rows(state.last_tokens, state.prompt_mask, state.output_counts,
                                      logits, plan, step_cfg=step_cfg, truncation=truncation)
    return dataclasses.replace(state, last_tokens=last_tokens), output
