"""Run by test_multihost.py: one process of an engine spanning several (multi-controller JAX,
parallel/distributed.py), each with its own CPU devices. Every process runs the same
requests on the same meshes (parallel_run.py's `run`) and prints its outputs as JSON on
stdout, so the test can check that every process saw the same tokens.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/engine/multihost_run.py \\
        127.0.0.1:PORT NUM_PROCESSES PROCESS_ID [--model FOLDER] "2,4,1" "1,8,1" ...

Without --model: the tiny mixed config's random weights. --model FOLDER: a checkpoint folder
with a reference.npz (the DeepSeek-V4.1 oracle fixtures), its prompts served.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer_jax  # noqa: E402
from deepinfer_jax import SamplingParams  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from tests.engine.parallel_run import ENGINE_OPTIONS, run  # noqa: E402

CONFIG = "configs/tiny/tiny-mixed.json"
# jax.distributed's own bound on waiting for the other processes to join
JOIN_TIMEOUT_S = 120


def reference_prompts(folder: Path) -> list[list[int]]:
    """The oracle fixture's prompts, each row's last `lengths[r]` ids (left-padded rows)."""
    ref = np.load(folder / "reference.npz")
    return [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]


def main() -> None:
    address, processes, process_id, shapes = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                              sys.argv[4:])
    folder = None
    if shapes[:1] == ["--model"]:
        folder, shapes = Path(shapes[1]), shapes[2:]
    distributed = {"coordinator_address": address, "num_processes": processes,
                   "process_id": process_id, "initialization_timeout_s": JOIN_TIMEOUT_S}
    # before the model's arrays start jax's backend
    deepinfer_jax.join_processes(distributed)
    if folder is None:
        cfg = read_model_config(REPO / CONFIG).replace(num_mtp_layers=0)
        model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 5, jnp.float32))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (30, 130, 75)]
    else:
        model, prompts = folder, reference_prompts(folder)
    results = {}
    for shape in shapes:
        dp, ep, tp = map(int, shape.split(","))
        parallel = {"dp": dp, "ep": ep, "tp": tp}
        results[shape] = run(model, prompts, parallel, False, distributed=distributed)
    # a grammar compiles in the background, joining the batch at a step each process picks
    # for itself: refused (the last mesh's steps are compiled already, this engine reuses them)
    llm = deepinfer_jax.LLM(model, parallel=parallel, distributed=distributed, **ENGINE_OPTIONS)
    refused = llm.generate([prompts[0]], SamplingParams(max_tokens=4, regex="[ab]+"),
                           use_tqdm=False)[0]
    results["constrained_error"] = str(refused.error)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
