"""deepinfer-jax: an ahead-of-time compiled, functional inference engine for DeepSeek-V4."""

from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.llm import LLM, CompletionDelta
from deepinfer_jax.reference_model import Model, load
from deepinfer_jax.request import (
                                   FinishReason,
                                   InvalidRequestError,
                                   RequestError,
                                   RequestOutput,
                                   SamplingParams,
)
from deepinfer_jax.weights import CheckpointError, load_params, random_params

__all__ = ["LLM", "CheckpointError", "CompletionDelta", "ConfigError", "EngineConfig",
           "FinishReason", "InvalidRequestError", "Model", "ModelConfig", "RequestError",
           "RequestOutput", "SamplingParams", "load", "load_params", "random_params"]
