"""DeepSeek-V4.1's Engram tables in host memory (engram_tables="host", the default; issue 36)
against the same tables as device weights, on the two oracle fixtures.

With host tables the host gathers each fed token's rows (engine/engram_rows.py) and the step
reads them from the plan instead of gathering from `params.engram_tables`; a token reads the
same float32 values either way, so every logit must agree bit for bit, and the greedy
continuations must be the reference's `gen_tokens`. The device parameters hold no table, and
the memory plan counts the tables in host memory and the step's rows with the activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deepinfer_jax
import deepinfer_jax.device  # noqa: F401  (registers BatchPlan as a pytree)
from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory_v41 import engram_product_bytes, engram_table_bytes
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.engine import memory_plan
from deepinfer_jax.engine.engram_rows import EngramRows
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import Request, SamplingParams
from deepinfer_jax.model.family import model_family
from deepinfer_jax.model.v41 import engram_hash
from deepinfer_jax.model.v41.paged_forward import final_logits
from deepinfer_jax.model.v41.state import init_v41_state
from tests.engine.test_v41_engine import ENGINE, _engine
from tests.model.v41_oracle import ENGINE_FEATURE_FIXTURES, FIXTURES, case

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

CHUNK, BUCKET, PAGE, BLOCKS = 16, 48, 16, 6


def _prompts(ref) -> list[list[int]]:
    return [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]


@functools.lru_cache(maxsize=1)
def _device_llm(folder):
    return deepinfer_jax.LLM(folder, **ENGINE, engram_tables="device")


def _llm(folder, tables: str):
    # host tables are the default: test_v41_engine's engine, shared within a run
    return _engine(folder) if tables == "host" else _device_llm(folder)


# ---- the step: logits bit for bit ----------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(3, 4))
def _step(params, state, plan, cfg, step_cfg):
    state, final = model_family(cfg).forward(params, state, plan, plan.token_ids, cfg, step_cfg)
    return state, final_logits(params, final, cfg, step_cfg.compute)


def _step_config(cfg, host_rows: bool) -> StepConfig:
    return StepConfig(max_num_seqs=4, max_model_len=PAGE * BLOCKS, page_size=PAGE,
                      num_pages=3 * BLOCKS, max_blocks_per_seq=BLOCKS,
                      max_num_batched_tokens=BUCKET, token_buckets=(BUCKET,), max_logprobs=0,
                      vocab_size=cfg.vocab_size, speculative=None, compute=ComputeConfig(),
                      engram_shape=(len(cfg.engram.layer_ids), cfg.engram.n_columns),
                      engram_row_dim=cfg.engram.head_dim if host_rows else 0,
                      engram_lookback=0 if host_rows else cfg.engram.max_ngram_size - 1)


@pytest.mark.parametrize("folder", ENGINE_FEATURE_FIXTURES)
def test_host_rows_give_the_device_tables_logits_bit_for_bit(folder):
    """Chunked prefill with decoding rows beside it, then greedy decoding: every fed token's
    logits from the plan's host-hashed, host-gathered rows equal those of the step's own hash
    and gather exactly, and the tokens are the reference's."""
    cfg, params, ref = case(folder)
    tables = tuple(np.asarray(t) for t in params.engram_tables)
    products = engram_hash.product_words(ref["engram_token_map"],
                                         engram_hash.hash_tables(cfg.engram))
    runs = {}
    for host in (False, True):
        step_cfg = _step_config(cfg, host)
        runs[host] = dict(
            params=(params.replace(engram_tables=()) if host
                    else params.replace(engram_products=jnp.asarray(products))),
            step_cfg=step_cfg, state=init_v41_state(cfg, step_cfg),
            rows=EngramRows(cfg.engram, ref["engram_token_map"], tables) if host else None)
    steps = ref["gen_tokens"].shape[1]
    reqs = [Request(str(r), p, SamplingParams(), r) for r, p in enumerate(_prompts(ref))]
    computed = [0] * len(reqs)
    while any(len(r.generated) < steps for r in reqs):
        seqs = []
        for r, req in enumerate(reqs):
            if len(req.generated) < steps:
                n = min(CHUNK, len(req.tokens) - computed[r])
                seqs.append(ScheduledSeq(req, computed[r], n, computed[r] + n == len(req.tokens),
                                         r, list(range(r * BLOCKS, (r + 1) * BLOCKS))))
        decision = ScheduleDecision(tuple(seqs))
        logits = {}
        for host, run in runs.items():
            plan = build_plan(decision, BUCKET, run["step_cfg"])
            if host:
                run["rows"].fill(plan, decision)
            assert plan.engram_rows.shape[-1] == (cfg.engram.head_dim if host else 0)
            assert plan.engram_ids.shape[1:] == (run["step_cfg"].engram_shape if host else (0, 0))
            run["state"], out = _step(run["params"], run["state"], plan, cfg, run["step_cfg"])
            logits[host] = np.asarray(out)[: decision.num_tokens]
        assert logits[True].view(np.uint32).tolist() == logits[False].view(np.uint32).tolist()
        offset = 0
        for seq in seqs:
            offset += seq.num_tokens
            computed[int(seq.request.request_id)] += seq.num_tokens
            if seq.samples:
                seq.request.generated.append(int(logits[True][offset - 1].argmax()))
    np.testing.assert_array_equal([r.generated for r in reqs], ref["gen_tokens"])


# ---- the engine: tokens, logprobs, and where the tables are -----------------------------

