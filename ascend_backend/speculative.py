"""MTP speculative decoding in the torch step (deepinfer_jax/device/speculative.py): verify
the drafts each row fed, then draft the next ones with the MTP block.

A decoding row feeds its last token x_t and c drafts (positions t..t+c); draft d_{j+1} is
accepted while the target agrees: greedy rows while the argmax of the processed logits at
t+j equals it; sampled rows by rejection sampling against the point-mass draft (accept with
probability p(d_{j+1}), else draw from the target without it), so their output follows the
target's distribution, drawn from the torch generator's (seed, position) stream. The accepted
drafts and one target token (the bonus) are the row's new tokens. Then the MTP block catches
up over the committed positions and drafts up to the row's cap, recursively; with varlen,
drafting stops once the drafts' cumulative probability falls below the threshold."""

from __future__ import annotations

import dataclasses

import torch

from ascend_backend.model.forward import forward_step, layer_step, project_logits
from ascend_backend.model.mtp import mtp_input
from ascend_backend.model.ragged import TokenContext, token_context
from ascend_backend.model.state import StateCache
from ascend_backend.sampling import (
    SamplingRows,
    draw,
    filter_logits,
    process_logits,
    row_uniforms,
    sampling_rows,
    token_logprobs,
)
from ascend_backend.step import plan_to_torch, record_fed_tokens
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import BatchPlan, SpecStepOutput


