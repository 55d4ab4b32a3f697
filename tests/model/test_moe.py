"""MoE routing and experts against a plain numpy loop (covers the softmax router HF lacks)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import MlpKind, ScoringFunc
from deepinfer_jax.model.moe import moe, route
from deepinfer_jax.weights import random_params
from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts
from pallas_kernels.quantized import fp4_tile
from tests.conftest import REPO
from tests.kernels.which import KERNEL

BASE = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")
ON_KERNEL = ComputeConfig(kernels=KernelChoices(grouped_gemm=(KERNEL,)))
HASH_LAYER, ROUTED_LAYER = 0, 1


@pytest.fixture(scope="module")
def layers():
    params = random_params(BASE, 3, jnp.float32)
    routed = params.layers[ROUTED_LAYER].moe
    bias = 0.5 * jax.random.normal(jax.random.key(1), routed.bias.shape)  # large enough to matter
    return {MlpKind.HASH_MOE: params.layers[HASH_LAYER].moe,
            MlpKind.MOE: dataclasses.replace(routed, bias=bias)}


def numpy_scores(logits, func):
    if func is ScoringFunc.SOFTMAX:
        e = np.exp(logits - logits.max())
        return e / e.sum()
    if func is ScoringFunc.SIGMOID:
        return 1 / (1 + np.exp(-logits))
    return np.sqrt(np.log1p(np.exp(logits)))


def numpy_moe(x, token_ids, p, kind, cfg):
    """Token by token: score, choose, weight, run each chosen expert, add the shared expert."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    gate, w13, w2 = f64(p.gate), f64(p.experts.w13), f64(p.experts.w2)
    limit = cfg.swiglu_limit

    def swiglu(h):
        g, u = np.split(h, 2)
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        return g / (1 + np.exp(-g)) * u

    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        scores = numpy_scores(x[t] @ gate, cfg.scoring_func)
        if kind is MlpKind.HASH_MOE:
            chosen = np.asarray(p.tid2eid)[token_ids[t]]
        else:
            chosen = np.argsort(-(scores + f64(p.bias)), kind="stable")[: cfg.num_experts_per_tok]
        weights = scores[chosen]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights * cfg.routed_scaling_factor):
            out[t] += w * (swiglu(x[t] @ w13[e]) @ w2[e])
        out[t] += swiglu(x[t] @ f64(p.shared.w13)) @ f64(p.shared.w2)
    return out


@pytest.mark.parametrize("scoring", list(ScoringFunc))
@pytest.mark.parametrize("kind", list(MlpKind))
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_numpy_loop(layers, scoring, kind, norm_topk):
    cfg = BASE.replace(scoring_func=scoring, norm_topk_prob=norm_topk, swiglu_limit=1.5)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, cfg.hidden_size)).astype(np.float32)
    ids = rng.integers(0, cfg.vocab_size, 37)
    # float32 matmuls in float32: a GPU's default precision for them is TF32's 10-bit
    # mantissa, ~1e-3 off a float64 loop (the H100 run of all-tests, session 55)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(moe(jnp.asarray(x), jnp.asarray(ids), layers[kind], kind, cfg,
                             ComputeConfig())[0])
    want = numpy_moe(x.astype(np.float64), ids, layers[kind], kind, cfg)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_selection_bias_steers_the_choice_but_not_the_weights(layers):
    p = layers[MlpKind.MOE]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, BASE.hidden_size)), jnp.float32)
    ids = jnp.zeros(64, jnp.int32)
    chosen, weights = route(x, ids, p, MlpKind.MOE, BASE, ComputeConfig())
    unbiased, _ = route(x, ids, dataclasses.replace(p, bias=jnp.zeros_like(p.bias)), MlpKind.MOE,
                        BASE, ComputeConfig())
    assert (np.sort(chosen, -1) != np.sort(unbiased, -1)).any()   # the bias changed some choices
    scores = np.sqrt(np.log1p(np.exp(np.asarray(x, np.float64) @ np.asarray(p.gate, np.float64))))
    picked = np.take_along_axis(scores, np.asarray(chosen), -1)
    want = picked / picked.sum(-1, keepdims=True) * BASE.routed_scaling_factor
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)


def test_moe_through_the_grouped_gemm_kernel():
    """The model's MoE on the Mosaic GPU kernel path (interpreted on the CPU; compiled on a
    GPU) against the numpy loop: the wiring of layout, SwiGLU epilogue and down GEMM."""
    cfg = BASE.replace(hidden_size=128, moe_intermediate_size=64, swiglu_limit=1.5)
    p = random_params(cfg, 4, jnp.bfloat16).layers[ROUTED_LAYER].moe
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((9, cfg.hidden_size)), jnp.bfloat16)
    ids = rng.integers(0, cfg.vocab_size, 9)
    jaxpr = str(jax.make_jaxpr(lambda x: moe(x, jnp.asarray(ids), p, MlpKind.MOE, cfg,
                                             ON_KERNEL))(x))
    assert any(mark in jaxpr for mark in ("Ref<smem>", "pallas_call", "mosaic"))
    got = np.asarray(moe(x, jnp.asarray(ids), p, MlpKind.MOE, cfg, ON_KERNEL)[0], np.float32)
    want = numpy_moe(np.asarray(x, np.float64), ids, p, MlpKind.MOE, cfg)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * np.abs(want).max())


