"""Reading a safetensors checkpoint with numpy alone (the Ascend environment has no jax, so
it cannot use deepinfer_jax/weights/): a file is an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}}, then the tensors' bytes. Shards follow
`model.safetensors.index.json`, or every `*.safetensors` file of the directory.

A quantized release is dequantized here, exactly, to float32 (the Ascend step computes with
plain weights; pallas_kernels/quantized.py has the formats): FP8 E4M3 codes times one scale
per 128 x 128 block, FP4 E2M1 codes packed two a byte (low nibble first) times one scale per
32 inputs of a row, the scales E8M0 (2 ** (byte - 127)) or float32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}
FP8_BLOCK, FP4_GROUP = 128, 32
# E2M1 values by 4-bit code (bit 3: sign; bits 2-1: exponent, bias 1; bit 0: mantissa)
_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _e4m3_table() -> np.ndarray:
    """f32[256]: the value of each E4M3 (fn) byte: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal; 0x7F and 0xFF are NaN."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    value = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                     (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    value[(code & 0x7F) == 0x7F] = np.nan
    return (sign * value).astype(np.float32)


_E4M3 = _e4m3_table()

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


def _read_file(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, the tensor's bytes viewed as its numpy type, or as bytes for
    the 8-bit float formats)}."""
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
        if kind == "BF16":      # the top 16 bits of a float32
            array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif kind in _NUMPY:
            array = raw.view(_NUMPY[kind])
        elif kind in ("F8_E4M3", "F8_E8M0"):
            array = raw
        else:
            raise CheckpointFormatError(f"{path}: tensor {name} has dtype {kind}, which the "
                                        "Ascend backend does not read")
        out[name] = (kind, np.asarray(array).reshape(shape))
    return out


def _scale(kind: str, scale: np.ndarray) -> np.ndarray:
    if kind == "F8_E8M0":
        return (scale.astype(np.uint32) << 23).view(np.float32)
    return scale.astype(np.float32)


def dequantize(kind: str, codes: np.ndarray, scale_kind: str, scale: np.ndarray) -> np.ndarray:
    """A quantized [out, in] weight -> float32: FP8 (E4M3 codes, a scale per 128 x 128 block)
    or FP4 (packed in I8, a scale per 32 inputs)."""
    scale = _scale(scale_kind, scale)
    if kind == "F8_E4M3":
        out, inp = codes.shape
        full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:out, :inp]
        return _E4M3[codes] * full
    if kind in ("I8", "U8"):
        packed = codes.view(np.uint8)
        values = _FP4[np.stack([packed & 0x0F, packed >> 4], axis=-1)].reshape(
            *packed.shape[:-1], 2 * packed.shape[-1])
        return values * np.repeat(scale, FP4_GROUP, axis=-1)
    raise CheckpointFormatError(f"a quantized weight stored as {kind} (expected F8_E4M3 or "
                                "FP4 packed in I8)")


def read_checkpoint(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory by its official name, quantized weights
    dequantized to float32 (their .scale tensors consumed)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {directory}")
    stored: dict[str, tuple[str, np.ndarray]] = {}
    for name in files:
        stored.update(_read_file(directory / name))
    tensors = {}
    for name, (kind, array) in stored.items():
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in stored:
            continue
        scale = stored.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        if scale is not None:
            array = dequantize(kind, array, *scale)
        elif kind in ("F8_E4M3", "F8_E8M0"):
            raise CheckpointFormatError(f"{directory}: {name} is {kind} without a .scale")
        tensors[official_name(name)] = array
    return tensors
