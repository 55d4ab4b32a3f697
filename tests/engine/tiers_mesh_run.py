"""Run by test_kv_tiers_engine.py in its own process with 8 CPU devices: the KV tiers' host
tier on device meshes without data-parallel ranks, as JSON on stdout. Per mesh: the cold run
of a 540-token prompt on that mesh, then an engine with prefix caching and a host tier that
caches its 500-token prefix, evicts it to host memory with three other prompts, and serves
the prompt again from there (batch-invariant mode, a bf16 model).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine/tiers_mesh_run.py \\
        "1,4,1" "1,1,2,2" ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer_jax  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from tests.engine.test_kv_tiers_engine import ENGINE, GREEDY  # noqa: E402


def record(out) -> dict:
    return {"tokens": list(out.token_ids), "logprobs": [lp.logprob for lp in out.logprobs]}


def main() -> None:
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))
    rng = np.random.default_rng(0)
    base = rng.integers(2, 512, size=500).tolist()
    fillers = [rng.integers(2, 512, size=560).tolist() for _ in range(3)]
    target = base + rng.integers(2, 512, size=40).tolist()
    options = dict(ENGINE, compilation_cache_dir=None)
    results = {}
    for shape in sys.argv[1:]:
        parallel = dict(zip(("dp", "ep", "tp", "cp"), map(int, shape.split(","))))
        cold = deepinfer_jax.LLM(model, parallel=parallel, **options)
        llm = deepinfer_jax.LLM(model, parallel=parallel, enable_prefix_caching=True,
                                kv_host_tier_bytes=1 << 30, **options)
        for prompt in (base, *fillers):
            llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.engine.tiers.drain()
        hit_tokens = llm.prefix_cache_stats.hit_tokens
        warm = llm.generate([target], GREEDY, use_tqdm=False)[0]
        results[shape] = {"cold": record(cold.generate([target], GREEDY, use_tqdm=False)[0]),
                          "warm": record(warm), "mesh_devices": llm.engine.mesh.size,
                          "host_hits": llm.engine.tiers.store.stats().host.hits,
                          "hit_tokens": llm.prefix_cache_stats.hit_tokens - hit_tokens}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
