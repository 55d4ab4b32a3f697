"""The jitted step: the one boundary between the host and the device.

step(params, state, plan) -> (state, StepOutput); the state is donated, every per-step
quantity is an array in the plan, so one compiled program per token bucket serves all traffic.
"""

from __future__ import annotations

import dataclasses

import jax

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine_config import ResolvedEngineConfig
from deepinfer_jax.model.forward import project_logits
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.step_forward import forward_step
from deepinfer_jax.plan import BatchPlan
from deepinfer_jax.pytree import pytree_dataclass
from deepinfer_jax.sampling import greedy
from deepinfer_jax.state import StateCache

# The plan is built on the host with numpy (host modules never import jax); it becomes a
# pytree here, on the device side.
jax.tree_util.register_dataclass(
    BatchPlan, data_fields=[f.name for f in dataclasses.fields(BatchPlan)], meta_fields=[])


@pytree_dataclass
class StepOutput:
    next_tokens: jax.Array     # i32[N]  sampled token of each row (meaningful where it samples)


def step(params: ModelParams, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
         ecfg: ResolvedEngineConfig) -> tuple[StateCache, StepOutput]:
    state, streams = forward_step(params, state, plan, cfg, ecfg)
    logits = project_logits(streams[plan.sample_index], params.hc_head, params.norm,
                            params.head, cfg)                               # f32[N, V]
    return state, StepOutput(next_tokens=greedy(logits))
