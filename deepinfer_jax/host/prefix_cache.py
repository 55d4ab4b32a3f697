"""The prefix cache (host side, no jax): full token blocks -> the page of their compressed rows
and, at some block ends, a snapshot of the sequence's per-slot state there.

DeepSeek-V4 keeps almost everything about old tokens in compressed rows (pages, shared by
reference count); what a sequence holds per slot (each layer's raw window ring and the
compressors' open blocks) is small. A block is `block_size` tokens (one page; a multiple of
every compress rate). A new sequence whose tokens start with cached blocks takes their pages,
restores the snapshot of the last matched block that has one, and computes only what follows:
the state a cold prefill would have built, bit for bit in batch-invariant mode. Snapshots
exist where a step ended on a block boundary (prefill chunks are cut there), so at most one
chunk of cached tokens is computed again. A preempted sequence resumes the same way.

Why snapshots and not a replay of the last ~140 tokens: a replayed token's window attention
at layer l reads the layer l-1 outputs of the W-1 tokens before it, which in turn read
theirs, so only a replay of layers * (W-1) tokens (5,461 on V4-Flash) rebuilds the upper
layers' windows exactly. A snapshot is exact and costs one window per layer (see
docs/prefix_caching.md). The bounded replay is a mode (config/prefix_replay.py,
host/kv_cache.bounded_replay): its snapshots keep no windows.

With MTP speculation a snapshot also holds the MTP block's window, whose row for the block's
last position pairs that position with the *next* token (MTP's input is the token after).
Such a snapshot therefore also records the token that followed the block when it was taken,
and serves only sequences that continue with the same token.

Blocks are keyed by a hash chained from the start, so equal blocks after different prefixes
never meet; each block also keeps its tokens, so a hash collision cannot alias two prefixes.
Blocks no sequence uses are evicted least recently used first, the last block of a chain
before the ones it extends; when the snapshot pool runs out, the oldest snapshot of an inner
block goes first.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from deepinfer_jax.host.pages import PageAllocator


def extend_block_keys(keys: list[int], tokens: list[int], block_size: int) -> None:
    """Append to `keys` the chained hashes of the full blocks of `tokens` it lacks."""
    parent = keys[-1] if keys else 0
    for start in range(len(keys) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start: start + block_size])))
        keys.append(parent)


class SnapshotAllocator:
    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, snapshot: int) -> None:
        self._free.append(snapshot)


@dataclasses.dataclass
class CachedBlock:
    key: int
    parent: int | None            # the key of the block before it (None for the first)
    tokens: tuple[int, ...]
    page: int
    snapshot: int | None          # slot state right after the block (None: none kept)
    last_used: int
    children: set[int] = dataclasses.field(default_factory=set)
    snapshot_next: int | None = None   # the token after the block when snapshotted (MTP)


@dataclasses.dataclass(frozen=True)
class Match:
    pages: tuple[int, ...]        # pages of the usable blocks, in order
    snapshot: int | None          # the snapshot at the end of the last one
    num_tokens: int               # tokens the sequence need not compute
    num_cached: int               # tokens in cached blocks (those past num_tokens lack a snapshot)
    snapshot_end: int             # tokens the snapshot covers (num_tokens unless a bounded
                                  # replay computes some of them again)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0              # admissions that looked the cache up
    hits: int = 0                 # ... and reused at least one block
    hit_tokens: int = 0           # tokens not computed thanks to the cache
    replayed_tokens: int = 0      # tokens computed again although their results had existed
    cached_blocks: int = 0
    snapshots_in_use: int = 0


class PrefixCache:
    def __init__(self, pages: PageAllocator, snapshots: SnapshotAllocator, block_size: int,
                 snapshots_need_next_token: bool = False):
        self.pages, self.snapshots, self.block_size = pages, snapshots, block_size
        self.snapshots_need_next_token = snapshots_need_next_token   # MTP speculation on
        self.blocks: dict[int, CachedBlock] = {}
        # told of each block evicted, before its page and snapshot are freed (the KV tiers)
        self.on_evict: Callable[[CachedBlock], None] | None = None
        self._clock = itertools.count()
        self.stats = PrefixCacheStats()

    def lookup(self, tokens: list[int], keys: list[int], following: list[int] | None = None
               ) -> Match:
        """The longest cached prefix of `tokens` (block keys `keys`) ending in a snapshot; when
        snapshots need the next token, one whose recorded next token is the one in `following`
        (the sequence's tokens, at least one past the prefix looked up)."""
        chain = self._chain(tokens, keys)
        cached = len(chain) * self.block_size
        while chain and not self._snapshot_serves(chain[-1], len(chain), following):
            chain.pop()
        now = next(self._clock)
        for block in chain:
            block.last_used = now
        end = len(chain) * self.block_size
        return Match(tuple(b.page for b in chain), chain[-1].snapshot if chain else None,
                     end, cached, end)

    def cached_blocks(self, tokens: list[int], keys: list[int]) -> int:
        """How many leading blocks of `tokens` this cache holds, looked at only: nothing is
        shared and no block's recency changes (data-parallel placement asks every rank)."""
        return len(self._chain(tokens, keys))

    def _chain(self, tokens: list[int], keys: list[int]) -> list[CachedBlock]:
        chain = []
        for i, key in enumerate(keys):
            block = self.blocks.get(key)
            if block is None or block.tokens != tuple(
                    tokens[i * self.block_size: (i + 1) * self.block_size]):
                break
            chain.append(block)
        return chain

    def _snapshot_serves(self, block: CachedBlock, num_blocks: int, following) -> bool:
        if block.snapshot is None:
            return False
        if not self.snapshots_need_next_token:
            return True
        end = num_blocks * self.block_size
        return following is not None and len(following) > end and (
            block.snapshot_next == following[end])

    def get(self, key: int) -> CachedBlock | None:
        return self.blocks.get(key)

    def insert(self, key: int, parent: int | None, tokens: tuple[int, ...], page: int,
               snapshot: int | None, snapshot_next: int | None = None) -> None:
        """Cache a block. Takes over one reference to `page` and the snapshot, and gives back
        what it does not keep (block already cached, or its parent gone; a snapshot that needs
        its next token without one)."""
        if snapshot is not None and self.snapshots_need_next_token and snapshot_next is None:
            self.snapshots.free(snapshot)
            snapshot = None
        block = self.blocks.get(key)
        if block is None and (parent is None or parent in self.blocks):
            block = self.blocks[key] = CachedBlock(key, parent, tokens, page, snapshot,
                                                   next(self._clock), snapshot_next=snapshot_next)
            if parent is not None:
                self.blocks[parent].children.add(key)
            return
        self.pages.free([page])
        if block is not None and block.snapshot is None and snapshot is not None:
            block.snapshot, block.snapshot_next = snapshot, snapshot_next
        elif snapshot is not None:
            self.snapshots.free(snapshot)

    def allocate_snapshot(self) -> int | None:
        """A free snapshot, taken from the least recently used block if none is free (inner
        blocks first: a block's descendants still reach their own snapshots)."""
        snapshot = self.snapshots.allocate()
        if snapshot is None:
            holders = [b for b in self.blocks.values() if b.snapshot is not None]
            if holders:
                block = min(holders, key=lambda b: (b.last_used, -len(b.children)))
                snapshot, block.snapshot = block.snapshot, None
        return snapshot

    def evict(self, pages_needed: int) -> None:
        """Drop least recently used blocks that no sequence uses until `pages_needed` pages
        are free, or nothing more can go."""
        while self.pages.num_free < pages_needed:
            # leaves only: a prefix outlives its extensions (a preempted sequence loses its
            # last blocks first, and resumes from the ones before)
            idle = [b for b in self.blocks.values()
                    if not b.children and self.pages.refs(b.page) == 1]
            if not idle:
                return
            self._drop(min(idle, key=lambda b: b.last_used).key)

    def num_idle_blocks(self) -> int:
        """Cached blocks that no sequence uses: the pages `evict` can free."""
        return sum(self.pages.refs(b.page) == 1 for b in self.blocks.values())

    def _drop(self, key: int) -> None:
        block = self.blocks.pop(key)
        for child in list(block.children):
            if child in self.blocks:
                self._drop(child)
        if block.parent in self.blocks:
            self.blocks[block.parent].children.discard(key)
        if self.on_evict is not None:
            self.on_evict(block)
        self.pages.free([block.page])
        if block.snapshot is not None:
            self.snapshots.free(block.snapshot)

    def current_stats(self) -> PrefixCacheStats:
        return dataclasses.replace(
            self.stats, cached_blocks=len(self.blocks),
            snapshots_in_use=self.snapshots.count - self.snapshots.num_free)
