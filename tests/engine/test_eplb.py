"""The expert-parallel load balancer (parallel/eplb.py).

On the host alone: the assignment gives busy experts replicas and spreads the load, its
tables and weight moves are consistent. On 8 CPU devices (eplb_run.py, a process of its own):
a skewed router on an ep=4 mesh with 4 redundant slots, rebalanced mid-run, gives the single
device's tokens and logprobs bitwise, compiles nothing while serving, and cuts the busiest
device's load; and the engine rebalances on its own every `step_interval` steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.engine import EngineConfig, EngineConfigError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.options import DeviceFacts
from deepinfer_jax.model.moe import NO_EXPERT, physical_slots
from deepinfer_jax.model.params import ExpertPlacement
from deepinfer_jax.parallel.eplb import (
    balanced_assignment,
    device_loads,
    placement_tables,
    transfer_sources,
)
from tests.conftest import REPO, xla_flags

CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json")


def test_busy_experts_get_replicas_on_different_devices():
    load = np.array([1000, 10, 10, 10, 500, 10, 10, 10], float)
    assignment = balanced_assignment(load, slots=12, devices=4)
    replicas = np.bincount(assignment, minlength=8)
    # the 4 spares, each to the largest load per replica: 0 (1000), 0 (500, the lower of a
    # tie), 4 (500), 0 (333)
    assert replicas.tolist() == [4, 1, 1, 1, 2, 1, 1, 1]
    held = assignment.reshape(4, 3)
    assert all(sorted(set(row)) == sorted(row) for row in held)   # no device holds one twice
    # the busiest device carries a share of expert 0, not all of it (1000 + 2 others)
    assert device_loads(load, assignment, 4).max() < 600
    even = balanced_assignment(np.ones(8), slots=8, devices=4)
    assert sorted(even.tolist()) == list(range(8))


def test_tables_and_moves_are_consistent():
    old = balanced_assignment(np.ones(8), 12, 4)
    new = balanced_assignment(np.array([9, 1, 1, 1, 1, 1, 1, 9.0]), 12, 4)
    slots, count = placement_tables(new, 8)
    for expert in range(8):
        assert sorted(slots[expert, :count[expert]].tolist()) == np.flatnonzero(new == expert).tolist()
    sources = transfer_sources(old, new, 4)
    assert (old[sources] == new).all()                           # every slot gets its expert
    same_device = [s for s, src in enumerate(sources) if src // 3 == s // 3]
    assert all(new[s] in old[3 * (s // 3): 3 * (s // 3) + 3] for s in same_device)
    with pytest.raises(ValueError, match=r"experts \[7\] have no slot"):
        placement_tables(np.array([0, 1, 2, 3, 4, 5, 6, 0]), 8)


def test_pairs_go_to_their_experts_replicas_in_turn():
    assignment = np.array([3, 0, 3, 1, 2, 3], np.int32)          # expert 3 thrice
    slots, count = placement_tables(assignment, 4)
    placement = ExpertPlacement(jnp.asarray(slots), jnp.asarray(count))
    experts = jnp.asarray([[3, 0], [3, NO_EXPERT], [3, 2]], jnp.int32)
    got = np.asarray(physical_slots(experts, placement))
    routed = np.asarray(experts) != NO_EXPERT
    assert (assignment[got[routed]] == np.asarray(experts)[routed]).all()
    assert got[1, 1] == NO_EXPERT
    assert sorted(got[:, 0].tolist()) == [0, 2, 5]               # pairs 0, 2, 4: each replica once


def test_bad_balancer_options_name_the_sizes():
    with pytest.raises(EngineConfigError, match=r"8 routed experts \+ 3 redundant = 11 slots, "
                                                r"which dp x cp x ep = 1 x 1 x 4 does not divide"):
        EngineConfig(parallel={"ep": 4, "eplb": {"num_redundant_experts": 3}}).resolve(
            CFG, DeviceFacts(device_count=4))
    with pytest.raises(EngineConfigError, match=r"unknown option \['window'\]"):
        EngineConfig(parallel={"ep": 4, "eplb": {"window": 3}})


@pytest.fixture(scope="module")
def run():
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(REPO / "tests/engine/eplb_run.py")], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rebalancing_mid_run_changes_no_output_and_compiles_nothing(run):
    assert run["rebalances"] == 1 and run["compiles_while_serving"] == 0
    assert run["tokens"] == run["reference_tokens"]
    assert run["logprobs"] == run["reference_logprobs"]          # bitwise
    assert run["expert_rows_per_device"] == (8 + 4) // 4


def test_rebalancing_follows_the_skewed_load(run):
    load = np.asarray(run["load"])
    routed = [i for i, kind in enumerate(CFG.mlp_types) if kind.name == "MOE"]
    assert routed
    for i in routed:
        assert set(np.argsort(load[i])[-2:]) == {2, 5}           # the skew is real
        replicas = np.bincount(run["assignments"][i], minlength=8)
        assert replicas[2] > 1 and replicas[5] > 1
        assert run["max_device_load_after"][i] < 0.6 * run["max_device_load_before"][i]


def test_the_engine_rebalances_every_step_interval(run):
    assert run["auto_rebalances"] == run["auto_steps"] // 4 + 1 >= 3   # + the one asked for
    assert run["auto_tokens"] == run["reference_tokens"][:3]
    assert run["auto_logprobs"] == run["reference_logprobs"][:3]
