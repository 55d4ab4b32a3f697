"""Reading ahead from the disk tier (host/kv_tiers/prefetch.py), without a device: a chain
whose blocks only the disk holds is read on the worker's thread while admission passes the
request over, host-memory blocks are loaded at once, and a read that misses ends the chain
instead of holding the request forever."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.host.decision import TierLoad
from deepinfer_jax.host.kv_tiers import TierEntry, TierStore
from deepinfer_jax.host.kv_tiers.blocks import TierBlocks
from deepinfer_jax.host.kv_tiers.latency import LatencyHistogram
from deepinfer_jax.host.kv_tiers.prefetch import PENDING, STAGED, TierWorker
from deepinfer_jax.host.pages import PageAllocator
from deepinfer_jax.host.prefix_cache import PrefixCache, SnapshotAllocator, extend_block_keys

BS = 4
TOKENS = list(range(100, 108))                   # two blocks


def spilled_chain(store_config, gate=None):
    """A prefix cache and TierBlocks with a worker, whose store holds TOKENS' two blocks (as a
    first cache's evictions put them there); `gate` holds the worker's reads until set."""
    cache = PrefixCache(PageAllocator(3), SnapshotAllocator(2), BS)
    store = TierStore(store_config)
    keys = []
    extend_block_keys(keys, TOKENS, BS)
    for i, key in enumerate(keys):
        info = {"tokens": TOKENS[i * BS:(i + 1) * BS], "parent": keys[i - 1] if i else None,
                "next": None, "has_snapshot": False, "namespace": store_config.namespace}
        store.put(TierEntry(key, (np.full(3, i, np.int16),), info))

    if gate is not None:                       # the worker's reads wait for the gate
        lookup = store.lookup

        def held(key):
            assert gate.wait(30)
            return lookup(key)
        store.lookup = held
    worker = TierWorker(store)
    return cache, TierBlocks(store, cache, worker), keys


@pytest.fixture
def on_disk(tmp_path):
    return KVTierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20, namespace="m")


def test_disk_blocks_are_read_ahead_while_the_request_waits(on_disk):
    gate = threading.Event()
    cache, tiers, keys = spilled_chain(on_disk, gate)
    worker = tiers.worker
    assert tiers.bring_in(TOKENS + [1], keys) is None           # asked, not in yet
    assert tiers.bring_in(TOKENS + [1], keys) is None           # asked once only
    assert worker.status(keys[0]) == PENDING and tiers.take_ops() == ()
    assert cache.get(keys[0]) is None and cache.pages.num_free == 3
    gate.set()
    worker.drain()
    assert worker.status(keys[1]) == STAGED and not worker.pending
    held = tiers.bring_in(TOKENS + [1], keys)
    ops = tiers.take_ops()
    assert len(held) == 2 and [type(op) for op in ops] == [TierLoad, TierLoad]
    assert [int(op.entry.arrays[0][0]) for op in ops] == [0, 1]
    assert worker.status(keys[0]) is None                        # taken: nothing kept
    assert worker.admissions_deferred == 2 and worker.blocks_prefetched == 2
    disk = worker.stats()["disk"]
    assert disk.counters.hits == 2 and disk.prefetch_latency.count == 2


def test_host_memory_blocks_load_at_once():
    cache, tiers, keys = spilled_chain(KVTierConfig(host_bytes=1 << 20, namespace="m"))
    assert len(tiers.bring_in(TOKENS + [1], keys)) == 2
    report = tiers.worker.stats()
    assert set(report) == {"host"} and report["host"].counters.hits == 2
    assert report["host"].prefetch_latency.count == 2 and tiers.worker.admissions_deferred == 0


def test_a_read_that_misses_ends_the_chain(on_disk):
    gate = threading.Event()                   # the first look finds the read still going
    cache, tiers, keys = spilled_chain(on_disk, gate)
    directory = on_disk.disk_dir
    for name in os.listdir(directory):                 # both files altered on disk
        with open(os.path.join(directory, name), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\xff")
    assert tiers.bring_in(TOKENS + [1], keys) is None
    gate.set()
    tiers.worker.drain()
    assert tiers.bring_in(TOKENS + [1], keys) == [] and tiers.take_ops() == ()
    counters = tiers.worker.stats()["disk"].counters
    assert counters.corrupt_dropped == 1 and counters.hits == 0   # the second was never read


def test_an_aborted_requests_reads_are_dropped(on_disk):
    gate = threading.Event()
    _, tiers, keys = spilled_chain(on_disk, gate)
    assert tiers.bring_in(TOKENS + [1], keys) is None
    gate.set()
    tiers.worker.drain()
    assert tiers.worker.status(keys[0]) == STAGED
    tiers.forget(keys)
    assert all(tiers.worker.status(k) is None for k in keys)


def test_latency_quantiles_and_buckets():
    hist = LatencyHistogram(window=100)
    for ms in range(1, 201):                    # 1..200 ms; the window keeps the last 100
        hist.observe(ms / 1000)
    s = hist.summary()
    assert s.count == 200 and s.sum_s == pytest.approx(20.1)
    assert s.p50_s == pytest.approx(0.1505) and s.p99_s == pytest.approx(0.19901)
    assert s.buckets[-1] == (float("inf"), 200)
    assert dict(s.buckets)[0.1] == 100          # cumulative: <= 100 ms
