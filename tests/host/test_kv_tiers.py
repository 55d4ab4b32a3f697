"""The KV tiers below the device (host/kv_tiers/): round trips through host memory and disk,
byte budgets, 72 simulated hours of retention, corrupt files dropped and never served, a
writer killed mid-write, and an index that survives a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.kv_tiers import DEFAULT_RETENTION_S, KVTierConfig
from deepinfer_jax.host.kv_tiers import TierEntry, TierPayloadError, TierStore
from deepinfer_jax.host.kv_tiers.disk_tier import SUFFIX, TEMP_SUFFIX, file_name
from tests.conftest import REPO, subprocess_pythonpath
from tests.host.kv_tier_writer import payload

HOUR = 3600.0


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def entry(key: int, nbytes: int = 1024) -> TierEntry:
    rng = np.random.default_rng(key)
    return TierEntry(key, (rng.integers(0, 255, nbytes, dtype=np.uint8),), {"n": nbytes})


def assert_same(got: TierEntry | None, want: TierEntry):
    assert got is not None and got.key == want.key and dict(got.info) == dict(want.info)
    assert len(got.arrays) == len(want.arrays)
    for a, b in zip(got.arrays, want.arrays):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(raw(a), raw(b))     # bitwise, NaNs and -0.0 included


def raw(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def mixed_entry(key: int) -> TierEntry:
    """What a block set holds: bf16 pages and windows, f32 compressor tails, an int id, a
    0-d array and a non-contiguous view."""
    rng = np.random.default_rng(abs(key))
    pages = rng.standard_normal((2, 64, 8)).astype(ml_dtypes.bfloat16)
    tail = rng.standard_normal((4, 16)).astype(np.float32)
    return TierEntry(key, (pages, tail, np.array(7, np.int32), tail[:, ::2]),
                     {"tokens": list(range(64)), "parent": None, "next": 5})


@pytest.mark.parametrize("tiers", ["host", "disk", "both"])
def test_round_trip(tmp_path, tiers):
    cfg = KVTierConfig(host_bytes=1 << 20 if tiers != "disk" else 0,
                       disk_dir=str(tmp_path) if tiers != "host" else None,
                       disk_bytes=1 << 20 if tiers != "host" else 0)
    store = TierStore(cfg, Clock())
    want = [mixed_entry(k) for k in (3, -(1 << 70), 2**63 + 5)]   # any int is a key
    for e in want:
        store.put(e)
    for e in want:
        assert_same(store.get(e.key), e)
    assert store.get(99) is None
    stats = store.stats()
    tier = stats.host if tiers != "disk" else stats.disk
    assert (tier.hits, tier.misses, tier.entries) == (3, 1, 3)
    assert tier.bytes_read >= sum(e.nbytes for e in want) and tier.bytes_written >= tier.bytes_read
    if tiers != "host":
        assert len(files(tmp_path)) == (3 if tiers == "disk" else 0)   # host memory held all


def test_host_tier_moves_down_to_disk_and_disk_hits_come_back_up(tmp_path):
    clock = Clock()
    store = TierStore(KVTierConfig(host_bytes=3 * 1024, disk_dir=str(tmp_path),
                                   disk_bytes=1 << 20), clock)
    for key in range(10):
        store.put(entry(key))
        clock.t += 1
    stats = store.stats()
    assert stats.host.entries == 3 and stats.host.evictions == 7 and stats.disk.entries == 7
    assert_same(store.get(0), entry(0))            # from disk, now also in host memory
    assert store.stats().disk.hits == 1 and 0 in store.host
    assert_same(store.get(0), entry(0))
    assert store.stats().host.hits == 1


def test_byte_budgets_hold_under_many_inserts(tmp_path):
    clock = Clock()
    host_budget, disk_budget = 20_000, 60_000
    store = TierStore(KVTierConfig(host_bytes=host_budget, disk_dir=str(tmp_path),
                                   disk_bytes=disk_budget), clock)
    rng = np.random.default_rng(0)
    for key in range(300):
        store.put(entry(key, int(rng.integers(100, 8000))))
        if key % 7 == 0:
            store.get(int(rng.integers(0, key + 1)))
        clock.t += 1
        stats = store.stats()
        assert stats.host.bytes <= host_budget and stats.disk.bytes <= disk_budget
        on_disk = sum(os.path.getsize(tmp_path / f) for f in files(tmp_path))
        assert on_disk == stats.disk.bytes
    assert_same(store.get(299), entry(299, store.get(299).arrays[0].size))
    assert store.stats().host.evictions > 0 and store.stats().disk.evictions > 0
    too_big = TierStore(KVTierConfig(host_bytes=100), clock)
    too_big.put(entry(1, 1000))
    assert too_big.get(1) is None and too_big.stats().host.rejected == 1


def test_72_hours_entries_expire_on_time_and_not_before(tmp_path):
    """Ten entries put an hour apart, one of them used again at hour 50; the clock then walks
    90 hours in half-hour steps. The host tier holds 3, so most live on disk. At every step an
    entry is found exactly while less than 72 h have passed since its last use."""
    clock = Clock(0.0)
    store = TierStore(KVTierConfig(host_bytes=3 * 1024, disk_dir=str(tmp_path),
                                   disk_bytes=1 << 20), clock)
    last_use = {}
    for key in range(10):
        clock.t = key * HOUR
        store.put(entry(key))
        last_use[key] = clock.t
    for step in range(int(10 * HOUR / 1800), int(130 * HOUR / 1800)):
        clock.t = step * 1800.0
        if clock.t == 50 * HOUR:
            assert_same(store.get(4), entry(4))
            last_use[4] = clock.t
        stats = store.stats()
        assert stats.host.bytes <= 3 * 1024 and stats.disk.bytes <= 1 << 20
        for key, used in last_use.items():
            alive = clock.t < used + DEFAULT_RETENTION_S
            assert (key in store) == alive, (key, clock.t / HOUR)
    stats = store.stats()
    assert stats.host.entries == stats.disk.entries == 0 and files(tmp_path) == []
    assert stats.disk.expirations + stats.host.expirations >= 10 and stats.host.evictions >= 7


def test_a_restart_keeps_the_index_its_order_and_its_retention(tmp_path):
    clock = Clock(0.0)
    cfg = KVTierConfig(disk_dir=str(tmp_path), disk_bytes=5 * 1200)
    store = TierStore(cfg, clock)
    for key in range(4):
        store.put(entry(key))
        clock.t += HOUR
    store.get(0)                                    # 0 is now the most recently used
    del store
    clock.t += HOUR
    again = TierStore(cfg, clock)
    assert again.disk.keys() == [1, 2, 3, 0]
    again.put(entry(4))
    again.put(entry(5))                            # over budget: the oldest (1) goes
    assert 1 not in again
    for key in (0, 2, 3, 4, 5):
        assert_same(again.get(key), entry(key))
    clock.t += DEFAULT_RETENTION_S
    assert TierStore(cfg, clock).stats().disk.entries == 0 and files(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "swap_names",
                                    "garbage", "empty"])
def test_damaged_files_are_dropped_never_served(tmp_path, damage):
    cfg = KVTierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20)
    store = TierStore(cfg, Clock())
    for key in (1, 2):
        store.put(mixed_entry(key))
    path, other = tmp_path / file_name(1), tmp_path / file_name(2)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip_payload":
        data[-3] ^= 0x40
    elif damage == "flip_header":
        data[60] ^= 0x01                           # inside the JSON meta
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "empty":
        data = bytearray()
    if damage == "swap_names":
        os.replace(path, tmp_path / "x")
        os.replace(other, path)
        os.replace(tmp_path / "x", other)
    else:
        path.write_bytes(bytes(data))
    # the running store: the read that would serve the file checks it
    assert store.get(1) is None
    assert store.stats().disk.corrupt_dropped >= 1
    # a restarted store: the header checks drop what they can, the reads the rest
    fresh = TierStore(cfg, Clock())
    assert fresh.get(1) is None
    if damage != "swap_names":
        assert_same(fresh.get(2), mixed_entry(2))
    assert set(files(tmp_path)) <= {file_name(2)}


def test_a_writer_killed_before_its_rename_leaves_no_corrupt_entry(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tests.host.kv_tier_writer", str(tmp_path),
                             "stall"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": subprocess_pythonpath()})
    lines = [proc.stdout.readline().strip() for _ in range(6)]
    assert lines == ["0", "1", "2", "3", "4", "renaming"]
    assert any(f.endswith(TEMP_SUFFIX) for f in files(tmp_path))   # killed mid-write
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    store = TierStore(KVTierConfig(disk_dir=str(tmp_path), disk_bytes=3 << 20))   # real clock, as the writer
    assert sorted(store.disk.keys()) == [0, 1, 2, 3, 4] and 5 not in store
    assert files(tmp_path) == sorted(file_name(k) for k in range(5))   # the temp file is gone
    for key in range(5):
        assert_same(store.get(key), payload(key))
    assert store.stats().disk.corrupt_dropped == 0


@pytest.mark.parametrize("committed", [3, 11])
def test_a_writer_killed_at_any_point_leaves_a_consistent_index(tmp_path, committed):
    proc = subprocess.Popen([sys.executable, "-m", "tests.host.kv_tier_writer", str(tmp_path),
                             "loop"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": subprocess_pythonpath()})
    for _ in range(committed):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)               # somewhere in a later put: write, rename, evict
    proc.wait(timeout=10)
    store = TierStore(KVTierConfig(disk_dir=str(tmp_path), disk_bytes=3 << 20))   # real clock, as the writer
    keys = store.disk.keys()
    assert keys and max(keys) >= committed - 1
    assert sorted(files(tmp_path)) == sorted(file_name(k) for k in keys)
    assert store.stats().disk.bytes == sum(os.path.getsize(tmp_path / f) for f in files(tmp_path))
    for key in keys:
        assert_same(store.get(key), payload(key, size=(1 << 16) * (1 + key % 8)))
    assert all(not f.endswith(TEMP_SUFFIX) and f.endswith(SUFFIX) for f in files(tmp_path))


def test_config_is_validated_and_off_by_default():
    assert not KVTierConfig().enabled and KVTierConfig().retention_s == 72 * HOUR
    for bad in (dict(host_bytes=-1), dict(disk_bytes=10), dict(disk_dir="/tmp/x"),
                dict(host_bytes=1, retention_s=0)):
        with pytest.raises(EngineConfigError):
            KVTierConfig(**bad)
    assert TierStore.from_config(KVTierConfig()) is None


def test_engine_options_validate(tmp_path):
    from deepinfer_jax.config.engine import EngineConfig
    assert EngineConfig().kv_tiers == KVTierConfig()          # off by default
    with pytest.raises(EngineConfigError, match="enable_prefix_caching"):
        EngineConfig(kv_host_tier_bytes=1 << 20)
    with pytest.raises(EngineConfigError, match="several processes"):
        EngineConfig(enable_prefix_caching=True, kv_host_tier_bytes=1 << 20,
                     distributed={"coordinator_address": "127.0.0.1:1234", "num_processes": 2,
                                  "process_id": 0})
    for parallel in ({"ep": 4, "tp": 2}, {"dp": 2}):          # meshes, with ranks too: served
        EngineConfig(enable_prefix_caching=True, kv_host_tier_bytes=1 << 20, parallel=parallel)
    with pytest.raises(EngineConfigError):
        EngineConfig(kv_disk_tier_bytes=1 << 20)
    cfg = EngineConfig(enable_prefix_caching=True, kv_disk_tier_dir=str(tmp_path),
                       kv_disk_tier_bytes=1 << 20, kv_retention_s=60.0)
    assert cfg.kv_tiers == KVTierConfig(0, str(tmp_path), 1 << 20, 60.0)


def test_a_failing_disk_loses_the_entry_not_the_store(tmp_path, monkeypatch):
    store = TierStore(KVTierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20), Clock())
    store.put(entry(1))

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    store.put(entry(2))
    monkeypatch.undo()
    assert store.stats().disk.write_errors == 1 and 2 not in store
    assert files(tmp_path) == [file_name(1)]       # no temp file left behind
    assert_same(store.get(1), entry(1))


def test_payloads_the_tiers_cannot_store_are_refused(tmp_path):
    store = TierStore(KVTierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20), Clock())
    with pytest.raises(TierPayloadError):
        store.put(TierEntry(1, (np.array([object()]),)))
    with pytest.raises(TierPayloadError):
        store.put(TierEntry(1, (np.zeros(3),), {"x": object()}))
    assert files(tmp_path) == []
