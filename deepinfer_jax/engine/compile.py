"""Ahead-of-time compilation of the step for every declared bucket, with the persistent cache.

At start-up each token bucket's step is lowered and compiled once (`jit(...).lower(...)
.compile()`); serving then only calls these executables, which raise on a shape mismatch
instead of recompiling. The step cache (engine/step_cache.py) keeps each compiled step on
disk, so that a second process loads it instead of tracing it again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import BatchPlan
from deepinfer_jax.device.speculative import spec_step
from deepinfer_jax.device.step import step
from deepinfer_jax.engine import step_cache
from deepinfer_jax.engine.transfer import Wire
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.precision import matmul_precision
from deepinfer_jax.model.state import StateCache
from deepinfer_jax.parallel.mesh import mesh_context, over_ranks, step_out_shardings

_cache_dir: str | None = None


def enable_persistent_cache(directory: str | None) -> None:
    """Point jax's persistent compilation cache at `directory` (None or "" leaves it off)."""
    global _cache_dir
    if not directory or directory == _cache_dir:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.set_cache_dir(directory)
    _cache_dir = directory


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A bucket's compiled step on the wire (transfer.py): called with the host's numpy plan, it
    returns the new state and the step's output as one device buffer, which `read` turns
    into the output dataclass once fetched."""

    executable: jax.stages.Compiled
    plan_wire: Wire
    output_wire: Wire
    # On GPUs the plan goes by an explicit, asynchronous jax.device_put, the path the GPU
    # figures were taken with: the executable's own transfer of a numpy argument has to be
    # done with the host buffer before the call returns, and it is untimed there. On the CPU
    # the numpy buffer goes in as is: it costs the host a fraction of a jax.device_put
    # (docs/performance-log.md). Decided once, at compile time.
    explicit_transfer: bool = False
    # data-parallel attention ranks (parallel/mesh.py over_ranks): > 1, the step takes a plan
    # per rank and returns an output per rank
    ranks: int = 1
    # Over several processes (parallel/distributed.py) the explicit transfer's target: the
    # plan as the executable takes it, each process placing its own shards of the buffer
    # (every process has built the same plan). None: the default device, as in one process.
    plan_sharding: jax.sharding.Sharding | None = None

    def __call__(self, params: ModelParams, state: StateCache,
                 plan: BatchPlan | Sequence[BatchPlan]):
        buffer = (self.plan_wire.pack_host(plan) if self.ranks == 1 else
                  np.stack([self.plan_wire.pack_host(p) for p in plan]))
        if self.explicit_transfer:
            return self.executable(params, state, jax.device_put(buffer, self.plan_sharding))
        # the step's one transfer, allowed by name so that a "disallow" transfer guard (as the
        # loop's test sets) still catches any other. Over several processes jax places each
        # process's own shards of the (same) numpy buffer.
        with jax.transfer_guard_host_to_device("allow"):
            return self.executable(params, state, buffer)

    def read(self, output: jax.Array):
        """The output buffer -> StepOutput / SpecStepOutput of numpy arrays (a list of them, a
        rank's each, with data-parallel ranks); waits for it."""
        host = jax.device_get(output)     # explicit: a "disallow" transfer guard lets it by
        if self.ranks == 1:
            return self.output_wire.unpack_host(host)
        return [self.output_wire.unpack_host(row) for row in host]


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """Every bucket's compiled step. Where a branch on the device would stall the host
    (`launch_bound`), each bucket has two, the sampler with and without truncation (top-k/p,
    min-p: a sort over the vocabulary), and the scheduler's decision says which a step needs
    (`ScheduleDecision.truncating_sampler`); elsewhere one, which branches on the device (key
    None)."""

    by_key: dict[tuple[int, bool | None], CompiledStep]

    def select(self, bucket: int, truncating_sampler: bool) -> CompiledStep:
        if (bucket, None) in self.by_key:
            return self.by_key[bucket, None]
        return self.by_key[bucket, truncating_sampler]


# Batch-invariant mode: XLA may otherwise keep bf16 intermediates in higher precision inside
# fusions ("excess precision"), and fusion decisions follow the shapes, so a row's rounding
# would depend on the batch; and GPU scatter-adds / autotuning must be deterministic.
# XLA's GPU compiler also turns normalizations (a row's reduction and the elementwise ops
# around it) into Triton fusions whose tile, chosen by a cost model from the whole shape,
# sets the order a row is summed in; where rows are few (the head's, one per slot) that
# order followed the engine's slot count. Without the rewriter they are XLA's own
# reductions, which may still round a row by the shapes around it, so the work whose row
# count follows the slot count runs in fixed row tiles (model/invariant.per_sequence).
BATCH_INVARIANT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False,
                                    "xla_gpu_deterministic_ops": True,
                                    "xla_disable_hlo_passes": "triton-softmax-rewriter"}


