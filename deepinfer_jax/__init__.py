"""deepinfer-jax: an ahead-of-time compiled, functional inference engine for DeepSeek-V4.

The names below are the public surface. They load on first use (PEP 562), so that importing a
host module (`deepinfer_jax.host.*`) never imports jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "deepinfer_jax.api.llm",
    "CompletionDelta": "deepinfer_jax.api.llm",
    "Model": "deepinfer_jax.api.model",
    "load": "deepinfer_jax.api.model",
    "convert": "deepinfer_jax.api.model",
    "load_v41": "deepinfer_jax.api.v41_model",
    "ConfigError": "deepinfer_jax.config.model",
    "ModelConfig": "deepinfer_jax.config.model",
    "read_model_config": "deepinfer_jax.config.hf",
    "EngineConfig": "deepinfer_jax.config.engine",
    "FinishReason": "deepinfer_jax.host.request",
    "InvalidRequestError": "deepinfer_jax.host.request",
    "RequestError": "deepinfer_jax.host.request",
    "RequestOutput": "deepinfer_jax.host.request",
    "SamplingParams": "deepinfer_jax.host.request",
    "CheckpointError": "deepinfer_jax.weights",
    "load_params": "deepinfer_jax.weights",
    "random_params": "deepinfer_jax.weights",
    "join_processes": "deepinfer_jax.parallel.distributed",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
