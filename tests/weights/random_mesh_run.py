"""Run by test_random_mesh.py in its own process with 8 CPU devices (XLA's host platform
device count must be set before jax starts): random weights drawn straight into a mesh's
shardings (weights.random_params's `shardings`), and `load_format="dummy"` over a mesh.
Prints JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/weights/random_mesh_run.py \
        CONFIG dp=2,ep=4
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import deepinfer_jax  # noqa: E402
from deepinfer_jax.api import dummy  # noqa: E402
from deepinfer_jax.api.dummy import dummy_model  # noqa: E402
from deepinfer_jax.config.parallel import ParallelConfig  # noqa: E402
from deepinfer_jax.model.params import HyperConnectionParams, HyperHeadParams  # noqa: E402
from deepinfer_jax.parallel.mesh import make_mesh, param_shardings  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def compare(plain, placed, mesh) -> dict:
    """Equal values, the mesh's shardings, and each expert leaf's shard of the expert axis."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(placed)]
    wanted = jax.tree.leaves(param_shardings(plain, mesh))
    leaves = jax.tree.leaves(placed)
    return {
        "equal_values": all(np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b in zip(jax.tree.leaves(plain), leaves, strict=True)),
        "shardings_as_mesh": all(leaf.sharding == want for leaf, want in zip(leaves, wanted,
                                                                               strict=True)),
        "expert_rows": {path: [int(leaf.shape[0]), int(leaf.addressable_shards[0].data.shape[0])]
                        for path, leaf in zip(paths, leaves, strict=True)
                        if ".moe.experts." in path},
    }


def as_loaded(params):
    """The engine's params without what it adds at start-up (the mHC mixes' weight parts,
    model/mhc.py with_mix_parts): the loaded weights, leaf for leaf."""
    is_mix = lambda x: isinstance(x, (HyperConnectionParams, HyperHeadParams))   # noqa: E731
    return jax.tree.map(lambda p: p.replace(fn_parts=None) if is_mix(p) else p, params,
                        is_leaf=is_mix)


DRAWS: list[dict] = []
_draw = dummy.random_params


def _recorded(*args, **kwargs):
    """dummy_model's draws, each with the expert leaves' row counts on device 0 as drawn (before
    the engine places anything)."""
    params = _draw(*args, **kwargs)
    DRAWS.append({path: int(leaf.addressable_shards[0].data.shape[0])
                  for path, leaf in ((jax.tree_util.keystr(p), x) for p, x in
                                     jax.tree_util.tree_leaves_with_path(params))
                  if ".moe.experts." in path})
    return params


dummy.random_params = _recorded


def main() -> None:
    config, layout = Path(sys.argv[1]), sys.argv[2]
    parallel = {axis: int(n) for axis, n in (p.split("=") for p in layout.split(","))}
    mesh = make_mesh(ParallelConfig(**parallel))
    plain = dummy_model(config, layers=2)
    drawn = random_params(plain.config, 0, jnp.bfloat16,
                          shardings=functools.partial(param_shardings, mesh=mesh))
    llm = deepinfer_jax.LLM(str(config), load_format="dummy", dummy_layers=2, parallel=parallel,
                            max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                            token_buckets=(16,), show_progress=False, compilation_cache_dir=None,
                            device_memory_gib=4.0)
    out = llm.generate([[5, 17, 42, 9]], deepinfer_jax.SamplingParams(max_tokens=4,
                                                                      temperature=0.0,
                                                                      ignore_eos=True),
                       use_tqdm=False)
    print(json.dumps({"devices": len(jax.devices()), "drawn": compare(plain.params, drawn, mesh),
                      "engine": compare(plain.params, as_loaded(llm.engine.params),
                                        llm.engine.mesh),
                      "draws": DRAWS, "tokens": list(out[0].outputs[0].token_ids),
                      "mix_parts": llm.engine.params.layers[0].attn_hc.fn_parts is not None}))


if __name__ == "__main__":
    main()
