"""DeepSeek-V4.1 over a device mesh (issue 36; 8 CPU devices in a process of their own,
v41_parallel_run.py): data-parallel attention with each rank's Engram rows and prefix cache,
expert, tensor and context parallelism, batch-invariant mode on a mesh, and the Engram tables
split by rows over the devices (the asynchronous loop, the step hashing). The reference is
transformers' implementation (the oracle fixtures' `gen_tokens`): every mesh gives its greedy
tokens, with logprobs within 1e-5 of one device's (split projections and exchanged tokens add
in another order). Each device holds its share of the routed experts, and the plan's weights,
counted from the placed arrays' shards, equal the count from the config alone
(`deepinfer plan --devices N`) where only the experts are split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax.config.hf import read_model_config
from tests.conftest import REPO, xla_flags
from tests.model.v41_oracle import FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

# fixture a: 8 experts, 4 heads in 2 output groups, Engram; fixture b: 6 experts
CASES = {"a": ("2,2,2:device", "2,4,1:prefix", "1,4,1,2:invariant"), "b": ("1,1,1,2:invariant",)}


# b (context parallelism on the second fixture) is in the slow tier: a runs cp too
@pytest.fixture(scope="module", params=["a", pytest.param("b", marks=pytest.mark.slow)])
def runs(request):
    folder = FIXTURES["ab".index(request.param)]
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(REPO / "tests/engine/v41_parallel_run.py"),
                           str(folder), *CASES[request.param]], env=env, capture_output=True,
                          text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, json.loads(done.stdout.strip().splitlines()[-1])


def test_every_mesh_gives_the_reference_tokens(runs):
    folder, results = runs
    reference = np.load(folder / "reference.npz")["gen_tokens"].tolist()
    cfg = read_model_config(folder)
    single = results["1,1,1"]
    assert single["tokens"] == reference and single["mesh_devices"] == 1
    for case, ran in results.items():
        if case == "1,1,1":
            continue
        shape, *flags = case.split(":")
        dp, ep, tp, cp = (list(map(int, shape.split(","))) + [1])[:4]
        assert ran["mesh_devices"] == dp * ep * tp * cp, case
        assert ran["tokens"] == reference, case
        for ours, one in zip(ran["logprobs"], single["logprobs"], strict=True):
            np.testing.assert_allclose(ours, one, rtol=0, atol=1e-5, err_msg=case)
        assert ran["expert_shard_rows"] == cfg.n_routed_experts // (dp * ep * cp), case
        if tp == 1:
            assert ran["planned_weight_bytes"] == ran["config_weight_bytes"], case
        assert ran["planned_weight_bytes"] < single["planned_weight_bytes"], case
        if dp > 1:                  # each rank its own state and its share of the prompts
            assert ran["state_rank_rows"] == 1, case
            assert sum(ran["requests_per_rank"]) == 3 * (2 if "prefix" in flags else 1), case
            assert min(ran["requests_per_rank"]) > 0, case
        if "invariant" in flags:    # a prompt alone gives its batched logprobs bit for bit
            assert ran["alone_logprobs"] == ran["logprobs"], case
        if "device" in flags:
            # the Engram tables on the devices, each holding its share of the rows (padded to
            # a multiple of the devices); the step hashes, so the loop runs ahead
            split = dp * ep * cp
            assert ran["engram_shard_rows"] == [-(-n // split) for n in cfg.engram.num_embeddings]
            assert ran["async_scheduling"], case
        else:
            assert ran["engram_shard_rows"] == [] and not ran["async_scheduling"], case
        if "prefix" in flags:
            # the 70-token prompt's first chunk ends on a block end (a snapshot): its second
            # pass goes back to the rank caching it (host/ranks.py), which by load alone it
            # does not (the other rank has more free pages)
            assert ran["prefix_hits"] >= 1, case
