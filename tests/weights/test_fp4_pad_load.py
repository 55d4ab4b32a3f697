"""Where FP4 expert padding (weights/fp4_pad.py) applies: the V4.1 loader, the random
builder and an engine given a loaded model pad only at the granule the step's kernel table
asks for (none on the CPU's references), and the memory plan (`config_plan`, `deepinfer plan`,
the pre-load check) counts the bytes the loader then holds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.api import jax_engine  # the JAX backend's start-up (api/backends.py)
from deepinfer_jax.api.cli import main
from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.v41_model import load_v41
from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.errors import InsufficientMemoryError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory import MemoryLimits
from deepinfer_jax.config.memory_v41 import engram_product_bytes, v41_weight_bytes
from deepinfer_jax.engine.memory_plan import check_checkpoint_fits, config_plan, weight_bytes
from deepinfer_jax.weights.v41 import load_v41_params
from deepinfer_jax.weights.v41_random import random_v41_params
from pallas_kernels.quantized import Fp4Blocks, dequantize
from tests.model.v41_oracle import FIXTURES
from tests.model.v41_quantized import write_pair

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

KERNEL = KernelChoices(grouped_gemm=("interpret",))       # the table entry that pads on the CPU
SHAPES = dict(max_num_seqs=2, max_model_len=64, engram_tables="device")
TOL = 1e-5                # on logits ~1


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("v41q_pad"))[0]


def _experts(params):
    return [layer.moe.experts for layer in params.layers]


def _cut_back(w13: np.ndarray, w2: np.ndarray, inter: int):
    """Decoded padded stacks, their padding checked to be zero, cut back to I."""
    pad = w2.shape[-2]
    assert not w13[..., inter:pad].any() and not w13[..., pad + inter:].any()
    assert not w2[:, inter:].any()
    return np.concatenate([w13[..., :inter], w13[..., pad:pad + inter]], -1), w2[:, :inter]


def test_loader_pads_at_the_tables_granule_only(quantized):
    cfg = read_model_config(quantized)
    inter = cfg.moe_intermediate_size
    granule = ComputeConfig(kernels=KERNEL).fp4_expert_granule
    plain = load_v41_params(quantized, cfg)                      # the CPU's default: 1
    padded = load_v41_params(quantized, cfg, fp4_k_granule=granule)
    for raw, wide in zip(_experts(plain), _experts(padded), strict=True):
        assert isinstance(wide.w2, Fp4Blocks) and wide.w2.shape[-2] == granule > inter
        assert raw.w2.shape[-2] == inter and raw.w13.shape[-1] == 2 * inter
        w13, w2 = _cut_back(*(np.asarray(dequantize(w, jnp.float32)) for w in (wide.w13, wide.w2)),
                            inter)
        np.testing.assert_array_equal(w13, np.asarray(dequantize(raw.w13, jnp.float32)))
        np.testing.assert_array_equal(w2, np.asarray(dequantize(raw.w2, jnp.float32)))
    # the float twin has no FP4 stacks to pad
    floats = load_v41_params(quantized, cfg, keep_quantized=False, fp4_k_granule=granule)
    assert all(e.w2.shape[-2] == inter for e in _experts(floats))
    # the random builder (benchmarks) as the loader
    drawn = random_v41_params(cfg, 0, jnp.float32, fp4_k_granule=granule)
    assert [e.w2.shape for e in _experts(drawn)] == [e.w2.shape for e in _experts(padded)]
    assert all(e.w2.shape[-2] == inter for e in _experts(random_v41_params(cfg, 0, jnp.float32)))


def test_a_loaded_model_is_padded_for_the_engines_kernels(quantized):
    """LLM(V41Model) lays the model out for its step (V41Model.for_compute): padded where the
    table names the FP4 kernel, the very model otherwise."""
    model = load_v41(quantized)
    assert model.for_compute(ComputeConfig()) is model
    padded = model.for_compute(ComputeConfig(kernels=KERNEL))
    assert [e.w2.shape[-2] for e in _experts(padded.params)] == [512] * len(model.params.layers)
    assert padded.for_compute(ComputeConfig(kernels=KERNEL)) is padded      # once only
    # The cache-free forward reads I from the stacks: the same weights, so the same logits
    # but for the order XLA adds float32 products in at the wider shapes (test_fp4_pad:
    # within a reordering bound); TOL as test_v41_quantized_engine's for its reordered sums.
    ids = np.load(FIXTURES[0] / "reference.npz")["input_ids"][:1, -16:]
    want = model.logits(ids)
    assert np.abs(want).max() > 0.1
    assert np.abs(padded.logits(ids) - want).max() <= TOL


def test_memory_plan_counts_the_padded_bytes(quantized, capsys, monkeypatch):
    cfg = read_model_config(quantized)
    granule = ComputeConfig(kernels=KERNEL).fp4_expert_granule
    plain, padded = v41_weight_bytes(cfg, True, 4), v41_weight_bytes(cfg, True, 4, False, granule)
    assert weight_bytes(load_v41_params(quantized, cfg)) == plain
    assert weight_bytes(load_v41_params(quantized, cfg, fp4_k_granule=granule)) == padded
    # E experts x 3 x D x (I' - I) more FP4 weights, half a byte each and a byte a 32
    grown = (cfg.num_layers * cfg.n_routed_experts * 3 * cfg.hidden_size
             * (granule - cfg.moe_intermediate_size))
    assert padded - plain == grown // 2 + grown // 32
    # the plan from the config follows the step's table (with the device Engram tables'
    # hash products, which the engine adds)
    for kernels, want in ((None, plain), (KERNEL, padded)):
        step_cfg = EngineConfig(**SHAPES, kernels=kernels).resolve(cfg, environ={})
        assert (config_plan(cfg, step_cfg, dtype=jnp.float32).weights
                == want + engram_product_bytes(cfg))
    # the pre-load check too: a budget between the two fits only the unpadded weights
    limits = MemoryLimits((plain + padded) // 2, 1.0, None)
    check_checkpoint_fits(quantized, limits, dtype=jnp.float32, engram_on_host=False)
    with pytest.raises(InsufficientMemoryError):
        check_checkpoint_fits(quantized, limits, dtype=jnp.float32, engram_on_host=False,
                              fp4_k_granule=granule)
    # `deepinfer plan` resolves the table as the engine would (DEEPINFER_KERNEL_GROUPED_GEMM)
    shown = []
    for env in (None, "interpret"):
        if env:
            monkeypatch.setenv("DEEPINFER_KERNEL_GROUPED_GEMM", env)
        assert main(["plan", str(quantized), "--max-num-seqs", "2", "--max-model-len", "64",
                     "--engram-tables", "device"]) == 0
        lines = capsys.readouterr().out.splitlines()
        shown.append(next(float(x.split()[1]) for x in lines if x.startswith("weights")))
        noted = [x for x in lines if "zero-padded" in x]
        assert noted == ([] if env is None else
                         ["note: FP4 routed experts held at intermediate size 512 (32 "
                          "zero-padded to the FP4 kernel's K granule, weights/fp4_pad.py)"])
    bf16 = [v41_weight_bytes(cfg, True, 2, False, g) + engram_product_bytes(cfg)
            for g in (1, granule)]
    assert shown == [round(b / 2**30, 4) for b in bf16]


class _Built(Exception):
    """Raised by a stand-in EngineCore: what LLM hands the engine, without compiling it."""


def test_llm_hands_the_engine_stacks_at_its_tables_granule(quantized, monkeypatch):
    """LLM(checkpoint) loads, and LLM(V41Model) lays out, the FP4 stacks at its step's
    granule; the pre-load check counts them: a budget between the two sizes refuses the
    padded load before it starts."""
    cfg = read_model_config(quantized)
    seen = []

    def engine(model_cfg, params, step_cfg, *args, **kwargs):
        seen.append((step_cfg.compute.fp4_expert_granule,
                     {e.w2.shape[-2] for e in _experts(params)}))
        raise _Built
    monkeypatch.setattr(jax_engine, "EngineCore", engine)
    sizes = [v41_weight_bytes(cfg, True, 4, False, g) for g in (1, 512)]
    budget = dict(device_memory_gib=sum(sizes) / 2 / 2**30, gpu_memory_utilization=1.0)
    loaded = load_v41(quantized)
    # the jnp reference named, not left to the platform's default (a GPU's is the kernel)
    for kernels in ({"grouped_gemm": ("reference",)}, {"grouped_gemm": ("interpret",)}):
        for model in (quantized, loaded):
            with pytest.raises(_Built):
                LLM(model, dtype=np.float32, kernels=kernels, **SHAPES)
        with pytest.raises(InsufficientMemoryError if kernels["grouped_gemm"] == ("interpret",)
                           else _Built):
            LLM(quantized, dtype=np.float32, kernels=kernels, **SHAPES, **budget)
    inter = cfg.moe_intermediate_size
    assert seen == [(1, {inter})] * 3 + [(512, {512})] * 2