# Engines of equal shapes in one process (a notebook that builds its LLM again, a test suite)
# share their compiled steps, and so does the memory plan's probe with the engine it plans
# (engine/memory_plan.py): the persistent cache saves XLA's compile, but tracing the step
# again still takes seconds a bucket. Per trace key, each (bucket, sampler variant)'s step;
# bounded: the least recently used trace key goes first.
_MEMO_SIZE = 32
_memo: collections.OrderedDict[tuple, dict[tuple[int, bool | None], CompiledStep]] = \
    collections.OrderedDict()


def _trace_key(params: ModelParams, state: StateCache, cfg: ModelConfig,
               step_cfg: StepConfig, speculative: bool) -> tuple:
    """What the compiled steps depend on: the model and step configs (less the prefix cache's
    snapshot pool, which the step never reads; the ComputeConfig stays: formulation and
    kernels change the program), the arguments' shapes, dtypes and shardings (not their
    values), and the backend. The host's options are not part of it."""
    step_only = dataclasses.replace(step_cfg, enable_prefix_caching=False, num_snapshots=0)
    leaves, tree = jax.tree.flatten((params, state))
    avals = tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)
    return (cfg, step_only, speculative, tree, avals, jax.default_backend(),
            jax.config.jax_enable_x64)


def compile_steps(params: ModelParams, state: StateCache, cfg: ModelConfig,
                  step_cfg: StepConfig, host: HostOptions,
                  speculative: bool = False,
                  truncations: tuple[bool | None, ...] | None = None,
                  buckets: tuple[int, ...] | None = None) -> CompiledSteps:
    """The step compiled for every token bucket (and sampler variant; state donated): the
    plain step, or the speculative one (verify drafts, then MTP drafting). params and state
    may be abstract (their shapes, dtypes and shardings are what is compiled for). Memoised per
    process and step (`_trace_key`, bucket, variant), and across processes by the step cache
    (engine/step_cache.py) under the compilation cache directory. `truncations` and `buckets`
    restrict the sampler variants and buckets compiled (the memory probe's,
    engine/memory_plan.py); None: the formulation's, every declared bucket."""
    trace_key = _trace_key(params, state, cfg, step_cfg, speculative)
    truncations = truncations or ((False, True) if step_cfg.compute.launch_bound else (None,))
    keys = [(t, truncation) for t in buckets or step_cfg.token_buckets for truncation in truncations]
    known = _memo.setdefault(trace_key, {})
    _memo.move_to_end(trace_key)
    missing = [key for key in keys if key not in known]
    if missing:
        known.update(_compile_steps(params, state, cfg, step_cfg, host, speculative, trace_key,
                                    missing))
    if len(_memo) > _MEMO_SIZE:
        _memo.popitem(last=False)
    return CompiledSteps({key: known[key] for key in keys})


