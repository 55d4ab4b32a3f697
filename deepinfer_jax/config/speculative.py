"""SpeculativeConfig: MTP speculative decoding's options (vLLM's `speculative_config` shape)."""

from __future__ import annotations

import dataclasses
import os

from deepinfer_jax.config import options
from deepinfer_jax.config.errors import EngineConfigError


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """MTP speculative decoding (vLLM's `speculative_config` shape).

    num_speculative_tokens: the most drafts per request and step (the MTP block is applied
    recursively); varlen: per-request draft lengths, drafting stops once the drafts'
    cumulative probability under the MTP block falls below confidence_threshold;
    verify_token_budget: the most draft tokens verified per step, shared by the decoding
    requests (each gets at most budget // requests), so speculation fades out as the batch
    grows and the step becomes compute-bound; past `budget` requests the engine runs its plain
    step.
    draft_token_map: a file of token ids (a JSON list, or a .npy array) the MTP block drafts
    from: its head then reads only those columns of the LM head, a cheaper draft at large
    vocabularies (SGLang's speculative_token_map, after FR-Spec). Outputs are unchanged (a
    draft outside it is only never proposed); `tools/draft_token_map.py` writes one from a
    corpus's most frequent tokens. engine/draft_vocab.py reads and checks it.
    """

    method: str = "mtp"
    num_speculative_tokens: int = 5
    varlen: bool = True
    confidence_threshold: float = 0.3
    verify_token_budget: int = 32
    draft_token_map: str | None = None

    def __post_init__(self):
        if self.method != "mtp":
            raise EngineConfigError(f"speculative_config.method: only 'mtp', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise EngineConfigError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if not 0 <= self.confidence_threshold < 1:
            raise EngineConfigError("speculative_config.confidence_threshold must be in [0, 1)")
        if self.verify_token_budget < 1:
            raise EngineConfigError("speculative_config.verify_token_budget must be >= 1")
        if self.draft_token_map is not None:
            object.__setattr__(self, "draft_token_map", os.fspath(self.draft_token_map))

    @classmethod
    def from_options(cls, given) -> "SpeculativeConfig | None":
        """From LLM(speculative_config=...) or, when that is None, the environment
        (config/options.py)."""
        if isinstance(given, cls):
            return given
        if given is None:
            given = options.speculative_from_environment()
            if given is None:
                return None
        if not isinstance(given, dict):
            raise TypeError("speculative_config must be a dict or SpeculativeConfig")
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown speculative_config option(s): {sorted(unknown)}")
        return cls(**given)
