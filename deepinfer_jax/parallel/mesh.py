"""The device mesh of a ParallelConfig and where each parameter lives on it.

Axes ("dp", "cp", "ep", "tp") over the first dp x cp x ep x tp devices. Placement:
* routed experts: every leaf of a layer's expert stack split along its expert axis over the
  "dp", "cp" and "ep" axes together (model/moe.py computes each device's own experts inside
  `shard_map`);
* DeepSeek-V4.1's Engram tables on the device: split by rows over the same axes
  (model/v41/engram_tables.py reads each row from its holder);
* tensor parallel: the attention's wq_b by output columns (heads), wo_a by output group and
  wo_b by input rows (the same heads' groups), the shared expert's w13 by output and w2 by
  input columns; XLA's SPMD partitioner places the collectives these imply;
* everything else replicated;
* the step's state: with data-parallel attention (dp > 1) one state per rank, stacked on a
  leading axis split over "dp" (`init_rank_states`), and the step runs per rank inside
  `shard_map` over "dp" (`over_ranks`), on its own slice of the state and its own plan;
  otherwise replicated (over "cp" always: every cp device holds its rank's whole state);
* the step's tokens: split over "cp" (model/paged_forward.py constrains the residual streams).
A dimension that the axis size does not divide stays whole (a quantized weight's scale grid
of a tiny model, say): any placement is correct, the partitioner moves what it must.
Over several processes (parallel/distributed.py) the same code places global arrays (each
process puts its own shards of the same values) and the step's output comes back replicated
(`step_out_shardings`), so that every process reads it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.parallel import MESH_AXES, ParallelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.model.family import model_family

# (path fragment, the split of each of the leaf's leading axes) for tensor parallelism
_TP_SPLITS = ((".attn.wq_b", (None, "tp")), (".attn.wo_a", ("tp",)), (".attn.wo_b", ("tp",)),
              (".shared.w13", (None, "tp")), (".shared.w2", ("tp",)))


def make_mesh(parallel: ParallelConfig) -> Mesh | None:
    """The mesh over the first parallel.size devices; None for one device."""
    if parallel.size == 1:
        return None
    devices = np.asarray(jax.devices()[: parallel.size]).reshape(parallel.mesh_shape)
    return Mesh(devices, MESH_AXES)


def abstract_mesh(parallel: ParallelConfig) -> AbstractMesh | None:
    """make_mesh's axes and sizes without devices (None for one device): shardings on it let
    a step be lowered for a mesh this machine does not have (engine/compile.py lower_step)."""
    if parallel.size == 1:
        return None
    return AbstractMesh(parallel.mesh_shape, MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))   # as make_mesh's


EXPERT_AXES = ("dp", "cp", "ep")


def _fitted(spec: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """spec with every axis (a name or a tuple of names) whose size the dimension's does not
    divide dropped."""
    def size(axis) -> int:
        return int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
    axes = [axis if axis is not None and dim % size(axis) == 0 else None
            for axis, dim in zip(spec, shape, strict=False)]
    return PartitionSpec(*axes)


def _split(path) -> tuple:
    """The mesh axes each of a leaf's leading axes may be split over (the module docstring's
    placement), by its path alone."""
    name = jax.tree_util.keystr(path)
    if ".moe.experts" in name or ".engram_tables" in name:
        return (EXPERT_AXES,)
    for fragment, split in _TP_SPLITS:
        if fragment in name:
            return split
    return ()


def param_specs(params, mesh: Mesh):
    """A PartitionSpec per parameter leaf (the module docstring's placement)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _fitted(_split(path), leaf.shape, mesh), params)


def param_shardings(params, mesh: Mesh):
    """A NamedSharding per parameter leaf (params may be abstract: shapes suffice)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh))


def place_params(params, mesh: Mesh):
    return jax.device_put(params, param_shardings(params, mesh))


def split_axes(params):
    """Per parameter leaf, the indices of the axes that some mesh may split: a checkpoint
    chunked along them lets each device read only its shard (weights/orbax_store.py)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: tuple(i for i, axis in enumerate(_split(path)) if axis is not None),
        params)


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def mesh_context(mesh: Mesh | None):
    """The mesh as tracing's context (jax.set_mesh), or nothing for one device."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


# ---- data-parallel attention ----------------------------------------------------------------
def _rank_param_specs(params):
    """The parameters as `over_ranks` splits them over "dp": each rank's share of the routed
    experts and of the Engram tables' rows; the rest whole (any "ep" / "tp" split stays with
    the partitioner)."""
    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        split = ".moe.experts" in name or ".engram_tables" in name
        return PartitionSpec("dp") if split else PartitionSpec()
    return jax.tree_util.tree_map_with_path(spec, params)


def over_ranks(step_fn, params):
    """step_fn(params, state, buffer) -> (state, buffer), run once per data-parallel rank:
    over states and plan buffers stacked on a leading rank axis ([dp, ...], split over "dp").
    Inside, everything is one rank's, as on one device; the model's own collectives over "dp"
    (model/moe.py's routed experts) exchange tokens between ranks."""
    rank = PartitionSpec("dp")

    def per_rank(params, states, buffers):
        state, output = step_fn(params, jax.tree.map(lambda x: x[0], states), buffers[0])
        return jax.tree.map(lambda x: x[None], state), output[None]

    return jax.shard_map(per_rank, in_specs=(_rank_param_specs(params), rank, rank),
                         out_specs=(rank, rank), axis_names={"dp"}, check_vma=False)


def init_rank_states(make_state, mesh: Mesh, ranks: int):
    """`ranks` copies of make_state()'s state, stacked and split over "dp", each made on its
    own devices."""
    def stacked():
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (ranks, *x.shape)), make_state())
    return jax.jit(stacked, out_shardings=NamedSharding(mesh, PartitionSpec("dp")))()


