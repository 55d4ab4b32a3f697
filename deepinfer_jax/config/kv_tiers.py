"""KVTierConfig: the tiers below the device that keep prefix-cache blocks (host/kv_tiers/).

Off unless a budget is given. Each tier has a byte budget; entries leave a tier least recently
used first (host memory -> disk -> dropped) and expire `retention_s` after they were last
stored or served, in whichever tier they are.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.config.errors import EngineConfigError

# The reference design keeps a conversation's cache for 72 hours (issue 40).
DEFAULT_RETENTION_S = 72 * 3600.0


@dataclasses.dataclass(frozen=True)
class KVTierConfig:
    host_bytes: int = 0              # host-memory tier budget (0: no host tier)
    disk_dir: str | None = None      # the disk tier's directory (one store per directory)
    disk_bytes: int = 0              # disk tier budget, file sizes included (0: no disk tier)
    retention_s: float = DEFAULT_RETENTION_S
    # what the cached blocks were computed by (the engine fills it: model config and shapes);
    # an entry of another namespace in the same directory is never loaded
    namespace: str = ""

    def __post_init__(self):
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise EngineConfigError("KV tier byte budgets must be >= 0")
        # a directory without a budget (or the reverse) is a half-given option, not "off"
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise EngineConfigError("the disk KV tier needs both kv_disk_tier_dir and "
                                    "kv_disk_tier_bytes > 0")
        if not self.retention_s > 0:
            raise EngineConfigError(f"kv_retention_s must be > 0, got {self.retention_s}")

    @property
    def has_host(self) -> bool:
        return self.host_bytes > 0

    @property
    def has_disk(self) -> bool:
        return self.disk_bytes > 0

    @property
    def enabled(self) -> bool:
        return self.has_host or self.has_disk
