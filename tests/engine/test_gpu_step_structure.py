"""The step as traced for a GPU has nothing that makes the host wait or launch per iteration:
no conditional (XLA's GPU conditional copies its predicate to the host and blocks) and no loop
(one launch sequence per iteration). Lowered for CUDA on the CPU through jax.export, default
mode, plain and speculative steps. Loops inside a composite's decomposition do not count:
XLA implements the composite itself (cumsum's "chlo.scan" runs as one CUB scan on GPUs)."""

import re

import jax
import pytest

from deepinfer_jax import LLM
from deepinfer_jax.plan import build_plan
from deepinfer_jax.scheduler import ScheduleDecision
from deepinfer_jax.speculative import spec_step
from deepinfer_jax.step import step
from deepinfer_jax.wire import Wire
from tests.conftest import REPO


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


@pytest.mark.parametrize("step_fn", [step, spec_step], ids=["plain", "speculative"])
def test_gpu_step_has_no_conditionals_or_loops(monkeypatch, step_fn):
    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "gpu")
    llm = LLM(REPO / "models" / "deepinfer-tiny-v4", max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=16, token_buckets=(16,), show_progress=False,
              speculative_config={"num_speculative_tokens": 3})
    engine = llm.engine
    wire = Wire.of(build_plan(ScheduleDecision(()), 16, engine.ecfg))

    def lowered_for_cuda() -> str:      # a fresh jit each time: the formulation is read at trace
        traced = jax.jit(lambda p, s, b: step_fn(p, s, wire.unpack_device(b), cfg=engine.cfg,
                                                 ecfg=engine.ecfg))
        return jax.export.export(traced, platforms=["cuda"])(
            engine.params, engine.state, wire.spec()).mlir_module()

    assert loops_and_branches(lowered_for_cuda()) == (0, 0)
    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "cpu")       # the test can fail:
    whiles, cases = loops_and_branches(lowered_for_cuda())
    assert whiles > 0 and cases > 0
