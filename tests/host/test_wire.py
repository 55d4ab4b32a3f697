"""The step's wire format, both ways: a plan packed on the host and unpacked inside jit, an
output packed inside jit and unpacked on the host, give back every array bit for bit (int32,
float32 incl. NaN and -0.0, uint32 seeds past 2**31, bools, bfloat16 Engram rows two to a
word)."""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

import deepinfer_jax.device  # noqa: F401  (registers the plan and outputs as pytrees)
from deepinfer_jax.contract import BatchPlan, StepOutput
from deepinfer_jax.engine.transfer import Wire


def random_plan(rng: np.random.Generator) -> BatchPlan:
    t, n, words = 16, 4, 5
    arrays = {}
    for f in dataclasses.fields(BatchPlan):
        shape = {"block_table": (n, 3), "allowed": (n, words), "engram_ids": (t, 2, 3)}.get(f.name)
        per_token = f.name in ("token_ids", "positions", "token_seq", "next_token_ids")
        shape = shape or ((t,) if per_token else (n,))
        if f.name == "engram_rows":      # host-gathered table rows, the tables' bf16
            arrays[f.name] = rng.normal(size=(t, 2, 3, 4)).astype(ml_dtypes.bfloat16)
        elif f.name in ("temperature", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty"):
            arrays[f.name] = rng.normal(size=shape).astype(np.float32)
        elif f.name == "seed":
            arrays[f.name] = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
        elif f.name == "seq_samples":
            arrays[f.name] = rng.random(shape) < 0.5
        else:
            arrays[f.name] = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    arrays["temperature"][:2] = [-0.0, np.nan]
    arrays["seed"][0] = 2**32 - 1
    return BatchPlan(**arrays)


def test_pack_then_unpack_in_jit_is_exact():
    plan = random_plan(np.random.default_rng(0))
    wire = Wire.of(plan)
    buffer = wire.pack_host(plan)
    assert buffer.shape == (wire.size,) and buffer.dtype == np.int32
    back, host_back = jax.jit(wire.unpack_device)(buffer), wire.unpack_host(buffer)
    for f in dataclasses.fields(BatchPlan):
        want = getattr(plan, f.name)
        for got in (np.asarray(getattr(back, f.name)), getattr(host_back, f.name)):
            assert got.dtype == want.dtype and got.shape == want.shape, f.name
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                          err_msg=f.name)


def test_output_packed_in_jit_unpacks_on_the_host():
    rng = np.random.default_rng(1)
    logprob = rng.normal(size=8).astype(np.float32)
    logprob[:2] = [-np.inf, -0.0]
    out = StepOutput(next_tokens=rng.integers(0, 50_000, 8).astype(np.int32), logprob=logprob,
                     top_ids=rng.integers(0, 50_000, (8, 3)).astype(np.int32),
                     top_logprobs=rng.normal(size=(8, 3)).astype(np.float32))
    wire = Wire.of(out)
    back = wire.unpack_host(np.asarray(jax.jit(wire.pack_device)(out)))
    assert isinstance(back, StepOutput)
    for f in dataclasses.fields(StepOutput):
        want, got = getattr(out, f.name), getattr(back, f.name)
        assert got.dtype == want.dtype and got.shape == want.shape, f.name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f.name)


def test_a_zero_size_field_costs_nothing():
    """V4's plans carry Engram ids as i32[T, 0, 0]: no words on the wire, and they come back."""
    plan = dataclasses.replace(random_plan(np.random.default_rng(2)),
                               engram_ids=np.zeros((16, 0, 0), np.int32))
    wire = Wire.of(plan)
    assert wire.size == Wire.of(random_plan(np.random.default_rng(2))).size - 16 * 2 * 3
    back = jax.jit(wire.unpack_device)(wire.pack_host(plan))
    assert back.engram_ids.shape == (16, 0, 0)
    np.testing.assert_array_equal(np.asarray(back.token_ids), plan.token_ids)


def test_an_odd_two_byte_field_is_refused():
    """2-byte fields go two to a word; an odd count would leave half a word: a typed error."""
    plan = dataclasses.replace(random_plan(np.random.default_rng(3)),
                               engram_rows=np.zeros((3, 1, 1, 1), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="even-sized 2-byte"):
        Wire.of(plan).size
