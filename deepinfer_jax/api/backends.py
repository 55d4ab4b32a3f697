"""Which engine runs the LLM's steps, chosen once at start-up from `EngineConfig.backend`
(the argument, else DEEPINFER_BACKEND, else "jax"; config/platforms.py's BACKENDS):

* "jax": the compiled JAX engine (engine/core.py) on NVIDIA GPUs or the CPU (api/jax_engine.py);
* "ascend": the torch / torch_npu step behind the same contract (ascend_backend/engine.py), on
  an Ascend NPU or torch's CPU device.

Either start-up returns (engine, model, tokenizer, chat format), and the engine answers the
verbs the LLM's one host loop (api/llm.py) drives: add_request, step, has_unfinished, abort,
with the shared Scheduler inside. Both are imported here only when chosen: the JAX one's
modules import jax, which an Ascend machine does not have; the Ascend one is loaded by module
name, so that the core keeps no import of it (the import-linter contract "the core never
imports the Ascend backend": the engine runs where it is not installed, and asking for it
there fails with the typed error below)."""

from __future__ import annotations

import importlib

from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.errors import EngineConfigError

# backend -> the module whose `start(options, model, **load)` starts its engine
ENTRY_POINTS = {"jax": "deepinfer_jax.api.jax_engine", "ascend": "ascend_backend.engine_start"}
# backend -> the packages whose absence means "this backend is not installed here"
NEEDS = {"jax": ("jax", "jaxlib", "flax"), "ascend": ("ascend_backend", "torch", "torch_npu")}


def start_engine(options: EngineConfig, model, **load):
    """-> (engine, loaded model (its `config`), TextTokenizer or None, chat format or None) from the
    backend `options.backend` names; load: LLM's dtype, weights, tokenizer, load_format and
    dummy_layers arguments."""
    name = ENTRY_POINTS[options.backend]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in NEEDS[options.backend]:
            raise
        raise EngineConfigError(f"backend {options.backend!r} needs {err.name}, which is not "
                                f"installed here (pip install 'deepinfer-jax[{options.backend}]')"
                                ) from err
    return module.start(options, model, **load)
