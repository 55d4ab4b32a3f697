"""MTP speculative decoding on the shipped trained model (whose drafts get accepted): greedy
outputs and logprobs equal decoding without it (batch-invariant mode), on the CPU's and the
GPU's step formulations. Apart from test_speculative.py so that the two files run on
different test workers."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.conftest import REPO
from tests.engine.test_speculative import ENGINE, TINY, compare, mixed_params

sys.path.insert(0, str(REPO / "tools"))

# Room for a 310-token prompt in big chunks; one shape for the file's plain engines, which the
# tests then share (compile.py: engines of equal shapes share their compiled steps). One token
# bucket, which decode and verify steps pad: a speculative step's compile is most of the file.
SHIPPED = {**ENGINE, "max_model_len": 1024, "max_num_batched_tokens": 128,
           "token_buckets": (128,)}
# Five drafts, their count per request scheduled by confidence (varlen); both trained-model
# tests use it, so the speculative engine's steps compile once for the file.
GREEDY_SPEC = {"num_speculative_tokens": 5}


@pytest.mark.slow
def test_trained_model_greedy_equals_plain_decoding():
    tok = TextTokenizer.from_model_dir(TINY)
    texts = ["import os\n\n\ndef walk(top):", "class Point:\n    def __init__(self, x, y):",
             "def add(a, b):\n    return", "for line in open(path):", "x = [i * i for i in",
             "if __name__ == '__main__':"]
    prompts = [tok.encode(t) for t in texts]
    params = mixed_params(len(prompts))
    stop = SamplingParams(max_tokens=30, stop_token_ids=[tok.token_to_id("Ċ") or 1])
    llm, outputs = compare(str(TINY), prompts + [prompts[0]], params + [stop],
                           GREEDY_SPEC, SHIPPED)
    spec = llm.spec_metrics
    assert spec.accepted > 0 and spec.mean_accepted_length > 1.3      # the MTP block helps
    # drafts were accepted across compressed-block boundaries (CSA rate 4): a row closed
    # inside an accepted draft is kept, and equal outputs show it was right
    assert any(o.spec.accepted > 0 and len(o.token_ids) >= 8 for o in outputs)


def test_trained_model_logprobs_equal_plain_decoding_bitwise():
    """Batch-invariant mode: a verified token's logprob is bitwise the one plain decoding gives
    (the stream collapse of the hc head once summed the verify step's [N, S, hc, D] in another
    order than the plain step's [N, hc, D]; this prompt showed it at one token in 16)."""
    plain = deepinfer_jax.LLM(TINY, **SHIPPED)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = plain.tokenizer.encode(source)[:310]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    spec = deepinfer_jax.LLM(TINY, speculative_config=GREEDY_SPEC, **SHIPPED)
    ref, out = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (plain, spec))
    assert out.token_ids == ref.token_ids and spec.spec_metrics.accepted > 0
    np.testing.assert_array_equal([lp.logprob for lp in out.logprobs],
                                  [lp.logprob for lp in ref.logprobs])


# a combination (draft vocabulary x the shipped model): test_draft_vocab.py in CI's tier
@pytest.mark.slow
def test_a_draft_token_map_keeps_the_outputs_and_drafts_only_its_tokens(tmp_path):
    """speculative_config.draft_token_map: the MTP block drafts from the listed ids only.
    Two maps of one size (so the steps compile once): other modules' most frequent tokens,
    whose drafts get accepted, and ids that leave out every token plain decoding emits, whose
    drafts never can be. Either way the tokens and logprobs are plain decoding's, bitwise."""
    from draft_token_map import most_frequent

    plain = deepinfer_jax.LLM(TINY, **SHIPPED)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompt = plain.tokenizer.encode((stdlib / "textwrap.py").read_text())[:310]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    ref = plain.generate([prompt], params, use_tqdm=False)[0]
    vocab = plain.model.config.vocab_size
    corpus = np.concatenate([plain.tokenizer.encode((stdlib / name).read_text())
                             for name in ("string.py", "shlex.py", "glob.py")])
    size = vocab // 2
    emitted = set(ref.token_ids)
    maps = {"frequent": most_frequent(corpus, vocab, size),
            "without the output": [i for i in range(vocab) if i not in emitted][:size]}
    accepted = {}
    for name, ids in maps.items():
        path = tmp_path / "map.json"
        path.write_text(json.dumps(ids))
        # every draft made and verified (no confidence cut), so each map's drafts are tried
        spec = {"num_speculative_tokens": 3, "varlen": False, "draft_token_map": str(path)}
        llm = deepinfer_jax.LLM(TINY, speculative_config=spec, **SHIPPED)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids, name
        np.testing.assert_array_equal([lp.logprob for lp in out.logprobs],
                                      [lp.logprob for lp in ref.logprobs])
        assert llm.spec_metrics.drafted > 0
        accepted[name] = llm.spec_metrics.accepted
    assert accepted["without the output"] == 0 < accepted["frequent"]


@pytest.mark.slow
def test_the_gpu_formulation_gives_the_same_outputs(monkeypatch):
    """The step traced for GPUs (pallas_kernels.common.launch_bound) runs the MTP passes no row
    wants and the top-p sort of an all-greedy batch instead of branching (a lax.cond stalls the
    host there). In batch-invariant mode that is its only difference from the CPU formulation
    (the unrolled Sinkhorn and the dense expert products, which round differently, are
    default-mode choices tested on their own), so everything must be equal: tokens, logprobs,
    drafted and accepted counts, over greedy and seeded sampled rows where the sampled ones
    finish first."""
    tok = TextTokenizer.from_model_dir(TINY)
    texts = ["import os\n\n\ndef walk(top):", "def add(a, b):\n    return",
             "for line in open(path):", "class Point:\n    def __init__(self, x, y):"]
    prompts = [tok.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7, logprobs=1),
              SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=3, temperature=1.2, top_k=20, seed=3, logprobs=1)]
    engine = {**ENGINE, "max_num_batched_tokens": 16, "token_buckets": (16,)}  # 4 rows x (1 + 3)
    runs = []
    for formulation in ("cpu", "gpu"):
        monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", formulation)
        llm = deepinfer_jax.LLM(TINY, speculative_config={"num_speculative_tokens": 3}, **engine)
        runs.append((llm.generate(prompts, params, use_tqdm=False), llm.spec_metrics))
    (cpu, m_cpu), (gpu, m_gpu) = runs
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert [[lp.logprob for lp in o.logprobs] for o in gpu] == \
        [[lp.logprob for lp in o.logprobs] for o in cpu]
    assert (m_gpu.drafted, m_gpu.accepted, m_gpu.steps) == (m_cpu.drafted, m_cpu.accepted,
                                                            m_cpu.steps)
    assert m_cpu.accepted > 0
