"""Joining the processes of one engine (multi-controller JAX, config/distributed.py).

`jax.distributed.initialize` must run before anything starts jax's backend (a device query,
an array, a compile): then `jax.devices()` lists every process's devices, a mesh over them
spans processes and a step's collectives cross them. On the CPU the cross-process
collectives are gloo's over TCP (jax 0.11.2's default, set here so that a changed default
cannot turn them off). A model built before the engine has started the backend already, so
`join_processes` is public: call it first; the engine's own call then finds them joined.
"""

from __future__ import annotations

import jax

from deepinfer_jax.config.distributed import DistributedConfig
from deepinfer_jax.config.errors import EngineConfigError


def join_processes(config: DistributedConfig | dict | None) -> None:
    """Join this process to the others of `config` (nothing for None); again with the same
    config, nothing. Raises EngineConfigError if the backend started first or the processes
    were joined otherwise."""
    config = DistributedConfig.from_options(config)
    if config is None:
        return
    if jax.distributed.is_initialized():
        joined = (jax.process_count(), jax.process_index())
        if joined != (config.num_processes, config.process_id):
            raise EngineConfigError(f"distributed: this process already joined as process "
                                    f"{joined[1]} of {joined[0]}, not {config.process_id} of "
                                    f"{config.num_processes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(config.coordinator_address, config.num_processes,
                                   config.process_id,
                                   initialization_timeout=config.initialization_timeout_s)
    except RuntimeError as error:
        if "before any JAX calls" not in str(error):
            raise
        raise EngineConfigError("distributed: jax's backend started before the processes "
                                "joined (something used jax first: a Model, a device query); "
                                "call deepinfer_jax.join_processes(distributed) before "
                                "anything else") from error
