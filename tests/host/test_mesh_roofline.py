"""bench/lib/rooflines.py's per-device decode roofline (bench/e2e.py --parallel): on one
device it is the single-device roofline e2e.py has always used, the MTP block (which a plain
step never reads) is left out, and the routed experts a device holds are its placement's
share."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from bench.lib.rooflines import decode_roofline, mesh_decode_roofline, mesh_weight_counts, weight_counts
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights import random_params
from tests.conftest import REPO

CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json")      # 8 experts, an MTP block


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0, jnp.bfloat16)


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_one_device_is_the_single_device_roofline(params, batch):
    assert params.mtp                   # the config's MTP block is drawn ...
    counts = mesh_weight_counts(params, CFG, expert_ranks=1)
    # ... and not counted: the counts of the model without it
    assert {k: counts[k] for k in weight_counts(params, CFG)} == weight_counts(
        params.replace(mtp=()), CFG)
    assert counts["device_dense_bytes"] == counts["dense_bytes"]
    mesh = mesh_decode_roofline(counts, CFG, batch, batch, 4096, copy_tbps=4.0)
    single = decode_roofline(counts, CFG, batch, 4096, copy_tbps=4.0)
    assert mesh["bytes_per_step"] == pytest.approx(single["bytes_per_step"], rel=1e-12)
    assert batch / mesh["seconds"] == pytest.approx(single["tokens_per_s"], rel=1e-12)


def test_a_device_reads_its_share_of_the_experts(params):
    one = mesh_weight_counts(params, CFG, expert_ranks=1)
    eight = mesh_weight_counts(params, CFG, expert_ranks=8)
    assert (one["local_experts"], eight["local_experts"]) == (8, 1)
    # 512 tokens hit every expert: each device then reads exactly its one expert a layer
    full, split = (mesh_decode_roofline(c, CFG, 64, 512, 4096, 4.0)["bytes_per_step"]
                   for c in (one, eight))
    expert_bytes = CFG.num_layers * one["per_expert_bytes"]
    assert full - split == pytest.approx(7 * expert_bytes, rel=1e-9)
