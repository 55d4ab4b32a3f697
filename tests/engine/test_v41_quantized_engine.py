"""A V4.1 checkpoint in the release's formats (FP8 projections, FP4 routed experts, FP8 engram
tables; written by tests/model/v41_quantized.py with numpy from the documented format) served
with its weights kept quantized, against its dequantize-then-float twin (the same numbers
decoded by the writer, stored as float32).

The cache-free forward dequantizes each layer's kept weights to float32, exactly (E8M0
scales are powers of two), so the two compute with the same weight values; only XLA's fusion
of the decode may reorder float32 sums. The engine's step hands the routed experts to V4's
grouped GEMM as stored (Fp4Blocks) and the shared expert to `invariant.linear` as stored
(Fp8Blocks), which decode them inside the op, exactly as well. Tolerance: 1e-5 on logits
and logprobs (typical |logit| ~1); greedy tokens equal over 32 steps.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.api.v41_model import load_v41
from deepinfer_jax.host.request import SamplingParams
from deepinfer_jax.model import moe as v4_moe
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks, is_quantized
from tests.model.v41_oracle import FIXTURES
from tests.model.v41_quantized import write_pair

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

ENGINE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16, token_buckets=(16,),
              show_progress=False)
STEPS = 32
TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("v41q_engine"))


@functools.lru_cache(maxsize=1)
def _prompts():
    ref = np.load(FIXTURES[0] / "reference.npz")
    return ref, [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]


def _generate(folder):
    llm = deepinfer_jax.LLM(folder, dtype=np.float32, **ENGINE)
    _, prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               greedy, use_tqdm=False)]
    tokens = np.array([o.token_ids for o in outs])
    logprobs = np.array([[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)]
                         for o in outs])
    return llm, tokens, logprobs


def test_cache_free_logits_of_kept_weights_match_the_float_twin(pair):
    quantized, twin = pair
    ref, _ = _prompts()
    kept, floats = load_v41(quantized, pad_to=80), load_v41(twin, pad_to=80)
    assert not any(is_quantized(w) for w in jax.tree.leaves(floats.params, is_leaf=is_quantized))
    ids, mask = ref["input_ids"], ref["attention_mask"]
    ours, want = kept.logits(ids, mask), floats.logits(ids, mask)
    live = mask.astype(bool)
    assert np.abs(ours - want)[live].max() <= TOL
    # The quantization is not a no-op: the twin is a different model from the float fixture.
    assert np.abs(want - ref["logits"])[live].max() > 1e-2
    # weights="bf16" (the load option) gives the dequantized twin.
    bf16 = load_v41(quantized, weights="bf16", pad_to=80)
    for a, b in zip(jax.tree.leaves(bf16.params), jax.tree.leaves(floats.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_serves_kept_weights_as_its_float_twin(pair, monkeypatch):
    """Chunked prefill and continuous batching (16-token steps, three prompts of 7, 33 and 70
    tokens), greedy: the same 32 tokens per prompt and logprobs within TOL. The kept step
    reads the experts as stored: every layer's routed experts reach V4's `routed_experts` as
    Fp4Blocks and its shared expert `shared_expert` as Fp8Blocks (no float32 expert stack
    decoded per layer by the step); the twin's as float32 arrays."""
    seen = {"routed": [], "shared": []}

    def spy(name):
        real = getattr(v4_moe, name)

        def recorded(x, *args):     # (x, experts, weights, p, ...) / (x, p, ...)
            p = args[2] if name == "routed_experts" else args[0]
            seen[name.split("_")[0]].append((type(p.w13), type(p.w2), x.dtype))
            return real(x, *args)
        monkeypatch.setattr(v4_moe, name, recorded)

    spy("routed_experts")
    spy("shared_expert")
    quantized, twin = pair
    llm, tokens, logprobs = _generate(quantized)
    layer = llm.model.params.layers[1]
    assert isinstance(layer.attn.wq_b, Fp8Blocks) and isinstance(layer.moe.experts.w13, Fp4Blocks)
    layers = len(llm.model.params.layers)
    kept = {k: list(v) for k, v in seen.items()}
    assert len(kept["routed"]) >= layers and len(kept["shared"]) >= layers
    assert set(kept["routed"]) == {(Fp4Blocks, Fp4Blocks, np.dtype(np.float32))}
    assert set(kept["shared"]) == {(Fp8Blocks, Fp8Blocks, np.dtype(np.float32))}
    _, want_tokens, want_logprobs = _generate(twin)
    twin_routed = seen["routed"][len(kept["routed"]):]
    assert twin_routed and not {t[0] for t in twin_routed} & {Fp4Blocks, Fp8Blocks}
    np.testing.assert_array_equal(tokens, want_tokens)
    assert np.abs(logprobs - want_logprobs).max() <= TOL
