"""The KV tiers' device side: runs a decision's TierSpills and TierLoads (host/decision.py)
in order before the step, and hands the spilled block sets to the tiers' worker once the
step's output has been read (their copies were started to the host with it, so nothing
waits; the worker writes them on its thread). Block sets the worker reads from disk ahead of
admission start their copy to the device on its thread (`_stage`), so the load before the
step finds them there. With data-parallel ranks each rank's copies run on its own slice of
the stacked state and snapshot pool (parallel/rank_tier_copies.py), into one shared store: a
block set holds the same arrays whichever rank wrote it."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np
from jax.sharding import NamedSharding

from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.device.snapshot_layout import SNAPSHOT_LAYOUT
from deepinfer_jax.device.snapshots import SlotRings
from deepinfer_jax.device.tier_copies import compile_batched_loads, compile_tier_copies, page_pools
from deepinfer_jax.engine.snapshot_copies import SnapshotCopies
from deepinfer_jax.engine.transfer import start_host_copy
from deepinfer_jax.host.decision import TierLoad, TierSpill
from deepinfer_jax.host.kv_tiers import TierEntry, TierStore
from deepinfer_jax.host.kv_tiers.prefetch import TierReport, TierWorker
from deepinfer_jax.model.state import StateCache
from deepinfer_jax.parallel.rank_snapshots import RANK
from deepinfer_jax.parallel.rank_tier_copies import compile_rank_tier_copies

Spilled = list[tuple[TierSpill, tuple[jax.Array, ...]]]
# Block sets from host memory written by one compiled scatter (their arrays stacked on the host,
# one transfer an array): a 16k prefix is 128 V4-Flash blocks, each its own transfers and
# scatter call otherwise (prefix-cache-gpu.md).
LOAD_BATCH = 32


class TierCopies:
    def __init__(self, state: StateCache, snapshots: SnapshotCopies, step_cfg: StepConfig,
                 store: TierStore):
        self.snapshots, self.store = snapshots, store
        self.worker = TierWorker(store, stage=_stage)
        self.ranks = step_cfg.compute.parallel.dp        # > 1: the state is rank-stacked
        self._ranked = (NamedSharding(jax.tree.leaves(state)[0].sharding.mesh, RANK)
                        if self.ranks > 1 else None)
        compile_copies = compile_rank_tier_copies if self.ranks > 1 else compile_tier_copies
        (self._gather_page, self._scatter_page, self._gather_snapshot,
         self._scatter_snapshot) = compile_copies(state, snapshots.pool, step_cfg.num_pages)
        self._num_page_arrays = len(page_pools(state))
        # rank-stacked states keep the per-op copies (parallel/rank_tier_copies.py)
        self._batched = self.ranks == 1
        if self._batched:
            self._scatter_pages, self._scatter_snapshots = compile_batched_loads(
                state, snapshots.pool, step_cfg.num_pages, LOAD_BATCH)
        self._num_pages = step_cfg.num_pages

    @classmethod
    def of(cls, config: KVTierConfig | None, model: object, state: StateCache,
           snapshots: SnapshotCopies | None, step_cfg: StepConfig) -> TierCopies | None:
        """The tiers' copies, or None where no tier is configured (EngineConfig refuses tiers
        without prefix caching, so `snapshots` is there whenever a tier is). Entries are
        namespaced by the model's config and the copied arrays' shapes and dtypes: a
        directory another model wrote serves this one nothing. (Two checkpoints of one
        config share a namespace: give each its own directory.)"""
        if config is None or not config.enabled:
            return None
        ranked = step_cfg.compute.parallel.dp > 1       # a rank's shapes: shared across dp
        shapes = [(a.shape[ranked:], str(a.dtype)) for a in
                  jax.tree.leaves((page_pools(state), snapshots.pool))]
        # the layout's name too: a snapshot's shapes alone need not tell two layouts apart
        digest = hashlib.blake2b(repr((model, step_cfg.page_size, shapes,
                                       SNAPSHOT_LAYOUT)).encode(),
                                 digest_size=16).hexdigest()
        store = TierStore(dataclasses.replace(config, namespace=digest))
        return cls(state, snapshots, step_cfg, store)

    def run(self, state: StateCache, ops: tuple, spilled: Spilled) -> StateCache:
        """`state` after `ops`, in order (a decision's; with ranks a tuple of them per rank,
        each rank's in order), the snapshot pool updated in place; the spilled block sets'
        device arrays are appended to `spilled`, copying to the host."""
        per_rank = enumerate(ops) if self.ranks > 1 else ((None, ops),)
        for rank, rank_ops in per_rank:
            loads: list[TierLoad] = []     # consecutive loads from host memory, not yet run
            for op in rank_ops:
                if self._batched and isinstance(op, TierLoad) and _on_host(op):
                    loads.append(op)
                    if len(loads) == LOAD_BATCH:
                        state, loads = self._load_batch(state, loads), []
                    continue
                if loads:             # in order: a later op may touch what they write
                    state, loads = self._load_batch(state, loads), []
                if isinstance(op, TierSpill):
                    spilled.append((op, self._spill(state, op, rank)))
                else:
                    state = self._load(state, op, rank)
            if loads:
                state = self._load_batch(state, loads)
        return state

    def _spill(self, state: StateCache, op: TierSpill, rank: int | None) -> tuple[jax.Array, ...]:
        arrays = self._gather_page(state, self._id(op.page, rank))
        if op.snapshot is not None:
            arrays += self._gather_snapshot(self.snapshots.pool, self._id(op.snapshot, rank))
        if rank is not None:         # the asking rank's row of the stacked results
            arrays = tuple(a[rank] for a in arrays)
        start_host_copy(*arrays)
        return arrays

    def _load(self, state: StateCache, op: TierLoad, rank: int | None) -> StateCache:
        # explicit transfers: the loop may run under jax.transfer_guard("disallow")
        n = self._num_page_arrays
        if rank is None:
            arrays, extra = jax.device_put(tuple(op.entry.arrays)), ()
        else:        # stacked: the rank's row, zeros elsewhere (not written: `active`)
            arrays = jax.device_put(tuple(_stacked(a, rank, self.ranks) for a in op.entry.arrays),
                                    self._ranked)
            active = (np.arange(self.ranks) == rank).astype(np.int32)
            extra = (jax.device_put(active, self._ranked),)
        state = self._scatter_page(state, self._id(op.page, rank), *extra, arrays[:n])
        if op.snapshot is not None:
            pool: SlotRings = self.snapshots.pool
            self.snapshots.pool = self._scatter_snapshot(pool, self._id(op.snapshot, rank),
                                                         *extra, arrays[n:])
        return state

    def _load_batch(self, state: StateCache, ops: list[TierLoad]) -> StateCache:
        """Up to LOAD_BATCH host-memory block sets (distinct pages and snapshots, as a
        decision's are) in one transfer an array and one scatter each for pages and
        snapshots, padded with ids past the pools (written nowhere) and zeros."""
        n, pad = self._num_page_arrays, LOAD_BATCH - len(ops)
        pages = np.array([op.page for op in ops] + [self._num_pages] * pad, np.int32)
        page_rows = tuple(_stack([op.entry.arrays[i] for op in ops], pad) for i in range(n))
        state = self._scatter_pages(state, jax.device_put(pages), jax.device_put(page_rows))
        with_snapshot = [op for op in ops if op.snapshot is not None]
        if with_snapshot:
            pool_leaves = jax.tree.leaves(self.snapshots.pool)
            pad = LOAD_BATCH - len(with_snapshot)
            ids = np.array([op.snapshot for op in with_snapshot]
                           + [pool_leaves[0].shape[0]] * pad, np.int32)
            rings = tuple(_stack([op.entry.arrays[n + i] for op in with_snapshot], pad)
                          for i in range(len(pool_leaves)))
            self.snapshots.pool = self._scatter_snapshots(
                self.snapshots.pool, jax.device_put(ids), jax.device_put(rings))
        return state

    def _id(self, i: int, rank: int | None) -> jax.Array:
        """A page or snapshot id: with ranks, every rank's (the others' copies are dropped or
        write back what they hold)."""
        if rank is None:
            return _index(i)
        return jax.device_put(np.full(self.ranks, i, np.int32), self._ranked)

    def put(self, spilled: Spilled) -> None:
        self.worker.put([TierEntry(op.key, tuple(jax.device_get(arrays)), op.info)
                         for op, arrays in spilled])

    def drain(self) -> None:
        """Wait for the worker's puts and prefetches asked so far."""
        self.worker.drain()

    def stats(self) -> dict[str, TierReport]:
        return self.worker.stats()


def _stage(entry: TierEntry) -> TierEntry:
    # explicit transfer, on the worker's thread: the copy overlaps the loop's work
    return TierEntry(entry.key, tuple(jax.device_put(tuple(entry.arrays))), entry.info)


def _on_host(op: TierLoad) -> bool:
    """The block set is in host memory (a disk tier's prefetch stages its arrays on the device
    already: those are scattered one by one)."""
    return all(isinstance(a, np.ndarray) for a in op.entry.arrays)


def _stack(arrays: list[np.ndarray], pad: int) -> np.ndarray:
    out = np.zeros((len(arrays) + pad, *arrays[0].shape), arrays[0].dtype)
    out[:len(arrays)] = arrays
    return out


def _index(i: int) -> jax.Array:
    return jax.device_put(np.int32(i))


def _stacked(array: np.ndarray, rank: int, ranks: int) -> np.ndarray:
    out = np.zeros((ranks, *array.shape), array.dtype)
    out[rank] = array
    return out
