"""The step as traced for a GPU has nothing that makes the host wait or launch per iteration:
no conditional (XLA's GPU conditional copies its predicate to the host and blocks) and no loop
(one launch sequence per iteration). Lowered for CUDA on the CPU through jax.export, default
mode, plain and speculative steps. Loops inside a composite's decomposition do not count:
XLA implements the composite itself (cumsum's "chlo.scan" runs as one CUB scan on GPUs)."""

import re

import jax
import pytest

import deepinfer_jax
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.device.speculative import spec_step
from deepinfer_jax.device.step import step
from deepinfer_jax.engine.transfer import Wire
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.model.state import init_state
from tests.conftest import REPO


def traced_engine(max_num_seqs: int = 4, bucket: int = 16, **options):
    """What the engine traces its steps with (cfg, step_cfg, params, state) for the shipped model,
    without compiling them: these tests read the lowered module only."""
    model = deepinfer_jax.load(REPO / "models" / "deepinfer-tiny-v4")
    step_cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=128,
                            max_num_batched_tokens=bucket, token_buckets=(bucket,),
                            speculative_config={"num_speculative_tokens": 3},
                            **options).resolve(model.config)
    cfg = model.config
    return cfg, step_cfg, model.params, init_state(cfg, step_cfg, model.params.embed.dtype)


def loops_and_branches(module: str) -> tuple[int, int]:
    """(while loops, conditionals) outside composite decompositions of a StableHLO module."""
    decompositions = set(re.findall(r"decomposition = @([\w.$-]+)", module))
    whiles = cases = 0
    for function in re.split(r"\n\s*func\.func ", module):
        name = re.match(r"(?:private |public )?@([\w.$-]+)", function)
        if name and name.group(1) in decompositions:
            continue
        whiles += function.count("stablehlo.while")
        cases += function.count("stablehlo.case")
    return whiles, cases


# The speculative step runs the same layers with k + 1 rows a slot: a second case, in the full tier.
SPECULATIVE_SECOND_CASE = pytest.param(spec_step, id="speculative", marks=pytest.mark.slow)


@pytest.mark.parametrize("step_fn", [pytest.param(step, id="plain"), SPECULATIVE_SECOND_CASE])
def test_gpu_step_has_no_conditionals_or_loops(step_fn):
    def lowered_for_cuda(formulation: str) -> str:
        cfg, step_cfg, params, state = traced_engine(step_formulation=formulation)
        wire = Wire.of(build_plan(ScheduleDecision(()), 16, step_cfg))
        # the engine's variants: the sampler chosen by the host on GPUs, on the device else
        truncation = True if formulation == "gpu" else None
        traced = jax.jit(lambda p, s, b: step_fn(p, s, wire.unpack_device(b), cfg=cfg,
                                                 step_cfg=step_cfg, truncation=truncation))
        return jax.export.export(traced, platforms=["cuda"])(
            params, state, wire.spec()).mlir_module()

    assert loops_and_branches(lowered_for_cuda("gpu")) == (0, 0)
    whiles, cases = loops_and_branches(lowered_for_cuda("cpu"))     # the test can fail:
    assert whiles > 0 and cases > 0


# Scatters XLA runs as they are under xla_gpu_deterministic_ops (batch-invariant mode): unique
# indices, or a combiner whose result does not depend on the order of the updates. Any other
# it rewrites into a loop over the updates, one launch sequence and a host synchronisation per
# row written (every cache write of a step).
ORDER_FREE = {"add", "multiply", "maximum", "minimum", "and", "or", "xor"}


def order_dependent_scatters(module: str) -> list[str]:
    """The scatters of a StableHLO module whose result could depend on the order of the
    updates: indices not declared unique, and an overwrite or a float combiner."""
    found = []
    for match in re.finditer(r'stablehlo\.scatter"?\(.*?\}\)', module, re.S):
        op = match.group(0)
        head, _, body = op.partition("^bb0")
        dtype = re.match(r"\(%\w+: tensor<(\w+)>", body).group(1)
        ops = set(re.findall(r"stablehlo\.(\w+) %", body)) - {"return"}
        integral = dtype.startswith(("i", "ui"))
        if "unique_indices = true" not in head and not (
                ops and ops <= ORDER_FREE and (integral or ops <= {"maximum", "minimum"})):
            found.append(op.splitlines()[0][:160])
    return found


def test_order_dependent_scatter_is_recognised():
    """The check itself, on a hand-written case of each kind."""
    import jax.numpy as jnp

    def scatters(r, i, v, c):
        return (r.at[i].set(v, mode="drop"),                       # overwrite: flagged
                r.at[i].add(v, mode="drop"),                       # float add: flagged
                r.at[i].set(v, mode="drop", unique_indices=True),  # unique: fine
                c.at[i].add(1, mode="drop"),                       # integer add: fine
                (c > 0).at[i].max(True, mode="drop"))              # boolean or: fine
    text = jax.jit(scatters).lower(jnp.zeros((8, 4)), jnp.array([1, 1]), jnp.ones((2, 4)),
                                   jnp.zeros(8, jnp.int32)).as_text()
    assert len(order_dependent_scatters(text)) == 2


