"""Reading a DeepSeek-V4.1 checkpoint's tensors by reference name, in the release's formats,
checked against the shapes the config gives (weights/v41.py builds the pytree from them).

The release's formats (the V4.1 architecture notes, section 8) are V4's with a finer FP8 grid:
* dense projections (attention, shared experts, `engram.wkv`): E4M3 codes `[out, in]` with one
  E8M0 (or power-of-two float32) `weight_scale_inv` per `block` = (bo, bi) tile, 32 x 32 in
  the release (V41Config.fp8_block). Kept, they
  are V4's `Fp8Blocks` in the model's `[in, out]` layout (pallas_kernels/quantized.py);
* routed experts: E2M1 codes packed two per int8 `[out, in/2]` (low nibble = even input) with
  one E8M0 scale per 32 inputs `[out, in/32]`: kept, V4's `Fp4Blocks` stacks
  (`[E, J*out, in/2]`, group-major scales `[E, in/32, J*out]`);
* engram tables: E4M3 rows with a scale per row per 32 channels, dequantized on load (their
  rows are gathered on the device as float);
* everything else float (bf16 / fp32).
The reader takes whatever a tensor is stored as where its role allows it (a float projection
is read as float), so checkpoints that quantize fewer tensors load too. keep_quantized=False
dequantizes every quantized tensor to `dtype` on the host (exact: E8M0 scales are powers of
two). Every problem is noted, by tensor, and raised together by `finish` as CheckpointError.
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax.weights import quant
from deepinfer_jax.weights.safetensors_io import Checkpoint
from deepinfer_jax.weights.sources import CheckpointError
from deepinfer_jax.weights.v41_names import reference_name
from pallas_kernels import quantized as q

_FLOAT_KINDS = frozenset({"F16", "BF16", "F32", "F64"})
_SCALE_KINDS = frozenset({"F8_E8M0", "U8", "F32"})
_FP4_KINDS = frozenset({"I8", "U8"})
_TABLE_SCALE_BLOCK = 32          # engram tables: one scale per row per 32 channels


class V41Reader:
    def __init__(self, ckpt: Checkpoint, dtype: np.dtype, keep_quantized: bool,
                 block: tuple[int, int]):
        self.ckpt, self.dtype = ckpt, dtype
        self.keep_quantized, self.block = keep_quantized, tuple(block)
        self.by_name: dict[str, str] = {}
        for key in ckpt.keys():
            name = reference_name(key)
            if name is None:
                continue
            if name in self.by_name:
                raise CheckpointError(f"{key} and {self.by_name[name]} name the same tensor {name}")
            self.by_name[name] = key
        self.used: set[str] = set()
        self.problems: dict[str, list[str]] = {"missing": [], "mis-shaped": [], "invalid": []}

    def has(self, name: str) -> bool:
        return name in self.by_name

    def _kind(self, name: str) -> str:
        return self.ckpt.dtype_name(self.by_name[name])

    @staticmethod
    def scale_name(name: str) -> str:
        return name + "_scale_inv"

    # ---- float tensors -------------------------------------------------------------------
    def get(self, name: str, shape: tuple[int, ...], f32: bool = False) -> np.ndarray:
        """Float tensor `name` checked to be `shape` (the checkpoint's layout), as float32 or
        dtype. A quantized one is noted: the release keeps these in bf16 / fp32."""
        out_dtype = np.float32 if f32 else self.dtype
        if name not in self.by_name:
            self.problems["missing"].append(name)
            return np.zeros(shape, out_dtype)
        self.used.add(name)
        kind, scale = self._kind(name), self.scale_name(name)
        if scale in self.by_name or kind not in _FLOAT_KINDS:
            self.used.add(scale)
            self.problems["invalid"].append(
                f"{name}: stored as {kind}{' with a scale' if scale in self.by_name else ''}, "
                f"expected a float tensor (F16 / BF16 / F32): the release quantizes only the "
                f"dense projections, routed experts and engram tables")
            return np.zeros(shape, out_dtype)
        return self._checked(name, self.ckpt.get(self.by_name[name]), shape, out_dtype)

    def _checked(self, name, array, shape, out_dtype) -> np.ndarray:
        if array.shape != tuple(shape):
            self.problems["mis-shaped"].append(f"{name}: found shape {array.shape}, "
                                               f"expected {tuple(shape)}")
            return np.zeros(shape, out_dtype)
        array = np.asarray(array, np.float32)
        if not np.isfinite(array).all():
            self.problems["invalid"].append(f"{name}: NaN or inf values")
        return array.astype(out_dtype)

    def _shape_ok(self, name: str, expected: tuple[int, ...], what: str) -> bool:
        found = self.ckpt.shape(self.by_name[name])
        if tuple(found) != tuple(expected):
            self.problems["mis-shaped"].append(f"{name}: found shape {tuple(found)}, expected "
                                               f"{tuple(expected)} ({what})")
            return False
        return True

    # ---- FP8 projections -----------------------------------------------------------------
    def projection(self, name: str, shape: tuple[int, int]):
        """The `[out, in]` weight `name` in the model's `[in, out]` layout: float as stored,
        FP8 kept as Fp8Blocks (or dequantized to dtype with keep_quantized=False)."""
        scale = self.scale_name(name)
        if name not in self.by_name or (self._kind(name) in _FLOAT_KINDS
                                        and scale not in self.by_name):
            return self.get(name, shape).T
        self.used.update({name, scale} & set(self.by_name))
        parts = self._fp8_parts(name, shape)
        if parts is None:
            return np.zeros(shape[::-1], self.dtype)
        codes, scales = parts
        if self.keep_quantized:
            return q.fp8_from_checkpoint(codes, scales)
        return quant.dequant_fp8(codes, scales, self.block).T.astype(self.dtype)

    def _fp8_parts(self, name: str, shape: tuple[int, int]):
        """The stored E4M3 codes [out, in] and scales [ceil(out/bo), ceil(in/bi)], checked."""
        kind, scale = self._kind(name), self.scale_name(name)
        if kind != "F8_E4M3" or scale not in self.by_name:
            self.problems["invalid"].append(
                f"{name}: stored as {kind}{'' if scale in self.by_name else ' without a scale'}"
                f", expected a float projection or F8_E4M3 codes with a weight_scale_inv")
            return None
        (bo, bi), (out_dim, in_dim) = self.block, shape
        grid = (-(-out_dim // bo), -(-in_dim // bi))
        if not (self._shape_ok(name, shape, "FP8 E4M3 codes [out, in]")
                and self._shape_ok(scale, grid, f"one scale per {bo}x{bi} block of a "
                                                f"{list(shape)} weight")
                and self._scale_kind_ok(scale)):
            return None
        codes = self.ckpt.get(self.by_name[name])
        if np.any((codes.view(np.uint8) & 0x7F) == 0x7F):
            self.problems["invalid"].append(f"{name}: NaN codes (expected finite weights)")
        scales = self.ckpt.get(self.by_name[scale])
        bad = (np.count_nonzero(scales.view(np.uint8) == 0xFF) if scales.dtype.itemsize == 1
               else np.count_nonzero(~np.isfinite(scales) | (scales <= 0)))
        if bad:
            self.problems["invalid"].append(f"{scale}: {bad} of {scales.size} scales NaN or "
                                            f"not positive")
            return None
        return codes, scales

    def _scale_kind_ok(self, scale: str) -> bool:
        kind = self._kind(scale)
        if kind not in _SCALE_KINDS:
            self.problems["invalid"].append(f"{scale}: dtype {kind}, expected F8_E8M0 (or U8 "
                                            f"bytes, or power-of-two F32)")
            return False
        return True

    # ---- FP4 routed experts --------------------------------------------------------------
    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        """Expert e's `[out, in]` tensors names[j][e] joined along out, stacked: float
        [E, in, J*out] (as dtype), or Fp4Blocks [E, J*out, in/2] with scales [E, in/32, J*out]
        where stored FP4 and kept so. All experts must share one format."""
        first = names[0][0]
        if first in self.by_name and (self._kind(first) not in _FLOAT_KINDS
                                      or self.scale_name(first) in self.by_name):
            return self._fp4_experts(names, shape)
        stacks = [np.stack([self.get(n, shape) for n in column]) for column in names]
        return np.concatenate(stacks, axis=1).transpose(0, 2, 1)

    def _fp4_experts(self, names: list[list[str]], shape: tuple[int, int]):
        out_dim, in_dim = shape
        if in_dim % q.FP4_GROUP:
            raise CheckpointError(f"{names[0][0]}: FP4 experts need the input width to be a "
                                  f"multiple of {q.FP4_GROUP}, got {in_dim}")
        n, parts = len(names[0]), len(names)
        packed = np.zeros((n, parts * out_dim, in_dim // 2), np.uint8)
        scales = np.zeros((n, parts * out_dim, in_dim // q.FP4_GROUP), np.uint8)
        for j, column in enumerate(names):
            rows = slice(j * out_dim, (j + 1) * out_dim)
            for e, name in enumerate(column):
                self.fp4_into(name, packed[e, rows], scales[e, rows])
        if self.keep_quantized:
            return q.fp4_from_checkpoint(packed, scales)
        return np.stack([quant.dequant_fp4(p, s).T for p, s in zip(packed, scales, strict=True)]
                        ).astype(self.dtype)

    def fp4_into(self, name: str, packed: np.ndarray, scales: np.ndarray) -> bool:
        """FP4 tensor `name` (packed [..., out, in/2], scales [..., out, in/32] as E8M0 bytes)
        into the two buffers, checked; False (noted) where it cannot be read."""
        if name not in self.by_name:
            self.problems["missing"].append(name)
            return False
        scale = self.scale_name(name)
        self.used.update({name, scale} & set(self.by_name))
        kind = self._kind(name)
        if kind not in _FP4_KINDS or scale not in self.by_name:
            self.problems["invalid"].append(
                f"{name}: stored as {kind}{'' if scale in self.by_name else ' without a scale'}"
                f", expected FP4 E2M1 packed in I8 with a weight_scale_inv like the other "
                f"routed experts")
            return False
        if not (self._shape_ok(name, packed.shape, "FP4 E2M1 packed two per byte along in")
                and self._shape_ok(scale, scales.shape, f"one scale per {q.FP4_GROUP} inputs "
                                                        f"of a row")
                and self._scale_kind_ok(scale)):
            return False
        packed[...] = self.ckpt.get(self.by_name[name]).view(np.uint8)
        try:
            scales[...] = q.e8m0_bits(self.ckpt.get(self.by_name[scale]))
        except ValueError as err:
            self.problems["invalid"].append(f"{scale}: {err}")
            return False
        if np.any(scales == 0xFF):
            self.problems["invalid"].append(f"{scale}: NaN scales (E8M0 byte 255)")
        return True

    # ---- engram tables -------------------------------------------------------------------
    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """An engram table: float, or FP8 E4M3 rows with one scale per 32 channels."""
        key, scale_name = self.by_name.get(name), self.scale_name(name)
        if key is None:
            return self.get(name, shape)      # noted as missing
        if self.ckpt.dtype_name(key) in _FLOAT_KINDS:
            self.used.update({name, scale_name} & set(self.by_name))  # the scale: FP8 only
            return self._checked(name, self.ckpt.get(key), shape, self.dtype)
        self.used.update({name, scale_name})
        kind = self.ckpt.dtype_name(key)
        if kind != "F8_E4M3" or scale_name not in self.by_name:
            self.problems["invalid"].append(f"{name}: stored as {kind}, expected a float table "
                                            f"or F8_E4M3 with a weight_scale_inv")
            return np.zeros(shape, self.dtype)
        codes = self._checked(name, self.ckpt.get(key), shape, np.float32)
        blocks = (shape[0], -(-shape[1] // _TABLE_SCALE_BLOCK))
        scale = self._checked(scale_name, q.e8m0_to_float(self.ckpt.get(self.by_name[scale_name])),
                              blocks, np.float32)
        scale = np.repeat(scale, _TABLE_SCALE_BLOCK, axis=1)[:, : shape[1]]
        return (codes * scale).astype(self.dtype)

    def finish(self) -> None:
        lists = {**self.problems, "unexpected": sorted(set(self.by_name) - self.used)}
        text = [f"{len(v)} {k} tensor(s):\n  " + "\n  ".join(v[:40])
                + (f"\n  ... and {len(v) - 40} more" if len(v) > 40 else "")
                for k, v in lists.items() if v]
        if text:
            raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(text))
