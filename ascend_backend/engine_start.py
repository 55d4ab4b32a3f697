"""The Ascend backend's start-up under `deepinfer_jax.LLM(..., backend="ascend")`
(deepinfer_jax/api/backends.py loads this module by name): the engine options resolved into
the same StepConfig the JAX engine would take on the CPU (`EngineConfig.resolve`: the same
shapes and token buckets, so both backends see the same plans), the checkpoint read with
numpy and placed on the device, and the AscendEngine over the shared scheduler.

What the Ascend engine does not do fails here, before any weight is read: the platform
table's gates (batch-invariant mode, DeepSeek-V4.1, weights kept quantized: a quantized
release runs with weights="bf16", dequantized at load to the float32 it computes in), and
the options it would otherwise ignore (a device mesh, several processes, KV tiers, a bounded
prefix replay, kernel and formulation choices, memory planning, dummy weights, a loaded JAX
model)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

from ascend_backend.checkpoint import read_checkpoint
from ascend_backend.device import torch_device
from ascend_backend.engine import AscendEngine, check_supported
from ascend_backend.params import params_from_flat
from ascend_backend.weights import flat_params
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.options import CPU
from deepinfer_jax.config.platforms import UnsupportedFeatureError
from deepinfer_jax.host.deepseek_v4_chat import chat_format
from deepinfer_jax.host.tokenizer import TextTokenizer

PLATFORM = "ascend"


@dataclasses.dataclass(frozen=True)
class AscendModel:
    """What `LLM.model` is on this backend: the model's config (what the CLI and the demo
    read) and its torch parameters. No reference forward: prompt logprobs, which need one, are
    refused per request (engine.py)."""

    config: ModelConfig
    params: object              # params.py's tree of torch tensors


def default_device() -> str:
    """"npu" where torch_npu is installed (device.py then checks that an NPU is there: a
    machine with torch_npu and no NPU fails at start-up instead of running on the CPU),
    else torch's CPU device (how CI runs this backend)."""
    return "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"


def ignored_options(options: EngineConfig) -> list[str]:
    """The options given that the Ascend engine would not act on (refused, not ignored)."""
    asked = {"parallel": options.parallel.size > 1 or options.parallel.eplb is not None,
             "distributed": options.distributed is not None,
             "kv tiers": options.kv_tiers.enabled,
             "prefix_replay='bounded'": options.prefix_replay != "exact",
             "kernels": options.kernels is not None,
             "step_formulation": options.step_formulation is not None,
             "invariant_tile": options.invariant_tile is not None,
             "gpu_memory_utilization": options.gpu_memory_utilization is not None,
             "device_memory_gib": options.device_memory_gib is not None,
             "engram_tables": options.engram_tables is not None}
    return [name for name, on in asked.items() if on]


def start(options: EngineConfig, model, *, dtype, weights: str, tokenizer, load_format: str,
          dummy_layers: int | None):
    """-> (the AscendEngine, its AscendModel, the TextTokenizer or None, the chat format or
    None); the arguments are LLM's (deepinfer_jax/api/llm.py)."""
    if not isinstance(model, (str, Path)) or load_format != "auto":
        raise EngineConfigError("the Ascend backend reads a checkpoint directory "
                                "(load_format='auto'), not a loaded JAX model or dummy weights")
    if dtype is not None and np.dtype(dtype) != np.float32:
        raise EngineConfigError(f"the Ascend backend computes in float32 (bf16 is not tested "
                                f"against the JAX step yet), got dtype={dtype}")
    ignored = ignored_options(options)
    if ignored:
        raise EngineConfigError(f"the Ascend backend does not support {', '.join(ignored)}")
    cfg = read_model_config(model)
    step_cfg = options.resolve(cfg, CPU)      # the shapes the JAX engine takes on the CPU
    check_supported(cfg, step_cfg)
    if cfg.quantization is not None and weights == "quantized":
        raise UnsupportedFeatureError("quantized_weights", PLATFORM)
    text_tokenizer = TextTokenizer.from_model_dir(model)
    template = chat_format(model, text_tokenizer)
    if tokenizer is not None:     # a tokenizer.json, or a directory holding one
        path = Path(tokenizer)
        path = path.parent if path.is_file() else path
        text_tokenizer = TextTokenizer.from_model_dir(path)
        template = chat_format(path, text_tokenizer) or template
    device = default_device()
    params = params_from_flat(flat_params(cfg, read_checkpoint(model)), torch_device(device))
    # the loop is synchronous: the step reads every token before the next is planned
    host = dataclasses.replace(options.host_options(step_cfg), async_scheduling=False)
    engine = AscendEngine(cfg, params, step_cfg, device=device, seed=options.seed, host=host,
                          tokenizer=text_tokenizer)
    return engine, AscendModel(cfg, params), text_tokenizer, template
