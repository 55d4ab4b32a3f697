"""The FP8 projections on the GEMM kernel (model/invariant.py fp8_linear, grouped_linear: equal
groups, K split at decode sizes) against the dequantized weight's jnp product. Interpreted on
the CPU, compiled on an SM90 GPU."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.model.invariant import fp8_linear, grouped_linear
from pallas_kernels.grouped_gemm import mosaic_gpu
from pallas_kernels.quantized import Fp8Blocks, dequantize
from tests.kernels.gemm_cases import close
from tests.kernels.which import KERNEL

ON_KERNEL = ComputeConfig(kernels=KernelChoices(grouped_gemm=(KERNEL,)))


@pytest.fixture
def kernel_configs(monkeypatch) -> list:
    """The configs the GEMM kernel ran with (fp8_linear falls back to the dequantized
    weight where no kernel takes it: the tests assert it did not)."""
    seen = []
    kernel = mosaic_gpu.tiled_group_matmul

    def spy(*args, config, **kwargs):
        seen.append(config)
        return kernel(*args, config=config, **kwargs)

    monkeypatch.setattr(mosaic_gpu, "tiled_group_matmul", spy)
    return seen


def fp8_weight(rng, shape) -> Fp8Blocks:
    """E4M3 codes with a different scale per 128 x 128 block."""
    *lead, k, n = shape
    scale = rng.uniform(0.01, 0.05, (*lead, k // 128, n // 128)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, -2), 128, -1)
    codes = (rng.standard_normal(shape) / 8 / full).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Blocks(jnp.asarray(codes), jnp.asarray(scale))


@pytest.mark.parametrize("lead", [(3,), (2, 9)], ids=["decode rows", "batch x tokens"])
def test_fp8_linear_on_the_kernel_matches_the_dequantized_product(lead, kernel_configs):
    rng = np.random.default_rng(len(lead))
    w = fp8_weight(rng, (512, 256))                 # K split: ranges read their own scales
    x = jnp.asarray(rng.standard_normal((*lead, 512)), jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(dequantize(w, jnp.float32))
    out = fp8_linear(x, w, ON_KERNEL)
    assert out.shape == (*lead, 256) and out.dtype == jnp.bfloat16
    assert [c.split_k for c in kernel_configs] == [2]      # 2 column blocks: K in 2 ranges
    close(out, want)


def test_grouped_linear_on_the_kernel_matches_the_dequantized_product(kernel_configs):
    """[..., G, K] @ [G, K, N]: each group's rows against its own weight."""
    rng = np.random.default_rng(5)
    w = fp8_weight(rng, (4, 256, 128))
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 256)), jnp.bfloat16)
    want = np.einsum("btgk,gkn->btgn", np.asarray(x, np.float32),
                     np.asarray(dequantize(w, jnp.float32)))
    out = grouped_linear(x, w, ON_KERNEL)
    assert out.shape == (2, 3, 4, 128) and len(kernel_configs) == 1
    close(out, want)
