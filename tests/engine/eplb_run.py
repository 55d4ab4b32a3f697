"""Run by test_eplb.py in its own process with 8 CPU devices: the tiny model with a skewed
router (two experts favoured by every routed layer's selection bias) served on one device, and
on an expert-parallel mesh with the load balancer rebalancing mid-run; JSON on stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/engine/eplb_run.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import deepinfer_jax  # noqa: E402
from deepinfer_jax import SamplingParams  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.parallel.eplb import device_loads  # noqa: E402

HOT = (2, 5)      # the experts every routed layer's bias favours
EPLB = {"num_redundant_experts": 4, "step_interval": 0}
MESH = {"ep": 4}

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiles.append(event) if event == dispatch.BACKEND_COMPILE_EVENT
    else None)


def skewed(params):
    layers = []
    for layer in params.layers:
        moe = layer.moe
        if moe.bias is not None:
            moe = dataclasses.replace(moe, bias=moe.bias.at[jnp.asarray(HOT)].add(4.0))
        layers.append(dataclasses.replace(layer, moe=moe))
    return dataclasses.replace(params, layers=tuple(layers))


def main() -> None:
    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json").replace(num_mtp_layers=0)
    model = deepinfer_jax.Model(cfg, skewed(deepinfer_jax.random_params(cfg, 5, jnp.float32)))
    rng = np.random.default_rng(1)
    first = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (30, 90, 60)]
    second = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (50, 20)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    # one token bucket: one compile per engine (test_parallel's runs say why)
    common = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64,
                  token_buckets=(64,), show_progress=False, compilation_cache_dir=None)

    def logprobs(outs):
        return [[float(next(iter(s.values())).logprob) for s in o.outputs[0].logprobs]
                for o in outs]

    single = deepinfer_jax.LLM(model, **common)
    # the same batches as the balanced run's (a default-mode batch's numbers depend on its rows)
    reference = (single.generate(first, params, use_tqdm=False)
                 + single.generate(second, params, use_tqdm=False))
    llm = deepinfer_jax.LLM(model, parallel={**MESH, "eplb": EPLB}, **common)
    engine = llm.engine
    initial = [a.copy() for a in engine.balancer.assignments]
    compiled_at_start = len(compiles)
    before = llm.generate(first, params, use_tqdm=False)
    load = engine.expert_load()
    llm.rebalance_experts()                      # mid-run: the second batch runs on the new slots
    after = llm.generate(second, params, use_tqdm=False)
    compiles_while_serving = len(compiles) - compiled_at_start
    devices = engine.balancer.devices
    # every 4 steps on its own (the first batch again: the reference's first three rows)
    auto = deepinfer_jax.LLM(model, parallel={**MESH, "eplb": {**EPLB, "step_interval": 4}},
                             **common)
    auto_outs = auto.generate(first, params, use_tqdm=False)
    auto_steps = auto.engine.num_steps
    auto.rebalance_experts()    # one more, run after those the steps asked for (launch order)
    print(json.dumps({
        "auto_tokens": [list(o.outputs[0].token_ids) for o in auto_outs],
        "auto_logprobs": logprobs(auto_outs), "auto_rebalances": auto.engine.balancer.rebalances,
        "auto_steps": auto_steps,
        "tokens": [list(o.outputs[0].token_ids) for o in before + after],
        "reference_tokens": [list(o.outputs[0].token_ids) for o in reference],
        "logprobs": logprobs(before + after), "reference_logprobs": logprobs(reference),
        "compiles_while_serving": compiles_while_serving,
        "rebalances": engine.balancer.rebalances,
        "load": load.tolist(),
        "initial": [a.tolist() for a in initial],
        "assignments": [a.tolist() for a in engine.balancer.assignments],
        "max_device_load_before": [float(device_loads(load[i], initial[i], devices).max())
                                   for i in range(cfg.num_layers)],
        "max_device_load_after": [float(device_loads(load[i], a, devices).max())
                                  for i, a in enumerate(engine.balancer.assignments)],
        "expert_rows_per_device": int(jax.tree.leaves(engine.params.layers[0].moe.experts)[0]
                                      .addressable_shards[0].data.shape[0]),
    }))


if __name__ == "__main__":
    main()
