"""Prefix caching in the engine: a warm cache, and a preempted-and-resumed sequence, give the
same tokens and per-token logprobs as a cold run, bitwise (batch-invariant mode, bf16); the
tokens the model runs on a hit are only those after the reused prefix, counted."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from bench.lib.admission import admit_first_chunks
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.hf import read_model_config
from tests.conftest import REPO

BUDGET, BLOCK = 128, 64
ENGINE = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=BUDGET,
              token_buckets=(32, BUDGET), page_size=BLOCK, show_progress=False,
              batch_invariant=True)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
TINY = REPO / "models" / "deepinfer-tiny-v4"      # the shipped trained model


@pytest.fixture(scope="module")
def model():
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    return deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))


@pytest.fixture(scope="module")
def cold(model):
    return deepinfer_jax.LLM(model, **ENGINE)


def run_alone(llm, prompts, params):
    return [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]


def assert_same(outputs, reference):
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids
        np.testing.assert_array_equal([lp.logprob for lp in out.logprobs],
                                      [lp.logprob for lp in ref.logprobs])


def tokens(rng, n):
    return rng.integers(2, 512, size=n).tolist()


def test_warm_cache_equals_cold_run_bitwise(model, cold):
    rng = np.random.default_rng(0)
    base = tokens(rng, 500)
    first = base                                   # its decode crosses block 7's end (512)
    first_params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)
    first_out = cold.generate([first], first_params, use_tqdm=False)[0]
    penalized = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1,
                               repetition_penalty=1.3, presence_penalty=0.5)
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, temperature=0.8, seed=5)
    prompts = [base + tokens(rng, 10),
               base + tokens(rng, 70),
               base[:300],
               base,
               tokens(rng, 200),
               # a chat's next turn: the first answer is now prompt (penalties recounted)
               first + first_out.token_ids + tokens(rng, 20),
               base + tokens(rng, 40)]
    params = [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY, penalized, sampled]
    reference = run_alone(cold, prompts, params)

    warm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **ENGINE)
    assert_same([warm.generate([first], first_params, use_tqdm=False)[0]], [first_out])
    assert_same(warm.generate(prompts, params, use_tqdm=False), reference)   # one batch
    stats = warm.prefix_cache_stats
    assert stats.hits >= 5 and stats.hit_tokens >= 5 * 256
    assert_same(warm.generate(prompts, params, use_tqdm=False), reference)   # all cached now
    assert warm.prefix_cache_stats.hits == stats.hits + len(prompts)
    assert not cold.prefix_cache_stats


def test_a_hit_computes_only_what_follows_the_reused_prefix(model):
    llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **ENGINE)
    rng = np.random.default_rng(1)
    first = tokens(rng, 600)
    llm.generate([first], GREEDY, use_tqdm=False)
    fed, stats = llm.engine.stats.tokens, llm.prefix_cache_stats
    second = first + tokens(rng, 30)
    llm.generate([second], GREEDY, use_tqdm=False)
    fed = llm.engine.stats.tokens - fed
    hit = llm.prefix_cache_stats.hit_tokens - stats.hit_tokens
    # prefill chunks of 128 end on block ends, so the snapshot closest to 600 is at 512; the
    # block 512..576 is cached but has none, and 576..600 never filled a block
    assert hit == 512
    assert llm.prefix_cache_stats.replayed_tokens - stats.replayed_tokens == 576 - 512
    assert fed == len(second) - hit + GREEDY.max_tokens - 1
    assert fed <= 30 + BUDGET + GREEDY.max_tokens       # bounded by one chunk, not the prompt


def test_preempted_sequences_resume_from_the_cache_exactly(model, cold):
    rng = np.random.default_rng(2)
    prompts = [tokens(rng, n) for n in (250, 230, 270, 240)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1)
    reference = run_alone(cold, prompts, [params] * 4)
    cold_fed = sum(len(p) + params.max_tokens - 1 for p in prompts)

    # 4 sequences of ~5 pages each, 16 pages: decoding runs out of pages and preempts
    tight = deepinfer_jax.LLM(model, enable_prefix_caching=True, **{**ENGINE, "num_pages": 16})
    admit_first_chunks(tight)        # admission that overcommits the cache, so that it preempts
    assert_same(tight.generate(prompts, params, use_tqdm=False), reference)
    preemptions = tight.engine.scheduler.num_preemptions
    stats = tight.prefix_cache_stats
    assert preemptions > 0 and stats.hit_tokens > 0
    # a resumed sequence recomputes at most the tokens since its last snapshot: less than a
    # block while decoding (a snapshot at every block end), less than a chunk in prefill
    extra = tight.engine.stats.tokens - cold_fed
    assert 0 < extra <= preemptions * (BUDGET + BLOCK)
    assert stats.replayed_tokens == extra        # every token fed twice is counted as replayed


# a combination (prefix caching x MTP speculation), 50-80 s on CI's machine: the slow tier
@pytest.mark.slow
def test_with_mtp_speculation_a_warm_cache_equals_a_cold_run():
    """Prefix caching with MTP speculation on the shipped trained model (whose drafts get
    accepted): the snapshots then hold the MTP block's window too. Warm speculative runs give
    the same tokens and logprobs as cold speculative runs (speculative against plain decoding:
    test_speculative.py), and accept exactly as many drafts: the MTP state came back bit for
    bit (the prompts end less than a window (64) after the hit, so the first drafts read the
    restored MTP rows, and an unrelated request runs in the slot before each). The third prompt
    shares the first 256 tokens but not the token after them, so its lookup falls back to the
    snapshot before."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "varlen": False}
    # decode and verify steps (a row and its 3 drafts) in a bucket of their own: the test's
    # dozen short generations padded to the prefill's 128 rows cost more than its compile
    engine = {**ENGINE, "token_buckets": (16, BUDGET)}
    cold_spec = deepinfer_jax.LLM(TINY, speculative_config=spec, **engine)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = cold_spec.tokenizer.encode(source)
    base, other = ids[:300], ids[1000:1100]
    prompts = [base[:256] + ids[256:266], base + ids[300:310], base[:256] + other[:10]]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    warm_spec = deepinfer_jax.LLM(TINY, speculative_config=spec, enable_prefix_caching=True,
                                  **engine)
    warm_spec.generate([base + ids[300:305]], params, use_tqdm=False)         # fills the cache
    for prompt, hit in zip(prompts, (256, 256, 128), strict=True):
        warm_spec.generate([other[:50]], params, use_tqdm=False)     # leaves its state in the slot
        accepted = cold_spec.spec_metrics.accepted, warm_spec.spec_metrics.accepted
        hits = warm_spec.prefix_cache_stats.hit_tokens
        out_cold = cold_spec.generate([prompt], params, use_tqdm=False)[0]
        out_warm = warm_spec.generate([prompt], params, use_tqdm=False)[0]
        assert_same([out_warm], [out_cold])
        assert warm_spec.prefix_cache_stats.hit_tokens - hits == hit
        assert (warm_spec.spec_metrics.accepted - accepted[1]
                == cold_spec.spec_metrics.accepted - accepted[0] > 0)
        # and the MTP window right after the prefill is the cold run's, bit for bit
        assert np.array_equal(*(mtp_window_after_prefill(llm, prompt, other[:50])
                                for llm in (cold_spec, warm_spec)))


def mtp_window_after_prefill(llm, prompt, unrelated) -> np.ndarray:
    llm.generate([unrelated], SamplingParams(max_tokens=4), use_tqdm=False)   # dirties the slot
    engine = llm.engine
    req = engine.add_request("probe", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while not req.generated:
        engine.step()
    for flight in engine._in_flight:    # the asynchronous loop: the next step's state (both runs')
        flight.output.result()
    window = np.asarray(engine.state.mtp.window[req.slot], np.float32)
    engine.abort("probe")
    while engine.has_unfinished():
        engine.step()
    return window
