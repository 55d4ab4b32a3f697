"""V4.1 checkpoints in the release's formats (tests/model/v41_quantized.py writes them with
numpy from the documented format): the loader keeps FP8 projections and FP4 routed experts
quantized (V4's Fp8Blocks / Fp4Blocks) and reads the numbers the writer encoded; bad tensors
and scales are named with what was expected and found; the memory plan counts the weights in
the formats the loader holds them."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.api.cli import main
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory_v41 import engram_product_bytes, v41_weight_bytes
from deepinfer_jax.engine.memory_plan import config_plan, weight_bytes
from deepinfer_jax.weights.safetensors_io import Checkpoint, save_file
from deepinfer_jax.weights.sources import CheckpointError
from deepinfer_jax.weights.v41 import load_v41_params
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks, dequantize_tree, is_quantized
from tests.model.v41_oracle import FIXTURES
from tests.model.v41_quantized import write_pair

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("v41q"))


def _tensors(folder) -> dict[str, np.ndarray]:
    ckpt = Checkpoint(folder)
    return {k: np.array(ckpt.get(k)) for k in ckpt.keys()}


def _rewrite(tmp_path, folder, tensors):
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_release_formats_stay_quantized_and_decode_as_written(pair):
    quantized, twin = pair
    cfg = read_model_config(quantized)
    assert cfg.fp8_block == (32, 32)
    kept = load_v41_params(quantized, cfg)
    layer = kept.layers[1]                       # a KV + index source with an Engram
    for w in (layer.attn.wq_a, layer.attn.wq_b, layer.attn.wkv, layer.attn.wo_a,
              layer.attn.wo_b, layer.moe.shared.w13, layer.moe.shared.w2, layer.engram.wkv):
        assert isinstance(w, Fp8Blocks) and w.codes.dtype == ml_dtypes.float8_e4m3fn
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    # [in, out] codes, one scale per 32 x 32 tile: wq_a [D, R]
    assert layer.attn.wq_a.codes.shape == (d, cfg.q_lora_rank)
    assert layer.attn.wq_a.scale.shape == (d // 32, cfg.q_lora_rank // 32)
    w13 = layer.moe.experts.w13
    assert isinstance(w13, Fp4Blocks) and w13.packed.dtype == np.uint8
    assert w13.packed.shape == (e, 2 * inter, d // 2) and w13.scale.shape == (e, d // 32, 2 * inter)
    for w in (layer.attn.compressor.wkv, layer.attn.indexer.wq_b, layer.moe.gate, kept.head):
        assert not is_quantized(w)                # bf16 in the release
    # Decoded, the kept weights are exactly the numbers the writer encoded (its twin), and
    # keep_quantized=False gives the same twin.
    want = jax.tree.leaves(load_v41_params(twin, read_model_config(twin)))
    for kept_leaf, float_leaf, twin_leaf in zip(
            jax.tree.leaves(dequantize_tree(kept, np.float32)),
            jax.tree.leaves(load_v41_params(quantized, cfg, keep_quantized=False)), want,
            strict=True):
        np.testing.assert_array_equal(np.asarray(kept_leaf), np.asarray(twin_leaf))
        np.testing.assert_array_equal(np.asarray(float_leaf), np.asarray(twin_leaf))


def test_reference_named_stacked_fp4_experts(pair, tmp_path):
    """The reference's stacked names with FP4 codes (`experts.gate_up_proj` [E, 2I, D/2] and
    its `_scale_inv` [E, 2I, D/32]) give what the native per-expert tensors give."""
    quantized, _ = pair
    cfg = read_model_config(quantized)
    tensors = _tensors(quantized)
    e = cfg.n_routed_experts
    for i in range(cfg.num_layers):
        p = f"layers.{i}.ffn.experts."
        for ref, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            for suffix, ref_suffix in (("weight", ""), ("scale", "_scale_inv")):
                stacked = np.stack([np.concatenate([tensors.pop(f"{p}{x}.{w}.{suffix}")
                                                    for w in parts]) for x in range(e)])
                tensors[f"model.layers.{i}.mlp.experts.{ref}{ref_suffix}"] = stacked
    got = load_v41_params(_rewrite(tmp_path, quantized, tensors), cfg)
    want = load_v41_params(quantized, cfg)
    assert isinstance(got.layers[0].moe.experts.w2, Fp4Blocks)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_tensors_and_scales_are_named(pair, tmp_path):
    quantized, _ = pair
    tensors = _tensors(quantized)
    tensors["layers.1.attn.wkv.scale"] = tensors["layers.1.attn.wkv.scale"][:1]
    tensors["layers.2.ffn.experts.3.w2.weight"] = tensors["layers.2.ffn.experts.3.w2.weight"][:, :8]
    tensors["layers.0.ffn.experts.1.w1.scale"] = np.ones((32, 2), ml_dtypes.bfloat16)
    del tensors["layers.3.attn.wq_b.scale"]
    tensors["layers.4.attn_norm.weight"] = tensors["layers.4.attn_norm.weight"].astype(
        ml_dtypes.float8_e4m3fn)
    tensors["layers.5.ffn.experts.0.w3.weight"] = np.zeros((32, 64), np.float32)
    del tensors["layers.5.ffn.experts.0.w3.scale"]
    with pytest.raises(CheckpointError) as err:
        load_v41_params(_rewrite(tmp_path, quantized, tensors), read_model_config(quantized))
    text = str(err.value)
    for needle in (
            "model.layers.1.self_attn.kv_proj.weight_scale_inv: found shape (1, 2), expected "
            "(2, 2) (one scale per 32x32 block of a [64, 64] weight)",
            "model.layers.2.mlp.experts.3.w2.weight: found shape (64, 8), expected (64, 16)",
            "model.layers.0.mlp.experts.1.w1.weight_scale_inv: dtype BF16, expected F8_E8M0",
            "model.layers.3.self_attn.q_b_proj.weight: stored as F8_E4M3 without a scale",
            "model.layers.4.input_layernorm.weight: stored as F8_E4M3, expected a float tensor",
            "model.layers.5.mlp.experts.0.w3.weight: stored as F32 without a scale, expected "
            "FP4 E2M1"):
        assert needle in text, text


def test_memory_plan_counts_the_formats_the_loader_holds(pair, capsys):
    """config/memory_v41.py's count from the config alone equals the bytes of the loaded
    pytree: kept quantized, and the float twin at float32 and bfloat16; `deepinfer plan`
    shows it for a V4.1 checkpoint."""
    quantized, twin = pair
    cfg = read_model_config(quantized)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        size = np.dtype(dtype).itemsize
        for keep in (True, False):
            params = load_v41_params(quantized, cfg, dtype, keep_quantized=keep)
            assert weight_bytes(params) == v41_weight_bytes(cfg, keep, size)
            # over 2 and 4 devices: each holds its share of the expert stacks (the pytree's
            # `.moe.experts.` leaves split, memory_plan.weight_bytes), the rest whole
            for devices in (2, 4):
                assert (weight_bytes(params, devices)
                        == v41_weight_bytes(cfg, keep, size, devices=devices))
    kept, floats = v41_weight_bytes(cfg, True, 2), v41_weight_bytes(cfg, False, 2)
    assert kept < 0.65 * floats       # the tiny model's experts and projections are most of it
    # the tables on the device, as this pytree holds them (host tables: test_v41_engram_host),
    # and the step's hash products, which the engine adds
    step_cfg = EngineConfig(max_num_seqs=2, max_model_len=64, engram_tables="device").resolve(cfg)
    kept, floats = kept + engram_product_bytes(cfg), floats + engram_product_bytes(cfg)
    assert config_plan(cfg, step_cfg, quantized=True).weights == kept
    assert config_plan(cfg, step_cfg, quantized=False).weights == floats
    shown = []
    for weights in ("quantized", "bf16"):
        assert main(["plan", str(quantized), "--max-num-seqs", "2", "--max-model-len", "64",
                     "--weights", weights, "--engram-tables", "device"]) == 0
        lines = capsys.readouterr().out.splitlines()
        shown.append(next(float(x.split()[1]) for x in lines if x.startswith("weights")))
    assert shown == [round(kept / 2**30, 4), round(floats / 2**30, 4)]