def _compile_steps(params: ModelParams, state: StateCache, cfg: ModelConfig,
                   step_cfg: StepConfig, host: HostOptions, speculative: bool,
                   trace_key: tuple, keys: list[tuple[int, bool | None]]
                   ) -> dict[tuple[int, bool | None], CompiledStep]:
    enable_persistent_cache(host.compilation_cache_dir)
    options = BATCH_INVARIANT_COMPILER_OPTIONS if step_cfg.batch_invariant else None
    launch_bound = step_cfg.compute.launch_bound
    plan_wires = {key: Wire.of(build_plan(ScheduleDecision(()), key[0], step_cfg))
                  for key in keys}                                    # shapes are fixed
    ranks = step_cfg.compute.parallel.dp
    plan_specs = {key: _plan_spec(wire, state, ranks) for key, wire in plan_wires.items()}
    kind = "speculative steps" if speculative else "steps"
    # The step cache holds CPU executables of one process only: serializing a GPU step (its
    # Mosaic GPU kernels included) has not been validated on the H200 yet, nor a step whose
    # collectives cross processes (parallel/distributed.py); there jax's persistent cache,
    # which the step cache turns off while it compiles, keeps a later start's compile short.
    cache_dir = (host.compilation_cache_dir if host.step_cache and jax.default_backend() == "cpu"
                 and jax.process_count() == 1 else None)
    paths: dict = {}
    compiled: dict = {}
    if cache_dir:
        start = time.perf_counter()
        for key in keys:
            entry = step_cache.entry_key(trace_key, *key, options)
            paths[key] = (step_cache.entry_path(cache_dir, entry), entry)
            found = step_cache.load(*paths[key], (params, state, plan_specs[key]),
                                    plan_wires[key])
            if found is not None:
                compiled[key] = CompiledStep(found[0], plan_wires[key], found[1], launch_bound,
                                             ranks)
        if compiled:
            _say(host, f"deepinfer: {len(compiled)} {kind} loaded from the step cache in "
                       f"{time.perf_counter() - start:.1f} s ({Path(cache_dir) / 'steps'})")
    missing = [key for key in keys if key not in compiled]
    if not missing:
        return compiled
    _say(host, f"deepinfer: cold start, tracing and compiling {len(missing)} {kind} "
               f"(token buckets {sorted({t for t, _ in missing})}); "
               f"{_estimate(cache_dir, cfg, len(missing))}"
               + (f", then kept in {Path(cache_dir) / 'steps'} for the next start"
                  if cache_dir else ""))
    start = time.perf_counter()
    with _jax_cache_off() if cache_dir else contextlib.nullcontext():
        compiled.update(_build(params, state, cfg, step_cfg, host, speculative, missing,
                               plan_wires, plan_specs, options, paths))
    if cache_dir:
        _record_time(cache_dir, cfg, (time.perf_counter() - start) / len(missing))
    return compiled


def _plan_spec(plan_wire: Wire, state: StateCache, ranks: int) -> jax.ShapeDtypeStruct:
    """The step's plan argument: the wire's buffer, or a rank's each stacked and split over
    the mesh's "dp" axis (the state's mesh)."""
    if ranks == 1:
        return plan_wire.spec()
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    return jax.ShapeDtypeStruct((ranks, plan_wire.size), np.int32,
                                sharding=NamedSharding(mesh, PartitionSpec("dp")))


