"""Reading a safetensors checkpoint with numpy alone (the Ascend environment has no jax, so
it cannot use deepinfer_jax/weights/): a file is an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}}, then the tensors' bytes. Shards follow
`model.safetensors.index.json`, or every `*.safetensors` file of the directory.

Plain float and integer tensors only: quantized releases (FP8 / FP4 codes with scales) are
not supported by the Ascend backend yet (config/platforms.py, "quantized_weights")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from deepinfer_jax.config.platforms import UnsupportedFeatureError

_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}
_QUANTIZED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I4")

# transformers' save_pretrained writes the official DeepSeek names but for these few
_HF_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
               "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
               "hc_head.hc_scale": "hc_head_scale"}
_HF_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.)norm\.weight$")


class CheckpointFormatError(ValueError):
    """A checkpoint file the Ascend backend cannot read (names the file and the problem)."""


def official_name(key: str) -> str:
    key = key.removeprefix("model.")
    return _HF_KV_NORM.sub(r"\1kv_norm.weight", _HF_RENAMES.get(key, key))


def _read_file(path: Path) -> dict[str, np.ndarray]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = int.from_bytes(bytes(data[:8]), "little")
    try:
        header = json.loads(bytes(data[8:8 + size]))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({err})") from None
    base, out = 8 + size, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind, shape = info["dtype"], tuple(info["shape"])
        start, end = info["data_offsets"]
        raw = data[base + start: base + end]
        if kind in _QUANTIZED or name.endswith(".scale"):
            raise UnsupportedFeatureError("quantized_weights", "ascend")
        if kind == "BF16":      # the top 16 bits of a float32
            array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif kind in _NUMPY:
            array = raw.view(_NUMPY[kind])
        else:
            raise CheckpointFormatError(f"{path}: tensor {name} has dtype {kind}, which the "
                                        "Ascend backend does not read")
        out[official_name(name)] = np.asarray(array).reshape(shape)
    return out


def read_checkpoint(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory by its official name."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {directory}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(_read_file(directory / name))
    return tensors
