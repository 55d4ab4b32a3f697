"""Run by test_parallel.py in its own process with 8 CPU devices (XLA's host platform device
count must be set before jax starts): greedy outputs and per-token logprobs of the tiny
configs on one device and on each mesh shape asked, as JSON on stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine/parallel_run.py \
        CONFIG "1,8,1" "1,4,2" ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import deepinfer_jax  # noqa: E402
from deepinfer_jax import SamplingParams  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402


def _logprobs(out) -> list[float]:
    return [float(next(iter(step.values())).logprob) for step in out.outputs[0].logprobs]


# One token bucket: each engine compiles one step instead of three (16, 32, 64), which is most
# of these runs' time (a single device and a (2,2,2) mesh: 74 s -> 47 s, the same tokens). In
# batch-invariant runs a prompt alone and the prompts batched then run at the same token count
# with other rows beside them; invariance across buckets is test_batch_invariance.py's.
ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64,
                      token_buckets=(64,), show_progress=False, compilation_cache_dir=None,
                      device_memory_gib=4.0)


def run(model, prompts, parallel, batch_invariant, passes=1, **options):
    """options: more engine options (multihost_run.py's `distributed`); passes: the prompts
    served that many times, the last pass's outputs kept (prefix caching's hits)."""
    llm = deepinfer_jax.LLM(model, parallel=parallel, batch_invariant=batch_invariant,
                            **ENGINE_OPTIONS, **options)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    ranks = getattr(llm.engine.scheduler, "ranks", None)
    placed = []
    if ranks is not None:      # each rank's share of the prompts, recorded as they are added
        for index, rank in enumerate(ranks):
            rank.add = lambda req, add=rank.add, index=index: (placed.append(index), add(req))
    for _ in range(passes):
        outs = llm.generate(prompts, params, use_tqdm=False)
    prefix = llm.prefix_cache_stats
    requests_per_rank = ([placed.count(i) for i in range(len(ranks))] if ranks is not None
                         else [len(prompts)])
    state_leaf = jax.tree.leaves(llm.engine.state)[0]
    state_rank_rows = (int(state_leaf.addressable_shards[0].data.shape[0]) if ranks is not None
                       else None)
    # batch-invariant mode: each prompt again on its own, for the bitwise comparison
    alone = ([_logprobs(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
             if batch_invariant else None)
    mesh_devices = 1 if llm.engine.mesh is None else llm.engine.mesh.size
    expert_leaf = jax.tree.leaves(llm.engine.params.layers[0].moe.experts)[0]
    spec = llm.spec_metrics
    tables = getattr(llm.engine.params, "engram_tables", ())     # V4.1's, on the device
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "drafted": None if spec is None else spec.drafted,
            "logprobs": [_logprobs(o) for o in outs], "alone_logprobs": alone,
            "mesh_devices": mesh_devices,
            "planned_weight_bytes": llm.engine.memory_plan.weights,
            "expert_shard_rows": int(expert_leaf.addressable_shards[0].data.shape[0]),
            "engram_shard_rows": [int(t.addressable_shards[0].data.shape[0]) for t in tables],
            "async_scheduling": llm.host_options.async_scheduling,
            "requests_per_rank": requests_per_rank,
            # with data-parallel ranks, the leading rank axis of the state one device holds
            "state_rank_rows": state_rank_rows,
            "prefix_hits": None if prefix is None else prefix.hits,
            "prefix_hit_tokens": None if prefix is None else prefix.hit_tokens}


def main() -> None:
    """argv: CONFIG[:invariant][:long][:prefix[:bounded|:replay-all]] and mesh shapes
    "dp,ep,tp" or "dp,ep,tp,cp";
    ":long" adds a 440-token prompt (seven 64-token prefill chunks); ":prefix" serves three
    prompts sharing a 192-token prefix twice with prefix caching on (":bounded": its bounded
    replay of 48 tokens; ":replay-all": of 512, longer than any prefix); ":spec" keeps the MTP
    block and speculates with up to 2 drafts."""
    config, shapes = sys.argv[1], sys.argv[2:]
    flags = config.split(":")[1:]
    batch_invariant, long, prefix = "invariant" in flags, "long" in flags, "prefix" in flags
    speculative = "spec" in flags
    cfg = read_model_config(REPO / config.split(":")[0])
    if not speculative:
        cfg = cfg.replace(num_mtp_layers=0)
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 5, jnp.float32))
    rng = np.random.default_rng(0)
    lengths = (440, 30, 130) if long else (30, 130, 75)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in lengths]
    options = {}
    if prefix:
        shared = rng.integers(2, cfg.vocab_size, 192).tolist()
        prompts = [shared + rng.integers(2, cfg.vocab_size, n).tolist() for n in (20, 70, 45)]
        options = {"passes": 2, "enable_prefix_caching": True}
        if "bounded" in flags:        # hits rebuild the windows from the last 48 tokens
            options |= {"prefix_replay": "bounded", "swa_replay_tokens": 48}
        if "replay-all" in flags:     # a bounded replay as long as any prefix: the cold run's
            options |= {"prefix_replay": "bounded", "swa_replay_tokens": 512}
    if speculative:
        options["speculative_config"] = {"num_speculative_tokens": 2, "varlen": False}
    results = {"single": run(model, prompts, None, batch_invariant, **options)}
    for shape in shapes:
        sizes = dict(zip(("dp", "ep", "tp", "cp"), map(int, shape.split(","))))
        results[shape] = run(model, prompts, sizes, batch_invariant, **options)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
