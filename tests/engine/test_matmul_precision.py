"""float32 weights compute their matmuls in float32 (model/precision.py): every dot of the
engine's step and of the cache-free forward asks for HIGHEST precision (a GPU's default for
float32 is TF32), and bfloat16 weights' dots keep the default; V4.1's forward also when jitted
directly, as its tests and notebooks do (on the H200 its float32 comparisons with the reference
failed at TF32). Read from the lowered modules, so it holds on the CPU, where both precisions
compute alike."""

import re

import jax
import jax.numpy as jnp
import numpy as np
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


def expected_of(params) -> str:
    return "HIGHEST" if params.embed.dtype == jnp.float32 else "DEFAULT"


def expected(model) -> str:
    return expected_of(model.params)


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


# ---- V4.1: its cache-free forward and step called directly, and the engine's step ---------

@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def v41(request):
    from tests.model.v41_oracle import FIXTURES, case
    if not FIXTURES[0].exists():
        pytest.skip("no V4.1 oracle fixtures")
    cfg, params, ref = case(FIXTURES[0])
    dtype = getattr(jnp, request.param)
    return cfg, jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a,
                             params), ref


def test_v41_forward_called_directly(v41):
    from deepinfer_jax.model.v41 import engram_hash
    from deepinfer_jax.model.v41.forward import forward
    cfg, params, ref = v41
    tokens, live = np.zeros((1, 32), np.int32), np.ones((1, 32), bool)
    ids = engram_hash.hash_ids(tokens, live, ref["engram_token_map"], cfg.engram,
                               engram_hash.hash_tables(cfg.engram))
    module = jax.jit(forward, static_argnums=(1, 5)).lower(
        params, cfg, jnp.asarray(tokens), jnp.asarray(live), jnp.asarray(ids), True).as_text()
    precisions = dot_precisions(module)
    assert len(precisions) > 10 and set(precisions) == {expected_of(params)}


def test_v41_engines_step(v41):
    from deepinfer_jax.engine.engram_rows import engram_setup
    from deepinfer_jax.model.family import model_family
    cfg, params, ref = v41
    step_cfg = EngineConfig(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16,
                            token_buckets=(16,), engram_tables="device").resolve(cfg)
    # the device tables' hash words, as the engine adds them (no host options: not hashed there)
    params, step_cfg, _ = engram_setup(cfg, params, step_cfg, None, ref["engram_token_map"])
    state = model_family(cfg).init_state(cfg, step_cfg, params.embed.dtype)
    precisions = dot_precisions(lower_step(params, state, cfg, step_cfg, 16).as_text())
    assert len(precisions) > 10 and set(precisions) == {expected_of(params)}
