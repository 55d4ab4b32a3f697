"""Runs in .venv-ascend (no jax): greedy generation with `deepinfer_jax.LLM(...,
backend="ascend")` (the one LLM and its host loop over the Ascend engine: its own checkpoint
reading, the shared scheduler driving the torch step) on the prompts a JAX-side test wrote.

    python tests/ascend/torch_generate.py DIR

DIR holds case.json (the checkpoint, the engine's shapes and options, rounds of prompts, each
one `generate` call, and max_tokens); this writes result.json: each prompt's generated tokens,
the speculative counters summed over the requests (verify steps, drafts verified, drafts
accepted), the prefix cache's hits and hit tokens, and whether jax was imported (never).
With "startup_checks" in the case, also what `LLM(...)` raises at start-up for options the
Ascend backend refuses, chosen by the argument and by DEEPINFER_BACKEND, and without either
(the JAX backend, which this environment lacks)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deepinfer_jax import LLM, SamplingParams  # noqa: E402


def startup_error(checkpoint: str, engine: dict, **options) -> list:
    """-> [the error's type, its feature and platform (UnsupportedFeatureError), its message]
    that LLM(...) raises at start-up (an engine that starts is a failure of the caller's test)."""
    try:
        LLM(checkpoint, show_progress=False, **engine, **options)
    except Exception as err:        # noqa: BLE001 - the caller asserts which one
        return [type(err).__name__, getattr(err, "feature", None), getattr(err, "platform", None),
                str(err)]
    return ["started", None, None, ""]


def startup_checks(checkpoint: str, engine: dict) -> dict:
    os.environ.pop("DEEPINFER_BACKEND", None)
    checks = {"argument": startup_error(checkpoint, engine, backend="ascend", batch_invariant=True),
              "none": startup_error(checkpoint, engine)}
    os.environ["DEEPINFER_BACKEND"] = "ascend"
    checks["environment"] = startup_error(checkpoint, engine, batch_invariant=True)
    return checks


def main(directory: Path) -> None:
    case = json.loads((directory / "case.json").read_text())
    engine = {**case["engine"], "token_buckets": tuple(case["engine"]["token_buckets"])}
    checks = startup_checks(case["checkpoint"], engine) if case.get("startup_checks") else None
    os.environ.pop("DEEPINFER_BACKEND", None)
    llm = LLM(case["checkpoint"], backend="ascend", show_progress=False, **engine)
    default = SamplingParams(max_tokens=case["max_tokens"], ignore_eos=True)
    each = case.get("sampling")       # per prompt of the one round, or the default for all
    done = [o for prompts in case["rounds"] for o in llm.generate(
        prompts, [SamplingParams(**kw) for kw in each] if each else default, use_tqdm=False)]
    stats, spec = llm.prefix_cache_stats, llm.spec_metrics
    (directory / "result.json").write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in done],
        "errors": [None if o.error is None else str(o.error) for o in done],
        "text": [[o.outputs[0].text, str(o.outputs[0].finish_reason), o.outputs[0].stop_reason]
                 for o in done],
        "spec": [spec.steps, spec.drafted, spec.accepted],
        "prefix": None if stats is None else [stats.hits, stats.hit_tokens],
        "vocab_size": llm.model.config.vocab_size,
        "shapes": [llm.step_config.page_size, llm.step_config.num_pages,
                   list(llm.step_config.token_buckets)],
        "startup": checks, "jax_imported": "jax" in sys.modules}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
