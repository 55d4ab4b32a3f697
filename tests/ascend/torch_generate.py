"""Runs in .venv-ascend: greedy generation with the Ascend backend's LLM (ascend_backend/llm.py:
its own checkpoint reading, the shared scheduler driving the torch step) on the prompts a
JAX-side test wrote.

    python tests/ascend/torch_generate.py DIR

DIR holds case.json (the checkpoint, the engine's shapes and options, rounds of prompts, each
one `generate` call, and max_tokens); this writes result.json: each prompt's generated tokens,
the speculative counters summed over the requests (verify steps, drafts verified, drafts
accepted) and the prefix cache's hits and hit tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ascend_backend.llm import LLM  # noqa: E402
from deepinfer_jax.host.request import SamplingParams  # noqa: E402


def main(directory: Path) -> None:
    case = json.loads((directory / "case.json").read_text())
    llm = LLM(case["checkpoint"], **{**case["engine"],
                                     "token_buckets": tuple(case["engine"]["token_buckets"])})
    default = SamplingParams(max_tokens=case["max_tokens"], ignore_eos=True)
    each = case.get("sampling")       # per prompt of the one round, or the default for all
    done = [r for prompts in case["rounds"] for r in llm.generate(
        prompts, [SamplingParams(**kw) for kw in each] if each else default)]
    stats = llm.engine.scheduler.kv_cache.prefix_stats()
    (directory / "result.json").write_text(json.dumps({
        "tokens": [r.generated for r in done],
        "spec": [sum(getattr(r.spec, f) for r in done) for f in ("steps", "drafted", "accepted")],
        "prefix": None if stats is None else [stats.hits, stats.hit_tokens]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
