"""Converted stores (weights/orbax_store.py): a safetensors checkpoint written once in orbax's
layout comes back bitwise as load_params gives it (FP8 / FP4 leaves included), on one device
and straight into a mesh of 8 CPU devices (in a process of its own) where each device reads
only its shard; a store whose config.json disagrees names each tensor with both shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.api.cli import main
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights import CheckpointError, load_params, orbax_store
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks
from tests.conftest import ORACLE_DIR, REPO, xla_flags


@pytest.fixture(scope="module")
def checkpoint():
    """The torch-written FP8 / FP4 tiny checkpoint (tests/oracle/build_quantized.py)."""
    found = sorted(p for p in ORACLE_DIR.glob("quantized-tiny-mixed-*") if (p / "meta.json").exists())
    if not found:
        pytest.fail(f"no quantized oracle fixtures in {ORACLE_DIR}: run `make oracle`")
    return found[-1] / "quantized"


@pytest.fixture(scope="module")
def store(checkpoint, tmp_path_factory):
    return deepinfer_jax.convert(checkpoint, tmp_path_factory.mktemp("store") / "tiny")


def assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("stored, loaded", [("quantized", "quantized"), ("quantized", "bf16"),
                                            ("bf16", "bf16")])
def test_store_loads_as_the_checkpoint_does(checkpoint, tmp_path, dtype, stored, loaded):
    """Every leaf bitwise load_params' (the dtype the checkpoint's own, float32, or bf16); a
    quantized store read with weights="bf16" dequantizes on the device as the loader does."""
    out = deepinfer_jax.convert(checkpoint, tmp_path / "store", dtype=dtype, weights=stored)
    got = deepinfer_jax.load(out, weights=loaded)
    cfg = read_model_config(checkpoint)
    want = load_params(checkpoint, cfg, jnp.dtype(dtype or "float32"),
                       keep_quantized=stored == loaded == "quantized")
    assert_bitwise(got.params, want)
    assert got.config == cfg
    if stored == loaded == "quantized":
        assert isinstance(got.params.layers[1].attn.wq_b, Fp8Blocks)
        assert isinstance(got.params.layers[1].moe.experts.w13, Fp4Blocks)


def test_generation_from_a_store_equals_the_checkpoints(checkpoint, store):
    prompts = [[5, 17, 42, 99, 3], list(range(40, 70))]
    params = deepinfer_jax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shapes = dict(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=16)
    tokens = [[list(o.outputs[0].token_ids)
               for o in deepinfer_jax.LLM(path, **shapes).generate(prompts, params, use_tqdm=False)]
              for path in (checkpoint, store)]
    assert tokens[0] == tokens[1] and len(tokens[0][1]) == 8


def test_cli_converts_with_the_files_beside_the_weights(checkpoint, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(checkpoint, source)
    shutil.copy(REPO / "models/deepinfer-tiny-v4/tokenizer.json", source)
    assert main(["convert", str(source), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "params",
                                                                     "tokenizer.json"]
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert orbax_store.is_store(tmp_path / "out") and not orbax_store.is_store(source)
    # a second convert into it refuses, in one line
    assert main(["convert", str(source), str(tmp_path / "out")]) == 1
    assert "FileExistsError" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 640}, r"embed: stored float32\[512, 64\], the config's float32\[640, 64\]"),
    ({"moe_intermediate_size": 48},
     r"layers\.1\.moe\.experts\.w13: stored Fp4Blocks \(packed \[8, 64, 32\], scale \[8, 2, 64\]\) "
     r"of shape \[8, 64, 64\], the config's \[8, 64, 96\]"),
    ({"num_nextn_predict_layers": 0}, r"mtp\.0\.e_proj\.codes: unexpected"),
])
def test_store_whose_config_disagrees_names_tensor_and_shapes(store, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        deepinfer_jax.load(bad)


def test_store_refuses_another_dtype(store):
    with pytest.raises(ValueError, match=r"holds float32 weights; convert the checkpoint again "
                                         r"with --dtype bfloat16"):
        deepinfer_jax.load(store, dtype=jnp.bfloat16)


MESHES = ("dp=2,ep=4", "ep=4,tp=2")


@pytest.fixture(scope="module")
def mesh_runs(checkpoint, store, tmp_path_factory):
    """Each mesh's engine from the store and from the checkpoint (tests/weights/
    orbax_mesh_run.py), in one process, so the two share their compiled steps."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(REPO / "tests/weights/orbax_mesh_run.py"),
                           str(checkpoint), str(store), str(tmp_path_factory.mktemp("steps")),
                           *MESHES], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MESHES)
def test_store_restores_straight_into_the_mesh(mesh_runs, mesh):
    run = mesh_runs[mesh]
    sizes = {"dp": 1, "ep": 1, "tp": 1} | {a: int(n) for a, n in (p.split("=") for p in mesh.split(","))}
    assert run["devices"] == 8
    assert run["shardings_as_mesh"] and run["same_structure"] and run["equal_values"]
    assert run["tokens"] == run["loaded_tokens"]
    experts = {name: leaf for name, leaf in run["leaves"].items() if ".moe.experts." in name}
    for leaf in experts.values():
        assert leaf["shard"][0] * sizes["dp"] * sizes["ep"] == leaf["shape"][0]
    # What orbax read: each distinct shard once, for the devices holding it, and whole chunks
    # worth exactly that shard's bytes (the store's chunks follow the split axes), never the
    # tensor: an expert stack's reads are one per expert rank, each of its experts alone.
    reads = run["reads"]
    assert {r["array"] for r in reads} == set(run["leaves"])
    for r in reads:
        assert r["chunk_bytes"] == run["leaves"][r["array"]]["shard_bytes"], r
        assert len(r["devices"]) == 8 // len([x for x in reads if x["array"] == r["array"]])
    for name, leaf in experts.items():
        ranks = [r for r in reads if r["array"] == name]
        assert len(ranks) == sizes["dp"] * sizes["ep"] and len(ranks[0]["devices"]) == sizes["tp"]
        assert sorted(r["index"][0][0] for r in ranks) == list(range(0, leaf["shape"][0],
                                                                       leaf["shard"][0]))
    if sizes["tp"] > 1:     # a tensor-parallel projection's columns, half a device
        wq_b = [r for r in reads if r["array"] == "layers.1.attn.wq_b.codes"]
        assert sorted(r["index"][1] for r in wq_b) == [[0, 64], [64, 128]]
