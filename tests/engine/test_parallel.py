"""The engine over a device mesh (8 CPU devices, in a process of its own: XLA's device count
is fixed when jax starts): data-parallel attention, expert and tensor parallel meshes give the
single device's greedy tokens, its logprobs bitwise with expert parallelism alone and within
1e-5 otherwise (split projections add partial products in another order; a data-parallel
rank's batch differs from the single device's); each device holds its share of the experts;
and meshes the model or the devices cannot take fail with errors naming the sizes. Context
parallelism and batch-invariant mode: test_parallel_invariant.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax.config.engine import EngineConfig, EngineConfigError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.options import DeviceFacts
from tests.conftest import REPO, xla_flags

CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
# The four meshes. CI's tier runs expert parallelism alone (bitwise) and (2,2,2), which
# has every axis; the full tier adds dp x ep and data parallelism alone, in a run of their own.
MESHES = ("1,8,1", "2,2,2")
FULL_TIER_MESHES = ("2,4,1", "8,1,1")


def run_meshes(config: str, meshes) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(REPO / "tests/engine/parallel_run.py"),
                           config, *meshes], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def mesh_runs(meshes: tuple[str, ...]) -> dict:
    return run_meshes("configs/tiny/tiny-mixed.json", meshes)


@pytest.mark.parametrize("mesh", [*MESHES, *(pytest.param(mesh, marks=pytest.mark.slow)
                                             for mesh in FULL_TIER_MESHES)])
def test_mesh_matches_one_device(mesh):
    runs = mesh_runs(MESHES if mesh in MESHES else FULL_TIER_MESHES)
    single, sharded = runs["single"], runs[mesh]
    dp, ep, tp = map(int, mesh.split(","))
    assert single["mesh_devices"] == 1 and sharded["mesh_devices"] == dp * ep * tp
    assert sharded["tokens"] == single["tokens"]
    for ours, ref in zip(sharded["logprobs"], single["logprobs"], strict=True):
        if tp == 1 and dp == 1:     # expert parallel alone is exact (moe.expert_parallel)
            np.testing.assert_array_equal(ours, ref)
        else:
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
    assert sharded["expert_shard_rows"] == CFG.n_routed_experts // (dp * ep)
    # the three prompts spread over the data-parallel ranks (round robin while loads are
    # equal), each rank's state its own
    assert sharded["requests_per_rank"] == [3 // dp + (rank < 3 % dp) for rank in range(dp)]
    assert sharded["state_rank_rows"] == (None if dp == 1 else 1)
    # the memory plan counts what one device holds: with the experts split, less
    assert sharded["planned_weight_bytes"] < single["planned_weight_bytes"]


@pytest.mark.parametrize("parallel, devices, message", [
    ({"ep": 3}, 8, r"ep=3.*spans 3 devices, which does not divide the 8 devices"),
    ({"ep": 16}, 16, r"dp x cp x ep = 1 x 1 x 16 does not divide the model's 8 routed experts"),
    ({"dp": 4, "ep": 4}, 16, r"dp x cp x ep = 4 x 1 x 4 does not divide the model's 8 routed"),
    ({"tp": 8}, 8, r"tp=8 does not divide the model's 4 attention heads"),
    ({"dp": 2, "cp": 2}, 8, r"context parallelism inside data-parallel ranks is not built"),
    ({"ep": 0}, 8, r"ep must be an integer >= 1, got 0"),
    ({"pp": 2}, 8, r"unknown axis \['pp'\]"),
])
def test_bad_mesh_names_the_sizes(parallel, devices, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(parallel=parallel).resolve(CFG, DeviceFacts(device_count=devices))


@pytest.mark.slow
def test_data_parallel_ranks_speculate_and_keep_their_own_prefix_caches():
    """dp 2 x ep 2 with MTP speculation (up to 2 drafts) and prefix caching on: three prompts
    sharing a 192-token prefix, served twice. The ranks run the speculative step together
    (each verifies its own rows' drafts), the second pass reuses cached blocks on both ranks
    (each rank's own cache and snapshots), and both passes give the single device's tokens,
    logprobs within 1e-5. (One run for both features: each run costs minutes of compiles.)"""
    runs = run_meshes("configs/tiny/tiny-mixed.json:prefix:spec", ["2,2,1"])
    single, ranked = runs["single"], runs["2,2,1"]
    assert ranked["requests_per_rank"] == [4, 2]        # both passes, round robin
    assert ranked["tokens"] == single["tokens"]
    for ours, ref in zip(ranked["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
    assert ranked["drafted"] > 0 and single["drafted"] > 0
    # the second pass: every prompt found its prefix on its own rank
    assert ranked["prefix_hits"] >= 3 and single["prefix_hits"] >= 3
    assert ranked["prefix_hit_tokens"] >= 3 * 192 - 3 * 64


@pytest.mark.slow
def test_bounded_prefix_replay_over_a_mesh():
    """prefix_replay="bounded" (48 tokens) on expert and tensor, and on context parallel
    meshes: one device's tokens, logprobs within 1e-5, the same hits. Data-parallel ranks hit
    where their own cache holds the prefix, so their hits (and a short replay's approximation)
    differ from one device's; with a replay longer than any prefix each hit recomputes its
    windows whole, and the ranks give one device's tokens."""
    short = run_meshes("configs/tiny/tiny-mixed.json:prefix:bounded", ["1,4,2", "1,2,1,2"])
    single = short["single"]
    assert single["prefix_hits"] >= 3 and single["prefix_hit_tokens"] > 0
    for mesh in ("1,4,2", "1,2,1,2"):
        ran = short[mesh]
        assert ran["tokens"] == single["tokens"], mesh
        for ours, one in zip(ran["logprobs"], single["logprobs"], strict=True):
            np.testing.assert_allclose(ours, one, rtol=0, atol=1e-5, err_msg=mesh)
        assert (ran["prefix_hits"], ran["prefix_hit_tokens"]) == (
            single["prefix_hits"], single["prefix_hit_tokens"]), mesh
    whole = run_meshes("configs/tiny/tiny-mixed.json:prefix:replay-all", ["2,2,1"])
    ranked, single = whole["2,2,1"], whole["single"]
    assert ranked["prefix_hits"] >= 3 and ranked["requests_per_rank"] == [4, 2]
    assert ranked["tokens"] == single["tokens"]
    for ours, one in zip(ranked["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(ours, one, rtol=0, atol=1e-5)

