"""ParallelConfig: how one engine spreads a model over devices (vLLM's `parallel` sizes).

The device mesh has the axes ("dp", "ep", "tp"):
* dp: data-parallel attention ranks. Each holds its own requests, state slots and page pool
  (the step's sizes, max_num_seqs, num_pages and the token buckets, are a rank's) and runs
  the attention of its own tokens; the host's scheduler places each request on a rank.
* ep: expert parallelism. The routed experts are split over every device of the dp and ep
  axes together (E / (dp x ep) each, as vLLM and SGLang spread them over all data-parallel
  ranks): each computes its experts' share of every rank's tokens, the shares summed back
  to the tokens' own ranks. ep > 1 adds devices that share one attention rank.
* tp: tensor parallelism, the attention's and shared expert's projections split by output
  or input columns (XLA's SPMD partitioner placing the collectives).
Context parallelism (`cp`, a long prompt's chunk split over ranks) is validated but refused
until it is built (issue 33).
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
    def expert_ranks(self) -> int:
        """Devices the routed experts are split over (the dp and ep axes)."""
        return self.dp * self.ep

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.ep, self.tp)

    def describe(self) -> str:
        return f"dp={self.dp}, ep={self.ep}, tp={self.tp}, cp={self.cp}"

    def check(self, model: ModelConfig, devices: int, processes: int = 1) -> None:
        """Raises EngineConfigError naming the sizes for a mesh this model or these devices
        cannot take. Over several processes the mesh spans every device: a process without
        one in the mesh could not take part in its steps."""
        if processes > 1 and self.size != devices:
            raise EngineConfigError(f"parallel {self.describe()} spans {self.size} devices; "
                                    f"one engine over {processes} processes must span all "
                                    f"{devices} of their devices")
        if self.size == 1:
            return
        if devices % self.size:
            raise EngineConfigError(f"parallel {self.describe()} spans {self.size} devices, "
                                    f"which does not divide the {devices} devices present")
        if model.n_routed_experts % self.expert_ranks:
            raise EngineConfigError(f"parallel dp x ep = {self.dp} x {self.ep} does not divide "
                                    f"the model's {model.n_routed_experts} routed experts (they "
                                    f"are split over both axes)")
        for what, width in (("attention heads", model.num_heads),
                            ("output groups (o_groups)", model.o_groups),
                            ("shared-expert width", model.shared_intermediate_size
                             if model.n_shared_experts else self.tp)):
            if width % self.tp:
                raise EngineConfigError(f"parallel tp={self.tp} does not divide the model's "
                                        f"{width} {what}")
        if self.cp > 1:
            raise EngineConfigError(f"parallel {self.describe()}: context parallelism (cp) is "
                                    f"not built yet; dp, ep and tp are")
