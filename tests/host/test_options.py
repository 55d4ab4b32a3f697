"""Engine options resolved once: arguments first, DEEPINFER_* variables second, then the
device's defaults (config/options.py); the per-device kernel table."""

import pytest

from deepinfer_jax.config.compute import ComputeConfig, ComputeConfigError, KernelChoices
from deepinfer_jax.config.options import (
    ATTENTION_MIN_TOKENS,
    CPU,
    DeviceFacts,
    compile_threads,
    default_kernels,
    resolve_compute,
)

H200 = DeviceFacts("gpu", "9.0")
B200 = DeviceFacts("gpu", "10.0")


def test_hopper_kernels_run_on_compute_capability_9_only():
    hopper = default_kernels(H200)
    assert hopper.grouped_gemm == ("mosaic_gpu", "reference")
    assert hopper.attention_min_tokens == ATTENTION_MIN_TOKENS
    for device in (B200, DeviceFacts("gpu", "8.0"), CPU):
        assert default_kernels(device) == KernelChoices()       # the jnp references
    assert KernelChoices().indexer == ("reference",)


def test_device_defaults():
    assert resolve_compute(CPU, environ={}) == ComputeConfig(formulation="cpu",
                                                             invariant_tile=8)
    gpu = resolve_compute(H200, environ={})
    assert (gpu.formulation, gpu.invariant_tile) == ("gpu", 64)
    assert gpu.kernels == default_kernels(H200)


def test_arguments_win_over_variables_which_win_over_defaults():
    env = {"DEEPINFER_STEP_FORMULATION": "gpu", "DEEPINFER_KERNELS": "interpret",
           "DEEPINFER_INVARIANT_TILE": "16"}
    from_env = resolve_compute(CPU, environ=env)
    assert (from_env.formulation, from_env.invariant_tile) == ("gpu", 16)
    assert from_env.kernels == KernelChoices.every_op("interpret")
    assert from_env.kernels.sinkhorn == ("interpret", "reference")    # reference falls last
    given = resolve_compute(CPU, formulation="cpu", kernels={"sinkhorn": "interpret"},
                            invariant_tile=4, environ=env)
    assert (given.formulation, given.invariant_tile) == ("cpu", 4)
    assert given.kernels == KernelChoices(sinkhorn=("interpret",))


def test_one_ops_variable_wins_over_every_ops():
    env = {"DEEPINFER_KERNELS": "reference", "DEEPINFER_KERNEL_SINKHORN": "interpret"}
    kernels = resolve_compute(H200, environ=env).kernels
    assert kernels.sinkhorn == ("interpret", "reference")
    assert kernels.sink_attention == ("reference",)


def test_a_chosen_attention_kernel_runs_at_every_size():
    env = {"DEEPINFER_KERNEL_SINK_ATTENTION": "mosaic_gpu"}
    assert resolve_compute(H200, environ=env).kernels.attention_min_tokens == 0
    assert resolve_compute(H200, environ={}).kernels.attention_min_tokens == ATTENTION_MIN_TOKENS


def test_batch_invariant_mode_runs_the_attention_kernel_at_every_size():
    default = resolve_compute(H200, batch_invariant=True, environ={}).kernels
    assert default.sink_attention == ("mosaic_gpu", "reference")
    assert default.attention_min_tokens == 0        # no size threshold: a row's path is fixed
    assert default.grouped_gemm == ("mosaic_gpu", "reference")
    asked = resolve_compute(H200, batch_invariant=True, environ={
        "DEEPINFER_KERNEL_SINK_ATTENTION": "mosaic_gpu"}).kernels
    assert asked.sink_attention == ("mosaic_gpu", "reference")


def test_bad_values_are_named():
    with pytest.raises(ComputeConfigError, match="sinkhorn: unknown implementation 'triton'"):
        resolve_compute(CPU, environ={"DEEPINFER_KERNEL_SINKHORN": "triton"})
    with pytest.raises(ComputeConfigError, match="formulation"):
        resolve_compute(CPU, environ={"DEEPINFER_STEP_FORMULATION": "tpu"})


def test_compile_threads():
    assert compile_threads(None, environ={}) == 1
    assert compile_threads(None, environ={"DEEPINFER_COMPILE_THREADS": "3"}) == 3
    assert compile_threads(5, environ={"DEEPINFER_COMPILE_THREADS": "3"}) == 5
