"""Run by test_kv_tiers_engine.py in its own process with 8 CPU devices: the KV tiers' host
tier on device meshes, as JSON on stdout. Per mesh: the cold run of a 540-token prompt on
that mesh, then an engine with prefix caching and a host tier that caches its 500-token
prefix, evicts it to host memory with three other prompts, and serves the prompt again from
there (batch-invariant mode, a bf16 model). With data-parallel ranks the other prompts come
as one batch of three per rank, so that every rank's pool evicts what it cached.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine/tiers_mesh_run.py \\
        "1,4,1" "1,1,2,2" "2,2,1" ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer_jax  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.device.tier_copies import page_pools  # noqa: E402
from deepinfer_jax.host.decision import TierLoad, TierSpill  # noqa: E402
from deepinfer_jax.host.kv_tiers.entry import TierEntry  # noqa: E402
from tests.engine.test_kv_tiers_engine import ENGINE, GREEDY  # noqa: E402


def record(out) -> dict:
    return {"tokens": list(out.token_ids), "logprobs": [lp.logprob for lp in out.logprobs]}


def rank_copies_check(llm) -> dict:
    """With ranks, the copies themselves: a page and a snapshot spilled from rank 1 and loaded
    back into rank 0 at other ids move exactly those rows, and nothing else of either rank's
    state or snapshot pool changes (the other rank writes back what it holds)."""
    engine, tiers = llm.engine, llm.engine.tiers
    pages, snapshots = (page_pools(engine.state), engine.snapshots.pool)
    before = jax.device_get((pages, snapshots))
    spilled = []
    engine.state = tiers.run(engine.state, ((), (TierSpill(1, 3, 2, {}),)), spilled)
    arrays = jax.device_get(spilled[0][1])
    load = TierLoad(5, 1, TierEntry(1, tuple(arrays), {}))
    engine.state = tiers.run(engine.state, ((load,), ()), [])
    after = jax.device_get((page_pools(engine.state), engine.snapshots.pool))
    n = len(before[0])
    expected = jax.tree.map(np.copy, before)
    for k, (b, e) in enumerate(zip(before[0], expected[0], strict=True)):
        per_page = b.shape[1] // engine.step_cfg.num_pages
        e[0, 5 * per_page: 6 * per_page] = b[1, 3 * per_page: 4 * per_page]
        assert np.array_equal(arrays[k], b[1, 3 * per_page: 4 * per_page])
    for k, (b, e) in enumerate(zip(jax.tree.leaves(before[1]), jax.tree.leaves(expected[1]),
                                   strict=True)):
        e[0, 1] = b[1, 2]
        assert np.array_equal(arrays[n + k], b[1, 2])
    same = all(np.array_equal(a, e) for a, e in
               zip(jax.tree.leaves(after), jax.tree.leaves(expected), strict=True))
    moved = not all(np.array_equal(a, b) for a, b in
                    zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True))
    return {"exact": same, "moved": moved}


def main() -> None:
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))
    rng = np.random.default_rng(0)
    base = rng.integers(2, 512, size=500).tolist()
    fillers = [rng.integers(2, 512, size=560).tolist() for _ in range(6)]
    target = base + rng.integers(2, 512, size=40).tolist()
    options = dict(ENGINE, compilation_cache_dir=None)
    results = {}
    for shape in sys.argv[1:]:
        parallel = dict(zip(("dp", "ep", "tp", "cp"), map(int, shape.split(","))))
        cold = deepinfer_jax.LLM(model, parallel=parallel, **options)
        llm = deepinfer_jax.LLM(model, parallel=parallel, enable_prefix_caching=True,
                                kv_host_tier_bytes=1 << 30, **options)
        llm.generate([base], GREEDY, use_tqdm=False)
        ranks = parallel["dp"]
        for batch in ([fillers[:3 * ranks]] if ranks > 1 else [[f] for f in fillers[:3]]):
            llm.generate(batch, GREEDY, use_tqdm=False)
        llm.engine.tiers.drain()
        hit_tokens = llm.prefix_cache_stats.hit_tokens
        warm = llm.generate([target], GREEDY, use_tqdm=False)[0]
        results[shape] = {"cold": record(cold.generate([target], GREEDY, use_tqdm=False)[0]),
                          "warm": record(warm), "mesh_devices": llm.engine.mesh.size,
                          "host_hits": llm.engine.tiers.store.stats().host.hits,
                          "hit_tokens": llm.prefix_cache_stats.hit_tokens - hit_tokens}
        if ranks > 1:
            results[shape]["rank_copies"] = rank_copies_check(llm)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
