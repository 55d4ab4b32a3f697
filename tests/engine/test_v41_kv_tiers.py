"""The KV tiers for DeepSeek-V4.1 (issues 36 and 40), as tests/engine/test_kv_tiers_engine.py
checks them for V4: blocks the device prefix cache evicts go to host memory or disk, and a
request whose prefix was evicted gets them back with the cold run's tokens and logprobs,
bitwise (batch-invariant mode, both oracle fixtures). A V4.1 block set is its page of the KV
sources' FP4 entries and indexer keys (codes and block scales as stored) and the slot
snapshot at its end (FP8 window rings, float32 open-group tails). The disk case runs in a
fresh engine on the same directory: a restart. A damaged file is dropped, and the request is
served from the blocks before it, still bitwise the cold run."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.host.kv_tiers.blockfile import read_meta
from deepinfer_jax.host.kv_tiers.disk_tier import SUFFIX
from deepinfer_jax.host.request import SamplingParams
from tests.model.v41_oracle import ENGINE_FEATURE_FIXTURES, FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

BLOCK = 16
# Ten pages of 16 tokens: two 100-token requests (7 pages each with their answers) evict a
# cached 70-token prefix (4 blocks, 5 with its answer) from the device.
ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16, token_buckets=(16,),
              page_size=BLOCK, num_pages=10, batch_invariant=True, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


@functools.lru_cache(maxsize=2)
def prompts(folder):
    ref = np.load(folder / "reference.npz")
    base = ref["input_ids"][2, -70:].tolist()
    rng = np.random.default_rng(0)
    vocab = ref["gen_logits"].shape[-1]
    fillers = [rng.integers(1, vocab, size=100).tolist() for _ in range(2)]
    return base, fillers, base + rng.integers(1, vocab, size=9).tolist()


@functools.lru_cache(maxsize=2)
def cold(folder):
    return run_alone(deepinfer_jax.LLM(folder, **ENGINE), prompts(folder)[2])


def run_alone(llm, prompt):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]


def assert_same(out, ref):
    assert out.token_ids == ref.token_ids
    # per position the chosen token's and the top token's logprobs, bitwise
    assert ([sorted((t, x.logprob) for t, x in lp.items()) for lp in out.logprobs]
            == [sorted((t, x.logprob) for t, x in lp.items()) for lp in ref.logprobs])


def spill_base(folder, options):
    """An engine that cached the base prompt's blocks and then evicted them to the tiers."""
    base, fillers, _ = prompts(folder)
    llm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, **options, **ENGINE)
    run_alone(llm, base)
    for filler in fillers:                          # evict the base's blocks from the device
        run_alone(llm, filler)
    llm.engine.tiers.drain()                        # the worker's puts, written
    return llm


def tier_options(tier, tmp_path):
    return (dict(kv_host_tier_bytes=1 << 30) if tier == "host" else
            dict(kv_disk_tier_dir=str(tmp_path), kv_disk_tier_bytes=1 << 30))


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("folder", ENGINE_FEATURE_FIXTURES)
def test_v41_a_prefix_back_from_a_tier_equals_the_cold_run_bitwise(folder, tier, tmp_path):
    options = tier_options(tier, tmp_path)
    llm = spill_base(folder, options)
    stats = llm.engine.tiers.store.stats()
    spilled = stats.host if tier == "host" else stats.disk
    assert spilled.entries >= 4                     # the base's 4 prompt blocks, at least
    if tier == "disk":                              # a restart: only the files remain
        llm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, **options, **ENGINE)
    before = llm.prefix_cache_stats.hit_tokens
    assert_same(run_alone(llm, prompts(folder)[2]), cold(folder))
    stats = llm.engine.tiers.store.stats()
    served = stats.host if tier == "host" else stats.disk
    # the 4 blocks came from the tier (the device had none of them), none was dropped
    assert served.hits >= 4 and served.corrupt_dropped == 0
    assert llm.prefix_cache_stats.hit_tokens - before == 4 * BLOCK


def test_v41_a_bounded_replay_from_the_disk_tier_equals_the_cold_run_bitwise(tmp_path):
    """Bounded mode (snapshots keep nothing for V4.1): the block sets on disk are pages only,
    and a hit after a restart replays the windows' reach, 6 * (8 - 1) tokens, bitwise."""
    folder = FIXTURES[0]
    options = dict(tier_options("disk", tmp_path), prefix_replay="bounded",
                   swa_replay_tokens=42)
    spill_base(folder, options)
    llm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, **options, **ENGINE)
    assert_same(run_alone(llm, prompts(folder)[2]), cold(folder))
    assert llm.engine.tiers.store.stats().disk.hits >= 4
    stats = llm.prefix_cache_stats
    assert stats.hit_tokens == 4 * BLOCK - 42 and stats.replayed_tokens == 42


@pytest.mark.parametrize("damage", ["truncate", "flip_payload"])
def test_v41_a_damaged_tier_file_is_dropped_and_never_served(damage, tmp_path):
    """Block 2's file (tokens 32-47 of the base) truncated or one payload byte flipped, then a
    restart: the file is detected and dropped (by its size when the index is rebuilt, or by
    its checksum on the read), blocks 0-1 are served from the disk, the rest recomputed, and
    the output is the cold run's, bitwise."""
    folder = FIXTURES[0]
    base, _, target = prompts(folder)
    options = tier_options("disk", tmp_path)
    spill_base(folder, options)
    damaged = [p for p in tmp_path.iterdir() if p.name.endswith(SUFFIX)
               and read_meta(str(p))[0]["info"]["tokens"] == base[2 * BLOCK: 3 * BLOCK]]
    assert len(damaged) == 1
    data = bytearray(damaged[0].read_bytes())
    if damage == "truncate":
        data = data[:-10]
    else:
        data[-3] ^= 0x40
    damaged[0].write_bytes(bytes(data))
    llm = deepinfer_jax.LLM(folder, enable_prefix_caching=True, **options, **ENGINE)
    assert_same(run_alone(llm, target), cold(folder))
    disk = llm.engine.tiers.store.stats().disk
    assert disk.corrupt_dropped == 1 and disk.hits == 2
    assert llm.prefix_cache_stats.hit_tokens == 2 * BLOCK
    assert not damaged[0].exists()
