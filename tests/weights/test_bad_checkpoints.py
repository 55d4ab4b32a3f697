"""Broken checkpoints fail on load with errors that name the file, the tensor and what was
expected: wrong dtypes, non-finite weights, empty, truncated or garbled safetensors files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.weights import CheckpointError, load_params
from deepinfer_jax.weights.safetensors_io import SafetensorsError, SafetensorsFile
from tests.weights.test_checkpoints import CFG, tensors, write  # noqa: F401  (tensors: fixture)

WEIGHT = "layers.1.attn.wq_a.weight"


def test_weight_stored_as_int32_is_named(tmp_path, tensors):  # noqa: F811
    broken = {**tensors, WEIGHT: tensors[WEIGHT].astype(np.int32)}
    with pytest.raises(CheckpointError) as err:
        load_params(write(tmp_path / "ckpt", broken), CFG, np.float32)
    assert f"{WEIGHT}: dtype I32, expected one of ['BF16', 'F16', 'F32', 'F64']" in str(err.value)


def test_hash_table_stored_as_floats_is_named(tmp_path, tensors):  # noqa: F811
    name = "layers.0.ffn.gate.tid2eid"
    broken = {**tensors, name: tensors[name].astype(np.float32)}
    with pytest.raises(CheckpointError, match=f"{name}: dtype F32, expected one of"):
        load_params(write(tmp_path / "ckpt", broken), CFG, np.float32)


@pytest.mark.parametrize("in_pieces", [False, True])
@pytest.mark.parametrize("poison, expected", [
    (lambda w: np.full_like(w, np.nan), "all NaN"),
    (lambda w: np.where(np.arange(w.size).reshape(w.shape) == 5, np.inf, w), "1 of"),
])
def test_non_finite_weights_are_named(tmp_path, tensors, poison, expected, in_pieces,  # noqa: F811
                                      monkeypatch):
    """in_pieces: the 2-D tensors read in row pieces (as large ones are), counted over all."""
    if in_pieces:
        from deepinfer_jax.weights import sources
        monkeypatch.setattr(sources, "PLACE_AT_ONCE_BYTES", 1)
        monkeypatch.setattr(sources, "STACK_CHUNK_BYTES", 4096)
    norm = "layers.2.attn_norm.weight"
    broken = {**tensors, **{name: poison(tensors[name]) for name in (WEIGHT, norm, "embed.weight")}}
    with pytest.raises(CheckpointError) as err:
        load_params(write(tmp_path / "ckpt", broken), CFG, np.float32)
    message = str(err.value)
    for name in (WEIGHT, norm, "embed.weight"):
        assert f"{name}: {expected}" in message and "expected finite weights" in message


def truncated_copy(tmp_path, tensors, keep: int):  # noqa: F811
    """A checkpoint directory whose model.safetensors keeps only its first `keep` bytes
    (negative: all but the last -keep)."""
    d = write(tmp_path / "ckpt", tensors)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return d, path


def test_empty_safetensors_file_is_named(tmp_path, tensors):  # noqa: F811
    d, path = truncated_copy(tmp_path, tensors, 0)
    with pytest.raises(SafetensorsError, match=f"{path}: 0 bytes, too short"):
        deepinfer_jax.load(d)


def test_truncated_header_is_named(tmp_path, tensors):  # noqa: F811
    d, path = truncated_copy(tmp_path, tensors, 100)
    with pytest.raises(SafetensorsError, match=f"{path}: truncated: the header alone needs"):
        deepinfer_jax.load(d)


def test_truncated_data_names_the_file_and_the_tensor(tmp_path, tensors):  # noqa: F811
    d, path = truncated_copy(tmp_path, tensors, -1000)
    with pytest.raises(SafetensorsError) as err:
        deepinfer_jax.load(d)
    last = sorted(tensors)[-1]           # save_file writes the keys in order
    message = str(err.value)
    assert f"{path}: truncated: the data section holds" in message and last in message


def test_garbled_header_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    header = b'{"x": {"dtype": "F32", "shape": [2], '
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(SafetensorsError, match=f"{path}: the header is not valid JSON"):
        SafetensorsFile(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(SafetensorsError, match=r"tensor x: data_offsets \[0, 8\] hold 8 bytes, "
                                               r"expected 12 for F32 \[3\]"):
        SafetensorsFile(path)


def test_broken_shard_index_is_named(tmp_path, tensors):  # noqa: F811
    d = write(tmp_path / "ckpt", tensors)
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(SafetensorsError, match=f"{index}: expected a JSON object"):
        deepinfer_jax.load(d)
    index.write_text(json.dumps({"weight_map": {WEIGHT: "model-00002.safetensors"}}))
    with pytest.raises(SafetensorsError, match="model-00002.safetensors"):
        deepinfer_jax.load(d)
