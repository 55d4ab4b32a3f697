"""A converted checkpoint: the loaded parameter pytree in orbax-checkpoint's layout, restored
straight into a device mesh.

A safetensors checkpoint is read, checked and brought to the model's layout once (`deepinfer
convert`); the store keeps that pytree as it is, FP8 / FP4 weights as their codes and scales.
Restoring gives every leaf its target sharding up front, so orbax reads for each device (and
in a multi-process run, each process for its own devices) only the chunks of its shard:

    OUT/config.json, tokenizer.json, ...   every file beside the source's weights, copied
    OUT/params/                            orbax's StandardCheckpointer (zarr3 arrays in OCDBT)

Chunks: orbax 0.12 chunks an array as written (one chunk for a single device's array) and can
only cut a chosen axis into single slices (`SaveArgs.shard_axes`). The axes a mesh may split
(parallel/mesh.py `split_axes`) are cut so where they have at most MAX_SLICE_CHUNKS slices:
an expert, an output group, a small projection's rows or columns. Longer axes stay one chunk,
as many slices read slowly (on a 2-core CPU, 3 s for V4-Flash's 32 MiB wq_b by its 32768
columns against 0.07 s whole): at V4-Flash's sizes a tensor-parallel rank reads wq_b, wo_b
and the shared expert whole and keeps its part; the routed experts are always per expert.

The store's config.json is the source's; the pytree it must hold follows from it (the random
source's shapes, with quantized leaves where the store has codes and scales), and a store
that disagrees raises CheckpointError naming each tensor with both shapes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.weights import random_params
from deepinfer_jax.weights.sources import CheckpointError
from pallas_kernels.quantized import FP4_GROUP, Fp4Blocks, Fp8Blocks, dequantize_tree

PARAMS = "params"
MAX_SLICE_CHUNKS = 1024
# A quantized leaf is stored as its fields; these name it (pallas_kernels/quantized.py).
_QUANTIZED = {("codes", "scale"): Fp8Blocks, ("packed", "scale"): Fp4Blocks}


def _ocp():
    """orbax.checkpoint, imported when a store is written or read (0.7 s, not at every start)."""
    import orbax.checkpoint as ocp

    return ocp


def is_store(path: str | Path) -> bool:
    """Whether `path` is a converted store. On a local disk orbax writes into a temporary
    directory and renames it when complete, so `params/` exists only for a finished store."""
    return (Path(path) / PARAMS).is_dir()


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json"))


def save(params: ModelParams, source: str | Path, out: str | Path, split_axes=None) -> Path:
    """Write `params` (as load_params gave them) into a new store `out`, with every file of
    the checkpoint directory `source` beside its weights. split_axes: per leaf, the axes a
    mesh may split (parallel/mesh.py), chunked so that a shard's reads are its own."""
    source, out = Path(source), Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and not _is_weights(path.name):
            shutil.copy2(path, out / path.name)
    ocp = _ocp()
    save_args = None
    if split_axes is not None:
        save_args = jax.tree.map(
            lambda leaf, axes: ocp.SaveArgs(shard_axes=_chunked_axes(leaf.shape, axes)),
            params, split_axes)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS, params, save_args=save_args)
    return out


def _chunked_axes(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a for a in axes if 1 < shape[a] <= MAX_SLICE_CHUNKS)


def restore(path: str | Path, cfg: ModelConfig, dtype=None, keep_quantized: bool = True,
            shardings=None) -> ModelParams:
    """The store's parameters, each leaf read straight into its sharding.

    dtype: None or the store's own (a store holds one compute dtype; convert again for
    another). keep_quantized: False dequantizes FP8 / FP4 leaves to the dtype on the devices,
    as load_params would at load. shardings: abstract params -> their shardings (a pytree of
    the same structure); None puts every leaf on the default device."""
    stored = _stored_leaves(path)
    target = expected_params(cfg, stored)
    held = jnp.dtype(target.embed.dtype)
    if dtype is not None and jnp.dtype(dtype) != held:
        raise ValueError(f"{path} holds {held.name} weights; convert the checkpoint again with "
                         f"--dtype {jnp.dtype(dtype).name} for {jnp.dtype(dtype).name}")
    place = (shardings or _on_default_device)(target)
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), target, place)
    with _ocp().StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(Path(path).absolute() / PARAMS, abstract)
    if keep_quantized:
        return params
    plain = jax.eval_shape(lambda p: dequantize_tree(p, held), params)
    return jax.jit(lambda p: dequantize_tree(p, held),
                   out_shardings=(shardings or _on_default_device)(plain))(params)


