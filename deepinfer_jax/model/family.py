"""The device side of the model-family table (config/family.py has the pure-Python side): how
each family's paged state is made, how its ragged step runs, and how the sampled rows' logits
come out of it. The engine's step (device/step.py), state placement (parallel/mesh.py) and
memory plan dispatch here on the config's type; nothing else in the engine knows which
family it serves.

    forward(params, state, plan, token_ids, cfg, step_cfg) -> (state, final)
    sampled_logits(params, final, rows i32[N], cfg, step_cfg) -> f32[N, V]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config.family import V4, V41, FamilyFacts, facts_of
from deepinfer_jax.model import paged_forward
from deepinfer_jax.model.invariant import per_sequence
from deepinfer_jax.model.reference_forward import project_logits
from deepinfer_jax.model.state import init_state
from deepinfer_jax.model.v41 import engram_device
from deepinfer_jax.model.v41 import paged_forward as v41_forward
from deepinfer_jax.model.v41.state import init_v41_state


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    facts: FamilyFacts
    init_state: Callable[..., Any]          # (cfg, step_cfg, dtype) -> the zeroed paged state
    forward: Callable[..., tuple[Any, Any]]
    sampled_logits: Callable[..., jax.Array]


def _v4_logits(params, streams, rows, cfg, step_cfg):
    return project_logits(streams[rows], params.hc_head, params.norm, params.head, cfg,
                          step_cfg.compute, rows=per_sequence(step_cfg.compute))


def _v41_state(cfg, step_cfg, dtype):
    # The window and page formats are the reference's (FP8 / FP4 codes) whatever the compute
    # dtype; the open-group tails stay float32, the reference's pooling numerics.
    return init_v41_state(cfg, step_cfg, jnp.float32)


def _v41_forward(params, state, plan, token_ids, cfg, step_cfg):
    engram_ids = plan.engram_ids if cfg.engram is not None else None
    if step_cfg.engram_lookback:        # hashed here, from the resolved tokens
        look_back = engram_device.plan_look_back(token_ids, plan, plan.engram_before)
        engram_ids = engram_device.hash_ids(look_back, params.engram_products, cfg.engram)
    engram_rows = plan.engram_rows if step_cfg.engram_rows_on_host else None
    return v41_forward.forward_step(params, state, plan, token_ids, engram_ids, cfg, step_cfg,
                                    engram_rows)


def _v41_logits(params, final, rows, cfg, step_cfg):
    sampled = final.replace(streams=final.streams[rows], pre=final.pre[rows], top_k=(),
                            candidates=None)
    return v41_forward.final_logits(params, sampled, cfg, step_cfg.compute)


_FAMILIES = {
    V4.name: ModelFamily(V4, init_state, paged_forward.forward_step, _v4_logits),
    V41.name: ModelFamily(V41, _v41_state, _v41_forward, _v41_logits),
}


def model_family(cfg) -> ModelFamily:
    return _FAMILIES[facts_of(cfg).name]
