"""The memory plan from a model's parameters and its compiled step (config/memory.py holds
the cache's layout and the pool's rule; this module supplies the figures only jax knows).

* Weights: the bytes of every leaf of the parameter pytree (loaded arrays, `Fp8Blocks` /
  `Fp4Blocks`, or `jax.eval_shape`'s abstract leaves: no weights are read to plan). Quantized,
  the pytree is the one the loader builds from a released checkpoint: FP8 dense projections
  (1 byte a parameter + a float32 scale per 128 x 128 block), FP4 routed experts (half a byte
  + one scale byte per 32 inputs), everything else as the builder has it.
* Host memory: DeepSeek-V4.1's Engram tables with engram_tables="host" are not in the
  device's pytree; they are reported apart (`MemoryPlan.host_weights`), and the step's
  gathered rows, an input the plan carries, count with the activations.
* Devices: DeepSeek's serving layout, routed experts split N ways (expert parallel),
  everything else replicated (data-parallel attention); figures are per device.
* Activations: XLA's memory analysis of the largest token bucket's compiled step, compiled
  before the real pool is chosen (the temporaries hardly depend on the pool's size: the plan
  keeps `with_slack`'s margin for the difference) over the
  pool the engine has where memory does not cap it (the stated `num_pages`, else every
  slot's reach): where it does not, the engine's own compile finds that step done
  (engine/compile.py's memo) and the plan costs no compile. The probe goes through the step
  cache, so a warm start loads it.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from deepinfer_jax.config.family import facts_of
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.memory import (
    MemoryLimits,
    MemoryPlan,
    best_pool,
    check_weights,
    plan_pool,
)
from deepinfer_jax.config.memory_v41 import (
    engram_product_bytes,
    engram_rows_bytes,
    engram_table_bytes,
    v41_weight_bytes,
)
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.engine.compile import compile_steps
from deepinfer_jax.engine.devices import held_outside_free_block
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.parallel.mesh import abstract_state
from deepinfer_jax.weights import random_params
from pallas_kernels import quantized as q

log = logging.getLogger("deepinfer_jax")

def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16, quantized: bool = False) -> ModelParams:
    """The parameter pytree's shapes and dtypes (MTP block included), without a byte of it;
    quantized: in the release's formats (weights/builder.py says which tensors)."""
    return jax.eval_shape(lambda: random_params(cfg, 0, dtype, release_formats=quantized))


