"""What every kernel folder shares: which implementation runs where, and GPU interpret mode.

`implementation()` picks "mosaic_gpu" on an NVIDIA GPU of compute capability 9.0 or newer and
"reference" (plain jnp) elsewhere. `DEEPINFER_KERNELS=reference|mosaic_gpu` overrides it for
every op, `DEEPINFER_KERNEL_<OP>` (e.g. DEEPINFER_KERNEL_SINKHORN) for one, ahead of both.
Until a kernel has been validated on the H200 its folder keeps the reference as the default
on GPU too (see each api.py): an unmeasured kernel must be asked for.

`launch_bound()` says which formulation of jnp code to trace: for a device whose kernels the
host launches one by one (GPUs: fewer, fused kernels; no loops of small ops) or for the CPU.

`gpu_interpret()` runs Mosaic GPU kernels on the CPU (jax's GPU interpret mode: SMEM, TMA,
barriers and wgmma simulated), which is how CI tests them; `abstract_gpu()` lets a CPU
machine lower a kernel for CUDA (`jax.export`), which checks Mosaic's layout rules.
"""

from __future__ import annotations

import contextlib
import os

import jax

IMPLEMENTATIONS = ("reference", "mosaic_gpu", "interpret")


FORMULATIONS = ("cpu", "gpu")


def launch_bound() -> bool:
    """Whether the code being traced runs where every kernel is launched from the host (GPUs):
    there XLA runs a loop as launches per iteration and a `lax.cond` as a host synchronisation,
    so jnp paths prefer unrolled, fused or dense formulations. On the CPU launches are cheap
    and loops compile faster. DEEPINFER_STEP_FORMULATION=cpu|gpu overrides the backend's
    choice (tests trace the GPU formulation on the CPU)."""
    forced = os.environ.get("DEEPINFER_STEP_FORMULATION")
    if forced:
        if forced not in FORMULATIONS:
            raise ValueError(f"DEEPINFER_STEP_FORMULATION must be one of {FORMULATIONS}, "
                             f"got {forced!r}")
        return forced == "gpu"
    return jax.default_backend() != "cpu"


def settled(*indices: jax.Array):
    """Index arrays computed once before the wide gathers or scatters that use them.

    XLA's GPU fusion folds an index's arithmetic (divisions, block-table lookups, searches)
    into the gather or scatter kernel that consumes it, which then recomputes it for every
    element of every row it moves (512 or 4096 times per row here). An optimization barrier
    keeps the index its own small fusion, written once. Values are unchanged. GPU formulation
    only (`launch_bound`); DEEPINFER_SETTLE_INDICES=0 turns it off, for comparison."""
    if not launch_bound() or os.environ.get("DEEPINFER_SETTLE_INDICES") == "0":
        return indices[0] if len(indices) == 1 else indices
    out = jax.lax.optimization_barrier(indices)
    return out[0] if len(indices) == 1 else out


def on_hopper_or_newer() -> bool:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
    return major >= 9


def overridden(op: str) -> bool:
    """Whether an env variable chooses `op`'s implementation (then every size takes it)."""
    return bool(os.environ.get(f"DEEPINFER_KERNEL_{op.upper()}") or
                os.environ.get("DEEPINFER_KERNELS"))


def implementation(validated: bool, op: str) -> str:
    """The implementation of `op` to run: an env override (this op's, then every op's), else
    the kernel where it is validated."""
    for var in (f"DEEPINFER_KERNEL_{op.upper()}", "DEEPINFER_KERNELS"):
        choice = os.environ.get(var)
        if choice:
            if choice not in IMPLEMENTATIONS:
                raise ValueError(f"{var} must be one of {IMPLEMENTATIONS}, got {choice!r}")
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
