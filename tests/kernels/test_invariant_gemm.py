"""The batch-invariant dense GEMM (grouped_gemm/invariant.py): a row's bits whatever the
batch (M), the tile shape, the K ranges' kernels; the persistent kernel for large batches
(the same bits as the per-tile split-K kernel); the configs; lowering for CUDA. Interpreted
on the CPU, compiled on an SM90+ GPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import abstract_gpu, kernel_mode
from pallas_kernels.grouped_gemm import api, invariant, mosaic_gpu_persistent, reference
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig, tiled_group_matmul
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig
from tests.kernels.gemm_cases import KERNEL, SIZES, K, N, bitwise_operands, close, problem


def test_dense_gemm_rows_do_not_depend_on_the_number_of_rows():
    rng = np.random.default_rng(5)
    x, w = bitwise_operands(rng, (1000, K), (K, N))
    full = np.asarray(invariant.matmul(x, w, implementation=KERNEL), np.float32)
    close(full, invariant.matmul(x, w, implementation="reference"))
    for m in (1, 3, 64):
        np.testing.assert_array_equal(
            np.asarray(invariant.matmul(x[:m], w, implementation=KERNEL), np.float32), full[:m])


PERSISTENT = mosaic_gpu_persistent.PersistentConfig(block_n=128, store_n=64, programs=3)   # (loops)


@pytest.mark.parametrize("splits, ranges", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_persistent_dense_gemm_gives_the_split_k_kernels_bits(splits, ranges):
    """The persistent kernel sums the K ranges apart (`ranges` per call in accumulators of
    their own, the calls chained, each adding the ranges before it): the same bits as the
    one-warpgroup kernel's per-range partials summed after it, so a large batch on it gets
    the rows a small batch gets from the other (M = 200: padded tiles)."""
    rng = np.random.default_rng(11)
    x, w = bitwise_operands(rng, (200, 4 * K), (4 * K, N))
    per_tile = invariant.matmul(x, w, implementation=KERNEL, config=TileConfig(64, 128, split_k=splits))
    config = dataclasses.replace(PERSISTENT, ranges=ranges)
    with kernel_mode(KERNEL == "interpret"):
        chained = mosaic_gpu_persistent.chained_matmul(x, w, splits=splits, config=config)
    np.testing.assert_array_equal(np.asarray(chained, np.float32),
                                  np.asarray(per_tile, np.float32))
    close(chained, invariant.matmul(x, w, implementation="reference"))


def test_large_batches_take_the_persistent_kernel_with_the_weights_k_ranges(monkeypatch):
    for k, n in ((4096, 4096), (4096, 1024), (1024, 32768)):
        small = invariant.dense_invariant_config(64, n, k)
        large = invariant.dense_invariant_config(8192, n, k)
        assert isinstance(small, TileConfig) and isinstance(large, mosaic_gpu_persistent.PersistentConfig)
        assert small.split_k == invariant.invariant_split_k(k, n)
        large.check(k, n, splits=small.split_k)
    # and through invariant.matmul: the rows of a large batch's config are the small one's
    rng = np.random.default_rng(12)
    x, w = bitwise_operands(rng, (130, 4 * K), (4 * K, N))
    monkeypatch.setattr(invariant, "MIN_SPLIT_K", 128)       # (K = 512 splits at this size)
    monkeypatch.setattr(invariant, "SPLIT_PROGRAMS", 4)
    assert invariant.invariant_split_k(4 * K, N) == 2
    big = np.asarray(invariant.matmul(x, w, implementation=KERNEL, config=PERSISTENT), np.float32)
    np.testing.assert_array_equal(np.asarray(invariant.matmul(x[:3], w, implementation=KERNEL), np.float32),
                                  big[:3])


def test_the_large_batch_config_runs_on_the_persistent_kernel(monkeypatch):
    """The config a large batch gets (two K ranges summed in one call) runs on the persistent
    kernel: its fit was once checked for one range, so every large batch fell back to the
    per-tile split-K kernel (the same bits, 48-50% of XLA's dot on the H200)."""
    monkeypatch.setattr(invariant, "MIN_SPLIT_K", 128)       # (K = 512 splits in two here)
    monkeypatch.setattr(invariant, "SPLIT_PROGRAMS", 4)
    assert invariant.invariant_split_k(4 * K, N) == 2
    config = dataclasses.replace(invariant.persistent_config(N, 2), programs=3)   # (loops)
    assert config.ranges == 2
    calls, chained = [], mosaic_gpu_persistent.chained_matmul
    monkeypatch.setattr(mosaic_gpu_persistent, "chained_matmul",
                        lambda *a, **kw: calls.append(kw["config"]) or chained(*a, **kw))
    x, w = bitwise_operands(np.random.default_rng(13), (130, 4 * K), (4 * K, N))
    out = invariant.matmul(x, w, implementation=KERNEL, config=config)
    assert calls == [config]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
        invariant.matmul(x, w, implementation=KERNEL), np.float32))     # the small batches' path


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_persistent_dense_kernel_lowers_for_cuda(splits):
    """At V4-Flash's 4096 x 4096 with the configs the engine picks (shared memory is checked
    at lowering)."""
    config = invariant.persistent_config(4096, splits)
    x = jnp.zeros((8192, 4096), jnp.bfloat16)
    w = jnp.zeros((4096, 4096), jnp.bfloat16)
    fn = jax.jit(functools.partial(mosaic_gpu_persistent.chained_matmul, splits=splits, config=config))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(x, w)
    assert exported.mlir_module().count("mosaic_gpu") >= splits // config.ranges


