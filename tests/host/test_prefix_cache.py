"""The prefix cache's bookkeeping on the host alone: keys, matching, reference counts, LRU
eviction, snapshot reuse, and the scheduler's use of it (no model, no jax)."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.contract import StepOutput
from deepinfer_jax.host.decision import ScheduledSeq
from deepinfer_jax.host.kv_cache import KVCacheManager
from deepinfer_jax.host.pages import PageAllocator
from deepinfer_jax.host.prefix_cache import PrefixCache, SnapshotAllocator, extend_block_keys
from deepinfer_jax.host.request import PLACEHOLDER, Request, SamplingParams
from deepinfer_jax.host.scheduler import Scheduler
from tests.conftest import REPO

BS = 4
MODEL = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")


def keys_of(tokens):
    keys = []
    extend_block_keys(keys, tokens, BS)
    return keys


def cache_with(num_pages=16, num_snapshots=8):
    pages = PageAllocator(num_pages)
    return PrefixCache(pages, SnapshotAllocator(num_snapshots), BS), pages


def put(cache, pages, tokens, snapshot_every_block=True):
    """Cache every full block of `tokens` as a finished sequence would leave it."""
    keys = keys_of(tokens)
    for i, key in enumerate(keys):
        page = pages.allocate(1)[0]     # the sequence's page, handed over to the cache
        snapshot = cache.snapshots.allocate() if snapshot_every_block else None
        cache.insert(key, keys[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]), page,
                     snapshot)
    return keys


def test_keys_chain_from_the_start():
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = keys_of([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]                    # the same second block after a different first one
    grown = a[:1]
    extend_block_keys(grown, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert grown == a


def test_lookup_matches_whole_blocks_up_to_the_last_snapshot():
    cache, pages = cache_with()
    tokens = list(range(100, 112))                        # three blocks
    put(cache, pages, tokens)
    probe = tokens[:10] + [0, 0]                          # diverges inside the third block
    match = cache.lookup(probe, keys_of(probe))
    assert match.num_tokens == 8 and match.num_cached == 8 and len(match.pages) == 2
    cache.blocks[keys_of(tokens)[1]].snapshot = None      # no snapshot at the end of block 2
    match = cache.lookup(probe, keys_of(probe))
    assert match.num_tokens == 4 and match.num_cached == 8
    assert cache.lookup([5] * 12, keys_of([5] * 12)).num_tokens == 0


def test_with_mtp_a_snapshot_serves_only_the_same_next_token():
    """Under MTP speculation a snapshot's MTP window pairs the block's last position with the
    token after it: a sequence continuing differently falls back to an earlier snapshot, and
    a snapshot taken without its next token is not kept."""
    pages = PageAllocator(16)
    cache = PrefixCache(pages, SnapshotAllocator(8), BS, snapshots_need_next_token=True)
    tokens = list(range(100, 112))                        # three blocks
    keys = keys_of(tokens)
    for i, key in enumerate(keys):
        following = tokens[(i + 1) * BS] if (i + 1) * BS < len(tokens) else None
        cache.insert(key, keys[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]),
                     pages.allocate(1)[0], cache.snapshots.allocate(), following)
    assert cache.blocks[keys[2]].snapshot is None         # its next token was unknown
    assert cache.snapshots.num_free == 8 - 2
    same = tokens[:9] + [0]
    assert cache.lookup(same[:9], keys_of(same[:9]), following=same).num_tokens == 8
    other = tokens[:8] + [7, 0]                           # another token right after block 2
    match = cache.lookup(other[:9], keys_of(other[:9]), following=other)
    assert match.num_tokens == 4 and match.num_cached == 8
    assert cache.lookup(same[:9], keys_of(same[:9])).num_tokens == 0   # no next token given


def test_with_mtp_a_block_whose_next_token_is_in_flight_waits_for_it():
    """The asynchronous loop plans the next step before reading the one that completed a
    block: the token after the block is a placeholder then. The block is cached once that
    token is read, with its snapshot (cached before, it would lose the snapshot, and no later
    request could match it: the two loops' admissions then differed)."""
    kv = KVCacheManager(16, BS, prefix_caching=True, num_snapshots=8,
                        snapshots_need_next_token=True)
    req = Request("r", [100, 101, 102], SamplingParams(max_tokens=4), 0)
    req.generated = [103, PLACEHOLDER]     # the step feeds 103 at position 3, samples position 4
    assert kv.grow(req, 4)
    (save,) = kv.snapshot_saves([ScheduledSeq(req, 3, 1, True, 0, req.pages)])
    assert save.end == 4
    key = keys_of([100, 101, 102, 103])[0]
    kv.cache_completed()
    assert kv.prefix_cache.get(key) is None               # its next token is still unread
    req.generated[-1] = 7                                  # the step is read
    kv.cache_completed()
    block = kv.prefix_cache.get(key)
    assert (block.snapshot, block.snapshot_next) == (save.snapshot, 7)
    kv.release(req)
    again = Request("a", [100, 101, 102, 103, 7, 8], SamplingParams(max_tokens=4), 1)
    assert kv.match_prefix(again).num_tokens == 4
    other = Request("o", [100, 101, 102, 103, 9, 8], SamplingParams(max_tokens=4), 2)
    assert kv.match_prefix(other).num_tokens == 0          # another token after the block


def test_a_hash_collision_cannot_alias_two_prefixes():
    cache, pages = cache_with()
    tokens = [1, 2, 3, 4]
    keys = put(cache, pages, tokens)
    assert cache.lookup([9, 9, 9, 9], keys).num_tokens == 0   # same key, other tokens


def test_insert_gives_back_what_it_does_not_keep():
    cache, pages = cache_with(num_pages=4, num_snapshots=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = keys_of(tokens)
    page = pages.allocate(1)[0]
    cache.insert(keys[1], keys[0], tuple(tokens[4:]), page, cache.snapshots.allocate())
    assert pages.num_free == 4 and cache.snapshots.num_free == 2   # parent missing: refused
    put(cache, pages, tokens, snapshot_every_block=False)
    twin = pages.allocate(1)[0]
    cache.insert(keys[1], keys[0], tuple(tokens[4:]), twin, cache.snapshots.allocate())
    assert pages.refs(twin) == 0                                   # already cached: page back
    assert cache.blocks[keys[1]].snapshot is not None              # but its snapshot is kept


def test_eviction_is_lru_takes_descendants_and_spares_used_pages():
    cache, pages = cache_with(num_pages=6)
    a = put(cache, pages, [1] * 8)                 # two blocks
    put(cache, pages, [2] * 8)                     # B
    c = put(cache, pages, [3] * 8)
    assert pages.num_free == 0
    cache.lookup([1] * 8, a)                       # B is now the least recently used, then A
    cache.lookup([3] * 8, c)
    pages.share(cache.blocks[c[0]].page)           # a running sequence holds C's first page
    cache.evict(2)
    assert set(cache.blocks) == set(a) | set(c)    # B went first (least recently used)
    cache.evict(5)
    # A went (its second block with its first), then C's second; C's first is in use
    assert set(cache.blocks) == {c[0]} and pages.num_free == 5


def test_a_full_snapshot_pool_takes_from_the_oldest_inner_block():
    cache, pages = cache_with(num_snapshots=3)
    a = put(cache, pages, list(range(12)))          # three blocks, three snapshots
    snapshot = cache.allocate_snapshot()
    assert snapshot is not None
    assert cache.blocks[a[0]].snapshot is None      # the inner block lost its snapshot ...
    assert cache.lookup(list(range(12)), a).num_tokens == 12   # ... the chain's end did not


def _scheduler(num_pages, budget=24, page_size=16):
    step_cfg = EngineConfig(max_num_seqs=4, max_model_len=128, page_size=page_size,
                            num_pages=num_pages, max_num_batched_tokens=budget,
                            enable_prefix_caching=True, compilation_cache_dir=None).resolve(MODEL)
    return Scheduler(step_cfg, MODEL.eos_token_ids)


def _run(sched, request):
    """Serve `request` alone to the end, synchronously; returns the decisions."""
    sched.add(request)
    decisions = []
    while sched.has_work():
        decision = sched.schedule()
        n = len(decision.seqs)
        sched.postprocess(decision, StepOutput(np.full(n, 7, np.int32), np.zeros(n, np.float32),
                                               np.zeros((n, 1), np.int32),
                                               np.zeros((n, 1), np.float32)))
        decisions.append(decision)
    return decisions


def test_scheduler_cuts_chunks_at_blocks_and_reuses_the_cached_prefix():
    prompt = list(range(20, 95))                    # 75 tokens, blocks of 16, budget 24
    sched = _scheduler(num_pages=32)
    first = _run(sched, Request("a", prompt, SamplingParams(max_tokens=2), 0))
    assert [d.seqs[0].num_tokens for d in first] == [16, 16, 16, 16, 11, 1]  # cut at block ends
    # each chunk that ends on a block end has its slot snapshotted after the step
    # (at its block end, which orders its rings: device/snapshot_layout.py)
    assert [[(s.slot, s.snapshot, s.end) for s in d.saves] for d in first] == [
        [(0, 0, 16)], [(0, 1, 32)], [(0, 2, 48)], [(0, 3, 64)], [], []]
    again = _run(sched, Request("b", prompt + [50], SamplingParams(max_tokens=1), 1))
    seq = again[0].seqs[0]
    assert seq.start == 64 and again[0].restores[0].tokens == tuple(prompt[:64])
    assert again[0].restores[0].snapshot == 3 and again[0].restores[0].slot == seq.slot
    assert again[0].restores[0].end == 64
    stats = sched.kv_cache.prefix_stats()
    assert stats.queries == 2 and stats.hits == 1 and stats.hit_tokens == 64
    # every page is either free or held by the cache alone
    pages = sched.kv_cache.pages
    held = {b.page for b in sched.kv_cache.prefix_cache.blocks.values()}
    assert pages.num_free + len(held) == 32
    assert all(pages.refs(p) == 1 for p in held)


def test_a_bounded_replay_hit_recomputes_the_last_tokens_without_writing_rows():
    kv = KVCacheManager(16, BS, prefix_caching=True, num_snapshots=8, replay_tokens=5)
    tokens = list(range(100, 112))                        # three blocks
    put(kv.prefix_cache, kv.pages, tokens)
    req = Request("r", tokens + [7, 8], SamplingParams(max_tokens=4), 0)
    match = kv.match_prefix(req)
    # the snapshot at 12 serves; the last 5 cached tokens are computed again
    assert len(match.pages) == 3 and match.num_tokens == 7 and match.snapshot is not None
    assert match.snapshot_end == 12         # the snapshot still restores at its block end
    assert (req.num_computed, req.window_from, req.rows_from) == (7, 7, 12)
    kv.release(req)
    short = Request("s", tokens[:4] + [9], SamplingParams(max_tokens=4), 1)
    kv.match_prefix(short)                                # shorter than the replay: all of it
    assert (short.num_computed, short.window_from, short.rows_from) == (0, 0, 4)
