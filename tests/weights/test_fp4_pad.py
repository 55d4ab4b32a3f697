"""FP4 routed-expert stacks zero-padded to the FP4 kernel's K granule (weights/fp4_pad.py):
the padded weights decode to the unpadded ones with zero columns after each of gate and up and
zero rows of w2; the reference MoE paths give the unpadded outputs to an ulp; V4.1-Flash's
padded stacks pass the FP4 kernel's operand check where the unpadded down projection does
not; the memory plan's granule is the kernel's."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory_v41 import FP4_K_GRANULE
from deepinfer_jax.model.moe import routed_experts
from deepinfer_jax.model.params import ExpertParams, MoEParams
from deepinfer_jax.model.v41 import blocks
from deepinfer_jax.weights.fp4_pad import pad_fp4_experts, padded_intermediate
from pallas_kernels.common import NotSupported
from pallas_kernels.grouped_gemm import fp4_path
from pallas_kernels.grouped_gemm.mosaic_gpu_fp4 import K_GRANULE
from pallas_kernels.grouped_gemm.reference import swiglu
from pallas_kernels.quantized import Fp4Blocks, dequantize
from tests.conftest import REPO

FLASH = REPO / "configs" / "deepseek-v41-flash.json"


def _stacks(rng, e: int, d: int, inter: int, xp=np) -> ExpertParams:
    """Random FP4 stacks (every code, scales 2**-4 .. 2**-1) in Fp4Blocks' layout."""
    def blocks_of(k, n):
        packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
        scale = rng.integers(123, 127, (e, k // 32, n), dtype=np.uint8)
        return Fp4Blocks(xp.asarray(packed), xp.asarray(scale))
    return ExpertParams(w13=blocks_of(d, 2 * inter), w2=blocks_of(inter, d))


def test_granule_is_the_kernels():
    assert FP4_K_GRANULE == K_GRANULE == 512
    assert [padded_intermediate(i) for i in (32, 512, 513, 2304)] == [512, 512, 1024, 2560]


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_padded_stacks_decode_to_zero_columns_after_gate_and_up(xp):
    e, d, inter = 3, 64, 96
    raw = _stacks(np.random.default_rng(0), e, d, inter, xp)
    padded = pad_fp4_experts(raw)
    assert type(padded.w13.packed) is type(raw.w13.packed)          # host stays host
    w13, w2 = (np.asarray(dequantize(w, jnp.float32)) for w in (raw.w13, raw.w2))
    extra = 512 - inter
    # independent of fp4_pad: the decoded stacks with zeros appended by numpy
    zeros = np.zeros((e, d, extra), np.float32)
    want13 = np.concatenate([w13[..., :inter], zeros, w13[..., inter:], zeros], axis=-1)
    want2 = np.concatenate([w2, np.zeros((e, extra, d), np.float32)], axis=1)
    assert padded.w13.shape == (e, d, 2 * 512) and padded.w2.shape == (e, 512, d)
    assert padded.w13.scale.shape == (e, d // 32, 2 * 512)          # group-major kept
    assert padded.w2.scale.shape == (e, 512 // 32, d)
    got13 = np.asarray(dequantize(padded.w13, jnp.float32))
    got2 = np.asarray(dequantize(padded.w2, jnp.float32))
    np.testing.assert_array_equal(got13, want13)
    np.testing.assert_array_equal(got2, want2)
    assert not np.signbit(got13[..., inter:512]).any()              # +0.0, not -0.0


def test_float_and_aligned_stacks_are_left_alone():
    rng = np.random.default_rng(1)
    aligned = _stacks(rng, 2, 64, 512)
    assert pad_fp4_experts(aligned) is aligned
    floats = ExpertParams(w13=np.ones((2, 64, 192), np.float32), w2=np.ones((2, 96, 64)))
    assert pad_fp4_experts(floats) is floats


def _unpadded_twin(experts: ExpertParams, inter: int, padded_inter: int) -> ExpertParams:
    """Float stacks cut back to I from decoded padded ones (the unpadded computation)."""
    w13 = dequantize(experts.w13, jnp.float32)
    w2 = dequantize(experts.w2, jnp.float32)
    return ExpertParams(
        w13=jnp.concatenate([w13[..., :inter], w13[..., padded_inter:padded_inter + inter]], -1),
        w2=w2[:, :inter])


@pytest.mark.parametrize("t", [5, 16, 24])
def test_reference_paths_give_the_unpadded_outputs(t):
    """V4's grouped path over Fp4Blocks (the engine's CPU form) and V4.1's reference
    `blocks.moe` over decoded stacks, padded vs unpadded, same tokens and router, at the tiny
    V4.1 model's D = 64, I = 32. The padded hidden columns are exactly 0 (silu(0) * 0) and
    every added product 0 * 0, yet the outputs are not always bitwise equal: XLA's CPU
    kernels pick their summation order by the operands' shapes, and the padded stacks are
    wider (measured here: the grouped path at 24 tokens bitwise, at 5 and 16 tokens two
    float32 ulps apart). So the bound is a few ulps of the largest output."""
    cfg = read_model_config(FLASH)
    e, d, inter = 8, 64, 32
    rng = np.random.default_rng(2)
    raw = _stacks(rng, e, d, inter, jnp)
    padded = pad_fp4_experts(raw)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(t)]),
                          jnp.int32)
    weights = jnp.asarray(rng.random((t, 2)), jnp.float32)

    def close(got, want):
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(want).max())

    grouped = [np.asarray(routed_experts(x, experts, weights, w, cfg.swiglu_limit,
                                         ComputeConfig())) for w in (raw, padded)]
    close(grouped[1], grouped[0])

    w13 = dequantize(padded.w13, jnp.float32)
    hidden = swiglu(jnp.einsum("td,edi->eti", x, w13), cfg.swiglu_limit)     # [E, T, I']
    assert not np.asarray(hidden[..., inter:]).any()                       # exactly 0

    gate = jnp.asarray(rng.standard_normal((d, e)) / 8, jnp.float32)

    def reference(stacks):
        p = MoEParams(gate=gate, bias=jnp.zeros((e,), jnp.float32), tid2eid=None,
                      experts=stacks, shared=None)
        return np.asarray(blocks.moe(x[None], p, cfg))
    floats = ExpertParams(w13=dequantize(raw.w13, jnp.float32), w2=dequantize(raw.w2, jnp.float32))
    want = reference(floats)
    close(reference(ExpertParams(w13=w13, w2=dequantize(padded.w2, jnp.float32))), want)
    # the padded stacks cut back to I compute the unpadded result bit for bit
    np.testing.assert_array_equal(reference(_unpadded_twin(padded, inter, 512)), want)


