"""deepinfer-jax: an ahead-of-time compiled, functional inference engine for DeepSeek-V4."""

from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.reference_model import Model, load
from deepinfer_jax.weights import CheckpointError, load_params, random_params

__all__ = ["CheckpointError", "ConfigError", "Model", "ModelConfig", "load", "load_params",
           "random_params"]
