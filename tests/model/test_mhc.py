"""The mHC Sinkhorn's two formulations (fused unrolled adds for GPUs, a loop of reductions for
the CPU) against a float64 numpy loop written from the formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.mhc import _mixes, bf16_parts, hc_post, with_mix_parts
from pallas_kernels.sinkhorn import api as sinkhorn_op

ITERS, EPS = 20, 1e-6


def sinkhorn(logits, iters, eps, unrolled: bool):
    """The op's two jnp forms: unrolled elementwise ("reference") or a loop ("loop")."""
    return sinkhorn_op.sinkhorn(logits, iters, eps,
                                implementation="reference" if unrolled else "loop")


def numpy_sinkhorn(logits: np.ndarray) -> np.ndarray:
    x = np.exp(logits - logits.max(-1, keepdims=True))
    c = x / x.sum(-1, keepdims=True) + EPS
    c = c / (c.sum(-2, keepdims=True) + EPS)
    for _ in range(ITERS - 1):
        c = c / (c.sum(-1, keepdims=True) + EPS)
        c = c / (c.sum(-2, keepdims=True) + EPS)
    return c


@pytest.mark.parametrize("unrolled", [False, True])
def test_sinkhorn_matches_the_formula(unrolled):
    logits = 3 * jax.random.normal(jax.random.key(0), (5, 7, 4, 4), jnp.float32)
    got = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, unrolled))(logits)
    want = numpy_sinkhorn(np.asarray(logits, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got).sum(-2), 1.0, atol=1e-5)   # columns last


def test_unrolled_sinkhorn_is_one_fused_chain_without_loops():
    """The point of the unrolled form: no while loop and no reductions left for XLA to launch
    one by one."""
    logits = jnp.zeros((16, 4, 4), jnp.float32)
    hlo = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, True)).lower(logits).as_text()
    assert "stablehlo.while" not in hlo and "stablehlo.reduce" not in hlo
    loop = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, False)).lower(logits).as_text()
    assert "stablehlo.while" in loop



def test_bf16_parts_hold_a_float32_weight():
    w = jax.random.normal(jax.random.key(1), (512, 24), jnp.float32) * 0.01
    hi, mid, lo = bf16_parts(w)
    rebuilt = sum(np.asarray(part, np.float64) for part in (hi, mid, lo))
    np.testing.assert_allclose(np.asarray(rebuilt), np.asarray(w, np.float64), rtol=2**-23, atol=0)


@pytest.mark.parametrize("invariant", [False, True])
def test_mixes_are_the_normalised_float32_projection(invariant):
    """bf16 streams: the projection of the RMS-normalised flat streams, to float32 accuracy
    (the default mode's three bf16 parts with the norm applied after, and the invariant
    mode's float32 form), against float64 numpy."""
    streams = jax.random.normal(jax.random.key(2), (5, 3, 4, 256), jnp.bfloat16) * 3
    fn = jax.random.normal(jax.random.key(3), (4 * 256, 24), jnp.float32) * 0.02
    got = jax.jit(lambda s, f: _mixes(s, f, 1e-6, ComputeConfig(batch_invariant=invariant)))(streams, fn)
    flat = np.asarray(streams, np.float64).reshape(5, 3, -1)
    normed = flat / np.sqrt(np.mean(flat**2, axis=-1, keepdims=True) + 1e-6)
    want = normed @ np.asarray(fn, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("invariant", [False, True])
def test_mix_parts_made_once_give_the_same_mixes(invariant):
    """The engine's `fn_parts` (with_mix_parts, made once at start-up) stand in for the parts
    `_mixes` otherwise cuts from fn at each call: the same mixes, bit for bit, for every mix
    of a model's tree and nothing else changed."""
    from deepinfer_jax.config.hf import read_model_config
    from deepinfer_jax.weights import random_params
    from tests.conftest import REPO
    cfg = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")
    params = random_params(cfg, 0, jnp.bfloat16)
    made = with_mix_parts(params)
    mixes = [made.hc_head, *(m for layer in made.layers for m in (layer.attn_hc, layer.ffn_hc)),
             *(m for mtp in made.mtp for m in (mtp.hc_head, mtp.layer.attn_hc, mtp.layer.ffn_hc))]
    assert len(mixes) == 1 + 2 * cfg.num_layers + 3 * len(params.mtp)
    assert params.layers[0].attn_hc.fn_parts is None
    for mix in mixes:
        np.testing.assert_array_equal(np.asarray(mix.fn_parts, np.float32),
                                      np.asarray(jnp.concatenate(bf16_parts(mix.fn), -1), np.float32))
    np.testing.assert_array_equal(np.asarray(made.embed), np.asarray(params.embed))
    hc = params.layers[0].attn_hc
    streams = jax.random.normal(jax.random.key(5), (7, hc.fn.shape[0] // cfg.hidden_size,
                                                    cfg.hidden_size), jnp.bfloat16)
    compute = ComputeConfig(batch_invariant=invariant)
    mixes_of = jax.jit(lambda s, fn, parts: _mixes(s, fn, 1e-6, compute, parts))
    np.testing.assert_array_equal(np.asarray(mixes_of(streams, hc.fn, None)),
                                  np.asarray(mixes_of(streams, hc.fn, made.layers[0].attn_hc.fn_parts)))


def test_hc_post_is_the_oracles_arithmetic_to_bf16_rounding():
    """X'_k = post_k f + sum_j C[j, k] X_j as the HF model computes it in bf16: the weights
    rounded to bf16, the mix summed in float32 and rounded, then the bf16 product and add."""
    k = jax.random.split(jax.random.key(4), 4)
    streams = jax.random.normal(k[0], (6, 4, 128), jnp.bfloat16)
    block_out = jax.random.normal(k[1], (6, 128), jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (6, 4), jnp.float32))
    comb = sinkhorn(jax.random.normal(k[3], (6, 4, 4), jnp.float32), ITERS, EPS, False)
    got = np.asarray(jax.jit(hc_post, static_argnums=4)(block_out, streams, post, comb,
                                                        ComputeConfig()), np.float32)
    bf16 = jnp.bfloat16
    c = np.asarray(comb.astype(bf16), np.float64)
    mixed = np.einsum("njk,njd->nkd", c, np.asarray(streams, np.float64))
    term = np.asarray(post.astype(bf16)[..., None] * block_out[:, None, :], np.float64)
    want = np.asarray(jnp.asarray(term, bf16) + jnp.asarray(mixed, bf16), np.float32)
    # float32 sums against float64 ones; and a GPU, allowed excess precision, may skip any of
    # the bf16 roundings (of the weights, the mix, the product: seen on the H200), each a
    # bf16 step of what it rounds, and the mix's terms may cancel: a few bf16 steps of the
    # terms' magnitudes at most. A wrong mix is off by O(1).
    magnitude = np.abs(term) + np.einsum("njk,njd->nkd", np.abs(c), np.abs(np.asarray(streams, np.float64)))
    assert np.all(np.abs(got - want) <= 2**-6 * magnitude + 1e-6)
