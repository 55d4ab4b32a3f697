"""MTP speculation in the asynchronous loop (host/spec_booking.py, device/spec_carry.py): the
same tokens, finish reasons, logprobs, acceptance counts and prefix-cache hits as the
synchronous loop on the shipped trained model (batch-invariant mode), over greedy and seeded
sampled rows, stop tokens, stop strings and max_tokens ending inside accepted drafts, prefix
caching (blocks completed by carried rows reused), preemption, and plain steps between
speculative ones; and the asynchronous loop really plans rows whose speculative step is
still unread (carried rows): it does not fall back. One engine shape for the whole file
(engines of equal shapes share their compiled steps)."""

from __future__ import annotations

import dataclasses

import pytest

import deepinfer_jax
from bench.lib.admission import admit_first_chunks
from deepinfer_jax import FinishReason, SamplingParams
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.parallel import ParallelConfig
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.engine.test_speculative import ENGINE, TINY

# 12 pages of 32 tokens: admission holds requests back (a repeated prompt then hits the
# cache), the old admission preempts
SHAPES = {**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,), "page_size": 32,
          "num_pages": 12, "enable_prefix_caching": True}
SPEC = {"num_speculative_tokens": 3}     # verify budget 32: 3 drafts a row up to 10 rows
LONG = ("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('path')\n    args = parser.parse_args(argv)\n"
        "    for root, dirs, files in os.walk(args.path):\n")
TEXTS = [LONG, "class Point:\n    def __init__(self, x, y):", "def add(a, b):\n    return",
         "for line in open(path):", "x = [i * i for i in", "if __name__ == '__main__':"]


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_model_dir(TINY)


def workload(tok):
    prompts = [tok.encode(t) for t in TEXTS]
    newline = tok.token_to_id("Ċ") or 1
    params = [SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_tokens=30, stop_token_ids=[newline]),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, stop=["import_helper", "):"])]
    # the long prompt again, admitted later: a prefix-cache hit on its blocks
    return prompts + [prompts[0]], params + [params[0]]


def engine(async_scheduling: bool, preempt: bool = False):
    """An engine and the (speculative, carried rows) of each step it plans."""
    llm = deepinfer_jax.LLM(TINY, speculative_config=SPEC, async_scheduling=async_scheduling,
                            **SHAPES)
    assert llm.host_options.async_scheduling is async_scheduling
    if preempt:
        admit_first_chunks(llm)
        # a verify budget of 6: 7+ rows run plain steps, 3 rows 2 drafts, 2 rows 3 (the budget
        # is the scheduler's alone: the file's compiled steps serve it)
        cfg = llm.engine.scheduler.step_cfg
        llm.engine.scheduler.step_cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(
            cfg.speculative, verify_token_budget=6))
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        decision = schedule(*args, **kwargs)
        if decision.seqs:
            steps.append((decision.speculative, sum(seq.carried for seq in decision.seqs)))
        return decision

    scheduler.schedule = recording
    return llm, steps


def assert_same(fast, slow):
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in slow]
    assert [o.text for o in fast] == [o.text for o in slow]
    assert ([o.outputs[0].stop_reason for o in fast]
            == [o.outputs[0].stop_reason for o in slow])
    lps = lambda outs: [[lp and lp.logprob for lp in o.logprobs or []] for o in outs]  # noqa: E731
    assert lps(fast) == lps(slow)
    assert ([dataclasses.astuple(o.spec) for o in fast]
            == [dataclasses.astuple(o.spec) for o in slow])