def test_invariant_steps_scatter_without_order():
    """The batch-invariant steps (plain and speculative) and the prefix cache's slot copies,
    as traced for a GPU, write only through order-free scatters."""
    from deepinfer_jax.device import snapshots

    cfg, step_cfg, params, state = traced_engine(batch_invariant=True, enable_prefix_caching=True,
                                             step_formulation="gpu")
    wire = Wire.of(build_plan(ScheduleDecision(()), 16, step_cfg))
    for step_fn in (step, spec_step):
        traced = jax.jit(lambda p, s, b: step_fn(p, s, wire.unpack_device(b), cfg=cfg,
                                                 step_cfg=step_cfg, truncation=True))
        module = jax.export.export(traced, platforms=["cuda"])(
            params, state, wire.spec()).mlir_module()
        assert order_dependent_scatters(module) == [], step_fn.__name__
    ids = jax.ShapeDtypeStruct((4,), "int32")
    tokens = jax.ShapeDtypeStruct((4, 128), "int32")
    pool = snapshots.init_pool(state, step_cfg.num_snapshots, spare=step_cfg.spec_tokens)
    save = jax.jit(snapshots.save).lower(snapshots.slot_rings(state), pool, ids, ids, ids)
    restore = jax.jit(snapshots.restore).lower(state, pool, ids, ids, tokens, ids, ids)
    assert order_dependent_scatters(save.as_text()) == []
    assert order_dependent_scatters(restore.as_text()) == []


def float_sums(module: str) -> set[tuple[str, str]]:
    """The float sum reductions of a StableHLO module: their operand types and dimensions."""
    found = set()
    for match in re.finditer(r"stablehlo\.reduce\((.*?)(?:\n\s*\}|$)", module, re.M | re.S):
        op = match.group(0)
        shape = re.search(r"across dimensions = \[([\d, ]*)\] : \((tensor<[^>]*(?:f32|bf16|f16)>)", op)
        if shape and "stablehlo.add" in op:
            found.add((shape.group(2), shape.group(1)))
    return found


@pytest.mark.parametrize("step_fn", [pytest.param(step, id="plain"), SPECULATIVE_SECOND_CASE])
def test_invariant_sums_do_not_follow_the_slot_count(step_fn):
    """Batch-invariant mode, traced for a GPU: an engine of 4 slots and one of 8, same token
    bucket, sum over the same float shapes (more row tiles, each a copy of the same program,
    where rows are more). The work over a step's sequences (the sampled rows' head and
    sampler, the speculative step's verify and draft rows, the compressor's closed rows) has
    min(bucket, slots) rows, and XLA's GPU reductions may round a row by the shapes around
    it: an 8-slot engine's logprobs differed from a 32-slot one's on an H100 while that work
    was summed over the whole batch."""
    def sums(slots: int) -> set[tuple[str, str]]:
        cfg, step_cfg, params, state = traced_engine(max_num_seqs=slots, batch_invariant=True,
                                                     step_formulation="gpu")
        wire = Wire.of(build_plan(ScheduleDecision(()), 16, step_cfg))
        traced = jax.jit(lambda p, s, b: step_fn(p, s, wire.unpack_device(b), cfg=cfg,
                                                 step_cfg=step_cfg, truncation=True))
        return float_sums(jax.export.export(traced, platforms=["cuda"])(
            params, state, wire.spec()).mlir_module())

    few, many = sums(4), sums(8)
    assert few                                    # (the parse finds the step's sums)
    assert few == many, (sorted(few - many), sorted(many - few))


# Float arithmetic whose rounding may follow the fusion XLA builds around it (a multiply and an
# add fused into one FMA or not): any of it over a shape that follows the slot count lets the
# compiler round a row by the engine's size.
FLOAT_ARITHMETIC = re.compile(r"stablehlo\.(add|subtract|multiply|divide|exponential|rsqrt|sqrt|"
                              r"log|power|tanh|logistic)\s[^\n]*?:\s*"
                              r"(tensor<[^>]*(?:f32|bf16|f16)>)")


@pytest.mark.parametrize("step_fn, bucket", [(step, 16), (spec_step, 16), (step, 512)],
                         ids=["plain", "speculative", "prefill"])
def test_invariant_arithmetic_does_not_follow_the_slot_count(step_fn, bucket):
    """Batch-invariant mode, traced for a GPU: an engine of 4 slots and one of 8, same token
    bucket, do float arithmetic over the same shapes only. The compressors' newly closed rows
    (T // rate + N of them) ran over their whole count, and an 8-slot step compiled for the
    H200 fused that work otherwise than a 32-slot one (session 56's dumps), where prompt 22
    of test_sync_loop_on_fewer_slots moved; they now run in fixed row tiles, or (a chunk's
    many rows, here 512 // 4 + N) at once padded to a multiple of four tiles."""
    def arithmetic(slots: int) -> set[tuple[str, str]]:
        cfg, step_cfg, params, state = traced_engine(max_num_seqs=slots, bucket=bucket,
                                                     batch_invariant=True,
                                                     step_formulation="gpu")
        wire = Wire.of(build_plan(ScheduleDecision(()), bucket, step_cfg))
        traced = jax.jit(lambda p, s, b: step_fn(p, s, wire.unpack_device(b), cfg=cfg,
                                                 step_cfg=step_cfg, truncation=True))
        return set(FLOAT_ARITHMETIC.findall(jax.export.export(traced, platforms=["cuda"])(
            params, state, wire.spec()).mlir_module()))

    few, many = arithmetic(4), arithmetic(8)
    assert len(few) > 20                          # (the parse finds the step's arithmetic)
    assert few == many, (sorted(few - many), sorted(many - few))
