"""DistributedConfig: one engine spanning several processes (multi-controller JAX).

Every process runs the same engine on the same requests: the host side is deterministic, so
each builds the same plans and launches the same steps in the same order, and the one
compiled step runs over the devices of every process, its collectives crossing processes.
`parallel/distributed.py` joins the processes (`jax.distributed.initialize`) before the
backend starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from deepinfer_jax.config.errors import EngineConfigError

_FIELDS = ("coordinator_address", "num_processes", "process_id", "initialization_timeout_s")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str             # "host:port" of process 0's coordination service
    num_processes: int
    process_id: int                      # this process: 0 .. num_processes - 1
    # how long a process waits for the others to join before it fails
    initialization_timeout_s: int = 300

    def __post_init__(self):
        host, _, port = str(self.coordinator_address).rpartition(":")
        if not isinstance(self.coordinator_address, str) or not host or not port.isdigit():
            raise EngineConfigError(f"distributed: coordinator_address must be 'host:port', "
                                    f"got {self.coordinator_address!r}")
        for name in ("num_processes", "initialization_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"distributed: {name} must be a positive integer, "
                                        f"got {value!r}")
        if (not isinstance(self.process_id, int) or isinstance(self.process_id, bool)
                or not 0 <= self.process_id < self.num_processes):
            raise EngineConfigError(f"distributed: process_id must be in [0, "
                                    f"{self.num_processes}), got {self.process_id!r}")

    @classmethod
    def from_options(cls, value: Mapping | DistributedConfig | None) -> DistributedConfig | None:
        if value is None or isinstance(value, DistributedConfig):
            return value
        unknown = set(value) - set(_FIELDS)
        missing = set(_FIELDS[:3]) - set(value)
        if unknown or missing:
            raise EngineConfigError(f"distributed: expected the keys {list(_FIELDS[:3])} "
                                    f"(and optionally initialization_timeout_s); "
                                    + (f"unknown {sorted(unknown)}" if unknown else
                                       f"missing {sorted(missing)}"))
        return cls(**value)
