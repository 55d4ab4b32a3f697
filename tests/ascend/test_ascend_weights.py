"""The Ascend backend reads a checkpoint itself (numpy, no jax: ascend_backend/checkpoint.py
and weights.py): its parameter tree equals the JAX engine's, leaf by leaf, for the three tiny
oracle checkpoints (HF names, sliding / CSA / HCA layers, hash and routed MoE, an MTP block,
tied and untied heads as the configs have them)."""

from __future__ import annotations

import numpy as np
import pytest

import deepinfer_jax
from tests.ascend.ascend_env import needs_ascend_env, run_in_ascend_env
from tests.ascend.jax_side import flat_params
from tests.conftest import ORACLE_CASES, ORACLE_DIR, oracle_case

pytestmark = [needs_ascend_env, pytest.mark.oracle]

READ = ("import sys, numpy as np\n"
        "from ascend_backend.checkpoint import read_checkpoint\n"
        "from ascend_backend.weights import flat_params\n"
        "from deepinfer_jax.config.hf import read_model_config\n"
        "path, out = sys.argv[1], sys.argv[2]\n"
        "cfg = read_model_config(path + '/config.json')\n"
        "np.savez(out, **flat_params(cfg, read_checkpoint(path)))\n")


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_checkpoint_reads_into_the_jax_engines_tree(name, tmp_path):
    case = oracle_case(name)
    run_in_ascend_env("-c", READ, str(case.checkpoint), str(tmp_path / "ours.npz"))
    ours = dict(np.load(tmp_path / "ours.npz"))
    theirs = flat_params(case.model.params)
    assert sorted(ours) == sorted(theirs)
    for path, array in theirs.items():
        assert ours[path].shape == array.shape, path
        np.testing.assert_array_equal(ours[path], array, err_msg=path)


def test_quantized_release_dequantizes_to_the_jax_loaders_values(tmp_path):
    """The quantized tiny-mixed release (FP8 dense projections, FP4 routed experts, E8M0
    scales): the Ascend reader's float32 tree equals the JAX loader's dequantized one
    (weights="bf16": dequantized at load, here to float32), leaf by leaf, exactly."""
    [case] = sorted(ORACLE_DIR.glob("quantized-tiny-mixed-*"))[-1:]
    checkpoint = case / "quantized"
    run_in_ascend_env("-c", READ, str(checkpoint), str(tmp_path / "ours.npz"))
    ours = dict(np.load(tmp_path / "ours.npz"))
    theirs = flat_params(deepinfer_jax.load(checkpoint, dtype=np.float32, weights="bf16").params)
    assert sorted(ours) == sorted(theirs)
    for path, array in theirs.items():
        assert array.dtype != np.uint8, path           # nothing left quantized on their side
        np.testing.assert_array_equal(ours[path], array, err_msg=path)
