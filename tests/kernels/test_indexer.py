"""The lightning indexer's score kernel against its jnp reference (GPU interpret mode on the
CPU, compiled on a GPU), the reference against the model's per-token scores, and the
kernel's lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.model.indexer import index_scores
from pallas_kernels.common import NotSupported, abstract_gpu
from pallas_kernels.indexer import api, reference
from pallas_kernels.indexer.mosaic_gpu import IndexerConfig
from pallas_kernels.indexer.mosaic_gpu import indexer_scores as kernel
from tests.kernels.which import KERNEL


def problem(token_seq, seqs: int, rows: int, head_dim: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = len(token_seq)
    q = jnp.asarray(rng.standard_normal((tokens, 64, head_dim)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((seqs, rows, head_dim)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.float32)
    return q, keys, weights, jnp.asarray(token_seq, jnp.int32)


@pytest.mark.parametrize("rows, config", [
    (128, IndexerConfig()),                                   # one block
    (100, IndexerConfig()),                                   # padded to a block
    (300, IndexerConfig(block_r=64, range_rows=128)),         # padded to 3 ranges of 2 blocks
])
def test_kernel_matches_reference(rows, config):
    """Tokens of three sequences, one sequence with none, padding tokens between."""
    q, keys, weights, token_seq = problem([0, 0, 2, -1, 2, 2, 0, -1], seqs=4, rows=rows,
                                          seed=rows)
    out = api.indexer_scores(q, keys, weights, token_seq, implementation=KERNEL, config=config)
    expected = reference.indexer_scores(q, keys, weights, token_seq)
    assert out.shape == expected.shape == (8, rows)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5,
                               atol=1e-5 * float(np.abs(expected).max()))
    assert not np.any(np.asarray(out)[np.asarray(token_seq) < 0])


def test_reference_is_the_models_per_token_score():
    """Per sequence keys, the same numbers as the model's scores over per-token keys (its
    float32 queries rounded to bf16 first, as the kernel takes them)."""
    q, keys, weights, token_seq = problem([1, 0, 1], seqs=2, rows=40, head_dim=64, seed=3)
    per_token = keys[token_seq].astype(jnp.float32)
    expected = index_scores(q.astype(jnp.float32)[:, None], weights[:, None], per_token)[:, 0]
    np.testing.assert_allclose(np.asarray(reference.indexer_scores(q, keys, weights, token_seq)),
                               np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_heads_in_a_fixed_order_give_the_same_scores():
    """Batch-invariant mode's form (the weighted heads summed by elementwise adds in a fixed
    tree): the model's per-token scores to float32 rounding."""
    q, keys, weights, token_seq = problem([1, 0, 1, -1], seqs=2, rows=40, head_dim=64, seed=5)
    ordered = reference.indexer_scores(q, keys, weights, token_seq, ordered_heads=True)
    plain = reference.indexer_scores(q, keys, weights, token_seq)
    per_token = keys[jnp.maximum(token_seq, 0)].astype(jnp.float32)
    expected = index_scores(q.astype(jnp.float32)[:, None], weights[:, None], per_token)[:, 0]
    expected = jnp.where((token_seq >= 0)[:, None], expected, 0.0)
    np.testing.assert_allclose(np.asarray(ordered), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(np.asarray(ordered), np.asarray(plain))   # a different order


def test_the_invariant_reference_sums_no_heads_by_a_contraction():
    """In batch-invariant mode (row tiles) the only contraction is q . key over the head dim;
    the heads are summed by adds, whose grouping no compiler picks."""
    q, keys, weights, token_seq = problem([0, 1, 1], seqs=2, rows=32, head_dim=64)
    jaxpr = str(jax.make_jaxpr(functools.partial(
        api.indexer_scores, implementation="reference", row_tile=2))(q, keys, weights, token_seq))
    assert jaxpr.count("dot_general[") == 1
    assert "dimension_numbers=(([2], [2]), ([0], [0]))" in jaxpr     # q . key, per token
    assert "reduce_sum" not in jaxpr


def test_a_tokens_scores_do_not_depend_on_the_batch():
    q, keys, weights, token_seq = problem([0, 1, 1, 0, 1], seqs=2, rows=128, seed=7)
    together = api.indexer_scores(q, keys, weights, token_seq, implementation=KERNEL)
    alone = api.indexer_scores(q[2:3], keys, weights[2:3], token_seq[2:3], implementation=KERNEL)
    np.testing.assert_array_equal(np.asarray(together[2:3]), np.asarray(alone))


def test_the_range_split_does_not_change_a_score():
    """default_config picks ranges by batch size; with the block fixed, the bits stay."""
    q, keys, weights, token_seq = problem([0, 1, 0], seqs=2, rows=512, seed=9)
    split = [api.indexer_scores(q, keys, weights, token_seq, implementation=KERNEL,
                                config=IndexerConfig(range_rows=r)) for r in (128, 512)]
    np.testing.assert_array_equal(np.asarray(split[0]), np.asarray(split[1]))


def test_shapes_the_kernel_does_not_take_go_to_the_reference():
    q, keys, weights, token_seq = problem([0, 0], seqs=1, rows=16, head_dim=32)
    with pytest.raises(NotSupported, match="dims a multiple of 64"):
        api.indexer_scores(q, keys, weights, token_seq, implementation="mosaic_gpu")
    np.testing.assert_array_equal(
        np.asarray(api.indexer_scores(q, keys, weights, token_seq,
                                      implementation=("mosaic_gpu", "reference"))),
        np.asarray(reference.indexer_scores(q, keys, weights, token_seq)))


@pytest.mark.parametrize("config", [IndexerConfig(), IndexerConfig(block_r=64, range_rows=256)])
def test_kernel_lowers_for_cuda(config):
    """Mosaic GPU's own checks (layouts, wgmma shapes, shared memory) run at lowering."""
    q, keys, weights, token_seq = problem([0, 1], seqs=2, rows=2048)
    with abstract_gpu():
        exported = jax.export.export(jax.jit(functools.partial(kernel, config=config)),
                                     platforms=["cuda"])(q, keys, weights, token_seq)
    assert "mosaic_gpu" in exported.mlir_module()
