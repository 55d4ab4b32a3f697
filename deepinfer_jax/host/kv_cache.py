"""The KV cache's host side (no jax): one owner for the compressed-row pages, the prefix index
and its slot snapshots. The scheduler asks it for a request's pages (idle cached blocks are
evicted before it says no), for the longest cached prefix at admission, for the snapshots a
launched step saves, and gives a request's pages back when it leaves.

Pages are reference counted (pages.py): a request holds one reference to each page of its
block table, the prefix cache one to each cached block's page, and a block that a launched
step completed holds one (and its snapshot, if any) while it waits for its tokens to reach the
host: they may still be placeholders, and a stop may cut them, in which case it is dropped.
Without prefix caching only the request references exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from deepinfer_jax.host.decision import ScheduledSeq, SnapshotSave, TierLoad, TierSpill
from deepinfer_jax.host.kv_tiers.blocks import TierBlocks
from deepinfer_jax.host.kv_tiers.prefetch import TierWorker
from deepinfer_jax.host.pages import PageAllocator, pages_needed
from deepinfer_jax.host.prefix_cache import (
    Match,
    PrefixCache,
    PrefixCacheStats,
    SnapshotAllocator,
    extend_block_keys,
)
from deepinfer_jax.host.request import Request


def bounded_replay(req: Request, match: Match, replay_tokens: int) -> Match:
    """A hit in bounded-replay mode: `req` keeps the matched pages and the snapshot of the
    compressor tails at their end, and computes again (window rows only) its last
    `replay_tokens` cached tokens, or all of them, to rebuild its windows."""
    start = max(0, match.num_tokens - replay_tokens)
    req.num_computed, req.window_from, req.rows_from = start, start, match.num_tokens
    return dataclasses.replace(match, num_tokens=start)


class Prefetching:
    """match_prefix's answer for a request whose prefix blocks are still being read."""


PREFETCHING = Prefetching()


