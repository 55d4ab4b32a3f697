"""The grouped GEMM kernel against its jnp reference, in GPU interpret mode on the CPU (the
same tests run the compiled kernel on a GPU), plus the reference against a float64 numpy
computation, the tile layout and the kernel's lowering for CUDA. The batch-invariant dense
GEMM's tests: test_invariant_gemm.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.common import NotSupported, abstract_gpu, kernel_mode
from pallas_kernels.grouped_gemm import (
    api,
    invariant,
    layout,
    mosaic_gpu_persistent,
    mosaic_gpu_rows,
    reference,
)
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig, tiled_group_matmul
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import tiled_group_matmul as tiled_group_matmul_ws
from tests.kernels.gemm_cases import (
    KERNEL,
    SIZES,
    K,
    N,
    close,
    expert_weights,
    problem,
    routed_pairs,
)
from tests.tiers import covering


@pytest.mark.parametrize("case, swiglu", covering({"case": list(SIZES), "swiglu": [None, 7.0]}))
def test_kernel_matches_reference_bf16(case, swiglu):
    lhs, rhs, sizes, _ = problem(SIZES[case], fp8=False)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu, implementation=KERNEL), ref)


WS = WarpSpecializedConfig(block_n=64)
# Tiles whose second 64-row half is all padding (its consumer skips) or holds one row.
WS_SIZES = SIZES | {"halves at the edge": [64, 65, 0, 129, 128]}


# The persistent kernel on groups: programs loop over the (tile, column) pairs (3 of them here)
WS_PERSISTENT = mosaic_gpu_persistent.PersistentConfig(block_n=64, programs=3)


@pytest.mark.parametrize("case, swiglu, config", covering(
    {"case": list(WS_SIZES), "swiglu": [None, 7.0], "config": {"per tile": WS, "persistent": WS_PERSISTENT}},
    always=[("halves at the edge", None, "per tile")]))
def test_warp_specialized_kernel_matches_reference(case, swiglu, config):
    lhs, rhs, sizes, _ = problem(WS_SIZES[case], fp8=False)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu, implementation=KERNEL, config=config),
          ref)


def test_persistent_expert_mlp_matches_the_reference_chain():
    rng = np.random.default_rng(13)
    sizes = jnp.asarray(WS_SIZES["halves at the edge"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13, w2 = expert_weights(rng, len(sizes))
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, implementation=KERNEL,
                         configs=(WS_PERSISTENT, dataclasses.replace(WS_PERSISTENT, block_n=128))),
          api.expert_mlp(x, w13, w2, sizes, 7.0, implementation="reference"))


def test_warp_specialized_expert_mlp_and_dense_invariance():
    rng = np.random.default_rng(8)
    sizes = jnp.asarray(SIZES["one hot expert"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13, w2 = expert_weights(rng, len(sizes))
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, implementation=KERNEL, configs=(WS, WS)),
          api.expert_mlp(x, w13, w2, sizes, 7.0, implementation="reference"))
    full = np.asarray(invariant.matmul(x, w13[0], implementation=KERNEL, config=WS), np.float32)
    for m in (1, 3, 64):
        np.testing.assert_array_equal(
            np.asarray(invariant.matmul(x[:m], w13[0], implementation=KERNEL, config=WS),
                       np.float32), full[:m])


@pytest.mark.parametrize("rows", [100, 5000])
def test_default_configs_small_and_large_batches(rows):
    """The decode-sized and prefill-sized default tiles (api.default_config) on one problem."""
    rng = np.random.default_rng(rows)
    sizes = jnp.asarray(np.bincount(rng.integers(0, 6, rows), minlength=6), jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((6, K, N)) / 8, jnp.bfloat16)
    assert api.default_config(rows, N // 2, swiglu=True).block_m == (64 if rows < 4096 else 128)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0, implementation=KERNEL), ref)


@pytest.mark.parametrize("case, swiglu", covering({"case": ["balanced", "empty experts"],
                                                     "swiglu": [None, 0.0]}))
def test_kernel_matches_reference_fp8_block_scales(case, swiglu):
    lhs, rhs, sizes, scale = problem(SIZES[case], fp8=True)
    ref = reference.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=swiglu)
    out = api.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=swiglu, implementation=KERNEL,
                             config=TileConfig(block_n=128))
    close(out, ref)


def fp8_problem(sizes, k: int, n: int, seed: int = 0):
    """FP8 E4M3 weights [G, k, n] with a different scale for every 128 x 128 block."""
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((int(sizes.sum()), k)), jnp.bfloat16)
    scale = rng.uniform(0.01, 0.05, (len(sizes), k // 128, n // 128)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 1), 128, 2)
    codes = (rng.standard_normal((len(sizes), k, n)) / 8 / full).astype(ml_dtypes.float8_e4m3fn)
    return lhs, jnp.asarray(codes), sizes, jnp.asarray(scale)


@pytest.mark.parametrize("sizes", [[16], [5, 0, 9]], ids=["one group", "groups"])
def test_fp8_split_k_reads_each_ranges_block_scales(sizes):
    """K split into 4 ranges over FP8 weights: each range's programs dequantize with the scales
    of their own K blocks (range r starts at block r of a 512-row weight), the partials summed."""
    lhs, codes, group_sizes, scale = fp8_problem(sizes, 512, 128)
    ref = reference.grouped_matmul(lhs, codes, group_sizes, rhs_scale=scale)
    out = api.grouped_matmul(lhs, codes, group_sizes, rhs_scale=scale, implementation=KERNEL,
                             config=TileConfig(block_n=128, split_k=4))
    close(out, ref)


@pytest.mark.parametrize("groups, rows, config", [(1, 16, None), (3, 70, None),
                                                   (2, 5, TileConfig(block_n=64, split_k=2))])
def test_batched_matmul_fp8_matches_the_dequantized_product(groups, rows, config):
    """Equal groups without a tile layout (the FP8 dense projections, G = 1, and the grouped
    output projection): each group's rows against its own weight, rows not a whole tile."""
    lhs, codes, _, scale = fp8_problem([rows] * groups, 256, 128, seed=groups)
    lhs = lhs.reshape(groups, rows, -1)
    want = np.einsum("gmk,gkn->gmn", np.asarray(lhs, np.float32),
                     np.asarray(reference.dequantize(codes, scale, jnp.float32)))
    for impl in ("reference", KERNEL):
        close(api.batched_matmul(lhs, codes, rhs_scale=scale, implementation=impl, config=config),
              want)


@pytest.mark.parametrize("swiglu, split_k", [(None, 4), (0.0, 1)])
def test_fp8_scales_staged_in_shared_memory(swiglu, split_k):
    """scales_in_smem: each program copies its group's scale grid into shared memory and reads
    its steps' scales there; every 128 x 128 block has its own scale, K split into ranges or
    the SwiGLU's gate and up halves (the up half's blocks at columns N/2 on)."""
    lhs, codes, group_sizes, scale = fp8_problem([5, 0, 9], 512, 1024, seed=7)
    config = TileConfig(block_n=128, split_k=split_k, scales_in_smem=True)
    ref = reference.grouped_matmul(lhs, codes, group_sizes, rhs_scale=scale, swiglu_limit=swiglu)
    out = api.grouped_matmul(lhs, codes, group_sizes, rhs_scale=scale, swiglu_limit=swiglu,
                             implementation=KERNEL, config=config)
    close(out, ref)


def test_fp8_scales_in_shared_memory_need_whole_tma_rows():
    """A scale row narrower than TMA's 16 bytes (N = 256: 2 scales) is refused with the
    reason, not miscompiled."""
    with pytest.raises(ValueError, match="16-byte"):
        TileConfig(block_n=128, scales_in_smem=True).check(512, 256, fp8=True)
    TileConfig(block_n=128, scales_in_smem=True).check(512, 512, fp8=True)


def test_small_batches_split_k_until_the_gpu_is_filled():
    """The decode default: an FP8 4096 -> 512 projection at M = 16 (one row tile, 4 column
    blocks) splits K until 256 programs or 256 rows a range; a wide one is left whole."""
    narrow = api.split_for_small_batches(TileConfig(block_n=128), 1, 4096, 512)
    assert narrow.split_k == 16                         # 4 x 16 = 64 programs (K floor)
    assert api.split_for_small_batches(TileConfig(block_n=128), 1, 8192, 4096).split_k == 8
    assert api.split_for_small_batches(TileConfig(block_n=128), 1, 1024, 32768).split_k == 1
    assert api.split_for_small_batches(TileConfig(block_n=128), 8, 4096, 1024).split_k == 4
    assert api.split_for_small_batches(TileConfig(block_n=128), 64, 4096, 4096).split_k == 1


def test_expert_mlp_matches_reference_chain():
    rng = np.random.default_rng(7)
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13, w2 = expert_weights(rng, len(sizes))
    ref = api.expert_mlp(x, w13, w2, sizes, 7.0, implementation="reference")
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, implementation=KERNEL), ref)


@pytest.mark.parametrize("impl, sparse_tiles", [(KERNEL, 1), (KERNEL, 10**6), ("reference", 1)],
                         ids=["sorted then copied into tiles", "gathered into tiles", "reference"])
def test_expert_mlp_gathers_its_rows_and_orders_its_result(impl, sparse_tiles, monkeypatch):
    """source_rows / out_order (the routed experts' tokens in, pairs out): the same bits as
    gathering the sorted rows first and reordering the result after, on both of the kernel
    path's ways into the tiles (api.SPARSE_TILES chooses)."""
    monkeypatch.setattr(api, "SPARSE_TILES", sparse_tiles)
    rng = np.random.default_rng(8)
    sizes, tokens, source_rows, out_order = routed_pairs(rng)
    w13, w2 = expert_weights(rng, len(sizes))
    sorted_first = api.expert_mlp(tokens[source_rows], w13, w2, sizes, 7.0, implementation=impl)
    np.testing.assert_array_equal(
        np.asarray(api.expert_mlp(tokens, w13, w2, sizes, 7.0, implementation=impl, source_rows=source_rows,
                                  out_order=out_order), np.float32),
        np.asarray(sorted_first[out_order], np.float32))


def test_a_rows_result_does_not_depend_on_its_groups_size():
    """What batch-invariant MoE needs: the same (row, expert) pair gives the same bits
    whether the expert got one row or many."""
    lhs, rhs, sizes, _ = problem(SIZES["one hot expert"], fp8=False)
    many = np.asarray(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0, implementation=KERNEL),
                      np.float32)
    one = api.grouped_matmul(lhs[:1], rhs, jnp.asarray([0, 0, 1, 0], jnp.int32),
                             swiglu_limit=7.0, implementation=KERNEL)
    np.testing.assert_array_equal(np.asarray(one, np.float32), many[:1])


def test_unfit_shapes_fall_through_to_the_reference():
    assert not api.kernel_fits(96, 40, api.default_config(8, 40), False)   # K not a multiple of 64
    assert api.kernel_fits(128, 128, api.default_config(8, 128), False)
    lhs = jnp.ones((5, 96), jnp.bfloat16)
    rhs = jnp.ones((2, 96, 40), jnp.bfloat16)
    sizes = jnp.asarray([2, 3], jnp.int32)
    with pytest.raises(NotSupported, match="K=96"):
        api.grouped_matmul(lhs, rhs, sizes, implementation="mosaic_gpu")
    out = api.grouped_matmul(lhs, rhs, sizes, implementation=("mosaic_gpu", "reference"))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((5, 40), 96.0))


def test_the_dense_form_takes_small_products_only():
    """"dense" (one einsum over every group, for launch-bound devices) equals ragged_dot, and
    refuses products past reference.DENSE_PRODUCTS."""
    lhs, rhs, sizes, _ = problem(SIZES["empty experts"], fp8=False, seed=4)
    dense = api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0, implementation="dense")
    close(dense, api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0))
    big = jnp.zeros((reference.DENSE_PRODUCTS // (rhs.shape[0] * N) + 1, K), jnp.bfloat16)
    with pytest.raises(NotSupported, match="dense"):
        api.grouped_matmul(big, rhs, sizes, implementation="dense")


def test_reference_against_float64():
    lhs, rhs, sizes, scale = problem(SIZES["empty experts"], fp8=True, seed=3)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    weights = f64(rhs) * np.repeat(np.repeat(f64(scale), 128, 1), 128, 2)
    weights = f64(weights.astype(ml_dtypes.bfloat16))   # the reference dequantizes to bf16
    groups = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    gate_up = np.einsum("mk,mkn->mn", f64(lhs), weights[groups])
    gate, up = np.minimum(gate_up[:, : N // 2], 7.0), np.clip(gate_up[:, N // 2:], -7.0, 7.0)
    expected = gate / (1 + np.exp(-gate)) * up
    out = reference.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=7.0)
    np.testing.assert_allclose(f64(out), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_tile_layout_gives_every_row_one_slot_in_its_groups_tile():
    sizes = jnp.asarray([0, 70, 0, 3, 130, 1], jnp.int32)
    bm = 64
    tiles = layout.tile_layout(sizes, int(sizes.sum()), bm)
    padded, groups = np.asarray(tiles.padded_row), np.asarray(tiles.tile_group)
    assert len(set(padded.tolist())) == len(padded)
    row_group = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    assert (groups[padded // bm] == row_group).all()
    assert len(groups) == layout.max_tiles(int(sizes.sum()), len(sizes), bm)
    used = -(-np.asarray(sizes) // bm)
    assert (groups[: used.sum()] >= 0).all() and (groups[used.sum():] == -1).all()
    # Each tile's row count, by hand: 70 -> 64 + 6, 3, 130 -> 64 + 64 + 2, 1, unused 0s.
    expected_rows = [64, 6, 3, 64, 64, 2, 1] + [0] * (len(groups) - 7)
    assert np.asarray(tiles.tile_rows).tolist() == expected_rows
    # Each tile's first sorted row: 0, 64 | 70 | 73, 137, 201 | 203, unused 0s.
    expected_first = [0, 64, 70, 73, 137, 201, 203] + [0] * (len(groups) - 7)
    assert np.asarray(tiles.tile_first_row).tolist() == expected_first


@pytest.mark.parametrize("limit", [1, 8, 64, 128])
def test_row_pieces_cover_exactly_the_first_rows(limit):
    """Every count 0..limit: the present pieces are disjoint and cover rows [0, count), so a
    partial tile's copies never reach a neighbour group's rows."""
    for count in range(limit + 1):
        covered = []
        for size, first, present in mosaic_gpu_rows.row_pieces(jnp.int32(count), limit):
            if bool(present):
                covered += range(int(first), int(first) + size)
        assert sorted(covered) == list(range(count)), count


def test_rows_copied_into_tiles_land_in_their_slots():
    """The TMA copy into tiles against the jnp layout (a scatter into zeros): the same row in
    every row's slot (the padding is left undefined by the copy)."""
    sizes = jnp.asarray([0, 70, 0, 3, 130, 1, 64], jnp.int32)
    total, bm = int(sizes.sum()), 64
    x = jnp.asarray(np.random.default_rng(4).standard_normal((total + 5, 192)), jnp.bfloat16)
    tiles = layout.tile_layout(sizes, total + 5, bm)
    with kernel_mode(KERNEL == "interpret"):
        copied = mosaic_gpu_rows.copy_to_tiles(x, tiles.tile_first_row, tiles.tile_rows,
                                               tiles=tiles.tile_group.shape[0], block_m=bm,
                                               block_k=64)
    slots = np.asarray(tiles.padded_row)[:total]
    np.testing.assert_array_equal(np.asarray(copied, np.float32)[slots],
                                  np.asarray(layout.to_tiles(x, tiles, bm), np.float32)[slots])


def test_rows_past_the_groups_total_are_in_no_tile():
    """ragged_dot's rows in no group (the MoE's padding pairs, sorted last): no tile slot, so
    they neither take a tile nor overwrite a group's row; the rows in groups keep their slots."""
    sizes = jnp.asarray([0, 70, 0, 3], jnp.int32)
    bm, total = 64, 73
    alone = layout.tile_layout(sizes, total, bm)
    with_extra = layout.tile_layout(sizes, total + 40, bm)
    tiles = with_extra.tile_group.shape[0]
    padded = np.asarray(with_extra.padded_row)
    np.testing.assert_array_equal(padded[:total], np.asarray(alone.padded_row))
    assert (padded[total:] >= tiles * bm).all()
    assert (np.asarray(with_extra.tile_group)[:2] == [1, 1]).all()
    assert int((np.asarray(with_extra.tile_group) >= 0).sum()) == 3        # 70 -> 2 tiles, 3 -> 1


def test_expert_mlp_rows_in_groups_ignore_rows_past_the_total():
    """The kernel path's rows in groups are those of the reference (which gives the rows past
    the total zeros; the kernel leaves them undefined), however many rows follow."""
    rng = np.random.default_rng(9)
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    total = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((total + 30, K)), jnp.bfloat16)
    w13, w2 = expert_weights(rng, len(sizes))
    ref = api.expert_mlp(x[:total], w13, w2, sizes, 7.0, implementation="reference")
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, implementation=KERNEL)[:total], ref)
    np.testing.assert_array_equal(
        np.asarray(api.expert_mlp(x, w13, w2, sizes, 7.0, implementation="reference")[total:]), 0)


@pytest.mark.parametrize("block_n, swiglu", [(64, 10.0), (128, 10.0), (256, None)])
def test_persistent_grouped_kernel_lowers_for_cuda(block_n, swiglu):
    """V4-Flash's expert GEMMs (gate/up 4096 -> 2 x 2048 with the SwiGLU, down 2048 -> 4096)
    in the configs the bench sweeps (shared memory and registers checked at lowering)."""
    k, n = (4096, 4096) if swiglu else (2048, 4096)
    config = mosaic_gpu_persistent.PersistentConfig(block_n=block_n)
    fn = jax.jit(functools.partial(mosaic_gpu_persistent.tiled_group_matmul, swiglu_limit=swiglu,
                                   config=config))
    tiles = jax.ShapeDtypeStruct((400,), jnp.int32)      # shapes only: no 8 GB of weights
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            jax.ShapeDtypeStruct((400 * 128, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, k, n), jnp.bfloat16), tiles, tiles)
    assert "mosaic_gpu" in exported.mlir_module()


def test_fp8_kernel_with_scales_in_shared_memory_lowers_for_cuda():
    """The scale grid's TMA copy and the steps' scalar reads from shared memory pass Mosaic
    GPU's lowering (V4-Flash's wo_b: K 8192, N 4096, K in 8 ranges)."""
    config = TileConfig(block_n=128, split_k=8, scales_in_smem=True)
    fn = jax.jit(functools.partial(tiled_group_matmul, config=config))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            jax.ShapeDtypeStruct((64, 8192), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 8192, 4096), ml_dtypes.float8_e4m3fn),
            jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1, 64, 32), jnp.float32))
    assert "smem_scales" in exported.mlir_module()


def test_warp_specialized_kernel_lowers_for_cuda():
    lhs, rhs, sizes, _ = problem(SIZES["balanced"], fp8=False)
    tiles = layout.tile_layout(sizes, lhs.shape[0], WS.block_m)
    fn = jax.jit(functools.partial(tiled_group_matmul_ws, swiglu_limit=7.0, config=WS))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            layout.to_tiles(lhs, tiles, WS.block_m), rhs, tiles.tile_group, tiles.tile_rows)
    assert "mosaic_gpu" in exported.mlir_module()


def test_warp_specialized_kernel_storing_sorted_rows_lowers_for_cuda():
    """V4-Flash's down GEMM storing its rows straight into sorted order (row pieces from
    plain shared memory: Mosaic's layout rules checked at lowering), and the copy into tiles."""
    config = WarpSpecializedConfig(block_n=256)
    tiles = jax.ShapeDtypeStruct((444,), jnp.int32)
    down = jax.jit(functools.partial(tiled_group_matmul_ws, config=config, sorted_rows=49152))
    copy = jax.jit(functools.partial(mosaic_gpu_rows.copy_to_tiles, tiles=444, block_m=128))
    with abstract_gpu():
        exported = [jax.export.export(down, platforms=["cuda"])(
                        jax.ShapeDtypeStruct((444 * 128, 2048), jnp.bfloat16),
                        jax.ShapeDtypeStruct((256, 2048, 4096), jnp.bfloat16), tiles, tiles, tiles),
                    jax.export.export(copy, platforms=["cuda"])(
                        jax.ShapeDtypeStruct((49152, 4096), jnp.bfloat16), tiles, tiles)]
    assert all("mosaic_gpu" in e.mlir_module() for e in exported)


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_lowers_for_cuda(fp8):
    """Mosaic GPU's own checks (layouts, tiling, shared memory) run at lowering."""
    lhs, rhs, sizes, scale = problem(SIZES["balanced"], fp8=fp8)
    tiles = layout.tile_layout(sizes, lhs.shape[0], 64)
    fn = jax.jit(functools.partial(tiled_group_matmul, swiglu_limit=7.0))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            layout.to_tiles(lhs, tiles, 64), rhs, tiles.tile_group, scale)
    assert "mosaic_gpu" in exported.mlir_module()
