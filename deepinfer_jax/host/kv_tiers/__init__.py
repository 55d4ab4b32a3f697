"""KV retention below the device: prefix-cache block sets kept in host memory, then on disk,
for up to a retention time (issue 40). Plain Python and numpy."""

from deepinfer_jax.host.kv_tiers.entry import (
    TierEntry,
    TierError,
    TierFileCorrupt,
    TierPayloadError,
    TierStats,
)
from deepinfer_jax.host.kv_tiers.store import TierStore, TierStoreStats

__all__ = ["TierEntry", "TierError", "TierFileCorrupt", "TierPayloadError", "TierStats",
           "TierStore", "TierStoreStats"]
