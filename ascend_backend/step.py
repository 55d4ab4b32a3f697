"""The Ascend backend's step: step(params, state, plan) -> (state, StepOutput), the contract
of deepinfer_jax/device/step.py, in torch operations on a torch device (an NPU through
torch_npu, or the CPU).

The plan arrives as the host builds it (numpy) and the output leaves as numpy, so the host's
scheduler, plan builder and loop are shared unchanged. Only the DeepSeek-V4 family's plain
step is here (no MTP verify, no V4.1)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ascend_backend.model.forward import forward_step, project_logits
from ascend_backend.model.ragged import gather, token_context
from ascend_backend.model.state import StateCache
from ascend_backend.sampling import sample, sampling_rows
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import BatchPlan, StepOutput


def plan_to_torch(plan: BatchPlan, device: torch.device) -> BatchPlan:
    """The numpy plan as torch tensors on `device` (integers int64, the indexing type)."""
    def convert(a):
        a = np.asarray(a)
        if a.dtype == np.uint32:
            a = a.astype(np.int64)
        elif np.issubdtype(a.dtype, np.integer):
            a = a.astype(np.int64)
        return torch.as_tensor(a, device=device)
    return BatchPlan(**{f.name: convert(getattr(plan, f.name))
                        for f in dataclasses.fields(BatchPlan)})


def resolve_placeholders(plan: BatchPlan, last_tokens: torch.Tensor) -> torch.Tensor:
    """Tokens the host does not know yet (-1) are the previous sample of their row's slot."""
    n = plan.seq_slot.shape[0]
    slot = plan.seq_slot[plan.token_seq.clamp(max=n - 1)]
    return torch.where(plan.token_ids < 0, gather(last_tokens, slot), plan.token_ids)


def record_fed_tokens(state: StateCache, plan: BatchPlan, token_ids: torch.Tensor) -> None:
    """Penalty bookkeeping, in place: rows starting at position 0 reset their slot; every fed
    token is marked as a prompt token or counted as a generated one (positions >= prompt_len)."""
    n, slots = plan.seq_slot.shape[0], state.last_tokens.shape[0]
    fresh = plan.seq_slot[(plan.seq_start == 0) & (plan.seq_len > 0)]
    fresh = fresh[fresh < slots]
    state.prompt_mask[fresh] = False
    state.output_counts[fresh] = 0
    row = plan.token_seq.clamp(max=n - 1)
    real = (plan.token_seq < n) & (plan.seq_slot[row] < slots)
    generated = plan.positions >= plan.prompt_len[row]
    slot = plan.seq_slot[row]
    prompt = real & ~generated
    state.prompt_mask[slot[prompt], token_ids[prompt]] = True
    counted = real & generated
    state.output_counts.index_put_((slot[counted], token_ids[counted]),
                                   torch.ones_like(token_ids[counted]), accumulate=True)


def step_with_logits(params, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
                     step_cfg: StepConfig) -> tuple[StateCache, StepOutput, torch.Tensor]:
    """`step`, also returning every token's logits f32[T, V] (tests and diagnostics)."""
    device = state.last_tokens.device
    plan = plan_to_torch(plan, device)
    token_ids = resolve_placeholders(plan, state.last_tokens)
    record_fed_tokens(state, plan, token_ids)
    final = forward_step(params, state, token_context(plan), token_ids, cfg, step_cfg)
    logits = project_logits(final, params.hc_head, params.norm, params.head, cfg)  # [T, V]
    rows = sampling_rows(plan, plan.positions[plan.sample_index][:, None])
    slots = state.last_tokens.shape[0]
    slot = plan.seq_slot.clamp(max=slots - 1)
    tokens, logprob, top_ids, top_logprobs = sample(
        logits[plan.sample_index], rows, state.prompt_mask[slot], state.output_counts[slot],
        step_cfg.max_logprobs)
    samples = plan.seq_samples & (plan.seq_slot < slots)
    state.last_tokens[plan.seq_slot[samples]] = tokens[samples]
    out = StepOutput(tokens.to(torch.int32).cpu().numpy(), logprob.cpu().numpy(),
                     top_ids.to(torch.int32).cpu().numpy(), top_logprobs.cpu().numpy())
    return state, out, logits


@torch.inference_mode()
def step(params, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
         step_cfg: StepConfig) -> tuple[StateCache, StepOutput]:
    """One engine step on the torch device: the state is updated in place and returned."""
    state, out, _ = step_with_logits(params, state, plan, cfg=cfg, step_cfg=step_cfg)
    return state, out
