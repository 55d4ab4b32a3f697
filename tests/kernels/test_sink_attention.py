"""The decode/verify sink-attention kernel against its jnp reference (GPU interpret mode on the
CPU, compiled on a GPU), the reference against float64 numpy and the model's attention, and
the kernel's lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.model.attention import sink_attention as model_sink_attention
from deepinfer_jax.model.attention import sink_attention_parts
from pallas_kernels.common import NotSupported, abstract_gpu
from pallas_kernels.sink_attention import api, reference
from pallas_kernels.sink_attention.mosaic_gpu import AttentionConfig
from pallas_kernels.sink_attention.mosaic_gpu import sink_attention as kernel_one_wg
from pallas_kernels.sink_attention.mosaic_gpu_ws import WarpSpecializedConfig
from pallas_kernels.sink_attention.mosaic_gpu_ws import sink_attention as kernel_ws
from tests.kernels.which import KERNEL
from tests.tiers import covering

HD = 512


def visibility(pattern: str, tokens: int, rows: int, rng) -> np.ndarray:
    """Which rows each token sees: every one, a random subset, none (an empty set: only the
    sink), or the first few (fewer valid rows than selected, as with a short context)."""
    match pattern:
        case "all":
            return np.ones((tokens, rows), bool)
        case "random":
            return rng.random((tokens, rows)) < 0.6
        case "none":
            return np.zeros((tokens, rows), bool)
        case "first few":
            return np.arange(rows)[None, :] < rng.integers(1, 9, (tokens, 1))


def problem(tokens: int, heads: int, rows: int, pattern: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((tokens, heads, HD)) * 2, jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((tokens, rows, HD)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    return q, kv, jnp.asarray(visibility(pattern, tokens, rows, rng)), sinks


def close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * max(np.abs(ref).max(), 1e-3))


@pytest.mark.parametrize("rows, pattern", covering({"rows": [64, 100, 320],
                                                     "pattern": ["all", "random", "none", "first few"]}))
def test_kernel_matches_reference(rows, pattern):
    q, kv, visible, sinks = problem(3, 64, rows, pattern, seed=rows)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL),
          reference.sink_attention(q, kv, visible, sinks))


def test_one_warpgroup_kernel_column_blocks_of_64_and_many_tokens():
    """The one-warpgroup kernel's 64 and 128 output dims per program."""
    q, kv, visible, sinks = problem(70, 64, 64, "random", seed=5)
    ref = reference.sink_attention(q, kv, visible, sinks)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL,
                             config=AttentionConfig(block_d=128)), ref)
    close(api.sink_attention(q[:3], kv[:3], visible[:3], sinks, implementation=KERNEL,
                             config=AttentionConfig(block_d=64)), ref[:3])


def test_the_kernels_refuse_batches_under_min_tokens():
    """The size policy (config/options.py: 512 query tokens up on the H200, XLA's fused path
    below) reaches the kernel as min_tokens: under it the kernel refuses before it traces
    anything, and the next implementation runs."""
    q, kv, visible, sinks = problem(3, 64, 64, "random", seed=2)
    for impl in ("mosaic_gpu", "interpret"):
        with pytest.raises(NotSupported, match="min_tokens=4"):
            api.sink_attention(q, kv, visible, sinks, implementation=impl, min_tokens=4)
    np.testing.assert_array_equal(
        np.asarray(api.sink_attention(q, kv, visible, sinks, min_tokens=4,
                                      implementation=("mosaic_gpu", "reference")), np.float32),
        np.asarray(reference.sink_attention(q, kv, visible, sinks), np.float32))


def test_a_tokens_result_does_not_follow_its_batch():
    """Batch-invariant mode runs the kernel at every batch size (config/options.py): its
    default config must not change with the tokens, and a token's output must be bitwise the
    one it gets alone."""
    assert all(api.default_config(t) == api.default_config(1) for t in (16, 64, 8192))
    assert api.default_config(1).num_splits == 1
    q, kv, visible, sinks = problem(5, 64, 100, "random", seed=7)
    batched = np.asarray(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL),
                         np.float32)
    for t in (0, 3):
        alone = api.sink_attention(q[t:t + 1], kv[t:t + 1], visible[t:t + 1], sinks,
                                   implementation=KERNEL)
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], batched[t])


@pytest.mark.parametrize("splits, pattern", covering({"splits": [2, 4],
                                                       "pattern": ["random", "first few", "none"]}))
def test_rows_split_over_programs(splits, pattern):
    """Flash-decoding: a token's rows in `splits` ranges, merged after. "first few" leaves
    the later ranges with no visible row, "none" every range (only the sink's term)."""
    q, kv, visible, sinks = problem(2, 64, 200, pattern, seed=splits)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL,
                             config=AttentionConfig(block_d=64, num_splits=splits)),
          reference.sink_attention(q, kv, visible, sinks))


@pytest.mark.parametrize("shape, pattern, split_scores", covering(
    {"shape": {"100-1": (100, 1), "300-2": (300, 2)},
     "pattern": ["all", "random", "none", "first few"], "split_scores": [False, True]}))
def test_warp_specialized_kernel_matches_reference(shape, pattern, split_scores):
    """One program per token (or row range) for all 512 dims, two warpgroups sharing each
    row block: "first few" with 2 ranges leaves the second with no visible row, "none" both.
    With split_scores each warpgroup scores half of a block's rows and they exchange maxima
    and P: "first few" leaves a warpgroup's half with no visible row in every block."""
    rows, splits = shape
    q, kv, visible, sinks = problem(3, 64, rows, pattern, seed=rows + splits)
    config = WarpSpecializedConfig(num_splits=splits, split_scores=split_scores)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL, config=config),
          reference.sink_attention(q, kv, visible, sinks))


