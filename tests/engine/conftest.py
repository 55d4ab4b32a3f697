"""Engine fixtures: the tiny-mixed model and its 32-request Hugging Face workload."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import deepinfer_jax
from tests.conftest import oracle_case

# Small enough to compile quickly, large enough for 600-token prompts. The compilation cache
# is the default one, under $XDG_CACHE_HOME (set by tests/conftest.py), so that engines built
# by the CLI tests with the same shapes reuse the compiled steps.
ENGINE = dict(max_num_seqs=8, max_model_len=640, max_num_batched_tokens=128,
              token_buckets=(16, 32, 64, 128), page_size=64, show_progress=False)


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
