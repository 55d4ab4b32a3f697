"""Checkpoint loading: names, shards, strict checking, export round trip, quantised formats."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.hf import read_model_config, to_hf_dict
from deepinfer_jax.weights import CheckpointError, load_params, quant, random_params
from deepinfer_jax.weights.export import export_tensors, save_checkpoint
from deepinfer_jax.weights.safetensors_io import Checkpoint, save_file
from pallas_kernels.quantized import Fp4Blocks, Fp8Blocks, dequantize_tree
from tests.conftest import REPO

CFG = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    """Official-name tensors of a random float32 tiny model (with its MTP block)."""
    return export_tensors(random_params(CFG, 7, jnp.float32), CFG)


def write(directory, tensors, cfg_dict=None):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(cfg_dict or to_hf_dict(CFG)))
    return directory


def assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_then_load_round_trips(tmp_path, tensors):
    params = random_params(CFG, 7, jnp.float32)
    save_checkpoint(params, CFG, tmp_path / "ckpt")
    assert_same_params(load_params(tmp_path / "ckpt", CFG, jnp.float32), params)
    assert Checkpoint(tmp_path / "ckpt").keys() and "mtp.0.e_proj.weight" in tensors


def test_hf_save_pretrained_names_load_like_official_names(tmp_path, tensors):
    """transformers writes `model.` prefixes, embed_tokens, lm_head, hc_head.hc_* and
    attn.norm for the kv norm: all of them map onto the official names."""
    hf_names = {}
    for name, value in tensors.items():
        renamed = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                   "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                   "hc_head_scale": "model.hc_head.hc_scale"}.get(name)
        if renamed is None:
            renamed = name.replace(".attn.kv_norm.", ".attn.norm.")
            renamed = renamed if renamed.startswith("mtp.") else "model." + renamed
        hf_names[renamed] = value
    official = load_params(write(tmp_path / "a", tensors), CFG, jnp.float32)
    hf = load_params(write(tmp_path / "b", hf_names), CFG, jnp.float32)
    assert_same_params(official, hf)


def test_sharded_checkpoint_with_index(tmp_path, tensors):
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    d = tmp_path / "sharded"
    d.mkdir()
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps(to_hf_dict(CFG)))
    assert_same_params(load_params(d, CFG, jnp.float32),
                       load_params(write(tmp_path / "single", tensors), CFG, jnp.float32))


def test_bad_checkpoint_lists_every_offending_tensor(tmp_path, tensors):
    broken = dict(tensors)
    del broken["layers.1.attn.wq_a.weight"]
    del broken["layers.3.ffn.experts.5.w2.weight"]
    broken["layers.2.attn.bogus.weight"] = np.zeros(3, np.float32)
    broken["layers.0.attn.wkv.weight"] = np.zeros((7, 64), np.float32)
    with pytest.raises(CheckpointError) as err:
        load_params(write(tmp_path / "bad", broken), CFG, jnp.float32)
    message = str(err.value)
    for name in ("layers.1.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight",
                 "layers.2.attn.bogus.weight", "layers.0.attn.wkv.weight"):
        assert name in message
    assert "missing" in message and "unexpected" in message and "mis-shaped" in message


def test_hash_table_with_out_of_range_experts_is_rejected(tmp_path, tensors):
    broken = dict(tensors)
    table = broken["layers.0.ffn.gate.tid2eid"].copy()
    table[3, 1] = CFG.n_routed_experts
    broken["layers.0.ffn.gate.tid2eid"] = table
    with pytest.raises(CheckpointError, match="tid2eid"):
        load_params(write(tmp_path / "bad", broken), CFG, jnp.float32)


def test_checkpoint_without_mtp_weights_loads_without_the_block(tmp_path, tensors):
    no_mtp = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    params = load_params(write(tmp_path / "nomtp", no_mtp), CFG, jnp.float32)
    assert params.mtp == ()


# FP8 in the release: every projection except the compressors, routers and wo_a-free norms.
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                "attn.wo_b.weight", "attn.indexer.wq_b.weight", "shared_experts.w1.weight",
                "shared_experts.w2.weight", "shared_experts.w3.weight", "e_proj.weight",
                "h_proj.weight")


def quantize_checkpoint(tensors):
    """(quantised tensors, their dequantised float32 twin)."""
    quantised, twin = {}, {}
    for name, value in tensors.items():
        if name.endswith(FP8_SUFFIXES):
            codes, scale = quant.quantize_fp8(value.astype(np.float32))
            quantised[name], quantised[name[:-6] + "scale"] = codes, scale
            twin[name] = quant.dequant_fp8(codes, scale)
        elif ".experts." in name:
            packed, scale = quant.quantize_fp4(value.astype(np.float32))
            quantised[name], quantised[name[:-6] + "scale"] = packed, scale
            twin[name] = quant.dequant_fp4(packed, scale)
        else:
            quantised[name] = twin[name] = value
    return quantised, twin


def test_quantized_checkpoint_matches_its_dequantized_twin(tmp_path, tensors):
    quantised, twin = quantize_checkpoint(tensors)
    assert Checkpoint(write(tmp_path / "q", quantised)).dtype_name(
        "layers.0.attn.wq_a.weight") == "F8_E4M3"
    cfg_q = {**to_hf_dict(CFG), "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                         "scale_fmt": "ue8m0",
                                                         "weight_block_size": [128, 128]}}
    write(tmp_path / "q", quantised, cfg_q)
    write(tmp_path / "twin", twin)
    # float32 loads are exact: dequantisation on load equals the twin bit for bit, and so
    # does the quantized load's meaning (pallas_kernels/quantized.py's dequantize).
    twin_f32 = load_params(tmp_path / "twin", CFG, jnp.float32)
    assert_same_params(load_params(tmp_path / "q", CFG, jnp.float32, keep_quantized=False),
                       twin_f32)
    kept = load_params(tmp_path / "q", CFG, jnp.float32)
    assert isinstance(kept.layers[0].attn.wq_a, Fp8Blocks)
    assert isinstance(kept.layers[0].moe.experts.w13, Fp4Blocks)
    assert_same_params(dequantize_tree(kept, jnp.float32), twin_f32)
    # bf16: dequantise-then-cast equals cast-of-the-twin, so the logits are identical, with
    # the weights dequantized at load or kept quantized ...
    ids = np.random.default_rng(0).integers(2, CFG.vocab_size, size=(1, 200))
    q_bf16 = deepinfer_jax.load(tmp_path / "q", dtype=jnp.bfloat16, weights="bf16")
    assert q_bf16.params.layers[0].attn.wq_a.dtype == jnp.bfloat16
    got = q_bf16.logits(ids)
    np.testing.assert_array_equal(got, deepinfer_jax.load(tmp_path / "twin", dtype=jnp.bfloat16).logits(ids))
    np.testing.assert_array_equal(got, deepinfer_jax.load(tmp_path / "q", dtype=jnp.bfloat16).logits(ids))
    # ... and within bf16 tolerance of the float32 twin. bf16 rounding flips discrete choices
    # (expert and indexer top-k) at a few positions of a random model, so the bound is on the
    # typical position, not the worst.
    want = deepinfer_jax.load(tmp_path / "twin", dtype=jnp.float32).logits(ids)
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    assert np.median(err) <= 0.03 and np.mean(err <= 0.05) >= 0.8


def test_quantized_weight_without_scale_is_an_error(tmp_path, tensors):
    quantised, _ = quantize_checkpoint(tensors)
    del quantised["layers.0.attn.wq_a.scale"]
    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a.weight"):
        load_params(write(tmp_path / "q", quantised), CFG, jnp.float32)


def test_bf16_tensors_on_disk(tmp_path, tensors):
    as_bf16 = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v)
               for k, v in tensors.items()}
    params = load_params(write(tmp_path / "bf16", as_bf16), CFG, jnp.float32)
    want = as_bf16["layers.2.attn.wkv.weight"].astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(params.layers[2].attn.wkv), want)


def test_random_params_have_the_checkpoint_structure(case):
    loaded = case.model.params
    rand = jax.eval_shape(lambda: random_params(case.model.config, 0, jnp.float32))
    assert jax.tree.structure(loaded) == jax.tree.structure(rand)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(rand), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_load_copies_nothing_it_does_not_need(tmp_path):
    """A model directory may hold other files (tokenizer, generation config)."""
    d = tmp_path / "m"
    shutil.copytree(REPO / "configs" / "tiny", d / "unrelated")
    save_checkpoint(random_params(CFG, 7, jnp.float32), CFG, d)
    (d / "generation_config.json").write_text("{}")
    assert deepinfer_jax.load(d).config == CFG


@pytest.mark.parametrize("plain_in_pieces", [False, True])
def test_expert_stacks_read_in_chunks_equal_whole_stacks(tmp_path, tensors, monkeypatch,
                                                         plain_in_pieces):
    """The loader reads a routed-expert stack a few experts at a time (each chunk written
    into the stack on the device); chunks of 3 experts (a partial last chunk) give the same
    parameters as one whole stack, FP4, FP8-dense and plain. plain_in_pieces: every plain 2-D
    tensor is read in row pieces too (as the embedding and LM head are at full size), the
    projections transposed on the device, the last piece partial."""
    from deepinfer_jax.weights import sources

    quantised, _ = quantize_checkpoint(tensors)
    write(tmp_path / "q", quantised)
    whole = load_params(tmp_path / "q", CFG, jnp.float32)
    plain_whole = load_params(tmp_path / "q", CFG, jnp.float32, keep_quantized=False)
    per_expert = CFG.moe_intermediate_size * 2 * (CFG.hidden_size // 2 + CFG.hidden_size // 32)
    monkeypatch.setattr(sources, "STACK_CHUNK_BYTES", 3 * per_expert)
    if plain_in_pieces:
        monkeypatch.setattr(sources, "PLACE_AT_ONCE_BYTES", 1)
        assert CFG.vocab_size % (3 * per_expert // (CFG.hidden_size * 4))
    chunked = load_params(tmp_path / "q", CFG, jnp.float32)
    assert CFG.n_routed_experts % 3
    assert_same_params(chunked, whole)
    assert_same_params(load_params(tmp_path / "q", CFG, jnp.float32, keep_quantized=False),
                       plain_whole)


@pytest.mark.parametrize("name, bad, expected", [
    ("layers.0.attn.wq_b.scale", lambda a: a[:, :0], r"layers\.0\.attn\.wq_b\.scale: found shape "
     r"\(1, 0\), expected \(1, 1\)"),
    ("layers.1.ffn.experts.3.w2.scale", lambda a: a[:32],
     r"layers\.1\.ffn\.experts\.3\.w2\.scale: found shape \(32, 1\), expected \(64, 1\)"),
    ("layers.1.ffn.experts.2.w1.weight", lambda a: np.concatenate([a, a], 1),
     r"layers\.1\.ffn\.experts\.2\.w1\.weight: found shape \(32, 64\), expected \(32, 32\)"),
    ("layers.0.attn.wkv.scale", lambda a: a.astype(np.int32),
     r"layers\.0\.attn\.wkv\.scale: dtype I32, expected F8_E8M0"),
])
def test_quantized_tensor_that_disagrees_is_named_with_found_and_expected(
        tmp_path, tensors, name, bad, expected):
    quantised, _ = quantize_checkpoint(tensors)
    quantised[name] = bad(np.asarray(quantised[name]).view(np.uint8) if name.endswith("scale")
                          else quantised[name])
    with pytest.raises(CheckpointError, match=expected):
        load_params(write(tmp_path / "q", quantised), CFG, jnp.float32)


def test_fp4_scales_beyond_the_kernels_range_refuse_the_quantized_load_only(tmp_path, tensors):
    """FP4 experts kept quantized run on the kernels, exact for scales up to 2 (E8M0 byte
    128); a larger scale is named at load, and the same checkpoint still loads dequantized."""
    quantised, _ = quantize_checkpoint(tensors)
    name = "layers.1.ffn.experts.2.w1.scale"
    scale = np.asarray(quantised[name]).view(np.uint8).copy()
    scale[0, 0] = 129                                          # 2 ** 2
    quantised[name] = scale.view(quantised[name].dtype)
    write(tmp_path / "q", quantised)
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.2\.w1\.scale: scales "
                                              r"above 2 \(E8M0 byte 129 > 128\)"):
        load_params(tmp_path / "q", CFG, jnp.float32)
    plain = load_params(tmp_path / "q", CFG, jnp.float32, keep_quantized=False)
    assert not isinstance(plain.layers[1].moe.experts.w13, Fp4Blocks)
