"""The param builder's checkpoint source: reads a safetensors checkpoint and checks it against
the config (weights/random_source.py draws random weights instead)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.weights import pieces, quant
from deepinfer_jax.weights.builder import Role
from deepinfer_jax.weights.safetensors_io import DTYPES, Checkpoint
from pallas_kernels import quantized

_F32_ROLES = {Role.NORM, Role.MIX, Role.ZEROS, Role.ONES}

# transformers' `save_pretrained` writes the official names except for these few.
_HF_RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_HF_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.)norm\.weight$")


def official_name(key: str) -> str:
    """Map a checkpoint key to the official DeepSeek name."""
    if key.startswith("model."):
        key = key[len("model."):]
    key = _HF_RENAMES.get(key, key)
    return _HF_KV_NORM.sub(r"\1kv_norm.weight", key)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: lists every offending tensor."""


# What a tensor may be stored as without a .scale: floats (cast to the compute dtype or
# float32) and, for the hash tables, integers.
_FLOAT_KINDS = frozenset({"F16", "BF16", "F32", "F64"})
_INT_KINDS = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})


def _all_finite(array: np.ndarray) -> bool:
    """One pass and no temporary the size of the tensor: a float64 sum is finite exactly when
    every value is (|bf16| < 3.4e38, so no finite tensor can overflow it)."""
    return bool(np.isfinite(np.sum(array, dtype=np.float64)))


def _numpy_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


# Host memory a routed-expert stack or a large plain tensor is read in, a piece at a time,
# before each piece goes to the device (pieces.py): well under a V4-Flash shard (3-4 GiB), so
# the loader's host footprint stays a fraction of the largest shard whatever the tensors' size.
STACK_CHUNK_BYTES = 256 << 20
FP4_MAX_SCALE_BYTE = 128           # 2 ** 1: fp4_dequant.py's "bits" forms multiply by 2 ** (byte - 1)
# Plain tensors at least this large go to the device as they are read, in row pieces (the
# embedding and the LM head, 1 GiB each at V4-Flash's vocabulary), not with their layer.
PLACE_AT_ONCE_BYTES = 64 << 20


