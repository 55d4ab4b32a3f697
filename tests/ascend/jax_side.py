"""The JAX side of the Ascend backend's tests: the parameter tree handed over by path, and
both engines run on the same prompts (the Ascend one in .venv-ascend, tests/ascend/
torch_generate.py)."""

from __future__ import annotations

import json

import jax
import numpy as np

import deepinfer_jax
from deepinfer_jax import SamplingParams
from tests.ascend.ascend_env import run_in_ascend_env


def flat_params(params) -> dict[str, np.ndarray]:
    """The parameter tree's leaves by dotted path ("layers.0.attn.wq_a")."""
    def name(key):
        for attr in ("name", "idx", "key"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        raise TypeError(key)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return {".".join(name(k) for k in path): np.asarray(leaf) for path, leaf in leaves}


MAX_TOKENS = 64
ENGINE = dict(max_num_seqs=4, max_model_len=320, page_size=64, num_pages=12,
              max_num_batched_tokens=64, token_buckets=(16, 64), show_progress=False)


def both_engines(tmp_path, checkpoint, model, rounds, sampling: list[dict] | None = None,
                 tokenizer=None, **options) -> tuple[list, dict, object]:
    """-> (the JAX engine's tokens per prompt, the Ascend side's result.json, the JAX LLM),
    both engines on the checkpoint (the JAX one's float32 `model` of it) with the same shapes
    and options; each round of prompts is one `generate` call, with SamplingParams(**kw) per
    prompt of a single round (sampling) or MAX_TOKENS greedy ones ignoring EOS. tokenizer: the
    JAX engine's (the Ascend one reads the checkpoint's tokenizer.json itself)."""
    llm = deepinfer_jax.LLM(model, tokenizer=tokenizer, **{**ENGINE, **options})
    params = ([SamplingParams(**kw) for kw in sampling] if sampling else
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    outputs = [o for prompts in rounds for o in llm.generate(prompts, params, use_tqdm=False)]
    sc = llm.engine.step_cfg        # the same shapes (the pool, the buckets) on both sides
    (tmp_path / "case.json").write_text(json.dumps({
        "checkpoint": str(checkpoint), "rounds": rounds, "max_tokens": MAX_TOKENS,
        "sampling": sampling,
        "engine": dict(max_num_seqs=sc.max_num_seqs, max_model_len=sc.max_model_len,
                       page_size=sc.page_size, num_pages=sc.num_pages,
                       max_num_batched_tokens=sc.max_num_batched_tokens,
                       token_buckets=list(sc.token_buckets), max_logprobs=sc.max_logprobs,
                       **{k: v for k, v in options.items() if k not in ENGINE})}))
    run_in_ascend_env("tests/ascend/torch_generate.py", str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    return [list(o.outputs[0].token_ids) for o in outputs], result, llm


