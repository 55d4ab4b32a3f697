"""The engine's paged, chunked, batched path against Hugging Face on every oracle case: greedy
tokens and logprobs (the chosen token's and the top 5) at every position HF has logits for.

Per case, one engine (a 32-token step budget: each prompt is prefilled over many steps, which
it shares with the others) runs a batch of greedy requests together:
  * HF's greedy prompt, 32 new tokens, held to `generate`'s tokens and to the logits each of its
    steps took the argmax of (the oracle's `greedy_tokens`, `greedy_logits`);
  * three prefixes of each logits prompt (`input_ids`), one new token each, held to HF's
    full-sequence logits at the prefix's last position (and their argmax).

Tolerances follow the precision the engine runs in, relative to S, the largest |HF logit| over
the case's compared positions (as tests/model/test_hf_parity.py measures its error):
  * float32: |logit error| <= 1e-4 S, the bound the cache-free forward meets against HF in
    test_hf_parity.py; the paged forward must meet it too (it is ~1e-6 S here).
  * bfloat16: |logit error| <= 4u S, u = 2^-8 bf16's unit roundoff: the lm head's input is
    rounded to bf16, and so is every layer's output before it; a few roundings' worth.
  * A logprob, logit - logsumexp(logits), moves by at most twice the largest logit error
    (logsumexp is 1-Lipschitz in the max norm), so the logprob tolerance is twice the logit
    bound. The k-th largest logprob moves no more than the logprobs do, which lets the top 5
    be checked whatever their ties.
  * Greedy tokens: equal to HF's, except where HF's top two logits lie within twice the logit
    bound of each other: a near tie, which rounding may order either way. There the contexts
    part, so the request's comparison ends with that token. No float32 comparison has a near
    tie (`test_float32_comparisons_have_no_near_ties`): there every token must equal HF's.

The shipped checkpoint runs in bf16, as its config asks; as HF's reference is float32, it also
runs in float32, where its tolerance is tight.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from tests.conftest import REPO, oracle_case

pytestmark = pytest.mark.oracle

SHIPPED = REPO / "models" / "deepinfer-tiny-v4"
CASES = ("tiny-mixed", "tiny-sigmoid", "tiny-legacy", "deepinfer-tiny-v4")
TOP = 5
BUDGET = 32
# One token bucket: one compiled step per model. Room for tiny-legacy's 600-token prompt.
ENGINE = dict(max_num_seqs=4, max_model_len=640, max_num_batched_tokens=BUDGET,
              token_buckets=(BUDGET,), show_progress=False)
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
LOGIT_BOUND = {F32: 1e-4, BF16: 4 * 2.0**-8}
# id: (oracle case, dtype asked for (None: the checkpoint's own), the compute dtype expected)
RUNS = {"tiny-mixed": ("tiny-mixed", None, F32),
        "tiny-sigmoid": ("tiny-sigmoid", None, F32),
        "tiny-legacy": ("tiny-legacy", None, F32),
        "deepinfer-tiny-v4": ("deepinfer-tiny-v4", None, BF16),
        "deepinfer-tiny-v4-float32": ("deepinfer-tiny-v4", np.float32, F32)}


@dataclasses.dataclass
class HfWorkload:
    prompts: list[list[int]]
    tokens: list[np.ndarray]          # per request: HF's greedy tokens [n]
    logits: list[np.ndarray]          # per request: the logits HF took them from [n, V]

    def logit_tol(self, dtype) -> float:
        return LOGIT_BOUND[jnp.dtype(dtype)] * max(float(np.abs(x).max()) for x in self.logits)

    def near_ties(self, i: int, dtype) -> np.ndarray:
        """Request i's positions where HF's top two logits are within twice the bound."""
        top2 = np.sort(self.logits[i], axis=-1)[:, -2:]
        return top2[:, 1] - top2[:, 0] <= 2 * self.logit_tol(dtype)


def hf_workload(name: str) -> HfWorkload:
    case = oracle_case(name)
    ref = case.reference
    if "greedy_logits" not in ref:
        pytest.fail(f"{case.dir} predates greedy_logits: rebuild the oracle (`make oracle`)")
    work = HfWorkload([ref["greedy_prompt"].tolist()], [ref["greedy_tokens"]],
                      [ref["greedy_logits"]])
    ids, logits = ref["input_ids"], ref["logits"]
    for b in range(ids.shape[0]):
        for k in (ids.shape[1], ids.shape[1] // 2 + 1, 97):
            work.prompts.append(ids[b, :k].tolist())
            work.logits.append(logits[b, k - 1: k])
            work.tokens.append(logits[b, k - 1: k].argmax(-1))     # HF's greedy next token
    return work


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclasses.dataclass
class Run:
    hf: HfWorkload
    dtype: jnp.dtype                  # the model's compute dtype
    expected_dtype: jnp.dtype
    outputs: list                     # the engine's RequestOutputs, in prompt order
    num_steps: int

    @property
    def logprob_tol(self) -> float:
        return 2 * self.hf.logit_tol(self.dtype)

    def compared(self, i: int) -> tuple[int, bool]:
        """(how many of request i's positions see HF's context, whether the engine parted from
        HF at the last of them): all, unless it took another token than HF at a near tie."""
        tokens = np.asarray(self.outputs[i].token_ids)
        n = len(tokens)
        parted = np.flatnonzero((tokens != self.hf.tokens[i][:n])
                                & self.hf.near_ties(i, self.dtype)[:n])
        return (int(parted[0]) + 1, True) if parted.size else (n, False)


@pytest.fixture(scope="module", params=list(RUNS))
def run(request) -> Run:
    name, dtype, expected = RUNS[request.param]
    hf = hf_workload(name)
    model = deepinfer_jax.load(SHIPPED if name == "deepinfer-tiny-v4"
                               else oracle_case(name).checkpoint, dtype=dtype)
    params = [SamplingParams(max_tokens=len(t), ignore_eos=True, logprobs=TOP) for t in hf.tokens]
    llm = deepinfer_jax.LLM(model, **ENGINE)
    outputs = llm.generate(hf.prompts, params, use_tqdm=False)
    return Run(hf, jnp.dtype(model.params.head.dtype), expected, outputs, llm.engine.num_steps)


def test_every_request_completes_with_logprobs(run):
    assert run.dtype == run.expected_dtype
    assert len(run.outputs) == len(run.hf.prompts)
    for out, want in zip(run.outputs, run.hf.tokens):
        assert out.error is None, out.error
        assert len(out.token_ids) == len(want) and len(out.logprobs) == len(want)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_greedy_tokens_match_hf(run):
    for i, out in enumerate(run.outputs):
        n, parted = run.compared(i)
        held = n - 1 if parted else n           # a token taken at a near tie is exempt
        chex.assert_trees_all_equal(np.asarray(out.token_ids[:held]), run.hf.tokens[i][:held])


def test_chosen_logprobs_match_hf(run):
    for i, out in enumerate(run.outputs):
        n, _ = run.compared(i)
        hf = log_softmax(run.hf.logits[i][:n])
        ours = np.array([lp.logprob for lp in out.logprobs[:n]])
        chex.assert_trees_all_close(ours, hf[np.arange(n), out.token_ids[:n]],
                                    atol=run.logprob_tol, rtol=0)


def test_top_logprobs_match_hf(run):
    for i, out in enumerate(run.outputs):
        n, _ = run.compared(i)
        hf = log_softmax(run.hf.logits[i][:n])
        top_ids = np.array([[t for t, _ in lp.top] for lp in out.logprobs[:n]])
        top_values = np.array([[v for _, v in lp.top] for lp in out.logprobs[:n]])
        chex.assert_shape([top_ids, top_values], (n, TOP))
        # the k-th largest values agree, k = 1..5 ...
        chex.assert_trees_all_close(top_values, -np.sort(-hf, axis=-1)[:, :TOP],
                                    atol=run.logprob_tol, rtol=0)
        # ... and each is the HF logprob of the token named with it
        chex.assert_trees_all_close(top_values, np.take_along_axis(hf, top_ids, axis=-1),
                                    atol=run.logprob_tol, rtol=0)


def test_prompts_were_chunked_and_batched(run):
    """Guard on the setup: the test exercises what it claims to."""
    prompts = run.hf.prompts
    assert len(prompts) >= 4 and all(len(p) > BUDGET for p in prompts)
    # every prompt token went through a step of at most BUDGET tokens ...
    assert run.num_steps >= math.ceil(sum(map(len, prompts)) / BUDGET)
    # ... and the requests shared steps: one at a time would take this many
    alone = sum(math.ceil(len(p) / BUDGET) + len(t) - 1 for p, t in zip(prompts, run.hf.tokens))
    assert run.num_steps < alone


@pytest.mark.parametrize("name", CASES)
def test_float32_comparisons_have_no_near_ties(name):
    """Guard on the fixtures: in float32 every greedy token is held to HF's."""
    hf = hf_workload(name)
    for i in range(len(hf.prompts)):
        assert not hf.near_ties(i, F32).any(), f"request {i}"
