"""A process that writes the disk KV tier and gets killed (tests/host/test_kv_tiers.py).

    python -m tests.host.kv_tier_writer DIR stall   # commits keys 0-4, then hangs inside
                                                    # the write of key 5, before its rename
    python -m tests.host.kv_tier_writer DIR loop    # commits keys 0, 1, 2, ... until killed

Each committed key is printed once its put returned, so the parent knows what must survive.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.host.kv_tiers import TierEntry, TierStore

DISK_BYTES = 3 << 20     # loop mode: room for ~6 entries, so eviction runs while it is killed


def payload(key: int, size: int = 1 << 17) -> TierEntry:
    """The block set `key`, the same in every process: what a reader must get back."""
    rng = np.random.default_rng(key)
    pages = rng.integers(0, 1 << 16, size // 2, dtype=np.uint16)
    window = rng.standard_normal(64).astype(np.float32).reshape(4, 16)
    return TierEntry(key, (pages, window), {"tokens": [key, key + 1]})


def main(directory: str, mode: str) -> None:
    store = TierStore(KVTierConfig(disk_dir=directory, disk_bytes=DISK_BYTES))
    if mode == "stall":
        for key in range(5):
            store.put(payload(key))
            print(key, flush=True)
        real_replace = os.replace

        def stalled(src, dst):     # the temp file is complete and fsynced; die before renaming
            print("renaming", flush=True)
            time.sleep(600)
            real_replace(src, dst)

        os.replace = stalled
        store.put(payload(5, size=1 << 20))
        return
    key = 0
    while True:
        store.put(payload(key, size=(1 << 16) * (1 + key % 8)))
        print(key, flush=True)
        key += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
