"""One engine spanning two processes (multi-controller JAX, parallel/distributed.py): two
processes of multihost_run.py on the loopback address, 4 CPU devices each, run each mesh over
the 2 x 4 devices, with gloo's collectives between them. Both give the tokens of one process
on one device and its logprobs within 1e-5; the distributed options and the meshes several
processes cannot take fail with errors naming them; structured outputs (whose grammars join
the batch when their background compile ends, at another step in each process) are refused.
DeepSeek-V4.1 (issue 36) spans the two processes too: an oracle fixture's greedy tokens, the
reference's (transformers'), from both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from deepinfer_jax.config.engine import EngineConfig, EngineConfigError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.options import DeviceFacts
from deepinfer_jax.parallel.distributed import join_processes
from tests.conftest import REPO, xla_flags
from tests.model.v41_oracle import FIXTURES as V41_FIXTURES

CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
# (dp, ep, tp): one mesh with every axis, a data-parallel rank a process, the experts over both
# processes and the tensor-parallel pairs inside one (one mesh: each costs the two processes a
# start-up and a compile)
MESHES = ("2,2,2",)
PROCESSES, DEVICES_EACH = 2, 4
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_together(commands: dict[str, list[str]], envs: dict[str, dict]) -> dict[str, str]:
    """Run every command at once; their stdouts once all succeeded. A failed one (or the
    deadline) kills the rest, and the assertion shows each one's stderr."""
    logs = Path(tempfile.mkdtemp(prefix="multihost-"))
    procs = {}
    for name, command in commands.items():
        with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen(command, env=envs[name], stdout=out, stderr=err,
                                           cwd=REPO)
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs.values()):
        failed = any(p.returncode not in (None, 0) for p in procs.values())
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    codes = {name: p.returncode for name, p in procs.items()}
    errors = "\n".join(f"--- {name} (exit {codes[name]}):\n"
                       f"{(logs / f'{name}.err').read_text()[-3000:]}" for name in procs)
    assert all(code == 0 for code in codes.values()), errors
    return {name: (logs / f"{name}.out").read_text() for name in procs}


def _processes(*args: str) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """multihost_run.py's commands and environments, one a process, joined at a free port."""
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={DEVICES_EACH}"))
    names = [f"process{process}" for process in range(PROCESSES)]
    commands = {name: [sys.executable, str(REPO / "tests/engine/multihost_run.py"), address,
                       str(PROCESSES), str(process), *args] for process, name in enumerate(names)}
    return commands, dict.fromkeys(names, env)


def _outputs(outs: dict[str, str]) -> dict:
    return {name: json.loads(out.strip().splitlines()[-1]) for name, out in outs.items()}


@pytest.fixture(scope="module")
def runs():
    commands, envs = _processes(*MESHES)
    commands["single"] = [sys.executable, str(REPO / "tests/engine/parallel_run.py"),
                          "configs/tiny/tiny-mixed.json"]
    envs["single"] = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    return _outputs(_run_together(commands, envs))


@pytest.mark.parametrize("mesh", MESHES)
def test_two_processes_match_one_device(runs, mesh):
    single = runs["single"]["single"]
    dp, ep, tp = map(int, mesh.split(","))
    for process in range(PROCESSES):
        ours = runs[f"process{process}"][mesh]
        assert ours["mesh_devices"] == PROCESSES * DEVICES_EACH == dp * ep * tp
        assert ours["tokens"] == single["tokens"], process
        for got, ref in zip(ours["logprobs"], single["logprobs"], strict=True):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
        # each device holds its share of the experts, each rank its own state
        assert ours["expert_shard_rows"] == CFG.n_routed_experts // (dp * ep)
        assert ours["state_rank_rows"] == (None if dp == 1 else 1)
    # every process read the same outputs: one engine, not two
    assert runs["process0"][mesh] == runs["process1"][mesh]


def test_structured_outputs_are_refused_over_processes(runs):
    for process in range(PROCESSES):
        assert "not supported by an engine spanning processes" in (
            runs[f"process{process}"]["constrained_error"])


@pytest.mark.parametrize("distributed, message", [
    ({"coordinator_address": "localhost", "num_processes": 2, "process_id": 0},
     r"coordinator_address must be 'host:port', got 'localhost'"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2},
     r"process_id must be in \[0, 2\), got 2"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 0, "process_id": 0},
     r"num_processes must be a positive integer, got 0"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2},
     r"missing \['process_id'\]"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 0, "rank": 0},
     r"unknown \['rank'\]"),
])
def test_bad_distributed_options_name_them(distributed, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(distributed=distributed)


def test_a_mesh_over_processes_spans_every_device():
    with pytest.raises(EngineConfigError, match=r"spans 4 devices; one engine over 2 processes "
                                                r"must span all 8"):
        EngineConfig(parallel={"ep": 4}).resolve(CFG, DeviceFacts(device_count=8, process_count=2))


def test_joining_after_the_backend_started_says_what_to_do():
    jax.devices()       # the backend is up: too late for jax.distributed.initialize
    if jax.distributed.is_initialized():
        pytest.skip("this process has joined others")
    with pytest.raises(EngineConfigError, match=r"backend started before the processes joined"):
        join_processes({"coordinator_address": "127.0.0.1:1", "num_processes": 2,
                        "process_id": 0})


@pytest.mark.slow
@pytest.mark.skipif(not V41_FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")
def test_v41_over_two_processes_gives_the_reference_tokens():
    """Fixture a (Engram tables in each process's host memory, 8 experts) on a (2,2,2) mesh
    over both processes: a data-parallel rank a process, its share of the experts a device,
    and transformers' greedy tokens from each process."""
    folder = V41_FIXTURES[0]
    outs = _outputs(_run_together(*_processes("--model", str(folder), "2,2,2")))
    reference = np.load(folder / "reference.npz")["gen_tokens"].tolist()
    experts = read_model_config(folder).n_routed_experts
    for process in range(PROCESSES):
        ran = outs[f"process{process}"]["2,2,2"]
        assert ran["mesh_devices"] == PROCESSES * DEVICES_EACH
        assert ran["tokens"] == reference, process
        assert ran["expert_shard_rows"] == experts // 4 and ran["state_rank_rows"] == 1
    assert outs["process0"] == outs["process1"]

