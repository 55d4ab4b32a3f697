"""How many step buckets compile at once: side by side on the CPU, one at a time where XLA
autotunes on the device (GPUs), the env override ahead of both."""

import os

from deepinfer_jax.engine.compile import compile_threads


def test_compile_threads(monkeypatch):
    monkeypatch.delenv("DEEPINFER_COMPILE_THREADS", raising=False)   # (set under xdist)
    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "gpu")
    assert compile_threads(8) == 1
    monkeypatch.setenv("DEEPINFER_STEP_FORMULATION", "cpu")
    assert compile_threads(8) == min(8, os.cpu_count())
    assert compile_threads(1) == 1
    monkeypatch.setenv("DEEPINFER_COMPILE_THREADS", "3")
    assert compile_threads(8) == 3 and compile_threads(2) == 2
