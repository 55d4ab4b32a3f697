"""Runs in .venv-ascend: greedy generation with the Ascend engine (ascend_backend/engine.py,
the shared scheduler driving the torch step) on the prompts a JAX-side test wrote.

    python tests/ascend/torch_generate.py DIR

DIR holds params.npz (leaves by dotted path) and case.json (config.json path, the step's
shapes, prompts, max_tokens); this writes result.json: each prompt's generated tokens and the
scheduler's preemption count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ascend_backend.device import torch_device  # noqa: E402
from ascend_backend.engine import AscendEngine, step_config  # noqa: E402
from ascend_backend.params import params_from_flat  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.host.request import SamplingParams  # noqa: E402


def main(directory: Path) -> None:
    case = json.loads((directory / "case.json").read_text())
    cfg = read_model_config(Path(case["config"]))
    step_cfg = step_config(cfg, **{**case["step"], "token_buckets": tuple(case["step"]["token_buckets"])})
    params = params_from_flat(dict(np.load(directory / "params.npz")), torch_device("cpu"))
    engine = AscendEngine(cfg, params, step_cfg)
    done = engine.generate(case["prompts"], SamplingParams(max_tokens=case["max_tokens"],
                                                           ignore_eos=True))
    (directory / "result.json").write_text(json.dumps({
        "tokens": [r.generated for r in done],
        "preemptions": engine.scheduler.num_preemptions}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
