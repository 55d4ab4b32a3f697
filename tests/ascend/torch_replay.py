"""Runs in the Ascend backend's environment (.venv-ascend: Python 3.11 and CPU torch, no
jax): replays the plans a JAX-side test wrote through the torch step and writes its outputs.

    python tests/ascend/torch_replay.py DIR

DIR holds params.npz (the parameter tree's leaves by dotted path), case.json (the model's
config.json path, the StepConfig's shapes, the number of steps) and plan_<i>.npz; this writes
out_<i>.npz: every token's logits and the StepOutput's fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ascend_backend.device import torch_device  # noqa: E402
from ascend_backend.model.state import init_state  # noqa: E402
from ascend_backend.params import params_from_flat  # noqa: E402
from ascend_backend.step import step_with_logits  # noqa: E402
from deepinfer_jax.config.compute import ComputeConfig  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.config.step import StepConfig  # noqa: E402
from deepinfer_jax.contract import BatchPlan  # noqa: E402


def main(directory: Path) -> None:
    case = json.loads((directory / "case.json").read_text())
    cfg = read_model_config(Path(case["config"]))
    step_cfg = StepConfig(**{**case["step"], "token_buckets": tuple(case["step"]["token_buckets"])},
                          speculative=None, compute=ComputeConfig())
    device = torch_device("cpu")
    params = params_from_flat(dict(np.load(directory / "params.npz")), device)
    state = init_state(cfg, step_cfg, device)
    with torch.inference_mode():
        for i in range(case["steps"]):
            plan = BatchPlan(**dict(np.load(directory / f"plan_{i}.npz")))
            state, out, logits = step_with_logits(params, state, plan, cfg=cfg,
                                                  step_cfg=step_cfg)
            np.savez(directory / f"out_{i}.npz", logits=logits.numpy(),
                     next_tokens=out.next_tokens, logprob=out.logprob, top_ids=out.top_ids,
                     top_logprobs=out.top_logprobs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
