"""Snapshots of a slot's rings for the prefix cache (deepinfer_jax/device/snapshots.py): a
snapshot holds what a sequence keeps per slot besides its pages, every layer's window ring
and compressor tails and, when speculating, the MTP block's window ring. The scheduler asks
for copies in its decision: `restores` before the step (a prefix hit's rings into the
admitted request's slot, and its penalty counters recounted from the cached tokens, which
may have been a prompt for one request and generated text for another), `saves` after it
(a row that ended on a block end). Exact snapshots only (no bounded prefix replay)."""

from __future__ import annotations

import torch

from ascend_backend.model.state import StateCache
from deepinfer_jax.host.decision import Restore, SnapshotSave


def _rings(state: StateCache) -> list[torch.Tensor]:
    """Every per-slot ring of the state, [slots, ...] each, in a fixed order."""
    rings = []
    for ls in state.layers:
        rings.append(ls.window)
        for tail in (ls.tail, ls.index_tail):
            if tail is not None:
                rings += [tail.kv, tail.score]
    if state.mtp is not None:
        rings.append(state.mtp.window)
    return rings


class SnapshotPool:
    def __init__(self, state: StateCache, count: int):
        self.pool = [torch.zeros((count, *r.shape[1:]), dtype=r.dtype, device=r.device)
                     for r in _rings(state)]

    def save(self, state: StateCache, saves: tuple[SnapshotSave, ...]) -> None:
        """pool[save.snapshot] = the rings of save.slot, for each save."""
        for save in saves:
            for snap, ring in zip(self.pool, _rings(state), strict=True):
                snap[save.snapshot] = ring[save.slot]

    def restore(self, state: StateCache, restores: tuple[Restore, ...]) -> None:
        """In place: the rings of each restore's slot from its snapshot, and the slot's
        penalty counters recounted from the tokens the snapshot covers (positions >=
        prompt_len are generated tokens)."""
        for r in restores:
            for snap, ring in zip(self.pool, _rings(state), strict=True):
                ring[r.slot] = snap[r.snapshot]
            tokens = torch.tensor(r.tokens, dtype=torch.int64, device=state.prompt_mask.device)
            generated = torch.arange(len(r.tokens), device=tokens.device) >= r.prompt_len
            state.prompt_mask[r.slot] = False
            state.prompt_mask[r.slot, tokens[~generated]] = True
            state.output_counts[r.slot] = torch.bincount(
                tokens[generated], minlength=state.output_counts.shape[1])
