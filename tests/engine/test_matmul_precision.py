"""float32 weights compute their matmuls in float32 (model/precision.py): every dot of the
engine's step and of the cache-free forward asks for HIGHEST precision (a GPU's default for
float32 is TF32), and bfloat16 weights' dots keep the default. Read from the lowered modules,
so it holds on the CPU, where both precisions compute alike."""

import re

import jax.numpy as jnp
import pytest

import deepinfer_jax
from deepinfer_jax.api.model import _logits
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.engine.compile import lower_step
from deepinfer_jax.model.state import init_state
from tests.conftest import REPO


def dot_precisions(module: str) -> list[str]:
    """Each dot's precision in a StableHLO module ("DEFAULT" where it names none)."""
    precisions = []
    for dot in re.findall(r"stablehlo\.dot(?:_general)?[^\n]*", module):
        named = re.search(r"precision = \[(\w+)", dot)
        precisions.append(named.group(1) if named else "DEFAULT")
    return precisions


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return deepinfer_jax.load(REPO / "models" / "deepinfer-tiny-v4",
                              dtype=getattr(jnp, request.param))


def expected(model) -> str:
    return "HIGHEST" if model.params.embed.dtype == jnp.float32 else "DEFAULT"


def test_the_engines_step(model):
    step_cfg = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16,
                            token_buckets=(16,)).resolve(model.config)
    state = init_state(model.config, step_cfg, model.params.embed.dtype)
    precisions = dot_precisions(lower_step(model.params, state, model.config, step_cfg,
                                           16).as_text())
    assert len(precisions) > 10 and set(precisions) == {expected(model)}


def test_the_cache_free_forward(model):
    ids = jnp.zeros((1, 128), jnp.int32)
    module = _logits.lower(model.params, ids, model.config, model.compute).as_text()
    precisions = dot_precisions(module)
    assert len(precisions) > 10 and set(precisions) == {expected(model)}
