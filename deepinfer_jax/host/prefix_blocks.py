"""The scheduler's side of prefix caching (no jax): which blocks a launched step completes and
which of them to snapshot, moving them into the cache once their tokens reach the host, and
giving an admitted request the pages of its longest cached prefix.

A completed block holds a reference to its page (and its snapshot, if any) while it waits:
its tokens may still be placeholders, and a stop may cut them, in which case it is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from deepinfer_jax.host.pages import PageAllocator
from deepinfer_jax.host.prefix_cache import PrefixCache, extend_block_keys
from deepinfer_jax.host.request import Request

if TYPE_CHECKING:
    from deepinfer_jax.host.scheduler import ScheduleDecision


@dataclasses.dataclass(frozen=True)
class PendingBlock:
    """A block a launched step completed, waiting for its tokens to reach the host before it
    enters the prefix cache. Holds a reference to the page (and the snapshot, if any)."""

    request: Request
    index: int
    page: int
    snapshot: int | None


class PrefixBlocks:
    def __init__(self, cache: PrefixCache, pages: PageAllocator, page_size: int):
        self.cache, self.pages, self.page_size = cache, pages, page_size
        self._pending: list[PendingBlock] = []

    def snapshot_saves(self, decision: ScheduleDecision) -> list[tuple[int, int]]:
        """Call when the step is launched (before `commit`): the blocks it completes wait to
        be cached, and where a row ends on a block boundary its slot is to be snapshotted
        after the step. Returns (slot, snapshot) pairs to copy."""
        bs, saves = self.page_size, []
        for seq in decision.seqs:
            req = seq.request
            end = seq.start + seq.num_tokens - seq.num_drafts
            if (len(req.block_keys) + 1) * bs <= req.num_tokens:   # else no new full block
                extend_block_keys(req.block_keys, req.known_tokens, bs)
            for index in range(seq.start // bs, end // bs):
                cached = (self.cache.get(req.block_keys[index])
                          if index < len(req.block_keys) else None)
                # A row with drafts ends the step past `end` (by its accepted drafts).
                wants_snapshot = (index + 1) * bs == end and seq.num_drafts == 0
                if cached is not None and (cached.snapshot is not None or not wants_snapshot):
                    continue
                snapshot = self.cache.allocate_snapshot() if wants_snapshot else None
                self.pages.share(req.pages[index])
                self._pending.append(PendingBlock(req, index, req.pages[index], snapshot))
                if snapshot is not None:
                    saves.append((req.slot, snapshot))
        return saves

    def cache_completed(self) -> None:
        """Move pending blocks whose tokens the host now knows into the cache; drop those
        whose tokens were cut (stop, abort)."""
        if not self._pending:
            return
        bs, waiting = self.page_size, []
        for block in self._pending:
            req, end = block.request, (block.index + 1) * bs
            known = req.known_tokens
            del req.block_keys[len(known) // bs:]     # a stop may have cut generated tokens
            extend_block_keys(req.block_keys, known, bs)
            if block.index < len(req.block_keys):
                keys = req.block_keys
                self.cache.insert(keys[block.index], keys[block.index - 1] if block.index
                                  else None, tuple(known[end - bs: end]), block.page,
                                  block.snapshot, known[end] if len(known) > end else None)
            elif req.num_tokens >= end:               # a token still in flight
                waiting.append(block)
            else:
                self.pages.free([block.page])
                if block.snapshot is not None:
                    self.cache.snapshots.free(block.snapshot)
        self._pending = waiting

    def reuse(self, req: Request):
        """Give an admitted request the pages of its longest cached prefix (at least its last
        token stays to compute, it samples the next). Returns the match."""
        extend_block_keys(req.block_keys, req.known_tokens, self.page_size)
        usable = req.tokens[: req.num_tokens - 1]
        match = self.cache.lookup(usable, req.block_keys[: len(usable) // self.page_size],
                                  following=req.known_tokens)
        for page in match.pages:
            self.pages.share(page)
        req.pages, req.num_computed = list(match.pages), match.num_tokens
        return match

    def count_lookup(self, req: Request, match) -> None:
        stats = self.cache.stats
        stats.queries += 1
        stats.hits += match.num_tokens > 0
        stats.hit_tokens += match.num_tokens
        req.replay_until = max(req.replay_until, match.num_cached)
