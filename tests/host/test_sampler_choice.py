"""The scheduler's choice of compiled sampler (`ScheduleDecision.truncating_sampler`) is the
one the step's rows call for: what `host_truncates` finds in the plan built from the decision
(the choice the engine made from the plan before the scheduler made it)."""

from __future__ import annotations

import itertools

import numpy as np

from deepinfer_jax.device.sampling import host_truncates
from deepinfer_jax.host.buckets import token_bucket
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import SamplingParams
from tests.host.test_scheduler import make, request

# values at the edges of float32, where a comparison in float64 would disagree with the plan
TEMPERATURES = [0, 1e-50, 1e-30, 0.7]
TOP_K = [-1, 0, 1, 50]
TOP_P = [1, 1 - 1e-9, 1 - 1e-6, 0.9]
MIN_P = [0, 1e-50, 1e-30, 0.1]


def test_every_combination_agrees_with_the_step_rows():
    for temperature, top_k, top_p, min_p in itertools.product(TEMPERATURES, TOP_K, TOP_P, MIN_P):
        p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        row = [np.float32(temperature)], [np.int32(max(top_k, 0))], [np.float32(top_p)], [
            np.float32(min_p)]
        assert p.truncates == host_truncates(*(np.array(x) for x in row)), p


def test_a_decision_asks_for_the_sampler_its_plan_needs():
    rng = np.random.default_rng(0)
    seen = set()
    for trial in range(40):
        sched = make(budget=64, seqs=4)
        for i in range(int(rng.integers(1, 5))):
            sched.add(request(i, int(rng.integers(1, 30)), max_tokens=4,
                              temperature=float(rng.choice(TEMPERATURES)),
                              top_k=int(rng.choice(TOP_K)), top_p=float(rng.choice(TOP_P)),
                              min_p=float(rng.choice(MIN_P))))
        decision = sched.schedule()
        plan = build_plan(decision, token_bucket(sched.step_cfg.token_buckets, decision.num_tokens),
                          sched.step_cfg)
        assert decision.truncating_sampler == host_truncates(plan.temperature, plan.top_k,
                                                             plan.top_p, plan.min_p), trial
        seen.add(decision.truncating_sampler)
    assert seen == {False, True}
