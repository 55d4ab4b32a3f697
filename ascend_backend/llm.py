"""The Ascend backend's entry point: a checkpoint directory in, completions out, with the
JAX engine's host side (ascend_backend/engine.py). The JAX engine's `LLM` needs jax at
import, which an Ascend machine does not have, so this is the Ascend side's `LLM` for now.

    llm = LLM("path/to/checkpoint", device="npu", max_num_seqs=8, max_model_len=4096)
    tokens = [r.generated for r in llm.generate(prompts, SamplingParams(max_tokens=64))]
"""

from __future__ import annotations

from pathlib import Path

from ascend_backend.checkpoint import read_checkpoint
from ascend_backend.device import torch_device
from ascend_backend.engine import AscendEngine, step_config
from ascend_backend.params import params_from_flat
from ascend_backend.weights import flat_params
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.speculative import SpeculativeConfig
from deepinfer_jax.host.request import Request, SamplingParams


class LLM:
    def __init__(self, model: str | Path, *, device: str = "cpu",
                 max_num_seqs: int = 8, max_model_len: int = 1024, page_size: int = 64,
                 num_pages: int | None = None, max_num_batched_tokens: int = 256,
                 token_buckets: tuple[int, ...] | None = None, max_logprobs: int = 20,
                 batch_invariant: bool = False, speculative_config: dict | None = None,
                 enable_prefix_caching: bool = False, num_prefix_snapshots: int | None = None,
                 seed: int = 0):
        """num_pages None: every slot can hold max_model_len tokens; token_buckets None: powers
        of two up to max_num_batched_tokens (the plan's padded sizes). The model computes in
        float32 (bf16 is not tested against the JAX step yet)."""
        cfg = read_model_config(Path(model) / "config.json")
        blocks = -(-max_model_len // page_size)
        buckets = token_buckets or tuple(
            2 ** k for k in range(4, max_num_batched_tokens.bit_length())
            if 2 ** k < max_num_batched_tokens) + (max_num_batched_tokens,)
        step_cfg = step_config(cfg, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               page_size=page_size, num_pages=num_pages or max_num_seqs * blocks,
                               max_num_batched_tokens=max_num_batched_tokens,
                               token_buckets=buckets, max_logprobs=max_logprobs,
                               batch_invariant=batch_invariant,
                               speculative=SpeculativeConfig.from_options(speculative_config)
                               if speculative_config is not None else None,
                               enable_prefix_caching=enable_prefix_caching,
                               num_snapshots=num_prefix_snapshots)
        params = params_from_flat(flat_params(cfg, read_checkpoint(model)), torch_device(device))
        tokenizer = Path(model) / "tokenizer.json"
        self.engine = AscendEngine(cfg, params, step_cfg, device=device, seed=seed,
                                   tokenizer_json=tokenizer if tokenizer.exists() else None)

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Request]:
        """Token-id prompts to completion (one SamplingParams for all, or one each) -> their
        requests (`generated`), in prompt order."""
        return self.engine.generate(prompts, sampling_params or SamplingParams())
