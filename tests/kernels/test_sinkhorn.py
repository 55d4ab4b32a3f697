"""The Sinkhorn kernel (GPU interpret mode on the CPU, compiled on a GPU) against a float64
numpy loop written from the formula and against the jnp reference, and its lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import abstract_gpu, on_hopper_or_newer
from pallas_kernels.sinkhorn import api, reference
from pallas_kernels.sinkhorn.mosaic_gpu import sinkhorn_entry_major
from tests.model.test_mhc import EPS, ITERS, numpy_sinkhorn

KERNEL = "mosaic_gpu" if on_hopper_or_newer() else "interpret"


def test_kernel_matches_the_formula_and_the_reference():
    """More tokens than one program (and a padded last one), some with logits large enough
    that the softmax needs its max."""
    logits = 3 * jax.random.normal(jax.random.key(0), (130, 4, 4), jnp.float32)
    logits = logits.at[:5].multiply(10.0)
    got = np.asarray(api.sinkhorn(logits, ITERS, EPS, impl=KERNEL))
    np.testing.assert_allclose(got, numpy_sinkhorn(np.asarray(logits, np.float64)),
                               rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got, np.asarray(reference.sinkhorn(logits, ITERS, EPS)),
                               rtol=1e-6, atol=1e-7)


def test_kernel_lowers_for_cuda():
    """Mosaic GPU's own checks (layouts, shared memory, TMA boxes) run at lowering."""
    fn = functools.partial(sinkhorn_entry_major, hc=4, iters=ITERS, eps=EPS)
    with abstract_gpu():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            jax.ShapeDtypeStruct((16, 256), jnp.float32))
    assert "mosaic_gpu" in exported.mlir_module()
