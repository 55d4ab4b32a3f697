"""V4.1 weights: the oracle checkpoints load under the reference's names and, renamed to the
released checkpoint's native names (experts split per expert) in a temporary checkpoint, give
the same pytree; bad tensors are reported by name. The release's FP8 / FP4 formats:
test_v41_quantized.py."""

from __future__ import annotations

import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.weights.safetensors_io import Checkpoint, save_file
from deepinfer_jax.weights.sources import CheckpointError
from deepinfer_jax.weights.v41 import load_v41_params
from tests.conftest import V41_ORACLE_DIR

FIXTURES = [V41_ORACLE_DIR / f"deepseek-v41-tiny-{x}" for x in "ab"]
pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")

# Reference -> native, restated from the oracle README's "Tensor names" (applied in order).
_TO_NATIVE = [
    (r"^model\.embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^model\.norm\.", "norm."),
    (r"^model\.engram_tables\.(\d+)\.weight_scale_inv$", r"layers.\1.engram.embed.scale"),
    (r"^model\.engram_tables\.(\d+)\.", r"layers.\1.engram.embed."),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."), (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.indexer\.q_b_proj\.", ".indexer.wq_b."), (r"\.indexer\.k_proj\.", ".indexer.wk."),
    (r"\.self_attn\.q_a_proj\.", ".attn.wq_a."), (r"\.self_attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.self_attn\.q_b_proj\.", ".attn.wq_b."), (r"\.self_attn\.kv_proj\.", ".attn.wkv."),
    (r"\.self_attn\.o_a_proj\.", ".attn.wo_a."), (r"\.self_attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.gate\.e_score_correction_bias_vl$", ".ffn.gate.bias_vl"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
]


def _native(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tensors.items():
        name = key
        for pattern, replacement in _TO_NATIVE:
            name = re.sub(pattern, replacement, name)
        if name.endswith("experts.gate_up_proj"):
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.w1.weight")] = value[e, :inter]
                out[name.replace("gate_up_proj", f"{e}.w3.weight")] = value[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                out[name.replace("down_proj", f"{e}.w2.weight")] = value[e]
        else:
            out[name] = value
    return out


def _tensors(folder) -> dict[str, np.ndarray]:
    ckpt = Checkpoint(folder)
    return {k: np.array(ckpt.get(k)) for k in ckpt.keys()}


def _rewrite(tmp_path, folder, tensors):
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_reference_names_load_every_tensor_once(folder):
    cfg = read_model_config(folder)
    params = load_v41_params(folder, cfg)
    tensors = _tensors(folder)
    stored = sum(x.size for k, x in tensors.items() if not k.endswith("weight_scale_inv"))
    assert sum(x.size for x in jax.tree.leaves(params)) == stored   # float tables: scales unused
    # Layouts: [in, out] projections, stacked experts, group-major o_a_proj, tables by layer.
    l3 = params.layers[3]
    t = lambda name: tensors[f"model.layers.3.{name}"]   # noqa: E731
    np.testing.assert_array_equal(l3.attn.wq_a, t("self_attn.q_a_proj.weight").T)
    np.testing.assert_array_equal(l3.attn.compressor.wkv, t("self_attn.compressor.kv_proj.weight").T)
    assert l3.attn.compressor.wgate is None                     # ratio 1: no pooling gate
    np.testing.assert_array_equal(l3.attn.indexer.wk, t("self_attn.indexer.k_proj.weight").T)
    e, inter = 1, cfg.moe_intermediate_size
    np.testing.assert_array_equal(l3.moe.experts.w13[e], t("mlp.experts.gate_up_proj")[e].T)
    np.testing.assert_array_equal(l3.moe.experts.w2[e], t("mlp.experts.down_proj")[e].T)
    np.testing.assert_array_equal(l3.moe.shared.w13[:, inter:], t("mlp.shared_experts.up_proj.weight").T)
    L = cfg.o_lora_rank
    np.testing.assert_array_equal(l3.attn.wo_a[1], t("self_attn.o_a_proj.weight")[L:2 * L].T)
    np.testing.assert_array_equal(l3.attn_hc.fn, t("attn_hc.fn").T)
    first = cfg.engram.layer_ids[0]
    np.testing.assert_array_equal(params.engram_tables[0], tensors[f"model.engram_tables.{first}.weight"])
    assert params.layers[2].attn.compressor is None                 # a Reuse consumer


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_native_names_give_the_same_params(tmp_path, folder):
    cfg = read_model_config(folder)
    native = _native(_tensors(folder))
    assert "embed.weight" in native and "layers.3.ffn.experts.0.w1.weight" in native
    native["mtp.0.enorm.weight"] = np.ones(4, np.float32)            # the drafter: ignored
    got = load_v41_params(_rewrite(tmp_path, folder, native), cfg)
    want = load_v41_params(folder, cfg)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fp8_engram_table_is_dequantized(tmp_path):
    folder = FIXTURES[0]
    cfg = read_model_config(folder)
    tensors = _tensors(folder)
    name = f"model.engram_tables.{cfg.engram.layer_ids[0]}"
    table = tensors[name + ".weight"]
    scale = np.exp2(np.ceil(np.log2(np.abs(table).reshape(len(table), -1, 32).max(-1) / 448)))
    tensors[name + ".weight"] = (table / np.repeat(scale, 32, 1)).astype(ml_dtypes.float8_e4m3fn)
    tensors[name + ".weight_scale_inv"] = scale.astype(np.float32)
    params = load_v41_params(_rewrite(tmp_path, folder, tensors), cfg)
    want = tensors[name + ".weight"].astype(np.float32) * np.repeat(scale, 32, 1)
    np.testing.assert_array_equal(params.engram_tables[0], want.astype(np.float32))
    assert np.abs(params.engram_tables[0] - table).max() < 0.07 * np.abs(table).max()


def test_bad_tensors_are_named(tmp_path):
    folder = FIXTURES[0]
    tensors = _tensors(folder)
    del tensors["model.layers.2.self_attn.sinks"]
    tensors["model.layers.0.self_attn.q_a_proj.weight"] = np.zeros((3, 3), np.float32)
    w = tensors["model.layers.1.self_attn.kv_proj.weight"]
    norm = tensors["model.layers.1.self_attn.kv_norm.weight"]      # float in the release
    tensors["model.layers.1.self_attn.kv_norm.weight"] = norm.astype(ml_dtypes.float8_e4m3fn)
    tensors["model.layers.0.self_attn.compressor.kv_proj.weight"] = w   # layer 0 has none
    with pytest.raises(CheckpointError) as err:
        load_v41_params(_rewrite(tmp_path, folder, tensors), read_model_config(folder))
    text = str(err.value)
    for needle in ("1 missing", "model.layers.2.self_attn.sinks", "1 mis-shaped",
                   "q_a_proj.weight: found shape (3, 3)", "kv_norm.weight: stored as F8_E4M3",
                   "1 unexpected", "layers.0.self_attn.compressor.kv_proj.weight"):
        assert needle in text, text
