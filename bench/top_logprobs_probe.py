"""Whether the bf16 engine's top logprobs name the wrong tokens on a GPU, or its logits err
(`test_top_logprobs_match_hf[deepinfer-tiny-v4]`, session 59's H100 run: at one position of the
greedy request the top-5 values matched HF's sorted ones, but ranks 1 and 3 carried -6.882 and
-7.548 where HF gives their tokens -7.601 and -6.953: two ids traded places, or two logits
erred by the same amounts in opposite directions).

The test's engine and requests again, then for the greedy request's positions, three readings
of the same row: the engine's top 5 (ids, values), the cache-free forward's log-softmax on the
same device at the engine's tokens (the engine's context) with its top 5 by numpy, and HF's.
Positions where the engine's values are not the forward's at the ids it names are listed with
all three. Also `chunked_top_k` and `lax.top_k` on this device against numpy on the forward's
rows. Needs the oracle's deepinfer-tiny-v4 folder (DEEPINFER_ORACLE_DIR or .cache/oracle).

    python bench/top_logprobs_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.device.chunked_top_k import chunked_top_k

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "deepinfer-tiny-v4"
TOP = 5
# tests/engine/test_engine_vs_hf_cases.py's engine: one 32-token bucket, four slots
ENGINE = dict(max_num_seqs=4, max_model_len=640, max_num_batched_tokens=32, token_buckets=(32,),
              show_progress=False)


def _reference() -> dict:
    root = Path(os.environ.get("DEEPINFER_ORACLE_DIR", REPO / ".cache" / "oracle"))
    found = sorted(p for p in root.glob("deepinfer-tiny-v4-*") if (p / "reference.npz").exists())
    if not found:
        raise SystemExit(f"no deepinfer-tiny-v4 oracle folder in {root} (`make oracle`)")
    return dict(np.load(found[-1] / "reference.npz"))


def _workload(ref: dict) -> tuple[list[list[int]], list[int]]:
    """The test's prompts (HF's greedy prompt, then three prefixes of each logits prompt) and
    how many tokens each generates."""
    prompts, lengths = [ref["greedy_prompt"].tolist()], [len(ref["greedy_tokens"])]
    ids = ref["input_ids"]
    for b in range(ids.shape[0]):
        for k in (ids.shape[1], ids.shape[1] // 2 + 1, 97):
            prompts.append(ids[b, :k].tolist())
            lengths.append(1)
    return prompts, lengths


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _numpy_top(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """top_k's order: larger first, then the lower index."""
    order = np.lexsort((np.broadcast_to(np.arange(rows.shape[-1]), rows.shape), -rows), axis=-1)
    ids = order[:, :k]
    return np.take_along_axis(rows, ids, axis=-1), ids


def main() -> None:
    print("device:", jax.devices()[0], flush=True)
    ref = _reference()
    prompts, lengths = _workload(ref)
    model = deepinfer_jax.load(SHIPPED)
    print("compute dtype:", model.params.head.dtype, flush=True)
    llm = deepinfer_jax.LLM(model, **ENGINE)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=TOP) for n in lengths]
    out = llm.generate(prompts, params, use_tqdm=False)[0]
    tokens = np.asarray(out.token_ids)
    hf_tokens, hf_logits = ref["greedy_tokens"], ref["greedy_logits"]
    n = min(len(tokens), len(hf_tokens))
    same_context = int(np.argmax(tokens[:n] != hf_tokens[:n])) if (tokens[:n] != hf_tokens[:n]).any() \
        else n
    print(f"greedy tokens equal to HF's for the first {same_context} of {n}", flush=True)

    top_ids = np.array([[t for t, _ in lp.top] for lp in out.logprobs])           # [n, TOP]
    top_values = np.array([[v for _, v in lp.top] for lp in out.logprobs])
    # the cache-free forward over the engine's own context: row i predicts token i
    context = list(prompts[0]) + tokens[:-1].tolist()
    forward = _log_softmax(np.asarray(model.logits(context))[0][len(prompts[0]) - 1:])
    hf = _log_softmax(hf_logits[:n])

    at_named = np.take_along_axis(forward, top_ids, axis=-1)       # forward at the engine's ids
    fwd_values, fwd_ids = _numpy_top(forward, TOP)
    misnamed = np.abs(at_named - top_values).max(-1)
    sorted_gap = np.abs(fwd_values - top_values).max(-1)
    print(f"engine values vs the forward's sorted top {TOP}: max |diff| {sorted_gap.max():.4f}")
    print(f"engine values vs the forward at the ids named: max |diff| {misnamed.max():.4f}")
    worst = np.argsort(-misnamed)[:4]
    for i in worst:
        print(f"position {i}: engine ids {top_ids[i].tolist()} values {np.round(top_values[i], 4).tolist()}")
        print(f"    forward at those ids {np.round(at_named[i], 4).tolist()}; forward's own top "
              f"{fwd_ids[i].tolist()} {np.round(fwd_values[i], 4).tolist()}")
        if i < same_context:
            print(f"    HF at the engine's ids {np.round(hf[i][top_ids[i]], 4).tolist()}; HF's top "
                  f"{_numpy_top(hf[i:i + 1], TOP)[1][0].tolist()}")
    # the sampler's top-k on this device against numpy, on the forward's rows as float32
    rows = jnp.asarray(forward.astype(np.float32))
    want_values, want_ids = _numpy_top(np.asarray(rows), 20)
    for name, fn in (("chunked_top_k", chunked_top_k), ("lax.top_k", jax.lax.top_k)):
        values, ids = jax.jit(fn, static_argnums=1)(rows, 20)
        print(f"{name} on {rows.devices().pop().platform}, k=20 over {rows.shape}: ids equal "
              f"numpy's {bool((np.asarray(ids) == want_ids).all())}, values equal "
              f"{bool((np.asarray(values) == want_values).all())}")
    verdict = ("ids misnamed: the engine's values are the forward's sorted ones, not those of "
               "the tokens it names" if misnamed.max() > 3 * sorted_gap.max() + 1e-3 else
               "the engine's ids and values agree with the forward: its logits, not its ids, "
               "part from HF's")
    print("verdict:", verdict)


if __name__ == "__main__":
    main()
