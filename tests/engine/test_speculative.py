"""MTP speculative decoding: greedy outputs equal decoding without it (batch-invariant mode),
rejection sampling keeps the target distribution, switches and errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.engine_config import EngineConfig, EngineConfigError, SpeculativeConfig
from deepinfer_jax.sampling import SamplingRows
from deepinfer_jax.speculative import verify
from deepinfer_jax.tokenizer import TextTokenizer
from tests.conftest import REPO, oracle_case

ENGINE = dict(max_num_seqs=8, max_model_len=640, max_num_batched_tokens=64,
              token_buckets=(16, 32, 64), page_size=64, show_progress=False, batch_invariant=True)
TINY = REPO / "models" / "deepinfer-tiny-v4"


def mixed_params(n: int) -> list[SamplingParams]:
    """Lengths that end mid-draft, a stop token, EOS handling, long runs."""
    return [SamplingParams(max_tokens=[3, 7, 40, 25, 1, 16][i % 6], ignore_eos=i % 2 == 0)
            for i in range(n)]


def compare(model, prompts, params, spec):
    base = deepinfer_jax.LLM(model, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = deepinfer_jax.LLM(model, speculative_config=spec, **ENGINE)
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in base]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in base]
    return llm, fast


def test_trained_model_greedy_equals_plain_decoding():
    tok = TextTokenizer.from_model_dir(TINY)
    texts = ["import os\n\n\ndef walk(top):", "class Point:\n    def __init__(self, x, y):",
             "def add(a, b):\n    return", "for line in open(path):", "x = [i * i for i in",
             "if __name__ == '__main__':"]
    prompts = [tok.encode(t) for t in texts]
    params = mixed_params(len(prompts))
    stop = SamplingParams(max_tokens=30, stop_token_ids=[tok.token_to_id("Ċ") or 1])
    llm, outputs = compare(str(TINY), prompts + [prompts[0]], params + [stop],
                           {"num_speculative_tokens": 5})
    spec = llm.spec_metrics
    assert spec.accepted > 0 and spec.mean_accepted_length > 1.3      # the MTP block helps
    # drafts were accepted across compressed-block boundaries (CSA rate 4): a row closed
    # inside an accepted draft is kept, and equal outputs show it was right
    assert any(o.spec.accepted > 0 and len(o.token_ids) >= 8 for o in outputs)


@pytest.mark.parametrize("k", [1, 3])
def test_trained_model_logprobs_equal_plain_decoding_bitwise(k):
    """Batch-invariant mode: a verified token's logprob is bitwise the one plain decoding gives
    (the stream collapse of the hc head once summed the verify step's [N, S, hc, D] in another
    order than the plain step's [N, hc, D]; this prompt showed it at one token in 16)."""
    plain = deepinfer_jax.LLM(TINY, **{**ENGINE, "max_model_len": 1024,
                                        "max_num_batched_tokens": 128, "token_buckets": (16, 128)})
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = plain.tokenizer.encode(source)[:310]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    spec = deepinfer_jax.LLM(TINY, speculative_config={"num_speculative_tokens": k,
                                                       "varlen": False},
                             **{**ENGINE, "max_model_len": 1024, "max_num_batched_tokens": 128,
                                "token_buckets": (16, 128)})
    ref, out = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (plain, spec))
    assert out.token_ids == ref.token_ids and spec.spec_metrics.accepted > 0
    np.testing.assert_array_equal([lp.logprob for lp in out.logprobs],
                                  [lp.logprob for lp in ref.logprobs])


@pytest.mark.oracle
def test_random_model_greedy_equals_plain_decoding(workload):
    prompts = [workload.prompts[i] for i in range(0, 32, 3)]
    params = mixed_params(len(prompts))
    llm, outputs = compare(oracle_case("tiny-mixed").model, prompts, params,
                           {"num_speculative_tokens": 3, "varlen": False})
    assert llm.spec_metrics.drafted > 0             # random drafts: mostly rejected


def test_rejection_sampling_keeps_the_target_distribution():
    vocab, n = 6, 30_000
    probs = np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    logits = jnp.asarray(np.log(probs), jnp.float32)
    target = probs / probs.sum()
    for draft_token in (0, 4):                      # a likely and an unlikely draft
        rows = SamplingRows(
            temperature=jnp.ones(2 * n), top_k=jnp.zeros(2 * n, jnp.int32),
            top_p=jnp.ones(2 * n), min_p=jnp.zeros(2 * n), repetition_penalty=jnp.ones(2 * n),
            presence_penalty=jnp.zeros(2 * n), frequency_penalty=jnp.zeros(2 * n),
            seed=jnp.repeat(jnp.arange(n, dtype=jnp.uint32), 2),
            position=jnp.tile(jnp.array([10, 11], jnp.int32), n),
            allowed=jnp.full((2 * n, 1), -1, jnp.int32))
        out, accepted, _ = jax.jit(verify, static_argnums=6)(
            jnp.broadcast_to(logits, (n, 2, vocab)),
            jnp.full((n, 2), draft_token, jnp.int32), jnp.ones(n, jnp.int32), rows,
            jnp.zeros((2 * n, vocab), bool), jnp.zeros((2 * n, vocab), jnp.int32), 2)
        first = np.asarray(out)[:, 0]
        counts = np.bincount(first, minlength=vocab)
        assert stats.chisquare(counts, target * counts.sum()).pvalue > 1e-3, (draft_token, counts)
        np.testing.assert_allclose(np.mean(np.asarray(accepted)), target[draft_token], atol=0.01)


def test_switches_and_errors(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    spec = EngineConfig().speculative_config
    assert spec == SpeculativeConfig(num_speculative_tokens=3, varlen=True)
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    assert EngineConfig().speculative_config is None
    with pytest.raises(TypeError, match="bogus"):
        EngineConfig(speculative_config={"bogus": 1})
    with pytest.raises(EngineConfigError, match="method"):
        EngineConfig(speculative_config={"method": "eagle"})
    # a checkpoint without MTP weights
    cfg = deepinfer_jax.ModelConfig.from_json_file(REPO / "configs/tiny/tiny-mixed.json")
    params = deepinfer_jax.random_params(cfg, 0, jnp.float32)
    no_mtp = deepinfer_jax.Model(cfg, type(params)(**{**params.__dict__, "mtp": ()}))
    with pytest.raises(EngineConfigError, match="MTP"):
        deepinfer_jax.LLM(no_mtp, speculative_config={"num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(EngineConfigError, match="MTP"):
        EngineConfig(speculative_config={}).resolve(cfg.replace(num_mtp_layers=0))


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