def test_async_loop_equals_the_synchronous_one(tok):
    prompts, params = workload(tok)
    (slow_llm, slow_steps), (llm, steps) = engine(False), engine(True)
    slow = slow_llm.generate(prompts, params, use_tqdm=False)
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert_same(fast, slow)
    assert not any(c for _, c in slow_steps)
    assert sum(c for _, c in steps) > 20        # the asynchronous loop carried rows
    assert llm.spec_metrics.accepted > 0
    # max_tokens ended inside accepted drafts; a stop string cut a row's tokens
    assert any(o.spec.accepted and len(o.token_ids) == p.max_tokens and p.max_tokens % 2
               for o, p in zip(fast, params))
    assert (fast[5].finish_reason is FinishReason.STOP
            and fast[5].outputs[0].stop_reason == "import_helper")
    # the long prompt continued by its own output: blocks the decoding completed (by carried
    # rows in the asynchronous loop) are reused, as many as in the synchronous loop
    more = [prompts[0] + fast[0].token_ids[:36]]
    again = SamplingParams(max_tokens=12, ignore_eos=True)
    before = [e.engine.scheduler.prefix_stats().hit_tokens for e in (slow_llm, llm)]
    assert_same(llm.generate(more, again, use_tqdm=False),
                slow_llm.generate(more, again, use_tqdm=False))
    stats = [e.engine.scheduler.prefix_stats() for e in (slow_llm, llm)]
    assert before[0] > 0 and before[1] == before[0]
    assert stats[1].hit_tokens == stats[0].hit_tokens > before[0]
    assert stats[1].cached_blocks == stats[0].cached_blocks


def test_preemption_and_plain_steps(tok):
    """A cache too small for the batch (the old admission overcommits it): requests are
    preempted, planned with their speculative step read first (SpecBooking.must_read_first),
    and recomputed. Two requests speculate, five more join (no verify budget left for 7 rows:
    plain steps, the carried rows' step read first), and as they finish, plain steps'
    placeholders feed speculative steps on the device. The same tokens as the synchronous
    loop, verify and accepted counts included."""
    prompts, _ = workload(tok)
    params = [SamplingParams(max_tokens=50, ignore_eos=True) if i % 3 else
              SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.9, seed=i)
              for i in range(len(prompts))]
    runs = []
    for async_scheduling in (False, True):
        llm, steps = engine(async_scheduling, preempt=True)
        core = llm.engine
        requests = [core.add_request(str(i), p, q) for i, (p, q) in
                    enumerate(zip(prompts[:2], params))]
        for _ in range(8):
            core.step()
        requests += [core.add_request(str(i), p, q) for i, (p, q) in
                     enumerate(zip(prompts, params)) if i >= 2]
        while core.has_unfinished():
            core.step()
        assert core.scheduler.num_preemptions > 0
        runs.append(([(list(r.generated), dataclasses.astuple(r.spec), r.num_preemptions)
                      for r in requests], core.scheduler.prefix_stats(), steps))
    (slow, slow_stats, _), (fast, stats, steps) = runs
    # the same tokens, verify steps, drafts and accepted drafts per request, preemptions and
    # prefix-cache hits: a block completed by a step still unread waits for its next token
    # (host/kv_cache.py), so its snapshot serves the preempted request's readmission as in
    # the synchronous loop
    assert fast == slow
    assert stats.hit_tokens == slow_stats.hit_tokens > 0
    kinds = [speculative for speculative, _ in steps]
    assert sum(c for _, c in steps) > 0
    assert any(a and not b for a, b in zip(kinds, kinds[1:]))     # speculative, then plain
    assert any(b and not a for a, b in zip(kinds, kinds[1:]))     # plain, then speculative


def test_fallbacks_are_explicit():
    """Speculation over data-parallel ranks keeps the synchronous loop (host/ranks.py books
    no speculative step at launch)."""
    options = EngineConfig(speculative_config={"num_speculative_tokens": 2}, **ENGINE)
    step = options.resolve(read_model_config(TINY / "config.json"))
    assert options.host_options(step).async_scheduling
    ranks = dataclasses.replace(step, compute=dataclasses.replace(
        step.compute, parallel=ParallelConfig(dp=2)))
    assert not options.host_options(ranks).async_scheduling
    assert options.host_options(dataclasses.replace(ranks, speculative=None)).async_scheduling