class CheckpointSource:
    """Reads tensors by official name, checks their shapes and dtypes against the config, and
    remembers what was used so that `finish()` can report missing and unexpected tensors.

    keep_quantized: FP8 projections and FP4 (or FP8) routed experts stay as stored (codes and
    scales, pallas_kernels/quantized.py); else they are dequantized to the compute dtype."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, dtype, keep_quantized: bool = True):
        self.ckpt = ckpt
        self.dtype = _numpy_dtype(dtype)
        self.keep_quantized = keep_quantized
        self.block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
        self.n_experts = cfg.n_routed_experts
        self.by_name: dict[str, str] = {}
        for key in ckpt.keys():
            name = official_name(key)
            if name in self.by_name:
                raise CheckpointError(f"{key} and {self.by_name[name]} name the same tensor {name}")
            self.by_name[name] = key
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.invalid: list[str] = []

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.by_name)

    def place(self, tree):
        """Host arrays to the device, as each layer is finished (their host copies then go;
        a CPU backend may keep them as the device arrays' own memory)."""
        return jax.device_put(tree)

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> np.ndarray:
        stored = self._stored(name, role)
        if stored is None:
            return np.zeros(shape, self._dtype(role))
        if self._in_pieces(stored, shape, role):
            return self._placed_rows(name, stored, shape, role, transpose=False)
        return self._plain(name, stored, shape, role)

    def projection(self, name: str, shape: tuple[int, int], released_fp8: bool):
        stored = self._stored(name, Role.LINEAR)
        if stored is None:
            return np.zeros(shape[::-1], self.dtype)
        if self._in_pieces(stored, shape, Role.LINEAR):    # transposed on the device
            return self._placed_rows(name, stored, shape, Role.LINEAR, transpose=True)
        if stored.scale_key is None or not self.keep_quantized:
            array = self._plain(name, stored, shape, Role.LINEAR)       # dequantized here
            return self.place(array).T if array.nbytes >= PLACE_AT_ONCE_BYTES else array.T
        if stored.kind != "F8_E4M3":
            self.invalid.append(f"{name}: a quantized dense projection must be F8_E4M3, found "
                                f"{stored.kind}")
            return np.zeros(shape[::-1], self.dtype)
        codes, scale = self._fp8_parts(name, stored, shape)
        if codes is None:
            return np.zeros(shape[::-1], self.dtype)
        return quantized.fp8_from_checkpoint(codes, scale)

    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        """Expert e's tensors names[j][e] joined along out and stacked, read straight into
        host buffers of a few experts at a time (STACK_CHUNK_BYTES), each chunk written into
        the stack on the device as the next is read (pieces.py): the host never holds a whole
        stack (2 GiB of FP4 codes for one V4-Flash layer's gate and up)."""
        out_dim, in_dim = shape
        parts = len(names)
        kind = self._quantized_kind(names[0][0])
        if not self.keep_quantized or kind is None:
            def make(count):
                return np.zeros((count, in_dim, parts * out_dim), self.dtype)

            def fill(e, i, stack):
                for j, column in enumerate(names):
                    stack[i, :, j * out_dim:(j + 1) * out_dim] = self.tensor(column[e], shape,
                                                                             Role.LINEAR).T
            return self._stacked(make, fill, in_dim * parts * out_dim * self.dtype.itemsize)
        if kind == "F8_E4M3":        # FP8 experts (the Flash-Base release)
            bo, bi = self.block
            grid = (-(-in_dim // bi), parts * -(-out_dim // bo))

            def make(count):
                return quantized.Fp8Blocks(
                    np.zeros((count, in_dim, parts * out_dim), ml_dtypes.float8_e4m3fn),
                    np.zeros((count, *grid), np.float32))

            def fill(e, i, stack):
                for j, column in enumerate(names):
                    stored = self._stored(column[e], Role.LINEAR)
                    codes, scale = ((None, None) if stored is None
                                    else self._fp8_parts(column[e], stored, shape))
                    if codes is None:
                        continue
                    blocks = quantized.fp8_from_checkpoint(codes, scale)
                    stack.codes[i, :, j * out_dim:(j + 1) * out_dim] = blocks.codes
                    width = blocks.scale.shape[1]
                    stack.scale[i, :, j * width:(j + 1) * width] = blocks.scale
            return self._stacked(make, fill, in_dim * parts * out_dim)
        if kind not in ("I8", "U8"):
            self.invalid.append(f"{names[0][0]}: quantized experts must be FP4 (I8/U8 with "
                                f"F8_E8M0 scales) or F8_E4M3, found {kind}")
            return np.zeros((self.n_experts, in_dim, parts * out_dim), self.dtype)
        if in_dim % quantized.FP4_GROUP:
            raise CheckpointError(f"FP4 experts need the input width to be a multiple of "
                                  f"{quantized.FP4_GROUP}, got {in_dim}")
        groups = in_dim // quantized.FP4_GROUP

        def make(count):
            return quantized.Fp4Blocks(np.zeros((count, parts * out_dim, in_dim // 2), np.uint8),
                                       np.zeros((count, groups, parts * out_dim), np.uint8))

        row_scales = np.zeros((out_dim, groups), np.uint8)    # as stored; kept group-major

        def fill(e, i, stack):
            for j, column in enumerate(names):
                rows = slice(j * out_dim, (j + 1) * out_dim)
                stored = self._stored(column[e], Role.LINEAR)
                if stored is not None and self._read_fp4_into(
                        column[e], stored, stack.packed[i, rows], row_scales):
                    self._check_fp4_kernel_range(stored.scale_name, row_scales)
                    stack.scale[i, :, rows] = row_scales.T
        return self._stacked(make, fill, parts * out_dim * (in_dim // 2 + groups))

    def _stacked(self, make, fill, expert_bytes: int):
        """The n_experts stack, built STACK_CHUNK_BYTES of experts at a time: make(count) ->
        host buffers (a pytree of [count, ...] arrays), fill(expert, index in chunk, buffers)."""
        n = self.n_experts
        chunk = max(1, STACK_CHUNK_BYTES // max(1, expert_bytes))
        stack = None if chunk >= n else pieces.Pieces(jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), make(0)))
        for first in range(0, n, chunk):
            count = min(chunk, n - first)
            buffers = make(count)
            for i in range(count):
                fill(first + i, i, buffers)
            if stack is None:                   # the whole stack in one piece
                return self.place(buffers)
            stack.write(buffers, first)
            del buffers
        return stack.result()

    def finish(self) -> None:
        unexpected = sorted(set(self.by_name) - self.used)
        problems = []
        for title, names in (("missing", self.missing), ("mis-shaped", self.misshaped),
                             ("unexpected", unexpected), ("invalid", self.invalid)):
            if names:
                shown = "\n  ".join(names[:40]) + (f"\n  ... and {len(names) - 40} more"
                                                   if len(names) > 40 else "")
                problems.append(f"{len(names)} {title} tensor(s):\n  {shown}")
        if problems:
            raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(problems))

    # ---- reading and checking ------------------------------------------------------------

    def _dtype(self, role: Role) -> np.dtype:
        if role is Role.TABLE:
            return np.dtype(np.int32)
        return np.dtype(np.float32) if role in _F32_ROLES else self.dtype

    def _quantized_kind(self, name: str) -> str | None:
        """The stored dtype of `name` if it has a .scale (nothing noted, nothing marked used)."""
        key = self.by_name.get(name)
        if key is None or self.by_name.get(name[: -len("weight")] + "scale") is None:
            return None
        return self.ckpt.dtype_name(key)

    def _stored(self, name: str, role: Role) -> _Stored | None:
        """Where tensor `name` (and its .scale) is, with its dtype checked against what its
        role allows; None (and the problem noted) when absent or of the wrong kind."""
        key = self.by_name.get(name)
        if key is None:
            self.missing.append(name)
            return None
        self.used.add(name)
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        scale_key = self.by_name.get(scale_name) if scale_name else None
        kind = self.ckpt.dtype_name(key)
        if scale_key is None:
            if kind.startswith("F8") or kind in ("I8", "U8") and role is not Role.TABLE:
                self.invalid.append(f"{name}: quantised dtype {kind} without a .scale tensor")
                return None
            expected = _INT_KINDS if role is Role.TABLE else _FLOAT_KINDS
            if kind not in expected:
                self.invalid.append(f"{name}: dtype {kind}, expected one of {sorted(expected)}"
                                    + ("" if role is Role.TABLE else
                                       " (or F8_E4M3 / FP4 in I8 with a .scale tensor)"))
                return None
            return _Stored(key, kind, None, None)
        self.used.add(scale_name)
        scale_kind = self.ckpt.dtype_name(scale_key)
        if scale_kind not in ("F8_E8M0", "U8", "F32"):
            self.invalid.append(f"{scale_name}: dtype {scale_kind}, expected F8_E8M0 (or F32)")
            return None
        if kind not in ("F8_E4M3", "I8", "U8"):
            self.invalid.append(f"{name}: a .scale tensor next to a {kind} weight (expected "
                                f"F8_E4M3, or FP4 packed in I8)")
            return None
        return _Stored(key, kind, scale_key, scale_name)

    def _plain(self, name: str, stored: _Stored, shape: tuple[int, ...], role: Role) -> np.ndarray:
        """The tensor as an array of its role's dtype (quantized ones dequantized)."""
        if stored.scale_key is None:
            array = self.ckpt.get(stored.key)
        else:
            array = self._dequantized(name, stored, shape)
            if array is None:
                return np.zeros(shape, self._dtype(role))
        if array.shape != shape:
            self.misshaped.append(f"{name}: found shape {array.shape}, expected {shape}")
            return np.zeros(shape, self._dtype(role))
        if role is Role.TABLE and (array.min() < 0 or array.max() >= self.n_experts):
            self.invalid.append(f"{name}: expert ids outside [0, {self.n_experts})")
        if role is not Role.TABLE and not _all_finite(array):
            bad = array.size - np.count_nonzero(np.isfinite(array))
            what = "all NaN" if np.isnan(array).all() else f"{bad} of {array.size} values NaN or inf"
            self.invalid.append(f"{name}: {what} (expected finite weights)")
        return array.astype(self._dtype(role), copy=False)

    def _in_pieces(self, stored: _Stored, shape: tuple[int, ...], role: Role) -> bool:
        return (stored.scale_key is None and role is not Role.TABLE and len(shape) == 2
                and math.prod(shape) * self._dtype(role).itemsize >= PLACE_AT_ONCE_BYTES)

    def _placed_rows(self, name: str, stored: _Stored, shape: tuple[int, int], role: Role,
                     transpose: bool):
        """A large plain [rows, cols] tensor read STACK_CHUNK_BYTES of rows at a time, each
        piece checked, cast and written into its device array ([cols, rows] if transpose)."""
        found, dtype = self.ckpt.shape(stored.key), self._dtype(role)
        if found != tuple(shape):
            self.misshaped.append(f"{name}: found shape {found}, expected {tuple(shape)}")
            return np.zeros(shape[::-1] if transpose else shape, dtype)
        bad, nan = [], []

        def check(piece):
            if not _all_finite(piece):
                bad.append(piece.size - np.count_nonzero(np.isfinite(piece)))
                nan.append(np.count_nonzero(np.isnan(piece)))

        whole = pieces.place_rows(functools.partial(self.ckpt.read_rows_into, stored.key), shape,
                                  DTYPES[stored.kind], dtype, transpose, check,
                                  STACK_CHUNK_BYTES)
        if bad:
            size = math.prod(shape)
            what = "all NaN" if sum(nan) == size else f"{sum(bad)} of {size} values NaN or inf"
            self.invalid.append(f"{name}: {what} (expected finite weights)")
        return whole

    def _dequantized(self, name: str, stored: _Stored, shape) -> np.ndarray | None:
        if stored.kind == "F8_E4M3":
            codes, scale = self._fp8_parts(name, stored, shape)
            return None if codes is None else quant.dequant_fp8(codes, scale, self.block)
        packed = np.zeros((shape[0], shape[1] // 2), np.uint8)
        scale = np.zeros((shape[0], shape[1] // quantized.FP4_GROUP), np.uint8)
        if not self._read_fp4_into(name, stored, packed, scale):
            return None
        return quant.dequant_fp4(packed, scale)

    def _check_shape(self, name: str, key: str, expected: tuple[int, ...], what: str) -> bool:
        found = self.ckpt.shape(key)
        if found != tuple(expected):
            self.misshaped.append(f"{name}: found shape {found}, expected {tuple(expected)} "
                                  f"({what})")
            return False
        return True

    def _fp8_parts(self, name: str, stored: _Stored, shape: tuple[int, int]):
        """The stored FP8 codes [out, in] and scales [ceil(out/bo), ceil(in/bi)], checked."""
        out_dim, in_dim = shape
        bo, bi = self.block
        grid = (-(-out_dim // bo), -(-in_dim // bi))
        if not (self._check_shape(name, stored.key, shape, "FP8 E4M3 codes [out, in]")
                and self._check_shape(stored.scale_name, stored.scale_key, grid,
                                      f"one scale per {bo}x{bi} block of a {list(shape)} weight")):
            return None, None
        codes = self.ckpt.get(stored.key)
        if np.any((codes.view(np.uint8) & 0x7F) == 0x7F):
            self.invalid.append(f"{name}: NaN codes (expected finite weights)")
        scale = self._scale(stored)
        return (codes, scale) if scale is not None else (None, None)

    def _scale(self, stored: _Stored) -> np.ndarray | None:
        scale = self.ckpt.get(stored.scale_key)
        bad = (np.count_nonzero(scale.view(np.uint8) == 0xFF) if scale.dtype.itemsize == 1
               else np.count_nonzero(~np.isfinite(scale) | (scale <= 0)))
        if bad:
            self.invalid.append(f"{stored.scale_name}: {bad} of {scale.size} scales NaN or not "
                                f"positive")
            return None
        return scale

    def _check_fp4_kernel_range(self, scale_name: str, scale: np.ndarray) -> None:
        """Kept quantized, FP4 experts run on the kernels, whose dequantization
        (pallas_kernels/grouped_gemm/fp4_dequant.py) is exact for scales up to 2."""
        if np.any(scale > FP4_MAX_SCALE_BYTE):
            self.invalid.append(f"{scale_name}: scales above 2 (E8M0 byte {int(scale.max())} > "
                                f"{FP4_MAX_SCALE_BYTE}), beyond the FP4 kernels' range; "
                                f"load with weights='bf16'")

    def _read_fp4_into(self, name: str, stored: _Stored, packed: np.ndarray,
                       scale: np.ndarray) -> bool:
        """FP4 tensor `name` ([out, in/2] packed, scales [out, in/32]) into the two buffers."""
        if stored.kind not in ("I8", "U8") or stored.scale_key is None:
            self.invalid.append(f"{name}: dtype {stored.kind}"
                                f"{'' if stored.scale_key else ' without a .scale'}, expected "
                                f"FP4 packed in I8 with an F8_E8M0 .scale like the other experts")
            return False
        out_dim, half = packed.shape
        if not (self._check_shape(name, stored.key, packed.shape,
                                  f"FP4 E2M1 two per byte: [{out_dim}, {2 * half} / 2]")
                and self._check_shape(stored.scale_name, stored.scale_key, scale.shape,
                                      f"one scale per {quantized.FP4_GROUP} inputs of a row")):
            return False
        self.ckpt.read_into(stored.key, packed)
        if self.ckpt.dtype_name(stored.scale_key) == "F32":
            scale[...] = quantized.e8m0_bits(self.ckpt.get(stored.scale_key))
        else:
            self.ckpt.read_into(stored.scale_key, scale)
        if np.any(scale == 0xFF):
            self.invalid.append(f"{stored.scale_name}: NaN scales (E8M0 byte 255)")
        return True


@dataclasses.dataclass(frozen=True)
class _Stored:
    key: str                    # the checkpoint's key of the weight
    kind: str                   # its safetensors dtype name
    scale_key: str | None       # its .scale tensor's key, if quantized
    scale_name: str | None