def test_the_callers_k_ranges_hold_at_every_batch_size(monkeypatch):
    """k_ranges (the mHC mixes' fixed split): the per-tile split kernel at every M, a large
    batch included (no persistent chain), and a row's bits the same alone as in the batch."""
    monkeypatch.setattr(invariant, "PERSISTENT_MIN_ROWS", 128)      # 200 rows count as large
    assert isinstance(invariant.dense_invariant_config(200, N, 4 * K),
                      mosaic_gpu_persistent.PersistentConfig)
    large = invariant.dense_invariant_config(200, N, 4 * K, k_ranges=4)
    assert isinstance(large, TileConfig) and large.split_k == 4
    rng = np.random.default_rng(14)
    x, w = bitwise_operands(rng, (200, 4 * K), (4 * K, N))
    full = np.asarray(invariant.matmul(x, w, implementation=KERNEL, k_ranges=4), np.float32)
    close(full, np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    for m in (1, 3):
        np.testing.assert_array_equal(np.asarray(invariant.matmul(
            x[:m], w, implementation=KERNEL, k_ranges=4), np.float32), full[:m])


SPLIT = TileConfig(block_m=64, block_n=128, split_k=4)     # K = 4 x 128: ranges of 2 steps
GROUPED = TileConfig(block_m=64, block_n=64, split_k=4, group_tiles=3)   # 4 tiles: 3 + 1


def test_split_k_rows_do_not_depend_on_the_number_of_rows():
    """K summed in 4 ranges by separate programs, the partials added after: a row's result is
    the same for M = 1, 3, 64 as inside 200 rows, and is the product."""
    rng = np.random.default_rng(6)
    x, w = bitwise_operands(rng, (200, 4 * K), (4 * K, N))
    full = np.asarray(invariant.matmul(x, w, implementation=KERNEL, config=SPLIT), np.float32)
    close(full, np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    for m in (1, 3, 64):
        np.testing.assert_array_equal(
            np.asarray(invariant.matmul(x[:m], w, implementation=KERNEL, config=SPLIT), np.float32), full[:m])
    # programs in groups of row tiles (the last group short): every (tile, column) once
    np.testing.assert_array_equal(
        np.asarray(invariant.matmul(x, w, implementation=KERNEL, config=GROUPED), np.float32), full)


def test_split_k_follows_the_weight_shape_only():
    assert invariant.invariant_split_k(4096, 512) == 8        # 4 column tiles: K in ranges of 512
    assert invariant.invariant_split_k(4096, 64) == 8         # one 64-column tile
    assert invariant.invariant_split_k(8192, 4096) == 2       # 32 column tiles
    assert invariant.invariant_split_k(4096, 24) == 1         # no 64-column tile
    assert invariant.invariant_split_k(1024, 32768) == 1      # 256 column tiles fill the SMs
    for rows in (1, 64, 256):
        config = invariant.dense_invariant_config(rows, 1024, 4096)
        assert config.split_k == 8 and api.kernel_fits(4096, 1024, config, False)
    large = invariant.dense_invariant_config(5000, 1024, 4096)   # the persistent kernel's chain
    assert isinstance(large, mosaic_gpu_persistent.PersistentConfig)
    large.check(4096, 1024, splits=8)
    with pytest.raises(ValueError, match="split K"):
        SPLIT.check(4 * K, N, fp8=False, swiglu=True)


@pytest.mark.parametrize("config", [SPLIT, GROUPED, TileConfig(128, 128, 64, 6, split_k=4,
                                                                 group_tiles=8)],
                         ids=["split", "split-grouped-tiles", "split-128-rows"])
def test_split_k_kernel_lowers_for_cuda(config):
    x = jnp.zeros((128, 4 * K), jnp.bfloat16)
    w = jnp.zeros((1, 4 * K, N), jnp.bfloat16)
    fn = jax.jit(functools.partial(tiled_group_matmul, config=config))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(x, w, jnp.zeros((2,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == (4, 128, N)


@pytest.mark.parametrize("case", SIZES)
def test_dense_fallback_equals_ragged_dot(case):
    """The jnp path's dense formulation (used off the CPU for small products) against a
    float64 numpy loop over the groups, with padding rows past the groups' total."""
    lhs, rhs, sizes, _ = problem(SIZES[case], fp8=False)
    lhs = jnp.concatenate([lhs, jnp.ones((5, K), lhs.dtype)])            # 5 rows in no group
    got = jax.jit(functools.partial(reference.grouped_matmul, dense=True))(lhs, rhs, sizes)
    x, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    want, start = np.zeros((lhs.shape[0], N)), 0
    for g, size in enumerate(np.asarray(sizes)):
        want[start: start + size] = x[start: start + size] @ w[g]
        start += size
    close(got, want)
    assert not np.asarray(got[-5:], np.float32).any()


# What the invariant configs' free tile shapes rest on: on the H200 (where it is the real question, wgmma's
# per-element sums) and in interpret mode. The SwiGLU epilogue is elementwise, so the plain
# product is the whole question; block_k stays 64 in every config.
TILE_SHAPES = [TileConfig(block_m=64, block_n=128), TileConfig(block_m=128, block_n=128),
               TileConfig(block_m=64, block_n=64), TileConfig(block_m=64, block_n=16),
               TileConfig(block_m=128, block_n=64),
               WarpSpecializedConfig(block_n=128), WarpSpecializedConfig(block_n=256),
               mosaic_gpu_persistent.PersistentConfig(block_n=128, programs=3)]


def test_rows_do_not_depend_on_the_tile_shape():
    rng = np.random.default_rng(9)
    x, w = bitwise_operands(rng, (130, 4 * K), (4 * K, N))
    outs = [np.asarray(invariant.matmul(x, w, implementation=KERNEL, config=c), np.float32)
            for c in TILE_SHAPES]
    close(outs[0], invariant.matmul(x, w, implementation="reference"))
    for config, out in zip(TILE_SHAPES[1:], outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=str(config))


def test_invariant_configs_follow_the_batch_where_the_tile_shape_is_free():
    """Tiles may follow the batch (wgmma's sums ignore the tile's shape:
    test_rows_do_not_depend_on_the_tile_shape); the K ranges may not."""
    small = invariant.dense_invariant_config(64, 512)               # a decode batch's 4096 -> 512
    assert small.block_n == 16 and api.kernel_fits(4096, 512, small, False)
    wide = invariant.dense_invariant_config(64, 32768)              # already 256 programs at 128
    assert wide.block_n == 128
    assert invariant.dense_invariant_config(8192, 512) == api.default_config(
        invariant.LARGE_BATCH, 512, warp_specialized=False)
    assert not api.kernel_fits(4096, 24, invariant.dense_invariant_config(64, 24), False,
                               jnp.float32)                # mHC's: float32, not a wgmma type
    # 8 columns (a tiny model's router): Mosaic GPU finds no shared-memory tiling for them
    assert not api.kernel_fits(4096, 8, invariant.dense_invariant_config(64, 8, 4096), False)
    assert not api.kernel_fits(4096, 8, api.default_config(64, 8), False)


def test_batched_matmul_is_each_groups_product_and_row_invariant():
    """G equal-size groups in one launch (the attention's grouped output projection): each
    group's rows are its own product, and a row's result does not depend on M."""
    rng = np.random.default_rng(7)
    x, w = bitwise_operands(rng, (3, 70, K), (3, K, N))
    full = np.asarray(invariant.batched_matmul(x, w, implementation=KERNEL), np.float32)
    close(full, np.einsum("gmk,gkn->gmn", np.asarray(x, np.float64), np.asarray(w, np.float64)))
    for m in (1, 5):
        np.testing.assert_array_equal(
            np.asarray(invariant.batched_matmul(x[:, :m], w, implementation=KERNEL), np.float32), full[:, :m])


@pytest.mark.parametrize("config", [TileConfig(block_m=64, block_n=128), SPLIT],
                         ids=["whole-k", "split-k"])
def test_dense_gemm_float32_out_keeps_the_float32_sum(config):
    """out_dtype=float32 (the compressor's and router's projections of bf16 values): the
    float32 sums come out unrounded, so they match a float64 product to float32's rounding of
    a K-term sum, far inside bf16's; and a row's result still does not depend on M."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((130, 4 * K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4 * K, N)) / 8, jnp.bfloat16)
    out = invariant.matmul(x, w, implementation=KERNEL, config=config, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(
        np.asarray(invariant.matmul(x[:3], w, implementation=KERNEL, config=config, out_dtype=jnp.float32)),
        np.asarray(out)[:3])
