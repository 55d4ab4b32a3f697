"""Engine fixtures: the tiny-mixed model and its 32-request Hugging Face workload."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import deepinfer_jax
from tests.conftest import REPO, oracle_case

# Small enough to compile quickly, large enough for 600-token prompts. Two token buckets:
# decode steps take 16 tokens, prefill chunks 128; buckets between would only save padding,
# and each is a compiled step (most of an engine test's time on the CPU). The choice among
# several is tested on the host (tests/host/test_sampler_choice.py) and in the engine by
# test_batch_invariance.py's bucket sets (16 and 128; 1, 4 and 32).
ENGINE = dict(max_num_seqs=8, max_model_len=640, max_num_batched_tokens=128,
              token_buckets=(16, 128), page_size=64, show_progress=False)


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    max_new: list[int]
    expected: list[list[int]]        # HF generate(do_sample=False) of each prompt alone


@pytest.fixture(scope="session")
def model():
    return oracle_case("tiny-mixed").model


@pytest.fixture(scope="session")
def workload() -> Workload:
    ref = oracle_case("tiny-mixed").reference
    lens, new = ref["batch_prompt_lens"], ref["batch_max_new"]
    prompts = np.split(ref["batch_prompts"], np.cumsum(lens)[:-1])
    outputs = np.split(ref["batch_outputs"], np.cumsum(new)[:-1])
    return Workload([p.tolist() for p in prompts], new.tolist(), [o.tolist() for o in outputs])


@pytest.fixture(scope="session")
def llm(model):
    """The default engine, compiled once for the session."""
    return deepinfer_jax.LLM(model, **ENGINE)


CORPUS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
          "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 20


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, model):
    """The tiny-mixed checkpoint plus a byte-level BPE tokenizer that fits its 512-token vocab,
    and the shipped model's chat template (with this tokenizer's BOS)."""
    d = tmp_path_factory.mktemp("with-tokenizer")
    for f in oracle_case("tiny-mixed").checkpoint.iterdir():
        os.symlink(f, d / f.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(d / "tokenizer.json"))
    shipped = json.loads((REPO / "models/deepinfer-tiny-v4/tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": shipped["chat_template"]}))
    return d


@pytest.fixture(scope="session")
def text_llm(model_dir):
    """The default engine's shapes over the checkpoint with a tokenizer (shares its steps)."""
    return deepinfer_jax.LLM(model_dir, **ENGINE)
