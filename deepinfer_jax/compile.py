"""Ahead-of-time compilation of the step for every declared bucket, with the persistent cache.

At start-up each token bucket's step is lowered and compiled once (`jit(...).lower(...)
.compile()`); serving then only calls these executables, which raise on a shape mismatch
instead of recompiling. The persistent compilation cache makes a second start fast.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache
from tqdm.auto import tqdm

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine_config import ResolvedEngineConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.plan import BatchPlan, build_plan
from deepinfer_jax.plan_wire import PlanWire
from deepinfer_jax.scheduler import ScheduleDecision
from deepinfer_jax.speculative import spec_step
from deepinfer_jax.state import StateCache
from deepinfer_jax.step import step

_cache_dir: str | None = None


def enable_persistent_cache(directory: str | None) -> None:
    """Point jax's persistent compilation cache at `directory` (None or "" leaves it off)."""
    global _cache_dir
    if not directory or directory == _cache_dir:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.set_cache_dir(directory)
    _cache_dir = directory


def plan_wire(token_bucket: int, ecfg: ResolvedEngineConfig) -> PlanWire:
    """The wire layout of a bucket's plans (from an empty plan: the shapes are fixed)."""
    return PlanWire.for_plan(build_plan(ScheduleDecision(()), token_bucket, ecfg))


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A bucket's compiled step, called with the host's numpy plan: one buffer goes to the
    device (see plan_wire.py), the step unpacks it."""

    executable: jax.stages.Compiled
    wire: PlanWire

    def __call__(self, params: ModelParams, state: StateCache, plan: BatchPlan):
        return self.executable(params, state, jax.device_put(self.wire.pack(plan)))


# Batch-invariant mode: XLA may otherwise keep bf16 intermediates in higher precision inside
# fusions ("excess precision"), and fusion decisions follow the shapes, so a row's rounding
# would depend on the batch; and GPU scatter-adds / autotuning must be deterministic.
BATCH_INVARIANT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False,
                                    "xla_gpu_deterministic_ops": True}


def compile_steps(params: ModelParams, state: StateCache, cfg: ModelConfig,
                  ecfg: ResolvedEngineConfig, speculative: bool = False
                  ) -> dict[int, CompiledStep]:
    """One compiled step per token bucket (state donated): the plain step, or the speculative
    one (verify drafts, then MTP drafting)."""
    enable_persistent_cache(ecfg.compilation_cache_dir)
    step_fn = functools.partial(spec_step if speculative else step, cfg=cfg, ecfg=ecfg)
    options = BATCH_INVARIANT_COMPILER_OPTIONS if cfg.batch_invariant else None
    compiled = {}
    buckets = tqdm(ecfg.token_buckets, unit="bucket",
                   desc=f"compiling {'speculative ' if speculative else ''}step buckets",
                   disable=not ecfg.show_progress)
    for t in buckets:
        buckets.set_postfix(tokens=t)
        wire = plan_wire(t, ecfg)

        def wired_step(params, state, buffer, wire=wire):
            return step_fn(params, state, wire.unpack(buffer))

        jitted = jax.jit(wired_step, donate_argnums=(1,))
        compiled[t] = CompiledStep(
            jitted.lower(params, state, wire.spec()).compile(compiler_options=options), wire)
    return compiled
