"""ComputeConfig: how the step computes the model (never what the model is).

The same ModelConfig can be computed by other programs: jnp code traced for the CPU or for a
launch-bound GPU, Pallas kernels or their jnp references, and the batch-invariant mode. Every
such choice is a field here, resolved once at start-up (config/options.py) and passed
explicitly to the model's functions, so traced code reads no environment and no globals.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.config.parallel import ParallelConfig

FORMULATIONS = ("cpu", "gpu")
# The Pallas ops and the names their implementation tables take (pallas_kernels/*/api.py):
# "mosaic_gpu" the compiled Hopper kernel, "interpret" the same kernel simulated on the CPU,
# "reference" plain jnp, which takes every shape.
KERNEL_OPS = ("grouped_gemm", "sink_attention", "sinkhorn", "indexer")
IMPLEMENTATIONS = ("mosaic_gpu", "interpret", "reference")
# The FP4 grouped-GEMM kernel's K granule (pallas_kernels/grouped_gemm/mosaic_gpu_fp4.py
# K_GRANULE; config may not import kernels, tests/weights/test_fp4_pad.py ties the two).
FP4_K_GRANULE = 512


class ComputeConfigError(ValueError):
    pass


def implementation_list(value: str | tuple[str, ...] | list[str], what: str) -> tuple[str, ...]:
    """One name or an ordered list -> a tuple ending in "reference" (the fall-through that
    takes every shape), each name checked."""
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ComputeConfigError(f"{what}: unknown implementation {name!r}; expected one of "
                                     f"{IMPLEMENTATIONS}")
    return names if names and names[-1] == "reference" else names + ("reference",)


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """Per Pallas op, the implementations to try in order: each falls through to the next on
    the kernel's typed "not supported for these shapes" error (pallas_kernels.common)."""

    grouped_gemm: tuple[str, ...] = ("reference",)
    sink_attention: tuple[str, ...] = ("reference",)
    sinkhorn: tuple[str, ...] = ("reference",)
    indexer: tuple[str, ...] = ("reference",)
    # The sink-attention kernel from this many query tokens up (0: every size). Below, XLA's
    # fused jnp path is faster on the H200 (docs/performance-log.md); a fixed threshold would
    # make a row's path follow its batch, so batch-invariant mode leaves the kernel out
    # unless asked for explicitly.
    attention_min_tokens: int = 0

    def __post_init__(self):
        for op in KERNEL_OPS:
            object.__setattr__(self, op, implementation_list(getattr(self, op), op))
        if self.attention_min_tokens < 0:
            raise ComputeConfigError("attention_min_tokens must be >= 0")

    @classmethod
    def every_op(cls, implementation: str | tuple[str, ...], **fields) -> KernelChoices:
        return cls(**{op: implementation for op in KERNEL_OPS}, **fields)


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """formulation: which form of jnp code to trace. "gpu" for a device whose kernels the host
    launches one by one: there XLA runs a loop as launches per iteration and a `lax.cond` as a
    host synchronisation, so the step prefers unrolled, fused or dense forms and never
    branches at run time. "cpu": launches are cheap and loops compile faster.

    batch_invariant: every reduction ordered independently of the batch
    (docs/batch_invariance.md); invariant_tile: the fixed row tile of that mode's jnp paths
    (any fixed size is invariant, as long as runs compared use the same one)."""

    formulation: str = "cpu"
    kernels: KernelChoices = KernelChoices()
    batch_invariant: bool = False
    invariant_tile: int = 8
    # the device mesh's sizes (config/parallel.py): the model shards its routed experts over
    # "ep" explicitly; the rest follows the parameters' shardings (parallel/mesh.py)
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        if self.formulation not in FORMULATIONS:
            raise ComputeConfigError(f"formulation must be one of {FORMULATIONS}, got "
                                     f"{self.formulation!r}")
        if self.invariant_tile < 1:
            raise ComputeConfigError("invariant_tile must be >= 1")

    @property
    def fp4_expert_granule(self) -> int:
        """The multiple that FP4 routed-expert stacks' intermediate size I is zero-padded to
        at load (weights/fp4_pad.py): the FP4 kernel's K granule where the grouped GEMM's
        table names the kernel (compiled or interpreted: the down projection's K is I, which
        it refuses unless a multiple), else 1, I as stored: the jnp references take any I,
        and padding would only widen their products (a tiny test model's 16-fold)."""
        kernel = {"mosaic_gpu", "interpret"} & set(self.kernels.grouped_gemm)
        return FP4_K_GRANULE if kernel else 1

    @property
    def fp4_expert_order(self) -> str | None:
        """How FP4 routed-expert codes are held on the device (weights/fp4_tiles.py): in the
        FP4 kernel's tiles where the grouped GEMM's table names it first, as 32-bit words where
        compiled ("words": their dequantization is PTX) and bytes where interpreted
        ("bytes"); None, the checkpoint's rows, for the jnp references (which read either, and
        the tiles would only cost them a re-layout a call)."""
        return {"mosaic_gpu": "words", "interpret": "bytes"}.get(self.kernels.grouped_gemm[0])

    @property
    def launch_bound(self) -> bool:
        return self.formulation == "gpu"

    @property
    def tile_segments(self) -> bool:
        """Batch-invariant mode runs whole per-token segments (projections, norms, mixing) in
        row tiles where XLA's elementwise code may give a row other bits in a batch of another
        size: the CPU's vectorised loops do, a GPU's per-element code does not. In the GPU
        formulation each matmul-like op is invariant by itself (kernels by construction, jnp
        references in row tiles) and the rest of a per-token segment runs over the whole batch;
        work over the step's sequences runs in row tiles on every device (model/invariant.py)."""
        return self.batch_invariant and not self.launch_bound
