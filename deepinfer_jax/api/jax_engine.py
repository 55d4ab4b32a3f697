"""The JAX backend's start-up (api/backends.py): the model loaded (a checkpoint, a loaded
`Model` / `V41Model`, or dummy weights), the compiled engine (engine/core.py) over it, and the
model's tokenizer and chat format. The only module of the LLM's start-up that imports jax:
api/llm.py imports it when the JAX backend is chosen, so that the LLM runs without jax on the
Ascend backend."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from deepinfer_jax.api.cli_llm import model_directory
from deepinfer_jax.api.dummy import LOAD_FORMATS, dummy_config, dummy_model
from deepinfer_jax.api.model import Model, checkpoint_dtype, load
from deepinfer_jax.api.v41_model import V41Model, load_v41
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.engine.core import EngineCore
from deepinfer_jax.engine.devices import local_device_facts
from deepinfer_jax.engine.memory_plan import check_checkpoint_fits
from deepinfer_jax.host.deepseek_v4_chat import chat_format
from deepinfer_jax.host.tokenizer import TextTokenizer
from deepinfer_jax.parallel.distributed import join_processes
from deepinfer_jax.parallel.mesh import make_mesh, param_shardings
from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts


def start(options: EngineConfig, model, *, dtype, weights: str, tokenizer, load_format: str,
          dummy_layers: int | None):
    """-> (the engine, the loaded model, its TextTokenizer or None, its chat format or None);
    the arguments are LLM's (api/llm.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    join_processes(options.distributed)      # before anything starts jax's backend
    device = local_device_facts()
    memory = options.memory(device)
    if isinstance(model, (Model, V41Model)):
        step_config = options.resolve(model.config, device)
        # V4.1's FP4 experts padded where the step's kernel needs it (fp4_pad.py)
        loaded = model.for_compute(step_config.compute) if isinstance(model, V41Model) else model
        text_tokenizer, template = None, None
    elif isinstance(model, (str, Path)) and load_format == "dummy":
        # random weights drawn on the device: no checkpoint, nothing to check before; over a
        # mesh each device draws its own shards (a model no one device holds whole)
        step_config = options.resolve(dummy_config(model, weights, dummy_layers), device)
        mesh = make_mesh(step_config.compute.parallel)
        loaded = dummy_model(model, dtype, weights, dummy_layers, shardings=(
            None if mesh is None else functools.partial(param_shardings, mesh=mesh)))
        text_tokenizer = TextTokenizer.from_model_dir(model_directory(model))
        template = chat_format(model_directory(model), text_tokenizer)
    elif isinstance(model, (str, Path)):
        # resolved from config.json before the weights: a converted store is restored
        # straight into the mesh (load's `mesh`)
        config = read_model_config(model)
        step_config = options.resolve(config, device)
        granule = step_config.compute.fp4_expert_granule    # V4.1's FP4 expert padding
        if memory is not None:        # weights that cannot fit fail before they load
            check_checkpoint_fits(model, memory, quantized=weights == "quantized",
                                  dtype=dtype or checkpoint_dtype(model),
                                  engram_on_host=step_config.engram_rows_on_host,
                                  fp4_k_granule=granule)
        if isinstance(config, V41Config):
            loaded = load_v41(model, dtype=dtype or checkpoint_dtype(model), weights=weights,
                              engram_tables=("host" if step_config.engram_rows_on_host
                                             else "device"), fp4_k_granule=granule)
        else:
            loaded = load(model, dtype=dtype, weights=weights,
                          mesh=make_mesh(step_config.compute.parallel))
        text_tokenizer = TextTokenizer.from_model_dir(model)
        template = chat_format(model, text_tokenizer)
    else:
        raise TypeError(f"model must be a path or a deepinfer_jax.Model, got {type(model)}")
    # FP4 experts in the kernel's tile order where it runs (weights/fp4_tiles.py); a Model
    # passed in keeps its arrays, the engine's are a copy
    params = tile_fp4_experts(loaded.params, step_config.compute.fp4_expert_order,
                              owned=not isinstance(model, (Model, V41Model)))
    if params is not loaded.params:
        loaded = dataclasses.replace(loaded, params=params)
    if tokenizer is not None:     # a tokenizer.json, or a directory holding one
        path = Path(tokenizer)
        path = path.parent if path.is_file() else path
        text_tokenizer = TextTokenizer.from_model_dir(path)
        template = chat_format(path, text_tokenizer) or template
    engine = EngineCore(loaded.config, loaded.params, step_config,
                        options.host_options(step_config), text_tokenizer, memory,
                        engram_token_map=getattr(loaded, "token_map", None))
    return engine, loaded, text_tokenizer, template
