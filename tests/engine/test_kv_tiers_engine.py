"""The KV tiers in the engine: blocks the device prefix cache evicts go to host memory or
disk, and a request whose prefix was evicted gets them back, with the same tokens and
per-token logprobs as a cold run, bitwise (batch-invariant mode, bf16). The disk case runs
in a fresh engine on the same directory: a restart. With MTP speculation too (the shipped
trained model, whose drafts are accepted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.device.tier_copies import page_pools
from deepinfer_jax.engine import tier_copies
from deepinfer_jax.host.decision import TierLoad, TierSpill
from deepinfer_jax.host.kv_tiers import TierEntry
from tests.conftest import REPO, xla_flags

# A pool of 20 pages of 64 tokens: three ~560-token requests evict a cached 500-token prefix.
ENGINE = dict(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=128,
              token_buckets=(32, 128), page_size=64, num_pages=20, show_progress=False,
              batch_invariant=True)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
TINY = REPO / "models" / "deepinfer-tiny-v4"      # the shipped trained model


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
    llm.engine.tiers.drain()                        # the worker's puts, written
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


def test_a_prefetch_in_flight_holds_only_its_request_back(model, prompts, reference, tmp_path):
    """The disk read of a request's prefix is held open while the loop plans its next steps:
    the request waits (its blocks are not in), another request runs meanwhile, and once the
    read lands the request is served from the tier, bitwise equal to the cold run."""
    base, fillers, target = prompts
    options = dict(kv_disk_tier_dir=str(tmp_path), kv_disk_tier_bytes=1 << 30)
    llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **options, **ENGINE)
    run_alone(llm, base)
    for filler in fillers:
        run_alone(llm, filler)
    llm.engine.tiers.drain()
    llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, **options, **ENGINE)  # restart
    tiers, scheduler = llm.engine.tiers, llm.engine.scheduler
    gate, read = threading.Event(), tiers.store.disk.get

    def slow_read(*args, **kwargs):               # the worker's disk reads, held at the gate
        assert gate.wait(60)
        return read(*args, **kwargs)

    tiers.store.disk.get = slow_read
    seen, step = [], llm.engine.step

    def observed_step():
        waiting = [r.prompt == target for r in scheduler.waiting]
        running = [r.prompt == target for r in scheduler.running]
        seen.append((any(waiting), running.count(False), tiers.worker.pending))
        if len(seen) == 4:
            gate.set()
        return step()

    llm.engine.step = observed_step
    other = prompts[1][0][:100]
    out = llm.generate([target, other], GREEDY, use_tqdm=False)
    # steps 2-4: the target still waits on its read while the other request runs
    assert all(w and r == 1 and p for w, r, p in seen[1:4]), seen
    assert tiers.worker.admissions_deferred >= 3 and tiers.worker.blocks_prefetched >= 6
    assert_same(out[0], reference)
    stats = llm.kv_tier_stats["disk"]
    assert stats.counters.hits >= 6 and stats.prefetch_latency.count >= 6
    assert stats.prefetch_latency.p50_s > 0
    assert llm.prefix_cache_stats.hit_tokens >= 6 * 64


def test_host_block_sets_load_in_batches_in_order(model, monkeypatch):
    """Block sets from host memory are written LOAD_BATCH at a time (here 8: 19 loads make
    batches of 8, 8 and 3, padded with ids written nowhere), in the decision's order: a spill
    between loads reads the page an earlier load wrote. Every loaded page and snapshot holds
    its block set's arrays, and nothing else of the state or the snapshot pool changes."""
    monkeypatch.setattr(tier_copies, "LOAD_BATCH", 8)      # before the engine compiles them
    llm = deepinfer_jax.LLM(model, enable_prefix_caching=True, kv_host_tier_bytes=1 << 30,
                            **ENGINE)
    engine, tiers = llm.engine, llm.engine.tiers
    before = jax.device_get((page_pools(engine.state), engine.snapshots.pool))
    pool_size = jax.tree.leaves(before[1])[0].shape[0]
    rng = np.random.default_rng(1)

    def block_set():            # random bits of each array's dtype: a block set's shapes
        page = [b[:b.shape[0] // engine.step_cfg.num_pages] for b in before[0]]
        snap = [b[0] for b in jax.tree.leaves(before[1])]
        drawn = (rng.integers(0, 256, a.nbytes, np.uint8).view(a.dtype).reshape(a.shape)
                 for a in page + snap)
        # but no NaNs: a GPU's copy may quiet a signalling NaN's payload, which no cache
        # entry the engine computes holds (the H200 did, in 34 of 10240 values)
        return tuple(np.where(np.isnan(a), a.dtype.type(0), a)
                     if jnp.issubdtype(a.dtype, jnp.floating) else a for a in drawn)
    free_snapshots = iter(range(pool_size))          # distinct, as a decision's are
    loads = [TierLoad(page, next(free_snapshots, None) if page % 3 else None,
                      TierEntry(page, block_set(), {})) for page in range(19)]
    assert sum(load.snapshot is not None for load in loads) >= 2
    spilled = []
    ops = (*loads[:10], TierSpill(10, 4, None, {}), *loads[10:])
    engine.state = tiers.run(engine.state, ops, spilled)
    after = jax.device_get((page_pools(engine.state), engine.snapshots.pool))
    n = len(before[0])
    expected = jax.tree.map(np.copy, before)
    for load in loads:
        for k, e in enumerate(expected[0]):
            per_page = e.shape[0] // engine.step_cfg.num_pages
            e[load.page * per_page:(load.page + 1) * per_page] = load.entry.arrays[k]
        if load.snapshot is not None:
            for k, e in enumerate(jax.tree.leaves(expected[1])):
                e[load.snapshot] = load.entry.arrays[n + k]
    for a, e in zip(jax.tree.leaves(after), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(bits(a), bits(e))
    # the spill ran after the first 10 loads: page 4 as loads[4] wrote it
    for got, want in zip(jax.device_get(spilled[0][1]), loads[4].entry.arrays[:n], strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def bits(a: np.ndarray) -> np.ndarray:
    """An array's bytes as unsigned integers of its width: compared bit for bit."""
    return np.asarray(a).view(np.dtype(f"u{np.asarray(a).dtype.itemsize}"))


@pytest.mark.slow
def test_with_mtp_speculation_a_prefix_back_from_the_host_tier_equals_the_cold_run():
    """MTP speculation on the shipped trained model (drafts accepted): the snapshots then hold
    the MTP block's window too, and a prefix the device evicted to host memory comes back
    with it: the cold speculative run's tokens and logprobs bit for bit, as many drafts
    accepted."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "varlen": False}
    cold = deepinfer_jax.LLM(TINY, speculative_config=spec, **ENGINE)
    warm = deepinfer_jax.LLM(TINY, speculative_config=spec, enable_prefix_caching=True,
                             kv_host_tier_bytes=1 << 30, **ENGINE)
    ids = cold.tokenizer.encode((REPO / "deepinfer_jax" / "host" / "scheduler.py").read_text())
    base, target = ids[:500], ids[:540]
    fillers = [ids[600 + 600 * i: 1160 + 600 * i] for i in range(3)]
    run_alone(warm, base)
    for filler in fillers:                          # evict the base's blocks from the device
        run_alone(warm, filler)
    warm.engine.tiers.drain()
    assert warm.engine.tiers.store.stats().host.entries >= 7
    hits, accepted = warm.prefix_cache_stats.hit_tokens, warm.spec_metrics.accepted
    out_warm, out_cold = run_alone(warm, target), run_alone(cold, target)
    assert_same(out_warm, out_cold)
    assert warm.engine.tiers.store.stats().host.hits >= 6
    assert warm.prefix_cache_stats.hit_tokens - hits >= 6 * 64
    assert warm.spec_metrics.accepted - accepted == cold.spec_metrics.accepted > 0


@pytest.mark.slow
def test_over_a_device_mesh_a_prefix_back_from_the_host_tier_equals_the_cold_run():
    """Expert parallel (ep 4), tensor with context parallel (tp 2 x cp 2), and data-parallel
    ranks with expert parallel (dp 2 x ep 2: each rank's prefix cache over one shared store),
    in a process of 8 CPU devices (tiers_mesh_run.py): the prefix evicted to host memory comes
    back and the prompt's tokens and logprobs are the same mesh's cold run, bit for bit. (The
    bf16 model meets the XLA CPU compiler abort the MoE's float32 sums work around:
    model/moe.py.)"""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    meshes = ("1,4,1", "1,1,2,2", "2,2,1")
    done = subprocess.run([sys.executable, str(REPO / "tests/engine/tiers_mesh_run.py"), *meshes],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for mesh in meshes:
        ran = results[mesh]
        assert ran["mesh_devices"] == 4, mesh
        assert ran["warm"] == ran["cold"], mesh
        assert ran["host_hits"] >= 6 and ran["hit_tokens"] >= 6 * 64, mesh
        if mesh.startswith("2,"):      # one rank's page and snapshot out, into the other's
            assert ran["rank_copies"] == {"exact": True, "moved": True}
