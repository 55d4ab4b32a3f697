"""The grouped GEMM on FP4 weights (quantized.Fp4Blocks): the jnp forms are dequantize-then-bf16
exactly, and the kernel (mosaic_gpu_fp4.py; interpreted on the CPU, compiled on an SM90 GPU)
matches `quantized.dequantize` + the reference at several group-size patterns, with and without
the SwiGLU epilogue, and through the whole expert MLP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quantized
from pallas_kernels.common import NotSupported, abstract_gpu, kernel_mode
from pallas_kernels.grouped_gemm import api, fp4_path, reference
from pallas_kernels.grouped_gemm.fp4_dequant import word_major
from pallas_kernels.grouped_gemm.mosaic_gpu_fp4 import Fp4Config, tile_major, tiled_fp4_matmul_t
from tests.kernels.gemm_cases import KERNEL, close, routed_pairs
from tests.tiers import covering

K = 512                       # the kernel stages scale rows in 16-byte pieces: K % 512 == 0
N = 128
SIZES = {
    "empty experts": [0, 20, 0, 0, 3, 0, 1],
    "one hot expert": [0, 0, 40, 0],
    "one token": [0, 1, 0],
}


def fp4_weights(rng, groups: int, n: int, k: int) -> quantized.Fp4Blocks:
    """Random codes (every nibble value, subnormal 0.5 and -0 included) and scales 2**-9..2**0."""
    return quantized.Fp4Blocks(
        jnp.asarray(rng.integers(0, 256, (groups, n, k // 2)), jnp.uint8),
        jnp.asarray(rng.integers(118, 128, (groups, k // 32, n)), jnp.uint8))


def rows(rng, sizes, k: int = K, integers: bool = False):
    shape = (int(sum(sizes)), k)
    values = rng.integers(-3, 4, shape) if integers else rng.standard_normal(shape)
    return jnp.asarray(values, jnp.bfloat16), jnp.asarray(sizes, jnp.int32)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("swiglu", [None, 7.0])
def test_reference_is_dequantize_then_bf16(swiglu):
    rng = np.random.default_rng(0)
    w = fp4_weights(rng, 7, N, 64)
    lhs, sizes = rows(rng, SIZES["empty experts"], k=64)
    dense = quantized.dequantize(w, jnp.bfloat16)
    for impl in ("reference", "dense"):
        np.testing.assert_array_equal(
            bits(api.grouped_matmul(lhs, w, sizes, swiglu_limit=swiglu, implementation=impl)),
            bits(api.grouped_matmul(lhs, dense, sizes, swiglu_limit=swiglu,
                                    implementation=impl)))


@pytest.mark.parametrize("invariant", [False, True])
def test_expert_mlp_reference_is_dequantize_then_bf16(invariant):
    rng = np.random.default_rng(1)
    w13, w2 = fp4_weights(rng, 7, 2 * 32, 64), fp4_weights(rng, 7, 64, 32)
    x, sizes = rows(rng, SIZES["empty experts"], k=64)
    run = functools.partial(api.expert_mlp, group_sizes=sizes, swiglu_limit=7.0,
                            implementation="reference", invariant=invariant)
    np.testing.assert_array_equal(
        bits(run(x, w13, w2)),
        bits(run(x, quantized.dequantize(w13), quantized.dequantize(w2))))


def test_the_dequantized_meaning_against_the_e2m1_table():
    """quantized.dequantize, the oracle, against a by-hand decode of a few bytes."""
    packed = jnp.asarray([[[0x21, 0xF9] + [0] * 14]], jnp.uint8)     # codes 1, 2, 9, 15
    scale = jnp.asarray([[[126]]], jnp.uint8)                       # 2 ** -1
    w = quantized.dequantize(quantized.Fp4Blocks(packed, scale))
    np.testing.assert_array_equal(bits(w)[0, :4, 0], [0.25, 0.5, -0.25, -3.0])


@pytest.mark.parametrize("case, swiglu", covering({"case": list(SIZES), "swiglu": [None, 7.0]}))
def test_kernel_matches_dequantize_and_reference(case, swiglu):
    rng = np.random.default_rng(2)
    lhs, sizes = rows(rng, SIZES[case])
    w = fp4_weights(rng, len(SIZES[case]), N, K)
    ref = reference.grouped_matmul(lhs, quantized.dequantize(w), sizes, swiglu_limit=swiglu)
    close(api.grouped_matmul(lhs, w, sizes, swiglu_limit=swiglu, implementation=KERNEL), ref)


@pytest.mark.parametrize("dequant, chains, pipelined, swizzle, step", [
    ("convert", 1, False, 0, False), ("bits", 1, False, 0, False), ("bits", 4, True, 0, False),
    ("bits", 1, True, 64, False), ("bits_ptx", 1, False, 0, False),
    ("bits_ptx", 2, False, 0, False), ("bits_ptx", 4, False, 0, False),
    ("bits_ptx", 1, True, 0, False), ("bits_ptx", 4, True, 0, False),
    ("bits_ptx", 1, True, 64, False), ("bits_ptx", 1, False, 32, False),
    ("bits_ptx", 1, True, 0, True), ("bits_ptx", 1, False, 64, True)])
def test_kernel_reads_every_nibble_and_scale_exactly(dequant, chains, pipelined, swizzle, step):
    """Small-integer activations: every product and partial sum is exact in f32, so the
    kernel's output must equal the reference's bit for bit; a wrong nibble, sign, input
    order or scale would show, in each dequantization formulation (fp4_dequant.py)."""
    if KERNEL == "interpret" and dequant == "bits_ptx":
        pytest.skip("inline PTX runs only in a compiled kernel")
    rng = np.random.default_rng(3)
    lhs, sizes = rows(rng, SIZES["empty experts"], integers=True)
    w = fp4_weights(rng, len(SIZES["empty experts"]), N, K)
    ref = reference.grouped_matmul(lhs, quantized.dequantize(w), sizes)
    config = Fp4Config(a_in_registers=KERNEL != "interpret", dequant=dequant, k_chains=chains,
                       scales_in_pipeline=pipelined, codes_swizzle=swizzle, wgmma_per_step=step)
    out = api.grouped_matmul(lhs, w, sizes, implementation=KERNEL, config=config)
    np.testing.assert_array_equal(bits(out), bits(ref))


@pytest.mark.parametrize("swiglu", [None, 7.0])
def test_tile_major_codes_give_the_same_bits(swiglu):
    """The codes laid out tile-major (one program step's bytes contiguous) are read as the
    row-major ones: the same output, bit for bit."""
    rng = np.random.default_rng(6)
    lhs, sizes = rows(rng, SIZES["empty experts"], k=2 * K)
    w = fp4_weights(rng, len(SIZES["empty experts"]), N, 2 * K)
    config = Fp4Config(block_n=64, block_k=128, a_in_registers=KERNEL != "interpret",
                       dequant="bits")
    with kernel_mode(KERNEL == "interpret"):
        x_t, tiles = fp4_path.kernel_input(lhs, sizes, config.block_m)
        call = functools.partial(tiled_fp4_matmul_t, x_t, scale=w.scale,
                                 tile_group=tiles.tile_group, swiglu_limit=swiglu)
        row_major = call(packed=w.packed, config=config)
        tiled = call(packed=tile_major(w.packed, 64, 128),
                     config=dataclasses_replace(config, tile_major=True))
    used = np.repeat(np.asarray(tiles.tile_group) >= 0, config.block_m)   # unused: unwritten
    np.testing.assert_array_equal(bits(tiled)[:, used], bits(row_major)[:, used])


@pytest.mark.parametrize("swiglu, shape", covering({"swiglu": [None, 7.0], "shape": {
    "one token": ("one token", 60, 1, 6), "empty experts": ("empty experts", 0, 4, 8)}}))
def test_persistent_programs_give_the_same_bits(swiglu, shape):
    """Persistent programs looping over the used tiles' pairs only write what one program a
    pair writes, bit for bit: one token's rows padded as a decode bucket pads them (1 tile
    of 6 used), and three experts' rows with no padding (4 of 8 used: without SwiGLU 8 used
    pairs over the 4 programs interpret mode runs, two each)."""
    case, padding_rows, used_tiles, tiles = shape
    rng = np.random.default_rng(9)
    lhs, sizes = rows(rng, SIZES[case], integers=True)
    lhs = jnp.pad(lhs, ((0, padding_rows), (0, 0)))            # rows in no group
    w = fp4_weights(rng, len(SIZES[case]), N, K)
    config = Fp4Config(block_n=64, a_in_registers=KERNEL != "interpret",
                       dequant="bits" if KERNEL == "interpret" else "bits_ptx",
                       scales_in_pipeline=True)
    with kernel_mode(KERNEL == "interpret"):
        x_t, layout = fp4_path.kernel_input(lhs, sizes, config.block_m)
        call = functools.partial(tiled_fp4_matmul_t, x_t, w.packed, w.scale, layout.tile_group,
                                 swiglu_limit=swiglu)
        per_pair = call(config=config)
        persistent = call(config=dataclasses_replace(config, programs_per_sm=1))
    used = np.asarray(layout.tile_group) >= 0
    assert (int(used.sum()), used.size) == (used_tiles, tiles)
    used = np.repeat(used, config.block_m)
    np.testing.assert_array_equal(bits(persistent)[:, used], bits(per_pair)[:, used])
    ref = reference.grouped_matmul(lhs, quantized.dequantize(w), sizes, swiglu_limit=swiglu)
    out = fp4_path._from_kernel_form(persistent, layout)[:int(sizes.sum())]
    close(out, ref[:int(sizes.sum())])


@pytest.mark.parametrize("vector", [2, 4])
def test_word_major_gives_each_thread_its_wgmma_bytes(vector):
    """The contract `word_major` keeps with the kernel: in the WGMMA layout a thread of column
    quad q holds, of each 16-byte scale group's row, bytes 2q, 2q+1, 8+2q, 9+2q as u8 codes;
    as u32 words (WGMMA layout for vector 2, its 8-bit variant for 4) it holds words
    v*q .. v*q + v-1 of each column tile c of 4v words; its word of group v*c + e must hold
    its four bytes of that group, in that order (little-endian)."""
    rng = np.random.default_rng(8)
    packed = rng.integers(0, 256, (3, 5, 128), dtype=np.uint8)
    words = np.asarray(word_major(jnp.asarray(packed), vector))
    assert words.dtype == np.uint32 and words.shape == (3, 5, 32)
    for c in range(8 // vector):
        for q in range(4):
            for e in range(vector):
                g = vector * c + e
                group = packed[..., 16 * g:16 * (g + 1)]
                want = group[..., [2 * q, 2 * q + 1, 8 + 2 * q, 9 + 2 * q]].astype(np.uint32)
                got = words[..., 4 * vector * c + vector * q + e]
                np.testing.assert_array_equal(
                    got, want[..., 0] | want[..., 1] << 8 | want[..., 2] << 16 | want[..., 3] << 24)


@pytest.mark.parametrize("swiglu, step, tiled, vector", [
    (None, False, False, 2), (7.0, False, True, 2), (7.0, True, False, 2), (None, True, True, 2),
    (None, False, False, 4), (7.0, False, True, 4), (7.0, True, False, 4), (None, True, True, 4)])
def test_word_codes_give_the_same_bits(swiglu, step, tiled, vector):
    """Word-major codes (one 8-byte load a thread and two groups) are read as the bytes are:
    the same output bit for bit, per group and with one wgmma a step, row-major and
    tile-major. Compiled only (the words' dequantization is inline PTX)."""
    if KERNEL == "interpret":
        pytest.skip("inline PTX runs only in a compiled kernel")
    rng = np.random.default_rng(7)
    lhs, sizes = rows(rng, SIZES["empty experts"], k=2 * K, integers=True)
    w = fp4_weights(rng, len(SIZES["empty experts"]), N, 2 * K)
    config = Fp4Config(block_n=64, block_k=128, dequant="bits_ptx", scales_in_pipeline=True,
                       wgmma_per_step=step)
    x_t, tiles = fp4_path.kernel_input(lhs, sizes, config.block_m)
    call = functools.partial(tiled_fp4_matmul_t, x_t, scale=w.scale,
                             tile_group=tiles.tile_group, swiglu_limit=swiglu)
    words = word_major(w.packed, vector)
    bytes_out = call(packed=w.packed, config=config)
    words_out = call(packed=tile_major(words, 64, 128) if tiled else words,
                     config=dataclasses_replace(config, word_codes=vector, tile_major=tiled))
    used = np.repeat(np.asarray(tiles.tile_group) >= 0, config.block_m)
    np.testing.assert_array_equal(bits(words_out)[:, used], bits(bytes_out)[:, used])


@pytest.mark.parametrize("a_in_registers", [True, False])
def test_expert_mlp_end_to_end(a_in_registers):
    """Tokens in by source_rows, (token, slot) pairs out by out_order, through both FP4 GEMMs
    (w13 [G, 2I, D/2] gate rows first; w2 [G, D, I/2]), against the reference chain."""
    if KERNEL == "interpret" and a_in_registers:
        pytest.skip("interpret mode has no register-A wgmma (the kernel stages A there)")
    rng = np.random.default_rng(4)
    sizes, tokens, source_rows, out_order = routed_pairs(rng, K)
    w13, w2 = fp4_weights(rng, len(sizes), 2 * K, K), fp4_weights(rng, len(sizes), K, K)
    config = Fp4Config(a_in_registers=a_in_registers)
    ref = api.expert_mlp(tokens, w13, w2, sizes, 7.0, implementation="reference",
                         source_rows=source_rows, out_order=out_order)
    close(api.expert_mlp(tokens, w13, w2, sizes, 7.0, implementation=KERNEL,
                         configs=(config, config), source_rows=source_rows,
                         out_order=out_order), ref)


def test_unfit_shapes_fall_through_to_the_reference():
    rng = np.random.default_rng(5)
    w = fp4_weights(rng, 3, 64, 64)                   # K = 64: not a multiple of 512
    lhs, sizes = rows(rng, SIZES["one token"], k=64)
    with pytest.raises(NotSupported, match="K=64"):
        api.grouped_matmul(lhs, w, sizes, implementation="mosaic_gpu")
    np.testing.assert_array_equal(
        bits(api.grouped_matmul(lhs, w, sizes, implementation=("mosaic_gpu", "reference"))),
        bits(api.grouped_matmul(lhs, quantized.dequantize(w), sizes)))


@pytest.mark.parametrize("swiglu, k, n, dequant, chains, pipelined, tiled, extra", [
    (10.0, 4096, 4096, "convert", 1, False, False, {}),
    (None, 2048, 4096, "convert", 1, False, False, {}),
    (10.0, 4096, 4096, "bits_ptx", 1, False, False, {}),
    (10.0, 4096, 4096, "bits_ptx", 4, True, True, {}),
    (None, 2048, 4096, "bits_ptx", 2, True, False, {}),
    (None, 2048, 4096, "bits_ptx", 1, True, True, {}),
    (10.0, 4096, 4096, "bits_ptx", 1, True, False, {"codes_swizzle": 64}),
    (None, 2048, 4096, "bits_ptx", 1, True, True, {"codes_swizzle": 64}),
    (10.0, 4096, 4096, "bits_ptx", 1, True, True, {"wgmma_per_step": True}),
    (None, 2048, 4096, "bits_ptx", 1, True, False, {"wgmma_per_step": True}),
    (10.0, 4096, 4096, "bits_ptx", 1, True, True, {"word_codes": 2}),
    (None, 2048, 4096, "bits_ptx", 2, True, False, {"word_codes": 2}),
    (10.0, 4096, 4096, "bits_ptx", 1, False, True, {"word_codes": 4, "wgmma_per_step": True}),
    (None, 2048, 4096, "bits_ptx", 1, True, False, {"word_codes": 4}),
    (10.0, 4096, 4096, "bits_ptx", 1, True, True, {"word_codes": 4, "wgmma_per_step": True,
                                                   "programs_per_sm": 4})])
@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_lowers_for_cuda_at_v4_flash_shapes(swiglu, k, n, dequant, chains, pipelined,
                                                    tiled, extra, block_m):
    """Mosaic's layout, register and shared-memory rules, checked at lowering (no GPU)."""
    config = dataclasses_replace(fp4_path.default_config(100), block_m=block_m, dequant=dequant,
                                 k_chains=chains, scales_in_pipeline=pipelined, tile_major=tiled,
                                 **extra)
    fn = jax.jit(functools.partial(tiled_fp4_matmul_t, swiglu_limit=swiglu, config=config))
    per, code_dtype = (8, jnp.uint32) if config.word_codes else (2, jnp.uint8)
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            jax.ShapeDtypeStruct((k, 400 * block_m), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, n, k // per) if not tiled else
                                 (256, n * k // config.block_k, config.block_k // per),
                                 code_dtype),
            jax.ShapeDtypeStruct((256, k // 32, n), jnp.uint8),
            jax.ShapeDtypeStruct((400,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()


def dataclasses_replace(config, **changes):
    import dataclasses
    return dataclasses.replace(config, **changes)


@pytest.mark.parametrize("fields, message", [
    ({"codes_swizzle": 48}, "codes_swizzle"),
    ({"codes_swizzle": 128, "block_k": 128}, "codes_swizzle"),     # 64-byte rows
    ({"wgmma_per_step": True, "dequant": "bits"}, "wgmma_per_step"),
    ({"wgmma_per_step": True, "dequant": "bits_ptx", "k_chains": 2}, "wgmma_per_step"),
    ({"word_codes": 2, "dequant": "bits"}, "word_codes"),
    ({"word_codes": 3, "dequant": "bits_ptx"}, "word_codes"),
    ({"word_codes": 4, "dequant": "bits_ptx", "block_k": 64}, "word_codes"),
    ({"word_codes": 2, "dequant": "bits_ptx", "codes_swizzle": 64}, "word_codes"),
    ({"programs_per_sm": 2}, "programs_per_sm")])               # scales staged whole
def test_config_refuses_options_the_kernel_cannot_build(fields, message):
    with pytest.raises(ValueError, match=message):
        Fp4Config(**fields).check(4096, 2048)
