"""The paged, ragged V4.1 step (model/v41/paged_forward.py) against the reference fixtures.

The three prompts of `reference.npz`, unpadded, run as one ragged batch of continuous
batching: chunked prefill (chunks of 13 tokens, which split ratio-2 / ratio-4 groups and
candidate blocks across steps), the short prompt decoding while the long ones still prefill,
then greedy decoding to 12 tokens each. Plans come from the host's plan builder; every step
has one shape (one compile per fixture).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import deepinfer_jax.device  # noqa: F401  (registers BatchPlan as a pytree)
from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import Request, SamplingParams
from deepinfer_jax.model.v41 import engram_hash
from deepinfer_jax.model.v41.paged_forward import final_logits, forward_step
from deepinfer_jax.model.v41.state import init_v41_state
from tests.model.v41_oracle import FIXTURES, assert_parted_only_after_rounding_boundaries, case

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

CHUNK, BUCKET, PAGE, BLOCKS = 13, 40, 16, 6      # 6 pages of 16 positions: 96 >= 70 + 12


@functools.partial(jax.jit, static_argnums=(5, 6))
def _step(params, state, plan, token_ids, engram_ids, cfg, step_cfg):
    state, final = forward_step(params, state, plan, token_ids, engram_ids, cfg, step_cfg)
    return state, final_logits(params, final, cfg, step_cfg.compute), (final.top_k, final.candidates)


def _step_config(cfg, num_seqs: int) -> StepConfig:
    return StepConfig(max_num_seqs=4, max_model_len=PAGE * BLOCKS, page_size=PAGE,
                      num_pages=num_seqs * BLOCKS, max_blocks_per_seq=BLOCKS,
                      max_num_batched_tokens=BUCKET, token_buckets=(BUCKET,), max_logprobs=0,
                      vocab_size=cfg.vocab_size, speculative=None, compute=ComputeConfig())


def _engram_ids(plan, reqs, seqs, cfg, ref, tables) -> np.ndarray:
    """i32[T, L_e, C]: each fed token's row ids, hashed over its sequence so far (the host's
    look-back across steps)."""
    out = np.zeros((plan.num_tokens, len(cfg.engram.layer_ids), cfg.engram.n_columns), np.int32)
    for row, seq in enumerate(seqs):
        tokens = np.array([reqs[row].tokens[: seq.start + seq.num_tokens]])
        ids = engram_hash.hash_ids(tokens, np.ones_like(tokens, bool), ref["engram_token_map"],
                                   cfg.engram, tables)[0, seq.start:]
        offset = plan.seq_offset[row]
        out[offset: offset + seq.num_tokens] = ids
    return out


def _layout(prompts, steps: int, step_cfg: StepConfig, scattered: bool):
    """-> (slot of each sequence, its pages)."""
    if not scattered:
        return (list(range(len(prompts))),
                [list(range(r * BLOCKS, (r + 1) * BLOCKS)) for r in range(len(prompts))])
    pool = np.random.default_rng(0).permutation(step_cfg.num_pages).tolist()
    pages = []
    for p in prompts:
        need = -(-(len(p) + steps) // PAGE)
        pages.append([pool.pop() for _ in range(need)])
    return [3, 0, 2][: len(prompts)], pages


@functools.lru_cache(maxsize=4)
def run_paged(folder, chunk: int = CHUNK, scattered: bool = False):
    """-> (per prompt: logits f32[len, V] of its prompt tokens, then the logits f32[12, V] that
    chose each generated token; greedy tokens; per prompt the
    top-k i32[len, k] of its prompt tokens per index source layer, and the candidate source's
    blocks bool[len, R] under the key "candidates"). scattered: the sequences get slots out of
    order and only the pages they need, drawn at random from the pool (the rest of each block
    table points past it)."""
    cfg, params, ref = case(folder)
    steps = ref["gen_tokens"].shape[1]
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    step_cfg = _step_config(cfg, len(prompts))
    tables = engram_hash.hash_tables(cfg.engram)
    state = init_v41_state(cfg, step_cfg)
    reqs = [Request(str(r), p, SamplingParams(), r) for r, p in enumerate(prompts)]
    slots, pages = _layout(prompts, steps, step_cfg, scattered)
    computed = [0] * len(reqs)
    logits = [np.zeros((len(p), cfg.vocab_size), np.float32) for p in prompts]
    sampled = [[] for _ in prompts]
    top_k = [{i: [None] * len(p) for i in (*cfg.index_source_layer_ids, "candidates")}
             for p in prompts]
    while any(len(r.generated) < steps for r in reqs):
        live = [r for r, req in enumerate(reqs) if len(req.generated) < steps]
        seqs = []
        for r in live:
            total = len(reqs[r].tokens)
            n = min(chunk, total - computed[r])
            seqs.append(ScheduledSeq(reqs[r], computed[r], n, samples=computed[r] + n == total,
                                     slot=slots[r], pages=pages[r]))
        plan = build_plan(ScheduleDecision(tuple(seqs)), BUCKET, step_cfg)
        ids = _engram_ids(plan, [reqs[r] for r in live], seqs, cfg, ref, tables)
        state, out, (chosen, candidates) = _step(params, state, plan, plan.token_ids, ids, cfg,
                                                 step_cfg)
        out, chosen = np.asarray(out), {i: np.asarray(c) for i, c in enumerate(chosen)
                                        if c is not None}
        chosen["candidates"] = np.asarray(candidates)
        for row, (r, seq) in enumerate(zip(live, seqs)):
            span = slice(plan.seq_offset[row], plan.seq_offset[row] + seq.num_tokens)
            prompt_part = slice(seq.start, min(seq.start + seq.num_tokens, len(prompts[r])))
            n_prompt = prompt_part.stop - prompt_part.start
            if n_prompt > 0:
                logits[r][prompt_part] = out[span][:n_prompt]
                for i in top_k[r]:
                    top_k[r][i][prompt_part] = chosen[i][span][:n_prompt]
            computed[r] += seq.num_tokens
            if seq.samples:
                sampled[r].append(out[span][-1])
                reqs[r].generated.append(int(out[span][-1].argmax()))
    return (logits, np.array(sampled)), np.array([r.generated for r in reqs]), top_k


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
@pytest.mark.parametrize("chunk,scattered", [(CHUNK, False), (5, True)])
def test_paged_greedy_tokens_match_the_reference(folder, chunk, scattered):
    _, _, ref = case(folder)
    _, tokens, _ = run_paged(folder, chunk, scattered)
    np.testing.assert_array_equal(tokens, ref["gen_tokens"])


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_paged_chunking_and_layout_do_not_change_the_logits(folder):
    """Chunks of 13 in slots 0-2 with contiguous pages, and chunks of 5 in slots 3, 0, 2 with
    scattered pages, give the same logits up to float32 reassociation (one step shape and each
    token's row computed alone, but XLA's CPU code for a row may depend on where it sits in the
    step: 2e-6 seen on AVX2), parting only after a rounding boundary."""
    (prompt_a, sampled_a), _, _ = run_paged(folder)
    (prompt_b, sampled_b), _, _ = run_paged(folder, 5, True)
    assert_parted_only_after_rounding_boundaries(
        folder, [np.abs(a - b).max(-1) for a, b in zip(prompt_a, prompt_b)], 1e-5)
    assert_parted_only_after_rounding_boundaries(
        folder, np.abs(sampled_a - sampled_b).max(-1), 1e-5, _decode_starts(folder))


def _decode_starts(folder) -> list[int]:
    """Per prompt, the position whose logits choose its first generated token."""
    _, _, ref = case(folder)
    return [int(n) - 1 for n in ref["lengths"]]


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_paged_prompt_logits_match_each_prompt_alone(folder):
    """Within 1e-4 of `logits_single` up to each prompt's first fake-quantization rounding
    boundary (v41_oracle.first_rounding_boundaries); past one, the paged step and the reference
    may round a value a whole step apart (the fixtures' README)."""
    _, _, ref = case(folder)
    (logits, _), _, _ = run_paged(folder)
    assert_parted_only_after_rounding_boundaries(
        folder, [np.abs(got - ref["logits_single"][r, -len(got):]).max(-1)
                 for r, got in enumerate(logits)], 1e-4)


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_paged_decode_logits_match_a_reference_step(folder):
    """The logits that chose each generated token, within 1e-4 of the reference's cached step
    (`gen_logits`) or of its cache-free recomputation (`gen_logits_nocache`), which differ from
    each other by isolated fake-quantization flips (README); past a prompt's first rounding
    boundary the paged step may part from both."""
    _, _, ref = case(folder)
    (_, sampled), _, _ = run_paged(folder)
    err = np.minimum(np.abs(sampled - ref["gen_logits"]).max(-1),
                     np.abs(sampled - ref["gen_logits_nocache"]).max(-1))
    assert_parted_only_after_rounding_boundaries(folder, err, 1e-4, _decode_starts(folder))


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_paged_indexer_selections_match_the_reference_as_sets(folder):
    """Every prompt token's top-k at every index source, as sets, and the candidate source's
    block mask, equal the reference's (left padding shifts no entry index), up to each
    prompt's first rounding boundary."""
    cfg, _, ref = case(folder)
    _, _, top_k = run_paged(folder)
    differs = []                                    # per prompt: bool[n], any selection differs
    for r, chosen in enumerate(top_k):
        n = len(chosen["candidates"])
        mismatch = np.zeros(n, bool)
        for i in cfg.index_source_layer_ids:
            want = ref[f"indexer_topk_idx_layer{i}"][r, -n:]
            mismatch |= [set(a.tolist()) - {-1} != set(b.tolist()) - {-1}
                         for a, b in zip(chosen[i], want, strict=True)]
        mask = np.stack(chosen["candidates"])
        want = ref[f"indexer_candidates_layer{cfg.candidate_source_layer_id}"][r, -n:]
        # whole blocks: the newest block may reach past the last entry (and past the
        # reference's width, S entries)
        mismatch |= (mask[:, :want.shape[1]] != want).any(-1)
        differs.append(mismatch)
    assert_parted_only_after_rounding_boundaries(folder, differs, 0.5)
