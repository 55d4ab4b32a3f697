"""The plan builder: a scheduler decision as a BatchPlan of fixed-shape numpy arrays (no jax).

It runs right after `schedule()`, which has booked the step as launched: slots and pages come
from the decision's rows (a request finished at launch has released its own); the tokens from
the request, whose tokens before each row's end do not change until the step's output is
postprocessed (a sampled row's next token is already a PLACEHOLDER, which the plan marks as
unknown, -1, as it would an absent one).

The batch is ragged: the new tokens of N' <= N sequences are laid out back to back in a flat
array of T slots (T, N from the step's bucket). A token id of -1 (PLACEHOLDER) is a token
sampled by the previous step and not yet seen by the host: the step reads it on the device.
Padding tokens and rows point out of range (token_seq = N, seq_slot = max_num_seqs,
pages = num_pages): gathers from them are masked and scatters to them are dropped.
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import CARRIED, BatchPlan
from deepinfer_jax.host.decision import ScheduleDecision

ENGRAM_NONE = -1      # engram_before before position 0 (engram_hash.DEAD)


def build_plan(decision: ScheduleDecision, token_bucket: int,
               step_cfg: StepConfig) -> BatchPlan:
    t_cap, n_cap = token_bucket, step_cfg.seq_bucket(token_bucket)
    token_ids = np.zeros(t_cap, np.int32)
    positions = np.zeros(t_cap, np.int32)
    token_seq = np.full(t_cap, n_cap, np.int32)
    seq_slot = np.full(n_cap, step_cfg.max_num_seqs, np.int32)
    seq_start = np.zeros(n_cap, np.int32)
    seq_len = np.zeros(n_cap, np.int32)
    seq_offset = np.zeros(n_cap, np.int32)
    block_table = np.full((n_cap, step_cfg.max_blocks_per_seq), step_cfg.num_pages, np.int32)
    sample_index = np.zeros(n_cap, np.int32)
    seq_samples = np.zeros(n_cap, np.bool_)
    prompt_len = np.zeros(n_cap, np.int32)
    f32 = lambda fill: np.full(n_cap, fill, np.float32)  # noqa: E731
    temperature, top_p, min_p = f32(0), f32(1), f32(0)
    repetition, presence, frequency = f32(1), f32(0), f32(0)
    top_k = np.zeros(n_cap, np.int32)
    seed = np.zeros(n_cap, np.uint32)
    allowed = np.full((n_cap, step_cfg.mask_words), -1, np.int32)
    next_token_ids = np.full(t_cap, -1, np.int32)
    num_drafts = np.zeros(n_cap, np.int32)
    draft_cap = np.zeros(n_cap, np.int32)
    window_from, rows_from = np.zeros(n_cap, np.int32), np.zeros(n_cap, np.int32)
    # filled by the engine (engine/engram_rows.py), which may import the hash; zero-size
    # without Engram, so V4's wire carries nothing for it
    engram_ids = np.zeros((t_cap, *step_cfg.plan_engram_shape), np.int32)
    engram_rows = np.zeros((t_cap, *step_cfg.engram_row_shape), step_cfg.engram_row_np_dtype)
    back = step_cfg.engram_lookback     # the step hashes: each row's tokens before its span
    engram_before = np.full((n_cap, back), ENGRAM_NONE, np.int32)
    offset = 0
    for row, seq in enumerate(decision.seqs):
        req, n = seq.request, seq.num_tokens
        span = slice(offset, offset + n)
        # the span's tokens and the one after each (drafts follow the last token)
        if seq.carried:      # the device has its tokens and true positions (device/spec_carry.py)
            token_ids[span] = next_token_ids[span] = CARRIED
        else:    # the known tokens, then the drafts (a booked step's placeholder may follow
            # the known tokens already: host/spec_booking.py)
            d = seq.num_drafts
            window = req.token_slice(seq.start, seq.start + n - d + 1)
            fed = window[: n - d] + req.drafts[:d]
            token_ids[span] = fed
            following = fed[1:] if d else window[1:]
            next_token_ids[offset: offset + len(following)] = following
        num_drafts[row], draft_cap[row] = seq.num_drafts, seq.draft_cap
        positions[span] = np.arange(seq.start, seq.start + n)
        token_seq[span] = row
        seq_slot[row], seq_start[row], seq_len[row], seq_offset[row] = seq.slot, seq.start, n, offset
        block_table[row, : len(seq.pages)] = seq.pages
        sample_index[row], seq_samples[row] = offset + n - 1, seq.samples
        prompt_len[row] = len(req.prompt)
        window_from[row], rows_from[row] = req.window_from, req.rows_from
        if back:
            engram_before[row, back - min(back, seq.start):] = _known(
                req, max(seq.start - back, 0), seq.start)
        p = req.params
        temperature[row], top_k[row], top_p[row], min_p[row] = (p.temperature, max(p.top_k, 0),
                                                                 p.top_p, p.min_p)
        repetition[row], presence[row], frequency[row] = (p.repetition_penalty, p.presence_penalty,
                                                          p.frequency_penalty)
        seed[row] = req.seed
        offset += n
    return BatchPlan(token_ids, positions, token_seq, seq_slot, seq_start, seq_len, seq_offset,
                     block_table, sample_index, seq_samples, prompt_len, temperature, top_k,
                     top_p, min_p, repetition, presence, frequency, seed, allowed,
                     next_token_ids, num_drafts, draft_cap, engram_ids, engram_rows,
                     engram_before, window_from, rows_from)


def _known(req, start: int, end: int) -> list[int]:
    """The request's tokens [start, end), which the host has read: only a span's own first
    token may be in flight, and the step resolves that one itself."""
    tokens = req.token_slice(start, end)
    if any(t < 0 for t in tokens):
        raise RuntimeError(f"request {req.request_id}: a token before its span is still in "
                           f"flight; the Engram look-back needs it")
    return tokens


def suppress_stops(plan: BatchPlan, decision: ScheduleDecision, eos_token_ids) -> None:
    """min_tokens: while a row's next token would come before its min_tokens-th, its EOS and
    stop tokens are masked out (in place, on top of any grammar mask)."""
    for row, seq in enumerate(decision.seqs):
        req = seq.request
        if seq.mask_stops:
            banned = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos
                                                       else set(eos_token_ids))
            bits = plan.allowed.view(np.uint32)
            for t in banned:
                bits[row, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
