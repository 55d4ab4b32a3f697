"""The two V4.1 oracle fixtures (issue 36), loaded once, and the cache-free forward run on them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.model.v41 import engram_hash
from deepinfer_jax.model.v41.forward import forward
from deepinfer_jax.weights.v41 import load_v41_params
from tests.conftest import V41_ORACLE_DIR

FIXTURES = [V41_ORACLE_DIR / f"deepseek-v41-tiny-{x}" for x in "ab"]
_FORWARD = jax.jit(forward, static_argnums=(1, 5))


@functools.lru_cache(maxsize=2)
def case(folder):
    cfg = read_model_config(folder)
    ref = np.load(folder / "reference.npz")
    return cfg, load_v41_params(folder, cfg), {k: ref[k] for k in ref}


def run(folder, tokens, live, quant=True):
    cfg, params, ref = case(folder)
    ids = engram_hash.hash_ids(tokens, live, ref["engram_token_map"], cfg.engram,
                               engram_hash.hash_tables(cfg.engram))
    return _FORWARD(params, cfg, jnp.asarray(tokens), jnp.asarray(live), jnp.asarray(ids), quant)
