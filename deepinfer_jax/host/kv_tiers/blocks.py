"""TierBlocks: the prefix cache's traffic with the KV tiers (host side, no jax).

Blocks the device prefix cache evicts become TierSpills (their page and snapshot are copied
out before the step that may reuse them, then put in the TierStore). At admission, the
blocks of a request's prefix that the device cache lacks and the tiers hold come back:
each gets a page (and a free snapshot if it had one), enters the device cache, and becomes
a TierLoad written before the step. Spills and loads form one ordered list, run on the
device in the order they were made, since a page spilled can be reallocated to a load in
the same step (and a block loaded can be evicted again before its load ran).

With a TierWorker (prefetch.py), blocks only the disk holds are read ahead on its thread:
`bring_in` asks for them and returns None (admit this request later) until they are in host
memory; host-memory blocks are read at once. Without one, the store is read in place (tests).

Only free snapshots are loaded into, never one taken from a cached block: a restore of this
same step may still read that one, and it runs after the loads.
"""

from __future__ import annotations

from deepinfer_jax.host.decision import TierLoad, TierSpill
from deepinfer_jax.host.kv_tiers.entry import TierEntry
from deepinfer_jax.host.kv_tiers.prefetch import MISSED, PENDING, TierWorker
from deepinfer_jax.host.kv_tiers.store import TierStore
from deepinfer_jax.host.prefix_cache import CachedBlock, PrefixCache


class TierBlocks:
    def __init__(self, store: TierStore, cache: PrefixCache, worker: TierWorker | None = None):
        self.store, self.cache, self.worker = store, cache, worker
        self._ops: list[TierSpill | TierLoad] = []
        cache.on_evict = self._spill

    def _spill(self, block: CachedBlock) -> None:
        self._ops.append(TierSpill(block.key, block.page, block.snapshot, {
            "tokens": list(block.tokens), "parent": block.parent, "next": block.snapshot_next,
            "has_snapshot": block.snapshot is not None,
            "namespace": self.store.config.namespace}))

    def take_ops(self) -> tuple[TierSpill | TierLoad, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops

    def bring_in(self, tokens: list[int], keys: list[int]) -> list[int] | None:
        """Load the blocks of `keys` (over `tokens`) that follow the device cache's match
        from the tiers, while each stays a chain from the start. Returns the pages of the
        chain with one extra reference each (so that making room for the next block cannot
        evict them), which the caller frees after its lookup; None (and nothing loaded) while
        some of those blocks are still being read from disk."""
        if self.worker is not None and not self._prefetched(keys):
            self.worker.admissions_deferred += 1
            return None
        bs, held = self.cache.block_size, []
        for i, key in enumerate(keys):
            block_tokens = tuple(tokens[i * bs: (i + 1) * bs])
            block = self.cache.get(key)
            if block is None:
                block = self._load(key, keys[i - 1] if i else None, block_tokens)
            if block is None or block.tokens != block_tokens:
                break
            self.cache.pages.share(block.page)
            held.append(block.page)
        self.forget(keys)         # read ahead for a block past where the chain broke: unused
        return held

    def _prefetched(self, keys: list[int]) -> bool:
        """Whether the chain's blocks that only the disk holds are in host memory (read for
        this admission); asks the worker for those that are not, and for none past a block
        no tier holds."""
        wanted = []
        for key in keys:
            if self.cache.get(key) is not None:
                continue
            status = self.worker.status(key)
            if status == MISSED:
                break
            if status is not None:          # staged, or on its way
                continue
            where = self.store.locate(key)
            if where is None:
                break
            if where == "disk":
                wanted.append(key)
        self.worker.prefetch(wanted)
        return not any(self.worker.status(key) == PENDING for key in keys)

    def _entry(self, key: int) -> TierEntry | None:
        if self.worker is None:
            return self.store.get(key)
        prefetched, entry = self.worker.take(key)
        return entry if prefetched else self.worker.get_host(key)

    def forget(self, keys: list[int]) -> None:
        """A request that will not be admitted: drop what was read ahead for it."""
        if self.worker is not None:
            self.worker.discard(keys)

    def _load(self, key: int, parent: int | None, tokens: tuple[int, ...]
              ) -> CachedBlock | None:
        entry = self._entry(key)
        # the key is a hash of tokens alone: the tokens and the parent settle that it is this
        # block, the namespace that this model and these shapes computed it
        if (entry is None or tuple(entry.info["tokens"]) != tokens
                or entry.info["parent"] != parent
                or entry.info.get("namespace") != self.store.config.namespace):
            return None
        pages = self.cache.pages
        if not pages.can_allocate(1):
            self.cache.evict(1)
        if not pages.can_allocate(1):
            return None
        page = pages.allocate(1)[0]
        snapshot = self.cache.snapshots.allocate() if entry.info["has_snapshot"] else None
        self.cache.insert(key, parent, tokens, page, snapshot,
                          entry.info["next"] if snapshot is not None else None)
        block = self.cache.get(key)
        if block is None or block.page != page:     # not taken (its parent is gone)
            return None
        self._ops.append(TierLoad(page, block.snapshot, entry))
        return block