def placed_state(cfg: ModelConfig, step_cfg: StepConfig, dtype, mesh: Mesh | None):
    """The step's initial state where the step expects it: on one device; replicated over the
    mesh; or with data-parallel ranks, a rank's each (`init_rank_states`)."""
    def make():
        return model_family(cfg).init_state(cfg, step_cfg, dtype)
    if mesh is None:
        return make()
    ranks = step_cfg.compute.parallel.dp
    return init_rank_states(make, mesh, ranks) if ranks > 1 else replicate(make(), mesh)


def step_out_shardings(state):
    """The step's output shardings (state, output buffer) for jit: over several processes the
    state where it came in and the output replicated, so that each process reads its own copy
    (an array split over processes is not readable by one, and gathering it on the host would
    be a collective the loop's thread issues beside the launcher's); None otherwise: where
    the partitioner puts them, as in one process."""
    mesh = getattr(jax.tree.leaves(state)[0].sharding, "mesh", None)
    if not isinstance(mesh, Mesh) or not mesh.is_multi_process:
        return None
    return jax.tree.map(lambda x: x.sharding, state), NamedSharding(mesh, PartitionSpec())


def abstract_state(cfg: ModelConfig, step_cfg: StepConfig, dtype,
                   mesh: Mesh | AbstractMesh | None):
    """placed_state's shapes, dtypes and shardings, without a byte of it (the mesh may be
    abstract)."""
    shapes = jax.eval_shape(lambda: placed_state(cfg, step_cfg, dtype, None))
    if mesh is None:
        return shapes
    ranks = step_cfg.compute.parallel.dp
    if ranks > 1:       # init_rank_states' stack, a rank's state each
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((ranks, *x.shape), x.dtype), shapes)
    spec = PartitionSpec("dp") if ranks > 1 else PartitionSpec()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=NamedSharding(mesh, spec)), shapes)


def abstract_placed(params, mesh: Mesh | AbstractMesh | None):
    """Abstract parameters (shapes and dtypes) with the shardings place_params gives them."""
    if mesh is None:
        return params
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, param_shardings(params, mesh))