def test_engine_with_host_tables_matches_device_tables_and_the_reference():
    """Through the engine on fixture a (the step test above covers both fixtures): the host's
    hash and gather in the synchronous loop, and the step's own in the asynchronous loop,
    give the same tokens, the reference's, and the same top-20 logprobs to the bit. The
    asynchronous run must really plan steps whose fed tokens are still on the device (-1):
    the step hashes those from the tokens it sampled."""
    folder = FIXTURES[0]
    ref = np.load(folder / "reference.npz")
    steps = ref["gen_tokens"].shape[1]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=20)
    got, in_flight = {}, []
    for tables in ("host", "device"):
        llm = _llm(folder, tables)
        assert llm.host_options.async_scheduling == (tables == "device")
        plan = llm.engine._plan

        def recorded(*args, plan=plan, **kwargs):
            out = plan(*args, **kwargs)
            in_flight.append((tables, int((out.token_ids == -1).sum())))
            return out

        llm.engine._plan = recorded
        try:
            outs = llm.generate(_prompts(ref), params, use_tqdm=False)
        finally:
            del llm.engine._plan
        got[tables] = [o.outputs[0] for o in outs]
        np.testing.assert_array_equal([o.token_ids for o in got[tables]], ref["gen_tokens"])
    for host, device in zip(got["host"], got["device"], strict=True):
        for lp_host, lp_device in zip(host.logprobs, device.logprobs, strict=True):
            assert len(lp_host) >= 20
            assert ({t: lp.logprob for t, lp in lp_host.items()}
                    == {t: lp.logprob for t, lp in lp_device.items()})
    placeholders = {t: sum(n for name, n in in_flight if name == t) for t in ("host", "device")}
    assert placeholders["host"] == 0 and placeholders["device"] >= steps - 1


def test_bfloat16_tables_give_the_same_tokens_and_logprobs():
    """Tables loaded in bfloat16 stay bfloat16 on the host, and their rows cross in the plan
    two to a word (engine/transfer.py): the same bits reach the step as the device's own
    gather gives."""
    folder = FIXTURES[0]
    ref = np.load(folder / "reference.npz")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    got, llms = {}, {}
    for tables in ("host", "device"):
        llms[tables] = deepinfer_jax.LLM(folder, dtype=ml_dtypes.bfloat16, **ENGINE,
                                         engram_tables=tables)
        outs = llms[tables].generate(_prompts(ref), params, use_tqdm=False)
        got[tables] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                 for step in o.outputs[0].logprobs])
                       for o in outs]
    assert got["host"] == got["device"]
    host = llms["host"].engine
    assert host.step_cfg.engram_row_dtype == "bfloat16" and host.params.engram_tables == ()
    assert all(isinstance(t, np.ndarray) and t.dtype == ml_dtypes.bfloat16
               for t in host.engram_rows.host_tables)


def test_host_tables_are_not_in_the_device_params():
    folder = FIXTURES[0]
    cfg = read_model_config(folder)
    host, device = _llm(folder, "host").engine, _llm(folder, "device").engine
    table_shapes = {(n, cfg.engram.head_dim) for n in cfg.engram.num_embeddings}
    assert host.params.engram_tables == ()
    assert not {x.shape for x in jax.tree.leaves(host.params)} & table_shapes
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(host.params))
    # the loader never placed them: the model's own pytree holds numpy tables too
    assert all(isinstance(t, np.ndarray) for t in _llm(folder, "host").model.params.engram_tables)
    held = host.engram_rows.host_tables
    assert [t.shape for t in held] == [(n, cfg.engram.head_dim) for n in cfg.engram.num_embeddings]
    assert all(isinstance(t, np.ndarray) and t.dtype == np.float32 for t in held)
    for mine, theirs in zip(held, device.params.engram_tables, strict=True):
        np.testing.assert_array_equal(mine, np.asarray(theirs))
    assert host.step_cfg.engram_row_dim == cfg.engram.head_dim
    assert host.step_cfg.engram_row_dtype == "float32"
    assert device.engram_rows is None and device.step_cfg.engram_row_dim == 0
    assert len(device.params.engram_tables) == len(cfg.engram.layer_ids)
    assert host.params.engram_products is None      # the host hashes
    tables, products = sum(t.nbytes for t in held), engram_product_bytes(cfg)
    assert device.params.engram_products.nbytes == products
    assert (memory_plan.weight_bytes(device.params) - memory_plan.weight_bytes(host.params)
            == tables + products)


# ---- the memory plan ---------------------------------------------------------------------

def test_config_plan_counts_host_tables_in_host_memory():
    """`deepinfer plan`'s count: the tables leave the device's weights for host memory, and
    the largest bucket's rows ([T, L_e, C, ed] in the load's bf16) join the activations."""
    cfg = read_model_config(FIXTURES[0])            # 290 + 370 rows of 32, L_e = 2, C = 4
    plans = {t: memory_plan.config_plan(cfg, EngineConfig(max_num_seqs=2, max_model_len=64,
                                                          engram_tables=t).resolve(cfg))
             for t in ("host", "device")}
    tables = (290 + 370) * 32 * 2
    assert engram_table_bytes(cfg, 2) == tables
    assert plans["device"].host_weights == 0
    assert plans["host"].host_weights == tables
    # the device also holds the step's hash products: u32[V = 512, L_e = 2, 3 slots, 2]
    assert engram_product_bytes(cfg) == 512 * 2 * 3 * 2 * 4
    assert plans["device"].weights - plans["host"].weights == tables + engram_product_bytes(cfg)
    assert plans["host"].activations - plans["device"].activations == 256 * 2 * 4 * 32 * 2
    assert "host memory" in plans["host"].format() and "host memory" not in plans["device"].format()


def test_a_bad_engram_tables_option_is_refused():
    from deepinfer_jax.config.errors import EngineConfigError
    with pytest.raises(EngineConfigError, match="engram_tables must be 'host' or 'device'"):
        EngineConfig(engram_tables="disk")
