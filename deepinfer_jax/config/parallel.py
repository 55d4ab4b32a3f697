"""ParallelConfig: how one engine spreads a model over devices (vLLM's `parallel` sizes).

The device mesh has the axes ("dp", "ep", "tp"): data-parallel attention ranks, expert
parallelism (the routed experts split evenly, each rank computing its own experts' share
of every token and the shares summed across ranks), and tensor parallelism (the attention's
and shared expert's projections split by output or input columns, XLA's SPMD partitioner
placing the collectives). Context parallelism (`cp`) splits a long prompt's chunk over ranks.

Built so far: ep and tp. dp and cp are validated but refused with a clear error until the
scheduler places requests and pages per rank (issue 33).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.model import ModelConfig

MESH_AXES = ("dp", "ep", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1      # data-parallel attention ranks
    ep: int = 1      # expert-parallel ranks
    tp: int = 1      # tensor-parallel ranks
    cp: int = 1      # context-parallel ranks (long prefills)

    def __post_init__(self):
        for axis in ("dp", "ep", "tp", "cp"):
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise EngineConfigError(f"parallel: {axis} must be a positive integer, got "
                                        f"{size!r}")

    @classmethod
    def from_options(cls, value: Mapping | ParallelConfig | None) -> ParallelConfig:
        if value is None:
            return cls()
        if isinstance(value, ParallelConfig):
            return value
        unknown = set(value) - {"dp", "ep", "tp", "cp"}
        if unknown:
            raise EngineConfigError(f"parallel: unknown axis {sorted(unknown)}; expected dp, "
                                    f"ep, tp, cp")
        return cls(**value)

    @property
    def size(self) -> int:
        """Devices the mesh spans."""
        return self.dp * self.ep * self.tp * self.cp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.ep, self.tp)

    def describe(self) -> str:
        return f"dp={self.dp}, ep={self.ep}, tp={self.tp}, cp={self.cp}"

    def check(self, model: ModelConfig, devices: int) -> None:
        """Raises EngineConfigError naming the sizes for a mesh this model or these devices
        cannot take."""
        if self.size == 1:
            return
        if devices % self.size:
            raise EngineConfigError(f"parallel {self.describe()} spans {self.size} devices, "
                                    f"which does not divide the {devices} devices present")
        if model.n_routed_experts % self.ep:
            raise EngineConfigError(f"parallel ep={self.ep} does not divide the model's "
                                    f"{model.n_routed_experts} routed experts")
        for what, width in (("attention heads", model.num_heads),
                            ("output groups (o_groups)", model.o_groups),
                            ("shared-expert width", model.shared_intermediate_size
                             if model.n_shared_experts else self.tp)):
            if width % self.tp:
                raise EngineConfigError(f"parallel tp={self.tp} does not divide the model's "
                                        f"{width} {what}")
        if self.dp > 1 or self.cp > 1:
            raise EngineConfigError(f"parallel {self.describe()}: data-parallel attention (dp) "
                                    f"and context parallelism (cp) are not built yet; ep and tp "
                                    f"are")
