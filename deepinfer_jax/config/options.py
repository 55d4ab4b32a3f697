"""Where the engine's options are resolved: arguments first, DEEPINFER_* variables second,
then defaults that follow the device. The one module that reads the environment; nothing is
read at import time, and traced code only ever sees the frozen result.

| variable | sets |
|---|---|
| DEEPINFER_BACKEND=jax\\|ascend | backend: which engine runs the steps (config/platforms.py) |
| DEEPINFER_BATCH_INVARIANT=1 | batch_invariant |
| DEEPINFER_ENABLE_MTP_VARLEN=1, DEEPINFER_USE_NEXTN_DECODE=k | speculative_config (MTP, up to k drafts) |
| DEEPINFER_KERNELS=name[,name...] | every Pallas op's implementations, in order |
| DEEPINFER_KERNEL_<OP>=name[,name...] | one op's (GROUPED_GEMM, SINK_ATTENTION, SINKHORN, INDEXER) |
| DEEPINFER_STEP_FORMULATION=cpu\\|gpu | the jnp formulation traced (config/compute.py) |
| DEEPINFER_INVARIANT_TILE=n | batch-invariant mode's row tile |
| DEEPINFER_COMPILE_THREADS=n | step buckets compiled at once at start-up |
| DEEPINFER_DEVICE_MEMORY_GIB=g | device_memory_gib: the memory a device has, in GiB |
| DEEPINFER_GPU_MEMORY_UTILIZATION=u | gpu_memory_utilization: the share of it the engine plans for |
| XDG_CACHE_HOME | where the persistent compilation cache goes |
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from deepinfer_jax.config.compute import KERNEL_OPS, ComputeConfig, KernelChoices

log = logging.getLogger("deepinfer_jax")

ATTENTION_MIN_TOKENS = 512      # the sink-attention kernel's default threshold (KernelChoices)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the defaults depend on: the backend's platform, on GPUs the compute capability
    ("9.0"), and the memory XLA's allocator may use where the device reports it (its
    `memory_stats()["bytes_limit"]`; None on the CPU). Gathered once by the engine
    (engine/devices.py)."""

    platform: str = "cpu"
    compute_capability: str | None = None
    memory_bytes: int | None = None
    device_count: int = 1          # every process's (config/distributed.py)
    process_count: int = 1

    @property
    def major(self) -> int:
        return int((self.compute_capability or "0").split(".")[0])


CPU = DeviceFacts()


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    base = _environ(environ).get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "deepinfer-jax" / "xla")


def xla_flags(environ: Mapping[str, str] | None = None) -> str:
    """XLA_FLAGS as XLA will read it: compiled programs depend on it (the step cache's key)."""
    return _environ(environ).get("XLA_FLAGS", "")


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """A DEEPINFER_* on/off variable: None if unset or empty, else whether it is not "0"."""
    value = _environ(environ).get(name, "")
    return None if value == "" else value != "0"


