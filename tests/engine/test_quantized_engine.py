"""The shipped (trained) tiny model in the release's formats on a GPU: the engine with its
FP8 / FP4 weights kept quantized (the GEMM kernels dequantize as they read) against the same
checkpoint dequantized to bf16 at load. The weights are the same numbers either way (E4M3
and E2M1 values times power-of-two scales are exact in bf16); only the kernels' summation
order differs, and a trained model's margins are wide enough that 64 greedy tokens agree.
GPU only: on the CPU both forms run the same dequantize-then-matmul path
(tests/weights/test_quantized_oracle.py covers that path against Hugging Face)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights import load_params
from deepinfer_jax.weights.export import export_tensors
from deepinfer_jax.weights.safetensors_io import save_file
from pallas_kernels.grouped_gemm import api as gemm
from tests.conftest import REPO
from tests.weights.test_checkpoints import quantize_checkpoint

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
SHIPPED = REPO / "models" / "deepinfer-tiny-v4"


@pytest.fixture(scope="module")
def quantized_checkpoint(tmp_path_factory):
    cfg = read_model_config(SHIPPED)
    tensors = export_tensors(load_params(SHIPPED, cfg, jnp.float32), cfg)
    quantized, _ = quantize_checkpoint(tensors)
    directory = tmp_path_factory.mktemp("quantized")
    save_file(quantized, directory / "model.safetensors")
    config = json.loads((SHIPPED / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, directory / name)
    return directory


def test_quantized_engine_matches_bf16_dequantized_on_gpu(quantized_checkpoint, monkeypatch):
    fp8_kernel_calls = []
    kernel = gemm._BATCHED["mosaic_gpu"]        # the FP8 projections' (model/invariant.py)

    def recording(lhs, rhs, *args, **kwargs):
        out = kernel(lhs, rhs, *args, **kwargs)      # NotSupported passes through unrecorded
        fp8_kernel_calls.append(rhs.dtype == jnp.float8_e4m3fn)
        return out
    monkeypatch.setitem(gemm._BATCHED, "mosaic_gpu", recording)

    prompts = ["def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def __init__"]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=1)
    shapes = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64,
                  show_progress=False)
    outs = {}
    for weights in ("quantized", "bf16"):
        llm = deepinfer_jax.LLM(quantized_checkpoint, weights=weights, **shapes)
        outs[weights] = llm.generate(prompts, params, use_tqdm=False)
    assert any(fp8_kernel_calls), "no FP8 projection ran on the GEMM kernel"
    for q, b in zip(outs["quantized"], outs["bf16"], strict=True):
        assert list(q.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert len(q.outputs[0].token_ids) == 64
        chosen = lambda out: np.array([next(iter(step.values())).logprob  # noqa: E731
                                       for step in out.outputs[0].logprobs])
        np.testing.assert_allclose(chosen(q), chosen(b), atol=0.05)
