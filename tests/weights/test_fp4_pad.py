"""FP4 routed-expert stacks zero-padded to the FP4 kernel's K granule (weights/fp4_pad.py):
the granule follows the grouped GEMM's implementation table (1 on the CPU's references); the
padded weights decode to the unpadded ones with zero columns after each of gate and up and
zero rows of w2; forced on the CPU through the table's "interpret" entry, the padded expert
GEMMs give the unpadded results bit for bit where the arithmetic is exact and the expert MLP
within a float32 reordering bound; V4.1-Flash's padded stacks pass the FP4 kernel's operand
check where the unpadded down projection does not."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import FP4_K_GRANULE, ComputeConfig
from deepinfer_jax.config.options import CPU, DeviceFacts, resolve_compute
from deepinfer_jax.model.moe import routed_experts
from deepinfer_jax.model.params import ExpertParams
from deepinfer_jax.weights.fp4_pad import pad_fp4_experts, padded_intermediate
from pallas_kernels.common import NotSupported
from pallas_kernels.grouped_gemm import api as gemm
from pallas_kernels.grouped_gemm import fp4_path
from pallas_kernels.grouped_gemm.mosaic_gpu_fp4 import K_GRANULE
from pallas_kernels.quantized import Fp4Blocks, dequantize
from tests.conftest import REPO

FLASH = REPO / "configs" / "deepseek-v41-flash.json"
LIMIT = 10.0                      # V4.1-Flash's swiglu_limit
EPS32 = 2.0 ** -24                # float32's unit roundoff


def _granule(device=CPU, **kernels) -> int:
    return resolve_compute(device, kernels=kernels or None, environ={}).fp4_expert_granule


def _stacks(rng, e: int, d: int, inter: int, xp=np) -> ExpertParams:
    """Random FP4 stacks (every code, scales 2**-4 .. 2**-1) in Fp4Blocks' layout."""
    def blocks_of(k, n):
        packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
        scale = rng.integers(123, 127, (e, k // 32, n), dtype=np.uint8)
        return Fp4Blocks(xp.asarray(packed), xp.asarray(scale))
    return ExpertParams(w13=blocks_of(d, 2 * inter), w2=blocks_of(inter, d))


def _dyadic(rng, shape) -> np.ndarray:
    """Multiples of 1/8 in [-1, 1]: 4 significant bits."""
    return rng.integers(-8, 9, shape).astype(np.float32) / 8


def test_granule_follows_the_grouped_gemm_table():
    assert FP4_K_GRANULE == K_GRANULE == 512                  # config may not import kernels
    hopper, blackwell = DeviceFacts("gpu", "9.0"), DeviceFacts("gpu", "10.0")
    assert _granule() == 1 and _granule(blackwell) == 1       # jnp references: I as stored
    assert _granule(hopper) == 512                            # the FP4 kernel by default
    assert _granule(grouped_gemm=("interpret",)) == 512       # forced on the CPU
    assert _granule(hopper, grouped_gemm=("reference",)) == 1
    assert _granule(sink_attention=("interpret",)) == 1       # only the grouped GEMM's entry
    assert [padded_intermediate(i, 512) for i in (32, 512, 513, 2304)] == [512, 512, 1024, 2560]


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_padded_stacks_decode_to_zero_columns_after_gate_and_up(xp):
    e, d, inter = 3, 64, 96
    raw = _stacks(np.random.default_rng(0), e, d, inter, xp)
    padded = pad_fp4_experts(raw, 512)
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


def test_float_aligned_and_unpadded_stacks_are_left_alone():
    rng = np.random.default_rng(1)
    raw, aligned = _stacks(rng, 2, 64, 96), _stacks(rng, 2, 64, 512)
    assert pad_fp4_experts(raw, 1) is raw
    assert pad_fp4_experts(aligned, 512) is aligned
    floats = ExpertParams(w13=np.ones((2, 64, 192), np.float32), w2=np.ones((2, 96, 64)))
    assert pad_fp4_experts(floats, 512) is floats
    for bad in (48, 0, -32):
        with pytest.raises(ValueError, match="positive multiple of 32"):
            pad_fp4_experts(raw, bad)


@pytest.mark.parametrize("implementation", ["reference", "dense"])
def test_padded_expert_gemms_equal_the_unpadded_bit_for_bit(implementation):
    """Each of the expert MLP's GEMMs at the tiny V4.1 model's D = 64, I = 32 over the
    stacks padded to the granule the table's "interpret" entry asks for, on exact
    arithmetic: activations are multiples of 1/8 up to 1 and FP4 weights multiples of 2**-5 up
    to 3, so every product is an integer multiple of 2**-8 below 2**10 and any sum of at most
    512 of them below 2**19 * 2**-8: exact in float32's 24 bits, in whatever order XLA adds.
    So a padded weight that were not exactly 0, or a column or row out of place, changes the
    bits; zero rows and columns cannot (0 * v = 0 and s + 0 = s exactly)."""
    granule = _granule(grouped_gemm=("interpret",))
    e, d, inter, rows = 4, 64, 32, 24
    rng = np.random.default_rng(2)
    raw = _stacks(rng, e, d, inter, jnp)
    padded = pad_fp4_experts(raw, granule)
    assert padded.w2.shape[-2] == granule
    sizes = jnp.asarray([7, 0, 12, 5], jnp.int32)                     # rows sorted by group

    def run(lhs, w):
        return np.asarray(gemm.grouped_matmul(jnp.asarray(lhs), w, sizes,
                                              implementation=implementation))
    x = _dyadic(rng, (rows, d))
    gate_up, padded_gate_up = run(x, raw.w13), run(x, padded.w13)     # [M, 2I], [M, 2I']
    assert np.abs(gate_up).max() > 0
    np.testing.assert_array_equal(padded_gate_up[:, :inter], gate_up[:, :inter])
    np.testing.assert_array_equal(padded_gate_up[:, granule:granule + inter], gate_up[:, inter:])
    pads = np.concatenate([padded_gate_up[:, inter:granule], padded_gate_up[:, granule + inter:]])
    assert not pads.any() and not np.signbit(pads).any()              # exactly +0.0
    hidden = _dyadic(rng, (rows, inter))
    # the padded hidden columns are 0 (silu(0) * 0); here any values: the rows of w2 they
    # meet must be exactly 0
    wide = np.concatenate([hidden, _dyadic(rng, (rows, granule - inter))], axis=1)
    down = run(hidden, raw.w2)
    np.testing.assert_array_equal(run(wide, padded.w2), down)


@pytest.mark.parametrize("t", [5, 16, 24])
def test_padded_expert_mlp_within_a_reordering_bound(t):
    """V4's routed experts over Fp4Blocks (the engine's CPU path: the reference grouped GEMM,
    SwiGLU, the weighted sum of K = 2 slots), padded vs unpadded. The gate/up products are
    exact (test above: dyadic x) and SwiGLU is elementwise, so both see the same hidden
    values; the padded hidden columns are exactly 0 and meet zero rows. What may differ is the
    order XLA's CPU dot adds the I = 32 real products in (its blocking follows the operands'
    shapes; measured here: bit for bit at these shapes, but only the bound is promised). Any two
    orders of n float32 additions differ by at most 2 * gamma_n * sum|terms|, gamma_n =
    n u / (1 - n u) (Higham, Accuracy and Stability, 3.1); with the slot weight's product and
    the K - 1 slot sums, n = I + K per output, against sum_k |r_k| sum_i |h_ki w_kij|."""
    granule = _granule(grouped_gemm=("interpret",))
    e, d, inter, k = 8, 64, 32, 2
    rng = np.random.default_rng(3)
    raw = _stacks(rng, e, d, inter, jnp)
    padded = pad_fp4_experts(raw, granule)
    x = _dyadic(rng, (t, d))
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    got, want = (np.asarray(routed_experts(jnp.asarray(x), jnp.asarray(experts),
                                           jnp.asarray(weights), w, LIMIT, ComputeConfig()))
                 for w in (padded, raw))
    # sum_k |r_k| sum_i |h_ki w_kij| in float64 from the decoded weights
    w13, w2 = (np.asarray(dequantize(w, jnp.float32), np.float64) for w in (raw.w13, raw.w2))
    gate_up = np.einsum("td,tkdi->tki", x.astype(np.float64), w13[experts])
    gate, up = np.minimum(gate_up[..., :inter], LIMIT), np.clip(gate_up[..., inter:], -LIMIT, LIMIT)
    hidden = gate / (1 + np.exp(-gate)) * up                              # [T, K, I]
    magnitude = np.einsum("tk,tki,tkij->tj", weights, np.abs(hidden), np.abs(w2[experts]))
    n = inter + k
    gamma = n * EPS32 / (1 - n * EPS32)
    assert np.abs(want).max() > 0.1
    assert (np.abs(got - want) <= 2 * gamma * magnitude).all(), np.abs(got - want).max()


def test_flash_stacks_pass_the_fp4_kernels_check_only_padded():
    """V4.1-Flash's shapes (one expert): the down projection's K = I = 2304 is refused by the
    FP4 kernel's operand check, the padded 2560 accepted, at the configs the path picks."""
    raw_cfg = json.loads(FLASH.read_text())
    d, inter = raw_cfg["hidden_size"], raw_cfg["moe_intermediate_size"]
    assert inter % K_GRANULE                       # the case this padding exists for
    raw = _stacks(np.random.default_rng(4), 1, d, inter)
    padded = pad_fp4_experts(raw, _granule(DeviceFacts("gpu", "9.0")))
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
