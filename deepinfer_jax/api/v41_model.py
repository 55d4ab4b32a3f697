"""`deepinfer_jax.load_v41(path)`: a DeepSeek-V4.1 checkpoint with its cache-free reference
forward (model/v41/forward.py), for notebooks and parity tests while the engine does not
serve V4.1 yet.

The Engram hash needs the checkpoint's tokenizer (its token map is tokenizer-derived); the
row ids are computed on the host with the tokens. Sequences are right-extended with dead
slots to a multiple of `pad_to` so that growing them one token at a time does not recompile
at every length: the compressor skips dead slots, attention masks them and the hash treats
them as DEAD, so they are invisible to the real positions.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import ConfigError
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.v41 import engram_hash
from deepinfer_jax.model.v41.forward import forward
from deepinfer_jax.model.v41.params import V41ModelParams
from deepinfer_jax.weights.fp4_pad import pad_v41_params
from deepinfer_jax.weights.v41 import load_v41_params


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params: V41ModelParams, tokens: jax.Array, live: jax.Array,
            engram_ids: jax.Array | None, cfg: V41Config) -> jax.Array:
    return forward(params, cfg, tokens, live, engram_ids)[0]


@dataclasses.dataclass(frozen=True)
class V41Model:
    config: V41Config
    params: V41ModelParams
    token_map: np.ndarray | None          # i64[V] compressed ids for the Engram hash
    pad_to: int = 128

    def logits(self, token_ids, attention_mask=None) -> np.ndarray:
        """token_ids [S] or [B, S] (left-padded where attention_mask [B, S] is 0) -> float32
        logits [B, S, V]; values at pads are meaningless."""
        ids = np.atleast_2d(np.asarray(token_ids)).astype(np.int64)
        live = (np.ones(ids.shape, bool) if attention_mask is None
                else np.atleast_2d(np.asarray(attention_mask)).astype(bool))
        if ids.shape != live.shape or ids.shape[1] == 0:
            raise ValueError(f"token_ids {ids.shape} and attention_mask {live.shape} must be "
                             f"the same non-empty [B, S]")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        seq = ids.shape[1]
        extra = -(-seq // self.pad_to) * self.pad_to - seq
        ids, live = np.pad(ids, ((0, 0), (0, extra))), np.pad(live, ((0, 0), (0, extra)))
        engram_ids = None
        if self.config.engram is not None:
            tables = engram_hash.hash_tables(self.config.engram)
            engram_ids = jnp.asarray(engram_hash.hash_ids(ids, live, self.token_map,
                                                          self.config.engram, tables))
        out = _logits(self.params, jnp.asarray(ids, jnp.int32), jnp.asarray(live), engram_ids,
                      self.config)
        return np.asarray(out)[:, :seq]

    def for_compute(self, compute: ComputeConfig) -> V41Model:
        """The model with its FP4 routed experts laid out for the step's kernels: padded to
        compute.fp4_expert_granule (weights/fp4_pad.py; itself where nothing changes)."""
        params = pad_v41_params(self.params, compute.fp4_expert_granule)
        return self if params is self.params else dataclasses.replace(self, params=params)

    def greedy(self, token_ids, steps: int, attention_mask=None) -> np.ndarray:
        """[B, steps] greedy continuation, each step a cache-free forward."""
        ids = np.atleast_2d(np.asarray(token_ids)).astype(np.int64)
        live = (np.ones(ids.shape, bool) if attention_mask is None
                else np.atleast_2d(np.asarray(attention_mask)).astype(bool))
        out = []
        for _ in range(steps):
            nxt = self.logits(ids, live)[:, -1].argmax(-1)
            out.append(nxt)
            ids = np.concatenate([ids, nxt[:, None]], 1)
            live = np.concatenate([live, np.ones((len(ids), 1), bool)], 1)
        return np.stack(out, 1)


def load_v41(path: str | Path, dtype=np.float32, pad_to: int = 128,
             weights: str = "quantized", engram_tables: str = "device",
             fp4_k_granule: int = 1) -> V41Model:
    """A V4.1 checkpoint directory (config.json, safetensors, tokenizer.json) -> V41Model.
    weights: "quantized" keeps the release's FP8 projections and FP4 routed experts as stored
    (weights/v41_reader.py), "bf16" dequantizes them to `dtype` at load. engram_tables:
    "host" leaves the Engram tables numpy arrays in host memory (the engine's default; the
    cache-free `logits` then passes them to each call), "device" places them too.
    fp4_k_granule: the FP4 expert stacks' padding (load_v41_params; the engine passes its
    ComputeConfig.fp4_expert_granule)."""
    if engram_tables not in ("host", "device"):
        raise ValueError(f"engram_tables must be 'host' or 'device', got {engram_tables!r}")
    if weights not in ("quantized", "bf16"):
        raise ValueError(f"weights must be 'quantized' or 'bf16', got {weights!r}")
    path = Path(path)
    cfg = read_model_config(path)
    if not isinstance(cfg, V41Config):
        raise ConfigError(f"{path}: not a DeepSeek-V4.1 config; use deepinfer_jax.load")
    token_map = None
    if cfg.engram is not None:
        if not (path / "tokenizer.json").exists():
            raise ConfigError(f"{path}: the Engram hash needs the checkpoint's tokenizer.json")
        token_map, size = engram_hash.compressed_token_map(
            Tokenizer.from_file(str(path / "tokenizer.json")))
        if size != cfg.engram.compressed_vocab_size:
            raise ConfigError(f"{path}: the tokenizer gives {size} compressed ids, the config's "
                              f"engram_compressed_vocab_size is {cfg.engram.compressed_vocab_size}: "
                              f"every Engram row would be hashed wrongly")
    params = load_v41_params(path, cfg, dtype, keep_quantized=weights == "quantized",
                             engram_on_host=engram_tables == "host", fp4_k_granule=fp4_k_granule)
    return V41Model(config=cfg, params=params, token_map=token_map, pad_to=pad_to)