@pytest.mark.parametrize("pattern", ["none", "first few"])
def test_warp_specialized_ping_pong(pattern):
    """The warpgroups taking turns on the tensor cores (a barrier both reach twice a block,
    one starting a turn behind): the same result, empty ranges included."""
    q, kv, visible, sinks = problem(2, 64, 300, pattern, seed=11)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL,
                             config=WarpSpecializedConfig(num_splits=2, ping_pong=True,
                                                          split_scores=False)),
          reference.sink_attention(q, kv, visible, sinks))


@pytest.mark.parametrize("pattern", ["random", "first few"])
def test_split_scores_in_32_row_blocks_four_in_flight(pattern):
    """Scores split over the warpgroups in 16-row halves, 4 blocks in the pipeline: 300 rows
    pad to 320 (10 blocks), the exchanges' slots alternating over an even and an odd count."""
    q, kv, visible, sinks = problem(2, 64, 300, pattern, seed=13)
    config = WarpSpecializedConfig(block_r=32, max_concurrent_steps=4, split_scores=True)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL, config=config),
          reference.sink_attention(q, kv, visible, sinks))


@pytest.mark.parametrize("heads", [16, 128])
def test_head_counts_other_than_64(heads):
    q, kv, visible, sinks = problem(2, heads, 64, "random", seed=heads)
    close(api.sink_attention(q, kv, visible, sinks, implementation=KERNEL),
          reference.sink_attention(q, kv, visible, sinks))


def test_reference_against_float64_and_the_model():
    q, kv, visible, sinks = problem(2, 8, 40, "random", seed=9)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    logits = np.einsum("thd,trd->thr", f64(q), f64(kv)) / np.sqrt(HD)
    logits = np.where(np.asarray(visible)[:, None], logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(f64(sinks)[None, :, None], (2, 8, 1))], -1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    expected = np.einsum("thr,trd->thd", probs[..., :-1], f64(kv))
    out = reference.sink_attention(q, kv, visible, sinks)
    np.testing.assert_allclose(f64(out), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
    model = model_sink_attention(q[:, None], kv, visible[:, None], sinks, ComputeConfig())[:, 0]
    if jax.default_backend() == "cpu":    # the same jnp ops in the same order: the same bits
        np.testing.assert_array_equal(np.asarray(model, np.float32), np.asarray(out, np.float32))
    else:   # a GPU fuses the two programs apart (an H200: 1 element of 8192 a bf16 step off)
        np.testing.assert_allclose(np.asarray(model, np.float32), np.asarray(out, np.float32),
                                   rtol=1e-2, atol=0)


@pytest.mark.parametrize("warp_specialized", [False, True, "split scores"])
@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_lowers_for_cuda(splits, warp_specialized):
    """Mosaic GPU's own checks (layouts, wgmma shapes, shared memory, contiguous copies) run
    at lowering."""
    q, kv, visible, sinks = problem(2, 64, 128, "random")
    bias = jnp.where(visible, 0.0, -jnp.inf).astype(jnp.float32)
    if warp_specialized:
        kernel, config = kernel_ws, WarpSpecializedConfig(
            num_splits=splits, split_scores=warp_specialized == "split scores")
    else:
        kernel, config = kernel_one_wg, AttentionConfig(block_d=64 if splits > 1 else 128,
                                                        num_splits=splits)
    with abstract_gpu():
        exported = jax.export.export(jax.jit(functools.partial(kernel, config=config)),
                                     platforms=["cuda"])(q, kv, bias, sinks)
    assert "mosaic_gpu" in exported.mlir_module()


def test_the_models_step_attention_dispatches_to_the_kernel():
    """The model's one-query-per-token attention over two row sets (what the engine's step
    runs) takes the kernel its ComputeConfig names, and equals the jnp path within bf16
    tolerance."""
    q, kv, visible, sinks = problem(2, 64, 64, "random", seed=4)
    parts, seen = (kv[:, :24], kv[:, 24:]), (visible[:, :24], visible[:, 24:])
    on_kernel = ComputeConfig(kernels=KernelChoices(sink_attention=(KERNEL,)))

    def attend(compute):
        return lambda q, *a: sink_attention_parts(q, a[:2], a[2:], sinks, compute)

    jaxpr = str(jax.make_jaxpr(attend(on_kernel))(q, *parts, *seen))
    assert any(mark in jaxpr for mark in ("Ref<smem>", "pallas_call", "mosaic"))
    close(attend(on_kernel)(q, *parts, *seen),
          model_sink_attention(q[:, None], kv, visible[:, None], sinks, ComputeConfig())[:, 0])


def test_configs_that_overflow_shared_memory_are_refused():
    """A split program's f32 output tile of 128 dims, with q and two row blocks in flight,
    exceeds an SM90 program's shared memory: refused up front (the dispatch then falls back
    to the reference) instead of failing to compile on the GPU."""
    too_big = AttentionConfig(block_d=128, num_splits=2)
    assert too_big.smem_bytes(HD) > 232448 >= AttentionConfig().smem_bytes(HD)
    q, kv, visible, sinks = problem(2, 64, 128, "random")
    with pytest.raises(ValueError, match="shared memory"):
        too_big.check(64, 128, HD)
    with pytest.raises(NotSupported):
        api.sink_attention(q, kv, visible, sinks, implementation=KERNEL, config=too_big)
    close(api.sink_attention(q, kv, visible, sinks, implementation=(KERNEL, "reference"),
                             config=too_big), reference.sink_attention(q, kv, visible, sinks))
