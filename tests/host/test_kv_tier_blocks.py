"""The prefix cache's traffic with the KV tiers (host/kv_tiers/blocks.py), without a device:
evicted blocks become spills, a device miss that a tier holds becomes loads into fresh pages,
in one ordered list, and a block set whose tokens or parent differ is never loaded."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.host.decision import TierLoad, TierSpill
from deepinfer_jax.host.kv_tiers import TierEntry, TierStore
from deepinfer_jax.host.kv_tiers.blocks import TierBlocks
from deepinfer_jax.host.pages import PageAllocator
from deepinfer_jax.host.prefix_cache import PrefixCache, SnapshotAllocator, extend_block_keys

BS = 4


def setup(num_pages=3, namespace="model-a"):
    cache = PrefixCache(PageAllocator(num_pages), SnapshotAllocator(2), BS)
    store = TierStore(KVTierConfig(host_bytes=1 << 20, namespace=namespace))
    return cache, TierBlocks(store, cache)


def cache_chain(cache, tokens):
    keys = []
    extend_block_keys(keys, tokens, BS)
    for i, key in enumerate(keys):
        page = cache.pages.allocate(1)[0]
        snapshot = cache.snapshots.allocate() if i == len(keys) - 1 else None
        cache.insert(key, keys[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]), page,
                     snapshot)
    return keys


def spill_to_store(tiers, ops):
    """What the engine does with spills: the page's (and snapshot's) arrays into the store."""
    for op in ops:
        arrays = (np.full(3, op.page, np.int16),) + (
            (np.full(2, op.snapshot, np.int16),) if op.snapshot is not None else ())
        tiers.store.put(TierEntry(op.key, arrays, op.info))


def test_evicted_blocks_spill_and_come_back_in_order():
    cache, tiers = setup()
    tokens = list(range(100, 108))
    keys = cache_chain(cache, tokens)                 # 2 blocks, 2 of the 3 pages
    cache.evict(3)                                    # both go, leaf first
    ops = tiers.take_ops()
    assert [type(op) for op in ops] == [TierSpill, TierSpill]
    assert [op.key for op in ops] == keys[::-1] and ops[0].snapshot is not None
    spill_to_store(tiers, ops)
    held = tiers.bring_in(tokens + [1], keys)
    loads = tiers.take_ops()
    assert [type(op) for op in loads] == [TierLoad, TierLoad]
    assert [cache.get(k).page for k in keys] == [op.page for op in loads] == held
    assert loads[1].snapshot is not None and loads[0].snapshot is None
    match = cache.lookup(tokens + [1], keys)
    assert match.num_tokens == 8 and match.snapshot == loads[1].snapshot
    cache.pages.free(held)
    assert all(cache.pages.refs(p) == 1 for p in held)


def test_a_load_that_needs_room_spills_first():
    cache, tiers = setup(num_pages=2)
    old = list(range(8))
    old_keys = cache_chain(cache, old)
    cache.evict(2)
    spill_to_store(tiers, tiers.take_ops())
    cache_chain(cache, list(range(50, 58)))           # fills the pool again
    held = tiers.bring_in(old + [1], old_keys)
    ops = tiers.take_ops()
    # each load's page came from an eviction just before it, whose copy must run first
    kinds = [type(op).__name__ for op in ops]
    assert kinds == ["TierSpill", "TierLoad", "TierSpill", "TierLoad"]
    assert ops[0].page == ops[1].page and ops[2].page == ops[3].page
    assert len(held) == 2


def test_another_models_blocks_are_not_loaded(tmp_path):
    def on_disk(namespace):
        cache = PrefixCache(PageAllocator(3), SnapshotAllocator(2), BS)
        store = TierStore(KVTierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20,
                                       namespace=namespace))
        return cache, TierBlocks(store, cache)

    cache, tiers = on_disk("model-a")
    tokens = list(range(8))
    keys = cache_chain(cache, tokens)
    cache.evict(3)
    spill_to_store(tiers, tiers.take_ops())
    _, other = on_disk("model-b")                    # the same directory, another model
    assert other.bring_in(tokens + [1], keys) == [] and other.take_ops() == ()
    _, same = on_disk("model-a")                     # the same model, restarted
    assert len(same.bring_in(tokens + [1], keys)) == 2


def test_other_tokens_or_parent_are_not_loaded():
    cache, tiers = setup()
    tokens = list(range(8))
    keys = cache_chain(cache, tokens)
    cache.evict(3)
    ops = tiers.take_ops()
    for op in ops:                                    # a store whose entries lie about tokens
        tiers.store.put(TierEntry(op.key, (np.zeros(1),), {**op.info, "tokens": [9] * BS}))
    assert tiers.bring_in(tokens + [1], keys) == [] and tiers.take_ops() == ()
    assert cache.get(keys[0]) is None
