"""Where speculative decoding's logprobs part from plain decoding's on a GPU (batch-invariant
mode; tests/engine/test_speculative_shipped.py's bitwise test fails on the H100, not on the
CPU). Two probes, JSON lines on stdout:

  python bench/invariance_probe.py softmax          # the sampler's log-softmax, [8, V] vs [48, V]
  python bench/invariance_probe.py engines          # the test's engines: where and how much
                                                    # (and the speculative engine's state
                                                    # under plain steps only)

  python bench/invariance_probe.py states           # plain engines whose states differ in
                                                    # shape only (more slots, more pages)

`engines` runs under the caller's XLA_FLAGS, so that one run per flag set (autotuning off,
cuBLAS instead of Triton GEMMs) tells which compiler choice moves the bits. On the H100
(2026-12-06): every one of the 16 logprobs differed, from the first token on, up to 0.02,
whatever the flags, with optimization barriers around the head or without; and the
speculative engine running plain steps only differed as much (docs/performance-log.md).
`states` asks whether the state's shapes alone move the bits. On the H100 (session 49) 16
slots moved them as much as speculation did, through XLA's Triton normalization fusions;
batch-invariant mode compiles without them since 5c8bb0e, and both probes are bitwise there.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def softmax_probe() -> None:
    from deepinfer_jax.device.sampling import token_logprobs

    for vocab in (6144, 129280):
        logits = jax.random.normal(jax.random.key(0), (48, vocab), jnp.float32) * 4
        tokens = jnp.arange(48, dtype=jnp.int32)
        fn = jax.jit(token_logprobs, static_argnums=2)
        few = fn(logits[:8], tokens[:8], 1)
        many = fn(logits, tokens, 1)
        diff = np.abs(np.asarray(few.logprob) - np.asarray(many.logprob[:8]))
        print(json.dumps({"probe": "softmax", "vocab": vocab, "rows": [8, 48],
                          "bitwise": bool((diff == 0).all()), "max_diff": float(diff.max())}),
              flush=True)


def engines_probe() -> None:
    import deepinfer_jax
    from deepinfer_jax import SamplingParams

    tiny = REPO / "models" / "deepinfer-tiny-v4"
    engine = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=128,
                  token_buckets=(128,), page_size=64, show_progress=False, batch_invariant=True,
                  enable_prefix_caching=False)
    plain = deepinfer_jax.LLM(tiny, **engine)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = plain.tokenizer.encode(source)[:310]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {"plain": plain}
    for k in (3,):
        runs[f"spec{k}"] = deepinfer_jax.LLM(
            tiny, speculative_config={"num_speculative_tokens": k, "varlen": False}, **engine)
    outs = {name: llm.generate([prompt], params, use_tqdm=False)[0] for name, llm in runs.items()}
    # The speculative engine's state (its rings hold spare rows for drafts) under plain steps
    # only: equal to plain decoding, the state's shapes are not what moves the bits
    from deepinfer_jax.host.scheduler import Scheduler
    draft_cap = Scheduler.draft_cap
    Scheduler.draft_cap = lambda self: 0
    try:
        outs["spec3 state, plain steps"] = runs["spec3"].generate([prompt], params,
                                                                  use_tqdm=False)[0]
    finally:
        Scheduler.draft_cap = draft_cap
    ref = np.array([lp.logprob for lp in outs["plain"].logprobs])
    for name, out in outs.items():
        got = np.array([lp.logprob for lp in out.logprobs])
        diff = np.abs(got - ref)
        row = {"probe": "engines", "run": name,
               "tokens_equal": out.token_ids ==
               outs["plain"].token_ids, "differing": np.flatnonzero(diff).tolist(),
               "max_diff": float(diff.max()), "logprobs": got.tolist()}
        if name in runs and name != "plain":
            m = runs[name].spec_metrics
            row |= {"drafted": m.drafted, "accepted": m.accepted}
        print(json.dumps(row), flush=True)


def states_probe() -> None:
    """Plain engines alike but for their states' shapes: a request's logprobs in each."""
    import deepinfer_jax
    from deepinfer_jax import SamplingParams

    tiny = REPO / "models" / "deepinfer-tiny-v4"
    engine = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=128,
                  token_buckets=(128,), page_size=64, show_progress=False, batch_invariant=True,
                  enable_prefix_caching=False)
    variants = {"plain": {}, "16 slots": {"max_num_seqs": 16}, "more pages": {"num_pages": 192}}
    outs = {}
    for name, change in variants.items():
        llm = deepinfer_jax.LLM(tiny, **{**engine, **change})
        source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
        prompt = llm.tokenizer.encode(source)[:310]
        outs[name] = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True,
                                                           logprobs=1), use_tqdm=False)[0]
        del llm
    ref = np.array([lp.logprob for lp in outs["plain"].logprobs])
    for name, out in outs.items():
        got = np.array([lp.logprob for lp in out.logprobs])
        diff = np.abs(got - ref)
        print(json.dumps({"probe": "states", "run": name,
                          "tokens_equal": out.token_ids == outs["plain"].token_ids,
                          "differing": np.flatnonzero(diff).tolist(),
                          "max_diff": float(diff.max())}), flush=True)


if __name__ == "__main__":
    {"softmax": softmax_probe, "engines": engines_probe, "states": states_probe}[sys.argv[1]]()
