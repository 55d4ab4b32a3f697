"""A tiny DeepSeek-V4.1 checkpoint in the release's formats, written here with numpy from the
documented format (the V4.1 architecture notes, section 8), independently of the engine's own
quantizer (deepinfer_jax/weights/quant.py) and of its loader's decoding:

* FP8 dense projections (attention wq_a / wq_b / wkv / wo_a / wo_b, the shared experts,
  `engram.wkv`): E4M3 codes [out, in] (numpy's cast through ml_dtypes, round to nearest even)
  and one E8M0 scale byte per 32 x 32 tile, 2 ** ceil(log2(amax / 448)), as `X.scale`;
* FP4 routed experts: E2M1 codes, the nearest of the 8 magnitudes with bit 3 the sign, two a
  byte along the input axis (even input in the low nibble), as int8 [out, in/2], and one
  E8M0 byte per 32 inputs of a row, 2 ** ceil(log2(amax / 6));
* the engram tables: E4M3 rows with one E8M0 scale per row per 32 channels;
* compressor / indexer projections, router, embeddings, head, norms, mHC: float, as released.

Made from the oracle fixture `a` renamed to the native names (test_v41_weights's `_native`),
next to its float32 twin: the same checkpoint with every quantized tensor decoded here (the
dequantize-then-float reference the loader's quantized path must agree with).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from deepinfer_jax.weights.safetensors_io import Checkpoint, save_file
from tests.model.v41_oracle import FIXTURES

FP8_NATIVE = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.shared_experts\.w[123]\.weight$"
                        r"|\.engram\.wkv\.weight$")
FP4_NATIVE = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
TABLE_NATIVE = re.compile(r"\.engram\.embed\.weight$")
BLOCK = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [BLOCK, BLOCK]}


def _exponent(amax: np.ndarray, top: float) -> np.ndarray:
    """ceil(log2(amax / top)) as an int: the E8M0 scale 2 ** e is the least power of two
    that brings amax to within `top`."""
    return np.ceil(np.log2(np.maximum(amax, 2.0 ** -100) / top)).astype(np.int32)


def _e8m0(e: np.ndarray) -> np.ndarray:
    return (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def encode_fp8(w: np.ndarray, rows: int = BLOCK, cols: int = BLOCK):
    """[out, in] -> (E4M3 codes, E8M0 scales [ceil(out/rows), ceil(in/cols)], decoded f32)."""
    out_dim, in_dim = w.shape
    tiles = -(-out_dim // rows), -(-in_dim // cols)
    padded = np.zeros((tiles[0] * rows, tiles[1] * cols), np.float32)
    padded[:out_dim, :in_dim] = np.abs(w)
    e = _exponent(padded.reshape(tiles[0], rows, tiles[1], cols).max(axis=(1, 3)), 448.0)
    per_element = np.exp2(e.astype(np.float32)).repeat(rows, 0).repeat(cols, 1)[:out_dim, :in_dim]
    codes = (w / per_element).astype(ml_dtypes.float8_e4m3fn)
    return codes, _e8m0(e), codes.astype(np.float32) * per_element


def encode_fp4(w: np.ndarray):
    """[out, in] -> (int8 [out, in/2], E8M0 scales [out, in/32], decoded f32)."""
    out_dim, in_dim = w.shape
    groups = w.reshape(out_dim, in_dim // 32, 32)
    e = _exponent(np.abs(groups).max(-1), 6.0)
    scale = np.exp2(e.astype(np.float32))
    scaled = (groups / scale[..., None]).reshape(out_dim, in_dim)
    magnitude = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1)
    code = (magnitude | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(np.int8)
    signed = np.where(code >= 8, -1.0, 1.0) * E2M1[code & 7]
    return packed, _e8m0(e), (signed * np.repeat(scale, 32, 1)).astype(np.float32)


def write_pair(root: Path, source: Path = FIXTURES[0]) -> tuple[Path, Path]:
    """`root`/quantized and `root`/dequantized from the fixture `source`; returns both."""
    from tests.weights.test_v41_weights import _native

    ckpt = Checkpoint(source)
    tensors = _native({k: np.array(ckpt.get(k)) for k in ckpt.keys()})
    quantized, twin = {}, {}
    for name, value in tensors.items():
        scale_name = name[: -len("weight")] + "scale"
        if FP8_NATIVE.search(name):
            quantized[name], quantized[scale_name], twin[name] = encode_fp8(value)
        elif FP4_NATIVE.search(name):
            quantized[name], quantized[scale_name], twin[name] = encode_fp4(value)
        elif TABLE_NATIVE.search(name):
            quantized[name], quantized[scale_name], twin[name] = encode_fp8(value, 1, BLOCK)
        elif not name.endswith("embed.scale"):       # the float tables' unused scales
            quantized[name] = twin[name] = value
    config = json.loads((source / "config.json").read_text())
    out = []
    for sub, contents, extra in (("quantized", quantized, {"quantization_config": QUANT_CONFIG}),
                                 ("dequantized", twin, {})):
        folder = root / sub
        folder.mkdir(parents=True, exist_ok=True)
        save_file(contents, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, folder / name)
        out.append(folder)
    return out[0], out[1]
