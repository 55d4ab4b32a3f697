"""What `Scheduler.schedule()` decides for one step (no jax): the rows, the prefix-cache
snapshot copies around the step, and which compiled sampler it needs.

A decision is self-contained for building the step's plan: `schedule()` has already booked
the step as launched when it returns (counts advanced, placeholders appended, requests that
reach their length limit finished and their slot and pages released), so each row carries the
slot and pages it was scheduled with instead of reading them off the request.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.host.kv_tiers.entry import TierEntry
from deepinfer_jax.host.request import Request


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int          # tokens already in the device state (position of the first new token)
    num_tokens: int     # tokens fed this step (including drafts)
    samples: bool       # the chunk reaches the last known token: sample the next one
    slot: int           # the request's state slot for this step
    # its pages for this step, in order; never mutated (the allocator hands a request a new
    # list when it grows), so it stays as scheduled after the request moves on
    pages: list[int]
    num_drafts: int = 0 # the last num_drafts fed tokens are MTP drafts to verify
    draft_cap: int = 0  # the most drafts the row may propose for the next step
    # where the sampled token goes in request.generated (a PLACEHOLDER until postprocess);
    # None when the row samples nothing, and in speculative steps (their tokens are appended
    # in postprocess)
    token_index: int | None = None
    mask_stops: bool = False   # its next token comes before min_tokens: EOS and stop tokens banned
    # continues the row its request sampled in the speculative step still unread (the
    # asynchronous loop, host/spec_booking.py): its tokens come from the device and `start`
    # is a lower bound (the true one is higher by that step's accepted drafts)
    carried: bool = False


@dataclasses.dataclass(frozen=True)
class Restore:
    """Before the step: load a cached snapshot into an admitted request's slot."""

    slot: int
    snapshot: int
    end: int                      # the block end it was taken at (its ring order)
    tokens: tuple[int, ...]       # the tokens before the first one computed (penalty counters)
    prompt_len: int


@dataclasses.dataclass(frozen=True)
class SnapshotSave:
    """After the step: copy a slot's state into a snapshot (the row ended on a block end)."""

    slot: int
    snapshot: int
    end: int                      # the block end: tokens the snapshot covers (its ring order)


@dataclasses.dataclass(frozen=True)
class TierSpill:
    """Before the step: copy an evicted block's page (and snapshot) out for the KV tiers; its
    page and snapshot are free on the host already, so this runs before anything reuses them."""

    key: int
    page: int
    snapshot: int | None
    info: dict          # tokens, parent key, the token after (host/kv_tiers/blocks.py)


@dataclasses.dataclass(frozen=True)
class TierLoad:
    """Before the step: write a block set from the KV tiers into a page (and a snapshot)."""

    page: int
    snapshot: int | None      # None: the entry's snapshot is not loaded (no free one)
    entry: TierEntry


@dataclasses.dataclass(frozen=True)
class ScheduleDecision:
    seqs: tuple[ScheduledSeq, ...]
    speculative: bool = False     # run the speculative step (verify drafts, draft with MTP)
    restores: tuple[Restore, ...] = ()
    saves: tuple[SnapshotSave, ...] = ()
    # KV tier copies, in the order the host made them (a page can be spilled and loaded again)
    tier_ops: tuple[TierSpill | TierLoad, ...] = ()
    # some row samples with top-k / top-p / min-p: the step needs the sampler that sorts the
    # vocabulary (where the step does not decide that on the device)
    truncating_sampler: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)
