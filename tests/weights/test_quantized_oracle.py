"""The release's FP8 / FP4 formats as written by torch (tests/oracle/build_quantized.py, from
the documented format, independently of the engine's quantizer), against:
  * torch's own decoding of them (the loader must read the same numbers),
  * Hugging Face on the decoded weights (logits and a 64-token greedy continuation), and
  * the engine with the same checkpoint dequantized to bf16 at load (greedy equal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights import load_params
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks, dequantize_tree, is_quantized
from tests.conftest import ORACLE_DIR

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def fixture_dir():
    found = sorted(p for p in ORACLE_DIR.glob("quantized-tiny-mixed-*") if (p / "meta.json").exists())
    if not found:
        pytest.fail(f"no quantized oracle fixtures in {ORACLE_DIR}: run `make oracle`")
    return found[-1]


@pytest.fixture(scope="module")
def reference(fixture_dir):
    return dict(np.load(fixture_dir / "reference.npz"))


def test_loader_reads_torch_written_formats_as_torch_decodes_them(fixture_dir):
    cfg = read_model_config(fixture_dir / "quantized")
    kept = load_params(fixture_dir / "quantized", cfg, jnp.float32)
    layer = kept.layers[1]
    assert isinstance(layer.attn.wq_b, Fp8Blocks) and layer.attn.wq_b.codes.dtype == jnp.float8_e4m3fn
    assert isinstance(layer.attn.indexer.wq_b, Fp8Blocks)
    assert isinstance(layer.moe.experts.w13, Fp4Blocks)
    assert layer.moe.experts.w13.packed.dtype == jnp.uint8
    # [E, 2I, D/2]: gate rows then up rows, as stored
    assert layer.moe.experts.w13.packed.shape == (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size,
                                                  cfg.hidden_size // 2)
    assert isinstance(kept.mtp[0].e_proj, Fp8Blocks)
    decoded = load_params(fixture_dir / "dequantized", cfg, jnp.float32)
    leaves = jax.tree.leaves(dequantize_tree(kept, jnp.float32))
    for ours, torch_decoded in zip(leaves, jax.tree.leaves(decoded), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(torch_decoded))


def test_quantized_model_matches_hf_on_the_decoded_weights(fixture_dir, reference):
    model = deepinfer_jax.load(fixture_dir / "quantized", dtype=jnp.float32)
    assert any(is_quantized(w) for w in jax.tree.leaves(model.params, is_leaf=is_quantized))
    ours = model.logits(reference["input_ids"])
    err = np.abs(ours - reference["logits"]).max(axis=-1) / np.abs(reference["logits"]).max()
    assert err.max() <= 1e-4, err.max()
    tokens = [int(t) for t in reference["greedy_prompt"]]
    for _ in range(len(reference["greedy_tokens"])):
        tokens.append(int(model.logits(tokens)[0, -1].argmax()))
    assert tokens[len(reference["greedy_prompt"]):] == reference["greedy_tokens"].tolist()


def test_engine_greedy_quantized_equals_bf16_dequantized(fixture_dir, reference):
    """64 greedy tokens through the engine (paged steps, chunked prefill), the weights kept
    quantized vs dequantized to bf16 at load; and the logits within bf16 rounding."""
    prompt = [int(t) for t in reference["greedy_prompt"]]
    shapes = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64, token_buckets=(64,))
    params = deepinfer_jax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = {}
    for weights in ("quantized", "bf16"):
        llm = deepinfer_jax.LLM(fixture_dir / "quantized", dtype=jnp.bfloat16, weights=weights,
                                tokenizer=None, **shapes)
        outs[weights] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(outs["quantized"]) == 64
    assert list(outs["quantized"]) == list(outs["bf16"])


def test_batch_invariant_mode_on_quantized_weights(fixture_dir):
    """FP8 / FP4 weights kept quantized, batch-invariant mode: each request's logprobs are
    bitwise those it gets alone."""
    llm = deepinfer_jax.LLM(fixture_dir / "quantized", dtype=jnp.bfloat16, batch_invariant=True,
                            max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64,
                            token_buckets=(16, 64), show_progress=False)
    assert isinstance(llm.engine.params.layers[1].moe.experts.w13, Fp4Blocks)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, n).tolist() for n in (20, 90, 45)]
    params = deepinfer_jax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                          logprobs=1)

    def logprobs(out):
        return [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]

    batched = [logprobs(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [logprobs(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    assert batched == alone