def verify(logits: torch.Tensor, drafted: torch.Tensor, num_drafts: torch.Tensor,
           rows: SamplingRows, prompt_mask: torch.Tensor, output_counts: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits f32[N, S, V] at positions t..t+k, drafted int[N, S] (d_{j+1} at column j) ->
    (new tokens int[N, S], accepted int[N])."""
    n, s, vocab = logits.shape
    processed = process_logits(logits.reshape(n * s, vocab), rows, prompt_mask, output_counts)
    sampled = rows.temperature > 0
    target = torch.argmax(processed, dim=-1)
    d = drafted.reshape(-1)
    agree = target == d
    resampled = target
    if bool(sampled.any()):
        filtered = filter_logits(processed, rows)
        target = torch.where(sampled, draw(filtered, rows.seed, rows.position), target)
        p_draft = torch.gather(torch.softmax(filtered, -1), -1, d[:, None])[:, 0]
        u = row_uniforms(rows.seed, rows.position, 1, purpose=1)[:, 0]
        agree = torch.where(sampled, u < p_draft, target == d)
        without = filtered.scatter(-1, d[:, None], float("-inf"))
        resampled = draw(without, rows.seed, rows.position, purpose=2)
    in_range = torch.arange(s, device=d.device)[None] < num_drafts[:, None]
    accepted = torch.cumprod((agree.reshape(n, s) & in_range).long(), dim=1).sum(1)
    at = lambda a, j: torch.gather(a.reshape(n, s), 1, j[:, None])[:, 0]  # noqa: E731
    rejected = accepted < num_drafts
    bonus = torch.where(sampled.reshape(n, s)[:, 0] & rejected, at(resampled, accepted),
                        at(target, accepted))
    j = torch.arange(s, device=d.device)[None]
    new = torch.where(j < accepted[:, None], drafted,
                      torch.where(j == accepted[:, None], bonus[:, None], 0))
    return new, accepted


def draft(params, state: StateCache, plan: BatchPlan, ctx: TokenContext, streams: torch.Tensor,
          next_tokens: torch.Tensor, committed: torch.Tensor, last: torch.Tensor,
          cfg: ModelConfig, step_cfg: StepConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP catch-up over the committed flat tokens, then recursive drafting (the MTP window
    ring updated in place) -> (drafts int[N, k], their probabilities f32[N, k])."""
    mp = params.mtp[0]
    z = mtp_input(mp, params.embed, streams, next_tokens.clamp(min=0), cfg)
    z, _ = layer_step(mp.layer, z, next_tokens, dataclasses.replace(ctx, valid=committed),
                      AttentionKind.SLIDING, MlpKind.MOE, state.mtp, cfg, step_cfg)
    z_row, token = z[last], None
    position = plan.positions[last]
    n = plan.seq_slot.shape[0]
    zeros = torch.zeros_like(position)
    drafts, probs = [], []
    for j in range(step_cfg.spec_tokens):
        valid = plan.seq_samples & (plan.draft_cap > j)
        if j > 0 and bool(valid.any()):     # rows past their cap write nothing
            ctx1 = TokenContext(positions=position, valid=valid,
                                seq=torch.arange(n, device=position.device),
                                slot=plan.seq_slot, start=position, end=position + 1,
                                block_table=plan.block_table, window_from=zeros, rows_from=zeros)
            z_row, _ = layer_step(mp.layer, mtp_input(mp, params.embed, z_row, token, cfg),
                                  token, ctx1, AttentionKind.SLIDING, MlpKind.MOE, state.mtp,
                                  cfg, step_cfg)
        logits = project_logits(z_row, mp.hc_head, mp.norm, params.head, cfg)      # [N, V]
        token = torch.argmax(logits, dim=-1)
        drafts.append(token)
        probs.append(torch.softmax(logits, -1).amax(-1))
        position = position + 1
    return torch.stack(drafts, 1), torch.stack(probs, 1)


@torch.inference_mode()
def spec_step(params, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
              step_cfg: StepConfig) -> tuple[StateCache, SpecStepOutput]:
    """The speculative step: verify, commit, draft; the state updated in place."""
    plan = plan_to_torch(plan, state.last_tokens.device)
    k, s = step_cfg.spec_tokens, step_cfg.spec_tokens + 1
    n, num_tokens = plan.seq_slot.shape[0], plan.token_ids.shape[0]
    record_fed_tokens(state, plan, plan.token_ids)
    ctx = token_context(plan)
    streams = forward_step(params, state, ctx, plan.token_ids, cfg, step_cfg)
    device = plan.token_ids.device
    first = plan.seq_offset + plan.seq_len - 1 - plan.num_drafts        # x_t (or last token)
    columns = first[:, None] + torch.arange(s, device=device)[None]      # [N, S]
    verify_at = columns.clamp(0, num_tokens - 1)
    logits = project_logits(streams[verify_at], params.hc_head, params.norm, params.head, cfg)
    rows = sampling_rows(plan, plan.positions[verify_at])
    slots = state.last_tokens.shape[0]
    slot = plan.seq_slot.clamp(max=slots - 1)
    drafted = plan.token_ids[(columns + 1).clamp(0, num_tokens - 1)]
    new, accepted = verify(logits, drafted, plan.num_drafts, rows,
                           state.prompt_mask[slot].repeat_interleave(s, 0),
                           state.output_counts[slot].repeat_interleave(s, 0))
    logprob, top_ids, top_logprobs = token_logprobs(logits.reshape(n * s, -1), new.reshape(-1),
                                                    step_cfg.max_logprobs)
    bonus = torch.gather(new, 1, accepted[:, None])[:, 0]
    samples = plan.seq_samples & (plan.seq_slot < slots)
    state.last_tokens[plan.seq_slot[samples]] = bonus[samples]

    last = first + accepted                      # committed tokens: a prefix of each span
    row = plan.token_seq.clamp(max=n - 1)
    token = torch.arange(num_tokens, device=device)
    committed = (plan.token_seq < n) & (token <= last[row])
    next_tokens = torch.where((token == last[row]) & plan.seq_samples[row], bonus[row],
                              plan.next_token_ids)
    drafts, probs = draft(params, state, plan, ctx, streams, next_tokens,
                          committed & (next_tokens >= 0), last, cfg, step_cfg)
    wanted = torch.arange(k, device=device)[None] < plan.draft_cap[:, None]
    if step_cfg.speculative.varlen:
        wanted &= torch.cumprod(probs, dim=1) >= step_cfg.speculative.confidence_threshold
    num_drafts = torch.where(plan.seq_samples, torch.cumprod(wanted.long(), dim=1).sum(1), 0)
    i32 = lambda a: a.to(torch.int32).cpu().numpy()  # noqa: E731
    return state, SpecStepOutput(
        new_tokens=i32(new), num_new=i32(torch.where(plan.seq_samples, accepted + 1, 0)),
        drafts=i32(drafts), num_drafts=i32(num_drafts), logprob=logprob.reshape(n, s).cpu().numpy(),
        top_ids=i32(top_ids.reshape(n, s, -1)),
        top_logprobs=top_logprobs.reshape(n, s, -1).cpu().numpy())