def backend(given: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The backend that runs the steps: `backend` if given, else DEEPINFER_BACKEND, else
    "jax" (config/platforms.py's BACKENDS)."""
    return given or _environ(environ).get("DEEPINFER_BACKEND") or "jax"


def speculative_from_environment(environ: Mapping[str, str] | None = None) -> dict | None:
    env = _environ(environ)
    if not flag("DEEPINFER_ENABLE_MTP_VARLEN", env):
        return None
    return {"method": "mtp", "varlen": True,
            "num_speculative_tokens": int(env.get("DEEPINFER_USE_NEXTN_DECODE") or 5)}


def compile_threads(given: int | None, environ: Mapping[str, str] | None = None) -> int:
    """Buckets compiled at once: one unless asked. On GPUs XLA times candidate GEMMs on the
    device while it compiles, and concurrent timings disturb each other; on the CPU, XLA's
    client crashed the process (segfaults in the compiler, an abort serializing) three times
    in CI runs with buckets compiling side by side on pool threads, and never with one."""
    forced = given or _environ(environ).get("DEEPINFER_COMPILE_THREADS")
    return max(1, int(forced)) if forced else 1


# vLLM's default share of a GPU's memory for weights, activations and the cache.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def device_memory(given_gib: float | None, device: DeviceFacts,
                  environ: Mapping[str, str] | None = None) -> int | None:
    """Bytes of memory one device has for the engine: `device_memory_gib` if given, else
    DEEPINFER_DEVICE_MEMORY_GIB, else what the device reports (None where it reports nothing:
    the CPU, whose pool then keeps its size from the shapes alone)."""
    value = given_gib or _environ(environ).get("DEEPINFER_DEVICE_MEMORY_GIB")
    if value:
        return int(float(value) * 2**30)
    return device.memory_bytes


def memory_utilization(given: float | None, environ: Mapping[str, str] | None = None) -> float:
    """The share of the device's memory the engine plans for (gpu_memory_utilization)."""
    value = given or _environ(environ).get("DEEPINFER_GPU_MEMORY_UTILIZATION")
    return float(value) if value else DEFAULT_GPU_MEMORY_UTILIZATION


def default_kernels(device: DeviceFacts) -> KernelChoices:
    """The per-device implementation table. The Mosaic GPU kernels use Hopper's wgmma and
    TMA, which exist on compute capability 9.x only (Blackwell, 10.x, has neither wgmma nor
    these kernels yet): there every op takes its kernel first; any other device the jnp
    references."""
    if device.platform == "gpu" and device.major == 9:
        return KernelChoices.every_op(("mosaic_gpu", "reference"),
                                      attention_min_tokens=ATTENTION_MIN_TOKENS)
    if device.platform == "gpu":
        log.info("deepinfer_jax: no Pallas kernels for compute capability %s yet; every op "
                 "runs its jnp reference", device.compute_capability)
    return KernelChoices()


def kernels_from(value, what: str) -> KernelChoices:
    """`kernels=` as given to the engine: a KernelChoices, one implementation list for every
    op, or a dict op -> list (other ops keep their reference). Chosen kernels run at every
    batch size."""
    if isinstance(value, KernelChoices):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(KERNEL_OPS)
        if unknown:
            raise ValueError(f"{what}: unknown op(s) {sorted(unknown)}; ops are {KERNEL_OPS}")
        return KernelChoices(**value)
    return KernelChoices.every_op(value)


def _kernels_from_environment(env: Mapping[str, str], device: DeviceFacts) -> KernelChoices:
    """DEEPINFER_KERNEL_<OP> for one op, ahead of DEEPINFER_KERNELS for every op, ahead of the
    device's table. An op named by either runs its choice at every batch size."""
    every = env.get("DEEPINFER_KERNELS")
    chosen = {op: env.get(f"DEEPINFER_KERNEL_{op.upper()}") or every for op in KERNEL_OPS}
    chosen = {op: tuple(names.split(",")) for op, names in chosen.items() if names}
    choices = dataclasses.replace(default_kernels(device), **chosen)
    if "sink_attention" in chosen:
        choices = dataclasses.replace(choices, attention_min_tokens=0)
    return choices


def resolve_compute(device: DeviceFacts = CPU, *, formulation: str | None = None,
                    kernels=None, batch_invariant: bool = False,
                    invariant_tile: int | None = None,
                    environ: Mapping[str, str] | None = None) -> ComputeConfig:
    """The step's ComputeConfig: each argument given wins; else its DEEPINFER_* variable; else
    the device's default."""
    env = _environ(environ)
    formulation = (formulation or env.get("DEEPINFER_STEP_FORMULATION")
                   or ("cpu" if device.platform == "cpu" else "gpu"))
    if kernels is not None:
        choices = kernels_from(kernels, "kernels")
    else:
        choices = _kernels_from_environment(env, device)
        if batch_invariant and choices.attention_min_tokens:
            # a size threshold would make a row's path follow its batch: the kernel then runs
            # at every size. It is invariant by construction (one program per token, its rows
            # in a fixed order; test_rows_stay_invariant_on_the_kernels on the H200), where
            # the reference would run the prefill in a loop of row tiles
            choices = dataclasses.replace(choices, attention_min_tokens=0)
    tile = invariant_tile or int(env.get("DEEPINFER_INVARIANT_TILE") or 0) or (
        # 8 rows on the CPU (little padding); 64 on GPUs, where each tile is one more
        # iteration of launches and re-reads every weight it multiplies. A property of the
        # device, not of the formulation, so both formulations agree on one machine.
        8 if device.platform == "cpu" else 64)
    return ComputeConfig(formulation=formulation, kernels=choices,
                         batch_invariant=batch_invariant, invariant_tile=tile)