def named_leaves(params) -> list[tuple[str, object]]:
    """(dotted name, leaf) for every weight; a quantized weight is one leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=q.is_quantized)
    return [(jax.tree_util.keystr(path, simple=True, separator="."), leaf)
            for path, leaf in flat]


def leaf_bytes(leaf) -> int:
    """A weight's bytes as one device holds it (a quantized one: codes and scales; an array
    placed on a mesh: its shard)."""
    if q.is_quantized(leaf):
        return sum(leaf_bytes(part) for part in leaf)
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return math.prod(shape) * jnp.dtype(leaf.dtype).itemsize


def weight_bytes(params, devices: int = 1) -> int:
    """Bytes of the weights on one of `devices` devices: routed experts and device Engram
    tables split, the rest replicated."""
    total = 0
    for name, leaf in named_leaves(params):
        size = leaf_bytes(leaf)
        if ".moe.experts." in name and devices > 1:
            experts = leaf.shape[0] if not q.is_quantized(leaf) else jax.tree.leaves(leaf)[0].shape[0]
            size = size // experts * math.ceil(experts / devices)
        elif name.startswith("engram_tables.") and devices > 1:     # rows split the same way
            size = size // leaf.shape[0] * math.ceil(leaf.shape[0] / devices)
        total += size
    return total


def step_peak(executable: jax.stages.Compiled) -> int | None:
    """A compiled step's memory beyond its arguments: XLA's temporaries, generated code and
    outputs that do not alias a donated argument (None where the backend has no analysis)."""
    stats = executable.memory_analysis()
    if stats is None:
        return None
    return (stats.temp_size_in_bytes + stats.generated_code_size_in_bytes
            + max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes))


# XLA's buffer assignment follows the shapes, so the real pool's step may need a little more
# than the probe's: the plan keeps this margin above the measured peak, and check_compiled
# warns if a compiled step still needs more.
SLACK_FRACTION = 0.02
SLACK_MIN_BYTES = 1 << 20


def with_slack(peak: int) -> int:
    """The activations the plan reserves for a measured peak."""
    return peak + max(SLACK_MIN_BYTES, math.ceil(peak * SLACK_FRACTION))


def measured_activations(params: ModelParams, cfg: ModelConfig, step_cfg: StepConfig,
                         host: HostOptions, mesh: Mesh | None = None) -> int | None:
    """The largest bucket's activation peak, from its step compiled over step_cfg's pool (the
    truncating sampler's variant where there are two; the speculative step's too)."""
    state = abstract_state(cfg, step_cfg, params.embed.dtype, mesh)
    truncations = (True,) if step_cfg.compute.launch_bound else None
    peaks = []
    for speculative in (False, True) if step_cfg.spec_tokens else (False,):
        steps = compile_steps(params, state, cfg, step_cfg, host, speculative=speculative,
                              truncations=truncations, buckets=(max(step_cfg.token_buckets),))
        peaks += [step_peak(c.executable) for c in steps.by_key.values()]
    return None if None in peaks else max(peaks)


def engine_plan(params: ModelParams, cfg: ModelConfig, step_cfg: StepConfig,
                host: HostOptions, limits: MemoryLimits, mesh: Mesh | None = None,
                host_weights: int = 0) -> tuple[StepConfig, MemoryPlan]:
    """The step's shapes with the planned pool, and the plan. Raises InsufficientMemoryError
    before the real steps compile: weights alone over the budget before any compile, the
    rest after the probe's. host_weights: bytes of weights kept in host memory (V4.1's Engram
    tables), reported apart; the step's gathered rows (an input, which XLA's analysis of its
    temporaries leaves out) count with the activations. What the allocator holds beyond the
    weights outside its largest free block is planned as unusable: the step's temporaries are
    one block, and holes between freed buffers cannot take it."""
    weights = weight_bytes(params)
    check_weights(weights, limits.device_bytes, limits.utilization)
    activations = measured_activations(params, cfg, step_cfg, host, mesh)
    measured = activations is not None
    family = facts_of(cfg)               # the state's bytes: DeepSeek-V4's or V4.1's
    if not measured:
        activations = family.activation_estimate(cfg, step_cfg)
    else:
        activations = with_slack(activations)
        if isinstance(cfg, V41Config):
            activations += engram_rows_bytes(step_cfg)
    dtype_bytes = jnp.dtype(params.embed.dtype).itemsize
    devices = jax.local_devices()[:1] if mesh is None else mesh.local_devices
    plan = plan_pool(MemoryPlan(
        weights=weights, activations=activations, activations_measured=measured,
        unusable=max(0, held_outside_free_block(devices) - weights) if limits.reported else 0,
        fixed_cache=family.fixed_cache_bytes(cfg, step_cfg, dtype_bytes),
        page_bytes=family.page_bytes(cfg, step_cfg.page_size, dtype_bytes),
        page_size=step_cfg.page_size, pages=0, max_num_seqs=step_cfg.max_num_seqs,
        max_model_len=step_cfg.max_model_len, blocks_per_seq=step_cfg.max_blocks_per_seq,
        device_bytes=limits.device_bytes, utilization=limits.utilization,
        host_weights=host_weights), limits.num_pages)
    return dataclasses.replace(step_cfg, num_pages=plan.pages), plan


def config_plan(cfg: ModelConfig, step_cfg: StepConfig, *, devices: int = 1,
                quantized: bool = True, device_bytes: int | None = None,
                utilization: float = 0.9, dtype=jnp.bfloat16) -> MemoryPlan:
    """A plan from the configuration alone (`deepinfer plan`): weights from the parameter
    pytree's shapes, the activation estimate, and as many pages as fit (it may not fit:
    `plan.fits`). No weights are read and nothing is compiled."""
    dtype_bytes = jnp.dtype(dtype).itemsize
    family = facts_of(cfg)
    host_weights = 0
    if isinstance(cfg, V41Config):
        on_host = step_cfg.engram_rows_on_host
        weights = v41_weight_bytes(cfg, quantized, dtype_bytes, engram_on_host=on_host,
                                   fp4_k_granule=step_cfg.compute.fp4_expert_granule,
                                   devices=devices)
        if on_host:      # the tables, and so the step's rows, in the load's dtype
            host_weights = engram_table_bytes(cfg, dtype_bytes)
            step_cfg = dataclasses.replace(step_cfg, engram_row_dtype=jnp.dtype(dtype).name)
        else:            # the step hashes: its products join the weights (engram_rows.py)
            weights += engram_product_bytes(cfg)
    else:
        weights = weight_bytes(abstract_params(cfg, dtype, quantized), devices)
    experts = math.ceil(cfg.n_routed_experts / devices)
    notes = ((f"weights {'quantized as released (FP8 dense projections, FP4 routed experts; '
                          'from shapes)' if quantized else 'in bf16 (norms, mixing, biases in f32)'}"
              ),
             "activations: an estimate (config/memory.py activation_estimate); LLM(...) "
             "measures the compiled step instead")
    granule, inter = step_cfg.compute.fp4_expert_granule, cfg.moe_intermediate_size
    if isinstance(cfg, V41Config) and quantized and inter % granule:
        notes += (f"FP4 routed experts held at intermediate size {-(-inter // granule) * granule}"
                  f" ({inter} zero-padded to the FP4 kernel's K granule, weights/fp4_pad.py)",)
    if devices > 1:
        tables = (", the Engram tables' rows too" if isinstance(cfg, V41Config)
                  and cfg.engram is not None and not step_cfg.engram_rows_on_host else "")
        notes += (f"layout: routed experts split {devices} ways (expert parallel, {experts} "
                  f"of {cfg.n_routed_experts} a device){tables}, everything else replicated "
                  f"(data-parallel attention); slots and pages are each device's own",)
    return best_pool(MemoryPlan(
        weights=weights, activations=family.activation_estimate(cfg, step_cfg),
        activations_measured=False,
        fixed_cache=family.fixed_cache_bytes(cfg, step_cfg, dtype_bytes),
        page_bytes=family.page_bytes(cfg, step_cfg.page_size, dtype_bytes),
        page_size=step_cfg.page_size, pages=0, max_num_seqs=step_cfg.max_num_seqs,
        max_model_len=step_cfg.max_model_len, blocks_per_seq=step_cfg.max_blocks_per_seq,
        device_bytes=device_bytes, utilization=utilization, devices=devices, notes=notes,
        host_weights=host_weights))


def check_checkpoint_fits(path, limits: MemoryLimits, quantized: bool = True,
                          dtype=jnp.bfloat16, engram_on_host: bool = False,
                          fp4_k_granule: int = 1) -> None:
    """Before a checkpoint loads: its weights counted from its config.json (quantized where
    the checkpoint is and the load keeps it so), which must fit the budget. The exact check
    follows once they are loaded (`engine_plan`). DeepSeek-V4.1: config/memory_v41.py's
    count in the loader's formats (FP4 experts padded to `fp4_k_granule`), less the Engram
    tables where they stay in host memory."""
    cfg = read_model_config(path)
    if isinstance(cfg, V41Config):
        weights = v41_weight_bytes(cfg, quantized and cfg.quantization is not None,
                                   jnp.dtype(dtype).itemsize, engram_on_host, fp4_k_granule)
    else:
        weights = weight_bytes(abstract_params(cfg, quantized=quantized
                                               and cfg.quantization is not None))
    check_weights(weights, limits.device_bytes, limits.utilization, f" of {path}")


def check_compiled(plan: MemoryPlan, *steps) -> None:
    """After the real buckets compiled: warn if one needs more than the plan keeps for
    activations (the probe's peak and its margin; the plan assumes the largest bucket is the
    peak)."""
    peaks = [step_peak(c.executable) for group in steps if group is not None
             for c in group.by_key.values()]
    peak = max((p for p in peaks if p is not None), default=0)
    if plan.activations_measured and peak > plan.activations:
        log.warning("deepinfer_jax: a compiled step needs %d bytes of activations, more than "
                    "the %d the memory plan keeps (the largest bucket's, measured, and a "
                    "margin)", peak, plan.activations)
