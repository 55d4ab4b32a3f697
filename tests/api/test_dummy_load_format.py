"""`--load-format dummy`: random weights from a config alone (api/dummy.py), served by
`deepinfer serve` with no tokenizer: token-id prompts complete with exactly the tokens asked
for (counted in usage), their text is empty, and a text prompt is a 400 that says why."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import openai
import pytest

from deepinfer_jax.api.dummy import dummy_model
from deepinfer_jax.config.model import AttentionKind, MlpKind
from tests.api.conftest import REPO_ROOT, free_port
from tests.api.server_process import connect_when_up
from tests.conftest import subprocess_pythonpath

CONFIG = REPO_ROOT / "configs" / "tiny" / "tiny-mixed.json"


def test_a_dummy_model_is_the_config_sliced_with_weights_fixed_by_the_seed():
    a, b = (dummy_model(CONFIG, layers=2) for _ in range(2))
    assert a.config.num_layers == 2 and a.config.num_mtp_layers == 0
    assert a.config.layer_types == (AttentionKind.CSA, AttentionKind.HCA)
    assert a.config.mlp_types == (MlpKind.MOE, MlpKind.MOE)
    assert a.params.embed.dtype == np.dtype("bfloat16")        # the config names no dtype
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_deepinfer_serve_a_dummy_model_without_a_tokenizer():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(), "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "deepinfer_jax.api.cli", "serve", str(CONFIG), "--port", str(port),
         "--load-format", "dummy", "--dummy-layers", "2", "--log-level", "warning",
         "--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "16",
         "--token-buckets", "16"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client, [model] = connect_when_up(process, port, timeout_s=240, request_timeout_s=60)
        assert model.id == "tiny-mixed"           # the config file's name
        request = dict(model="tiny-mixed", prompt=[5, 17, 42, 9], max_tokens=7, temperature=0,
                       extra_body={"ignore_eos": True})
        out = client.completions.create(**request)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 7)
        assert out.choices[0].text == "" and out.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(**request, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 7
        assert sum(len(c.choices) for c in chunks) >= 1
        assert all(c.text == "" for chunk in chunks for c in chunk.choices)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{**request, "prompt": "words need a tokenizer"})
        assert info.value.body["param"] == "prompt" and "token ids" in info.value.body["message"]
    finally:
        process.send_signal(2)
        assert process.wait(30) == 0
