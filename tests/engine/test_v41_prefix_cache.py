"""Prefix caching for DeepSeek-V4.1 (issue 36), exact mode: a warm hit gives the cold run's
tokens and logprobs bitwise (batch-invariant mode, both oracle fixtures), and computes only
the tokens after the reused prefix (the engine's fed-token count and the cache's counters).

What a hit reuses: the pages of the KV sources' FP4 entries and indexer keys (the consumer
layers read their source's pages, they own none), and the snapshot of the slot at the last
cached block end: every layer's FP8 window ring and the ratio > 1 sources' open-group tails.
The Engram look-back of the first computed tokens comes from the request's own tokens."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.memory_v41 import v41_slot_bytes, v41_snapshot_bytes
from deepinfer_jax.host.request import SamplingParams
from tests.model.v41_oracle import ENGINE_FEATURE_FIXTURES, FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

BLOCK = 16
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16, token_buckets=(16,),
              page_size=BLOCK, batch_invariant=True, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


@functools.lru_cache(maxsize=2)
def _cold(folder):
    return deepinfer_jax.LLM(folder, **ENGINE)


def _outputs(llm, prompts, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        # per position the chosen token's and the top token's logprobs, bitwise
        assert ([sorted((t, x.logprob) for t, x in lp.items()) for lp in out.logprobs]
                == [sorted((t, x.logprob) for t, x in lp.items()) for lp in ref.logprobs])


@pytest.mark.parametrize("folder", ENGINE_FEATURE_FIXTURES)
def test_v41_warm_hits_equal_the_cold_run_and_skip_the_cached_tokens(folder):
    ref = np.load(folder / "reference.npz")
    base, other = (ref["input_ids"][r, -n:].tolist() for r, n in ((2, 70), (1, 33)))
    rng = np.random.default_rng(0)

    def fresh(n):
        return rng.integers(1, ref["gen_logits"].shape[-1], size=n).tolist()

    warm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, **ENGINE)
    [first] = _outputs(warm, [base])
    assert first.token_ids == ref["gen_tokens"][2].tolist()
    prompts = [base + fresh(9),                            # blocks 0-3 (prefill chunk ends)
               base[:40] + fresh(20),                      # diverges inside block 2
               base + first.token_ids + fresh(5),          # the next turn: block 4 ended in decode
               other]                                      # nothing cached
    hits = [64, 32, 80, 0]
    # the next turn with penalties: the cached answer is prompt now, its counters recounted
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1,
                               repetition_penalty=1.3, presence_penalty=0.5)
    params = [GREEDY, GREEDY, penalized, GREEDY]
    fed, stats = warm.engine.stats.tokens, warm.prefix_cache_stats
    outs = _outputs(warm, prompts, params)
    _assert_same(outs, [_outputs(_cold(folder), [p], q)[0] for p, q in zip(prompts, params)])
    now = warm.prefix_cache_stats
    assert now.hits - stats.hits == 3 and now.hit_tokens - stats.hit_tokens == sum(hits)
    assert now.replayed_tokens == stats.replayed_tokens
    # the model ran only the tokens after each reused prefix (and the decode steps)
    assert warm.engine.stats.tokens - fed == sum(len(p) - h + GREEDY.max_tokens - 1
                                                 for p, h in zip(prompts, hits, strict=True))


def test_v41_the_memory_plan_counts_the_snapshots():
    llm = deepinfer_jax.LLM(FIXTURES[0], enable_prefix_caching=True, device_memory_gib=1,
                            **ENGINE)
    cfg, step_cfg = llm.model.config, llm.step_config
    pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(llm.engine.snapshots.pool))
    assert step_cfg.num_snapshots > 0 and pool == step_cfg.num_snapshots * v41_snapshot_bytes(cfg)
    assert llm.memory_plan.fixed_cache == step_cfg.max_num_seqs * v41_slot_bytes(cfg) + pool


def test_v41_preempted_sequences_resume_from_the_cache():
    """Eight pages of 16 positions for three sequences that need 2, 3 and 6, admitted on their
    first chunk: decoding runs out of pages, preempts, and the preempted sequences resume from
    their own cached blocks (Engram look-back rehashed from their tokens): the reference's
    greedy continuations, bitwise the cold run's logprobs."""
    from bench.lib.admission import admit_first_chunks

    ref = np.load(FIXTURES[1] / "reference.npz")
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    llm = deepinfer_jax.LLM(FIXTURES[1], enable_prefix_caching=True,
                            **{**ENGINE, "num_pages": 8})
    admit_first_chunks(llm)
    outs = _outputs(llm, prompts)
    np.testing.assert_array_equal([o.token_ids for o in outs], ref["gen_tokens"])
    _assert_same(outs, [_outputs(_cold(FIXTURES[1]), [p])[0] for p in prompts])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.prefix_cache_stats.hit_tokens > 0