def test_flash_stacks_pass_the_fp4_kernels_check_only_padded():
    """V4.1-Flash's shapes (one expert): the down projection's K = I = 2304 is refused by the
    FP4 kernel's operand check, the padded 2560 accepted, at the configs the path picks."""
    raw_cfg = json.loads(FLASH.read_text())
    d, inter = raw_cfg["hidden_size"], raw_cfg["moe_intermediate_size"]
    assert inter % K_GRANULE                       # the case this padding exists for
    raw = _stacks(np.random.default_rng(3), 1, d, inter)
    padded = pad_fp4_experts(raw)
    x = jnp.zeros((4, d), jnp.bfloat16)
    for rows in (16, 8192):                        # decode- and prefill-sized configs
        for w, ok in ((raw, False), (padded, True)):
            i = w.w2.shape[-2]
            up = fp4_path.default_config(rows, False, "gate_up")
            down = fp4_path.default_config(rows, False, "down", d)
            fp4_path._check(x, w.w13, i, up)       # K = D = 5120: fine either way
            if ok:
                fp4_path._check(x[:, :i], w.w2, d, down)
            else:
                with pytest.raises(NotSupported, match="K % 512"):
                    fp4_path._check(x[:, :i], w.w2, d, down)


def test_random_v41_builder_pads():
    """The tiny V4.1 oracle config's I (32) is padded by the random builder as by the loader
    (test_v41_random: the same pytree; test_v41_quantized: the memory plan counts it)."""
    from deepinfer_jax.weights.v41_random import random_v41_params
    from tests.model.v41_oracle import FIXTURES
    if not FIXTURES[0].exists():
        pytest.skip("no V4.1 oracle fixtures")
    cfg = read_model_config(FIXTURES[0])
    assert cfg.moe_intermediate_size % K_GRANULE
    params = random_v41_params(cfg, 0, jnp.float32)
    i = padded_intermediate(cfg.moe_intermediate_size)
    for layer in params.layers:
        assert layer.moe.experts.w13.shape[-1] == 2 * i and layer.moe.experts.w2.shape[-2] == i
    jax.block_until_ready(params.layers[0].moe.experts.w2.packed)