def _on_default_device(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, tree)


def _stored_leaves(path: str | Path) -> dict[tuple, object]:
    """The store's arrays' metadata (shape, dtype) by path: names and indices."""
    params = Path(path).absolute() / PARAMS
    with _ocp().StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(params).item_metadata.tree
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_names(p): leaf for p, leaf in flat}


def _names(path) -> tuple:
    """A key path as plain names and indices: the params' attribute keys and the stored
    tree's dict keys then compare equal."""
    return tuple(getattr(k, "name", getattr(k, "key", getattr(k, "idx", None))) for k in path)


def _dotted(names: tuple) -> str:
    return ".".join(str(n) for n in names)


def expected_params(cfg: ModelConfig, stored: dict[tuple, object]) -> ModelParams:
    """The abstract pytree the store must hold for `cfg`: the plain layout at the store's
    dtype with its MTP blocks, a quantized leaf where the store has that format's fields;
    raises CheckpointError listing each missing, unexpected or mis-shaped tensor."""
    if ("embed",) not in stored:
        raise CheckpointError("the store holds no embed tensor: not a converted checkpoint")
    dtype = jnp.dtype(stored[("embed",)].dtype)
    plain = jax.eval_shape(lambda: random_params(cfg, 0, dtype))
    mtp_blocks = len({names[1] for names in stored if names[0] == "mtp"})
    plain = plain.replace(mtp=plain.mtp[:mtp_blocks])
    used, problems = set(), []

    def leaf(path, want):
        names = _names(path)
        if names in stored:
            used.add(names)
            return _checked(names, stored[names], want, problems)
        for fields, kind in _QUANTIZED.items():
            parts = [names + (f,) for f in fields]
            if all(p in stored for p in parts):
                used.update(parts)
                got = kind(*(jax.ShapeDtypeStruct(tuple(stored[p].shape), stored[p].dtype)
                             for p in parts))
                return _checked_quantized(names, got, want, problems)
        problems.append(f"{_dotted(names)}: missing (the config's shape {tuple(want.shape)})")
        return want

    target = jax.tree_util.tree_map_with_path(leaf, plain)
    problems += [f"{name}: unexpected" for name in sorted(_dotted(n) for n in set(stored) - used)]
    if problems:
        shown = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more"
                                               if len(problems) > 40 else "")
        raise CheckpointError(f"the store does not match its config.json ({len(problems)} "
                              f"tensor(s)):\n  {shown}")
    return target


def _checked(names, got, want, problems: list[str]):
    shape, dtype = tuple(got.shape), jnp.dtype(got.dtype)
    if shape != tuple(want.shape) or dtype != want.dtype:
        problems.append(f"{_dotted(names)}: stored {dtype.name}{list(shape)}, the config's "
                        f"{jnp.dtype(want.dtype).name}{list(want.shape)}")
    return jax.ShapeDtypeStruct(shape, dtype)


def _checked_quantized(names, got, want, problems: list[str]):
    """A stored FP8 / FP4 weight: its dequantized shape must be the config's (an FP4 weight's
    scales one per FP4_GROUP inputs of a row, group-major)."""
    ok = tuple(got.shape) == tuple(want.shape)
    if isinstance(got, Fp4Blocks):
        *lead, n, half = got.packed.shape
        ok = ok and tuple(got.scale.shape) == (*lead, 2 * half // FP4_GROUP, n)
    if not ok:
        parts = ", ".join(f"{field} {list(part.shape)}" for field, part in zip(got._fields, got))
        problems.append(f"{_dotted(names)}: stored {type(got).__name__} ({parts}) of shape "
                        f"{list(got.shape)}, the config's {list(want.shape)}")
    return got

