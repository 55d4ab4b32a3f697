"""The expert-parallel load balancer (EPLB): which physical expert slots hold which experts.

With `parallel={"eplb": {...}}` every MoE layer's routed experts live in P = E + R physical
slots (R redundant replicas), split evenly over the dp x ep devices (S = P / devices each, in
slot order). Each layer has its own assignment (physical slot -> logical expert) and, as
data in the parameters, its `ExpertPlacement` (expert -> its slots), which the MoE reads to
route a pair to one of its expert's replicas (model/moe.py `physical_slots`). The step counts
routed pairs per layer and expert on the device (`StateCache.expert_load`).

Rebalancing (host, numpy; DeepSeek's EPLB in its simplest form, per layer):
1. replicas: each of the R spare slots goes to the expert with the largest load per replica;
2. packing: replicas, heaviest first, each to the least loaded device with a free slot,
   avoiding a device that already holds the same expert where one can.
Then the weights move: each new slot copies an old slot of its expert (one on the same device
where there is one) by a gather compiled once at start-up, and the placement tables are
replaced. Shapes never change, so no step recompiles, and since a pair's result does not
depend on which replica computes it, outputs do not change either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.params import ExpertParams, ExpertPlacement, ModelParams


# ---- the assignment (host) ------------------------------------------------------------------
def balanced_assignment(load: np.ndarray, slots: int, devices: int) -> np.ndarray:
    """Per-expert loads f[E] -> the logical expert of each of `slots` physical slots, i32[P],
    device d holding slots [d*S, (d+1)*S) (S = slots / devices)."""
    experts = load.shape[0]
    load = np.maximum(np.asarray(load, np.float64), 0.0)
    replicas = np.ones(experts, np.int64)
    for _ in range(slots - experts):
        replicas[int(np.argmax(load / replicas))] += 1      # ties: the lowest expert
    per_device = slots // devices
    items = sorted(((load[e] / replicas[e], e) for e in range(experts)
                    for _ in range(replicas[e])), key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(devices)]
    device_load = np.zeros(devices)
    for weight, expert in items:
        free = [d for d in range(devices) if len(held[d]) < per_device]
        spread = [d for d in free if expert not in held[d]] or free
        d = min(spread, key=lambda d: (device_load[d], d))
        held[d].append(expert)
        device_load[d] += weight
    return np.asarray([e for d in range(devices) for e in sorted(held[d])], np.int32)


def placement_tables(assignment: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """An assignment i32[P] -> (slots i32[E, P - E + 1], count i32[E]): each expert's slots
    (unused entries repeat its first), and how many."""
    count = np.bincount(assignment, minlength=experts).astype(np.int32)
    if (count == 0).any():
        raise ValueError(f"experts {np.flatnonzero(count == 0).tolist()} have no slot")
    slots = np.zeros((experts, assignment.shape[0] - experts + 1), np.int32)
    for expert in range(experts):
        held = np.flatnonzero(assignment == expert)
        slots[expert] = held[0]
        slots[expert, :held.size] = held
    return slots, count


def transfer_sources(old: np.ndarray, new: np.ndarray, devices: int) -> np.ndarray:
    """For each new slot, the old slot whose weights it copies: one holding the same expert,
    on the same device where there is one."""
    per_device = old.shape[0] // devices
    sources = np.empty_like(new)
    for slot, expert in enumerate(new):
        holders = np.flatnonzero(old == expert)
        local = holders[holders // per_device == slot // per_device]
        sources[slot] = local[0] if local.size else holders[0]
    return sources


def device_loads(load: np.ndarray, assignment: np.ndarray, devices: int) -> np.ndarray:
    """The pairs each device would compute under `assignment` (an expert's load split evenly
    over its replicas): f[devices]."""
    replicas = np.bincount(assignment, minlength=load.shape[0])
    per_slot = load[assignment] / replicas[assignment]
    return per_slot.reshape(devices, -1).sum(axis=1)


# ---- the weights (device) -------------------------------------------------------------------
def _placement(assignment: np.ndarray, experts: int) -> ExpertPlacement:
    slots, count = placement_tables(assignment, experts)
    return ExpertPlacement(slots=jnp.asarray(slots), count=jnp.asarray(count))


def with_placement(params: ModelParams, experts: int, slots: int, devices: int
                   ) -> tuple[ModelParams, list[np.ndarray]]:
    """The loaded parameters with every layer's expert stacks [E, ...] laid out in `slots`
    physical slots under the even-load assignment, and the layers' assignments."""
    assignment = balanced_assignment(np.ones(experts), slots, devices)
    index = jnp.asarray(assignment)
    layers = []
    for layer in params.layers:
        moe = layer.moe
        stacks = jax.tree.map(lambda x: x[index], moe.experts)
        moe = dataclasses.replace(moe, experts=stacks, placement=_placement(assignment, experts))
        layers.append(dataclasses.replace(layer, moe=moe))
    return dataclasses.replace(params, layers=tuple(layers)), [assignment] * len(layers)


def compile_transfer(stacks: ExpertParams):
    """The weight move, compiled once for the layers' (equal) expert stacks as placed:
    (stacks, sources i32[P]) -> stacks[sources], on the same shardings, the old stacks
    donated."""
    sharding = jax.tree.map(lambda x: x.sharding, stacks)

    def gather(stacks, sources):
        return jax.tree.map(lambda x: x[sources], stacks)

    sources = jax.ShapeDtypeStruct((jax.tree.leaves(stacks)[0].shape[0],), jnp.int32)
    return jax.jit(gather, donate_argnums=(0,), out_shardings=sharding).lower(
        stacks, sources).compile()


@dataclasses.dataclass
class ExpertBalancer:
    """The engine's balancer: each layer's assignment, the load counted at the last
    rebalance, and how many rebalances ran."""

    experts: int
    devices: int
    assignments: list[np.ndarray]
    transfer: jax.stages.Compiled
    counted: np.ndarray                 # the load (i32[L, E]) at the last rebalance
    rebalances: int = 0

    def rebalance(self, params: ModelParams, total_load: np.ndarray) -> ModelParams:
        """New assignments from the load since the last rebalance; the parameters with their
        expert stacks moved and their placements replaced."""
        window = total_load - self.counted
        self.counted = total_load
        layers = []
        for i, layer in enumerate(params.layers):
            old = self.assignments[i]
            new = balanced_assignment(window[i], old.shape[0], self.devices)
            moe = layer.moe
            if not np.array_equal(new, old):
                sources = transfer_sources(old, new, self.devices)
                placement = _placement(new, self.experts)
                placement = jax.device_put(placement, jax.tree.map(lambda x: x.sharding,
                                                                   moe.placement))
                moe = dataclasses.replace(moe, experts=self.transfer(moe.experts, sources),
                                          placement=placement)
                self.assignments[i] = new
            layers.append(dataclasses.replace(layer, moe=moe))
        self.rebalances += 1
        return dataclasses.replace(params, layers=tuple(layers))
