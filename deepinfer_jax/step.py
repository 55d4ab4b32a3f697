"""The jitted step: the one boundary between the host and the device.

step(params, state, plan) -> (state, StepOutput); the state is donated, every per-step
quantity is an array in the plan, so one compiled program per token bucket serves all traffic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def resolve_placeholders(token_ids: jax.Array, plan: BatchPlan, last_tokens: jax.Array) -> jax.Array:
    """Tokens the host does not know yet (-1) are the previous sample of their row's slot."""
    n = plan.seq_slot.shape[0]
    slot = plan.seq_slot[jnp.minimum(plan.token_seq, n - 1)]
    return jnp.where(token_ids < 0, last_tokens[slot], token_ids)


def step(params: ModelParams, state: StateCache, plan: BatchPlan, *, cfg: ModelConfig,
         ecfg: ResolvedEngineConfig) -> tuple[StateCache, StepOutput]:
    token_ids = resolve_placeholders(plan.token_ids, plan, state.last_tokens)
    state, streams = forward_step(params, state, plan, token_ids, cfg, ecfg)
    logits = project_logits(streams[plan.sample_index], params.hc_head, params.norm,
                            params.head, cfg)                               # f32[N, V]
    next_tokens = greedy(logits)
    slots = jnp.where(plan.seq_samples, plan.seq_slot, state.last_tokens.shape[0])
    state = dataclasses.replace(state, last_tokens=state.last_tokens.at[slots].set(
        next_tokens, mode="drop"))
    return state, StepOutput(next_tokens=next_tokens)
