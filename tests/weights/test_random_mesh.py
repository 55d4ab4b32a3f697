"""Random weights drawn straight into a device mesh (weights.random_params's `shardings`):
each device draws only its shards, so `load_format="dummy"` serves a model no single device
could hold whole (V4-Flash's 43 layers over 8 GPUs). Checked in a process of 8 CPU devices
(tests/weights/random_mesh_run.py): the same values as the draw on one device, the shardings
the engine's mesh gives each leaf, and the dummy path handing the engine its weights already
split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, xla_flags

CONFIG = REPO / "configs" / "tiny" / "tiny-mixed.json"
LAYOUT = "dp=2,ep=4"       # the routed experts split over dp x ep = 8 devices


@pytest.fixture(scope="module")
def run() -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(REPO / "tests/weights/random_mesh_run.py"),
                           str(CONFIG), LAYOUT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_draw_into_the_mesh_equals_the_draw_on_one_device(run):
    assert run["devices"] == 8
    for name in ("drawn", "engine"):
        assert run[name]["equal_values"] and run[name]["shardings_as_mesh"], name
        assert run[name]["expert_rows"], name
        for rows, shard in run[name]["expert_rows"].values():
            assert shard * 8 == rows


def test_dummy_weights_reach_the_engine_already_split(run):
    """The dummy path's draw itself returns each device's eighth of every expert stack (not
    the whole model on one device, placed after), and the engine generates from it."""
    [drawn] = run["draws"][-1:]
    assert len(run["draws"]) == 2           # the test's own dummy_model, then the engine's
    assert drawn == {path: rows // 8 for path, (rows, _) in run["engine"]["expert_rows"].items()}
    assert len(run["tokens"]) == 4
    assert run["mix_parts"]        # the bf16 engine made its mHC weight parts once (mhc.py)
