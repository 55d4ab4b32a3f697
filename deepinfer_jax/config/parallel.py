"""ParallelConfig: how one engine spreads a model over devices (vLLM's `parallel` sizes).

The device mesh has the axes ("dp", "cp", "ep", "tp"):
* dp: data-parallel attention ranks. Each holds its own requests, state slots and page pool
  (the step's sizes, max_num_seqs, num_pages and the token buckets, are a rank's) and runs
  the attention of its own tokens; the host's scheduler places each request on a rank.
* cp: context parallelism. A rank's step tokens (a long prompt's chunk) are split over the
  cp devices: every per-token computation runs on its own share, the attention of each
  share reads the keys and rows the whole chunk writes, which the state (replicated over cp)
  holds on every cp device.
* ep: expert parallelism. The routed experts are split over every device of the dp, cp and
  ep axes together (as vLLM and SGLang spread them over all data-parallel ranks): each
  computes its experts' share of every token of its dp rank, the shares summed back to the
  tokens' own devices. ep > 1 adds devices that share one attention rank and its tokens.
* tp: tensor parallelism, the attention's and shared expert's projections split by output
  or input columns (XLA's SPMD partitioner placing the collectives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.model import ModelConfig

MESH_AXES = ("dp", "cp", "ep", "tp")


def _count(owner: str, name: str, value, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise EngineConfigError(f"{owner}: {name} must be an integer >= {least}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EplbConfig:
    """The expert-parallel load balancer (vLLM's `eplb_config` names): the routed experts live
    in `n_routed_experts + num_redundant_experts` physical slots, the busiest experts with
    replicas; every `step_interval` steps (0: only when asked, `LLM.rebalance_experts()`) the
    slots are reassigned from the routing counts the step collects on the device, and the
    weights moved to match. The expert-location map is data in the parameters, so nothing
    recompiles (parallel/eplb.py)."""

    num_redundant_experts: int = 0
    step_interval: int = 0

    def __post_init__(self):
        _count("parallel eplb", "num_redundant_experts", self.num_redundant_experts, 0)
        _count("parallel eplb", "step_interval", self.step_interval, 0)

    @classmethod
    def from_options(cls, value: Mapping | EplbConfig | None) -> EplbConfig | None:
        if value is None or isinstance(value, EplbConfig):
            return value
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise EngineConfigError(f"parallel eplb: unknown option {sorted(unknown)}; expected "
                                    f"num_redundant_experts, step_interval")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1      # data-parallel attention ranks
    ep: int = 1      # expert-parallel ranks
    tp: int = 1      # tensor-parallel ranks
    cp: int = 1      # context-parallel ranks (long prefills)
    eplb: EplbConfig | None = None   # the expert-parallel load balancer; None: off

    def __post_init__(self):
        for axis in ("dp", "ep", "tp", "cp"):
            _count("parallel", axis, getattr(self, axis), 1)
        object.__setattr__(self, "eplb", EplbConfig.from_options(self.eplb))

    @classmethod
    def from_options(cls, value: Mapping | ParallelConfig | None) -> ParallelConfig:
        if value is None:
            return cls()
        if isinstance(value, ParallelConfig):
            return value
        unknown = set(value) - {"dp", "ep", "tp", "cp", "eplb"}
        if unknown:
            raise EngineConfigError(f"parallel: unknown axis {sorted(unknown)}; expected dp, "
                                    f"ep, tp, cp (and eplb)")
        return cls(**value)

    @property
    def size(self) -> int:
        """Devices the mesh spans."""
        return self.dp * self.ep * self.tp * self.cp

    @property
    def expert_ranks(self) -> int:
        """Devices the routed experts are split over (the dp, cp and ep axes)."""
        return self.dp * self.cp * self.ep

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.ep, self.tp)

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
        if self.eplb is not None:
            slots = model.n_routed_experts + self.eplb.num_redundant_experts
            if slots % self.expert_ranks:
                raise EngineConfigError(
                    f"parallel eplb: {model.n_routed_experts} routed experts + "
                    f"{self.eplb.num_redundant_experts} redundant = {slots} slots, which dp x cp x "
                    f"ep = {self.dp} x {self.cp} x {self.ep} does not divide")
        if self.size == 1:
            return
        if devices % self.size:
            raise EngineConfigError(f"parallel {self.describe()} spans {self.size} devices, "
                                    f"which does not divide the {devices} devices present")
        if self.eplb is None and model.n_routed_experts % self.expert_ranks:
            raise EngineConfigError(f"parallel dp x cp x ep = {self.dp} x {self.cp} x {self.ep} "
                                    f"does not divide the model's {model.n_routed_experts} routed "
                                    f"experts (they are split over all three axes)")
        if self.dp > 1 and self.cp > 1:
            raise EngineConfigError(f"parallel {self.describe()}: context parallelism inside "
                                    f"data-parallel ranks is not built yet (XLA's SPMD "
                                    f"partitioner aborts on the step's row gathers, jax 0.11.2); "
                                    f"use dp or cp")
        for what, width in (("attention heads", model.num_heads),
                            ("output groups (o_groups)", model.o_groups),
                            ("shared-expert width", model.shared_intermediate_size
                             if model.n_shared_experts else self.tp)):
            if width % self.tp:
                raise EngineConfigError(f"parallel tp={self.tp} does not divide the model's "
                                        f"{width} {what}")