# a combination (FP4 tiles x the MoE layer): the tile order's bits in test_grouped_gemm_fp4.py
@pytest.mark.slow
def test_moe_on_fp4_tiles_equals_the_moe_on_fp4_rows():
    """FP4 experts in the kernel's stored tile order (weights/fp4_tiles.py: bytes where
    interpreted, 32-bit words where compiled; nibbles re-paired so that the activations come
    unpermuted) give the MoE what the checkpoint's row order gives on the same kernel, to
    float32 rounding (each wgmma sums another half of a scale group's inputs), and what the
    jnp reference gives within bf16 rounding."""
    cfg = BASE.replace(hidden_size=512, moe_intermediate_size=512, swiglu_limit=1.5,
                       num_layers=2, layer_types=BASE.layer_types[:2],
                       mlp_types=BASE.mlp_types[:2], n_routed_experts=4)
    rows = random_params(cfg, 5, jnp.bfloat16, release_formats=True)
    order = ON_KERNEL.fp4_expert_order
    tiled = tile_fp4_experts(rows, order, owned=False)
    p_rows, p_tiled = rows.layers[ROUTED_LAYER].moe, tiled.layers[ROUTED_LAYER].moe
    assert fp4_tile(p_tiled.experts.w13).words == (order == "words")
    assert fp4_tile(p_tiled.experts.w2) is not None and fp4_tile(p_rows.experts.w2) is None
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((9, cfg.hidden_size)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, 9))
    run = lambda p, compute: np.asarray(moe(x, ids, p, MlpKind.MOE, cfg, compute)[0],  # noqa: E731
                                        np.float32)
    on_tiles, on_rows = run(p_tiled, ON_KERNEL), run(p_rows, ON_KERNEL)
    np.testing.assert_allclose(on_tiles, on_rows, rtol=1e-2, atol=1e-2 * np.abs(on_rows).max())
    want = run(p_rows, ComputeConfig())
    np.testing.assert_allclose(on_tiles, want, rtol=3e-2, atol=3e-2 * np.abs(want).max())


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_padding_rows_reach_no_routed_expert(monkeypatch, impl):
    """A step's padding rows (valid False) are routed nowhere: the grouped GEMM's groups count
    the real rows' pairs only (so no expert is read for padding), the real rows' outputs are
    those of the real rows alone, and a padding row gets the shared expert's output only."""
    from deepinfer_jax.model.moe import shared_expert
    from pallas_kernels.grouped_gemm import api as gemm

    compute = ON_KERNEL if impl == "kernel" else ComputeConfig()
    cfg = BASE.replace(hidden_size=128, moe_intermediate_size=64, swiglu_limit=1.5)
    p = random_params(cfg, 6, jnp.bfloat16).layers[ROUTED_LAYER].moe
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((16, cfg.hidden_size)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, 16))
    valid = jnp.arange(16) < 3                       # one 3-token chunk in a 16-token bucket
    seen = []
    real_expert_mlp = gemm.expert_mlp

    def counting(x, w13, w2, group_sizes, *args, **kwargs):
        jax.debug.callback(lambda total: seen.append(int(total)), group_sizes.sum())
        return real_expert_mlp(x, w13, w2, group_sizes, *args, **kwargs)

    monkeypatch.setattr(gemm, "expert_mlp", counting)
    run = jax.jit(lambda x, ids, valid: moe(x, ids, p, MlpKind.MOE, cfg, compute, valid)[0])
    got = np.asarray(run(x, ids, valid), np.float32)
    alone = np.asarray(run(x[:3], ids[:3], None), np.float32)
    assert seen == [3 * cfg.num_experts_per_tok, 3 * cfg.num_experts_per_tok]
    np.testing.assert_array_equal(got[:3], alone)
    shared = np.asarray(shared_expert(x[3:], p.shared, cfg.swiglu_limit, compute), np.float32)
    np.testing.assert_array_equal(got[3:], shared)


def test_invariant_ffn_on_the_kernel_runs_untiled_and_row_by_row():
    """Batch-invariant mode's GPU formulation runs the MoE sublayer over the whole batch at
    once (one read of the expert weights per step, not one per row tile), its routed experts
    on the grouped-GEMM kernel: a token's new streams are then bitwise the same among few
    tokens as among many, whatever rows share its experts' tiles. The default mode's are not
    on the CPU (the control; on the H200 XLA's kernels for the other ops happened to keep
    these rows too)."""
    from deepinfer_jax.model import paged_forward
    from deepinfer_jax.model.invariant import segments

    assert segments(dataclasses.replace(ON_KERNEL, formulation="gpu", batch_invariant=True)
                    )(lambda x: x + 1, 1) == 2                        # untiled: applied at once
    rng = np.random.default_rng(3)
    few = np.array([30, 2, 17, 5, 11])
    for invariant in (True, False):
        cfg = BASE.replace(hidden_size=128, moe_intermediate_size=64)
        compute = dataclasses.replace(ON_KERNEL, batch_invariant=invariant)
        layer = random_params(cfg, 5, jnp.bfloat16).layers[ROUTED_LAYER]
        streams = jnp.asarray(rng.standard_normal((37, cfg.hc_mult, cfg.hidden_size)),
                              jnp.bfloat16)
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, 37))
        ffn = jax.jit(lambda s, i, cfg=cfg, compute=compute, layer=layer:
                      paged_forward.ffn_outputs(layer, MlpKind.MOE, cfg, compute, s, i)[0])
        alone = np.asarray(ffn(streams[few], ids[few]), np.float32)
        among_all = np.asarray(ffn(streams, ids), np.float32)[few]
        if invariant or jax.default_backend() == "cpu":
            assert np.array_equal(alone, among_all) == invariant


def test_sort_by_expert_is_the_stable_argsort():
    from deepinfer_jax.model.moe import sort_by_expert

    rng = np.random.default_rng(5)
    for pairs, experts in ((1, 4), (96, 256), (49152, 256), (1000, 3)):
        flat = jnp.asarray(rng.integers(0, experts, pairs), jnp.int32)
        np.testing.assert_array_equal(np.asarray(sort_by_expert(flat, experts)),
                                      np.argsort(np.asarray(flat), kind="stable"))
