"""The two V4.1 oracle fixtures (issue 36), loaded once, and the cache-free forward run on them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.model.v41 import csa, engram_hash, fake_quant
from deepinfer_jax.model.v41.forward import forward
from deepinfer_jax.weights.v41 import load_v41_params
from tests.conftest import V41_ORACLE_DIR

FIXTURES = [V41_ORACLE_DIR / f"deepseek-v41-tiny-{x}" for x in "ab"]
# An engine feature's test (invariance, prefix cache and replay, KV tiers, host Engram rows) on
# both fixtures: b in the slow tier. b runs the same engine code with other sizes (a 4:1 CSA,
# YaRN, no draft layer); its parity with the reference stays in CI's tier (test_v41_engine.py).
ENGINE_FEATURE_FIXTURES = [pytest.param(FIXTURES[0], id="a"),
                           pytest.param(FIXTURES[1], id="b", marks=pytest.mark.slow)]
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


def near_rounding_boundary(values: np.ndarray, block: int, fp4: bool, e4m3_scales: bool = False,
                           rel: float = 1e-6) -> np.ndarray:
    """values f32[..., n] as one fake-quantization call receives them -> bool[...]: whether any
    element or its block's scale lies within `rel` (relative) of a rounding boundary, where a
    float32 summation-order difference between two computations decides the rounding."""
    blocks = np.asarray(values, np.float32).reshape(*values.shape[:-1], -1, block)

    def scales(b):
        if fp4:
            return np.asarray(fake_quant.fp4_scales(jnp.asarray(b), e4m3_scales))
        amax = np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4)
        return np.asarray(fake_quant.pow2_ceil(jnp.asarray(amax / fake_quant.FP8_MAX)))

    def codes(q):
        if fp4:
            return np.asarray(fake_quant.round_e2m1(jnp.clip(jnp.asarray(q), -6.0, 6.0)))
        return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)

    q = blocks / scales(blocks)
    near = (scales(blocks * (1 + rel)) != scales(blocks * (1 - rel))).any((-2, -1))
    return near | (codes(q * (1 + rel)) != codes(q * (1 - rel))).any((-2, -1))


@functools.lru_cache(maxsize=2)
def first_rounding_boundaries(folder) -> tuple[float, ...]:
    """Per prompt of `reference.npz`: the first position of prompt + greedy continuation (real
    positions, from 0) where the cache-free forward fake-quantizes a value near a rounding
    boundary (window K=V, compressed entries, indexer keys or queries), inf where none. From
    there on, two correct computations may round one value a whole step apart and part (the
    fixtures' README, "Observed agreement"); before it they agree to float32 noise."""
    cfg, params, ref = case(folder)
    tokens = np.concatenate([ref["input_ids"], ref["gen_tokens"]], 1)
    live = np.concatenate([ref["attention_mask"], np.ones_like(ref["gen_tokens"])], 1) > 0
    ids = engram_hash.hash_ids(tokens, live, ref["engram_token_map"], cfg.engram,
                               engram_hash.hash_tables(cfg.engram))
    calls = []                                    # (values, block, fp4, e4m3 scales, per token)
    fp8, fp4 = csa.fake_quant_fp8, csa.fake_quant_fp4

    def record_fp8(x, block=32):
        calls.append((x, block, False, False))
        return fp8(x, block)

    def record_fp4(x, block, e4m3_scales=False):
        calls.append((x, block, True, e4m3_scales))
        return fp4(x, block, e4m3_scales)

    def traced(params, tokens, live, ids):
        forward(params, cfg, tokens, live, ids)
        return [c[0] for c in calls]

    csa.fake_quant_fp8, csa.fake_quant_fp4 = record_fp8, record_fp4
    try:
        values = jax.jit(traced)(params, jnp.asarray(tokens), jnp.asarray(live), jnp.asarray(ids))
    finally:
        csa.fake_quant_fp8, csa.fake_quant_fp4 = fp8, fp4
    width, lengths = tokens.shape[1], live.sum(1)
    first = [np.inf] * len(tokens)
    for x, (_, block, is_fp4, e4m3) in zip(values, calls, strict=True):
        near = near_rounding_boundary(np.asarray(x), block, is_fp4, e4m3)
        near = near.reshape(*near.shape[:2], -1).any(-1)                   # [B, S or G]
        # Window K=V and indexer queries are per (left-padded) token; compressed entries and
        # indexer keys per group of `ratio` real tokens, complete at its last token.
        per_token = not is_fp4 or (not e4m3 and x.ndim == 4)
        ratio = width // near.shape[1]
        for row, index in zip(*np.nonzero(near)):
            at = index - (width - lengths[row]) if per_token else (index + 1) * ratio - 1
            first[row] = min(first[row], int(at))
    return tuple(first)


def assert_parted_only_after_rounding_boundaries(folder, errors, tolerance: float,
                                                 starts=None) -> None:
    """errors: per prompt of `reference.npz`, f32[n] over its consecutive positions from
    starts[row] (0 by default). Every position beyond `tolerance` must come at or after the
    prompt's first rounding boundary: a prompt with none agrees everywhere."""
    boundaries = first_rounding_boundaries(folder)
    for row, err in enumerate(errors):
        beyond = np.nonzero(np.asarray(err) > tolerance)[0]
        if len(beyond):
            at = (0 if starts is None else starts[row]) + beyond[0]
            assert at >= boundaries[row], (
                f"prompt {row} parts at position {at} (by {np.max(err):.1e}), before its first "
                f"rounding boundary ({boundaries[row]})")
