"""The engine serves DeepSeek-V4.1 (issue 36): `LLM(path)` on the two oracle fixtures, with
continuous batching and chunked prefill, gives the reference's greedy continuations.

The three prompts of `reference.npz`, unpadded, go in as token ids with a 16-token step
budget: the 33- and 70-token prompts prefill in chunks while the 7-token one already decodes,
so steps mix prefill and decode rows. One token bucket, so each fixture compiles one step.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import deepinfer_jax
from bench.lib.admission import admit_first_chunks
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.memory_v41 import v41_page_bytes, v41_slot_bytes
from deepinfer_jax.engine import memory_plan
from deepinfer_jax.host.request import SamplingParams
from tests.model.v41_oracle import FIXTURES, assert_parted_only_after_rounding_boundaries

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

ENGINE = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, token_buckets=(16,),
              show_progress=False)


@functools.lru_cache(maxsize=2)
def _engine(folder):
    return deepinfer_jax.LLM(folder, **ENGINE)


def _reference(folder):
    ref = np.load(folder / "reference.npz")
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    return prompts, ref


def _greedy(steps: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0)


@functools.lru_cache(maxsize=2)
def _batched(folder):
    prompts, ref = _reference(folder)
    llm = _engine(folder)
    decisions, schedule = [], llm.engine.scheduler.schedule

    def recorded():
        decisions.append(schedule())
        return decisions[-1]

    llm.engine.scheduler.schedule = recorded
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            _greedy(ref["gen_tokens"].shape[1]), use_tqdm=False)
    finally:
        del llm.engine.scheduler.schedule
    return [o.outputs[0] for o in outs], decisions


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_v41_engine_greedy_tokens_match_the_reference(folder):
    _, ref = _reference(folder)
    outs, decisions = _batched(folder)
    np.testing.assert_array_equal([o.token_ids for o in outs], ref["gen_tokens"])
    # chunked prefill, and steps where a decoding row rides with a prefill chunk
    chunks = [s for d in decisions for s in d.seqs if s.start + s.num_tokens < len(s.request.prompt)]
    mixed = [d for d in decisions
             if {s.start >= len(s.request.prompt) for s in d.seqs} == {True, False}]
    assert chunks and mixed


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_v41_engine_logprobs_match_the_reference(folder):
    """The chosen tokens' logprobs within 1e-4 of the log-softmax of the reference's cached
    step (`gen_logits`) or of its cache-free recomputation (`gen_logits_nocache`): the two
    differ by isolated fake-quantization flips (the fixtures' README), and the paged step may
    land on either side of one, or part from both past a prompt's first rounding boundary
    (as tests/model/test_v41_paged.py allows)."""
    _, ref = _reference(folder)
    outs, _ = _batched(folder)
    got = np.array([[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
                    for o in outs])

    def chosen(logits):
        z = logits - logits.max(-1, keepdims=True)
        lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return np.take_along_axis(lsm, ref["gen_tokens"][..., None], -1)[..., 0]

    err = np.minimum(np.abs(got - chosen(ref["gen_logits"])),
                     np.abs(got - chosen(ref["gen_logits_nocache"])))
    # the logits at a prompt's last position choose its first generated token
    assert_parted_only_after_rounding_boundaries(folder, err, 1e-4, ref["lengths"] - 1)


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_v41_engine_one_at_a_time_gives_the_same_tokens(folder):
    prompts, ref = _reference(folder)
    llm = _engine(folder)
    for prompt, want in zip(prompts, ref["gen_tokens"], strict=True):
        out = llm.generate([prompt], _greedy(len(want)), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want.tolist()


def test_v41_engine_runs_synchronously():
    """The host hashes every fed token for Engram, so it must have read each sampled token
    before it plans the next step."""
    llm = _engine(FIXTURES[0])
    assert llm.step_config.engram_shape == (2, 4) and not llm.host_options.async_scheduling


@pytest.mark.parametrize("folder, why", [
    # fixture a declares one draft layer and DSpark fields (target layers [2, 4, 5])
    (FIXTURES[0], r"1 draft layer\(s\).*DSpark drafter \(blocks of 5 drafts.*\[2, 4, 5\]"),
    (FIXTURES[1], r"no draft layers \(num_nextn_predict_layers = 0\)"),
])
def test_v41_speculation_is_refused_naming_the_dspark_drafter(folder, why):
    """V4.1's draft layers are the DSpark drafter, not V4's MTP block, and no public reference
    implements it (config/family.py), so speculation is refused with the reason, before
    anything loads or compiles; the V4 speculative step is never run on a V4.1 model."""
    with pytest.raises(EngineConfigError, match="not supported for DeepSeek-V4.1: " + ".*" + why):
        deepinfer_jax.LLM(folder, **ENGINE,
                          speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_v41_memory_plan_counts_the_v41_state():
    """With the device's memory stated, the pool is planned with V4.1's state bytes
    (config/memory_v41.py), which are what the engine's state really holds. The Engram
    tables stay in host memory (the default): device weights are the params' bytes, which
    hold no table, the tables count as host memory, and the measured activations gain the
    plan's rows (an input, which XLA's count of temporaries leaves out): 16 tokens x 2
    layers x 4 columns x 32 float32."""
    llm = deepinfer_jax.LLM(FIXTURES[0], **ENGINE, device_memory_gib=1)
    plan, cfg, engine = llm.memory_plan, llm.model.config, llm.engine
    assert plan.page_bytes == v41_page_bytes(cfg, llm.step_config.page_size)
    assert plan.fixed_cache == llm.step_config.max_num_seqs * v41_slot_bytes(cfg)
    assert plan.pages == llm.step_config.num_pages == plan.full_reach_pages
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(llm.engine.state))
    assert held == plan.cache
    assert engine.params.engram_tables == ()
    assert plan.weights == memory_plan.weight_bytes(engine.params)
    assert plan.host_weights == (290 + 370) * 32 * 4
    measured = memory_plan.measured_activations(engine.params, cfg, engine.step_cfg, engine.host)
    assert plan.activations_measured
    assert plan.activations == memory_plan.with_slack(measured) + 16 * 2 * 4 * 32 * 4


def test_v41_structured_output_without_an_eos_fails_the_request_alone():
    """The fixtures name no EOS token, which grammars need: such a request fails with a
    request error, and the engine still serves the others."""
    llm = _engine(FIXTURES[0])
    prompts, _ = _reference(FIXTURES[0])
    bad, good = llm.generate([prompts[0], prompts[0]],
                             [SamplingParams(max_tokens=2, regex="a+"), _greedy(2)],
                             use_tqdm=False)
    assert bad.error is not None and "end-of-sequence" in str(bad.error)
    assert len(good.outputs[0].token_ids) == 2


def test_v41_weights_that_cannot_fit_fail_before_they_load(monkeypatch):
    from deepinfer_jax.api import jax_engine as llm_module  # the JAX backend's start-up
    from deepinfer_jax.config.errors import InsufficientMemoryError

    def never(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(llm_module, "load_v41", never)
    with pytest.raises(InsufficientMemoryError, match="weights of"):
        deepinfer_jax.LLM(FIXTURES[0], **ENGINE, device_memory_gib=1e-4)


@pytest.mark.parametrize("first_chunk_admission, tables", [(False, "host"), (True, "host"),
                                                           (True, "device")])
def test_v41_a_short_page_pool_gives_the_same_tokens(first_chunk_admission, tables):
    """Three pages of 64 positions for three sequences that need two each: requests wait for
    pages, or (admitted on their first chunk) are preempted and replayed, their Engram
    look-back rehashed from position 0; every continuation is still the reference's. With
    device tables the loop runs ahead and the step hashes, the replays included."""
    prompts, ref = _reference(FIXTURES[1])
    llm = deepinfer_jax.LLM(FIXTURES[1], **ENGINE, num_pages=3, engram_tables=tables)
    assert llm.host_options.async_scheduling == (tables == "device")
    if first_chunk_admission:
        admit_first_chunks(llm)
    outs = llm.generate(prompts, _greedy(ref["gen_tokens"].shape[1]), use_tqdm=False)
    np.testing.assert_array_equal([o.outputs[0].token_ids for o in outs], ref["gen_tokens"])
    assert (llm.engine.scheduler.num_preemptions > 0) == first_chunk_admission
