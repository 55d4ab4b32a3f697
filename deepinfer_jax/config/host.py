"""HostOptions: the engine options only the host reads (never part of a compiled step)."""

from __future__ import annotations

import dataclasses

from deepinfer_jax.config.kv_tiers import KVTierConfig


@dataclasses.dataclass(frozen=True)
class HostOptions:
    compilation_cache_dir: str | None    # the persistent compilation cache (None: off)
    show_progress: bool                  # progress bars while compiling and generating
    async_scheduling: bool               # plan step N+1 while step N runs
    launch_thread: bool                  # with async scheduling, launch steps from a worker
    seed: int                            # draws the seeds of requests that give none
    grammar_compile_timeout_s: float
    compile_threads: int                 # step buckets compiled at once at start-up
    step_cache: bool = True              # compiled CPU steps kept on disk (engine/step_cache.py)
    kv_tiers: KVTierConfig | None = None  # prefix-cache blocks below the device (None: off)