@dataclasses.dataclass(frozen=True)
class PendingBlock:
    """A block a launched step completed, waiting for its tokens to reach the host before it
    enters the prefix cache. Holds a reference to the page (and the snapshot, if any)."""

    request: Request
    index: int
    page: int
    snapshot: int | None


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False,
                 num_snapshots: int = 0, snapshots_need_next_token: bool = False,
                 tiers: TierWorker | None = None, replay_tokens: int = 0):
        self.page_size = page_size
        self.replay_tokens = replay_tokens    # a bounded prefix replay (0: exact snapshots)
        self.pages = PageAllocator(num_pages)
        self.prefix_cache = (PrefixCache(self.pages, SnapshotAllocator(num_snapshots), page_size,
                                         snapshots_need_next_token) if prefix_caching else None)
        # the KV tiers below the device (host/kv_tiers/): evicted blocks go there, and come back
        self.tiers = (TierBlocks(tiers.store, self.prefix_cache, tiers)
                      if tiers is not None and self.prefix_cache is not None else None)
        self._pending: list[PendingBlock] = []

    @property
    def caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    def can_provide(self, num_pages: int) -> bool:
        """Whether `num_pages` pages can be had: free ones, then cached blocks that no
        sequence uses (eviction drops them leaf first, so each can go). Counts the cached
        blocks only when the free pages do not suffice."""
        free = self.pages.num_free
        if num_pages <= free or self.prefix_cache is None:
            return num_pages <= free
        return num_pages <= free + self.prefix_cache.num_idle_blocks()

    # ---- a request's pages ----------------------------------------------------------------
    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` the pages for its positions < num_tokens, evicting idle cached blocks if
        the free pages do not suffice. False (and nothing allocated) if they are not there.
        `req.pages` is replaced, never extended in place: a scheduled row keeps the list it
        was scheduled with."""
        need = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if self.prefix_cache is not None and not self.pages.can_allocate(need):
            self.prefix_cache.evict(need)
        if not self.pages.can_allocate(need):
            return False
        if need > 0:
            req.pages = req.pages + self.pages.allocate(need)
        return True

    def release(self, req: Request) -> None:
        """Give back `req`'s references to its pages (cached blocks keep theirs)."""
        self.pages.free(req.pages)
        req.pages = []

    # ---- prefix caching -------------------------------------------------------------------
    def match_prefix(self, req: Request) -> Match | Prefetching | None:
        """Give a request being admitted the pages of its longest cached prefix (at least its
        last token stays to compute, it samples the next) and count that much as computed.
        None without prefix caching; PREFETCHING (nothing given) while blocks of its prefix are
        being read from the disk tier. The caller releases them if it does not admit `req`."""
        if self.prefix_cache is None:
            return None
        extend_block_keys(req.block_keys, req.known_tokens, self.page_size)
        usable = req.tokens[: req.num_tokens - 1]
        keys = req.block_keys[: len(usable) // self.page_size]
        held = self.tiers.bring_in(usable, keys) if self.tiers is not None else []
        if held is None:
            return PREFETCHING
        match = self.prefix_cache.lookup(usable, keys, following=req.known_tokens)
        for page in match.pages:
            self.pages.share(page)
        self.pages.free(held)
        req.pages, req.num_computed = list(match.pages), match.num_tokens
        req.window_from, req.rows_from = 0, 0
        if self.replay_tokens and match.num_tokens:
            match = bounded_replay(req, match, self.replay_tokens)
        return match

    def cached_prefix_blocks(self, req: Request) -> int:
        """The leading blocks of req's known tokens this device's prefix cache holds (0
        without prefix caching), without taking them: where data-parallel placement sends
        a request."""
        if self.prefix_cache is None:
            return 0
        extend_block_keys(req.block_keys, req.known_tokens, self.page_size)
        usable = req.tokens[: req.num_tokens - 1]
        return self.prefix_cache.cached_blocks(usable, req.block_keys[: len(usable) // self.page_size])

    def count_lookup(self, req: Request, match: Match) -> None:
        """An admitted request used `match`: count it, and mark its cached tokens as computed
        before (recomputing them is a replay)."""
        stats = self.prefix_cache.stats
        stats.queries += 1
        stats.hits += bool(match.pages)      # (a bounded replay may compute them all)
        stats.hit_tokens += match.num_tokens
        req.replay_until = max(req.replay_until, match.num_cached)

    def count_replayed(self, req: Request, start: int) -> None:
        """A launched row computed req's tokens from `start` up to req.num_computed: those
        below its replay_until had been computed before (a replay: a bounded prefix replay, a
        preempted request's recomputation)."""
        if self.prefix_cache is not None:
            self.prefix_cache.stats.replayed_tokens += max(
                0, min(req.num_computed, req.replay_until) - start)
        req.replay_until = max(req.replay_until, req.num_computed)

    def snapshot_saves(self, seqs: Iterable[ScheduledSeq], snapshots: bool = True
                       ) -> tuple[SnapshotSave, ...]:
        """At launch, before the step's counts advance: the blocks it completes wait to be
        cached, and where a row ends on a block boundary its slot is to be snapshotted after
        the step. snapshots False: blocks only (a row registered after its step ran, its
        slot gone on: host/spec_booking.py)."""
        if self.prefix_cache is None:
            return ()
        bs, saves = self.page_size, []
        for seq in seqs:
            req = seq.request
            end = seq.start + seq.num_tokens - seq.num_drafts
            if (len(req.block_keys) + 1) * bs <= req.num_tokens:   # else no new full block
                extend_block_keys(req.block_keys, req.known_tokens, bs)
            for index in range(seq.start // bs, end // bs):
                cached = (self.prefix_cache.get(req.block_keys[index])
                          if index < len(req.block_keys) else None)
                # A row with drafts ends the step past `end` (by its accepted drafts).
                # (and not inside a bounded replay: its tails are those of its end)
                wants_snapshot = ((index + 1) * bs == end and seq.num_drafts == 0
                                  and end >= req.rows_from and snapshots)
                if cached is not None and (cached.snapshot is not None or not wants_snapshot):
                    continue
                snapshot = self.prefix_cache.allocate_snapshot() if wants_snapshot else None
                self.pages.share(seq.pages[index])
                self._pending.append(PendingBlock(req, index, seq.pages[index], snapshot))
                if snapshot is not None:
                    saves.append(SnapshotSave(seq.slot, snapshot, end))
        return tuple(saves)

    def cache_completed(self) -> None:
        """Move pending blocks whose tokens the host now knows into the cache (with the token
        after them, where their snapshot needs it); drop those whose tokens were cut (stop,
        abort)."""
        if not self._pending:
            return
        bs, waiting = self.page_size, []
        for block in self._pending:
            req, end = block.request, (block.index + 1) * bs
            known = req.known_tokens
            del req.block_keys[len(known) // bs:]     # a stop may have cut generated tokens
            extend_block_keys(req.block_keys, known, bs)
            if (block.index < len(req.block_keys) and block.snapshot is not None
                    and self.prefix_cache.snapshots_need_next_token
                    and len(known) <= end < req.num_tokens):
                # its snapshot serves only with the token after the block, still in flight
                # (the asynchronous loop plans before reading): cached now, the snapshot
                # would be dropped and the block could never be matched
                waiting.append(block)
            elif block.index < len(req.block_keys):
                keys = req.block_keys
                self.prefix_cache.insert(keys[block.index], keys[block.index - 1] if block.index
                                         else None, tuple(known[end - bs: end]), block.page,
                                         block.snapshot, known[end] if len(known) > end else None)
            elif req.num_tokens >= end:               # a token still in flight
                waiting.append(block)
            else:
                self.pages.free([block.page])
                if block.snapshot is not None:
                    self.prefix_cache.snapshots.free(block.snapshot)
        self._pending = waiting

    @property
    def prefetching(self) -> bool:
        return self.tiers is not None and self.tiers.worker is not None and self.tiers.worker.pending

    def wait_prefetch(self, timeout_s: float) -> None:
        if self.prefetching:
            self.tiers.worker.wait(timeout_s)

    def forget_prefetch(self, req: Request) -> None:
        if self.tiers is not None:
            self.tiers.forget(req.block_keys)

    def take_tier_ops(self) -> tuple[TierSpill | TierLoad, ...]:
        """The tier copies made since the last call, for the next launched step."""
        return () if self.tiers is None else self.tiers.take_ops()

    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters now, or None without prefix caching."""
        return None if self.prefix_cache is None else self.prefix_cache.current_stats()
