"""Bounded prefix replay for DeepSeek-V4.1 (issues 36 and 40), as tests/engine/
test_prefix_replay.py checks it for V4: a hit keeps the cached pages (the KV sources' FP4
entries and indexer keys) and no snapshot of the slot at all, and replays the prefix's last
swa_replay_tokens tokens to rebuild every layer's FP8 window. CSA2's groups do not overlap,
so at a block end no open-group tail holds a prefix token a later entry pools, and the
consumer layers read their source's pages: the replay writes windows only.

A replay of num_layers * (sliding_window - 1) tokens, the windows' reach through the layers,
equals the cold run bitwise (batch-invariant mode, both oracle fixtures); a shorter one is
approximate, and never rewrites the cached entries other requests share."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.family import facts_of
from deepinfer_jax.config.memory_v41 import v41_slot_bytes
from deepinfer_jax.device.tier_copies import gather_page
from deepinfer_jax.host.request import SamplingParams
from tests.model.v41_oracle import ENGINE_FEATURE_FIXTURES, FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

BLOCK = 16
ENGINE = dict(max_num_seqs=4, max_model_len=160, max_num_batched_tokens=16, token_buckets=(16,),
              page_size=BLOCK, batch_invariant=True, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
# num_hidden_layers * (sliding_window - 1): fixture a 6 * 7, fixture b 5 * 15
REACH = {FIXTURES[0]: 42, FIXTURES[1]: 75}


@functools.lru_cache(maxsize=2)
def prompts(folder):
    """A 110-token base (a reference prompt and random tokens: 6 cached blocks) and a target
    that extends it."""
    ref = np.load(folder / "reference.npz")
    rng = np.random.default_rng(0)
    vocab = ref["gen_logits"].shape[-1]
    base = ref["input_ids"][2, -70:].tolist() + rng.integers(1, vocab, size=40).tolist()
    return base, base + rng.integers(1, vocab, size=9).tolist()


@functools.lru_cache(maxsize=2)
def cold(folder):
    return run_alone(deepinfer_jax.LLM(folder, **ENGINE), prompts(folder)[1])


def run_alone(llm, prompt):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]


def logprobs(out):
    return [sorted((t, x.logprob) for t, x in lp.items()) for lp in out.logprobs]


def bounded(folder, replay):
    """An engine in bounded mode that cached the base prompt."""
    llm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, prefix_replay="bounded",
                            swa_replay_tokens=replay, **ENGINE)
    run_alone(llm, prompts(folder)[0])
    return llm


@pytest.mark.parametrize("folder", ENGINE_FEATURE_FIXTURES)
def test_v41_a_replay_of_the_windows_reach_equals_the_cold_run_bitwise(folder):
    replay = REACH[folder]
    llm = bounded(folder, replay)
    # no snapshot keeps anything, and the memory plan counts none
    assert jax.tree.leaves(llm.engine.snapshots.pool) == []
    cfg, step_cfg = llm.model.config, llm.step_config
    assert step_cfg.num_snapshots > 0 and facts_of(cfg).fixed_cache_bytes(cfg, step_cfg, 4) == (
        step_cfg.max_num_seqs * v41_slot_bytes(cfg))
    stats = llm.prefix_cache_stats
    out = run_alone(llm, prompts(folder)[1])
    assert out.token_ids == cold(folder).token_ids
    assert logprobs(out) == logprobs(cold(folder))
    now = llm.prefix_cache_stats
    # the 96 cached tokens: the last `replay` fed again (window rows only), the rest skipped
    assert now.hits - stats.hits == 1 and now.hit_tokens - stats.hit_tokens == 6 * BLOCK - replay
    assert now.replayed_tokens - stats.replayed_tokens == replay


def test_v41_a_short_replay_is_approximate_and_leaves_the_cached_entries_alone():
    """4 replayed tokens rebuild too little of the windows: the hit is served, its logprobs
    differ from the cold run's (the windows do come from the replay), and the cached blocks'
    entries and indexer keys, which the replayed tokens would compute differently, are
    bitwise what the base's cold prefill wrote."""
    folder = FIXTURES[0]
    llm = bounded(folder, 4)
    engine = llm.engine
    pages = sorted(b.page for b in engine.scheduler.kv_cache.prefix_cache.blocks.values())
    num_pages = llm.step_config.num_pages

    def cached_rows():
        return [np.asarray(a) for p in pages for a in gather_page(engine.state, p, num_pages)]

    before = cached_rows()
    assert len(pages) >= 6 and len(before) > 0
    out = run_alone(llm, prompts(folder)[1])
    assert llm.prefix_cache_stats.replayed_tokens == 4
    assert logprobs(out) != logprobs(cold(folder))
    after = cached_rows()
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
