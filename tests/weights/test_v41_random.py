"""Random V4.1 weights for benchmarks (weights/v41_random.py) against the loader: for the tiny
oracle config they must be the very pytree `load_v41_params` builds from a checkpoint in the
release's formats (tests/model/v41_quantized.py writes one from the documented format): the
same structure, FP8 / FP4 where the release quantizes, the same shapes and dtypes, and a
forward over them stays finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.api.v41_model import V41Model
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights.v41 import load_v41_params
from deepinfer_jax.weights.v41_random import random_v41_params
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks, is_quantized
from tests.model.v41_oracle import FIXTURES
from tests.model.v41_quantized import write_pair

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


def _described(params):
    leaves, tree = jax.tree.flatten(params, is_leaf=is_quantized)
    return tree, [(type(w).__name__, jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), w))
                  for w in leaves]


def test_random_release_weights_are_the_loaders_pytree(tmp_path):
    quantized, _ = write_pair(tmp_path)
    cfg = read_model_config(quantized)
    loaded = load_v41_params(quantized, cfg, np.float32, engram_on_host=True)
    drawn = random_v41_params(cfg, 0, jnp.float32, release_formats=True)
    assert _described(drawn) == _described(loaded)
    layer = drawn.layers[1]
    assert isinstance(layer.attn.wq_b, Fp8Blocks) and isinstance(layer.moe.experts.w13, Fp4Blocks)
    assert all(isinstance(t, np.ndarray) for t in drawn.engram_tables)      # host memory
    float_twin = random_v41_params(cfg, 0, jnp.float32, release_formats=False)
    assert not any(is_quantized(w) for w in jax.tree.leaves(float_twin, is_leaf=is_quantized))

    model = V41Model(config=cfg, params=drawn, token_map=np.arange(cfg.vocab_size) % 384,
                     pad_to=16)
    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, (1, 12))
    logits = model.logits(ids)
    assert np.isfinite(logits).all() and np.ptp(logits) > 0
