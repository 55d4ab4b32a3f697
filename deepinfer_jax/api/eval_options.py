"""The evaluation backend's model args (`--model_args pretrained=PATH,batch_invariant=True,...`),
each parsed to its type: the checkpoint, the engine's options, and the backend's own.

lm-eval splits model args on commas and guesses each value's type; the values are taken again
here from their text form, so `max_num_seqs=8` and `max_num_seqs="8"` give the same int and a
wrong one fails with the arg's name before anything loads.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    try:
        return _BOOLS[str(value).strip().lower()]
    except KeyError:
        raise ValueError(f"expected true or false, got {value!r}") from None


def _int(value) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(str(value).strip()) if not isinstance(value, (int, float)) else int(value)


def _optional_str(value) -> str | None:
    return None if value is None or str(value).lower() == "none" else str(value)


def _dtype(value) -> str | None:
    value = _optional_str(value)
    if value not in (None, "float32", "bfloat16"):
        raise ValueError(f"expected float32 or bfloat16, got {value!r}")
    return value


# the EngineConfig fields a model arg may set, with their types
ENGINE_ARGS = {
    "max_num_seqs": _int, "max_model_len": _int, "max_num_batched_tokens": _int,
    "page_size": _int, "num_pages": _int, "num_prefix_snapshots": _int,
    "gpu_memory_utilization": float, "device_memory_gib": float,
    "batch_invariant": _bool, "enable_prefix_caching": _bool, "async_scheduling": _bool,
    "seed": _int, "step_formulation": str, "invariant_tile": _int, "compile_threads": _int,
    "prefix_replay": str, "swa_replay_tokens": _int,
}
# MTP speculation, as the CLI's --speculative-tokens and SpeculativeConfig's fields
SPEC_ARGS = {"speculative_tokens": ("num_speculative_tokens", _int),
             "speculative_confidence": ("confidence_threshold", float),
             "speculative_varlen": ("varlen", _bool),
             "speculative_verify_budget": ("verify_token_budget", _int),
             "speculative_token_map": ("draft_token_map", str)}
LOAD_ARGS = {"pretrained": str, "dtype": _dtype, "weights": str, "tokenizer": _optional_str}
# the backend's own: the seed of sampled generations (request i is seeded generation_seed + i)
# and where to write the run's manifest
BACKEND_ARGS = {"generation_seed": _int, "manifest": _optional_str}
# the engine's defaults where a model arg gives none: the quick start's shapes
DEFAULTS = {"max_num_seqs": 4, "max_model_len": 512, "max_num_batched_tokens": 32}


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    pretrained: str | None
    load: dict            # dtype, weights, tokenizer: LLM's keyword args
    engine: dict          # EngineConfig's fields
    generation_seed: int
    manifest: str | None

    @property
    def llm_kwargs(self) -> dict:
        return {**self.load, **self.engine}


def parse_model_args(args: dict) -> EvalArgs:
    """Model args (strings or values lm-eval already typed) -> EvalArgs; an unknown name or a
    value of the wrong type raises ValueError naming it."""
    load, engine, spec, own = {}, dict(DEFAULTS), {}, {"generation_seed": 0, "manifest": None}
    for name, value in args.items():
        try:
            if name in LOAD_ARGS:
                load[name] = LOAD_ARGS[name](value)
            elif name in ENGINE_ARGS:
                engine[name] = ENGINE_ARGS[name](value)
            elif name in SPEC_ARGS:
                field, kind = SPEC_ARGS[name]
                spec[field] = kind(value)
            elif name in BACKEND_ARGS:
                own[name] = BACKEND_ARGS[name](value)
            else:
                known = sorted({*LOAD_ARGS, *ENGINE_ARGS, *SPEC_ARGS, *BACKEND_ARGS})
                raise ValueError(f"unknown model arg {name!r}; known: {', '.join(known)}")
        except (TypeError, ValueError) as e:
            if str(e).startswith("unknown model arg"):
                raise
            raise ValueError(f"model arg {name}={value!r}: {e}") from None
    if spec:
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculation needs speculative_tokens=K")
        engine["speculative_config"] = spec
    if "dtype" in load and load["dtype"] is not None:
        load["dtype"] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[load["dtype"]]
    pretrained = load.pop("pretrained", None)
    return EvalArgs(pretrained, {k: v for k, v in load.items() if v is not None}, engine,
                    own["generation_seed"], own["manifest"])
