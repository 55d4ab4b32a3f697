"""Run by test_orbax_store.py in its own process with 8 CPU devices (XLA's host platform device
count must be set before jax starts): a converted store restored straight into a mesh, against
the safetensors checkpoint it came from loaded and placed by the engine. Prints JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/weights/orbax_mesh_run.py \
        CHECKPOINT STORE CACHE_DIR dp=2,ep=4 ep=4,tp=2 ...

Every read orbax makes is recorded (its tensorstore, the devices it is for, the index and the
bytes of the whole chunks it touches, orbax's own estimate) by wrapping the one function that
reads a shard: orbax's serialization._read_array_index_and_device_put.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orbax.checkpoint._src.serialization import serialization  # noqa: E402

import deepinfer_jax  # noqa: E402
from deepinfer_jax.parallel.mesh import param_shardings  # noqa: E402

READS: list[dict] = []
_read_shard = serialization._read_array_index_and_device_put


async def _recorded(devices, index, t, **kwargs):
    shards, chunk_bytes = await _read_shard(devices, index, t, **kwargs)
    READS.append({"array": str(t.kvstore.path).rstrip("/"), "devices": [d.id for d in devices],
                  "index": [[s.start, s.stop] for s in index], "chunk_bytes": int(chunk_bytes)})
    return shards, chunk_bytes


serialization._read_array_index_and_device_put = _recorded


def generate(model, parallel, cache_dir) -> tuple[object, list[list[int]]]:
    llm = deepinfer_jax.LLM(model, parallel=parallel, max_num_seqs=2, max_model_len=128,
                            max_num_batched_tokens=16, show_progress=False,
                            compilation_cache_dir=cache_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, llm.model.config.vocab_size, n).tolist() for n in (9, 21)]
    params = deepinfer_jax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def compare(checkpoint: str, store: str, cache_dir: str, parallel: dict) -> dict:
    READS.clear()
    stored, tokens = generate(store, parallel, cache_dir)
    restored = stored.model.params          # as restored, before the engine saw them
    reads = list(READS)
    loaded, loaded_tokens = generate(checkpoint, parallel, cache_dir)
    mesh = stored.engine.mesh
    want = param_shardings(restored, mesh)
    flat, _ = jax.tree_util.tree_flatten_with_path(restored)
    leaves = {jax.tree_util.keystr(p, simple=True, separator="."): leaf for p, leaf in flat}
    return {
        "tokens": tokens, "loaded_tokens": loaded_tokens, "devices": mesh.size,
        "shardings_as_mesh": all(a.sharding == s for a, s in zip(
            jax.tree.leaves(restored), jax.tree.leaves(want), strict=True)),
        "equal_values": all(np.array_equal(np.asarray(a).view(np.uint8),
                                           np.asarray(b).view(np.uint8))
                            for a, b in zip(jax.tree.leaves(restored),
                                            jax.tree.leaves(loaded.model.params), strict=True)),
        "same_structure": str(jax.tree.structure(restored))
        == str(jax.tree.structure(loaded.model.params)),
        # per leaf: its shape and the shape and bytes of one device's shard
        "leaves": {name: {"shape": list(leaf.shape),
                          "shard": list(leaf.addressable_shards[0].data.shape),
                          "shard_bytes": int(leaf.addressable_shards[0].data.nbytes)}
                   for name, leaf in leaves.items()},
        "reads": reads,
    }


def main() -> None:
    checkpoint, store, cache_dir, *meshes = sys.argv[1:]
    results = {}
    for mesh in meshes:
        parallel = {axis: int(size) for axis, size in (p.split("=") for p in mesh.split(","))}
        results[mesh] = compare(checkpoint, store, cache_dir, parallel)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
