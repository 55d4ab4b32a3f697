"""The paged V4.1 state's layout (model/v41/state.py) and its byte counts (config/memory_v41.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory_v41 import v41_cache_bytes, v41_page_bytes
from deepinfer_jax.config.speculative import SpeculativeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.model.v41.state import init_v41_state
from tests.model.v41_oracle import FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


def _step_cfg(cfg, speculative=None) -> StepConfig:
    return StepConfig(max_num_seqs=3, max_model_len=128, page_size=16, num_pages=10,
                      max_blocks_per_seq=8, max_num_batched_tokens=32, token_buckets=(32,),
                      max_logprobs=0, vocab_size=cfg.vocab_size, speculative=speculative,
                      compute=ComputeConfig())


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
@pytest.mark.parametrize("spec", [None, 2])
def test_the_byte_counts_match_the_pytree(folder, spec):
    cfg = read_model_config(folder)
    speculative = None if spec is None else SpeculativeConfig(num_speculative_tokens=spec)
    step_cfg = _step_cfg(cfg, speculative)
    state = init_v41_state(cfg, step_cfg)
    real = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert real == v41_cache_bytes(cfg, step_cfg)


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_only_kv_sources_own_pages(folder):
    cfg = read_model_config(folder)
    step_cfg = _step_cfg(cfg)
    state = init_v41_state(cfg, step_cfg)
    for i, ls in enumerate(state.layers):
        assert (ls.entries is not None) == cfg.is_kv_source(i)
        assert (ls.index_keys is not None) == (cfg.is_kv_source(i) and cfg.is_index_source(i))
        assert (ls.tail is not None) == (cfg.is_kv_source(i) and cfg.compress_ratios[i] > 1)
        if ls.entries is not None:
            rows = step_cfg.num_pages * step_cfg.rows_per_page(cfg.compress_ratios[i])
            assert ls.entries.codes.shape == (rows, cfg.head_dim)
            assert ls.entries.scales.dtype == jnp.float8_e4m3fn
        assert ls.window.codes.dtype == jnp.float8_e4m3fn
    # in both fixtures every KV source is an index source; consumers add nothing
    per_page = sum(16 // cfg.compress_ratios[i] * (cfg.head_dim + cfg.head_dim // 16
                                                   + cfg.index_head_dim + cfg.index_head_dim // 32)
                   for i in cfg.kv_source_layer_ids)
    assert v41_page_bytes(cfg, 16) == per_page


def test_widths_off_the_quantization_blocks_are_refused():
    cfg = read_model_config(FIXTURES[0])
    with pytest.raises(ValueError, match="index_head_dim=24"):
        init_v41_state(cfg.replace(index_head_dim=24), _step_cfg(cfg))
