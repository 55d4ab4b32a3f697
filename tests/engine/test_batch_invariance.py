"""Batch-invariant mode: a request's per-step logprobs do not depend on what it is batched
with, on chunk boundaries, on the loop, or on a cold vs warm engine -- bitwise, in bf16 (where
reduction order shows). The default mode does differ (so the test can fail)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.engine.core import UnsupportedModeError, require_batch_invariant_support
from tests.conftest import REPO

# Two buckets: a request alone decodes in the 16-token step, in a group of 32 in the 128-token
# one (the widest apart the engine has); test_small_buckets_and_chunks adds 1, 4 and 32.
ENGINE = dict(max_num_seqs=32, max_model_len=640, max_num_batched_tokens=128,
              token_buckets=(16, 128), page_size=64, show_progress=False)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model():
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    return deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))


@pytest.fixture(scope="module")
def prompts():
    # 34: groups of 8, and two groups of 32 (prompts 0-31 and 2-33) that overlap
    rng = np.random.default_rng(0)
    return [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(5, 300, size=34)]


def logprobs(outputs) -> list[np.ndarray]:
    return [np.array([lp.logprob for lp in o.logprobs], np.float32) for o in outputs]


def in_groups(llm, prompts, size) -> list[np.ndarray]:
    """Each prompt run inside a batch of `size` (the last group overlaps the one before)."""
    result = [None] * len(prompts)
    starts = list(range(0, len(prompts) - size + 1, size))
    if starts[-1] + size < len(prompts):
        starts.append(len(prompts) - size)
    for start in starts:
        for i, lp in enumerate(logprobs(llm.generate(prompts[start: start + size], PARAMS,
                                                     use_tqdm=False))):
            result[start + i] = lp
    return result


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def invariant(model):
    return deepinfer_jax.LLM(model, batch_invariant=True, **ENGINE)


@pytest.fixture(scope="module")
def alone(invariant, prompts):
    # the engine's very first call (cold), one request at a time
    return [logprobs(invariant.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]


def test_with_7_and_31_others(invariant, prompts, alone):
    assert same(in_groups(invariant, prompts, 8), alone)
    assert same(in_groups(invariant, prompts, 32), alone)


# Three tests, not one: a GPU run stopped at its time limit shows which failed only in
# pytest's progress line (session 51's failed one of these checks, it could not tell which).
def test_small_buckets_and_chunks(model, prompts, alone):
    # buckets down to one token: the batch's last rows decode in steps of 1 and 4 rows,
    # where `alone` ran each in a bucket of 16
    small_chunks = deepinfer_jax.LLM(model, batch_invariant=True, **{
        **ENGINE, "max_num_batched_tokens": 32, "token_buckets": (1, 4, 32)})
    assert same(logprobs(small_chunks.generate(prompts, PARAMS, use_tqdm=False)), alone)


def test_sync_loop_on_fewer_slots(model, prompts, alone):
    # the synchronous loop, on a state of 8 slots instead of 32: the slot count shapes the
    # state and the rows of the work over a step's sequences (invariant.per_sequence)
    sync = deepinfer_jax.LLM(model, batch_invariant=True, async_scheduling=False,
                             **{**ENGINE, "max_num_seqs": 8})
    assert same(logprobs(sync.generate(prompts, PARAMS, use_tqdm=False)), alone)


def test_warm_call(invariant, prompts, alone):
    warm = [logprobs(invariant.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]
    assert same(warm, alone)


def test_the_default_mode_is_not_invariant(model, prompts):
    """The control: without the mode, bf16 logprobs move with the batch."""
    llm = deepinfer_jax.LLM(model, batch_invariant=False, **ENGINE)
    single = [logprobs(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts[:8]]
    assert not same(in_groups(llm, prompts[:8], 8), single)


def test_mode_is_reported_and_gated(invariant, monkeypatch):
    [out] = invariant.generate([[3, 4]], PARAMS, use_tqdm=False)
    assert out.batch_invariant
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert deepinfer_jax.EngineConfig().batch_invariant
    with pytest.raises(UnsupportedModeError, match="npu"):
        require_batch_invariant_support("npu")


@pytest.mark.oracle
def test_invariant_mode_computes_the_same_model(workload):
    """The tiled path is the same math: float32, it reproduces HF greedy outputs too."""
    from tests.conftest import oracle_case
    from tests.engine.conftest import ENGINE as HF_ENGINE
    from tests.engine.test_engine_vs_hf import check_outputs, sampling

    llm = deepinfer_jax.LLM(oracle_case("tiny-mixed").model, batch_invariant=True, **HF_ENGINE)
    check_outputs(llm.generate(workload.prompts, sampling(workload), use_tqdm=False), workload)


# Dimensions the Pallas kernels tile (head_dim a multiple of 128, hidden and expert width of
# 64, the indexer's 64 heads of 64): the step runs the grouped GEMM for the experts, the
# invariant dense GEMM for the projections, the sink attention and the indexer's scores;
# compiled on a GPU, interpreted on the CPU.
KERNEL_CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json").replace(
    hidden_size=128, head_dim=128, moe_intermediate_size=64, num_mtp_layers=0,
    index_n_heads=64, index_head_dim=64)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="GPU: interpreted on the CPU, this "
                    "engine takes over 15 minutes (test_kernels_in_engine, in `make test-all`, "
                    "runs the kernels there)")
@pytest.mark.parametrize("split_k", [False, True], ids=["whole-k", "split-k"])
def test_rows_stay_invariant_on_the_kernels(monkeypatch, split_k):
    from pallas_kernels.grouped_gemm import api as gemm
    from pallas_kernels.grouped_gemm import invariant as gemm_invariant
    from pallas_kernels.indexer.mosaic_gpu import HEADS as INDEXER_HEADS
    from pallas_kernels.sink_attention import api as attention

    monkeypatch.setenv("DEEPINFER_KERNELS", "mosaic_gpu")
    inter, hidden = KERNEL_CFG.moe_intermediate_size, KERNEL_CFG.hidden_size
    if split_k:     # the dense GEMM's K in ranges (invariant_split_k), small enough here
        monkeypatch.setattr(gemm_invariant, "MIN_SPLIT_K", 64)
        assert gemm_invariant.dense_invariant_config(64, hidden, hidden).split_k > 1
    # the kernels take these shapes (else they would fall through to the jnp paths)
    q = jnp.zeros((1, KERNEL_CFG.num_heads, KERNEL_CFG.head_dim), jnp.bfloat16)
    assert attention.kernel_fits(q, q, attention.default_config(1))
    assert KERNEL_CFG.index_n_heads == INDEXER_HEADS and KERNEL_CFG.index_head_dim % 64 == 0
    assert gemm.kernel_fits(hidden, inter, gemm.default_config(16, inter, swiglu=True), False)
    assert gemm.kernel_fits(inter, hidden, gemm.default_config(16, hidden), False)
    assert gemm.kernel_fits(hidden, hidden, gemm_invariant.dense_invariant_config(64, hidden),
                            False)
    model = deepinfer_jax.Model(KERNEL_CFG, deepinfer_jax.random_params(KERNEL_CFG, 3,
                                                                        jnp.bfloat16))
    llm = deepinfer_jax.LLM(model, batch_invariant=True, max_num_seqs=8, max_model_len=320,
                            max_num_batched_tokens=64, token_buckets=(16, 64), page_size=64,
                            show_progress=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(5, 200, size=8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    alone = [logprobs(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert same(logprobs(llm.generate(prompts, params, use_tqdm=False)), alone)


@pytest.mark.slow       # the GPU formulation on the CPU; `invariance-tests` runs it on a GPU
def test_untiled_segments_are_the_same_computation():
    """The GPU formulation runs the per-token segments untiled (each matmul-like op invariant
    by itself, fewer loops in the step as lowered for CUDA); they compute what the CPU
    formulation's row tiles do (float32, so to rounding: tokens equal, logprobs close).
    Whether rows stay bitwise invariant that way is the GPU's test above."""
    from deepinfer_jax.device.step import step
    from deepinfer_jax.engine.transfer import Wire
    from deepinfer_jax.host.decision import ScheduleDecision
    from deepinfer_jax.host.plan_builder import build_plan

    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json").replace(
        num_mtp_layers=0)
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.float32))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (7, 90, 150)]
    results, loops = {}, {}
    for formulation in ("cpu", "gpu"):
        llm = deepinfer_jax.LLM(model, batch_invariant=True, max_num_seqs=4, max_model_len=256,
                                max_num_batched_tokens=64, token_buckets=(64,), page_size=64,
                                show_progress=False, step_formulation=formulation)
        engine = llm.engine
        assert engine.step_cfg.compute.tile_segments == (formulation == "cpu")
        wire = Wire.of(build_plan(ScheduleDecision(()), 64, engine.step_cfg))
        traced = jax.jit(lambda p, s, b, engine=engine, wire=wire: step(
            p, s, wire.unpack_device(b), cfg=engine.cfg, step_cfg=engine.step_cfg, truncation=False))
        module = jax.export.export(traced, platforms=["cuda"])(
            engine.params, engine.state, wire.spec()).mlir_module()
        loops[formulation] = module.count("stablehlo.while")
        out = llm.generate(prompts, PARAMS, use_tqdm=False)
        results[formulation] = ([o.token_ids for o in out], logprobs(out))
    assert loops["gpu"] < loops["cpu"]
    assert results["gpu"][0] == results["cpu"][0]
    # float32 sums in other orders: on a GPU, XLA's dots also take shape-dependent algorithms
    # (an H100: 1.8e-4 apart at -4.37); a wrong computation is off by far more
    np.testing.assert_allclose(np.concatenate(results["gpu"][1]),
                               np.concatenate(results["cpu"][1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", ["tiny-mixed", "kernel dims"])
def test_the_gpu_step_lowers_with_every_kernel(monkeypatch, cfg):
    """The batch-invariant step as a GPU compiles it, every Pallas kernel forced on, lowered
    for CUDA on the CPU: Mosaic GPU's layout and tiling checks run at lowering, so a shape the
    kernels cannot take that still reaches them fails here rather than on the H200 (a tiny
    router's 8 columns did)."""
    from deepinfer_jax.config.engine import EngineConfig
    from deepinfer_jax.device.step import step
    from deepinfer_jax.engine.transfer import Wire
    from deepinfer_jax.host.decision import ScheduleDecision
    from deepinfer_jax.host.plan_builder import build_plan
    from deepinfer_jax.model.state import init_state
    from pallas_kernels.common import abstract_gpu

    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "gpu")
    monkeypatch.setenv("DEEPINFER_KERNELS", "mosaic_gpu")      # read when the step is traced
    config = KERNEL_CFG if cfg == "kernel dims" else read_model_config(
        REPO / "configs/tiny/tiny-mixed.json").replace(num_mtp_layers=0)
    params = deepinfer_jax.random_params(config, 3, jnp.bfloat16)
    step_cfg = EngineConfig(batch_invariant=True, max_num_seqs=4, max_model_len=256,
                            max_num_batched_tokens=64, token_buckets=(64,), page_size=64
                            ).resolve(config)          # no engine: nothing compiled for the CPU
    wire = Wire.of(build_plan(ScheduleDecision(()), 64, step_cfg))
    traced = jax.jit(lambda p, s, b: step(p, s, wire.unpack_device(b), cfg=config, step_cfg=step_cfg))
    with abstract_gpu():
        module = jax.export.export(traced, platforms=["cuda"])(
            params, init_state(config, step_cfg, jnp.bfloat16), wire.spec()).mlir_module()
    assert "mosaic_gpu" in module


@pytest.mark.parametrize("bucket, quantized", [(16, False), (1024, False), (1024, True)],
                         ids=["decode", "prefill", "prefill-release-formats"])
def test_the_v4_flash_step_runs_no_row_tiles_on_a_gpu(bucket, quantized):
    """At V4-Flash's dimensions every matmul-like op of the invariant step takes a kernel
    (the mHC mixes the dense GEMM's, in bf16 parts) and the per-token code runs untiled, so
    the step as lowered for CUDA has no loop over row tiles: each would be launches per
    iteration (the mHC mixes, hc_post and the compressed rows' pooling ran 128 such
    iterations a layer in the 8k prefill before)."""
    from bench.step_ops import census, lower

    loops = census(lower(2, bucket, quantized=quantized, batch_invariant=True), {"while"}, 3)
    assert not loops, loops
