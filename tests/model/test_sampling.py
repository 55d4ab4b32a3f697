"""The device sampler against hand-computed distributions (chi-square over many seeded draws),
and penalties and bitmasks against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deepinfer_jax.device.sampling import (
    SamplingRows,
    apply_penalties,
    filter_logits,
    host_truncates,
    sample,
    scale_by_temperature,
    truncates,
    unpack_bitmask,
)

V = 12
LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -3.0], np.float32)
DRAWS = 40_000


def rows(n, **overrides) -> SamplingRows:
    base = dict(temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                repetition_penalty=np.ones(n, np.float32),
                presence_penalty=np.zeros(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                seed=np.arange(n, dtype=np.uint32), position=np.full(n, 7, np.int32),
                allowed=np.full((n, 1), -1, np.int32))
    if "allowed" in overrides:                      # its own width (the vocabulary / 32)
        base["allowed"] = np.asarray(overrides.pop("allowed"), np.int32)
    for k, v in overrides.items():
        base[k] = np.broadcast_to(np.asarray(v, base[k].dtype), base[k].shape).copy()
    return SamplingRows(**{k: jnp.asarray(v) for k, v in base.items()})


_sample = jax.jit(sample, static_argnames=("num_logprobs", "truncation"))


def draw(**overrides) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, V))
    zeros = jnp.zeros((DRAWS, V), bool), jnp.zeros((DRAWS, V), jnp.int32)
    out = _sample(logits, rows(DRAWS, **overrides), *zeros, num_logprobs=2)
    return np.bincount(np.asarray(out.tokens), minlength=V)


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The intended distribution, computed step by step in float64."""
    scaled = LOGITS.astype(np.float64) / temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(V, bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    cum_before = 0.0
    for t in order:                        # top-p over the top-k renormalised mass
        if cum_before >= top_p:
            keep[t] = False
        cum_before += q[t]
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("setting", [
    dict(), dict(temperature=0.6), dict(temperature=1.7), dict(top_k=3), dict(top_p=0.7),
    dict(min_p=0.3), dict(top_k=5, top_p=0.8, temperature=1.3), dict(min_p=0.1, top_p=0.9),
])
def test_sampled_distribution_matches(setting):
    counts = draw(**setting)
    want = expected(**setting)
    assert counts[want == 0].sum() == 0            # filtered tokens never appear
    live = want > 0
    chi2 = stats.chisquare(counts[live], want[live] / want[live].sum() * counts[live].sum())
    assert chi2.pvalue > 1e-3, (setting, counts, np.round(want * DRAWS))


def test_greedy_rows_take_the_argmax_of_masked_logits():
    allowed = np.zeros((4, 1), np.int32)
    allowed[:, 0] = (1 << 3) | (1 << 9)            # only tokens 3 and 9
    out = _sample(jnp.broadcast_to(jnp.asarray(LOGITS), (4, V)),
                  rows(4, temperature=0.0, allowed=allowed),
                  jnp.zeros((4, V), bool), jnp.zeros((4, V), jnp.int32), num_logprobs=3)
    assert np.asarray(out.tokens).tolist() == [3] * 4
    raw = LOGITS - np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(np.asarray(out.logprob), raw[3], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0], raw[:3], rtol=1e-5)
    assert np.asarray(out.top_ids)[0].tolist() == [0, 1, 2]


def test_streams_depend_on_seed_and_position_only():
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (64, V))
    zeros = jnp.zeros((64, V), bool), jnp.zeros((64, V), jnp.int32)
    seeds = np.repeat(np.arange(8, dtype=np.uint32), 8)
    positions = np.tile(np.arange(8, dtype=np.int32), 8)
    a = np.asarray(_sample(logits, rows(64, seed=seeds, position=positions), *zeros, num_logprobs=1).tokens)
    perm = np.random.default_rng(0).permutation(64)
    b = np.asarray(_sample(logits, rows(64, seed=seeds[perm], position=positions[perm]), *zeros,
                           num_logprobs=1).tokens)
    np.testing.assert_array_equal(a[perm], b)                   # batch order does not matter
    assert len({tuple(a[s * 8:(s + 1) * 8]) for s in range(8)}) > 1   # seeds differ


def test_a_row_draws_the_same_whichever_sampler_variant_the_batch_needs():
    """The host compiles the sampler with and without truncation and picks per batch: rows
    that truncate nothing (greedy, temperature only, top-p 1) must draw the same tokens in
    both, seeded, over a long flat tail (where a float cumsum reaches 1 before the end)."""
    n, vocab = 256, 4096
    logits = jax.random.normal(jax.random.key(0), (n, vocab)) * 0.1      # a flat distribution
    zeros = jnp.zeros((n, vocab), bool), jnp.zeros((n, vocab), jnp.int32)
    temperature = np.where(np.arange(n) % 4 == 0, 0.0, 1.3).astype(np.float32)
    everything = np.full((n, vocab // 32), -1)
    plain = rows(n, temperature=temperature, allowed=everything)
    mixed = rows(n, temperature=temperature, top_p=np.where(np.arange(n) == 1, 0.5, 1.0),
                 allowed=everything)
    assert not host_truncates(temperature, 0, 1.0, 0.0) and host_truncates(temperature, 0, 0.5, 0.0)
    assert not host_truncates(np.zeros(n), 5, 0.5, 0.1)           # greedy rows never truncate
    assert not bool(truncates(plain)) and bool(truncates(mixed))
    without = np.asarray(_sample(logits, plain, *zeros, num_logprobs=1, truncation=False).tokens)
    with_ = np.asarray(_sample(logits, mixed, *zeros, num_logprobs=1, truncation=True).tokens)
    decided = np.asarray(_sample(logits, mixed, *zeros, num_logprobs=1, truncation=None).tokens)
    untouched = np.arange(n) != 1
    np.testing.assert_array_equal(with_[untouched], without[untouched])
    np.testing.assert_array_equal(decided, with_)
    # at the logits: a peaked row's float cumsum reaches 1 at once, yet top-p 1 keeps its tail
    peaked = logits.at[:, 0].set(30.0)
    np.testing.assert_array_equal(np.asarray(filter_logits(peaked, mixed))[untouched],
                                  np.asarray(scale_by_temperature(peaked, mixed))[untouched])


def test_penalties_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    prompt = rng.random((3, V)) < 0.3
    counts = rng.integers(0, 3, (3, V)) * (rng.random((3, V)) < 0.5)
    r = rows(3, repetition_penalty=[1.0, 1.3, 0.8], presence_penalty=[0.5, 0.0, -0.2],
             frequency_penalty=[0.1, 0.4, 0.0])
    got = np.asarray(apply_penalties(jnp.asarray(logits), r, jnp.asarray(prompt), jnp.asarray(counts)))
    want = logits.astype(np.float64).copy()
    for i, (rep, pres, freq) in enumerate([(1.0, 0.5, 0.1), (1.3, 0.0, 0.4), (0.8, -0.2, 0.0)]):
        for t in range(V):
            if prompt[i, t] or counts[i, t] > 0:
                want[i, t] = want[i, t] / rep if want[i, t] > 0 else want[i, t] * rep
            want[i, t] -= freq * counts[i, t] + pres * (counts[i, t] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bitmask_unpacks_like_the_llguidance_reference():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(1)
    vocab = 70
    bits = rng.integers(-2**31, 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    ref = np.zeros((4, vocab), np.float32)
    apply_token_bitmask_inplace(ref, bits)
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(bits), vocab)), ref == 0)
