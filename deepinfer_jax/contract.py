"""The types that cross between the host and the device, and nothing else.

The host builds a `BatchPlan` of numpy arrays for every step; the jitted step takes it (packed
in one buffer, `engine/transfer.py`) and returns a `StepOutput` (or a `SpecStepOutput` when it
verifies drafts), which the host reads back as numpy arrays one step late.

This module imports nothing but the standard library, so that host modules can build plans
without jax; the device package registers these dataclasses as pytrees (`device/__init__.py`).

Shapes: T tokens and N sequence rows of the step's bucket, V the vocabulary, L the top
logprobs kept, k the most drafts per row, S = k + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

Array = Any   # np.ndarray on the host, jax.Array inside the step

# A speculative step's row whose tokens are all CARRIED (-2) continues the row its request
# sampled in the speculative step before, which the host has not read yet: the device feeds
# that step's bonus token and drafts and shifts the row's positions by its accepted drafts
# (device/spec_carry.py; the plan's positions and seq_start assume none were accepted).
CARRIED = -2


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Everything the device needs for one step, as fixed-shape arrays.

    The batch is ragged: the new tokens of N' <= N sequences lie back to back in T flat slots.
    A token id of -1 (PLACEHOLDER) is a token sampled by the previous step and not yet seen by
    the host: the step reads it on the device. Padding tokens and rows point out of range
    (token_seq = N, seq_slot = max_num_seqs, pages = num_pages): gathers from them are masked
    and scatters to them are dropped."""

    token_ids: Array     # i32[T]
    positions: Array     # i32[T]   position of each token in its sequence
    token_seq: Array     # i32[T]   batch row of each token (N for padding)
    seq_slot: Array      # i32[N]   state slot of each row
    seq_start: Array     # i32[N]   tokens already in the state = first new position
    seq_len: Array       # i32[N]   new tokens this step (0 for padding rows)
    seq_offset: Array    # i32[N]   flat index of the row's first token
    block_table: Array   # i32[N, max_blocks]  page of each logical block of the row
    sample_index: Array  # i32[N]   flat index of the token whose logits are sampled
    seq_samples: Array   # bool[N]  the row samples a token this step
    prompt_len: Array    # i32[N]   positions >= prompt_len hold generated tokens (penalties)
    # sampling controls per row (see device/sampling.SamplingRows)
    temperature: Array   # f32[N]
    top_k: Array         # i32[N]
    top_p: Array         # f32[N]
    min_p: Array         # f32[N]
    repetition_penalty: Array  # f32[N]
    presence_penalty: Array    # f32[N]
    frequency_penalty: Array   # f32[N]
    seed: Array          # u32[N]
    allowed: Array       # i32[N, ceil(V/32)]  token bitmask (grammar, min_tokens); -1 = all
    # speculative decoding (MTP)
    next_token_ids: Array  # i32[T]  the token after each token when the host knows it, else -1
    num_drafts: Array      # i32[N]  drafts at the end of the row's span, to verify
    draft_cap: Array       # i32[N]  the most drafts the row may propose for the next step
    # DeepSeek-V4.1's Engram: each token's row ids into each Engram layer's table, hashed on the
    # host over the sequence's look-back (StepConfig.plan_engram_shape); i32[T, 0, 0] without
    # Engram or where the step hashes
    engram_ids: Array      # i32[T, L_e, C]
    # ... and, with the tables in host memory (StepConfig.engram_row_dim), those rows gathered
    # by the host, in the tables' dtype; [T, L_e, C, 0] when the tables are on the device
    engram_rows: Array     # [T, L_e, C, ed]
    # where the step hashes (StepConfig.engram_lookback = b): the b tokens before each row's
    # span, the last one last, -1 before position 0; i32[N, 0] elsewhere
    engram_before: Array   # i32[N, b]
    # a bounded prefix replay (config/prefix_replay.py): window rows of positions below
    # window_from are not visible (the replay starts there), and positions below rows_from
    # write no compressed rows or compressor tails (theirs are cached); 0 elsewhere
    window_from: Array     # i32[N]
    rows_from: Array       # i32[N]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_slot.shape[0]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    next_tokens: Array     # i32[N]     sampled token of each row (meaningful where it samples)
    logprob: Array         # f32[N]     its raw logprob
    top_ids: Array         # i32[N, L]  the L most likely tokens
    top_logprobs: Array    # f32[N, L]


@dataclasses.dataclass(frozen=True)
class SpecStepOutput:
    new_tokens: Array      # i32[N, S]     accepted drafts, then the bonus token
    num_new: Array         # i32[N]        a + 1 for rows that sample, else 0
    drafts: Array          # i32[N, k]     drafts for the next step
    num_drafts: Array      # i32[N]        how many of them to verify (confidence, cap)
    logprob: Array         # f32[N, S]     raw logprobs of the new tokens
    top_ids: Array         # i32[N, S, L]
    top_logprobs: Array    # f32[N, S, L]


CROSSING_TYPES = (BatchPlan, StepOutput, SpecStepOutput)
