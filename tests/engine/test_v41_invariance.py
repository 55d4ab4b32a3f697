"""Batch-invariant mode for DeepSeek-V4.1 (issue 36): a request's tokens and logprobs are
bitwise the same alone, batched with other requests, and with its prompt chunked otherwise;
greedy, they are still the reference's (`gen_tokens` of the oracle fixtures).

The control: without the mode, another chunk budget (token bucket) moves the logprobs of the
same requests, so the comparison can fail."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.host.request import SamplingParams
from tests.model.v41_oracle import ENGINE_FEATURE_FIXTURES, FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

STEPS = 12


@functools.lru_cache(maxsize=4)
def _engine(folder, budget: int, invariant: bool):
    return deepinfer_jax.LLM(folder, max_num_seqs=8, max_model_len=96,
                             max_num_batched_tokens=budget, token_buckets=(budget,),
                             batch_invariant=invariant, show_progress=False)


def _prompts(folder):
    ref = np.load(folder / "reference.npz")
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    rng = np.random.default_rng(0)
    others = [rng.integers(1, ref["gen_logits"].shape[-1], size=n).tolist() for n in (5, 40, 23, 61)]
    return prompts, others, ref["gen_tokens"]


def _run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(o.token_ids, np.array([[x.logprob for x in lp.values()] for lp in o.logprobs]))
            for o in outs]


def _alone(llm, prompts):
    return [_run(llm, [p])[0] for p in prompts]


def _same(a, b) -> bool:
    return all(ta == tb and np.array_equal(la, lb) for (ta, la), (tb, lb) in zip(a, b, strict=True))


@pytest.mark.parametrize("folder", ENGINE_FEATURE_FIXTURES)
def test_v41_rows_do_not_depend_on_the_batch_or_the_chunks(folder):
    prompts, others, gen_tokens = _prompts(folder)
    small = _engine(folder, 16, True)
    alone = _alone(small, prompts)
    assert [t for t, _ in alone] == gen_tokens.tolist()
    # batched with four others (steps mix their prefill chunks and decodes with the target's)
    assert _same(_run(small, prompts + others)[:3], alone)
    # 64-token chunks (the 70-token prompt in two chunks instead of five), others first
    assert _same(_run(_engine(folder, 64, True), others[:2] + prompts)[2:], alone)
    assert all(o.batch_invariant for o in small.generate([prompts[0]], SamplingParams(max_tokens=1),
                                                         use_tqdm=False))


@pytest.mark.slow       # a second guard: test_batch_invariance.py's default-mode check stays in CI's tier
def test_v41_the_default_mode_moves_with_the_chunks():
    prompts, _, _ = _prompts(FIXTURES[0])
    small, large = _engine(FIXTURES[0], 16, False), _engine(FIXTURES[0], 64, False)
    assert not _same(_alone(small, prompts), _alone(large, prompts))


def test_v41_the_invariant_step_lowers_for_a_gpu(monkeypatch):
    """The GPU formulation of V4.1's batch-invariant step (its segments still in row tiles,
    the Pallas kernels asked for and falling through where the tiny shapes do not fit) lowers
    for CUDA on the CPU; its kernel-free jnp is what the CPU tests above run."""
    from deepinfer_jax.config.engine import EngineConfig
    from deepinfer_jax.device.step import step
    from deepinfer_jax.engine.transfer import Wire
    from deepinfer_jax.host.decision import ScheduleDecision
    from deepinfer_jax.host.plan_builder import build_plan
    from deepinfer_jax.model.family import model_family
    from pallas_kernels.common import abstract_gpu
    from tests.model.v41_oracle import case

    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "gpu")
    monkeypatch.setenv("DEEPINFER_KERNELS", "mosaic_gpu")
    cfg, params, _ = case(FIXTURES[0])
    loops = {}
    for invariant in (False, True):
        step_cfg = EngineConfig(batch_invariant=invariant, max_num_seqs=4, max_model_len=96,
                                max_num_batched_tokens=16, token_buckets=(16,)).resolve(cfg)
        assert step_cfg.compute.launch_bound
        wire = Wire.of(build_plan(ScheduleDecision(()), 16, step_cfg))
        state = model_family(cfg).init_state(cfg, step_cfg, jnp.float32)
        traced = jax.jit(lambda p, s, b, wire=wire, step_cfg=step_cfg: step(
            p, s, wire.unpack_device(b), cfg=cfg, step_cfg=step_cfg))
        with abstract_gpu():
            module = jax.export.export(traced, platforms=["cuda"])(params, state,
                                                                   wire.spec()).mlir_module()
        loops[invariant] = module.count("stablehlo.while")
    assert loops[True] > loops[False]        # the row tiles' loops