def lower_step(params: ModelParams, state: StateCache, cfg: ModelConfig, step_cfg: StepConfig,
               bucket: int, speculative: bool = False, truncation: bool | None = None
               ) -> jax.stages.Lowered:
    """One bucket's step traced and lowered as the engine compiles it, not compiled: for XLA's
    cost analysis (`.cost_analysis()`) or the program's text. params and state may be abstract
    (jax.ShapeDtypeStruct), their shardings on a device mesh or on an AbstractMesh
    (parallel/mesh.py's abstract_mesh: a mesh this machine need not have), lowered then for
    this machine's platform."""
    plan_wire = Wire.of(build_plan(ScheduleDecision(()), bucket, step_cfg))
    plan_spec = _plan_spec(plan_wire, state, step_cfg.compute.parallel.dp)
    mesh = getattr(jax.tree.leaves(state)[0].sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        with jax.sharding.use_abstract_mesh(mesh):
            return _lower(params, state, cfg, step_cfg, speculative, truncation, plan_wire,
                          plan_spec, platforms=(jax.default_backend(),))[0]
    with mesh_context(mesh):
        return _lower(params, state, cfg, step_cfg, speculative, truncation, plan_wire,
                      plan_spec)[0]


def _lower(params, state, cfg, step_cfg, speculative, truncation, plan_wire, plan_spec,
           platforms=None) -> tuple[jax.stages.Lowered, Wire]:
    """The step of one bucket and sampler variant on the wire, traced and lowered (the state
    donated), and its output's wire."""
    step_fn = functools.partial(spec_step if speculative else step, cfg=cfg, step_cfg=step_cfg,
                                truncation=truncation)
    output_wire = []            # the output's layout, read while the step is traced

    def wired_step(params, state, buffer):
        with matmul_precision(params.embed.dtype):
            state, output = step_fn(params, state, plan_wire.unpack_device(buffer))
        output_wire.append(Wire.of(output))
        return state, output_wire[-1].pack_device(output)

    program = over_ranks(wired_step, params) if step_cfg.compute.parallel.dp > 1 else wired_step
    out_shardings = step_out_shardings(state)     # None: jit's own choice (None would replicate)
    placement = {} if out_shardings is None else {"out_shardings": out_shardings}
    traced = jax.jit(program, donate_argnums=(1,), **placement).trace(params, state, plan_spec)
    lowered = traced.lower() if platforms is None else traced.lower(lowering_platforms=platforms)
    return lowered, output_wire[-1]


def _build(params, state, cfg, step_cfg, host, speculative, keys, plan_wires, plan_specs,
           options, paths) -> dict:
    """Trace, lower and compile `keys`' steps; each is written to the step cache (at `paths`)
    after they all compiled, before any runs."""
    launch_bound = step_cfg.compute.launch_bound
    ranks = step_cfg.compute.parallel.dp
    # Tracing and lowering is Python (one at a time); XLA's compile releases the GIL, so
    # host.compile_threads > 1 compiles buckets side by side (config/options.py says why the
    # default is one).
    lowered, wires = {}, {}
    kind = "speculative steps" if speculative else "steps"
    for t, truncation in tqdm(keys, unit="step", disable=not host.show_progress,
                              desc=f"tracing {kind}"):
        plan_wire = plan_wires[t, truncation]
        lowered[t, truncation], output_wire = _lower(params, state, cfg, step_cfg, speculative,
                                                     truncation, plan_wire, plan_specs[t, truncation])
        wires[t, truncation] = (plan_wire, output_wire)
    step_cache.stats.traced += len(keys)
    progress = tqdm(total=len(keys), unit="step", disable=not host.show_progress,
                    desc=f"compiling {kind}")
    compiled = {}

    def done(key, executable):
        compiled[key] = CompiledStep(executable, *wires[key], launch_bound, ranks,
                                     _plan_sharding(executable))
        progress.set_postfix(tokens=key[0])
        progress.update()

    if host.compile_threads == 1:       # on this thread: no compile ever beside another
        for key in keys:
            done(key, lowered[key].compile(compiler_options=options))
    else:
        with ThreadPoolExecutor(min(len(keys), host.compile_threads)) as pool:
            futures = {pool.submit(lowered[key].compile, compiler_options=options): key
                       for key in keys}
            for future in as_completed(futures):
                done(futures[future], future.result())
    progress.close()
    # Written once every compile has ended: XLA's CPU client aborted the process serializing
    # one executable while the pool compiled the next (a CI run, in step_cache.store; an
    # earlier one segfaulted in jax's own cache write with compiles side by side).
    for key in keys:
        if key in paths:
            step_cache.store(*paths[key], compiled[key].executable, *wires[key])
    return compiled


def _plan_sharding(executable: jax.stages.Compiled) -> jax.sharding.Sharding | None:
    """Where the executable takes its plan (its third argument), over several processes;
    None in one."""
    return executable.input_shardings[0][2] if jax.process_count() > 1 else None


@contextlib.contextmanager
def _jax_cache_off():
    """Compile without jax's persistent cache: an executable read from it cannot be written
    to the step cache (XLA's CPU client serializes a deserialized executable without all its
    functions, jax 0.11.2), and every later start reads the step cache instead."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def _say(host: HostOptions, line: str) -> None:
    if host.show_progress:
        print(line, file=sys.stderr, flush=True)


# The cold-start estimate's fallback where this machine has no record of its own: a step of
# the shipped model per layer on a 2-core CPU (docs/performance-log.md, start-up).
_SECONDS_PER_STEP_PER_LAYER = 3.0


def _estimate(cache_dir: str | None, cfg: ModelConfig, steps: int) -> str:
    """Roughly how long the cold start takes: this machine's last cold start, per step and
    layer, or the shipped model's figure."""
    per_layer, where = _SECONDS_PER_STEP_PER_LAYER, "on a 2-core CPU"
    try:
        per_layer = json.loads((Path(cache_dir) / "steps" / "cold-start.json").read_text()
                               )["seconds_per_step_per_layer"]
        where = "on this machine"
    except (OSError, TypeError, ValueError, KeyError):
        pass
    seconds = per_layer * steps * max(cfg.num_layers, 1)
    about = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return f"roughly {about} {where}"


def _record_time(cache_dir: str, cfg: ModelConfig, seconds_per_step: float) -> None:
    path = Path(cache_dir) / "steps" / "cold-start.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds_per_step_per_layer":
                                    seconds_per_step / max(cfg.num_layers, 1)}))
    except OSError:
        pass
