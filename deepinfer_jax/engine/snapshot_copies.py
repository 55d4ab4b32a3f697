"""The prefix cache's snapshot pool on the device and its two copies, fed from the host's
Restore / SnapshotSave lists (host/decision.py): one pool, or with data-parallel ranks one per
rank (parallel/rank_snapshots.py), whose copies take a rank's row of each argument."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.device.snapshots import compile_copies, init_pool, slot_rings
from deepinfer_jax.host.decision import Restore, SnapshotSave
from deepinfer_jax.model.state import StateCache
from deepinfer_jax.parallel.rank_snapshots import compile_rank_copies, init_rank_pool


class SnapshotCopies:
    def __init__(self, state: StateCache, step_cfg: StepConfig):
        self.step_cfg = step_cfg
        self.ranked = step_cfg.compute.parallel.dp > 1
        pool, copies = ((init_rank_pool, compile_rank_copies) if self.ranked else
                        (init_pool, compile_copies))
        # a bounded prefix replay rebuilds the windows: snapshots keep none (not with ranks)
        self.windows = self.ranked or not step_cfg.bounded_replay
        extra = () if self.ranked else (self.windows,)
        self.pool = pool(state, step_cfg.num_snapshots, *extra, spare=step_cfg.spec_tokens)
        self._save, self._restore = copies(state, self.pool, step_cfg.max_num_seqs,
                                           step_cfg.max_model_len, *extra)

    def restore(self, state: StateCache, restores: tuple) -> StateCache:
        """state with the snapshots of `restores` (a decision's Restores, or with ranks a tuple
        of them per rank) in their slots (the state is donated)."""
        rows = [self._restore_arrays(r) for r in self._per_rank(restores)]
        return self._restore(state, self.pool, *self._stacked(rows))

    def save(self, state: StateCache, saves: tuple) -> None:
        """Copy the slots of `saves` (SnapshotSaves, or a tuple of them per rank) into the
        pool (the pool is donated and replaced)."""
        rows = [self._save_arrays(s) for s in self._per_rank(saves)]
        self.pool = self._save(slot_rings(state, self.windows), self.pool, *self._stacked(rows))

    def _restore_arrays(self, restores: tuple[Restore, ...]) -> tuple[np.ndarray, ...]:
        width, step_cfg = self.step_cfg.max_num_seqs, self.step_cfg
        slots = np.full(width, step_cfg.max_num_seqs, np.int32)
        snapshots = np.zeros(width, np.int32)
        tokens = np.full((width, step_cfg.max_model_len), -1, np.int32)
        prompt_len, ends = np.zeros(width, np.int32), np.zeros(width, np.int32)
        for i, r in enumerate(restores):
            slots[i], snapshots[i], prompt_len[i] = r.slot, r.snapshot, r.prompt_len
            tokens[i, : len(r.tokens)] = r.tokens
            ends[i] = r.end
        return snapshots, slots, tokens, prompt_len, ends

    def _save_arrays(self, saves: tuple[SnapshotSave, ...]) -> tuple[np.ndarray, ...]:
        width = self.step_cfg.max_num_seqs
        slots, ends = np.zeros(width, np.int32), np.zeros(width, np.int32)
        snapshots = np.full(width, self.step_cfg.num_snapshots, np.int32)   # padding: dropped
        for i, save in enumerate(saves):
            slots[i], snapshots[i], ends[i] = save.slot, save.snapshot, save.end
        return slots, snapshots, ends

    def _per_rank(self, copies: tuple) -> tuple:
        return copies if self.ranked else (copies,)

    def _stacked(self, rows: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        """One pool's arrays as they are; the ranks' stacked on a leading rank axis."""
        if not self.ranked:
            return rows[0]
        return tuple(np.stack(arrays) for arrays in zip(*rows, strict=True))
