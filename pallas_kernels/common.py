"""What every kernel folder shares: which implementation runs where, and GPU interpret mode.

`implementation()` picks "mosaic_gpu" on an NVIDIA GPU of compute capability 9.0 or newer and
"reference" (plain jnp) elsewhere. `DEEPINFER_KERNELS=reference|mosaic_gpu` overrides it.
Until a kernel has been validated on the H200 its folder keeps the reference as the default
on GPU too (see each api.py): an unmeasured kernel must be asked for.

`gpu_interpret()` runs Mosaic GPU kernels on the CPU (jax's GPU interpret mode: SMEM, TMA,
barriers and wgmma simulated), which is how CI tests them; `abstract_gpu()` lets a CPU
machine lower a kernel for CUDA (`jax.export`), which checks Mosaic's layout rules.
"""

from __future__ import annotations

import contextlib
import os

import jax

IMPLEMENTATIONS = ("reference", "mosaic_gpu", "interpret")


def on_hopper_or_newer() -> bool:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
    return major >= 9


def implementation(validated: bool) -> str:
    """The implementation to run: the env override, else the kernel where it is validated."""
    choice = os.environ.get("DEEPINFER_KERNELS")
    if choice:
        if choice not in IMPLEMENTATIONS:
            raise ValueError(f"DEEPINFER_KERNELS must be one of {IMPLEMENTATIONS}, got {choice!r}")
        return choice
    return "mosaic_gpu" if validated and on_hopper_or_newer() else "reference"


def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3"):
    """A context in which a CPU-only process can lower GPU kernels (for jax.export)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind=device_kind, platform="gpu", num_cores=8))
    return jax.sharding.use_abstract_mesh(mesh)


@contextlib.contextmanager
def gpu_interpret():
    """Run Mosaic GPU kernels called inside this context in GPU interpret mode, on the CPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    with abstract_gpu(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield
