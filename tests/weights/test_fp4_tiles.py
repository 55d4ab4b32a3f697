"""FP4 expert codes in the FP4 kernel's tile order (pallas_kernels/fp4_layout.py,
deepinfer_jax/weights/fp4_tiles.py): the orders against index arithmetic written here, the
round trips exact, the dequantized weights unchanged, and the engine's start-up laying out
only what the kernel reads, leaving a caller's arrays alone unless it hands them over."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.model.params import ExpertParams
from deepinfer_jax.weights import random_params
from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts
from pallas_kernels import fp4_layout, quantized
from pallas_kernels.quantized import Fp4Blocks, Fp4Tile
from tests.conftest import REPO, xla_flags

BASE = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")
# sizes the kernel reads (K a multiple of its 512 granule) and the stored tiles divide
FITS = BASE.replace(hidden_size=512, moe_intermediate_size=512, num_mtp_layers=0)


def random_codes(rng, *shape) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


def test_tiles_hold_each_step_of_a_row_block_contiguously():
    rng = np.random.default_rng(0)
    packed = random_codes(rng, 2, 256, 384)            # [G, N, K/2]: K = 768
    tiled = np.asarray(fp4_layout.to_tiles(jnp.asarray(packed), 64, 256))
    assert tiled.shape == (2, 4, 3, 64, 128)
    for g, r, s, i, j in [(0, 0, 0, 0, 0), (1, 3, 2, 63, 127), (0, 2, 1, 5, 77), (1, 1, 0, 40, 3)]:
        assert tiled[g, r, s, i, j] == packed[g, 64 * r + i, 128 * s + j]
    np.testing.assert_array_equal(np.asarray(fp4_layout.from_tiles(jnp.asarray(tiled))), packed)


def test_halves_pair_each_groups_inputs_j_and_j_plus_16():
    packed = random_codes(np.random.default_rng(7), 2, 3, 48)           # 3 groups a row
    code = lambda b, i: (b[i // 2] >> (4 * (i % 2))) & 0x0F  # noqa: E731  (checkpoint pairs)
    got = np.asarray(fp4_layout.halves(jnp.asarray(packed)))
    for row in ((0, 0), (1, 2), (0, 1)):
        for g in range(3):
            stored, want = packed[row][16 * g:16 * (g + 1)], got[row][16 * g:16 * (g + 1)]
            for j in range(16):
                assert want[j] == code(stored, j) | code(stored, j + 16) << 4
    np.testing.assert_array_equal(np.asarray(fp4_layout.pairs(jnp.asarray(got))), packed)


@pytest.mark.parametrize("vector", [2, 4])
def test_word_bytes_undoes_word_major(vector):
    packed = random_codes(np.random.default_rng(vector), 3, 5, 256)
    words = fp4_layout.word_major(jnp.asarray(packed), vector)
    assert words.dtype == jnp.uint32 and words.shape == (3, 5, 64)
    np.testing.assert_array_equal(np.asarray(fp4_layout.word_bytes(words, vector)), packed)


def fp4_weight(rng, experts=3, n=256, k=512) -> Fp4Blocks:
    return Fp4Blocks(jnp.asarray(random_codes(rng, experts, n, k // 2)),
                     jnp.asarray(rng.integers(120, 131, (experts, k // 32, n), dtype=np.uint8)))


@pytest.mark.parametrize("words", [False, True])
def test_tiled_codes_dequantize_to_the_same_weights(words):
    w = fp4_weight(np.random.default_rng(1))
    tile = Fp4Tile(64, 128, words)
    tiled = quantized.fp4_tiled(w, tile)
    assert quantized.fp4_tile(w) is None and quantized.fp4_tile(tiled) == tile
    assert tiled.packed.dtype == (jnp.uint32 if words else jnp.uint8)
    assert tiled.shape == w.shape == (3, 512, 256)
    assert quantized.nbytes(tiled) == quantized.nbytes(w)
    np.testing.assert_array_equal(np.asarray(quantized.fp4_rows(tiled).packed), np.asarray(w.packed))
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(tiled, jnp.float32)),
                                  np.asarray(quantized.dequantize(w, jnp.float32)))


def expert_stacks(params) -> list[ExpertParams]:
    return [layer.moe.experts for layer in params.layers]


def test_start_up_tiles_the_stacks_the_kernel_reads_and_frees_owned_codes():
    params = random_params(FITS, 2, jnp.bfloat16, release_formats=True)
    before = expert_stacks(params)
    rows = [quantized.dequantize(s.w13, jnp.float32) for s in before]
    tiled = tile_fp4_experts(params, "words", owned=True)
    for old, new, want in zip(before, expert_stacks(tiled), rows, strict=True):
        assert quantized.fp4_tile(new.w13) == Fp4Tile(64, 128, True)
        assert quantized.fp4_tile(new.w2) == Fp4Tile(128, 128, True)
        assert old.w13.packed.is_deleted() and old.w2.packed.is_deleted()
        assert new.w13.scale is old.w13.scale            # scales as loaded
        np.testing.assert_array_equal(np.asarray(quantized.dequantize(new.w13, jnp.float32)),
                                      np.asarray(want))
    assert tiled.layers[0].attn.wq_a.codes is params.layers[0].attn.wq_a.codes   # dense: as is


def test_a_callers_params_stay_valid_and_rows_stay_where_the_kernel_cannot_read():
    params = random_params(FITS, 3, jnp.bfloat16, release_formats=True)
    copy = tile_fp4_experts(params, "bytes", owned=False)
    for old, new in zip(expert_stacks(params), expert_stacks(copy), strict=True):
        assert not old.w13.packed.is_deleted()
        assert quantized.fp4_tile(old.w13) is None
        assert quantized.fp4_tile(new.w13) == Fp4Tile(64, 128, False)
    assert tile_fp4_experts(params, None, owned=True) is params     # the jnp references: rows
    # I = 192: the down projection's K is not a multiple of the kernel's granule, nor is D = 256
    small = random_params(BASE.replace(num_mtp_layers=0), 4, jnp.bfloat16, release_formats=True)
    assert isinstance(small.layers[1].moe.experts.w13, Fp4Blocks)
    assert tile_fp4_experts(small, "words", owned=True) is small


def test_compute_config_names_the_order_of_its_first_grouped_gemm_implementation():
    order = lambda *names: ComputeConfig(kernels=KernelChoices(grouped_gemm=names)).fp4_expert_order  # noqa: E731
    assert order("mosaic_gpu") == "words"
    assert order("interpret") == "bytes"
    assert order("reference") is None
    assert order("reference", "mosaic_gpu") is None


# In a process of 2 CPU devices (XLA's device count is read when jax starts): a stack split
# over "ep" keeps that split, with the same weights.
SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from deepinfer_jax.model.params import ExpertParams
from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts
from pallas_kernels import quantized
from tests.weights.test_fp4_tiles import fp4_weight
mesh = Mesh(np.asarray(jax.devices()[:2]), ("ep",))
w = fp4_weight(np.random.default_rng(5), experts=4)
placed = jax.device_put(w, NamedSharding(mesh, PartitionSpec("ep")))
tiled = tile_fp4_experts(ExpertParams(w13=placed, w2=placed), "words", owned=False)
assert len(jax.devices()) == 2
assert tiled.w13.packed.sharding.spec[0] == "ep", tiled.w13.packed.sharding
assert tiled.w13.packed.addressable_shards[0].data.shape[0] == 2
np.testing.assert_array_equal(np.asarray(quantized.dequantize(tiled.w13, jnp.float32)),
                              np.asarray(quantized.dequantize(w, jnp.float32)))
print("ok")
"""


def test_tiling_keeps_the_expert_axis_sharding():
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["ok"], done.stderr[-3000:]


def test_a_kernel_config_for_another_code_order_is_refused():
    from pallas_kernels.grouped_gemm import fp4_path
    w = fp4_weight(np.random.default_rng(6))
    tiled = quantized.fp4_tiled(w, Fp4Tile(64, 128, False))
    lhs = jnp.zeros((4, 512), jnp.bfloat16)
    sizes = jnp.asarray([4, 0, 0], jnp.int32)
    rows_config = fp4_path.default_config(4, interpret=True, op="down", n_out=256)
    with pytest.raises(ValueError, match="reads codes as None, the weights hold"):
        fp4_path.grouped_matmul(lhs, tiled, sizes, swiglu_limit=None, config=rows_config,
                                interpret=True)
