"""What every kernel folder shares: the implementation tables' dispatch, GPU interpret mode and
the batch-invariant forms of the jnp references (fixed row tiles, sums in a fixed order).

Each op's `api.py` maps implementation names to functions of the same contract: "mosaic_gpu"
(the Hopper kernel, compiled), "interpret" (the same kernel simulated on the CPU, which is how
CI tests it) and "reference" (plain jnp, which takes every shape). The caller passes one name
or an ordered list; a kernel that cannot take the operands raises `NotSupported` before it
emits anything, and the next name is tried. Which list a device gets by default is the
engine's decision (deepinfer_jax/config/options.py), never the kernels'.

`abstract_gpu()` lets a CPU machine lower a kernel for CUDA (`jax.export`), which checks
Mosaic's layout rules without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp


class NotSupported(Exception):
    """This implementation does not take these operands (shapes, dtypes, sizes); the op
    falls through to the next implementation in the caller's list."""


def implementation_names(implementation: str | Sequence[str]) -> tuple[str, ...]:
    return (implementation,) if isinstance(implementation, str) else tuple(implementation)


def dispatch(op: str, table: Mapping[str, Callable], implementation: str | Sequence[str],
             *args, **kwargs):
    """table[name](*args, **kwargs) for the first name in `implementation` that takes them."""
    reasons = []
    for name in implementation_names(implementation):
        if name not in table:
            raise ValueError(f"{op}: unknown implementation {name!r}; expected one of "
                             f"{tuple(table)}")
        try:
            return table[name](*args, **kwargs)
        except NotSupported as why:
            reasons.append(f"{name}: {why}")
    raise NotSupported(f"{op}: no implementation in {implementation!r} takes these operands "
                       f"({'; '.join(reasons)})")


def settled(*indices: jax.Array):
    """Index arrays computed once before the wide gathers or scatters that use them.

    XLA's GPU fusion folds an index's arithmetic (divisions, block-table lookups, searches)
    into the gather or scatter kernel that consumes it, which then recomputes it for every
    element of every row it moves. An optimization barrier keeps the index its own small
    fusion, written once. Values are unchanged."""
    out = jax.lax.optimization_barrier(indices)
    return out[0] if len(indices) == 1 else out


def in_row_tiles(fn: Callable, tile: int, *args):
    """fn (row-wise: pytrees of [tile, ...] -> a pytree of [tile, ...]) over fixed-size tiles
    of the leading axis of every array in `args`, one tile after the other: a row's result
    never depends on how many rows share its batch (batch-invariant mode's jnp paths)."""
    rows = jax.tree.leaves(args)[0].shape[0]
    pad = -rows % tile

    def to_tiles(a):
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, tile, *a.shape[1:])

    out = jax.lax.map(lambda t: fn(*t), jax.tree.map(to_tiles, args))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:rows], out)


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` in a fixed pairwise tree: element i + element i + n/2, halving until one
    is left (an odd one out joins the next level). The grouping depends on the axis length
    alone, and each level is elementwise adds that no compiler regroups, unlike a reduction,
    which may be split into partial sums following the surrounding shapes. log2(n) steps
    rather than a loop of n (which on a GPU is n launches)."""
    x = jnp.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        paired = x[:half] + x[half: 2 * half]
        x = jnp.concatenate([paired, x[2 * half:]]) if x.shape[0] % 2 else paired
    return x[0]


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


def kernel_mode(interpret: bool):
    """The kernel compiled for the GPU, or simulated on the CPU."""
    return gpu_interpret() if interpret else contextlib.nullcontext()
