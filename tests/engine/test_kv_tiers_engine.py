"""The KV tiers in the engine: blocks the device prefix cache evicts go to host memory or
disk, and a request whose prefix was evicted gets them back, with the same tokens and
per-token logprobs as a cold run, bitwise (batch-invariant mode, bf16). The disk case runs
in a fresh engine on the same directory: a restart."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.hf import read_model_config
from tests.conftest import REPO

# A pool of 20 pages of 64 tokens: three ~560-token requests evict a cached 500-token prefix.
ENGINE = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=128,
              token_buckets=(16, 32, 64, 128), page_size=64, num_pages=20, show_progress=False,
              batch_invariant=True)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model():
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    return deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(2, 512, size=500).tolist()
    fillers = [rng.integers(2, 512, size=560).tolist() for _ in range(3)]
    return base, fillers, base + rng.integers(2, 512, size=40).tolist()


@pytest.fixture(scope="module")
def reference(model, prompts):
    return deepinfer_jax.LLM(model, **ENGINE).generate([prompts[2]], GREEDY, use_tqdm=False)[0]


def run_alone(llm, prompt):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def assert_same(out, ref):
    assert out.token_ids == ref.token_ids
    np.testing.assert_array_equal([lp.logprob for lp in out.logprobs],
                                  [lp.logprob for lp in ref.logprobs])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_back_from_a_tier_equals_the_cold_run_bitwise(model, prompts, reference,
                                                               tier, tmp_path):
    base, fillers, target = prompts
    options = (dict(kv_host_tier_bytes=1 << 30) if tier == "host" else
               dict(kv_disk_tier_dir=str(tmp_path), kv_disk_tier_bytes=1 << 30))
    llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **options, **ENGINE)
    run_alone(llm, base)
    for filler in fillers:                          # evict the base's blocks from the device
        run_alone(llm, filler)
    stats = llm.engine.tiers.store.stats()
    spilled = stats.host if tier == "host" else stats.disk
    assert spilled.entries >= 7                     # the base's 7 full blocks, at least
    if tier == "disk":                              # a restart: only the files remain
        llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **options, **ENGINE)
    before = llm.prefix_cache_stats.hit_tokens
    assert_same(run_alone(llm, target), reference)
    stats = llm.engine.tiers.store.stats()
    served = stats.host if tier == "host" else stats.disk
    assert served.hits >= 6 and served.corrupt_dropped == 0
    assert llm.prefix_cache_stats.hit_tokens - before >= 6 * 64
