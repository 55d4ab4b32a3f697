"""MTP speculative decoding: greedy outputs equal decoding without it (batch-invariant mode)
on a random model, rejection sampling keeps the target distribution, switches and errors. The
shipped trained model's cases: test_speculative_shipped.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.engine import EngineConfig, EngineConfigError, SpeculativeConfig
from deepinfer_jax.device.sampling import SamplingRows
from deepinfer_jax.device.speculative import verify
from tests.conftest import REPO, oracle_case

# One token bucket: a speculative step's compile is most of a test here
ENGINE = dict(max_num_seqs=8, max_model_len=640, max_num_batched_tokens=64,
              token_buckets=(64,), page_size=64, show_progress=False, batch_invariant=True)
TINY = REPO / "models" / "deepinfer-tiny-v4"


def mixed_params(n: int) -> list[SamplingParams]:
    """Lengths that end mid-draft, a stop token, EOS handling, long runs."""
    return [SamplingParams(max_tokens=[3, 7, 40, 25, 1, 16][i % 6], ignore_eos=i % 2 == 0)
            for i in range(n)]


def compare(model, prompts, params, spec, engine=ENGINE):
    base = deepinfer_jax.LLM(model, **engine).generate(prompts, params, use_tqdm=False)
    llm = deepinfer_jax.LLM(model, speculative_config=spec, **engine)
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in base]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in base]
    return llm, fast


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
    cfg = deepinfer_jax.read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    params = deepinfer_jax.random_params(cfg, 0, jnp.float32)
    no_mtp = deepinfer_jax.Model(cfg, type(params)(**{**params.__dict__, "mtp": ()}))
    with pytest.raises(EngineConfigError, match="MTP"):
        deepinfer_jax.LLM(no_mtp, speculative_config={"num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(EngineConfigError, match="MTP"):
        EngineConfig(speculative_config={}).resolve(cfg.replace(num_mtp_layers=0))


