"""The Sinkhorn kernel (GPU interpret mode on the CPU, compiled on a GPU) against a float64
numpy loop written from the formula and against the jnp reference, and its lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import abstract_gpu
from pallas_kernels.sinkhorn import api, reference
from pallas_kernels.sinkhorn.mosaic_gpu import sinkhorn_entry_major
from tests.kernels.which import KERNEL
from tests.model.test_mhc import EPS, ITERS, numpy_sinkhorn


def test_kernel_matches_the_formula_and_the_reference():
    """More tokens than one program (and a padded last one), some with logits large enough
    that the softmax needs its max."""
    logits = 3 * jax.random.normal(jax.random.key(0), (130, 4, 4), jnp.float32)
    logits = logits.at[:5].multiply(10.0)
    got = np.asarray(api.sinkhorn(logits, ITERS, EPS, implementation=KERNEL))
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


def test_a_tokens_result_does_not_depend_on_its_batch():
    """Batch-invariant mode runs the kernel (model/mhc.py): the same logits give the same bits
    whatever their place, neighbours and program (the last program holds 2 tokens and padding).
    One call: each interpret-mode call compiles the kernel anew (~15 s here)."""
    logits = 3 * jax.random.normal(jax.random.key(1), (130, 4, 4), jnp.float32)
    logits = logits.at[129].set(logits[5]).at[77].set(logits[0])
    out = np.asarray(api.sinkhorn(logits, ITERS, EPS, implementation=KERNEL))
    np.testing.assert_array_equal(out[129], out[5])
    np.testing.assert_array_equal(out[77], out[0])
    assert not np.array_equal(out[0], out[5])          # different logits, different results


def test_batch_invariant_mhc_runs_the_kernel_only_where_it_runs():
    """hc_pre in batch-invariant mode, GPU formulation: the kernel when it is chosen, else the
    loop (the unrolled jnp form is not proven invariant)."""
    from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
    from deepinfer_jax.model import mhc
    from deepinfer_jax.model.params import HyperConnectionParams

    hc, dim = 4, 8
    p = HyperConnectionParams(fn=jnp.zeros((hc * dim, (2 + hc) * hc)),
                              base=jnp.zeros(((2 + hc) * hc,)), scale=jnp.ones((3,)))
    streams = jnp.ones((3, hc, dim), jnp.bfloat16)
    for impl, kernel in ((KERNEL, True), ("reference", False)):
        compute = ComputeConfig(formulation="gpu", kernels=KernelChoices(sinkhorn=(impl,)),
                                batch_invariant=True)
        assert mhc.sinkhorn_implementations(compute) == ((impl,) if kernel else ()) + ("loop",)
        jaxpr = str(jax.make_jaxpr(lambda s, compute=compute: mhc.hc_pre(
            s, p, hc_eps=EPS, norm_eps=1e-6, sinkhorn_iters=ITERS, compute=compute))(streams))
        # the kernel: its shared-memory buffers (interpreted) or its call (compiled)
        assert any(mark in jaxpr for mark in ("Ref<smem>", "pallas_call", "mosaic")) == kernel
